//! Bad decks and bad data through the real binary: every rank exits non-zero with a one-line
//! `error:` message, no panic, no backtrace, no hang — alone and under `mpirun`.

mod common;
use common::*;
use std::process::Command;

/// Generous bound for a run that should fail at start-up; a hang would hit it.
const FAIL_FAST_SECS: u64 = 60;

/// Each entry: a name, the `--set` overrides that break the tiny deck, and a substring the
/// error must contain.
const BAD_DECKS: &[(&str, &[&str], &str)] = &[
    ("unknown key", &["model.n_head=4"], "n_heads"),
    ("unknown table", &["modle.d_model=64"], "[model]"),
    ("wrong type", &["model.d_model=\"big\""], "[model] d_model"),
    ("bad enum", &["optim.schedule=\"exp\""], "cosine"),
    ("d_model % n_heads", &["model.d_model=60"], "n_heads"),
    ("n_heads % n_kv_heads", &["model.n_kv_heads=3"], "n_kv_heads"),
    ("seq_len > max_seq_len", &["train.seq_len=512"], "max_seq_len"),
    ("world size", &["parallel.dp_shard=2"], "but the job has 1 rank"),
    ("global batch", &["train.global_batch=15"], "global_batch(15)"),
    ("negative lr", &["optim.lr=-1.0"], "[optim] lr"),
    ("min_lr above lr", &["optim.min_lr=1.0"], "min_lr"),
    ("beta out of range", &["optim.beta2=1.0"], "beta2"),
    ("zero steps", &["run.steps=0"], "steps"),
    ("missing data path", &["data.source=\"bin\""], "path"),
    ("tp does not divide heads", &["parallel.tp=3", "parallel.dp_shard=1"], "tp"),
];

fn assert_clean_failure(name: &str, o: &std::process::Output, timed_out: bool, want: &str) {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!timed_out, "{name}: hung\n{}", text(o));
    assert!(!o.status.success(), "{name}: exited 0\n{}", text(o));
    assert!(stderr.contains("error:"), "{name}: no `error:` line\n{}", text(o));
    assert!(stderr.contains(want), "{name}: message lacks {want:?}\n{}", text(o));
    assert!(!stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"), "{name}: panic or backtrace\n{}", text(o));
    let error_line = stderr.lines().find(|l| l.starts_with("error:")).unwrap();
    assert!(error_line.len() > 20, "{name}: error line too terse: {error_line}");
}

#[test]
fn bad_decks_fail_with_one_clear_line() {
    let deck = tiny_deck();
    for (name, sets, want) in BAD_DECKS {
        let mut cmd = Command::new(bin());
        mpi_env(&mut cmd).arg("train").arg(&deck);
        for s in *sets {
            cmd.args(["--set", s]);
        }
        let (o, timed_out) = output_within(&mut cmd, FAIL_FAST_SECS);
        assert_clean_failure(name, &o, timed_out, want);
        assert_eq!(o.status.code(), Some(2), "{name}: bad input exits with code 2\n{}", text(&o));
    }
}

#[test]
fn bad_deck_fails_on_every_rank_under_mpirun() {
    let deck = tiny_deck();
    let mut cmd = Command::new("mpirun");
    mpi_env(&mut cmd).args(["--oversubscribe", "-n", "2", bin(), "train"]).arg(&deck).args(["--set", "model.n_kv_heads=3"]);
    let (o, timed_out) = output_within(&mut cmd, FAIL_FAST_SECS);
    assert_clean_failure("mpirun bad deck", &o, timed_out, "n_kv_heads");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(stderr.matches("error:").count(), 2, "both ranks report\n{}", text(&o));
}

/// A failure after start-up (a data file that does not exist) is one rank's news as far as
/// the program knows: it aborts the whole job instead of leaving the others waiting.
#[test]
fn runtime_error_aborts_every_rank() {
    let deck = tiny_deck();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.bin");
    let mut cmd = Command::new("mpirun");
    mpi_env(&mut cmd)
        .args(["--oversubscribe", "-n", "2", bin(), "train"])
        .arg(&deck)
        .args(["--set", "parallel.dp_replicate=2", "--set", "parallel.dp_shard=1"])
        .args(["--set", "data.source=\"bin\"", "--set", &format!("data.path=\"{}\"", missing.display())])
        .args(["--set", &format!("run.out_dir=\"{}\"", dir.path().join("out").display())]);
    let (o, timed_out) = output_within(&mut cmd, FAIL_FAST_SECS);
    assert_clean_failure("missing data file", &o, timed_out, "missing.bin");
}

/// Mesh errors are found on every rank before any communication: each rank prints the
/// degrees and the world size, every rank exits non-zero, nothing hangs.
#[test]
fn mesh_errors_fail_on_every_rank() {
    let cases: &[(&str, usize, &[&str], &str)] = &[
        ("product is not the world", 4, &["parallel.dp_replicate=2", "parallel.dp_shard=4"], "but the job has 4 ranks"),
        ("dp_shard = -1 cannot fill", 3, &["parallel.dp_replicate=2"], "dp_shard"),
        ("degree does not divide the batch", 3, &["parallel.dp_shard=3"], "global_batch"),
        ("seq_len not divisible by 2·cp", 2, &["parallel.cp=2", "train.seq_len=66"], "seq_len"),
        ("tp does not divide the kv heads", 2, &["parallel.tp=2", "model.n_kv_heads=1"], "n_kv_heads"),
        ("tp does not divide the heads", 4, &["parallel.tp=4", "model.n_heads=6", "model.n_kv_heads=2", "model.d_model=48"], "n_heads"),
    ];
    for (name, ranks, sets, want) in cases {
        let mut cmd = Command::new("mpirun");
        mpi_env(&mut cmd).args(["--oversubscribe", "-n", &ranks.to_string(), bin(), "train"]).arg(tiny_deck());
        for s in *sets {
            cmd.args(["--set", s]);
        }
        let (o, timed_out) = output_within(&mut cmd, FAIL_FAST_SECS);
        assert_clean_failure(name, &o, timed_out, want);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(stderr.matches("error:").count(), *ranks, "{name}: every rank reports\n{}", text(&o));
    }
}
