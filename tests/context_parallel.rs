//! Context parallelism (zigzag sequence split, ring attention) against one rank, alone and in
//! the 4-D mesh, through the real binary under `mpirun`; and every 4-rank layout of the tiny
//! deck.

mod common;
use common::*;

#[test]
fn context_parallel_layouts_match_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let base = run_layout(dir.path(), "one", 1, &[]);
    let layouts: &[(&str, usize, &[&str])] = &[
        ("CP=2", 2, &["parallel.cp=2"]),
        ("CP=4", 4, &["parallel.cp=4"]),
        ("FSDP=2 x CP=2", 4, &["parallel.dp_shard=2", "parallel.cp=2"]),
        ("CP=2 x TP=2", 4, &["parallel.cp=2", "parallel.tp=2"]),
        ("2x2x2x1", 8, &["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.cp=2"]),
        ("1x2x2x2 + SP", 8, &["parallel.dp_shard=2", "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("CP=2 checkpointed", 2, &["parallel.cp=2", "train.activation_checkpointing=\"full\""]),
    ];
    assert_layouts_match(dir.path(), &base, layouts);
}

/// Every factorisation of 4 ranks into dp_replicate × dp_shard × cp × tp that the tiny deck
/// accepts reproduces the one-rank losses: the whole matrix, not a chosen few.
#[test]
fn every_four_rank_layout_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["run.steps=4", "run.threads=1", "optim.warmup_steps=1", "optim.grad_clip=0.3"];
    let (_, base) = train_losses(dir.path(), "one", &tiny_deck(), Some(1), &sets);
    let mut tried = 0;
    for r in [1, 2, 4] {
        for s in [1, 2, 4] {
            for c in [1, 2, 4] {
                for t in [1, 2, 4] {
                    if r * s * c * t != 4 {
                        continue;
                    }
                    let layout = [
                        format!("parallel.dp_replicate={r}"),
                        format!("parallel.dp_shard={s}"),
                        format!("parallel.cp={c}"),
                        format!("parallel.tp={t}"),
                    ];
                    let mut all: Vec<&str> = sets.to_vec();
                    all.extend(layout.iter().map(|x| x.as_str()));
                    let name = format!("{r}x{s}x{c}x{t}");
                    let (_, losses) = train_losses(dir.path(), &name, &tiny_deck(), Some(4), &all);
                    assert_losses_within(&name, &base, &losses, LOSS_TOL);
                    tried += 1;
                }
            }
        }
    }
    assert_eq!(tried, 10, "the 10 ordered factorisations of 4 into four degrees");
}

/// Zigzag balance: every cp rank processes the same number of causally visible (query, key)
/// pairs (counted by the model), within 1 %.
#[test]
fn attention_work_is_balanced_across_cp_ranks() {
    let dir = tempfile::tempdir().unwrap();
    train_losses(dir.path(), "cp4", &tiny_deck(), Some(4), &["run.steps=1", "run.threads=1", "optim.warmup_steps=0", "parallel.cp=4"]);
    let work: Vec<f64> = (0..4).map(|rank| last_timing_value(&dir.path().join("cp4"), rank, "attention_pairs")).collect();
    let (lo, hi) = work.iter().fold((f64::MAX, 0.0f64), |(l, h), &w| (l.min(w), h.max(w)));
    assert!(lo > 0.0 && (hi - lo) / hi < 0.01, "attention work per cp rank {work:?}");
}
