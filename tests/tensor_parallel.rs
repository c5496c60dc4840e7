//! Tensor parallelism (Megatron-style, vocab-parallel embedding and loss) against one rank,
//! alone and composed with FSDP and HSDP, through the real binary under `mpirun`.

mod common;
use common::*;

#[test]
fn tensor_parallel_layouts_match_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let base = run_layout(dir.path(), "one", 1, &[]);
    let layouts: &[(&str, usize, &[&str])] = &[
        ("TP=2", 2, &["parallel.tp=2"]),
        ("TP=4", 4, &["parallel.tp=4"]),
        ("FSDP=2 x TP=2", 4, &["parallel.dp_shard=2", "parallel.tp=2"]),
        ("DP=2 x TP=2", 4, &["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.tp=2"]),
        ("HSDP=2x2 x TP=2", 8, &["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2"]),
        ("TP=2 checkpointed", 2, &["parallel.tp=2", "train.activation_checkpointing=\"full\""]),
        ("TP=2 + SP", 2, &["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("TP=2 + SP selective", 2, &["parallel.tp=2", "parallel.sequence_parallel=true", "train.activation_checkpointing=\"selective\""]),
        ("TP=4 + SP checkpointed", 4, &["parallel.tp=4", "parallel.sequence_parallel=true", "train.activation_checkpointing=\"full\""]),
        ("FSDP=2 x TP=2 + SP", 4, &["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    ];
    assert_layouts_match(dir.path(), &base, layouts);
}

/// A vocabulary that tp does not divide is padded inside the program; the padding must change
/// neither the loss nor the gradients nor what is exported (257 = 2·128 + 1).
#[test]
fn vocabulary_not_divisible_by_tp_gives_one_rank_results() {
    let dir = tempfile::tempdir().unwrap();
    let v = "model.vocab_size=257";
    let base = run_layout(dir.path(), "one", 1, &[v]);
    let tp2 = run_layout(dir.path(), "tp2", 2, &[v, "parallel.tp=2"]);
    assert_eq!(tp2.1.embed_tokens.len(), 257 * 64, "the export holds exactly the real vocabulary");
    assert_equivalent("V=257 TP=2", &base, &tp2);
}

/// Qwen3's attention (per-head q/k norms, a head width of 12 apart from d_model / n_heads = 8)
/// on the layouts where it differs from Llama's: tensor parallelism splits the heads, so each
/// tp rank's gradient of the replicated q/k norm weights covers its heads only and is summed
/// over tp (with and without sequence parallelism); context parallelism, FSDP, zero bubble's
/// deferred norm gradients and checkpointing's recomputation carry the new tensors too (every
/// step's loss within `LOSS_TOL`, the exported final model within `PARAM_TOL`).
#[test]
fn qwen3_attention_layouts_match_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let qwen3: Vec<&str> = EQUIV_SETS.iter().copied().chain(["model.qk_norm=true", "model.head_dim=12"]).collect();
    let base = run_layout_with(dir.path(), "one", 1, &qwen3, &[]);
    let layouts: &[(&str, usize, &[&str])] = &[
        ("TP=2", 2, &["parallel.tp=2"]),
        ("TP=2 + SP selective", 2, &["parallel.tp=2", "parallel.sequence_parallel=true", "train.activation_checkpointing=\"selective\""]),
        ("FSDP=2 x TP=2 checkpointed", 4, &["parallel.dp_shard=2", "parallel.tp=2", "train.activation_checkpointing=\"full\""]),
        ("CP=2", 2, &["parallel.cp=2"]),
    ];
    assert_layouts_match_with(dir.path(), &qwen3, &base, layouts);
    // A pipeline exports no final model (it is never gathered on one rank): its losses.
    let pp: Vec<&str> = qwen3.iter().copied().chain(["parallel.pp=2", "parallel.pp_schedule=\"zero_bubble\""]).collect();
    let (_, losses) = train_losses(dir.path(), "pp2_zero_bubble", &tiny_deck(), Some(2), &pp);
    assert_losses_within("PP=2 zero bubble", &base.0, &losses, LOSS_TOL);
}
