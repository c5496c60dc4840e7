//! What this rank's threads can do on the host, measured: the f32 GEMM rate (the MFU
//! denominator when the deck states no `[hardware] peak_flops_per_rank`) and the memory
//! bandwidth (`ndtrain probe`, for the planner's `[hardware]`).

use super::gemm::{matmul, Mat, MatMut};
use std::time::Instant;

/// Measured f32 GEMM rate of this rank on its threads (FLOP/s): the best of a few 1024³
/// products.
pub fn gemm_flops() -> f64 {
    let n = 1024;
    let a = vec![1.0f32; n * n];
    let b = vec![0.5f32; n * n];
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t = Instant::now();
        matmul(MatMut::rm(&mut c, n, n), Mat::rm(&a, n, n), Mat::rm(&b, n, n), false);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * n * n) as f64 / best
}

/// Memory bandwidth of this rank on its threads (bytes/s): best of a few STREAM-style triads
/// `a = b + s·c` over three 64 MiB arrays (read b and c, write a: 3 × 64 MiB moved).
pub fn memory_bandwidth() -> f64 {
    use rayon::prelude::*;
    let n = 16 << 20;
    let b = vec![1.0f32; n];
    let c = vec![2.0f32; n];
    let mut a = vec![0.0f32; n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        a.par_chunks_mut(1 << 16).zip(b.par_chunks(1 << 16)).zip(c.par_chunks(1 << 16)).for_each(|((a, b), c)| {
            for ((x, y), z) in a.iter_mut().zip(b).zip(c) {
                *x = y + 3.0 * z;
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&a);
    3.0 * 4.0 * n as f64 / best
}
