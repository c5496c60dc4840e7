//! Expert parallelism through the real binary under `mpirun`: the experts split over `ep`
//! ranks cut out of `dp_shard × cp`, their rows moved by all-to-alls, reproduce one rank on
//! every layout it composes with (FSDP and HSDP over the remaining ranks, TP with SP, CP,
//! pipelines under 1F1B and zero bubble, checkpointing, bias balancing); the all-to-all moves
//! the bytes of its formula; a checkpoint written on `ep` 4 resumes on other layouts.
//!
//! The model is the tiny deck's with 8 experts of width 48, top-2, and the auxiliary loss on.

mod common;
use common::*;

fn experts() -> Vec<&'static str> {
    expert_sets_after(&["run.steps=8"])
}

#[test]
fn expert_parallel_layouts_match_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let base = run_layout_with(dir.path(), "one", 1, &experts(), &[]);
    let aux = column(&dir.path().join("one"), "aux_loss");
    let layouts: &[(&str, usize, &[&str])] = &[
        ("EP=2", 2, &["parallel.dp_shard=2", "parallel.ep=2"]),
        ("EP=4", 4, &["parallel.dp_shard=4", "parallel.ep=4"]),
        ("FSDP=4 EP=2", 4, &["parallel.dp_shard=4", "parallel.ep=2"]),
        ("HSDP=2x2 EP=2", 4, &["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2"]),
        ("EP=2 x TP=2 SP", 4, &["parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
        // The ep group is the cp group here: the two halves of each sequence send their rows
        // to each other's experts.
        ("EP=2 x CP=2", 4, &["parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=2"]),
        ("EP=2 full checkpointing", 2, &["parallel.dp_shard=2", "parallel.ep=2", "train.activation_checkpointing=\"full\""]),
    ];
    assert_layouts_match_with(dir.path(), &experts(), &base, layouts);
    for (name, _, _) in layouts {
        let out = dir.path().join(name.replace([' ', '=', '×'], "_"));
        assert_losses_within(&format!("{name} aux_loss"), &aux, &column(&out, "aux_loss"), LOSS_TOL);
    }
}

/// With every expert chosen by every token (`experts_per_token = n_experts`) each rank sends
/// exactly `(ep − 1)/ep` of its routed rows off-rank in every exchange, whatever the router
/// says: the measured all-to-all bytes equal the formula exactly, on EP 2 and on EP 4 with
/// full checkpointing (two more exchanges per recomputed block).
#[test]
fn the_all_to_all_moves_the_bytes_of_its_formula() {
    let dir = tempfile::tempdir().unwrap();
    let mut sets = experts();
    sets.retain(|s| !s.starts_with("model.experts_per_token") && !s.starts_with("run.steps"));
    sets.extend(["model.experts_per_token=8", "run.steps=3"]);
    let base = run_layout_with(dir.path(), "one", 1, &sets, &[]);
    let layouts: &[(&str, usize, &[&str])] = &[
        ("EP=2", 2, &["parallel.dp_shard=2", "parallel.ep=2"]),
        ("EP=4 full", 4, &["parallel.dp_shard=4", "parallel.ep=4", "train.activation_checkpointing=\"full\""]),
    ];
    // `run_layout_with` asserts every step's bytes per collective against the planner.
    assert_layouts_match_with(dir.path(), &sets, &base, layouts);
    let csv = std::fs::read_to_string(dir.path().join("EP_2/timing/rank_00000.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = header.iter().position(|c| *c == "ep.all_to_all_bytes").expect("an all-to-all column");
    let first: u64 = csv.lines().nth(1).unwrap().split(',').nth(col).unwrap().parse().unwrap();
    // 2 blocks × 4 exchanges × 4 micro-steps × (2 sequences × 64 tokens × 8 choices, half
    // of them off-rank) × D 64 × 4 bytes.
    assert_eq!(first, 2 * 4 * 4 * (2 * 64 * 8 / 2) * 64 * 4);
}

/// Pipelines whose stages split their experts: the rows of each stage's blocks go to the
/// stage's ep ranks, under 1F1B and under zero bubble (the experts' weight gradients computed
/// later from kept operands, on the rank that holds them).
#[test]
fn expert_parallel_pipelines_match_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = train_experts(d, "one", 1, &[]);
    for (name, layout) in [
        ("ep2_pp2_1f1b", &["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2"][..]),
        ("ep2_pp2_zero_bubble", &["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2", "parallel.pp_schedule=\"zero_bubble\""][..]),
    ] {
        let l = train_experts(d, name, 4, layout);
        assert_losses_within(name, &base, &l, LOSS_TOL);
        assert_close(name, &ckpt(d, "one", 6), &ckpt(d, name, 6));
        let mut sets = expert_pipeline_sets();
        sets.extend_from_slice(layout);
        let owned: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let deck = ndtrain::config::Deck::from_file(&tiny_deck(), &owned).unwrap();
        assert_bytes_match_formula(d, name, &deck, 4);
    }
}

/// A checkpoint written on EP 4 (each rank holding 2 of the 8 experts of every block) holds
/// the logical per-expert tensors: it resumes on one rank and on FSDP 2 × TP 2, and both
/// continue the one-rank curve to the same final checkpoint.
#[test]
fn a_checkpoint_written_on_ep_4_resumes_on_other_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let one = train_experts(d, "one", 1, &[]);
    let written = train_experts(d, "writer", 4, &["parallel.dp_shard=4", "parallel.ep=4"]);
    assert_losses_within("EP=4", &one, &written, LOSS_TOL);
    assert_close("EP=4", &ckpt(d, "one", 6), &ckpt(d, "writer", 6));
    let resume = format!("checkpoint.resume=\"{}\"", ckpt(d, "writer", 3).display());
    for (name, ranks, layout) in [("on_one", 1, &[][..]), ("on_fsdp2_tp2", 4, &["parallel.dp_shard=2", "parallel.tp=2"][..])] {
        let mut extra = layout.to_vec();
        extra.push(&resume);
        let l = train_experts(d, name, ranks, &extra);
        assert_losses_within(name, &one[3..], &l, LOSS_TOL);
        assert_close(name, &ckpt(d, "one", 6), &ckpt(d, name, 6));
    }
}

/// Balancing without an auxiliary loss on EP 2: every step's global expert counts, and so the
/// biases and the choices, are those of one rank.
#[test]
fn bias_balancing_on_ep_2_makes_the_choices_of_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bias: &[&str] = &["model.router_aux_loss_coef=0", "model.router_bias_update_rate=0.01"];
    let base = train_experts(d, "one", 1, bias);
    let mut extra = bias.to_vec();
    extra.extend(["parallel.dp_shard=2", "parallel.ep=2"]);
    let l = train_experts(d, "ep2", 2, &extra);
    assert_losses_within("EP=2 bias", &base, &l, LOSS_TOL);
    let load = |name: &str| std::fs::read_to_string(d.join(name).join("expert_load.csv")).unwrap();
    assert_eq!(load("ep2"), load("one"), "the same choices every step");
}

