//! `ndtrain plan` held to the measurements: on eight layouts (two of them pipelines, where
//! rank 0 is the first stage) of a model whose state and activations dominate the process, the
//! predicted bytes per group equal the counters of every step, every memory category equals
//! what the run tracked, and the predicted peak is within 10 % of the measured growth of the
//! resident set. And a Llama 3 8B deck on 512 ranks plans
//! in seconds.

mod common;

use common::*;
use ndtrain::config::Deck;
use std::process::Command;

/// 5.2 M parameters, micro-batches of 4 × 256 tokens: about 100-250 MiB per rank, of which the
/// runtime's own memory (MPI, threads, GEMM packing) is a few percent.
const MODEL: &[&str] = &[
    "model.d_model=256",
    "model.ffn_hidden=768",
    "model.n_layers=4",
    "model.vocab_size=4096",
    "train.seq_len=256",
    "train.micro_batch=4",
    "train.global_batch=16",
    "run.steps=2",
    "run.threads=1",
    "optim.warmup_steps=1",
];

/// Predicted peak vs measured peak-RSS growth: measured 0.88-0.97 on these layouts. The
/// prediction omits MPI's buffers, rayon's stacks and the GEMM's packing buffers, of which the
/// allocator keeps the largest per GEMM thread for reuse (`backend::cpu::heap`: 4-8 MiB here, a
/// few percent of these small runs' growth).
const PEAK_TOL: f64 = 0.15;

/// The tests of this file run one at a time: two of them time what they run (the planning of
/// a large deck, and a trained step against the probe's prediction), which the others' ranks
/// would slow on this machine's cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn timing_last_row(out: &std::path::Path) -> std::collections::BTreeMap<String, f64> {
    timing_last_row_of(out, 0)
}

fn timing_last_row_of(out: &std::path::Path, rank: usize) -> std::collections::BTreeMap<String, f64> {
    let csv = std::fs::read_to_string(out.join(format!("timing/rank_{rank:05}.csv"))).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let last: Vec<f64> = lines.last().unwrap().split(',').map(|v| v.parse().unwrap()).collect();
    header.iter().map(|h| h.to_string()).zip(last).collect()
}

/// The model-state memory columns of a timing row equal the plan's to the byte.
fn assert_state_matches(name: &str, row: &std::collections::BTreeMap<String, f64>, p: &ndtrain::tools::plan::RankPlan) {
    for (col, want) in [
        ("param_bytes", p.state.params),
        ("grad_bytes", p.state.grads),
        ("optim_bytes", p.state.optim),
        ("gathered_peak_bytes", p.state.gathered_peak),
        ("grad_scratch_bytes", p.state.grad_scratch),
    ] {
        assert_eq!(row[col] as usize, want, "{name}: {col}");
    }
}

/// The predicted peak is within `PEAK_TOL` of the run's resident-set growth.
fn assert_peak_matches_rss(name: &str, row: &std::collections::BTreeMap<String, f64>, p: &ndtrain::tools::plan::RankPlan) {
    let grown = row["peak_rss_bytes"] - row["rss_start_bytes"];
    let predicted = p.peak_bytes() as f64;
    eprintln!("{name}: predicted peak {:.1} MiB, measured RSS growth {:.1} MiB", predicted / 1048576.0, grown / 1048576.0);
    assert!((predicted - grown).abs() <= PEAK_TOL * grown, "{name}: predicted {predicted} vs measured {grown}");
}

