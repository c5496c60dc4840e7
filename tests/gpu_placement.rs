//! Which GPU each rank takes, and whether a node's ranks share GPUs, decided on real ranks: the
//! device lists injected (`NDTRAIN_DEBUG_GPUS`, as the CPU feature check injects features), the
//! decision gathered over the node's communicator and shown by the placement table. The
//! decision's rules case by case are `run::gpus`' unit tests; this holds the gathering and the
//! table on four ranks of a real `mpirun`.

mod common;

use common::*;
use std::process::Command;

/// The placement lines of a 4-rank run of the tiny deck (one step) with `gpus` injected.
fn placement(gpus: &str) -> (String, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = mpi_env(&mut Command::new("mpirun"))
        .args(["--oversubscribe", "--bind-to", "none", "-n", "4", bin(), "train"])
        .arg(tiny_deck())
        .args(["--set", "run.steps=1", "--set", "run.threads=1", "--set"])
        .arg(format!("run.out_dir=\"{}\"", out.display()))
        .env(ndtrain::run::faults::GPUS_ENV, gpus)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let log = text(&o);
    let lines = log.lines().filter(|l| l.starts_with("placement:")).map(String::from).collect();
    (log, lines)
}

/// Two GPUs on one NUMA node for four ranks: ranks 0 and 2 take the first, 1 and 3 the second,
/// and the node's ranks share GPUs (no NCCL).
#[test]
fn four_ranks_on_two_gpus_share_them_in_node_rank_order() {
    let (log, lines) = placement("GPU-a:0,GPU-b:0");
    assert_eq!(lines.len(), 4, "{log}");
    for (rank, want) in [(0, "gpu 0 (GPU-a, 0000:10:00.0"), (1, "gpu 1 (GPU-b, 0000:11:00.0"), (2, "gpu 0 (GPU-a"), (3, "gpu 1 (GPU-b")] {
        let line = lines.iter().find(|l| l.contains(&format!(" rank {rank}: "))).unwrap_or_else(|| panic!("rank {rank}: {log}"));
        assert!(line.contains(want), "rank {rank}: {line}");
    }
    assert!(log.contains("ranks of a node share GPUs") && log.contains("not NCCL"), "{log}");
}

/// One GPU per task (each rank sees a single, different GPU as ordinal 0): every rank has its
/// own, and NCCL is possible.
#[test]
fn one_gpu_per_task_gives_every_rank_its_own() {
    let (log, lines) = placement("GPU-{node_rank}:0");
    for rank in 0..4 {
        let line = lines.iter().find(|l| l.contains(&format!(" rank {rank}: "))).unwrap_or_else(|| panic!("rank {rank}: {log}"));
        assert!(line.contains(&format!("gpu 0 (GPU-{rank},")), "{line}");
    }
    assert!(log.contains("every rank has a GPU of its own: NCCL can run the collectives"), "{log}");
}
