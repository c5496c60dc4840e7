//! Each parallelism at degree 8 against one rank, through the real binary under `mpirun -n 8`
//! (oversubscribed: the runs are tiny and short). Degree 8 splits the tiny model down to one
//! query and one kv head per tp rank, 2-token chunks per cp rank, and one sequence per dp rank.

mod common;
use common::*;

/// The tiny model with 8 kv heads (tp 8 divides 8 query and 8 kv heads, ffn 192 and vocab
/// 128), sequences of 32 tokens (cp 8 cuts them into 16 chunks of 2), and a global batch of 8
/// single-sequence micro-batches (one rank accumulates 8 micro-steps, DP=8 and FSDP=8 one).
/// 3 steps with clipping at 0.3 active in every step and a 1-step warm-up. Measured against
/// one rank: losses ≤ 6.5e-9 (DP=8, FSDP=8) and ≤ 6.2e-8 (TP=8, CP=8), within the shared
/// `LOSS_TOL` (1e-6); final parameters ≤ 3.6e-5 and ≤ 2.4e-4 (CP=8), within `PARAM_TOL` (1e-3).
const EIGHT_SETS: &[&str] = &[
    "model.n_kv_heads=8",
    "train.seq_len=32",
    "train.micro_batch=1",
    "train.global_batch=8",
    "run.steps=3",
    "run.threads=1",
    "optim.warmup_steps=1",
    "optim.grad_clip=0.3",
];

#[test]
fn every_parallelism_at_degree_eight_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let base = run_layout_with(dir.path(), "one", 1, EIGHT_SETS, &[]);
    let layouts: &[(&str, usize, &[&str])] = &[
        ("DP=8", 8, &["parallel.dp_replicate=8", "parallel.dp_shard=1"]),
        ("FSDP=8", 8, &["parallel.dp_shard=8"]),
        ("TP=8", 8, &["parallel.tp=8"]),
        ("CP=8", 8, &["parallel.cp=8"]),
    ];
    assert_layouts_match_with(dir.path(), EIGHT_SETS, &base, layouts);
}
