//! The host backend: every operation is the CPU kernel its contract names (rayon-parallel,
//! the `gemm` crate's GEMM), on `Vec<T>`. It is the reference the GPU backend is checked
//! against, and what training runs on by default. Its kernels live beside it: `gemm` (the GEMM
//! and the linear layers), `kernels` (norms, RoPE transposes, SwiGLU, cross entropy), `attention`
//! (flash-style causal attention), `adamw`, `probe` (the GEMM, FMA-peak and memory rates
//! of this rank's threads), `heap` (the host memory policy: mmap threshold, a spare GEMM block per thread) and `features` (the CPU features the build uses, checked at start). A rank's threads are shared by the GEMM and rayon's pool ([`use_threads`]).
//!
//! With [`Precision::Bf16`] the linear layers round their operands to bf16 (nearest even)
//! before an f32 GEMM: what the GPU's bf16 tensor-core GEMMs compute up to summation order, so
//! a mixed-precision run has a host reference. It is slower than fp32 here (the rounded copies).

pub mod adamw;
pub mod attention;
pub mod features;
pub mod gemm;
pub mod heap;
pub mod kernels;
pub mod probe;

use super::{AdamStep, AttnDims, Backend, Precision};
use crate::scalar::Real;
use attention::{attention_bwd, attention_fwd, merge_partial};
use gemm::{linear_bwd, linear_bwd_input, linear_bwd_weight, linear_fwd, linear_fwd_pair};
use rayon::prelude::*;
use std::ops::Range;

/// The host. `Cpu::default()` is fp32 with its buffers in plain sight.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu {
    pub precision: Precision,
    /// Present the buffers as device memory (`host` and `host_mut` answer `None`), so every
    /// host access is staged through copies as on a GPU: a host test of the device path.
    pub staged: bool,
}

/// `x` rounded to bf16 and back (nearest even; NaN stays NaN), in f32 arithmetic.
pub fn round_bf16(x: f32) -> f32 {
    let u = x.to_bits();
    if x.is_nan() {
        return f32::from_bits((u | 0x0040_0000) & 0xffff_0000);
    }
    f32::from_bits((u.wrapping_add(0x7fff + ((u >> 16) & 1))) & 0xffff_0000)
}

/// Runs the host kernels on `threads` threads: rayon's global pool and the GEMM's share. A
/// second global pool cannot be built: a process that trains twice (tests) keeps the first.
pub fn use_threads(threads: usize) {
    let _ = rayon::ThreadPoolBuilder::new().num_threads(threads).build_global();
    set_gemm_threads(threads);
}

/// How many threads a GEMM may use; set once per rank at start (`[run] threads`). Read by the
/// GEMM (`gemm`) and by the allocator, which keeps a packing buffer per GEMM thread (`heap`).
static GEMM_THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

/// Sets the number of threads each GEMM uses on this rank.
pub fn set_gemm_threads(n: usize) {
    GEMM_THREADS.store(n.max(1), std::sync::atomic::Ordering::Relaxed);
}

/// The number of threads each GEMM uses on this rank.
pub fn gemm_threads() -> usize {
    GEMM_THREADS.load(std::sync::atomic::Ordering::Relaxed)
}

impl Cpu {
    /// The operands of a GEMM as the configured precision sees them.
    fn operand<'a, T: Real>(&self, x: &'a [T], scratch: &'a mut Vec<T>) -> &'a [T] {
        match self.precision {
            Precision::Fp32 => x,
            Precision::Bf16 => {
                scratch.clear();
                scratch.par_extend(x.par_iter().map(|&v| T::from_f64(round_bf16(v.to_f64() as f32) as f64)));
                scratch
            }
        }
    }
}

impl<T: Real> Backend<T> for Cpu {
    type Buf = Vec<T>;
    type Ids = Vec<u32>;
    type Fence = ();
    type Pos = Vec<usize>;

    fn describe(&self) -> String {
        if self.staged { "cpu (staged as a device)" } else { "cpu" }.into()
    }

