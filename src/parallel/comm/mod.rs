//! Communication: MPI start-up and shut-down, groups of ranks, collectives and their counters.
//!
//! The only module that names `mpi::`. A [`Group`] wraps one communicator of the mesh and
//! records, per collective kind, how many calls, bytes and seconds it spent, so logs and tests
//! read measured volumes. A group of size 1 returns at once from every collective: call sites
//! never special-case a degree of 1. While a rank blocks in a collective, [`in_collective`] says
//! so (the watchdog reads it). Knows nothing of the model, of what the buffers mean, or of who
//! watches it.
//!
//! * `runtime` — MPI's life (initialise, finalise) and the abort policy: a panic or a failure
//!   only one rank saw ends every rank with `MPI_Abort`;
//! * `group` — [`Group`], its blocking collectives and its counters;
//! * `nonblocking` — collectives and point-to-point transfers that own their buffers until
//!   completed ([`Ticket`]), and the ring exchange of context parallelism;
//! * `raw` — blocking collectives on memory MPI reads through raw pointers (a CUDA-aware MPI's
//!   device buffers).

mod group;
mod nonblocking;
mod raw;
mod runtime;

pub use group::{CommCount, Group};
pub use nonblocking::Ticket;
pub use raw::RawCollective;
pub use runtime::{abort, cuda_aware, fail, library_version, world_rank, Runtime};

use mpi::ffi;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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
