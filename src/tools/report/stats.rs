//! The statistics of one run drawn from its logs ([`RunStats`]): median step time, throughput,
//! final loss and MFU from `metrics.csv`; from the per-rank timing logs, each phase's seconds
//! per step across ranks (min, mean, max, imbalance), the bytes each collective moved, and the
//! peak memory, all over the steady steps (the first is left out from three steps on). A
//! column of the timing logs over the steady steps is a `[rank, step]` table (`Array2`), reduced
//! along one axis or the other.
//!
//! Reads no files (`read.rs` does) and formats nothing (`tables.rs`, `plots.rs`); comparing
//! runs with each other is `scaling.rs`.

use super::read::{CsvTable, RunLayout, RunLog};
use crate::metrics::{median, PHASES};
use ndarray::{Array1, Array2, ArrayView2, Axis, Zip};
use std::collections::BTreeMap;

/// The axes of a `[rank, step]` table of one timing column.
const RANK_AXIS: Axis = Axis(0);
const STEP_AXIS: Axis = Axis(1);

/// The steady-state part of a run's steps: the first step pays one-time costs (allocations,
/// page faults, the first communicator use), so it is left out when there are 3 or more.
fn steady<T>(steps: &[T]) -> &[T] {
    if steps.len() >= 3 {
        &steps[1..]
    } else {
        steps
    }
}

fn mean<'a>(v: impl IntoIterator<Item = &'a f64, IntoIter: ExactSizeIterator>) -> f64 {
    let v = v.into_iter();
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else {
        v.sum::<f64>() / n as f64
    }
}

/// The sums along `axis`, each adding its terms in index order as [`mean`] does, so a mean
/// taken from it is the same number to the bit (`sum_axis` may add a contiguous lane in
/// another order). The start is -0.0, the identity of `+`, as in `Iterator::sum`.
fn sum_along(table: ArrayView2<'_, f64>, axis: Axis) -> Array1<f64> {
    table.fold_axis(axis, -0.0, |&acc, &x| acc + x)
}

/// The means along `axis` (over steps: one per rank; over ranks: one per step).
fn mean_along(table: ArrayView2<'_, f64>, axis: Axis) -> Array1<f64> {
    sum_along(table, axis) / table.len_of(axis) as f64
}

/// One phase's seconds per step across ranks: the mean over steady steps of each step's
/// min, mean and max across ranks.
#[derive(Clone, Debug)]
pub(super) struct PhaseStat {
    pub(super) phase: &'static str,
    pub(super) min: f64,
    pub(super) avg: f64,
    pub(super) max: f64,
}

impl PhaseStat {
    /// `(max - avg) / avg`: how much longer the slowest rank took than the average (0 when
    /// the phase took no time).
    pub(super) fn imbalance(&self) -> f64 {
        if self.avg > 0.0 {
            (self.max - self.avg) / self.avg
        } else {
            0.0
        }
    }
}

/// Everything the tables and plots show about one run (not the trainer's end-of-run
/// `train::RunSummary`: this is drawn from the logs afterwards).
pub(super) struct RunStats {
    pub(super) name: String,
    pub(super) dir: String,
    pub(super) ranks: usize,
    pub(super) layout: RunLayout,
    pub(super) steps: usize,
    pub(super) global_batch: usize,
    pub(super) seq_len: usize,
    pub(super) tokens_per_step: usize,
    /// Median over the steady steps of `metrics.csv`'s `step_s` (the training time of a step,
    /// without checkpoint and logging: what `tokens_per_s` is computed from).
    pub(super) median_step_s: f64,
    pub(super) tokens_per_s: f64,
    pub(super) final_loss: f64,
    /// Median of `metrics.csv`'s `mfu` over the steady steps (NaN when the column is absent).
    pub(super) mfu: f64,
    /// What the per-rank timing logs say.
    pub(super) timing: TimingStats,
    /// `(step, loss)` of every logged step.
    pub(super) loss_curve: Vec<(f64, f64)>,
    /// `(step, held-out loss)` of the steps `[eval]` evaluated after.
    pub(super) val_curve: Vec<(f64, f64)>,
    /// Every checkpoint written, from `checkpoint_io.csv`.
    pub(super) checkpoints: Vec<CheckpointWrite>,
}

