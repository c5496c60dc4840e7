//! Across hosts: every `mpirun` of this file launches on the emulated cluster of
//! `jobscripts/local/cluster-local.sh` — two hosts `cn1` and `cn2`, each a network namespace with
//! its own hostname, address, `/tmp` and `/dev/shm`, on a bridge, two slots each — so ranks 0-1
//! run on `cn1` and ranks 2-3 on `cn2`, and what crosses between them goes over TCP.
//!
//! Each parallel layout reproduces one rank with its groups across the node boundary; the
//! placement names the 2 nodes and the groups that span them; ranks on different hosts share no
//! memory (a job that may use only shared memory cannot start) and speak TCP; a checkpoint
//! written on 2 hosts resumes on one rank and the reverse; a node lost mid-run (its processes
//! killed, or its link cut) ends every surviving rank within 60 s with one line naming the lost
//! host, the last checkpoint stays intact, and the job resumes on the host that remains with
//! fewer ranks and continues the one-rank curve. On the cluster's Slurm, `sbatch --nodes=2`
//! trains, checkpoints, requeues itself and resumes, and a study over 1 and 2 nodes runs
//! through the queue; `ndtrain probe` measures the network between the hosts.
//!
//! Needs root (namespaces, a bridge). The tests take turns on the one cluster, which is started
//! once and stopped when the test binary exits.

mod common;
use common::*;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

fn cluster_local() -> PathBuf {
    repo().join("jobscripts/local/cluster-local.sh")
}

fn cluster_cmd(args: &[&str]) -> Output {
    Command::new("bash").arg(cluster_local()).args(args).output().expect("cluster-local.sh runs")
}

extern "C" fn stop_cluster() {
    let _ = cluster_cmd(&["stop"]);
}

/// The `KEY=VALUE` pairs of `cluster-local.sh env`'s `export` lines.
fn cluster_env() -> Vec<(String, String)> {
    let o = cluster_cmd(&["env"]);
    assert!(o.status.success(), "cluster-local.sh env: {}", text(&o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("export "))
        .flat_map(|l| l.split_whitespace().filter_map(|w| w.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())))
        .collect()
}

static TURN: Mutex<()> = Mutex::new(());

/// The cluster, whole (both hosts up, their links up), for this test alone while the guard
/// lives. The first call starts it; it is stopped when the test binary exits.
fn cluster() -> MutexGuard<'static, ()> {
    static STARTED: OnceLock<Result<(), String>> = OnceLock::new();
    let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let started = STARTED.get_or_init(|| {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("tests/multinode.rs needs root: cluster-local.sh makes network namespaces and a bridge".into());
        }
        let o = cluster_cmd(&["start", "2"]);
        // SAFETY: `stop_cluster` is a plain function that runs a command; it is registered once.
        unsafe { libc::atexit(stop_cluster) };
        if !o.status.success() {
            return Err(format!("cluster-local.sh start 2: {}", text(&o)));
        }
        let hostfile = PathBuf::from(String::from_utf8_lossy(&cluster_cmd(&["hostfile"]).stdout).trim());
        // mpirun runs on cn1, as on the first node of a batch job.
        let on_cn1 = ["bash", cluster_local().to_str().unwrap(), "run", "cn1"].map(String::from).to_vec();
        launch_on_cluster(on_cn1, hostfile, cluster_env());
        Ok(())
    });
    if let Err(e) = started {
        panic!("{e}");
    }
    // A test before this one may have cut cn2's link or killed its daemons: `start` brings
    // every link up and every daemon back.
    let o = cluster_cmd(&["start", "2"]);
    assert!(o.status.success(), "cluster-local.sh start 2: {}", text(&o));
    turn
}

