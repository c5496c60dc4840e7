//! `ndtrain sweep status DIR`: where each job of a study is, one line per point and repeat:
//! not submitted, queued, running, done, failed (with its exit code), preempted or requeued.
//!
//! Three witnesses, each where it answers: the batch system (`scontrol show job`, else `sacct`;
//! `qstat -x -f`), which forgets a job some time after it ends; the run's `run.json`, whose
//! status rank 0 writes at the start and the end; and the job's output (`job.out`), whose last
//! "exited with code N" line the job scripts print.

use super::study::Launcher;
use super::submit::{read_jobs, Submitted};
use super::{launcher_of, read_manifest, ManifestRow};
use std::path::Path;
use std::process::Command;

/// Where a job is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    NotSubmitted,
    Queued,
    Running,
    Done,
    /// With the exit code (or what ended it) where known.
    Failed(String),
    Preempted,
    Requeued,
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            State::NotSubmitted => write!(f, "not submitted"),
            State::Queued => write!(f, "queued"),
            State::Running => write!(f, "running"),
            State::Done => write!(f, "done"),
            State::Failed(why) if why.is_empty() => write!(f, "failed"),
            State::Failed(why) => write!(f, "failed ({why})"),
            State::Preempted => write!(f, "preempted"),
            State::Requeued => write!(f, "requeued"),
        }
    }
}

/// What the batch system says of a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sched {
    Pending {
        restarted: bool,
    },
    Running,
    Requeued,
    Preempted,
    /// Ended: with the exit code, or what ended it (`TIMEOUT`, a signal).
    Ended {
        ok: bool,
        how: String,
    },
}

/// `Name=value` of `scontrol show job`'s output.
fn field<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    text.split_whitespace().find_map(|w| w.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
}

/// A Slurm state and exit code (`2:0`: exit code 2; `0:9`: signal 9).
pub fn slurm_state(state: &str, exit: &str, restarts: u32) -> Option<Sched> {
    let state = state.split_whitespace().next().unwrap_or("");
    let (code, signal) = exit.split_once(':').unwrap_or((exit, "0"));
    let how = match (code, signal) {
        (c, "0") if !c.is_empty() => format!("exit code {c}"),
        (_, s) => format!("signal {s}"),
    };
    Some(match state {
        "PENDING" => Sched::Pending { restarted: restarts > 0 },
        "REQUEUED" | "REQUEUE_HOLD" | "REQUEUE_FED" => Sched::Requeued,
        "RUNNING" | "COMPLETING" | "CONFIGURING" | "SUSPENDED" | "STOPPED" | "SIGNALING" | "STAGE_OUT" | "RESIZING" => Sched::Running,
        "PREEMPTED" => Sched::Preempted,
        "COMPLETED" => Sched::Ended { ok: how == "exit code 0", how },
        "" => return None,
        // FAILED says no more than its exit code; other states (TIMEOUT, CANCELLED, OUT_OF_MEMORY)
        // say what ended the job.
        "FAILED" if how != "exit code 0" => Sched::Ended { ok: false, how },
        other if how == "exit code 0" => Sched::Ended { ok: false, how: other.to_string() },
        other => Sched::Ended { ok: false, how: format!("{how}, {other}") },
    })
}

/// A PBS `job_state` with its `Exit_status` and `run_count`.
pub fn pbs_state(state: &str, exit: Option<&str>, run_count: u32) -> Option<Sched> {
    Some(match state {
        "Q" | "H" | "W" | "T" | "S" => Sched::Pending { restarted: run_count > 1 },
        "R" | "E" | "B" | "U" => Sched::Running,
        "F" | "X" => {
            let code = exit.unwrap_or("?");
            Sched::Ended { ok: code == "0", how: format!("exit code {code}") }
        }
        _ => return None,
    })
}

fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let o = Command::new(program).args(args).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).to_string())
}

/// Asks the batch system; `None` where it does not answer (no such command, a job it has
/// forgotten).
fn ask(launcher: Launcher, id: &str) -> Option<Sched> {
    match launcher {
        Launcher::Local => None,
        Launcher::Slurm => {
            if let Some(t) = command_output("scontrol", &["show", "job", id]) {
                let restarts = field(&t, "Restarts").and_then(|r| r.parse().ok()).unwrap_or(0);
                if let Some(s) = slurm_state(field(&t, "JobState")?, field(&t, "ExitCode").unwrap_or(""), restarts) {
                    return Some(s);
                }
            }
            let t = command_output("sacct", &["-n", "-P", "-X", "-j", id, "-o", "State,ExitCode"])?;
            let line = t.lines().next()?;
            let (state, exit) = line.split_once('|')?;
            slurm_state(state, exit, 0)
        }
        Launcher::Pbs => {
            let t = command_output("qstat", &["-x", "-f", id])?;
            let attr =
                |name: &str| t.lines().find_map(|l| l.trim().strip_prefix(name).and_then(|v| v.trim().strip_prefix('=')).map(str::trim));
            pbs_state(attr("job_state")?, attr("Exit_status"), attr("run_count").and_then(|r| r.parse().ok()).unwrap_or(0))
        }
    }
}

