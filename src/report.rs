//! `ndtrain report`: summaries and plots of the logs of one or more finished (or stopped) runs.
//!
//! Owns reading a run directory as `ndtrain train` leaves it (`deck.toml`, `metrics.csv`,
//! `timing/rank_<5 digits>.csv`), the statistics drawn from it (median step time, throughput,
//! per-phase load imbalance across ranks, bytes per collective, peak memory), the scaling
//! analysis across runs, and writing `summary.md`, `summary.csv`, `scaling.csv` and the plots
//! (PNG and SVG, drawn with `plotters`, text through a TrueType font loaded at run time).
//!
//! Knows nothing of training itself: it links none of the trainer's state, only the file
//! formats. Columns are found by name in each header, so logs with more columns still read;
//! the phase order comes from [`crate::metrics::PHASES`] and the run's shape from the
//! `# Resolved by ...` comment that opens `deck.toml`.

use crate::metrics::{fmt_bytes, median, PHASES};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::error::Error;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Writes the report of `runs` into `out` (created); returns the files written.
pub fn run(runs: &[PathBuf], out: &Path) -> Result<Vec<PathBuf>, String> {
    if runs.is_empty() {
        return Err("ndtrain report: no run directories given".into());
    }
    let logs = runs.iter().map(|dir| RunLog::read(dir)).collect::<Result<Vec<_>, _>>()?;
    let names = unique_names(&logs);
    let summaries = logs.iter().zip(names).map(|(log, name)| RunSummary::of(log, name)).collect::<Result<Vec<_>, _>>()?;
    let scaling = (summaries.len() >= 2).then(|| Scaling::of(&summaries));
    // Before anything is written: a missing font should not leave half a report behind.
    register_font()?;
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create the report directory {}: {e}", out.display()))?;

    let mut written = vec![
        write_text(&out.join("summary.md"), &summary_markdown(&summaries, scaling.as_ref()))?,
        write_text(&out.join("summary.csv"), &summary_csv(&summaries))?,
    ];
    if let Some(s) = &scaling {
        written.push(write_text(&out.join("scaling.csv"), &scaling_csv(s))?);
    }
    written.extend(write_figure(&LossFigure { runs: &summaries }, out, "loss")?);
    for s in &summaries {
        written.extend(write_figure(&PhaseFigure { run: s }, out, &format!("phases_{}", s.name))?);
    }
    written.extend(write_figure(&CommFigure { runs: &summaries }, out, "comm_bytes")?);
    if let Some(s) = &scaling {
        written.extend(write_figure(&ScalingFigure { scaling: s }, out, "scaling")?);
    }
    Ok(written)
}

fn write_text(path: &Path, text: &str) -> Result<PathBuf, String> {
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path.to_path_buf())
}

// ------------------------------------------------------------------------------------------
// Reading the logs
// ------------------------------------------------------------------------------------------

/// A CSV log: the header and the rows' fields, parsed as numbers only in the columns asked
/// for (a column this report does not read may hold anything).
struct CsvTable {
    path: PathBuf,
    header: Vec<String>,
    /// `(line number, fields)`, the line numbers 1-based as editors show them.
    rows: Vec<(usize, Vec<String>)>,
}

impl CsvTable {
    fn read(path: &Path) -> Result<CsvTable, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut lines = text.lines().enumerate();
        let header: Vec<String> = match lines.next() {
            Some((_, h)) if !h.trim().is_empty() => h.split(',').map(|c| c.trim().to_string()).collect(),
            _ => return Err(format!("{}: empty file (no header line)", path.display())),
        };
        let mut rows = Vec::new();
        for (index, line) in lines.filter(|(_, l)| !l.trim().is_empty()) {
            let fields: Vec<String> = line.split(',').map(|f| f.trim().to_string()).collect();
            if fields.len() != header.len() {
                return Err(format!("{}:{}: {} fields, but the header has {}", path.display(), index + 1, fields.len(), header.len()));
            }
            rows.push((index + 1, fields));
        }
        Ok(CsvTable { path: path.to_path_buf(), header, rows })
    }

    fn index_of(&self, name: &str) -> Option<usize> {
        self.header.iter().position(|h| h == name)
    }

    /// Column `name` as numbers, one per row; a field that is not a number is an error naming
    /// the file, the line and the column.
    fn column(&self, name: &str) -> Result<Vec<f64>, String> {
        let i = self.index_of(name).ok_or_else(|| format!("{}: no column '{name}' in the header", self.path.display()))?;
        self.rows.iter().map(|(line, fields)| parse_field(&self.path, *line, name, &fields[i])).collect()
    }

    /// The `step` column as integers, one per row.
    fn steps(&self) -> Result<Vec<u64>, String> {
        Ok(self.column("step")?.into_iter().map(|s| s as u64).collect())
    }
}

fn parse_field(path: &Path, line: usize, column: &str, field: &str) -> Result<f64, String> {
    field.parse::<f64>().map_err(|_| format!("{}:{line}: column '{column}': '{field}' is not a number", path.display()))
}

/// The layout of the mesh: `dp_replicate × dp_shard × cp × tp` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    dp_replicate: usize,
    dp_shard: usize,
    cp: usize,
    tp: usize,
}

impl Layout {
    /// `dp_shard=2 tp=2`: the dimensions of degree above one (`serial` for one rank).
    fn short(&self) -> String {
        let dims = [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)];
        let parts: Vec<String> = dims.iter().filter(|(_, d)| *d > 1).map(|(n, d)| format!("{n}={d}")).collect();
        if parts.is_empty() {
            "serial".into()
        } else {
            parts.join(" ")
        }
    }
}

/// What the report needs from `deck.toml`: the resolved shape of the run.
#[derive(Clone, Debug)]
struct DeckFacts {
    ranks: usize,
    layout: Layout,
    global_batch: usize,
    seq_len: usize,
}

