//! `run.json`: every field present and sane after a finished run on two ranks and after its
//! resume, `running` while a run trains, `preempted` after SIGTERM, `failed` after a failure
//! every rank agreed on and after an error on rank 0. Every run is the real binary under
//! `mpirun`.

mod common;

use common::*;
use ndtrain::run::faults;
use ndtrain::run::provenance;
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

/// The runs here: one thread per rank, FSDP over the two ranks.
const SETS: &[&str] = &["run.threads=1", "parallel.dp_shard=2"];

fn read(out: &Path) -> (Value, String) {
    let text = std::fs::read_to_string(out.join(provenance::FILE)).expect("run.json exists");
    (serde_json::from_str(&text).unwrap_or_else(|e| panic!("run.json parses: {e}\n{text}")), text)
}

/// A number of the file exactly as written: the text after `"key": ` (serde_json's default
/// parser may be one ulp off; Rust's is exact).
fn exact(text: &str, key: &str) -> f64 {
    let pat = format!("\"{key}\": ");
    let at = text.find(&pat).unwrap_or_else(|| panic!("no {key}")) + pat.len();
    let end = text[at..].find([',', '\n']).unwrap() + at;
    text[at..end].parse().unwrap_or_else(|e| panic!("{key}: {:?}: {e}", &text[at..end]))
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not an unsigned integer: {v}"))
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// `YYYY-MM-DDTHH:MM:SSZ`.
fn assert_rfc3339_utc(v: &Value) {
    let s = v.as_str().unwrap_or_else(|| panic!("not a string: {v}"));
    let digits = |r: std::ops::Range<usize>| s.get(r).is_some_and(|x| x.chars().all(|c| c.is_ascii_digit()));
    let shape = s.len() == 20 && [4, 7].iter().all(|&i| &s[i..=i] == "-") && &s[10..11] == "T" && &s[13..14] == ":";
    assert!(shape && &s[16..17] == ":" && s.ends_with('Z') && digits(0..4) && digits(5..7) && digits(8..10), "{s}");
    assert!(digits(11..13) && digits(14..16) && digits(17..19), "{s}");
}

/// No temporary file of the atomic write is left beside it.
fn assert_no_temporaries(out: &Path) {
    for e in std::fs::read_dir(out).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        assert!(!name.contains(".tmp"), "{name} left in {}", out.display());
    }
}

