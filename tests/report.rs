//! `ndtrain report` on real runs: a 4-rank FSDP×TP run alone and a 1/2/4-rank strong-scaling
//! set of the tiny deck, trained here under mpirun. Checks the tables against the logs they
//! summarise and that every plot is a real picture; and that bad inputs fail naming the cause.

mod common;
use common::*;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;

/// Six steps (the first is the report's warm-up, five are timed), a learning-rate warm-up that
/// fits in them, one thread per rank: 4 ranks stay fast on 2 cores.
const FAST: &[&str] = &["run.steps=6", "run.threads=1", "optim.warmup_steps=2"];

fn report(runs: &[PathBuf], out: &Path) -> Output {
    let mut args: Vec<&str> = vec!["report"];
    args.extend(runs.iter().map(|r| r.to_str().unwrap()));
    args.extend(["--out", out.to_str().unwrap()]);
    run_single(&args)
}

/// `summary.csv`-style file: one map of column → value per row.
fn csv_rows(path: &Path) -> Vec<HashMap<String, String>> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    lines.map(|l| header.iter().map(|h| h.to_string()).zip(l.split(',').map(String::from)).collect()).collect()
}

fn num(row: &HashMap<String, String>, column: &str) -> f64 {
    row.get(column).unwrap_or_else(|| panic!("no column {column}")).parse().unwrap_or_else(|_| panic!("{column}: not a number"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// A plot must be a PNG of real content: the signature, more than 10 kB, and drawn pixels of
/// many colours (lines, bars, anti-aliased text), not one flat background.
fn assert_real_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{}: not a PNG", path.display());
    assert!(bytes.len() > 10_000, "{}: only {} bytes", path.display(), bytes.len());
    let mut reader = png::Decoder::new(std::io::Cursor::new(&bytes)).read_info().expect("PNG decodes");
    let mut pixels = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut pixels).expect("PNG frame decodes");
    assert!(info.width >= 800 && info.height >= 500, "{}: {}x{}", path.display(), info.width, info.height);
    let channels = info.color_type.samples();
    let pixels: Vec<&[u8]> = pixels[..info.buffer_size()].chunks(channels).collect();
    let background = pixels[0];
    let drawn = pixels.iter().filter(|p| **p != background).count();
    let colours: std::collections::HashSet<&[u8]> = pixels.iter().copied().collect();
    assert!(drawn * 50 > pixels.len(), "{}: only {drawn} of {} pixels drawn", path.display(), pixels.len());
    assert!(colours.len() >= 20, "{}: only {} distinct colours", path.display(), colours.len());
}

fn assert_plots(out: &Path, stems: &[String]) {
    for stem in stems {
        assert_real_png(&out.join(format!("{stem}.png")));
        let svg = std::fs::read_to_string(out.join(format!("{stem}.svg"))).unwrap();
        assert!(svg.contains("<svg") && svg.contains("<text"), "{stem}.svg");
    }
}

#[test]
fn report_of_one_run_and_of_a_strong_scaling_set() {
    let start = std::time::Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tp_sets: Vec<&str> = FAST.iter().copied().chain(["parallel.tp=2"]).collect();
    train_losses(d, "fsdp2_tp2", &tiny_deck(), Some(4), &tp_sets);
    for n in [1, 2, 4] {
        train_losses(d, &format!("fsdp{n}"), &tiny_deck(), Some(n), FAST);
    }
    let pp_sets: Vec<&str> = FAST.iter().copied().chain(["parallel.pp=2", "model.n_layers=4"]).collect();
    train_losses(d, "pp2", &tiny_deck(), Some(2), &pp_sets);
    let trained = start.elapsed();

    // The 4-rank FSDP×TP run alone: no scaling table or plot.
    let out = d.join("report_tp");
    let o = report(&[d.join("fsdp2_tp2")], &out);
    assert!(o.status.success(), "{}", text(&o));
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(md.contains("| fsdp2_tp2 |") && md.contains("1×2×1×2"), "{md}");
    for phase in ["data", "forward", "backward", "comm", "optimizer", "checkpoint", "wait"] {
        assert!(md.contains(&format!("| fsdp2_tp2 | {phase} |")), "phase {phase} missing:\n{md}");
    }
    assert!(md.contains("tp.all_reduce") && !md.contains("## Scaling") && !md.contains("## Pipeline bubble"), "{md}");
    let rows = csv_rows(&out.join("summary.csv"));
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!((num(r, "ranks"), num(r, "dp_shard"), num(r, "tp"), num(r, "steps")), (4.0, 2.0, 2.0, 6.0));
    assert!(num(r, "tp.all_reduce_bytes") > 0.0 && num(r, "fsdp.all_gather_bytes") > 0.0);
    assert!(num(r, "forward_max_s") >= num(r, "forward_avg_s") && num(r, "forward_avg_s") >= num(r, "forward_min_s"));
    // The median skips the warm-up step; tokens/s follows from it.
    let step_s = column(&d.join("fsdp2_tp2"), "step_s");
    assert_eq!(num(r, "median_step_s"), median(step_s[1..].to_vec()));
    assert!((num(r, "tokens_per_s") - 16.0 * 64.0 / num(r, "median_step_s")).abs() < 1e-6 * num(r, "tokens_per_s"));
    assert_eq!(num(r, "final_loss"), *column(&d.join("fsdp2_tp2"), "loss").last().unwrap());
    assert!(!out.join("scaling.png").exists());
    assert_plots(&out, &["loss", "phases_fsdp2_tp2", "comm_bytes"].map(String::from));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("phases_fsdp2_tp2.png") && stdout.contains("summary.csv"), "{stdout}");

    // The strong-scaling set.
    let out = d.join("report_scaling");
    let runs: Vec<PathBuf> = [1, 2, 4].iter().map(|n| d.join(format!("fsdp{n}"))).collect();
    let o = report(&runs, &out);
    assert!(o.status.success(), "{}", text(&o));
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(md.contains("## Scaling (strong)"), "{md}");
    let rows = csv_rows(&out.join("scaling.csv"));
    assert_eq!(rows.iter().map(|r| num(r, "ranks")).collect::<Vec<_>>(), [1.0, 2.0, 4.0]);
    let base = num(&rows[0], "tokens_per_s");
    for r in &rows {
        assert_eq!(r["mode"], "strong");
        let speedup = num(r, "tokens_per_s") / base;
        assert!((num(r, "speedup") - speedup).abs() < 1e-9 * speedup.max(1.0), "{r:?}");
        assert!((num(r, "efficiency") - speedup / num(r, "ranks")).abs() < 1e-9, "{r:?}");
        assert!(md.contains(&format!("| {} | {} | 1024 |", r["run"], r["ranks"])), "scaling row of {}:\n{md}", r["run"]);
    }
    let summary = csv_rows(&out.join("summary.csv"));
    assert_eq!(summary.iter().map(|r| r["run"].as_str()).collect::<Vec<_>>(), ["fsdp1", "fsdp2", "fsdp4"]);
    // One rank communicates nothing through the FSDP group; more ranks do.
    assert_eq!(num(&summary[0], "fsdp.all_gather_bytes"), 0.0);
    assert!(num(&summary[2], "fsdp.all_gather_bytes") > 0.0);
    let mut stems: Vec<String> = ["loss", "comm_bytes", "scaling"].map(String::from).to_vec();
    stems.extend([1, 2, 4].map(|n| format!("phases_fsdp{n}")));
    assert_plots(&out, &stems);
    // A pipeline run: the bubble of each stage, between 0 and 100 %.
    let out = d.join("report_pp");
    let o = report(&[d.join("pp2")], &out);
    assert!(o.status.success(), "{}", text(&o));
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(md.contains("## Pipeline bubble") && md.contains("2×1×1×1×1"), "{md}");
    for stage in 0..2 {
        let row = md.lines().find(|l| l.starts_with(&format!("| pp2 | {stage} | 1 |"))).unwrap_or_else(|| panic!("stage {stage}:\n{md}"));
        let bubble: f64 = row.trim_end_matches(" |").rsplit("| ").next().unwrap().trim_end_matches('%').parse().unwrap();
        assert!((0.0..100.0).contains(&bubble) && bubble > 0.0, "{row}");
    }
    assert_eq!(num(&csv_rows(&out.join("summary.csv"))[0], "pp"), 2.0);

    eprintln!("trained 5 runs in {:.1} s, reports took {:.1} s", trained.as_secs_f64(), (start.elapsed() - trained).as_secs_f64());
}

