//! The collectives of one mesh group on a backend's buffers: what the strategies (`fsdp`,
//! `tp`, `cp`) call, whatever memory the buffers live in.
//!
//! [`Collective`] is written over the buffer type `V`. A host vector's implementation is the
//! group itself (`comm::Group`, over MPI); [`Staged`] runs the group's MPI collectives on any
//! backend's buffers through host copies (a device's, or the host's in the device path).
//! Non-blocking collectives take their buffers and give them back when waited for, so nothing
//! touches a buffer in flight. Bytes and time are counted by the group (`comm`), per kind.

use super::comm::{Group, Ticket};
use super::mesh::Mesh;
use crate::backend::Backend;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

/// One group's collectives on buffers `V` (`recv = [send of rank 0, send of rank 1, …]` for a
/// gather; a reduce-scatter leaves block `rank` of the sum).
pub trait Collective<V> {
    /// The group's degree.
    fn degree(&self) -> usize;
    /// This rank's coordinate in the group.
    fn rank(&self) -> usize;
    /// Element-wise sum across the group, in place.
    fn all_reduce_sum(&self, buf: &mut V);
    /// Element-wise sum across the group of `buf[range]`, in place.
    fn all_reduce_sum_range(&self, buf: &mut V, range: Range<usize>);
    /// Element-wise maximum across the group, in place.
    fn all_reduce_max(&self, buf: &mut V);
    /// `recv = [send of every rank]` (`recv` holds degree × `send`).
    fn all_gather(&self, send: &V, recv: &mut V);
    /// Sums `send` (`[degree][recv.len()]`) across the group; this rank's block lands in `recv`.
    fn reduce_scatter_sum(&self, send: &V, recv: &mut V);
    /// Starts [`Collective::all_gather`] of `send` into `recv`; the buffers come back from
    /// [`Collective::wait`].
    fn start_all_gather(&self, send: V, recv: V) -> Ticket;
    /// Starts [`Collective::reduce_scatter_sum`].
    fn start_reduce_scatter_sum(&self, send: V, recv: V) -> Ticket;
    /// Starts the sum of `send` across the group into `recv`.
    fn start_all_reduce_sum(&self, send: V, recv: V) -> Ticket;
    /// Lets the collective of `t` progress without blocking; true once it has completed.
    fn test(&self, t: &Ticket) -> bool;
    /// Completes the collective of `t`; returns its buffers `(send, recv)`.
    fn wait(&self, t: Ticket) -> (V, V);
    /// Starts sending a copy of `buf` to the next rank of the ring (exchange `slot`) while the
    /// previous rank's block is received; the caller may keep computing on `buf`.
    fn start_shift(&self, slot: usize, buf: &V);
    /// Completes exchange `slot`: `buf` becomes the previous rank's block.
    fn finish_shift(&self, slot: usize, buf: &mut V);
    /// Called once the device has finished the step's work: a group whose collectives run
    /// asynchronously on a device counts their time now (the host's collectives are counted
    /// as they run).
    fn settle(&self) {}
}

impl Collective<Vec<f32>> for Group {
    fn degree(&self) -> usize {
        self.size()
    }
    fn rank(&self) -> usize {
        Group::rank(self)
    }
    fn all_reduce_sum(&self, buf: &mut Vec<f32>) {
        self.all_reduce_sum_f32(buf);
    }
    fn all_reduce_sum_range(&self, buf: &mut Vec<f32>, range: Range<usize>) {
        self.all_reduce_sum_f32(&mut buf[range]);
    }
    fn all_reduce_max(&self, buf: &mut Vec<f32>) {
        self.all_reduce_max_f32(buf);
    }
    fn all_gather(&self, send: &Vec<f32>, recv: &mut Vec<f32>) {
        self.all_gather_f32(send, recv);
    }
    fn reduce_scatter_sum(&self, send: &Vec<f32>, recv: &mut Vec<f32>) {
        self.reduce_scatter_sum_f32(send, recv);
    }
    fn start_all_gather(&self, send: Vec<f32>, recv: Vec<f32>) -> Ticket {
        self.start_all_gather_f32(send, recv)
    }
    fn start_reduce_scatter_sum(&self, send: Vec<f32>, recv: Vec<f32>) -> Ticket {
        self.start_reduce_scatter_sum_f32(send, recv)
    }
    fn start_all_reduce_sum(&self, send: Vec<f32>, recv: Vec<f32>) -> Ticket {
        self.start_all_reduce_sum_f32(send, recv)
    }
    fn test(&self, t: &Ticket) -> bool {
        Group::test(self, t)
    }
    fn wait(&self, t: Ticket) -> (Vec<f32>, Vec<f32>) {
        Group::wait(self, t)
    }
    fn start_shift(&self, slot: usize, buf: &Vec<f32>) {
        self.start_ring_shift_f32(slot, buf);
    }
    fn finish_shift(&self, slot: usize, buf: &mut Vec<f32>) {
        self.finish_ring_shift_f32(slot, buf);
    }
}

/// The send and receive buffers of a collective.
type Buffers<V> = (V, V);

