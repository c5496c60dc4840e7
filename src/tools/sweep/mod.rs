//! `ndtrain sweep STUDY.toml`: expands a scaling study into one deck and one job per point and
//! repeat, a manifest of them (`points.csv`), and the scripts that submit them and report on
//! them; `ndtrain sweep submit DIR` queues (or runs) them ([`submit`]) and `ndtrain sweep status
//! DIR` says where each one is ([`status`]).
//!
//! A study names a base deck, the rank counts (or explicit points), overrides for every point,
//! values that grow with the ranks (weak scaling), the batch system and its queue options
//! ([`study`]). Everything is checked before anything is written: every point's deck for its
//! rank count and the study's scaling, every file a deck reads, every queue option against the
//! batch system. So a study never queues a job that would fail on a bad layout or a missing
//! file. Knows nothing of training; the job scripts in `jobscripts/` do the launching.

pub mod scripts;
pub mod status;
pub mod study;
pub mod submit;

use crate::config::{Deck, Device, Source};
use scripts::{absolute, quote, Job};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use study::{Launcher, Point, Queue};

/// The manifest of the expansion: one row per point and repeat.
pub const POINTS_CSV: &str = "points.csv";
pub const POINTS_HEADER: &str = "label,ranks,repeat,run_dir,deck,job";
/// The copy of the study file in the output folder, which `submit` reads the launcher from.
pub const STUDY_COPY: &str = "study.toml";

