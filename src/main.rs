//! The `ndtrain` binary: the command line (`cli`) over the library, and the process's memory
//! allocator.

/// The system allocator, keeping the GEMM's packing buffers (one per GEMM thread) for reuse
/// instead of mapping and faulting them in again in every call (`backend::cpu::heap`).
#[global_allocator]
static HEAP: ndtrain::backend::cpu::heap::SpareBlockAlloc = ndtrain::backend::cpu::heap::SpareBlockAlloc::new();

fn main() {
    std::process::exit(ndtrain::cli::main());
}
