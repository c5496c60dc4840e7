//! The report's figures, drawn with `plotters` alike as PNG and SVG: the training loss of every
//! run, each run's seconds per step by phase and rank, the bytes per step of each collective,
//! and the scaling panels (throughput, speed-up, efficiency against ranks). Also the TrueType
//! font the figures' text needs, loaded at run time (pure Rust through ab_glyph, no fontconfig
//! or freetype), and the axis tick formats.
//!
//! Draws what [`RunStats`] and [`Scaling`] hold; computes no statistics of its own beyond axis
//! ranges, and writes no text files (`tables.rs`).

use super::scaling::{Scaling, ScalingMode};
use super::stats::{collectives_of, PhaseStat, RunStats};
use super::tables::{fmt_num, plural};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

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
pub(super) fn register_font() -> Result<(), String> {
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
// Axis ticks
// ------------------------------------------------------------------------------------------

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

/// Draws every figure of the report into `out`, each as PNG and SVG: the losses, the phases of
/// each run, the bytes per collective, and the scaling when there is one.
pub(super) fn write_figures(runs: &[RunStats], scaling: Option<&Scaling>, out: &Path) -> Result<Vec<PathBuf>, String> {
    let mut written = write_figure(&LossFigure { runs }, out, "loss")?;
    for s in runs {
        written.extend(write_figure(&PhaseFigure { run: s }, out, &format!("phases_{}", s.name))?);
    }
    written.extend(write_figure(&CommFigure { runs }, out, "comm_bytes")?);
    if let Some(s) = scaling {
        written.extend(write_figure(&ScalingFigure { scaling: s }, out, "scaling")?);
    }
    Ok(written)
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
    runs: &'a [RunStats],
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
        let finite = |c: &[(f64, f64)]| c.iter().copied().filter(|p| p.1.is_finite()).collect::<Vec<_>>();
        let curves: Vec<Vec<(f64, f64)>> = self.runs.iter().map(|r| finite(&r.loss_curve)).collect();
        let held_out: Vec<Vec<(f64, f64)>> = self.runs.iter().map(|r| finite(&r.val_curve)).collect();
        let (x_lo, x_hi, y_lo, y_hi) = curves
            .iter()
            .chain(&held_out)
            .flatten()
            .fold((f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY), |(x0, x1, y0, y1), &(s, l)| {
                (x0.min(s), x1.max(s), y0.min(l), y1.max(l))
            });
        let (x_lo, x_hi) = if x_lo.is_finite() { (x_lo, x_hi.max(x_lo + 1.0)) } else { (0.0, 1.0) };
        let (y_lo, y_hi) = if y_lo.is_finite() { padded(y_lo, y_hi, 0.05) } else { (0.0, 1.0) };
        let mut chart = ChartBuilder::on(&plot)
            .caption(
                if held_out.iter().any(|c| !c.is_empty()) { "Training loss (lines), held-out loss (dots)" } else { "Training loss" },
                title_font(),
            )
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
        for (i, points) in held_out.iter().enumerate() {
            let radius = 4 + 2 * (n - 1 - i) as i32;
            chart.draw_series(points.iter().map(|&(s, l)| Circle::new((s as i64, l), radius, color(i).filled())))?;
        }
        let entries: Vec<(String, RGBColor)> = self.runs.iter().enumerate().map(|(i, r)| (r.name.clone(), color(i))).collect();
        draw_legend(&legend, "run", &entries)
    }
}

/// Per-rank stacked bars of the mean seconds per step in each phase.
struct PhaseFigure<'a> {
    run: &'a RunStats,
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
    runs: &'a [RunStats],
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
