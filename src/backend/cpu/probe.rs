//! What this rank's threads can do on the host, measured: the f32 GEMM rate (the MFU
//! denominator when the deck states no `[hardware] peak_flops_per_rank`), the f32 FMA peak (what
//! the silicon can do: the ceiling any GEMM is held to) and the memory bandwidth (`ndtrain
//! probe`, for the planner's `[hardware]`).

use super::gemm::{matmul, Mat, MatMut};
use std::sync::Barrier;
use std::time::{Duration, Instant};

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

/// Independent FMA dependency chains per thread, each in its own register. A chain's next FMA
/// waits for its last (4 cycles on current x86 cores), and a core issues up to two vector FMAs
/// per cycle: 8 chains in flight keep both units busy; 12 leave a margin.
const CHAINS: usize = 12;

/// Iterations (one FMA on each chain) between two looks at the clock: about 15 µs of AVX-512
/// on a 3.5 GHz core, a few milliseconds under an emulator.
const CHUNK: u64 = 4096;

/// The FMA instructions the peak is measured with: the widest this CPU has, chosen at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FmaKernel {
    /// 512-bit `vfmadd` on 16 lanes (x86-64 with AVX-512F).
    Avx512,
    /// 256-bit `vfmadd` on 8 lanes (x86-64 with AVX2 and FMA).
    Avx2,
    /// `f32::mul_add`, one lane per operation as written (other architectures); the compiler
    /// may still vectorise it, which changes the rate but not the FLOPs counted.
    Scalar,
}

impl FmaKernel {
    /// The widest FMA this CPU and its operating system support.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return FmaKernel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return FmaKernel::Avx2;
            }
        }
        FmaKernel::Scalar
    }

    /// The vector width in bits.
    pub fn width_bits(self) -> u32 {
        32 * self.lanes() as u32
    }

    /// f32 lanes per FMA instruction.
    pub fn lanes(self) -> usize {
        match self {
            FmaKernel::Avx512 => 16,
            FmaKernel::Avx2 => 8,
            FmaKernel::Scalar => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FmaKernel::Avx512 => "AVX-512",
            FmaKernel::Avx2 => "AVX2+FMA",
            FmaKernel::Scalar => "scalar",
        }
    }

    /// FLOPs of `iters` iterations: one FMA (2 FLOPs) on every lane of every chain.
    fn flops(self, iters: u64) -> f64 {
        2.0 * (self.lanes() * CHAINS) as f64 * iters as f64
    }

    /// Runs `iters` iterations of `x ← x·a + b` on every chain and lane, the chains starting
    /// at `x0`; returns the sum of all of them (the caller hides it from the optimiser).
    fn run(self, iters: u64, a: f32, b: f32, x0: f32) -> f32 {
        match self {
            // SAFETY: every caller runs `detect`'s kernel or a narrower one (`fma_peak_of`
            // asserts it; the tests skip wider ones): the CPU and the OS support it.
            #[cfg(target_arch = "x86_64")]
            FmaKernel::Avx512 => unsafe { fma_avx512(iters, a, b, x0) },
            #[cfg(target_arch = "x86_64")]
            FmaKernel::Avx2 => unsafe { fma_avx2(iters, a, b, x0) },
            _ => fma_scalar(iters, a, b, x0),
        }
    }
}

/// The f32 FMA peak of a rank's threads, measured.
#[derive(Clone, Copy, Debug)]
pub struct FmaPeak {
    /// FLOP/s of all the threads together (2 FLOPs per lane per FMA).
    pub flops: f64,
    /// The instructions measured.
    pub kernel: FmaKernel,
    /// Their vector width in bits.
    pub width_bits: u32,
    /// The threads that ran them at once.
    pub threads: usize,
}

/// This rank's physical f32 FMA limit on `threads` threads (FLOP/s): every thread runs
/// 12 independent chains of the widest vector FMA in registers, all threads at once,
/// for 20 ms; the best of 5 repetitions (about 0.1 s in all).
pub fn fma_peak(threads: usize) -> FmaPeak {
    fma_peak_of(FmaKernel::detect(), threads, 5, Duration::from_millis(20))
}

