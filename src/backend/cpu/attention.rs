//! Causal grouped-query attention, flash-style: the forward keeps only the output and each
//! row's log-sum-exp; the backward recomputes the probabilities from them.
//!
//! Legend: `B` micro-batch, `H` query heads, `KV` key/value heads (`H % KV == 0`, query head
//! `h` reads kv head `h / (H/KV)`), `Sq`/`Sk` query/key lengths, `hd` head dim, `QB` query
//! rows per block. Tensors are head-major: `q [B, H, Sq, hd]`, `k, v [B, KV, Sk, hd]`.
//! Causality is by global position (`k_pos[j] > q_pos[i]` is masked), so the same code serves
//! a rank that holds a non-contiguous piece of the sequence. Scores of one query block at a
//! time live in a `[QB, Sk]` scratch: no `[S, S]` matrix is ever held.
//! Knows nothing of projections, RoPE or parallelism.

use super::gemm::{matmul_serial as matmul, Mat, MatMut};
use crate::backend::AttnDims;
use crate::scalar::{dot, max_lanes, sum_lanes, Real};
use rayon::prelude::*;

/// Query rows per block: the scratch is `QB × Sk` per task.
const QB: usize = 64;

/// How many leading keys a block of queries can see: with ascending key positions, the keys
/// at or before the block's last position; otherwise all (masking handles the rest).
fn key_limit(k_pos: &[usize], k_sorted: bool, q_pos_block: &[usize]) -> usize {
    if !k_sorted {
        return k_pos.len();
    }
    let last = q_pos_block.iter().copied().max().unwrap_or(0);
    k_pos.partition_point(|&p| p <= last)
}

/// How many leading keys the query at position `qp` sees: with ascending key positions the
/// keys at or before it; otherwise all of them (the caller masks).
fn visible_keys(k_pos: &[usize], k_sorted: bool, qp: usize) -> usize {
    if k_sorted {
        k_pos.partition_point(|&p| p <= qp)
    } else {
        k_pos.len()
    }
}

/// One row of attention scores `q·kᵀ` becomes, in place, the softmax of `scale·q·kᵀ` over the
/// keys the query at `qp` sees (0 for the others). Returns the row's log-sum-exp of the scaled
/// scores, −∞ when it sees no key (a context-parallel rank's early queries against a later
/// chunk: the row then contributes nothing).
fn softmax_row<T: Real>(row: &mut [T], k_pos: &[usize], k_sorted: bool, qp: usize, scale: T) -> T {
    let vis = visible_keys(k_pos, k_sorted, qp);
    let (seen, hidden) = row.split_at_mut(vis);
    hidden.fill(T::ZERO);
    seen.iter_mut().for_each(|x| *x *= scale);
    if !k_sorted {
        for (x, &kp) in seen.iter_mut().zip(k_pos) {
            if kp > qp {
                *x = T::NEG_INFINITY;
            }
        }
    }
    let m = max_lanes(seen);
    if m == T::NEG_INFINITY {
        seen.fill(T::ZERO);
        return T::NEG_INFINITY;
    }
    // e^(−∞ − m) = 0 for the masked keys.
    seen.iter_mut().for_each(|x| *x = (*x - m).exp());
    let sum = sum_lanes(seen);
    let inv = T::ONE / sum;
    seen.iter_mut().for_each(|x| *x *= inv);
    m + sum.ln()
}

