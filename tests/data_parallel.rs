//! Data parallelism in its three forms against one rank, through the real binary under
//! `mpirun`: DP (dp_replicate), FSDP (dp_shard, ZeRO-3 and ZeRO-2-like) and HSDP (both).

mod common;
use common::*;
use std::path::Path;

#[test]
fn every_data_parallel_layout_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let base = run_layout(dir.path(), "one", 1, &[]);
    let layouts: &[(&str, usize, &[&str])] = &[
        ("DP=2", 2, &["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
        ("DP=4", 4, &["parallel.dp_replicate=4", "parallel.dp_shard=1"]),
        ("FSDP=2", 2, &["parallel.dp_shard=2"]),
        ("FSDP=4", 4, &["parallel.dp_shard=4"]),
        ("HSDP=2x2", 4, &["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
        ("FSDP=2 no reshard", 2, &["parallel.dp_shard=2", "parallel.reshard_after_forward=false"]),
    ];
    assert_layouts_match(dir.path(), &base, layouts);
}

/// Sum of the model-state memory columns of a rank's last timing row.
fn model_state_bytes(out: &Path, rank: usize) -> u64 {
    ["param_bytes", "grad_bytes", "optim_bytes", "gathered_peak_bytes", "grad_scratch_bytes"]
        .iter()
        .map(|c| last_timing_value(out, rank, c) as u64)
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
