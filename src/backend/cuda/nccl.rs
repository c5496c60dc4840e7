//! NCCL: the mesh groups' collectives on the GPU's own buffers, one communicator per group,
//! bootstrapped over the group's MPI communicator (`Gpu::nccl`).
//!
//! Every collective runs on a communication stream of its own (one for all of the mesh's
//! groups, so their collectives keep one order on every rank), ordered against the compute
//! stream by CUDA events: the communication stream waits for the compute enqueued before a
//! collective starts (which produced its input), and the compute stream waits for the
//! collective only where its buffers come back (`wait`, `finish_shift`, or at once for the
//! blocking calls). So FSDP's prefetched all-gather, the reduce-scatter left in flight over the
//! next block's backward and DP's bucketed all-reduce overlap the GEMMs on the device as they
//! do on the host, and the host never waits for them. Each collective is timed by a pair of
//! events around it on the communication stream; the times are read once the events have
//! completed (`settle`, after the step has synchronised) and counted on the group's MPI twin
//! with its bytes, as the host counts them, so the timing log and `ndtrain plan` agree.
//! NCCL needs one GPU per rank; `comm_backend` chooses it only then (`choose`).

use super::backend::{ok, DevBuf, GpuBackend};
use crate::backend::Backend;
use crate::config::CommBackend;
use crate::parallel::collective::{Collective, Finished, MeshCollectives};
use crate::parallel::comm::{Group, Ticket};
use crate::parallel::mesh::Mesh;
use cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream};
use cudarc::nccl::{Comm, ReduceOp};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

/// One collective enqueued on the communication stream: its kind and bytes, and the events
/// recorded before and after it (the compute waits for `end`; both time it).
struct Enqueued {
    kind: &'static str,
    bytes: usize,
    start: CudaEvent,
    end: CudaEvent,
}

/// One mesh group's collectives over NCCL.
pub struct NcclGroup<'g> {
    /// The communicator, bound to the communication stream.
    comm: Comm,
    /// The group's MPI communicator: its coordinates and its counters.
    group: &'g Group,
    be: GpuBackend,
    /// Where the collectives run (shared by the mesh's groups).
    comm_stream: Arc<CudaStream>,
    /// The started collectives' buffers, by ticket, and the ring's received blocks.
    finished: Finished<DevBuf<f32>>,
    /// The started collectives' events, by ticket, and the ring exchanges', by slot.
    started: RefCell<BTreeMap<u64, Enqueued>>,
    shifts: RefCell<BTreeMap<usize, Enqueued>>,
    /// Collectives the compute already waits for, whose time is not yet counted.
    untimed: RefCell<Vec<Enqueued>>,
}

/// `Err` of an NCCL call, as the run-time failure it is.
fn nccl<R, E: std::fmt::Debug>(what: &str, r: Result<R, E>) -> R {
    ok(what, r.map_err(|e| format!("{e:?}")))
}

impl<'g> NcclGroup<'g> {
    /// The communicator of `group` on `be`'s GPU, running on `comm_stream` (a collective call
    /// over the group).
    pub fn new(be: &GpuBackend, group: &'g Group, comm_stream: &Arc<CudaStream>) -> Result<Self, String> {
        let comm = be.gpu().nccl(group, comm_stream)?;
        Ok(NcclGroup {
            comm,
            group,
            be: be.clone(),
            comm_stream: comm_stream.clone(),
            finished: Finished::default(),
            started: RefCell::new(BTreeMap::new()),
            shifts: RefCell::new(BTreeMap::new()),
            untimed: RefCell::new(vec![]),
        })
    }

    fn peers(&self) -> (i32, i32) {
        let (r, n) = (self.group.rank(), self.group.size());
        (((r + 1) % n) as i32, ((r + n - 1) % n) as i32)
    }

