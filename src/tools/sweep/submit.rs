//! `ndtrain sweep submit DIR`: queues every job of a written study that `jobs.csv` does not hold
//! yet (`job.sh`: `sbatch --parsable` / `qsub`), recording each as soon as it is queued, so that
//! a refused job or an interrupted call loses nothing and a second call submits only what is
//! missing. Then it queues `report.sh` to start after every job, however they end. With the
//! local launcher it runs the jobs and the report here, one after another.

use super::study::Launcher;
use super::{launcher_of, read_manifest};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// The manifest of submitted jobs.
pub const JOBS_CSV: &str = "jobs.csv";
pub const JOBS_HEADER: &str = "label,repeat,job_id,script";
/// The report jobs queued so far, each with the jobs it waits for.
pub const REPORT_JOBS_CSV: &str = "report_jobs.csv";
/// The script that queues `report.sh` after the jobs given to it.
pub const SUBMIT_REPORT: &str = "submit_report.sh";

/// A row of `jobs.csv`.
#[derive(Debug, Clone, PartialEq)]
pub struct Submitted {
    pub label: String,
    pub repeat: usize,
    pub job_id: String,
    pub script: String,
}

/// Reads `<out>/jobs.csv` (none yet: no job submitted).
pub fn read_jobs(out: &Path) -> Result<Vec<Submitted>, String> {
    let path = out.join(JOBS_CSV);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let mut lines = text.lines();
    if lines.next() != Some(JOBS_HEADER) {
        return Err(format!("{}: the first line is not \"{JOBS_HEADER}\"", path.display()));
    }
    lines
        .enumerate()
        .filter(|(_, l)| !l.is_empty())
        .map(|(i, l)| {
            let f: Vec<&str> = l.splitn(4, ',').collect();
            let bad = || format!("{} line {}: \"{l}\" is not {JOBS_HEADER}", path.display(), i + 2);
            if f.len() != 4 {
                return Err(bad());
            }
            Ok(Submitted { label: f[0].into(), repeat: f[1].parse().map_err(|_| bad())?, job_id: f[2].into(), script: f[3].into() })
        })
        .collect()
}

/// Appends one line to `file` (with `header` first when the file is new), flushed at once.
fn append(file: &Path, header: &str, line: &str) -> Result<(), String> {
    let new = !file.exists();
    let mut f =
        std::fs::OpenOptions::new().create(true).append(true).open(file).map_err(|e| format!("cannot open {}: {e}", file.display()))?;
    let text = if new { format!("{header}\n{line}\n") } else { format!("{line}\n") };
    f.write_all(text.as_bytes()).and_then(|_| f.sync_data()).map_err(|e| format!("cannot write {}: {e}", file.display()))
}

/// The job id a submission printed: its last line (`sbatch --parsable` adds `;cluster` on a
/// federation, which the id does not include).
fn job_id(stdout: &str) -> Option<String> {
    let last = stdout.lines().map(str::trim).rfind(|l| !l.is_empty())?;
    let id = last.split(';').next().unwrap_or(last).trim();
    (!id.is_empty() && !id.contains(char::is_whitespace) && !id.contains(',')).then(|| id.to_string())
}

/// The outcome of one call.
#[derive(Debug, Default)]
pub struct Outcome {
    /// What was done, one line each.
    pub lines: Vec<String>,
    /// Jobs refused by the batch system (or, here, that failed), and a report that could not
    /// be queued or written.
    pub failures: usize,
}

/// Runs `script` with its stdout captured and its stderr passed on; `log` (when given)
/// receives both instead.
fn run_script(script: &Path, cwd: &Path, log: Option<&Path>) -> Result<(std::process::ExitStatus, String), String> {
    let mut cmd = Command::new("bash");
    cmd.arg(script).current_dir(cwd).stdin(Stdio::null());
    if let Some(log) = log {
        let f =
            std::fs::OpenOptions::new().create(true).append(true).open(log).map_err(|e| format!("cannot open {}: {e}", log.display()))?;
        let f2 = f.try_clone().map_err(|e| e.to_string())?;
        cmd.stdout(f).stderr(f2);
        let status = cmd.status().map_err(|e| format!("cannot run {}: {e}", script.display()))?;
        let mut f = std::fs::OpenOptions::new().append(true).open(log).map_err(|e| e.to_string())?;
        let code = status.code().map(|c| c.to_string()).unwrap_or_else(|| "a signal".into());
        writeln!(f, "{} exited with code {code}", script.display()).map_err(|e| e.to_string())?;
        return Ok((status, String::new()));
    }
    let o = cmd.stderr(Stdio::piped()).output().map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    let err = String::from_utf8_lossy(&o.stderr);
    // The submission command's own echo is noise on success; the batch system's message is
    // what a refused job needs.
    let said: Vec<&str> = err.lines().filter(|l| !l.starts_with("+ ")).collect();
    if !o.status.success() {
        return Err(format!("{} (exit code {})", said.join(" / ").trim(), o.status.code().unwrap_or(-1)));
    }
    Ok((o.status, String::from_utf8_lossy(&o.stdout).to_string()))
}

