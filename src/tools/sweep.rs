//! `ndtrain sweep STUDY.toml`: expands a scaling study into one deck and one job script per
//! point, a script that runs or submits them all, and one that reports on them.
//!
//! A study names a base deck, the rank counts (or explicit points), overrides for every point,
//! values that grow with the ranks (weak scaling), and the batch system. Every point's deck is
//! validated for its rank count here, so a study never queues a job that would fail on a bad
//! layout. Knows nothing of training; the job scripts in `jobscripts/` do the launching.

use crate::config::Deck;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The study file (`docs/hpc.md`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Study {
    pub study: StudyCfg,
    /// `"table.key" = value` for every point.
    #[serde(default)]
    pub set: BTreeMap<String, toml::Value>,
    /// `"table.key" = value` multiplied by the point's ranks (weak scaling: per-rank work).
    #[serde(default)]
    pub per_rank: BTreeMap<String, toml::Value>,
    /// Explicit points (instead of, or besides, `[study] ranks`).
    #[serde(default)]
    pub point: Vec<Point>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StudyCfg {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The base deck, relative to the study file.
    pub base: String,
    /// `"strong"` (same global batch at every point) or `"weak"` (work per rank fixed).
    pub scaling: String,
    /// `"local"` (mpirun here), `"slurm"` (sbatch) or `"pbs"` (qsub).
    #[serde(default = "default_launcher")]
    pub launcher: String,
    #[serde(default = "one")]
    pub ranks_per_node: usize,
    /// CPUs (cores) each rank asks the batch system for: its threads (`--cpus-per-task`;
    /// PBS `ncpus = ranks_per_node × cpus_per_rank`, `ompthreads = cpus_per_rank`).
    #[serde(default = "one")]
    pub cpus_per_rank: usize,
    #[serde(default)]
    pub gpus_per_node: usize,
    /// Rank counts, each a point with `[set]` and `[per_rank]` only.
    #[serde(default)]
    pub ranks: Vec<usize>,
    /// Where the decks, scripts and runs go (default `out/studies/<name>`).
    #[serde(default)]
    pub out: String,
}

fn default_launcher() -> String {
    "local".into()
}

fn one() -> usize {
    1
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Point {
    pub ranks: usize,
    /// Names the point's folder (default `ranks_<N>`).
    #[serde(default)]
    pub label: String,
    #[serde(default)]
    pub set: BTreeMap<String, toml::Value>,
}

/// One expanded point.
#[derive(Debug, Clone)]
pub struct Expanded {
    pub label: String,
    pub ranks: usize,
    pub dir: PathBuf,
    pub deck: PathBuf,
    pub job: PathBuf,
    pub run_dir: PathBuf,
}

fn override_line(key: &str, v: &toml::Value) -> String {
    format!("{key}={v}")
}

/// `value × ranks` for an integer or float.
fn times(key: &str, v: &toml::Value, ranks: usize) -> Result<toml::Value, String> {
    match v {
        toml::Value::Integer(i) => Ok(toml::Value::Integer(i * ranks as i64)),
        toml::Value::Float(f) => Ok(toml::Value::Float(f * ranks as f64)),
        other => Err(format!("[per_rank] \"{key}\" = {other}: a per-rank value must be a number")),
    }
}

/// Finds `jobscripts/` from the current directory or the study file's ancestors.
fn find_jobscripts(study: &Path) -> Result<PathBuf, String> {
    let mut tried = vec![];
    let cwd = std::env::current_dir().map_err(|e| e.to_string())?;
    let mut candidates = vec![cwd.join("jobscripts")];
    let abs = if study.is_absolute() { study.to_path_buf() } else { cwd.join(study) };
    candidates.extend(abs.ancestors().skip(1).map(|a| a.join("jobscripts")));
    for c in candidates {
        if c.join("slurm/train.sbatch").is_file() {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    Err(format!("cannot find jobscripts/ (with slurm/train.sbatch) in {}; run sweep from the ndtrain source tree", tried.join(", ")))
}

fn absolute(p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().map(|c| c.join(p)).unwrap_or_else(|_| p.to_path_buf())
    }
}

/// The command that runs (local) or submits (slurm, pbs) one point.
fn job_script(s: &StudyCfg, jobscripts: &Path, deck: &Path, ranks: usize) -> Result<String, String> {
    let per_node = s.ranks_per_node.max(1).min(ranks);
    let nodes = ranks.div_ceil(per_node);
    if nodes * per_node != ranks {
        return Err(format!("{ranks} ranks do not fill nodes of ranks_per_node = {} evenly", s.ranks_per_node));
    }
    if s.cpus_per_rank == 0 {
        return Err("[study] cpus_per_rank = 0: each rank needs at least one CPU".into());
    }
    let (deck, cpus) = (deck.display(), s.cpus_per_rank);
    let line = match s.launcher.as_str() {
        "local" => format!("NRANKS={ranks} exec {}/local/train.sh {deck}", jobscripts.display()),
        "slurm" => {
            let gpus = if s.gpus_per_node > 0 { format!(" --gpus-per-node={}", s.gpus_per_node) } else { String::new() };
            format!(
                "exec sbatch --nodes={nodes} --ntasks-per-node={per_node} --cpus-per-task={cpus}{gpus} --job-name={}_{ranks} --export=ALL,DECK={deck} {}/slurm/train.sbatch",
                s.name,
                jobscripts.display()
            )
        }
        "pbs" => {
            let gpus = if s.gpus_per_node > 0 { format!(":ngpus={}", s.gpus_per_node) } else { String::new() };
            format!(
                "exec qsub -N {}_{ranks} -l select={nodes}:ncpus={}:mpiprocs={per_node}:ompthreads={cpus}{gpus} -v DECK={deck} {}/pbs/train.pbs",
                s.name,
                per_node * cpus,
                jobscripts.display()
            )
        }
        other => return Err(format!("[study] launcher = \"{other}\": use \"local\", \"slurm\" or \"pbs\"")),
    };
    Ok(format!("#!/usr/bin/env bash\n# Point of study {} ({ranks} ranks), written by ndtrain sweep.\nset -euo pipefail\necho \"+ {line}\"\n{line}\n", s.name))
}

fn write(path: &Path, text: &str, executable: bool) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    if executable {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// Expands `study_path` into `out` (default: the study's `out`, else `out/studies/<name>`).
pub fn run(study_path: &Path, out: Option<&Path>) -> Result<Vec<Expanded>, String> {
    let text = std::fs::read_to_string(study_path).map_err(|e| format!("cannot read {}: {e}", study_path.display()))?;
    let study: Study = toml::from_str(&text).map_err(|e| format!("{}: {e}", study_path.display()))?;
    let s = &study.study;
    if s.scaling != "strong" && s.scaling != "weak" {
        return Err(format!("{}: [study] scaling = \"{}\": use \"strong\" or \"weak\"", study_path.display(), s.scaling));
    }
    let base = study_path.parent().unwrap_or(Path::new(".")).join(&s.base);
    let jobscripts = absolute(&find_jobscripts(study_path)?);
    let out = absolute(&match out {
        Some(o) => o.to_path_buf(),
        None if !s.out.is_empty() => PathBuf::from(&s.out),
        None => Path::new("out/studies").join(&s.name),
    });
    let mut points: Vec<Point> = s.ranks.iter().map(|&ranks| Point { ranks, label: String::new(), set: BTreeMap::new() }).collect();
    points.extend(study.point);
    if points.is_empty() {
        return Err(format!("{}: the study has no points: give [study] ranks or [[point]] tables", study_path.display()));
    }
    let mut expanded = vec![];
    let mut global_batches = vec![];
    for p in &points {
        let label = if p.label.is_empty() { format!("ranks_{}", p.ranks) } else { p.label.clone() };
        let dir = out.join(&label);
        // Runs are named by their folder in reports: one folder per point label.
        let run_dir = out.join("runs").join(&label);
        let mut lines: Vec<String> = study.set.iter().map(|(k, v)| override_line(k, v)).collect();
        for (k, v) in &study.per_rank {
            lines.push(override_line(k, &times(k, v, p.ranks)?));
        }
        lines.extend(p.set.iter().map(|(k, v)| override_line(k, v)));
        lines.push(format!("run.name=\"{}_{label}\"", s.name));
        lines.push(format!("run.out_dir=\"{}\"", run_dir.display()));
        let deck = Deck::from_file(&base, &lines).map_err(|e| format!("study {} point {label}: {e}", s.name))?;
        let res = deck.resolve(p.ranks).map_err(|e| format!("study {} point {label} ({} ranks): {e}", s.name, p.ranks))?;
        global_batches.push((p.ranks, res.tokens_per_step));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let deck_path = dir.join("deck.toml");
        let header = format!(
            "# Point {label} of study {} ({} scaling, {} ranks), from {} by ndtrain sweep.\n",
            s.name,
            s.scaling,
            p.ranks,
            base.display()
        );
        write(&deck_path, &(header + &deck.to_toml()), false)?;
        let job = dir.join("job.sh");
        write(&job, &job_script(s, &jobscripts, &deck_path, p.ranks)?, true)?;
        expanded.push(Expanded { label, ranks: p.ranks, dir, deck: deck_path, job, run_dir });
    }
    check_scaling(&s.scaling, &global_batches).map_err(|e| format!("study {}: {e}", s.name))?;
    let all = expanded.iter().map(|e| format!("{}\n", e.job.display())).collect::<String>();
    write(
        &out.join("run_all.sh"),
        &format!("#!/usr/bin/env bash\n# Runs (local) or submits (slurm, pbs) every point of study {}.\nset -euo pipefail\n{all}", s.name),
        true,
    )?;
    let runs = expanded.iter().map(|e| e.run_dir.display().to_string()).collect::<Vec<_>>().join(" ");
    write(
        &out.join("report.sh"),
        &format!(
            "#!/usr/bin/env bash\n# The study's tables and plots, once every point has run.\nset -euo pipefail\nexec \"${{NDTRAIN:-ndtrain}}\" report {runs} --out {}\n",
            out.join("report").display()
        ),
        true,
    )?;
    Ok(expanded)
}

/// Strong scaling keeps the tokens per step; weak scaling grows them with the ranks.
fn check_scaling(scaling: &str, points: &[(usize, usize)]) -> Result<(), String> {
    let (r0, t0) = points[0];
    for &(r, t) in &points[1..] {
        let ok = match scaling {
            "strong" => t == t0,
            _ => t * r0 == t0 * r,
        };
        if !ok {
            return Err(format!(
                "{scaling} scaling, but {r} ranks train {t} tokens per step and {r0} ranks {t0} (use [per_rank] for weak scaling, [set] for strong)"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn study(launcher: &str, cpus_per_rank: usize) -> StudyCfg {
        StudyCfg {
            name: "s".into(),
            description: String::new(),
            base: "b.toml".into(),
            scaling: "strong".into(),
            launcher: launcher.into(),
            ranks_per_node: 4,
            cpus_per_rank,
            gpus_per_node: 0,
            ranks: vec![],
            out: String::new(),
        }
    }

    /// Each rank asks for its CPUs: Slurm's `--cpus-per-task`, PBS's `ncpus` for every rank of
    /// a node and `ompthreads` (what `train.pbs` reads the threads from).
    #[test]
    fn a_point_asks_the_batch_system_for_every_rank_s_cpus() {
        let (js, deck) = (Path::new("/j"), Path::new("/d.toml"));
        let slurm = job_script(&study("slurm", 8), js, deck, 16).unwrap();
        assert!(slurm.contains("sbatch --nodes=4 --ntasks-per-node=4 --cpus-per-task=8 "), "{slurm}");
        let pbs = job_script(&study("pbs", 8), js, deck, 16).unwrap();
        assert!(pbs.contains("-l select=4:ncpus=32:mpiprocs=4:ompthreads=8 "), "{pbs}");
        let e = job_script(&study("pbs", 0), js, deck, 16).unwrap_err();
        assert!(e.contains("cpus_per_rank = 0"), "{e}");
    }
}
