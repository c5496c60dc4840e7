//! Stopping early to be continued: SIGTERM or SIGUSR1 (what Slurm sends before a time limit
//! with `--signal`, and what `scancel` sends) only sets a flag; `[run] max_walltime` is a limit
//! the program watches itself (as GROMACS' `-maxh` does). The training loop agrees on either
//! across ranks at the next step boundary, writes a checkpoint and exits with
//! [`crate::exit::PREEMPTED`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::sync::OnceLock;
use std::time::Instant;

static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Installs the handlers (once per process; later calls do nothing).
pub fn install() -> std::io::Result<()> {
    if FLAG.get().is_some() {
        return Ok(());
    }
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGUSR1] {
        signal_hook::flag::register(sig, flag.clone())?;
    }
    let _ = FLAG.set(flag);
    Ok(())
}

/// Whether this process has received a stop signal.
pub fn requested() -> bool {
    FLAG.get().is_some_and(|f| f.load(Ordering::Relaxed))
}

/// When this process started: the clock `[run] max_walltime` counts from. The first call fixes
/// it; the command line makes that call as it starts.
pub fn process_start() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

static JOB_END: OnceLock<f64> = OnceLock::new();

/// Records when the batch job ends, in seconds after [`process_start`] (`[run]
/// stop_before_job_end`).
pub fn set_job_end(at_s: f64) {
    let _ = JOB_END.set(at_s);
}

/// The limit the run stops before, in seconds after [`process_start`] (0: none), and what it
/// is: the tighter of `[run] max_walltime` (0: none) and the batch job's end.
pub fn limit(max_walltime: f64) -> (f64, String) {
    match JOB_END.get() {
        Some(&end) if max_walltime <= 0.0 || end < max_walltime => {
            (end, format!("the batch job's time limit ({end:.0} s after the start)"))
        }
        _ => (max_walltime, format!("[run] max_walltime = {max_walltime} s")),
    }
}

/// `[run] max_walltime = limit_s` (0: none): whether, `elapsed_s` into the job, the next step
/// (`next_step_s`) and then a checkpoint (`checkpoint_s`) would end past the limit — so the
/// checkpoint must be written now.
pub fn walltime_exceeded(limit_s: f64, elapsed_s: f64, next_step_s: f64, checkpoint_s: f64) -> bool {
    limit_s > 0.0 && elapsed_s + next_step_s + checkpoint_s > limit_s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_walltime_stop_leaves_room_for_a_step_and_a_checkpoint() {
        assert!(!walltime_exceeded(0.0, 1e9, 1.0, 1.0), "0 is no limit");
        assert!(!walltime_exceeded(100.0, 80.0, 10.0, 10.0));
        assert!(walltime_exceeded(100.0, 80.5, 10.0, 10.0));
    }
}
