//! The held-out loss of `[eval]` on real multi-rank runs: computed after the steps it names,
//! logged in `metrics.csv`, the same on every layout as on one rank, and bad held-out settings
//! refused before training.

mod common;
use common::*;
use std::path::Path;

/// Steps 6, an evaluation of 2 held-out global batches after steps 3 and 6.
const EVAL_SETS: &[&str] = &["run.steps=6", "run.threads=1", "eval.every=3", "eval.batches=2"];

/// `(step, val_loss as written)` of the rows that have one.
fn val_losses(out: &Path) -> Vec<(u64, String)> {
    let csv = std::fs::read_to_string(out.join("metrics.csv")).expect("metrics.csv exists");
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = header.iter().position(|h| *h == "val_loss").expect("a val_loss column");
    lines
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter(|f| !f[col].is_empty())
        .map(|f| (f[0].parse().expect("a step"), f[col].to_string()))
        .collect()
}

fn run(dir: &Path, name: &str, ranks: usize, layout: &[&str]) -> Vec<(u64, String)> {
    let sets: Vec<&str> = EVAL_SETS.iter().chain(layout).copied().collect();
    train_losses(dir, name, &tiny_deck(), Some(ranks), &sets);
    val_losses(&dir.join(name))
}

/// The held-out loss is a forward of the same samples normalised by the same global token
/// count: a layout reproduces one rank's value as it reproduces the training loss — bit for
/// bit where the arithmetic is the same (a pipeline only moves whole blocks to other ranks),
/// within the training loss's tolerance where tensor or context parallelism reorders sums.
#[test]
fn the_held_out_loss_matches_one_rank_on_every_layout() {
    let dir = tempfile::tempdir().unwrap();
    let base = run(dir.path(), "one", 1, &[]);
    assert_eq!(base.iter().map(|v| v.0).collect::<Vec<_>>(), vec![3, 6], "evaluated after steps 3 and 6 only");
    let (_, train) = losses(&dir.path().join("one"));
    let first: f64 = base[0].1.parse().unwrap();
    assert!(first.is_finite() && first > 0.5 && (first - train[2]).abs() > 1e-6, "a loss of other samples: {first} vs {}", train[2]);
    assert!(base[1].1.parse::<f64>().unwrap() < first, "the held-out loss falls as the model trains: {base:?}");

    let pp2 = run(dir.path(), "pp2", 2, &["parallel.pp=2"]);
    assert_eq!(pp2, base, "a pipeline computes the same numbers (17 digits)");
    for (name, ranks, layout) in [("fsdp2_tp2", 4, &["parallel.dp_shard=2", "parallel.tp=2"][..]), ("cp2", 2, &["parallel.cp=2"][..])] {
        let other = run(dir.path(), name, ranks, layout);
        let (a, b): (Vec<f64>, Vec<f64>) =
            base.iter().zip(&other).map(|(x, y)| (x.1.parse::<f64>().unwrap(), y.1.parse::<f64>().unwrap())).unzip();
        assert_eq!(other.iter().map(|v| v.0).collect::<Vec<_>>(), vec![3, 6], "{name}");
        assert_losses_within(name, &a, &b, LOSS_TOL);
    }
}

/// A tail that leaves nothing to train on is bad input: every rank exits 2 before training,
/// and the message names the key and the numbers once.
#[test]
fn a_held_out_tail_as_large_as_the_data_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let set_out = format!("run.out_dir=\"{}\"", out.display());
    let deck = tiny_deck();
    let args = ["train", deck.to_str().unwrap(), "--set", &set_out, "--set", "eval.every=2", "--set", "eval.tail_samples=281474976710656"];
    let o = run_mpi(2, &args);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert_eq!(t.matches("tail_samples(281474976710656) = 281474976710656 samples leaves no training samples").count(), 1, "{t}");
    assert!(!out.join("metrics.csv").exists(), "nothing trained: {t}");
}
