//! A mixture of experts through the real binary under `mpirun`: every data-parallel layout
//! (DP, FSDP, HSDP, with activation checkpointing) reproduces one rank, the auxiliary loss
//! included, and the final model goes out as a Mixtral folder and comes back in.
//!
//! The model is the tiny deck's with 8 experts of width 48, top-2, and the auxiliary loss on
//! (its gradient is part of every step, so a layout that got it wrong would drift).

mod common;
use common::*;

const EXPERTS: &[&str] = &[
    "run.steps=10",
    "run.threads=1",
    "optim.grad_clip=0.3",
    "optim.warmup_steps=2",
    "model.n_experts=8",
    "model.experts_per_token=2",
    "model.moe_ffn_hidden=48",
    "model.router_aux_loss_coef=0.05",
];

#[test]
fn every_data_parallel_layout_of_experts_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let base = run_layout_with(dir.path(), "one", 1, EXPERTS, &[]);
    let aux_one = column(&dir.path().join("one"), "aux_loss");
    assert_eq!(aux_one.len(), base.0.len(), "metrics.csv has an aux_loss for every step");
    // E · Σ_e f_e·P_e is k (2) for an even load and at most E·k (16).
    assert!(aux_one.iter().all(|a| (1.0..16.0).contains(a)), "aux losses of top-2 over 8 experts: {aux_one:?}");
    let layouts: &[(&str, usize, &[&str])] = &[
        ("DP=2", 2, &["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
        ("FSDP=4", 4, &["parallel.dp_shard=4"]),
        ("HSDP=2x2", 4, &["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
        ("FSDP=2 full checkpointing", 2, &["parallel.dp_shard=2", "train.activation_checkpointing=\"full\""]),
        ("FSDP=2 selective checkpointing", 2, &["parallel.dp_shard=2", "train.activation_checkpointing=\"selective\""]),
        ("TP=2", 2, &["parallel.tp=2", "parallel.dp_shard=1"]),
        ("TP=2 SP", 2, &["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp_shard=1"]),
        ("CP=2", 2, &["parallel.cp=2", "parallel.dp_shard=1"]),
        ("FSDP=2 x CP=2", 4, &["parallel.cp=2", "parallel.dp_shard=2"]),
        ("CP=2 x TP=2 SP", 4, &["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp_shard=1"]),
    ];
    assert_layouts_match_with(dir.path(), EXPERTS, &base, layouts);
    let aux_hsdp = column(&dir.path().join("HSDP_2x2"), "aux_loss");
    assert_losses_within("HSDP=2x2 aux_loss", &aux_one, &aux_hsdp, LOSS_TOL);
}

/// A Qwen3-MoE-shaped model (q/k norm, no top-k renormalisation) with a dense first block
/// exports as `Qwen3MoeForCausalLM` and reads back with the same tensors.
#[test]
fn a_qwen3_moe_model_with_a_dense_block_trains_and_round_trips_through_hugging_face_files() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["model.qk_norm=true", "model.norm_topk_prob=false", "model.first_dense_layers=1", "run.steps=4"];
    let mut all = EXPERTS.to_vec();
    all.extend(sets);
    let one = run_layout_with(dir.path(), "one", 1, &all, &[]);
    let fsdp = run_layout_with(dir.path(), "fsdp2", 2, &all, &["parallel.dp_shard=2"]);
    assert_equivalent("FSDP=2 with a dense block", &one, &fsdp);
    let config = std::fs::read_to_string(dir.path().join("one/final_hf/config.json")).unwrap();
    assert!(config.contains("\"Qwen3MoeForCausalLM\"") && config.contains("\"mlp_only_layers\": [\n    0\n  ]"), "{config}");
}
