//! `ndtrain report`: summaries and plots of the logs of one or more finished (or stopped) runs.
//!
//! Reads a run directory as `ndtrain train` leaves it (`deck.toml`, `metrics.csv`,
//! `timing/rank_<5 digits>.csv`, and a mixture of experts' `expert_load.csv`), draws statistics from it (median step time, throughput,
//! per-phase load imbalance across ranks, bytes per collective, peak memory), analyses the
//! scaling across runs, and writes `summary.md`, `summary.csv`, `scaling.csv` and the plots
//! (PNG and SVG, drawn with `plotters`, text through a TrueType font loaded at run time).
//! This file holds the entry point [`run`] and the order of those steps; each step is a file:
//! `read.rs` (the run's files), `stats.rs` (one run's statistics), `scaling.rs` (runs against
//! each other), `tables.rs` (markdown and CSV) and `plots.rs` (figures and fonts).
//!
//! Knows nothing of training itself: it links none of the trainer's state, only the file
//! formats. Columns are found by name in each header, so logs with more columns still read;
//! the phase order comes from [`crate::metrics::PHASES`] and the run's shape from the
//! `# Resolved by ...` comment that opens `deck.toml`.

mod plots;
mod read;
mod scaling;
mod stats;
mod study;
mod tables;

use read::{unique_names, RunLog};
use scaling::Scaling;
use stats::RunStats;
use std::path::{Path, PathBuf};
use tables::{expert_load_markdown, scaling_csv, study_csv, study_markdown, summary_csv, summary_markdown};

/// Writes the report of `runs` into `out` (created); returns the files written. A run that
/// cannot be read is listed under *Not reported* (and on stderr); only when none can be read
/// is it an error.
pub fn run(runs: &[PathBuf], out: &Path) -> Result<Vec<PathBuf>, String> {
    if runs.is_empty() {
        return Err("ndtrain report: no run directories given".into());
    }
    let (mut logs, mut unread) = (vec![], vec![]);
    for dir in runs {
        match RunLog::read(dir) {
            Ok(log) => logs.push(log),
            Err(e) => unread.push(e),
        }
    }
    if logs.is_empty() {
        return Err(unread.join("\n"));
    }
    for u in &unread {
        eprintln!("warning: not reported: {u}");
    }
    write_report(&logs, &unread, out)
}

/// `ndtrain report --study DIR`: the study's `points.csv` (`study.rs`) as `study.md` and
/// `study.csv`, and the usual report of every repeat that could be read, into `out`.
pub fn run_study(study: &Path, out: &Path) -> Result<Vec<PathBuf>, String> {
    let runs = study::read_points(study)?;
    let (points, logs) = study::points(&runs);
    let unread: Vec<String> = points.iter().flat_map(|p| p.notes.iter().map(move |n| format!("{}: {n}", p.label))).collect();
    if logs.is_empty() {
        return Err(format!("{}: no run of the study can be read:\n{}", study.display(), unread.join("\n")));
    }
    for u in &unread {
        eprintln!("warning: not in the medians: {u}");
    }
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create the report directory {}: {e}", out.display()))?;
    let mut written = vec![
        write_text(&out.join("study.md"), &study_markdown(&points, &unread))?,
        write_text(&out.join("study.csv"), &study_csv(&points))?,
    ];
    written.extend(write_report(&logs, &[], out)?);
    Ok(written)
}

/// The tables and plots of readable `logs` (`unread`: the runs listed as not reported).
fn write_report(logs: &[RunLog], unread: &[String], out: &Path) -> Result<Vec<PathBuf>, String> {
    let names = unique_names(logs);
    let loads = logs
        .iter()
        .zip(&names)
        .filter_map(|(log, name)| log.expert_load.as_ref().map(|t| expert_load_markdown(name, t, log.deck.n_experts)))
        .collect::<Result<String, _>>()?;
    let summaries = logs.iter().zip(names).map(|(log, name)| RunStats::of(log, name)).collect::<Result<Vec<_>, _>>()?;
    let scaling = (summaries.len() >= 2).then(|| Scaling::of(&summaries));
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create the report directory {}: {e}", out.display()))?;
    let mut md = summary_markdown(&summaries, scaling.as_ref());
    if !loads.is_empty() {
        md += "\n## Expert load\n\nPer run and expert block, from `expert_load.csv`: the coefficient of variation of the choices per expert (0: an even load) over the steps, and the last step's least and most chosen expert against the even share.\n";
        md += &loads;
    }
    if !unread.is_empty() {
        md += "\n## Not reported\n\n";
        md += &unread.iter().map(|u| format!("- {u}\n")).collect::<String>();
    }
    let mut written = vec![write_text(&out.join("summary.md"), &md)?, write_text(&out.join("summary.csv"), &summary_csv(&summaries))?];
    if let Some(s) = &scaling {
        written.push(write_text(&out.join("scaling.csv"), &scaling_csv(s))?);
    }
    // Without a font the tables stand alone: one warning, no figures.
    match plots::register_font() {
        Ok(()) => written.extend(plots::write_figures(&summaries, scaling.as_ref(), out)?),
        Err(e) => eprintln!("warning: plots skipped: {e}"),
    }
    Ok(written)
}

fn write_text(path: &Path, text: &str) -> Result<PathBuf, String> {
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path.to_path_buf())
}