/// Attention forward. Overwrites `o [B, H, Sq, hd]` and `lse [B, H, Sq]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd<T: Real>(o: &mut [T], lse: &mut [T], q: &[T], k: &[T], v: &[T], q_pos: &[usize], k_pos: &[usize], dm: AttnDims) {
    let AttnDims { h, kv, sq, sk, hd, .. } = dm;
    let rep = h / kv;
    let scale = T::from_f64(1.0 / (hd as f64).sqrt());
    let k_sorted = k_pos.windows(2).all(|w| w[0] <= w[1]);
    // The score scratch `[QB, Sk]` is allocated once per rayon job, not per (batch, kv head).
    let scratch = || vec![T::ZERO; QB * sk];
    let tasks = o.par_chunks_mut(rep * sq * hd).zip(lse.par_chunks_mut(rep * sq)).enumerate();
    tasks.for_each_init(scratch, |scores, (bg, (o_g, lse_g))| {
        let kg = &k[bg * sk * hd..][..sk * hd]; // [Sk, hd]
        let vg = &v[bg * sk * hd..][..sk * hd]; // [Sk, hd]
        let qg = &q[bg * rep * sq * hd..][..rep * sq * hd]; // [rep, Sq, hd]
        for j in 0..rep {
            for i0 in (0..sq).step_by(QB) {
                let qb = QB.min(sq - i0);
                let nk = key_limit(k_pos, k_sorted, &q_pos[i0..i0 + qb]);
                let q_blk = &qg[(j * sq + i0) * hd..][..qb * hd];
                let o_blk = &mut o_g[(j * sq + i0) * hd..][..qb * hd];
                let lse_blk = &mut lse_g[j * sq + i0..][..qb];
                if nk == 0 {
                    // No visible key (cannot happen for causal self-attention on one rank).
                    o_blk.iter_mut().for_each(|x| *x = T::ZERO);
                    lse_blk.iter_mut().for_each(|x| *x = T::NEG_INFINITY);
                    continue;
                }
                let s_blk = &mut scores[..qb * nk];
                matmul(MatMut::rm(s_blk, qb, nk), Mat::rm(q_blk, qb, hd), Mat::rm(&kg[..nk * hd], nk, hd).t(), false);
                for (r, row) in s_blk.chunks_mut(nk).enumerate() {
                    lse_blk[r] = softmax_row(row, &k_pos[..nk], k_sorted, q_pos[i0 + r], scale);
                }
                matmul(MatMut::rm(o_blk, qb, hd), Mat::rm(s_blk, qb, nk), Mat::rm(&vg[..nk * hd], nk, hd), false);
            }
        }
    });
}