impl DeckFacts {
    /// Reads the first-line comment (`# Resolved by ndtrain ... for 4 ranks: layout
    /// dp_replicate=1 dp_shard=2 cp=1 tp=2, grad_accum=4, global_batch=16, ...`), which holds
    /// the resolved values (the TOML body keeps `dp_shard = -1` and friends as written), and
    /// `train.seq_len` from the TOML body.
    fn read(path: &Path) -> Result<DeckFacts, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let first = text.lines().next().unwrap_or("");
        let bad_comment = || {
            format!(
                "{}:1: expected the comment that ndtrain train writes, \
                 '# Resolved by ndtrain ... for N ranks: layout dp_replicate=.. dp_shard=.. cp=.. tp=.., ... global_batch=..'",
                path.display()
            )
        };
        if !first.starts_with("# Resolved by") {
            return Err(bad_comment());
        }
        let words: Vec<&str> = first.split(|c: char| c.is_whitespace() || c == ',' || c == ':').filter(|w| !w.is_empty()).collect();
        let pairs: BTreeMap<&str, usize> =
            words.iter().filter_map(|w| w.split_once('=')).filter_map(|(k, v)| v.parse().ok().map(|v| (k, v))).collect();
        let get = |key: &str| pairs.get(key).copied().ok_or_else(bad_comment);
        let layout = Layout { dp_replicate: get("dp_replicate")?, dp_shard: get("dp_shard")?, cp: get("cp")?, tp: get("tp")? };
        let ranks = words
            .windows(3)
            .find(|w| w[0] == "for" && w[2].starts_with("rank"))
            .and_then(|w| w[1].parse().ok())
            .unwrap_or(layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp);
        let toml: toml::Value = text.parse().map_err(|e| format!("{}: not valid TOML: {e}", path.display()))?;
        let seq_len = toml
            .get("train")
            .and_then(|t| t.get("seq_len"))
            .and_then(|v| v.as_integer())
            .filter(|&v| v > 0)
            .ok_or_else(|| format!("{}: no positive [train] seq_len", path.display()))? as usize;
        Ok(DeckFacts { ranks, layout, global_batch: get("global_batch")?, seq_len })
    }
}

/// The logs of one run directory, read and checked.
struct RunLog {
    dir: PathBuf,
    deck: DeckFacts,
    metrics: CsvTable,
    /// One timing log per rank, in rank order.
    timing: Vec<CsvTable>,
}

impl RunLog {
    fn read(dir: &Path) -> Result<RunLog, String> {
        if !dir.is_dir() {
            return Err(format!("{}: not a directory (expected a run directory of ndtrain train)", dir.display()));
        }
        let metrics_path = dir.join("metrics.csv");
        let timing_dir = dir.join("timing");
        let deck_path = dir.join("deck.toml");
        for (path, what) in [(&metrics_path, "metrics.csv"), (&timing_dir, "timing/"), (&deck_path, "deck.toml")] {
            if !path.exists() {
                return Err(format!("{}: no {what} in this directory: is it a run directory of ndtrain train?", dir.display()));
            }
        }
        let deck = DeckFacts::read(&deck_path)?;
        let metrics = CsvTable::read(&metrics_path)?;
        if metrics.rows.is_empty() {
            return Err(format!("{}: no steps logged", metrics_path.display()));
        }
        let timing = read_timing_logs(&timing_dir, deck.ranks)?;
        Ok(RunLog { dir: dir.to_path_buf(), deck, metrics, timing })
    }
}

/// Reads `timing/rank_*.csv`; there must be exactly one per rank, 0 to `ranks - 1`.
fn read_timing_logs(dir: &Path, ranks: usize) -> Result<Vec<CsvTable>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut found: Vec<(usize, PathBuf)> = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(rank) = name.strip_prefix("rank_").and_then(|r| r.strip_suffix(".csv")).and_then(|r| r.parse().ok()) {
            found.push((rank, entry.path()));
        }
    }
    found.sort();
    let have: Vec<usize> = found.iter().map(|(r, _)| *r).collect();
    if have != (0..ranks).collect::<Vec<_>>() {
        return Err(format!("{}: expected the logs rank_00000.csv .. of {ranks} ranks (deck.toml), found ranks {have:?}", dir.display()));
    }
    let tables = found.iter().map(|(_, p)| CsvTable::read(p)).collect::<Result<Vec<_>, _>>()?;
    for t in &tables {
        if t.rows.is_empty() {
            return Err(format!("{}: no steps logged", t.path.display()));
        }
    }
    Ok(tables)
}

/// Run names for tables, legends and file names: the directory's name, made safe for a file
/// name and unique (a suffix `_2`, `_3`, ... when two directories share a name).
fn unique_names(logs: &[RunLog]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for log in logs {
        let dir = std::fs::canonicalize(&log.dir).unwrap_or_else(|_| log.dir.clone());
        let raw = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into());
        let base: String = raw.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
        let mut name = base.clone();
        let mut k = 2;
        while names.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        names.push(name);
    }
    names
}

// ------------------------------------------------------------------------------------------
// Statistics
// ------------------------------------------------------------------------------------------