/// What is the same in every record of a two-rank tiny run, whatever its outcome.
fn assert_run_facts(out: &Path, j: &Value, sets: &[&str]) {
    assert_eq!(j["schema"], provenance::SCHEMA);
    assert_rfc3339_utc(&j["start_time"]);

    let p = &j["program"];
    assert_eq!(p["name"], "ndtrain");
    assert_eq!(p["version"], env!("CARGO_PKG_VERSION"));
    let commit = p["git_commit"].as_str().unwrap();
    assert_eq!(commit, env!("NDTRAIN_GIT_COMMIT"), "the binary's and the tests' build script agree");
    match env!("NDTRAIN_GIT_COMMIT_FROM") {
        "git" => assert!(commit.len() >= 40 && commit.chars().all(|c| c.is_ascii_hexdigit()), "commit {commit:?} from .git"),
        "none" => assert_eq!(commit, "unknown"),
        _ => assert!(!commit.is_empty()),
    }
    assert!(env!("NDTRAIN_GIT_COMMIT_FROM") != "none" || !repo().join(".git/HEAD").exists(), "a checkout with .git has a commit");
    assert!(["debug", "release"].contains(&p["profile"].as_str().unwrap()), "{}", p["profile"]);
    assert!(p["target_triple"].as_str().unwrap().contains('-'), "{}", p["target_triple"]);
    assert_eq!(p["build_target"], ndtrain::backend::cpu::features::build_target());
    let features: Vec<&str> = p["cpu_features"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
    assert_eq!(features, ndtrain::backend::cpu::features::compiled());
    let cargo: Vec<&str> = p["cargo_features"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
    assert_eq!(cargo, if cfg!(feature = "cuda") { vec!["cuda"] } else { vec![] });
    assert!(p["rustc"].as_str().unwrap().starts_with("rustc "), "{}", p["rustc"]);

    let l = &j["libraries"];
    let mpi = l["mpi"].as_str().unwrap();
    assert!(mpi.lines().next().unwrap_or("").contains("MPI"), "MPI's description: {mpi:?}");
    let hdf5 = l["hdf5"].as_str().unwrap();
    assert!(hdf5.split('.').count() == 3 && hdf5.split('.').all(|x| x.parse::<u32>().is_ok()) && hdf5 != "0.0.0", "{hdf5}");
    assert!(l["cuda_driver"].is_null(), "a CPU run: {}", l["cuda_driver"]);

    let job = &j["job"];
    let (scheduler, id) = provenance::scheduler_job(|k| std::env::var(k).ok());
    assert_eq!(job["scheduler"], serde_json::json!(scheduler));
    assert_eq!(job["id"], serde_json::json!(id));
    let hosts = job["hosts"].as_object().unwrap();
    let mut ranks: Vec<u64> = hosts.values().flat_map(|r| r.as_array().unwrap().iter().map(u)).collect();
    ranks.sort();
    assert_eq!(ranks, [0, 1], "every rank under one host: {hosts:?}");
    assert_eq!(hosts.keys().collect::<Vec<_>>(), [&ndtrain::run::placement::hostname()], "mpirun ran both ranks here");
    assert_eq!(job["world_size"], 2);
    assert_eq!(job["threads_per_rank"], 1);
    assert_eq!(job["device"], "cpu");

    assert_eq!(j["deck"]["path"], tiny_deck().display().to_string());
    assert_eq!(j["deck"]["name"], "tiny");
    assert_eq!(j["deck"]["resolved"], "deck.toml");
    assert!(out.join("deck.toml").exists());

    let owned: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let res = ndtrain::config::Deck::from_file(&tiny_deck(), &owned).unwrap().resolve(2).unwrap();
    let lay = &j["layout"];
    let l = res.layout;
    let want = [("pp", l.pp), ("dp_replicate", l.dp_replicate), ("dp_shard", l.dp_shard), ("cp", l.cp), ("tp", l.tp)];
    for (k, v) in want.into_iter().chain([
        ("grad_accum", res.grad_accum),
        ("global_batch", res.global_batch),
        ("seq_len", res.deck.train.seq_len),
        ("tokens_per_step", res.tokens_per_step),
    ]) {
        assert_eq!(u(&lay[k]), v as u64, "layout.{k}");
    }
    assert_eq!((l.dp_shard, l.pp * l.dp_replicate * l.cp * l.tp), (2, 1), "the layout the runs ask for");
    assert_eq!(lay["precision"], "fp32");
}

/// The results of a run that ended with a checkpoint: steps, losses against `metrics.csv`, the
/// speed and MFU they give, the checkpoints.
fn assert_results(out: &Path, j: &Value, text: &str, first: u64, last: u64, checkpoint_steps: &[u64]) {
    let r = &j["results"];
    assert_eq!((u(&r["steps_run"]), u(&r["first_step"]), u(&r["last_step"])), (last - first + 1, first, last));
    assert_eq!(u(&r["resumed_from_step"]), first - 1);
    let (loss_text, _) = losses(out);
    assert_eq!(loss_text.len() as u64, last, "metrics.csv has every step");
    let final_loss = exact(text, "final_loss");
    assert!(final_loss.is_finite() && final_loss > 0.0);
    assert_eq!(final_loss.to_bits(), loss_text.last().unwrap().parse::<f64>().unwrap().to_bits(), "the last loss of metrics.csv");
    assert!(r["final_val_loss"].is_null() || f(&r["final_val_loss"]).is_finite(), "{}", r["final_val_loss"]);
    let (step_s, tps, mfu) = (f(&r["mean_step_s"]), f(&r["tokens_per_s"]), f(&r["mfu"]));
    let tokens_per_step = u(&j["layout"]["tokens_per_step"]) as f64;
    assert!(step_s > 0.0 && (tps * step_s / tokens_per_step - 1.0).abs() < 1e-9, "tokens/s {tps} vs step {step_s} s");
    let (fpt, peak) = (f(&r["flops_per_token"]), f(&r["peak_flops_per_rank"]));
    let expect_fpt = ndtrain::metrics::flops_per_token(&ndtrain::config::Deck::from_file(&tiny_deck(), &[]).unwrap().model, 64);
    assert_eq!(fpt, expect_fpt);
    assert!(peak > 0.0 && mfu > 0.0 && (mfu / (tps * fpt / (peak * 2.0)) - 1.0).abs() < 1e-9, "mfu {mfu}");
    assert_eq!(u(&r["skipped_steps"]), 0);
    let ckpts = r["checkpoints"].as_array().unwrap();
    assert_eq!(u(&r["checkpoints_written"]), ckpts.len() as u64);
    let steps: Vec<u64> = ckpts.iter().map(|c| u(&c["step"])).collect();
    assert_eq!(steps, checkpoint_steps);
    let last_ckpt = Path::new(ckpts.last().unwrap()["path"].as_str().unwrap());
    assert_eq!(last_ckpt, out.join("ckpt").join(format!("step_{last:08}.h5")));
    assert!(last_ckpt.exists());
    let train_s = f(&r["train_s"]);
    assert!(train_s > 0.0 && f(&j["wall_s"]) >= train_s, "train {train_s} s, wall {}", j["wall_s"]);
    assert_rfc3339_utc(&j["end_time"]);
    assert!(j["end_time"].as_str() >= j["start_time"].as_str());
    assert!(j["error"].is_null());
}

#[test]
fn a_finished_run_and_its_resume_record_every_field() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut sets = SETS.to_vec();
    sets.extend(["run.steps=6", "checkpoint.every=3"]);
    let o = mpirun_tiny(2, &out, &sets).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let (j, raw) = read(&out);
    assert_eq!((j["status"].as_str(), j["exit_code"].as_i64()), (Some("finished"), Some(0)), "{raw}");
    assert_run_facts(&out, &j, &sets);
    assert_results(&out, &j, &raw, 1, 6, &[3, 6]);
    assert_no_temporaries(&out);
    // The console's line under the banner: the commit and MPI's first line.
    let mpi_first = j["libraries"]["mpi"].as_str().unwrap().lines().next().unwrap().to_string();
    let short: String = env!("NDTRAIN_GIT_COMMIT").chars().take(12).collect();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.lines().any(|l| l.starts_with(&format!("commit {short} (")) && l.ends_with(&mpi_first)), "{stdout}");

    // Resumed in the same folder: the record is this invocation's.
    sets.extend(["run.steps=8", "checkpoint.resume=\"auto\""]);
    let o = mpirun_tiny(2, &out, &sets).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let (j, raw) = read(&out);
    assert_eq!(j["status"], "finished", "{raw}");
    assert_run_facts(&out, &j, &sets);
    assert_results(&out, &j, &raw, 7, 8, &[8]);
}

