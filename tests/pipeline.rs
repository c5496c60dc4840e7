//! Pipeline parallelism against one rank, through the real binary under `mpirun`: every
//! schedule (zero bubble included) on 2 and 4 stages, the interleaved schedule, the pipeline
//! composed with FSDP, TP with SP, CP and HSDP (8 ranks included), tied embeddings, checkpoints
//! written on one pipeline layout and resumed on others, and the non-finite policy and
//! preemption under a pipeline.

mod common;

use common::*;
use ndtrain::io::checkpoint::tools;
use std::path::Path;

/// The tiny deck with 4 blocks (so 4 stages fit), 6 steps of 16 sequences in micro-batches of
/// 2 (8 micro-steps on one rank), clipping active, a checkpoint at steps 3 and 6.
const SETS: &[&str] = &[
    "model.n_layers=4",
    "run.steps=6",
    "run.threads=1",
    "train.global_batch=16",
    "optim.grad_clip=0.3",
    "optim.warmup_steps=2",
    "checkpoint.every=3",
];

fn train(dir: &Path, name: &str, ranks: usize, extra: &[&str]) -> (Vec<String>, Vec<f64>) {
    let mut sets: Vec<&str> = SETS.to_vec();
    sets.extend_from_slice(extra);
    let ranks = (ranks > 1).then_some(ranks);
    train_losses(dir, name, &tiny_deck(), ranks, &sets)
}

fn assert_bitwise(name: &str, a: &Path, b: &Path) {
    for n in tools::dataset_paths(a).unwrap() {
        let (_, xa) = tools::read_tensor(a, &n).unwrap();
        let (_, xb) = tools::read_tensor(b, &n).unwrap();
        assert!(xa.iter().zip(&xb).all(|(x, y)| x.to_bits() == y.to_bits()), "{name}: {n} differs");
    }
}

/// Acceptance 1: every schedule and every composition reproduces the one-rank run (losses
/// within `LOSS_TOL`, the final checkpoint within `PARAM_TOL`), and rank 0 moves the bytes
/// `ndtrain plan` predicts, the pipeline's sends and receives included. A pipeline alone computes each
/// micro-batch with the one-rank code in the one-rank order, so its losses are identical.
#[test]
fn every_schedule_and_composition_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (base_s, base) = train(d, "one", 1, &[]);
    let layouts: &[(&str, usize, &[&str], bool)] = &[
        ("pp2_1f1b", 2, &["parallel.pp=2"], true),
        ("pp2_gpipe", 2, &["parallel.pp=2", "parallel.pp_schedule=\"gpipe\""], true),
        ("pp4_1f1b", 4, &["parallel.pp=4"], true),
        ("pp4_gpipe", 4, &["parallel.pp=4", "parallel.pp_schedule=\"gpipe\""], true),
        ("pp2_zero_bubble", 2, &["parallel.pp=2", "parallel.pp_schedule=\"zero_bubble\""], true),
        ("pp4_zero_bubble", 4, &["parallel.pp=4", "parallel.pp_schedule=\"zero_bubble\""], true),
        ("pp2_interleaved", 2, &["parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule=\"interleaved\""], true),
        ("pp2_uneven", 2, &["parallel.pp=2", "parallel.pp_layers=[3, 1]", "train.activation_checkpointing=\"full\""], true),
        ("pp2_fsdp2", 4, &["parallel.pp=2", "parallel.dp_shard=2"], false),
        ("pp2_tp2_sp", 4, &["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"], false),
        ("pp2_cp2", 4, &["parallel.pp=2", "parallel.cp=2"], false),
        ("pp2_fsdp2_zero_bubble", 4, &["parallel.pp=2", "parallel.dp_shard=2", "parallel.pp_schedule=\"zero_bubble\""], false),
        (
            "pp2_tp2_sp_zero_bubble_full",
            4,
            &[
                "parallel.pp=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "parallel.pp_schedule=\"zero_bubble\"",
                "train.activation_checkpointing=\"full\"",
            ],
            false,
        ),
        ("pp2_hsdp2x2", 8, &["parallel.pp=2", "parallel.dp_replicate=2", "parallel.dp_shard=2"], false),
        ("pp2_fsdp2_tp2", 8, &["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2"], false),
        ("pp2_cp2_tp2", 8, &["parallel.pp=2", "parallel.cp=2", "parallel.tp=2"], false),
    ];
    for (name, ranks, layout, bitwise) in layouts {
        let (s, l) = train(d, name, *ranks, layout);
        if *bitwise {
            assert_eq!(s, base_s, "{name}: a pipeline alone gives the one-rank losses bit for bit");
        }
        assert_losses_within(name, &base, &l, LOSS_TOL);
        assert_close(name, &ckpt(d, "one", 6), &ckpt(d, name, 6));
        let owned: Vec<String> = SETS.iter().chain(layout.iter()).map(|s| s.to_string()).collect();
        let deck = ndtrain::config::Deck::from_file(&tiny_deck(), &owned).unwrap();
        assert_bytes_match_formula(d, name, &deck, *ranks);
        let norms = column(&d.join(name), "grad_norm");
        assert!(norms.iter().all(|&n| n > 0.3), "{name}: clipping active in every step: {norms:?}");
    }
}