/// [`fma_peak`] with `kernel` (one the CPU supports), `reps` repetitions of `each` each.
pub fn fma_peak_of(kernel: FmaKernel, threads: usize, reps: usize, each: Duration) -> FmaPeak {
    let threads = threads.max(1);
    assert!(kernel == FmaKernel::detect() || kernel.width_bits() < FmaKernel::detect().width_bits(), "{kernel:?}: not on this CPU");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("the FMA probe's threads start");
    // The multiplier and addend pass through `black_box` so that no chain can be computed at
    // compile time; `x ← 0.999·x + 0.001` tends to 1 from 0.5: no overflow, no subnormals.
    let (a, b, x0) = (std::hint::black_box(0.999f32), std::hint::black_box(0.001f32), std::hint::black_box(0.5f32));
    let mut best = 0.0f64;
    for _ in 0..reps.max(1) {
        let start = Barrier::new(threads);
        let spans = pool.broadcast(|_| {
            start.wait();
            let t0 = Instant::now();
            let (mut iters, mut sum) = (0u64, 0.0f32);
            let t1 = loop {
                sum += kernel.run(CHUNK, a, b, x0);
                iters += CHUNK;
                let t = Instant::now();
                if t - t0 >= each {
                    break t;
                }
            };
            std::hint::black_box(sum);
            (t0, t1, iters)
        });
        let first = spans.iter().map(|s| s.0).min().expect("one thread at least");
        let last = spans.iter().map(|s| s.1).max().expect("one thread at least");
        let flops: f64 = spans.iter().map(|s| kernel.flops(s.2)).sum();
        best = best.max(flops / (last - first).as_secs_f64());
    }
    FmaPeak { flops: best, kernel, width_bits: kernel.width_bits(), threads }
}

/// The AVX-512 chains: `zmm16`–`zmm27`, with `a` and `b` in `zmm28`–`zmm29`. Written in
/// assembly so that the program still builds with Rust 1.85 (the AVX-512 intrinsics and
/// `target_feature` are stable from 1.89): the compiler is told of no AVX-512 register, so the
/// block saves the fourteen it uses to memory first and restores them at the end.
///
/// # Safety
/// The CPU and the operating system must support AVX-512F.
#[cfg(target_arch = "x86_64")]
unsafe fn fma_avx512(iters: u64, a: f32, b: f32, x0: f32) -> f32 {
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    struct Zmm([f32; 16]);
    let mut save = [Zmm([0.0; 16]); 14];
    let mut out = Zmm([0.0; 16]);
    let consts = [a, b, x0];
    std::arch::asm!(
        "vmovups zmmword ptr [{save}], zmm16",
        "vmovups zmmword ptr [{save} + 64], zmm17",
        "vmovups zmmword ptr [{save} + 128], zmm18",
        "vmovups zmmword ptr [{save} + 192], zmm19",
        "vmovups zmmword ptr [{save} + 256], zmm20",
        "vmovups zmmword ptr [{save} + 320], zmm21",
        "vmovups zmmword ptr [{save} + 384], zmm22",
        "vmovups zmmword ptr [{save} + 448], zmm23",
        "vmovups zmmword ptr [{save} + 512], zmm24",
        "vmovups zmmword ptr [{save} + 576], zmm25",
        "vmovups zmmword ptr [{save} + 640], zmm26",
        "vmovups zmmword ptr [{save} + 704], zmm27",
        "vmovups zmmword ptr [{save} + 768], zmm28",
        "vmovups zmmword ptr [{save} + 832], zmm29",
        "vbroadcastss zmm28, dword ptr [{consts}]",
        "vbroadcastss zmm29, dword ptr [{consts} + 4]",
        "vbroadcastss zmm16, dword ptr [{consts} + 8]",
        "vmovaps zmm17, zmm16",
        "vmovaps zmm18, zmm16",
        "vmovaps zmm19, zmm16",
        "vmovaps zmm20, zmm16",
        "vmovaps zmm21, zmm16",
        "vmovaps zmm22, zmm16",
        "vmovaps zmm23, zmm16",
        "vmovaps zmm24, zmm16",
        "vmovaps zmm25, zmm16",
        "vmovaps zmm26, zmm16",
        "vmovaps zmm27, zmm16",
        "test {n}, {n}",
        "jz 3f",
        "2:",
        "vfmadd213ps zmm16, zmm28, zmm29",
        "vfmadd213ps zmm17, zmm28, zmm29",
        "vfmadd213ps zmm18, zmm28, zmm29",
        "vfmadd213ps zmm19, zmm28, zmm29",
        "vfmadd213ps zmm20, zmm28, zmm29",
        "vfmadd213ps zmm21, zmm28, zmm29",
        "vfmadd213ps zmm22, zmm28, zmm29",
        "vfmadd213ps zmm23, zmm28, zmm29",
        "vfmadd213ps zmm24, zmm28, zmm29",
        "vfmadd213ps zmm25, zmm28, zmm29",
        "vfmadd213ps zmm26, zmm28, zmm29",
        "vfmadd213ps zmm27, zmm28, zmm29",
        "dec {n}",
        "jnz 2b",
        "3:",
        "vaddps zmm16, zmm16, zmm17",
        "vaddps zmm18, zmm18, zmm19",
        "vaddps zmm20, zmm20, zmm21",
        "vaddps zmm22, zmm22, zmm23",
        "vaddps zmm24, zmm24, zmm25",
        "vaddps zmm26, zmm26, zmm27",
        "vaddps zmm16, zmm16, zmm18",
        "vaddps zmm20, zmm20, zmm22",
        "vaddps zmm24, zmm24, zmm26",
        "vaddps zmm16, zmm16, zmm20",
        "vaddps zmm16, zmm16, zmm24",
        "vmovups zmmword ptr [{out}], zmm16",
        "vmovups zmm16, zmmword ptr [{save}]",
        "vmovups zmm17, zmmword ptr [{save} + 64]",
        "vmovups zmm18, zmmword ptr [{save} + 128]",
        "vmovups zmm19, zmmword ptr [{save} + 192]",
        "vmovups zmm20, zmmword ptr [{save} + 256]",
        "vmovups zmm21, zmmword ptr [{save} + 320]",
        "vmovups zmm22, zmmword ptr [{save} + 384]",
        "vmovups zmm23, zmmword ptr [{save} + 448]",
        "vmovups zmm24, zmmword ptr [{save} + 512]",
        "vmovups zmm25, zmmword ptr [{save} + 576]",
        "vmovups zmm26, zmmword ptr [{save} + 640]",
        "vmovups zmm27, zmmword ptr [{save} + 704]",
        "vmovups zmm28, zmmword ptr [{save} + 768]",
        "vmovups zmm29, zmmword ptr [{save} + 832]",
        save = in(reg) save.as_mut_ptr(),
        consts = in(reg) consts.as_ptr(),
        out = in(reg) out.0.as_mut_ptr(),
        n = inout(reg) iters => _,
        options(nostack),
    );
    out.0.iter().sum()
}

