//! `jobscripts/slurm/train.sbatch` against a real single-node Slurm (slurmctld, slurmd and munge
//! from Debian, started by `jobscripts/local/slurm-local.sh`): a job trains the tiny deck on 4 ranks
//! (FSDP=2×TP=2) with `srun --mpi=pmix`, checkpoints and logs every rank; a second job resumes
//! from its checkpoint. The cluster is stopped whatever happens.

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

/// `sbatch --wait` of the job script with `sets` as its `SETS`; returns the exit code and the
/// job's output.
fn sbatch(env: &[(String, String)], out: &std::path::Path, name: &str, sets: &str) -> (i32, String) {
    let job_out = out.join(format!("{name}.out"));
    let export = format!("ALL,DECK={},NDTRAIN={},SETS={sets}", tiny_deck().display(), bin());
    let o = Command::new("sbatch")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .args(["--wait", "--ntasks-per-node=4", "--time=00:10:00", &format!("--job-name={name}")])
        .arg(format!("--chdir={}", repo().display()))
        .arg(format!("--output={}", job_out.display()))
        .arg(format!("--export={export}"))
        .arg(repo().join("jobscripts/slurm/train.sbatch"))
        .output()
        .expect("sbatch runs");
    let log = std::fs::read_to_string(&job_out).unwrap_or_default();
    (o.status.code().unwrap_or(-1), format!("{}\n--- job output ---\n{log}", text(&o)))
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
    let env: Vec<(String, String)> = String::from_utf8_lossy(&env_lines.stdout)
        .split_whitespace()
        .filter_map(|w| w.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect();

    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let common = format!("optim.warmup_steps=2 parallel.tp=2 checkpoint.every=3 run.out_dir=\"{}\"", run.display());
    let (rc, log) = sbatch(&env, dir.path(), "first", &format!("run.steps=6 {common}"));
    assert_eq!(rc, 0, "{log}");
    assert!(log.contains("+ srun --mpi=pmix"), "{log}");
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
    let (rc, log) = sbatch(&env, dir.path(), "second", &format!("run.steps=10 {common}"));
    assert_eq!(rc, 0, "{log}");
    assert!(log.contains("resumed from") && log.contains("step_00000006.h5"), "{log}");
    let (_, l) = losses(&run);
    assert_eq!(l.len(), 10, "one log of steps 1-10");
    assert!(run.join("ckpt/step_00000010.h5").exists());

    // The requeue pattern: SIGUSR1 to the tasks (what --signal=USR1@120 sends before the time
    // limit) → checkpoint and exit 75 → the script requeues the job → it resumes and finishes.
    requeue_after_signal(&env, dir.path());
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
