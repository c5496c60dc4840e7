//! f32 GEMM backend benchmark for ndtrain: the `gemm` crate, `matrixmultiply`, system OpenBLAS.
//!
//! One process measures one thread count. Backends are interleaved (A B C A B C ...) within
//! every repetition of every shape so slow drift of a shared machine hits all of them alike.
//! Each backend's result is checked against a naive f64 reference before timing.
//!
//! Usage: gemm_backends --threads T [--reps N] [--backends gemm,mm,openblas] [--tag NAME]
//!                      [--min-sample-ms MS] [--no-check]
//! Output: a human table on stderr, machine-readable `RESULT` / `CHECK` / `INFO` lines on stdout.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------- OpenBLAS FFI
const CBLAS_ROW_MAJOR: c_int = 101;
const CBLAS_NO_TRANS: c_int = 111;
const CBLAS_TRANS: c_int = 112;

extern "C" {
    fn cblas_sgemm(
        order: c_int,
        transa: c_int,
        transb: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f32,
        a: *const f32,
        lda: c_int,
        b: *const f32,
        ldb: c_int,
        beta: f32,
        c: *mut f32,
        ldc: c_int,
    );
    fn openblas_set_num_threads(n: c_int);
    fn openblas_get_num_threads() -> c_int;
    fn openblas_get_corename() -> *const c_char;
    fn openblas_get_config() -> *const c_char;
    fn openblas_get_parallel() -> c_int;
}

fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return "(null)".into();
    }
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

// ---------------------------------------------------------------- problems
/// A strided view description: element (i, j) lives at `i * rs + j * cs`.
#[derive(Clone, Copy)]
struct Layout {
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl Layout {
    /// Row-major `[rows, cols]` with leading dimension `ld` (>= cols).
    fn rm(rows: usize, cols: usize, ld: usize) -> Self {
        Layout { rows, cols, rs: ld, cs: 1 }
    }
    /// Transpose view of a row-major `[cols, rows]` buffer with leading dimension `ld`.
    fn rm_t(rows: usize, cols: usize, ld: usize) -> Self {
        Layout { rows, cols, rs: 1, cs: ld }
    }
    fn len(&self) -> usize {
        (self.rows - 1) * self.rs + (self.cols - 1) * self.cs + 1
    }
    /// (transpose flag, leading dimension) for row-major CBLAS.
    fn cblas(&self) -> (c_int, c_int) {
        if self.cs == 1 {
            (CBLAS_NO_TRANS, self.rs as c_int)
        } else {
            assert_eq!(self.rs, 1);
            (CBLAS_TRANS, self.cs as c_int)
        }
    }
}

struct Shape {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    a: Layout,
    b: Layout,
    c: Layout,
}

const TOK: usize = 2048; // micro batch 4 x seq 512
const D: usize = 512;
const F: usize = 1536;
const V: usize = 4096;
const SEQ: usize = 512;
const HD: usize = 64;

/// y[M,N] = x[M,K] . W^T with W stored [N,K] row-major (forward).
fn fwd(name: &'static str, m: usize, n: usize, k: usize) -> Shape {
    Shape { name, m, n, k, a: Layout::rm(m, k, k), b: Layout::rm_t(k, n, k), c: Layout::rm(m, n, n) }
}
/// dx[M,N] = dy[M,K] . W with W stored [K,N] row-major (input grad; K = layer's out dim).
fn dx(name: &'static str, m: usize, n: usize, k: usize) -> Shape {
    Shape { name, m, n, k, a: Layout::rm(m, k, k), b: Layout::rm(k, n, n), c: Layout::rm(m, n, n) }
}
/// dW[M,N] = dy^T . x with dy stored [K,M], x stored [K,N] row-major (weight grad, K = tokens).
fn dw(name: &'static str, m: usize, n: usize, k: usize) -> Shape {
    Shape { name, m, n, k, a: Layout::rm_t(m, k, m), b: Layout::rm(k, n, n), c: Layout::rm(m, n, n) }
}

fn shapes() -> Vec<Shape> {
    vec![
        fwd("fwd q/k/v/o  x.Wt", TOK, D, D),
        fwd("fwd gate/up  x.Wt", TOK, F, D),
        fwd("fwd down     x.Wt", TOK, D, F),
        fwd("fwd lm_head  x.Wt", TOK, V, D),
        dx("dx q/k/v/o   dy.W", TOK, D, D),
        dx("dx gate/up   dy.W", TOK, D, F),
        dx("dx down      dy.W", TOK, F, D),
        dx("dx lm_head   dy.W", TOK, D, V),
        dw("dW q/k/v/o   dyT.x", D, D, TOK),
        dw("dW gate/up   dyT.x", F, D, TOK),
        dw("dW down      dyT.x", D, F, TOK),
        dw("dW lm_head   dyT.x", V, D, TOK),
        // One head inside [seq, d_model] rows (ld = d_model), as the attention kernels read them.
        Shape {
            name: "attn S=Q.Kt (1 head)",
            m: SEQ,
            n: SEQ,
            k: HD,
            a: Layout::rm(SEQ, HD, D),
            b: Layout::rm_t(HD, SEQ, D),
            c: Layout::rm(SEQ, SEQ, SEQ),
        },
        Shape {
            name: "attn O=P.V (1 head)",
            m: SEQ,
            n: HD,
            k: SEQ,
            a: Layout::rm(SEQ, SEQ, SEQ),
            b: Layout::rm(SEQ, HD, D),
            c: Layout::rm(SEQ, HD, D),
        },
        dx("square 1024^3 NN", 1024, 1024, 1024),
    ]
}

// ---------------------------------------------------------------- backends
#[derive(Clone, Copy, PartialEq, Debug)]
enum Backend {
    Gemm,
    MatrixMultiply,
    OpenBlas,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Gemm => "gemm-0.19",
            Backend::MatrixMultiply => "matrixmultiply-0.3",
            Backend::OpenBlas => "openblas",
        }
    }
}