    /// A timing event recorded now on the communication stream.
    fn mark(&self) -> CudaEvent {
        nccl("recording an event on the communication stream", self.comm_stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
    }

    /// Runs `call` (NCCL calls on the communication stream) after the compute enqueued so far,
    /// between two timing events.
    fn enqueue(&self, kind: &'static str, bytes: usize, call: impl FnOnce()) -> Enqueued {
        self.settle_completed();
        nccl("ordering the communication stream after the compute", self.comm_stream.join(&self.be.gpu().stream));
        let start = self.mark();
        call();
        Enqueued { kind, bytes, start, end: self.mark() }
    }

    /// The compute stream waits for `e`'s collective; its time is counted once it completes.
    fn join(&self, e: Enqueued) {
        nccl("ordering the compute after a collective", self.be.gpu().stream.wait(&e.end));
        self.untimed.borrow_mut().push(e);
    }

    /// Counts the collectives that have completed (their events answer without waiting).
    fn settle_completed(&self) {
        let mut untimed = self.untimed.borrow_mut();
        let (done, pending): (Vec<Enqueued>, Vec<Enqueued>) = untimed.drain(..).partition(|e| e.end.is_complete());
        *untimed = pending;
        for e in done {
            let ms = nccl("reading a collective's time", e.start.elapsed_ms(&e.end));
            self.group.count(e.kind, e.bytes, f64::from(ms) / 1e3);
        }
    }

    /// A blocking collective: enqueued, and the compute ordered after it.
    fn blocking(&self, kind: &'static str, bytes: usize, call: impl FnOnce()) {
        let e = self.enqueue(kind, bytes, call);
        self.join(e);
    }

    /// A started collective: its buffers and events kept under a ticket until `wait`.
    fn start(&self, send: DevBuf<f32>, recv: DevBuf<f32>, e: Option<Enqueued>) -> Ticket {
        let t = self.finished.keep(send, recv);
        if let Some(e) = e {
            self.started.borrow_mut().insert(t.id(), e);
        }
        t
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
            let bytes = 4 * buf.len();
            self.blocking("all_reduce", bytes, || {
                nccl("NCCL all-reduce", self.comm.all_reduce_in_place(buf.get_mut(), &ReduceOp::Sum));
            });
        }
    }
    fn all_reduce_sum_range(&self, buf: &mut DevBuf<f32>, range: Range<usize>) {
        if !range.is_empty() {
            self.blocking("all_reduce", 4 * range.len(), || {
                nccl("NCCL all-reduce", self.comm.all_reduce_in_place(&mut buf.get_mut().slice_mut(range), &ReduceOp::Sum));
            });
        }
    }
    fn all_reduce_max(&self, buf: &mut DevBuf<f32>) {
        if !buf.is_empty() {
            let bytes = 4 * buf.len();
            self.blocking("all_reduce", bytes, || {
                nccl("NCCL all-reduce (max)", self.comm.all_reduce_in_place(buf.get_mut(), &ReduceOp::Max));
            });
        }
    }
    fn all_gather(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) {
        assert_eq!(recv.len(), send.len() * self.degree(), "all_gather: recv must hold degree × send");
        if !send.is_empty() {
            let bytes = 4 * recv.len();
            self.blocking("all_gather", bytes, || {
                nccl("NCCL all-gather", self.comm.all_gather(send.get(), recv.get_mut()));
            });
        }
    }
    fn reduce_scatter_sum(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) {
        assert_eq!(send.len(), recv.len() * self.degree(), "reduce_scatter: send must hold degree × recv");
        if !recv.is_empty() {
            self.blocking("reduce_scatter", 4 * send.len(), || {
                nccl("NCCL reduce-scatter", self.comm.reduce_scatter(send.get(), recv.get_mut(), &ReduceOp::Sum));
            });
        }
    }
    fn start_all_gather(&self, send: DevBuf<f32>, mut recv: DevBuf<f32>) -> Ticket {
        assert_eq!(recv.len(), send.len() * self.degree(), "all_gather: recv must hold degree × send");
        let e = (!send.is_empty()).then(|| {
            self.enqueue("all_gather", 4 * recv.len(), || {
                nccl("NCCL all-gather", self.comm.all_gather(send.get(), recv.get_mut()));
            })
        });
        self.start(send, recv, e)
    }
    fn start_reduce_scatter_sum(&self, send: DevBuf<f32>, mut recv: DevBuf<f32>) -> Ticket {
        assert_eq!(send.len(), recv.len() * self.degree(), "reduce_scatter: send must hold degree × recv");
        let e = (!recv.is_empty()).then(|| {
            self.enqueue("reduce_scatter", 4 * send.len(), || {
                nccl("NCCL reduce-scatter", self.comm.reduce_scatter(send.get(), recv.get_mut(), &ReduceOp::Sum));
            })
        });
        self.start(send, recv, e)
    }
    fn start_all_reduce_sum(&self, send: DevBuf<f32>, mut recv: DevBuf<f32>) -> Ticket {
        let e = (!send.is_empty()).then(|| {
            self.enqueue("all_reduce", 4 * send.len(), || {
                nccl("NCCL all-reduce", self.comm.all_reduce(send.get(), recv.get_mut(), &ReduceOp::Sum));
            })
        });
        self.start(send, recv, e)
    }
    /// Whether the collective has finished on the device (never blocks).
    fn test(&self, t: &Ticket) -> bool {
        self.started.borrow().get(&t.id()).is_none_or(|e| e.end.is_complete())
    }
    /// Orders the compute after the collective and hands its buffers back; the host does not
    /// wait.
    fn wait(&self, t: Ticket) -> (DevBuf<f32>, DevBuf<f32>) {
        if let Some(e) = self.started.borrow_mut().remove(&t.id()) {
            self.join(e);
        }
        self.finished.take(t)
    }
    fn start_shift(&self, slot: usize, buf: &DevBuf<f32>) {
        let mut recv = self.be.zeros(buf.len());
        if !buf.is_empty() {
            let next_prev = self.peers();
            let e = self.enqueue("ring", 4 * buf.len(), || {
                let (next, prev) = next_prev;
                let (send_view, recv_view) = (buf.get().slice(..), recv.get_mut().slice_mut(..));
                let mut g = self.comm.group();
                nccl("NCCL ring send", g.send(send_view, next));
                nccl("NCCL ring receive", g.recv(recv_view, prev));
                drop(g);
            });
            let old = self.shifts.borrow_mut().insert(slot, e);
            assert!(old.is_none(), "ring slot {slot} already in flight");
        }
        self.finished.hold_shift(slot, recv);
    }
    fn finish_shift(&self, slot: usize, buf: &mut DevBuf<f32>) {
        if let Some(e) = self.shifts.borrow_mut().remove(&slot) {
            self.join(e);
        }
        self.be.copy(buf, &self.finished.take_shift(slot));
    }
    /// After the device has finished the step's work: every collective's time counted.
    fn settle(&self) {
        self.settle_completed();
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
    /// One communicator per group, created in the same order on every rank, all on one
    /// communication stream forked from the compute stream.
    pub fn new(be: &GpuBackend, mesh: &'g Mesh) -> Result<Self, String> {
        let stream = be.gpu().stream.fork().map_err(|e| format!("creating the communication stream: {e:?}"))?;
        Ok(NcclMesh {
            tp: NcclGroup::new(be, &mesh.tp, &stream)?,
            cp: NcclGroup::new(be, &mesh.cp, &stream)?,
            fsdp: NcclGroup::new(be, &mesh.fsdp, &stream)?,
            dp_rep: NcclGroup::new(be, &mesh.dp_rep, &stream)?,
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
