//! The checks of `ndtrain gpu-check`: every operation of the backend boundary on the GPU
//! against the host backend (`backend::cpu::Cpu` and its kernels) on the same inputs, a whole
//! forward and backward of a small model on both (one rank's hooks), and an NCCL all-reduce per
//! group, each with a named tolerance.

use crate::backend::cpu::Cpu;
use crate::backend::cuda::backend::{DevBuf, GpuBackend};
use crate::backend::{AdamStep, AttnDims, Backend, Precision};
use crate::config::{ActCkpt, ModelCfg};
use crate::model::hooks::Hooks;
use crate::model::params::{Dims, ModelParams};
use crate::model::positions::rope_tables;
use crate::model::{Model, Tokens};
use crate::parallel::collective::nccl::NcclGroup;
use crate::parallel::collective::{Collective, Staged};
use crate::parallel::comm::Group;
use crate::parallel::cp::zigzag_positions;

/// The result of one comparison.
pub struct Check {
    pub what: String,
    /// Largest |gpu − cpu| over the largest |cpu| (equal infinities count as no difference).
    pub rel_err: f64,
    pub tol: f64,
}

impl Check {
    pub fn ok(&self) -> bool {
        self.rel_err <= self.tol
    }
}

/// fp32 GPU kernels against the CPU reference: the same maths in another summation order
/// (cuBLAS's blocking, warp and block reductions, attention's per-row key loop) and with the
/// GPU's `expf`/`sqrtf`/`logf`.
pub const F32_TOL: f64 = 1e-5;

/// bf16 operands (8 significant bits, relative rounding ≤ 2⁻⁹ each) with f32 accumulation,
/// against the fp32 reference on the unrounded inputs.
pub const BF16_TOL: f64 = 1e-2;

/// A whole forward and backward (two blocks, 256 tokens) against the host: every GEMM,
/// reduction and exponential in another order, compounded through the blocks and the backward;
/// the largest gradient difference over the tensor's largest value. (A wrong index or a missed
/// accumulation shows as ≥ 1e-2.) It holds for bf16 GEMM operands too, which both sides round
/// alike, with attention's products in f32 on both.
pub const MODEL_TOL: f64 = 1e-4;

/// The same model with attention's products on TF32 tensor cores (as training under bf16 runs
/// them) against the host's f32 attention: TF32 keeps 11 significant bits, a relative rounding
/// of at most 2⁻¹¹ per operand; four products in a row (scores, P·V, and their backward's two)
/// round both of their operands, and the two blocks' backward compounds them once more, so
/// 16 · 2⁻¹¹ = 2⁻⁷ bounds the worst gradient's relative difference.
pub const TF32_MODEL_TOL: f64 = 1.0 / 128.0;

pub(crate) fn rel_err(gpu: &[f32], cpu: &[f32]) -> f64 {
    assert_eq!(gpu.len(), cpu.len(), "compared buffers differ in length");
    let scale = cpu.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, &x| m.max(x.abs() as f64)).max(f64::MIN_POSITIVE);
    // A NaN on either side, or an infinity against a number, is an infinite error.
    let diff = gpu.iter().zip(cpu).fold(0.0f64, |m, (&a, &b)| {
        let d = if a == b { 0.0 } else { (a as f64 - b as f64).abs() };
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    });
    diff / scale
}