/// c = a . b (overwrite: beta = 0 / read_dst = false).
fn run(be: Backend, s: &Shape, a: &[f32], b: &[f32], c: &mut [f32], threads: usize) {
    let (m, n, k) = (s.m, s.n, s.k);
    unsafe {
        match be {
            Backend::Gemm => {
                let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
                gemm::gemm(
                    m,
                    n,
                    k,
                    c.as_mut_ptr(),
                    s.c.cs as isize,
                    s.c.rs as isize,
                    false,
                    a.as_ptr(),
                    s.a.cs as isize,
                    s.a.rs as isize,
                    b.as_ptr(),
                    s.b.cs as isize,
                    s.b.rs as isize,
                    0.0f32,
                    1.0f32,
                    false,
                    false,
                    false,
                    par,
                );
            }
            Backend::MatrixMultiply => {
                // Threads come from MATMUL_NUM_THREADS (read once per process).
                matrixmultiply::sgemm(
                    m,
                    k,
                    n,
                    1.0,
                    a.as_ptr(),
                    s.a.rs as isize,
                    s.a.cs as isize,
                    b.as_ptr(),
                    s.b.rs as isize,
                    s.b.cs as isize,
                    0.0,
                    c.as_mut_ptr(),
                    s.c.rs as isize,
                    s.c.cs as isize,
                );
            }
            Backend::OpenBlas => {
                let (ta, lda) = s.a.cblas();
                let (tb, ldb) = s.b.cblas();
                assert_eq!(s.c.cs, 1);
                cblas_sgemm(
                    CBLAS_ROW_MAJOR,
                    ta,
                    tb,
                    m as c_int,
                    n as c_int,
                    k as c_int,
                    1.0,
                    a.as_ptr(),
                    lda,
                    b.as_ptr(),
                    ldb,
                    0.0,
                    c.as_mut_ptr(),
                    s.c.rs as c_int,
                );
            }
        }
    }
}

// ---------------------------------------------------------------- data + reference
fn fill(buf: &mut [f32], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for v in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *v = ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
    }
}