/// One expanded job: a point's repeat.
#[derive(Debug, Clone)]
pub struct Expanded {
    pub label: String,
    pub ranks: usize,
    /// 1..=repeats.
    pub repeat: usize,
    /// The job's folder: its deck, `job.sh` and the batch system's output (`job.out`).
    pub dir: PathBuf,
    pub deck: PathBuf,
    pub job: PathBuf,
    pub run_dir: PathBuf,
    /// `<study>_<label>_r<repeat>`.
    pub name: String,
    pub gpu: bool,
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

fn write(path: &Path, text: &str, executable: bool) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    if executable {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// Every path a deck names, absolute against `cwd`: a run reads them relative to its working
/// directory, and the jobs run elsewhere (the study's folder, a node's scratch).
fn absolute_paths(deck: &mut Deck, cwd: &Path) {
    let abs = |p: &mut String| {
        if !p.is_empty() {
            *p = absolute(Path::new(p.as_str()), cwd).display().to_string();
        }
    };
    abs(&mut deck.data.path);
    abs(&mut deck.eval.path);
    abs(&mut deck.checkpoint.dir);
    abs(&mut deck.checkpoint.init_from);
    abs(&mut deck.checkpoint.export_hf);
    if deck.checkpoint.resume != "auto" {
        abs(&mut deck.checkpoint.resume);
    }
}

/// Whether `name` matches `pattern`, where `*` is any run of characters.
fn wildcard(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if parts.len() == 1 {
        return name == pattern;
    }
    if name.len() < first.len() + last.len() || !name.starts_with(first) || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for middle in &parts[1..parts.len() - 1] {
        match rest.find(middle) {
            Some(i) => rest = &rest[i + middle.len()..],
            None => return false,
        }
    }
    true
}

/// A file a deck reads (a `*` pattern in its file name: at least one match).
fn file_exists(p: &str) -> bool {
    let path = Path::new(p);
    match path.file_name().and_then(|n| n.to_str()) {
        Some(name) if name.contains('*') => {
            let dir = path.parent().unwrap_or(Path::new("."));
            std::fs::read_dir(dir)
                .map(|entries| entries.filter_map(Result::ok).any(|e| e.file_name().to_str().is_some_and(|n| wildcard(name, n))))
                .unwrap_or(false)
        }
        _ => path.is_file(),
    }
}

/// The files and folders a deck reads before its first step, each that does not exist named
/// with its key.
fn missing_inputs(deck: &Deck) -> Vec<String> {
    let mut missing = vec![];
    if deck.data.source != Source::Synthetic && !file_exists(&deck.data.path) {
        missing.push(format!("[data] path = \"{}\"", deck.data.path));
    }
    if !deck.eval.path.is_empty() && !file_exists(&deck.eval.path) {
        missing.push(format!("[eval] path = \"{}\"", deck.eval.path));
    }
    if !deck.checkpoint.init_from.is_empty() && !Path::new(&deck.checkpoint.init_from).is_dir() {
        missing.push(format!("[checkpoint] init_from = \"{}\" (a folder)", deck.checkpoint.init_from));
    }
    let resume = &deck.checkpoint.resume;
    if !resume.is_empty() && resume != "auto" && !Path::new(resume).is_file() {
        missing.push(format!("[checkpoint] resume = \"{resume}\""));
    }
    missing
}

/// What one point's jobs are, before anything is written.
struct Planned {
    label: String,
    ranks: usize,
    queue: Queue,
    /// Per repeat: the deck text and its run folder.
    decks: Vec<(String, PathBuf)>,
    gpu: bool,
}

/// Expands `study_path` into `out` (default: the study's `out`, else `out/studies/<name>`),
/// relative paths against the current directory.
pub fn run(study_path: &Path, out: Option<&Path>) -> Result<Vec<Expanded>, String> {
    let cwd = std::env::current_dir().map_err(|e| format!("the current directory: {e}"))?;
    let text = std::fs::read_to_string(study_path).map_err(|e| format!("cannot read {}: {e}", study_path.display()))?;
    let study = study::parse(&text).map_err(|e| format!("{}: {e}", study_path.display()))?;
    let s = &study.study;
    if s.scaling != "strong" && s.scaling != "weak" {
        return Err(format!("{}: [study] scaling = \"{}\": use \"strong\" or \"weak\"", study_path.display(), s.scaling));
    }
    let launcher = Launcher::parse(&s.launcher).map_err(|e| format!("{}: {e}", study_path.display()))?;
    let study_dir = absolute(study_path.parent().unwrap_or(Path::new(".")), &cwd);
    let base = study_dir.join(&s.base);
    let jobscripts = scripts::find_jobscripts(study_path)?;
    let out = absolute(
        &match out {
            Some(o) => o.to_path_buf(),
            None if !s.out.is_empty() => PathBuf::from(&s.out),
            None => Path::new("out/studies").join(&s.name),
        },
        &cwd,
    );
    let no_queue = study::QueueKeys::default();
    let mut points: Vec<Point> =
        s.ranks.iter().map(|&ranks| Point { ranks, label: String::new(), set: BTreeMap::new(), queue: no_queue.clone() }).collect();
    points.extend(study.point);
    if points.is_empty() {
        return Err(format!("{}: the study has no points: give [study] ranks or [[point]] tables", study_path.display()));
    }

    // Every check first: nothing is written for a study that would fail.
    let mut planned = vec![];
    let mut global_batches = vec![];
    let mut labels = std::collections::BTreeSet::new();
    for p in &points {
        let label = if p.label.is_empty() { format!("ranks_{}", p.ranks) } else { p.label.clone() };
        if label.is_empty() || !label.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) || label.starts_with('.') {
            return Err(format!("study {}: point label \"{label}\": use letters, digits, '-', '_' and '.'", s.name));
        }
        if !labels.insert(label.clone()) {
            return Err(format!("study {}: two points are labelled \"{label}\": give each a label of its own", s.name));
        }
        let whose = format!("study {} point {label}", s.name);
        let queue = Queue::of(&s.queue, &p.queue, launcher, &whose)?;
        let mut lines: Vec<String> = study.set.iter().map(|(k, v)| override_line(k, v)).collect();
        for (k, v) in &study.per_rank {
            lines.push(override_line(k, &times(k, v, p.ranks)?));
        }
        lines.extend(p.set.iter().map(|(k, v)| override_line(k, v)));
        let mut deck = Deck::from_file(&base, &lines).map_err(|e| format!("{whose}: {e}"))?;
        absolute_paths(&mut deck, &cwd);
        let res = deck.resolve(p.ranks).map_err(|e| format!("{whose} ({} ranks): {e}", p.ranks))?;
        let missing = missing_inputs(&deck);
        if !missing.is_empty() {
            return Err(format!("{whose}: the deck reads what does not exist: {}", missing.join(", ")));
        }
        if let Some(setup) = &queue.setup {
            let setup = absolute(Path::new(setup), &study_dir);
            if !setup.is_file() {
                return Err(format!("{whose}: setup = \"{}\": no such file", setup.display()));
            }
        }
        global_batches.push((p.ranks, res.tokens_per_step));
        let header = format!(
            "# Point {label} of study {} ({} scaling, {} ranks), from {} by ndtrain sweep.\n",
            s.name,
            s.scaling,
            p.ranks,
            base.display()
        );
        let mut decks = vec![];
        for r in 1..=queue.repeats {
            // Runs are named by their folder in reports: one folder per point label (and repeat).
            let run_dir =
                if queue.repeats == 1 { out.join("runs").join(&label) } else { out.join("runs").join(&label).join(format!("r{r}")) };
            let mut d = deck.clone();
            d.run.name = format!("{}_{label}_r{r}", s.name);
            d.run.out_dir = run_dir.display().to_string();
            decks.push((header.clone() + &d.to_toml(), run_dir));
        }
        planned.push(Planned { label, ranks: p.ranks, gpu: deck.run.device == Device::Cuda, queue, decks });
    }
    check_scaling(&s.scaling, &global_batches).map_err(|e| format!("study {}: {e}", s.name))?;

    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let mut expanded = vec![];
    for p in &planned {
        let setup = p.queue.setup.as_ref().map(|f| absolute(Path::new(f), &study_dir));
        for (i, (deck_text, run_dir)) in p.decks.iter().enumerate() {
            let repeat = i + 1;
            let dir = if p.queue.repeats == 1 { out.join(&p.label) } else { out.join(&p.label).join(format!("r{repeat}")) };
            std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
            let deck = dir.join("deck.toml");
            write(&deck, deck_text, false)?;
            let name = format!("{}_{}_r{repeat}", s.name, p.label);
            let job = dir.join("job.sh");
            let spec = Job {
                study: s,
                launcher,
                queue: &p.queue,
                jobscripts: &jobscripts,
                out: &out,
                dir: &dir,
                deck: &deck,
                ranks: p.ranks,
                gpu: p.gpu,
                name: &name,
                setup: setup.as_deref(),
            };
            let text = scripts::job_script(&spec).map_err(|e| format!("study {} point {}: {e}", s.name, p.label))?;
            write(&job, &text, true)?;
            expanded.push(Expanded {
                label: p.label.clone(),
                ranks: p.ranks,
                repeat,
                dir,
                deck,
                job,
                run_dir: run_dir.clone(),
                name,
                gpu: p.gpu,
            });
        }
    }
    write_manifest(&out, &expanded)?;
    write(&out.join(STUDY_COPY), &text, false)?;
    let first = &planned[0].queue;
    let setup = first.setup.as_ref().map(|f| absolute(Path::new(f), &study_dir));
    write(&out.join("report.sh"), &scripts::report_script(s, &out, setup.as_deref()), true)?;
    if let Some(t) = scripts::submit_report_script(s, launcher, first, &out, setup.as_deref()) {
        write(&out.join(submit::SUBMIT_REPORT), &t, true)?;
    }
    write(&out.join("run_all.sh"), &scripts::run_all_script(s, &out), true)?;
    Ok(expanded)
}

/// `points.csv`: the report and `submit` read the study from it.
fn write_manifest(out: &Path, jobs: &[Expanded]) -> Result<(), String> {
    let mut csv = format!("{POINTS_HEADER}\n");
    for j in jobs {
        for p in [&j.run_dir, &j.deck, &j.job] {
            if p.display().to_string().contains([',', '\n', '"']) {
                return Err(format!("{}: a path in {POINTS_CSV} cannot hold a comma, quote or newline", p.display()));
            }
        }
        csv += &format!("{},{},{},{},{},{}\n", j.label, j.ranks, j.repeat, j.run_dir.display(), j.deck.display(), j.job.display());
    }
    write(&out.join(POINTS_CSV), &csv, false)
}

/// A row of `points.csv`.
#[derive(Debug, Clone)]
pub struct ManifestRow {
    pub label: String,
    pub ranks: usize,
    pub repeat: usize,
    pub run_dir: PathBuf,
    pub deck: PathBuf,
    pub job: PathBuf,
}

/// Reads `<out>/points.csv`.
pub fn read_manifest(out: &Path) -> Result<Vec<ManifestRow>, String> {
    let path = out.join(POINTS_CSV);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!("cannot read {}: {e} (write the study with ndtrain sweep STUDY.toml --out {})", path.display(), out.display())
    })?;
    let mut lines = text.lines();
    if lines.next() != Some(POINTS_HEADER) {
        return Err(format!("{}: the first line is not \"{POINTS_HEADER}\"", path.display()));
    }
    lines
        .enumerate()
        .filter(|(_, l)| !l.is_empty())
        .map(|(i, l)| {
            let f: Vec<&str> = l.split(',').collect();
            let bad = || format!("{} line {}: \"{l}\" is not {POINTS_HEADER}", path.display(), i + 2);
            if f.len() != 6 {
                return Err(bad());
            }
            Ok(ManifestRow {
                label: f[0].to_string(),
                ranks: f[1].parse().map_err(|_| bad())?,
                repeat: f[2].parse().map_err(|_| bad())?,
                run_dir: f[3].into(),
                deck: f[4].into(),
                job: f[5].into(),
            })
        })
        .collect()
}

