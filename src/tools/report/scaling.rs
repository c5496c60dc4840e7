//! The scaling analysis across runs: each run against the one with the fewest ranks, as
//! strong, weak or mixed scaling (from how tokens per step relate to ranks), with speed-up,
//! parallel efficiency and the ideal speed-up to compare them with.
//!
//! Works on [`RunStats`] only; the scaling table and figure are drawn by `tables.rs` and
//! `plots.rs`.

use super::stats::RunStats;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ScalingMode {
    /// Same tokens per step on every run: the work is split over more ranks.
    Strong,
    /// Tokens per step proportional to ranks: each rank keeps the same work.
    Weak,
    /// Neither: speed-up and efficiency are still computed from throughput.
    Mixed,
}

impl ScalingMode {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            ScalingMode::Strong => "strong",
            ScalingMode::Weak => "weak",
            ScalingMode::Mixed => "mixed",
        }
    }
}

pub(super) struct ScalingRow {
    pub(super) name: String,
    pub(super) ranks: usize,
    pub(super) tokens_per_step: usize,
    pub(super) step_s: f64,
    pub(super) tokens_per_s: f64,
    pub(super) speedup: f64,
    pub(super) efficiency: f64,
}

/// The runs against the one with the fewest ranks (the first given among equals), sorted by
/// ranks.
pub(super) struct Scaling {
    pub(super) mode: ScalingMode,
    pub(super) base_name: String,
    pub(super) base_ranks: usize,
    pub(super) base_tokens_per_s: f64,
    pub(super) rows: Vec<ScalingRow>,
}

impl Scaling {
    pub(super) fn of(runs: &[RunStats]) -> Scaling {
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
    pub(super) fn ideal_speedup(&self, ranks: f64) -> f64 {
        ranks / self.base_ranks as f64
    }
}
