//! The one-device training loop (`train_device`: the GPU path's loop, with every operation
//! behind the `Backend` boundary) run on the host backend through the debug option
//! `NDTRAIN_DEBUG_DEVICE_LOOP`, against the main loop. What this shows without a GPU: the loop
//! (initialisation, gradient accumulation, loss normalisation, clipping, AdamW through the
//! backend, the schedule, the logs) is the main loop's; a GPU then only has to show that its
//! backend's operations match the host's (`ndtrain gpu-check`).
//!
//! And mixed precision on the host: `[train] precision = "bf16"` rounds every GEMM operand to
//! bf16, so the losses move away from fp32 by bf16's rounding and no more.

mod common;
use common::*;
use std::path::Path;

/// 12 steps of the tiny deck with clipping active, 4 micro-steps per step (gradient
/// accumulation), one rank.
const SETS: &[&str] = &["run.steps=12", "run.threads=2", "optim.grad_clip=0.3", "optim.warmup_steps=2", "hardware.peak_flops_per_rank=1e9"];

fn run(dir: &Path, name: &str, device_loop: bool, extra: &[&str]) -> Vec<f64> {
    let out = dir.join(name);
    let mut cmd = std::process::Command::new(bin());
    mpi_env(&mut cmd).arg("train").arg(tiny_deck()).args(["--set", &format!("run.out_dir=\"{}\"", out.display())]);
    for s in SETS.iter().chain(extra) {
        cmd.args(["--set", s]);
    }
    if device_loop {
        cmd.env(ndtrain::run::faults::DEVICE_PATH_ENV, "1");
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{name}: {}", text(&o));
    let said = String::from_utf8_lossy(&o.stdout);
    assert_eq!(said.contains("on cpu (Fp32 GEMMs)") || said.contains("on cpu (Bf16 GEMMs)"), device_loop, "{name}: which loop ran\n{said}");
    losses(&out).1
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

#[test]
fn the_device_loop_reproduces_the_main_loop() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let main = run(d, "main", false, &[]);
    let device = run(d, "device", true, &[]);
    // The same maths in the same order but for the gradient norm's summation (per tensor here,
    // per shard there): equal to rounding.
    let diff = max_diff(&main, &device);
    eprintln!("main vs device loop: max |Δloss| {diff:.3e}");
    assert!(diff <= LOSS_TOL, "main {main:?}\ndevice {device:?}");
    assert!(main.last().unwrap() < &(main[0] - 0.3), "the run learns: {main:?}");
    // Activation checkpointing through the backend recomputes with the forward's own code.
    let full = run(d, "device_full", true, &["train.activation_checkpointing=\"full\""]);
    let selective = run(d, "device_selective", true, &["train.activation_checkpointing=\"selective\""]);
    assert_eq!(full, device, "full checkpointing is bit-identical");
    assert_eq!(selective, device, "selective checkpointing is bit-identical");
}

/// bf16 GEMM operands: the losses move away from fp32 by bf16's rounding (relative 2⁻⁹ per
/// operand; measured 2.4e-4 over 12 steps, bounded at 3e-3), and the two loops agree (measured
/// 2.0e-5, bounded at 3e-4: a last-bit difference in a gradient can flip a bf16 rounding later).
#[test]
fn bf16_operands_move_the_losses_by_bf16_rounding_only() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let fp32 = run(d, "fp32", false, &[]);
    let bf16 = run(d, "bf16", false, &["train.precision=\"bf16\""]);
    let bf16_device = run(d, "bf16_device", true, &["train.precision=\"bf16\""]);
    let (gap, loops) = (max_diff(&fp32, &bf16), max_diff(&bf16, &bf16_device));
    eprintln!("bf16 vs fp32: max |Δloss| {gap:.3e}; bf16 main vs device loop {loops:.3e}");
    assert!(gap > 0.0 && gap < 3e-3, "bf16 {bf16:?}\nfp32 {fp32:?}");
    // The first step's loss is the forward of the same initial model in both loops: bf16 rounds
    // the same operands, so it agrees to f32 rounding.
    assert!((bf16[0] - bf16_device[0]).abs() <= LOSS_TOL, "{} vs {}", bf16[0], bf16_device[0]);
    assert!(loops < 3e-4, "bf16 main {bf16:?}\nbf16 device {bf16_device:?}");
}
