//! The study file (`docs/hpc.md`, "Scaling studies"): its tables and keys, and the queue
//! options of each point (the study's, with the point's own where it gives them), validated
//! against the batch system before anything is written.

use serde::Deserialize;
use std::collections::BTreeMap;

/// The study file.
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

/// The batch system's options for a point's jobs. In `[study]` they hold for every point; a
/// `[[point]]` gives only those in which it differs.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueKeys {
    /// `"HH:MM:SS"`: `--time` (Slurm), `-l walltime` (PBS).
    pub walltime: Option<String>,
    /// `--account` / `-A`.
    pub account: Option<String>,
    /// `--partition` / `-q` (`queue` is the PBS name for it).
    #[serde(alias = "queue")]
    pub partition: Option<String>,
    /// `--qos` (Slurm only).
    pub qos: Option<String>,
    /// `--constraint` (Slurm only: PBS chooses node types by chunk resources).
    pub constraint: Option<String>,
    /// Whole nodes for each job: `--exclusive` / `-l place=scatter:excl`.
    pub exclusive: Option<bool>,
    /// Further options for `sbatch` / `qsub`, each one argument (an entry with spaces, such as
    /// `"-l mem=64gb"`, is split at them).
    pub scheduler_options: Option<Vec<String>>,
    /// Runs of each point (each in its own folder and job).
    pub repeats: Option<usize>,
    /// The site's setup file (`module load` / `spack load` lines) that the job scripts source
    /// (`NDTRAIN_SETUP`).
    pub setup: Option<String>,
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
    /// Taken out of the table before the rest is read ([`parse`]).
    #[serde(skip)]
    pub queue: QueueKeys,
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
    #[serde(skip)]
    pub queue: QueueKeys,
}

/// The keys of [`QueueKeys`], which `[study]` and every `[[point]]` may hold.
const QUEUE_KEYS: [&str; 10] =
    ["walltime", "account", "partition", "queue", "qos", "constraint", "exclusive", "scheduler_options", "repeats", "setup"];

/// Reads a study file's text. The queue keys are read apart from the rest of their table, so
/// that an unknown key in either is still refused by name.
pub fn parse(text: &str) -> Result<Study, String> {
    let mut root: toml::Table = text.parse().map_err(|e: toml::de::Error| e.to_string())?;
    fn split(table: &mut toml::Table, whose: &str) -> Result<QueueKeys, String> {
        let mut keys = toml::Table::new();
        for k in QUEUE_KEYS {
            if let Some(v) = table.remove(k) {
                keys.insert(k.to_string(), v);
            }
        }
        keys.try_into().map_err(|e: toml::de::Error| format!("{whose}: {}", e.message()))
    }
    let study_queue = match root.get_mut("study") {
        Some(toml::Value::Table(t)) => split(t, "[study]")?,
        _ => QueueKeys::default(),
    };
    let mut point_queues = vec![];
    if let Some(toml::Value::Array(points)) = root.get_mut("point") {
        for (i, p) in points.iter_mut().enumerate() {
            if let toml::Value::Table(t) = p {
                point_queues.push(split(t, &format!("[[point]] {}", i + 1))?);
            }
        }
    }
    let mut study: Study = root.try_into().map_err(|e: toml::de::Error| e.message().to_string())?;
    study.study.queue = study_queue;
    for (p, q) in study.point.iter_mut().zip(point_queues) {
        p.queue = q;
    }
    Ok(study)
}

/// The batch systems a study can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    Local,
    Slurm,
    Pbs,
}

impl Launcher {
    pub fn parse(name: &str) -> Result<Launcher, String> {
        match name {
            "local" => Ok(Launcher::Local),
            "slurm" => Ok(Launcher::Slurm),
            "pbs" => Ok(Launcher::Pbs),
            other => Err(format!("[study] launcher = \"{other}\": use \"local\", \"slurm\" or \"pbs\"")),
        }
    }
}

/// A point's queue options, the study's overridden by the point's, checked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Queue {
    pub walltime: Option<String>,
    pub account: Option<String>,
    pub partition: Option<String>,
    pub qos: Option<String>,
    pub constraint: Option<String>,
    pub exclusive: bool,
    pub scheduler_options: Vec<String>,
    pub repeats: usize,
    pub setup: Option<String>,
}

