//! Causal grouped-query attention on the GPU as batched GEMMs: the orchestration, written
//! against [`AttnDevice`] so that a test can run the very same sequence of calls on a host
//! emulation of cuBLAS and of the kernels (`tests` below) and hold it to `backend::cpu::attention`.
//!
//! Per chunk of (batch, kv head) groups — the `rep = H/KV` query heads of a group are stacked
//! as `rep·Sq` rows, so grouped-query attention needs no copies — forward computes
//! `S = Q·Kᵀ`, the causal softmax of `scale·S` in place with its log-sum-exp, and `O = P·V`;
//! backward recomputes `P` from the log-sum-exp, then `dV = Pᵀ·dO`, `dP = dO·Vᵀ`,
//! `dS = scale·P∘(dP − rowsum(dO∘O))`, `dQ = dS·K`, `dK = dSᵀ·Q`. Tensors are head-major:
//! `q, o [B, H, Sq, hd]`, `k, v [B, KV, Sk, hd]`, `lse [B, H, Sq]`.

use crate::backend::AttnDims;

/// Elements of one score buffer (1 GiB of f32): the groups are processed in chunks that fit.
pub const SCORES_CAP: usize = 1 << 28;

/// What the orchestration needs from a device.
pub trait AttnDevice {
    type Buf;
    type Pos;
    /// A buffer of at least `n` elements (reused between calls).
    fn ensure(&self, buf: &mut Self::Buf, n: usize);
    /// `count` row-major products `c_i = op(a_i)·op(b_i)` (`beta = 0`), operand `i` at
    /// `offset + i·stride` (see `Gpu::gemm_batched`).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        c: (&mut Self::Buf, usize),
        a: (&Self::Buf, usize),
        b: (&Self::Buf, usize),
        mnk: (usize, usize, usize),
        trans: (bool, bool),
        batch: (usize, (usize, usize, usize)),
    );
    /// The kernels of `kernels.cu` of the same names; `rows = (rows, row0, sq, sk)`.
    fn softmax(
        &self,
        s: &mut Self::Buf,
        lse: &mut Self::Buf,
        pos: (&Self::Pos, &Self::Pos),
        rows: (usize, usize, usize, usize),
        scale: f32,
    );
    fn probs(&self, s: &mut Self::Buf, lse: &Self::Buf, pos: (&Self::Pos, &Self::Pos), rows: (usize, usize, usize, usize), scale: f32);
    fn dscores(&self, dp: &mut Self::Buf, p: &Self::Buf, dd: &Self::Buf, rows: (usize, usize, usize), scale: f32);
    fn rowdot(&self, dd: &mut Self::Buf, d_o: &Self::Buf, o: &Self::Buf, rows: (usize, usize));
}

/// How one attention call is cut: `groups = B·KV` products of `rep·Sq` query rows against
/// `Sk` keys, `chunk` groups at a time.
pub struct AttnPlan {
    pub groups: usize,
    pub chunk: usize,
    /// Query rows of one group, and the elements of a group's q / k block and scores.
    pub rows: usize,
    pub q_block: usize,
    pub k_block: usize,
    pub s_block: usize,
    pub sq: usize,
    pub sk: usize,
    pub hd: usize,
    pub scale: f32,
}

impl AttnPlan {
    pub fn new(dm: AttnDims, cap: usize) -> AttnPlan {
        let i32_ok = [dm.b * dm.h * dm.sq, dm.sq, dm.sk, dm.hd].iter().all(|&x| i32::try_from(x).is_ok());
        assert!(i32_ok && dm.kv > 0 && dm.h % dm.kv == 0, "attention sizes {dm:?} beyond the GPU kernels' 32-bit indices");
        let rows = dm.h / dm.kv * dm.sq;
        let s_block = rows * dm.sk;
        let groups = dm.b * dm.kv;
        AttnPlan {
            groups,
            chunk: (cap / s_block.max(1)).clamp(1, groups.max(1)),
            rows,
            q_block: rows * dm.hd,
            k_block: dm.sk * dm.hd,
            s_block,
            sq: dm.sq,
            sk: dm.sk,
            hd: dm.hd,
            scale: 1.0 / (dm.hd as f32).sqrt(),
        }
    }

