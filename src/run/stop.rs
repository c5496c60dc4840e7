//! When a run stops early to be continued: a stop signal (`preempt`), `[run] max_walltime` or
//! the batch job's own time limit (`job_limit`), or `[run] stop_after_steps`. [`StopPolicy`]
//! measures the steps and checkpoints, and at each step boundary the world agrees whether to
//! stop there — every rank then writes the checkpoint and exits with
//! [`crate::exit::PREEMPTED`].

use super::{job_limit, preempt};
use crate::config::RunCfg;
use crate::parallel::comm::Group;
use crate::say;
use std::time::Instant;

/// Why a run stops early. Its text is the console's line.
#[derive(Clone, Debug, PartialEq)]
pub enum Stop {
    /// SIGTERM or SIGUSR1 reached a rank.
    Signal,
    /// The next step and a checkpoint would end past the time limit `what`.
    Walltime { what: String, elapsed_s: f64, step_s: f64, checkpoint_s: f64 },
    /// `[run] stop_after_steps`: this job's share of the run is done.
    Quota(u64),
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::Signal => f.write_str("stop signal (SIGTERM/SIGUSR1)"),
            Stop::Walltime { what, elapsed_s, step_s, checkpoint_s } => write!(
                f,
                "{what}: {elapsed_s:.1} s in, a step (up to {step_s:.2} s) and a checkpoint (~{checkpoint_s:.2} s) would end past it"
            ),
            Stop::Quota(n) => write!(f, "[run] stop_after_steps = {n}: this job's share of the run is done"),
        }
    }
}

/// The limits of `[run]` and what the run has measured against them: the longest a step took
/// from one boundary to the next (its checkpoint left out), and the last checkpoint's time.
pub struct StopPolicy {
    max_walltime: f64,
    signal_lead_time: f64,
    stop_after_steps: u64,
    /// The job's first step (the checkpoint it resumed from) and the run's last.
    first_step: u64,
    steps: u64,
    last_boundary: Instant,
    slowest_step_s: f64,
    /// Checkpoint time since the last boundary, and the last checkpoint's time.
    ckpt_since_boundary_s: f64,
    last_ckpt_s: Option<f64>,
    /// The stop-signal lead-time warning was printed.
    lead_warned: bool,
}

impl StopPolicy {
    /// The policy of `run` for a job that starts after step `first_step`.
    pub fn new(run: &RunCfg, first_step: u64) -> StopPolicy {
        StopPolicy {
            max_walltime: run.max_walltime,
            signal_lead_time: run.signal_lead_time,
            stop_after_steps: run.stop_after_steps,
            first_step,
            steps: run.steps,
            last_boundary: Instant::now(),
            slowest_step_s: 0.0,
            ckpt_since_boundary_s: 0.0,
            last_ckpt_s: None,
            lead_warned: false,
        }
    }

    /// Records `secs` the training thread spent on checkpoints at this boundary (not part of
    /// the step's pace).
    pub fn stalled(&mut self, secs: f64) {
        self.ckpt_since_boundary_s += secs;
    }

    /// Records a checkpoint write that took `secs` from its snapshot to its file in place: what
    /// a stop must leave time for, since it waits for its checkpoint to be in place.
    pub fn checkpoint_took(&mut self, secs: f64) {
        self.last_ckpt_s = Some(secs);
    }

    /// Whether the run stops after step `s1`, and why: a stop signal reached a rank, or (before
    /// the last step) the next step and a checkpoint would end past the time limit on a rank,
    /// or this job's quota of steps is done. Agreed over `world`, so every rank stops here.
    pub fn at_boundary(&mut self, s1: u64, world: &Group) -> Option<Stop> {
        let t = Instant::now();
        let step_s = (t - self.last_boundary).as_secs_f64() - std::mem::take(&mut self.ckpt_since_boundary_s);
        self.slowest_step_s = self.slowest_step_s.max(step_s);
        self.last_boundary = t;
        let (limit, what) = preempt::limit(self.max_walltime);
        let elapsed_s = preempt::process_start().elapsed().as_secs_f64();
        // Until a checkpoint has been timed, one is taken to cost as much as a step.
        let checkpoint_s = self.last_ckpt_s.unwrap_or(self.slowest_step_s);
        let walltime = s1 < self.steps && preempt::walltime_exceeded(limit, elapsed_s, self.slowest_step_s, checkpoint_s);
        self.warn_about_lead_time(checkpoint_s);
        let quota = self.stop_after_steps;
        let quota_done = quota > 0 && s1 < self.steps && s1 - self.first_step >= quota;
        let mut stop = [preempt::requested() as u64, walltime as u64, quota_done as u64];
        world.agree_max_u64(&mut stop);
        match stop {
            [1, _, _] => Some(Stop::Signal),
            [_, 1, _] => Some(Stop::Walltime { what, elapsed_s, step_s: self.slowest_step_s, checkpoint_s }),
            [_, _, 1] => Some(Stop::Quota(quota)),
            _ => None,
        }
    }

    /// Once: a warning when a step and a checkpoint take longer than the scheduler's
    /// stop-signal lead time.
    fn warn_about_lead_time(&mut self, checkpoint_s: f64) {
        let lead = self.signal_lead_time;
        if lead > 0.0 && !self.lead_warned && self.slowest_step_s + checkpoint_s > lead {
            self.lead_warned = true;
            say!(
                "warning: a step (up to {:.1} s) and a checkpoint (~{checkpoint_s:.1} s) take longer than the scheduler's stop-signal \
                 lead time ([run] signal_lead_time = {lead} s): a job stopped by that signal may be killed before its \
                 checkpoint is complete; ask for the signal earlier (sbatch --signal=USR1@{:.0}) or set [run] \
                 stop_before_job_end = true",
                self.slowest_step_s,
                2.0 * (self.slowest_step_s + checkpoint_s).ceil()
            );
        }
    }
}

/// `[run] stop_before_job_end`: rank 0 asks the scheduler how long the job has left (one query
/// per job, not per rank) and every rank stops before that, counted from its own start.
/// Returns the console line that says so; every rank gets rank 0's answer, so all take the
/// same branch.
pub fn agree_job_end(world: &Group) -> Result<String, String> {
    let mut answer = match world.rank() {
        0 => match job_limit::seconds_left() {
            Ok(Some((secs, source))) => format!("{secs}\t{source}"),
            Ok(None) => "none".to_string(),
            Err(e) => format!("error\t{e}"),
        },
        _ => String::new(),
    }
    .into_bytes();
    world.broadcast_bytes(0, &mut answer);
    let answer = String::from_utf8_lossy(&answer).into_owned();
    match answer.split_once('\t') {
        Some(("error", e)) => Err(e.to_string()),
        Some((secs, source)) => {
            let secs: f64 = secs.parse().map_err(|_| format!("the scheduler's time left {secs:?} is not a number"))?;
            let at = preempt::process_start().elapsed().as_secs_f64() + secs;
            preempt::set_job_end(at);
            Ok(format!(
                "walltime: {source}: {} left; the run stops with a checkpoint before it ([run] stop_before_job_end)",
                crate::metrics::fmt_duration(secs)
            ))
        }
        None => Ok("walltime: the batch job has no time limit ([run] stop_before_job_end has nothing to stop before)".into()),
    }
}