#[test]
fn the_plan_matches_the_measured_bytes_and_memory() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let layouts: &[(&str, usize, &[&str])] = &[
        ("one", 1, &[]),
        ("fsdp2", 2, &["parallel.dp_shard=2"]),
        ("fsdp2_tp2", 4, &["parallel.tp=2"]),
        ("hsdp_cp2", 4, &["parallel.dp_replicate=2", "parallel.cp=2"]),
        ("tp2_sp_full", 4, &["parallel.tp=2", "parallel.sequence_parallel=true", "train.activation_checkpointing=\"full\""]),
        ("dp2_keep", 2, &["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.reshard_after_forward=false"]),
        // The first pipeline stage holds 2 micro-batches' activations under 1F1B, all 4 under
        // GPipe.
        ("pp2_1f1b", 2, &["parallel.pp=2"]),
        ("pp2_gpipe", 2, &["parallel.pp=2", "parallel.pp_schedule=\"gpipe\""]),
        // Zero bubble: 1F1B's activations, and the weight-gradient operands it keeps.
        ("pp2_zero_bubble", 2, &["parallel.pp=2", "parallel.pp_schedule=\"zero_bubble\""]),
        // A mixture of experts (8 of width 384, top-2, a dense first block): the experts'
        // routed rows and their all-reduced loads.
        (
            "moe_fsdp2",
            2,
            &[
                "parallel.dp_shard=2",
                "model.n_experts=8",
                "model.experts_per_token=2",
                "model.moe_ffn_hidden=384",
                "model.first_dense_layers=1",
            ],
        ),
        (
            "moe_pp2_zero_bubble",
            2,
            &[
                "parallel.pp=2",
                "parallel.pp_schedule=\"zero_bubble\"",
                "model.n_experts=8",
                "model.experts_per_token=2",
                "model.moe_ffn_hidden=384",
            ],
        ),
        (
            "moe_tp2_sp_cp2",
            4,
            &[
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "parallel.cp=2",
                "parallel.dp_shard=1",
                "model.n_experts=8",
                "model.experts_per_token=2",
                "model.moe_ffn_hidden=384",
                "model.router_aux_loss_coef=0.01",
            ],
        ),
    ];
    for (name, ranks, layout) in layouts {
        let mut sets: Vec<&str> = MODEL.to_vec();
        sets.extend_from_slice(layout);
        train_losses(dir.path(), name, &tiny_deck(), Some(*ranks), &sets);
        let owned: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let deck = Deck::from_file(&tiny_deck(), &owned).unwrap();
        assert_bytes_match_formula(dir.path(), name, &deck, *ranks);

        let p = ndtrain::tools::plan::plan(&deck.resolve(*ranks).unwrap());
        let row = timing_last_row(&dir.path().join(name));
        assert_state_matches(name, &row, &p);
        assert_eq!(row["activation_bytes"] as usize, p.activations.activations(), "{name}: activation_bytes");
        // With a pipeline, rank 0 of every stage holds what its stage's plan says.
        let per_stage = *ranks / p.layout.pp;
        for st in p.stages.iter().skip(1) {
            let row = timing_last_row_of(&dir.path().join(name), st.stage * per_stage);
            for (col, want) in [("param_bytes", st.state.params), ("activation_bytes", st.activations.activations())] {
                assert_eq!(row[col] as usize, want, "{name}: stage {}: {col}", st.stage);
            }
        }
        assert_peak_matches_rss(name, &row, &p);
    }
}

