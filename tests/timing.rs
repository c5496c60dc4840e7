//! The per-rank timing logs of a 4-rank FSDP=2×TP=2 run: one file per rank with the documented
//! columns (`docs/timing_logs.md`), phases that add up to each step's wall time, and the
//! collectives of every group that communicates.

mod common;

use common::*;
use ndtrain::metrics::{COLLECTIVES, PHASES};

/// Every column of a timing log, in order (`docs/timing_logs.md`).
fn schema() -> Vec<String> {
    let mut cols = vec!["step".to_string(), "step_s".to_string()];
    cols.extend(PHASES.iter().map(|p| format!("{p}_s")));
    cols.push("log_s".into());
    for c in COLLECTIVES {
        cols.push(format!("{c}_s"));
        cols.push(format!("{c}_bytes"));
    }
    for c in [
        "param_bytes",
        "grad_bytes",
        "optim_bytes",
        "gathered_peak_bytes",
        "grad_scratch_bytes",
        "activation_bytes",
        "peak_rss_bytes",
        "rss_start_bytes",
        "attention_pairs",
    ] {
        cols.push(c.into());
    }
    cols
}

#[test]
fn every_rank_logs_every_phase_and_group_and_the_phases_add_up() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["run.steps=6", "optim.warmup_steps=2", "run.threads=1", "parallel.tp=2", "checkpoint.every=3"];
    train_losses(dir.path(), "run", &tiny_deck(), Some(4), &sets);
    let timing = dir.path().join("run/timing");
    let mut files: Vec<String> = std::fs::read_dir(&timing).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(files, ["rank_00000.csv", "rank_00001.csv", "rank_00002.csv", "rank_00003.csv"]);
    let want = schema();
    assert_eq!(want.iter().filter(|c| c.ends_with("_s") && PHASES.iter().any(|p| **c == format!("{p}_s"))).count(), 7);
    for f in &files {
        let csv = std::fs::read_to_string(timing.join(f)).unwrap();
        let mut lines = csv.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        assert_eq!(header, want, "{f}: the documented schema");
        let rows: Vec<Vec<f64>> = lines.map(|l| l.split(',').map(|v| v.parse().unwrap()).collect()).collect();
        assert_eq!(rows.len(), 6, "{f}: one row per step");
        let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(r[col("step")] as usize, i + 1);
            let step_s = r[col("step_s")];
            let phases: f64 = PHASES.iter().map(|p| r[col(&format!("{p}_s"))]).sum();
            assert!((phases - step_s).abs() <= 0.05 * step_s, "{f} step {}: phases {phases} vs step {step_s}", i + 1);
            // The groups of FSDP=2×TP=2 that communicate every step, with their time.
            for c in ["fsdp.all_gather", "fsdp.reduce_scatter", "tp.all_reduce", "batch.all_reduce"] {
                assert!(r[col(&format!("{c}_bytes"))] > 0.0 && r[col(&format!("{c}_s"))] > 0.0, "{f} step {}: {c}", i + 1);
            }
            for c in ["cp.ring", "dp_rep.all_reduce"] {
                assert_eq!(r[col(&format!("{c}_bytes"))], 0.0, "{f}: {c} has degree 1");
            }
            assert!(r[col("peak_rss_bytes")] > r[col("rss_start_bytes")] && r[col("activation_bytes")] > 0.0);
            // Checkpoints after steps 3 and 6 only.
            let ckpt = r[col("checkpoint_s")];
            assert_eq!(ckpt > 0.0, (i + 1) % 3 == 0, "{f} step {}: checkpoint_s {ckpt}", i + 1);
        }
    }
}
