//! The device path on the host: the one training loop run as it runs on a GPU — every host
//! access to the model state staged through copies, every collective staged through host
//! buffers apart from the "device" ones (`parallel::collective::Staged`) — through the debug
//! option `NDTRAIN_DEBUG_DEVICE_PATH`, against the host path, on one rank and on parallel
//! layouts. What this shows without a GPU: everything the GPU runs besides its backend's
//! operations (initialisation, the strategies and their collectives, gradient accumulation,
//! loss normalisation, clipping, AdamW through the backend, the schedule, the logs,
//! checkpoints) is the host's; a GPU then only has to show that its backend's operations match
//! the host's (`ndtrain gpu-check`).
//!
//! And mixed precision on the host: `[train] precision = "bf16"` rounds every GEMM operand to
//! bf16, so the losses move away from fp32 by bf16's rounding and no more.

mod common;
use common::*;
use std::path::Path;

/// 12 steps of the tiny deck with clipping active, 4 micro-steps per step (gradient
/// accumulation), one rank.
const SETS: &[&str] = &["run.steps=12", "run.threads=2", "optim.grad_clip=0.3", "optim.warmup_steps=2", "hardware.peak_flops_per_rank=1e9"];

fn run(dir: &Path, name: &str, device_path: bool, extra: &[&str]) -> Vec<f64> {
    run_on(1, dir, name, device_path, extra)
}

/// [`run`] on `ranks` ranks under `mpirun`.
fn run_on(ranks: usize, dir: &Path, name: &str, device_path: bool, extra: &[&str]) -> Vec<f64> {
    let out = dir.join(name);
    let mut cmd = std::process::Command::new(if ranks == 1 { bin() } else { "mpirun" });
    if ranks > 1 {
        cmd.args(["--oversubscribe", "-n", &ranks.to_string(), bin()]);
    }
    mpi_env(&mut cmd).arg("train").arg(tiny_deck()).args(["--set", &format!("run.out_dir=\"{}\"", out.display())]);
    for s in SETS.iter().chain(extra) {
        cmd.args(["--set", s]);
    }
    if device_path {
        cmd.env(ndtrain::run::faults::DEVICE_PATH_ENV, "1");
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{name}: {}", text(&o));
    let said = String::from_utf8_lossy(&o.stdout);
    assert_eq!(said.contains("on cpu (staged as a device)"), device_path, "{name}: which path ran\n{said}");
    losses(&out).1
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// Every tensor of the checkpoint of step 12 in `<dir>/<name>`.
fn checkpoint_tensors(dir: &Path, name: &str) -> Vec<(String, Vec<f32>)> {
    use ndtrain::io::checkpoint::tools::{dataset_paths, read_tensor};
    let file = dir.join(name).join("ckpt").join(ndtrain::io::checkpoint::file_name(12));
    let paths = dataset_paths(&file).expect("the checkpoint reads");
    assert!(!paths.is_empty(), "{}", file.display());
    paths.into_iter().map(|p| (p.clone(), read_tensor(&file, &p).expect("a tensor reads").1)).collect()
}

#[test]
fn the_device_path_reproduces_the_host_path() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ckpt = "checkpoint.every=12";
    let main = run(d, "main", false, &[ckpt]);
    let device = run(d, "device", true, &[ckpt]);
    // One loop, the same operations in the same order: the staging copies and the staged
    // collectives change no bit, of the losses or of the checkpoint the device path wrote.
    assert_eq!(main, device, "the losses are bitwise equal");
    assert_eq!(checkpoint_tensors(d, "main"), checkpoint_tensors(d, "device"), "the checkpoints hold the same bits");
    assert!(main.last().unwrap() < &(main[0] - 0.3), "the run learns: {main:?}");
    // Activation checkpointing through the backend recomputes with the forward's own code.
    let full = run(d, "device_full", true, &["train.activation_checkpointing=\"full\""]);
    let selective = run(d, "device_selective", true, &["train.activation_checkpointing=\"selective\""]);
    assert_eq!(full, device, "full checkpointing is bit-identical");
    assert_eq!(selective, device, "selective checkpointing is bit-identical");
}

/// The strategies on the device path: every collective of FSDP, TP with SP and the
/// vocabulary-parallel loss, the CP ring and HSDP's outer reduction staged through host
/// buffers. MPI sums the same values in the same order, so the losses and the checkpoints are
/// the host path's, bit for bit.
#[test]
fn the_device_path_reproduces_the_host_path_on_parallel_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let layouts: [(&str, &[&str]); 3] = [
        ("fsdp2_tp2_sp", &["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("cp2_tp2", &["parallel.cp=2", "parallel.tp=2"]),
        ("hsdp2x2", &["parallel.dp_replicate=2", "parallel.dp_shard=2", "train.activation_checkpointing=\"full\""]),
    ];
    for (name, sets) in layouts {
        let mut all = vec!["run.threads=1", "checkpoint.every=12"];
        all.extend_from_slice(sets);
        let host = run_on(4, d, &format!("{name}_host"), false, &all);
        let device = run_on(4, d, &format!("{name}_device"), true, &all);
        assert_eq!(host, device, "{name}: the losses are bitwise equal");
        assert_eq!(
            checkpoint_tensors(d, &format!("{name}_host")),
            checkpoint_tensors(d, &format!("{name}_device")),
            "{name}: the checkpoints"
        );
    }
}

/// bf16 GEMM operands: the losses move away from fp32 by bf16's rounding (relative 2⁻⁹ per
/// operand; measured 2.4e-4 over 12 steps, bounded at 3e-3), and the two paths agree (bitwise
/// now that they are one loop; bounded at 3e-4 as before).
#[test]
fn bf16_operands_move_the_losses_by_bf16_rounding_only() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let fp32 = run(d, "fp32", false, &[]);
    let bf16 = run(d, "bf16", false, &["train.precision=\"bf16\""]);
    let bf16_device = run(d, "bf16_device", true, &["train.precision=\"bf16\""]);
    let (gap, loops) = (max_diff(&fp32, &bf16), max_diff(&bf16, &bf16_device));
    eprintln!("bf16 vs fp32: max |Δloss| {gap:.3e}; bf16 host vs device path {loops:.3e}");
    assert!(gap > 0.0 && gap < 3e-3, "bf16 {bf16:?}\nfp32 {fp32:?}");
    // The first step's loss is the forward of the same initial model on both paths: bf16 rounds
    // the same operands, so it agrees to f32 rounding.
    assert!((bf16[0] - bf16_device[0]).abs() <= LOSS_TOL, "{} vs {}", bf16[0], bf16_device[0]);
    assert!(loops < 3e-4, "bf16 main {bf16:?}\nbf16 device {bf16_device:?}");
}