/// The steady-state part of a run's steps: the first step pays one-time costs (allocations,
/// page faults, the first communicator use), so it is left out when there are 3 or more.
fn steady<T>(steps: &[T]) -> &[T] {
    if steps.len() >= 3 {
        &steps[1..]
    } else {
        steps
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// One phase's seconds per step across ranks: the mean over steady steps of each step's
/// min, mean and max across ranks.
#[derive(Clone, Debug)]
struct PhaseStat {
    phase: &'static str,
    min: f64,
    avg: f64,
    max: f64,
}

impl PhaseStat {
    /// `(max - avg) / avg`: how much longer the slowest rank took than the average (0 when
    /// the phase took no time).
    fn imbalance(&self) -> f64 {
        if self.avg > 0.0 {
            (self.max - self.avg) / self.avg
        } else {
            0.0
        }
    }
}

/// Everything the tables and plots show about one run.
struct RunSummary {
    name: String,
    dir: String,
    ranks: usize,
    layout: Layout,
    steps: usize,
    global_batch: usize,
    seq_len: usize,
    tokens_per_step: usize,
    /// Median over the steady steps of `metrics.csv`'s `step_s` (the training time of a step,
    /// without checkpoint and logging: what `tokens_per_s` is computed from).
    median_step_s: f64,
    tokens_per_s: f64,
    final_loss: f64,
    /// Median of `metrics.csv`'s `mfu` over the steady steps (NaN when the column is absent).
    mfu: f64,
    /// What the per-rank timing logs say.
    timing: TimingStats,
    /// `(step, loss)` of every logged step.
    loss_curve: Vec<(f64, f64)>,
}

impl RunSummary {
    fn of(log: &RunLog, name: String) -> Result<RunSummary, String> {
        let metrics = &log.metrics;
        let steps = metrics.steps()?;
        let losses = metrics.column("loss")?;
        let step_s = metrics.column("step_s")?;
        let mfu = match metrics.index_of("mfu") {
            Some(_) => median(steady(&metrics.column("mfu")?)),
            None => f64::NAN,
        };
        let median_step_s = median(steady(&step_s));
        let tokens_per_step = log.deck.global_batch * log.deck.seq_len;
        let timing = TimingStats::of(&log.timing)?;
        Ok(RunSummary {
            name,
            dir: log.dir.display().to_string(),
            ranks: log.deck.ranks,
            layout: log.deck.layout,
            steps: steps.len(),
            global_batch: log.deck.global_batch,
            seq_len: log.deck.seq_len,
            tokens_per_step,
            median_step_s,
            tokens_per_s: tokens_per_step as f64 / median_step_s,
            final_loss: *losses.last().expect("metrics has rows"),
            mfu,
            timing,
            loss_curve: steps.iter().zip(&losses).map(|(&s, &l)| (s as f64, l)).collect(),
        })
    }

    fn tokens_per_s_per_rank(&self) -> f64 {
        self.tokens_per_s / self.ranks as f64
    }

    fn comm_bytes_of(&self, collective: &str) -> f64 {
        self.timing.comm_bytes.iter().find(|(c, _)| c == collective).map_or(0.0, |(_, b)| *b)
    }

    fn phase(&self, phase: &str) -> Option<&PhaseStat> {
        self.timing.phases.iter().find(|p| p.phase == phase)
    }
}

/// The statistics of a run's per-rank timing logs, over the steady steps every rank logged.
struct TimingStats {
    /// Steps of the timing logs the phase and byte statistics average over.
    steps: usize,
    phases: Vec<PhaseStat>,
    /// `[rank][phase]`: mean seconds per step, phases in `phases` order.
    rank_phase_s: Vec<Vec<f64>>,
    /// Mean of the timing logs' `step_s` per rank (wall time of the whole step), if logged.
    rank_step_s: Option<Vec<f64>>,
    /// `(group.kind, bytes per step per rank)`, mean over ranks and steps; non-zero only.
    comm_bytes: Vec<(String, f64)>,
    peak_rss_bytes: Option<u64>,
}

impl TimingStats {
    fn of(ranks: &[CsvTable]) -> Result<TimingStats, String> {
        let first = &ranks[0];
        // A killed job may leave ranks one step apart: use the steps every rank finished.
        let row_of_step: Vec<BTreeMap<u64, usize>> = ranks
            .iter()
            .map(|t| Ok(t.steps()?.into_iter().enumerate().map(|(row, step)| (step, row)).collect()))
            .collect::<Result<_, String>>()?;
        let common: Vec<u64> = row_of_step[0].keys().copied().filter(|s| row_of_step.iter().all(|r| r.contains_key(s))).collect();
        let window = steady(&common);
        if window.is_empty() {
            return Err(format!("{}: the ranks' timing logs share no step", first.path.parent().unwrap_or(&first.path).display()));
        }
        // [rank][i]: the row of each rank's log that holds the i-th step of the window.
        let rows: Vec<Vec<usize>> = row_of_step.iter().map(|r| window.iter().map(|s| r[s]).collect()).collect();
        let phases: Vec<&'static str> = PHASES.iter().copied().filter(|p| first.index_of(&format!("{p}_s")).is_some()).collect();
        if phases.is_empty() {
            return Err(format!("{}: none of the phase columns {:?} (as <phase>_s)", first.path.display(), PHASES));
        }
        // [rank][step in window] for one column.
        let series = |column: &str| -> Result<Vec<Vec<f64>>, String> {
            ranks.iter().zip(&rows).map(|(t, rows)| t.column(column).map(|values| rows.iter().map(|&r| values[r]).collect())).collect()
        };
        let mut phase_stats = Vec::new();
        let mut rank_phase_s = vec![Vec::new(); ranks.len()];
        for phase in &phases {
            let s = series(&format!("{phase}_s"))?;
            phase_stats.push(phase_across_ranks(phase, &s));
            for (rank, values) in s.iter().enumerate() {
                rank_phase_s[rank].push(mean(values));
            }
        }
        let rank_step_s = match first.index_of("step_s") {
            Some(_) => Some(series("step_s")?.iter().map(|v| mean(v)).collect()),
            None => None,
        };
        let mut comm_bytes = Vec::new();
        for collective in first.header.iter().filter_map(|h| h.strip_suffix("_bytes")).filter(|c| c.contains('.')) {
            let s = series(&format!("{collective}_bytes"))?;
            let per_rank = mean(&s.iter().map(|v| mean(v)).collect::<Vec<_>>());
            if per_rank > 0.0 {
                comm_bytes.push((collective.to_string(), per_rank));
            }
        }
        let peak_rss_bytes = match first.index_of("peak_rss_bytes") {
            Some(_) => {
                let all = ranks.iter().map(|t| t.column("peak_rss_bytes")).collect::<Result<Vec<_>, _>>()?;
                Some(all.iter().flatten().fold(0.0f64, |m, &v| m.max(v)) as u64)
            }
            None => None,
        };
        Ok(TimingStats { steps: window.len(), phases: phase_stats, rank_phase_s, rank_step_s, comm_bytes, peak_rss_bytes })
    }
}

/// `series[rank][step]` of one phase → the mean over steps of the min/avg/max across ranks.
fn phase_across_ranks(phase: &'static str, series: &[Vec<f64>]) -> PhaseStat {
    let steps = series[0].len();
    let at = |step: usize| series.iter().map(move |rank| rank[step]);
    let mins: Vec<f64> = (0..steps).map(|s| at(s).fold(f64::INFINITY, f64::min)).collect();
    let avgs: Vec<f64> = (0..steps).map(|s| at(s).sum::<f64>() / series.len() as f64).collect();
    let maxs: Vec<f64> = (0..steps).map(|s| at(s).fold(f64::NEG_INFINITY, f64::max)).collect();
    PhaseStat { phase, min: mean(&mins), avg: mean(&avgs), max: mean(&maxs) }
}

/// Every collective (`group.kind`) any run used, in the order they first appear.
fn collectives_of(runs: &[RunSummary]) -> Vec<String> {
    let mut all: Vec<String> = Vec::new();
    for (c, _) in runs.iter().flat_map(|r| &r.timing.comm_bytes) {
        if !all.contains(c) {
            all.push(c.clone());
        }
    }
    all
}

// ------------------------------------------------------------------------------------------
// Scaling
// ------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ScalingMode {
    /// Same tokens per step on every run: the work is split over more ranks.
    Strong,
    /// Tokens per step proportional to ranks: each rank keeps the same work.
    Weak,
    /// Neither: speed-up and efficiency are still computed from throughput.
    Mixed,
}

impl ScalingMode {
    fn as_str(self) -> &'static str {
        match self {
            ScalingMode::Strong => "strong",
            ScalingMode::Weak => "weak",
            ScalingMode::Mixed => "mixed",
        }
    }
}

