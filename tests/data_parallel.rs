//! Data parallelism in its three forms against one rank, through the real binary under
//! `mpirun`: DP (dp_replicate), FSDP (dp_shard, ZeRO-3 and ZeRO-2-like) and HSDP (both).

mod common;
use common::*;
use ndtrain::config::Deck;
use ndtrain::fsdp::{predicted_comm_bytes, ShardPlan};
use std::path::Path;

/// Per-step losses: layouts sum the same per-sample gradients in another order, in f32, and
/// Adam's division by sqrt(v) amplifies that noise over steps. Measured after 10 steps on the
/// tiny deck: ≤ 1.7e-8 (DP=2/4, FSDP=2/4, HSDP 2×2). 1e-6 leaves a 50× margin and still
/// catches a wrong normalisation or a lost micro-batch (≥ 1e-3).
const LOSS_TOL: f64 = 1e-6;
/// Final parameters, max |Δ| relative to the tensor's max |value|: measured ≤ 6.8e-6 (elements
/// whose gradient is near zero get Adam updates whose sign follows rounding noise); 1e-4 is a
/// 15× margin, while one wrong update of lr = 3e-3 on weights of ~0.05 shows as > 1e-2.
const PARAM_TOL: f64 = 1e-4;

const COMMON: &[&str] = &["run.steps=10", "run.threads=1", "optim.grad_clip=0.3", "optim.warmup_steps=2"];

/// Checks every step's measured bytes per collective on rank 0 against the analytic formula.
fn assert_bytes_match_formula(dir: &Path, name: &str, deck: &Deck, world: usize) {
    let res = deck.resolve(world).unwrap();
    let l = res.layout;
    let plan = ShardPlan::new(&deck.model, l.dp_shard * l.cp, 0);
    let want = predicted_comm_bytes(&plan, l.dp_replicate, l.dp(), res.grad_accum, deck.parallel.reshard_after_forward);
    let csv = std::fs::read_to_string(dir.join(name).join("timing/rank_00000.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    for (i, line) in lines.enumerate() {
        let row: Vec<&str> = line.split(',').collect();
        for (col, value) in header.iter().zip(&row) {
            if let Some(key) = col.strip_suffix("_bytes").filter(|k| k.contains('.')) {
                let got: u64 = value.parse().unwrap();
                let expect = want.get(key).copied().unwrap_or(0);
                assert_eq!(got, expect, "{name}: step {} {key}: measured {got} bytes, formula {expect}", i + 1);
            }
        }
    }
}

fn run(dir: &Path, name: &str, ranks: usize, layout: &[&str]) -> (Vec<f64>, ndtrain::model::params::ModelParams<f32>) {
    let export = dir.join(name).join("final_hf");
    let exp = format!("checkpoint.export_hf=\"{}\"", export.display());
    let mut sets: Vec<&str> = COMMON.to_vec();
    sets.extend_from_slice(layout);
    sets.push(&exp);
    let (_, losses) = train_losses(dir, name, &tiny_deck(), Some(ranks), &sets);
    let norms = column(&dir.join(name), "grad_norm");
    assert!(norms.iter().all(|&n| n > 0.3), "{name}: clipping must be active in every step: {norms:?}");
    let owned: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let deck = Deck::from_file(&tiny_deck(), &owned).unwrap();
    assert_bytes_match_formula(dir, name, &deck, ranks);
    let params = ndtrain::hf::load_params::<f32>(&export, &deck.model).expect("exported model loads");
    (losses, params)
}

fn assert_equivalent(
    name: &str,
    base: &(Vec<f64>, ndtrain::model::params::ModelParams<f32>),
    other: &(Vec<f64>, ndtrain::model::params::ModelParams<f32>),
) {
    assert_eq!(base.0.len(), other.0.len(), "{name}: step count");
    let mut worst_loss = 0.0f64;
    for (s, (a, b)) in base.0.iter().zip(&other.0).enumerate() {
        assert!((a - b).abs() < LOSS_TOL, "{name}: step {} loss {a} vs {b}", s + 1);
        worst_loss = worst_loss.max((a - b).abs());
    }
    let mut worst_param = 0.0f64;
    for (i, (a, b)) in base.1.tensors().iter().zip(other.1.tensors()).enumerate() {
        let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
        let diff = a.iter().zip(b.iter()).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) as f64;
        assert!(diff / scale < PARAM_TOL, "{name}: tensor {i} differs by {diff} (scale {scale})");
        worst_param = worst_param.max(diff / scale);
    }
    eprintln!("{name}: worst loss diff {worst_loss:.3e}, worst relative parameter diff {worst_param:.3e}");
}

