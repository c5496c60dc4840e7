//! Where ranks' threads run, under the bindings a user meets: the automatic thread count is
//! the CPUs of the rank's affinity mask shared by the ranks with the same mask, and rank 0's
//! placement table says so (one line per rank) with a warning for idle or shared cores.

mod common;
use common::*;
use std::process::Command;

/// The machine's CPUs (the tests assume the ones this process may use are 0..n).
fn cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// `mpirun LAUNCHER -n N ndtrain train tiny` for one step; returns the console.
fn placed(launcher: &[&str], n: usize) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = format!("run.out_dir=\"{}\"", dir.path().join("run").display());
    let deck = tiny_deck();
    let o = mpi_env(&mut Command::new("mpirun"))
        .args(launcher)
        .args(["-n", &n.to_string(), bin(), "train", deck.to_str().unwrap(), "--set", "run.steps=1", "--set", &out])
        .output()
        .expect("mpirun runs");
    let t = text(&o);
    assert!(o.status.success(), "{launcher:?}: {t}");
    t
}

fn lines<'a>(t: &'a str, prefix: &str) -> Vec<&'a str> {
    t.lines().filter(|l| l.starts_with(prefix)).collect()
}

#[test]
fn the_automatic_thread_count_follows_the_binding() {
    let n = cpus();
    if n < 2 {
        eprintln!("one CPU: every binding gives one thread; nothing to tell apart");
        return;
    }
    let all = format!("0-{}", n - 1);
    // Bound to one core each (Open MPI's default for up to 2 ranks): one thread per rank, and
    // no division by the node's ranks on top of the binding.
    let t = placed(&["--bind-to", "core"], 2);
    let table = lines(&t, "placement: ");
    assert_eq!(table.len(), 2, "{t}");
    assert!(table[0].ends_with("rank 0: cpus 0, 1 threads, gpu none"), "{t}");
    assert!(table[1].ends_with("rank 1: cpus 1, 1 threads, gpu none"), "{t}");
    // Unbound: both ranks see every CPU and split them.
    let t = placed(&["--bind-to", "none"], 2);
    for (r, line) in lines(&t, "placement: ").iter().enumerate() {
        assert!(line.ends_with(&format!("rank {r}: cpus {all}, {} threads, gpu none", n / 2)), "{t}");
    }
    // One rank given every CPU (--cpus-per-rank, spelled as Open MPI 4 and 5 both take it).
    let t = placed(&["--map-by", &format!("slot:PE={n}")], 1);
    assert!(lines(&t, "placement: ")[0].ends_with(&format!("rank 0: cpus {all}, {n} threads, gpu none")), "{t}");
    assert!(lines(&t, "ndtrain ")[0].contains(&format!("| 1 ranks × {n} threads |")), "{t}");
    assert!(lines(&t, "warning: ").iter().all(|w| !w.contains("idle") && !w.contains("share cores")), "{t}");
    // One rank bound to one core: one thread, and a warning that the other cores sit idle.
    let t = placed(&["--bind-to", "core"], 1);
    assert!(lines(&t, "placement: ")[0].ends_with("rank 0: cpus 0, 1 threads, gpu none"), "{t}");
    let idle = lines(&t, "warning: ").into_iter().find(|w| w.contains("sit idle")).unwrap_or_else(|| panic!("an idle warning: {t}"));
    assert!(idle.contains(&format!("1 rank(s) run 1 threads where the job may use {n} CPUs: {} sit idle", n - 1)), "{idle}");
    // More ranks than CPUs: a warning that they share cores.
    let t = placed(&["--bind-to", "none", "--oversubscribe"], 2 * n);
    assert!(
        lines(&t, "warning: ").iter().any(|w| w.contains(&format!("run {} threads on {n} CPU(s) ({all}): threads share cores", 2 * n))),
        "{t}"
    );
}