struct ScalingRow {
    name: String,
    ranks: usize,
    tokens_per_step: usize,
    step_s: f64,
    tokens_per_s: f64,
    speedup: f64,
    efficiency: f64,
}

/// The runs against the one with the fewest ranks (the first given among equals), sorted by
/// ranks.
struct Scaling {
    mode: ScalingMode,
    base_name: String,
    base_ranks: usize,
    base_tokens_per_s: f64,
    rows: Vec<ScalingRow>,
}

impl Scaling {
    fn of(runs: &[RunSummary]) -> Scaling {
        let base = runs.iter().min_by_key(|r| r.ranks).expect("two or more runs");
        let mode = if runs.iter().all(|r| r.tokens_per_step == base.tokens_per_step) {
            ScalingMode::Strong
        } else if runs.iter().all(|r| r.tokens_per_step * base.ranks == base.tokens_per_step * r.ranks) {
            ScalingMode::Weak
        } else {
            ScalingMode::Mixed
        };
        let mut rows: Vec<ScalingRow> = runs
            .iter()
            .map(|r| {
                let speedup = r.tokens_per_s / base.tokens_per_s;
                let efficiency = match mode {
                    // Same work per rank: ideally the step time stays the same.
                    ScalingMode::Weak => base.median_step_s / r.median_step_s,
                    // Ideally throughput grows with the ranks.
                    ScalingMode::Strong | ScalingMode::Mixed => speedup / (r.ranks as f64 / base.ranks as f64),
                };
                ScalingRow {
                    name: r.name.clone(),
                    ranks: r.ranks,
                    tokens_per_step: r.tokens_per_step,
                    step_s: r.median_step_s,
                    tokens_per_s: r.tokens_per_s,
                    speedup,
                    efficiency,
                }
            })
            .collect();
        rows.sort_by_key(|r| r.ranks);
        Scaling { mode, base_name: base.name.clone(), base_ranks: base.ranks, base_tokens_per_s: base.tokens_per_s, rows }
    }

    /// The ideal speed-up at `ranks`: linear in the ranks.
    fn ideal_speedup(&self, ranks: f64) -> f64 {
        ranks / self.base_ranks as f64
    }
}

// ------------------------------------------------------------------------------------------
// Tables
// ------------------------------------------------------------------------------------------

/// A number for people: 4 significant digits, scientific notation when very large or small.
fn fmt_num(x: f64) -> String {
    if !x.is_finite() {
        return "n/a".into();
    }
    if x == 0.0 {
        return "0".into();
    }
    let magnitude = x.abs().log10().floor() as i32;
    if !(-3..6).contains(&magnitude) {
        format!("{x:.3e}")
    } else {
        format!("{x:.*}", (3 - magnitude).max(0) as usize)
    }
}

