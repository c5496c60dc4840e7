//! The collectives of one mesh group on a backend's buffers: what the strategies (`fsdp`,
//! `tp`, `cp`) call, whatever memory the buffers live in.
//!
//! [`Collective`] is written over the buffer type `V`. A host vector's implementation is the
//! group itself (`comm::Group`, over MPI); [`Solo`] is a group of one rank on any backend
//! (every collective a copy or nothing), which is how a single device runs the same strategies.
//! Non-blocking collectives take their buffers and give them back when waited for, so nothing
//! touches a buffer in flight. Bytes and time are counted by the group (`comm`), per kind.

use super::comm::{Group, Ticket};
use crate::backend::Backend;
use std::cell::RefCell;
use std::collections::BTreeMap;
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

/// A group of one rank on backend `B`: reductions are identities, a gather or a reduce-scatter
/// is a copy, a ring shift returns the block to its sender. What a strategy of degree 1 calls
/// on a backend whose buffers no MPI group takes.
pub struct Solo<B: Backend<f32>> {
    be: B,
    /// Finished "collectives" by ticket, until waited for.
    done: RefCell<BTreeMap<u64, Buffers<B::Buf>>>,
    next: RefCell<u64>,
    /// Ring exchanges by slot: the block sent is the block received.
    ring: RefCell<BTreeMap<usize, B::Buf>>,
}

impl<B: Backend<f32>> Solo<B> {
    pub fn new(be: B) -> Self {
        Solo { be, done: RefCell::new(BTreeMap::new()), next: RefCell::new(0), ring: RefCell::new(BTreeMap::new()) }
    }

    fn finished(&self, send: B::Buf, mut recv: B::Buf) -> Ticket {
        self.be.copy(&mut recv, &send);
        let mut next = self.next.borrow_mut();
        let t = *next;
        *next += 1;
        self.done.borrow_mut().insert(t, (send, recv));
        Ticket(t)
    }
}

impl<B: Backend<f32>> Collective<B::Buf> for Solo<B> {
    fn degree(&self) -> usize {
        1
    }
    fn rank(&self) -> usize {
        0
    }
    fn all_reduce_sum(&self, _buf: &mut B::Buf) {}
    fn all_reduce_sum_range(&self, _buf: &mut B::Buf, _range: Range<usize>) {}
    fn all_reduce_max(&self, _buf: &mut B::Buf) {}
    fn all_gather(&self, send: &B::Buf, recv: &mut B::Buf) {
        self.be.copy(recv, send);
    }
    fn reduce_scatter_sum(&self, send: &B::Buf, recv: &mut B::Buf) {
        self.be.copy(recv, send);
    }
    fn start_all_gather(&self, send: B::Buf, recv: B::Buf) -> Ticket {
        self.finished(send, recv)
    }
    fn start_reduce_scatter_sum(&self, send: B::Buf, recv: B::Buf) -> Ticket {
        self.finished(send, recv)
    }
    fn start_all_reduce_sum(&self, send: B::Buf, recv: B::Buf) -> Ticket {
        self.finished(send, recv)
    }
    fn test(&self, _t: &Ticket) -> bool {
        true
    }
    fn wait(&self, t: Ticket) -> (B::Buf, B::Buf) {
        self.done.borrow_mut().remove(&t.0).expect("a ticket of this group, waited for once")
    }
    fn start_shift(&self, slot: usize, buf: &B::Buf) {
        let mut copy = self.be.zeros(self.be.len(buf));
        self.be.copy(&mut copy, buf);
        self.ring.borrow_mut().insert(slot, copy);
    }
    fn finish_shift(&self, slot: usize, buf: &mut B::Buf) {
        let back = self.ring.borrow_mut().remove(&slot).expect("finish_shift after start_shift");
        self.be.copy(buf, &back);
    }
}

/// Every mesh group's collectives on buffers `V`, as the strategies use them.
pub struct MeshCollectives<'a, V> {
    pub tp: &'a dyn Collective<V>,
    pub cp: &'a dyn Collective<V>,
    pub fsdp: &'a dyn Collective<V>,
    pub dp_rep: &'a dyn Collective<V>,
}
