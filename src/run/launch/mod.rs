//! The SPMD start-up of `ndtrain train`, on every rank: MPI, the deck and the checks every rank
//! agrees on before any work (bad input ends every rank with code 2), the mesh, the rank's
//! threads and device, the collectives on the device's buffers, `run.json`, and then the
//! training loop (`train::train`). The run's outcome comes back as [`Ended`], with MPI
//! finalised; a failure only this rank may have seen ends the whole job with `MPI_Abort`
//! (`docs/reliability.md`). The GPU's part of the start-up is in `gpu` (feature `cuda`).

#[cfg(feature = "cuda")]
mod gpu;

use crate::backend::cpu::{probe, Cpu};
use crate::config::{Deck, Device, Resolved};
use crate::exit;
use crate::metrics::set_root;
use crate::parallel::collective::{MeshCollectives, StagedMesh};
use crate::parallel::comm::{self, Group, Runtime};
use crate::parallel::mesh::Mesh;
use crate::run::placement::{self, Place};
use crate::run::provenance::{self, RunRecord};
use crate::run::Error;
use crate::say;
use crate::train::{AgreedFailure, Peak, RunSummary};
use std::path::Path;

/// How a training job ended, on this rank (MPI is finalised by then).
#[derive(Debug)]
pub enum Ended {
    /// Every step ran, or the run stopped early to be continued (`summary.preempted`).
    Trained(RunSummary),
    /// Bad input found before any work (said once, by the rank that reports it).
    BadInput,
    /// A failure every rank agreed on (reported by one rank).
    Failed,
}

impl Ended {
    /// The process exit code of the outcome (`crate::exit`).
    pub fn code(&self) -> i32 {
        match self {
            Ended::Trained(s) if s.preempted => exit::PREEMPTED,
            Ended::Trained(_) => exit::OK,
            Ended::BadInput => exit::BAD_INPUT,
            Ended::Failed => exit::RUN_FAILED,
        }
    }
}

/// `ndtrain train DECK --set …` on this rank.
pub fn train(deck_path: &Path, set: &[String]) -> Ended {
    // The clock of `[run] max_walltime` starts now.
    crate::run::preempt::process_start();
    crate::backend::cpu::heap::fix_mmap_threshold();
    let rt = Runtime::init();
    let world = rt.world();
    set_root(world.rank() == 0);
    let Some((res, job_end_line)) = agreed_deck(&world, deck_path, set) else {
        return Ended::BadInput;
    };
    let mesh = Mesh::new(world, res.layout);
    // What only the job's devices can tell (NCCL needs a GPU per rank): bad input, agreed.
    let devices = Devices::decide(&res, &mesh);
    if bad_input_agreed(&mesh.world, devices.bad_input()) {
        return Ended::BadInput;
    }
    let (threads, places) = place_rank(&res, &mesh, &devices);
    let _liveness = crate::run::liveness::start(&mesh, &places, liveness_after(&res));
    // run.json: what this run is, written by rank 0 before training and rewritten with the
    // outcome at the end. A file that cannot be written is a warning.
    let mut record = RunRecord::start(&res, &places, deck_path, threads);
    let out_dir = res.deck.run.out_dir();
    let mut lines = placement::table(&places, res.deck.run.threads == 0);
    lines.extend(placement::groups_across_nodes(&places, &res.layout));
    lines.extend(devices.sharing());
    say_start(&res, &mesh, &record, (deck_path, threads), lines, job_end_line);
    write_resolved_deck(&res, &mesh, &out_dir);
    save_record(&mesh, &record, &out_dir);
    let ended = match train_on_device(&res, &mesh, &out_dir, &devices) {
        Ok(summary) => Ended::Trained(summary),
        Err(e) => match e.downcast::<AgreedFailure>() {
            // Every rank stopped at the same point: finalise together, report once.
            Ok(agreed) => {
                if let Some(m) = &agreed.message {
                    exit::report(m);
                }
                record.finish(exit::RUN_FAILED, None, Some(agreed.to_string()));
                save_record(&mesh, &record, &out_dir);
                return Ended::Failed;
            }
            Err(e) => {
                let message = format!("rank {}: {e}", mesh.world.rank());
                exit::report(&message);
                record.finish(exit::RUN_FAILED, None, Some(message));
                save_record(&mesh, &record, &out_dir);
                comm::abort(exit::RUN_FAILED)
            }
        },
    };
    if let Ended::Trained(summary) = &ended {
        record.finish(ended.code(), Some(summary.results()), None);
    }
    save_record(&mesh, &record, &out_dir);
    ended
}