/// `run.json`'s status: running, finished, preempted or failed.
fn run_status(run_dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(run_dir.join("run.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("status")?.as_str().map(str::to_string)
}

/// The last exit code the job's output reports.
pub fn last_exit_code(output: &str) -> Option<i32> {
    output
        .lines()
        .rev()
        .find_map(|l| l.split("exited with code ").nth(1).and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()))
}

/// The state from the three witnesses: the batch system's while it holds the job; once it has
/// ended (or the batch system does not answer), `run.json`'s, with the exit code the batch
/// system or the job's output gives.
pub fn decide(sched: Option<Sched>, run: Option<&str>, exit: Option<i32>) -> State {
    let failed = |how: Option<String>| State::Failed(how.or_else(|| exit.map(|c| format!("exit code {c}"))).unwrap_or_default());
    let ended_how = match &sched {
        Some(Sched::Pending { restarted: true }) | Some(Sched::Requeued) => return State::Requeued,
        Some(Sched::Pending { restarted: false }) => return State::Queued,
        Some(Sched::Running) => return State::Running,
        Some(Sched::Preempted) => return State::Preempted,
        Some(Sched::Ended { ok, how }) => Some((*ok, how.clone())),
        None => None,
    };
    match (run, ended_how) {
        (Some("finished"), _) => State::Done,
        (Some("preempted"), _) => State::Preempted,
        (Some("failed"), Some((_, how))) => failed(Some(how)),
        (Some("failed"), None) => failed(None),
        (_, Some((false, how))) => failed(Some(how)),
        // Ended well, but the run left no final status: it cannot have trained to its end.
        (_, Some((true, _))) if exit != Some(0) => failed(exit.map(|c| format!("exit code {c}"))),
        (_, Some((true, _))) => State::Done,
        (_, None) => match exit {
            Some(0) => State::Done,
            Some(_) => failed(None),
            None if run == Some("running") => State::Running,
            None => State::Queued,
        },
    }
}

/// One line per point and repeat.
pub fn status(out: &Path) -> Result<Vec<(ManifestRow, Option<Submitted>, State)>, String> {
    let rows = read_manifest(out)?;
    let launcher = launcher_of(out)?;
    let jobs = read_jobs(out)?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let job = jobs.iter().rev().find(|j| j.label == r.label && j.repeat == r.repeat).cloned();
            let state = match &job {
                None => State::NotSubmitted,
                Some(j) => {
                    let output = std::fs::read_to_string(r.job.parent().unwrap_or(out).join("job.out")).unwrap_or_default();
                    decide(ask(launcher, &j.job_id), run_status(&r.run_dir).as_deref(), last_exit_code(&output))
                }
            };
            (r, job, state)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_system_s_word_holds_while_it_holds_the_job() {
        assert_eq!(decide(slurm_state("PENDING", "0:0", 0), None, None), State::Queued);
        assert_eq!(decide(slurm_state("PENDING", "0:0", 1), Some("preempted"), Some(0)), State::Requeued);
        assert_eq!(decide(slurm_state("RUNNING", "0:0", 0), Some("running"), None), State::Running);
        assert_eq!(decide(pbs_state("Q", None, 2), None, None), State::Requeued);
        assert_eq!(decide(pbs_state("R", None, 1), None, None), State::Running);
    }

    #[test]
    fn an_ended_job_is_what_its_run_and_exit_code_say() {
        assert_eq!(decide(slurm_state("COMPLETED", "0:0", 0), Some("finished"), Some(0)), State::Done);
        assert_eq!(decide(slurm_state("FAILED", "2:0", 0), Some("failed"), Some(2)), State::Failed("exit code 2".into()));
        assert_eq!(decide(slurm_state("TIMEOUT", "0:15", 0), Some("running"), None), State::Failed("signal 15, TIMEOUT".into()));
        assert_eq!(decide(slurm_state("CANCELLED", "0:0", 0), None, None), State::Failed("CANCELLED".into()));
        assert_eq!(decide(pbs_state("F", Some("1"), 1), Some("failed"), None), State::Failed("exit code 1".into()));
        // The batch system has forgotten the job: run.json and the job's output decide.
        assert_eq!(decide(None, Some("finished"), Some(0)), State::Done);
        assert_eq!(decide(None, None, Some(2)), State::Failed("exit code 2".into()));
        assert_eq!(decide(None, Some("preempted"), Some(75)), State::Preempted);
        assert_eq!(decide(None, Some("running"), None), State::Running);
        assert_eq!(decide(None, None, None), State::Queued);
        // Exit 0 but no final status: the run did not end as a run ends.
        assert_eq!(decide(slurm_state("COMPLETED", "0:0", 0), Some("running"), Some(1)), State::Failed("exit code 1".into()));
    }

    #[test]
    fn the_last_exit_code_of_the_output_counts() {
        let out = "ndtrain exited with code 75: 2026-01-01\n+ scontrol requeue 4\nndtrain exited with code 2: 2026-01-01\n";
        assert_eq!(last_exit_code(out), Some(2));
        assert_eq!(last_exit_code("/o/p/job.sh exited with code 0\n"), Some(0));
        assert_eq!(last_exit_code("nothing"), None);
    }
}
