//! Sharded parallel-HDF5 checkpoints: bitwise resume on the same layout, resume on other
//! layouts, files that h5py and h5dump read, crash and corruption safety, preemption, memory-
//! light loading and the `ckpt` tools. Every run is the real binary under `mpirun`.

mod common;

use common::*;
use ndtrain::io::checkpoint::tools;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The runs here: 10 steps, clipping active, a checkpoint every 5.
const SETS: &[&str] = &["run.steps=10", "run.threads=1", "optim.grad_clip=0.3", "optim.warmup_steps=2", "checkpoint.every=5"];

fn train(dir: &Path, name: &str, ranks: Option<usize>, extra: &[&str]) -> Vec<String> {
    let mut sets: Vec<&str> = SETS.to_vec();
    sets.extend_from_slice(extra);
    train_losses(dir, name, &tiny_deck(), ranks, &sets).0
}

fn ckpt(dir: &Path, name: &str, step: u64) -> PathBuf {
    dir.join(name).join("ckpt").join(format!("step_{step:08}.h5"))
}

/// `mpirun -n N ndtrain train tiny.toml` with `SETS` and `extra`, writing to `out`; not started.
fn mpirun_train(n: usize, out: &Path, extra: &[&str]) -> Command {
    let sets: Vec<&str> = SETS.iter().chain(extra).copied().collect();
    mpirun_tiny(n, out, &sets)
}

fn resume_from(path: &Path) -> String {
    format!("checkpoint.resume=\"{}\"", path.display())
}

/// Every dataset of two checkpoints has the same shape and the same bits.
fn assert_bitwise_equal(a: &Path, b: &Path) {
    let names = tools::dataset_paths(a).unwrap();
    assert_eq!(names, tools::dataset_paths(b).unwrap());
    assert_eq!(names.len(), 3 * 21, "parameters and both moments of the tiny model");
    for n in &names {
        let (sa, xa) = tools::read_tensor(a, n).unwrap();
        let (sb, xb) = tools::read_tensor(b, n).unwrap();
        assert_eq!(sa, sb, "{n}");
        assert!(xa.iter().zip(&xb).all(|(x, y)| x.to_bits() == y.to_bits()), "{n} differs between {} and {}", a.display(), b.display());
    }
}

/// Parameters within `PARAM_TOL` of the tensor's max |value|. The moments of another layout
/// carry the same f32 noise, relative to each tensor's largest moment (measured ≤ 2e-4 for
/// exp_avg, ≤ 4e-4 for exp_avg_sq, whose tiny elements Adam's noise dominates); 5e-3 still
/// catches a moment of the wrong tensor or block (order 1).
fn assert_close(a: &Path, b: &Path) {
    for n in tools::dataset_paths(a).unwrap() {
        let (sa, xa) = tools::read_tensor(a, &n).unwrap();
        let (sb, xb) = tools::read_tensor(b, &n).unwrap();
        assert_eq!(sa, sb, "{n}");
        let scale = xa.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
        let diff = xa.iter().zip(&xb).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) as f64;
        let tol = if n.starts_with("model/") { PARAM_TOL } else { 5e-3 };
        assert!(diff <= tol * scale, "{n}: max |Δ| {diff:e} vs scale {scale:e} ({} vs {})", a.display(), b.display());
    }
}

