//! Shared helpers of the integration tests: run the real `ndtrain` binary, alone (a singleton
//! MPI job) or under `mpirun`, and read what it wrote.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
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
    mpi_env(&mut Command::new("mpirun")).args(["--oversubscribe", "-n", &n.to_string(), bin()]).args(args).output().expect("mpirun runs")
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