/// The deck every rank resolved, the checks every rank makes before the first collective of
/// training (output folders, data, checkpoint, init_from) and, with `[run]
/// stop_before_job_end`, the job's time limit: `None` (every rank stops, code 2) when any rank
/// failed one. Each rank parses the deck itself; a rank that cannot read it (a path one node
/// does not see) must not leave the others waiting, so every verdict is agreed.
fn agreed_deck(world: &Group, deck_path: &Path, set: &[String]) -> Option<(Resolved, Option<String>)> {
    let parsed = Deck::from_file(deck_path, set).and_then(|d| d.resolve(world.size()));
    let cuda_missing = matches!(&parsed, Ok(r) if r.deck.run.device == Device::Cuda && !cfg!(feature = "cuda"));
    let verdict = match &parsed {
        Err(e) => Err(e.to_string()),
        Ok(_) if cuda_missing => Err(NO_CUDA.to_string()),
        Ok(_) => Ok(()),
    };
    let res = match (bad_input_agreed(world, verdict), parsed) {
        (false, Ok(r)) => r,
        _ => return None,
    };
    if bad_input_agreed(world, crate::run::preflight::check(&res, world.rank(), &res.deck.run.out_dir())) {
        return None;
    }
    // Every rank gets rank 0's answer, so all take the same branch.
    match res.deck.run.stop_before_job_end.then(|| crate::run::stop::agree_job_end(world)).transpose() {
        Ok(line) => Some((res, line)),
        Err(e) => {
            bad_input_agreed(world, Err(e));
            None
        }
    }
}

const NO_CUDA: &str = "[run] device = \"cuda\", but this ndtrain was built without the `cuda` feature: \
                       rebuild with `cargo build --release --features cuda`";

/// The console at start: the program, the build, the ranks and threads, the record's banner,
/// the placement table, the resolved layout's summary, and the job's time limit.
fn say_start(
    res: &Resolved,
    mesh: &Mesh,
    record: &RunRecord,
    (deck_path, threads): (&Path, usize),
    places: Vec<String>,
    job_end: Option<String>,
) {
    say!(
        "ndtrain {} ({}) | {} ranks × {threads} threads | deck {}",
        env!("CARGO_PKG_VERSION"),
        crate::backend::cpu::features::build_target(),
        mesh.world.size(),
        deck_path.display()
    );
    say!("{}", record.banner());
    for line in places.iter().chain(&res.summary).chain(&job_end) {
        say!("{line}");
    }
}

/// `<out_dir>/deck.toml`, written by rank 0 (and echoed on the console): the deck as resolved
/// for this world, with the layout in its first line. A folder rank 0 cannot write to ends the
/// job.
fn write_resolved_deck(res: &Resolved, mesh: &Mesh, out_dir: &Path) {
    let l = &res.layout;
    let text = format!(
        "# Resolved by ndtrain {} for {} ranks: layout pp={} dp_replicate={} dp_shard={} cp={} tp={}, grad_accum={}, global_batch={}, peak lr={:e}\n{}",
        env!("CARGO_PKG_VERSION"),
        mesh.world.size(),
        l.pp,
        l.dp_replicate,
        l.dp_shard,
        l.cp,
        l.tp,
        res.grad_accum,
        res.global_batch,
        res.lr,
        res.deck.to_toml()
    );
    say!("--- resolved deck ---\n{}---", text);
    if mesh.world.rank() == 0 {
        if let Err(e) = std::fs::create_dir_all(out_dir).and_then(|_| std::fs::write(out_dir.join("deck.toml"), &text)) {
            exit::report(&format!("rank 0: cannot write to {}: {e}", out_dir.display()));
            comm::abort(exit::RUN_FAILED);
        }
    }
    mesh.world.barrier();
}

/// Rank 0 writes `run.json`; a file that cannot be written is a warning.
fn save_record(mesh: &Mesh, record: &RunRecord, out_dir: &Path) {
    if mesh.world.rank() == 0 {
        if let Err(e) = record.write(out_dir) {
            eprintln!("warning: rank 0: cannot write {}: {e}", out_dir.join(provenance::FILE).display());
        }
    }
}

/// Bad input each rank found on its own, agreed by the world: true when any rank failed (then
/// every rank exits with code 2). Each reason is said once: when every rank failed with the
/// same text only rank 0 prints it; otherwise each failing rank prints its own, prefixed with
/// its rank (a file one node cannot see). Every rank takes part, so none is left waiting.
fn bad_input_agreed(world: &Group, verdict: Result<(), String>) -> bool {
    use std::hash::{Hash, Hasher};
    let failed = world.count_true(verdict.is_err());
    if failed == 0 {
        return false;
    }
    // `DefaultHasher::new()` has fixed keys: the same text hashes alike on every rank.
    let hash = verdict.as_ref().err().map_or(0, |e| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        e.hash(&mut h);
        h.finish()
    });
    let mut extremes = [hash, u64::MAX - hash];
    world.agree_max_u64(&mut extremes);
    let agreed = failed == world.size() && extremes[0] == u64::MAX - extremes[1];
    if let Err(e) = verdict {
        if !agreed {
            exit::report(&format!("rank {}: {e}", world.rank()));
        } else if world.rank() == 0 {
            exit::report(&e);
        }
    }
    true
}

