//! NCCL: the mesh groups' collectives on the GPU's own buffers, one communicator per group,
//! bootstrapped over the group's MPI communicator (its rank 0 creates the unique id and
//! broadcasts it).
//!
//! Every collective runs on a communication stream of its own (one for all of the mesh's
//! groups, so their collectives keep one order on every rank), ordered against the compute
//! stream by events: the communication stream waits only for the compute call that last used
//! the collective's buffers (`backend::cuda`'s call marks; not for compute queued before it
//! that touches other buffers), and the compute stream waits for the collective only where its
//! buffers come back (`wait`, `finish_shift`, or at once for the
//! blocking calls). So FSDP's prefetched all-gather, the reduce-scatter left in flight over the
//! next block's backward and DP's bucketed all-reduce overlap the GEMMs on the device as they
//! do on the host, and the host never waits for them. Each collective is timed by a pair of
//! events around it on the communication stream; the times are read once the events have
//! completed (`settle`, after the step has synchronised) and counted on the group's MPI twin
//! with its bytes, as the host counts them, so the timing log and `ndtrain plan` agree.
//! A failed device call is recorded on the backend (and skips the calls after it), which
//! reports it when the step synchronises. NCCL needs one GPU per rank; [`super::choose`]
//! chooses it only then.

use super::{Collective, Finished, MeshCollectives, Staged};
use crate::backend::cuda::backend::{DevBuf, GpuBackend};
use crate::backend::cuda::comm::{CommStream, Event};
use crate::backend::cuda::nccl::{AsyncErrors, NcclComm, NcclId};
use crate::backend::Backend;
use crate::parallel::comm::{Group, Ticket};
use crate::parallel::mesh::Mesh;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Range;
use std::rc::Rc;

/// One collective enqueued on the communication stream: its kind and bytes, and the events
/// recorded before and after it (the compute waits for `end`; both time it).
struct Enqueued {
    kind: &'static str,
    bytes: usize,
    start: Event,
    end: Event,
}

/// One mesh group's collectives over NCCL.
pub struct NcclGroup<'g> {
    comm: NcclComm,
    /// The group's MPI communicator: its coordinates and its counters.
    group: &'g Group,
    be: GpuBackend,
    /// Where the collectives run (shared by the mesh's groups).
    stream: Rc<CommStream>,
    /// The started collectives' buffers, by ticket, and the ring's received blocks.
    finished: Finished<DevBuf<f32>>,
    /// The started collectives' events, by ticket, and the ring exchanges', by slot.
    started: RefCell<BTreeMap<u64, Enqueued>>,
    shifts: RefCell<BTreeMap<usize, Enqueued>>,
    /// Collectives the compute already waits for, whose time is not yet counted.
    untimed: RefCell<Vec<Enqueued>>,
}

/// Joins the NCCL communicator of `group`'s ranks on `stream`: rank 0 of the group creates the
/// unique id, the group's MPI communicator broadcasts it, every rank joins (a collective call
/// over the group). The ranks agree before the broadcast (every one loaded NCCL, rank 0 made
/// the id) and after the join, so a rank that fails ends the bootstrap on every rank instead of
/// leaving the others waiting in a collective.
pub fn bootstrap(group: &Group, stream: &CommStream) -> Result<NcclComm, String> {
    let ready = match group.rank() {
        0 => NcclId::new().map(|id| id.to_bytes()),
        _ => crate::backend::cuda::nccl::version().map(|_| vec![0; NcclId::BYTES]),
    };
    let mut id = group.agree(ready)?;
    group.broadcast_bytes(0, &mut id);
    let joined = NcclId::from_bytes(&id).and_then(|id| NcclComm::join(&id, group.rank(), group.size(), stream));
    group.agree(joined.map_err(|e| format!("{e} ({} ranks in {})", group.size(), group.name())))
}

impl<'g> NcclGroup<'g> {
    /// The communicator of `group` on `be`'s GPU, running on `stream` (a collective call over
    /// the group).
    pub fn new(be: &GpuBackend, group: &'g Group, stream: &Rc<CommStream>) -> Result<Self, String> {
        Ok(NcclGroup {
            comm: bootstrap(group, stream)?,
            group,
            be: be.clone(),
            stream: stream.clone(),
            finished: Finished::default(),
            started: RefCell::new(BTreeMap::new()),
            shifts: RefCell::new(BTreeMap::new()),
            untimed: RefCell::new(vec![]),
        })
    }

