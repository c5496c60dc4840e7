//! `ndtrain gpu-check`: every GPU kernel, the cuBLAS GEMMs and an NCCL all-reduce against the
//! CPU reference (`model::kernels`, `model::attention`, `optim::AdamW`, `real::matmul`) on the
//! same inputs, with named tolerances.

use super::{round_bf16, AttnDims, Gpu};
use crate::comm::Group;
use cudarc::nccl::ReduceOp;

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

struct Checks<'a> {
    gpu: &'a Gpu,
    out: Vec<Check>,
}

impl Checks<'_> {
    fn compare(&mut self, what: impl Into<String>, dev: &cudarc::driver::CudaSlice<f32>, cpu: &[f32], tol: f64) -> Result<(), String> {
        let got = self.gpu.download(dev)?;
        self.out.push(Check { what: what.into(), rel_err: rel_err(&got, cpu), tol });
        Ok(())
    }
}

/// Runs every kernel on the GPU and on the CPU with the same inputs.
pub fn check_kernels(gpu: &Gpu) -> Result<Vec<Check>, String> {
    let mut c = Checks { gpu, out: vec![] };
    gemms(&mut c)?;
    norms_and_elementwise(&mut c)?;
    cross_entropy(&mut c)?;
    // Causal self-attention with GQA (4 query heads on 2 kv heads), and a context-parallel
    // piece: rank 0's zigzag queries against rank 1's keys (of cp = 2), where the first
    // chunk's queries see no key at all (lse = −∞).
    let s = 96;
    let all: Vec<usize> = (0..s).collect();
    attention(&mut c, "causal, GQA 4/2", &all, &all)?;
    let (q_pos, k_pos) = (crate::model::attention::zigzag_positions(s, 2, 0), crate::model::attention::zigzag_positions(s, 2, 1));
    attention(&mut c, "zigzag cp piece", &q_pos, &k_pos)?;
    adamw(&mut c)?;
    gpu.synchronize()?;
    Ok(c.out)
}

fn gemms(c: &mut Checks) -> Result<(), String> {
    use crate::real::{matmul, Mat, MatMut};
    let gpu = c.gpu;
    let (m, n, k) = (257, 384, 193);
    let (a, b) = (inputs(m * k, 1), inputs(k * n, 2));
    let mut c_cpu = vec![0.0f32; m * n];
    matmul(MatMut::rm(&mut c_cpu, m, n), Mat::rm(&a, m, k), Mat::rm(&b, k, n), false);
    let (ad, bd) = (gpu.upload(&a)?, gpu.upload(&b)?);
    let mut cd = gpu.zeros(m * n)?;
    gpu.matmul(&mut cd, &ad, &bd, m, n, k)?;
    c.compare("cuBLAS sgemm [257×193]·[193×384]", &cd, &c_cpu, F32_TOL)?;

    // bf16: the conversion is exact round-to-nearest-even, and the GEMM of the rounded
    // operands is the fp32 GEMM of the rounded values (their products are exact in f32).
    let (mut a16, mut b16) = (gpu.zeros::<u16>(m * k)?, gpu.zeros::<u16>(k * n)?);
    gpu.to_bf16(&mut a16, &ad)?;
    gpu.to_bf16(&mut b16, &bd)?;
    let mut back = gpu.zeros(m * k)?;
    gpu.from_bf16(&mut back, &a16)?;
    let a_rounded: Vec<f32> = a.iter().map(|&x| round_bf16(x)).collect();
    c.compare("f32 → bf16 → f32 (round to nearest even)", &back, &a_rounded, 0.0)?;
    let b_rounded: Vec<f32> = b.iter().map(|&x| round_bf16(x)).collect();
    let mut c_rounded = vec![0.0f32; m * n];
    matmul(MatMut::rm(&mut c_rounded, m, n), Mat::rm(&a_rounded, m, k), Mat::rm(&b_rounded, k, n), false);
    gpu.matmul_bf16(&mut cd, &a16, &b16, m, n, k)?;
    c.compare("cublasGemmEx bf16·bf16 → f32, vs fp32 of the rounded operands", &cd, &c_rounded, F32_TOL)?;
    c.compare("cublasGemmEx bf16·bf16 → f32, vs fp32", &cd, &c_cpu, BF16_TOL)
}