/// The rows of `<out>/checkpoint_io.csv` of `event` (`write` or `load`), by column name.
fn io_rows(out: &Path, event: &str) -> Vec<std::collections::BTreeMap<String, String>> {
    let text = std::fs::read_to_string(out.join("checkpoint_io.csv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    lines
        .map(|l| header.iter().map(|h| h.to_string()).zip(l.split(',').map(String::from)).collect::<std::collections::BTreeMap<_, _>>())
        .filter(|r| r["event"] == event)
        .collect()
}

fn assert_losses_close(name: &str, got: &[String], want: &[String]) {
    assert_eq!(got.len(), want.len(), "{name}: step count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w): (f64, f64) = (g.parse().unwrap(), w.parse().unwrap());
        assert!((g - w).abs() < LOSS_TOL, "{name}: resumed step {} loss {g} vs uninterrupted {w}", i + 1);
    }
}

/// Acceptance 1: 10 steps straight, or 5 then resume for 5 more: the same losses and the same
/// final parameters and moments, bit for bit, on one rank and on FSDP=2×TP=2.
#[test]
fn resume_on_the_same_layout_continues_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (name, ranks, layout) in [("one_rank", None, &[][..]), ("fsdp2_tp2", Some(4), &["parallel.tp=2"][..])] {
        let straight = train(d, &format!("{name}_straight"), ranks, layout);
        assert_eq!(straight.len(), 10);
        let mut extra = layout.to_vec();
        let r = resume_from(&ckpt(d, &format!("{name}_straight"), 5));
        extra.push(&r);
        let resumed = train(d, &format!("{name}_resumed"), ranks, &extra);
        assert_eq!(resumed, straight[5..], "{name}: losses of steps 6..10");
        assert_bitwise_equal(&ckpt(d, &format!("{name}_straight"), 10), &ckpt(d, &format!("{name}_resumed"), 10));
        // No write made a collective HDF5 call; the resume's load made them.
        let writes = io_rows(&d.join(format!("{name}_straight")), "write");
        assert_eq!(writes.len(), 2, "{writes:?}");
        assert!(writes.iter().all(|r| r["collective_hdf5_calls"] == "0"), "{writes:?}");
        let loads = io_rows(&d.join(format!("{name}_resumed")), "load");
        assert!(loads.len() == 1 && loads[0]["collective_hdf5_calls"].parse::<u64>().unwrap() > 0, "{loads:?}");
    }
}

/// Acceptance 2: written on FSDP=2×TP=2, resumed on one rank, on DP=2×CP=2 and on TP=4: losses
/// within the layout tolerance of the uninterrupted one-rank run, final state close to it.
#[test]
fn a_checkpoint_resumes_on_other_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = train(d, "base", None, &[]);
    train(d, "writer", Some(4), &["parallel.tp=2"]);
    let r = resume_from(&ckpt(d, "writer", 5));
    for (name, ranks, layout) in [
        ("one_rank", None, &[][..]),
        ("dp2_cp2", Some(4), &["parallel.dp_replicate=2", "parallel.cp=2"][..]),
        ("tp4", Some(4), &["parallel.tp=4"][..]),
    ] {
        let mut extra = layout.to_vec();
        extra.push(&r);
        let resumed = train(d, name, ranks, &extra);
        assert_losses_close(name, &resumed, &base[5..]);
        assert_close(&ckpt(d, "base", 10), &ckpt(d, name, 10));
        // The checksums of a checkpoint written with replicas (dp2_cp2: each shard held twice,
        // written once) and of the others verify: every element was counted exactly once.
        let v = Command::new(bin()).args(["ckpt", "verify"]).arg(ckpt(d, name, 10)).output().unwrap();
        assert!(v.status.success(), "{name}: ckpt verify\n{}", text(&v));
    }
}

/// Acceptance 3: h5dump and h5py (Debian's python3-h5py) read a checkpoint written by four
/// ranks; every tensor has its logical shape and equals what one rank holds after the same
/// training.
#[test]
fn h5py_and_h5dump_read_a_sharded_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    train(d, "one", None, &[]);
    train(d, "four", Some(4), &["parallel.tp=2"]);
    let (one, four) = (ckpt(d, "one", 10), ckpt(d, "four", 10));

    let header = Command::new("h5dump").arg("-H").arg(&four).output().expect("h5dump runs (Debian's hdf5-tools)");
    assert!(header.status.success(), "{}", text(&header));
    let h = String::from_utf8_lossy(&header.stdout);
    for (name, shape) in [
        ("model.embed_tokens.weight", "( 128, 64 )"),
        ("model.layers.1.self_attn.o_proj.weight", "( 64, 64 )"),
        ("model.layers.0.mlp.down_proj.weight", "( 64, 192 )"),
        ("model.norm.weight", "( 64 )"),
        ("lm_head.weight", "( 128, 64 )"),
    ] {
        let at = h.find(&format!("DATASET \"{name}\"")).unwrap_or_else(|| panic!("h5dump lists {name}:\n{h}"));
        assert!(h[at..].lines().take(4).any(|l| l.contains(&format!("SIMPLE {{ {shape} / {shape} }}"))), "{name} has shape {shape}");
    }
    let norm = Command::new("h5dump").args(["-d", "/model/model.norm.weight", "-m", "%.9g"]).arg(&four).output().unwrap();
    let values: Vec<f32> = String::from_utf8_lossy(&norm.stdout)
        .split("DATA {")
        .nth(1)
        .and_then(|rest| rest.split('}').next())
        .expect("h5dump prints the data")
        .split(|c: char| c == ',' || c.is_whitespace() || c == '}')
        .filter(|t| !t.is_empty() && !t.ends_with(':'))
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(values, tools::read_tensor(&four, "model/model.norm.weight").unwrap().1, "h5dump shows the stored values");

    let script = r#"
