//! Communication: MPI start-up and shut-down, groups of ranks, collectives and their counters.
//!
//! The only module that touches `mpi::`. A `Group` wraps one communicator of the mesh and
//! records, per collective kind, how many calls, bytes and seconds it spent, so logs and tests
//! read measured volumes. A group of size 1 returns at once from every collective: call sites
//! never special-case a degree of 1. Non-blocking collectives own their buffers until they
//! complete: `start_*` hands them over and returns a [`Ticket`], `wait` gives them back. While a
//! rank blocks in a collective, [`in_collective`] says so (the watchdog reads it). Knows
//! nothing of the model, of what the buffers mean, or of who watches it.

use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use mpi::datatype::{Equivalence, PartitionMut};
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

/// An MPI communicator handle, for the libraries that take one (parallel HDF5's MPI-IO driver).
pub type RawComm = ffi::MPI_Comm;

/// Non-blocking operations of this process not yet known to be complete.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// The calling thread is blocked in a collective, waiting for the other ranks.
static IN_COLLECTIVE: AtomicBool = AtomicBool::new(false);

/// Whether this process is blocked in a collective right now: a rank waiting there is usually
/// waiting for a rank that is stuck elsewhere (read by the watchdog to name the right rank).
pub fn in_collective() -> bool {
    IN_COLLECTIVE.load(Ordering::Relaxed)
}

/// Runs a blocking collective with [`in_collective`] set.
fn waiting<R>(f: impl FnOnce() -> R) -> R {
    IN_COLLECTIVE.store(true, Ordering::Relaxed);
    let r = f();
    IN_COLLECTIVE.store(false, Ordering::Relaxed);
    r
}

/// Lets MPI move every non-blocking operation in flight, without blocking. MPI progresses them
/// only inside MPI calls (Open MPI's shared-memory transfers and its non-blocking collectives'
/// rounds, MPICH alike), so compute calls this between its large pieces of work. A probe
/// enters the progress engine and matches nothing; with nothing in flight it returns at once
/// without calling MPI.
pub fn progress() {
    if IN_FLIGHT.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut flag = 0;
    // SAFETY: MPI is initialised while anything is in flight (every Pending completes before
    // finalisation); the probe only reads the message queue.
    unsafe {
        ffi::MPI_Iprobe(ffi::RSMPI_ANY_SOURCE, ffi::RSMPI_ANY_TAG, ffi::RSMPI_COMM_WORLD, &mut flag, ffi::RSMPI_STATUS_IGNORE);
    }
}

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

/// Whether the MPI library says it takes device (CUDA) buffers itself: Open MPI's
/// `MPIX_Query_cuda_support`, looked up at run time; an MPI without the symbol says no.
pub fn cuda_aware() -> bool {
    // SAFETY: dlsym with RTLD_DEFAULT only looks a name up in the loaded libraries; where it is
    // found it is Open MPI's `int MPIX_Query_cuda_support(void)`, which takes nothing and may be
    // called after MPI_Init.
    unsafe {
        let sym = libc::dlsym(libc::RTLD_DEFAULT, c"MPIX_Query_cuda_support".as_ptr());
        if sym.is_null() {
            return false;
        }
        let query: extern "C" fn() -> libc::c_int = std::mem::transmute(sym);
        query() != 0
    }
}

/// Ends the job from this rank for a failure only it may have seen (a device fault): prints
/// `error: rank R: MESSAGE` as one write and aborts every rank with the run-failure code.
pub fn fail(message: &str) -> ! {
    use std::io::Write;
    let line = format!("error: rank {}: {message}\n", world_rank());
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
    abort(crate::exit::RUN_FAILED)
}

/// The rank of this process in the world (0 before MPI is up or after it is down).
pub fn world_rank() -> usize {
    if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
        SimpleCommunicator::world().rank() as usize
    } else {
        0
    }
}