/// A run directory written by hand: 1 rank, 3 steps, the columns the report reads.
fn handmade_run(dir: &Path, metrics_rows: &[&str]) {
    std::fs::create_dir_all(dir.join("timing")).unwrap();
    let deck =
        "# Resolved by ndtrain 0.1.0 for 1 ranks: layout dp_replicate=1 dp_shard=1 cp=1 tp=1, grad_accum=1, global_batch=2, peak lr=1e-3\n\
                [train]\nseq_len = 8\n";
    std::fs::write(dir.join("deck.toml"), deck).unwrap();
    let metrics = ["step,loss,lr,grad_norm,tokens_per_s,tokens_per_s_per_rank,mfu,step_s,elapsed_s"].iter().chain(metrics_rows);
    std::fs::write(dir.join("metrics.csv"), metrics.map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    let mut timing = String::from("step,step_s,data_s,forward_s,backward_s,comm_s,optimizer_s,checkpoint_s,wait_s,log_s,peak_rss_bytes\n");
    for step in 1..=3 {
        timing += &format!("{step},0.1,0.001,0.04,0.05,0.005,0.002,0,0.001,0,1000000\n");
    }
    std::fs::write(dir.join("timing/rank_00000.csv"), timing).unwrap();
}

const GOOD_ROWS: &[&str] = &["1,4.8,1e-3,1,160,160,0.01,0.1,0.1", "2,4.7,1e-3,1,160,160,0.01,0.1,0.2", "3,4.6,1e-3,1,160,160,0.01,0.1,0.3"];

/// A GPU run's timing log carries the device allocator's high-water mark (written by hand here:
/// no GPU): the report states its maximum over ranks and steps; a host run's zeros are no
/// device memory at all (empty, `n/a`).
#[test]
fn the_device_memory_peak_is_reported_for_gpu_runs_only() {
    let dir = tempfile::tempdir().unwrap();
    let (gpu, host) = (dir.path().join("gpu"), dir.path().join("host"));
    for (run, peaks) in [(&gpu, [3_000_000u64, 7_000_000, 5_000_000]), (&host, [0, 0, 0])] {
        handmade_run(run, GOOD_ROWS);
        let mut timing = String::from(
            "step,step_s,data_s,forward_s,backward_s,comm_s,optimizer_s,checkpoint_s,wait_s,log_s,peak_rss_bytes,device_peak_bytes\n",
        );
        for (step, peak) in (1..=3).zip(peaks) {
            timing += &format!("{step},0.1,0.001,0.04,0.05,0.005,0.002,0,0.001,0,1000000,{peak}\n");
        }
        std::fs::write(run.join("timing/rank_00000.csv"), timing).unwrap();
    }
    let out = dir.path().join("out");
    let o = report(&[gpu, host], &out);
    assert!(o.status.success(), "{}", text(&o));
    let rows = csv_rows(&out.join("summary.csv"));
    assert_eq!(num(&rows[0], "device_peak_bytes"), 7_000_000.0);
    assert_eq!(rows[1]["device_peak_bytes"], "");
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(md.contains("peak device memory"), "{md}");
}

#[test]
fn a_directory_without_logs_fails_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("not_a_run");
    std::fs::create_dir_all(&empty).unwrap();
    let o = report(std::slice::from_ref(&empty), &dir.path().join("out"));
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(empty.to_str().unwrap()) && err.contains("metrics.csv"), "{err}");
}

