//! Blocking collectives on memory the MPI library reads and writes through raw pointers: a
//! device's buffers handed to a CUDA-aware MPI ([`super::cuda_aware`]).

use super::{ffi, waiting, Group};
use mpi::raw::AsRaw;
use std::ffi::c_void;
use std::time::Instant;

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

impl Group {
    /// Blocking collectives on memory the MPI library reads and writes through raw pointers: a
    /// device's buffers handed to a CUDA-aware MPI ([`super::cuda_aware`]). Counted like the host's.
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
        let (s, r, n) = (send as *const c_void, recv as *mut c_void, super::nonblocking::mpi_count(count));
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
}