    fn peers(&self) -> (usize, usize) {
        let (r, n) = (self.group.rank(), self.group.size());
        ((r + 1) % n, (r + n - 1) % n)
    }

    /// Runs `call` (NCCL calls on the communication stream) after the compute call
    /// `last_use`, the last that used its buffers (`GpuBackend::last_use`), between two timing
    /// events; `None` where a device call has failed (recorded on the backend).
    fn enqueue(
        &self,
        kind: &'static str,
        bytes: usize,
        last_use: u64,
        call: impl FnOnce(&NcclComm) -> Result<(), String>,
    ) -> Option<Enqueued> {
        if self.be.has_failed() {
            return None;
        }
        self.settle_completed();
        let enqueued = (|| {
            self.stream.after(&self.be, last_use)?;
            let start = self.stream.record()?;
            call(&self.comm)?;
            Ok(Enqueued { kind, bytes, start, end: self.stream.record()? })
        })();
        enqueued.map_err(|e| self.be.record_failure(&format!("NCCL {kind} over {}", self.group.name()), e)).ok()
    }

    /// The compute stream waits for `e`'s collective; its time is counted once it completes.
    fn join(&self, e: Enqueued) {
        self.be.run("ordering the compute after a collective", || self.be.compute_waits_for(&e.end));
        self.untimed.borrow_mut().push(e);
    }

    /// Counts the collectives that have completed (their events answer without waiting).
    fn settle_completed(&self) {
        let mut untimed = self.untimed.borrow_mut();
        let (done, pending): (Vec<Enqueued>, Vec<Enqueued>) = untimed.drain(..).partition(|e| e.end.is_complete());
        *untimed = pending;
        for e in done {
            match e.end.seconds_since(&e.start) {
                Ok(secs) => self.group.count(e.kind, e.bytes, secs),
                Err(err) => self.be.record_failure("timing a collective", err),
            }
        }
    }