import sys, json, h5py, numpy as np
four, one, tol = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r"), float(sys.argv[3])
shapes = {"model.embed_tokens.weight": (128, 64), "lm_head.weight": (128, 64), "model.norm.weight": (64,)}
for l in range(2):
    p = f"model.layers.{l}."
    shapes.update({p + "input_layernorm.weight": (64,), p + "post_attention_layernorm.weight": (64,),
        p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64), p + "self_attn.v_proj.weight": (32, 64),
        p + "self_attn.o_proj.weight": (64, 64), p + "mlp.gate_proj.weight": (192, 64), p + "mlp.up_proj.weight": (192, 64),
        p + "mlp.down_proj.weight": (64, 192)})
assert int(four.attrs["step"]) == 10 and int(four.attrs["format_version"]) == 1
layout = json.loads(four.attrs["layout"])
assert (layout["dp_shard"], layout["tp"], layout["world"]) == (2, 2, 4), layout
assert "[model]" in four.attrs["deck"]
n = 0
for kind in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
    assert sorted(four[kind].keys()) == sorted(shapes), (kind, sorted(four[kind].keys()))
    for name, shape in shapes.items():
        a, b = four[kind][name][()], one[kind][name][()]
        assert a.dtype == np.float32 and a.shape == shape, (kind, name, a.dtype, a.shape)
        t = tol if kind == "model" else 5e-3
        assert np.abs(a - b).max() <= t * np.abs(b).max(), (kind, name, np.abs(a - b).max())
        n += 1
print("h5py read", n, "tensors")
"#;
    let py = Command::new("/usr/bin/python3")
        .args(["-c", script])
        .arg(&four)
        .arg(&one)
        .arg(PARAM_TOL.to_string())
        .output()
        .expect("Debian's python3 runs (jobscripts/local/setup-debian.sh installs python3-h5py)");
    assert!(py.status.success(), "{}", text(&py));
    assert!(String::from_utf8_lossy(&py.stdout).contains("h5py read 63 tensors"), "{}", text(&py));
}

/// Acceptance 4a: a job killed in the middle of writing a checkpoint leaves the previous one
/// complete and `latest` pointing at it; `resume = "auto"` continues from it bitwise.
#[test]
fn a_kill_during_a_write_leaves_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sets = ["run.steps=6", "checkpoint.every=2", "parallel.dp_shard=2"];
    let straight = train(d, "straight", Some(2), &sets);
    let out = d.join("killed");
    let (o, timed_out) = output_within(mpirun_train(2, &out, &sets).env(ndtrain::run::faults::ABORT_DURING_CHECKPOINT_ENV, "4"), 120);
    assert!(!timed_out && !o.status.success(), "the job must die mid-write: {}", text(&o));
    let ck = out.join("ckpt");
    assert!(
        ck.join("step_00000002.h5").exists() && !ck.join("step_00000004.h5").exists(),
        "{:?}",
        std::fs::read_dir(&ck).unwrap().collect::<Vec<_>>()
    );
    assert!(ck.join("step_00000004.h5.tmp").exists(), "the partial file stays under its temporary name");
    assert_eq!(std::fs::read_to_string(ck.join("latest")).unwrap().trim(), "step_00000002.h5");
    let v = run_single(&["ckpt", "verify", ck.join("step_00000002.h5").to_str().unwrap()]);
    assert!(v.status.success(), "{}", text(&v));

    let mut extra = sets.to_vec();
    extra.push("checkpoint.resume=\"auto\"");
    let resumed = train(d, "killed", Some(2), &extra);
    // The resumed run keeps the log rows of steps 1-2 and appends 3-6.
    assert_eq!(resumed, straight, "losses after resuming from step 2");
    assert!(!ck.join("step_00000004.h5.tmp").exists(), "the stale temporary is removed once step 4 is published");
    assert_bitwise_equal(&ckpt(d, "straight", 6), &ck.join("step_00000006.h5"));
}

