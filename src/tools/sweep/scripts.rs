//! The shell scripts a study is run with: where the installed job scripts are, each job's
//! submission script (`job.sh`: `sbatch` / `qsub` of the CPU or GPU job script with the point's
//! resources and queue options, or `train.sh` here), `report.sh`, the script that queues it after
//! the points, and `run_all.sh`.

use super::study::{Launcher, Queue, StudyCfg};
use std::path::{Path, PathBuf};

/// The job scripts: `$NDTRAIN_JOBSCRIPTS`, else `jobscripts/` in the current directory or
/// above the study file (a source tree), else `<exe dir>/../share/ndtrain/jobscripts` (the
/// install prefix's layout, which Spack's and the release tarball's installs share).
pub fn find_jobscripts(study: &Path) -> Result<PathBuf, String> {
    let cwd = std::env::current_dir().map_err(|e| e.to_string())?;
    let mut candidates = vec![];
    if let Some(env) = std::env::var_os("NDTRAIN_JOBSCRIPTS") {
        let env = PathBuf::from(env);
        if !env.join("slurm/train.sbatch").is_file() {
            return Err(format!("NDTRAIN_JOBSCRIPTS={}: no slurm/train.sbatch there", env.display()));
        }
        return Ok(absolute(&env, &cwd));
    }
    candidates.push(cwd.join("jobscripts"));
    let abs = absolute(study, &cwd);
    candidates.extend(abs.ancestors().skip(1).map(|a| a.join("jobscripts")));
    if let Some(exe_dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
        candidates.push(exe_dir.join("../share/ndtrain/jobscripts"));
    }
    let mut tried = vec![];
    for c in candidates {
        if c.join("slurm/train.sbatch").is_file() {
            return Ok(c.canonicalize().unwrap_or(c));
        }
        tried.push(c.display().to_string());
    }
    Err(format!(
        "cannot find the job scripts (a jobscripts/ folder with slurm/train.sbatch) in {}: set NDTRAIN_JOBSCRIPTS to it",
        tried.join(", ")
    ))
}

/// `p` against `base` when relative.
pub fn absolute(p: &Path, base: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// `s` as one shell word.
pub fn quote(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,@+%^".contains(&b)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

fn words(args: &[String]) -> String {
    args.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" ")
}

/// `echo "+ COMMAND $* SCRIPT" >&2`: the command as it runs, on stderr (stdout carries the
/// job id). `command` may use `$vars`; other `$` and quotes are taken literally.
fn echo(command: &str, script: &str) -> String {
    let esc = |t: &str| t.replace('\\', "\\\\").replace('"', "\\\"").replace('`', "\\`").replace('$', "\\$").replace("\\$vars", "$vars");
    format!("echo \"+ {} $* {}\" >&2", esc(command), esc(script))
}

/// One job: what its submission script needs.
pub struct Job<'a> {
    pub study: &'a StudyCfg,
    pub launcher: Launcher,
    pub queue: &'a Queue,
    pub jobscripts: &'a Path,
    /// The study's output folder: the jobs' working directory.
    pub out: &'a Path,
    /// The job's folder (its deck, this script and the batch system's output file).
    pub dir: &'a Path,
    pub deck: &'a Path,
    pub ranks: usize,
    pub gpu: bool,
    pub name: &'a str,
    /// The site setup file, absolute.
    pub setup: Option<&'a Path>,
}

/// A value that travels in a comma-separated list (`--export`, `qsub -v`) must hold no comma.
fn listable(what: &str, p: &Path) -> Result<String, String> {
    let s = p.display().to_string();
    if s.contains(',') {
        return Err(format!("{what} {s}: a path with a comma cannot be passed in sbatch --export / qsub -v"));
    }
    Ok(s)
}

