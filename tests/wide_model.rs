//! A wider model than the tiny deck's (4 layers, width 256, grouped-query attention with head
//! dimension 32, a vocabulary no tp degree divides) against its one-rank run on the main
//! layouts, through the real binary under `mpirun`. The tiny model (2 layers, width 64) leaves
//! shapes untested that only show with more than one kv head per tp rank, more than two blocks
//! to shard and gather, or padded vocabulary rows on every tp degree.

mod common;
use common::*;

/// The wide model on the tiny deck: 4 layers, d_model 256, 8 query and 4 kv heads (head
/// dimension 32; tp 2 and 4 divide both), ffn 512, and vocabulary 251 (prime: padded on every
/// tp > 1). Short runs: 4 steps of 4 sequences of 32 tokens, micro-batch 1, so one rank
/// accumulates 4 micro-steps, the DP=2, FSDP=2, TP and CP layouts 2 or 4, HSDP=2×2 one.
/// Clipping at 0.1 is active in every step (`run_layout_with` asserts it), warm-up 1 step.
///
/// The peak LR is 5e-4, not the tiny deck's 3e-3: Adam's first updates are about ±lr on every
/// element, whatever its gradient, so elements whose gradient is rounding noise move by
/// noise-driven amounts proportional to lr, and at width 256 (weights of max |w| ≈ 0.04) the
/// tiny deck's LR put the final parameters of the TP and CP layouts 8.3e-4 apart (relative),
/// too near the shared `PARAM_TOL` (1e-3). At 5e-4, measured against one rank: losses ≤ 4.5e-8
/// (DP, FSDP, HSDP) and ≤ 1.5e-7 (TP, CP; `LOSS_TOL` 1e-6), final parameters ≤ 7.1e-6 and
/// ≤ 1.6e-4 (`PARAM_TOL` 1e-3). A wrong or lost update still moves a parameter by ~lr, i.e.
/// > 1e-2 of the tensor's largest value.
const WIDE_SETS: &[&str] = &[
    "model.n_layers=4",
    "model.d_model=256",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.ffn_hidden=512",
    "model.vocab_size=251",
    "train.seq_len=32",
    "train.micro_batch=1",
    "train.global_batch=4",
    "run.steps=4",
    "run.threads=1",
    "optim.lr=5e-4",
    "optim.min_lr=5e-5",
    "optim.warmup_steps=1",
    "optim.grad_clip=0.1",
];

#[test]
fn wide_gqa_model_matches_one_rank_on_the_main_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let base = run_layout_with(dir.path(), "one", 1, WIDE_SETS, &[]);
    assert_eq!(base.1.embed_tokens.len(), 251 * 256, "the export holds exactly the real vocabulary");
    let layouts: &[(&str, usize, &[&str])] = &[
        ("DP=2", 2, &["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
        ("FSDP=2", 2, &["parallel.dp_shard=2"]),
        ("TP=2 + SP", 2, &["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("CP=2", 2, &["parallel.cp=2"]),
        ("FSDP=2 x TP=2", 4, &["parallel.dp_shard=2", "parallel.tp=2"]),
        ("CP=2 x TP=2", 4, &["parallel.cp=2", "parallel.tp=2"]),
        ("HSDP=2x2", 4, &["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    ];
    assert_layouts_match_with(dir.path(), WIDE_SETS, &base, layouts);
}
