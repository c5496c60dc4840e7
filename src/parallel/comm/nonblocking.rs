//! Non-blocking collectives and point-to-point transfers. Each owns its buffers until it
//! completes: `start_*` hands them over and returns a [`Ticket`], [`Group::wait`] gives them
//! back, so nothing can read or write a buffer in flight. MPI progresses them only inside MPI
//! calls ([`super::progress`]).

use super::{ffi, waiting, Group, IN_FLIGHT};
use mpi::raw::AsRaw;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// A non-blocking collective started on a [`Group`] (or on another implementation of a group's
/// collectives, `parallel::collective`), to be completed by its `wait`.
#[derive(Debug, PartialEq, Eq)]
pub struct Ticket(pub(in crate::parallel) u64);

impl Ticket {
    /// The number that tells this ticket from the group's others.
    pub fn id(&self) -> u64 {
        self.0
    }
}

/// A group's non-blocking operations in flight: the ring exchanges by slot (at most a few at a
/// time), the other operations by ticket, and the buffers of finished ring exchanges, reused by
/// the next ones (no allocation per shift).
#[derive(Default)]
pub(super) struct InFlight {
    ring: RefCell<BTreeMap<usize, Pending>>,
    ring_spare: RefCell<Vec<Vec<f32>>>,
    by_ticket: RefCell<BTreeMap<u64, Pending>>,
    next_ticket: Cell<u64>,
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

/// What an MPI call needs to start an operation on a [`Pending`]'s buffers: pointers into
/// buffers the `Pending` owns (a Vec's heap storage does not move when the Vec does), their
/// lengths, the communicator, and where the request goes.
struct Post {
    send: *const c_void,
    send_len: i32,
    recv: *mut c_void,
    recv_len: i32,
    comm: ffi::MPI_Comm,
    request: *mut ffi::MPI_Request,
}

/// `n` elements as the `int` count MPI takes; a larger message is a defect of the caller (the
/// largest tensor a rank sends is far below 2³¹ elements), so it ends the job with its size.
pub(super) fn mpi_count(n: usize) -> i32 {
    i32::try_from(n).unwrap_or_else(|_| panic!("an MPI message of {n} elements: above 2^31 - 1, the most one MPI call takes"))
}

impl Group {
    /// The skeleton every non-blocking operation shares: the buffers move into a [`Pending`],
    /// `post` starts the MPI operation on them, and the operation is kept until
    /// [`Group::wait`]. A collective (`lone_copies`) over a group of one completes at once,
    /// `recv` a copy of `send`.
    fn start(
        &self,
        kind: &'static str,
        bytes: usize,
        (send, mut recv): (Vec<f32>, Vec<f32>),
        lone_copies: bool,
        post: impl FnOnce(&Post),
    ) -> Ticket {
        if lone_copies && self.size == 1 {
            recv.copy_from_slice(&send);
            return self.keep(Pending::completed(kind, bytes, send, recv));
        }
        let mut p = Pending::new(kind, bytes, send, recv);
        post(&Post {
            send: p.send.as_ptr() as *const c_void,
            send_len: mpi_count(p.send.len()),
            recv: p.recv.as_mut_ptr() as *mut c_void,
            recv_len: mpi_count(p.recv.len()),
            comm: self.comm.as_raw(),
            request: &mut p.request,
        });
        self.keep(p)
    }

    /// Starts a non-blocking all-gather of `send` into `recv` (`[size][send.len()]`). The
    /// buffers come back from [`Group::wait`]. Counted bytes: the gathered output.
    pub fn start_all_gather_f32(&self, send: Vec<f32>, recv: Vec<f32>) -> Ticket {
        assert_eq!(recv.len(), send.len() * self.size, "all_gather: recv must hold size × send");
        let bytes = std::mem::size_of_val(&recv[..]);
        self.start("all_gather", bytes, (send, recv), true, |p| {
            // SAFETY: `p` points into buffers a `Pending` owns until the request completes.
            unsafe { ffi::MPI_Iallgather(p.send, p.send_len, ffi::RSMPI_FLOAT, p.recv, p.send_len, ffi::RSMPI_FLOAT, p.comm, p.request) };
        })
    }

    /// Starts a non-blocking element-wise sum of `send` across the group; the sum comes back
    /// as the second buffer of [`Group::wait`].
    pub fn start_all_reduce_sum_f32(&self, send: Vec<f32>, recv: Vec<f32>) -> Ticket {
        assert_eq!(recv.len(), send.len(), "all_reduce: buffers differ in length");
        let bytes = std::mem::size_of_val(&send[..]);
        self.start("all_reduce", bytes, (send, recv), true, |p| {
            // SAFETY: as in `start_all_gather_f32`.
            unsafe { ffi::MPI_Iallreduce(p.send, p.recv, p.send_len, ffi::RSMPI_FLOAT, ffi::RSMPI_SUM, p.comm, p.request) };
        })
    }