impl Queue {
    /// The options of a point under `launcher`: `point`'s keys where given, else `study`'s.
    /// `whose` names the point in errors. A key the batch system lacks is refused, not dropped.
    pub fn of(study: &QueueKeys, point: &QueueKeys, launcher: Launcher, whose: &str) -> Result<Queue, String> {
        fn pick<T: Clone>(p: &Option<T>, s: &Option<T>) -> Option<T> {
            p.clone().or_else(|| s.clone())
        }
        let q = Queue {
            walltime: pick(&point.walltime, &study.walltime),
            account: pick(&point.account, &study.account),
            partition: pick(&point.partition, &study.partition),
            qos: pick(&point.qos, &study.qos),
            constraint: pick(&point.constraint, &study.constraint),
            exclusive: pick(&point.exclusive, &study.exclusive).unwrap_or(false),
            scheduler_options: pick(&point.scheduler_options, &study.scheduler_options)
                .unwrap_or_default()
                .iter()
                .flat_map(|o| o.split_whitespace().map(str::to_string).collect::<Vec<_>>())
                .collect(),
            repeats: pick(&point.repeats, &study.repeats).unwrap_or(1),
            setup: pick(&point.setup, &study.setup),
        };
        if q.repeats == 0 {
            return Err(format!("{whose}: repeats = 0: each point runs at least once"));
        }
        if let Some(w) = &q.walltime {
            check_walltime(w).map_err(|e| format!("{whose}: walltime = \"{w}\": {e}"))?;
        }
        for (key, value) in [("account", &q.account), ("partition", &q.partition), ("qos", &q.qos), ("constraint", &q.constraint)] {
            if value.as_deref().is_some_and(|v| v.is_empty() || v.contains(char::is_whitespace) || v.contains(',') && key != "constraint") {
                return Err(format!("{whose}: {key} = \"{}\": one name without spaces or commas", value.as_deref().unwrap_or("")));
            }
        }
        let lacks = |key: &str, why: &str| Err(format!("{whose}: {key} is set, but {why}"));
        match launcher {
            Launcher::Local => {
                let set: Vec<&str> = [
                    ("walltime", q.walltime.is_some()),
                    ("account", q.account.is_some()),
                    ("partition", q.partition.is_some()),
                    ("qos", q.qos.is_some()),
                    ("constraint", q.constraint.is_some()),
                    ("exclusive", q.exclusive),
                    ("scheduler_options", !q.scheduler_options.is_empty()),
                ]
                .iter()
                .filter(|(_, on)| *on)
                .map(|(k, _)| *k)
                .collect();
                if !set.is_empty() {
                    return lacks(&set.join(", "), "launcher = \"local\" runs here without a batch system: use \"slurm\" or \"pbs\"");
                }
            }
            Launcher::Pbs => {
                if q.qos.is_some() {
                    return lacks("qos", "PBS has no QoS: name the queue (partition/queue) or pass it in scheduler_options");
                }
                if q.constraint.is_some() {
                    return lacks("constraint", "PBS selects node types by chunk resources: pass them in scheduler_options");
                }
            }
            Launcher::Slurm => {}
        }
        Ok(q)
    }

    /// The options for `sbatch`.
    pub fn sbatch_args(&self) -> Vec<String> {
        let mut a = vec![];
        let mut opt = |flag: &str, v: &Option<String>| {
            if let Some(v) = v {
                a.push(format!("--{flag}={v}"));
            }
        };
        opt("time", &self.walltime);
        opt("account", &self.account);
        opt("partition", &self.partition);
        opt("qos", &self.qos);
        opt("constraint", &self.constraint);
        if self.exclusive {
            a.push("--exclusive".into());
        }
        a.extend(self.scheduler_options.iter().cloned());
        a
    }