/// Deterministic inputs in [−1, 1).
pub(crate) fn inputs(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Runs every operation of [`Backend`] on the GPU and on the host with the same inputs, then a
/// whole forward and backward of a small model on each.
pub fn check_backend(gpu: &GpuBackend) -> Vec<Check> {
    let mut fp32 = gpu.clone();
    fp32.set_precision(Precision::Fp32);
    let mut c = Pair { cpu: Cpu::default(), gpu: fp32, out: vec![] };
    c.gemms();
    c.norms_and_elementwise();
    c.embedding();
    c.cross_entropy();
    // Causal self-attention with GQA (4 query heads on 2 kv heads), and a context-parallel
    // piece: rank 0's zigzag queries against rank 1's keys (of cp = 2), where the first
    // chunk's queries see no key at all (lse = −∞).
    let s = 96;
    let all: Vec<usize> = (0..s).collect();
    c.attention("causal, GQA 4/2", &all, &all);
    let (q_pos, k_pos) = (zigzag_positions(s, 2, 0), zigzag_positions(s, 2, 1));
    c.attention("zigzag cp piece", &q_pos, &k_pos);
    c.optimiser();
    c.ranges();
    c.model(ActCkpt::None);
    c.model(ActCkpt::Full);
    let mut out = c.out;
    // Mixed precision: the same GEMMs on bf16 operands, with attention in f32 on both sides
    // (the host has no TF32), then as training runs it, attention on TF32 tensor cores.
    let mut bf16 = gpu.clone();
    bf16.set_precision(Precision::Bf16);
    bf16.set_tf32(false);
    let mut c = Pair { cpu: Cpu { precision: Precision::Bf16, staged: false }, gpu: bf16.clone(), out: vec![] };
    c.bf16_gemms();
    c.model(ActCkpt::None);
    bf16.set_tf32(true);
    c.gpu = bf16;
    c.model_with_tolerance(ActCkpt::None, (TF32_MODEL_TOL, TF32_MODEL_TOL), "TF32 attention");
    out.append(&mut c.out);
    out
}

/// The two backends and the results so far.
struct Pair {
    cpu: Cpu,
    gpu: GpuBackend,
    out: Vec<Check>,
}

impl Pair {
    fn up(&self, x: &[f32]) -> DevBuf<f32> {
        let mut d = DevBuf::default();
        self.gpu.upload(&mut d, x);
        d
    }

    fn down(&self, d: &DevBuf<f32>) -> Vec<f32> {
        let mut h = vec![0.0; self.gpu.len(d)];
        self.gpu.download(d, &mut h);
        h
    }

    fn cmp(&mut self, what: impl Into<String>, dev: &DevBuf<f32>, cpu: &[f32], tol: f64) {
        let got = self.down(dev);
        self.out.push(Check { what: what.into(), rel_err: rel_err(&got, cpu), tol });
    }

    fn scalar(&mut self, what: impl Into<String>, gpu: f64, cpu: f64, tol: f64) {
        let rel_err = if gpu == cpu { 0.0 } else { (gpu - cpu).abs() / cpu.abs().max(f64::MIN_POSITIVE) };
        self.out.push(Check { what: what.into(), rel_err: if rel_err.is_nan() { f64::INFINITY } else { rel_err }, tol });
    }

    /// The three linear-layer GEMMs, overwriting and accumulating, on shapes that are not
    /// multiples of any tile.
    fn gemms(&mut self) {
        let (m, n, k) = (257, 384, 193);
        let (x, w, dy) = (inputs(m * k, 1), inputs(n * k, 2), inputs(m * n, 3));
        let (xd, wd, dyd) = (self.up(&x), self.up(&w), self.up(&dy));
        for acc in [false, true] {
            let init = inputs(m * n.max(k), 4);
            let (mut y, mut yd) = (init[..m * n].to_vec(), self.up(&init[..m * n]));
            self.cpu.linear_fwd(&mut y, &x, &w, m, n, k, acc);
            self.gpu.linear_fwd(&mut yd, &xd, &wd, m, n, k, acc);
            self.cmp(format!("linear_fwd [{m}×{k}]·[{n}×{k}]ᵀ (accumulate = {acc})"), &yd, &y, F32_TOL);
            let (mut dx, mut dxd) = (init[..m * k].to_vec(), self.up(&init[..m * k]));
            self.cpu.linear_bwd_input(&mut dx, &dy, &w, m, n, k, acc);
            self.gpu.linear_bwd_input(&mut dxd, &dyd, &wd, m, n, k, acc);
            self.cmp(format!("linear_bwd_input (accumulate = {acc})"), &dxd, &dx, F32_TOL);
            let (mut dw, mut dwd) = (init[..n * k].to_vec(), self.up(&init[..n * k]));
            self.cpu.linear_bwd_weight(&mut dw, &dy, &x, m, n, k, acc);
            self.gpu.linear_bwd_weight(&mut dwd, &dyd, &xd, m, n, k, acc);
            self.cmp(format!("linear_bwd_weight (accumulate = {acc})"), &dwd, &dw, F32_TOL);
        }
    }

    /// bf16 operands: against the host's bf16 (the same rounded operands, f32 products exact,
    /// another summation order) and against fp32.
    fn bf16_gemms(&mut self) {
        let (m, n, k) = (257, 384, 193);
        let (x, w) = (inputs(m * k, 1), inputs(n * k, 2));
        let (mut y16, mut y32, mut yd) = (vec![0.0; m * n], vec![0.0; m * n], self.gpu.zeros(m * n));
        self.cpu.linear_fwd(&mut y16, &x, &w, m, n, k, false);
        Cpu::default().linear_fwd(&mut y32, &x, &w, m, n, k, false);
        self.gpu.linear_fwd(&mut yd, &self.up(&x), &self.up(&w), m, n, k, false);
        self.cmp("bf16 linear_fwd vs the host's bf16 operands", &yd, &y16, F32_TOL);
        self.cmp("bf16 linear_fwd vs fp32", &yd, &y32, BF16_TOL);
    }

    fn norms_and_elementwise(&mut self) {
        let (rows, d, eps) = (64, 1000, 1e-5);
        let (x, w, dy) = (inputs(rows * d, 3), inputs(d, 4), inputs(rows * d, 11));
        let (xd, wd, dyd) = (self.up(&x), self.up(&w), self.up(&dy));
        let (mut y, mut r) = (vec![0.0; rows * d], vec![0.0; rows]);
        let (mut yd, mut rd) = (self.gpu.zeros(rows * d), self.gpu.zeros(rows));
        self.cpu.rmsnorm_fwd(&mut y, &mut r, &x, &w, d, eps);
        self.gpu.rmsnorm_fwd(&mut yd, &mut rd, &xd, &wd, d, eps);
        self.cmp("rmsnorm_fwd y", &yd, &y, F32_TOL);
        self.cmp("rmsnorm_fwd rstd", &rd, &r, F32_TOL);
        let rstd = self.up(&r);
        for acc in [false, true] {
            // dx starts from x (so accumulation shows), dw from w (dw always accumulates).
            let (mut dx, mut dw) = (x.clone(), w.clone());
            let (mut dxd, mut dwd) = (self.up(&x), self.up(&w));
            self.cpu.rmsnorm_bwd(&mut dx, &mut dw, &dy, &x, &w, &r, d, acc);
            self.gpu.rmsnorm_bwd(&mut dxd, &mut dwd, &dyd, &xd, &wd, &rstd, d, acc);
            self.cmp(format!("rmsnorm_bwd dx (accumulate = {acc})"), &dxd, &dx, F32_TOL);
            self.cmp(format!("rmsnorm_bwd dw (accumulate = {acc})"), &dwd, &dw, F32_TOL);
        }

        // RoPE at positions that are not 0..S (a context-parallel rank's zigzag positions).
        let (b, s, nh, hd) = (2, 48, 3, 64);
        let (cos, sin) = rope_tables::<f32>(&zigzag_positions(2 * s, 2, 1), hd, 500000.0);
        let (cosd, sind) = (self.up(&cos), self.up(&sin));
        let src = inputs(b * s * nh * hd, 12);
        let srcd = self.up(&src);
        for rotate in [true, false] {
            let rope = rotate.then_some((&cos, &sin));
            let rope_d = rotate.then_some((&cosd, &sind));
            let (mut h, mut hd_) = (vec![0.0; src.len()], self.gpu.zeros(src.len()));
            self.cpu.tokens_to_heads(&mut h, &src, b, s, nh, hd, rope);
            self.gpu.tokens_to_heads(&mut hd_, &srcd, b, s, nh, hd, rope_d);
            self.cmp(format!("tokens_to_heads (rope = {rotate})"), &hd_, &h, F32_TOL);
            self.cpu.heads_to_tokens(&mut h, &src, b, s, nh, hd, rope);
            self.gpu.heads_to_tokens(&mut hd_, &srcd, b, s, nh, hd, rope_d);
            self.cmp(format!("heads_to_tokens, the backward (rope = {rotate})"), &hd_, &h, F32_TOL);
        }

        let len = 100_003;
        let g: Vec<f32> = inputs(len, 5).iter().map(|x| 8.0 * x).collect();
        let (u, dh) = (inputs(len, 6), inputs(len, 7));
        let (gd, ud, dhd) = (self.up(&g), self.up(&u), self.up(&dh));
        let (mut h, mut hdv) = (vec![0.0; len], self.gpu.zeros(len));
        self.cpu.swiglu_fwd(&mut h, &g, &u);
        self.gpu.swiglu_fwd(&mut hdv, &gd, &ud);
        self.cmp("swiglu_fwd", &hdv, &h, F32_TOL);
        let (mut dg, mut du, mut dgd, mut dud) = (vec![0.0; len], vec![0.0; len], self.gpu.zeros(len), self.gpu.zeros(len));
        self.cpu.swiglu_bwd(&mut dg, &mut du, &dh, &g, &u);
        self.gpu.swiglu_bwd(&mut dgd, &mut dud, &dhd, &gd, &ud);
        self.cmp("swiglu_bwd dgate", &dgd, &dg, F32_TOL);
        self.cmp("swiglu_bwd dup", &dud, &du, F32_TOL);
        self.cpu.add_assign(&mut h, &u);
        self.gpu.add_assign(&mut hdv, &ud);
        self.cmp("add_assign", &hdv, &h, 0.0);
        let (mut c, mut cd) = (u.clone(), self.gpu.zeros(len));
        self.gpu.copy(&mut cd, &ud);
        self.cmp("copy", &cd, &c, 0.0);
        self.cpu.scale(&mut c, 0.37);
        self.gpu.scale(&mut cd, 0.37);
        self.cmp("scale", &cd, &c, 0.0);
        self.cpu.fill(&mut c, f32::NEG_INFINITY);
        self.gpu.fill(&mut cd, f32::NEG_INFINITY);
        self.cmp("fill (−∞)", &cd, &c, 0.0);
    }

    /// A vocabulary-parallel rank's rows [1000, 1029) of a padded table of 32 rows, ids that
    /// repeat (their gradients add in token order, bit for bit) and ids outside those rows.
    fn embedding(&mut self) {
        let (n, d, offset, valid) = (300, 96, 1000, 29);
        let ids: Vec<u32> = (0..n as u32).map(|i| 990 + (i * 7919) % 45).collect();
        let table = inputs(32 * d, 30);
        let dx = inputs(n * d, 31);
        let (mut idsc, mut idsd) = (vec![], Default::default());
        Backend::<f32>::set_ids(&self.cpu, &mut idsc, &ids);
        self.gpu.set_ids(&mut idsd, &ids);
        let (mut x, mut xd) = (vec![0.0; n * d], self.gpu.zeros(n * d));
        self.cpu.embed_fwd(&mut x, &table, &idsc, offset, valid, d);
        self.gpu.embed_fwd(&mut xd, &self.up(&table), &idsd, offset, valid, d);
        self.cmp("embed_fwd (vocabulary-parallel rows)", &xd, &x, 0.0);
        let mut dt = table.clone();
        let mut dtd = self.up(&table);
        self.cpu.embed_bwd(&mut dt, &dx, &idsc, offset, valid, d);
        self.gpu.embed_bwd(&mut dtd, &self.up(&dx), &idsd, offset, valid, d);
        self.cmp("embed_bwd (repeated ids, token order)", &dtd, &dt, 0.0);
    }

    /// A vocabulary-parallel piece: this rank holds rows [offset, offset + valid) of a
    /// vocabulary, padded to `v` columns; some targets fall outside it.
    fn cross_entropy(&mut self) {
        let (n, v, offset, valid) = (77, 1040, 1000, 1029);
        let logits: Vec<f32> = inputs(n * v, 13).iter().map(|x| 6.0 * x).collect();
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 397) % 2100).collect();
        let ld = self.up(&logits);
        let (mut tc, mut td) = (vec![], Default::default());
        Backend::<f32>::set_ids(&self.cpu, &mut tc, &targets);
        self.gpu.set_ids(&mut td, &targets);
        let (mut m, mut s, mut t) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let (mut md, mut sd, mut tdv) = (self.gpu.zeros(n), self.gpu.zeros(n), self.gpu.zeros(n));
        self.cpu.ce_row_max(&mut m, &logits, v, valid);
        self.gpu.ce_row_max(&mut md, &ld, v, valid);
        self.cmp("cross entropy: row max", &md, &m, 0.0);
        self.cpu.ce_row_sum_exp(&mut s, &logits, &m, v, valid);
        self.gpu.ce_row_sum_exp(&mut sd, &ld, &md, v, valid);
        self.cmp("cross entropy: row Σ exp", &sd, &s, F32_TOL);
        self.cpu.ce_target_logit(&mut t, &logits, &tc, v, offset, valid);
        self.gpu.ce_target_logit(&mut tdv, &ld, &td, v, offset, valid);
        self.cmp("cross entropy: target logit", &tdv, &t, 0.0);
        let loss = self.cpu.ce_finish(&mut s, &m, &t);
        let loss_d = self.gpu.ce_finish(&mut sd, &md, &tdv);
        self.cmp("cross entropy: log-sum-exp", &sd, &s, F32_TOL);
        self.scalar("cross entropy: summed loss", loss_d, loss, F32_TOL);
        let scale = 1.0 / 123.0;
        let (mut dl, mut dld) = (logits.clone(), self.up(&logits));
        self.cpu.ce_bwd_inplace(&mut dl, &s, &tc, v, offset, valid, scale);
        self.gpu.ce_bwd_inplace(&mut dld, &sd, &td, v, offset, valid, scale);
        self.cmp("cross entropy backward (in place)", &dld, &dl, F32_TOL);
    }

    fn attention(&mut self, what: &str, q_pos: &[usize], k_pos: &[usize]) {
        let dm = AttnDims { b: 2, h: 4, kv: 2, sq: q_pos.len(), sk: k_pos.len(), hd: 64 };
        let (nq, nk) = (dm.b * dm.h * dm.sq * dm.hd, dm.b * dm.kv * dm.sk * dm.hd);
        let (q, k, v, d_o) = (inputs(nq, 21), inputs(nk, 22), inputs(nk, 23), inputs(nq, 24));
        let (qd, kd, vd, dod) = (self.up(&q), self.up(&k), self.up(&v), self.up(&d_o));
        let (mut qp, mut kp, mut qpd, mut kpd) = (vec![], vec![], Default::default(), Default::default());
        Backend::<f32>::set_positions(&self.cpu, &mut qp, q_pos);
        Backend::<f32>::set_positions(&self.cpu, &mut kp, k_pos);
        self.gpu.set_positions(&mut qpd, q_pos);
        self.gpu.set_positions(&mut kpd, k_pos);
        let (mut o, mut lse) = (vec![0.0; nq], vec![0.0; nq / dm.hd]);
        let (mut od, mut lsed) = (self.gpu.zeros(nq), self.gpu.zeros(nq / dm.hd));
        self.cpu.attention_fwd(&mut o, &mut lse, &q, &k, &v, &qp, &kp, dm);
        self.gpu.attention_fwd(&mut od, &mut lsed, &qd, &kd, &vd, &qpd, &kpd, dm);
        self.cmp(format!("attention forward, {what}: o"), &od, &o, F32_TOL);
        self.cmp(format!("attention forward, {what}: lse"), &lsed, &lse, F32_TOL);
        // The backward reads the host's o and lse, so it is checked on its own.
        let (oh, lseh) = (self.up(&o), self.up(&lse));
        let (mut dq, mut dk, mut dv) = (vec![0.0; nq], vec![0.0; nk], vec![0.0; nk]);
        let (mut dqd, mut dkd, mut dvd) = (self.gpu.zeros(nq), self.gpu.zeros(nk), self.gpu.zeros(nk));
        self.cpu.attention_bwd(&mut dq, &mut dk, &mut dv, &d_o, &q, &k, &v, &o, &lse, &qp, &kp, dm);
        self.gpu.attention_bwd(&mut dqd, &mut dkd, &mut dvd, &dod, &qd, &kd, &vd, &oh, &lseh, &qpd, &kpd, dm);
        self.cmp(format!("attention backward, {what}: dq"), &dqd, &dq, F32_TOL);
        self.cmp(format!("attention backward, {what}: dk"), &dkd, &dk, F32_TOL);
        self.cmp(format!("attention backward, {what}: dv"), &dvd, &dv, F32_TOL);
        // Merging this block's result into a running one (ring attention's online softmax).
        let (o0, lse0): (Vec<f32>, Vec<f32>) = (
            inputs(nq, 25),
            inputs(nq / dm.hd, 26).iter().enumerate().map(|(i, &x)| if i % 5 == 0 { f32::NEG_INFINITY } else { 3.0 * x }).collect(),
        );
        let (mut om, mut lm, mut omd, mut lmd) = (o0.clone(), lse0.clone(), self.up(&o0), self.up(&lse0));
        self.cpu.attention_merge(&mut om, &mut lm, &o, &lse, dm.hd);
        self.gpu.attention_merge(&mut omd, &mut lmd, &oh, &lseh, dm.hd);
        self.cmp(format!("attention merge, {what}: o"), &omd, &om, F32_TOL);
        self.cmp(format!("attention merge, {what}: lse"), &lmd, &lm, F32_TOL);
    }

    /// Three AdamW steps of a decayed and an undecayed tensor, and the gradient's Σ x².
    fn optimiser(&mut self) {
        let len = 100_003;
        let cfg = crate::config::OptimCfg::default();
        for decayed in [true, false] {
            let mut p = inputs(len, 8);
            let (mut m, mut v) = (vec![0.0; len], vec![0.0; len]);
            let (mut pd, mut md, mut vd) = (self.up(&p), self.gpu.zeros(len), self.gpu.zeros(len));
            for t in 1..=3u64 {
                let g = inputs(len, 100 + t);
                let step = AdamStep::new(t, 1e-3 * t as f64, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, decayed);
                self.cpu.adamw(&mut p, &mut m, &mut v, &g, 0..len, &step);
                self.gpu.adamw(&mut pd, &mut md, &mut vd, &self.up(&g), 0..len, &step);
            }
            self.cmp(format!("adamw, 3 steps (decayed = {decayed}): parameters"), &pd, &p, F32_TOL);
            self.cmp(format!("adamw, 3 steps (decayed = {decayed}): exp_avg_sq"), &vd, &v, F32_TOL);
        }
        let g = inputs(3_000_017, 9);
        let (a, b) = (self.cpu.sum_sq(&g, 0..g.len()), self.gpu.sum_sq(&self.up(&g), 0..g.len()));
        self.scalar("Σ x² (the gradient norm), f64", b, a, 1e-12);
    }

    /// The operations on parts of a buffer that the sharded model state uses (a tensor's
    /// place in a shard): copies, adds and fills of ranges, resizing, Σ x² and one AdamW step
    /// of a range, all exact but the last two.
    fn ranges(&mut self) {
        let (n, r) = (40_009, 1_234..31_234);
        let (a, b) = (inputs(n, 21), inputs(n, 22));
        let (mut c, mut cd) = (a.clone(), self.up(&a));
        let bd = self.up(&b);
        self.cpu.copy_range(&mut c, 7, &b, r.clone());
        self.gpu.copy_range(&mut cd, 7, &bd, r.clone());
        self.cpu.add_range(&mut c, 11, &b, r.clone());
        self.gpu.add_range(&mut cd, 11, &bd, r.clone());
        self.cpu.fill_range(&mut c, 100..2_000, 0.0);
        self.gpu.fill_range(&mut cd, 100..2_000, 0.0);
        self.cpu.resize(&mut c, n + 500);
        self.gpu.resize(&mut cd, n + 500);
        self.cpu.resize(&mut c, n - 9);
        self.gpu.resize(&mut cd, n - 9);
        self.cmp("copy/add/fill of ranges, resize", &cd, &c, 0.0);
        let (s, sd) = (self.cpu.sum_sq(&c, r.clone()), self.gpu.sum_sq(&cd, r.clone()));
        self.scalar("Σ x² of a range, f64", sd, s, 1e-12);
        let (mut m, mut v, mut md, mut vd) = (vec![0.0; c.len()], vec![0.0; c.len()], self.gpu.zeros(c.len()), self.gpu.zeros(c.len()));
        let g = inputs(c.len(), 23);
        let step = AdamStep::new(1, 1e-3, 0.9, 0.95, 1e-8, 0.1, true);
        self.cpu.adamw(&mut c, &mut m, &mut v, &g, r.clone(), &step);
        self.gpu.adamw(&mut cd, &mut md, &mut vd, &self.up(&g), r, &step);
        self.cmp("adamw of a range (the rest untouched)", &cd, &c, F32_TOL);
    }

    /// One micro-batch forward and backward of a two-block model (GQA, untied head, a
    /// vocabulary that is not a multiple of anything) on both backends, from the same seeded
    /// weights: the loss and every parameter's gradient.
    fn model(&mut self, ckpt: ActCkpt) {
        self.model_with_tolerance(ckpt, (F32_TOL, MODEL_TOL), "");
    }

    /// A two-block model's forward and backward on both backends: the loss within `loss_tol`,
    /// every gradient within `tol`; `note` tags the check's name.
    fn model_with_tolerance(&mut self, ckpt: ActCkpt, (loss_tol, tol): (f64, f64), note: &str) {
        let cfg = ModelCfg {
            vocab_size: 1000,
            d_model: 256,
            n_layers: 2,
            n_heads: 8,
            n_kv_heads: 2,
            head_dim: 0,
            qk_norm: false,
            ffn_hidden: 688,
            max_seq_len: 256,
            ..ModelCfg::default()
        };
        let (b, s) = (2, 128);
        let host = ModelParams::<f32>::init(&cfg, 7);
        let inputs_: Vec<u32> = (0..(b * s) as u32).map(|i| (i * 7919 + 13) % 1000).collect();
        let targets: Vec<u32> = (0..(b * s) as u32).map(|i| (i * 104729 + 5) % 1000).collect();
        let positions: Vec<usize> = (0..s).collect();
        let tok = Tokens { inputs: &inputs_, targets: &targets, positions: &positions, batch: b, seq: s };
        let scale = 1.0 / (b * s) as f32;

        let mut cpu_model = Model::<f32, Cpu>::on(self.cpu, Dims::full(&cfg), ckpt);
        let mut cpu_grads = ModelParams::<f32>::zeros(&cfg);
        let loss = cpu_model.forward_with(&mut &host, &tok, Hooks::one_rank());
        cpu_model.backward_with(&mut &host, &mut cpu_grads, scale, Hooks::one_rank());

        let dev = host.map(|t| self.up(t));
        let mut dev_grads = host.map(|t| self.gpu.zeros(t.len()));
        let mut gpu_model = Model::<f32, GpuBackend>::on(self.gpu.clone(), Dims::full(&cfg), ckpt);
        let loss_d = gpu_model.forward_with(&mut &dev, &tok, Hooks::one_rank());
        gpu_model.backward_with(&mut &dev, &mut dev_grads, scale, Hooks::one_rank());

        let precision = self.cpu.precision;
        let note = if note.is_empty() { String::new() } else { format!(", {note}") };
        let tag = format!("model fwd+bwd ({precision:?}, checkpointing {}{note})", ckpt.name());
        self.scalar(format!("{tag}: loss"), loss_d, loss, loss_tol);
        let names = crate::model::params::param_specs(&cfg);
        let worst = dev_grads
            .tensors()
            .iter()
            .zip(cpu_grads.tensors())
            .zip(&names)
            .map(|((d, c), spec)| (rel_err(&self.down(d), c), spec.name.clone()))
            .fold((0.0f64, String::new()), |a, b| if b.0 > a.0 { b } else { a });
        self.out.push(Check { what: format!("{tag}: every gradient (worst: {})", worst.1), rel_err: worst.0, tol });
    }
}