/// `moe_tiny`'s experts (8, top-2) on ep 2, at the size of the plan tests above (experts of
/// 384): each rank holds 4 of the 8 experts of every block, sharded over nobody (ep =
/// dp_shard = 2). The model state is the plan's to the byte; the expert-side activations
/// follow the routing (the plan takes the even split), and with every expert chosen by every
/// token (`experts_per_token = 8`) they are the plan's to the byte too.
#[test]
fn the_plan_of_experts_on_ep_2_matches_the_measured_memory() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let deck_path = repo().join("inputs/moe_tiny.toml");
    for (name, extra) in [("top2", &[][..]), ("every_expert", &["model.experts_per_token=8"][..])] {
        let mut sets = MODEL.to_vec();
        sets.extend(["model.moe_ffn_hidden=384", "parallel.dp_shard=2", "parallel.ep=2"]);
        sets.extend_from_slice(extra);
        train_losses(dir.path(), name, &deck_path, Some(2), &sets);
        let owned: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let deck = Deck::from_file(&deck_path, &owned).unwrap();
        assert_bytes_match_formula(dir.path(), name, &deck, 2);
        let p = ndtrain::tools::plan::plan(&deck.resolve(2).unwrap());
        let row = timing_last_row(&dir.path().join(name));
        assert_state_matches(name, &row, &p);
        // Each rank stores half the experts' weights either way (4 experts whole, or every
        // expert's half under FSDP 2), but a block gathers only its own 4 experts.
        let fsdp = &owned[..owned.len() - extra.len() - 1];
        let whole = ndtrain::tools::plan::plan(&Deck::from_file(&deck_path, fsdp).unwrap().resolve(2).unwrap());
        assert_eq!(p.state.params, whole.state.params, "{name}");
        assert!(p.state.gathered_peak < whole.state.gathered_peak, "{name}: ep 2 gathers fewer expert weights than FSDP 2");
        let (got, want) = (row["activation_bytes"], p.activations.activations() as f64);
        if extra.is_empty() {
            assert!((got - want).abs() <= 0.25 * want, "{name}: activations {got} vs the even split's {want}");
        } else {
            assert_eq!(got, want, "{name}: activations");
        }
        assert_peak_matches_rss(name, &row, &p);
    }
}

