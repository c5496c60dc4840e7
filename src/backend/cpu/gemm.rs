//! The host GEMM every matrix product goes through, and the linear layers built on it.
//!
//! Owns the choice of GEMM library (the `gemm` crate; see `benches/results/gemm_backends.md`
//! for why) and how a rank's threads share the products: one GEMM split into bands of the
//! output, or two independent GEMMs of a layer side by side. Every output element is summed in
//! the same order whatever the thread count. Knows nothing about what the matrices mean.

use super::gemm_threads;
use crate::scalar::Real;

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

/// `c = a · b` (`accumulate = false`) or `c += a · b` (`accumulate = true`).
///
/// Shapes: `a [m, k]`, `b [k, n]`, `c [m, n]`, each with its own strides, so transposed
/// operands and heads inside a wider row cost no copy.
pub fn matmul<T: Real>(c: MatMut<'_, T>, a: Mat<'_, T>, b: Mat<'_, T>, accumulate: bool) {
    matmul_on(c, a, b, accumulate, gemm_threads())
}

/// [`matmul`] on the calling thread only: for products inside an already-parallel loop
/// (attention runs one task per head group), where a nested parallel GEMM only adds overhead.
pub fn matmul_serial<T: Real>(c: MatMut<'_, T>, a: Mat<'_, T>, b: Mat<'_, T>, accumulate: bool) {
    matmul_on(c, a, b, accumulate, 1)
}

/// [`matmul`] on `threads` threads of the rank's pool.
fn matmul_on<T: Real>(c: MatMut<'_, T>, a: Mat<'_, T>, b: Mat<'_, T>, accumulate: bool, threads: usize) {
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
    let big = m * n * k >= 64 * 64 * 64;
    if threads > 1 && big {
        // Bands of C, one per thread: rows when C is at least as tall as wide, else columns.
        // Each band is a whole serial GEMM over the full depth k, so every element sums in the
        // same order as on one thread (the results do not depend on the thread count), and the
        // threads meet once per product instead of once per cache block as in the `gemm`
        // crate's own split (measured: `benches/results/gemm_pairs.md`).
        let rows = m >= n;
        let len = if rows { m } else { n };
        let parts = threads.min(len / 32).max(1);
        let (cp, ap, bp) = (SendPtr(c.data.as_mut_ptr()), SendPtr(a.data.as_ptr() as *mut T), SendPtr(b.data.as_ptr() as *mut T));
        let (cst, ast, bst) = ((c.rs, c.cs), (a.rs, a.cs), (b.rs, b.cs));
        use rayon::prelude::*;
        (0..parts).into_par_iter().for_each(|p| {
            let (lo, hi) = (len * p / parts, len * (p + 1) / parts);
            let (c0, a0, b0) = (cp.get(), ap.get(), bp.get());
            // SAFETY: the bands are disjoint element sets of `c` (rows lo..hi or columns
            // lo..hi), each inside the bounds asserted above; `a` and `b` are only read.
            unsafe {
                if rows {
                    gemm_raw(hi - lo, n, k, c0.add(lo * cst.0), cst, accumulate, a0.add(lo * ast.0), ast, b0, bst);
                } else {
                    gemm_raw(m, hi - lo, k, c0.add(lo * cst.1), cst, accumulate, a0, ast, b0.add(lo * bst.1), bst);
                }
            }
        });
        return;
    }
    // SAFETY: the asserts above bound every element the strides can reach inside the three
    // slices; `c` is borrowed mutably, so it cannot alias `a` or `b`.
    unsafe {
        gemm_raw(m, n, k, c.data.as_mut_ptr(), (c.rs, c.cs), accumulate, a.data.as_ptr(), (a.rs, a.cs), b.data.as_ptr(), (b.rs, b.cs))
    }
}

/// A pointer that may cross to another thread of the pool (the caller keeps the accesses
/// disjoint).
#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// Through a method, so a closure captures the whole (sendable) wrapper, not its field.
    fn get(self) -> *mut T {
        self.0
    }
}