#[test]
fn a_malformed_row_fails_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("bad");
    handmade_run(&run, &[GOOD_ROWS[0], "2,oops,1e-3,1,160,160,0.01,0.1,0.2", GOOD_ROWS[2]]);
    let o = report(std::slice::from_ref(&run), &dir.path().join("out"));
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!("{}:3", run.join("metrics.csv").display())) && err.contains("'loss'"), "{err}");
    // A truncated row of a timing log.
    handmade_run(&run, GOOD_ROWS);
    let timing = run.join("timing/rank_00000.csv");
    let mut text_of_log = std::fs::read_to_string(&timing).unwrap();
    text_of_log += "4,0.1,0.001\n";
    std::fs::write(&timing, text_of_log).unwrap();
    let o = report(std::slice::from_ref(&run), &dir.path().join("out"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains(&format!("{}:5", timing.display())), "{err}");
}

/// Without a TrueType font (the font lookup pointed at an empty folder) the tables are still
/// written, the plots are skipped with one warning; with the default search they are drawn.
#[test]
fn without_a_font_the_tables_are_written_and_the_plots_skipped_with_one_warning() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("good");
    handmade_run(&run, GOOD_ROWS);
    let out = dir.path().join("out");
    let no_fonts = dir.path().join("no_fonts");
    std::fs::create_dir_all(&no_fonts).unwrap();
    let args = ["report", run.to_str().unwrap(), "--out", out.to_str().unwrap()];
    let o = mpi_env(&mut std::process::Command::new(bin())).env("NDTRAIN_FONT", &no_fonts).args(args).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.matches("warning").count(), 1, "{err}");
    assert!(err.contains("plots skipped") && err.contains("fonts-dejavu-core") && err.contains("NDTRAIN_FONT"), "{err}");
    assert!(out.join("summary.md").exists() && out.join("summary.csv").exists());
    assert!(!out.join("phases_good.png").exists());
    // With the font search of the default paths, the same run reports with its plots.
    let o = run_single(&args);
    assert!(o.status.success(), "{}", text(&o));
    assert_real_png(&out.join("phases_good.png"));
}

/// `metrics.csv` rows of steps `1..` with the given step times.
fn rows_with_times(times: &[f64]) -> Vec<String> {
    times.iter().enumerate().map(|(i, t)| format!("{},4.5,1e-3,1,160,160,0.01,{t},{}", i + 1, t * (i + 1) as f64)).collect()
}