/// A group's collectives on a backend whose buffers MPI does not take (device memory), staged
/// through host memory: device → host → MPI (the group's own collective) → device. Works with
/// any MPI and any number of ranks per device. The group counts bytes and time as on the host;
/// a non-blocking collective copies its input out when it starts and its output in when it is
/// waited for, so the device buffers and the host staging buffers stay apart. The host buffers
/// are kept for the next collective of the same length (every step repeats the same sizes) and
/// page-locked where the backend can pin them, so the copies run at the bus's speed.
pub struct Staged<'g, B: Backend<f32>> {
    be: B,
    group: &'g Group,
    /// The device buffers of the collectives in flight, by ticket (their host copies are in
    /// the group).
    in_flight: RefCell<BTreeMap<u64, Buffers<B::Buf>>>,
    /// Host staging buffers not in use, by length.
    spare: RefCell<BTreeMap<usize, Vec<Vec<f32>>>>,
    /// The addresses of the staging buffers the backend pinned.
    pinned: RefCell<BTreeSet<usize>>,
}

/// Spare staging buffers kept per length. A staging buffer is given back when its collective
/// completes, so at most two of one length are in use at once (a prefetched gather's beside the
/// current one's); more would only hold pinned host memory, which is scarce on GPU nodes.
const SPARE_PER_LENGTH: usize = 2;

impl<'g, B: Backend<f32>> Staged<'g, B> {
    pub fn new(be: B, group: &'g Group) -> Self {
        Staged {
            be,
            group,
            in_flight: RefCell::new(BTreeMap::new()),
            spare: RefCell::new(BTreeMap::new()),
            pinned: RefCell::new(BTreeSet::new()),
        }
    }

    /// A host staging buffer of `len` elements (a spare one, else a new one, pinned if the
    /// backend can).
    fn stage(&self, len: usize) -> Vec<f32> {
        if let Some(h) = self.spare.borrow_mut().get_mut(&len).and_then(|v| v.pop()) {
            return h;
        }
        let mut h = vec![0.0; len];
        if self.be.pin_host(&mut h) {
            self.pinned.borrow_mut().insert(h.as_ptr() as usize);
        }
        h
    }

    /// Gives a staging buffer back for the next collective of its length.
    fn unstage(&self, mut h: Vec<f32>) {
        let mut spare = self.spare.borrow_mut();
        let same = spare.entry(h.len()).or_default();
        if same.len() < SPARE_PER_LENGTH {
            same.push(h);
        } else if self.pinned.borrow_mut().remove(&(h.as_ptr() as usize)) {
            self.be.unpin_host(&mut h);
        }
    }

    /// A host copy of `buf`, in a staging buffer.
    fn down(&self, buf: &B::Buf) -> Vec<f32> {
        let mut host = self.stage(self.be.len(buf));
        self.be.download(buf, &mut host);
        host
    }

    /// Runs `f` on a host copy of `buf` and copies the result back.
    fn through_host(&self, buf: &mut B::Buf, f: impl FnOnce(&mut Vec<f32>)) {
        let mut host = self.down(buf);
        f(&mut host);
        self.be.upload(buf, &host);
        self.unstage(host);
    }

    fn keep(&self, t: Ticket, send: B::Buf, recv: B::Buf) -> Ticket {
        self.in_flight.borrow_mut().insert(t.0, (send, recv));
        t
    }
}

impl<B: Backend<f32>> Drop for Staged<'_, B> {
    /// Unpins the spare staging buffers before they are freed.
    fn drop(&mut self) {
        let pinned = self.pinned.get_mut();
        for h in self.spare.get_mut().values_mut().flatten() {
            if pinned.remove(&(h.as_ptr() as usize)) {
                self.be.unpin_host(h);
            }
        }
    }
}

