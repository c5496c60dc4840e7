//! The elementwise and row-wise kernels of the decoder, each forward beside its backward.
//!
//! Legend: `N = B·S` tokens of the micro-batch, `D` width, `F` ffn hidden, `V` vocab,
//! `hd` head dim. Every backward says whether it overwrites (`=`) or accumulates (`+=`).
//! Knows nothing of layers, parameters or parallelism.

use crate::scalar::{max_lanes, sum_lanes_by, Real};
use rayon::prelude::*;

/// Rows per parallel task: big enough that scheduling costs nothing next to the row work.
const ROWS_PER_TASK: usize = 64;

/// RMSNorm forward: `y = x / sqrt(mean(x²) + eps) * w`; saves `rstd = 1/sqrt(mean(x²)+eps)`.
///
/// `x, y [N, D]`, `w [D]`, `rstd [N]`.
pub fn rmsnorm_fwd<T: Real>(y: &mut [T], rstd: &mut [T], x: &[T], w: &[T], d: usize, eps: f64) {
    let eps = T::from_f64(eps);
    let inv_d = T::ONE / T::from_f64(d as f64);
    y.par_chunks_mut(d * ROWS_PER_TASK).zip(rstd.par_chunks_mut(ROWS_PER_TASK)).zip(x.par_chunks(d * ROWS_PER_TASK)).for_each(
        |((y, rstd), x)| {
            for ((yr, r), xr) in y.chunks_mut(d).zip(rstd.iter_mut()).zip(x.chunks(d)) {
                let ms = sum_lanes_by(xr, |v| v * v) * inv_d;
                let s = T::ONE / (ms + eps).sqrt();
                *r = s;
                for ((yo, &xi), &wi) in yr.iter_mut().zip(xr).zip(w) {
                    *yo = wi * (xi * s);
                }
            }
        },
    );
}

/// RMSNorm backward. `dx (=|+=)` per `accumulate`; `dw +=` always.
///
/// With `r = rstd`: `dx_i = r·w_i·dy_i − r³/D · x_i · Σ_j w_j·dy_j·x_j`, `dw_i += Σ_n dy_i·x_i·r`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_bwd<T: Real>(dx: &mut [T], dw: &mut [T], dy: &[T], x: &[T], w: &[T], rstd: &[T], d: usize, accumulate: bool) {
    let inv_d = T::ONE / T::from_f64(d as f64);
    // dw is reduced over rows: each task sums its rows into its own partial, added in task order
    // so the result does not depend on the thread count.
    let partials: Vec<Vec<T>> = dx
        .par_chunks_mut(d * ROWS_PER_TASK)
        .zip(dy.par_chunks(d * ROWS_PER_TASK))
        .zip(x.par_chunks(d * ROWS_PER_TASK))
        .zip(rstd.par_chunks(ROWS_PER_TASK))
        .map(|(((dx, dy), x), rstd)| {
            let mut dw_part = vec![T::ZERO; d];
            for (((dxr, dyr), xr), &r) in dx.chunks_mut(d).zip(dy.chunks(d)).zip(x.chunks(d)).zip(rstd) {
                for j in 0..d {
                    dw_part[j] += dyr[j] * xr[j] * r;
                }
                let c = r * r * r * inv_d * dot3(w, dyr, xr);
                for j in 0..d {
                    let g = r * w[j] * dyr[j] - c * xr[j];
                    if accumulate {
                        dxr[j] += g;
                    } else {
                        dxr[j] = g;
                    }
                }
            }
            dw_part
        })
        .collect();
    for p in partials {
        for (a, b) in dw.iter_mut().zip(p) {
            *a += b;
        }
    }
}

/// `Σ_j a_j·b_j·c_j` with 16 partial sums (vectorises; see `scalar::sum_lanes_by`).
fn dot3<T: Real>(a: &[T], b: &[T], c: &[T]) -> T {
    let mut acc = [T::ZERO; 16];
    let (ca, cb, cc) = (a.chunks_exact(16), b.chunks_exact(16), c.chunks_exact(16));
    let tail = ca.remainder().iter().zip(cb.remainder()).zip(cc.remainder()).fold(T::ZERO, |s, ((&x, &y), &z)| s + x * y * z);
    for ((x, y), z) in ca.zip(cb).zip(cc) {
        for i in 0..16 {
            acc[i] += x[i] * y[i] * z[i];
        }
    }
    acc.iter().fold(tail, |s, &x| s + x)
}

