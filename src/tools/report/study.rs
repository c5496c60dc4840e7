//! A study's report (`ndtrain report --study DIR`): the points `ndtrain sweep` wrote in
//! `points.csv` (`label,ranks,repeat,run_dir,deck,job`, one row per repeat), each repeat's
//! state from its `run.json`, the median step time over a point's usable repeats and their
//! spread, the planner's predicted step time beside it, and strong or weak efficiency, measured
//! and predicted (`docs/report.md`, *Studies*).
//!
//! A repeat is usable when `run.json` says `finished` and its logs read. One `preempted`,
//! `failed` or still `running` is marked and left out of the medians. A run resumed across
//! allocations is timed over its last allocation only (`run.json`'s `first_step` on, which the
//! resumed invocation rewrote), or over every step and marked `mixed` when that allocation ran
//! fewer than 2 steps. Missing or unreadable repeats are listed; nothing here fails unless no
//! repeat at all can be read.

use super::read::{CsvTable, RunLog};
use crate::metrics::median;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One row of `points.csv`.
#[derive(Clone, Debug)]
pub(super) struct PointRun {
    pub(super) label: String,
    pub(super) ranks: usize,
    pub(super) repeat: usize,
    pub(super) run_dir: PathBuf,
    pub(super) deck: PathBuf,
}

/// What became of one repeat.
pub(super) enum Outcome {
    /// Its step times (`mixed`: they span allocations) and tokens per step.
    Timed { step_s: Vec<f64>, mixed: bool, tokens_per_step: usize },
    /// Marked and left out: why.
    Left(String),
}

/// Reads `points.csv`; columns by name, the ranks and repeats as positive integers.
pub(super) fn read_points(study: &Path) -> Result<Vec<PointRun>, String> {
    let path = study.join("points.csv");
    let table = CsvTable::read(&path)?;
    let col = |name: &str| table.index_of(name).ok_or_else(|| format!("{}: no column '{name}' in the header", path.display()));
    let (label, ranks, repeat, run_dir, deck) = (col("label")?, col("ranks")?, col("repeat")?, col("run_dir")?, col("deck")?);
    let mut points = vec![];
    for (line, f) in table.rows() {
        let int = |i: usize, name: &str| {
            f[i].parse::<usize>()
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| format!("{}:{line}: column '{name}': '{}' is not a positive integer", path.display(), f[i]))
        };
        points.push(PointRun {
            label: f[label].clone(),
            ranks: int(ranks, "ranks")?,
            repeat: int(repeat, "repeat")?,
            run_dir: PathBuf::from(&f[run_dir]),
            deck: PathBuf::from(&f[deck]),
        });
    }
    if points.is_empty() {
        return Err(format!("{}: no points", path.display()));
    }
    Ok(points)
}

/// What `run.json` says of the last invocation: its status, and the first and last step it
/// ran and the step it resumed from.
struct Record {
    status: String,
    first_step: Option<u64>,
    steps_run: u64,
    resumed_from: u64,
}

