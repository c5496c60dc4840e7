//! `ndtrain sweep` end to end: a local study with two repeats per point written, run by `sweep
//! submit`, reported on and told by `sweep status`; a PBS study's scripts (bash -n, ShellCheck,
//! the queue options and the setup hook) submitted to a fake `qsub` that refuses one job; a study
//! refused for a file it would read that does not exist; the GPU job script for a cuda deck; the
//! job scripts found outside the source tree; and every shipped study expanded for its batch
//! system.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn sweep(cwd: &Path, args: &[&str]) -> std::process::Output {
    mpi_env(&mut Command::new(bin())).current_dir(cwd).arg("sweep").args(args).env("NDTRAIN", bin()).output().unwrap()
}

fn write_study(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, format!("[study]\nname = \"{name}\"\nbase = \"{}\"\n{body}", tiny_deck().display())).unwrap();
    p
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).lines().map(str::to_string).collect()
}

/// Whether the `report` subcommand reads a study's folder (`--study`).
fn report_reads_studies() -> bool {
    let o = Command::new(bin()).args(["report", "--help"]).output().unwrap();
    String::from_utf8_lossy(&o.stdout).contains("--study")
}

#[test]
fn a_local_study_with_repeats_runs_each_point_twice_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let study = write_study(
        dir.path(),
        "rep",
        "scaling = \"strong\"\nlauncher = \"local\"\nranks_per_node = 2\nranks = [1, 2]\nrepeats = 2\n[set]\n\"run.steps\" = 4\n\"run.threads\" = 1\n\"optim.warmup_steps\" = 1\n",
    );
    let out = dir.path().join("out");
    let o = sweep(&repo(), &[study.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    // The manifest: one row per point and repeat, absolute paths, the job named by its label.
    let rows = lines(&out.join("points.csv"));
    assert_eq!(rows[0], "label,ranks,repeat,run_dir,deck,job");
    assert_eq!(rows.len(), 5, "{rows:?}");
    for (row, (label, ranks, r)) in rows[1..].iter().zip([("ranks_1", 1, 1), ("ranks_1", 1, 2), ("ranks_2", 2, 1), ("ranks_2", 2, 2)]) {
        let (run_dir, job_dir) = (out.join(format!("runs/{label}/r{r}")), out.join(format!("{label}/r{r}")));
        let expect = format!(
            "{label},{ranks},{r},{},{},{}",
            run_dir.display(),
            job_dir.join("deck.toml").display(),
            job_dir.join("job.sh").display()
        );
        assert_eq!(row, &expect);
        let deck = std::fs::read_to_string(job_dir.join("deck.toml")).unwrap();
        assert!(
            deck.contains(&format!("name = \"rep_{label}_r{r}\"")) && deck.contains(&format!("out_dir = \"{}\"", run_dir.display())),
            "{deck}"
        );
    }
    let status = sweep(dir.path(), &["status", out.to_str().unwrap()]);
    assert!(status.status.success(), "{}", text(&status));
    let said = String::from_utf8_lossy(&status.stdout).to_string();
    assert_eq!(said.lines().filter(|l| l.ends_with("not submitted")).count(), 4, "{said}");

    // Without NDTRAIN, the jobs run the binary that wrote the study, and the report `ndtrain` on PATH.
    let path = format!("{}:{}", Path::new(bin()).parent().unwrap().display(), std::env::var("PATH").unwrap());
    let submit = mpi_env(&mut Command::new(bin()))
        .current_dir(dir.path())
        .env_remove("NDTRAIN")
        .env_remove("NDTRAIN_BIN")
        .env("PATH", path)
        .args(["sweep", "submit", out.to_str().unwrap()])
        .output()
        .unwrap();
    let jobs = lines(&out.join("jobs.csv"));
    assert_eq!(jobs[0], "label,repeat,job_id,script");
    assert_eq!(jobs.len(), 5, "{jobs:?}\n{}", text(&submit));
    for label in ["ranks_1", "ranks_2"] {
        for r in [1, 2] {
            let run = out.join(format!("runs/{label}/r{r}"));
            assert_eq!(losses(&run).1.len(), 4, "{}", run.display());
            let run_json = std::fs::read_to_string(run.join("run.json")).unwrap();
            assert!(run_json.contains("\"status\": \"finished\""), "{run_json}");
            assert!(jobs.contains(&format!("{label},{r},local,{}", out.join(format!("{label}/r{r}/job.sh")).display())), "{jobs:?}");
        }
    }
    // The report ran after the points: `ndtrain report --study <out>`.
    let report_log = std::fs::read_to_string(out.join("report.out")).unwrap();
    assert!(report_log.contains(&format!("report --study {}", out.display())), "{report_log}");
    if report_reads_studies() {
        assert!(submit.status.success(), "{}", text(&submit));
        assert!(out.join("report").is_dir(), "{report_log}");
    } else {
        // Until `report` reads a study's folder, report.sh fails and submit says so.
        assert_eq!(submit.status.code(), Some(1), "{}", text(&submit));
        assert!(text(&submit).contains("report: report.sh failed with exit code 2"), "{}", text(&submit));
    }
    let status = sweep(dir.path(), &["status", out.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&status.stdout).to_string();
    assert_eq!(said.lines().filter(|l| l.ends_with(" done") && l.contains("job local")).count(), 4, "{said}");

    // A second call submits only what is missing: nothing.
    let again = sweep(dir.path(), &["submit", out.to_str().unwrap()]);
    assert!(again.status.success(), "{}", text(&again));
    assert_eq!(String::from_utf8_lossy(&again.stdout).matches("already submitted").count(), 4, "{}", text(&again));
    assert_eq!(lines(&out.join("jobs.csv")).len(), 5);
}

/// A fake PBS: `qsub` records each call's arguments (one per line) in `qsub.<n>` and prints the
/// job id `<n>.pbs-test`, but refuses a job named in the file `refuse`; `qstat -x -f` says the
/// job is queued.
fn fake_pbs(dir: &Path) -> PathBuf {
    let bin_dir = dir.join("fakebin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    let d = dir.display();
    let qsub = format!(
        "#!/bin/bash\nn=$(ls '{d}' | grep -c '^qsub\\.')\nn=$((n + 1))\nfor a in \"$@\"; do if [ -f '{d}/refuse' ] && [ \"$a\" = \"$(cat '{d}/refuse')\" ]; then echo 'qsub: Job rejected by all possible destinations' >&2; exit 1; fi; done\nprintf '%s\\n' \"$@\" > '{d}/qsub.'$n\necho \"$n.pbs-test\"\n"
    );
    let qstat = "#!/bin/sh\nprintf 'Job Id: %s\\n    job_state = Q\\n    run_count = 0\\n' \"$3\"\n";
    for (name, body) in [("qsub", qsub.as_str()), ("qstat", qstat)] {
        std::fs::write(bin_dir.join(name), body).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(bin_dir.join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    bin_dir
}

fn shellcheck(scripts: &[PathBuf]) {
    for sh in scripts {
        let o = Command::new("bash").arg("-n").arg(sh).output().unwrap();
        assert!(o.status.success(), "bash -n {}: {}", sh.display(), text(&o));
    }
    let o = Command::new("shellcheck").args(scripts).output().expect("shellcheck runs (Debian package shellcheck)");
    assert!(o.status.success(), "shellcheck: {}", text(&o));
}

#[test]
fn a_pbs_study_carries_its_queue_options_and_survives_a_refused_job() {
    let dir = tempfile::tempdir().unwrap();
    let setup = dir.path().join("site setup.sh");
    std::fs::write(&setup, "module load openmpi\n").unwrap();
    let study = write_study(
        dir.path(),
        "pq",
        "scaling = \"strong\"\nlauncher = \"pbs\"\nranks_per_node = 2\ncpus_per_rank = 2\nranks = [1, 2]\nwalltime = \"00:20:00\"\naccount = \"proj1\"\nqueue = \"workq\"\nexclusive = true\nscheduler_options = [\"-l mem=4gb\"]\nsetup = \"site setup.sh\"\n[[point]]\nranks = 2\nlabel = \"long\"\nwalltime = \"01:30:00\"\n",
    );
    let out = dir.path().join("out");
    let o = sweep(&repo(), &[study.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let mut scripts: Vec<PathBuf> = ["report.sh", "run_all.sh", "submit_report.sh"].iter().map(|s| out.join(s)).collect();
    scripts.extend(["ranks_1", "ranks_2", "long"].iter().map(|l| out.join(l).join("job.sh")));
    shellcheck(&scripts);

    let fake = fake_pbs(dir.path());
    let path = format!("{}:{}", fake.display(), std::env::var("PATH").unwrap());
    std::fs::write(dir.path().join("refuse"), "pq_ranks_2_r1").unwrap();
    let run = |args: &[&str]| {
        mpi_env(&mut Command::new(bin()))
            .current_dir(dir.path())
            .env("PATH", &path)
            .env("NDTRAIN", bin())
            .env_remove("NDTRAIN_BIN")
            .arg("sweep")
            .args(args)
            .output()
            .unwrap()
    };
    let submit = run(&["submit", out.to_str().unwrap()]);
    assert_eq!(submit.status.code(), Some(1), "{}", text(&submit));
    assert!(
        text(&submit).contains("ranks_2 r1: refused: qsub: Job rejected by all possible destinations (exit code 1)"),
        "{}",
        text(&submit)
    );
    let args = |n: usize| lines(&dir.path().join(format!("qsub.{n}")));
    // The first point's job: its chunk, the study's queue options, the setup hook, the CPU script.
    let a = args(1);
    for pair in [
        ["-N", "pq_ranks_1_r1"],
        ["-l", "select=1:ncpus=2:mpiprocs=1:ompthreads=2"],
        ["-l", "walltime=00:20:00"],
        ["-A", "proj1"],
        ["-q", "workq"],
        ["-l", "place=scatter:excl"],
        ["-l", "mem=4gb"],
        ["-o", &out.join("ranks_1/job.out").display().to_string()],
    ] {
        assert!(a.windows(2).any(|w| w == pair), "{pair:?} missing: {a:?}");
    }
    let v = &a[a.iter().position(|x| x == "-v").unwrap() + 1];
    assert!(
        v.contains(&format!("NDTRAIN_SETUP={}", setup.display()))
            && v.contains(&format!("DECK={}", out.join("ranks_1/deck.toml").display())),
        "{v}"
    );
    assert!(v.ends_with(",NDTRAIN"), "the binary chosen goes with the job: {v}");
    assert!(a.last().unwrap().ends_with("jobscripts/pbs/train.pbs"), "{a:?}");
    // The labelled point's own walltime; then the report, after the two jobs queued.
    assert!(args(2).windows(2).any(|w| w == ["-l", "walltime=01:30:00"]) && args(2).contains(&"pq_long_r1".to_string()), "{:?}", args(2));
    let report = args(3);
    assert!(report.windows(2).any(|w| w == ["-W", "depend=afterany:1.pbs-test:2.pbs-test"]), "{report:?}");
    assert!(report.windows(2).any(|w| w == ["-A", "proj1"]) && report.last().unwrap().ends_with("report.sh"), "{report:?}");
    let to_report = format!("NDTRAIN_SETUP={},NDTRAIN", setup.display());
    assert!(report.windows(2).any(|w| w[0] == "-v" && w[1] == to_report), "the setup file and the binary: {report:?}");
    let jobs = lines(&out.join("jobs.csv"));
    assert_eq!(jobs.len(), 3, "{jobs:?}");
    assert!(jobs[1].starts_with("ranks_1,1,1.pbs-test,") && jobs[2].starts_with("long,1,2.pbs-test,"), "{jobs:?}");
    let status = run(&["status", out.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&status.stdout).to_string();
    assert!(said.lines().any(|l| l.starts_with("ranks_2") && l.ends_with("not submitted")), "{said}");
    assert_eq!(said.lines().filter(|l| l.ends_with(" queued")).count(), 2, "{said}");

    // Once the queue takes it, a second call submits only the missing job, and a report after all.
    std::fs::remove_file(dir.path().join("refuse")).unwrap();
    let again = run(&["submit", out.to_str().unwrap()]);
    assert!(again.status.success(), "{}", text(&again));
    assert!(args(4).contains(&"pq_ranks_2_r1".to_string()), "{:?}", args(4));
    assert!(args(5).windows(2).any(|w| w == ["-W", "depend=afterany:1.pbs-test:2.pbs-test:4.pbs-test"]), "{:?}", args(5));
    assert!(!dir.path().join("qsub.6").exists());
    assert_eq!(lines(&out.join("jobs.csv")).len(), 4);
}

#[test]
fn a_study_that_would_read_missing_files_or_a_bad_queue_option_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let refused = |name: &str, body: &str, says: &str| {
        let study = write_study(dir.path(), name, body);
        let out = dir.path().join(name).join("out");
        // Relative paths are the current directory's: a folder outside the source tree, where the
        // job scripts come from NDTRAIN_JOBSCRIPTS.
        let o = Command::new(bin())
            .current_dir(dir.path())
            .env("NDTRAIN_JOBSCRIPTS", repo().join("jobscripts"))
            .args(["sweep", study.to_str().unwrap(), "--out", out.to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(err.contains(says), "{says}: {err}");
        assert_eq!(err.lines().filter(|l| l.starts_with("error:")).count(), 1, "{err}");
        assert!(!out.exists(), "nothing is written for a refused study");
    };
    let base = "scaling = \"strong\"\nlauncher = \"slurm\"\nranks = [1, 2]\n";
    refused(
        "nodata",
        &format!("{base}[set]\n\"data.source\" = \"bin\"\n\"data.path\" = \"tokens/train_*.bin\"\n"),
        &format!(
            "study nodata point ranks_1: the deck reads what does not exist: [data] path = \"{}/tokens/train_*.bin\"",
            dir.path().display()
        ),
    );
    refused(
        "noinit",
        &format!("{base}[[point]]\nranks = 4\nlabel = \"warm\"\nset = {{ \"checkpoint.init_from\" = \"/nonexistent/hf\" }}\n"),
        "point warm: the deck reads what does not exist: [checkpoint] init_from = \"/nonexistent/hf\" (a folder)",
    );
    refused("badtime", &format!("{base}walltime = \"90:00\"\n"), "walltime = \"90:00\": use HH:MM:SS");
    refused("pbsqos", "scaling = \"strong\"\nlauncher = \"pbs\"\nranks = [1]\nqos = \"high\"\n", "qos is set, but PBS has no QoS");
    refused("nosetup", &format!("{base}setup = \"missing.sh\"\n"), "setup = \"");
    refused("unknown", &format!("{base}walltimes = \"01:00:00\"\n"), "unknown field `walltimes`");
}

#[test]
fn a_cuda_deck_gets_the_gpu_job_script_and_jobs_find_installed_scripts() {
    let dir = tempfile::tempdir().unwrap();
    // The job scripts as an install lays them out, outside the source tree, found through
    // NDTRAIN_JOBSCRIPTS from a directory that is not the source tree.
    let js = dir.path().join("prefix/share/ndtrain/jobscripts");
    std::fs::create_dir_all(js.parent().unwrap()).unwrap();
    let o = Command::new("cp").arg("-r").arg(repo().join("jobscripts")).arg(&js).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let study = write_study(
        dir.path(),
        "g",
        "scaling = \"strong\"\nlauncher = \"slurm\"\nranks_per_node = 2\ngpus_per_node = 2\nranks = [2]\n[set]\n\"run.device\" = \"cuda\"\n",
    );
    let out = dir.path().join("out");
    let o = mpi_env(&mut Command::new(bin()))
        .current_dir(dir.path())
        .env("NDTRAIN_JOBSCRIPTS", &js)
        .args(["sweep", study.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let job = std::fs::read_to_string(out.join("ranks_2/job.sh")).unwrap();
    assert!(job.contains(" --gpus-per-node=2 ") && job.contains(&format!("JOBSCRIPTS={}", js.display())), "{job}");
    assert!(job.trim_end().ends_with(&format!("{}/slurm/train_gpu.sbatch", js.display())), "{job}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("(GPU)"), "{}", text(&o));
    // Without NDTRAIN_JOBSCRIPTS, outside the source tree: the scripts beside the installed
    // binary (<prefix>/bin/ndtrain, <prefix>/share/ndtrain/jobscripts).
    std::fs::create_dir_all(dir.path().join("prefix/bin")).unwrap();
    let installed = dir.path().join("prefix/bin/ndtrain");
    std::fs::copy(bin(), &installed).unwrap();
    let o = mpi_env(&mut Command::new(&installed))
        .current_dir(dir.path())
        .args(["sweep", study.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let job = std::fs::read_to_string(out.join("ranks_2/job.sh")).unwrap();
    assert!(job.trim_end().ends_with("prefix/share/ndtrain/jobscripts/slurm/train_gpu.sbatch"), "{job}");
    // A cuda deck without GPUs to ask for is refused.
    let nogpu =
        write_study(dir.path(), "ng", "scaling = \"strong\"\nlauncher = \"slurm\"\nranks = [1]\n[set]\n\"run.device\" = \"cuda\"\n");
    let o = sweep(&repo(), &[nogpu.to_str().unwrap(), "--out", dir.path().join("ng").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("[study] gpus_per_node = 0"), "{}", text(&o));
}

#[test]
fn every_shipped_study_expands_for_its_batch_system() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = 0;
    for e in std::fs::read_dir(repo().join("inputs/studies")).unwrap() {
        let study = e.unwrap().path();
        let name = study.file_stem().unwrap().to_str().unwrap().to_string();
        let out = dir.path().join(&name);
        let o = Command::new(bin()).current_dir(repo()).arg("sweep").arg(&study).arg("--out").arg(&out).output().unwrap();
        assert!(o.status.success(), "{}: {}", study.display(), text(&o));
        let rows = lines(&out.join("points.csv"));
        assert!(rows.len() >= 4, "{}: {rows:?}", study.display());
        let mut scripts = vec![out.join("run_all.sh"), out.join("report.sh")];
        scripts.extend(rows[1..].iter().map(|r| PathBuf::from(r.rsplit(',').next().unwrap())));
        if out.join("submit_report.sh").exists() {
            scripts.push(out.join("submit_report.sh"));
        }
        shellcheck(&scripts);
        // The GPU studies submit the GPU job scripts, and only they do.
        let job = std::fs::read_to_string(&scripts[2]).unwrap();
        let gpu = name.starts_with("gpu") || name == "mesh4d";
        assert_eq!(job.contains("train_gpu."), gpu, "{name}: {job}");
        n += 1;
    }
    assert!(n >= 6, "the shipped studies: {n}");
    // A study whose points do not keep the global batch is refused as strong scaling.
    let bad = write_study(dir.path(), "bad", "scaling = \"strong\"\nranks = [1, 2]\n[per_rank]\n\"train.global_batch\" = 8\n");
    let o = Command::new(bin()).current_dir(repo()).arg("sweep").arg(&bad).arg("--out").arg(dir.path().join("b")).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("strong scaling, but 2 ranks train 1024 tokens per step and 1 ranks 512"), "{}", text(&o));
}
