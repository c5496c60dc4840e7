//! End-to-end runs of the binary on the tiny deck: it learns, it runs with and without a
//! launcher, activation checkpointing changes nothing, plain data parallelism matches one rank.

mod common;
use common::*;

/// After the tiny deck's 150 steps the loss sits ~0.09 nats above the synthetic source's
/// entropy floor (1.2425; it starts at ln 128 ≈ 4.85). 0.2 leaves room for summation-order
/// noise yet fails if learning is broken or slowed down materially.
const FLOOR_MARGIN: f64 = 0.2;

fn floor_from_stdout(s: &str) -> f64 {
    let line = s.lines().find(|l| l.contains("entropy floor")).expect("floor printed");
    let after = line.split("entropy floor").nth(1).unwrap();
    after.split_whitespace().next().unwrap().parse().expect("floor value")
}

#[test]
fn tiny_deck_learns_to_near_its_entropy_floor() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = run_single(&["train", tiny_deck().to_str().unwrap(), "--set", &format!("run.out_dir=\"{}\"", out.display())]);
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let floor = floor_from_stdout(&stdout);
    let (_, l) = losses(&out);
    assert_eq!(l.len(), 150);
    assert!(l[0] > 4.0, "first loss {} should be near ln(128)", l[0]);
    let last = *l.last().unwrap();
    assert!(last - floor < FLOOR_MARGIN, "final loss {last} is not within {FLOOR_MARGIN} of the floor {floor}");
    assert!(last > floor - 0.05, "final loss {last} below the entropy floor {floor}: the floor or the loss is wrong");
    // The run's folder: resolved deck, metrics, one timing file.
    assert!(out.join("deck.toml").exists());
    assert!(out.join("timing/rank_00000.csv").exists());
}

#[test]
fn mpirun_one_rank_equals_singleton_and_checkpointing_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let deck = tiny_deck();
    let base = ["run.steps=12", "run.threads=1"];
    let (single, _) = train_losses(dir.path(), "single", &deck, None, &base);
    let (launched, _) = train_losses(dir.path(), "mpirun1", &deck, Some(1), &base);
    assert_eq!(single, launched, "mpirun -n 1 must reproduce the singleton run bitwise");
    for mode in ["full", "selective"] {
        let set = format!("train.activation_checkpointing=\"{mode}\"");
        let (ckpt, _) = train_losses(dir.path(), mode, &deck, None, &[base[0], base[1], &set]);
        assert_eq!(single, ckpt, "activation checkpointing ({mode}) must not change a single bit of the loss");
    }
}

#[test]
fn data_parallel_two_ranks_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let deck = tiny_deck();
    let (_, one) = train_losses(dir.path(), "one", &deck, Some(1), &["run.steps=10", "run.threads=1"]);
    let (_, two) = train_losses(
        dir.path(),
        "dp2",
        &deck,
        Some(2),
        &["run.steps=10", "run.threads=1", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
    );
    // The shared equivalence tolerance (`LOSS_TOL`, see tests/common): DP=2 only reorders the
    // f32 sum of the same per-sample gradients.
    let worst = assert_losses_within("DP=2 vs one rank", &one, &two, LOSS_TOL);
    eprintln!("DP=2 vs one rank: worst |Δloss| {worst:.3e} over {} steps", one.len());
}

/// `[checkpoint] init_from` starts the binary from a Hugging Face folder (the numerics of the
/// import are checked against PyTorch in `tests/reference.rs`; this checks the deck path end to
/// end), and a deck whose `[model]` disagrees with `config.json` is refused.
#[test]
fn init_from_hugging_face_folder_trains() {
    let dir = tempfile::tempdir().unwrap();
    let hf = repo().join("tests/reference/data/untied");
    let init = format!("checkpoint.init_from=\"{}\"", hf.display());
    let sets = [
        init.as_str(),
        "model.vocab_size=100",
        "model.d_model=64",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.ffn_hidden=160",
        "model.max_seq_len=64",
        "run.steps=3",
        "optim.warmup_steps=0",
    ];
    let (_, l) = train_losses(dir.path(), "hf", &tiny_deck(), None, &sets);
    assert_eq!(l.len(), 3);
    assert!(l.iter().all(|x| x.is_finite()));
    // Each of four ranks (FSDP=2×TP=2) reads only its slices of the file: the same model.
    let mut sharded = sets.to_vec();
    sharded.push("parallel.tp=2");
    let (_, l4) = train_losses(dir.path(), "hf_fsdp2_tp2", &tiny_deck(), Some(4), &sharded);
    assert_losses_within("init_from: FSDP=2×TP=2 vs one rank", &l, &l4, LOSS_TOL);
    // A mismatched deck is refused, naming the Hugging Face key.
    let o = run_single(&["train", tiny_deck().to_str().unwrap(), "--set", &init]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("vocab_size"), "{}", text(&o));
}