    /// `(first group, groups)` of each chunk.
    pub fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.groups).step_by(self.chunk).map(|g| (g, self.chunk.min(self.groups - g)))
    }
}

/// `o =`, `lse =`; `s` is the score scratch.
#[allow(clippy::too_many_arguments)]
pub fn forward<D: AttnDevice>(
    d: &D,
    p: &AttnPlan,
    s: &mut D::Buf,
    (o, lse): (&mut D::Buf, &mut D::Buf),
    (q, k, v): (&D::Buf, &D::Buf, &D::Buf),
    pos: (&D::Pos, &D::Pos),
) {
    d.ensure(s, p.chunk * p.s_block);
    for (g0, n) in p.chunks() {
        let (qo, ko) = (g0 * p.q_block, g0 * p.k_block);
        d.gemm((s, 0), (q, qo), (k, ko), (p.rows, p.sk, p.hd), (false, true), (n, (p.q_block, p.k_block, p.s_block)));
        d.softmax(s, lse, pos, (n * p.rows, g0 * p.rows, p.sq, p.sk), p.scale);
        d.gemm((o, qo), (s, 0), (v, ko), (p.rows, p.hd, p.sk), (false, false), (n, (p.s_block, p.k_block, p.q_block)));
    }
}

/// What the backward reads: `dO`, and the forward's `q, k, v, o, lse`.
pub type Saved<'a, B> = (&'a B, &'a B, &'a B, &'a B, &'a B, &'a B);

/// `dq =`, `dk =`, `dv =`; `s`, `ds`, `dd` are scratch.
#[allow(clippy::too_many_arguments)]
pub fn backward<D: AttnDevice>(
    d: &D,
    p: &AttnPlan,
    (s, ds, dd): (&mut D::Buf, &mut D::Buf, &mut D::Buf),
    (dq, dk, dv): (&mut D::Buf, &mut D::Buf, &mut D::Buf),
    (d_o, q, k, v, o, lse): Saved<'_, D::Buf>,
    pos: (&D::Pos, &D::Pos),
) {
    let total_rows = p.groups * p.rows;
    d.ensure(dd, total_rows);
    d.rowdot(dd, d_o, o, (total_rows, p.hd));
    d.ensure(s, p.chunk * p.s_block);
    d.ensure(ds, p.chunk * p.s_block);
    for (g0, n) in p.chunks() {
        let (qo, ko) = (g0 * p.q_block, g0 * p.k_block);
        let (qs, ks, ss) = (p.q_block, p.k_block, p.s_block);
        let rows = (n * p.rows, g0 * p.rows, p.sq, p.sk);
        d.gemm((s, 0), (q, qo), (k, ko), (p.rows, p.sk, p.hd), (false, true), (n, (qs, ks, ss)));
        d.probs(s, lse, pos, rows, p.scale);
        d.gemm((dv, ko), (s, 0), (d_o, qo), (p.sk, p.hd, p.rows), (true, false), (n, (ss, qs, ks)));
        d.gemm((ds, 0), (d_o, qo), (v, ko), (p.rows, p.sk, p.hd), (false, true), (n, (qs, ks, ss)));
        d.dscores(ds, s, dd, (n * p.rows, g0 * p.rows, p.sk), p.scale);
        d.gemm((dq, qo), (ds, 0), (k, ko), (p.rows, p.hd, p.sk), (false, false), (n, (ss, ks, qs)));
        d.gemm((dk, ko), (ds, 0), (q, qo), (p.sk, p.hd, p.rows), (true, false), (n, (ss, qs, ks)));
    }
}