/// Starts this rank's threads on the CPUs of its affinity mask (shared with the node's ranks
/// that have the same mask); returns their number and every rank's place.
fn place_rank(res: &Resolved, mesh: &Mesh, devices: &Devices) -> (usize, Vec<Place>) {
    let cpus = placement::affinity();
    let threads = placement::threads_on_node(&mesh.node, res.deck.run.threads, &cpus);
    crate::backend::cpu::use_threads(threads);
    let mine = Place {
        host: placement::hostname(),
        rank: mesh.world.rank(),
        cpus,
        threads,
        gpu: devices.describe(),
        node_cpus: placement::node_cpus(),
    };
    (threads, placement::gather(&mesh.world, &mine))
}

/// How long a rank waits in a collective before it probes its peers: `[run]
/// liveness_seconds`, and zero (off) where the watchdog that runs the probe is off.
fn liveness_after(res: &Resolved) -> std::time::Duration {
    let run = &res.deck.run;
    if run.watchdog_seconds > 0.0 {
        std::time::Duration::from_secs_f64(run.liveness_seconds)
    } else {
        std::time::Duration::ZERO
    }
}

/// What the deck's `[run] device` needs decided on every rank before training: on GPUs, each
/// rank's GPU and the job's collectives (`gpu`). With a device list injected
/// (`NDTRAIN_DEBUG_GPUS`) the GPU assignment runs on any build and any device, for the
/// placement table to show it.
struct Devices {
    #[cfg(feature = "cuda")]
    gpu: Option<gpu::GpuPlan>,
    /// The GPU assignment of an injected device list, where the job does not train on GPUs.
    injected: Option<Result<crate::run::gpus::Assignment, String>>,
}

impl Devices {
    /// A collective call over each node where the deck trains on GPUs or a list is injected.
    fn decide(res: &Resolved, mesh: &Mesh) -> Devices {
        let injected = crate::run::faults::injected_gpus(mesh.node.rank());
        #[cfg(feature = "cuda")]
        if res.deck.run.device == Device::Cuda {
            return Devices { gpu: Some(gpu::GpuPlan::decide(res, mesh, injected)), injected: None };
        }
        let _ = res;
        let injected = injected.transpose().map(|list| {
            let view = crate::run::gpus::RankView { visible: list?, numa_nodes: crate::run::gpus::numa_nodes_of(&placement::affinity()) };
            crate::run::gpus::assign_on_node(&mesh.node, &view)
        });
        Devices {
            #[cfg(feature = "cuda")]
            gpu: None,
            injected,
        }
    }

    /// The bad input only the job's devices can tell (`comm_backend` they do not allow, an
    /// injected list that does not parse).
    fn bad_input(&self) -> Result<(), String> {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            return g.bad_input();
        }
        self.injected.as_ref().map_or(Ok(()), |a| a.as_ref().map(|_| ()).map_err(Clone::clone))
    }

    /// The placement table's GPU column.
    fn describe(&self) -> String {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            return g.describe();
        }
        match &self.injected {
            Some(Ok(a)) => crate::run::gpus::describe(&a.gpu),
            _ => "none".into(),
        }
    }

    /// A console line on whether the node's ranks share GPUs, where that was decided.
    fn sharing(&self) -> Option<String> {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            return g.sharing();
        }
        match &self.injected {
            Some(Ok(a)) => Some(crate::run::gpus::sharing_line(a, crate::run::faults::GPUS_ENV)),
            _ => None,
        }
    }
}

/// The rate MFU is stated against: the deck's `[hardware] peak_flops_per_rank`, else `probe`.
fn peak(res: &Resolved, probe: impl FnOnce() -> Result<(f64, String), Error>) -> Result<Peak, Error> {
    let stated = res.deck.hardware.peak_flops_per_rank;
    if stated > 0.0 {
        return Ok(Peak { flops: stated, source: "[hardware] peak_flops_per_rank".into() });
    }
    let (flops, source) = probe()?;
    Ok(Peak { flops, source })
}

/// Trains on the deck's `[run] device`: the host (MPI collectives on host memory), or the
/// rank's GPU. Under the debug option `NDTRAIN_DEBUG_DEVICE_PATH` the host runs the device's
/// path: its buffers treated as device memory, the collectives staged through host copies.
fn train_on_device(res: &Resolved, mesh: &Mesh, out_dir: &Path, devices: &Devices) -> Result<RunSummary, Error> {
    let precision = res.deck.train.precision;
    match res.deck.run.device {
        Device::Cpu => {
            let peak = peak(res, || Ok((probe::gemm_flops(), "measured f32 GEMM probe".into())))?;
            if crate::run::faults::device_path() {
                let be = Cpu { precision, staged: true };
                let staged = StagedMesh::new(&be, mesh);
                return crate::train::train(be, staged.collectives(), res, mesh, out_dir, peak);
            }
            crate::train::train(Cpu { precision, staged: false }, MeshCollectives::host(mesh), res, mesh, out_dir, peak)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda => gpu::train(res, mesh, out_dir, devices.gpu.as_ref().expect("decided for a GPU deck")),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => {
            let _ = devices;
            Err(NO_CUDA.into())
        }
    }
}
