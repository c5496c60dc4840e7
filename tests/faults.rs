//! Faults in a real job: a rank that errors, a rank killed with SIGKILL, a rank that
//! hangs, a NaN in a gradient, a checkpoint write that fails. Every fault is injected by a
//! documented debug option (`docs/debugging.md`) or by the test itself, into the real binary
//! under `mpirun` with four ranks.

mod common;

use common::*;
use ndtrain::io::checkpoint::tools;
use ndtrain::run::faults as debug;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Four ranks, FSDP=2 × TP=2, a checkpoint every 2 steps.
const LAYOUT: &[&str] =
    &["run.threads=1", "parallel.dp_shard=2", "parallel.tp=2", "optim.warmup_steps=1", "checkpoint.every=2", "log.every=1"];

/// `mpirun -n 4 ndtrain train tiny.toml` with `LAYOUT`, `sets` and the debug variables `env`.
fn job(out: &Path, sets: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new("mpirun");
    mpi_env(&mut cmd).args(["--oversubscribe", "-n", "4", bin(), "train"]).arg(tiny_deck());
    cmd.arg("--set").arg(format!("run.out_dir=\"{}\"", out.display()));
    for s in LAYOUT.iter().chain(sets) {
        cmd.args(["--set", s]);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

fn spawn(mut cmd: Command) -> Child {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("mpirun starts")
}

fn wait_for_steps(out: &Path, n: usize, child: &mut Child) {
    let start = Instant::now();
    while steps_done(out) < n {
        assert!(child.try_wait().unwrap().is_none(), "the job ended before step {n}");
        assert!(start.elapsed() < Duration::from_secs(HANG_S), "the job never logged {n} steps in {HANG_S} s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How long a test waits for what must happen before it calls the job hung. No test bounds how
/// fast a job ends by the clock: a loaded machine runs everything slower. A job ended by a
/// fault must end sooner than its remaining steps would have taken at its own measured pace
/// ([`assert_cut_short`]); this only keeps a hang from holding the suite forever.
const HANG_S: u64 = 300;

/// Waits for `child` to end (at most [`HANG_S`]); returns its output and how long it took.
fn wait_to_end(mut child: Child) -> (std::process::Output, Duration) {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(HANG_S) {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!("the job was still running {HANG_S} s later\n{}", text(&o));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = start.elapsed();
    (child.wait_with_output().unwrap(), took)
}

/// The job in `out`, ended `took` after its fault, ended sooner than the `steps` it was given
/// would have taken at its own pace (the wall time per step it logged, `elapsed_s`, which
/// counts the injected step delay): the fault cut it short, rather than the ranks running on or
/// hanging until a limit.
fn assert_cut_short(out: &Path, steps: usize, took: Duration, o: &std::process::Output) {
    let elapsed = column(out, "elapsed_s");
    assert!(!elapsed.is_empty(), "no step logged\n{}", text(o));
    let pace = elapsed[elapsed.len() - 1] / elapsed.len() as f64;
    let remaining = (steps - elapsed.len()) as f64 * pace;
    assert!(
        took.as_secs_f64() < remaining,
        "the job took {took:?} to end after its fault, longer than its remaining {} steps would have taken at its pace ({remaining:.1} s)\n{}",
        steps - elapsed.len(),
        text(o)
    );
}

fn alive(pid: i32) -> bool {
    // A zombie has exited; only its parent has not collected it yet.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s[s.rfind(')').unwrap() + 2..].starts_with('Z'))
}

/// Every one of `pids` is gone after the launcher's exit (mpirun returns while the processes
/// it killed may still be on their way out).
fn assert_all_gone(pids: &[i32]) {
    let start = Instant::now();
    while pids.iter().any(|&p| alive(p)) {
        assert!(
            start.elapsed() < Duration::from_secs(HANG_S),
            "ranks still running: {:?}",
            pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn ckpt(out: &Path, step: u64) -> PathBuf {
    out.join("ckpt").join(format!("step_{step:08}.h5"))
}

/// Every dataset of two checkpoints has the same bits.
fn assert_bitwise_equal(a: &Path, b: &Path) {
    let names = tools::dataset_paths(a).unwrap();
    assert_eq!(names, tools::dataset_paths(b).unwrap());
    for n in &names {
        let (xa, xb) = (tools::read_tensor(a, n).unwrap().1, tools::read_tensor(b, n).unwrap().1);
        assert_eq!(xa.len(), xb.len(), "{n}: element count differs between {} and {}", a.display(), b.display());
        assert!(xa.iter().zip(&xb).all(|(x, y)| x.to_bits() == y.to_bits()), "{n} differs between {} and {}", a.display(), b.display());
    }
}

/// One rank of four returns an error at step 3 of 50: the job ends long before its remaining
/// steps would have run, every rank is gone, and the one message names the rank and the cause.
#[test]
fn one_rank_failing_ends_every_rank_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let delay = (debug::STEP_DELAY_ENV, "300");
    let mut child = spawn(job(&out, &["run.steps=50"], &[(debug::FAIL_ENV, "step=3,rank=2"), delay]));
    let ranks = {
        wait_for_steps(&out, 1, &mut child);
        children(child.id())
    };
    assert_eq!(ranks.len(), 4, "mpirun's children: {ranks:?}");
    wait_for_steps(&out, 2, &mut child);
    let (o, took) = wait_to_end(child);
    assert_cut_short(&out, 50, took, &o);
    assert!(!o.status.success(), "{}", text(&o));
    let err = stderr(&o);
    assert!(err.contains("error: rank 2: injected failure (NDTRAIN_DEBUG_FAIL) at step 3"), "{}", text(&o));
    assert_eq!(err.matches("error:").count(), 1, "one message\n{}", text(&o));
    assert!(!err.contains("panicked"), "{}", text(&o));
    assert_all_gone(&ranks);
    assert_eq!(steps_done(&out), 2);
}

/// A device failure on one rank of two (injected where an asynchronous CUDA error surfaces:
/// when the step synchronises with its device), on the device path: the job ends long before
/// its remaining steps would have run, with exit 1 and one message naming the rank and the
/// device, not a panic.
#[test]
fn a_device_failure_on_one_rank_ends_the_job_with_its_message() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut cmd = Command::new("mpirun");
    mpi_env(&mut cmd).args(["--oversubscribe", "-n", "2", bin(), "train"]).arg(tiny_deck());
    cmd.arg("--set").arg(format!("run.out_dir=\"{}\"", out.display()));
    cmd.args(["--set", "run.steps=50", "--set", "run.threads=1", "--set", "optim.warmup_steps=1"]);
    cmd.env(debug::DEVICE_PATH_ENV, "1").env(debug::DEVICE_ERROR_ENV, "step=3,rank=1").env(debug::STEP_DELAY_ENV, "300");
    let mut child = spawn(cmd);
    let ranks = {
        wait_for_steps(&out, 1, &mut child);
        children(child.id())
    };
    assert_eq!(ranks.len(), 2, "mpirun's children: {ranks:?}");
    wait_for_steps(&out, 2, &mut child);
    let (o, took) = wait_to_end(child);
    assert_cut_short(&out, 50, took, &o);
    assert_eq!(o.status.code(), Some(ndtrain::exit::RUN_FAILED), "{}", text(&o));
    let err = stderr(&o);
    let want = "error: rank 1: cpu (staged as a device): a device operation failed (NDTRAIN_DEBUG_DEVICE_ERROR at step 3)";
    assert!(err.contains(want), "{}", text(&o));
    assert_eq!(err.matches("error:").count(), 1, "one message\n{}", text(&o));
    assert!(!err.contains("panicked"), "{}", text(&o));
    assert_all_gone(&ranks);
    assert_eq!(steps_done(&out), 2);
}

/// One rank killed with SIGKILL mid-step: the launcher ends the job before its remaining steps
/// would have run; `resume = "auto"` continues from the last checkpoint and reproduces the uninterrupted run's
/// losses and final state bit for bit.
#[test]
fn a_killed_rank_ends_the_job_and_the_resume_is_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sets = ["run.steps=12"];
    let straight = d.join("straight");
    let o = job(&straight, &sets, &[]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));

    let out = d.join("killed");
    let mut child = spawn(job(&out, &sets, &[(debug::STEP_DELAY_ENV, "1000")]));
    wait_for_steps(&out, 5, &mut child);
    let ranks = children(child.id());
    assert_eq!(ranks.len(), 4, "mpirun's children: {ranks:?}");
    assert!(Command::new("kill").args(["-KILL", &ranks[1].to_string()]).status().unwrap().success());
    let (o, took) = wait_to_end(child);
    assert_cut_short(&out, 12, took, &o);
    assert!(!o.status.success(), "{}", text(&o));
    assert_all_gone(&ranks);
    let killed_at = steps_done(&out);
    assert!((5..12).contains(&killed_at), "killed after step {killed_at}");

    let o = job(&out, &[sets[0], "checkpoint.resume=\"auto\""], &[]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("resumed from"), "{}", text(&o));
    assert_eq!(losses(&out).0, losses(&straight).0, "losses of the killed-and-resumed run");
    assert_bitwise_equal(&ckpt(&straight, 12), &ckpt(&out, 12));
}

/// The watchdog: a rank that stops making progress (stuck in I/O) ends the job with a message
/// naming the rank and where it stalled, instead of holding the allocation until its limit (a
/// hung rank never ends by itself: that the job ends, with the watchdog's message, is the
/// check).
#[test]
fn the_watchdog_ends_a_job_with_a_hung_rank() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let child = spawn(job(&out, &["run.steps=20", "run.watchdog_seconds=2"], &[(debug::HANG_ENV, "step=3,rank=1")]));
    let (o, _) = wait_to_end(child);
    assert!(!o.status.success(), "{}", text(&o));
    let err = stderr(&o);
    assert!(err.contains("error: rank 1: watchdog: no progress for") && err.contains("since: step 3"), "{}", text(&o));
    assert!(err.contains("watchdog_seconds = 2"), "{}", text(&o));
    assert_eq!(steps_done(&out), 2);
}

/// The watchdog polls the communicators' asynchronous errors (NCCL's report of a peer that is
/// gone, while the rank waits inside NCCL): an error on one rank ends the job with its message,
/// naming the rank. The stall limit is set far beyond the test's wait, and its own message
/// differs, so only the poll can have ended it.
#[test]
fn the_watchdog_ends_a_job_on_a_communicator_s_asynchronous_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let child = spawn(job(&out, &["run.steps=20", "run.watchdog_seconds=3600"], &[(debug::ASYNC_ERROR_ENV, "step=3,rank=1")]));
    let (o, _) = wait_to_end(child);
    assert!(!o.status.success(), "{}", text(&o));
    let err = stderr(&o);
    assert!(!err.contains("no progress for"), "the stall limit, not the poll, ended it\n{}", text(&o));
    assert!(err.contains("error: rank 1: communicator of group world: injected asynchronous error"), "{}", text(&o));
    assert_eq!(steps_done(&out), 2);
}

/// Acceptance 4: a NaN injected into one rank's gradient of one tensor at step 3. `skip` skips
/// exactly that update (the AdamW step count is one behind, the losses up to step 3 are the
/// clean run's) and training goes on; `abort` ends the run with one message naming the step,
/// the rank and the tensor.
#[test]
fn a_nan_gradient_is_skipped_or_stops_the_run_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tensor = "model.layers.1.self_attn.k_proj.weight";
    let nan = format!("step=3,rank=3,tensor={tensor}");
    let clean = d.join("clean");
    let o = job(&clean, &["run.steps=6"], &[]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));

    let skip = d.join("skip");
    let o = job(&skip, &["run.steps=6", "optim.on_nonfinite=\"skip\""], &[(debug::NAN_GRAD_ENV, &nan)]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("step 3: loss") && text(&o).contains("update skipped"), "{}", text(&o));
    assert!(text(&o).contains("1 step(s) skipped"), "{}", text(&o));
    let (got, want) = (losses(&skip).0, losses(&clean).0);
    assert_eq!(got.len(), 6, "training went on to the end");
    assert_eq!(got[..3], want[..3], "the NaN arrives after step 3's loss");
    assert_ne!(got[3], want[3], "step 4 starts from the parameters of step 2");
    let norms = column(&skip, "grad_norm");
    assert!(norms[2].is_nan() && norms.iter().enumerate().all(|(i, x)| i == 2 || x.is_finite()), "{norms:?}");
    let meta = |out: &Path| ndtrain::io::checkpoint::Reader::open_serial(&ckpt(out, 6)).unwrap().meta;
    assert_eq!((meta(&skip).step, meta(&skip).optim_step), (6, 5), "exactly one update skipped");
    assert_eq!(meta(&clean).optim_step, 6);

    let abort = d.join("abort");
    let (o, _) = wait_to_end(spawn(job(&abort, &["run.steps=6"], &[(debug::NAN_GRAD_ENV, &nan)])));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = stderr(&o);
    assert_eq!(err.matches("error:").count(), 1, "reported once\n{}", text(&o));
    assert!(err.contains("error: rank 3: step 3:") && err.contains("gradient norm NaN") && err.contains(tensor), "{}", text(&o));
    assert_eq!(steps_done(&abort), 2, "step 3 is not logged as done");
}

/// The documented policy for a checkpoint that cannot be written (a full disk, an I/O error
/// on any rank): the run stops with exit code 1 and one message; the temporary file is gone,
/// the previous checkpoint and `latest` are intact, and `resume = "auto"` continues from them
/// to the clean run's result.
#[test]
fn a_failed_checkpoint_write_keeps_the_previous_one_and_stops() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let clean = d.join("clean");
    let o = job(&clean, &["run.steps=6"], &[]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));

    let out = d.join("full_disk");
    let (o, _) = wait_to_end(spawn(job(&out, &["run.steps=6"], &[(debug::CHECKPOINT_WRITE_ERROR_ENV, "step=4,rank=2")])));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = stderr(&o);
    assert_eq!(err.matches("error:").count(), 1, "reported once\n{}", text(&o));
    assert!(err.contains("injected write error") && err.contains("previous checkpoint is untouched"), "{}", text(&o));
    let mut files: Vec<String> =
        std::fs::read_dir(out.join("ckpt")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    files.sort();
    assert_eq!(files, ["latest", "step_00000002.h5"], "no temporary file, the previous checkpoint kept");
    assert_eq!(std::fs::read_to_string(out.join("ckpt/latest")).unwrap().trim(), "step_00000002.h5");
    tools::verify(&ckpt(&out, 2)).unwrap();

    let o = job(&out, &["run.steps=6", "checkpoint.resume=\"auto\""], &[]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(losses(&out).0, losses(&clean).0);
    assert_bitwise_equal(&ckpt(&clean, 6), &ckpt(&out, 6));
}