#[cfg(test)]
mod tests {
    //! The orchestration above on a host emulation: cuBLAS's column-major strided-batched GEMM
    //! interpreted from the very call parameters the GPU passes (`gemm_config`), and the
    //! kernels re-stated in Rust. Shows the plan, offsets, strides, transposes and the
    //! backward's algebra right; the CUDA code itself is checked by `gpu-check` on a GPU.
    use super::*;
    use crate::backend::cpu::attention::{attention_bwd, attention_fwd};
    use crate::backend::cuda::gemm_config;
    use cudarc::cublas::sys::cublasOperation_t;

    struct Host;

    impl AttnDevice for Host {
        type Buf = Vec<f32>;
        type Pos = Vec<usize>;
        fn ensure(&self, buf: &mut Vec<f32>, n: usize) {
            if buf.len() < n {
                buf.resize(n, 0.0);
            }
        }
        fn gemm(
            &self,
            c: (&mut Vec<f32>, usize),
            a: (&Vec<f32>, usize),
            b: (&Vec<f32>, usize),
            (m, n, k): (usize, usize, usize),
            trans: (bool, bool),
            (count, (sa, sb, sc)): (usize, (usize, usize, usize)),
        ) {
            // cuBLAS: C_cm = op(A_cm)·op(B_cm) with A_cm = our b, B_cm = our a, column-major.
            let cfg = gemm_config(m, n, k, trans, 0.0);
            let (mc, nc, kc) = (cfg.m as usize, cfg.n as usize, cfg.k as usize);
            let (lda, ldb, ldc) = (cfg.lda as usize, cfg.ldb as usize, cfg.ldc as usize);
            let at = |x: &[f32], ld: usize, t: cublasOperation_t, i: usize, j: usize| match t {
                cublasOperation_t::CUBLAS_OP_N => x[i + j * ld],
                _ => x[j + i * ld],
            };
            for bi in 0..count {
                let (ac, bc) = (&b.0[b.1 + bi * sb..], &a.0[a.1 + bi * sa..]);
                for j in 0..nc {
                    for i in 0..mc {
                        let s: f32 = (0..kc).map(|l| at(ac, lda, cfg.transa, i, l) * at(bc, ldb, cfg.transb, l, j)).sum();
                        c.0[c.1 + bi * sc + i + j * ldc] = s;
                    }
                }
            }
        }
        fn softmax(
            &self,
            s: &mut Vec<f32>,
            lse: &mut Vec<f32>,
            (qp, kp): (&Vec<usize>, &Vec<usize>),
            (rows, row0, sq, sk): (usize, usize, usize, usize),
            scale: f32,
        ) {
            for r in 0..rows {
                let x = &mut s[r * sk..][..sk];
                let q = qp[(row0 + r) % sq];
                let mx = (0..sk).filter(|&j| kp[j] <= q).map(|j| x[j] * scale).fold(f32::NEG_INFINITY, f32::max);
                if mx == f32::NEG_INFINITY {
                    x.iter_mut().for_each(|v| *v = 0.0);
                    lse[row0 + r] = f32::NEG_INFINITY;
                    continue;
                }
                let l = mx + (0..sk).filter(|&j| kp[j] <= q).map(|j| (x[j] * scale - mx).exp()).sum::<f32>().ln();
                for j in 0..sk {
                    x[j] = if kp[j] <= q { (x[j] * scale - l).exp() } else { 0.0 };
                }
                lse[row0 + r] = l;
            }
        }
        fn probs(
            &self,
            s: &mut Vec<f32>,
            lse: &Vec<f32>,
            (qp, kp): (&Vec<usize>, &Vec<usize>),
            (rows, row0, sq, sk): (usize, usize, usize, usize),
            scale: f32,
        ) {
            for r in 0..rows {
                let (q, l) = (qp[(row0 + r) % sq], lse[row0 + r]);
                for j in 0..sk {
                    let x = &mut s[r * sk + j];
                    *x = if l != f32::NEG_INFINITY && kp[j] <= q { (*x * scale - l).exp() } else { 0.0 };
                }
            }
        }
        fn dscores(&self, dp: &mut Vec<f32>, p: &Vec<f32>, dd: &Vec<f32>, (rows, row0, sk): (usize, usize, usize), scale: f32) {
            for r in 0..rows {
                for j in 0..sk {
                    let e = r * sk + j;
                    dp[e] = scale * p[e] * (dp[e] - dd[row0 + r]);
                }
            }
        }
        fn rowdot(&self, dd: &mut Vec<f32>, d_o: &Vec<f32>, o: &Vec<f32>, (rows, hd): (usize, usize)) {
            for r in 0..rows {
                dd[r] = (0..hd).map(|e| d_o[r * hd + e] * o[r * hd + e]).sum();
            }
        }
    }