fn norms_and_elementwise(c: &mut Checks) -> Result<(), String> {
    use crate::model::kernels;
    let gpu = c.gpu;
    let (rows, d, eps) = (64, 1000, 1e-5f32);
    let (x, w, dy) = (inputs(rows * d, 3), inputs(d, 4), inputs(rows * d, 11));
    let (mut y_cpu, mut r_cpu) = (vec![0.0f32; rows * d], vec![0.0f32; rows]);
    kernels::rmsnorm_fwd(&mut y_cpu, &mut r_cpu, &x, &w, d, eps as f64);
    let (xd, wd) = (gpu.upload(&x)?, gpu.upload(&w)?);
    let (mut y, mut r) = (gpu.zeros(rows * d)?, gpu.zeros(rows)?);
    gpu.rmsnorm_fwd(&mut y, &mut r, &xd, &wd, rows, d, eps)?;
    c.compare("rmsnorm_fwd y", &y, &y_cpu, F32_TOL)?;
    c.compare("rmsnorm_fwd rstd", &r, &r_cpu, F32_TOL)?;
    for accumulate in [false, true] {
        // dx starts from x (so accumulation shows), dw from w (dw always accumulates).
        let (mut dx_cpu, mut dw_cpu) = (x.clone(), w.clone());
        kernels::rmsnorm_bwd(&mut dx_cpu, &mut dw_cpu, &dy, &x, &w, &r_cpu, d, accumulate);
        let (mut dx, mut dw) = (gpu.upload(&x)?, gpu.upload(&w)?);
        gpu.rmsnorm_bwd(&mut dx, &mut dw, &gpu.upload(&dy)?, &xd, &wd, &gpu.upload(&r_cpu)?, (rows, d), accumulate)?;
        c.compare(format!("rmsnorm_bwd dx (accumulate = {accumulate})"), &dx, &dx_cpu, F32_TOL)?;
        c.compare(format!("rmsnorm_bwd dw (accumulate = {accumulate})"), &dw, &dw_cpu, F32_TOL)?;
    }

    // RoPE at positions that are not 0..S (a context-parallel rank's zigzag positions).
    let (b, s, nh, hd) = (2, 48, 3, 64);
    let positions = crate::model::attention::zigzag_positions(2 * s, 2, 1);
    let (cos, sin) = kernels::rope_tables::<f32>(&positions, hd, 500000.0);
    let src = inputs(b * s * nh * hd, 12);
    let srcd = gpu.upload(&src)?;
    let tables = (gpu.upload(&cos)?, gpu.upload(&sin)?);
    for rotate in [true, false] {
        let rope = rotate.then_some((&cos[..], &sin[..]));
        let rope_dev = rotate.then_some((&tables.0, &tables.1));
        let mut cpu = vec![0.0f32; src.len()];
        let mut dev = gpu.zeros(src.len())?;
        kernels::to_heads_rope(&mut cpu, &src, b, s, nh, hd, rope);
        gpu.heads_rope(&mut dev, &srcd, rope_dev, (b, s, nh, hd), true)?;
        c.compare(format!("to_heads (rope = {rotate})"), &dev, &cpu, F32_TOL)?;
        kernels::from_heads_rope(&mut cpu, &src, b, s, nh, hd, rope);
        gpu.heads_rope(&mut dev, &srcd, rope_dev, (b, s, nh, hd), false)?;
        c.compare(format!("from_heads, the backward (rope = {rotate})"), &dev, &cpu, F32_TOL)?;
    }

    let len = 100_003;
    let (g, u, dh) = (inputs(len, 5).iter().map(|x| 8.0 * x).collect::<Vec<_>>(), inputs(len, 6), inputs(len, 7));
    let mut h_cpu = vec![0.0f32; len];
    kernels::swiglu_fwd(&mut h_cpu, &g, &u);
    let (gd, ud) = (gpu.upload(&g)?, gpu.upload(&u)?);
    let mut h = gpu.zeros(len)?;
    gpu.swiglu_fwd(&mut h, &gd, &ud)?;
    c.compare("swiglu_fwd", &h, &h_cpu, F32_TOL)?;
    let (mut dg_cpu, mut du_cpu) = (vec![0.0f32; len], vec![0.0f32; len]);
    kernels::swiglu_bwd(&mut dg_cpu, &mut du_cpu, &dh, &g, &u);
    let (mut dg, mut du) = (gpu.zeros(len)?, gpu.zeros(len)?);
    gpu.swiglu_bwd(&mut dg, &mut du, &gpu.upload(&dh)?, &gd, &ud)?;
    c.compare("swiglu_bwd dgate", &dg, &dg_cpu, F32_TOL)?;
    c.compare("swiglu_bwd dup", &du, &du_cpu, F32_TOL)?;
    kernels::add_assign(&mut h_cpu, &u);
    gpu.add_assign(&mut h, &ud)?;
    c.compare("add_assign", &h, &h_cpu, 0.0)
}