    fn synchronize(&self) -> Result<(), String> {
        Ok(())
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn zeros(&self, n: usize) -> Vec<T> {
        vec![T::ZERO; n]
    }

    fn len(&self, b: &Vec<T>) -> usize {
        b.len()
    }

    fn resize(&self, b: &mut Vec<T>, n: usize) {
        b.resize(n, T::ZERO);
    }

    fn upload(&self, dst: &mut Vec<T>, host: &[T]) {
        dst.clear();
        dst.extend_from_slice(host);
    }

    fn download(&self, src: &Vec<T>, host: &mut [T]) {
        host.copy_from_slice(src);
    }

    fn copy(&self, dst: &mut Vec<T>, src: &Vec<T>) {
        dst.copy_from_slice(src);
    }

    fn fill(&self, dst: &mut Vec<T>, x: T) {
        dst.iter_mut().for_each(|d| *d = x);
    }

    fn copy_range(&self, dst: &mut Vec<T>, at: usize, src: &Vec<T>, from: Range<usize>) {
        dst[at..at + from.len()].copy_from_slice(&src[from]);
    }

    fn add_range(&self, dst: &mut Vec<T>, at: usize, src: &Vec<T>, from: Range<usize>) {
        for (a, &b) in dst[at..at + from.len()].iter_mut().zip(&src[from]) {
            *a += b;
        }
    }

    fn fill_range(&self, dst: &mut Vec<T>, range: Range<usize>, x: T) {
        dst[range].iter_mut().for_each(|d| *d = x);
    }

    fn host<'b>(&self, b: &'b Vec<T>) -> Option<&'b [T]> {
        (!self.staged).then_some(b.as_slice())
    }

    fn host_mut<'b>(&self, b: &'b mut Vec<T>) -> Option<&'b mut [T]> {
        (!self.staged).then_some(b.as_mut_slice())
    }

    fn set_ids(&self, dst: &mut Vec<u32>, host: &[u32]) {
        dst.clear();
        dst.extend_from_slice(host);
    }

    fn set_positions(&self, dst: &mut Vec<usize>, host: &[usize]) {
        dst.clear();
        dst.extend_from_slice(host);
    }

    fn linear_fwd(&self, y: &mut Vec<T>, x: &Vec<T>, w: &Vec<T>, m: usize, n: usize, k: usize, acc: bool) {
        let (mut sx, mut sw) = (vec![], vec![]);
        linear_fwd(y, self.operand(x, &mut sx), self.operand(w, &mut sw), m, n, k, acc);
    }

    fn linear_bwd_input(&self, dx: &mut Vec<T>, dy: &Vec<T>, w: &Vec<T>, m: usize, n: usize, k: usize, acc: bool) {
        let (mut sd, mut sw) = (vec![], vec![]);
        linear_bwd_input(dx, self.operand(dy, &mut sd), self.operand(w, &mut sw), m, n, k, acc);
    }

    fn linear_bwd_weight(&self, dw: &mut Vec<T>, dy: &Vec<T>, x: &Vec<T>, m: usize, n: usize, k: usize, acc: bool) {
        let (mut sd, mut sx) = (vec![], vec![]);
        linear_bwd_weight(dw, self.operand(dy, &mut sd), self.operand(x, &mut sx), m, n, k, acc);
    }

    fn linear_fwd_pair(&self, y1: &mut Vec<T>, w1: &Vec<T>, y2: &mut Vec<T>, w2: &Vec<T>, x: &Vec<T>, m: usize, n: usize, k: usize) {
        let (mut sx, mut s1, mut s2) = (vec![], vec![], vec![]);
        let (x, w1, w2) = (self.operand(x, &mut sx), self.operand(w1, &mut s1), self.operand(w2, &mut s2));
        linear_fwd_pair(y1, w1, y2, w2, x, m, n, k);
    }

    fn linear_bwd(
        &self,
        dx: &mut Vec<T>,
        acc_dx: bool,
        dw: &mut Vec<T>,
        dy: &Vec<T>,
        x: &Vec<T>,
        w: &Vec<T>,
        m: usize,
        n: usize,
        k: usize,
    ) {
        let (mut sd, mut sx, mut sw) = (vec![], vec![], vec![]);
        let (dy, x, w) = (self.operand(dy, &mut sd), self.operand(x, &mut sx), self.operand(w, &mut sw));
        linear_bwd(dx, acc_dx, dw, dy, x, w, m, n, k);
    }

    fn rmsnorm_fwd(&self, y: &mut Vec<T>, rstd: &mut Vec<T>, x: &Vec<T>, w: &Vec<T>, d: usize, eps: f64) {
        kernels::rmsnorm_fwd(y, rstd, x, w, d, eps);
    }

    fn rmsnorm_bwd(&self, dx: &mut Vec<T>, dw: &mut Vec<T>, dy: &Vec<T>, x: &Vec<T>, w: &Vec<T>, rstd: &Vec<T>, d: usize, acc: bool) {
        kernels::rmsnorm_bwd(dx, dw, dy, x, w, rstd, d, acc);
    }

    fn tokens_to_heads(&self, dst: &mut Vec<T>, src: &Vec<T>, b: usize, s: usize, nh: usize, hd: usize, rope: Option<(&Vec<T>, &Vec<T>)>) {
        kernels::to_heads_rope(dst, src, b, s, nh, hd, rope.map(|(c, s)| (c.as_slice(), s.as_slice())));
    }

    fn heads_to_tokens(&self, dst: &mut Vec<T>, src: &Vec<T>, b: usize, s: usize, nh: usize, hd: usize, rope: Option<(&Vec<T>, &Vec<T>)>) {
        kernels::from_heads_rope(dst, src, b, s, nh, hd, rope.map(|(c, s)| (c.as_slice(), s.as_slice())));
    }

    fn swiglu_fwd(&self, h: &mut Vec<T>, gate: &Vec<T>, up: &Vec<T>) {
        kernels::swiglu_fwd(h, gate, up);
    }

    fn swiglu_bwd(&self, dgate: &mut Vec<T>, dup: &mut Vec<T>, dh: &Vec<T>, gate: &Vec<T>, up: &Vec<T>) {
        kernels::swiglu_bwd(dgate, dup, dh, gate, up);
    }

    fn add_assign(&self, dst: &mut Vec<T>, src: &Vec<T>) {
        kernels::add_assign(dst, src);
    }

    fn embed_fwd(&self, x: &mut Vec<T>, table: &Vec<T>, ids: &Vec<u32>, offset: usize, valid: usize, d: usize) {
        for (row, &t) in x.chunks_mut(d).zip(ids) {
            let local = (t as usize).wrapping_sub(offset);
            if local < valid {
                row.copy_from_slice(&table[local * d..][..d]);
            } else {
                row.iter_mut().for_each(|x| *x = T::ZERO);
            }
        }
    }

    fn grouped_linear_fwd(&self, y: &mut Vec<T>, x: &Vec<T>, ws: &[&Vec<T>], offsets: &[usize], n: usize, k: usize) {
        for (g, w) in ws.iter().enumerate() {
            let (r0, r1) = (offsets[g], offsets[g + 1]);
            let (mut sx, mut sw) = (vec![], vec![]);
            let (xg, wg) = (self.operand(&x[r0 * k..r1 * k], &mut sx), self.operand(w, &mut sw));
            linear_fwd(&mut y[r0 * n..r1 * n], xg, wg, r1 - r0, n, k, false);
        }
    }

    fn grouped_linear_fwd_pair(
        &self,
        y1: &mut Vec<T>,
        ws1: &[&Vec<T>],
        y2: &mut Vec<T>,
        ws2: &[&Vec<T>],
        x: &Vec<T>,
        offsets: &[usize],
        n: usize,
        k: usize,
    ) {
        for (g, (w1, w2)) in ws1.iter().zip(ws2).enumerate() {
            let (r0, r1) = (offsets[g], offsets[g + 1]);
            if r1 > r0 {
                let (mut sx, mut s1, mut s2) = (vec![], vec![], vec![]);
                let (xg, w1, w2) = (self.operand(&x[r0 * k..r1 * k], &mut sx), self.operand(w1, &mut s1), self.operand(w2, &mut s2));
                linear_fwd_pair(&mut y1[r0 * n..r1 * n], w1, &mut y2[r0 * n..r1 * n], w2, xg, r1 - r0, n, k);
            }
        }
    }

    fn grouped_linear_bwd(
        &self,
        dx: &mut Vec<T>,
        acc_dx: bool,
        dws: &mut [&mut Vec<T>],
        dy: &Vec<T>,
        x: &Vec<T>,
        ws: &[&Vec<T>],
        offsets: &[usize],
        n: usize,
        k: usize,
    ) {
        for (g, (dw, w)) in dws.iter_mut().zip(ws).enumerate() {
            let (r0, r1) = (offsets[g], offsets[g + 1]);
            if r1 > r0 {
                let (mut sd, mut sx, mut sw) = (vec![], vec![], vec![]);
                let (dyg, xg, wg) =
                    (self.operand(&dy[r0 * n..r1 * n], &mut sd), self.operand(&x[r0 * k..r1 * k], &mut sx), self.operand(w, &mut sw));
                linear_bwd(&mut dx[r0 * k..r1 * k], acc_dx, dw, dyg, xg, wg, r1 - r0, n, k);
            }
        }
    }

    fn grouped_linear_bwd_input(&self, dx: &mut Vec<T>, dy: &Vec<T>, ws: &[&Vec<T>], offsets: &[usize], n: usize, k: usize, acc: bool) {
        for (g, w) in ws.iter().enumerate() {
            let (r0, r1) = (offsets[g], offsets[g + 1]);
            let (mut sd, mut sw) = (vec![], vec![]);
            let (dyg, wg) = (self.operand(&dy[r0 * n..r1 * n], &mut sd), self.operand(w, &mut sw));
            linear_bwd_input(&mut dx[r0 * k..r1 * k], dyg, wg, r1 - r0, n, k, acc);
        }
    }

    fn grouped_linear_bwd_weight(
        &self,
        dws: &mut [&mut Vec<T>],
        dy: &Vec<T>,
        x: &Vec<T>,
        offsets: &[usize],
        n: usize,
        k: usize,
        acc: bool,
    ) {
        for (g, dw) in dws.iter_mut().enumerate() {
            let (r0, r1) = (offsets[g], offsets[g + 1]);
            let (mut sd, mut sx) = (vec![], vec![]);
            let (dyg, xg) = (self.operand(&dy[r0 * n..r1 * n], &mut sd), self.operand(&x[r0 * k..r1 * k], &mut sx));
            linear_bwd_weight(dw, dyg, xg, r1 - r0, n, k, acc);
        }
    }

    fn embed_bwd(&self, dtable: &mut Vec<T>, dx: &Vec<T>, ids: &Vec<u32>, offset: usize, valid: usize, d: usize) {
        for (row, &t) in dx.chunks(d).zip(ids) {
            let local = (t as usize).wrapping_sub(offset);
            if local < valid {
                for (g, &x) in dtable[local * d..][..d].iter_mut().zip(row) {
                    *g += x;
                }
            }
        }
    }

    fn ce_row_max(&self, m: &mut Vec<T>, logits: &Vec<T>, v: usize, valid: usize) {
        kernels::row_max(m, logits, v, valid);
    }

    fn ce_row_sum_exp(&self, s: &mut Vec<T>, logits: &Vec<T>, m: &Vec<T>, v: usize, valid: usize) {
        kernels::row_sum_exp(s, logits, m, v, valid);
    }

    fn ce_target_logit(&self, t: &mut Vec<T>, logits: &Vec<T>, targets: &Vec<u32>, v: usize, offset: usize, valid: usize) {
        kernels::target_logit(t, logits, targets, v, offset, valid);
    }

    fn ce_finish(&self, lse: &mut Vec<T>, m: &Vec<T>, t: &Vec<T>) -> f64 {
        let mut loss = 0.0f64;
        for ((l, &mi), &ti) in lse.iter_mut().zip(m).zip(t) {
            *l = mi + l.ln();
            loss += (*l - ti).to_f64();
        }
        loss
    }

    fn ce_bwd_inplace(&self, logits: &mut Vec<T>, lse: &Vec<T>, targets: &Vec<u32>, v: usize, offset: usize, valid: usize, scale: T) {
        kernels::cross_entropy_bwd_inplace(logits, lse, targets, v, offset, valid, scale);
    }

    fn attention_fwd(
        &self,
        o: &mut Vec<T>,
        lse: &mut Vec<T>,
        q: &Vec<T>,
        k: &Vec<T>,
        v: &Vec<T>,
        q_pos: &Vec<usize>,
        k_pos: &Vec<usize>,
        dm: AttnDims,
    ) {
        attention_fwd(o, lse, q, k, v, q_pos, k_pos, dm);
    }

    fn attention_bwd(
        &self,
        dq: &mut Vec<T>,
        dk: &mut Vec<T>,
        dv: &mut Vec<T>,
        d_o: &Vec<T>,
        q: &Vec<T>,
        k: &Vec<T>,
        v: &Vec<T>,
        o: &Vec<T>,
        lse: &Vec<T>,
        q_pos: &Vec<usize>,
        k_pos: &Vec<usize>,
        dm: AttnDims,
    ) {
        attention_bwd(dq, dk, dv, d_o, q, k, v, o, lse, q_pos, k_pos, dm);
    }

    fn attention_merge(&self, o: &mut Vec<T>, lse: &mut Vec<T>, o_part: &Vec<T>, lse_part: &Vec<T>, hd: usize) {
        merge_partial(o, lse, o_part, lse_part, hd);
    }

    fn sum_sq(&self, x: &Vec<T>, range: Range<usize>) -> f64 {
        x[range].iter().map(|&v| v.to_f64() * v.to_f64()).sum()
    }

    fn scale(&self, x: &mut Vec<T>, c: T) {
        x.iter_mut().for_each(|v| *v *= c);
    }

    fn adamw(&self, p: &mut Vec<T>, m: &mut Vec<T>, v: &mut Vec<T>, g: &Vec<T>, range: Range<usize>, step: &AdamStep) {
        let r = range;
        adamw::adamw_update(&mut p[r.clone()], &g[r.clone()], &mut m[r.clone()], &mut v[r], step);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_nearest_even() {
        assert_eq!(round_bf16(1.0), 1.0);
        // 1 + 2⁻⁸ lies halfway between 1 and 1 + 2⁻⁷: ties go to the even mantissa, 1.
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3·2⁻⁸ lies halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶: the even one is 1 + 2⁻⁶.
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert_eq!(round_bf16(-2.5), -2.5);
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
        for i in 1..10_000 {
            let x = (i as f32 * 0.7311).sin() * 10f32.powi(i % 7 - 3);
            assert!(((round_bf16(x) - x) / x).abs() <= 1.0 / 256.0, "{x}");
        }
    }

    /// bf16 GEMMs: the product of rounded operands, so within bf16's relative rounding of the
    /// fp32 product, and exactly the fp32 GEMM of the rounded inputs.
    #[test]
    fn bf16_linear_rounds_its_operands() {
        let (m, n, k) = (7, 5, 33);
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 53 % 97) as f32 - 48.0) / 23.0).collect();
        let (fp32, bf16) = (Cpu::default(), Cpu { precision: Precision::Bf16, staged: false });
        let (mut y32, mut y16, mut yr) = (vec![0.0f32; m * n], vec![0.0f32; m * n], vec![0.0f32; m * n]);
        fp32.linear_fwd(&mut y32, &x, &w, m, n, k, false);
        bf16.linear_fwd(&mut y16, &x, &w, m, n, k, false);
        let (xr, wr): (Vec<f32>, Vec<f32>) = (x.iter().map(|&v| round_bf16(v)).collect(), w.iter().map(|&v| round_bf16(v)).collect());
        fp32.linear_fwd(&mut yr, &xr, &wr, m, n, k, false);
        assert_eq!(y16, yr);
        let scale = y32.iter().fold(0.0f32, |a, &b| a.max(b.abs()));
        assert!(y16.iter().zip(&y32).all(|(a, b)| (a - b).abs() <= 1e-2 * scale), "{y16:?} vs {y32:?}");
        assert_ne!(y16, y32);
    }
}
