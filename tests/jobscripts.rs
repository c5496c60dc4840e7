//! The job scripts: every one parses (`bash -n`) and those under `jobscripts/` pass
//! `shellcheck`; the PBS script runs real jobs under a fake PBS (a `$PBS_NODEFILE`, the job's
//! variables, Open MPI's `mpirun` as its `mpiexec`, and `qsub`/`qstat` stand-ins that record what
//! they were asked): 4 ranks from a nodefile, the threads per rank derived from the chunk, and a
//! SIGTERM to the script that checkpoints every rank, resubmits the job and is resumed by the
//! resubmitted job; the qsub options kept from `Submit_arguments`, the setup hook, Open MPI's
//! and HPE/Cray PALS's binding. And an installed ndtrain: the scripts of a copy of the install
//! prefix, run from another folder, find their deck, binary and setup file; and the Slurm
//! script's requeues capped by `MAX_REQUEUES`.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn scripts(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            scripts(&p, out);
        } else if matches!(p.extension().and_then(|e| e.to_str()), Some("sh" | "sbatch" | "pbs")) {
            out.push(p);
        }
    }
}

/// `bash -n` on every shell script of `jobscripts/` and `benches/`, and `shellcheck` (every
/// severity, style included) on every one of `jobscripts/`: no finding passes.
#[test]
fn every_job_script_parses_and_passes_shellcheck() {
    let mut all = vec![];
    scripts(&repo().join("jobscripts"), &mut all);
    let job_scripts = all.len();
    scripts(&repo().join("benches"), &mut all);
    assert!(job_scripts >= 7, "{all:?}");
    for s in &all {
        let o = Command::new("bash").arg("-n").arg(s).output().unwrap();
        assert!(o.status.success(), "{}: {}", s.display(), text(&o));
    }
    let o = Command::new("shellcheck")
        .args(["--severity=style", "--format=gcc"])
        .args(&all[..job_scripts])
        .output()
        .expect("shellcheck runs: install it (Debian package shellcheck; jobscripts/local/setup-debian.sh does)");
    assert!(o.status.success() && o.stdout.is_empty(), "shellcheck findings in jobscripts/:\n{}", text(&o));
}

/// A fake PBS job on this machine: a nodefile naming localhost once per rank, the variables PBS
/// sets, and `qsub` and `qstat` stand-ins first on `PATH`. `qsub` writes its arguments (one per
/// line) to `qsub.args` and its environment to `qsub.env`; `qstat -f` prints `qstat` (PBS's
/// format), or fails as where there is no qstat.
struct FakePbs {
    dir: tempfile::TempDir,
}

impl FakePbs {
    fn new(ranks: usize, qstat: Option<&str>) -> FakePbs {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("nodes"), "localhost\n".repeat(ranks)).unwrap();
        std::fs::create_dir(d.join("bin")).unwrap();
        let qsub = format!("#!/bin/sh\nprintf '%s\\n' \"$@\" > '{0}/qsub.args'\nenv > '{0}/qsub.env'\necho 43.pbs-test\n", d.display());
        let qstat = match qstat {
            Some(text) => {
                std::fs::write(d.join("qstat.txt"), text).unwrap();
                format!("#!/bin/sh\ncat '{}/qstat.txt'\n", d.display())
            }
            None => "#!/bin/sh\necho 'qstat: cannot connect to server' >&2\nexit 1\n".to_string(),
        };
        for (name, body) in [("qsub", qsub), ("qstat", qstat)] {
            let p = d.join("bin").join(name);
            std::fs::write(&p, body).unwrap();
            Command::new("chmod").arg("+x").arg(&p).status().unwrap();
        }
        FakePbs { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `bash <script>` in the job's environment, with `sets` as `SETS`.
    fn command(&self, script: &str, sets: &str) -> Command {
        self.command_at(&repo().join(script), sets)
    }

    /// `bash <path>` in the job's environment, as `command`.
    fn command_at(&self, script: &Path, sets: &str) -> Command {
        let mut cmd = Command::new("bash");
        mpi_env(&mut cmd).arg(script);
        // What the test machine's environment could add to a job's: none of it.
        for v in ["NCPUS", "OMP_NUM_THREADS", "THREADS", "RESUBMIT", "RESUBMIT_COUNT", "MAX_RESUBMITS", "JOBSCRIPT"] {
            cmd.env_remove(v);
        }
        let path = format!("{}:{}", self.path().join("bin").display(), std::env::var("PATH").unwrap_or_default());
        cmd.env("PATH", path)
            .env("PBS_NODEFILE", self.path().join("nodes"))
            .env("PBS_O_WORKDIR", repo())
            .env("PBS_JOBID", "42.pbs-test")
            .env("PBS_JOBNAME", "ndtrain")
            .env("MPIEXEC", "mpirun")
            .env("MPIEXEC_ARGS", "--oversubscribe")
            .env("NDTRAIN", bin())
            .env("DECK", tiny_deck())
            .env("SETS", sets);
        cmd
    }

    /// The arguments the fake `qsub` got, or `None` if it was not called.
    fn qsub_args(&self) -> Option<Vec<String>> {
        let text = std::fs::read_to_string(self.path().join("qsub.args")).ok()?;
        Some(text.lines().map(str::to_string).collect())
    }

    /// The value of `name` in the fake `qsub`'s environment.
    fn qsub_env(&self, name: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.path().join("qsub.env")).ok()?;
        text.lines().find_map(|l| l.strip_prefix(&format!("{name}=")).map(str::to_string))
    }
}

