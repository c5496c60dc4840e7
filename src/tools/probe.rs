//! `ndtrain probe`: the f32 GEMM rate, the cores' f32 FMA peak and the memory bandwidth of this
//! process's threads, and the `[hardware]` line to paste into a deck (`docs/planning.md`).

use crate::backend::cpu::probe::{fma_peak_of, gemm_flops, memory_bandwidth, FmaKernel};

/// Measures on `threads` threads (0: every core) and returns the report.
pub fn report(threads: usize) -> String {
    let threads = if threads > 0 { threads } else { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) };
    crate::backend::cpu::use_threads(threads);
    let flops = gemm_flops();
    let fma = fma_peak_of(FmaKernel::detect(), threads, 20, std::time::Duration::from_millis(20));
    let bw = memory_bandwidth();
    format!(
        "f32 GEMM (1024³, best of 4) on {threads} thread(s): {flops:.3e} FLOP/s\n\
         f32 FMA peak ({}, {}-bit, best of 20 × 20 ms) on {} thread(s): {:.3e} FLOP/s\n\
         GEMM / FMA peak: {:.3} (the GEMM's efficiency on this machine)\n\
         memory bandwidth (triad a = b + s·c over 3 × 64 MiB, best of 5) on {threads} thread(s): {bw:.3e} bytes/s\n\
         \n[hardware]\npeak_flops_per_rank = {flops:.4e}\n\
         # MFU against the silicon instead: peak_flops_per_rank = {:.4e} (the FMA peak; docs/model.md)\n",
        fma.kernel.name(),
        fma.width_bits,
        fma.threads,
        fma.flops,
        flops / fma.flops,
        fma.flops
    )
}