/// A finished (or other `status`) run of `times`, with `run.json` as `ndtrain train` writes it.
fn study_run(dir: &Path, status: &str, times: &[f64], resumed_from: u64) {
    let rows = rows_with_times(times);
    let rows: Vec<&str> = rows.iter().map(String::as_str).collect();
    handmade_run(dir, &rows);
    let first = resumed_from + 1;
    let json = format!(
        "{{\"schema\": 1, \"status\": \"{status}\", \"results\": {{\"steps_run\": {}, \"first_step\": {first}, \"last_step\": {}, \"resumed_from_step\": {resumed_from}}}}}",
        times.len() as u64 - resumed_from,
        times.len()
    );
    std::fs::write(dir.join("run.json"), json).unwrap();
}

/// A study folder as `ndtrain sweep` leaves it: one point with two repeats (median and spread),
/// one whose repeats are a preempted run and a missing folder, one resumed across allocations
/// (timed over its last), one whose last allocation ran a single step (mixed). The report lists
/// what it left out, and puts the planner's prediction beside each point.
#[test]
fn a_study_reports_medians_spread_predictions_and_what_it_left_out() {
    let dir = tempfile::tempdir().unwrap();
    let study = dir.path().join("study");
    let deck = dir.path().join("deck.toml");
    let hw = "\n[hardware]\npeak_flops_per_rank = 1e9\nblock_other_s_per_token = 1e-6\n";
    std::fs::write(&deck, std::fs::read_to_string(tiny_deck()).unwrap() + hw).unwrap();
    let run = |name: &str| study.join(name);
    study_run(&run("a1"), "finished", &[0.5, 0.1, 0.1, 0.1], 0);
    study_run(&run("a2"), "finished", &[0.5, 0.3, 0.3, 0.3], 0);
    study_run(&run("b1"), "preempted", &[0.5, 0.2], 0);
    study_run(&run("c1"), "finished", &[1.0, 1.0, 1.0, 0.9, 0.4, 0.4], 3);
    study_run(&run("d1"), "finished", &[0.6, 0.6, 0.6, 0.6], 3);
    let mut points = String::from("label,ranks,repeat,run_dir,deck,job\n");
    for (label, repeat, name) in [("a", 1, "a1"), ("a", 2, "a2"), ("b", 1, "b1"), ("b", 2, "b2"), ("c", 1, "c1"), ("d", 1, "d1")] {
        points += &format!("{label},1,{repeat},{},{},{}\n", run(name).display(), deck.display(), study.join("job.sh").display());
    }
    std::fs::write(study.join("points.csv"), points).unwrap();
    let out = dir.path().join("report");
    let o = run_single(&["report", "--study", study.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let rows = csv_rows(&out.join("study.csv"));
    let by = |p: &str| rows.iter().find(|r| r["point"] == p).unwrap_or_else(|| panic!("no point {p}: {rows:?}")).clone();
    let a = by("a");
    assert_eq!((num(&a, "median_step_s"), num(&a, "min_step_s"), num(&a, "max_step_s")), (0.2, 0.1, 0.3));
    assert_eq!(a["usable"], "2");
    assert!(num(&a, "predicted_step_s") > 0.0, "{a:?}");
    let b = by("b");
    assert_eq!(b["usable"], "0");
    assert!(b["note"].contains("preempted") && b["note"].contains("repeat 2"), "{b:?}");
    // The last allocation: steps 4-6, its first left out.
    assert_eq!(num(&by("c"), "median_step_s"), 0.4);
    assert_eq!(by("c")["mixed"], "false");
    assert_eq!(by("d")["mixed"], "true");
    let md = std::fs::read_to_string(out.join("study.md")).unwrap();
    assert!(md.contains("Not reported") && md.contains("Strong scaling efficiency") && md.contains("mixed"), "{md}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("preempted") && err.contains(run("b2").to_str().unwrap()), "{err}");
    // The readable repeats also get the usual report.
    assert!(out.join("summary.md").exists());
    // A study of which nothing can be read fails, naming why.
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(
        empty.join("points.csv"),
        format!("label,ranks,repeat,run_dir,deck,job\nx,1,1,{},{},j\n", run("b2").display(), deck.display()),
    )
    .unwrap();
    let o = run_single(&["report", "--study", empty.to_str().unwrap()]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("b2"), "{}", text(&o));
}

/// A list of run folders of which one is missing: it is listed, the rest reported.
#[test]
fn a_missing_run_is_listed_and_the_rest_reported() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    handmade_run(&good, GOOD_ROWS);
    let gone = dir.path().join("gone");
    let out = dir.path().join("out");
    let o = report(&[good, gone.clone()], &out);
    assert!(o.status.success(), "{}", text(&o));
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(md.contains("Not reported") && md.contains(gone.to_str().unwrap()), "{md}");
    assert_eq!(csv_rows(&out.join("summary.csv")).len(), 1);
}