#[test]
fn the_pbs_script_runs_four_ranks_from_a_nodefile() {
    let pbs = FakePbs::new(4, None);
    let out = pbs.path().join("run");
    let sets = format!("run.steps=4 optim.warmup_steps=1 parallel.tp=2 checkpoint.every=4 run.out_dir=\"{}\"", out.display());
    let o = pbs.command("jobscripts/pbs/train.pbs", &sets).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let log = text(&o);
    assert!(log.contains("job 42.pbs-test (resubmission 0) on 1 node(s), 4 ranks"), "{log}");
    assert!(log.contains("+ mpirun -n 4 -hostfile"), "{log}");
    // Open MPI's mpirun binds each of up to 2 ranks to one core unless told otherwise.
    assert!(log.contains(" --bind-to none "), "{log}");
    assert_eq!(std::fs::read_dir(out.join("timing")).unwrap().count(), 4);
    assert_eq!(losses(&out).1.len(), 4);
    assert!(out.join("ckpt/step_00000004.h5").exists());
    // The layout the deck resolved on the nodefile's 4 ranks.
    assert!(std::fs::read_to_string(out.join("deck.toml")).unwrap().contains("dp_shard=2 cp=1 tp=2"));
    assert!(pbs.qsub_args().is_none(), "a finished job is not resubmitted");
}

/// Runs the PBS script for one step on 2 ranks; asserts success and that every rank was given
/// `threads` threads (the banner and rank 0's placement table); returns the log.
fn threads_of_pbs_job(pbs: &FakePbs, name: &str, env: &[(&str, &str)], threads: usize) -> String {
    let out = pbs.path().join(name);
    let sets = format!("run.steps=1 optim.warmup_steps=1 run.out_dir=\"{}\"", out.display());
    let mut cmd = pbs.command("jobscripts/pbs/train.pbs", &sets);
    // Open MPI's automatic binding would need threads × ranks cores: this machine may have 2.
    cmd.env("MPIEXEC_BIND", "--bind-to none");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let (o, timed_out) = output_within(&mut cmd, 120);
    let log = text(&o);
    assert!(!timed_out && o.status.success(), "{env:?}: {log}");
    assert!(log.contains(&format!("| 2 ranks × {threads} threads |")), "{env:?}: {log}");
    for rank in 0..2 {
        assert!(
            log.lines().any(|l| l.starts_with("placement: ")
                && l.contains(&format!(" rank {rank}: cpus "))
                && l.ends_with(&format!(", {threads} threads, gpu none"))),
            "{env:?}: no placement line for rank {rank} with {threads} threads: {log}"
        );
    }
    log
}