/// One checkpoint write of `checkpoint_io.csv`: each time the largest of any rank.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct CheckpointWrite {
    pub(super) step: u64,
    pub(super) bytes: f64,
    /// From the snapshot to the file in place.
    pub(super) write_s: f64,
    /// What training waited for it, of which the copy into the snapshot and the wait for it to
    /// finish (NaN in a log of a run before these were recorded).
    pub(super) stall_s: f64,
    pub(super) snapshot_s: f64,
    pub(super) waited_s: f64,
}

/// The writes of a `checkpoint_io.csv` (its loads left out).
pub(super) fn checkpoint_writes(t: &CsvTable) -> Result<Vec<CheckpointWrite>, String> {
    let event = t.index_of("event").ok_or_else(|| format!("{}: no column 'event' in the header", t.path.display()))?;
    let writes: Vec<bool> = t.rows().map(|(_, f)| f[event] == "write").collect();
    let (steps, bytes, write_s) = (t.column("step")?, t.column("bytes")?, t.column("seconds")?);
    let sparse =
        |name: &str| -> Result<Vec<f64>, String> { Ok(t.sparse_column(name)?.into_iter().map(|x| x.unwrap_or(f64::NAN)).collect()) };
    let (stall_s, snapshot_s, waited_s) = (sparse("stall_s")?, sparse("snapshot_s")?, sparse("waited_s")?);
    Ok((0..writes.len())
        .filter(|&i| writes[i])
        .map(|i| CheckpointWrite {
            step: steps[i] as u64,
            bytes: bytes[i],
            write_s: write_s[i],
            stall_s: stall_s[i],
            snapshot_s: snapshot_s[i],
            waited_s: waited_s[i],
        })
        .collect())
}

impl RunStats {
    pub(super) fn of(log: &RunLog, name: String) -> Result<RunStats, String> {
        let metrics = &log.metrics;
        let steps = metrics.steps()?;
        let losses = metrics.column("loss")?;
        let val_losses = metrics.sparse_column("val_loss")?;
        let step_s = metrics.column("step_s")?;
        let mfu = match metrics.index_of("mfu") {
            Some(_) => median(steady(&metrics.column("mfu")?)),
            None => f64::NAN,
        };
        let median_step_s = median(steady(&step_s));
        let tokens_per_step = log.deck.global_batch * log.deck.seq_len;
        let timing = TimingStats::of(&log.timing)?;
        Ok(RunStats {
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
            val_curve: steps.iter().zip(&val_losses).filter_map(|(&s, l)| Some((s as f64, (*l)?))).collect(),
            checkpoints: log.checkpoint_io.as_ref().map(checkpoint_writes).transpose()?.unwrap_or_default(),
        })
    }

    pub(super) fn tokens_per_s_per_rank(&self) -> f64 {
        self.tokens_per_s / self.ranks as f64
    }

    pub(super) fn comm_bytes_of(&self, collective: &str) -> f64 {
        self.timing.comm_bytes.iter().find(|(c, _)| c == collective).map_or(0.0, |(_, b)| *b)
    }

    pub(super) fn phase(&self, phase: &str) -> Option<&PhaseStat> {
        self.timing.phases.iter().find(|p| p.phase == phase)
    }

    /// The pipeline's bubble per stage (runs with `pp > 1` whose logs have the columns): for
    /// each stage, the seconds per step its ranks waited for a neighbour and their bubble
    /// ([`TimingStats::rank_pp_bubble`]), means over the stage's ranks. Ranks are numbered
    /// with `pp` slowest, so stage `p` holds ranks `p·R .. (p+1)·R`, `R = ranks / pp`.
    pub(super) fn stage_bubbles(&self) -> Vec<StageBubble> {
        let (pp, Some(per_rank)) = (self.layout.pp, &self.timing.rank_pp_bubble) else { return vec![] };
        if pp < 2 {
            return vec![];
        }
        let per_stage = per_rank.len() / pp;
        per_rank
            .chunks(per_stage)
            .enumerate()
            .map(|(stage, ranks)| {
                let wait = mean(&ranks.iter().map(|r| r.0).collect::<Vec<_>>());
                let fraction = mean(&ranks.iter().map(|r| r.1).collect::<Vec<_>>());
                StageBubble { stage, ranks: ranks.len(), wait_s: wait, fraction }
            })
            .collect()
    }
}

