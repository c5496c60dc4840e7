//! The report's text output: `summary.md` (runs, phases, communication, scaling, and the
//! plots' links), `summary.csv` (one row per run) and `scaling.csv`, and how numbers are
//! written in them ([`fmt_num`] for people, the shortest exact decimal in CSV).
//!
//! Builds strings only: `mod.rs` writes them to files. Draws nothing (`plots.rs`).

use super::read::CsvTable;
use super::scaling::{Scaling, ScalingMode};
use super::stats::{collectives_of, RunStats};
use super::study::{efficiency, scaling_mode, PointStats};
use crate::metrics::{fmt_bytes, PHASES};
use std::fmt::Write as _;

/// A number for people: 4 significant digits, scientific notation when very large or small.
pub(super) fn fmt_num(x: f64) -> String {
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

fn md_row(cells: &[String]) -> String {
    format!("| {} |\n", cells.join(" | "))
}

fn md_header(cells: &[&str]) -> String {
    let mut s = md_row(&cells.iter().map(|c| c.to_string()).collect::<Vec<_>>());
    s += &md_row(&cells.iter().map(|_| "---".to_string()).collect::<Vec<_>>());
    s
}

pub(super) fn summary_markdown(runs: &[RunStats], scaling: Option<&Scaling>) -> String {
    let mut md = String::from("# ndtrain report\n\n");
    md += &runs_markdown(runs);
    md += &phases_markdown(runs);
    md += &comm_markdown(runs);
    md += &pipeline_markdown(runs);
    md += &checkpoints_markdown(runs);
    if let Some(s) = scaling {
        md += &scaling_markdown(s);
    }
    md += &plots_markdown(runs, scaling.is_some());
    md
}

fn runs_markdown(runs: &[RunStats]) -> String {
    let mut md = String::from("## Runs\n\n");
    md += "Median step time and MFU over the steady steps (all but the first when a run has 3 or more); ";
    md += "tokens per step = global batch × seq_len; tokens/s = tokens per step / median step time.\n\n";
    md += &md_header(&[
        "run",
        "dir",
        "ranks",
        "layout (pp×dp_replicate×dp_shard×cp×tp)",
        "steps",
        "global batch",
        "tokens/step",
        "median step (s)",
        "tokens/s",
        "tokens/s/rank",
        "final loss",
        "MFU",
        "peak RSS (max over ranks)",
        "peak device memory (max over ranks)",
    ]);
    for r in runs {
        let l = r.layout;
        md += &md_row(&[
            r.name.clone(),
            format!("`{}`", r.dir),
            r.ranks.to_string(),
            format!("{}×{}×{}×{}×{}", l.pp, l.dp_replicate, l.dp_shard, l.cp, l.tp),
            r.steps.to_string(),
            r.global_batch.to_string(),
            r.tokens_per_step.to_string(),
            fmt_num(r.median_step_s),
            fmt_num(r.tokens_per_s),
            fmt_num(r.tokens_per_s_per_rank()),
            fmt_num(r.final_loss),
            fmt_num(r.mfu),
            r.timing.peak_rss_bytes.map_or("n/a".into(), |b| fmt_bytes(b as f64)),
            r.timing.device_peak_bytes.map_or("n/a".into(), |b| fmt_bytes(b as f64)),
        ]);
    }
    md + "\n"
}

fn phases_markdown(runs: &[RunStats]) -> String {
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

fn comm_markdown(runs: &[RunStats]) -> String {
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

/// The bubble per pipeline stage of every run with a pipeline (nothing without one).
fn pipeline_markdown(runs: &[RunStats]) -> String {
    let rows: Vec<(&RunStats, Vec<_>)> = runs.iter().map(|r| (r, r.stage_bubbles())).filter(|(_, b)| !b.is_empty()).collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut md = String::from("## Pipeline bubble\n\n");
    md += "Per stage, mean over its ranks and the steady steps: the seconds a rank waited for a neighbour's activation or ";
    md += "gradient (`pp.recv_s`), and the bubble, the fraction of the step's pipeline phase in which the rank computed nothing: ";
    md += "`1 − busy / T`, `busy = data_s + forward_s + backward_s`, `T` the largest `busy + pp.recv_s` over the ranks. ";
    md += "Compare with the schedule's bubble that `ndtrain plan` prints.\n\n";
    md += &md_header(&["run", "stage", "ranks", "wait (s/step)", "bubble"]);
    for (r, stages) in rows {
        for b in stages {
            md += &md_row(&[
                r.name.clone(),
                b.stage.to_string(),
                b.ranks.to_string(),
                fmt_num(b.wait_s),
                format!("{:.1}%", 100.0 * b.fraction),
            ]);
        }
    }
    md + "\n"
}

/// Every checkpoint each run wrote: its size, its whole write and what it stalled training
/// (nothing when no run wrote one).
fn checkpoints_markdown(runs: &[RunStats]) -> String {
    if runs.iter().all(|r| r.checkpoints.is_empty()) {
        return String::new();
    }
    let mut md = String::from(
        "## Checkpoints

",
    );
    md += "From `checkpoint_io.csv`, each time the largest of any rank: the write from the snapshot to the file in place ";
    md += "(beside training with `[checkpoint] async`), and what training waited for it: the copy into the snapshot, ";
    md += "agreeing at step boundaries, and the wait for it to finish at the next checkpoint, a stop or the end of the run.

";
    md += &md_header(&["run", "step", "MiB", "write (s)", "stall (s)", "snapshot (s)", "waited (s)"]);
    for r in runs {
        for c in &r.checkpoints {
            md += &md_row(&[
                r.name.clone(),
                c.step.to_string(),
                fmt_num(c.bytes / 1048576.0),
                fmt_num(c.write_s),
                fmt_num(c.stall_s),
                fmt_num(c.snapshot_s),
                fmt_num(c.waited_s),
            ]);
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

fn plots_markdown(runs: &[RunStats], scaling: bool) -> String {
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
pub(super) fn summary_csv(runs: &[RunStats]) -> String {
    let collectives = collectives_of(runs);
    let mut header: Vec<String> = [
        "run",
        "dir",
        "ranks",
        "pp",
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
    header.extend(["peak_rss_bytes".into(), "device_peak_bytes".into()]);

    let mut csv = header.join(",") + "\n";
    for r in runs {
        let l = r.layout;
        let mut row: Vec<String> = vec![csv_field(&r.name), csv_field(&r.dir)];
        row.extend(
            [r.ranks, l.pp, l.dp_replicate, l.dp_shard, l.cp, l.tp, r.steps, r.global_batch, r.seq_len, r.tokens_per_step]
                .map(|v| v.to_string()),
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
        row.push(r.timing.device_peak_bytes.map_or(String::new(), |b| b.to_string()));
        csv += &(row.join(",") + "\n");
    }
    csv
}

pub(super) fn scaling_csv(s: &Scaling) -> String {
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

pub(super) fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// `study.md`: every point's median step time over its usable repeats with the spread, the
/// planner's prediction beside it, the efficiency table, and the repeats left out.
pub(super) fn study_markdown(points: &[PointStats], unread: &[String]) -> String {
    let mut md = String::from("# ndtrain study report\n\n## Points\n\n");
    md += "Median over the usable repeats of each repeat's median step time (its first step left out from 3 steps on); ";
    md += "spread = the repeats' min–max; predicted = `ndtrain plan` with the deck's `[hardware]`.\n\n";
    md += &md_header(&[
        "point",
        "ranks",
        "repeats used",
        "median s/step",
        "spread (min–max)",
        "predicted s/step",
        "predicted / measured",
        "note",
    ]);
    for p in points {
        let pred = p.predicted_s.map(fmt_num).unwrap_or_else(|| "n/a".into());
        let ratio = p.predicted_s.map(|x| fmt_num(x / p.median_s)).unwrap_or_else(|| "n/a".into());
        let mut note = p.notes.clone();
        if p.mixed {
            note.insert(0, "mixed: steps of more than one allocation".into());
        }
        md += &md_row(&[
            p.label.clone(),
            p.ranks.to_string(),
            format!("{} of {}", p.usable, p.repeats),
            fmt_num(p.median_s),
            format!("{}–{}", fmt_num(p.min_s), fmt_num(p.max_s)),
            pred,
            ratio,
            note.join("; "),
        ]);
    }
    if let Some((mode, base)) = scaling_mode(points) {
        let _ = write!(md, "\n## {} scaling efficiency\n\nAgainst {} ({} ranks).\n\n", capital(mode), base.label, base.ranks);
        md += &md_header(&["point", "ranks", "measured efficiency", "predicted efficiency"]);
        for p in points.iter().filter(|p| p.usable > 0) {
            let predicted = match (p.predicted_s, base.predicted_s) {
                (Some(t), Some(b)) => fmt_num(efficiency(mode, t, p.ranks, b, base.ranks)),
                _ => "n/a".into(),
            };
            md += &md_row(&[
                p.label.clone(),
                p.ranks.to_string(),
                fmt_num(efficiency(mode, p.median_s, p.ranks, base.median_s, base.ranks)),
                predicted,
            ]);
        }
    }
    if !unread.is_empty() {
        md += "\n## Not reported\n\n";
        for u in unread {
            let _ = writeln!(md, "- {u}");
        }
    }
    md
}

fn capital(s: &str) -> String {
    let mut c = s.chars();
    c.next().map(|f| f.to_uppercase().collect::<String>() + c.as_str()).unwrap_or_default()
}

/// `study.csv`: one row per point.
pub(super) fn study_csv(points: &[PointStats]) -> String {
    let mut s = String::from("point,ranks,repeats,usable,mixed,median_step_s,min_step_s,max_step_s,predicted_step_s,note\n");
    for p in points {
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{},{},{}",
            csv_field(&p.label),
            p.ranks,
            p.repeats,
            p.usable,
            p.mixed,
            csv_num(p.median_s),
            csv_num(p.min_s),
            csv_num(p.max_s),
            p.predicted_s.map(csv_num).unwrap_or_default(),
            csv_field(&p.notes.join("; "))
        );
    }
    s
}

/// A run's expert load (`expert_load.csv`) as a markdown table: per expert block the steps,
/// the coefficient of variation at the first step, its median over the steps and at the last
/// step, and the last step's least and most chosen expert against the even share.
pub(super) fn expert_load_markdown(name: &str, t: &CsvTable, experts: usize) -> Result<String, String> {
    let col = |c: &str| t.column(c);
    let (layer, choices, min, max, cv) = (col("layer")?, col("choices")?, col("min")?, col("max")?, col("cv")?);
    let mut out = format!(
        "\n### {name}\n\n| block | steps | cv first | cv median | cv last | last step min / even / max |\n|---|---|---|---|---|---|\n"
    );
    let mut blocks: Vec<u64> = layer.iter().map(|&l| l as u64).collect();
    blocks.sort_unstable();
    blocks.dedup();
    for b in blocks {
        let rows: Vec<usize> = (0..layer.len()).filter(|&i| layer[i] as u64 == b).collect();
        let cvs: Vec<f64> = rows.iter().map(|&i| cv[i]).collect();
        let last = *rows.last().expect("a row per block");
        let even = if experts > 0 { format!("{:.0}", choices[last] / experts as f64) } else { "?".into() };
        out += &format!(
            "| {b} | {} | {:.3} | {:.3} | {:.3} | {:.0} / {even} / {:.0} |\n",
            rows.len(),
            cvs[0],
            crate::metrics::median(&cvs),
            cv[last],
            min[last],
            max[last]
        );
    }
    Ok(out)
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
}
