//! The job scripts: every one parses (`bash -n`), and the PBS script runs a real 4-rank job
//! from a fake `$PBS_NODEFILE` with Open MPI's `mpirun` as its `mpiexec`.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn scripts(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            scripts(&p, out);
        } else if matches!(p.extension().and_then(|e| e.to_str()), Some("sh" | "sbatch" | "pbs")) {
            out.push(p);
        }
    }
}

#[test]
fn every_job_script_parses() {
    let mut all = vec![];
    scripts(&repo().join("jobscripts"), &mut all);
    scripts(&repo().join("benches"), &mut all);
    assert!(all.len() >= 5, "{all:?}");
    for s in &all {
        let o = Command::new("bash").arg("-n").arg(s).output().unwrap();
        assert!(o.status.success(), "{}: {}", s.display(), text(&o));
    }
}

#[test]
fn the_pbs_script_runs_four_ranks_from_a_nodefile() {
    let dir = tempfile::tempdir().unwrap();
    let nodefile = dir.path().join("nodes");
    std::fs::write(&nodefile, "localhost\n".repeat(4)).unwrap();
    let out = dir.path().join("run");
    let sets = format!("run.steps=4 optim.warmup_steps=1 parallel.tp=2 checkpoint.every=4 run.out_dir=\"{}\"", out.display());
    let o = mpi_env(&mut Command::new("bash"))
        .arg(repo().join("jobscripts/pbs/train.pbs"))
        .env("PBS_NODEFILE", &nodefile)
        .env("PBS_O_WORKDIR", repo())
        .env("PBS_JOBID", "42.pbs-test")
        .env("MPIEXEC", "mpirun")
        .env("MPIEXEC_ARGS", "--oversubscribe")
        .env("NDTRAIN", bin())
        .env("DECK", tiny_deck())
        .env("SETS", &sets)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let log = text(&o);
    assert!(log.contains("job 42.pbs-test on 1 node(s), 4 ranks"), "{log}");
    assert!(log.contains("+ mpirun -n 4 -hostfile"), "{log}");
    assert_eq!(std::fs::read_dir(out.join("timing")).unwrap().count(), 4);
    assert_eq!(losses(&out).1.len(), 4);
    assert!(out.join("ckpt/step_00000004.h5").exists());
    // The layout the deck resolved on the nodefile's 4 ranks.
    assert!(std::fs::read_to_string(out.join("deck.toml")).unwrap().contains("dp_shard=2 cp=1 tp=2"));
}

/// The GPU check script (`benches/gpu_check.sh`) on a machine without a GPU: it finds ndtrain,
/// says what it would run and stops with exit code 3 and "no GPU" before any check, writing no
/// result file. (On a machine with a GPU this would run the real checks: not here.)
#[test]
fn the_gpu_check_script_stops_cleanly_without_a_gpu() {
    let has_gpu = Command::new("nvidia-smi").arg("-L").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).starts_with("GPU "));
    if has_gpu {
        eprintln!("this machine has a GPU: run benches/gpu_check.sh itself");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new("bash").arg(repo().join("benches/gpu_check.sh")).env("NDTRAIN", bin()).env("OUT", dir.path()).output().unwrap();
    let log = text(&o);
    assert_eq!(o.status.code(), Some(3), "{log}");
    assert!(log.contains("no GPU on this machine") && log.contains("stopping before any"), "{log}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "a dry run writes no result: {log}");
}
