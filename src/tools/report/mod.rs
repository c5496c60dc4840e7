//! `ndtrain report`: summaries and plots of the logs of one or more finished (or stopped) runs.
//!
//! Reads a run directory as `ndtrain train` leaves it (`deck.toml`, `metrics.csv`,
//! `timing/rank_<5 digits>.csv`), draws statistics from it (median step time, throughput,
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
mod tables;

use read::{unique_names, RunLog};
use scaling::Scaling;
use stats::RunStats;
use std::path::{Path, PathBuf};
use tables::{scaling_csv, summary_csv, summary_markdown};

/// Writes the report of `runs` into `out` (created); returns the files written.
pub fn run(runs: &[PathBuf], out: &Path) -> Result<Vec<PathBuf>, String> {
    if runs.is_empty() {
        return Err("ndtrain report: no run directories given".into());
    }
    let logs = runs.iter().map(|dir| RunLog::read(dir)).collect::<Result<Vec<_>, _>>()?;
    let names = unique_names(&logs);
    let summaries = logs.iter().zip(names).map(|(log, name)| RunStats::of(log, name)).collect::<Result<Vec<_>, _>>()?;
    let scaling = (summaries.len() >= 2).then(|| Scaling::of(&summaries));
    // Before anything is written: a missing font should not leave half a report behind.
    plots::register_font()?;
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create the report directory {}: {e}", out.display()))?;

    let mut written = vec![
        write_text(&out.join("summary.md"), &summary_markdown(&summaries, scaling.as_ref()))?,
        write_text(&out.join("summary.csv"), &summary_csv(&summaries))?,
    ];
    if let Some(s) = &scaling {
        written.push(write_text(&out.join("scaling.csv"), &scaling_csv(s))?);
    }
    written.extend(plots::write_figures(&summaries, scaling.as_ref(), out)?);
    Ok(written)
}

fn write_text(path: &Path, text: &str) -> Result<PathBuf, String> {
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path.to_path_buf())
}