/// An axis tick: like [`fmt_num`], without trailing zeros (`0.7`, not `0.7000`).
fn fmt_tick(x: f64) -> String {
    let s = fmt_num(x);
    if s.contains('.') && !s.contains('e') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// A tick of a logarithmic byte axis (powers of ten): decimal units, `1 B` to `100 GB`.
fn fmt_bytes_tick(bytes: f64) -> String {
    let units = ["B", "kB", "MB", "GB", "TB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1000.0 * (1.0 - 1e-9) && unit + 1 < units.len() {
        value /= 1000.0;
        unit += 1;
    }
    format!("{} {}", fmt_tick(value), units[unit])
}

fn md_row(cells: &[String]) -> String {
    format!("| {} |\n", cells.join(" | "))
}

fn md_header(cells: &[&str]) -> String {
    let mut s = md_row(&cells.iter().map(|c| c.to_string()).collect::<Vec<_>>());
    s += &md_row(&cells.iter().map(|_| "---".to_string()).collect::<Vec<_>>());
    s
}

fn summary_markdown(runs: &[RunSummary], scaling: Option<&Scaling>) -> String {
    let mut md = String::from("# ndtrain report\n\n");
    md += &runs_markdown(runs);
    md += &phases_markdown(runs);
    md += &comm_markdown(runs);
    if let Some(s) = scaling {
        md += &scaling_markdown(s);
    }
    md += &plots_markdown(runs, scaling.is_some());
    md
}

fn runs_markdown(runs: &[RunSummary]) -> String {
    let mut md = String::from("## Runs\n\n");
    md += "Median step time and MFU over the steady steps (all but the first when a run has 3 or more); ";
    md += "tokens per step = global batch × seq_len; tokens/s = tokens per step / median step time.\n\n";
    md += &md_header(&[
        "run",
        "dir",
        "ranks",
        "layout (dp_replicate×dp_shard×cp×tp)",
        "steps",
        "global batch",
        "tokens/step",
        "median step (s)",
        "tokens/s",
        "tokens/s/rank",
        "final loss",
        "MFU",
        "peak RSS (max over ranks)",
    ]);
    for r in runs {
        let l = r.layout;
        md += &md_row(&[
            r.name.clone(),
            format!("`{}`", r.dir),
            r.ranks.to_string(),
            format!("{}×{}×{}×{}", l.dp_replicate, l.dp_shard, l.cp, l.tp),
            r.steps.to_string(),
            r.global_batch.to_string(),
            r.tokens_per_step.to_string(),
            fmt_num(r.median_step_s),
            fmt_num(r.tokens_per_s),
            fmt_num(r.tokens_per_s_per_rank()),
            fmt_num(r.final_loss),
            fmt_num(r.mfu),
            r.timing.peak_rss_bytes.map_or("n/a".into(), |b| fmt_bytes(b as f64)),
        ]);
    }
    md + "\n"
}

fn phases_markdown(runs: &[RunSummary]) -> String {
    let mut md = String::from("## Phases\n\n");
    md += "Seconds per step: for each steady step the min, mean and max across ranks, averaged over the steps; ";
    md += "imbalance = (max − avg) / avg.\n\n";
    md += &md_header(&["run", "phase", "min (s)", "avg (s)", "max (s)", "imbalance", "steps averaged"]);
    for r in runs {
        for p in &r.timing.phases {
            md += &md_row(&[
                r.name.clone(),
                p.phase.to_string(),
                fmt_num(p.min),
                fmt_num(p.avg),
                fmt_num(p.max),
                format!("{:.1}%", 100.0 * p.imbalance()),
                r.timing.steps.to_string(),
            ]);
        }
    }
    md + "\n"
}

fn comm_markdown(runs: &[RunSummary]) -> String {
    let mut md = String::from("## Communication\n\n");
    md += "Bytes per step one rank moves through each collective (`group.kind`), mean over ranks and steady steps; ";
    md += "collectives that moved nothing are left out.\n\n";
    if runs.iter().all(|r| r.timing.comm_bytes.is_empty()) {
        return md + "No collective moved any bytes (single-rank runs).\n\n";
    }
    md += &md_header(&["run", "collective", "bytes/step/rank", "(binary units)"]);
    for r in runs {
        for (c, b) in &r.timing.comm_bytes {
            md += &md_row(&[r.name.clone(), c.clone(), format!("{}", b.round()), fmt_bytes(*b)]);
        }
    }
    md + "\n"
}

fn scaling_markdown(s: &Scaling) -> String {
    let mut md = format!("## Scaling ({})\n\n", s.mode.as_str());
    md += &match s.mode {
        ScalingMode::Strong => "Strong scaling: every run has the same tokens per step.".to_string(),
        ScalingMode::Weak => "Weak scaling: tokens per step grow in proportion to the ranks.".to_string(),
        ScalingMode::Mixed => "Mixed: the runs neither share the tokens per step nor scale them with the ranks.".to_string(),
    };
    let _ =
        write!(md, " Against `{}` ({} rank{}): speed-up S = tokens/s(N) / tokens/s(N0); ", s.base_name, s.base_ranks, plural(s.base_ranks));
    md += match s.mode {
        ScalingMode::Weak => "efficiency E = step time(N0) / step time(N).\n\n",
        _ => "efficiency E = S / (N / N0).\n\n",
    };
    md += &md_header(&["run", "ranks", "tokens/step", "median step (s)", "tokens/s", "speed-up", "ideal", "efficiency"]);
    for r in &s.rows {
        md += &md_row(&[
            r.name.clone(),
            r.ranks.to_string(),
            r.tokens_per_step.to_string(),
            fmt_num(r.step_s),
            fmt_num(r.tokens_per_s),
            format!("{:.3}", r.speedup),
            format!("{:.3}", s.ideal_speedup(r.ranks as f64)),
            format!("{:.1}%", 100.0 * r.efficiency),
        ]);
    }
    md + "\n"
}

fn plots_markdown(runs: &[RunSummary], scaling: bool) -> String {
    let mut md = String::from("## Plots\n\n![loss](loss.png)\n\n");
    for r in runs {
        let _ = writeln!(md, "![phases of {0}](phases_{0}.png)\n", r.name);
    }
    md += "![bytes per collective](comm_bytes.png)\n\n";
    if scaling {
        md += "![scaling](scaling.png)\n\n";
    }
    md
}

/// One row per run; `<phase>_{min,avg,max}_s` and `<phase>_imbalance` for every phase,
/// `<group.kind>_bytes` (per step per rank) for every collective any run used.
fn summary_csv(runs: &[RunSummary]) -> String {
    let collectives = collectives_of(runs);
    let mut header: Vec<String> = [
        "run",
        "dir",
        "ranks",
        "dp_replicate",
        "dp_shard",
        "cp",
        "tp",
        "steps",
        "global_batch",
        "seq_len",
        "tokens_per_step",
        "median_step_s",
        "tokens_per_s",
        "tokens_per_s_per_rank",
        "final_loss",
        "mfu",
    ]
    .map(String::from)
    .to_vec();
    for p in PHASES {
        header.extend([format!("{p}_min_s"), format!("{p}_avg_s"), format!("{p}_max_s"), format!("{p}_imbalance")]);
    }
    header.extend(collectives.iter().map(|c| format!("{c}_bytes")));
    header.push("peak_rss_bytes".into());

    let mut csv = header.join(",") + "\n";
    for r in runs {
        let l = r.layout;
        let mut row: Vec<String> = vec![csv_field(&r.name), csv_field(&r.dir)];
        row.extend(
            [r.ranks, l.dp_replicate, l.dp_shard, l.cp, l.tp, r.steps, r.global_batch, r.seq_len, r.tokens_per_step].map(|v| v.to_string()),
        );
        row.extend([r.median_step_s, r.tokens_per_s, r.tokens_per_s_per_rank(), r.final_loss, r.mfu].map(csv_num));
        for p in PHASES {
            match r.phase(p) {
                Some(s) => row.extend([s.min, s.avg, s.max, s.imbalance()].map(csv_num)),
                None => row.extend(std::iter::repeat_n(String::new(), 4)),
            }
        }
        row.extend(collectives.iter().map(|c| csv_num(r.comm_bytes_of(c))));
        row.push(r.timing.peak_rss_bytes.map_or(String::new(), |b| b.to_string()));
        csv += &(row.join(",") + "\n");
    }
    csv
}

fn scaling_csv(s: &Scaling) -> String {
    let mut csv = String::from("run,ranks,tokens_per_step,median_step_s,tokens_per_s,speedup,ideal_speedup,efficiency,mode\n");
    for r in &s.rows {
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{},{},{},{}",
            csv_field(&r.name),
            r.ranks,
            r.tokens_per_step,
            csv_num(r.step_s),
            csv_num(r.tokens_per_s),
            csv_num(r.speedup),
            csv_num(s.ideal_speedup(r.ranks as f64)),
            csv_num(r.efficiency),
            s.mode.as_str()
        );
    }
    csv
}

/// Empty for a missing value, else the shortest exact decimal.
fn csv_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        String::new()
    }
}

/// Quotes a text field that holds a comma or a quote.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

// ------------------------------------------------------------------------------------------
// Fonts
// ------------------------------------------------------------------------------------------

/// A TrueType file for the plots' text, overriding the search of [`FONT_PATHS`].
const FONT_ENV: &str = "NDTRAIN_FONT";

/// Where common distributions put a sans-serif TrueType font, best first.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/google-noto/NotoSans-Regular.ttf",
    "/Library/Fonts/Arial.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// The family name the figures ask for; the loaded font is registered under it.
const FONT_FAMILY: &str = "sans-serif";

/// Registers the font once per process (plotters keeps it in a global table).
fn register_font() -> Result<(), String> {
    static LOADED: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    LOADED.get_or_init(load_font).clone().map(|_| ())
}