/// The threads per rank reach the binary from what PBS tells the job: `NCPUS` (a chunk's
/// `ncpus` when it asks no `ompthreads`) divided by the chunk's ranks in the nodefile; a
/// select statement's `ompthreads` (PBS then sets NCPUS to it: NCPUS / mpiprocs would be
/// wrong), read with `qstat -f` across a wrapped line; `THREADS` over both.
#[test]
fn the_pbs_script_derives_threads_per_rank_from_the_chunk() {
    // No qstat: NCPUS=4 over the 2 ranks of the first (only) node.
    let pbs = FakePbs::new(2, None);
    let log = threads_of_pbs_job(&pbs, "ncpus", &[("NCPUS", "4")], 2);
    assert!(log.contains("threads per rank: 2 (NCPUS=4 / 2 ranks on localhost)"), "{log}");

    // qstat: ompthreads=3 of the select statement (PBS sets NCPUS=OMP_NUM_THREADS=3).
    let qstat = "Job Id: 42.pbs-test\n    Job_Name = ndtrain\n    Resource_List.ncpus = 8\n    \
                 Resource_List.select = 1:ncpus=8:mpiprocs=2:ompthr\n\teads=3\n    Resource_List.walltime = 00:10:00\n";
    let pbs = FakePbs::new(2, Some(qstat));
    let log = threads_of_pbs_job(&pbs, "ompthreads", &[("NCPUS", "3"), ("OMP_NUM_THREADS", "3")], 3);
    assert!(log.contains("threads per rank: 3 (ompthreads of select=1:ncpus=8:mpiprocs=2:ompthreads=3)"), "{log}");

    // THREADS wins over what PBS says.
    let log = threads_of_pbs_job(&pbs, "threads", &[("NCPUS", "3"), ("THREADS", "1")], 1);
    assert!(log.contains("threads per rank: 1 (THREADS)"), "{log}");

    // Open MPI, binding left to the script: each rank on cores of its own, as many as its
    // threads (2 ranks × 1 thread fit any machine of 2 cores).
    let pbs = FakePbs::new(2, None);
    let log = threads_of_pbs_job(&pbs, "auto", &[("NCPUS", "2"), ("MPIEXEC_BIND", "auto")], 1);
    assert!(log.contains(" --map-by ppr:2:node:PE=1 --bind-to core "), "{log}");
    for rank in 0..2 {
        assert!(log.contains(&format!(" rank {rank}: cpus {rank}, 1 threads")), "rank {rank} bound to its own core: {log}");
    }
}

