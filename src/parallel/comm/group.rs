//! [`Group`]: one communicator of the mesh, its blocking collectives and its counters.

use super::nonblocking::InFlight;
use super::{waiting, RawComm};
use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use mpi::datatype::{Equivalence, Partition, PartitionMut};
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::Instant;

/// Calls, bytes and seconds of one collective kind on one group.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommCount {
    pub calls: u64,
    pub bytes: u64,
    pub seconds: f64,
}

/// One communicator of the mesh.
pub struct Group {
    name: &'static str,
    pub(super) comm: SimpleCommunicator,
    pub(super) rank: usize,
    pub(super) size: usize,
    counts: RefCell<BTreeMap<&'static str, CommCount>>,
    /// The non-blocking operations in flight and their spare buffers.
    pub(super) in_flight: InFlight,
    /// The send side of blocking in-place all-reduces (grows to the largest, then reused).
    reduce_scratch: RefCell<Vec<u64>>,
}

impl Group {
    pub(super) fn new(name: &'static str, comm: SimpleCommunicator) -> Group {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Group {
            name,
            comm,
            rank,
            size,
            counts: RefCell::new(BTreeMap::new()),
            in_flight: InFlight::default(),
            reduce_scratch: RefCell::new(vec![]),
        }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }
    /// This rank's coordinate in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The group's degree.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Splits this group: ranks with equal `color` form a new group, ordered by `key`.
    pub fn split(&self, name: &'static str, color: usize, key: usize) -> Group {
        let comm = self
            .comm
            .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            .expect("a rank with a defined colour always gets a communicator");
        Group::new(name, comm)
    }

    /// The ranks of this group that share a node (for the node-local rank and threads).
    pub fn split_shared(&self) -> Group {
        Group::new("node", self.comm.split_shared(self.rank as i32))
    }

    pub(super) fn record(&self, kind: &'static str, bytes: usize, start: Instant) {
        self.add(kind, bytes, start.elapsed().as_secs_f64());
    }

    fn add(&self, kind: &'static str, bytes: usize, seconds: f64) {
        let mut c = self.counts.borrow_mut();
        let e = c.entry(kind).or_default();
        e.calls += 1;
        e.bytes += bytes as u64;
        e.seconds += seconds;
    }

    /// Counts one collective another library ran on this group's ranks (NCCL on a device's
    /// buffers, timed there: `seconds` from its start to its end on the device), so the
    /// group's counters hold all of its traffic.
    pub fn count(&self, kind: &'static str, bytes: usize, seconds: f64) {
        if self.size > 1 {
            self.add(kind, bytes, seconds);
        }
    }

    /// Counters per collective kind since the last `take_counts`.
    pub fn take_counts(&self) -> BTreeMap<&'static str, CommCount> {
        std::mem::take(&mut *self.counts.borrow_mut())
    }

    fn all_reduce_in_place<T: Equivalence + Copy>(&self, buf: &mut [T], op: SystemOperation) {
        if self.size == 1 {
            return;
        }
        let start = Instant::now();
        // rsmpi has no MPI_IN_PLACE (its value differs between MPIs): the input goes through a
        // scratch buffer the group keeps, so a per-step collective never allocates.
        assert!(std::mem::align_of::<T>() <= std::mem::align_of::<u64>(), "all_reduce: element alignment above 8");
        let mut scratch = self.reduce_scratch.borrow_mut();
        let words = std::mem::size_of_val(buf).div_ceil(8);
        if scratch.len() < words {
            scratch.resize(words, 0);
        }
        // SAFETY: the scratch holds at least size_of_val(buf) bytes, aligned for u64 and so for
        // T (asserted), and every element is written by copy_from_slice before it is read.
        let send = unsafe { std::slice::from_raw_parts_mut(scratch.as_mut_ptr() as *mut T, buf.len()) };
        send.copy_from_slice(buf);
        waiting(|| self.comm.all_reduce_into(&send[..], buf, op));
        self.record("all_reduce", std::mem::size_of_val(buf), start);
    }

    /// Element-wise sum across the group, in place.
    pub fn all_reduce_sum_f64(&self, buf: &mut [f64]) {
        self.all_reduce_in_place(buf, SystemOperation::sum());
    }

    /// Element-wise sum across the group, in place.
    pub fn all_reduce_sum_f32(&self, buf: &mut [f32]) {
        self.all_reduce_in_place(buf, SystemOperation::sum());
    }

    /// Element-wise maximum across the group, in place.
    pub fn all_reduce_max_f32(&self, buf: &mut [f32]) {
        self.all_reduce_in_place(buf, SystemOperation::max());
    }

    /// Element-wise maximum across the group, in place (agreement on flags and errors).
    pub fn all_reduce_max_u64(&self, buf: &mut [u64]) {
        self.all_reduce_in_place(buf, SystemOperation::max());
    }

    /// Gathers every rank's `send` into `recv` (`[size][send.len()]`, rank order).
    /// Counted bytes: the gathered output.
    pub fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) {
        assert_eq!(recv.len(), send.len() * self.size, "all_gather: recv must hold size × send");
        if self.size == 1 {
            recv.copy_from_slice(send);
            return;
        }
        let start = Instant::now();
        waiting(|| self.comm.all_gather_into(send, recv));
        self.record("all_gather", std::mem::size_of_val(recv), start);
    }

    /// Sums `send` (`[size][recv.len()]`) across the group and leaves block `rank` in `recv`.
    /// Counted bytes: the input.
    pub fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        assert_eq!(send.len(), recv.len() * self.size, "reduce_scatter: send must hold size × recv");
        if self.size == 1 {
            recv.copy_from_slice(send);
            return;
        }
        let start = Instant::now();
        waiting(|| self.comm.reduce_scatter_block_into(send, recv, SystemOperation::sum()));
        self.record("reduce_scatter", std::mem::size_of_val(send), start);
    }

    /// Every rank's `send[q·k..(q+1)·k]` goes to rank q, where `k = send.len() / size`: returns
    /// `[size][k]`, block p from rank p. Routing counts (a few integers per rank): not counted.
    pub fn all_to_all_u64(&self, send: &[u64]) -> Vec<u64> {
        assert_eq!(send.len() % self.size, 0, "all_to_all: send must hold size blocks");
        if self.size == 1 {
            return send.to_vec();
        }
        let mut recv = vec![0u64; send.len()];
        waiting(|| self.comm.all_to_all_into(send, &mut recv[..]));
        recv
    }

    /// Sends `send_counts[q]` elements of `send` (consecutive, rank by rank) to rank q and
    /// receives `recv_counts[p]` from rank p into `recv` (rank by rank). Counted bytes: what
    /// leaves this rank for the others (its own block is copied, not sent).
    pub fn all_to_all_v_f32(&self, send: &[f32], send_counts: &[usize], recv: &mut [f32], recv_counts: &[usize]) {
        assert_eq!((send_counts.len(), recv_counts.len()), (self.size, self.size), "all_to_all_v: one count per rank");
        assert_eq!(send.len(), send_counts.iter().sum::<usize>(), "all_to_all_v: send holds the sum of the counts");
        assert_eq!(recv.len(), recv_counts.iter().sum::<usize>(), "all_to_all_v: recv holds the sum of the counts");
        let displs = |c: &[usize]| -> Vec<i32> { c.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n as i32))).collect() };
        if self.size == 1 {
            recv.copy_from_slice(send);
            return;
        }
        let start = Instant::now();
        let (sc, rc): (Vec<i32>, Vec<i32>) =
            (send_counts.iter().map(|&n| n as i32).collect(), recv_counts.iter().map(|&n| n as i32).collect());
        let (sd, rd) = (displs(send_counts), displs(recv_counts));
        // Empty vectors share one dangling address, which Open MPI refuses as aliased buffers:
        // an empty side gets a one-element scratch (its counts are zero, it is never touched).
        let (one_send, mut one_recv) = ([0f32; 1], [0f32; 1]);
        let send = if send.is_empty() { &one_send[..] } else { send };
        let recv: &mut [f32] = if recv.is_empty() { &mut one_recv[..] } else { recv };
        let parts = Partition::new(send, &sc[..], &sd[..]);
        let mut into = PartitionMut::new(recv, &rc[..], &rd[..]);
        waiting(|| self.comm.all_to_all_varcount_into(&parts, &mut into));
        let sent: usize = send_counts.iter().enumerate().filter(|&(q, _)| q != self.rank).map(|(_, &n)| n).sum();
        self.record("all_to_all", sent * 4, start);
    }

    /// Minimum and maximum of one value across the group (for run summaries).
    pub fn min_max_sum_f64(&self, x: f64) -> (f64, f64, f64) {
        if self.size == 1 {
            return (x, x, x);
        }
        let (mut lo, mut hi, mut sum) = (0.0, 0.0, 0.0);
        self.comm.all_reduce_into(&x, &mut lo, SystemOperation::min());
        self.comm.all_reduce_into(&x, &mut hi, SystemOperation::max());
        self.comm.all_reduce_into(&x, &mut sum, SystemOperation::sum());
        (lo, hi, sum)
    }

    pub fn barrier(&self) {
        if self.size > 1 {
            waiting(|| self.comm.barrier());
        }
    }

    /// Element-wise sum modulo 2^64 (unsigned overflow wraps in MPI as in C), in place: combines
    /// the per-rank parts of an additive checksum.
    pub fn all_reduce_wrapping_sum_u64(&self, buf: &mut [u64]) {
        self.all_reduce_in_place(buf, SystemOperation::sum());
    }

    /// Element-wise maximum across the group, in place, not counted in the step's traffic: the
    /// once-per-step agreement on control flags (stop requested, I/O failed).
    pub fn agree_max_u64(&self, buf: &mut [u64]) {
        if self.size > 1 {
            let send = buf.to_vec();
            waiting(|| self.comm.all_reduce_into(&send[..], buf, SystemOperation::max()));
        }
    }

    /// How many ranks of the group pass `true` (control flow, not counted in the traffic).
    pub fn count_true(&self, local: bool) -> usize {
        let mine = local as u64;
        if self.size == 1 {
            return mine as usize;
        }
        let mut total = 0u64;
        waiting(|| self.comm.all_reduce_into(&mine, &mut total, SystemOperation::sum()));
        total as usize
    }

    /// Agrees on an outcome: `Ok` on every rank only if it is `Ok` on every rank; otherwise
    /// every rank returns the message of the lowest rank that failed, naming that rank, so
    /// whichever rank reports it says why.
    pub fn agree<T>(&self, local: Result<T, String>) -> Result<T, String> {
        let mut who = [if local.is_err() { u64::MAX - self.rank as u64 } else { 0 }];
        self.agree_max_u64(&mut who);
        if who[0] == 0 {
            return local;
        }
        let root = (u64::MAX - who[0]) as usize;
        let mut text = match &local {
            Err(e) if self.rank == root => e.clone().into_bytes(),
            _ => vec![],
        };
        self.broadcast_bytes(root, &mut text);
        let text = String::from_utf8_lossy(&text);
        // A message that already names its rank is passed on as it is.
        Err(if text.starts_with("rank ") { text.into_owned() } else { format!("rank {root}: {text}") })
    }

    /// `root`'s bytes on every rank (`data` is resized to them).
    pub fn broadcast_bytes(&self, root: usize, data: &mut Vec<u8>) {
        if self.size > 1 {
            let proc = self.comm.process_at_rank(root as i32);
            let mut len = [data.len() as u64];
            proc.broadcast_into(&mut len[..]);
            data.resize(len[0] as usize, 0);
            proc.broadcast_into(&mut data[..]);
        }
    }

    /// Every rank's bytes, in rank order, on every rank (not counted in the step's traffic:
    /// start-up facts such as host names and CPU lists).
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Vec<Vec<u8>> {
        if self.size == 1 {
            return vec![mine.to_vec()];
        }
        let mut counts = vec![0i32; self.size];
        waiting(|| self.comm.all_gather_into(&(mine.len() as i32), &mut counts[..]));
        let displs: Vec<i32> = counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect();
        let mut all = vec![0u8; counts.iter().map(|&c| c as usize).sum()];
        if all.is_empty() {
            // Nothing to move, and empty send and receive vectors share one dangling address,
            // which Open MPI refuses as an aliased buffer (MPI_ERR_ARG).
            return vec![vec![]; self.size];
        }
        let mut parts = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
        waiting(|| self.comm.all_gather_varcount_into(mine, &mut parts));
        counts.iter().zip(&displs).map(|(&c, &d)| all[d as usize..(d + c) as usize].to_vec()).collect()
    }

    /// The MPI communicator, for libraries that take one (parallel HDF5's MPI-IO driver).
    pub fn raw(&self) -> RawComm {
        self.comm.as_raw()
    }
}