/// An all-reduce over `group` the way training runs one, on the collectives training would use
/// there: NCCL when every rank has a GPU of its own (`shared` false: started on a communication
/// stream, waited for by the compute stream, its result then read by a kernel), staged through
/// host memory when ranks share a GPU. Rank `r` sends `r + 1 + i/n`; the result must be
/// `Σ_r (r + 1) + size·i/n` exactly (small integers and the same fraction on every rank).
pub fn check_all_reduce(be: &GpuBackend, group: &Group, shared: bool) -> Result<Check, String> {
    let n = 1 << 20;
    let mine: Vec<f32> = (0..n).map(|i| (group.rank() + 1) as f32 + (i % 8) as f32 / 8.0).collect();
    let mut send = be.zeros(n);
    be.upload(&mut send, &mine);
    let run = |c: &dyn Collective<DevBuf<f32>>| {
        let ticket = c.start_all_reduce_sum(send, be.zeros(n));
        let (_, mut sum) = c.wait(ticket);
        be.scale(&mut sum, 1.0);
        let mut got = vec![0.0; n];
        be.download(&sum, &mut got);
        be.synchronize().map(|_| c.settle()).map(|_| got)
    };
    let (kind, got) = if shared {
        ("staged", run(&Staged::new(be.clone(), group))?)
    } else {
        let stream = std::rc::Rc::new(be.comm_stream()?);
        ("NCCL", run(&NcclGroup::new(be, group, &stream)?)?)
    };
    let size = group.size();
    let want: Vec<f32> = (0..n).map(|i| (size * (size + 1) / 2) as f32 + size as f32 * (i % 8) as f32 / 8.0).collect();
    let what = format!("{kind} all-reduce (sum), 4 MiB, over {} ({} ranks)", group.name(), size);
    Ok(Check { what, rel_err: rel_err(&got, &want), tol: 0.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where there is no GPU (CI), opening one is an error that names what is missing, not a
    /// panic; where there is one, it opens and every backend operation matches the host's.
    #[test]
    fn opening_a_gpu_works_or_says_what_is_missing() {
        match GpuBackend::open(0, Precision::Fp32) {
            Ok(gpu) => {
                for c in check_backend(&gpu) {
                    assert!(c.ok(), "{}: relative error {:e} > {:e}", c.what, c.rel_err, c.tol);
                }
            }
            Err(e) => assert!(e.contains("cannot load") || e.contains("no GPU"), "{e}"),
        }
    }

    #[test]
    fn test_inputs_are_deterministic_and_in_range() {
        let a = inputs(1000, 9);
        assert_eq!(a, inputs(1000, 9));
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
    }

    #[test]
    fn relative_error_treats_equal_infinities_as_equal_and_nan_as_failure() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(rel_err(&[1.0, 2.5], &[1.0, 2.0]), 0.25);
        assert_eq!(rel_err(&[f32::NEG_INFINITY, 2.0], &[f32::NEG_INFINITY, 2.0]), 0.0);
        assert_eq!(rel_err(&[1.0, 2.0], &[f32::NEG_INFINITY, 2.0]), f64::INFINITY);
        assert_eq!(rel_err(&[f32::NAN], &[1.0]), f64::INFINITY);
    }
}