#[test]
fn every_data_parallel_layout_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let base = run(dir.path(), "one", 1, &[]);
    let layouts: &[(&str, usize, &[&str])] = &[
        ("DP=2", 2, &["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
        ("DP=4", 4, &["parallel.dp_replicate=4", "parallel.dp_shard=1"]),
        ("FSDP=2", 2, &["parallel.dp_shard=2"]),
        ("FSDP=4", 4, &["parallel.dp_shard=4"]),
        ("HSDP=2x2", 4, &["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
        ("FSDP=2 no reshard", 2, &["parallel.dp_shard=2", "parallel.reshard_after_forward=false"]),
    ];
    for (name, ranks, layout) in layouts {
        let other = run(dir.path(), &name.replace([' ', '='], "_"), *ranks, layout);
        assert_equivalent(name, &base, &other);
    }
}

/// Sum of the model-state memory columns of a rank's last timing row.
fn model_state_bytes(out: &Path, rank: usize) -> u64 {
    let csv = std::fs::read_to_string(out.join(format!("timing/rank_{rank:05}.csv"))).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let last: Vec<&str> = lines.last().unwrap().split(',').collect();
    ["param_bytes", "grad_bytes", "optim_bytes", "gathered_peak_bytes", "grad_scratch_bytes"]
        .iter()
        .map(|c| last[header.iter().position(|h| h == c).unwrap()].parse::<u64>().unwrap())
        .sum()
}

/// FSDP over 4 ranks holds a quarter of the parameters, gradients and moments, plus the
/// gathered globals and one block and the gradient scratch: ≤ 0.30 of one rank's model state
/// on a deck deep enough (24 blocks) for those buffers not to dominate.
const FSDP4_STATE_RATIO: f64 = 0.30;

#[test]
fn fsdp_four_ranks_hold_a_quarter_of_the_model_state() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["run.steps=2", "run.threads=1", "model.n_layers=24", "optim.warmup_steps=0"];
    train_losses(dir.path(), "one", &tiny_deck(), Some(1), &sets);
    let mut sharded = sets.to_vec();
    sharded.push("parallel.dp_shard=4");
    train_losses(dir.path(), "fsdp4", &tiny_deck(), Some(4), &sharded);
    let one = model_state_bytes(&dir.path().join("one"), 0) as f64;
    for rank in 0..4 {
        let r = model_state_bytes(&dir.path().join("fsdp4"), rank) as f64 / one;
        eprintln!("FSDP=4 rank {rank}: model state {:.3} of one rank's ({one} bytes)", r);
        assert!(r <= FSDP4_STATE_RATIO, "rank {rank}: {r:.3} of the one-rank model state");
    }
}

/// Overlapping communication changes when collectives run, not what they compute: losses are
/// bitwise those of the blocking schedule.
#[test]
fn overlap_changes_nothing_but_timing() {
    let dir = tempfile::tempdir().unwrap();
    let hsdp = ["run.steps=4", "run.threads=1", "parallel.dp_replicate=2", "parallel.dp_shard=2", "optim.warmup_steps=0"];
    let (on, _) = train_losses(dir.path(), "on", &tiny_deck(), Some(4), &hsdp);
    let mut off_sets = hsdp.to_vec();
    off_sets.push("parallel.overlap=false");
    let (off, _) = train_losses(dir.path(), "off", &tiny_deck(), Some(4), &off_sets);
    assert_eq!(on, off);
}