/// What PBS does at the walltime or on `qdel` (SIGTERM) to the job script alone: the script
/// passes the stop to the ranks through mpirun (as SIGUSR1, which Open MPI's mpirun forwards),
/// every rank stops at a step boundary with a checkpoint, ndtrain exits 75 and the script
/// resubmits itself with `qsub` (same script, resources, name, queue and settings, resubmission
/// count 1) and exits 0. The resubmitted job, run with the environment `qsub -v` passed,
/// resumes from that checkpoint and finishes the run.
#[test]
fn sigterm_to_the_pbs_script_checkpoints_resubmits_and_the_next_job_resumes() {
    let qstat = "Job Id: 42.pbs-test\n    Job_Name = ndtrain\n    Resource_List.place = pack\n    \
                 Resource_List.select = 1:ncpus=2:mpiprocs=2\n    Resource_List.walltime = 01:00:00\n";
    let pbs = FakePbs::new(2, Some(qstat));
    let out = pbs.path().join("run");
    let sets = format!("run.steps=200 checkpoint.every=200 optim.warmup_steps=2 parallel.dp_shard=2 run.out_dir=\"{}\"", out.display());
    let log_path = pbs.path().join("first.log");
    let log_file = std::fs::File::create(&log_path).unwrap();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    // 100 ms per step: the signal lands mid-run on any machine, however fast its steps are.
    let mut script = pbs
        .command("jobscripts/pbs/train.pbs", &sets)
        .env("PBS_O_QUEUE", "workq")
        .env(ndtrain::run::faults::STEP_DELAY_ENV, "100")
        .stdout(Stdio::from(log_file.try_clone().unwrap()))
        .stderr(Stdio::from(log_file))
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while steps_done(&out) < 3 {
        assert!(start.elapsed().as_secs() < 300, "the job never logged 3 steps in 300 s: {}", log());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // The script's process only, as PBS signals the job's session leader.
    assert!(Command::new("kill").args(["-TERM", &script.id().to_string()]).status().unwrap().success());
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = script.try_wait().unwrap() {
            break s;
        }
        if start.elapsed().as_secs() > 60 {
            let _ = script.kill();
            panic!("the script did not end within 60 s of SIGTERM: {}", log());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let first = log();
    assert_eq!(status.code(), Some(0), "exit 0 after resubmitting: {first}");
    assert!(first.contains("received SIGTERM: SIGUSR1 to mpirun"), "{first}");
    assert!(first.contains("ndtrain exited with code 75"), "{first}");

    // Every rank stopped at the same step and the checkpoint of that step is whole.
    let stopped_at = steps_done(&out);
    assert!((3..200).contains(&stopped_at), "stopped after step {stopped_at}: {first}");
    assert!(first.contains(&format!("checkpoint of step {stopped_at} written")), "{first}");
    let ckpt = format!("step_{stopped_at:08}.h5");
    assert_eq!(std::fs::read_to_string(out.join("ckpt/latest")).unwrap().trim(), ckpt);
    let verify = Command::new(bin()).args(["ckpt", "verify"]).arg(out.join("ckpt").join(&ckpt)).output().unwrap();
    assert!(verify.status.success(), "{}", text(&verify));
    for rank in 0..2 {
        let timing = std::fs::read_to_string(out.join(format!("timing/rank_{rank:05}.csv"))).unwrap();
        assert_eq!(timing.lines().count() - 1, stopped_at, "rank {rank}'s timing log");
    }

    // The resubmission: this script again, with the job's resources and the settings by name.
    let args = pbs.qsub_args().unwrap_or_else(|| panic!("qsub was not called: {first}"));
    let script_path = repo().join("jobscripts/pbs/train.pbs");
    assert_eq!(args.last().map(PathBuf::from), Some(script_path), "{args:?}");
    for pair in
        [["-N", "ndtrain"], ["-q", "workq"], ["-l", "select=1:ncpus=2:mpiprocs=2"], ["-l", "place=pack"], ["-l", "walltime=01:00:00"]]
    {
        assert!(args.windows(2).any(|w| w == pair), "qsub {pair:?} missing: {args:?}");
    }
    let names: Vec<String> = args
        .windows(2)
        .find(|w| w[0] == "-v")
        .map(|w| w[1].split(',').map(str::to_string).collect())
        .unwrap_or_else(|| panic!("no -v in {args:?}"));
    for name in ["DECK", "SETS", "RESUME", "NDTRAIN", "RESUBMIT_COUNT", "MAX_RESUBMITS"] {
        assert!(names.iter().any(|n| n == name), "{name} not passed on: {names:?}");
    }
    assert_eq!(pbs.qsub_env("RESUBMIT_COUNT").as_deref(), Some("1"));
    assert_eq!(pbs.qsub_env("SETS").as_deref(), Some(sets.as_str()));

    // The next job: the environment qsub -v passed (without the step delay), another job id.
    let mut next = pbs.command("jobscripts/pbs/train.pbs", &sets);
    next.env("PBS_JOBID", "43.pbs-test");
    for name in &names {
        let value = pbs.qsub_env(name).unwrap_or_else(|| panic!("{name} is not in qsub's environment"));
        next.env(name, value);
    }
    let (o, timed_out) = output_within(&mut next, 300);
    let second = text(&o);
    assert!(!timed_out && o.status.success(), "{second}");
    assert!(second.contains("job 43.pbs-test (resubmission 1)"), "{second}");
    assert!(second.contains("resumed from") && second.contains(&format!("{ckpt} (step {stopped_at},")), "{second}");
    assert_eq!(losses(&out).1.len(), 200, "one log of steps 1-200");
}

/// A job that stops with a checkpoint by itself (`run.max_walltime`, no signal) when the chain
/// has already been resubmitted `MAX_RESUBMITS` times: not submitted again, exit code 75.
#[test]
fn the_pbs_script_stops_resubmitting_after_max_resubmits() {
    let pbs = FakePbs::new(2, None);
    let out = pbs.path().join("run");
    let sets = format!("run.steps=200 run.max_walltime=1 parallel.dp_shard=2 run.out_dir=\"{}\"", out.display());
    let mut cmd = pbs.command("jobscripts/pbs/train.pbs", &sets);
    cmd.env("RESUBMIT_COUNT", "2").env("MAX_RESUBMITS", "2").env(ndtrain::run::faults::STEP_DELAY_ENV, "100");
    let (o, timed_out) = output_within(&mut cmd, 120);
    let log = text(&o);
    assert!(!timed_out, "{log}");
    assert_eq!(o.status.code(), Some(ndtrain::exit::PREEMPTED), "{log}");
    assert!(log.contains("not resubmitting: 2 resubmissions reached MAX_RESUBMITS=2"), "{log}");
    assert!(pbs.qsub_args().is_none(), "{log}");
    assert!(std::fs::read_to_string(out.join("ckpt/latest")).is_ok(), "{log}");
}

/// `train_gpu.pbs` runs `train.pbs` and, when the job stops with a checkpoint, resubmits itself
/// (the GPU resources are in its `#PBS` lines), with its device set once in `SETS`: a `run.device`
/// already there (a resubmitted job's, or the user's; `"cpu"` here, where there is no GPU) is
/// kept. The job stops by itself (`run.max_walltime`), without a signal.
#[test]
fn the_pbs_gpu_wrapper_resubmits_itself() {
    let pbs = FakePbs::new(2, None);
    let out = pbs.path().join("run");
    let sets = format!("run.device=\"cpu\" run.steps=200 run.max_walltime=1 parallel.dp_shard=2 run.out_dir=\"{}\"", out.display());
    let mut cmd = pbs.command("jobscripts/pbs/train_gpu.pbs", &sets);
    cmd.env(ndtrain::run::faults::STEP_DELAY_ENV, "100");
    let (o, timed_out) = output_within(&mut cmd, 120);
    let log = text(&o);
    assert!(!timed_out && o.status.success(), "{log}");
    assert!(log.contains("ndtrain exited with code 75"), "{log}");
    let args = pbs.qsub_args().unwrap_or_else(|| panic!("qsub was not called: {log}"));
    assert_eq!(args.last().map(PathBuf::from), Some(repo().join("jobscripts/pbs/train_gpu.pbs")), "{args:?}");
    assert_eq!(pbs.qsub_env("SETS").as_deref(), Some(sets.as_str()), "{log}");
    assert_eq!(pbs.qsub_env("RESUBMIT_COUNT").as_deref(), Some("1"));
    assert!(!args.iter().any(|a| a.split(',').any(|n| n == "JOBSCRIPT")), "the next job runs its own copy: {args:?}");
}

/// The GPU check script (`benches/gpu_check.sh`) on a machine without a GPU: it finds ndtrain,
/// says what it would run and stops with exit code 3 and "no GPU" before any check, writing no
/// result file. (On a machine with a GPU this would run the real checks: not here.)
#[test]
fn the_gpu_check_script_stops_cleanly_without_a_gpu() {
    let has_gpu = Command::new("nvidia-smi").arg("-L").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).starts_with("GPU "));
    if has_gpu {
        eprintln!("this machine has a GPU: run benches/gpu_check.sh itself");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new("bash").arg(repo().join("benches/gpu_check.sh")).env("NDTRAIN", bin()).env("OUT", dir.path()).output().unwrap();
    let log = text(&o);
    assert_eq!(o.status.code(), Some(3), "{log}");
    assert!(log.contains("no GPU on this machine") && log.contains("stopping before any"), "{log}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "a dry run writes no result: {log}");
}

/// Writes an executable script.
fn write_script(path: &Path, body: &str) {
    std::fs::write(path, body).unwrap();
    Command::new("chmod").arg("+x").arg(path).status().unwrap();
}

/// Every PBS script runs under bash whatever the site's default shell (`#PBS -S /bin/bash`).
#[test]
fn every_pbs_script_asks_for_bash() {
    let mut all = vec![];
    scripts(&repo().join("jobscripts"), &mut all);
    let pbs: Vec<&PathBuf> = all.iter().filter(|p| p.extension().is_some_and(|e| e == "pbs")).collect();
    assert!(pbs.len() >= 2, "{all:?}");
    for p in pbs {
        let text = std::fs::read_to_string(p).unwrap();
        assert!(text.lines().any(|l| l == "#PBS -S /bin/bash"), "{}", p.display());
    }
}

/// A PBS job submitted with the user's own qsub options (`-V -A proj -q debug -l ... -v
/// FOO=bar,DECK=...`), as `qstat -f` shows them in `Submit_arguments`, from a folder that holds
/// the deck and its `setup.sh`: the setup file is sourced (it puts a fake `ndtrain` wrapper on
/// `PATH`), and the resubmission passes every one of the user's options again, their `-v`
/// variables joined to the script's settings. A `NDTRAIN_SETUP` that names no file is an error.
#[test]
fn the_pbs_script_sources_the_setup_hook_and_resubmits_with_the_users_qsub_options() {
    let submit = tempfile::tempdir().unwrap();
    let s = submit.path();
    std::fs::copy(tiny_deck(), s.join("deck.toml")).unwrap();
    std::fs::create_dir(s.join("site")).unwrap();
    // The site's environment: ndtrain on PATH, as `spack load ndtrain` would put it.
    write_script(&s.join("site/ndtrain"), &format!("#!/bin/sh\nexec '{}' \"$@\"\n", bin()));
    std::fs::write(s.join("setup.sh"), format!("export PATH='{}':\"$PATH\"\nexport SITE_SETUP_DONE=1\n", s.join("site").display()))
        .unwrap();
    let qstat = format!(
        "Job Id: 42.pbs-test\n    Job_Name = ndtrain\n    Resource_List.select = 1:ncpus=2:mpiprocs=2\n    Submit_arguments = -V -A proj -q debug \
         -l walltime=00:30:00 -v FOO=bar,DECK=deck.toml\n\t {}\n",
        repo().join("jobscripts/pbs/train.pbs").display()
    );
    let pbs = FakePbs::new(2, Some(&qstat));
    let out = pbs.path().join("run");
    let sets = format!("run.steps=200 run.max_walltime=1 parallel.dp_shard=2 run.out_dir=\"{}\"", out.display());
    let mut cmd = pbs.command("jobscripts/pbs/train.pbs", &sets);
    cmd.env_remove("NDTRAIN").env("DECK", "deck.toml").env("PBS_O_WORKDIR", s).env(ndtrain::run::faults::STEP_DELAY_ENV, "100");
    let (o, timed_out) = output_within(&mut cmd, 120);
    let log = text(&o);
    assert!(!timed_out && o.status.success(), "{log}");
    assert!(log.contains(&format!("+ . {}/setup.sh", s.display())), "{log}");
    assert!(
        log.contains(&format!(" ndtrain train {}/deck.toml ", s.display())),
        "ndtrain from the setup's PATH, the deck from the submit folder: {log}"
    );
    let args = pbs.qsub_args().unwrap_or_else(|| panic!("qsub was not called: {log}"));
    for pair in [["-A", "proj"], ["-q", "debug"], ["-l", "walltime=00:30:00"]] {
        assert!(args.windows(2).any(|w| w == pair), "qsub {pair:?} missing: {args:?}");
    }
    assert!(args.iter().any(|a| a == "-V"), "{args:?}");
    let names = args.windows(2).find(|w| w[0] == "-v").map(|w| w[1].clone()).unwrap_or_default();
    assert!(names.split(',').any(|n| n == "FOO=bar"), "the user's variables go on: {names}");
    assert!(!names.split(',').any(|n| n == "DECK=deck.toml"), "DECK goes on with the job's (absolute) value: {names}");
    assert_eq!(pbs.qsub_env("DECK"), Some(format!("{}/deck.toml", s.display())));
    assert_eq!(pbs.qsub_env("SITE_SETUP_DONE").as_deref(), Some("1"));

    let mut cmd = pbs.command("jobscripts/pbs/train.pbs", &sets);
    cmd.env("NDTRAIN_SETUP", "missing.sh").env("PBS_O_WORKDIR", s);
    let o = cmd.output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains(&format!("NDTRAIN_SETUP=missing.sh: no such file ({}/missing.sh)", s.display())), "{}", text(&o));
}

/// On HPE/Cray PALS (`mpiexec --version` names PALS) the script launches with `--ppn` (ranks
/// per node), `--depth` (threads per rank) and `--cpu-bind depth`, without a host file. The
/// stand-in `mpiexec` records its arguments instead of starting ranks.
#[test]
fn the_pbs_script_launches_with_pals_options_on_cray() {
    let pbs = FakePbs::new(4, None);
    let args = pbs.path().join("mpiexec.args");
    write_script(
        &pbs.path().join("bin/mpiexec"),
        &format!(
            "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'mpiexec version 1.2.12 (PALS)'; exit 0; fi\nprintf '%s\\n' \"$@\" > '{}'\n",
            args.display()
        ),
    );
    let mut cmd = pbs.command("jobscripts/pbs/train.pbs", "run.steps=1");
    cmd.env("MPIEXEC", "mpiexec").env("MPIEXEC_ARGS", "").env("NCPUS", "8");
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let got: Vec<String> = std::fs::read_to_string(&args).unwrap().lines().map(str::to_string).collect();
    let at = got.iter().position(|a| a == bin()).unwrap_or_else(|| panic!("{got:?}"));
    assert_eq!(got[..at], ["-n", "4", "--ppn", "4", "--depth", "2", "--cpu-bind", "depth"], "{got:?}");
    assert!(!got.iter().any(|a| a == "-hostfile"), "{got:?}");
}

/// A copy of an install prefix (`bin/ndtrain`, `share/ndtrain/{jobscripts,inputs}`, as the
/// Spack recipe lays it out) in a folder outside the source tree.
fn install_prefix() -> tempfile::TempDir {
    let prefix = tempfile::tempdir().unwrap();
    let p = prefix.path();
    std::fs::create_dir_all(p.join("bin")).unwrap();
    std::fs::copy(bin(), p.join("bin/ndtrain")).unwrap();
    std::fs::create_dir_all(p.join("share/ndtrain")).unwrap();
    for d in ["jobscripts", "inputs"] {
        let o = Command::new("cp").arg("-r").arg(repo().join(d)).arg(p.join("share/ndtrain")).output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
    }
    prefix
}

/// The installed scripts, run from a folder that is neither the source tree nor the prefix:
/// the local launcher with a deck relative to that folder; the Slurm script as Slurm runs it
/// (a copy in a spool folder, its submitted path from a stand-in `scontrol`, mpirun as the
/// launcher) with its default deck; the PBS script (its submitted path from Submit_arguments)
/// with a relative deck. Each trains with the prefix's own binary.
#[test]
fn installed_job_scripts_run_from_any_folder() {
    let prefix = install_prefix();
    let p = prefix.path();
    let share = p.join("share/ndtrain");
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    std::fs::copy(tiny_deck(), w.join("my.toml")).unwrap();
    let installed_bin = format!("{}/bin/ndtrain", p.display());

    // The local launcher, from the work folder.
    let out = w.join("local");
    let mut cmd = Command::new("bash");
    mpi_env(&mut cmd)
        .arg(share.join("jobscripts/local/train.sh"))
        .args(["my.toml", "--set", "run.steps=2", "--set", "optim.warmup_steps=1", "--set"])
        .arg(format!("run.out_dir=\"{}\"", out.display()))
        .env_remove("NDTRAIN")
        .env("NRANKS", "2")
        .env("MPIRUN_ARGS", "--oversubscribe --bind-to none")
        .current_dir(w);
    let (o, timed_out) = output_within(&mut cmd, 120);
    assert!(!timed_out && o.status.success(), "{}", text(&o));
    assert!(text(&o).contains(&format!("-n 2 {installed_bin} train my.toml")), "{}", text(&o));
    assert_eq!(losses(&out).1.len(), 2);

    // Slurm: the job runs a spool copy; scontrol names the installed script.
    let fake = tempfile::tempdir().unwrap();
    let f = fake.path();
    std::fs::create_dir_all(f.join("bin")).unwrap();
    std::fs::create_dir_all(f.join("spool")).unwrap();
    std::fs::copy(share.join("jobscripts/slurm/train.sbatch"), f.join("spool/slurm_script")).unwrap();
    write_script(
        &f.join("bin/scontrol"),
        &format!(
            "#!/bin/sh\necho 'JobId=7 JobName=ndtrain'\necho '   Command={}'\necho '   WorkDir={}'\n",
            share.join("jobscripts/slurm/train.sbatch").display(),
            w.display()
        ),
    );
    let out = w.join("slurm");
    let mut cmd = Command::new("bash");
    mpi_env(&mut cmd)
        .arg(f.join("spool/slurm_script"))
        .env("PATH", format!("{}:{}", f.join("bin").display(), std::env::var("PATH").unwrap_or_default()))
        .env("SLURM_JOB_ID", "7")
        .env("SLURM_SUBMIT_DIR", w)
        .env("SLURM_NTASKS", "2")
        .env("LAUNCH", "mpirun")
        .env("MPIRUN_ARGS", "--oversubscribe --bind-to none")
        .env("SETS", format!("run.steps=2 optim.warmup_steps=1 run.out_dir=\"{}\"", out.display()))
        .env("REQUEUE", "0")
        .current_dir(f.join("spool"));
    for v in ["DECK", "NDTRAIN", "JOBSCRIPTS", "NDTRAIN_SETUP", "SLURM_CPUS_PER_TASK"] {
        cmd.env_remove(v);
    }
    let (o, timed_out) = output_within(&mut cmd, 120);
    assert!(!timed_out && o.status.success(), "{}", text(&o));
    assert!(text(&o).contains(&format!("{installed_bin} train {}/inputs/tiny.toml", share.display())), "{}", text(&o));
    assert_eq!(losses(&out).1.len(), 2);

    // PBS: the submitted path in Submit_arguments, relative to PBS_O_WORKDIR.
    let qstat =
        format!("Job Id: 42.pbs-test\n    Submit_arguments = -v DECK=my.toml {}\n", share.join("jobscripts/pbs/train.pbs").display());
    let pbs = FakePbs::new(2, Some(&qstat));
    let out = w.join("pbs");
    let sets = format!("run.steps=2 optim.warmup_steps=1 run.out_dir=\"{}\"", out.display());
    std::fs::create_dir_all(pbs.path().join("spool")).unwrap();
    let copy = pbs.path().join("spool/42.pbs-test.SC");
    std::fs::copy(share.join("jobscripts/pbs/train.pbs"), &copy).unwrap();
    let mut cmd = pbs.command_at(&copy, &sets);
    cmd.env_remove("NDTRAIN").env("DECK", "my.toml").env("PBS_O_WORKDIR", w).env("MPIEXEC_BIND", "--bind-to none").current_dir(pbs.path());
    let (o, timed_out) = output_within(&mut cmd, 120);
    assert!(!timed_out && o.status.success(), "{}", text(&o));
    assert!(text(&o).contains(&format!("{installed_bin} train {}/my.toml", w.display())), "{}", text(&o));
    assert_eq!(losses(&out).1.len(), 2);
}

/// The Slurm script as Slurm runs it (a spool copy; a stand-in `scontrol` that names the
/// submitted script and records `requeue`), its job stopped with a checkpoint by itself
/// (`run.max_walltime`): requeued while `SLURM_RESTART_COUNT` is below `MAX_REQUEUES`, not at it
/// (exit 75, the checkpoint kept).
#[test]
fn the_slurm_script_requeues_at_most_max_requeues_times() {
    let fake = tempfile::tempdir().unwrap();
    let f = fake.path();
    std::fs::create_dir_all(f.join("bin")).unwrap();
    std::fs::create_dir_all(f.join("spool")).unwrap();
    std::fs::copy(repo().join("jobscripts/slurm/train.sbatch"), f.join("spool/slurm_script")).unwrap();
    let requeued = f.join("requeued");
    write_script(
        &f.join("bin/scontrol"),
        &format!(
            "#!/bin/sh\nif [ \"$1\" = requeue ]; then echo \"$2\" >> '{}'; exit 0; fi\necho '   Command={}'\n",
            requeued.display(),
            repo().join("jobscripts/slurm/train.sbatch").display()
        ),
    );
    let job = |restarts: &str, name: &str| {
        let out = f.join(name);
        let mut cmd = Command::new("bash");
        mpi_env(&mut cmd)
            .arg(f.join("spool/slurm_script"))
            .env("PATH", format!("{}:{}", f.join("bin").display(), std::env::var("PATH").unwrap_or_default()))
            .env("SLURM_JOB_ID", "9")
            .env("SLURM_RESTART_COUNT", restarts)
            .env("MAX_REQUEUES", "2")
            .env("SLURM_SUBMIT_DIR", f)
            .env("SLURM_NTASKS", "2")
            .env("LAUNCH", "mpirun")
            .env("MPIRUN_ARGS", "--oversubscribe --bind-to none")
            .env("NDTRAIN", bin())
            .env("DECK", tiny_deck())
            .env("SETS", format!("run.steps=200 run.max_walltime=1 parallel.dp_shard=2 run.out_dir=\"{}\"", out.display()))
            .env(ndtrain::run::faults::STEP_DELAY_ENV, "100")
            .current_dir(f.join("spool"));
        for v in ["JOBSCRIPTS", "NDTRAIN_SETUP", "SLURM_CPUS_PER_TASK", "REQUEUE"] {
            cmd.env_remove(v);
        }
        let (o, timed_out) = output_within(&mut cmd, 120);
        assert!(!timed_out, "{}", text(&o));
        o
    };
    let o = job("1", "first");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("requeue 2 of at most 2 resumes from it"), "{}", text(&o));
    assert_eq!(std::fs::read_to_string(&requeued).unwrap().trim(), "9");

    std::fs::remove_file(&requeued).unwrap();
    let o = job("2", "second");
    assert_eq!(o.status.code(), Some(ndtrain::exit::PREEMPTED), "{}", text(&o));
    assert!(text(&o).contains("not requeueing: 2 requeues reached MAX_REQUEUES=2"), "{}", text(&o));
    assert!(!requeued.exists(), "{}", text(&o));
    assert!(f.join("second/ckpt/latest").exists(), "{}", text(&o));
}
