//! A group's collectives on a backend whose buffers MPI does not take (device memory), staged
//! through host memory: device → host → MPI (the group's own collective) → device.

use super::{Buffers, Collective, MeshCollectives};
use crate::backend::{Backend, Fence};
use crate::model::hooks::ExpertExchange;
use crate::parallel::comm::{Group, Ticket};
use crate::parallel::mesh::Mesh;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Range;

/// A group's collectives on a backend whose buffers MPI does not take (device memory), staged
/// through host memory: device → host → MPI (the group's own collective) → device. Works with
/// any MPI and any number of ranks per device. The group counts bytes and time as on the host;
/// a non-blocking collective copies its input out when it starts and its output in when it is
/// waited for, so the device buffers and the host staging buffers stay apart. The host buffers
/// are kept for the next collective of the same length (every step repeats the same sizes) and
/// page-locked where the backend can pin them, so the copies run at the bus's speed
/// ([`StagingPool`]).
pub struct Staged<'g, B: Backend<f32>> {
    be: B,
    group: &'g Group,
    /// The device buffers of the collectives in flight, by ticket (their host copies are in
    /// the group).
    in_flight: RefCell<BTreeMap<u64, Buffers<B::Buf>>>,
    pool: RefCell<StagingPool<B::Fence>>,
}

/// Spare staging buffers kept per length. A staging buffer is given back when its collective
/// completes, so at most two of one length are in use at once (a prefetched gather's beside the
/// current one's); more would only hold pinned host memory, which is scarce on GPU nodes.
const SPARE_PER_LENGTH: usize = 2;

/// A staging buffer and the device copy that may still be reading it (an upload from
/// page-locked memory runs after the call that queued it returns).
struct Staging<F> {
    buf: Vec<f32>,
    pinned: bool,
    reading: Option<F>,
}

impl<F: Fence> Staging<F> {
    fn idle(&self) -> bool {
        self.reading.as_ref().is_none_or(|f| f.done())
    }
}

/// The host staging buffers of one group. A buffer a device copy may still be reading is
/// neither handed out again (MPI would write into it under the copy) nor unpinned and freed
/// until its fence says the copy has finished: surplus buffers wait in `retired` until then.
pub(crate) struct StagingPool<F> {
    /// Buffers not in use, by length.
    spare: BTreeMap<usize, Vec<Staging<F>>>,
    /// Surplus buffers whose last copy may still be running.
    retired: Vec<Staging<F>>,
    /// Buffers handed out, by address: whether each is pinned.
    lent: BTreeMap<usize, bool>,
}

impl<F: Fence> Default for StagingPool<F> {
    fn default() -> Self {
        StagingPool { spare: BTreeMap::new(), retired: vec![], lent: BTreeMap::new() }
    }
}

impl<F: Fence> StagingPool<F> {
    /// A buffer of `len` elements: a spare one no copy reads any more, else a new one (pinned
    /// where `pin` can).
    pub(crate) fn take(&mut self, len: usize, pin: impl FnOnce(&mut [f32]) -> bool) -> Vec<f32> {
        let same = self.spare.entry(len).or_default();
        let s = match same.iter().position(Staging::idle) {
            Some(i) => same.swap_remove(i),
            None => {
                let mut buf = vec![0.0; len];
                let pinned = pin(&mut buf);
                Staging { buf, pinned, reading: None }
            }
        };
        self.lent.insert(s.buf.as_ptr() as usize, s.pinned);
        s.buf
    }

    /// Takes back a buffer `take` handed out, which the copy behind `reading` may still read:
    /// kept for the next collective of its length, or retired. Releases the retired buffers
    /// whose copies have finished.
    pub(crate) fn give_back(&mut self, buf: Vec<f32>, reading: Option<F>, unpin: &mut impl FnMut(&mut [f32])) {
        let pinned = self.lent.remove(&(buf.as_ptr() as usize)).expect("a staging buffer of this pool");
        let s = Staging { buf, pinned, reading };
        let same = self.spare.entry(s.buf.len()).or_default();
        if same.len() < SPARE_PER_LENGTH {
            same.push(s);
        } else {
            self.retired.push(s);
        }
        self.release_finished(unpin);
    }

    /// Unpins and frees the retired buffers no copy reads any more.
    fn release_finished(&mut self, unpin: &mut impl FnMut(&mut [f32])) {
        let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retired).into_iter().partition(Staging::idle);
        self.retired = running;
        for s in done {
            release(s, unpin);
        }
    }

    /// Waits for every copy, then unpins and frees every buffer the pool holds.
    pub(crate) fn drain(&mut self, unpin: &mut impl FnMut(&mut [f32])) {
        let all = std::mem::take(&mut self.spare).into_values().flatten().chain(std::mem::take(&mut self.retired));
        for s in all {
            if let Some(f) = &s.reading {
                f.wait();
            }
            release(s, unpin);
        }
    }
}

fn release<F>(mut s: Staging<F>, unpin: &mut impl FnMut(&mut [f32])) {
    if s.pinned {
        unpin(&mut s.buf);
    }
}

impl<'g, B: Backend<f32>> Staged<'g, B> {
    pub fn new(be: B, group: &'g Group) -> Self {
        Staged { be, group, in_flight: RefCell::new(BTreeMap::new()), pool: RefCell::new(StagingPool::default()) }
    }

    /// A host staging buffer of `len` elements.
    fn stage(&self, len: usize) -> Vec<f32> {
        self.pool.borrow_mut().take(len, |h| self.be.pin_host(h))
    }

    /// Gives a staging buffer back once only downloads and MPI used it.
    fn unstage(&self, h: Vec<f32>) {
        self.pool.borrow_mut().give_back(h, None, &mut |h| self.be.unpin_host(h));
    }