    /// The options for `qsub`.
    pub fn qsub_args(&self) -> Vec<String> {
        let mut a = vec![];
        if let Some(w) = &self.walltime {
            a.extend(["-l".into(), format!("walltime={w}")]);
        }
        if let Some(acc) = &self.account {
            a.extend(["-A".into(), acc.clone()]);
        }
        if let Some(q) = &self.partition {
            a.extend(["-q".into(), q.clone()]);
        }
        if self.exclusive {
            a.extend(["-l".into(), "place=scatter:excl".into()]);
        }
        a.extend(self.scheduler_options.iter().cloned());
        a
    }
}

/// `HH:MM:SS` with minutes and seconds below 60 and a time above zero.
fn check_walltime(w: &str) -> Result<(), String> {
    let parts: Vec<&str> = w.split(':').collect();
    let numbers: Vec<u64> = parts.iter().filter_map(|p| p.parse().ok()).collect();
    let digits = parts.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    if parts.len() != 3 || numbers.len() != 3 || !digits || parts[1].len() != 2 || parts[2].len() != 2 {
        return Err("use HH:MM:SS (e.g. \"02:30:00\")".into());
    }
    if numbers[1] >= 60 || numbers[2] >= 60 {
        return Err(format!("minutes ({}) and seconds ({}) must be below 60", numbers[1], numbers[2]));
    }
    if numbers.iter().all(|&n| n == 0) {
        return Err("a job needs more than no time".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(toml_text: &str) -> QueueKeys {
        toml::from_str(toml_text).unwrap()
    }

    #[test]
    fn a_point_overrides_the_study_s_queue_options() {
        let study = keys("walltime = \"01:00:00\"\naccount = \"proj\"\nexclusive = true\nrepeats = 3\nqueue = \"batch\"");
        let point = keys("walltime = \"00:20:00\"\nexclusive = false");
        let q = Queue::of(&study, &point, Launcher::Slurm, "p").unwrap();
        assert_eq!(q.sbatch_args(), ["--time=00:20:00", "--account=proj", "--partition=batch"]);
        assert_eq!(q.repeats, 3);
        let q = Queue::of(&study, &QueueKeys::default(), Launcher::Pbs, "p").unwrap();
        assert_eq!(q.qsub_args(), ["-l", "walltime=01:00:00", "-A", "proj", "-q", "batch", "-l", "place=scatter:excl"]);
    }

    #[test]
    fn scheduler_options_are_split_into_arguments() {
        let q = Queue::of(&keys("scheduler_options = [\"-l mem=64gb\", \"--mail-type=END\"]"), &QueueKeys::default(), Launcher::Pbs, "p")
            .unwrap();
        assert_eq!(q.qsub_args(), ["-l", "mem=64gb", "--mail-type=END"]);
    }

    #[test]
    fn bad_walltimes_and_keys_a_batch_system_lacks_are_refused() {
        for (w, why) in [("1:00", "HH:MM:SS"), ("01:75:00", "minutes (75)"), ("00:00:00", "more than no time"), ("1h", "HH:MM:SS")] {
            let e = Queue::of(&keys(&format!("walltime = \"{w}\"")), &QueueKeys::default(), Launcher::Slurm, "point a").unwrap_err();
            assert!(e.starts_with(&format!("point a: walltime = \"{w}\": ")) && e.contains(why), "{e}");
        }
        let e = Queue::of(&keys("qos = \"high\""), &QueueKeys::default(), Launcher::Pbs, "study s").unwrap_err();
        assert!(e.contains("qos is set, but PBS has no QoS"), "{e}");
        let e = Queue::of(&keys("constraint = \"gpu\""), &QueueKeys::default(), Launcher::Pbs, "study s").unwrap_err();
        assert!(e.contains("constraint is set"), "{e}");
        let e =
            Queue::of(&keys("walltime = \"00:10:00\"\nexclusive = true"), &QueueKeys::default(), Launcher::Local, "study s").unwrap_err();
        assert!(e.contains("walltime, exclusive is set, but launcher = \"local\""), "{e}");
        let e = Queue::of(&keys("repeats = 0"), &QueueKeys::default(), Launcher::Local, "study s").unwrap_err();
        assert!(e.contains("repeats = 0"), "{e}");
        let e = Queue::of(&keys("account = \"a b\""), &QueueKeys::default(), Launcher::Slurm, "study s").unwrap_err();
        assert!(e.contains("account = \"a b\""), "{e}");
    }
}
