//! The device check (`benches/gpu_check.sh`) and its bundle (`benches/gpu_bundle.sh`) as text
//! and as a dry run, without a GPU: what `tests/jobscripts.rs` does not hold — that every step
//! runs under a timeout of its own, that the plan's budgets fit 8 minutes, that the dry run
//! prints them, and that both scripts pass ShellCheck.

mod common;

use common::*;
use std::process::Command;

fn script() -> String {
    std::fs::read_to_string(repo().join("benches/gpu_check.sh")).unwrap()
}

/// The plan's `name:seconds` entries, as the script declares them.
fn plan() -> Vec<(String, u64)> {
    let text = script();
    let start = text.find("PLAN=(").expect("the script declares its PLAN") + "PLAN=(".len();
    let end = start + text[start..].find(')').unwrap();
    text[start..end]
        .split_whitespace()
        .map(|e| {
            let (name, secs) = e.split_once(':').unwrap_or_else(|| panic!("{e} is not name:seconds"));
            (name.to_string(), secs.parse().unwrap_or_else(|_| panic!("{e}: seconds")))
        })
        .collect()
}

/// Every step of the plan is run through `step NAME` (or `layout NAME`, which calls it), the
/// one place that wraps a command in `timeout` with the step's budget; nothing else in the
/// script runs ndtrain, mpirun or python outside a step.
#[test]
fn every_step_runs_under_its_own_timeout_and_the_plan_fits_eight_minutes() {
    let plan = plan();
    let total: u64 = plan.iter().map(|(_, s)| s).sum();
    assert!(total <= 480, "the plan takes {total} s");
    let text = script();
    assert!(text.contains(r#"timeout --kill-after=5 "$(budget "$name")" "$@""#), "step wraps its command in timeout");
    for (name, _) in &plan {
        let run = [format!("step {name} "), format!("layout {name} ")];
        assert!(run.iter().any(|r| text.contains(r.as_str())), "the plan's step {name} is never run through `step`");
    }
    // Lines of the script itself, not of the single-quoted scripts the steps hand to `bash -c`.
    let mut quoted = false;
    for line in text.lines().map(str::trim) {
        if !quoted && line.starts_with('#') {
            continue;
        }
        let starts_quoted = quoted;
        quoted ^= line.matches('\'').count() % 2 == 1;
        if starts_quoted {
            continue;
        }
        let launches = ["\"$NDTRAIN\" ", "mpirun ", "python3 benches/"].iter().any(|c| line.starts_with(c));
        assert!(!launches, "a command outside a step (no timeout): {line}");
    }
}

/// Without a GPU the script prints its plan with the total and stops with exit code 3 before
/// any check: nothing is written to its output folder.
#[test]
fn the_dry_run_prints_the_plan_and_stops_before_any_check() {
    let has_gpu = Command::new("nvidia-smi").arg("-L").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).starts_with("GPU "));
    if has_gpu {
        eprintln!("this machine has a GPU: run benches/gpu_check.sh itself");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new("bash").arg(repo().join("benches/gpu_check.sh")).env("NDTRAIN", bin()).env("OUT", dir.path()).output().unwrap();
    let log = text(&o);
    assert_eq!(o.status.code(), Some(3), "{log}");
    let total: u64 = plan().iter().map(|(_, s)| s).sum();
    assert!(log.contains(&format!("total {total} s (at most 480 s)")), "{log}");
    assert!(log.contains("gpu-check:") && log.contains("pytorch:"), "{log}");
    let written: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(written.is_empty(), "the dry run wrote {written:?}\n{log}");
}

#[test]
fn the_gpu_scripts_pass_shellcheck() {
    let o = Command::new("shellcheck")
        .args(["--severity=style", "--format=gcc"])
        .arg(repo().join("benches/gpu_check.sh"))
        .arg(repo().join("benches/gpu_bundle.sh"))
        .output()
        .expect("shellcheck runs (Debian package shellcheck)");
    assert!(o.status.success() && o.stdout.is_empty(), "{}", text(&o));
}