    /// Gives back a staging buffer an upload was just queued from: it is reused or released only
    /// after that upload has finished.
    fn unstage_uploaded(&self, h: Vec<f32>) {
        let reading = self.be.fence();
        self.pool.borrow_mut().give_back(h, reading, &mut |h| self.be.unpin_host(h));
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
        self.unstage_uploaded(host);
    }

    fn keep(&self, t: Ticket, send: B::Buf, recv: B::Buf) -> Ticket {
        self.in_flight.borrow_mut().insert(t.0, (send, recv));
        t
    }
}

impl<B: Backend<f32>> Drop for Staged<'_, B> {
    /// Unpins and frees the staging buffers once no copy reads them.
    fn drop(&mut self) {
        let be = &self.be;
        self.pool.get_mut().drain(&mut |h| be.unpin_host(h));
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
        self.unstage_uploaded(host);
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

/// Expert parallelism's all-to-all through host copies: the device path of every
/// communication backend (`docs/gpu.md`).
impl<B: Backend<f32>> ExpertExchange<B::Buf> for Staged<'_, B> {
    fn degree(&self) -> usize {
        self.group.size()
    }
    fn rank(&self) -> usize {
        self.group.rank()
    }
    fn exchange_counts(&self, send: &[u64]) -> Vec<u64> {
        self.group.all_to_all_u64(send)
    }
    fn exchange_rows(&self, send: &B::Buf, send_counts: &[usize], recv: &mut B::Buf, recv_counts: &[usize]) {
        let h = self.down(send);
        self.be.resize(recv, recv_counts.iter().sum());
        let mut r = self.stage(self.be.len(recv));
        self.group.all_to_all_v_f32(&h, send_counts, &mut r, recv_counts);
        self.be.upload(recv, &r);
        self.unstage(h);
        self.unstage_uploaded(r);
    }
}

/// The mesh's groups as [`Staged`] collectives on backend `B`.
pub struct StagedMesh<'g, B: Backend<f32>> {
    tp: Staged<'g, B>,
    cp: Staged<'g, B>,
    fsdp: Staged<'g, B>,
    dp_rep: Staged<'g, B>,
    expert_fsdp: Staged<'g, B>,
    ep: Staged<'g, B>,
}

impl<'g, B: Backend<f32> + Clone> StagedMesh<'g, B> {
    pub fn new(be: &B, mesh: &'g Mesh) -> Self {
        let staged = |g| Staged::new(be.clone(), g);
        StagedMesh {
            tp: staged(&mesh.tp),
            cp: staged(&mesh.cp),
            fsdp: staged(&mesh.fsdp),
            dp_rep: staged(&mesh.dp_rep),
            expert_fsdp: staged(&mesh.expert_fsdp),
            ep: staged(&mesh.ep),
        }
    }

    pub fn collectives(&self) -> MeshCollectives<'_, B::Buf> {
        MeshCollectives { tp: &self.tp, cp: &self.cp, fsdp: &self.fsdp, dp_rep: &self.dp_rep, expert_fsdp: &self.expert_fsdp, ep: &self.ep }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A copy whose completion the test decides.
    #[derive(Clone)]
    struct Copy(Rc<Cell<bool>>);

    impl Fence for Copy {
        fn done(&self) -> bool {
            self.0.get()
        }
        fn wait(&self) {
            self.0.set(true);
        }
    }

    /// No buffer with an outstanding copy is handed out again, unpinned or freed; once the
    /// copy has finished it is reused, or (a surplus one) unpinned and freed at the next give-back.
    #[test]
    fn the_staging_pool_never_releases_a_buffer_with_an_outstanding_copy() {
        let mut pool: StagingPool<Copy> = StagingPool::default();
        let unpinned = Rc::new(Cell::new(0usize));
        let mut unpin = |_: &mut [f32]| unpinned.set(unpinned.get() + 1);
        let bufs: Vec<Vec<f32>> = (0..3).map(|_| pool.take(8, |_| true)).collect();
        let addr: Vec<usize> = bufs.iter().map(|b| b.as_ptr() as usize).collect();
        let copies: Vec<Copy> = (0..3).map(|_| Copy(Rc::new(Cell::new(false)))).collect();
        for (b, c) in bufs.into_iter().zip(&copies) {
            pool.give_back(b, Some(c.clone()), &mut unpin);
        }
        // Two spares (both still read) and one surplus, retired: nothing released yet.
        assert_eq!(unpinned.get(), 0);
        assert_eq!(pool.retired.len(), 1);
        // While both spares are read, a buffer taken is a new one; given back unread as a
        // surplus, it is released at once, while the retired one's copy still runs.
        let fresh = pool.take(8, |_| true);
        assert!(!addr.contains(&(fresh.as_ptr() as usize)));
        pool.give_back(fresh, None, &mut unpin);
        assert_eq!(unpinned.get(), 1);
        assert_eq!(pool.retired.iter().map(|s| s.buf.as_ptr() as usize).collect::<Vec<_>>(), [addr[2]]);
        // The first spare's copy finishes: it is the one handed out next.
        copies[0].0.set(true);
        let again = pool.take(8, |_| true);
        assert_eq!(again.as_ptr() as usize, addr[0]);
        // The retired buffer's copy finishes: released at the next give-back.
        copies[2].0.set(true);
        pool.give_back(again, None, &mut unpin);
        assert_eq!(unpinned.get(), 2);
        assert!(pool.retired.is_empty());
        // Dropping waits for the copy still running, then releases both spares.
        pool.drain(&mut unpin);
        assert_eq!(unpinned.get(), 4);
        assert!(copies.iter().all(|c| c.0.get()));
    }
}