/// Loads the first readable font of `$NDTRAIN_FONT` (alone, when set) or [`FONT_PATHS`].
/// Pure Rust (ab_glyph): no fontconfig or freetype on the machine.
fn load_font() -> Result<PathBuf, String> {
    let candidates: Vec<PathBuf> = match std::env::var_os(FONT_ENV) {
        Some(p) if !p.is_empty() => vec![PathBuf::from(p)],
        _ => FONT_PATHS.iter().map(PathBuf::from).collect(),
    };
    let mut tried = Vec::new();
    for path in &candidates {
        match std::fs::read(path) {
            // plotters keeps a `&'static` reference: the font lives as long as the process.
            Ok(bytes) => match plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, Box::leak(bytes.into_boxed_slice())) {
                Ok(()) => return Ok(path.clone()),
                Err(_) => tried.push(format!("{} (not a TrueType/OpenType font)", path.display())),
            },
            Err(e) => tried.push(format!("{} ({e})", path.display())),
        }
    }
    Err(format!(
        "ndtrain report draws its plots' text with a TrueType font and found none; tried: {}. \
         Install one (Debian/Ubuntu: apt-get install fonts-dejavu-core) or set {FONT_ENV} to a .ttf file",
        tried.join(", ")
    ))
}

// ------------------------------------------------------------------------------------------
// Figures
// ------------------------------------------------------------------------------------------

type DrawResult = Result<(), Box<dyn Error>>;

/// A plot drawn alike on any plotters backend (PNG and SVG).
trait Figure {
    fn size(&self) -> (u32, u32);
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static;
}

/// Draws `figure` as `<out>/<stem>.png` and `<out>/<stem>.svg`.
fn write_figure(figure: &impl Figure, out: &Path, stem: &str) -> Result<Vec<PathBuf>, String> {
    let png = out.join(format!("{stem}.png"));
    let svg = out.join(format!("{stem}.svg"));
    let failed = |path: &Path, e: Box<dyn Error>| format!("cannot draw {}: {e}", path.display());
    {
        let root = BitMapBackend::new(&png, figure.size()).into_drawing_area();
        figure.draw(&root).and_then(|()| Ok(root.present()?)).map_err(|e| failed(&png, e))?;
    }
    {
        let root = SVGBackend::new(&svg, figure.size()).into_drawing_area();
        figure.draw(&root).and_then(|()| Ok(root.present()?)).map_err(|e| failed(&svg, e))?;
    }
    Ok(vec![png, svg])
}

/// Tableau 10: distinct colours that stay distinct in print.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn title_font() -> TextStyle<'static> {
    (FONT_FAMILY, 26).into_font().color(&BLACK)
}

fn axis_font() -> TextStyle<'static> {
    (FONT_FAMILY, 20).into_font().color(&BLACK)
}

fn tick_font() -> TextStyle<'static> {
    (FONT_FAMILY, 16).into_font().color(&BLACK)
}

/// Width of the legend column right of a chart.
const LEGEND_W: u32 = 260;

/// Draws `entries` (label, colour) as a column of swatches in `area`, `title` above them.
fn draw_legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, title: &str, entries: &[(String, RGBColor)]) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let (x0, mut y) = (10, 70);
    area.draw(&Text::new(title.to_string(), (x0, y), axis_font()))?;
    y += 34;
    for (label, c) in entries {
        area.draw(&Rectangle::new([(x0, y), (x0 + 22, y + 16)], c.filled()))?;
        area.draw(&Text::new(label.clone(), (x0 + 32, y), tick_font()))?;
        y += 28;
    }
    Ok(())
}

/// A figure's area in pixels.
type Area<DB> = DrawingArea<DB, Shift>;

/// Splits `root` (filled white) into the chart area and the legend column.
fn chart_and_legend<DB: DrawingBackend>(root: &Area<DB>) -> Result<(Area<DB>, Area<DB>), Box<dyn Error>>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let (w, _) = root.dim_in_pixel();
    Ok(root.split_horizontally(w.saturating_sub(LEGEND_W)))
}

/// An axis of `n` slots (ranks, collectives): slot `i` is centred on `i`, values in between
/// place bars inside a slot, and the ticks are the slot centres (at most as many as fit).
struct SlotAxis {
    slots: usize,
}

impl Ranged for SlotAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let fraction = (value + 0.5) / self.slots as f64;
        limit.0 + ((limit.1 - limit.0) as f64 * fraction).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        let every = self.slots.div_ceil(hint.max_num_points().max(1)).max(1);
        (0..self.slots).step_by(every).map(|i| i as f64).collect()
    }

    fn range(&self) -> std::ops::Range<f64> {
        -0.5..self.slots as f64 - 0.5
    }
}

/// `[lo, hi]` widened by `pad` of its span on both sides (a flat range gets a span).
fn padded(lo: f64, hi: f64, pad: f64) -> (f64, f64) {
    let span = if hi > lo { hi - lo } else { lo.abs().max(1.0) };
    (lo - pad * span, hi + pad * span)
}

/// Loss against step, one line per run.
struct LossFigure<'a> {
    runs: &'a [RunSummary],
}

impl Figure for LossFigure<'_> {
    fn size(&self) -> (u32, u32) {
        (1200, 700)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let (plot, legend) = chart_and_legend(root)?;
        // A diverged run logs inf or NaN losses: they are left out of the axes and the lines.
        let finite = |r: &'_ RunSummary| r.loss_curve.iter().copied().filter(|p| p.1.is_finite()).collect::<Vec<_>>();
        let curves: Vec<Vec<(f64, f64)>> = self.runs.iter().map(finite).collect();
        let (x_lo, x_hi, y_lo, y_hi) = curves
            .iter()
            .flatten()
            .fold((f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY), |(x0, x1, y0, y1), &(s, l)| {
                (x0.min(s), x1.max(s), y0.min(l), y1.max(l))
            });
        let (x_lo, x_hi) = if x_lo.is_finite() { (x_lo, x_hi.max(x_lo + 1.0)) } else { (0.0, 1.0) };
        let (y_lo, y_hi) = if y_lo.is_finite() { padded(y_lo, y_hi, 0.05) } else { (0.0, 1.0) };
        let mut chart = ChartBuilder::on(&plot)
            .caption("Training loss", title_font())
            .margin(20)
            .x_label_area_size(60)
            .y_label_area_size(80)
            // Steps are integers: an integer axis keeps the ticks on whole steps.
            .build_cartesian_2d(x_lo as i64..x_hi as i64, y_lo..y_hi)?;
        chart
            .configure_mesh()
            .x_desc("optimiser step")
            .y_desc("loss")
            .axis_desc_style(axis_font())
            .label_style(tick_font())
            .y_label_formatter(&|y| fmt_tick(*y))
            .draw()?;
        // Runs of one layout family reproduce each other's losses: earlier runs are drawn
        // thicker, so lines that coincide stay visible underneath.
        let n = self.runs.len();
        for (i, curve) in curves.iter().enumerate() {
            let width = 2 + 3 * (n - 1 - i) as u32;
            chart.draw_series(LineSeries::new(curve.iter().map(|&(s, l)| (s as i64, l)), color(i).stroke_width(width)))?;
        }
        let entries: Vec<(String, RGBColor)> = self.runs.iter().enumerate().map(|(i, r)| (r.name.clone(), color(i))).collect();
        draw_legend(&legend, "run", &entries)
    }
}

