//! The GPU start-up of a training job (feature `cuda`): which GPU each rank opens
//! (`run::gpus`, gathered over the node), which collectives the job's GPUs and MPI allow
//! (`parallel::collective::choose`), and NCCL's communicators — their asynchronous errors
//! polled by the watchdog while they live, and ended cleanly when training has.

use super::peak;
use crate::backend::cuda::backend::GpuBackend;
use crate::config::{CommBackend, Resolved};
use crate::parallel::collective::cuda_aware::CudaAwareMesh;
use crate::parallel::collective::nccl::NcclMesh;
use crate::parallel::collective::{choose, Chosen, GpuFacts, StagedMesh};
use crate::parallel::comm;
use crate::parallel::mesh::Mesh;
use crate::run::gpus::{self, Assignment, RankView};
use crate::run::{placement, watchdog, Error};
use crate::say;
use crate::train::RunSummary;
use std::path::Path;

/// This rank's GPU and the job's collectives, decided on every rank before any work.
pub struct GpuPlan {
    /// The GPU this rank opens, or why it has none (a run-time failure at its start).
    assignment: Result<Assignment, String>,
    /// The collectives, or why `comm_backend` cannot be honoured (bad input).
    chosen: Result<Chosen, String>,
    /// Where the device lists came from: CUDA, or the debug option that injected them.
    source: &'static str,
}

impl GpuPlan {
    /// Gathers the GPUs every rank of the node sees — those CUDA lists, or an `injected` list
    /// (`NDTRAIN_DEBUG_GPUS`) — and decides (a collective call over the node, on every rank).
    pub fn decide(res: &Resolved, mesh: &Mesh, injected: Result<Option<Vec<crate::backend::GpuInfo>>, String>) -> GpuPlan {
        let source = if matches!(injected, Ok(Some(_))) { crate::run::faults::GPUS_ENV } else { "CUDA" };
        let visible = injected.and_then(|list| list.map_or_else(crate::backend::cuda::visible_gpus, Ok));
        let view = RankView { visible: visible.clone().unwrap_or_default(), numa_nodes: gpus::numa_nodes_of(&placement::affinity()) };
        let assignment = gpus::assign_on_node(&mesh.node, &view).and_then(|a| visible.map(|_| a));
        let chosen = match &assignment {
            Ok(a) => {
                let pool_memory = crate::backend::cuda::memory_pools(a.gpu.ordinal).unwrap_or(true);
                choose(res.deck.parallel.comm_backend, GpuFacts { shared: a.shared, cuda_aware: comm::cuda_aware(), pool_memory })
            }
            // Opening the GPU says what is missing, as a run-time failure.
            Err(_) => Ok(Chosen { backend: CommBackend::Staged, note: None }),
        };
        GpuPlan { assignment, chosen, source }
    }

    /// The console's line on whether the node's ranks share GPUs.
    pub fn sharing(&self) -> Option<String> {
        self.assignment.as_ref().ok().map(|a| gpus::sharing_line(a, self.source))
    }

    /// The bad input this rank found: `comm_backend` the GPUs or MPI do not allow.
    pub fn bad_input(&self) -> Result<(), String> {
        self.chosen.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    /// The placement table's GPU column for this rank.
    pub fn describe(&self) -> String {
        match &self.assignment {
            Ok(a) => gpus::describe(&a.gpu),
            Err(_) => "none".into(),
        }
    }
}

/// Trains on the rank's GPU with the collectives the plan chose: NCCL on the GPU's buffers,
/// CUDA-aware MPI, or staged through host memory.
pub fn train(res: &Resolved, mesh: &Mesh, out_dir: &Path, plan: &GpuPlan) -> Result<RunSummary, Error> {
    let precision = res.deck.train.precision;
    let gpu = plan.assignment.clone()?.gpu;
    let be = GpuBackend::open(gpu.ordinal, precision)?;
    let peak = peak(res, || Ok((be.gemm_probe()?, format!("measured {precision:?} GEMM probe on the GPU"))))?;
    be.set_planned_bytes(crate::tools::plan::plan(res).peak_bytes());
    let chosen = plan.chosen.clone()?;
    say!("collectives on the GPUs: {}", chosen.backend.name());
    if let Some(note) = &chosen.note {
        say!("{note}");
    }
    match chosen.backend {
        CommBackend::Nccl => {
            let nccl = NcclMesh::new(&be, mesh)?;
            // A peer that dies leaves NCCL waiting: the watchdog polls each communicator.
            let polls: Vec<watchdog::Check> = nccl
                .async_errors()
                .into_iter()
                .map(|(group, errors)| {
                    watchdog::add_check(move || errors.poll().map(|e| format!("NCCL communicator of group {group}: {e}")))
                })
                .collect();
            let summary = crate::train::train(be.clone(), nccl.collectives(), res, mesh, out_dir, peak)?;
            drop(polls);
            nccl.close(&mesh.world)?;
            Ok(summary)
        }
        CommBackend::Mpi => {
            let cuda_aware = CudaAwareMesh::new(&be, mesh);
            crate::train::train(be.clone(), cuda_aware.collectives(), res, mesh, out_dir, peak)
        }
        _ => {
            let staged = StagedMesh::new(&be, mesh);
            crate::train::train(be.clone(), staged.collectives(), res, mesh, out_dir, peak)
        }
    }
}