/// One serial `gemm` call on a sub-matrix: `m × n × k` from the given corners, with the
/// `(row, column)` strides of the views they lie in.
///
/// # Safety
/// The three corners and their extents must lie inside the views' slices, and the `c` block
/// must not be written by anyone else meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    c: *mut T,
    (c_rs, c_cs): (usize, usize),
    accumulate: bool,
    a: *const T,
    (a_rs, a_cs): (usize, usize),
    b: *const T,
    (b_rs, b_cs): (usize, usize),
) {
    // The packing buffers `gemm` allocates and frees in every call come from, and go back to,
    // the spare blocks (`heap`): the next product reuses their pages.
    super::heap::with_spare_blocks(|| {
        gemm::gemm(
            m,
            n,
            k,
            c,
            c_cs as isize,
            c_rs as isize,
            accumulate,
            a,
            a_cs as isize,
            a_rs as isize,
            b,
            b_cs as isize,
            b_rs as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    });
}

/// Runs two independent GEMM-bound jobs side by side, each on its share of the rank's GEMM
/// threads (the argument each receives); one after the other on one thread.
///
/// Why: one GEMM split across two threads reaches 1.3–1.9× one thread on the model's shapes
/// (worst on the 512 × 512 projections); two whole GEMMs, one per thread, 1.8–2.0×
/// (`benches/results/gemm_pairs.md`). The results are the same bits either way.
fn join_gemms(threads: usize, a: impl FnOnce(usize) + Send, b: impl FnOnce(usize) + Send) {
    if threads < 2 {
        a(1);
        b(1);
        return;
    }
    let ta = threads / 2;
    rayon::join(|| a(ta), || b(threads - ta));
}

/// Linear layer forward: `y [m, n] (=|+=) x [m, k] · wᵀ` with `w [n, k]` (Hugging Face `[out, in]`).
pub fn linear_fwd<T: Real>(y: &mut [T], x: &[T], w: &[T], m: usize, n: usize, k: usize, accumulate: bool) {
    linear_fwd_on(y, x, w, m, n, k, accumulate, gemm_threads());
}

#[allow(clippy::too_many_arguments)]
fn linear_fwd_on<T: Real>(y: &mut [T], x: &[T], w: &[T], m: usize, n: usize, k: usize, accumulate: bool, threads: usize) {
    matmul_on(MatMut::rm(y, m, n), Mat::rm(x, m, k), Mat::rm(w, n, k).t(), accumulate, threads);
}

/// Two projections of the same input with weights of the same shape (gate and up, key and
/// value): `y1 = x · w1ᵀ`, `y2 = x · w2ᵀ`, side by side (see [`join_gemms`]).
#[allow(clippy::too_many_arguments)]
pub fn linear_fwd_pair<T: Real>(y1: &mut [T], w1: &[T], y2: &mut [T], w2: &[T], x: &[T], m: usize, n: usize, k: usize) {
    linear_fwd_pair_on(y1, w1, y2, w2, x, m, n, k, gemm_threads());
}

#[allow(clippy::too_many_arguments)]
fn linear_fwd_pair_on<T: Real>(y1: &mut [T], w1: &[T], y2: &mut [T], w2: &[T], x: &[T], m: usize, n: usize, k: usize, threads: usize) {
    join_gemms(threads, |t| linear_fwd_on(y1, x, w1, m, n, k, false, t), |t| linear_fwd_on(y2, x, w2, m, n, k, false, t));
}

/// Linear layer input gradient: `dx [m, k] (=|+=) dy [m, n] · w` with `w [n, k]`.
pub fn linear_bwd_input<T: Real>(dx: &mut [T], dy: &[T], w: &[T], m: usize, n: usize, k: usize, accumulate: bool) {
    linear_bwd_input_on(dx, dy, w, m, n, k, accumulate, gemm_threads());
}

#[allow(clippy::too_many_arguments)]
fn linear_bwd_input_on<T: Real>(dx: &mut [T], dy: &[T], w: &[T], m: usize, n: usize, k: usize, accumulate: bool, threads: usize) {
    matmul_on(MatMut::rm(dx, m, k), Mat::rm(dy, m, n), Mat::rm(w, n, k), accumulate, threads);
}

/// Linear layer weight gradient: `dw [n, k] (=|+=) dyᵀ · x` with `dy [m, n]`, `x [m, k]`.
pub fn linear_bwd_weight<T: Real>(dw: &mut [T], dy: &[T], x: &[T], m: usize, n: usize, k: usize, accumulate: bool) {
    linear_bwd_weight_on(dw, dy, x, m, n, k, accumulate, gemm_threads());
}

#[allow(clippy::too_many_arguments)]
fn linear_bwd_weight_on<T: Real>(dw: &mut [T], dy: &[T], x: &[T], m: usize, n: usize, k: usize, accumulate: bool, threads: usize) {
    matmul_on(MatMut::rm(dw, n, k), Mat::rm(dy, m, n).t(), Mat::rm(x, m, k), accumulate, threads);
}

/// Both gradients of a linear layer, side by side (see [`join_gemms`]): `dx (=|+=) dy · w` per
/// `acc_dx`, and `dw += dyᵀ · x`. The two products have the same FLOPs, so the halves balance.
#[allow(clippy::too_many_arguments)]
pub fn linear_bwd<T: Real>(dx: &mut [T], acc_dx: bool, dw: &mut [T], dy: &[T], x: &[T], w: &[T], m: usize, n: usize, k: usize) {
    linear_bwd_on(dx, acc_dx, dw, dy, x, w, m, n, k, gemm_threads());
}

#[allow(clippy::too_many_arguments)]
fn linear_bwd_on<T: Real>(
    dx: &mut [T],
    acc_dx: bool,
    dw: &mut [T],
    dy: &[T],
    x: &[T],
    w: &[T],
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
) {
    join_gemms(threads, |t| linear_bwd_weight_on(dw, dy, x, m, n, k, true, t), |t| linear_bwd_input_on(dx, dy, w, m, n, k, acc_dx, t));
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

    /// The side-by-side products give the same bits as the plain ones, one after the other, on
    /// one thread and with the threads split unevenly (3 = 1 + 2).
    #[test]
    fn joined_linear_products_match_the_plain_ones() {
        let (m, n, k) = (96, 80, 72);
        let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let w1: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.91).cos()).collect();
        let w2: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.53).sin()).collect();
        let dy: Vec<f32> = (0..m * n).map(|i| (i as f32 * 0.29).cos()).collect();
        let (mut y1, mut y2) = (vec![0.0; m * n], vec![0.0; m * n]);
        linear_fwd(&mut y1, &x, &w1, m, n, k, false);
        linear_fwd(&mut y2, &x, &w2, m, n, k, false);
        let (mut dx, mut dw) = (vec![0.5; m * k], vec![0.25; n * k]);
        linear_bwd_input(&mut dx, &dy, &w1, m, n, k, true);
        linear_bwd_weight(&mut dw, &dy, &x, m, n, k, true);
        for threads in [1, 3] {
            let (mut p1, mut p2) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
            linear_fwd_pair_on(&mut p1, &w1, &mut p2, &w2, &x, m, n, k, threads);
            assert!(p1 == y1 && p2 == y2, "forward pair on {threads} threads");
            let (mut jx, mut jw) = (vec![0.5; m * k], vec![0.25; n * k]);
            linear_bwd_on(&mut jx, true, &mut jw, &dy, &x, &w1, m, n, k, threads);
            assert!(jx == dx && jw == dw, "backward pair on {threads} threads");
            // Overwriting dx ignores what it held.
            let mut ox = vec![f32::NAN; m * k];
            linear_bwd_on(&mut ox, false, &mut jw, &dy, &x, &w1, m, n, k, threads);
            assert!(ox.iter().zip(&dx).all(|(a, b)| (a - (b - 0.5)).abs() < 1e-4), "dx overwritten on {threads} threads");
        }
    }

    /// A GEMM split into bands of rows (tall C) or columns (wide C, or C stored transposed)
    /// gives the same bits as on one thread.
    #[test]
    fn banded_gemm_is_independent_of_the_thread_count() {
        for (m, n, k) in [(130, 100, 70), (70, 190, 90)] {
            let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.91).cos()).collect();
            let run = |threads: usize, transposed_c: bool| {
                let mut c = vec![0.25f32; m * n];
                let view = if transposed_c { MatMut { data: &mut c, rows: m, cols: n, rs: 1, cs: m } } else { MatMut::rm(&mut c, m, n) };
                matmul_on(view, Mat::rm(&a, m, k), Mat::rm(&b, k, n), true, threads);
                c
            };
            for transposed_c in [false, true] {
                let one = run(1, transposed_c);
                assert!(one.iter().all(|x| x.is_finite()));
                for threads in [2, 3, 5] {
                    assert!(run(threads, transposed_c) == one, "[{m}×{k}]·[{k}×{n}] on {threads} threads (transposed c: {transposed_c})");
                }
            }
        }
    }
}