/// Token-major `[B, S, nh·hd]` → head-major `[B, nh, S, hd]`, rotating by RoPE on the way
/// ("rotate-half": `(a, b) → (a·cos − b·sin, b·cos + a·sin)` for the halves `a`, `b`).
/// `cos, sin [S, hd/2]`; pass `None` to transpose without rotating (values).
#[allow(clippy::too_many_arguments)]
pub fn to_heads_rope<T: Real>(dst: &mut [T], src: &[T], b: usize, s: usize, nh: usize, hd: usize, rope: Option<(&[T], &[T])>) {
    let half = hd / 2;
    debug_assert_eq!(dst.len(), b * s * nh * hd);
    dst.par_chunks_mut(s * hd).enumerate().for_each(|(bh, out)| {
        let (bi, h) = (bh / nh, bh % nh);
        for t in 0..s {
            let row = &src[(bi * s + t) * nh * hd + h * hd..][..hd];
            let o = &mut out[t * hd..][..hd];
            match rope {
                None => o.copy_from_slice(row),
                Some((cos, sin)) => {
                    let (c, sn) = (&cos[t * half..][..half], &sin[t * half..][..half]);
                    for i in 0..half {
                        let (a, bb) = (row[i], row[i + half]);
                        o[i] = a * c[i] - bb * sn[i];
                        o[i + half] = bb * c[i] + a * sn[i];
                    }
                }
            }
        }
    });
}

/// Backward of [`to_heads_rope`]: head-major gradient → token-major, rotating by the inverse
/// (transposed) rotation. Overwrites `dst`.
#[allow(clippy::too_many_arguments)]
pub fn from_heads_rope<T: Real>(dst: &mut [T], src: &[T], b: usize, s: usize, nh: usize, hd: usize, rope: Option<(&[T], &[T])>) {
    let half = hd / 2;
    debug_assert_eq!(dst.len(), b * s * nh * hd);
    dst.par_chunks_mut(nh * hd).enumerate().for_each(|(n, row)| {
        let (bi, t) = (n / s, n % s);
        for h in 0..nh {
            let g = &src[((bi * nh + h) * s + t) * hd..][..hd];
            let o = &mut row[h * hd..][..hd];
            match rope {
                None => o.copy_from_slice(g),
                Some((cos, sin)) => {
                    let (c, sn) = (&cos[t * half..][..half], &sin[t * half..][..half]);
                    for i in 0..half {
                        let (ga, gb) = (g[i], g[i + half]);
                        o[i] = ga * c[i] + gb * sn[i];
                        o[i + half] = gb * c[i] - ga * sn[i];
                    }
                }
            }
        }
    });
}

/// SwiGLU forward: `h = silu(gate) · up`, all `[N, F]`.
pub fn swiglu_fwd<T: Real>(h: &mut [T], gate: &[T], up: &[T]) {
    h.par_chunks_mut(4096).zip(gate.par_chunks(4096)).zip(up.par_chunks(4096)).for_each(|((h, g), u)| {
        for ((o, &gi), &ui) in h.iter_mut().zip(g).zip(u) {
            *o = gi.silu() * ui;
        }
    });
}

/// SwiGLU backward; overwrites `dgate` and `dup`.
/// `silu'(g) = σ(g)·(1 + g·(1 − σ(g)))`.
pub fn swiglu_bwd<T: Real>(dgate: &mut [T], dup: &mut [T], dh: &[T], gate: &[T], up: &[T]) {
    dgate
        .par_chunks_mut(4096)
        .zip(dup.par_chunks_mut(4096))
        .zip(dh.par_chunks(4096))
        .zip(gate.par_chunks(4096).zip(up.par_chunks(4096)))
        .for_each(|(((dg, du), dh), (g, u))| {
            for i in 0..dg.len() {
                let sig = T::ONE / (T::ONE + (-g[i]).exp());
                let silu = g[i] * sig;
                du[i] = dh[i] * silu;
                dg[i] = dh[i] * u[i] * sig * (T::ONE + g[i] * (T::ONE - sig));
            }
        });
}