/// The MPI library's description of itself (`MPI_Get_library_version`): its first line names
/// the implementation and version (`Open MPI v4.1.4, …`, `MPICH Version: 4.1`). Any time after
/// [`Runtime::init`].
pub fn library_version() -> String {
    let v = mpi::environment::library_version().unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
    v.trim_end_matches(['\0', '\n', ' ']).to_string()
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
            abort(crate::exit::RUN_FAILED);
        }
    }));
}

/// A non-blocking collective started on a [`Group`] (or on another implementation of a group's
/// collectives, `parallel::collective`), to be completed by its `wait`.
#[derive(Debug, PartialEq, Eq)]
pub struct Ticket(pub(super) u64);

impl Ticket {
    /// The number that tells this ticket from the group's others.
    pub fn id(&self) -> u64 {
        self.0
    }
}

/// A non-blocking collective in flight. It owns its buffers, so nothing can read or write
/// them before it completes; dropping it waits for completion.
struct Pending {
    request: ffi::MPI_Request,
    /// A second request (the receive of a point-to-point exchange), or MPI_REQUEST_NULL.
    request2: ffi::MPI_Request,
    send: Vec<f32>,
    recv: Vec<f32>,
    done: bool,
    kind: &'static str,
    bytes: usize,
}

impl Pending {
    fn new(kind: &'static str, bytes: usize, send: Vec<f32>, recv: Vec<f32>) -> Pending {
        // SAFETY: reading the MPI_REQUEST_NULL handle constant.
        let request = unsafe { ffi::RSMPI_REQUEST_NULL };
        IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
        Pending { request, request2: request, send, recv, done: false, kind, bytes }
    }

    fn completed(kind: &'static str, bytes: usize, send: Vec<f32>, recv: Vec<f32>) -> Pending {
        let mut p = Pending::new(kind, bytes, send, recv);
        p.mark_done();
        p
    }