/// The job's `job.sh`: submits it (printing only the job id on stdout, for `ndtrain sweep
/// submit`; extra arguments, such as a dependency, go to `sbatch` / `qsub`), or runs it here.
pub fn job_script(j: &Job) -> Result<String, String> {
    let s = j.study;
    let per_node = s.ranks_per_node.max(1).min(j.ranks);
    let nodes = j.ranks.div_ceil(per_node);
    if nodes * per_node != j.ranks {
        return Err(format!("{} ranks do not fill nodes of ranks_per_node = {} evenly", j.ranks, s.ranks_per_node));
    }
    if s.cpus_per_rank == 0 {
        return Err("[study] cpus_per_rank = 0: each rank needs at least one CPU".into());
    }
    if j.gpu && j.launcher != Launcher::Local && s.gpus_per_node == 0 {
        return Err("the deck has [run] device = \"cuda\", but [study] gpus_per_node = 0: give the GPUs each node's job asks for".into());
    }
    let cpus = s.cpus_per_rank;
    let deck = listable("the deck", j.deck)?;
    let js = listable("the job scripts folder", j.jobscripts)?;
    let mut env = vec![format!("DECK={deck}"), format!("JOBSCRIPTS={js}")];
    if let Some(setup) = j.setup {
        env.push(format!("NDTRAIN_SETUP={}", listable("the setup file", setup)?));
    }
    let output = j.dir.join("job.out").display().to_string();
    let gpu = if j.gpu { "_gpu" } else { "" };
    let body = match j.launcher {
        Launcher::Local => {
            let setup = j.setup.map(|p| format!("export NDTRAIN_SETUP={}\n", quote(&p.display().to_string()))).unwrap_or_default();
            let train = j.jobscripts.join("local/train.sh").display().to_string();
            // The binary: the caller's choice, else the one that wrote the study (the job runs in
            // the study's folder, where no relative default would find one).
            format!(
                "{setup}export NDTRAIN=\"${{NDTRAIN:-${{NDTRAIN_BIN:-{}}}}}\"\necho \"+ NRANKS={} {train} {deck}\"\nNRANKS={} exec {} {}\n",
                this_binary(),
                j.ranks,
                j.ranks,
                quote(&train),
                quote(&deck)
            )
        }
        Launcher::Slurm => {
            let mut args = vec![
                "--parsable".to_string(),
                format!("--job-name={}", j.name),
                format!("--nodes={nodes}"),
                format!("--ntasks-per-node={per_node}"),
                format!("--cpus-per-task={cpus}"),
            ];
            if j.gpu {
                args.push(format!("--gpus-per-node={}", s.gpus_per_node));
            }
            args.extend(j.queue.sbatch_args());
            args.push(format!("--chdir={}", j.out.display()));
            args.push(format!("--output={output}"));
            args.push(format!("--export=ALL,{}", env.join(",")));
            let script = j.jobscripts.join(format!("slurm/train{gpu}.sbatch")).display().to_string();
            format!("{}\nexec sbatch {} \"$@\" {}\n", echo(&format!("sbatch {}", words(&args)), &script), words(&args), quote(&script))
        }
        Launcher::Pbs => {
            let ngpus = if j.gpu { format!(":ngpus={}", s.gpus_per_node) } else { String::new() };
            let mut args = vec![
                "-N".to_string(),
                j.name.to_string(),
                "-l".into(),
                format!("select={nodes}:ncpus={}:mpiprocs={per_node}:ompthreads={cpus}{ngpus}", per_node * cpus),
            ];
            args.extend(j.queue.qsub_args());
            args.extend(["-j".into(), "oe".into(), "-o".into(), output]);
            let script = j.jobscripts.join(format!("pbs/train{gpu}.pbs")).display().to_string();
            // qsub passes no environment: the settings by value, and the binary by name when the
            // caller chose one (`-v NAME` takes its value from here).
            format!(
                "vars={}\nif [ -n \"${{NDTRAIN:-}}\" ]; then vars=\"$vars,NDTRAIN\"; fi\nif [ -n \"${{NDTRAIN_BIN:-}}\" ]; then vars=\"$vars,NDTRAIN_BIN\"; fi\n{}\nexec qsub {} -v \"$vars\" \"$@\" {}\n",
                quote(&env.join(",")),
                echo(&format!("qsub {} -v $vars", words(&args)), &script),
                words(&args),
                quote(&script)
            )
        }
    };
    let what = match j.launcher {
        Launcher::Local => "Runs",
        _ => "Submits",
    };
    Ok(format!(
        "#!/usr/bin/env bash\n# {what} job {} of study {} ({} ranks{}), written by ndtrain sweep; `ndtrain sweep submit` runs it\n# and reads the job id it prints.\nset -euo pipefail\ncd {}\n{body}",
        j.name,
        s.name,
        j.ranks,
        if j.gpu { ", GPU nodes" } else { "" },
        quote(&j.out.display().to_string())
    ))
}

