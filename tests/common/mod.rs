//! Shared helpers of the integration tests: run the real `ndtrain` binary, alone (a singleton
//! MPI job) or under `mpirun`, and read what it wrote.
#![allow(dead_code)]

use ndtrain::io::checkpoint::tools;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The emulated cluster every `mpirun` of this test binary launches on, once set: the command
/// that runs a program on its first host, its hostfile and the environment `cluster-local.sh
/// env` gives.
struct Cluster {
    on_first_host: Vec<String>,
    hostfile: PathBuf,
    env: Vec<(String, String)>,
}

static CLUSTER: OnceLock<Cluster> = OnceLock::new();

/// From now on, `mpirun` (and every helper built on it) runs through `on_first_host` (the
/// program and its arguments follow it) and launches across the hosts of `hostfile` with
/// `env` (`tests/multinode.rs`).
pub fn launch_on_cluster(on_first_host: Vec<String>, hostfile: PathBuf, env: Vec<(String, String)>) {
    let _ = CLUSTER.set(Cluster { on_first_host, hostfile, env });
}

/// `mpirun --oversubscribe -n N`, on the emulated cluster once one is set.
pub fn mpirun(n: usize) -> Command {
    let mut cmd = match CLUSTER.get() {
        Some(c) => {
            let mut cmd = Command::new(&c.on_first_host[0]);
            cmd.args(&c.on_first_host[1..]).arg("mpirun").arg("--hostfile").arg(&c.hostfile);
            cmd.envs(c.env.iter().map(|(k, v)| (k, v)));
            cmd
        }
        None => Command::new("mpirun"),
    };
    mpi_env(&mut cmd).args(["--oversubscribe", "-n", &n.to_string()]);
    cmd
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_ndtrain")
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn tiny_deck() -> PathBuf {
    repo().join("inputs/tiny.toml")
}

/// Environment for Open MPI in a container: root allowed, idle ranks yield instead of spin.
pub fn mpi_env(cmd: &mut Command) -> &mut Command {
    // Open MPI 4 keeps every job's session directory under one `ompi.<host>.<uid>` folder of
    // the temporary directory and removes that folder when a job ends and finds it empty: a job
    // starting at that moment fails ("A call to mkdir was unable to create the desired
    // directory", open-mpi/ompi#8510). Each job gets a base folder of its own (Open MPI creates it).
    static JOBS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let job = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let base = std::env::temp_dir().join("ndtrain-tests-ompi").join(format!("{}-{job}", std::process::id()));
    cmd.env("OMPI_MCA_orte_tmpdir_base", base)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_mpi_yield_when_idle", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
}

/// `ndtrain ARGS` as a singleton MPI job (no launcher).
pub fn run_single(args: &[&str]) -> Output {
    mpi_env(&mut Command::new(bin())).args(args).output().expect("ndtrain runs")
}

/// `mpirun -n N ndtrain ARGS`.
pub fn run_mpi(n: usize, args: &[&str]) -> Output {
    mpirun(n).arg(bin()).args(args).output().expect("mpirun runs")
}

pub fn text(o: &Output) -> String {
    format!("--- stdout ---\n{}\n--- stderr ---\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The `loss` column of `<out>/metrics.csv`, as the exact strings written (for bitwise checks)
/// and as numbers.
pub fn losses(out: &Path) -> (Vec<String>, Vec<f64>) {
    let csv = std::fs::read_to_string(out.join("metrics.csv")).expect("metrics.csv exists");
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = header.iter().position(|h| *h == "loss").expect("loss column");
    let s: Vec<String> = lines.map(|l| l.split(',').nth(col).expect("loss value").to_string()).collect();
    let v = s.iter().map(|x| x.parse().expect("a number")).collect();
    (s, v)
}

/// Trains `deck` into `<dir>/<name>` with extra `--set` overrides, on `ranks` ranks
/// (`None` = singleton, no launcher); asserts success and returns the loss column.
pub fn train_losses(dir: &Path, name: &str, deck: &Path, ranks: Option<usize>, sets: &[&str]) -> (Vec<String>, Vec<f64>) {
    let out = dir.join(name);
    let set_out = format!("run.out_dir=\"{}\"", out.display());
    let mut args = vec!["train", deck.to_str().unwrap(), "--set", &set_out];
    for e in sets {
        args.push("--set");
        args.push(e);
    }
    let o = match ranks {
        None => run_single(&args),
        Some(n) => run_mpi(n, &args),
    };
    assert!(o.status.success(), "{name}: {}", text(&o));
    losses(&out)
}

/// Runs `cmd` and kills it if it has not finished within `secs` (a hang is a test failure,
/// not a stuck suite). Returns the output and whether it timed out.
pub fn output_within(cmd: &mut Command, secs: u64) -> (Output, bool) {
    use std::process::Stdio;
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("process starts");
    let start = std::time::Instant::now();
    let mut timed_out = false;
    while child.try_wait().expect("wait works").is_none() {
        if start.elapsed().as_secs() >= secs {
            let _ = child.kill();
            timed_out = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    (child.wait_with_output().expect("output collected"), timed_out)
}

/// A numeric column of `<out>/metrics.csv`.
pub fn column(out: &Path, name: &str) -> Vec<f64> {
    let csv = std::fs::read_to_string(out.join("metrics.csv")).expect("metrics.csv exists");
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no column {name}"));
    lines.map(|l| l.split(',').nth(col).expect("value").parse().expect("a number")).collect()
}

/// Per-step losses of a layout against one rank: layouts sum the same per-sample gradients in
/// another order, in f32, and Adam's division by sqrt(v) amplifies that noise over steps.
/// Measured after 10 steps on the tiny deck: ≤ 1.7e-8 for DP/FSDP/HSDP, ≤ 3.2e-8 with TP and
/// SP, ≤ 5.0e-8 with CP (the online-softmax merge reorders the sums). 1e-6 leaves a 20× margin
/// and still catches a wrong normalisation or a lost micro-batch (≥ 1e-3).
pub const LOSS_TOL: f64 = 1e-6;
/// Final parameters, max |Δ| relative to the tensor's max |value|: measured ≤ 6.8e-6 for the
/// data-parallel layouts, ≤ 5.8e-5 with TP and ≤ 6.8e-5 with CP (elements whose gradient is
/// near zero get Adam updates whose sign follows rounding noise; TP and CP change the summation
/// order inside every matmul and softmax). 1e-3 is a 15× margin, while one wrong update of
/// lr = 3e-3 on weights of ~0.05 shows as > 1e-2.
pub const PARAM_TOL: f64 = 1e-3;

/// What the equivalence tests share: 10 steps, clipping active in every step, warm-up short.
pub const EQUIV_SETS: &[&str] = &["run.steps=10", "run.threads=1", "optim.grad_clip=0.3", "optim.warmup_steps=2"];

pub type RunResult = (Vec<f64>, ndtrain::model::params::ModelParams<f32>);

/// Trains the tiny deck on a layout (`EQUIV_SETS` + `layout`), checks every step's measured
/// bytes against the formulas and that clipping was active, and returns the losses and the
/// final model (exported as Hugging Face files, read back).
pub fn run_layout(dir: &Path, name: &str, ranks: usize, layout: &[&str]) -> RunResult {
    run_layout_with(dir, name, ranks, EQUIV_SETS, layout)
}

/// `run_layout` with other shared overrides than `EQUIV_SETS` (another model, fewer steps):
/// the tiny deck with `base` + `layout`. Clipping must be active in every step (pre-clip norm
/// above the deck's `[optim] grad_clip`, so the clipping path is part of what is compared).
pub fn run_layout_with(dir: &Path, name: &str, ranks: usize, base: &[&str], layout: &[&str]) -> RunResult {
    run_deck_layout(&tiny_deck(), dir, name, ranks, base, layout)
}

/// `run_layout_with` on another deck.
pub fn run_deck_layout(deck_path: &Path, dir: &Path, name: &str, ranks: usize, base: &[&str], layout: &[&str]) -> RunResult {
    let export = dir.join(name).join("final_hf");
    let exp = format!("checkpoint.export_hf=\"{}\"", export.display());
    let mut sets: Vec<&str> = base.to_vec();
    sets.extend_from_slice(layout);
    sets.push(&exp);
    let (_, losses) = train_losses(dir, name, deck_path, Some(ranks), &sets);
    let owned: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let deck = ndtrain::config::Deck::from_file(deck_path, &owned).unwrap();
    let clip = deck.optim.grad_clip;
    let norms = column(&dir.join(name), "grad_norm");
    assert_eq!(norms.len(), losses.len(), "{name}: grad_norm column");
    assert!(clip > 0.0 && norms.iter().all(|&n| n > clip), "{name}: clipping at {clip} must be active in every step: {norms:?}");
    assert_bytes_match_formula(dir, name, &deck, ranks);
    let params = ndtrain::io::hf::load_params::<f32>(&export, &deck.model).expect("exported model loads");
    (losses, params)
}

/// Checks every step's measured bytes per collective on rank 0 against the planner's
/// prediction (`tools::plan::predicted_comm_bytes`, built on the `fsdp`, `tp` and `cp` formulas).
pub fn assert_bytes_match_formula(dir: &Path, name: &str, deck: &ndtrain::config::Deck, world: usize) {
    let want = ndtrain::tools::plan::predicted_comm_bytes(&deck.resolve(world).unwrap());
    let csv = std::fs::read_to_string(dir.join(name).join("timing/rank_00000.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    for (i, line) in lines.enumerate() {
        let row: Vec<&str> = line.split(',').collect();
        assert_eq!(row.len(), header.len(), "{name}: timing row {} has {} values for {} columns", i + 1, row.len(), header.len());
        for (col, value) in header.iter().zip(&row) {
            if let Some(key) = col.strip_suffix("_bytes").filter(|k| k.contains('.')) {
                let got: u64 = value.parse().unwrap();
                let expect = want.get(key).copied().unwrap_or(0);
                let (ep, k, e) = (deck.parallel.ep as u64, deck.model.experts_per_token, deck.model.n_experts);
                if key == "ep.all_to_all" && ep > 1 && k < e {
                    // The formula is the even split's: with top-k routing a rank sends between
                    // nothing and every routed row (ep/(ep − 1) times the even share) off-rank.
                    let all_off = expect * ep / (ep - 1);
                    assert!(got > 0 && got <= all_off, "{name}: step {} {key}: measured {got} bytes, outside (0, {all_off}]", i + 1);
                    continue;
                }
                assert_eq!(got, expect, "{name}: step {} {key}: measured {got} bytes, formula {expect}", i + 1);
            }
        }
    }
}

/// Asserts that two runs logged the same number of steps (a truncated run fails, it is not
/// compared on its prefix), at least one, and that every step's loss agrees within `tol`.
/// Returns the largest |Δloss|.
pub fn assert_losses_within(name: &str, base: &[f64], other: &[f64], tol: f64) -> f64 {
    assert_eq!(base.len(), other.len(), "{name}: step count differs: {base:?} vs {other:?}");
    assert!(!base.is_empty(), "{name}: no step was logged");
    let mut worst = 0.0f64;
    for (s, (a, b)) in base.iter().zip(other).enumerate() {
        let d = (a - b).abs();
        assert!(d < tol, "{name}: step {} loss {a} vs {b} (|Δ| {d:.3e}, tolerance {tol:.0e})", s + 1);
        worst = worst.max(d);
    }
    worst
}

/// Asserts a layout reproduced the one-rank run: every step's loss and the final parameters.
pub fn assert_equivalent(name: &str, base: &RunResult, other: &RunResult) {
    let worst_loss = assert_losses_within(name, &base.0, &other.0, LOSS_TOL);
    let mut worst_param = 0.0f64;
    let (ta, tb) = (base.1.tensors(), other.1.tensors());
    assert_eq!(ta.len(), tb.len(), "{name}: tensor count");
    for (i, (a, b)) in ta.iter().zip(tb).enumerate() {
        assert_eq!(a.len(), b.len(), "{name}: tensor {i} element count");
        let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
        let diff = a.iter().zip(b.iter()).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) as f64;
        assert!(diff / scale < PARAM_TOL, "{name}: tensor {i} differs by {diff} (scale {scale})");
        worst_param = worst_param.max(diff / scale);
    }
    eprintln!("{name}: worst loss diff {worst_loss:.3e}, worst relative parameter diff {worst_param:.3e}");
}

/// A column of the last row of a rank's timing log.
pub fn last_timing_value(out: &Path, rank: usize, name: &str) -> f64 {
    let csv = std::fs::read_to_string(out.join(format!("timing/rank_{rank:05}.csv"))).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let last: Vec<&str> = lines.last().unwrap().split(',').collect();
    last[header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no column {name}"))].parse().unwrap()
}

/// Runs each `(name, ranks, --set overrides)` layout and asserts it reproduces `base`.
pub fn assert_layouts_match(dir: &Path, base: &RunResult, layouts: &[(&str, usize, &[&str])]) {
    assert_layouts_match_with(dir, EQUIV_SETS, base, layouts);
}

/// `assert_layouts_match` on the tiny deck with `sets` instead of `EQUIV_SETS` (`base` must
/// have been run with the same `sets`, see `run_layout_with`).
pub fn assert_layouts_match_with(dir: &Path, sets: &[&str], base: &RunResult, layouts: &[(&str, usize, &[&str])]) {
    for (name, ranks, layout) in layouts {
        let other = run_layout_with(dir, &name.replace([' ', '=', '×'], "_"), *ranks, sets, layout);
        assert_equivalent(name, base, &other);
    }
}

/// The process ids whose parent is `parent` (the ranks `mpirun` started).
pub fn children(parent: u32) -> Vec<i32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // Fields after the command name, which is in parentheses: state, ppid, ...
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        if after.split(' ').nth(1).and_then(|p| p.parse::<u32>().ok()) == Some(parent) {
            out.push(pid);
        }
    }
    out
}

/// `mpirun -n N ndtrain train <tiny deck>` writing to `out`, with `sets` as `--set`s; not started.
pub fn mpirun_tiny(n: usize, out: &Path, sets: &[&str]) -> Command {
    let mut cmd = mpirun(n);
    cmd.args([bin(), "train"]).arg(tiny_deck());
    cmd.arg("--set").arg(format!("run.out_dir=\"{}\"", out.display()));
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd
}

/// Rows of `<out>/metrics.csv` so far (steps finished).
pub fn steps_done(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.csv")).map(|s| s.lines().count().saturating_sub(1)).unwrap_or(0)
}

/// Sends SIGTERM to each of the `ranks` rank processes `mpirun` (`launcher`) started — as a
/// scheduler signals the tasks, not the launcher — and returns their pids.
pub fn term_ranks(launcher: u32, ranks: usize) -> Vec<i32> {
    let pids = children(launcher);
    assert_eq!(pids.len(), ranks, "mpirun's children: {pids:?}");
    for pid in &pids {
        assert!(Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap().success());
    }
    pids
}

/// The checkpoint a run in `dir/name` wrote after `step` steps.
pub fn ckpt(dir: &Path, name: &str, step: u64) -> PathBuf {
    dir.join(name).join("ckpt").join(format!("step_{step:08}.h5"))
}

/// Every tensor of two checkpoints within the layout tolerance of the larger one's scale
/// (parameters `PARAM_TOL`; AdamW moments 5e-3, as in `tests/checkpoint.rs`).
pub fn assert_close(name: &str, a: &Path, b: &Path) {
    let names = tools::dataset_paths(a).unwrap();
    assert_eq!(names, tools::dataset_paths(b).unwrap(), "{name}: the same tensors");
    for n in names {
        let (sa, xa) = tools::read_tensor(a, &n).unwrap();
        let (sb, xb) = tools::read_tensor(b, &n).unwrap();
        assert_eq!(sa, sb, "{name}: {n}");
        let scale = xa.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
        let diff = xa.iter().zip(&xb).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) as f64;
        let tol = if n.starts_with("model/") { PARAM_TOL } else { 5e-3 };
        assert!(diff <= tol * scale, "{name}: {n}: max |Δ| {diff:e} vs scale {scale:e}");
    }
}

/// The tiny deck as a mixture of experts: 8 experts of width 48, top-2, the auxiliary loss
/// on; one thread, clipping active.
pub const EXPERT_SETS: &[&str] = &[
    "run.threads=1",
    "optim.grad_clip=0.3",
    "optim.warmup_steps=2",
    "model.n_experts=8",
    "model.experts_per_token=2",
    "model.moe_ffn_hidden=48",
    "model.router_aux_loss_coef=0.05",
];

/// [`EXPERT_SETS`] after `first` (the same keys in the same order as a list written out).
pub fn expert_sets_after(first: &[&'static str]) -> Vec<&'static str> {
    [first, EXPERT_SETS].concat()
}

/// [`EXPERT_SETS`] on 4 blocks, so a pipeline has 2 per stage and interleaving fits: 6 steps,
/// checkpoints at 3 and 6.
pub fn expert_pipeline_sets() -> Vec<&'static str> {
    [EXPERT_SETS, &["run.steps=6", "model.n_layers=4", "checkpoint.every=3"]].concat()
}

/// Trains `expert_pipeline_sets` + `extra` on `ranks` ranks (one: no `mpirun`); its losses.
pub fn train_experts(dir: &Path, name: &str, ranks: usize, extra: &[&str]) -> Vec<f64> {
    let mut sets = expert_pipeline_sets();
    sets.extend_from_slice(extra);
    train_losses(dir, name, &tiny_deck(), (ranks > 1).then_some(ranks), &sets).1
}

/// `sbatch --wait` of the job script with `sets` as its `SETS` and `resources` as sbatch options;
/// returns the exit code and the job's output.
pub fn sbatch(env: &[(String, String)], out: &Path, name: &str, sets: &str, resources: &[&str]) -> (i32, String) {
    let job_out = out.join(format!("{name}.out"));
    let export = format!("ALL,DECK={},NDTRAIN={},SETS={sets}", tiny_deck().display(), bin());
    let o = Command::new("sbatch")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .args(["--wait", "--time=00:10:00", &format!("--job-name={name}")])
        .args(resources)
        .arg(format!("--chdir={}", repo().display()))
        .arg(format!("--output={}", job_out.display()))
        .arg(format!("--export={export}"))
        .arg(repo().join("jobscripts/slurm/train.sbatch"))
        .output()
        .expect("sbatch runs");
    let log = std::fs::read_to_string(&job_out).unwrap_or_default();
    (o.status.code().unwrap_or(-1), format!("{}\n--- job output ---\n{log}", text(&o)))
}

/// `ndtrain sweep ARGS` from the repository root with the batch system's `env` (and the
/// binary as the jobs' `NDTRAIN`).
pub fn sweep(env: &[(String, String)], args: &[&str]) -> Output {
    Command::new(bin())
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("NDTRAIN", bin())
        .current_dir(repo())
        .arg("sweep")
        .args(args)
        .output()
        .unwrap()
}

/// `sweep STUDY --out OUT` then `sweep submit OUT`, each asserted to succeed.
pub fn sweep_submit(env: &[(String, String)], study: &Path, out: &Path) {
    let o = sweep(env, &[study.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let o = sweep(env, &["submit", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
}