/// Per-rank stacked bars of the mean seconds per step in each phase.
struct PhaseFigure<'a> {
    run: &'a RunSummary,
}

impl Figure for PhaseFigure<'_> {
    fn size(&self) -> (u32, u32) {
        (1200.max(300 + 90 * self.run.ranks as u32), 700)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let run = self.run;
        let (plot, legend) = chart_and_legend(root)?;
        let stacked_max = run.timing.rank_phase_s.iter().map(|p| p.iter().sum::<f64>()).fold(0.0, f64::max);
        let step_max = run.timing.rank_step_s.iter().flatten().copied().fold(0.0, f64::max);
        let y_hi = stacked_max.max(step_max).max(1e-9) * 1.1;
        let caption = format!("Time per step by phase and rank: {} ({})", run.name, run.layout.short());
        let mut chart = ChartBuilder::on(&plot)
            .caption(caption, title_font())
            .margin(20)
            .x_label_area_size(60)
            .y_label_area_size(90)
            .build_cartesian_2d(SlotAxis { slots: run.ranks }, 0.0..y_hi)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc("rank")
            .y_desc(format!("seconds per step (mean of {} steps)", run.timing.steps))
            .axis_desc_style(axis_font())
            .label_style(tick_font())
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| fmt_tick(*y))
            .draw()?;
        for (rank, phases) in run.timing.rank_phase_s.iter().enumerate() {
            let (left, right) = (rank as f64 - 0.35, rank as f64 + 0.35);
            let mut bottom = 0.0;
            for (i, &seconds) in phases.iter().enumerate() {
                let top = bottom + seconds;
                chart.draw_series(std::iter::once(Rectangle::new([(left, bottom), (right, top)], color(i).filled())))?;
                bottom = top;
            }
        }
        // The measured wall time of the step: the gap to the stack is time no phase counts.
        if let Some(step_s) = &run.timing.rank_step_s {
            let ticks = step_s
                .iter()
                .enumerate()
                .map(|(rank, &s)| PathElement::new(vec![(rank as f64 - 0.45, s), (rank as f64 + 0.45, s)], BLACK.stroke_width(3)));
            chart.draw_series(ticks)?;
        }
        let mut entries: Vec<(String, RGBColor)> = run.timing.phases.iter().enumerate().map(|(i, p)| (phase_label(p), color(i))).collect();
        if run.timing.rank_step_s.is_some() {
            entries.push(("whole step (black line)".into(), BLACK));
        }
        draw_legend(&legend, "phase (imbalance)", &entries)
    }
}

/// `forward (+12.3%)`: the phase and how far its slowest rank is above the average.
fn phase_label(p: &PhaseStat) -> String {
    format!("{} (+{:.1}%)", p.phase, 100.0 * p.imbalance())
}

/// Bytes per step per rank for each collective, one bar per run in each group.
struct CommFigure<'a> {
    runs: &'a [RunSummary],
}

impl Figure for CommFigure<'_> {
    fn size(&self) -> (u32, u32) {
        let groups = collectives_of(self.runs).len() as u32;
        (1200.max(LEGEND_W + 140 + groups * (60 + 30 * self.runs.len() as u32)), 700)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let (plot, legend) = chart_and_legend(root)?;
        let collectives = collectives_of(self.runs);
        let entries: Vec<(String, RGBColor)> = self
            .runs
            .iter()
            .enumerate()
            .map(|(i, r)| (if r.timing.comm_bytes.is_empty() { format!("{} (no traffic)", r.name) } else { r.name.clone() }, color(i)))
            .collect();
        draw_legend(&legend, "run", &entries)?;
        let caption = "Bytes per step and rank by collective (group.kind)";
        if collectives.is_empty() {
            let plot = plot.titled(caption, title_font())?;
            let (w, h) = plot.dim_in_pixel();
            let note = "no collective moved any bytes: every run has one rank";
            plot.draw(&Text::new(note, (w as i32 / 2 - 220, h as i32 / 2), axis_font()))?;
            return Ok(());
        }
        let max = self.runs.iter().flat_map(|r| r.timing.comm_bytes.iter().map(|(_, b)| *b)).fold(1.0, f64::max);
        // Log scale: a 16-byte loss all-reduce and megabytes of gathered weights both show.
        let mut chart = ChartBuilder::on(&plot)
            .caption(caption, title_font())
            .margin(20)
            .x_label_area_size(60)
            .y_label_area_size(100)
            .build_cartesian_2d(SlotAxis { slots: collectives.len() }, (1.0..max * 4.0).log_scale())?;
        let label_of = |x: &f64| collectives.get(x.round() as usize).cloned().unwrap_or_default();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc("collective")
            .y_desc("bytes per step per rank (log scale)")
            .axis_desc_style(axis_font())
            .label_style(tick_font())
            .x_label_formatter(&label_of)
            .y_label_formatter(&|y| fmt_bytes_tick(*y))
            .draw()?;
        let width = 0.8 / self.runs.len() as f64;
        for (i, r) in self.runs.iter().enumerate() {
            let bars = collectives.iter().enumerate().filter(|(_, c)| r.comm_bytes_of(c) > 0.0).map(|(g, c)| {
                let left = g as f64 - 0.4 + i as f64 * width;
                Rectangle::new([(left, 1.0), (left + width * 0.9, r.comm_bytes_of(c))], color(i).filled())
            });
            chart.draw_series(bars)?;
        }
        Ok(())
    }
}

/// Throughput, speed-up and efficiency against ranks, each with its ideal.
struct ScalingFigure<'a> {
    scaling: &'a Scaling,
}

/// One panel of [`ScalingFigure`]: measured points (with their run's name) and the ideal line.
struct ScalingPanel<'a> {
    title: String,
    y_desc: &'a str,
    measured: Vec<(f64, f64)>,
    names: Vec<&'a str>,
    ideal: Vec<(f64, f64)>,
}