    /// Context-parallel rank `rank`'s positions of a sequence of `s` tokens over `cp` ranks:
    /// chunks `rank` and `2·cp − 1 − rank` of `2·cp` ("zigzag", `docs/parallelism.md`).
    fn zigzag_positions(s: usize, cp: usize, rank: usize) -> Vec<usize> {
        let c = s / (2 * cp);
        (rank * c..(rank + 1) * c).chain((2 * cp - 1 - rank) * c..(2 * cp - rank) * c).collect()
    }

    /// Deterministic inputs in [−1, 1).
    fn inputs(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Largest |a − b| over the largest |b| (equal values, infinities included, differ by 0).
    fn rel(a: &[f32], b: &[f32]) -> f64 {
        let scale = b.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, &x| m.max(x.abs() as f64)).max(f64::MIN_POSITIVE);
        // A NaN on either side is an infinite error.
        let diff = a.iter().zip(b).fold(0.0f64, |m, (&x, &y)| {
            let d = if x == y { 0.0 } else { (x as f64 - y as f64).abs() };
            if d.is_nan() {
                f64::INFINITY
            } else {
                m.max(d)
            }
        });
        diff / scale
    }

    /// GQA 6 query heads on 2 kv heads, two sequences; causal, and a context-parallel piece
    /// whose first queries see no key; with a score cap that forces several chunks.
    #[test]
    fn batched_gemm_attention_matches_the_cpu_kernels() {
        let s = 24;
        let all: Vec<usize> = (0..s).collect();
        let cases = [("causal", all.clone(), all.clone()), ("zigzag", zigzag_positions(s, 2, 0), zigzag_positions(s, 2, 1))];
        for (what, qp, kp) in cases {
            for cap in [SCORES_CAP, 3 * 12 * 12] {
                let dm = AttnDims { b: 2, h: 6, kv: 2, sq: qp.len(), sk: kp.len(), hd: 16 };
                let (nq, nk) = (dm.b * dm.h * dm.sq * dm.hd, dm.b * dm.kv * dm.sk * dm.hd);
                let (q, k, v, d_o) = (inputs(nq, 1), inputs(nk, 2), inputs(nk, 3), inputs(nq, 4));
                let (mut o, mut lse) = (vec![0.0; nq], vec![0.0; nq / dm.hd]);
                attention_fwd(&mut o, &mut lse, &q, &k, &v, &qp, &kp, dm);
                let (mut dq, mut dk, mut dv) = (vec![0.0; nq], vec![0.0; nk], vec![0.0; nk]);
                attention_bwd(&mut dq, &mut dk, &mut dv, &d_o, &q, &k, &v, &o, &lse, &qp, &kp, dm);

                let plan = AttnPlan::new(dm, cap);
                assert!(cap == SCORES_CAP || plan.chunk < plan.groups, "{what}: the small cap must force chunks");
                let (mut s_, mut ds, mut dd) = (vec![], vec![], vec![]);
                let (mut o2, mut lse2) = (vec![0.0; nq], vec![0.0; nq / dm.hd]);
                forward(&Host, &plan, &mut s_, (&mut o2, &mut lse2), (&q, &k, &v), (&qp, &kp));
                assert!(rel(&o2, &o) < 1e-5 && rel(&lse2, &lse) < 1e-5, "{what}, cap {cap}: forward {} {}", rel(&o2, &o), rel(&lse2, &lse));
                let (mut dq2, mut dk2, mut dv2) = (vec![0.0; nq], vec![0.0; nk], vec![0.0; nk]);
                backward(
                    &Host,
                    &plan,
                    (&mut s_, &mut ds, &mut dd),
                    (&mut dq2, &mut dk2, &mut dv2),
                    (&d_o, &q, &k, &v, &o, &lse),
                    (&qp, &kp),
                );
                for (name, a, b) in [("dq", &dq2, &dq), ("dk", &dk2, &dk), ("dv", &dv2, &dv)] {
                    assert!(rel(a, b) < 1e-5, "{what}, cap {cap}: {name} relative error {}", rel(a, b));
                }
            }
        }
    }

