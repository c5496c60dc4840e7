//! Two independent GEMMs on two threads: each split across both threads (one band of the
//! output per thread, `backend::cpu::gemm::matmul`), one after the other, as `linear_bwd_input` +
//! `linear_bwd_weight` do; against the two side by side, one whole GEMM per thread
//! (`linear_bwd`, `linear_fwd_pair`); with one thread as the baseline. The shapes
//! are `bench_small`'s linear layers (N = 2048 tokens).
//!
//! The three ways alternate inside every repetition (1T, 2T split, 2T side by side, …), so a
//! load change on this shared machine hits them alike; each reports the median over the
//! repetitions. Every result is checked against the one-thread one (the same bits).
//!
//! `cargo bench --bench gemm_pairs -- [--reps 15]`

use ndtrain::backend::cpu::gemm::{linear_bwd, linear_bwd_input, linear_bwd_weight, linear_fwd, linear_fwd_pair};
use ndtrain::backend::cpu::set_gemm_threads;
use ndtrain::metrics::median;
use std::time::Instant;

/// The allocator the `ndtrain` binary runs with (`src/main.rs`), so the bench measures what
/// training does: the GEMM's packing buffers kept for reuse (`backend::cpu::heap`).
#[global_allocator]
static HEAP: ndtrain::backend::cpu::heap::SpareBlockAlloc = ndtrain::backend::cpu::heap::SpareBlockAlloc::new();

/// Tokens of a `bench_small` micro-batch (4 × 512).
const M: usize = 2048;

/// `(name, n, k)`: the layer's weight is `[n, k]`.
const LAYERS: [(&str, usize, usize); 4] = [
    ("q/k/v/o  [512, 512]", 512, 512),
    ("gate/up  [1536, 512]", 1536, 512),
    ("down     [512, 1536]", 512, 1536),
    ("lm_head [4096, 512]", 4096, 512),
];

fn filled(len: usize, seed: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 7 + seed) % 23) as f32 * 0.01 - 0.11).collect()
}

fn secs(f: impl FnOnce()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64()
}

fn main() {
    let mut reps = 15usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--reps" => reps = args.next().and_then(|v| v.parse().ok()).expect("--reps takes a count"),
            "--bench" => {}
            other => panic!("unknown argument {other}; usage: cargo bench --bench gemm_pairs -- [--reps N]"),
        }
    }
    rayon::ThreadPoolBuilder::new().num_threads(2).build_global().expect("the global pool is built once");
    println!(
        "| products | shape | 1 thread GFLOP/s | 2 threads, each GEMM split | 2 threads, side by side | split / 1T | side by side / 1T |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    for (name, n, k) in LAYERS {
        let (x, w, w2, dy) = (filled(M * k, 1), filled(n * k, 2), filled(n * k, 3), filled(M * n, 4));
        // Backward: dx = dy · w and dw += dyᵀ · x.
        let bwd_one = |threads: usize, joined: bool| {
            set_gemm_threads(threads);
            // Touched before the clock starts (the model reuses its buffers: no page faults there).
            let (mut dx, mut dw) = (vec![f32::NAN; M * k], vec![0.5f32; n * k]);
            let t = secs(|| {
                if joined {
                    linear_bwd(&mut dx, false, &mut dw, &dy, &x, &w, M, n, k);
                } else {
                    linear_bwd_weight(&mut dw, &dy, &x, M, n, k, true);
                    linear_bwd_input(&mut dx, &dy, &w, M, n, k, false);
                }
            });
            (t, dx, dw)
        };
        // Forward pair: y1 = x · wᵀ, y2 = x · w2ᵀ.
        let fwd_one = |threads: usize, joined: bool| {
            set_gemm_threads(threads);
            let (mut y1, mut y2) = (vec![f32::NAN; M * n], vec![f32::NAN; M * n]);
            let t = secs(|| {
                if joined {
                    linear_fwd_pair(&mut y1, &w, &mut y2, &w2, &x, M, n, k);
                } else {
                    linear_fwd(&mut y1, &x, &w, M, n, k, false);
                    linear_fwd(&mut y2, &x, &w2, M, n, k, false);
                }
            });
            (t, y1, y2)
        };
        let flops = 4.0 * (M * n * k) as f64;
        for (what, run) in [("dx + dw", &bwd_one as &dyn Fn(usize, bool) -> (f64, Vec<f32>, Vec<f32>)), ("fwd pair", &fwd_one)] {
            let mut times = [vec![], vec![], vec![]];
            for rep in 0..reps + 2 {
                let (t1, a1, b1) = run(1, false);
                let (t2, a2, b2) = run(2, false);
                let (t3, a3, b3) = run(2, true);
                assert!(a1 == a2 && a1 == a3 && b1 == b2 && b1 == b3, "{what} {name}: the three ways disagree");
                if rep >= 2 {
                    for (v, t) in times.iter_mut().zip([t1, t2, t3]) {
                        v.push(t);
                    }
                }
            }
            let g = times.map(|v| flops / median(&v) / 1e9);
            println!("| {what} | {name} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} |", g[0], g[1], g[2], g[1] / g[0], g[2] / g[0]);
        }
    }
}