impl Figure for ScalingFigure<'_> {
    fn size(&self) -> (u32, u32) {
        (1800, 650)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let s = self.scaling;
        root.fill(&WHITE)?;
        let title =
            format!("{} scaling against {} ({} rank{})", capitalised(s.mode.as_str()), s.base_name, s.base_ranks, plural(s.base_ranks));
        let root = root.titled(&title, title_font())?;
        let panels = root.split_evenly((1, 3));
        let ranks: Vec<f64> = s.rows.iter().map(|r| r.ranks as f64).collect();
        let names: Vec<&str> = s.rows.iter().map(|r| r.name.as_str()).collect();
        let ideal_ranks = [s.base_ranks as f64, ranks.iter().copied().fold(0.0, f64::max)];
        let efficiency_ideal = match s.mode {
            ScalingMode::Weak => "efficiency = step time(N0) / step time(N)",
            _ => "efficiency = speed-up / (N / N0)",
        };
        let specs = [
            ScalingPanel {
                title: "Throughput".into(),
                y_desc: "tokens/s (global)",
                measured: s.rows.iter().map(|r| (r.ranks as f64, r.tokens_per_s)).collect(),
                names: names.clone(),
                ideal: ideal_ranks.iter().map(|&n| (n, s.base_tokens_per_s * s.ideal_speedup(n))).collect(),
            },
            ScalingPanel {
                title: "Speed-up S = tokens/s(N) / tokens/s(N0)".into(),
                y_desc: "speed-up",
                measured: s.rows.iter().map(|r| (r.ranks as f64, r.speedup)).collect(),
                names: names.clone(),
                ideal: ideal_ranks.iter().map(|&n| (n, s.ideal_speedup(n))).collect(),
            },
            ScalingPanel {
                title: capitalised(efficiency_ideal),
                y_desc: "parallel efficiency",
                measured: s.rows.iter().map(|r| (r.ranks as f64, r.efficiency)).collect(),
                names: names.clone(),
                ideal: ideal_ranks.iter().map(|&n| (n, 1.0)).collect(),
            },
        ];
        for (area, panel) in panels.iter().zip(&specs) {
            draw_scaling_panel(area, panel, &ranks)?;
        }
        Ok(())
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

fn capitalised(s: &str) -> String {
    let mut c = s.chars();
    c.next().map(|f| f.to_uppercase().collect::<String>() + c.as_str()).unwrap_or_default()
}

fn draw_scaling_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, panel: &ScalingPanel<'_>, ranks: &[f64]) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let (x_lo, x_hi) = ranks.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &n| (lo.min(n), hi.max(n)));
    // Headroom above the data for the legend in the upper left, where scaling curves that
    // start at the smallest run and rise to the right leave room.
    let y_hi = panel.measured.iter().chain(&panel.ideal).map(|p| p.1).fold(0.0, f64::max) * 1.35;
    let mut ticks: Vec<f64> = ranks.to_vec();
    ticks.dedup();
    // Ranks double from run to run in a scaling study: a log axis spaces them evenly.
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, axis_font())
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(90)
        .build_cartesian_2d((x_lo / 1.5..x_hi * 1.5).log_scale().with_key_points(ticks), 0.0..y_hi.max(1e-9))?;
    chart
        .configure_mesh()
        .x_desc("ranks N")
        .y_desc(panel.y_desc)
        .axis_desc_style(axis_font())
        .label_style(tick_font())
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| fmt_tick(*y))
        .draw()?;
    let ideal_style = RGBColor(120, 120, 120).stroke_width(2);
    chart
        .draw_series(DashedLineSeries::new(panel.ideal.iter().copied(), 10, 6, ideal_style))?
        .label("ideal")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], ideal_style));
    let measured = color(0);
    // The line joins the best run at each rank count; every run is a marker.
    let mut best: Vec<(f64, f64)> = Vec::new();
    for &(n, y) in &panel.measured {
        match best.iter_mut().find(|b| b.0 == n) {
            Some(b) => b.1 = b.1.max(y),
            None => best.push((n, y)),
        }
    }
    chart.draw_series(panel.measured.iter().map(|&p| Circle::new(p, 6, measured.stroke_width(2))))?;
    chart
        .draw_series(LineSeries::new(best, measured.stroke_width(3)))?
        .label("measured")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], measured.stroke_width(3)));
    // Each point names its run (pixel offsets: right of and above the marker).
    // Runs with the same rank count stack their names instead of overwriting each other.
    let labels = panel.measured.iter().zip(&panel.names).enumerate().map(|(i, (&p, name))| {
        let same_ranks_before = panel.measured[..i].iter().filter(|q| q.0 == p.0).count() as i32;
        EmptyElement::at(p) + Text::new(name.to_string(), (8, -22 - 18 * same_ranks_before), tick_font())
    });
    chart.draw_series(labels)?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(tick_font())
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_for_people() {
        assert_eq!(fmt_num(0.58751), "0.5875");
        assert_eq!(fmt_num(1275.6), "1276");
        assert_eq!(fmt_num(0.0), "0");
        assert_eq!(fmt_num(2.5e-5), "2.500e-5");
        assert_eq!(fmt_bytes(1713152.0), "1.63 MiB");
        assert_eq!(fmt_bytes(16.0), "16 B");
    }

    #[test]
    fn warm_up_step_is_left_out_from_three_steps_on() {
        assert_eq!(steady(&[1, 2]), &[1, 2]);
        assert_eq!(steady(&[1, 2, 3]), &[2, 3]);
    }

    #[test]
    fn phase_statistics_across_ranks() {
        // Two ranks, two steps: rank 1 is slower by 1 s in each.
        let s = phase_across_ranks("forward", &[vec![1.0, 3.0], vec![2.0, 4.0]]);
        assert_eq!((s.min, s.avg, s.max), (2.0, 2.5, 3.0));
        assert!((s.imbalance() - 0.2).abs() < 1e-12);
    }

    #[test]
    fn malformed_rows_name_file_and_line() {
        let dir = std::env::temp_dir().join(format!("ndtrain_report_unit_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.csv");
        std::fs::write(&path, "step,loss,note\n1,4.5,warm\n2,abc,x\n").unwrap();
        let table = CsvTable::read(&path).unwrap();
        assert_eq!(table.column("step").unwrap(), [1.0, 2.0]);
        let e = table.column("loss").unwrap_err();
        assert!(e.contains("m.csv:3") && e.contains("'loss'") && e.contains("abc"), "{e}");
        std::fs::write(&path, "step,loss\n1,4.5\n2\n").unwrap();
        let e = CsvTable::read(&path).err().unwrap();
        assert!(e.contains("m.csv:3") && e.contains("1 fields"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