/// Acceptance 4b: flipped bytes in a tensor are found by its checksum, named by `ckpt verify`
/// and `ckpt inspect`, and `resume = "auto"` reports the file and uses the previous one.
#[test]
fn a_corrupted_checkpoint_is_detected_and_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sets = ["run.steps=4", "checkpoint.every=2"];
    let straight = train(d, "run", None, &sets);
    let newest = ckpt(d, "run", 4);
    let tensor = "model/model.layers.1.mlp.up_proj.weight";
    let at = tools::dataset_offset(&newest, tensor).unwrap() + 1000;
    let mut bytes = std::fs::read(&newest).unwrap();
    bytes[at as usize] ^= 0x5a;
    std::fs::write(&newest, bytes).unwrap();

    let v = run_single(&["ckpt", "verify", newest.to_str().unwrap()]);
    assert_eq!(v.status.code(), Some(1), "{}", text(&v));
    assert!(String::from_utf8_lossy(&v.stderr).contains(&format!("checksum mismatch in 1 tensor(s): {tensor}")), "{}", text(&v));
    let i = run_single(&["ckpt", "inspect", newest.to_str().unwrap()]);
    assert_eq!(i.status.code(), Some(1), "{}", text(&i));
    let report = String::from_utf8_lossy(&i.stdout);
    assert!(report.lines().any(|l| l.starts_with(tensor) && l.contains("CORRUPT")), "{report}");
    assert!(report.contains("INVALID: 1 tensor(s)"), "{report}");

    let (o, _) = output_within(&mut mpirun_train(1, &d.join("run"), &["run.steps=4", "checkpoint.resume=\"auto\""]), 120);
    assert!(o.status.success(), "{}", text(&o));
    let log = text(&o);
    assert!(log.contains("skipping a checkpoint that is not valid") && log.contains(tensor), "{log}");
    assert!(log.contains("resumed from") && log.contains("step_00000002.h5"), "{log}");
    assert_eq!(losses(&d.join("run")).0, straight, "steps 3-4 retrained from step 2");
}

/// Acceptance 7: SIGTERM to every rank (what Slurm does at a time limit) mid-run: a checkpoint
/// at the next step boundary, exit code 75, and `resume = "auto"` finishes the run bitwise
/// like one that was never stopped.
#[test]
fn sigterm_checkpoints_at_a_step_boundary_and_the_resume_is_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sets = ["run.steps=200", "checkpoint.every=200", "parallel.dp_shard=2"];
    let straight = train(d, "straight", Some(2), &sets);
    let out = d.join("stopped");
    // 100 ms per step: the signal lands mid-run on any machine, however fast its steps are.
    let child = mpirun_train(2, &out, &sets)
        .env(ndtrain::run::faults::STEP_DELAY_ENV, "100")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let rows = || steps_done(&out);
    while rows() < 3 {
        assert!(start.elapsed().as_secs() < 300, "the run never logged 3 steps in 300 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let logged_before_signal = rows() as u64;
    term_ranks(child.id(), 2);
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(ndtrain::exit::PREEMPTED), "{}", text(&o));
    let stopped_at = losses(&out).0.len() as u64;
    // The signal arrives during step `logged + 1` (or just after `logged` was written, before
    // the next step's agreement): the ranks stop at the end of that step or the next, no later.
    assert!(
        (logged_before_signal..=logged_before_signal + 2).contains(&stopped_at),
        "signalled after {logged_before_signal} logged steps, stopped after step {stopped_at}"
    );
    assert!(text(&o).contains(&format!("checkpoint of step {stopped_at} written")), "{}", text(&o));
    assert_eq!(std::fs::read_to_string(out.join("ckpt/latest")).unwrap().trim(), format!("step_{stopped_at:08}.h5"));

    let mut extra = sets.to_vec();
    extra.push("checkpoint.resume=\"auto\"");
    let resumed = train(d, "stopped", Some(2), &extra);
    assert_eq!(resumed, straight, "losses of the stopped-and-resumed run");
    assert_bitwise_equal(&ckpt(d, "straight", 200), &out.join("ckpt/step_00000200.h5"));
}

/// Acceptance 5: loading a checkpoint, a rank's memory grows with its shard, not the model. A
/// 16.0 M-parameter model (184 MiB with its moments) written by 4 ranks is loaded by 1, 2 and 4;
/// so is its Hugging Face export (`init_from`, 61 MiB of parameters).
#[test]
fn loading_memory_grows_with_the_shard_not_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = [
        "model.d_model=384",
        "model.n_layers=6",
        "model.vocab_size=8192",
        "model.ffn_hidden=1024",
        "train.seq_len=32",
        "train.micro_batch=1",
        "train.global_batch=4",
        "run.steps=1",
        "optim.warmup_steps=1",
        "checkpoint.every=1",
    ];
    let hf = format!("checkpoint.export_hf=\"{}\"", d.join("hf").display());
    let mut writer = model.to_vec();
    writer.push(&hf);
    train_losses(d, "writer", &tiny_deck(), Some(4), &writer);
    // Resuming the checkpoint (parameters and both moments), and starting from the Hugging
    // Face export of the same model (`init_from`: parameters only, read by slices).
    let r = resume_from(&ckpt(d, "writer", 1));
    let init = format!("checkpoint.init_from=\"{}\"", d.join("hf").display());
    for (what, load) in [("resume", &r), ("init_from", &init)] {
        assert_loading_memory_follows_the_shard(d, what, &model, load);
    }
}