    fn mark_done(&mut self) {
        if !self.done {
            self.done = true;
            IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn finish(&mut self) {
        if !self.done {
            // SAFETY: both are live requests of this process or MPI_REQUEST_NULL (for which
            // MPI_Wait returns at once); MPI_Wait completes them.
            unsafe {
                ffi::MPI_Wait(&mut self.request, ffi::RSMPI_STATUS_IGNORE);
                ffi::MPI_Wait(&mut self.request2, ffi::RSMPI_STATUS_IGNORE);
            }
            self.mark_done();
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A collective on raw pointers ([`Group::raw_collective`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawCollective {
    AllReduceSum,
    AllReduceMax,
    AllGather,
    ReduceScatterSum,
    /// Send to the next rank of the group, receive from the previous (tag = the slot).
    RingShift(usize),
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
    /// Ring exchanges in flight, by slot (at most a few at a time).
    ring: RefCell<BTreeMap<usize, Pending>>,
    /// Buffers of finished ring exchanges, reused by the next ones (no allocation per shift).
    ring_spare: RefCell<Vec<Vec<f32>>>,
    /// Non-blocking collectives in flight, by ticket.
    in_flight: RefCell<BTreeMap<u64, Pending>>,
    next_ticket: Cell<u64>,
    /// The send side of blocking in-place all-reduces (grows to the largest, then reused).
    reduce_scratch: RefCell<Vec<u64>>,
}

impl Group {
    fn new(name: &'static str, comm: SimpleCommunicator) -> Group {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Group {
            name,
            comm,
            rank,
            size,
            counts: RefCell::new(BTreeMap::new()),
            ring: RefCell::new(BTreeMap::new()),
            ring_spare: RefCell::new(vec![]),
            in_flight: RefCell::new(BTreeMap::new()),
            next_ticket: Cell::new(0),
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

    fn record(&self, kind: &'static str, bytes: usize, start: Instant) {
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

    /// Starts a non-blocking all-gather of `send` into `recv` (`[size][send.len()]`). The
    /// buffers move into the returned [`Pending`] and come back from [`Group::wait`].
    pub fn start_all_gather_f32(&self, send: Vec<f32>, mut recv: Vec<f32>) -> Ticket {
        assert_eq!(recv.len(), send.len() * self.size, "all_gather: recv must hold size × send");
        let bytes = std::mem::size_of_val(&recv[..]);
        if self.size == 1 {
            recv.copy_from_slice(&send);
            return self.keep(Pending::completed("all_gather", bytes, send, recv));
        }
        let mut p = Pending::new("all_gather", bytes, send, recv);
        // SAFETY: the buffers are owned by `p` and not touched until the request completes
        // (in `wait`, or in `Drop`); a Vec's heap storage does not move when the Vec does.
        unsafe {
            ffi::MPI_Iallgather(
                p.send.as_ptr() as *const c_void,
                p.send.len() as i32,
                ffi::RSMPI_FLOAT,
                p.recv.as_mut_ptr() as *mut c_void,
                p.send.len() as i32,
                ffi::RSMPI_FLOAT,
                self.comm.as_raw(),
                &mut p.request,
            );
        }
        self.keep(p)
    }

    /// Starts a non-blocking element-wise sum of `buf` across the group; the sum comes back
    /// as the second buffer of [`Group::wait`].
    pub fn start_all_reduce_sum_f32(&self, send: Vec<f32>, mut recv: Vec<f32>) -> Ticket {
        assert_eq!(recv.len(), send.len(), "all_reduce: buffers differ in length");
        let bytes = std::mem::size_of_val(&send[..]);
        if self.size == 1 {
            recv.copy_from_slice(&send);
            return self.keep(Pending::completed("all_reduce", bytes, send, recv));
        }
        let mut p = Pending::new("all_reduce", bytes, send, recv);
        // SAFETY: as in `start_all_gather_f32`.
        unsafe {
            ffi::MPI_Iallreduce(
                p.send.as_ptr() as *const c_void,
                p.recv.as_mut_ptr() as *mut c_void,
                p.send.len() as i32,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                self.comm.as_raw(),
                &mut p.request,
            );
        }
        self.keep(p)
    }

    /// Starts a non-blocking reduce-scatter: `send` (`[size][recv.len()]`) summed across the
    /// group, block `rank` into `recv`. Buffers as in [`Group::start_all_gather_f32`].
    /// Counted bytes: the input.
    pub fn start_reduce_scatter_sum_f32(&self, send: Vec<f32>, mut recv: Vec<f32>) -> Ticket {
        assert_eq!(send.len(), recv.len() * self.size, "reduce_scatter: send must hold size × recv");
        let bytes = std::mem::size_of_val(&send[..]);
        if self.size == 1 {
            recv.copy_from_slice(&send);
            return self.keep(Pending::completed("reduce_scatter", bytes, send, recv));
        }
        let mut p = Pending::new("reduce_scatter", bytes, send, recv);
        // SAFETY: as in `start_all_gather_f32`.
        unsafe {
            ffi::MPI_Ireduce_scatter_block(
                p.send.as_ptr() as *const c_void,
                p.recv.as_mut_ptr() as *mut c_void,
                p.recv.len() as i32,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                self.comm.as_raw(),
                &mut p.request,
            );
        }
        self.keep(p)
    }

    /// Starts sending `data` to rank `dest` of the group with `tag` (`MPI_Isend`); the buffer
    /// comes back as the first of [`Group::wait`]'s. Point-to-point, for the pipeline's
    /// activations and their gradients: posted as soon as they exist, completed later.
    pub fn start_send_f32(&self, dest: usize, tag: usize, data: Vec<f32>) -> Ticket {
        assert!(dest < self.size && dest != self.rank, "send to rank {dest} of a group of {}", self.size);
        let mut p = Pending::new("send", std::mem::size_of_val(&data[..]), data, vec![]);
        // SAFETY: as in `start_all_gather_f32`.
        unsafe {
            ffi::MPI_Isend(
                p.send.as_ptr() as *const c_void,
                p.send.len() as i32,
                ffi::RSMPI_FLOAT,
                dest as i32,
                tag as i32,
                self.comm.as_raw(),
                &mut p.request,
            );
        }
        self.keep(p)
    }

    /// Starts receiving `buf.len()` elements from rank `src` of the group with `tag`
    /// (`MPI_Irecv`); they come back as the second buffer of [`Group::wait`], whose blocked
    /// time is counted (how long this rank waited for its neighbour).
    pub fn start_recv_f32(&self, src: usize, tag: usize, buf: Vec<f32>) -> Ticket {
        assert!(src < self.size && src != self.rank, "receive from rank {src} of a group of {}", self.size);
        let mut p = Pending::new("recv", std::mem::size_of_val(&buf[..]), vec![], buf);
        // SAFETY: as in `start_all_gather_f32`.
        unsafe {
            ffi::MPI_Irecv(
                p.recv.as_mut_ptr() as *mut c_void,
                p.recv.len() as i32,
                ffi::RSMPI_FLOAT,
                src as i32,
                tag as i32,
                self.comm.as_raw(),
                &mut p.request,
            );
        }
        self.keep(p)
    }

    /// Holds `p` until [`Group::wait`] completes it.
    fn keep(&self, p: Pending) -> Ticket {
        let id = self.next_ticket.get();
        self.next_ticket.set(id + 1);
        self.in_flight.borrow_mut().insert(id, p);
        Ticket(id)
    }

    /// Lets MPI progress the collective of `t` without blocking; true once it has completed.
    pub fn test(&self, t: &Ticket) -> bool {
        let mut in_flight = self.in_flight.borrow_mut();
        let p = in_flight.get_mut(&t.0).expect("a ticket of this group, not yet waited for");
        if !p.done {
            let mut flag = 0;
            // SAFETY: `p.request` is a live request of this process.
            unsafe { ffi::MPI_Test(&mut p.request, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            if flag != 0 {
                p.mark_done();
            }
        }
        p.done
    }

    /// Completes the collective of `t`, counting the time spent blocked here (the exposed part
    /// of the collective) and its bytes; returns its buffers `(send, recv)`.
    pub fn wait(&self, t: Ticket) -> (Vec<f32>, Vec<f32>) {
        let p = self.in_flight.borrow_mut().remove(&t.0).expect("a ticket of this group, waited for once");
        self.complete(p)
    }

    fn complete(&self, mut p: Pending) -> (Vec<f32>, Vec<f32>) {
        let start = Instant::now();
        waiting(|| p.finish());
        if self.size > 1 {
            self.record(p.kind, p.bytes, start);
        }
        (std::mem::take(&mut p.send), std::mem::take(&mut p.recv))
    }

    /// Starts a ring step in the background: a copy of `data` goes to the next rank while the
    /// previous rank's block is received (`MPI_Isend` + `MPI_Irecv`, tag = `slot`), so the
    /// caller computes on `data` meanwhile. [`Group::finish_ring_shift_f32`] completes it.
    pub fn start_ring_shift_f32(&self, slot: usize, data: &[f32]) {
        let bytes = std::mem::size_of_val(data);
        let buffer = || {
            let mut v = self.ring_spare.borrow_mut().pop().unwrap_or_default();
            v.clear();
            v.resize(data.len(), 0.0);
            v
        };
        let mut send = buffer();
        send.copy_from_slice(data);
        let mut p = Pending::new("ring", bytes, send, buffer());
        if self.size > 1 {
            let next = ((self.rank + 1) % self.size) as i32;
            let prev = ((self.rank + self.size - 1) % self.size) as i32;
            // SAFETY: the buffers are owned by `p` (kept in `self.ring` until completion) and a
            // Vec's heap storage does not move when the Vec does.
            unsafe {
                ffi::MPI_Isend(
                    p.send.as_ptr() as *const c_void,
                    p.send.len() as i32,
                    ffi::RSMPI_FLOAT,
                    next,
                    slot as i32,
                    self.comm.as_raw(),
                    &mut p.request,
                );
                ffi::MPI_Irecv(
                    p.recv.as_mut_ptr() as *mut c_void,
                    p.recv.len() as i32,
                    ffi::RSMPI_FLOAT,
                    prev,
                    slot as i32,
                    self.comm.as_raw(),
                    &mut p.request2,
                );
            }
        } else {
            p.recv.copy_from_slice(&p.send);
            p.mark_done();
        }
        let old = self.ring.borrow_mut().insert(slot, p);
        assert!(old.is_none(), "ring slot {slot} already in flight");
    }

    /// Completes the ring step of `slot` into `out` (the previous rank's block), counting the
    /// time blocked here (the exposed part) and the bytes sent.
    pub fn finish_ring_shift_f32(&self, slot: usize, out: &mut [f32]) {
        let p = self.ring.borrow_mut().remove(&slot).expect("finish_ring_shift_f32 after start_ring_shift_f32");
        let (send, recv) = self.complete(p);
        out.copy_from_slice(&recv);
        self.ring_spare.borrow_mut().extend([send, recv]);
    }

    /// Blocking collectives on memory the MPI library reads and writes through raw pointers: a
    /// device's buffers handed to a CUDA-aware MPI ([`cuda_aware`]). Counted like the host's.
    /// `count` is the elements of `send` (of `recv` for a reduce-scatter); the group has more
    /// than one rank (a lone rank's collective is a copy the caller makes).
    ///
    /// # Safety
    /// `send` and `recv` are valid for the elements the collective reads and writes (`recv` of
    /// an all-gather holds `size × count`, `send` of a reduce-scatter `size × count`), in
    /// memory this MPI accepts, do not overlap, and nothing else touches them (the device work
    /// that produced `send` has finished) until the call returns.
    pub unsafe fn raw_collective(&self, op: RawCollective, send: *const f32, recv: *mut f32, count: usize) {
        assert!(self.size > 1, "a raw collective over one rank: the caller copies");
        let start = Instant::now();
        let (s, r, n) = (send as *const c_void, recv as *mut c_void, count as i32);
        let comm = self.comm.as_raw();
        let (kind, bytes) = waiting(|| match op {
            RawCollective::AllReduceSum | RawCollective::AllReduceMax => {
                let mpi_op = if op == RawCollective::AllReduceSum { ffi::RSMPI_SUM } else { ffi::RSMPI_MAX };
                // SAFETY: as the caller guarantees.
                unsafe { ffi::MPI_Allreduce(s, r, n, ffi::RSMPI_FLOAT, mpi_op, comm) };
                ("all_reduce", 4 * count)
            }
            RawCollective::AllGather => {
                // SAFETY: as the caller guarantees.
                unsafe { ffi::MPI_Allgather(s, n, ffi::RSMPI_FLOAT, r, n, ffi::RSMPI_FLOAT, comm) };
                ("all_gather", 4 * count * self.size)
            }
            RawCollective::ReduceScatterSum => {
                // SAFETY: as the caller guarantees.
                unsafe { ffi::MPI_Reduce_scatter_block(s, r, n, ffi::RSMPI_FLOAT, ffi::RSMPI_SUM, comm) };
                ("reduce_scatter", 4 * count * self.size)
            }
            RawCollective::RingShift(slot) => {
                let next = ((self.rank + 1) % self.size) as i32;
                let prev = ((self.rank + self.size - 1) % self.size) as i32;
                let tag = slot as i32;
                // SAFETY: as the caller guarantees; the send and the receive are one call.
                unsafe {
                    ffi::MPI_Sendrecv(s, n, ffi::RSMPI_FLOAT, next, tag, r, n, ffi::RSMPI_FLOAT, prev, tag, comm, ffi::RSMPI_STATUS_IGNORE)
                };
                ("ring", 4 * count)
            }
        });
        self.record(kind, bytes, start);
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
        let mut parts = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
        waiting(|| self.comm.all_gather_varcount_into(mine, &mut parts));
        counts.iter().zip(&displs).map(|(&c, &d)| all[d as usize..(d + c) as usize].to_vec()).collect()
    }

    /// The MPI communicator, for libraries that take one (parallel HDF5's MPI-IO driver).
    pub fn raw(&self) -> RawComm {
        self.comm.as_raw()
    }
}
