//! The scalar type of the numerics and the one GEMM every matrix product goes through.
//!
//! The model, its kernels and the optimiser are generic over [`Real`] so that training runs in
//! f32 while the finite-difference gradient checks run the very same code in f64. This module
//! owns the choice of GEMM backend (see `benches/results/gemm_backends.md` for why); it knows
//! nothing about what the matrices mean.

use std::fmt::{Debug, Display};
use std::iter::Sum;
use std::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

/// A floating-point element type of the model: `f32` for training, `f64` for gradient checks.
pub trait Real:
    Copy
    + Send
    + Sync
    + Default
    + Debug
    + Display
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + Sum
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn max(self, other: Self) -> Self;
    /// `x · sigmoid(x)`.
    fn silu(self) -> Self {
        self / (Self::ONE + (-self).exp())
    }
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            #[inline(always)]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

/// A read-only strided matrix view: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a, T> {
    pub data: &'a [T],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// A row-major `[rows, cols]` matrix.
    pub fn rm(data: &'a [T], rows: usize, cols: usize) -> Self {
        Mat { data, rows, cols, rs: cols, cs: 1 }
    }
    /// A `[rows, cols]` block of a row-major matrix whose rows are `ld` elements apart.
    pub fn rm_ld(data: &'a [T], rows: usize, cols: usize, ld: usize) -> Self {
        Mat { data, rows, cols, rs: ld, cs: 1 }
    }
    /// The transpose, without copying.
    pub fn t(self) -> Self {
        Mat { data: self.data, rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs }
    }
    fn last_index(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows - 1) * self.rs + (self.cols - 1) * self.cs
        }
    }
}

/// A mutable strided matrix view.
pub struct MatMut<'a, T> {
    pub data: &'a mut [T],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> MatMut<'a, T> {
    pub fn rm(data: &'a mut [T], rows: usize, cols: usize) -> Self {
        MatMut { data, rows, cols, rs: cols, cs: 1 }
    }
    pub fn rm_ld(data: &'a mut [T], rows: usize, cols: usize, ld: usize) -> Self {
        MatMut { data, rows, cols, rs: ld, cs: 1 }
    }
}

/// How many threads a GEMM may use; set once per rank at start (`[run] threads`).
static GEMM_THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

/// Sets the number of threads each GEMM uses on this rank.
pub fn set_gemm_threads(n: usize) {
    GEMM_THREADS.store(n.max(1), std::sync::atomic::Ordering::Relaxed);
}

pub fn gemm_threads() -> usize {
    GEMM_THREADS.load(std::sync::atomic::Ordering::Relaxed)
}

/// `c = a · b` (`accumulate = false`) or `c += a · b` (`accumulate = true`).
///
/// Shapes: `a [m, k]`, `b [k, n]`, `c [m, n]`, each with its own strides, so transposed
/// operands and heads inside a wider row cost no copy.
pub fn matmul<T: Real>(c: MatMut<'_, T>, a: Mat<'_, T>, b: Mat<'_, T>, accumulate: bool) {
    matmul_with(c, a, b, accumulate, true)
}

/// [`matmul`] on the calling thread only: for products inside an already-parallel loop
/// (attention runs one task per head group), where a nested parallel GEMM only adds overhead.
pub fn matmul_serial<T: Real>(c: MatMut<'_, T>, a: Mat<'_, T>, b: Mat<'_, T>, accumulate: bool) {
    matmul_with(c, a, b, accumulate, false)
}

fn matmul_with<T: Real>(c: MatMut<'_, T>, a: Mat<'_, T>, b: Mat<'_, T>, accumulate: bool, parallel: bool) {
    let (m, n, k) = (c.rows, c.cols, a.cols);
    assert_eq!(a.rows, m, "matmul: a has {} rows, c has {}", a.rows, m);
    assert_eq!(b.rows, k, "matmul: a has {} cols, b has {} rows", k, b.rows);
    assert_eq!(b.cols, n, "matmul: b has {} cols, c has {}", b.cols, n);
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.last_index() < a.data.len() || k == 0, "matmul: a out of bounds");
    assert!(b.last_index() < b.data.len() || k == 0, "matmul: b out of bounds");
    let c_last = (m - 1) * c.rs + (n - 1) * c.cs;
    assert!(c_last < c.data.len(), "matmul: c out of bounds");
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    c.data[i * c.rs + j * c.cs] = T::ZERO;
                }
            }
        }
        return;
    }
    let threads = gemm_threads();
    let par =
        if parallel && threads > 1 && m * n * k >= 64 * 64 * 64 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the asserts above bound every element the strides can reach inside the three
    // slices; `c` is borrowed mutably, so it cannot alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.data.as_mut_ptr(),
            c.cs as isize,
            c.rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            par,
        );
    }
}

/// Linear layer forward: `y [m, n] (=|+=) x [m, k] · wᵀ` with `w [n, k]` (Hugging Face `[out, in]`).
pub fn linear_fwd<T: Real>(y: &mut [T], x: &[T], w: &[T], m: usize, n: usize, k: usize, accumulate: bool) {
    matmul(MatMut::rm(y, m, n), Mat::rm(x, m, k), Mat::rm(w, n, k).t(), accumulate);
}

/// Linear layer input gradient: `dx [m, k] (=|+=) dy [m, n] · w` with `w [n, k]`.
pub fn linear_bwd_input<T: Real>(dx: &mut [T], dy: &[T], w: &[T], m: usize, n: usize, k: usize, accumulate: bool) {
    matmul(MatMut::rm(dx, m, k), Mat::rm(dy, m, n), Mat::rm(w, n, k), accumulate);
}

/// Linear layer weight gradient: `dw [n, k] (=|+=) dyᵀ · x` with `dy [m, n]`, `x [m, k]`.
pub fn linear_bwd_weight<T: Real>(dw: &mut [T], dy: &[T], x: &[T], m: usize, n: usize, k: usize, accumulate: bool) {
    matmul(MatMut::rm(dw, n, k), Mat::rm(dy, m, n).t(), Mat::rm(x, m, k), accumulate);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f64], b: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    c[i * n + j] += a[i * k + p] * b[p * n + j];
                }
            }
        }
        c
    }

    #[test]
    fn matmul_matches_naive_with_transposes_and_accumulation() {
        let (m, n, k) = (7, 5, 3);
        let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.91).cos()).collect();
        let want = naive(&a, &b, m, n, k);
        let mut c = vec![1.0; m * n];
        matmul(MatMut::rm(&mut c, m, n), Mat::rm(&a, m, k), Mat::rm(&b, k, n), true);
        for i in 0..m * n {
            assert!((c[i] - want[i] - 1.0).abs() < 1e-12);
        }
        // bᵀ stored as [n, k], used through .t()
        let mut bt = vec![0.0; n * k];
        for p in 0..k {
            for j in 0..n {
                bt[j * k + p] = b[p * n + j];
            }
        }
        let mut y = vec![0.0; m * n];
        linear_fwd(&mut y, &a, &bt, m, n, k, false);
        for i in 0..m * n {
            assert!((y[i] - want[i]).abs() < 1e-12);
        }
    }
}