/// Naive f64 reference, dense row-major [m, n]; two threads over rows.
fn reference(s: &Shape, a: &[f32], b: &[f32]) -> Vec<f64> {
    let (m, n, k) = (s.m, s.n, s.k);
    let mut ad = vec![0f64; m * k];
    for i in 0..m {
        for p in 0..k {
            ad[i * k + p] = a[i * s.a.rs + p * s.a.cs] as f64;
        }
    }
    let mut bd = vec![0f64; k * n];
    for p in 0..k {
        for j in 0..n {
            bd[p * n + j] = b[p * s.b.rs + j * s.b.cs] as f64;
        }
    }
    let mut c = vec![0f64; m * n];
    let half = (m / 2).max(1) * n;
    let (c0, c1) = c.split_at_mut(half.min(m * n));
    std::thread::scope(|sc| {
        for (row0, chunk) in [(0usize, c0), (half / n, c1)] {
            let (ad, bd) = (&ad, &bd);
            sc.spawn(move || {
                for (ii, row) in chunk.chunks_mut(n).enumerate() {
                    let i = row0 + ii;
                    for p in 0..k {
                        let aip = ad[i * k + p];
                        let brow = &bd[p * n..p * n + n];
                        for j in 0..n {
                            row[j] += aip * brow[j];
                        }
                    }
                }
            });
        }
    });
    c
}

/// The reference depends only on the (deterministic) inputs: compute it once per shape and keep
/// it in `$GEMM_REF_CACHE` (if set) so the several runs of `run.sh` share it.
fn cached_reference(si: usize, s: &Shape, a: &[f32], b: &[f32]) -> Vec<f64> {
    let Ok(dir) = std::env::var("GEMM_REF_CACHE") else { return reference(s, a, b) };
    let path = std::path::Path::new(&dir).join(format!("ref_{si}_{}x{}x{}.f64", s.m, s.n, s.k));
    if let Ok(bytes) = std::fs::read(&path) {
        if bytes.len() == s.m * s.n * 8 {
            return bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect();
        }
    }
    let r = reference(s, a, b);
    let bytes: Vec<u8> = r.iter().flat_map(|v| v.to_le_bytes()).collect();
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(&path, bytes);
    r
}

/// (max |c - ref| / max |ref|, count of non-finite outputs).
fn check(s: &Shape, c: &[f32], r: &[f64]) -> (f64, usize) {
    let (mut err, mut big, mut bad) = (0f64, 0f64, 0usize);
    for i in 0..s.m {
        for j in 0..s.n {
            let v = c[i * s.c.rs + j * s.c.cs] as f64;
            let rv = r[i * s.n + j];
            if !v.is_finite() {
                bad += 1;
            }
            err = err.max((v - rv).abs());
            big = big.max(rv.abs());
        }
    }
    (if bad > 0 { f64::INFINITY } else { err / big }, bad)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) }
}

