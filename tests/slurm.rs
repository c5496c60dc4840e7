//! `jobscripts/slurm/train.sbatch` against a real single-node Slurm (slurmctld, slurmd and munge
//! from Debian, started by `jobscripts/local/slurm-local.sh`): a job trains the tiny deck on 4 ranks
//! (FSDP=2×TP=2) under `srun` (PMIx: the cluster's `MpiDefault`, else `SRUN_MPI=pmix`),
//! checkpoints and logs every rank; a second job resumes from its checkpoint; a job of one task
//! with `--cpus-per-task=2` gives its rank 2 threads; a job signalled as before its time limit
//! checkpoints, requeues itself and finishes. A study of two points repeated twice, with a
//! walltime, an account and whole nodes, is submitted by `ndtrain sweep submit`: every job
//! carries those options, `jobs.csv` records it, `sweep status` tells done and failed (a point
//! whose data path is broken after submission), and the report job runs after them all. The
//! cluster is stopped whatever happens.

mod common;

use common::*;
use std::path::PathBuf;
use std::process::Command;

/// `$NDTRAIN_SLURM_LOCAL`, or the repository's `jobscripts/local/slurm-local.sh`.
fn slurm_local() -> PathBuf {
    match std::env::var_os("NDTRAIN_SLURM_LOCAL") {
        Some(p) => PathBuf::from(p),
        None => repo().join("jobscripts/local/slurm-local.sh"),
    }
}

/// Stops the cluster when the test ends, passed or failed.
struct Cluster(PathBuf);

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(&self.0).arg("stop").output();
    }
}

