//! Shared by every family: the tolerances, seeded inputs, the max-norm comparison, central differences.

use ndtrain::scalar::Real;

/// f32 kernels: ε = 2⁻²³ ≈ 1.2e-7 and the longest reduction here has ~140 terms (a softmax
/// row, a dot product, a column of dW), so a correct kernel lands near 1e-6 of the largest
/// value (at most 7e-7 measured, in attention); a wrong sign, scale or index is off by 1e-2
/// or more.
pub(crate) const F32_TOL: f64 = 1e-5;
/// f64 kernels: the same operations with ε = 2⁻⁵² ≈ 2.2e-16; ~140-term sums stay below 1e-13
/// (at most 3e-15 measured).
pub(crate) const F64_TOL: f64 = 1e-12;
/// `rope_tables` rounds each inverse frequency `θ^(−2i/hd)` to f32 as Hugging Face computes
/// it (two f32 roundings, ≤ 2·2⁻²⁴ ≈ 1.2e-7 relative; the exponent `2i/hd` is exact for the
/// power-of-two `hd` used here). An angle off by `δ` moves its cosine and sine by at most `δ`,
/// so an element may differ from the exact table by `pos · inv_freq · ROPE_FREQ_ROUNDING`.
pub(crate) const ROPE_FREQ_ROUNDING: f64 = 1.5e-7;
/// Central differences with step 1e-5 have truncation error ~h²·f''' ≈ 1e-10 and round-off
/// ~1e-16/h ≈ 1e-11; a correct reference gradient agrees to ~1e-10, a wrong term to 1e-2.
pub(crate) const FD_TOL: f64 = 1e-6;
const FD_STEP: f64 = 1e-5;
/// Filler for vocabulary padding columns and for outputs a kernel must overwrite: large
/// enough that using it anywhere breaks a result (`exp(1e3)` overflows even f64).
pub(crate) const GARBAGE: f64 = 1e3;

/// splitmix64: deterministic, dependency-free test inputs.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`, rounded to f32 so the f32 and f64 runs see identical inputs.
    pub(crate) fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        (lo + (hi - lo) * u) as f32 as f64
    }

    pub(crate) fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub(crate) fn cast<T: Real>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::from_f64(v)).collect()
}

pub(crate) fn to_f64<T: Real>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

/// The tolerance of a kernel run in element type `T`.
pub(crate) fn tol<T: Real>() -> f64 {
    if std::mem::size_of::<T>() == 4 {
        F32_TOL
    } else {
        F64_TOL
    }
}

/// `max_i |got_i − want_i| ≤ tol · max_i |want_i|`; an infinite reference element (a
/// log-sum-exp over no key) must be matched exactly.
#[track_caller]
pub(crate) fn assert_close<T: Real>(what: &str, got: &[T], want: &[f64], tol: f64) {
    let ty = std::any::type_name::<T>();
    assert_eq!(got.len(), want.len(), "{what} [{ty}]: length");
    let scale = want.iter().filter(|w| w.is_finite()).fold(0.0f64, |a, w| a.max(w.abs())).max(f64::MIN_POSITIVE);
    let mut worst = (0, 0.0f64);
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f64();
        if w.is_infinite() {
            assert_eq!(g, w, "{what} [{ty}]: element {i}");
            continue;
        }
        let err = (g - w).abs();
        assert!(err.is_finite(), "{what} [{ty}]: element {i} is {g}, want {w}");
        if err > worst.1 {
            worst = (i, err);
        }
    }
    let (i, err) = worst;
    assert!(
        err <= tol * scale,
        "{what} [{ty}]: element {i} is {}, want {}: error {err:.3e} > {tol:.0e} × max|want| {scale:.3e}",
        got[i],
        want[i]
    );
}

/// Central-difference gradient of `f` at `x`.
pub(crate) fn fd_grad(f: impl Fn(&[f64]) -> f64, x: &[f64]) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            xp[i] = x[i] + FD_STEP;
            let up = f(&xp);
            xp[i] = x[i] - FD_STEP;
            let down = f(&xp);
            xp[i] = x[i];
            (up - down) / (2.0 * FD_STEP)
        })
        .collect()
}

pub(crate) fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
