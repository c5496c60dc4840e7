//! The batch job's own time limit, for `[run] stop_before_job_end`: how many seconds the job
//! has left, asked of its scheduler once at start. Slurm: `SLURM_JOB_END_TIME` where the
//! scheduler exports it, else `squeue -h -j $SLURM_JOB_ID -o %L` (the time left). PBS:
//! `PBS_WALLTIME` (Torque exports the limit in seconds), else `qstat -f $PBS_JOBID`'s
//! `Resource_List.walltime` minus `resources_used.walltime`. The training loop then stops as it
//! does before `[run] max_walltime` (`preempt::walltime_exceeded`).

use std::process::Command;

/// Seconds in `[days-]hours:minutes:seconds`, `minutes:seconds` or `seconds` (Slurm's `%L`
/// and PBS's walltime formats); `None` for `UNLIMITED`, `NOT_SET`, `INVALID` or anything else.
pub fn parse_duration(text: &str) -> Option<f64> {
    let text = text.trim();
    let (days, clock) = match text.split_once('-') {
        Some((d, rest)) => (d.parse::<u64>().ok()?, rest),
        None => (0, text),
    };
    let mut seconds = 0u64;
    let fields: Vec<&str> = clock.split(':').collect();
    if fields.is_empty() || fields.len() > 3 || fields.iter().any(|f| f.is_empty() || !f.bytes().all(|b| b.is_ascii_digit())) {
        return None;
    }
    for f in &fields {
        seconds = seconds.checked_mul(60)?.checked_add(f.parse::<u64>().ok()?)?;
    }
    Some((days * 86_400 + seconds) as f64)
}

/// A `key = value` line of `qstat -f` output.
fn qstat_field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once('=')?;
        (k.trim() == key).then_some(v.trim())
    })
}

/// Seconds left from `qstat -f` output: the limit minus the time used (0 used if not listed).
pub fn pbs_seconds_left(qstat: &str) -> Option<f64> {
    let limit = parse_duration(qstat_field(qstat, "Resource_List.walltime")?)?;
    let used = qstat_field(qstat, "resources_used.walltime").and_then(parse_duration).unwrap_or(0.0);
    Some((limit - used).max(0.0))
}

fn run(cmd: &str, args: &[&str]) -> Result<String, String> {
    let o = Command::new(cmd).args(args).output().map_err(|e| format!("`{cmd} {}` could not run: {e}", args.join(" ")))?;
    if !o.status.success() {
        return Err(format!("`{cmd} {}` failed ({}): {}", args.join(" "), o.status, String::from_utf8_lossy(&o.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// The seconds this batch job has left and where that came from; `Ok(None)` when the job has
/// no limit; an error outside a batch job or when the scheduler cannot be asked.
pub fn seconds_left() -> Result<Option<(f64, String)>, String> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if let Some(job) = env("SLURM_JOB_ID") {
        if let Some(end) = env("SLURM_JOB_END_TIME").and_then(|e| e.parse::<u64>().ok()) {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            return Ok(Some((end.saturating_sub(now) as f64, format!("Slurm job {job}: SLURM_JOB_END_TIME"))));
        }
        let left = run("squeue", &["-h", "-j", &job, "-o", "%L"])?;
        let source = format!("Slurm job {job}: squeue -o %L = {}", left.trim());
        return Ok(parse_duration(&left).map(|s| (s, source)));
    }
    if let Some(job) = env("PBS_JOBID") {
        if let Some(limit) = env("PBS_WALLTIME").and_then(|w| parse_duration(&w)) {
            // Torque's variable is the whole limit: the job script started moments ago.
            return Ok(Some((limit, format!("PBS job {job}: PBS_WALLTIME"))));
        }
        let text = run("qstat", &["-f", &job])?;
        return Ok(pbs_seconds_left(&text).map(|s| (s, format!("PBS job {job}: qstat -f walltime limit minus used"))));
    }
    Err("[run] stop_before_job_end = true, but this is not a Slurm or PBS batch job (neither SLURM_JOB_ID nor PBS_JOBID is set)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_durations_parse() {
        assert_eq!(parse_duration("59:23"), Some(3563.0));
        assert_eq!(parse_duration("1:00:00"), Some(3600.0));
        assert_eq!(parse_duration("2-03:04:05"), Some(2.0 * 86400.0 + 3.0 * 3600.0 + 4.0 * 60.0 + 5.0));
        assert_eq!(parse_duration("45\n"), Some(45.0));
        for none in ["UNLIMITED", "NOT_SET", "INVALID", "", "1:2:3:4", "1::2", "-5"] {
            assert_eq!(parse_duration(none), None, "{none:?}");
        }
        let qstat = "Job Id: 12.pbs\n    Resource_List.walltime = 01:00:00\n    resources_used.walltime = 00:10:30\n";
        assert_eq!(pbs_seconds_left(qstat), Some(3600.0 - 630.0));
        assert_eq!(pbs_seconds_left("    Resource_List.walltime = 00:05:00\n"), Some(300.0));
        assert_eq!(pbs_seconds_left("Job Id: 12.pbs\n"), None);
    }
}