/// While a run trains the record says `running` (no results yet); stopped by SIGTERM (exit 75)
/// it says `preempted`, with the results up to the checkpoint written on the way out.
#[test]
fn a_run_is_running_then_preempted() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut sets = SETS.to_vec();
    sets.push("run.steps=400");
    // 100 ms per step: the signal lands mid-run however fast the steps are.
    let mut child = mpirun_tiny(2, &out, &sets)
        .env(faults::STEP_DELAY_ENV, "100")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while steps_done(&out) < 2 {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before its second step");
        assert!(start.elapsed() < Duration::from_secs(300), "the run never logged 2 steps in 300 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (j, raw) = read(&out);
    assert_eq!(j["status"], "running", "{raw}");
    for k in ["exit_code", "end_time", "wall_s", "results", "error"] {
        assert!(j[k].is_null(), "{k} while running: {raw}");
    }
    assert_run_facts(&out, &j, &sets);

    term_ranks(child.id(), 2);
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(ndtrain::exit::PREEMPTED), "{}", text(&o));
    let (j, raw) = read(&out);
    assert_eq!((j["status"].as_str(), j["exit_code"].as_i64()), (Some("preempted"), Some(75)), "{raw}");
    let stopped = steps_done(&out) as u64;
    assert!((2..400).contains(&stopped), "stopped after step {stopped}");
    assert_run_facts(&out, &j, &sets);
    assert_results(&out, &j, &raw, 1, stopped, &[stopped]);
    assert_no_temporaries(&out);
}

/// A checkpoint write that fails on rank 1 ends every rank together (exit 1): `failed`, with
/// the message; an error on rank 0 alone (which then aborts the job): `failed` as well.
#[test]
fn failures_are_recorded_as_failed() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("agreed", faults::CHECKPOINT_WRITE_ERROR_ENV, "step=2,rank=1", "injected write error"),
        ("rank0", faults::FAIL_ENV, "step=3,rank=0", "rank 0: injected failure"),
    ];
    for (name, var, spec, message) in cases {
        let out = dir.path().join(name);
        let mut sets = SETS.to_vec();
        sets.extend(["run.steps=6", "checkpoint.every=2"]);
        let (o, timed_out) = output_within(mpirun_tiny(2, &out, &sets).env(var, spec), 120);
        assert!(!timed_out && !o.status.success(), "{name}: {}", text(&o));
        let (j, raw) = read(&out);
        assert_eq!((j["status"].as_str(), j["exit_code"].as_i64()), (Some("failed"), Some(1)), "{name}: {raw}");
        assert!(j["error"].as_str().is_some_and(|e| e.contains(message)), "{name}: {raw}");
        assert!(j["results"].is_null(), "{name}: {raw}");
        assert_rfc3339_utc(&j["end_time"]);
        assert_run_facts(&out, &j, &sets);
    }
}
