//! MPI's life in the process and the abort policy: initialisation (also as a singleton
//! without a launcher), finalisation, and `MPI_Abort` for a panic or a failure that only this
//! rank may have seen, so no other rank waits forever in a collective.

use super::Group;
use mpi::topology::{Communicator, SimpleCommunicator};

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
