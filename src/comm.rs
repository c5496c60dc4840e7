//! Communication: MPI start-up and shut-down, groups of ranks, collectives and their counters.
//!
//! The only module that touches `mpi::`. A `Group` wraps one communicator of the mesh and
//! records, per collective kind, how many calls, bytes and seconds it spent, so logs and tests
//! read measured volumes. A group of size 1 returns at once from every collective: call sites
//! never special-case a degree of 1. Knows nothing of the model or of what the buffers mean.

use mpi::collective::{CommunicatorCollectives, SystemOperation};
use mpi::datatype::Equivalence;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::Instant;

/// MPI for the life of the program; finalises on drop.
pub struct Runtime {
    universe: Option<mpi::environment::Universe>,
}

impl Runtime {
    /// Initialises MPI (works as a singleton without a launcher) and installs the panic hook
    /// that turns a panic on any rank into `MPI_Abort`, so no other rank waits forever.
    pub fn init() -> Runtime {
        let universe = mpi::initialize().expect("MPI was already initialised");
        install_abort_on_panic();
        Runtime { universe: Some(universe) }
    }

    /// The group of every rank of the job.
    pub fn world(&self) -> Group {
        Group::new("world", self.universe.as_ref().expect("MPI is running").world())
    }

    /// Finalises MPI and exits the process with `code`.
    pub fn finalize_and_exit(mut self, code: i32) -> ! {
        drop(self.universe.take());
        std::process::exit(code)
    }
}

/// Ends every rank of the job: for errors that other ranks may not have seen.
pub fn abort(code: i32) -> ! {
    SimpleCommunicator::world().abort(code)
}

/// The rank of this process in the world (0 before MPI is up or after it is down).
pub fn world_rank() -> usize {
    if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
        SimpleCommunicator::world().rank() as usize
    } else {
        0
    }
}

fn install_abort_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let rank = world_rank();
        eprintln!("error: rank {rank} panicked: {info}");
        if std::env::var_os("RUST_BACKTRACE").is_some() {
            default(info);
        }
        if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
            abort(1);
        }
    }));
}

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
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    counts: RefCell<BTreeMap<&'static str, CommCount>>,
}

impl Group {
    fn new(name: &'static str, comm: SimpleCommunicator) -> Group {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Group { name, comm, rank, size, counts: RefCell::new(BTreeMap::new()) }
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

    fn record(&self, kind: &'static str, bytes: usize, start: Instant) {
        let mut c = self.counts.borrow_mut();
        let e = c.entry(kind).or_default();
        e.calls += 1;
        e.bytes += bytes as u64;
        e.seconds += start.elapsed().as_secs_f64();
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
        let send = buf.to_vec();
        self.comm.all_reduce_into(&send[..], buf, op);
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
        self.comm.all_gather_into(send, recv);
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
        self.comm.reduce_scatter_block_into(send, recv, SystemOperation::sum());
        self.record("reduce_scatter", std::mem::size_of_val(send), start);
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
            self.comm.barrier();
        }
    }
}
