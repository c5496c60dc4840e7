//! NCCL: the mesh groups' collectives on the GPU's own buffers, one communicator per group,
//! bootstrapped over the group's MPI communicator (`Gpu::nccl`).
//!
//! Every collective is enqueued on the GPU's stream, in order with the compute that produces
//! and consumes its buffers, so a "started" collective is complete for every kernel enqueued
//! after it and waiting for it costs nothing on the host. (A communication stream of its own,
//! ordered by events, would let it overlap the compute: `docs/gpu.md`.) Bytes are counted on
//! the group's MPI twin, as the host counts them, so the timing log and `ndtrain plan` agree.
//! NCCL needs one GPU per rank; `comm_backend` chooses it only then (`choose`).

use super::backend::{ok, DevBuf, GpuBackend};
use crate::backend::Backend;
use crate::config::CommBackend;
use crate::parallel::collective::{Collective, Finished, MeshCollectives};
use crate::parallel::comm::{Group, Ticket};
use crate::parallel::mesh::Mesh;
use cudarc::nccl::{Comm, ReduceOp};
use std::ops::Range;
use std::time::Instant;

/// One mesh group's collectives over NCCL.
pub struct NcclGroup<'g> {
    comm: Comm,
    /// The group's MPI communicator: its coordinates and its counters.
    group: &'g Group,
    be: GpuBackend,
    /// The enqueued collectives' buffers and the ring's received blocks.
    finished: Finished<DevBuf<f32>>,
}

/// `Err` of an NCCL call, as the run-time failure it is.
fn nccl<R, E: std::fmt::Debug>(what: &str, r: Result<R, E>) -> R {
    ok(what, r.map_err(|e| format!("{e:?}")))
}

impl<'g> NcclGroup<'g> {
    /// The communicator of `group` on `be`'s GPU (a collective call over the group).
    pub fn new(be: &GpuBackend, group: &'g Group) -> Result<Self, String> {
        let comm = be.gpu().nccl(group)?;
        Ok(NcclGroup { comm, group, be: be.clone(), finished: Finished::default() })
    }

    fn peers(&self) -> (i32, i32) {
        let (r, n) = (self.group.rank(), self.group.size());
        (((r + 1) % n) as i32, ((r + n - 1) % n) as i32)
    }
}

impl Collective<DevBuf<f32>> for NcclGroup<'_> {
    fn degree(&self) -> usize {
        self.group.size()
    }
    fn rank(&self) -> usize {
        self.group.rank()
    }
    fn all_reduce_sum(&self, buf: &mut DevBuf<f32>) {
        if !buf.is_empty() {
            let start = Instant::now();
            nccl("NCCL all-reduce", self.comm.all_reduce_in_place(buf.get_mut(), &ReduceOp::Sum));
            self.group.count("all_reduce", 4 * buf.len(), start);
        }
    }
    fn all_reduce_sum_range(&self, buf: &mut DevBuf<f32>, range: Range<usize>) {
        if !range.is_empty() {
            let (start, bytes) = (Instant::now(), 4 * range.len());
            nccl("NCCL all-reduce", self.comm.all_reduce_in_place(&mut buf.get_mut().slice_mut(range), &ReduceOp::Sum));
            self.group.count("all_reduce", bytes, start);
        }
    }
    fn all_reduce_max(&self, buf: &mut DevBuf<f32>) {
        if !buf.is_empty() {
            let start = Instant::now();
            nccl("NCCL all-reduce (max)", self.comm.all_reduce_in_place(buf.get_mut(), &ReduceOp::Max));
            self.group.count("all_reduce", 4 * buf.len(), start);
        }
    }
    fn all_gather(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) {
        assert_eq!(recv.len(), send.len() * self.degree(), "all_gather: recv must hold degree × send");
        if !send.is_empty() {
            let start = Instant::now();
            nccl("NCCL all-gather", self.comm.all_gather(send.get(), recv.get_mut()));
            self.group.count("all_gather", 4 * recv.len(), start);
        }
    }
    fn reduce_scatter_sum(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) {
        assert_eq!(send.len(), recv.len() * self.degree(), "reduce_scatter: send must hold degree × recv");
        if !recv.is_empty() {
            let start = Instant::now();
            nccl("NCCL reduce-scatter", self.comm.reduce_scatter(send.get(), recv.get_mut(), &ReduceOp::Sum));
            self.group.count("reduce_scatter", 4 * send.len(), start);
        }
    }
    fn start_all_gather(&self, send: DevBuf<f32>, mut recv: DevBuf<f32>) -> Ticket {
        self.all_gather(&send, &mut recv);
        self.finished.keep(send, recv)
    }
    fn start_reduce_scatter_sum(&self, send: DevBuf<f32>, mut recv: DevBuf<f32>) -> Ticket {
        self.reduce_scatter_sum(&send, &mut recv);
        self.finished.keep(send, recv)
    }
    fn start_all_reduce_sum(&self, send: DevBuf<f32>, mut recv: DevBuf<f32>) -> Ticket {
        if !send.is_empty() {
            let start = Instant::now();
            nccl("NCCL all-reduce", self.comm.all_reduce(send.get(), recv.get_mut(), &ReduceOp::Sum));
            self.group.count("all_reduce", 4 * send.len(), start);
        }
        self.finished.keep(send, recv)
    }
    /// Enqueued on the stream the compute runs on: complete for everything enqueued after it.
    fn test(&self, _t: &Ticket) -> bool {
        true
    }
    fn wait(&self, t: Ticket) -> (DevBuf<f32>, DevBuf<f32>) {
        self.finished.take(t)
    }
    fn start_shift(&self, slot: usize, buf: &DevBuf<f32>) {
        let mut recv = self.be.zeros(buf.len());
        if !buf.is_empty() {
            let (start, (next, prev)) = (Instant::now(), self.peers());
            let (send_view, recv_view) = (buf.get().slice(..), recv.get_mut().slice_mut(..));
            let mut g = self.comm.group();
            nccl("NCCL ring send", g.send(send_view, next));
            nccl("NCCL ring receive", g.recv(recv_view, prev));
            drop(g);
            self.group.count("ring", 4 * buf.len(), start);
        }
        self.finished.hold_shift(slot, recv);
    }
    fn finish_shift(&self, slot: usize, buf: &mut DevBuf<f32>) {
        self.be.copy(buf, &self.finished.take_shift(slot));
    }
}