    /// A blocking collective: enqueued, and the compute ordered after it.
    fn blocking(&self, kind: &'static str, bytes: usize, last_use: u64, call: impl FnOnce(&NcclComm) -> Result<(), String>) {
        if let Some(e) = self.enqueue(kind, bytes, last_use, call) {
            self.join(e);
        }
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
        let n = buf.len();
        self.all_reduce_sum_range(buf, 0..n);
    }
    fn all_reduce_sum_range(&self, buf: &mut DevBuf<f32>, range: Range<usize>) {
        if !range.is_empty() {
            let last = self.be.last_use(&[buf]);
            self.blocking("all_reduce", 4 * range.len(), last, |c| c.all_reduce_in_place(buf, range, false));
        }
    }
    fn all_reduce_max(&self, buf: &mut DevBuf<f32>) {
        if !buf.is_empty() {
            let n = buf.len();
            let last = self.be.last_use(&[buf]);
            self.blocking("all_reduce", 4 * n, last, |c| c.all_reduce_in_place(buf, 0..n, true));
        }
    }
    fn all_gather(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) {
        assert_eq!(recv.len(), send.len() * self.degree(), "all_gather: recv must hold degree × send");
        if !send.is_empty() {
            let last = self.be.last_use(&[send, recv]);
            self.blocking("all_gather", 4 * recv.len(), last, |c| c.all_gather(send, recv, self.degree()));
        }
    }
    fn reduce_scatter_sum(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) {
        assert_eq!(send.len(), recv.len() * self.degree(), "reduce_scatter: send must hold degree × recv");
        if !recv.is_empty() {
            let last = self.be.last_use(&[send, recv]);
            self.blocking("reduce_scatter", 4 * send.len(), last, |c| c.reduce_scatter_sum(send, recv, self.degree()));
        }
    }
    fn start_all_gather(&self, send: DevBuf<f32>, mut recv: DevBuf<f32>) -> Ticket {
        assert_eq!(recv.len(), send.len() * self.degree(), "all_gather: recv must hold degree × send");
        let (bytes, last) = (4 * recv.len(), self.be.last_use(&[&send, &recv]));
        let e =
            if send.is_empty() { None } else { self.enqueue("all_gather", bytes, last, |c| c.all_gather(&send, &mut recv, self.degree())) };
        self.start(send, recv, e)
    }
    fn start_reduce_scatter_sum(&self, send: DevBuf<f32>, mut recv: DevBuf<f32>) -> Ticket {
        assert_eq!(send.len(), recv.len() * self.degree(), "reduce_scatter: send must hold degree × recv");
        let (bytes, last) = (4 * send.len(), self.be.last_use(&[&send, &recv]));
        let e = if recv.is_empty() {
            None
        } else {
            self.enqueue("reduce_scatter", bytes, last, |c| c.reduce_scatter_sum(&send, &mut recv, self.degree()))
        };
        self.start(send, recv, e)
    }
    fn start_all_reduce_sum(&self, send: DevBuf<f32>, mut recv: DevBuf<f32>) -> Ticket {
        let (bytes, last) = (4 * send.len(), self.be.last_use(&[&send, &recv]));
        let e = if send.is_empty() { None } else { self.enqueue("all_reduce", bytes, last, |c| c.all_reduce_sum(&send, &mut recv)) };
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
            let (peers, last) = (self.peers(), self.be.last_use(&[buf, &recv]));
            if let Some(e) = self.enqueue("ring", 4 * buf.len(), last, |c| c.shift(buf, &mut recv, peers)) {
                let old = self.shifts.borrow_mut().insert(slot, e);
                assert!(old.is_none(), "ring slot {slot} already in flight");
            }
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
    expert_fsdp: NcclGroup<'g>,
    /// Expert parallelism's all-to-all, staged through the host (`docs/gpu.md`).
    ep: Staged<'g, GpuBackend>,
}

impl<'g> NcclMesh<'g> {
    /// One communicator per group, created in the same order on every rank, all on one
    /// communication stream forked from the compute stream.
    pub fn new(be: &GpuBackend, mesh: &'g Mesh) -> Result<Self, String> {
        let stream = Rc::new(be.comm_stream()?);
        Ok(NcclMesh {
            tp: NcclGroup::new(be, &mesh.tp, &stream)?,
            cp: NcclGroup::new(be, &mesh.cp, &stream)?,
            fsdp: NcclGroup::new(be, &mesh.fsdp, &stream)?,
            dp_rep: NcclGroup::new(be, &mesh.dp_rep, &stream)?,
            expert_fsdp: NcclGroup::new(be, &mesh.expert_fsdp, &stream)?,
            ep: Staged::new(be.clone(), &mesh.ep),
        })
    }

    pub fn collectives(&self) -> MeshCollectives<'_, DevBuf<f32>> {
        MeshCollectives { tp: &self.tp, cp: &self.cp, fsdp: &self.fsdp, dp_rep: &self.dp_rep, expert_fsdp: &self.expert_fsdp, ep: &self.ep }
    }

    fn groups(&self) -> [&NcclGroup<'g>; 5] {
        [&self.tp, &self.cp, &self.fsdp, &self.dp_rep, &self.expert_fsdp]
    }

    /// What another thread polls for each communicator's asynchronous errors (a peer gone),
    /// named by its group.
    pub fn async_errors(&self) -> Vec<(&'static str, AsyncErrors)> {
        self.groups().iter().map(|g| (g.group.name(), g.comm.async_errors())).collect()
    }

    /// Ends every communicator cleanly: every rank of the world first agrees that its work is
    /// done (a slower peer is not left in its last operation), then `ncclCommFinalize` and
    /// `ncclCommDestroy`. Dropped without it (a failed run), the communicators are aborted.
    pub fn close(self, world: &Group) -> Result<(), String> {
        world.barrier();
        let mut first_error = Ok(());
        for g in [self.tp, self.cp, self.fsdp, self.dp_rep, self.expert_fsdp] {
            let name = g.group.name();
            if let Err(e) = g.comm.finish() {
                first_error = first_error.and(Err(format!("{name}: {e}")));
            }
        }
        first_error
    }
}