/// A vocabulary-parallel piece: this rank holds rows [offset, offset + valid) of a vocabulary,
/// padded to `v` columns; some targets fall outside it.
fn cross_entropy(c: &mut Checks) -> Result<(), String> {
    use crate::model::kernels;
    let gpu = c.gpu;
    let (n, v, offset, valid) = (77, 1040, 1000, 1029);
    let logits: Vec<f32> = inputs(n * v, 13).iter().map(|x| 6.0 * x).collect();
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 397) % 2100).collect();
    let (mut m, mut se, mut tl) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    kernels::row_max(&mut m, &logits, v, valid);
    kernels::row_sum_exp(&mut se, &logits, &m, v, valid);
    kernels::target_logit(&mut tl, &logits, &targets, v, offset, valid);
    let (ld, td) = (gpu.upload(&logits)?, gpu.upload(&targets)?);
    let (mut md, mut sed, mut tld) = (gpu.zeros(n)?, gpu.zeros(n)?, gpu.zeros(n)?);
    gpu.ce_row_stats((&mut md, &mut sed, &mut tld), &ld, &td, (n, v, offset, valid))?;
    c.compare("cross entropy: row max", &md, &m, 0.0)?;
    c.compare("cross entropy: row Σ exp", &sed, &se, F32_TOL)?;
    c.compare("cross entropy: target logit", &tld, &tl, 0.0)?;
    let lse: Vec<f32> = m.iter().zip(&se).map(|(&a, &b)| a + b.ln() + 0.25).collect();
    let scale = 1.0 / 123.0;
    let mut d_cpu = logits.clone();
    kernels::cross_entropy_bwd_inplace(&mut d_cpu, &lse, &targets, v, offset, valid, scale);
    let mut dd = ld.clone();
    gpu.ce_bwd_inplace(&mut dd, &gpu.upload(&lse)?, &td, (n, v, offset, valid), scale)?;
    c.compare("cross entropy backward (in place)", &dd, &d_cpu, F32_TOL)
}

fn attention(c: &mut Checks, what: &str, q_pos: &[usize], k_pos: &[usize]) -> Result<(), String> {
    use crate::model::attention::{attention_bwd, attention_fwd, AttnDims as CpuDims};
    let gpu = c.gpu;
    let dm = CpuDims { b: 2, h: 4, kv: 2, sq: q_pos.len(), sk: k_pos.len(), hd: 64 };
    let (nq, nk) = (dm.b * dm.h * dm.sq * dm.hd, dm.b * dm.kv * dm.sk * dm.hd);
    let (q, k, v, d_o) = (inputs(nq, 21), inputs(nk, 22), inputs(nk, 23), inputs(nq, 24));
    let (mut o, mut lse) = (vec![0.0f32; nq], vec![0.0f32; nq / dm.hd]);
    attention_fwd(&mut o, &mut lse, &q, &k, &v, q_pos, k_pos, dm);
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; nq], vec![0.0f32; nk], vec![0.0f32; nk]);
    attention_bwd(&mut dq, &mut dk, &mut dv, &d_o, &q, &k, &v, &o, &lse, q_pos, k_pos, dm);

    let gdm = AttnDims::new(dm)?;
    let pos = |p: &[usize]| -> Vec<i32> { p.iter().map(|&x| x as i32).collect() };
    let (qp, kp) = (gpu.upload(&pos(q_pos))?, gpu.upload(&pos(k_pos))?);
    let (qd, kd, vd) = (gpu.upload(&q)?, gpu.upload(&k)?, gpu.upload(&v)?);
    let (mut od, mut lsed) = (gpu.zeros(nq)?, gpu.zeros(nq / dm.hd)?);
    gpu.attention_fwd(&mut od, &mut lsed, (&qd, &kd, &vd), &qp, &kp, gdm)?;
    c.compare(format!("attention forward, {what}: o"), &od, &o, F32_TOL)?;
    c.compare(format!("attention forward, {what}: lse"), &lsed, &lse, F32_TOL)?;
    let (mut dqd, mut dkd, mut dvd, mut ddd) = (gpu.zeros(nq)?, gpu.zeros(nk)?, gpu.zeros(nk)?, gpu.zeros(nq / dm.hd)?);
    // The backward reads the CPU's o and lse, so it is checked on its own.
    let (o_ref, lse_ref) = (gpu.upload(&o)?, gpu.upload(&lse)?);
    gpu.attention_bwd((&mut dqd, &mut dkd, &mut dvd, &mut ddd), &gpu.upload(&d_o)?, (&qd, &kd, &vd, &o_ref, &lse_ref), &qp, &kp, gdm)?;
    c.compare(format!("attention backward, {what}: dq"), &dqd, &dq, F32_TOL)?;
    c.compare(format!("attention backward, {what}: dk"), &dkd, &dk, F32_TOL)?;
    c.compare(format!("attention backward, {what}: dv"), &dvd, &dv, F32_TOL)
}