fn assert_loading_memory_follows_the_shard(d: &Path, what: &str, model: &[&str], load: &str) {
    let mut grown = vec![];
    for n in [1usize, 2, 4] {
        let mut sets = model.to_vec();
        sets.push(load);
        sets.retain(|s| !(what == "init_from" && s.starts_with("checkpoint.every")));
        train_losses(d, &format!("{what}{n}"), &tiny_deck(), Some(n), &sets);
        let csv = std::fs::read_to_string(d.join(format!("{what}{n}/checkpoint_io.csv"))).unwrap();
        let row: Vec<&str> = csv.lines().find(|l| l.contains(",load,")).expect("a load row").split(',').collect();
        let (before, peak, state): (f64, f64, f64) = (row[7].parse().unwrap(), row[8].parse().unwrap(), row[9].parse().unwrap());
        let mib = |x: f64| x / 1048576.0;
        eprintln!(
            "{what}, {n} rank(s): state {:.1} MiB/rank, resident {:.1} MiB before, peak {:.1} MiB after",
            mib(state),
            mib(before),
            mib(peak)
        );
        // The shard itself plus at most 32 MiB of HDF5/MPI-IO buffers.
        assert!(
            peak - before <= state + 32.0 * 1048576.0,
            "{what}, {n} ranks: grew {:.1} MiB for a {:.1} MiB shard",
            mib(peak - before),
            mib(state)
        );
        grown.push(peak - before);
    }
    assert!(grown[2] < 0.5 * grown[0], "{what}: 4 ranks must need well under half of what 1 rank needs: {grown:?}");
}

/// `ckpt export` writes the Hugging Face folder the run's own `export_hf` writes; `keep`
/// bounds the checkpoints on disk.
#[test]
fn ckpt_export_matches_export_hf_and_keep_prunes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let hf_run = d.join("hf_run");
    let e = format!("checkpoint.export_hf=\"{}\"", hf_run.display());
    train(d, "run", Some(4), &["run.steps=6", "checkpoint.every=1", "checkpoint.keep=2", "parallel.tp=2", &e]);
    let mut left: Vec<String> =
        std::fs::read_dir(d.join("run/ckpt")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, ["latest", "step_00000005.h5", "step_00000006.h5"]);

    let hf_ckpt = d.join("hf_ckpt");
    let o = run_single(&["ckpt", "export", ckpt(d, "run", 6).to_str().unwrap(), "--hf", hf_ckpt.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let owned: Vec<String> = SETS.iter().map(|s| s.to_string()).collect();
    let cfg = ndtrain::config::Deck::from_file(&tiny_deck(), &owned).unwrap().model;
    let a = ndtrain::io::hf::load_params::<f32>(&hf_run, &cfg).unwrap();
    let b = ndtrain::io::hf::load_params::<f32>(&hf_ckpt, &cfg).unwrap();
    assert_eq!(a, b, "the same model, bit for bit");
    assert_eq!(std::fs::read(hf_run.join("config.json")).unwrap(), std::fs::read(hf_ckpt.join("config.json")).unwrap());

    let i = run_single(&["ckpt", "inspect", ckpt(d, "run", 6).to_str().unwrap()]);
    assert!(i.status.success(), "{}", text(&i));
    let report = String::from_utf8_lossy(&i.stdout);
    for want in ["step           6 of 6", "dp_replicate=1 dp_shard=2 cp=1 tp=2 (4 ranks)", "valid: every checksum matches", "128×64"] {
        assert!(report.contains(want), "inspect shows {want}:\n{report}");
    }
}

/// A checkpoint of another model, or a resume path that does not exist, stops every rank with
/// a message naming the key and the values, without a hang.
#[test]
fn an_incompatible_or_missing_checkpoint_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    train(d, "small", None, &["run.steps=2", "checkpoint.every=2"]);
    let r = resume_from(&ckpt(d, "small", 2));
    let missing = resume_from(&d.join("nope.h5"));
    for (sets, want) in [
        (vec![r.as_str(), "model.ffn_hidden=128"], "the deck has [model] ffn_hidden = 128, the checkpoint's model has ffn_hidden = 192"),
        (
            vec![r.as_str(), "train.global_batch=32"],
            "the deck has [train] global_batch = 32, the checkpoint was written with global_batch = 16",
        ),
        (vec![missing.as_str()], "[checkpoint] resume = "),
    ] {
        let (o, timed_out) = output_within(&mut mpirun_train(2, &d.join("bad"), &sets), 60);
        assert!(!timed_out && !o.status.success(), "{}", text(&o));
        assert!(text(&o).contains(want), "expected '{want}' in:\n{}", text(&o));
    }
}

