//! A mixture of experts through the real binary under `mpirun`: every layout (DP, FSDP, HSDP,
//! TP with and without SP, CP, pipelines and their compositions, with activation
//! checkpointing) reproduces one rank, the auxiliary loss included; a checkpoint written on one
//! layout resumes on others; the final model goes out as a Mixtral or Qwen3-MoE folder and
//! comes back in.
//!
//! The model is the tiny deck's with 8 experts of width 48, top-2, and the auxiliary loss on
//! (its gradient is part of every step, so a layout that got it wrong would drift).

mod common;
use common::*;
use std::path::Path;

fn experts() -> Vec<&'static str> {
    expert_sets_after(&["run.steps=10"])
}

#[test]
fn every_data_parallel_layout_of_experts_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let base = run_layout_with(dir.path(), "one", 1, &experts(), &[]);
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
    assert_layouts_match_with(dir.path(), &experts(), &base, layouts);
    let aux_hsdp = column(&dir.path().join("HSDP_2x2"), "aux_loss");
    assert_losses_within("HSDP=2x2 aux_loss", &aux_one, &aux_hsdp, LOSS_TOL);
    // The routing log: per step and expert block the global batch's 16 × 64 tokens × top-2
    // choices, counted over every rank; the first step's (same weights) equal on every layout.
    let load_one = expert_load(&dir.path().join("one"));
    assert_eq!(load_one.len(), 2 * base.0.len(), "a row per step and expert block");
    for row in &load_one {
        let (choices, min, max) = (row[2], row[3], row[4]);
        assert!(choices == 2048.0 && min <= choices / 8.0 && max >= choices / 8.0 && row[5] >= 0.0, "{row:?}");
    }
    for layout in ["DP_2", "HSDP_2x2", "CP_2_x_TP_2_SP"] {
        let other = expert_load(&dir.path().join(layout));
        assert_eq!(other[..2], load_one[..2], "{layout}: the first step's expert load");
    }
    // The report shows it per block (the even share: 2048 choices over 8 experts).
    let (one, report) = (dir.path().join("one"), dir.path().join("report"));
    let o = run_single(&["report", one.to_str().unwrap(), "--out", report.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let md = std::fs::read_to_string(report.join("summary.md")).unwrap();
    let section = md.split("## Expert load").nth(1).expect("an expert-load section");
    for block in [0, 1] {
        assert!(section.contains(&format!("| {block} | 10 |")) && section.contains("/ 256 /"), "{section}");
    }
}

/// The rows of `expert_load.csv` (step, layer, choices, min, max, cv).
fn expert_load(out: &Path) -> Vec<Vec<f64>> {
    let text = std::fs::read_to_string(out.join("expert_load.csv")).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("step,layer,choices,min,max,cv"));
    lines.map(|l| l.split(',').map(|v| v.parse().unwrap()).collect()).collect()
}

/// A Qwen3-MoE-shaped model (q/k norm, no top-k renormalisation) with a dense first block
/// exports as `Qwen3MoeForCausalLM` and reads back with the same tensors.
#[test]
fn a_qwen3_moe_model_with_a_dense_block_trains_and_round_trips_through_hugging_face_files() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["model.qk_norm=true", "model.norm_topk_prob=false", "model.first_dense_layers=1", "run.steps=4"];
    let mut all = experts();
    all.extend(sets);
    let one = run_layout_with(dir.path(), "one", 1, &all, &[]);
    let fsdp = run_layout_with(dir.path(), "fsdp2", 2, &all, &["parallel.dp_shard=2"]);
    assert_equivalent("FSDP=2 with a dense block", &one, &fsdp);
    let config = std::fs::read_to_string(dir.path().join("one/final_hf/config.json")).unwrap();
    assert!(config.contains("\"Qwen3MoeForCausalLM\"") && config.contains("\"mlp_only_layers\": [\n    0\n  ]"), "{config}");
}