/// The AVX2 chains: twelve 256-bit accumulators (with `a` and `b`, 14 of the 16 `ymm`
/// registers).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: u64, a: f32, b: f32, x0: f32) -> f32 {
    use std::arch::x86_64::*;
    let (va, vb) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
    let mut acc = [_mm256_set1_ps(x0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, va, vb);
        }
    }
    let mut sum = _mm256_setzero_ps();
    for x in acc {
        sum = _mm256_add_ps(sum, x);
    }
    std::mem::transmute::<__m256, [f32; 8]>(sum).iter().sum()
}

/// The portable chains: `f32::mul_add` on twelve scalars.
fn fma_scalar(iters: u64, a: f32, b: f32, x0: f32) -> f32 {
    let mut acc = [x0; CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = x.mul_add(a, b);
        }
    }
    acc.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU's flags as the kernel reports them (empty where `/proc/cpuinfo` is absent).
    fn cpuinfo_flags() -> Vec<String> {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let line = info.lines().find(|l| l.starts_with("flags")).unwrap_or("");
        line.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn fma_probe_uses_the_widest_fma_and_gives_a_positive_finite_rate() {
        let flags = cpuinfo_flags();
        let kernel = FmaKernel::detect();
        if flags.iter().any(|f| f == "avx512f") {
            assert_eq!(kernel, FmaKernel::Avx512, "the CPU has avx512f: {flags:?}");
        } else if flags.iter().any(|f| f == "avx2") && flags.iter().any(|f| f == "fma") {
            assert_eq!(kernel, FmaKernel::Avx2);
        }
        for threads in [1, 2] {
            let p = fma_peak(threads);
            assert!(p.flops.is_finite() && p.flops > 0.0, "{p:?}");
            assert_eq!((p.kernel, p.width_bits, p.threads), (kernel, kernel.width_bits(), threads));
        }
    }

    #[test]
    fn every_fma_kernel_this_cpu_has_computes_the_same_chains() {
        // 100 steps of x ← 0.999·x + 0.001 from 0.5: 1 − 0.5·0.999^100, on every lane and chain.
        let one = 1.0 - 0.5 * 0.999f64.powi(100);
        let detected = FmaKernel::detect();
        for kernel in [FmaKernel::Avx512, FmaKernel::Avx2, FmaKernel::Scalar] {
            if kernel != detected && kernel.width_bits() >= detected.width_bits() {
                continue;
            }
            let want = one * (kernel.lanes() * CHAINS) as f64;
            let got = kernel.run(100, 0.999, 0.001, 0.5) as f64;
            assert!((got - want).abs() < 1e-4 * want, "{kernel:?}: {got} against {want}");
            assert_eq!(kernel.run(0, 0.999, 0.001, 0.5), 0.5 * (kernel.lanes() * CHAINS) as f32, "{kernel:?}");
            let p = fma_peak_of(kernel, 1, 1, Duration::from_millis(2));
            assert!(p.flops.is_finite() && p.flops > 0.0, "{p:?}");
        }
    }

    /// No GEMM can beat the FMA peak of the same threads. Both are best-of-several, taken in
    /// turns so that a quiet moment of a shared machine serves both; the margin (0.8) covers
    /// what noise is left.
    #[test]
    fn the_gemm_probe_stays_under_the_fma_peak() {
        let threads = crate::backend::cpu::gemm_threads();
        let (mut fma, mut gemm) = (0.0f64, 0.0f64);
        for _ in 0..5 {
            fma = fma.max(fma_peak(threads).flops);
            gemm = gemm.max(gemm_flops());
        }
        assert!(fma >= 0.8 * gemm, "FMA peak {fma:.3e} FLOP/s below 0.8 × the GEMM's {gemm:.3e} on {threads} thread(s)");
    }
}