/// Three AdamW steps of one decayed tensor, against `optim::AdamW`.
fn adamw(c: &mut Checks) -> Result<(), String> {
    let gpu = c.gpu;
    let len = 100_003;
    let cfg = crate::config::OptimCfg::default();
    let mut opt = crate::optim::AdamW::<f32>::for_slots(&[(len, true)], &cfg);
    let mut p_cpu = inputs(len, 8);
    let (mut p, mut mm, mut vv) = (gpu.upload(&p_cpu)?, gpu.zeros(len)?, gpu.zeros(len)?);
    for t in 1..=3u64 {
        let grad = inputs(len, 100 + t);
        let lr = 1e-3 * t as f64;
        opt.step_slots(vec![&mut p_cpu[..]], &[&grad[..]], lr);
        gpu.adamw(&mut p, &mut mm, &mut vv, &gpu.upload(&grad)?, t, lr, (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay))?;
    }
    c.compare("adamw, 3 steps: parameters", &p, &p_cpu, F32_TOL)?;
    let v_cpu = opt.exp_avg_sq[0].clone();
    c.compare("adamw, 3 steps: exp_avg_sq", &vv, &v_cpu, F32_TOL)
}

/// An NCCL all-reduce over `group` against the sum every rank can compute: rank `r` sends
/// `r + 1 + i/n`; the result must be `Σ_r (r + 1) + size·i/n` exactly (small integers and
/// the same fraction on every rank).
pub fn check_nccl(gpu: &Gpu, group: &Group) -> Result<Check, String> {
    let comm = gpu.nccl(group)?;
    let n = 1 << 20;
    let mine: Vec<f32> = (0..n).map(|i| (group.rank() + 1) as f32 + (i % 8) as f32 / 8.0).collect();
    let mut buf = gpu.upload(&mine)?;
    comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum).map_err(|e| format!("ncclAllReduce: {e:?}"))?;
    let got = gpu.download(&buf)?;
    let size = group.size();
    let want: Vec<f32> = (0..n).map(|i| (size * (size + 1) / 2) as f32 + size as f32 * (i % 8) as f32 / 8.0).collect();
    let what = format!("NCCL all-reduce (sum), 4 MiB, over {} ({} ranks)", group.name(), size);
    Ok(Check { what, rel_err: rel_err(&got, &want), tol: 0.0 })
}

/// `gpu-check --layout R,S,C,T`: the mesh degrees `dp_replicate,dp_shard,cp,tp`, whose product
/// must be the number of ranks.
pub fn parse_layout(text: &str, ranks: usize) -> Result<crate::config::Layout, String> {
    let degrees: Vec<usize> = text
        .split(',')
        .map(|x| x.trim().parse::<usize>().ok().filter(|&d| d >= 1))
        .collect::<Option<_>>()
        .filter(|d: &Vec<usize>| d.len() == 4)
        .ok_or_else(|| format!("--layout {text:?}: expected four degrees ≥ 1, dp_replicate,dp_shard,cp,tp (e.g. 1,2,1,4)"))?;
    let layout = crate::config::Layout { dp_replicate: degrees[0], dp_shard: degrees[1], cp: degrees[2], tp: degrees[3] };
    // Checked without overflow: a product beyond usize is simply not the number of ranks.
    let product = degrees.iter().try_fold(1usize, |p, &d| p.checked_mul(d));
    if product != Some(ranks) {
        return Err(format!(
            "--layout {text}: dp_replicate·dp_shard·cp·tp must equal the {ranks} rank(s) of the job, not {}",
            degrees.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("·")
        ));
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_must_have_four_degrees_whose_product_is_the_ranks() {
        let l = parse_layout("1, 2,1,4", 8).unwrap();
        assert_eq!((l.dp_replicate, l.dp_shard, l.cp, l.tp), (1, 2, 1, 4));
        for (bad, want) in
            [("1,2,1", "four degrees"), ("1,2,0,4", "four degrees"), ("a,2,1,4", "four degrees"), ("2,2,1,4", "equal the 8 rank(s)")]
        {
            let e = parse_layout(bad, 8).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
        assert!(parse_layout("18446744073709551615,2,1,1", 8).unwrap_err().contains("equal the 8"));
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