fn read_record(dir: &Path) -> Result<Record, String> {
    let path = dir.join(crate::run::provenance::FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
    let status = v["status"].as_str().ok_or_else(|| format!("{}: no \"status\"", path.display()))?.to_string();
    let results = &v["results"];
    Ok(Record {
        status,
        first_step: results["first_step"].as_u64(),
        steps_run: results["steps_run"].as_u64().unwrap_or(0),
        resumed_from: results["resumed_from_step"].as_u64().unwrap_or(0),
    })
}

/// One repeat's outcome, or why it cannot be read at all (a missing or malformed folder).
pub(super) fn outcome(run: &PointRun) -> Result<(Outcome, Option<RunLog>), String> {
    let record = read_record(&run.run_dir)?;
    if record.status != "finished" {
        return Ok((Outcome::Left(format!("run.json status \"{}\"", record.status)), None));
    }
    let log = RunLog::read(&run.run_dir)?;
    let steps = log.metrics.steps()?;
    let times = log.metrics.column("step_s")?;
    let resumed = record.resumed_from > 0;
    let mixed = resumed && record.steps_run < 2;
    let first = match (resumed && !mixed, record.first_step) {
        (true, Some(first)) => first,
        _ => 0,
    };
    let mine: Vec<f64> = steps.iter().zip(&times).filter(|(&s, _)| s >= first).map(|(_, &t)| t).collect();
    // The allocation's first step pays its start-up: left out from 3 steps on.
    let step_s = if mine.len() >= 3 { mine[1..].to_vec() } else { mine };
    if step_s.is_empty() {
        return Ok((Outcome::Left("no step in its last allocation".into()), None));
    }
    let tokens_per_step = log.deck.global_batch * log.deck.seq_len;
    Ok((Outcome::Timed { step_s, mixed, tokens_per_step }, Some(log)))
}

/// One point: its repeats' median step time and spread, and the planner's prediction.
#[derive(Clone, Debug)]
pub(super) struct PointStats {
    pub(super) label: String,
    pub(super) ranks: usize,
    pub(super) repeats: usize,
    pub(super) usable: usize,
    pub(super) mixed: bool,
    pub(super) tokens_per_step: usize,
    /// Median over usable repeats of each repeat's median step time, and their min and max.
    pub(super) median_s: f64,
    pub(super) min_s: f64,
    pub(super) max_s: f64,
    pub(super) predicted_s: Option<f64>,
    /// Repeats left out or unreadable, each with why.
    pub(super) notes: Vec<String>,
}

/// Every point of the study in the order of `points.csv`, and the readable runs' logs.
pub(super) fn points(runs: &[PointRun]) -> (Vec<PointStats>, Vec<RunLog>) {
    let mut order: Vec<String> = vec![];
    let mut by_label: BTreeMap<String, Vec<&PointRun>> = BTreeMap::new();
    for r in runs {
        if !by_label.contains_key(&r.label) {
            order.push(r.label.clone());
        }
        by_label.entry(r.label.clone()).or_default().push(r);
    }
    let mut logs = vec![];
    let stats = order
        .iter()
        .map(|label| {
            let repeats = &by_label[label];
            let (mut medians, mut notes, mut mixed, mut tokens) = (vec![], vec![], false, 0);
            for r in repeats {
                match outcome(r) {
                    Ok((Outcome::Timed { step_s, mixed: m, tokens_per_step }, log)) => {
                        medians.push(median(&step_s));
                        mixed |= m;
                        tokens = tokens_per_step;
                        logs.extend(log);
                    }
                    Ok((Outcome::Left(why), _)) => notes.push(format!("repeat {}: {why}", r.repeat)),
                    Err(e) => notes.push(format!("repeat {}: {e}", r.repeat)),
                }
            }
            let (min_s, max_s) = medians.iter().fold((f64::NAN, f64::NAN), |(lo, hi), &x| (x.min(lo), x.max(hi)));
            PointStats {
                label: label.clone(),
                ranks: repeats[0].ranks,
                repeats: repeats.len(),
                usable: medians.len(),
                mixed,
                tokens_per_step: tokens,
                median_s: if medians.is_empty() { f64::NAN } else { median(&medians) },
                min_s,
                max_s,
                predicted_s: predicted_step_s(&repeats[0].deck, repeats[0].ranks).ok(),
                notes,
            }
        })
        .collect();
    (stats, logs)
}

/// The planner's step time for a point's deck on its ranks, with the deck's `[hardware]`;
/// an error when it has no calibration (`ndtrain probe --deck`) or no peak to time FLOPs at.
pub(super) fn predicted_step_s(deck: &Path, ranks: usize) -> Result<f64, String> {
    use crate::tools::plan;
    let res = crate::config::Deck::from_file(deck, &[]).and_then(|d| d.resolve(ranks)).map_err(|e| e.to_string())?;
    let hw = &res.deck.hardware;
    if hw.peak_flops_per_rank <= 0.0 {
        return Err(format!("{}: no [hardware] peak_flops_per_rank to predict with", deck.display()));
    }
    let p = plan::plan(&res);
    Ok(plan::cost(&p, &res.deck, hw, hw.peak_flops_per_rank).step_s)
}

/// Scaling of the usable points against the one with the fewest ranks: `strong` when every
/// point has the same tokens per step, `weak` when they grow with the ranks, else none.
pub(super) fn scaling_mode(points: &[PointStats]) -> Option<(&'static str, &PointStats)> {
    let timed: Vec<&PointStats> = points.iter().filter(|p| p.usable > 0).collect();
    let base = *timed.iter().min_by_key(|p| p.ranks)?;
    if timed.iter().all(|p| p.tokens_per_step == base.tokens_per_step) {
        Some(("strong", base))
    } else if timed.iter().all(|p| p.tokens_per_step * base.ranks == base.tokens_per_step * p.ranks) {
        Some(("weak", base))
    } else {
        None
    }
}

/// Parallel efficiency of a step time `t` on `ranks` against `base_t` on `base_ranks`.
pub(super) fn efficiency(mode: &str, t: f64, ranks: usize, base_t: f64, base_ranks: usize) -> f64 {
    match mode {
        "strong" => base_t * base_ranks as f64 / (t * ranks as f64),
        _ => base_t / t,
    }
}