/// Acceptance 1 (tied embeddings): both ends of the pipeline hold `embed_tokens`, their
/// gradients are summed, and the run matches one rank's (within tolerance: the two halves of
/// the tied gradient are summed in another order).
#[test]
fn tied_embeddings_across_the_pipeline_match_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tied = "model.tie_embeddings=true";
    let (_, base) = train(d, "one", 1, &[tied]);
    for (name, ranks, layout) in [("pp2", 2, &["parallel.pp=2"][..]), ("pp2_tp2", 4, &["parallel.pp=2", "parallel.tp=2"][..])] {
        let mut extra = layout.to_vec();
        extra.push(tied);
        let (_, l) = train(d, name, ranks, &extra);
        assert_losses_within(name, &base, &l, LOSS_TOL);
        assert_close(name, &ckpt(d, "one", 6), &ckpt(d, name, 6));
        let owned: Vec<String> = SETS.iter().chain(extra.iter()).map(|s| s.to_string()).collect();
        assert_bytes_match_formula(d, name, &ndtrain::config::Deck::from_file(&tiny_deck(), &owned).unwrap(), ranks);
    }
}

/// Acceptance 2: a checkpoint written under pp 2 × tp 2 resumes bitwise on the same layout,
/// within tolerance on one rank and on pp 4; a one-rank checkpoint resumes under pp 2.
#[test]
fn pipeline_checkpoints_resume_on_any_layout() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let writer: &[&str] = &["parallel.pp=2", "parallel.tp=2"];
    let (ws, _) = train(d, "writer", 4, writer);
    let (_, one) = train(d, "one", 1, &[]);
    let from = |name: &str| format!("checkpoint.resume=\"{}\"", ckpt(d, name, 3).display());
    let r = from("writer");
    let mut same = writer.to_vec();
    same.push(&r);
    let (s, _) = train(d, "same", 4, &same);
    assert_eq!(s, ws[3..], "pp2×tp2 resumed on pp2×tp2: losses of steps 4..6 bit for bit");
    assert_bitwise("same", &ckpt(d, "writer", 6), &ckpt(d, "same", 6));
    for (name, ranks, layout) in [("on_one", 1, &[][..]), ("on_pp4", 4, &["parallel.pp=4"][..])] {
        let mut extra = layout.to_vec();
        extra.push(&r);
        let (_, l) = train(d, name, ranks, &extra);
        assert_losses_within(name, &one[3..], &l, LOSS_TOL);
        assert_close(name, &ckpt(d, "one", 6), &ckpt(d, name, 6));
    }
    let r1 = from("one");
    let (_, l) = train(d, "one_on_pp2", 2, &["parallel.pp=2", &r1]);
    assert_losses_within("one_on_pp2", &one[3..], &l, LOSS_TOL);
    assert_bitwise("one_on_pp2", &ckpt(d, "one", 6), &ckpt(d, "one_on_pp2", 6));
}