/// After a resume the ETA comes from this job's own pace: resumed at step 10 of 30 (every step
/// slowed to 150 ms), the ETA printed at step 14 is the 16 steps left at the pace of this job's
/// steps 12 to 14, read from `metrics.csv`'s `elapsed_s` (the job's own clock, so the check holds
/// however loaded the machine is). Dividing by the absolute step would predict about a third of
/// it; counting the job's first step, with its start-up costs, in the pace would overestimate it.
#[test]
fn the_eta_after_a_resume_follows_this_jobs_pace() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("run");
    let run = |steps: &str, resume: bool| {
        let mut cmd = Command::new(bin());
        mpi_env(&mut cmd).arg("train").arg(tiny_deck()).env(ndtrain::run::faults::STEP_DELAY_ENV, "150");
        for s in ["run.threads=1", "optim.warmup_steps=2", "checkpoint.every=10", "log.every=1", steps] {
            cmd.args(["--set", s]);
        }
        cmd.arg("--set").arg(format!("run.out_dir=\"{}\"", out.display()));
        if resume {
            cmd.args(["--set", "checkpoint.resume=\"auto\""]);
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    run("run.steps=10", false);
    let console = run("run.steps=30", true);
    let line =
        console.lines().find(|l| l.split_whitespace().next() == Some("14")).unwrap_or_else(|| panic!("no line for step 14:\n{console}"));
    let eta: f64 = line.split_whitespace().last().unwrap().trim_end_matches('s').parse().unwrap_or_else(|_| panic!("{line}"));
    let elapsed = column(&out, "elapsed_s");
    // metrics.csv holds steps 1..=30 (the first job's rows kept, the second's appended).
    assert_eq!(elapsed.len(), 30);
    // Step 11 is the resumed job's first; the console prints the ETA to 0.1 s.
    let pace = (elapsed[13] - elapsed[10]) / 3.0 * 16.0;
    let absolute = elapsed[13] / 14.0 * 16.0;
    assert!((eta - pace).abs() <= 0.051 + 1e-5 * pace, "ETA at step 14: {eta} s, this job's pace: {pace} s\n{line}");
    assert!((eta - absolute).abs() > 0.051, "ETA at step 14: {eta} s is the absolute step's {absolute} s\n{line}");
}

/// The run in `out` stopped for a limit `limit_s` into the job, on its own clock (`metrics.csv`'s
/// `elapsed_s`): its last step ended before the limit, or after it by at most the longest step
/// (a step that ran longer than every one before it, which the stop rule counts the next step as).
fn assert_last_step_ends_before(out: &Path, limit_s: f64, context: &str) {
    let (elapsed, step_s) = (column(out, "elapsed_s"), column(out, "step_s"));
    let longest = step_s.iter().copied().fold(0.0, f64::max);
    let last = *elapsed.last().unwrap();
    assert!(last < limit_s + longest, "the last step ended {last} s into training, the longest step took {longest:.2} s{context}");
}

/// `[run] max_walltime` shorter than the run: the job checkpoints and exits 75 before the
/// limit (every step slowed to 150 ms, a limit of 2.5 s from the start), and `resume = "auto"`
/// finishes it with the losses and the final checkpoint of a run never stopped, bit for bit.
/// The limit is held on the job's own clock (`metrics.csv`'s `elapsed_s`): the run goes on only
/// while the next step and the checkpoint fit, the next step counted as the slowest so far, so its
/// last step ends before the limit unless that step ran longer than every one before it, by at
/// most that step.
#[test]
fn max_walltime_stops_before_the_limit_and_the_resume_is_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sets = ["run.steps=40", "checkpoint.every=40", "parallel.dp_shard=2"];
    let straight = train(d, "straight", Some(2), &sets);
    let out = d.join("limited");
    let mut limited = sets.to_vec();
    limited.push("run.max_walltime=2.5");
    let o = mpirun_train(2, &out, &limited).env(ndtrain::run::faults::STEP_DELAY_ENV, "150").output().unwrap();
    assert_eq!(o.status.code(), Some(ndtrain::exit::PREEMPTED), "{}", text(&o));
    let stopped_at = losses(&out).0.len();
    assert!((1..40).contains(&stopped_at), "stopped after step {stopped_at}");
    assert!(
        text(&o).contains("[run] max_walltime = 2.5 s") && text(&o).contains(&format!("checkpoint of step {stopped_at} written")),
        "{}",
        text(&o)
    );
    // The limit counts from each rank's start; mpirun's own start-up and exit come on top.
    assert_last_step_ends_before(&out, 2.5, "");
    let mut resume = sets.to_vec();
    resume.push("checkpoint.resume=\"auto\"");
    let resumed = train(d, "limited", Some(2), &resume);
    assert_eq!(resumed, straight, "losses of the limited-and-resumed run");
    assert_bitwise_equal(&ckpt(d, "straight", 40), &out.join("ckpt/step_00000040.h5"));
}