    /// The linear layers' three GEMMs as the GPU backend calls them (`linear_gemm`, through
    /// the cuBLAS parameters of `gemm_config`) equal `cpu::gemm::linear_*`.
    #[test]
    fn the_linear_gemms_as_the_gpu_calls_them_equal_the_host_ones() {
        use crate::backend::cuda::backend::{linear_gemm, Linear};
        let (m, n, k) = (6, 5, 9);
        let (x, w, dy) = (inputs(m * k, 7), inputs(n * k, 8), inputs(m * n, 9));
        let run = |which, a: &Vec<f32>, b: &Vec<f32>, len| {
            let (mnk, trans) = linear_gemm(which, m, n, k);
            let mut c = vec![0.0; len];
            Host.gemm((&mut c, 0), (a, 0), (b, 0), mnk, trans, (1, (0, 0, 0)));
            c
        };
        let (mut y, mut dx, mut dw) = (vec![0.0; m * n], vec![0.0; m * k], vec![0.0; n * k]);
        crate::backend::cpu::gemm::linear_fwd(&mut y, &x, &w, m, n, k, false);
        crate::backend::cpu::gemm::linear_bwd_input(&mut dx, &dy, &w, m, n, k, false);
        crate::backend::cpu::gemm::linear_bwd_weight(&mut dw, &dy, &x, m, n, k, false);
        assert!(rel(&run(Linear::Forward, &x, &w, m * n), &y) < 1e-6);
        assert!(rel(&run(Linear::Input, &dy, &w, m * k), &dx) < 1e-6);
        assert!(rel(&run(Linear::Weight, &dy, &x, n * k), &dw) < 1e-6);
    }

    /// The column-major call parameters compute the row-major products the three linear
    /// layers need, for every transpose combination.
    #[test]
    fn gemm_config_computes_row_major_products() {
        let (m, n, k) = (5, 7, 3);
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let (a, b) = (inputs(m * k, 5), inputs(k * n, 6));
            // Row-major a [m,k] (or [k,m] stored when transposed), b [k,n] (or [n,k]).
            let ga = |i: usize, l: usize| if ta { a[l * m + i] } else { a[i * k + l] };
            let gb = |l: usize, j: usize| if tb { b[j * k + l] } else { b[l * n + j] };
            let want: Vec<f32> = (0..m * n).map(|e| (0..k).map(|l| ga(e / n, l) * gb(l, e % n)).sum()).collect();
            let mut c = vec![0.0; m * n];
            Host.gemm((&mut c, 0), (&a, 0), (&b, 0), (m, n, k), (ta, tb), (1, (0, 0, 0)));
            assert!(rel(&c, &want) < 1e-6, "trans {ta} {tb}: {c:?} vs {want:?}");
        }
    }
}