/// Acceptance 1 (interleaved on 4 stages): 8 blocks as 8 virtual stages, 2 chunks per rank.
#[test]
fn interleaved_on_four_ranks_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (base_s, _) = train(d, "one", 1, &["model.n_layers=8"]);
    let layout = ["model.n_layers=8", "parallel.pp=4", "parallel.pp_virtual=2", "parallel.pp_schedule=\"interleaved\""];
    let (s, _) = train(d, "pp4_v2", 4, &layout);
    assert_eq!(s, base_s, "pp4 × 2 chunks: the one-rank losses bit for bit");
    assert_bitwise("pp4_v2", &ckpt(d, "one", 6), &ckpt(d, "pp4_v2", 6));
    let owned: Vec<String> = SETS.iter().chain(layout.iter()).map(|s| s.to_string()).collect();
    assert_bytes_match_formula(d, "pp4_v2", &ndtrain::config::Deck::from_file(&tiny_deck(), &owned).unwrap(), 4);
}

/// The run's policies under a pipeline (zero bubble, whose weight gradients come last): a NaN
/// injected into a gradient only the last stage holds is skipped by `on_nonfinite = "skip"`
/// (that step's norm is NaN, every other finite, the run goes on); SIGTERM to every rank mid-run
/// writes a checkpoint at a step boundary and exits 75, and `resume = "auto"` finishes it with
/// the losses of a run never stopped, bit for bit.
#[test]
fn nonfinite_policy_and_preemption_hold_under_a_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pipeline = ["parallel.pp=2", "parallel.pp_schedule=\"zero_bubble\""];
    let nan = ("NDTRAIN_DEBUG_NAN_GRAD", "step=2,rank=1,tensor=model.layers.3.mlp.up_proj.weight");
    let mut skip = pipeline.to_vec();
    skip.push("optim.on_nonfinite=\"skip\"");
    let out = d.join("skip");
    let o = launch(&out, &skip).env(nan.0, nan.1).output().unwrap();
    assert!(o.status.success() && text(&o).contains("update skipped"), "{}", text(&o));
    let norms = column(&out, "grad_norm");
    assert!(norms.len() == 6 && norms[1].is_nan() && norms.iter().enumerate().all(|(i, x)| i == 1 || x.is_finite()), "{norms:?}");

    let mut long = pipeline.to_vec();
    long.extend(["run.steps=60", "checkpoint.every=60"]);
    let (straight, _) = train(d, "straight", 2, &long);
    let out = d.join("stopped");
    // 100 ms per step: the signal lands mid-run however fast the steps are.
    let child = launch(&out, &long)
        .env(ndtrain::run::faults::STEP_DELAY_ENV, "100")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while steps_done(&out) < 3 {
        assert!(start.elapsed().as_secs() < 300, "the run never logged 3 steps in 300 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    term_ranks(child.id(), 2);
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(ndtrain::exit::PREEMPTED), "{}", text(&o));
    let stopped_at = losses(&out).0.len();
    assert!(stopped_at < 60 && text(&o).contains(&format!("checkpoint of step {stopped_at} written")), "{}", text(&o));
    let mut resume = long.to_vec();
    resume.push("checkpoint.resume=\"auto\"");
    let (resumed, _) = train(d, "stopped", 2, &resume);
    assert_eq!(resumed, straight, "losses of the stopped-and-resumed run");
    assert_bitwise("stopped", &ckpt(d, "straight", 60), &ckpt(d, "stopped", 60));
}

/// `mpirun -n 2 ndtrain train` of the tiny deck with `SETS` and `extra`, writing to `out`; not
/// started.
fn launch(out: &Path, extra: &[&str]) -> std::process::Command {
    let sets: Vec<&str> = SETS.iter().chain(extra).copied().collect();
    mpirun_tiny(2, out, &sets)
}
