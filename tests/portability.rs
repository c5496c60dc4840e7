//! The default build on other CPUs, emulated by QEMU's user mode (`qemu-x86_64 -cpu MODEL`,
//! Debian's `qemu-user`, which `setup-debian.sh` installs): on an AVX2-only CPU (Haswell: no
//! AVX-512) it trains and reproduces the reference losses; on a CPU without AVX2 (Westmere) it
//! ends before `main` with one line naming the missing features, exit code 2, no SIGILL.

mod common;
use common::*;
use std::process::Command;

fn qemu() -> Option<&'static str> {
    let found = Command::new("qemu-x86_64").arg("--version").output().is_ok_and(|o| o.status.success());
    found.then_some("qemu-x86_64")
}

/// QEMU's warnings about CPUID bits its emulator cannot provide are noise here.
fn without_qemu_warnings(s: &[u8]) -> String {
    String::from_utf8_lossy(s).lines().filter(|l| !l.starts_with("qemu-x86_64: warning")).map(|l| format!("{l}\n")).collect()
}

#[test]
fn the_default_build_trains_on_an_avx2_cpu_and_refuses_an_older_one_in_one_line() {
    if !cfg!(target_arch = "x86_64") {
        return;
    }
    let Some(qemu) = qemu() else {
        panic!("qemu-x86_64 is not installed: `apt-get install qemu-user` (jobscripts/local/setup-debian.sh installs it)");
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("haswell");
    let set_out = format!("run.out_dir=\"{}\"", out.display());
    let deck = tiny_deck();
    // No GEMM probe (slow under emulation): a stated peak.
    let sets = ["run.steps=2", "run.threads=1", "hardware.peak_flops_per_rank=1e9", &set_out];
    let mut cmd = Command::new(qemu);
    cmd.args(["-cpu", "Haswell", bin(), "train", deck.to_str().unwrap()]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let o = mpi_env(&mut cmd).output().expect("qemu runs");
    assert!(o.status.success(), "Haswell: {}{}", without_qemu_warnings(&o.stdout), without_qemu_warnings(&o.stderr));
    let reference = std::fs::read_to_string(repo().join("inputs/reference/tiny.1.csv")).unwrap();
    let expected: Vec<f64> = reference
        .lines()
        .filter(|l| l.starts_with(|c: char| c.is_ascii_digit()))
        .take(2)
        .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
        .collect();
    assert_losses_within("tiny on an emulated Haswell", &expected, &losses(&out).1, 1e-5);

    let o = Command::new(qemu).args(["-cpu", "Westmere", bin(), "--version"]).output().expect("qemu runs");
    let stderr = without_qemu_warnings(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "Westmere: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(lines[0].starts_with("error: this ndtrain was built for CPU features this CPU lacks: avx avx2 fma"), "{}", lines[0]);
    assert!(o.stdout.is_empty(), "nothing of the program ran: {}", String::from_utf8_lossy(&o.stdout));
}