/// Pipelines carry each micro-batch's expert loads with its activations and gradients: every
/// schedule (zero bubble keeps the experts' weight-gradient operands), composed with CP, TP
/// and FSDP, matches one rank (losses, auxiliary
/// losses, the final checkpoint) and moves the bytes the planner predicts.
#[test]
fn pipelines_of_experts_match_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = train_experts(d, "one", 1, &[]);
    let aux = column(&d.join("one"), "aux_loss");
    let layouts: &[(&str, usize, &[&str])] = &[
        ("pp2_1f1b", 2, &["parallel.pp=2"]),
        ("pp2_gpipe", 2, &["parallel.pp=2", "parallel.pp_schedule=\"gpipe\""]),
        ("pp2_interleaved", 2, &["parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule=\"interleaved\""]),
        ("pp2_zero_bubble", 2, &["parallel.pp=2", "parallel.pp_schedule=\"zero_bubble\""]),
        (
            "pp2_tp2_sp_zero_bubble",
            4,
            &["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp_schedule=\"zero_bubble\""],
        ),
        ("pp2_cp2", 4, &["parallel.pp=2", "parallel.cp=2"]),
        ("pp2_fsdp2_full", 4, &["parallel.pp=2", "parallel.dp_shard=2", "train.activation_checkpointing=\"full\""]),
    ];
    for (name, ranks, layout) in layouts {
        let l = train_experts(d, name, *ranks, layout);
        assert_losses_within(name, &base, &l, LOSS_TOL);
        assert_losses_within(&format!("{name} aux_loss"), &aux, &column(&d.join(name), "aux_loss"), LOSS_TOL);
        assert_close(name, &ckpt(d, "one", 6), &ckpt(d, name, 6));
        let mut sets = expert_pipeline_sets();
        sets.extend_from_slice(layout);
        let owned: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let deck = ndtrain::config::Deck::from_file(&tiny_deck(), &owned).unwrap();
        assert_bytes_match_formula(d, name, &deck, *ranks);
    }
}

/// A checkpoint of the expert model written on CP 2 × TP 2 with SP resumes on one rank and on
/// a pipeline with FSDP, and continues the one-rank curve.
#[test]
fn a_checkpoint_of_experts_resumes_on_other_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let one = train_experts(d, "one", 1, &[]);
    train_experts(d, "writer", 4, &["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]);
    let resume = format!("checkpoint.resume=\"{}\"", ckpt(d, "writer", 3).display());
    for (name, ranks, layout) in [("on_one", 1, &[][..]), ("on_pp2_fsdp2", 4, &["parallel.pp=2", "parallel.dp_shard=2"][..])] {
        let mut extra = layout.to_vec();
        extra.push(&resume);
        let l = train_experts(d, name, ranks, &extra);
        assert_losses_within(name, &one[3..], &l, LOSS_TOL);
        assert_close(name, &ckpt(d, "one", 6), &ckpt(d, name, 6));
    }
}

/// Balancing without an auxiliary loss (a selection bias moved after each step by the global
/// expert counts): the same on every layout, and restored from checkpoints so that a resumed
/// run continues bit for bit.
#[test]
fn bias_balancing_is_the_same_on_every_layout_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bias: &[&str] = &["model.router_aux_loss_coef=0", "model.router_bias_update_rate=0.01"];
    let base = train_experts(d, "one", 1, bias);
    let load = expert_load(&d.join("one"));
    // The bias changes the choices (from step 2 on: step 1 routes with a zero bias).
    train_experts(d, "no_bias", 1, &["model.router_aux_loss_coef=0"]);
    let plain = expert_load(&d.join("no_bias"));
    assert_eq!(plain[..2], load[..2], "step 1 routes without a bias either way");
    assert_ne!(plain, load, "the bias moves the choices");
    for (name, ranks, layout) in [
        ("dp2", 2, &["parallel.dp_replicate=2", "parallel.dp_shard=1"][..]),
        ("cp2_tp2_sp", 4, &["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"][..]),
        ("pp2_fsdp2", 4, &["parallel.pp=2", "parallel.dp_shard=2"][..]),
    ] {
        let mut extra = bias.to_vec();
        extra.extend_from_slice(layout);
        let l = train_experts(d, name, ranks, &extra);
        assert_losses_within(name, &base, &l, LOSS_TOL);
        assert_eq!(expert_load(&d.join(name)), load, "{name}: the same choices every step");
    }
    // Without the bias restored the routing of steps 4..6 would change.
    let resume = format!("checkpoint.resume=\"{}\"", ckpt(d, "one", 3).display());
    let mut extra = bias.to_vec();
    extra.push(&resume);
    let (s, _) = train_losses(d, "resumed", &tiny_deck(), None, &[expert_pipeline_sets(), extra].concat());
    let (whole, _) = losses(&d.join("one"));
    assert_eq!(s, whole[3..], "resumed at step 3: steps 4..6 bit for bit");
}