/// `[run] stop_before_job_end`: rank 0 asks the batch scheduler how long the job has left
/// (here a PBS job whose `qstat -f` says 3 s of a walltime limit remain) and the run stops with
/// a checkpoint and exit 75 before that; the scheduler is asked once per job. Outside a batch
/// job the key is bad input. A stop-signal lead time shorter than a step and a checkpoint is a
/// warning.
#[test]
fn the_batch_jobs_own_time_limit_stops_the_run_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bin_dir = d.join("bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    let qstat = bin_dir.join("qstat");
    let asked = d.join("qstat-calls");
    std::fs::write(
        &qstat,
        format!(
            "#!/bin/sh\necho \"$@\" >> {}\necho \"Job Id: $2\"\necho '    Resource_List.walltime = 00:00:03'\necho '    resources_used.walltime = 00:00:00'\n",
            asked.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&qstat, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap());
    let out = d.join("pbs");
    let sets = ["run.steps=60", "run.stop_before_job_end=true", "run.signal_lead_time=0.05"];
    let start = std::time::Instant::now();
    let o = mpirun_train(2, &out, &sets)
        .env("PATH", &path)
        .env("PBS_JOBID", "4242.pbs")
        .env(ndtrain::run::faults::STEP_DELAY_ENV, "150")
        .output()
        .unwrap();
    let (took, t) = (start.elapsed().as_secs_f64(), text(&o));
    assert_eq!(o.status.code(), Some(ndtrain::exit::PREEMPTED), "{t}");
    assert!(t.contains("walltime: PBS job 4242.pbs: qstat -f walltime limit minus used: "), "{t}");
    assert!(t.contains("the batch job's time limit (3 s after the start)"), "{t}");
    let stopped_at = losses(&out).0.len();
    assert!((1..60).contains(&stopped_at) && t.contains(&format!("checkpoint of step {stopped_at} written")), "{t}");
    // The limit counts from each rank's start, on its own clock: the steps ended before it,
    // unless the last ran longer than every one before it, by at most that step (mpirun's
    // start-up and exit, slow on a loaded machine, come on top of the wall time).
    assert_last_step_ends_before(&out, 3.0, &format!(" ({took:.2} s of wall time)"));
    assert_eq!(std::fs::read_to_string(&asked).unwrap(), "-f 4242.pbs\n", "asked once, by rank 0");
    assert_eq!(t.matches("take longer than the scheduler's stop-signal lead time ([run] signal_lead_time = 0.05 s)").count(), 1, "{t}");

    let o = mpirun_train(2, &d.join("nojob"), &["run.stop_before_job_end=true"])
        .env_remove("PBS_JOBID")
        .env_remove("SLURM_JOB_ID")
        .output()
        .unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert_eq!(t.matches("not a Slurm or PBS batch job").count(), 1, "{t}");
}

/// Asynchronous writes (`[checkpoint] async = true`, the default) make the files the
/// synchronous ones make, bit for bit, with the same checksums: on FSDP 2 × TP 2, PP 2 and
/// ep 2. Neither makes a collective HDF5 call, for the tiny model's 63 datasets as for the
/// mixture of experts' 3 × 127.
#[test]
fn asynchronous_checkpoints_are_the_synchronous_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let experts = [expert_pipeline_sets(), vec!["parallel.ep=2", "parallel.dp_shard=2"]].concat();
    let dense = |layout: &'static str| [SETS, &[layout]].concat();
    let cases: [(&str, usize, Vec<&str>, u64, usize); 3] =
        [("fsdp2_tp2", 4, dense("parallel.tp=2"), 10, 63), ("pp2", 2, dense("parallel.pp=2"), 10, 63), ("ep2", 2, experts, 6, 3 * 127)];
    for (name, ranks, sets, last, tensors) in cases {
        let mut runs = vec![];
        for mode in ["true", "false"] {
            let run = format!("{name}_async_{mode}");
            let mode_set = format!("checkpoint.async={mode}");
            let all: Vec<&str> = sets.iter().copied().chain([mode_set.as_str()]).collect();
            let losses = train_losses(d, &run, &tiny_deck(), Some(ranks), &all).0;
            let writes = io_rows(&d.join(&run), "write");
            assert!(!writes.is_empty() && writes.iter().all(|r| r["collective_hdf5_calls"] == "0"), "{run}: {writes:?}");
            runs.push((ckpt(d, &run, last), losses));
        }
        let ((a, la), (b, lb)) = (&runs[0], &runs[1]);
        assert_eq!(la, lb, "{name}: losses");
        let names = tools::dataset_paths(a).unwrap();
        assert_eq!(names, tools::dataset_paths(b).unwrap(), "{name}");
        assert_eq!(names.len(), tensors, "{name}");
        for n in &names {
            let ((sa, xa), (sb, xb)) = (tools::read_tensor(a, n).unwrap(), tools::read_tensor(b, n).unwrap());
            assert_eq!(sa, sb, "{name}: {n}");
            assert!(xa.iter().zip(&xb).all(|(x, y)| x.to_bits() == y.to_bits()), "{name}: {n} differs");
        }
        // Equal bits and both verified: equal checksums.
        for f in [a, b] {
            assert_eq!(tools::verify(f).unwrap(), tensors, "{}", f.display());
        }
    }
}