/// Cross entropy, part 1: the maximum of each row of `logits [N, V_local]` over its first
/// `valid` columns (the rest is vocabulary padding). Overwrites `m [N]`.
pub fn row_max<T: Real>(m: &mut [T], logits: &[T], v: usize, valid: usize) {
    m.par_chunks_mut(ROWS_PER_TASK).zip(logits.par_chunks(v * ROWS_PER_TASK)).for_each(|(m, rows)| {
        for (mi, row) in m.iter_mut().zip(rows.chunks(v)) {
            *mi = max_lanes(&row[..valid]);
        }
    });
}

/// Cross entropy, part 2: `s[n] = Σ_j exp(logits[n, j] − m[n])` over the valid columns.
pub fn row_sum_exp<T: Real>(s: &mut [T], logits: &[T], m: &[T], v: usize, valid: usize) {
    s.par_chunks_mut(ROWS_PER_TASK).zip(logits.par_chunks(v * ROWS_PER_TASK)).zip(m.par_chunks(ROWS_PER_TASK)).for_each(
        |((s, rows), m)| {
            for ((si, row), &mi) in s.iter_mut().zip(rows.chunks(v)).zip(m) {
                *si = sum_lanes_by(&row[..valid], |x| (x - mi).exp());
            }
        },
    );
}

/// Cross entropy, part 3: the target's logit where this rank holds the target's vocabulary
/// row (`offset ≤ target < offset + valid`), else 0. Overwrites `t [N]`.
pub fn target_logit<T: Real>(t: &mut [T], logits: &[T], targets: &[u32], v: usize, offset: usize, valid: usize) {
    for ((ti, row), &tg) in t.iter_mut().zip(logits.chunks(v)).zip(targets) {
        let local = (tg as usize).wrapping_sub(offset);
        *ti = if local < valid { row[local] } else { T::ZERO };
    }
}

/// Cross entropy backward, in place: `logits` becomes `dlogits = scale · (softmax − onehot)`
/// with `lse [N]` the log-sum-exp over the whole vocabulary; padding columns get 0.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_bwd_inplace<T: Real>(logits: &mut [T], lse: &[T], targets: &[u32], v: usize, offset: usize, valid: usize, scale: T) {
    logits.par_chunks_mut(v * ROWS_PER_TASK).zip(lse.par_chunks(ROWS_PER_TASK)).zip(targets.par_chunks(ROWS_PER_TASK)).for_each(
        |((rows, lse), targets)| {
            for ((row, &l), &t) in rows.chunks_mut(v).zip(lse).zip(targets) {
                let (real, pad) = row.split_at_mut(valid);
                for x in real.iter_mut() {
                    *x = (*x - l).exp() * scale;
                }
                pad.iter_mut().for_each(|x| *x = T::ZERO);
                let local = (t as usize).wrapping_sub(offset);
                if local < valid {
                    real[local] -= scale;
                }
            }
        },
    );
}

/// `dst += src`, elementwise.
pub fn add_assign<T: Real>(dst: &mut [T], src: &[T]) {
    dst.par_chunks_mut(8192).zip(src.par_chunks(8192)).for_each(|(d, s)| {
        for (a, &b) in d.iter_mut().zip(s) {
            *a += b;
        }
    });
}

/// `dst = a + b`, elementwise.
pub fn add<T: Real>(dst: &mut [T], a: &[T], b: &[T]) {
    dst.par_chunks_mut(8192).zip(a.par_chunks(8192)).zip(b.par_chunks(8192)).for_each(|((d, a), b)| {
        for ((o, &x), &y) in d.iter_mut().zip(a).zip(b) {
            *o = x + y;
        }
    });
}