// ---------------------------------------------------------------- main
fn main() {
    let mut threads = 1usize;
    let mut reps = 9usize;
    let mut tag = String::from("env");
    let mut min_sample_ms = 25.0f64;
    let mut do_check = true;
    let mut only: Option<Vec<String>> = None;
    let mut backends = vec![Backend::Gemm, Backend::MatrixMultiply, Backend::OpenBlas];
    let args: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--threads" => { threads = args[i + 1].parse().unwrap(); i += 1; }
            "--reps" => { reps = args[i + 1].parse().unwrap(); i += 1; }
            "--tag" => { tag = args[i + 1].clone(); i += 1; }
            "--min-sample-ms" => { min_sample_ms = args[i + 1].parse().unwrap(); i += 1; }
            "--no-check" => do_check = false,
            "--shapes" => { only = Some(args[i + 1].split(',').map(|s| s.to_string()).collect()); i += 1; }
            "--backends" => {
                backends = args[i + 1]
                    .split(',')
                    .map(|b| match b {
                        "gemm" => Backend::Gemm,
                        "mm" | "matrixmultiply" => Backend::MatrixMultiply,
                        "openblas" => Backend::OpenBlas,
                        other => panic!("unknown backend {other}"),
                    })
                    .collect();
                i += 1;
            }
            other => panic!("unknown arg {other}"),
        }
        i += 1;
    }

    unsafe { openblas_set_num_threads(threads as c_int) };
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| "<unset>".into());
    println!(
        "INFO tag={tag} threads={threads} reps={reps} OPENBLAS_CORETYPE={} OPENBLAS_L2_SIZE={} MATMUL_NUM_THREADS={} RAYON_NUM_THREADS={}",
        env("OPENBLAS_CORETYPE"),
        env("OPENBLAS_L2_SIZE"),
        env("MATMUL_NUM_THREADS"),
        env("RAYON_NUM_THREADS")
    );
    if backends.contains(&Backend::OpenBlas) {
        unsafe {
            println!(
                "INFO openblas corename={} num_threads={} parallel={} config=\"{}\"",
                cstr(openblas_get_corename()),
                openblas_get_num_threads(),
                openblas_get_parallel(),
                cstr(openblas_get_config()).trim()
            );
        }
    }
    println!("INFO loadavg_start={}", std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim());

    let t_all = Instant::now();
    for (si, s) in shapes().iter().enumerate() {
        if let Some(o) = &only {
            if !o.iter().any(|x| x.parse::<usize>().ok() == Some(si)) {
                continue;
            }
        }
        let mut a = vec![0f32; s.a.len()];
        let mut b = vec![0f32; s.b.len()];
        fill(&mut a, 1 + si as u64);
        fill(&mut b, 1001 + si as u64);
        let mut c = vec![0f32; s.c.len()];
        let flops = 2.0 * (s.m * s.n * s.k) as f64;

        // Correctness: every backend on a NaN-poisoned output, vs naive f64.
        if do_check {
            let t_ref = Instant::now();
            let r = cached_reference(si, s, &a, &b);
            println!("INFO reference shape=\"{}\" s={:.2}", s.name, t_ref.elapsed().as_secs_f64());
            for &be in &backends {
                c.iter_mut().for_each(|v| *v = f32::NAN);
                run(be, s, &a, &b, &mut c, threads);
                let (rel, bad) = check(s, &c, &r);
                let ok = rel < 1e-4;
                println!(
                    "CHECK tag={tag} threads={threads} shape=\"{}\" backend={} max_rel_err={:.3e} nonfinite={} {}",
                    s.name,
                    be.name(),
                    rel,
                    bad,
                    if ok { "OK" } else { "FAIL" }
                );
            }
        }

        // Warm-up + calibrate inner repeat count so one sample lasts >= min_sample_ms.
        let mut inner = vec![1usize; backends.len()];
        for (bi, &be) in backends.iter().enumerate() {
            run(be, s, &a, &b, &mut c, threads);
            // Time calls for >= min_sample_ms / 4 (at least 2 calls) and take the per-call mean.
            let t = Instant::now();
            let mut calls = 0usize;
            while calls < 2 || t.elapsed().as_secs_f64() * 1e3 < min_sample_ms / 4.0 {
                run(be, s, &a, &b, &mut c, threads);
                calls += 1;
            }
            let dt = t.elapsed().as_secs_f64() * 1e3 / calls as f64;
            inner[bi] = ((min_sample_ms / dt.max(1e-3)).ceil() as usize).clamp(1, 1000);
        }

        // Interleaved timing: rep 0: A B C, rep 1: B C A, ... (rotate start to cancel order bias).
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); backends.len()];
        for rep in 0..reps {
            for off in 0..backends.len() {
                let bi = (rep + off) % backends.len();
                let be = backends[bi];
                let t = Instant::now();
                for _ in 0..inner[bi] {
                    run(be, s, &a, &b, &mut c, threads);
                }
                let dt = t.elapsed().as_secs_f64() / inner[bi] as f64;
                samples[bi].push(flops / dt / 1e9);
                if be == Backend::OpenBlas && threads > 1 {
                    // Let OpenBLAS's spinning worker (THREAD_TIMEOUT ~2^28 cycles) go to sleep
                    // so it does not steal a core from the next backend's timing.
                    std::thread::sleep(Duration::from_millis(120));
                }
            }
        }
        for (bi, &be) in backends.iter().enumerate() {
            let mut v = samples[bi].clone();
            let min = v.iter().cloned().fold(f64::INFINITY, f64::min);
            let max = v.iter().cloned().fold(0.0, f64::max);
            let med = median(&mut v);
            println!(
                "RESULT tag={tag} threads={threads} shape=\"{}\" m={} n={} k={} backend={} gflops_median={:.1} gflops_min={:.1} gflops_max={:.1} inner={} reps={}",
                s.name, s.m, s.n, s.k, be.name(), med, min, max, inner[bi], reps
            );
            eprintln!("{:24} T={} {:20} {:7.1} GFLOP/s  [{:6.1} .. {:6.1}]", s.name, threads, be.name(), med, min, max);
        }
    }
    println!("INFO loadavg_end={}", std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim());
    println!("INFO elapsed_s={:.1}", t_all.elapsed().as_secs_f64());
}