/// The mesh's groups over NCCL.
pub struct NcclMesh<'g> {
    tp: NcclGroup<'g>,
    cp: NcclGroup<'g>,
    fsdp: NcclGroup<'g>,
    dp_rep: NcclGroup<'g>,
}

impl<'g> NcclMesh<'g> {
    /// One communicator per group, created in the same order on every rank.
    pub fn new(be: &GpuBackend, mesh: &'g Mesh) -> Result<Self, String> {
        Ok(NcclMesh {
            tp: NcclGroup::new(be, &mesh.tp)?,
            cp: NcclGroup::new(be, &mesh.cp)?,
            fsdp: NcclGroup::new(be, &mesh.fsdp)?,
            dp_rep: NcclGroup::new(be, &mesh.dp_rep)?,
        })
    }

    pub fn collectives(&self) -> MeshCollectives<'_, DevBuf<f32>> {
        MeshCollectives { tp: &self.tp, cp: &self.cp, fsdp: &self.fsdp, dp_rep: &self.dp_rep }
    }
}

/// The collectives a job of `ranks_on_node` ranks per node on `gpus` GPUs per node runs, with
/// an MPI that is (or is not) `cuda_aware`: `auto` is NCCL when every rank has a GPU of its
/// own, else CUDA-aware MPI where the library says it takes device buffers, else staged. NCCL
/// asked for with ranks sharing a GPU (NCCL refuses two ranks on one device), or CUDA-aware MPI
/// of an MPI that is not, is an error with a hint.
pub fn choose(asked: CommBackend, ranks_on_node: usize, gpus: usize, cuda_aware: bool) -> Result<CommBackend, String> {
    let own_gpu = ranks_on_node <= gpus;
    match asked {
        CommBackend::Auto if own_gpu => Ok(CommBackend::Nccl),
        CommBackend::Auto if cuda_aware => Ok(CommBackend::Mpi),
        CommBackend::Auto => Ok(CommBackend::Staged),
        CommBackend::Nccl if !own_gpu => Err(format!(
            "[parallel] comm_backend = \"nccl\": {ranks_on_node} ranks on this node share {gpus} GPU(s), and NCCL needs one GPU per \
             rank\nHINT: run one rank per GPU, or comm_backend = \"staged\" (any number of ranks per GPU)"
        )),
        CommBackend::Mpi if !cuda_aware => Err("[parallel] comm_backend = \"mpi\": this MPI does not say it takes device buffers \
             (MPIX_Query_cuda_support)\nHINT: comm_backend = \"nccl\" or \"staged\", or an MPI built with CUDA support"
            .into()),
        other => Ok(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_is_chosen_only_with_a_gpu_per_rank_and_mpi_only_where_it_takes_device_buffers() {
        assert_eq!(choose(CommBackend::Auto, 4, 4, false), Ok(CommBackend::Nccl));
        assert_eq!(choose(CommBackend::Auto, 8, 4, false), Ok(CommBackend::Staged));
        assert_eq!(choose(CommBackend::Auto, 8, 4, true), Ok(CommBackend::Mpi));
        assert_eq!(choose(CommBackend::Staged, 1, 8, true), Ok(CommBackend::Staged));
        let e = choose(CommBackend::Nccl, 2, 1, true).unwrap_err();
        assert!(e.contains("2 ranks on this node share 1 GPU(s)") && e.contains("HINT"), "{e}");
        let e = choose(CommBackend::Mpi, 1, 1, false).unwrap_err();
        assert!(e.contains("MPIX_Query_cuda_support") && e.contains("HINT"), "{e}");
    }
}
