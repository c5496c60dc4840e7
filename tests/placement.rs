//! Where ranks' threads run, under the bindings a user meets: the automatic thread count is
//! the CPUs of the rank's affinity mask shared by the ranks with the same mask, and rank 0's
//! placement table says so (one line per rank) with a warning for idle or shared cores. And
//! several nodes on one machine: ranks grouped into pretend nodes
//! (`NDTRAIN_DEBUG_PRETEND_NODES`) get node-local ranks, GPUs and a table as across real nodes.

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

/// 4 ranks as 2 pretend nodes (`tp = 2`, `cp = 2`) with 2 GPUs injected per node: the table
/// names 2 nodes of 2 ranks with node-local ranks 0-1, hosts `<host>:node<k>` (in `run.json`
/// too), each rank the GPU of its node-local rank without sharing (on one real node the 4 ranks
/// share the 2 GPUs), a warning for the `cp` groups that span the nodes and none for `tp`,
/// which stays inside each. A count that does not divide the ranks is bad input (code 2).
#[test]
fn four_ranks_as_two_pretend_nodes_place_as_on_two_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let run = |nodes: &str| {
        mpi_env(&mut Command::new("mpirun"))
            .args(["--oversubscribe", "--bind-to", "none", "-n", "4", bin(), "train"])
            .arg(tiny_deck())
            .args(["--set", "run.steps=1", "--set", "run.threads=1", "--set", "parallel.tp=2", "--set", "parallel.cp=2", "--set"])
            .arg(format!("run.out_dir=\"{}\"", out.display()))
            .env(ndtrain::run::faults::GPUS_ENV, "GPU-a:0,GPU-b:0")
            .env(ndtrain::parallel::mesh::PRETEND_NODES_ENV, nodes)
            .output()
            .unwrap()
    };
    let o = run("2");
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let host = ndtrain::run::placement::hostname();
    let nodes = lines(&t, "nodes: ");
    let want = format!("nodes: 2, 2 ranks per node; {host}:node0: ranks 0-1 (node-local 0-1); {host}:node1: ranks 2-3 (node-local 0-1)");
    assert_eq!(nodes.first().copied(), Some(want.as_str()), "{t}");
    for (rank, gpu) in [(0, "gpu 0 (GPU-a"), (1, "gpu 1 (GPU-b"), (2, "gpu 0 (GPU-a"), (3, "gpu 1 (GPU-b")] {
        let node = rank / 2;
        let line = lines(&t, "placement: ").into_iter().find(|l| l.contains(&format!(" rank {rank}: "))).unwrap_or_else(|| panic!("{t}"));
        assert!(line.starts_with(&format!("placement: {host}:node{node} rank {rank}: ")) && line.contains(gpu), "{line}");
    }
    assert!(t.contains("every rank has a GPU of its own"), "{t}");
    let warnings = lines(&t, "warning: ");
    assert!(warnings.iter().any(|w| w.starts_with("warning: 2 of 2 cp group(s) span nodes (up to 2 nodes each)")), "{t}");
    assert!(!warnings.iter().any(|w| w.contains("tp group(s) span")), "tp stays inside a node: {t}");
    assert!(nodes.contains(&"nodes: 2 of 2 fsdp group(s) span nodes (up to 2 nodes each)"), "FSDP shards over cp: {t}");
    let record = std::fs::read_to_string(out.join("run.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&record).unwrap();
    let hosts = json["job"]["hosts"].as_object().unwrap_or_else(|| panic!("{record}"));
    assert_eq!(hosts.len(), 2, "{record}");
    assert_eq!(hosts[&format!("{host}:node1")], serde_json::json!([2, 3]), "{record}");

    let o = run("3");
    assert_eq!(o.status.code(), Some(ndtrain::exit::BAD_INPUT), "{}", text(&o));
    assert!(text(&o).contains("NDTRAIN_DEBUG_PRETEND_NODES=\"3\": 4 ranks do not split evenly into 3 node(s)"), "{}", text(&o));
}