/// Attention backward. Overwrites `dq [B, H, Sq, hd]`, `dk, dv [B, KV, Sk, hd]`.
///
/// With `P = exp(scale·q·kᵀ − lse)`: `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP − rowsum(dO∘O))`,
/// `dQ = scale·dS·K`, `dK = scale·dSᵀ·Q`.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd<T: Real>(
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    d_o: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[T],
    q_pos: &[usize],
    k_pos: &[usize],
    dm: AttnDims,
) {
    let AttnDims { h, kv, sq, sk, hd, .. } = dm;
    let rep = h / kv;
    let scale = T::from_f64(1.0 / (hd as f64).sqrt());
    let k_sorted = k_pos.windows(2).all(|w| w[0] <= w[1]);
    // P and dP scratch `[QB, Sk]` each, allocated once per rayon job.
    let scratch = || (vec![T::ZERO; QB * sk], vec![T::ZERO; QB * sk]);
    dq.par_chunks_mut(rep * sq * hd).zip(dk.par_chunks_mut(sk * hd)).zip(dv.par_chunks_mut(sk * hd)).enumerate().for_each_init(
        scratch,
        |(p, dp), (bg, ((dq_g, dk_g), dv_g))| {
            dk_g.iter_mut().for_each(|x| *x = T::ZERO);
            dv_g.iter_mut().for_each(|x| *x = T::ZERO);
            let kg = &k[bg * sk * hd..][..sk * hd];
            let vg = &v[bg * sk * hd..][..sk * hd];
            let base = bg * rep * sq;
            for j in 0..rep {
                for i0 in (0..sq).step_by(QB) {
                    let qb = QB.min(sq - i0);
                    let nk = key_limit(k_pos, k_sorted, &q_pos[i0..i0 + qb]);
                    let row0 = base + j * sq + i0;
                    let q_blk = &q[row0 * hd..][..qb * hd];
                    let o_blk = &o[row0 * hd..][..qb * hd];
                    let do_blk = &d_o[row0 * hd..][..qb * hd];
                    let lse_blk = &lse[row0..][..qb];
                    let dq_blk = &mut dq_g[(j * sq + i0) * hd..][..qb * hd];
                    if nk == 0 {
                        dq_blk.iter_mut().for_each(|x| *x = T::ZERO);
                        continue;
                    }
                    let p_blk = &mut p[..qb * nk];
                    let dp_blk = &mut dp[..qb * nk];
                    let (k_vis, v_vis) = (Mat::rm(&kg[..nk * hd], nk, hd), Mat::rm(&vg[..nk * hd], nk, hd));
                    matmul(MatMut::rm(p_blk, qb, nk), Mat::rm(q_blk, qb, hd), k_vis.t(), false);
                    matmul(MatMut::rm(dp_blk, qb, nk), Mat::rm(do_blk, qb, hd), v_vis.t(), false);
                    for r in 0..qb {
                        let qp = q_pos[i0 + r];
                        let l = lse_blk[r];
                        let (do_r, o_r) = (&do_blk[r * hd..][..hd], &o_blk[r * hd..][..hd]);
                        let d_r = dot(do_r, o_r);
                        let (prow, dprow) = (&mut p_blk[r * nk..][..nk], &mut dp_blk[r * nk..][..nk]);
                        let vis = visible_keys(&k_pos[..nk], k_sorted, qp);
                        for (pv, dpv) in prow[..vis].iter_mut().zip(&mut dprow[..vis]) {
                            *pv = (*pv * scale - l).exp();
                            // dp now holds scale·dS, the gradient of the raw q·kᵀ product.
                            *dpv = *pv * (*dpv - d_r) * scale;
                        }
                        prow[vis..].fill(T::ZERO);
                        dprow[vis..].fill(T::ZERO);
                        if !k_sorted {
                            for ((pv, dpv), &kp) in prow.iter_mut().zip(dprow.iter_mut()).zip(k_pos) {
                                if kp > qp {
                                    (*pv, *dpv) = (T::ZERO, T::ZERO);
                                }
                            }
                        }
                    }
                    // dV += Pᵀ·dO ; dQ = dS·K ; dK += dSᵀ·Q
                    matmul(MatMut::rm(&mut dv_g[..nk * hd], nk, hd), Mat::rm(p_blk, qb, nk).t(), Mat::rm(do_blk, qb, hd), true);
                    matmul(MatMut::rm(dq_blk, qb, hd), Mat::rm(dp_blk, qb, nk), k_vis, false);
                    matmul(MatMut::rm(&mut dk_g[..nk * hd], nk, hd), Mat::rm(dp_blk, qb, nk).t(), Mat::rm(q_blk, qb, hd), true);
                }
            }
        },
    );
}

/// Merges a partial attention result `(o_part, lse_part)` over one block of keys into the
/// running `(o, lse)` (online softmax): `lse' = log(e^lse + e^lse_part)`,
/// `o' = o·e^(lse − lse') + o_part·e^(lse_part − lse')`. Rows are `[rows, hd]`; a row with
/// `lse_part = −∞` saw no key and leaves the running result as it is.
pub fn merge_partial<T: Real>(o: &mut [T], lse: &mut [T], o_part: &[T], lse_part: &[T], hd: usize) {
    o.par_chunks_mut(hd * 64).zip(lse.par_chunks_mut(64)).zip(o_part.par_chunks(hd * 64)).zip(lse_part.par_chunks(64)).for_each(
        |(((o, lse), op), lp)| {
            for (((orow, l), prow), &lpi) in o.chunks_mut(hd).zip(lse.iter_mut()).zip(op.chunks(hd)).zip(lp) {
                if lpi == T::NEG_INFINITY {
                    continue;
                }
                if *l == T::NEG_INFINITY {
                    orow.copy_from_slice(prow);
                    *l = lpi;
                    continue;
                }
                let m = l.max(lpi);
                let new = m + ((*l - m).exp() + (lpi - m).exp()).ln();
                let (a, b) = ((*l - new).exp(), (lpi - new).exp());
                for (x, &y) in orow.iter_mut().zip(prow) {
                    *x = *x * a + y * b;
                }
                *l = new;
            }
        },
    );
}