/// A fresh folder for `name` on the file system every host shares (each host's `/tmp` is its
/// own).
fn out_dir(name: &str) -> PathBuf {
    let d = repo().join("target/multinode").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// What rank 0 printed (stdout and stderr).
fn console(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn every_layout_across_two_hosts_matches_one_rank() {
    let _c = cluster();
    let d = out_dir("layouts");
    // A checkpoint after the last step too: a pipeline cannot export the model from one rank.
    let sets = [EQUIV_SETS, &["checkpoint.every=10"]].concat();
    let base = run_layout_with(&d, "one", 1, &sets, &[]);
    let layouts: &[(&str, usize, &[&str])] = &[
        ("FSDP=4", 4, &["parallel.dp_shard=4"]),
        ("HSDP=2x2", 4, &["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
        ("TP=2 within x DP=2 across", 4, &["parallel.dp_shard=2", "parallel.tp=2"]),
        ("CP=2 x TP=2", 4, &["parallel.cp=2", "parallel.tp=2"]),
    ];
    assert_layouts_match_with(&d, &sets, &base, layouts);
    // The two stages on different hosts: the activations and their gradients cross by TCP.
    let pp = [sets.as_slice(), &["parallel.pp=2", "parallel.dp_shard=2"]].concat();
    let (_, losses) = train_losses(&d, "pp2_across", &tiny_deck(), Some(4), &pp);
    assert_losses_within("PP=2 across", &base.0, &losses, LOSS_TOL);
    assert_close("PP=2 across", &ckpt(&d, "one", 10), &ckpt(&d, "pp2_across", 10));

    // Experts: ep 2 across the hosts (cut from dp_shard 2, whose groups span them), tp 2
    // within each.
    let moe = repo().join("inputs/moe_tiny.toml");
    let sets = ["run.steps=8", "run.threads=1", "optim.grad_clip=0.3", "optim.warmup_steps=2"];
    let one = run_deck_layout(&moe, &d, "moe_one", 1, &sets, &[]);
    let ep = ["parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"];
    let across = run_deck_layout(&moe, &d, "moe_ep2_across", 4, &sets, &ep);
    assert_equivalent("EP=2 across x TP=2 within (moe_tiny)", &one, &across);
}

/// The placement table of a 4-rank job: 2 nodes of 2 ranks, and which groups span them.
fn placement(layout: &[&str]) -> String {
    let d = out_dir("placement");
    let mut sets = vec!["run.steps=1"];
    sets.extend_from_slice(layout);
    let (o, timed_out) = output_within(&mut mpirun_tiny(4, &d, &sets), 120);
    assert!(!timed_out && o.status.success(), "{layout:?}: {}", text(&o));
    console(&o)
}

#[test]
fn the_placement_names_both_nodes_and_the_groups_that_span_them() {
    let _c = cluster();
    let nodes = "nodes: 2, 2 ranks per node; cn1: ranks 0-1 (node-local 0-1); cn2: ranks 2-3 (node-local 0-1)";
    let hsdp = placement(&["parallel.dp_replicate=2", "parallel.dp_shard=2"]);
    assert!(hsdp.contains(nodes), "{hsdp}");
    // The replicate axis is the outer one: it crosses the hosts, each shard group stays on one.
    assert!(hsdp.contains("nodes: 2 of 2 dp_replicate group(s) span nodes (up to 2 nodes each)"), "{hsdp}");
    assert!(!hsdp.contains("fsdp group(s) span nodes"), "{hsdp}");

    let tp_across = placement(&["parallel.tp=4"]);
    assert!(tp_across.contains(nodes), "{tp_across}");
    assert!(tp_across.contains("warning: 1 of 1 tp group(s) span nodes (up to 2 nodes each)"), "{tp_across}");

    let tp_within = placement(&["parallel.dp_shard=2", "parallel.tp=2"]);
    assert!(tp_within.contains("nodes: 2 of 2 fsdp group(s) span nodes"), "{tp_within}");
    assert!(!tp_within.contains("tp group(s) span nodes"), "{tp_within}");
}

/// Ranks on different hosts share no memory: with Open MPI's transports limited to shared
/// memory (`vader`) and self, the job cannot start across them, while on one host it runs; with
/// the defaults the ranks of different hosts reach each other through `tcp` and those of one
/// host through `vader`.
#[test]
fn ranks_on_different_hosts_share_no_memory_and_speak_tcp() {
    let _c = cluster();
    let d = out_dir("transport");
    let shm_only = |n: usize| {
        let mut cmd = mpirun_tiny(n, &d, &["run.steps=1"]);
        cmd.env("OMPI_MCA_btl", "self,vader");
        output_within(&mut cmd, 120)
    };
    let (o, timed_out) = shm_only(4);
    assert!(!timed_out, "{}", text(&o));
    assert!(!o.status.success(), "shared memory alone must not connect cn1 and cn2: {}", text(&o));
    assert!(console(&o).contains("unable to reach each other"), "{}", text(&o));
    let (o, _) = shm_only(2);
    assert!(o.status.success(), "ranks 0-1 share cn1: {}", text(&o));

    let mut cmd = mpirun_tiny(4, &d, &["run.steps=1"]);
    cmd.env("OMPI_MCA_btl_base_verbose", "100");
    let (o, timed_out) = output_within(&mut cmd, 120);
    assert!(!timed_out && o.status.success(), "{}", text(&o));
    // `[cnA:pid] mca: bml: Using X btl for send to [[job,1],R] on node cnB`: what each rank
    // speaks to each other one.
    let mut seen = std::collections::BTreeSet::new();
    for line in console(&o).lines() {
        let Some((from, rest)) = line.strip_prefix('[').and_then(|l| l.split_once(':')) else { continue };
        let Some(rest) = rest.split_once("mca: bml: Using ").map(|(_, r)| r) else { continue };
        let (btl, to) = (rest.split(' ').next().unwrap(), rest.rsplit(' ').next().unwrap());
        seen.insert((from.to_string(), to.to_string(), btl.to_string()));
    }
    let transports =
        |from: &str, to: &str| -> Vec<&str> { seen.iter().filter(|(f, t, _)| f == from && t == to).map(|(_, _, b)| b.as_str()).collect() };
    assert_eq!(transports("cn1", "cn2"), ["tcp"], "cn1 to cn2: {seen:?}");
    assert_eq!(transports("cn2", "cn1"), ["tcp"], "cn2 to cn1: {seen:?}");
    // Within a host: shared memory to the other rank, `self` to itself.
    assert_eq!(transports("cn1", "cn1"), ["self", "vader"], "within cn1: {seen:?}");
}

/// `ndtrain ckpt verify FILE` succeeds.
fn verify(file: &std::path::Path) {
    let o = run_single(&["ckpt", "verify", file.to_str().unwrap()]);
    assert!(o.status.success(), "ckpt verify {}: {}", file.display(), text(&o));
}

#[test]
fn a_checkpoint_written_on_two_hosts_resumes_on_one_rank_and_the_reverse() {
    let _c = cluster();
    let d = out_dir("checkpoint");
    let sets = ["run.steps=10", "run.threads=1", "checkpoint.every=5"];
    let (_, straight) = train_losses(&d, "straight", &tiny_deck(), Some(1), &sets);
    let resume = |from: &std::path::Path| format!("checkpoint.resume=\"{}\"", from.display());
    for (name, writer, reader, layout) in [("two_to_one", 4, 1, "parallel.dp_replicate=2"), ("one_to_two", 1, 4, "parallel.dp_replicate=1")]
    {
        let w = format!("{name}_writer");
        let mut first: Vec<&str> = sets.to_vec();
        first.extend(["run.stop_after_steps=5", layout]);
        let mut cmd = mpirun_tiny(writer, &d.join(&w), &first);
        let (o, _) = output_within(&mut cmd, 300);
        assert_eq!(o.status.code(), Some(75), "{name}: a stop after 5 steps exits 75: {}", text(&o));
        let file = ckpt(&d, &w, 5);
        verify(&file);
        let r = resume(&file);
        let mut second: Vec<&str> = sets.to_vec();
        second.push(&r);
        let (_, resumed) = train_losses(&d, &format!("{name}_reader"), &tiny_deck(), Some(reader), &second);
        assert_losses_within(name, &straight[5..], &resumed, LOSS_TOL);
    }
}

/// The processes of this machine (every host's) running the ndtrain binary.
fn ranks_running() -> Vec<i32> {
    let exe = std::fs::canonicalize(bin()).unwrap();
    let pids = std::fs::read_dir("/proc").unwrap().flatten().filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok());
    pids.filter(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe)).collect()
}

/// How a node is lost in [`a_lost_node`].
#[derive(Clone, Copy)]
enum Loss {
    /// Every process on cn2 is killed (SIGKILL), as when the node crashes and its host answers
    /// no more (here the host stays up: its network answers and refuses).
    Killed,
    /// cn2's link goes down: its processes live, but nothing reaches them.
    LinkDown,
}

/// 4 ranks train FSDP (`dp_shard = -1`) with a checkpoint every 4 steps; after the checkpoint of
/// step 8 cn2 is lost. Every rank ends within 60 s, non-zero, rank 0 or 1 naming cn2; the last
/// checkpoint verifies; the same deck resumes from it on cn1's 2 ranks (`dp_shard = -1` makes
/// it FSDP 2) and the losses continue the one-rank run of 24 steps.
fn a_lost_node(name: &str, loss: Loss, expect: &str) {
    let d = out_dir(name);
    let sets = ["run.steps=24", "run.threads=1", "checkpoint.every=4", "run.liveness_seconds=3", "parallel.dp_shard=-1"];
    let (_, straight) = train_losses(&d, "straight", &tiny_deck(), Some(1), &sets);

    let out = d.join("lost");
    let mut cmd = mpirun_tiny(4, &out, &sets);
    // The launch agent passes mpirun's environment on to every host (ssh would need `-x`).
    cmd.env(ndtrain::run::faults::STEP_DELAY_ENV, "300");
    use std::process::Stdio;
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("mpirun starts");
    let latest = out.join("ckpt/latest");
    let begin = Instant::now();
    while std::fs::read_to_string(&latest).map(|s| s.trim() < "step_00000008.h5").unwrap_or(true) {
        assert!(child.try_wait().unwrap().is_none(), "the job ended before step 8");
        assert!(begin.elapsed() < Duration::from_secs(300), "no checkpoint of step 8 within 300 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = match loss {
        Loss::Killed => cluster_cmd(&["kill", "cn2"]),
        Loss::LinkDown => cluster_cmd(&["link", "cn2", "down"]),
    };
    assert!(o.status.success(), "{}", text(&o));
    let lost_at = Instant::now();
    while child.try_wait().unwrap().is_none() && lost_at.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = lost_at.elapsed();
    let _ = child.kill();
    let o = child.wait_with_output().unwrap();
    let log = console(&o);
    eprintln!("{name}: the job ended {took:?} after the loss:\n{log}");
    assert!(took < Duration::from_secs(60), "{name}: the surviving ranks took {took:?} to end\n{log}");
    assert!(!o.status.success(), "{name}: {log}");
    assert!(log.contains(expect), "{name}: no line naming the lost node ({expect:?}):\n{log}");
    // The ranks on cn2, which mpirun may no longer reach, end too.
    while !ranks_running().is_empty() {
        assert!(lost_at.elapsed() < Duration::from_secs(60), "{name}: ranks {:?} still run 60 s after the loss", ranks_running());
        std::thread::sleep(Duration::from_millis(100));
    }
    let file = out.join("ckpt").join(std::fs::read_to_string(&latest).unwrap().trim());
    verify(&file);
    let at: usize = file.file_stem().unwrap().to_string_lossy()["step_".len()..].parse().unwrap();
    assert!(at >= 8, "{name}: latest is {}", file.display());
    // The same deck on the host that remains (cn2 still lost): `dp_shard = -1` makes it FSDP 2.
    let mut cmd = mpirun(2);
    cmd.args(["--host", "cn1:2", bin(), "train"]).arg(tiny_deck());
    cmd.arg("--set").arg(format!("run.out_dir=\"{}\"", d.join("resumed").display()));
    cmd.arg("--set").arg(format!("checkpoint.resume=\"{}\"", file.display()));
    for s in sets {
        cmd.args(["--set", s]);
    }
    let (o, timed_out) = output_within(&mut cmd, 300);
    assert!(!timed_out && o.status.success(), "{name}: the resume on cn1: {}", text(&o));
    let log = console(&o);
    assert!(log.contains("nodes: 1, 2 ranks per node; cn1: ranks 0-1"), "{log}");
    let (_, resumed) = losses(&d.join("resumed"));
    assert_losses_within(&format!("{name}: resumed on cn1"), &straight[at..], &resumed, LOSS_TOL);
}

#[test]
fn a_node_whose_processes_are_killed_ends_the_job_and_the_rest_resume() {
    let _c = cluster();
    a_lost_node("node_killed", Loss::Killed, "on host cn2 (cn2 answers, but the processes are gone)");
}

#[test]
fn a_node_whose_link_goes_down_ends_the_job_and_the_rest_resume() {
    let _c = cluster();
    a_lost_node("link_down", Loss::LinkDown, "lost ranks 2, 3 on host cn2 (cn2 does not answer on the network");
}

/// `jobscripts/slurm/train.sbatch` on the 2-host Slurm: `sbatch --nodes=2 --ntasks-per-node=2`
/// trains HSDP 2 × 2 under `srun`, the replicate axis across the nodes; stopped after 4 of its 8
/// steps it checkpoints and exits 75, the script requeues the job, and the requeued job (on 2
/// nodes again) resumes from the checkpoint and finishes, the losses those of one rank.
#[test]
fn a_slurm_job_on_two_nodes_trains_checkpoints_requeues_and_resumes() {
    let _c = cluster();
    let d = out_dir("slurm");
    let env = cluster_env();
    let (_, straight) = train_losses(&d, "straight", &tiny_deck(), Some(1), &["run.steps=8", "run.threads=1"]);
    let run = d.join("run");
    let common = format!("run.threads=1 parallel.dp_replicate=2 checkpoint.every=4 run.out_dir=\"{}\"", run.display());
    let two_nodes = ["--nodes=2", "--ntasks-per-node=2"];
    let (rc, log) = sbatch(&env, &d, "first", &format!("run.steps=8 run.stop_after_steps=4 {common}"), &two_nodes);
    assert_eq!(rc, 0, "the script requeues a run stopped after its steps or ends it cleanly: {log}");
    assert!(log.contains("nodes: 2, 2 ranks per node; cn1: ranks 0-1 (node-local 0-1); cn2: ranks 2-3 (node-local 0-1)"), "{log}");
    assert!(log.contains("nodes: 2 of 2 dp_replicate group(s) span nodes"), "{log}");
    assert!(log.contains("+ scontrol requeue "), "{log}");
    assert!(log.contains("resumed from") && log.contains("step_00000004.h5"), "{log}");
    assert!(run.join("ckpt/step_00000008.h5").exists(), "{log}");
    let (_, l) = losses(&run);
    assert_losses_within("slurm, 2 nodes", &straight, &l, LOSS_TOL);
}

/// A strong-scaling study over 1 and 2 nodes (2 and 4 ranks, 2 per node), submitted to the
/// 2-host Slurm by `ndtrain sweep submit`: each point's job gets its node count, both run, and
/// the report job after them writes the study's report.
#[test]
fn a_study_over_one_and_two_nodes_runs_through_the_queue() {
    let _c = cluster();
    let d = out_dir("study");
    let env = cluster_env();
    let study = d.join("nodes.toml");
    let deck = tiny_deck();
    std::fs::write(
        &study,
        format!(
            "[study]\nname = \"nodes\"\nbase = \"{}\"\nscaling = \"strong\"\nlauncher = \"slurm\"\nranks_per_node = 2\nranks = [2, 4]\nrepeats = 1\nwalltime = \"00:10:00\"\n[set]\n\"run.steps\" = 3\n\"run.threads\" = 1\n\"optim.warmup_steps\" = 1\n",
            deck.display()
        ),
    )
    .unwrap();
    let out = d.join("out");
    sweep_submit(&env, &study, &out);
    let report_log = out.join("report.out");
    let begin = Instant::now();
    loop {
        let status = String::from_utf8_lossy(&sweep(&env, &["status", out.to_str().unwrap()]).stdout).to_string();
        let reported = std::fs::read_to_string(&report_log).is_ok_and(|l| l.contains("report --study"));
        if reported && !status.contains("queued") && !status.contains("running") {
            assert_eq!(status.lines().filter(|l| l.ends_with(" done")).count(), 2, "{status}");
            break;
        }
        assert!(begin.elapsed() < Duration::from_secs(300), "the study did not end within 300 s: {status}");
        std::thread::sleep(Duration::from_millis(500));
    }
    for (label, nodes) in [("ranks_2", 1), ("ranks_4", 2)] {
        let log = std::fs::read_to_string(out.join(format!("runs/{label}/run.json"))).unwrap_or_default();
        let hosts = ["cn1", "cn2"].iter().filter(|h| log.contains(&format!("\"{h}\""))).count();
        assert_eq!(hosts, nodes, "{label}: ranks on {nodes} node(s): {log}");
    }
    assert!(out.join("report/study.md").exists(), "{}", std::fs::read_to_string(&report_log).unwrap_or_default());
}

/// `ndtrain probe --deck` on 2 hosts × 2 ranks with the hosts' links shaped to 1 Gbit/s: it
/// finds 2 nodes in MPI's node communicator, measures the collectives between them and writes
/// `inter_node_bandwidth` (the all-gather's), the all-reduce's and the reduce-scatter's and
/// `inter_node_latency`; each bandwidth is at most the link's; and the share of a
/// non-blocking all-gather across the hosts that moves while the ranks compute.
#[test]
fn the_probe_measures_the_network_between_nodes() {
    let _c = cluster();
    let shape = cluster_cmd(&["shape", "--rate", "1gbit"]);
    assert!(shape.status.success(), "{}", text(&shape));
    let deck = tiny_deck();
    let (o, timed_out) = output_within(mpirun(4).args([bin(), "probe", "--deck", deck.to_str().unwrap(), "--set", "run.threads=1"]), 600);
    let unshape = cluster_cmd(&["shape"]);
    assert!(unshape.status.success(), "{}", text(&unshape));
    assert!(!timed_out && o.status.success(), "{}", text(&o));
    let report = console(&o);
    assert!(report.contains("on 2 node(s) (MPI's shared-memory node communicator has 2 group(s)) of 2 rank(s)"), "{report}");
    let key = |name: &str| -> f64 {
        let line = report.lines().find(|l| l.starts_with(&format!("{name} = "))).unwrap_or_else(|| panic!("no {name}: {report}"));
        line.split(" = ").nth(1).unwrap().trim().parse().unwrap()
    };
    // 1 Gbit/s is 1.25e8 bytes/s, shared by the node's 2 ranks; 10 % for the shaper's burst.
    for name in [
        "inter_node_bandwidth",
        "inter_node_all_reduce_bandwidth",
        "inter_node_reduce_scatter_bandwidth",
        "inter_node_blocking_all_reduce_bandwidth",
    ] {
        let bandwidth = key(name);
        assert!(bandwidth > 0.0 && bandwidth <= 1.1 * 1.25e8, "{name} = {bandwidth:e}: {report}");
    }
    // Over every rank (2 per node) part of a collective stays inside the node, but each node
    // must still take in the other node's half: 2 shards of an all-gather or reduce-scatter
    // charged as 3 (`(n − 1)/n × 4` shards), one buffer of an all-reduce charged as 1.5 (it
    // can sum inside the node first). So the rate stays under 1.5 times the link's.
    for name in ["inter_node_packed_bandwidth", "inter_node_packed_all_reduce_bandwidth", "inter_node_packed_reduce_scatter_bandwidth"] {
        let bandwidth = key(name);
        assert!(bandwidth > 0.0 && bandwidth <= 1.5 * 1.1 * 1.25e8, "{name} = {bandwidth:e}: {report}");
    }
    let latency = key("inter_node_latency");
    assert!(latency > 0.0 && latency.is_finite(), "inter_node_latency = {latency:e}: {report}");
    assert!(key("intra_node_bandwidth") > 0.0, "{report}");
    let share = key("overlap_efficiency");
    assert!((0.0..=1.0).contains(&share), "overlap_efficiency = {share}: {report}");
    assert!(report.contains("% of it moved while computing"), "{report}");
}