/// `plan --all-layouts` on the Mixtral 8×7B deck over 64 ranks ranks layouts that split the
/// experts (an `ep` column, the all-to-all's seconds), and the detail of one shows the
/// all-to-all's bytes and a quarter of the experts per rank.
#[test]
fn the_mixtral_deck_plans_layouts_with_expert_parallelism() {
    let _serial = one_at_a_time();
    let deck = repo().join("inputs/mixtral_8x7b.toml");
    let o = mpi_env(&mut Command::new(bin()))
        .args(["plan", deck.to_str().unwrap(), "--ranks", "64", "--ranks-per-node", "8", "--all-layouts"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let rows: Vec<Vec<&str>> =
        out.lines().skip_while(|l| !l.trim_start().starts_with("rank")).skip(1).map(|l| l.split_whitespace().collect()).collect();
    let eps: std::collections::BTreeSet<&str> = rows.iter().filter(|r| r.len() > 19).map(|r| r[6]).collect();
    assert!(["1", "2", "4", "8"].iter().all(|e| eps.contains(e)), "every ep dividing the 8 experts is ranked: {eps:?}\n{out}");
    let with_ep = rows.iter().filter(|r| r.len() > 19 && r[6] != "1").count();
    assert!(with_ep > 10, "{out}");
    // Among the 10 best, some split the experts (an expert layout that fits is worth ranking).
    assert!(rows.iter().take(10).any(|r| r[6] != "1"), "{out}");

    let o = mpi_env(&mut Command::new(bin()))
        .args(["plan", deck.to_str().unwrap(), "--ranks", "64", "--set", "parallel.ep=4", "--set", "parallel.tp=2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in ["ep.all_to_all", "expert_fsdp.all_gather", "ep=4"] {
        assert!(out.contains(want), "plan shows {want}:\n{out}");
    }
    let d = Deck::from_file(&deck, &["parallel.ep=4".to_string(), "parallel.tp=2".to_string()]).unwrap();
    let p = ndtrain::tools::plan::plan(&d.resolve(64).unwrap());
    let plain = ndtrain::tools::plan::plan(&Deck::from_file(&deck, &["parallel.tp=2".to_string()]).unwrap().resolve(64).unwrap());
    assert!(p.comm["ep.all_to_all"] > 0 && !plain.comm.contains_key("ep.all_to_all"));
}

#[test]
fn a_llama3_8b_deck_on_512_ranks_plans_every_layout() {
    let _serial = one_at_a_time();
    let deck = repo().join("inputs/llama3_8b.toml");
    let o = mpi_env(&mut Command::new(bin()))
        .args(["plan", deck.to_str().unwrap(), "--ranks", "512", "--ranks-per-node", "8", "--all-layouts"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("valid layouts"), "{out}");
    let rows: Vec<&str> = out.lines().skip_while(|l| !l.trim_start().starts_with("rank")).skip(1).collect();
    assert!(rows.len() > 100, "a row per valid layout:\n{out}");
    // Ranked by tokens/s among those that fit (the memory column is a number and a unit; the
    // step time comes before tokens/s).
    let tokens: Vec<f64> = rows.iter().map(|r| r.split_whitespace().nth(19).unwrap().parse().unwrap()).collect();
    let fitting = rows.iter().take_while(|r| !r.contains("does not fit") && !r.contains("tp spans nodes")).count();
    assert!(fitting > 10 && tokens[..fitting].windows(2).all(|w| w[0] >= w[1]), "{out}");
    // The whole model on one rank does not fit in 80 GiB, and is marked so.
    assert!(out.lines().any(|l| l.contains("does not fit")), "{out}");

    // One layout in detail: per-rank memory with and without activation checkpointing.
    let o = mpi_env(&mut Command::new(bin()))
        .args(["plan", deck.to_str().unwrap(), "--ranks", "512", "--set", "parallel.dp_replicate=64", "--set", "parallel.dp_shard=8"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in ["parameters: 8030261248", "AdamW moments", "by activation_checkpointing: none", "fsdp.all_gather", "fits in"] {
        assert!(out.contains(want), "plan shows {want}:\n{out}");
    }
}

/// The Llama 3 405B deck plans the paper's two layouts on 16,384 GPUs: both fit in 80 GiB, the
/// first stage holds all 16 micro-batches under 1F1B, and the pipeline moves 1 GiB each way.
#[test]
fn the_llama3_405b_layouts_plan_and_fit() {
    let _serial = one_at_a_time();
    let deck = repo().join("inputs/llama3_405b.toml");
    let long: &[&str] = &["parallel.cp=16", "train.seq_len=131072", "model.max_seq_len=131072", "train.global_batch=128"];
    for sets in [&[][..], long] {
        let owned: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let d = Deck::from_file(&deck, &owned).unwrap();
        let res = d.resolve(16384).unwrap();
        assert_eq!((res.layout.pp, res.layout.tp, res.grad_accum), (16, 8, 16), "{sets:?}");
        let p = ndtrain::tools::plan::plan(&res);
        assert!((p.peak_bytes() as f64) < d.hardware.memory_per_rank, "{sets:?}: {} bytes", p.peak_bytes());
        assert_eq!(p.in_flight, vec![16]);
        // Under 1F1B the first stage holds the most: it is the largest peak of the 16 stages.
        assert_eq!(p.stages.len(), 16);
        assert_eq!(p.max_peak_bytes(), p.peak_bytes(), "{sets:?}");
        assert_eq!(p.stages.iter().map(|s| s.in_flight[0]).collect::<Vec<_>>(), (1..=16).rev().collect::<Vec<_>>());
        assert_eq!(p.comm["pp.send"], 16 * 8192 / 8 * 16384 * 4, "{sets:?}");
        assert!((p.bubble - 15.0 / 31.0).abs() < 1e-12);
    }
}

/// The step times docs/planning.md gives for the 405B layout on the deck's [hardware]: with
/// the overlap the code does and with every collective exposed, at the f32 peak the deck sets
/// and at the BF16 peak.
#[test]
fn the_llama3_405b_step_times_are_those_the_docs_give() {
    let deck = repo().join("inputs/llama3_405b.toml");
    let step = |sets: &[&str]| {
        let owned: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let d = Deck::from_file(&deck, &owned).unwrap();
        let p = ndtrain::tools::plan::plan(&d.resolve(16384).unwrap());
        ndtrain::tools::plan::cost(&p, &d, &d.hardware, d.hardware.peak_flops_per_rank).step_s
    };
    let bf16 = "hardware.peak_flops_per_rank=9.89e14";
    for (sets, docs) in [
        (&[][..], 25.8),
        (&["parallel.overlap=false"][..], 36.3),
        (&[bf16, "parallel.overlap=false"][..], 31.0),
        (&[bf16][..], 25.8),
        (&[bf16, "parallel.reshard_after_forward=false"][..], 18.6),
    ] {
        let s = step(sets);
        assert!((s - docs).abs() < 0.05, "{sets:?}: {s:.3} s per step, docs/planning.md says {docs}");
    }
    assert!(step(&[]) < step(&["parallel.overlap=false"]));
}

/// `plan --placement cyclic` deals the ranks to the nodes in turn: tp 2 on nodes of 2 then
/// spans them (the warning, and the ranking's note), where the block placement keeps it in.
#[test]
fn a_cyclic_placement_puts_tp_across_nodes() {
    let deck = tiny_deck();
    let plan = |placement: &str, all: bool| {
        let mut args = vec!["plan", deck.to_str().unwrap(), "--ranks", "4", "--ranks-per-node", "2", "--placement", placement];
        args.extend(["--set", "parallel.tp=2"]);
        if all {
            args.push("--all-layouts");
        }
        let o = run_single(&args);
        assert!(o.status.success(), "{}", text(&o));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    assert!(plan("cyclic", false).contains("warning: 2 of 2 tp group(s) span nodes"), "{}", plan("cyclic", false));
    assert!(!plan("block", false).contains("tp group(s) span nodes"), "{}", plan("block", false));
    let ranking = plan("cyclic", true);
    assert!(ranking.contains("placed cyclically") && ranking.contains("tp spans nodes"), "{ranking}");
}

/// `probe --deck` then `plan` on the tiny deck (2 ranks, FSDP, bigger micro-batches so a step
/// is mostly compute), against the same layout trained: the predicted step time within a factor
/// of 2 of the measured median (a planner that ignored the calibration, or timed the model at
/// the FMA peak, misses by far more on this model of small GEMMs).
///
/// The probe and the run measure the same machine a minute apart; another process that starts
/// or stops between them (a shared CI host) moves one and not the other. So the pair is measured
/// again, up to three times, and one pair within the factor passes: a planner that is wrong
/// misses on every pair, a burst of load on one.
#[test]
fn probe_then_plan_predicts_a_measured_step_within_a_factor_of_two() {
    let _serial = one_at_a_time();
    let mut misses = Vec::new();
    for attempt in 1..=3 {
        let (predicted, measured, plan) = probe_plan_and_train();
        let ratio = predicted / measured;
        if (0.5..2.0).contains(&ratio) {
            return;
        }
        misses.push(format!("pair {attempt}: predicted {predicted} s, measured {measured} s (ratio {ratio:.2})\n{plan}"));
    }
    panic!("no pair of probe and run within a factor of 2:\n{}", misses.join("\n"));
}

/// One `probe --deck`, the `plan` it calibrates and the run of that layout: the predicted step
/// time, the measured median step time and the plan's text.
fn probe_plan_and_train() -> (f64, f64, String) {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["train.micro_batch=4", "train.global_batch=16", "train.seq_len=128", "run.steps=6", "optim.warmup_steps=1"];
    let set_args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s]).collect();
    let deck = tiny_deck();
    let mut args = vec!["probe", "--deck", deck.to_str().unwrap()];
    args.extend(&set_args);
    let o = run_mpi(2, &args);
    assert!(o.status.success(), "{}", text(&o));
    let probe = String::from_utf8_lossy(&o.stdout).to_string();
    let hardware = &probe[probe.find("[hardware]").expect("a [hardware] table")..];
    for key in [
        "cores_per_node",
        "gemm_half_rate_rows",
        "gemm_half_rate_cols",
        "block_other_s_per_token",
        "attention_s_per_token",
        "block_s_per_token",
        "optimizer_bandwidth",
        "intra_node_reduce_bandwidth",
        "intra_node_latency",
        "tp_extra_s_per_token",
        "cp_extra_s_per_token",
        "overlap_efficiency",
    ] {
        assert!(hardware.contains(key), "{key} missing:\n{probe}");
    }
    let calibrated = dir.path().join("calibrated.toml");
    std::fs::write(&calibrated, std::fs::read_to_string(&deck).unwrap() + "\n" + hardware).unwrap();
    let mut args = vec!["plan", calibrated.to_str().unwrap(), "--ranks", "2"];
    args.extend(&set_args);
    let o = run_single(&args);
    assert!(o.status.success(), "{}", text(&o));
    let plan = String::from_utf8_lossy(&o.stdout).to_string();
    let predicted: f64 = plan
        .lines()
        .find_map(|l| l.strip_prefix("predicted step time: "))
        .and_then(|v| v.trim_end_matches(" s").parse().ok())
        .unwrap_or_else(|| panic!("no predicted step time:\n{plan}"));
    let out = dir.path().join("run");
    let set_out = format!("run.out_dir=\"{}\"", out.display());
    let mut args = vec!["train", calibrated.to_str().unwrap(), "--set", &set_out];
    args.extend(&set_args);
    let o = run_mpi(2, &args);
    assert!(o.status.success(), "{}", text(&o));
    let mut steps = column(&out, "step_s")[1..].to_vec();
    steps.sort_by(f64::total_cmp);
    (predicted, steps[steps.len() / 2], plan)
}

/// Without FSDP a replicated rank all-reduces one unit's gradient per call: the plan prices
/// the dp_rep all-reduce as the ring's bytes over the bandwidth plus a latency per unit (a
/// plan that took one call per byte priced this layout at minutes per step). With overlap it
/// runs under the last backward: what `overlap_efficiency` lets move while computing, up to
/// that backward, is hidden, and one unit's share stays exposed at least.
#[test]
fn replicated_data_parallelism_is_priced_per_unit_and_hidden_under_the_backward() {
    let deck = repo().join("inputs/bench_small.toml");
    let base = ["parallel.dp_replicate=2", "parallel.dp_shard=1", "train.micro_batch=1", "train.global_batch=4"];
    let hw = ndtrain::config::HardwareCfg { intra_node_bandwidth: 1e8, intra_node_latency: 1e-6, ranks_per_node: 2, ..Default::default() };
    let cost = |overlap: &str, efficiency: f64| {
        let sets: Vec<String> = base.iter().chain(&[overlap]).map(|s| s.to_string()).collect();
        let d = Deck::from_file(&deck, &sets).unwrap();
        let p = ndtrain::tools::plan::plan(&d.resolve(2).unwrap());
        let c = ndtrain::tools::plan::cost(&p, &d, &ndtrain::config::HardwareCfg { overlap_efficiency: efficiency, ..hw.clone() }, 1e11);
        (p, d, c)
    };
    let (p, d, blocking) = cost("parallel.overlap=false", 1.0);
    // A ring all-reduce over 2 ranks moves 2·(n−1)/n = 1 time the bytes.
    let ring = p.comm["dp_rep.all_reduce"] as f64 / 1e8;
    let units = (d.model.n_layers + 1) as f64;
    let dp = blocking.comm_s["dp_rep"];
    assert!(dp >= ring && dp <= ring + 2.0 * units * 1e-6 + 1e-9, "dp_rep {dp} s for {ring} s of bytes");
    assert_eq!(blocking.comm_whole_s["dp_rep"], dp);
    // The last backward: two thirds of a micro-batch's compute at the peak.
    let backward = p.flops_per_rank / 1e11 / p.grad_accum as f64 * 2.0 / 3.0;
    for efficiency in [1.0, 0.5, 0.0] {
        let (_, _, c) = cost("parallel.overlap=true", efficiency);
        let expected = (dp - (efficiency * dp).min(backward)).max(dp / units);
        assert!(
            (c.comm_s["dp_rep"] - expected).abs() < 1e-9 * dp,
            "efficiency {efficiency}: {} s, expected {expected} s",
            c.comm_s["dp_rep"]
        );
        assert_eq!(c.comm_whole_s["dp_rep"], dp);
    }
}