/// 20 jobs killed (every rank, SIGKILL) at moments drawn from a fixed seed while asynchronous
/// writes are in flight (each writer slowed to 4 ms a tensor, so a write spans several steps):
/// every complete checkpoint verifies, `latest` names one, none published before the kill is
/// lost, and `resume = "auto"` continues from the newest.
#[test]
fn kills_at_random_moments_of_asynchronous_writes_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sets = ["run.steps=400", "checkpoint.every=2", "parallel.dp_shard=2"];
    let complete = |ck: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(ck)
            .map(|rd| rd.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "h5")).collect())
            .unwrap_or_default();
        v.sort();
        v
    };
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut in_flight = 0;
    for trial in 0..20 {
        let out = d.join(format!("trial{trial}"));
        let ck = out.join("ckpt");
        let mut child = mpirun_train(2, &out, &sets)
            .env(ndtrain::run::faults::CHECKPOINT_WRITE_DELAY_ENV, "4")
            .env(ndtrain::run::faults::STEP_DELAY_ENV, "10")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        while !ck.join("latest").exists() {
            assert!(child.try_wait().unwrap().is_none(), "trial {trial}: the job ended before its first checkpoint");
            assert!(start.elapsed().as_secs() < 300, "trial {trial}: no checkpoint in 300 s");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // A moment within the next second: a SplitMix64 step of the seed.
        seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let wait_ms = (seed ^ (seed >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9) % 1000;
        std::thread::sleep(std::time::Duration::from_millis(wait_ms));
        let before = complete(&ck);
        for pid in children(child.id()) {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
        let _ = child.wait();
        let names: Vec<String> = std::fs::read_dir(&ck).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        in_flight += names.iter().any(|n| n.ends_with(".h5.tmp")) as usize;
        let after = complete(&ck);
        assert!(before.iter().all(|p| after.contains(p)), "trial {trial} (killed {wait_ms} ms in): lost {before:?} → {after:?}");
        for p in &after {
            let v = run_single(&["ckpt", "verify", p.to_str().unwrap()]);
            assert!(v.status.success(), "trial {trial} (killed {wait_ms} ms in): {}\n{}", p.display(), text(&v));
        }
        let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
        assert!(after.contains(&ck.join(latest.trim())), "trial {trial}: latest = {latest:?} of {after:?}");
        if trial == 19 {
            let o = mpirun_train(
                2,
                &out,
                &["run.steps=400", "checkpoint.every=2", "parallel.dp_shard=2", "run.stop_after_steps=2", "checkpoint.resume=\"auto\""],
            )
            .output()
            .unwrap();
            assert!(o.status.code() == Some(ndtrain::exit::PREEMPTED) && text(&o).contains("resumed from"), "{}", text(&o));
        }
    }
    // The kills landed while a write was in flight (its temporary file still there).
    assert!(in_flight >= 10, "only {in_flight} of 20 kills found a write in flight");
}