/// One pipeline stage's measured bubble ([`RunStats::stage_bubbles`]).
pub(super) struct StageBubble {
    pub(super) stage: usize,
    pub(super) ranks: usize,
    pub(super) wait_s: f64,
    pub(super) fraction: f64,
}

/// The statistics of a run's per-rank timing logs, over the steady steps every rank logged.
pub(super) struct TimingStats {
    /// Steps of the timing logs the phase and byte statistics average over.
    pub(super) steps: usize,
    pub(super) phases: Vec<PhaseStat>,
    /// `[rank][phase]`: mean seconds per step, phases in `phases` order.
    pub(super) rank_phase_s: Vec<Vec<f64>>,
    /// Mean of the timing logs' `step_s` per rank (wall time of the whole step), if logged.
    pub(super) rank_step_s: Option<Vec<f64>>,
    /// `(group.kind, bytes per step per rank)`, mean over ranks and steps; non-zero only.
    pub(super) comm_bytes: Vec<(String, f64)>,
    /// Per rank, means over steps: the seconds it waited for a pipeline neighbour
    /// (`pp.recv_s`) and its bubble — the fraction of the step's pipeline phase it computed
    /// nothing, `1 − busy / T` with `busy = data_s + forward_s + backward_s` and `T` the
    /// phase's length, the largest `busy + pp.recv_s` over the ranks (the ranks start each step
    /// together; one that finishes early waits for the others in the next collective) — if the
    /// logs have those columns.
    pub(super) rank_pp_bubble: Option<Vec<(f64, f64)>>,
    pub(super) peak_rss_bytes: Option<u64>,
    /// Max over ranks and steps of the device allocator's high-water mark (GPU runs only).
    pub(super) device_peak_bytes: Option<u64>,
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
        // One column as a [rank, step of the window] table.
        let series = |column: &str| -> Result<Array2<f64>, String> {
            let values = ranks.iter().map(|t| t.column(column)).collect::<Result<Vec<_>, _>>()?;
            Ok(Array2::from_shape_fn((ranks.len(), window.len()), |(r, i)| values[r][rows[r][i]]))
        };
        let mut phase_stats = Vec::new();
        // [phase][rank]: each rank's mean over the steps.
        let mut phase_rank_s = Vec::new();
        for phase in &phases {
            let s = series(&format!("{phase}_s"))?;
            phase_stats.push(phase_across_ranks(phase, s.view()));
            phase_rank_s.push(mean_along(s.view(), STEP_AXIS));
        }
        let rank_phase_s = (0..ranks.len()).map(|r| phase_rank_s.iter().map(|p| p[r]).collect()).collect();
        let rank_step_s = match first.index_of("step_s") {
            Some(_) => Some(mean_along(series("step_s")?.view(), STEP_AXIS).to_vec()),
            None => None,
        };
        let mut comm_bytes = Vec::new();
        for collective in first.header.iter().filter_map(|h| h.strip_suffix("_bytes")).filter(|c| c.contains('.')) {
            let s = series(&format!("{collective}_bytes"))?;
            let per_rank = mean(&mean_along(s.view(), STEP_AXIS));
            if per_rank > 0.0 {
                comm_bytes.push((collective.to_string(), per_rank));
            }
        }
        let pipeline_columns = ["pp.recv_s", "data_s", "forward_s", "backward_s"];
        let rank_pp_bubble = if pipeline_columns.iter().all(|c| first.index_of(c).is_some()) {
            let [wait, data, fwd, bwd] = pipeline_columns.map(series);
            let (wait, data, fwd, bwd) = (wait?, data?, fwd?, bwd?);
            let busy = &data + &fwd + &bwd;
            // Per step: the pipeline phase's length, the longest busy + wait of any rank.
            let phase = (&busy + &wait).fold_axis(RANK_AXIS, 0.0, |&m, &x| f64::max(m, x));
            let idle =
                Zip::from(&busy)
                    .and_broadcast(phase.view().insert_axis(RANK_AXIS))
                    .map_collect(|&b, &t| if t > 0.0 { 1.0 - b / t } else { 0.0 });
            let (wait, idle) = (mean_along(wait.view(), STEP_AXIS), mean_along(idle.view(), STEP_AXIS));
            Some(wait.into_iter().zip(idle).collect())
        } else {
            None
        };
        // The largest value of a column over every rank and step; `None` where the logs lack it.
        let column_max = |name: &str| -> Result<Option<u64>, String> {
            if first.index_of(name).is_none() {
                return Ok(None);
            }
            let all = ranks.iter().map(|t| t.column(name)).collect::<Result<Vec<_>, _>>()?;
            Ok(Some(all.iter().flatten().fold(0.0f64, |m, &v| m.max(v)) as u64))
        };
        let peak_rss_bytes = column_max("peak_rss_bytes")?;
        // Host runs log 0: no device memory to speak of.
        let device_peak_bytes = column_max("device_peak_bytes")?.filter(|&b| b > 0);
        Ok(TimingStats {
            steps: window.len(),
            phases: phase_stats,
            rank_phase_s,
            rank_step_s,
            comm_bytes,
            rank_pp_bubble,
            peak_rss_bytes,
            device_peak_bytes,
        })
    }
}