#[test]
fn a_slurm_job_trains_and_checkpoints_and_a_second_job_resumes() {
    let script = slurm_local();
    assert!(
        script.exists(),
        "{} not found: set NDTRAIN_SLURM_LOCAL to the slurm-local.sh that starts a single-node Slurm",
        script.display()
    );
    let start = Command::new(&script).arg("start").output().unwrap();
    let _cluster = Cluster(script.clone());
    assert!(start.status.success(), "slurm-local.sh start: {}", text(&start));
    // Open MPI as root and oversubscription inside the jobs, as the script recommends.
    let env_lines = Command::new(&script).arg("env").output().unwrap();
    let mut env: Vec<(String, String)> = String::from_utf8_lossy(&env_lines.stdout)
        .split_whitespace()
        .filter_map(|w| w.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect();
    // Debian's Open MPI speaks only PMIx to srun: the script leaves the plugin to the cluster's
    // MpiDefault unless SRUN_MPI names one.
    let mpi_default = config_value("MpiDefault");
    if !mpi_default.starts_with("pmix") {
        env.push(("SRUN_MPI".into(), "pmix".into()));
    }

    let dir = tempfile::tempdir().unwrap();
    a_study_runs_through_the_queue(&env, dir.path());

    let run = dir.path().join("run");
    let common = format!("optim.warmup_steps=2 parallel.tp=2 checkpoint.every=3 run.out_dir=\"{}\"", run.display());
    let (rc, log) = sbatch(&env, dir.path(), "first", &format!("run.steps=6 {common}"), &["--ntasks-per-node=4"]);
    assert_eq!(rc, 0, "{log}");
    // srun gets the job's --cpus-per-task (1, the script's default) and binds each task to cores.
    let srun = if mpi_default.starts_with("pmix") { "+ srun -c 1 --cpu-bind=cores" } else { "+ srun --mpi=pmix -c 1 --cpu-bind=cores" };
    assert!(log.contains(srun), "{srun}: {log}");
    assert!(run.join("ckpt/step_00000006.h5").exists() && run.join("ckpt/step_00000003.h5").exists(), "{log}");
    let mut ranks: Vec<String> =
        std::fs::read_dir(run.join("timing")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    ranks.sort();
    assert_eq!(ranks, ["rank_00000.csv", "rank_00001.csv", "rank_00002.csv", "rank_00003.csv"]);
    assert_eq!(losses(&run).1.len(), 6);
    assert!(std::fs::read_to_string(run.join("deck.toml"))
        .unwrap()
        .contains("for 4 ranks: layout pp=1 dp_replicate=1 dp_shard=2 cp=1 tp=2"));

    // The second job continues the same run to step 10 from the checkpoint of step 6.
    let (rc, log) = sbatch(&env, dir.path(), "second", &format!("run.steps=10 {common}"), &["--ntasks-per-node=4"]);
    assert_eq!(rc, 0, "{log}");
    assert!(log.contains("resumed from") && log.contains("step_00000006.h5"), "{log}");
    let (_, l) = losses(&run);
    assert_eq!(l.len(), 10, "one log of steps 1-10");
    assert!(run.join("ckpt/step_00000010.h5").exists());

    // One task with 2 CPUs: srun -c 2 gives the rank its 2 CPUs, and the automatic thread count
    // ([run] threads = 0, which the script leaves alone) is the CPUs of the rank's mask.
    two_cpus_per_task(&env, dir.path());

    // The requeue pattern: SIGUSR1 to the tasks (what --signal=USR1@120 sends before the time
    // limit) → checkpoint and exit 75 → the script requeues the job → it resumes and finishes.
    requeue_after_signal(&env, dir.path());
}

/// A study of the tiny deck on 1 and 2 ranks, each twice, submitted held (`--hold` through
/// `scheduler_options`) so that one job's deck can be broken before any starts.
fn a_study_runs_through_the_queue(env: &[(String, String)], dir: &std::path::Path) {
    let study = dir.join("queued.toml");
    std::fs::write(
        &study,
        format!(
            "[study]\nname = \"q\"\nbase = \"{}\"\nscaling = \"strong\"\nlauncher = \"slurm\"\nranks_per_node = 2\nranks = [1, 2]\nrepeats = 2\nwalltime = \"00:10:00\"\naccount = \"ndtrain_ci\"\nexclusive = true\nscheduler_options = [\"--hold\"]\n[set]\n\"run.steps\" = 3\n\"run.threads\" = 1\n\"optim.warmup_steps\" = 1\n",
            tiny_deck().display()
        ),
    )
    .unwrap();
    let out = dir.join("study");
    sweep_submit(env, &study, &out);
    let jobs: Vec<Vec<String>> = std::fs::read_to_string(out.join("jobs.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect();
    assert_eq!(jobs.len(), 4, "every job in jobs.csv: {jobs:?}");
    for j in &jobs {
        let (label, repeat, id) = (&j[0], &j[1], &j[2]);
        assert_eq!(j[3], out.join(format!("{label}/r{repeat}/job.sh")).display().to_string());
        // The options each job carries, as the controller holds them.
        assert_eq!(scontrol_field(id, "JobName"), format!("q_{label}_r{repeat}"));
        assert_eq!(scontrol_field(id, "TimeLimit"), "00:10:00", "job {id}");
        assert_eq!(scontrol_field(id, "Account"), "ndtrain_ci", "job {id}");
        assert_eq!(scontrol_field(id, "OverSubscribe"), "NO", "--exclusive: job {id}");
        assert_eq!(scontrol_field(id, "NumTasks"), if label == "ranks_1" { "1" } else { "2" }, "job {id}");
    }
    // The report job waits for every point, however they end.
    let report_jobs = std::fs::read_to_string(out.join("report_jobs.csv")).unwrap();
    let report_id = report_jobs.lines().nth(1).unwrap().split(',').next().unwrap().to_string();
    let ids: Vec<&str> = jobs.iter().map(|j| j[2].as_str()).collect();
    let dependency = scontrol_field(&report_id, "Dependency");
    assert!(ids.iter().all(|id| dependency.contains(&format!("afterany:{id}"))), "{dependency}");

    // A broken data path in one job's deck, after submission, before it starts.
    let broken = out.join("ranks_2/r2/deck.toml");
    let deck = std::fs::read_to_string(&broken).unwrap();
    let (head, data) = deck.split_once("[data]").unwrap();
    let data =
        data.replacen("source = \"synthetic\"", "source = \"bin\"", 1).replacen("path = \"\"", "path = \"/nonexistent/tokens.bin\"", 1);
    std::fs::write(&broken, format!("{head}[data]{data}")).unwrap();
    for id in &ids {
        assert!(Command::new("scontrol").args(["release", id]).status().unwrap().success());
    }
    let report_log = out.join("report.out");
    let status = || String::from_utf8_lossy(&sweep(env, &["status", out.to_str().unwrap()]).stdout).to_string();
    wait_for("the study's jobs and its report to end", 300, &report_log, || {
        std::fs::read_to_string(&report_log).is_ok_and(|l| l.contains("report --study"))
            && !status().contains("queued")
            && !status().contains("running")
    });
    let said = status();
    let line =
        |label: &str, r: usize| said.lines().find(|l| l.starts_with(label) && l.contains(&format!(" r{r} "))).unwrap_or("").to_string();
    for (label, r) in [("ranks_1", 1), ("ranks_1", 2), ("ranks_2", 1)] {
        assert!(line(label, r).ends_with(" done"), "{label} r{r}: {said}");
    }
    assert!(line("ranks_2", 2).contains(" failed (exit code "), "{said}");
    // The report is written all the same and names the failed repeat among those it left out
    // (the job failed before its run.json: the reason given is that it cannot be read).
    let log = std::fs::read_to_string(&report_log).unwrap();
    let listing = std::fs::read_to_string(out.join("report/study.md")).unwrap_or_default();
    assert!(listing.contains("ranks_2: repeat 2: "), "the report lists the failed point: {log}\n{listing}");
}

/// A value of `scontrol show config` (`Name = value`), empty if not listed.
fn config_value(name: &str) -> String {
    let o = Command::new("scontrol").args(["show", "config"]).output().unwrap();
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.split_once('=').filter(|(k, _)| k.trim() == name).map(|(_, v)| v.trim().to_string()))
        .unwrap_or_default()
}

/// CPUs this process may run on (`nproc`: its affinity mask).
fn nproc() -> usize {
    let o = Command::new("nproc").output().unwrap();
    String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
}

/// A job of one task with `--cpus-per-task=2`: the script passes `-c 2 --cpu-bind=cores` to srun
/// and no thread count, and the banner and rank 0's placement line show the rank's threads.
fn two_cpus_per_task(env: &[(String, String)], dir: &std::path::Path) {
    let run = dir.join("two_cpus");
    let sets = format!("run.steps=2 optim.warmup_steps=1 run.out_dir=\"{}\"", run.display());
    let (rc, log) = sbatch(env, dir, "two_cpus", &sets, &["--ntasks=1", "--ntasks-per-node=1", "--cpus-per-task=2"]);
    assert_eq!(rc, 0, "{log}");
    assert!(log.contains("1 tasks × 2 CPUs") && log.contains(" -c 2 --cpu-bind=cores "), "{log}");
    assert!(!log.contains("--set run.threads="), "the script leaves the thread count to ndtrain: {log}");
    // A task plugin that binds (task/affinity, task/cgroup) gives the task exactly its 2 CPUs;
    // task/none (this single-host cluster's, see slurm-local.sh) binds nothing, so the rank's mask
    // is every CPU of the machine: the same 2 on a 2-CPU machine.
    let binds = ["affinity", "cgroup"].iter().any(|p| config_value("TaskPlugin").contains(p));
    let threads = if binds { 2 } else { nproc() };
    assert!(log.contains(&format!("| 1 ranks × {threads} threads |")), "{threads} threads: {log}");
    assert!(
        log.lines().any(|l| l.starts_with("placement: ")
            && l.contains(" rank 0: cpus ")
            && l.ends_with(&format!(", {threads} threads, gpu none"))),
        "rank 0's placement line with {threads} threads: {log}"
    );
    assert_eq!(losses(&run).1.len(), 2, "{log}");
}

fn scontrol_field(job: &str, field: &str) -> String {
    let o = Command::new("scontrol").args(["show", "job", job]).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    text.split_whitespace().find_map(|w| w.strip_prefix(&format!("{field}=")).map(str::to_string)).unwrap_or_default()
}

fn wait_for(what: &str, secs: u64, log: &std::path::Path, mut done: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(
            start.elapsed().as_secs() < secs,
            "timed out after {secs} s waiting for {what}; job output:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

fn requeue_after_signal(env: &[(String, String)], dir: &std::path::Path) {
    let run = dir.join("requeued");
    let job_out = dir.join("requeued.out");
    // 100 steps of at least 0.1 s each (a debug delay): the run is still going when the signal
    // lands, however fast the machine.
    let sets = format!("run.steps=100 optim.warmup_steps=2 parallel.dp_shard=2 run.out_dir=\"{}\"", run.display());
    let o = Command::new("sbatch")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .args(["--parsable", "--ntasks-per-node=2", "--job-name=requeued"])
        .arg(format!("--chdir={}", repo().display()))
        .arg(format!("--output={}", job_out.display()))
        .arg(format!(
            "--export=ALL,DECK={},NDTRAIN={},SETS={sets},{}=100",
            tiny_deck().display(),
            bin(),
            ndtrain::run::faults::STEP_DELAY_ENV
        ))
        .arg(repo().join("jobscripts/slurm/train.sbatch"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let job = String::from_utf8_lossy(&o.stdout).trim().to_string();
    let rows = || std::fs::read_to_string(run.join("metrics.csv")).map(|s| s.lines().count().saturating_sub(1)).unwrap_or(0);
    wait_for("the job to log 3 steps", 60, &job_out, || rows() >= 3);
    assert!(Command::new("scancel").args(["--signal=USR1", &job]).status().unwrap().success());
    let log = || std::fs::read_to_string(&job_out).unwrap_or_default();
    wait_for("the job to requeue itself", 60, &job_out, || {
        scontrol_field(&job, "Restarts") == "1" && scontrol_field(&job, "JobState") == "PENDING"
    });
    // Slurm makes a requeued job eligible again only after its credentials expire (CredExpire,
    // 120 s by default), whatever its StartTime says: the test waits as a real job would.
    wait_for("the requeued job to start", 240, &job_out, || log().contains("(restart 1)"));
    wait_for("the requeued job to finish", 120, &job_out, || log().contains("ndtrain exited with code 0"));
    let log = log();
    assert!(log.contains("exiting with code 75") && log.contains(&format!("scontrol requeue {job}")), "{log}");
    assert!(log.contains("(restart 1)") && log.contains("resumed from"), "{log}");
    assert_eq!(losses(&run).1.len(), 100, "{log}");
}