/// Submits (or runs) what `jobs.csv` lacks, then the report after all jobs.
pub fn submit(out: &Path) -> Result<Outcome, String> {
    let rows = read_manifest(out)?;
    let launcher = launcher_of(out)?;
    let done = read_jobs(out)?;
    let jobs_csv = out.join(JOBS_CSV);
    let mut o = Outcome::default();
    let mut new = 0;
    for r in &rows {
        let key = format!("{} r{}", r.label, r.repeat);
        if let Some(d) = done.iter().find(|d| d.label == r.label && d.repeat == r.repeat) {
            o.lines.push(format!("{key}: already submitted (job {})", d.job_id));
            continue;
        }
        let id = match launcher {
            Launcher::Local => {
                let log = r.job.parent().unwrap_or(out).join("job.out");
                match run_script(&r.job, out, Some(&log)) {
                    Ok((status, _)) if status.success() => Ok("local".to_string()),
                    Ok((status, _)) => {
                        // It ran: recorded, so that a second call does not run it again.
                        append(&jobs_csv, JOBS_HEADER, &format!("{},{},local,{}", r.label, r.repeat, r.job.display()))?;
                        o.failures += 1;
                        o.lines.push(format!("{key}: failed with exit code {} (see {})", status.code().unwrap_or(-1), log.display()));
                        new += 1;
                        continue;
                    }
                    Err(e) => Err(e),
                }
            }
            _ => run_script(&r.job, out, None)
                .and_then(|(_, stdout)| job_id(&stdout).ok_or_else(|| format!("no job id in what it printed: \"{}\"", stdout.trim()))),
        };
        match id {
            Ok(id) => {
                append(&jobs_csv, JOBS_HEADER, &format!("{},{},{id},{}", r.label, r.repeat, r.job.display()))?;
                o.lines.push(if launcher == Launcher::Local { format!("{key}: ran") } else { format!("{key}: submitted, job {id}") });
                new += 1;
            }
            Err(e) => {
                o.failures += 1;
                o.lines.push(format!("{key}: refused: {e}"));
            }
        }
    }
    let all = read_jobs(out)?;
    let reports = out.join(REPORT_JOBS_CSV);
    if all.is_empty() {
        o.lines.push("report: not queued, no job was submitted".into());
        o.failures += 1;
    } else if new == 0 && reports.exists() {
        o.lines.push(format!("report: already queued (see {})", reports.display()));
    } else if launcher == Launcher::Local {
        let log = out.join("report.out");
        let (status, _) = run_script(&out.join("report.sh"), out, Some(&log))?;
        if status.success() {
            o.lines.push(format!("report: written (see {})", log.display()));
        } else {
            o.failures += 1;
            o.lines.push(format!("report: report.sh failed with exit code {} (see {})", status.code().unwrap_or(-1), log.display()));
        }
        append(&reports, "job_id,after", &format!("local,{}", all.len()))?;
    } else {
        let ids: Vec<&str> = all.iter().map(|j| j.job_id.as_str()).collect();
        let deps = ids.join(":");
        let script = out.join(SUBMIT_REPORT);
        let mut cmd = Command::new("bash");
        cmd.arg(&script).arg(&deps).current_dir(out).stdin(Stdio::null());
        let r = cmd.output().map_err(|e| format!("cannot run {}: {e}", script.display()))?;
        match job_id(&String::from_utf8_lossy(&r.stdout)).filter(|_| r.status.success()) {
            Some(id) => {
                append(&reports, "job_id,after", &format!("{id},{deps}"))?;
                o.lines.push(format!("report: job {id}, after {} jobs (afterany)", ids.len()));
            }
            None => {
                o.failures += 1;
                let err = String::from_utf8_lossy(&r.stderr);
                o.lines.push(format!(
                    "report: refused: {} (run {} by hand when the jobs have ended)",
                    err.trim(),
                    out.join("report.sh").display()
                ));
            }
        }
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_id_is_the_last_line_without_its_cluster() {
        assert_eq!(job_id("123\n").as_deref(), Some("123"));
        assert_eq!(job_id("123;cluster2\n").as_deref(), Some("123"));
        assert_eq!(job_id("43.pbs-test\n\n").as_deref(), Some("43.pbs-test"));
        assert_eq!(job_id("Submitted batch job 12\n"), None);
        assert_eq!(job_id(""), None);
    }
}