/// `report.sh`: `ndtrain report --study <out>`, by hand or as the job chained after the points.
pub fn report_script(study: &StudyCfg, out: &Path, setup: Option<&Path>) -> String {
    let out = quote(&out.display().to_string());
    let setup = setup.map(|p| quote(&p.display().to_string())).unwrap_or_default();
    format!(
        "#!/usr/bin/env bash
# The report of study {name}: `ndtrain report --study` over every point and repeat (points.csv),
# by hand or as the job `ndtrain sweep submit` queues after the points. The binary: $NDTRAIN_BIN,
# else $NDTRAIN (as the job scripts take it), else ndtrain on PATH.
set -eo pipefail
setup=\"${{NDTRAIN_SETUP:-{setup}}}\"
# The site's module lines may read unset variables: sourced before `set -u`.
# shellcheck disable=SC1090
if [ -n \"$setup\" ]; then . \"$setup\"; fi
set -u
bin=\"${{NDTRAIN_BIN:-${{NDTRAIN:-}}}}\"
if [ -z \"$bin\" ]; then
    bin=$(command -v ndtrain) || {{ echo \"error: ndtrain is not on PATH: set NDTRAIN_BIN or load it in the setup file\" >&2; exit 2; }}
fi
echo \"+ $bin report --study {out}\"
exec \"$bin\" report --study {out}
",
        name = study.name
    )
}

/// `submit_report.sh DEPS`: queues `report.sh` to start once every job of `DEPS` (job ids
/// joined by `:`) has ended, however it ended; prints the report job's id.
pub fn submit_report_script(study: &StudyCfg, launcher: Launcher, queue: &Queue, out: &Path, setup: Option<&Path>) -> Option<String> {
    let report = out.join("report.sh").display().to_string();
    let output = out.join("report.out").display().to_string();
    let name = format!("{}_report", study.name);
    // The report is one process for a minute or two: the study's account and partition, not its
    // node counts, exclusivity or walltime.
    let mut prelude = String::new();
    let line = match launcher {
        Launcher::Local => return None,
        Launcher::Slurm => {
            let mut args = vec![format!("--job-name={name}"), "--nodes=1".into(), "--ntasks=1".into(), "--time=00:30:00".into()];
            for (flag, v) in [("account", &queue.account), ("partition", &queue.partition), ("qos", &queue.qos)] {
                if let Some(v) = v {
                    args.push(format!("--{flag}={v}"));
                }
            }
            args.extend([format!("--chdir={}", out.display()), format!("--output={output}"), "--export=ALL".into()]);
            format!("sbatch --parsable {} --dependency=\"afterany:$1\" {}", words(&args), quote(&report))
        }
        Launcher::Pbs => {
            let mut args = vec!["-N".into(), name, "-l".into(), "select=1:ncpus=1".into(), "-l".into(), "walltime=00:30:00".into()];
            if let Some(a) = &queue.account {
                args.extend(["-A".into(), a.clone()]);
            }
            if let Some(q) = &queue.partition {
                args.extend(["-q".into(), q.clone()]);
            }
            args.extend(["-j".into(), "oe".into(), "-o".into(), output]);
            // qsub passes no environment: the setup file by value, the binary by name when the
            // caller chose one.
            let vars = setup.map(|s| format!("NDTRAIN_SETUP={}", s.display())).unwrap_or_default();
            prelude = format!(
                "vars={}\nfor v in NDTRAIN NDTRAIN_BIN; do if [ -n \"${{!v:-}}\" ]; then vars=\"${{vars:+$vars,}}$v\"; fi; done\n",
                quote(&vars)
            );
            format!("qsub {} ${{vars:+-v \"$vars\"}} -W depend=\"afterany:$1\" {}", words(&args), quote(&report))
        }
    };
    Some(format!(
        "#!/usr/bin/env bash\n# Queues report.sh of study {} after the jobs whose ids \"$1\" lists (joined by ':'), however\n# they end; prints its job id. `ndtrain sweep submit` runs it.\nset -euo pipefail\n: \"${{1:?usage: $0 JOBID[:JOBID...]}}\"\ncd {}\n{prelude}exec {line}\n",
        study.name,
        quote(&out.display().to_string())
    ))
}

/// This binary's path, for a script to fall back on inside double quotes; `ndtrain` (on `PATH`)
/// where the path holds a character that would need escaping there.
fn this_binary() -> String {
    std::env::current_exe()
        .map(|e| e.display().to_string())
        .ok()
        .filter(|e| !e.contains(['"', '$', '`', '\\', '\n']))
        .unwrap_or_else(|| "ndtrain".into())
}

/// `run_all.sh`: `ndtrain sweep submit <out>` (the same binary that wrote the study, unless
/// `NDTRAIN_BIN` names another).
pub fn run_all_script(study: &StudyCfg, out: &Path) -> String {
    format!(
        "#!/usr/bin/env bash\n# Runs (local) or submits (slurm, pbs) every job of study {} that is not yet in jobs.csv, then\n# the report after them: `ndtrain sweep submit`.\nset -euo pipefail\nexec \"${{NDTRAIN_BIN:-{}}}\" sweep submit {}\n",
        study.name,
        this_binary(),
        quote(&out.display().to_string())
    )
}