/// The launcher of the study written to `out`.
pub fn launcher_of(out: &Path) -> Result<Launcher, String> {
    let path = out.join(STUDY_COPY);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let study = study::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Launcher::parse(&study.study.launcher)
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

/// `s` quoted for a shell, for the lines `sweep` prints.
pub fn shell_word(s: &Path) -> String {
    quote(&s.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use study::{QueueKeys, StudyCfg};

    fn study(launcher: &str, cpus_per_rank: usize) -> StudyCfg {
        StudyCfg {
            name: "s".into(),
            description: String::new(),
            base: "b.toml".into(),
            scaling: "strong".into(),
            launcher: launcher.into(),
            ranks_per_node: 4,
            cpus_per_rank,
            gpus_per_node: 2,
            ranks: vec![],
            out: String::new(),
            queue: QueueKeys::default(),
        }
    }

    fn job(s: &StudyCfg, q: &Queue, gpu: bool) -> Result<String, String> {
        let launcher = Launcher::parse(&s.launcher).unwrap();
        let (js, d) = (Path::new("/j"), Path::new("/o/p"));
        let spec = Job {
            study: s,
            launcher,
            queue: q,
            jobscripts: js,
            out: Path::new("/o"),
            dir: d,
            deck: Path::new("/o/p/deck.toml"),
            ranks: 16,
            gpu,
            name: "s_p_r1",
            setup: Some(Path::new("/site/setup.sh")),
        };
        scripts::job_script(&spec)
    }

    /// Each rank asks for its CPUs: Slurm's `--cpus-per-task`, PBS's `ncpus` for every rank of
    /// a node and `ompthreads` (what `train.pbs` reads the threads from); the queue options and
    /// the setup file go with every job, and a cuda deck gets the GPU script.
    #[test]
    fn a_job_asks_the_batch_system_for_its_resources_and_queue() {
        let q = Queue { walltime: Some("00:10:00".into()), account: Some("acc".into()), exclusive: true, repeats: 1, ..Queue::default() };
        let slurm = job(&study("slurm", 8), &q, false).unwrap();
        assert!(
            slurm.contains("sbatch --parsable --job-name=s_p_r1 --nodes=4 --ntasks-per-node=4 --cpus-per-task=8 --time=00:10:00 --account=acc --exclusive --chdir=/o --output=/o/p/job.out --export=ALL,DECK=/o/p/deck.toml,JOBSCRIPTS=/j,NDTRAIN_SETUP=/site/setup.sh \"$@\" /j/slurm/train.sbatch"),
            "{slurm}"
        );
        let gpu = job(&study("slurm", 8), &q, true).unwrap();
        assert!(gpu.contains("--gpus-per-node=2 ") && gpu.contains(" /j/slurm/train_gpu.sbatch\n"), "{gpu}");
        let pbs = job(&study("pbs", 8), &q, true).unwrap();
        assert!(
            pbs.contains("qsub -N s_p_r1 -l select=4:ncpus=32:mpiprocs=4:ompthreads=8:ngpus=2 -l walltime=00:10:00 -A acc -l place=scatter:excl -j oe -o /o/p/job.out -v \"$vars\" \"$@\" /j/pbs/train_gpu.pbs"),
            "{pbs}"
        );
        assert!(pbs.contains("vars=DECK=/o/p/deck.toml,JOBSCRIPTS=/j,NDTRAIN_SETUP=/site/setup.sh\n"), "{pbs}");
        let e = job(&study("pbs", 0), &q, false).unwrap_err();
        assert!(e.contains("cpus_per_rank = 0"), "{e}");
        let mut no_gpus = study("slurm", 1);
        no_gpus.gpus_per_node = 0;
        let e = job(&no_gpus, &q, true).unwrap_err();
        assert!(e.contains("device = \"cuda\", but [study] gpus_per_node = 0"), "{e}");
    }

    #[test]
    fn data_patterns_match_as_the_reader_matches_them() {
        assert!(wildcard("train_*.bin", "train_000001.bin"));
        assert!(wildcard("a*b*c", "axxbyyc"));
        assert!(!wildcard("a*b*c", "axxc"));
        assert!(!wildcard("train_*.bin", "val_000001.bin"));
        assert!(wildcard("exact.bin", "exact.bin") && !wildcard("exact.bin", "exact.bin2"));
    }
}
