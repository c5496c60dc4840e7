//! `ndtrain sweep` on the shipped local study: one deck and one job script per point, every
//! point run by `run_all.sh`, and `report.sh` producing the strong-scaling table and plot. The
//! other shipped studies expand (and so validate) for their batch systems without running.

mod common;

use common::*;
use std::process::Command;

#[test]
fn a_local_study_expands_runs_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("study");
    let study = repo().join("inputs/studies/tiny_strong.toml");
    let o =
        mpi_env(&mut Command::new(bin())).current_dir(repo()).args(["sweep", study.to_str().unwrap(), "--out"]).arg(&out).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    for n in [1, 2, 4] {
        let p = out.join(format!("ranks_{n}"));
        let deck = std::fs::read_to_string(p.join("deck.toml")).unwrap();
        assert!(deck.contains("steps = 8") && deck.contains(&format!("runs/ranks_{n}")), "{deck}");
        let job = std::fs::read_to_string(p.join("job.sh")).unwrap();
        assert!(job.contains(&format!("NRANKS={n} exec")) && job.contains("jobscripts/local/train.sh"), "{job}");
    }
    let run_all = mpi_env(&mut Command::new(out.join("run_all.sh"))).env("NDTRAIN", bin()).output().unwrap();
    assert!(run_all.status.success(), "{}", text(&run_all));
    let report = Command::new(out.join("report.sh")).env("NDTRAIN", bin()).output().unwrap();
    assert!(report.status.success(), "{}", text(&report));
    let summary = std::fs::read_to_string(out.join("report/summary.md")).unwrap();
    assert!(summary.contains("Scaling (strong)"), "{summary}");
    for n in [1, 2, 4] {
        assert!(summary.lines().any(|l| l.starts_with(&format!("| ranks_{n} | {n} |"))), "{summary}");
    }
    assert!(std::fs::metadata(out.join("report/scaling.png")).unwrap().len() > 10_000);
}

#[test]
fn every_shipped_study_expands_for_its_batch_system() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = 0;
    for e in std::fs::read_dir(repo().join("inputs/studies")).unwrap() {
        let study = e.unwrap().path();
        let out = dir.path().join(study.file_stem().unwrap());
        let o = Command::new(bin()).current_dir(repo()).arg("sweep").arg(&study).arg("--out").arg(&out).output().unwrap();
        assert!(o.status.success(), "{}: {}", study.display(), text(&o));
        let jobs = std::fs::read_to_string(out.join("run_all.sh")).unwrap();
        assert!(jobs.lines().filter(|l| l.ends_with("job.sh")).count() >= 3, "{}: {jobs}", study.display());
        // Every script the sweep wrote (Slurm, PBS or local job scripts, run_all, report) parses.
        let mut scripts = vec![out.join("run_all.sh")];
        for p in std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()) {
            scripts.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()).filter(|f| f.extension().is_some_and(|x| x == "sh")));
        }
        assert!(scripts.len() >= 4, "{}: {scripts:?}", study.display());
        for sh in &scripts {
            let o = Command::new("bash").arg("-n").arg(sh).output().unwrap();
            assert!(o.status.success(), "bash -n {}: {}", sh.display(), text(&o));
        }
        n += 1;
    }
    assert!(n >= 6, "the shipped studies: {n}");
    // A study whose points do not keep the global batch is refused as strong scaling.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        format!(
            "[study]\nname = \"bad\"\nbase = \"{}\"\nscaling = \"strong\"\nranks = [1, 2]\n[per_rank]\n\"train.global_batch\" = 8\n",
            tiny_deck().display()
        ),
    )
    .unwrap();
    let o = Command::new(bin()).current_dir(repo()).arg("sweep").arg(&bad).arg("--out").arg(dir.path().join("b")).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("strong scaling, but 2 ranks train 1024 tokens per step and 1 ranks 512"), "{}", text(&o));
}
