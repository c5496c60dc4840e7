//! CUDA-aware MPI: the mesh groups' collectives with the GPU's buffers handed to MPI itself,
//! where the library says it supports them (`parallel::comm::cuda_aware`). MPI does not order
//! its transfers against the GPU's stream, so each collective waits for the device first; each
//! is blocking (a "started" one has completed when it returns). A group of one copies. Bytes
//! are counted by the group as on the host. A failed device call is recorded on the backend,
//! which reports it when the step synchronises.

use super::{Collective, Finished, MeshCollectives, Staged};
use crate::backend::cuda::backend::{DevBuf, GpuBackend};
use crate::backend::Backend;
use crate::parallel::comm::{Group, RawCollective, Ticket};
use crate::parallel::mesh::Mesh;
use std::ops::Range;

/// One mesh group's collectives over a CUDA-aware MPI.
pub struct CudaAwareGroup<'g> {
    group: &'g Group,
    be: GpuBackend,
    /// The finished collectives' buffers and the ring's received blocks.
    finished: Finished<DevBuf<f32>>,
}

impl<'g> CudaAwareGroup<'g> {
    pub fn new(be: &GpuBackend, group: &'g Group) -> Self {
        CudaAwareGroup { group, be: be.clone(), finished: Finished::default() }
    }

    /// `op` from the elements `from` of `send` into `recv`, `count` elements as
    /// [`Group::raw_collective`] counts them.
    fn run(&self, op: RawCollective, send: &DevBuf<f32>, from: Range<usize>, recv: &mut DevBuf<f32>, count: usize) {
        if from.is_empty() {
            return;
        }
        let group = self.group;
        self.be.run("CUDA-aware MPI collective", || {
            // SAFETY: both addresses are device allocations of this rank's GPU, sized for the
            // collective by the callers below (the shapes `Collective` documents), distinct
            // buffers; the device has finished writing `send`, and the MPI library said it
            // accepts device memory. The collective is done with them when it returns.
            unsafe { self.be.with_device_addresses(send, from, recv, |s, r| group.raw_collective(op, s, r, count)) }
        });
    }

    /// A device copy of `buf` (MPI has no portable in-place reduction here).
    fn copy_of(&self, buf: &DevBuf<f32>) -> DevBuf<f32> {
        let mut c = self.be.zeros(buf.len());
        self.be.copy(&mut c, buf);
        c
    }
}

impl Collective<DevBuf<f32>> for CudaAwareGroup<'_> {
    fn degree(&self) -> usize {
        self.group.size()
    }
    fn rank(&self) -> usize {
        self.group.rank()
    }
    fn all_reduce_sum(&self, buf: &mut DevBuf<f32>) {
        if self.degree() > 1 {
            let send = self.copy_of(buf);
            self.run(RawCollective::AllReduceSum, &send, 0..send.len(), buf, send.len());
        }
    }
    fn all_reduce_sum_range(&self, buf: &mut DevBuf<f32>, range: Range<usize>) {
        if self.degree() > 1 && !range.is_empty() {
            let send = self.copy_of(buf);
            let mut sum = self.be.zeros(range.len());
            self.run(RawCollective::AllReduceSum, &send, range.clone(), &mut sum, range.len());
            self.be.copy_range(buf, range.start, &sum, 0..range.len());
        }
    }
    fn all_reduce_max(&self, buf: &mut DevBuf<f32>) {
        if self.degree() > 1 {
            let send = self.copy_of(buf);
            self.run(RawCollective::AllReduceMax, &send, 0..send.len(), buf, send.len());
        }
    }
    fn all_gather(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) {
        assert_eq!(recv.len(), send.len() * self.degree(), "all_gather: recv must hold degree × send");
        if self.degree() == 1 {
            self.be.copy(recv, send);
        } else {
            self.run(RawCollective::AllGather, send, 0..send.len(), recv, send.len());
        }
    }
    fn reduce_scatter_sum(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) {
        assert_eq!(send.len(), recv.len() * self.degree(), "reduce_scatter: send must hold degree × recv");
        if self.degree() == 1 {
            self.be.copy(recv, send);
        } else {
            self.run(RawCollective::ReduceScatterSum, send, 0..send.len(), recv, recv.len());
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
        if self.degree() == 1 {
            self.be.copy(&mut recv, &send);
        } else {
            self.run(RawCollective::AllReduceSum, &send, 0..send.len(), &mut recv, send.len());
        }
        self.finished.keep(send, recv)
    }
    /// Blocking: complete when started.
    fn test(&self, _t: &Ticket) -> bool {
        true
    }
    fn wait(&self, t: Ticket) -> (DevBuf<f32>, DevBuf<f32>) {
        self.finished.take(t)
    }
    fn start_shift(&self, slot: usize, buf: &DevBuf<f32>) {
        let mut recv = self.be.zeros(buf.len());
        if self.degree() == 1 {
            self.be.copy(&mut recv, buf);
        } else {
            self.run(RawCollective::RingShift(slot), buf, 0..buf.len(), &mut recv, buf.len());
        }
        self.finished.hold_shift(slot, recv);
    }
    fn finish_shift(&self, slot: usize, buf: &mut DevBuf<f32>) {
        self.be.copy(buf, &self.finished.take_shift(slot));
    }
}

/// The mesh's groups over a CUDA-aware MPI.
pub struct CudaAwareMesh<'g> {
    tp: CudaAwareGroup<'g>,
    cp: CudaAwareGroup<'g>,
    fsdp: CudaAwareGroup<'g>,
    dp_rep: CudaAwareGroup<'g>,
    expert_fsdp: CudaAwareGroup<'g>,
    /// Expert parallelism's all-to-all, staged through the host (`docs/gpu.md`).
    ep: Staged<'g, GpuBackend>,
}

impl<'g> CudaAwareMesh<'g> {
    pub fn new(be: &GpuBackend, mesh: &'g Mesh) -> Self {
        let g = |group| CudaAwareGroup::new(be, group);
        CudaAwareMesh {
            tp: g(&mesh.tp),
            cp: g(&mesh.cp),
            fsdp: g(&mesh.fsdp),
            dp_rep: g(&mesh.dp_rep),
            expert_fsdp: g(&mesh.expert_fsdp),
            ep: Staged::new(be.clone(), &mesh.ep),
        }
    }

    pub fn collectives(&self) -> MeshCollectives<'_, DevBuf<f32>> {
        MeshCollectives { tp: &self.tp, cp: &self.cp, fsdp: &self.fsdp, dp_rep: &self.dp_rep, expert_fsdp: &self.expert_fsdp, ep: &self.ep }
    }
}
