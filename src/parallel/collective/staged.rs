//! A group's collectives on a backend whose buffers MPI does not take (device memory), staged
//! through host memory: device → host → MPI (the group's own collective) → device.

use super::{Buffers, Collective, MeshCollectives};
use crate::backend::Backend;
use crate::parallel::comm::{Group, Ticket};
use crate::parallel::mesh::Mesh;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

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