/// `series[[rank, step]]` of one phase → the mean over steps of the min/avg/max across ranks.
fn phase_across_ranks(phase: &'static str, series: ArrayView2<'_, f64>) -> PhaseStat {
    let mins = series.fold_axis(RANK_AXIS, f64::INFINITY, |&m, &x| f64::min(m, x));
    let avgs = mean_along(series, RANK_AXIS);
    let maxs = series.fold_axis(RANK_AXIS, f64::NEG_INFINITY, |&m, &x| f64::max(m, x));
    PhaseStat { phase, min: mean(&mins), avg: mean(&avgs), max: mean(&maxs) }
}

/// Every collective (`group.kind`) any run used, in the order they first appear.
pub(super) fn collectives_of(runs: &[RunStats]) -> Vec<String> {
    let mut all: Vec<String> = Vec::new();
    for (c, _) in runs.iter().flat_map(|r| &r.timing.comm_bytes) {
        if !all.contains(c) {
            all.push(c.clone());
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_step_is_left_out_from_three_steps_on() {
        assert_eq!(steady(&[1, 2]), &[1, 2]);
        assert_eq!(steady(&[1, 2, 3]), &[2, 3]);
    }

    #[test]
    fn phase_statistics_across_ranks() {
        // Two ranks, two steps: rank 1 is slower by 1 s in each.
        let s = phase_across_ranks("forward", ndarray::array![[1.0, 3.0], [2.0, 4.0]].view());
        assert_eq!((s.min, s.avg, s.max), (2.0, 2.5, 3.0));
        assert!((s.imbalance() - 0.2).abs() < 1e-12);
    }

    /// The axis means add in index order: the same bits as a plain sum of each row or column,
    /// also past the 8 terms where `sum_axis` would regroup them.
    #[test]
    fn axis_means_match_sequential_sums_to_the_bit() {
        let table = Array2::from_shape_fn((11, 13), |(r, i)| ((r * 13 + i) as f64 * 0.731).sin() * 10f64.powi((r % 5) as i32 - 2));
        let per_rank = mean_along(table.view(), STEP_AXIS);
        for (r, row) in table.outer_iter().enumerate() {
            assert_eq!(per_rank[r].to_bits(), mean(row.to_vec().iter()).to_bits());
        }
        let per_step = mean_along(table.view(), RANK_AXIS);
        for (i, col) in table.columns().into_iter().enumerate() {
            let n = col.len() as f64;
            assert_eq!(per_step[i].to_bits(), (col.iter().sum::<f64>() / n).to_bits());
        }
    }
}