/// Shared experts (DeepSeek's: one FFN of `n_shared_experts × moe_ffn_hidden` every row passes
/// beside the routed experts, cut over tp like the dense MLP): TP 2 with SP, ep 2 × TP 2 with
/// SP, and PP 2 under zero bubble with full checkpointing match one rank, with the bytes of
/// the formulas (the shared experts bring back the MLP's tp traffic).
#[test]
fn shared_experts_match_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let shared = "model.n_shared_experts=2";
    let base = train_experts(d, "one", 1, &[shared]);
    let layouts: &[(&str, usize, &[&str])] = &[
        ("tp2_sp", 2, &["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp_shard=1"]),
        ("ep2_tp2_sp", 4, &["parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("pp2_zero_bubble_full", 2, &["parallel.pp=2", "parallel.pp_schedule=\"zero_bubble\"", "train.activation_checkpointing=\"full\""]),
    ];
    for (name, ranks, layout) in layouts {
        let mut extra = layout.to_vec();
        extra.push(shared);
        let l = train_experts(d, name, *ranks, &extra);
        assert_losses_within(name, &base, &l, LOSS_TOL);
        assert_close(name, &ckpt(d, "one", 6), &ckpt(d, name, 6));
        let mut sets = expert_pipeline_sets();
        sets.extend_from_slice(&extra);
        let owned: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let deck = ndtrain::config::Deck::from_file(&tiny_deck(), &owned).unwrap();
        assert_bytes_match_formula(d, name, &deck, *ranks);
    }
    let names = ndtrain::io::checkpoint::tools::dataset_paths(&ckpt(d, "one", 6)).unwrap();
    assert!(names.iter().any(|n| n.ends_with("layers.1.mlp.shared_experts.down_proj.weight")), "{names:?}");
}
