//! The per-rank timing logs of a 4-rank FSDP=2×TP=2 run: one file per rank with the documented
//! columns (`docs/timing_logs.md`), phases that add up to each step's wall time, and the
//! collectives of every group that communicates; the end-of-run table on the console and the
//! MFU of `metrics.csv`.

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
        "device_bytes",
        "device_peak_bytes",
        "snapshot_bytes",
    ] {
        cols.push(c.into());
    }
    cols
}

#[test]
fn every_rank_logs_every_phase_and_group_and_the_phases_add_up() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let set_out = format!("run.out_dir=\"{}\"", out.display());
    let deck = tiny_deck();
    let mut args = vec!["train", deck.to_str().unwrap(), "--set", &set_out];
    for s in
        ["run.steps=6", "optim.warmup_steps=2", "run.threads=1", "parallel.tp=2", "checkpoint.every=3", "hardware.peak_flops_per_rank=2e9"]
    {
        args.extend(["--set", s]);
    }
    let o = run_mpi(4, &args);
    assert!(o.status.success(), "{}", text(&o));
    check_console_summary(&String::from_utf8_lossy(&o.stdout));
    check_mfu(&out, 2e9, 4);
    let timing = dir.path().join("run/timing");
    let mut files: Vec<String> = std::fs::read_dir(&timing).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(files, ["rank_00000.csv", "rank_00001.csv", "rank_00002.csv", "rank_00003.csv"]);
    let want = schema();
    assert_eq!(want.iter().filter(|c| c.ends_with("_s") && PHASES.iter().any(|p| **c == format!("{p}_s"))).count(), 8);
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
            // Checkpoints after steps 3 and 6; the boundaries after step 3 may move its write on
            // (an asynchronous write), the ones before any checkpoint cost nothing.
            let ckpt = r[col("checkpoint_s")];
            match i + 1 {
                3 | 6 => assert!(ckpt > 0.0, "{f} step {}: checkpoint_s {ckpt}", i + 1),
                1 | 2 => assert_eq!(ckpt, 0.0, "{f} step {}", i + 1),
                _ => assert!(ckpt >= 0.0, "{f} step {}: checkpoint_s {ckpt}", i + 1),
            }
        }
    }
}

/// The end-of-run table (LAMMPS style): one row per phase and `other`, each with min ≤ avg ≤
/// max across ranks, its share of the total and the load imbalance `(max − avg) / avg`; the
/// shares add up to the whole run.
fn check_console_summary(stdout: &str) {
    let lines: Vec<&str> = stdout.lines().collect();
    let head =
        lines.iter().position(|l| l.starts_with("phase") && l.contains("%imbal")).unwrap_or_else(|| panic!("no summary table:\n{stdout}"));
    let mut share = 0.0;
    for (i, name) in PHASES.iter().chain(&["other"]).enumerate() {
        let cols: Vec<&str> = lines[head + 1 + i].split_whitespace().collect();
        assert_eq!(cols.len(), 6, "{name}: {cols:?}");
        assert_eq!(cols[0], *name, "the rows follow the phases");
        let v: Vec<f64> = cols[1..].iter().map(|x| x.parse().unwrap()).collect();
        let (lo, avg, hi, total, imbal) = (v[0], v[1], v[2], v[3], v[4]);
        assert!(lo <= avg + 1e-3 && avg <= hi + 1e-3, "{name}: min {lo} avg {avg} max {hi}");
        assert!((0.0..=100.0).contains(&total), "{name}: {total} % of the total");
        if avg >= 0.05 {
            // Printed with 3 decimals: recompute the imbalance within their rounding.
            let want = 100.0 * (hi - avg) / avg;
            assert!((imbal - want).abs() <= 0.1 + 100.0 * 0.001 / avg, "{name}: imbalance {imbal} vs {want}");
        }
        share += total;
    }
    assert!((95.0..=105.0).contains(&share), "the shares add up to {share} %");
    assert!(lines[head + 1 + PHASES.len() + 1].starts_with("total "), "{}", lines[head + 1 + PHASES.len() + 1]);
}

/// `metrics.csv`'s MFU is tokens/s × FLOPs per token over the stated peak of all ranks, with
/// the `6·N_matmul + 12·L·D·S` of docs/planning.md counted here by hand for the tiny deck.
fn check_mfu(out: &std::path::Path, peak: f64, ranks: usize) {
    let (d, l, s, f, v, hd) = (64.0, 2.0, 64.0, 192.0, 128.0, 8.0);
    let (q, kv) = (8.0 * hd, 4.0 * hd);
    let n_matmul = l * (q * d + 2.0 * kv * d + d * q + 3.0 * f * d) + v * d;
    let flops_per_token = 6.0 * n_matmul + 12.0 * l * d * s;
    let csv = std::fs::read_to_string(out.join("metrics.csv")).unwrap();
    let mut rows = csv.lines();
    let header: Vec<&str> = rows.next().unwrap().split(',').collect();
    let col = |n: &str| header.iter().position(|h| *h == n).unwrap();
    for r in rows {
        // `val_loss` is empty on steps without an evaluation.
        let x: Vec<f64> = r.split(',').map(|v| if v.is_empty() { f64::NAN } else { v.parse().unwrap() }).collect();
        let want = x[col("tokens_per_s")] * flops_per_token / (peak * ranks as f64);
        assert!((x[col("mfu")] - want).abs() <= 1e-5 * want.max(1e-12) + 1e-12, "mfu {} vs {want}", x[col("mfu")]);
        assert!(x[col("mfu")] > 0.0);
        assert!((x[col("tokens_per_s_per_rank")] * ranks as f64 - x[col("tokens_per_s")]).abs() <= 1e-5 * x[col("tokens_per_s")]);
    }
}