    /// Starts a non-blocking reduce-scatter: `send` (`[size][recv.len()]`) summed across the
    /// group, block `rank` into `recv`. Counted bytes: the input.
    pub fn start_reduce_scatter_sum_f32(&self, send: Vec<f32>, recv: Vec<f32>) -> Ticket {
        assert_eq!(send.len(), recv.len() * self.size, "reduce_scatter: send must hold size × recv");
        let bytes = std::mem::size_of_val(&send[..]);
        self.start("reduce_scatter", bytes, (send, recv), true, |p| {
            // SAFETY: as in `start_all_gather_f32`.
            unsafe { ffi::MPI_Ireduce_scatter_block(p.send, p.recv, p.recv_len, ffi::RSMPI_FLOAT, ffi::RSMPI_SUM, p.comm, p.request) };
        })
    }

    /// Starts sending `data` to rank `dest` of the group with `tag` (`MPI_Isend`); the buffer
    /// comes back as the first of [`Group::wait`]'s. Point-to-point, for the pipeline's
    /// activations and their gradients: posted as soon as they exist, completed later.
    pub fn start_send_f32(&self, dest: usize, tag: usize, data: Vec<f32>) -> Ticket {
        assert!(dest < self.size && dest != self.rank, "send to rank {dest} of a group of {}", self.size);
        let bytes = std::mem::size_of_val(&data[..]);
        self.start("send", bytes, (data, vec![]), false, |p| {
            // SAFETY: as in `start_all_gather_f32`.
            unsafe { ffi::MPI_Isend(p.send, p.send_len, ffi::RSMPI_FLOAT, dest as i32, tag as i32, p.comm, p.request) };
        })
    }

    /// Starts receiving `buf.len()` elements from rank `src` of the group with `tag`
    /// (`MPI_Irecv`); they come back as the second buffer of [`Group::wait`], whose blocked
    /// time is counted (how long this rank waited for its neighbour).
    pub fn start_recv_f32(&self, src: usize, tag: usize, buf: Vec<f32>) -> Ticket {
        assert!(src < self.size && src != self.rank, "receive from rank {src} of a group of {}", self.size);
        let bytes = std::mem::size_of_val(&buf[..]);
        self.start("recv", bytes, (vec![], buf), false, |p| {
            // SAFETY: as in `start_all_gather_f32`.
            unsafe { ffi::MPI_Irecv(p.recv, p.recv_len, ffi::RSMPI_FLOAT, src as i32, tag as i32, p.comm, p.request) };
        })
    }

    /// Holds `p` until [`Group::wait`] completes it.
    fn keep(&self, p: Pending) -> Ticket {
        let id = self.in_flight.next_ticket.get();
        self.in_flight.next_ticket.set(id + 1);
        self.in_flight.by_ticket.borrow_mut().insert(id, p);
        Ticket(id)
    }

    /// Lets MPI progress the collective of `t` without blocking; true once it has completed.
    pub fn test(&self, t: &Ticket) -> bool {
        let mut in_flight = self.in_flight.by_ticket.borrow_mut();
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
        let p = self.in_flight.by_ticket.borrow_mut().remove(&t.0).expect("a ticket of this group, waited for once");
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
            let mut v = self.in_flight.ring_spare.borrow_mut().pop().unwrap_or_default();
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
            // SAFETY: the buffers are owned by `p` (kept in the ring slots until completion) and a
            // Vec's heap storage does not move when the Vec does.
            unsafe {
                ffi::MPI_Isend(
                    p.send.as_ptr() as *const c_void,
                    mpi_count(p.send.len()),
                    ffi::RSMPI_FLOAT,
                    next,
                    slot as i32,
                    self.comm.as_raw(),
                    &mut p.request,
                );
                ffi::MPI_Irecv(
                    p.recv.as_mut_ptr() as *mut c_void,
                    mpi_count(p.recv.len()),
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
        let old = self.in_flight.ring.borrow_mut().insert(slot, p);
        assert!(old.is_none(), "ring slot {slot} already in flight");
    }

    /// Completes the ring step of `slot` into `out` (the previous rank's block), counting the
    /// time blocked here (the exposed part) and the bytes sent.
    pub fn finish_ring_shift_f32(&self, slot: usize, out: &mut [f32]) {
        let p = self.in_flight.ring.borrow_mut().remove(&slot).expect("finish_ring_shift_f32 after start_ring_shift_f32");
        let (send, recv) = self.complete(p);
        out.copy_from_slice(&recv);
        self.in_flight.ring_spare.borrow_mut().extend([send, recv]);
    }
}