impl<B: Backend<f32>> Collective<B::Buf> for Staged<'_, B> {
    fn degree(&self) -> usize {
        self.group.size()
    }
    fn rank(&self) -> usize {
        self.group.rank()
    }
    fn all_reduce_sum(&self, buf: &mut B::Buf) {
        self.through_host(buf, |h| self.group.all_reduce_sum_f32(h));
    }
    fn all_reduce_sum_range(&self, buf: &mut B::Buf, range: Range<usize>) {
        self.through_host(buf, |h| self.group.all_reduce_sum_f32(&mut h[range]));
    }
    fn all_reduce_max(&self, buf: &mut B::Buf) {
        self.through_host(buf, |h| self.group.all_reduce_max_f32(h));
    }
    fn all_gather(&self, send: &B::Buf, recv: &mut B::Buf) {
        let h = self.down(send);
        self.through_host(recv, |r| self.group.all_gather_f32(&h, r));
        self.unstage(h);
    }
    fn reduce_scatter_sum(&self, send: &B::Buf, recv: &mut B::Buf) {
        let h = self.down(send);
        self.through_host(recv, |r| self.group.reduce_scatter_sum_f32(&h, r));
        self.unstage(h);
    }
    fn start_all_gather(&self, send: B::Buf, recv: B::Buf) -> Ticket {
        let t = self.group.start_all_gather_f32(self.down(&send), self.stage(self.be.len(&recv)));
        self.keep(t, send, recv)
    }
    fn start_reduce_scatter_sum(&self, send: B::Buf, recv: B::Buf) -> Ticket {
        let t = self.group.start_reduce_scatter_sum_f32(self.down(&send), self.stage(self.be.len(&recv)));
        self.keep(t, send, recv)
    }
    fn start_all_reduce_sum(&self, send: B::Buf, recv: B::Buf) -> Ticket {
        let t = self.group.start_all_reduce_sum_f32(self.down(&send), self.stage(self.be.len(&recv)));
        self.keep(t, send, recv)
    }
    fn test(&self, t: &Ticket) -> bool {
        self.group.test(t)
    }
    fn wait(&self, t: Ticket) -> (B::Buf, B::Buf) {
        let id = t.0;
        let (host_send, host) = self.group.wait(t);
        let (send, mut recv) = self.in_flight.borrow_mut().remove(&id).expect("a ticket of this group, waited for once");
        self.be.upload(&mut recv, &host);
        self.unstage(host_send);
        self.unstage(host);
        (send, recv)
    }
    fn start_shift(&self, slot: usize, buf: &B::Buf) {
        let h = self.down(buf);
        self.group.start_ring_shift_f32(slot, &h);
        self.unstage(h);
    }
    fn finish_shift(&self, slot: usize, buf: &mut B::Buf) {
        self.through_host(buf, |h| self.group.finish_ring_shift_f32(slot, h));
    }
}

/// The mesh's groups as [`Staged`] collectives on backend `B`.
pub struct StagedMesh<'g, B: Backend<f32>> {
    tp: Staged<'g, B>,
    cp: Staged<'g, B>,
    fsdp: Staged<'g, B>,
    dp_rep: Staged<'g, B>,
}

impl<'g, B: Backend<f32> + Clone> StagedMesh<'g, B> {
    pub fn new(be: &B, mesh: &'g Mesh) -> Self {
        let staged = |g| Staged::new(be.clone(), g);
        StagedMesh { tp: staged(&mesh.tp), cp: staged(&mesh.cp), fsdp: staged(&mesh.fsdp), dp_rep: staged(&mesh.dp_rep) }
    }

    pub fn collectives(&self) -> MeshCollectives<'_, B::Buf> {
        MeshCollectives { tp: &self.tp, cp: &self.cp, fsdp: &self.fsdp, dp_rep: &self.dp_rep }
    }
}

/// The buffers of collectives whose completion is ordered by other means than MPI requests —
/// run blocking, or on a device ordered by its events: the buffers until waited for, and each
/// ring exchange's received block until finished.
pub struct Finished<V> {
    done: RefCell<BTreeMap<u64, Buffers<V>>>,
    next: std::cell::Cell<u64>,
    ring: RefCell<BTreeMap<usize, V>>,
}

impl<V> Default for Finished<V> {
    fn default() -> Self {
        Finished { done: RefCell::new(BTreeMap::new()), next: std::cell::Cell::new(0), ring: RefCell::new(BTreeMap::new()) }
    }
}

impl<V> Finished<V> {
    /// Holds a finished collective's buffers; its ticket.
    pub fn keep(&self, send: V, recv: V) -> Ticket {
        let id = self.next.get();
        self.next.set(id + 1);
        self.done.borrow_mut().insert(id, (send, recv));
        Ticket(id)
    }

    /// The buffers of the collective of `t`.
    pub fn take(&self, t: Ticket) -> Buffers<V> {
        self.done.borrow_mut().remove(&t.0).expect("a ticket of this group, waited for once")
    }

    /// Holds the block ring exchange `slot` received.
    pub fn hold_shift(&self, slot: usize, received: V) {
        let old = self.ring.borrow_mut().insert(slot, received);
        assert!(old.is_none(), "ring slot {slot} already in flight");
    }

    /// The block ring exchange `slot` received.
    pub fn take_shift(&self, slot: usize) -> V {
        self.ring.borrow_mut().remove(&slot).expect("finish_shift after start_shift")
    }
}

/// Every mesh group's collectives on buffers `V`, as the strategies use them.
pub struct MeshCollectives<'a, V> {
    pub tp: &'a dyn Collective<V>,
    pub cp: &'a dyn Collective<V>,
    pub fsdp: &'a dyn Collective<V>,
    pub dp_rep: &'a dyn Collective<V>,
}

impl<V> MeshCollectives<'_, V> {
    /// Every group's [`Collective::settle`].
    pub fn settle(&self) {
        for c in [self.tp, self.cp, self.fsdp, self.dp_rep] {
            c.settle();
        }
    }
}

impl<'g> MeshCollectives<'g, Vec<f32>> {
    /// The mesh's groups themselves: MPI on host vectors.
    pub fn host(mesh: &'g Mesh) -> Self {
        MeshCollectives { tp: &mesh.tp, cp: &mesh.cp, fsdp: &mesh.fsdp, dp_rep: &mesh.dp_rep }
    }
}
