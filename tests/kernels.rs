//! Every compute kernel against a plain reference written here in f64.
//!
//! The references are the textbook maths in naive loops: RMSNorm and the Jacobian of each row,
//! Hugging Face rotate-half RoPE, SwiGLU, cross entropy over whole `[N, V]` rows, attention
//! through the full `[Sq, Sk]` softmax of each head (causal by global position, grouped-query),
//! plain matrix products, and AdamW, clipping and the learning-rate schedule as
//! `docs/model.md` states them. Each kernel runs in f32 (training) and in f64
//! (gradient checks) on the same inputs, which are rounded to f32 so that both element types
//! see identical values. Covered on purpose: attention lengths that are not a multiple of the
//! 64-row query block, GQA, context-parallel zigzag chunks with keys from another rank's chunk
//! or in ring-arrival (unsorted) order, vocabulary-sharded cross entropy with padding columns,
//! several parallel tasks per kernel, and the overwrite (`=`) / accumulate (`+=`) contract of
//! each backward. The backward references are themselves checked by central differences.
//!
//! Errors are measured in the max norm relative to the reference: `max |got − want|` over
//! `max |want|` of one tensor, so near-zero elements cannot blow the figure up.
//!
//! Legend: `N` rows (tokens), `D` width, `V` vocab, `B` batch, `H` query heads, `KV` key/value
//! heads, `Sq`/`Sk` query/key lengths, `hd` head dim.

// The references index like the maths they transcribe.
#![allow(clippy::needless_range_loop)]

use ndtrain::backend::cpu::attention::{attention_bwd, attention_fwd, merge_partial};
use ndtrain::backend::cpu::gemm::{linear_bwd_input, linear_bwd_weight, linear_fwd};
use ndtrain::backend::cpu::kernels::{
    add, add_assign, cross_entropy_bwd_inplace, from_heads_rope, rmsnorm_bwd, rmsnorm_fwd, row_max, row_sum_exp, swiglu_bwd, swiglu_fwd,
    target_logit, to_heads_rope,
};
use ndtrain::backend::AttnDims;
use ndtrain::config::{ModelCfg, OptimCfg, Schedule};
use ndtrain::model::params::ModelParams;
use ndtrain::model::positions::{rope_tables, visible_pairs};
use ndtrain::optim::{clip_coefficient, global_grad_norm, grad_sq_sum, lr_at, scale_grads, AdamW};
use ndtrain::parallel::cp::zigzag_positions;
use ndtrain::scalar::Real;

/// f32 kernels: ε = 2⁻²³ ≈ 1.2e-7 and the longest reduction here has ~140 terms (a softmax
/// row, a dot product, a column of dW), so a correct kernel lands near 1e-6 of the largest
/// value (at most 7e-7 measured, in attention); a wrong sign, scale or index is off by 1e-2
/// or more.
const F32_TOL: f64 = 1e-5;
/// f64 kernels: the same operations with ε = 2⁻⁵² ≈ 2.2e-16; ~140-term sums stay below 1e-13
/// (at most 3e-15 measured).
const F64_TOL: f64 = 1e-12;
/// `rope_tables` rounds each inverse frequency `θ^(−2i/hd)` to f32 as Hugging Face computes
/// it (two f32 roundings, ≤ 2·2⁻²⁴ ≈ 1.2e-7 relative; the exponent `2i/hd` is exact for the
/// power-of-two `hd` used here). An angle off by `δ` moves its cosine and sine by at most `δ`,
/// so an element may differ from the exact table by `pos · inv_freq · ROPE_FREQ_ROUNDING`.
const ROPE_FREQ_ROUNDING: f64 = 1.5e-7;
/// Central differences with step 1e-5 have truncation error ~h²·f''' ≈ 1e-10 and round-off
/// ~1e-16/h ≈ 1e-11; a correct reference gradient agrees to ~1e-10, a wrong term to 1e-2.
const FD_TOL: f64 = 1e-6;
const FD_STEP: f64 = 1e-5;
/// Filler for vocabulary padding columns and for outputs a kernel must overwrite: large
/// enough that using it anywhere breaks a result (`exp(1e3)` overflows even f64).
const GARBAGE: f64 = 1e3;

// ---------------------------------------------------------------------------------------------
// Inputs and comparison

/// splitmix64: deterministic, dependency-free test inputs.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
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
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        (lo + (hi - lo) * u) as f32 as f64
    }

    fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn cast<T: Real>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::from_f64(v)).collect()
}

fn to_f64<T: Real>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

/// The tolerance of a kernel run in element type `T`.
fn tol<T: Real>() -> f64 {
    if std::mem::size_of::<T>() == 4 {
        F32_TOL
    } else {
        F64_TOL
    }
}

/// `max_i |got_i − want_i| ≤ tol · max_i |want_i|`; an infinite reference element (a
/// log-sum-exp over no key) must be matched exactly.
#[track_caller]
fn assert_close<T: Real>(what: &str, got: &[T], want: &[f64], tol: f64) {
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
fn fd_grad(f: impl Fn(&[f64]) -> f64, x: &[f64]) -> Vec<f64> {
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

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

// ---------------------------------------------------------------------------------------------
// References, f64

/// RMSNorm of each `d`-row: `y = x / sqrt(mean(x²) + eps) * w`; also `rstd = 1 / sqrt(mean(x²) + eps)`.
fn ref_rmsnorm(x: &[f64], w: &[f64], d: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let n = x.len() / d;
    let (mut y, mut rstd) = (vec![0.0; n * d], vec![0.0; n]);
    for r in 0..n {
        let row = &x[r * d..][..d];
        let mean_sq = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
        rstd[r] = 1.0 / (mean_sq + eps).sqrt();
        for i in 0..d {
            y[r * d + i] = row[i] * rstd[r] * w[i];
        }
    }
    (y, rstd)
}

/// Backward of [`ref_rmsnorm`] through the explicit Jacobian of each row,
/// `∂y_i/∂x_j = w_i·(δ_ij·r − x_i·x_j·r³/D)`, and `∂y_i/∂w_i = x_i·r` summed over rows.
fn ref_rmsnorm_bwd(dy: &[f64], x: &[f64], w: &[f64], d: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let (_, rstd) = ref_rmsnorm(x, w, d, eps);
    let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; d]);
    for (row, &r) in rstd.iter().enumerate() {
        let (xr, dyr) = (&x[row * d..][..d], &dy[row * d..][..d]);
        for j in 0..d {
            for i in 0..d {
                let delta = if i == j { 1.0 } else { 0.0 };
                dx[row * d + j] += dyr[i] * w[i] * (delta * r - xr[i] * xr[j] * r.powi(3) / d as f64);
            }
        }
        for i in 0..d {
            dw[i] += dyr[i] * xr[i] * r;
        }
    }
    (dx, dw)
}

/// Hugging Face `LlamaRotaryEmbedding`: `inv_freq_i = θ^(−2i/hd)` for `i < hd/2`, and position
/// `p` turns pair `i` by `p · inv_freq_i`. Returns `cos, sin [S, hd/2]` and `inv_freq [hd/2]`.
fn ref_rope_tables(positions: &[usize], hd: usize, theta: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let inv_freq: Vec<f64> = (0..hd / 2).map(|i| theta.powf(-((2 * i) as f64) / hd as f64)).collect();
    let angles: Vec<f64> = positions.iter().flat_map(|&p| inv_freq.iter().map(move |f| p as f64 * f)).collect();
    (angles.iter().map(|a| a.cos()).collect(), angles.iter().map(|a| a.sin()).collect(), inv_freq)
}

/// Hugging Face `apply_rotary_pos_emb` on one head row: `x·cos + rotate_half(x)·sin` with
/// `cos = cat(cos_half, cos_half)` and `rotate_half(x) = cat(−x[hd/2..], x[..hd/2])`.
fn ref_rotate(x: &[f64], cos_half: &[f64], sin_half: &[f64]) -> Vec<f64> {
    let half = x.len() / 2;
    let cos: Vec<f64> = cos_half.iter().chain(cos_half).copied().collect();
    let sin: Vec<f64> = sin_half.iter().chain(sin_half).copied().collect();
    let rotated: Vec<f64> = x[half..].iter().map(|v| -v).chain(x[..half].iter().copied()).collect();
    (0..x.len()).map(|i| x[i] * cos[i] + rotated[i] * sin[i]).collect()
}

/// `[B, S, nh·hd]` → `[B, nh, S, hd]`, each head row rotated by its position's RoPE when given.
fn ref_to_heads(src: &[f64], b: usize, s: usize, nh: usize, hd: usize, rope: Option<(&[f64], &[f64])>) -> Vec<f64> {
    let half = hd / 2;
    let mut dst = vec![0.0; src.len()];
    for bi in 0..b {
        for t in 0..s {
            for h in 0..nh {
                let row = &src[((bi * s + t) * nh + h) * hd..][..hd];
                let out = match rope {
                    None => row.to_vec(),
                    Some((cos, sin)) => ref_rotate(row, &cos[t * half..][..half], &sin[t * half..][..half]),
                };
                dst[((bi * nh + h) * s + t) * hd..][..hd].copy_from_slice(&out);
            }
        }
    }
    dst
}

/// The backward of the linear map [`ref_to_heads`] is its transpose: `dst = Jᵀ·g`, each
/// column of `J` found by applying the forward to a unit vector.
fn ref_from_heads(g: &[f64], b: usize, s: usize, nh: usize, hd: usize, rope: Option<(&[f64], &[f64])>) -> Vec<f64> {
    let mut unit = vec![0.0; g.len()];
    (0..g.len())
        .map(|j| {
            unit[j] = 1.0;
            let column = ref_to_heads(&unit, b, s, nh, hd, rope);
            unit[j] = 0.0;
            dot(&column, g)
        })
        .collect()
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// SwiGLU: `h = silu(g)·u` with `silu(g) = g·σ(g)`.
fn ref_swiglu(g: &[f64], u: &[f64]) -> Vec<f64> {
    g.iter().zip(u).map(|(&g, &u)| g * sigmoid(g) * u).collect()
}

/// `∂h/∂u = silu(g)`; `∂h/∂g = u·(σ(g) + g·σ(g)·(1 − σ(g)))`, the product rule on `g·σ(g)`.
fn ref_swiglu_bwd(dh: &[f64], g: &[f64], u: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let dg = (0..g.len()).map(|i| dh[i] * u[i] * (sigmoid(g[i]) + g[i] * sigmoid(g[i]) * (1.0 - sigmoid(g[i])))).collect();
    let du = (0..g.len()).map(|i| dh[i] * g[i] * sigmoid(g[i])).collect();
    (dg, du)
}

/// Cross entropy of whole rows of `logits [N, V]`.
struct RefCe {
    max: Vec<f64>,
    /// `Σ_j exp(logit_j − max)`.
    sum_exp: Vec<f64>,
    lse: Vec<f64>,
    target: Vec<f64>,
    /// `scale · (softmax − onehot(target))`: the gradient of `scale · Σ_n (lse_n − logit_{n,t_n})`.
    dlogits: Vec<f64>,
}

fn ref_cross_entropy(logits: &[f64], targets: &[u32], v: usize, scale: f64) -> RefCe {
    let n = targets.len();
    let mut ce = RefCe { max: vec![0.0; n], sum_exp: vec![0.0; n], lse: vec![0.0; n], target: vec![0.0; n], dlogits: vec![0.0; n * v] };
    for r in 0..n {
        let row = &logits[r * v..][..v];
        let t = targets[r] as usize;
        ce.max[r] = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        ce.sum_exp[r] = row.iter().map(|x| (x - ce.max[r]).exp()).sum();
        ce.lse[r] = ce.max[r] + ce.sum_exp[r].ln();
        ce.target[r] = row[t];
        for j in 0..v {
            let onehot = if j == t { 1.0 } else { 0.0 };
            ce.dlogits[r * v + j] = scale * ((row[j] - ce.lse[r]).exp() - onehot);
        }
    }
    ce
}

/// `[m, n] = [m, k] · [k, n]`, all row-major.
fn ref_matmul(a: &[f64], b: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
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

fn transpose(a: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..cols * rows).map(|i| a[(i % rows) * cols + i / rows]).collect()
}

fn attn_dims(b: usize, h: usize, kv: usize, sq: usize, sk: usize, hd: usize) -> AttnDims {
    AttnDims { b, h, kv, sq, sk, hd }
}

/// Attention probabilities `P [B, H, Sq, Sk]` of the full softmax of `q·kᵀ / sqrt(hd)` over the
/// keys with `k_pos ≤ q_pos` (0 elsewhere), query head `h` reading kv head `h / (H/KV)`; and
/// `lse [B, H, Sq]`, −∞ for a query that sees no key.
fn ref_probs(q: &[f64], k: &[f64], q_pos: &[usize], k_pos: &[usize], dm: AttnDims) -> (Vec<f64>, Vec<f64>) {
    let AttnDims { b, h, kv, sq, sk, hd } = dm;
    let mut p = vec![0.0; b * h * sq * sk];
    let mut lse = vec![f64::NEG_INFINITY; b * h * sq];
    for bi in 0..b {
        for hi in 0..h {
            let g = hi / (h / kv);
            for i in 0..sq {
                let qi = &q[((bi * h + hi) * sq + i) * hd..][..hd];
                let visible: Vec<usize> = (0..sk).filter(|&j| k_pos[j] <= q_pos[i]).collect();
                if visible.is_empty() {
                    continue;
                }
                let score = |j: usize| dot(qi, &k[((bi * kv + g) * sk + j) * hd..][..hd]) / (hd as f64).sqrt();
                let m = visible.iter().map(|&j| score(j)).fold(f64::NEG_INFINITY, f64::max);
                let row_lse = m + visible.iter().map(|&j| (score(j) - m).exp()).sum::<f64>().ln();
                for &j in &visible {
                    p[((bi * h + hi) * sq + i) * sk + j] = (score(j) - row_lse).exp();
                }
                lse[(bi * h + hi) * sq + i] = row_lse;
            }
        }
    }
    (p, lse)
}

/// Attention output `o [B, H, Sq, hd] = P·v` (0 for a query that sees no key) and `lse`.
fn ref_attention(q: &[f64], k: &[f64], v: &[f64], q_pos: &[usize], k_pos: &[usize], dm: AttnDims) -> (Vec<f64>, Vec<f64>) {
    let AttnDims { b, h, kv, sq, sk, hd } = dm;
    let (p, lse) = ref_probs(q, k, q_pos, k_pos, dm);
    let mut o = vec![0.0; b * h * sq * hd];
    for bi in 0..b {
        for hi in 0..h {
            let g = hi / (h / kv);
            for i in 0..sq {
                for j in 0..sk {
                    for c in 0..hd {
                        o[((bi * h + hi) * sq + i) * hd + c] += p[((bi * h + hi) * sq + i) * sk + j] * v[((bi * kv + g) * sk + j) * hd + c];
                    }
                }
            }
        }
    }
    (o, lse)
}

/// Gradients `(dq, dk, dv)` of `Σ d_o ∘ o` for [`ref_attention`]: `dv_j = Σ_i P_ij·dO_i`,
/// `dP_ij = dO_i·v_j`, through the softmax Jacobian `dS_ij = P_ij·(dP_ij − Σ_l P_il·dP_il)`,
/// then `dq_i = Σ_j dS_ij·k_j / sqrt(hd)` and `dk_j = Σ_i dS_ij·q_i / sqrt(hd)`.
fn ref_attention_bwd(d_o: &[f64], q: &[f64], k: &[f64], v: &[f64], q_pos: &[usize], k_pos: &[usize], dm: AttnDims) -> [Vec<f64>; 3] {
    let AttnDims { b, h, kv, sq, sk, hd } = dm;
    let scale = 1.0 / (hd as f64).sqrt();
    let (p, _) = ref_probs(q, k, q_pos, k_pos, dm);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    for bi in 0..b {
        for hi in 0..h {
            let g = hi / (h / kv);
            for i in 0..sq {
                let qrow = (bi * h + hi) * sq + i;
                let pr = &p[qrow * sk..][..sk];
                let doi = &d_o[qrow * hd..][..hd];
                let dp: Vec<f64> = (0..sk).map(|j| dot(doi, &v[((bi * kv + g) * sk + j) * hd..][..hd])).collect();
                let mean_dp = dot(pr, &dp);
                for j in 0..sk {
                    let krow = (bi * kv + g) * sk + j;
                    let ds = pr[j] * (dp[j] - mean_dp);
                    for c in 0..hd {
                        dq[qrow * hd + c] += scale * ds * k[krow * hd + c];
                        dk[krow * hd + c] += scale * ds * q[qrow * hd + c];
                        dv[krow * hd + c] += pr[j] * doi[c];
                    }
                }
            }
        }
    }
    [dq, dk, dv]
}

/// Rows `idx` of the sequence axis of a head-major `[B, heads, S, hd]` tensor.
fn gather_seq(x: &[f64], b: usize, heads: usize, s: usize, hd: usize, idx: &[usize]) -> Vec<f64> {
    let mut out = Vec::with_capacity(b * heads * idx.len() * hd);
    for bh in 0..b * heads {
        for &i in idx {
            out.extend_from_slice(&x[(bh * s + i) * hd..][..hd]);
        }
    }
    out
}

/// docs/parallelism.md: the sequence is cut into `2·cp` equal chunks; rank `c` holds chunks `c` and `2·cp − 1 − c`.
fn ref_zigzag(seq_len: usize, cp: usize, rank: usize) -> Vec<usize> {
    let all: Vec<usize> = (0..seq_len).collect();
    let chunks: Vec<&[usize]> = all.chunks(seq_len / (2 * cp)).collect();
    [chunks[rank], chunks[2 * cp - 1 - rank]].concat()
}

/// One `torch.optim.AdamW` step on one tensor as docs/model.md states it: `p ← p·(1 − lr·wd)` when
/// decayed, `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`,
/// `p ← p − lr · (m/(1−β1^t)) / (sqrt(v/(1−β2^t)) + eps)`.
#[allow(clippy::too_many_arguments)]
fn ref_adamw(p: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f64], t: i32, lr: f64, decayed: bool, cfg: &OptimCfg) {
    for i in 0..p.len() {
        if decayed {
            p[i] *= 1.0 - lr * cfg.weight_decay;
        }
        m[i] = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * g[i];
        v[i] = cfg.beta2 * v[i] + (1.0 - cfg.beta2) * g[i] * g[i];
        let m_hat = m[i] / (1.0 - cfg.beta1.powi(t));
        let v_hat = v[i] / (1.0 - cfg.beta2.powi(t));
        p[i] -= lr * m_hat / (v_hat.sqrt() + cfg.eps);
    }
}

/// docs/model.md's schedule for 0-based step `s` of `steps`: warm-up `lr·(s+1)/warmup`, then with
/// `p = (s − warmup) / max(1, steps − warmup)` cosine, linear or constant down to `min_lr`.
fn ref_lr(schedule: Schedule, lr: f64, min_lr: f64, warmup: u64, s: u64, steps: u64) -> f64 {
    if s < warmup {
        return lr * (s + 1) as f64 / warmup as f64;
    }
    let p = (s - warmup) as f64 / (steps as f64 - warmup as f64).max(1.0);
    match schedule {
        Schedule::Cosine => min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f64::consts::PI * p).cos()),
        Schedule::Linear => lr - (lr - min_lr) * p,
        Schedule::Constant => lr,
    }
}

/// Every tensor of a model from its struct fields (not from `param_specs`), with whether
/// docs/model.md decays it: 2-D weights yes, norm weights no.
fn decay_table<T>(p: &mut ModelParams<T>) -> Vec<(String, bool, &mut Vec<T>)> {
    let mut out = vec![("embed_tokens".to_string(), true, &mut p.embed_tokens)];
    for (l, layer) in p.layers.iter_mut().enumerate() {
        out.push((format!("layers.{l}.input_layernorm"), false, &mut layer.input_layernorm));
        out.push((format!("layers.{l}.q_proj"), true, &mut layer.q_proj));
        out.push((format!("layers.{l}.k_proj"), true, &mut layer.k_proj));
        out.push((format!("layers.{l}.v_proj"), true, &mut layer.v_proj));
        out.push((format!("layers.{l}.o_proj"), true, &mut layer.o_proj));
        out.push((format!("layers.{l}.post_attention_layernorm"), false, &mut layer.post_attention_layernorm));
        out.push((format!("layers.{l}.gate_proj"), true, &mut layer.gate_proj));
        out.push((format!("layers.{l}.up_proj"), true, &mut layer.up_proj));
        out.push((format!("layers.{l}.down_proj"), true, &mut layer.down_proj));
    }
    out.push(("norm".to_string(), false, &mut p.norm));
    if let Some(h) = &mut p.lm_head {
        out.push(("lm_head".to_string(), true, h));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The references checked against themselves

#[test]
fn backward_references_match_finite_differences() {
    let mut rng = Rng::new(1);
    // RMSNorm: loss = Σ dy ∘ y.
    let (d, eps) = (5, 0.05);
    let (x, w, dy) = (rng.vec(3 * d, -1.0, 1.0), rng.vec(d, 0.5, 1.5), rng.vec(3 * d, -1.0, 1.0));
    let (dx, dw) = ref_rmsnorm_bwd(&dy, &x, &w, d, eps);
    assert_close("rmsnorm dx", &dx, &fd_grad(|x| dot(&dy, &ref_rmsnorm(x, &w, d, eps).0), &x), FD_TOL);
    assert_close("rmsnorm dw", &dw, &fd_grad(|w| dot(&dy, &ref_rmsnorm(&x, w, d, eps).0), &w), FD_TOL);

    // SwiGLU: loss = Σ dh ∘ h.
    let (g, u, dh) = (rng.vec(9, -4.0, 4.0), rng.vec(9, -2.0, 2.0), rng.vec(9, -1.0, 1.0));
    let (dg, du) = ref_swiglu_bwd(&dh, &g, &u);
    assert_close("swiglu dgate", &dg, &fd_grad(|g| dot(&dh, &ref_swiglu(g, &u)), &g), FD_TOL);
    assert_close("swiglu dup", &du, &fd_grad(|u| dot(&dh, &ref_swiglu(&g, u)), &u), FD_TOL);

    // Cross entropy: loss = scale · Σ_n (lse_n − logit_{n,t_n}).
    let (v, scale, targets) = (6, 0.3, [4u32, 0, 5]);
    let logits = rng.vec(3 * v, -3.0, 3.0);
    let loss = |l: &[f64]| {
        let ce = ref_cross_entropy(l, &targets, v, scale);
        scale * ce.lse.iter().zip(&ce.target).map(|(a, b)| a - b).sum::<f64>()
    };
    assert_close("cross entropy dlogits", &ref_cross_entropy(&logits, &targets, v, scale).dlogits, &fd_grad(loss, &logits), FD_TOL);

    // Attention (GQA, queries of two zigzag chunks against the whole sequence): loss = Σ dO ∘ O.
    let dm = attn_dims(1, 2, 1, 4, 8, 4);
    let (q_pos, k_pos): (Vec<usize>, Vec<usize>) = (vec![0, 1, 6, 7], (0..8).collect());
    let (q, k, vv) = (rng.vec(2 * 4 * 4, -1.5, 1.5), rng.vec(8 * 4, -1.5, 1.5), rng.vec(8 * 4, -1.0, 1.0));
    let d_o = rng.vec(q.len(), -1.0, 1.0);
    let [dq, dk, dv] = ref_attention_bwd(&d_o, &q, &k, &vv, &q_pos, &k_pos, dm);
    let out = |q: &[f64], k: &[f64], v: &[f64]| dot(&d_o, &ref_attention(q, k, v, &q_pos, &k_pos, dm).0);
    assert_close("attention dq", &dq, &fd_grad(|q| out(q, &k, &vv), &q), FD_TOL);
    assert_close("attention dk", &dk, &fd_grad(|k| out(&q, k, &vv), &k), FD_TOL);
    assert_close("attention dv", &dv, &fd_grad(|v| out(&q, &k, v), &vv), FD_TOL);
}

// ---------------------------------------------------------------------------------------------
// Elementwise and row-wise kernels

/// 150 rows (three parallel tasks of 64), rows scaled from 0.2 to 2 so that `eps = 0.05` is a
/// visible part of `mean(x²)`.
fn rmsnorm_inputs(rng: &mut Rng, n: usize, d: usize) -> (Vec<f64>, Vec<f64>) {
    let mut x = rng.vec(n * d, -1.0, 1.0);
    for row in x.chunks_mut(d) {
        let s = rng.uniform(0.2, 2.0);
        row.iter_mut().for_each(|v| *v = (*v * s) as f32 as f64);
    }
    (x, rng.vec(d, 0.5, 1.5))
}

fn check_rmsnorm_fwd<T: Real>() {
    let (n, d, eps) = (150, 24, 0.05);
    let (x, w) = rmsnorm_inputs(&mut Rng::new(2), n, d);
    let (want_y, want_rstd) = ref_rmsnorm(&x, &w, d, eps);
    let (mut y, mut rstd) = (cast::<T>(&vec![GARBAGE; n * d]), cast::<T>(&vec![GARBAGE; n]));
    rmsnorm_fwd(&mut y, &mut rstd, &cast::<T>(&x), &cast::<T>(&w), d, eps);
    assert_close("rmsnorm_fwd y", &y, &want_y, tol::<T>());
    assert_close("rmsnorm_fwd rstd", &rstd, &want_rstd, tol::<T>());
}

#[test]
fn rmsnorm_fwd_matches_reference() {
    check_rmsnorm_fwd::<f32>();
    check_rmsnorm_fwd::<f64>();
}

fn check_rmsnorm_bwd<T: Real>() {
    let (n, d, eps) = (150, 24, 0.05);
    let mut rng = Rng::new(3);
    let (x, w) = rmsnorm_inputs(&mut rng, n, d);
    let (dy, dx0, dw0) = (rng.vec(n * d, -1.0, 1.0), rng.vec(n * d, -1.0, 1.0), rng.vec(d, -1.0, 1.0));
    let (want_dx, want_dw) = ref_rmsnorm_bwd(&dy, &x, &w, d, eps);
    let (_, rstd) = ref_rmsnorm(&x, &w, d, eps);
    let (xt, wt, dyt, rstdt) = (cast::<T>(&x), cast::<T>(&w), cast::<T>(&dy), cast::<T>(&rstd));
    let plus = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x + y).collect::<Vec<f64>>();
    for accumulate in [false, true] {
        // dx is overwritten (its old value ignored) or accumulated into; dw always accumulates.
        let mut dx = cast::<T>(&if accumulate { dx0.clone() } else { vec![GARBAGE; n * d] });
        let mut dw = cast::<T>(&dw0);
        rmsnorm_bwd(&mut dx, &mut dw, &dyt, &xt, &wt, &rstdt, d, accumulate);
        let want = if accumulate { plus(&dx0, &want_dx) } else { want_dx.clone() };
        assert_close(&format!("rmsnorm_bwd dx (accumulate = {accumulate})"), &dx, &want, tol::<T>());
        assert_close(&format!("rmsnorm_bwd dw += (accumulate = {accumulate})"), &dw, &plus(&dw0, &want_dw), tol::<T>());
    }
}

#[test]
fn rmsnorm_bwd_matches_jacobian_with_and_without_accumulate() {
    check_rmsnorm_bwd::<f32>();
    check_rmsnorm_bwd::<f64>();
}

fn check_rope_tables<T: Real>() {
    // Zigzag positions of a context-parallel rank, and far positions where the angle is large.
    let positions = [4, 5, 6, 7, 24, 25, 26, 27, 0, 1, 300, 4095];
    for (hd, theta) in [(8, 10_000.0), (16, 500_000.0)] {
        let (cos, sin) = rope_tables::<T>(&positions, hd, theta);
        let (want_cos, want_sin, inv_freq) = ref_rope_tables(&positions, hd, theta);
        assert_eq!((cos.len(), sin.len()), (positions.len() * hd / 2, positions.len() * hd / 2));
        for (t, &pos) in positions.iter().enumerate() {
            for i in 0..hd / 2 {
                let e = t * hd / 2 + i;
                let allowed = tol::<T>() + pos as f64 * inv_freq[i] * ROPE_FREQ_ROUNDING;
                for (what, got, want) in [("cos", cos[e], want_cos[e]), ("sin", sin[e], want_sin[e])] {
                    let err = (got.to_f64() - want).abs();
                    assert!(
                        err <= allowed,
                        "rope_tables {what} (hd {hd}, pos {pos}, i {i}): {got} vs {want}, error {err:.3e} > {allowed:.3e}"
                    );
                }
            }
        }
    }
}

#[test]
fn rope_tables_match_hugging_face_frequencies() {
    check_rope_tables::<f32>();
    check_rope_tables::<f64>();
}

fn check_heads_rope<T: Real>() {
    let (b, s, nh, hd) = (2, 5, 3, 8);
    let positions = [3, 4, 9, 10, 100];
    let mut rng = Rng::new(4);
    let (x, g) = (rng.vec(b * s * nh * hd, -1.0, 1.0), rng.vec(b * s * nh * hd, -1.0, 1.0));
    let (cos, sin, _) = ref_rope_tables(&positions, hd, 10_000.0);
    // The kernel gets the tables in T; the reference uses the same rounded values.
    let (cos_t, sin_t) = (cast::<T>(&cos), cast::<T>(&sin));
    let (cos_r, sin_r) = (to_f64(&cos_t), to_f64(&sin_t));
    for rope in [false, true] {
        let (kernel_rope, ref_rope) = if rope { (Some((&cos_t[..], &sin_t[..])), Some((&cos_r[..], &sin_r[..]))) } else { (None, None) };
        let mut heads = cast::<T>(&vec![GARBAGE; x.len()]);
        to_heads_rope(&mut heads, &cast::<T>(&x), b, s, nh, hd, kernel_rope);
        assert_close(&format!("to_heads_rope (rope = {rope})"), &heads, &ref_to_heads(&x, b, s, nh, hd, ref_rope), tol::<T>());
        let mut tok = cast::<T>(&vec![GARBAGE; g.len()]);
        from_heads_rope(&mut tok, &cast::<T>(&g), b, s, nh, hd, kernel_rope);
        assert_close(&format!("from_heads_rope (rope = {rope})"), &tok, &ref_from_heads(&g, b, s, nh, hd, ref_rope), tol::<T>());
    }
}

#[test]
fn to_heads_and_from_heads_rope_match_rotate_half_and_its_transpose() {
    check_heads_rope::<f32>();
    check_heads_rope::<f64>();
}

fn check_swiglu<T: Real>() {
    // 5000 elements: two parallel chunks of 4096; a few gates far into both tails of σ.
    let n = 5000;
    let mut rng = Rng::new(5);
    let (mut gate, up, dh) = (rng.vec(n, -6.0, 6.0), rng.vec(n, -2.0, 2.0), rng.vec(n, -1.0, 1.0));
    gate[..4].copy_from_slice(&[-90.0, -30.0, 30.0, 90.0]);
    let (gt, ut) = (cast::<T>(&gate), cast::<T>(&up));
    let mut h = cast::<T>(&vec![GARBAGE; n]);
    swiglu_fwd(&mut h, &gt, &ut);
    assert_close("swiglu_fwd", &h, &ref_swiglu(&gate, &up), tol::<T>());
    let (want_dg, want_du) = ref_swiglu_bwd(&dh, &gate, &up);
    let (mut dg, mut du) = (cast::<T>(&vec![GARBAGE; n]), cast::<T>(&vec![GARBAGE; n]));
    swiglu_bwd(&mut dg, &mut du, &cast::<T>(&dh), &gt, &ut);
    assert_close("swiglu_bwd dgate", &dg, &want_dg, tol::<T>());
    assert_close("swiglu_bwd dup", &du, &want_du, tol::<T>());
}

#[test]
fn swiglu_fwd_and_bwd_match_reference() {
    check_swiglu::<f32>();
    check_swiglu::<f64>();
}

/// Columns `offset .. offset + valid` of `x [N, V]` as a `[N, v_local]` shard whose columns
/// past `valid` (vocabulary padding) hold `pad`.
fn vocab_shard(x: &[f64], v: usize, offset: usize, valid: usize, v_local: usize, pad: f64) -> Vec<f64> {
    x.chunks(v).flat_map(|row| (0..v_local).map(move |j| if j < valid { row[offset + j] } else { pad })).collect()
}

/// Runs the four cross-entropy kernels on `tp` vocabulary shards of `logits [N, V]` as the
/// model does (each shard `ceil(V/tp)` columns, the last one padded), reduces across shards
/// like the tp all-reduces, and checks every shard's piece against whole-row cross entropy.
fn check_cross_entropy<T: Real>(tp: usize) {
    let (n, v, scale) = (70, 37, 0.37);
    let mut rng = Rng::new(6 + tp as u64);
    let logits = rng.vec(n * v, -4.0, 4.0);
    // Targets on every shard, including both ends of the vocabulary.
    let targets: Vec<u32> = (0..n).map(|r| if r < 2 { [0, v - 1][r] as u32 } else { rng.below(v) as u32 }).collect();
    let want = ref_cross_entropy(&logits, &targets, v, scale);
    let v_local = v.div_ceil(tp);
    let (mut max, mut sum_exp, mut target) = (vec![f64::NEG_INFINITY; n], vec![0.0; n], vec![0.0; n]);
    let (m_t, lse_t) = (cast::<T>(&want.max), cast::<T>(&want.lse));
    for shard in 0..tp {
        let (offset, valid) = (shard * v_local, v_local.min(v - shard * v_local));
        let local = vocab_shard(&logits, v, offset, valid, v_local, GARBAGE);
        let mut local_t = cast::<T>(&local);
        let ctx = format!("(tp {tp}, shard {shard}: offset {offset}, valid {valid} of {v_local})");

        let mut m = cast::<T>(&vec![GARBAGE; n]);
        row_max(&mut m, &local_t, v_local, valid);
        let want_m: Vec<f64> = local.chunks(v_local).map(|r| r[..valid].iter().copied().fold(f64::NEG_INFINITY, f64::max)).collect();
        assert_close(&format!("row_max {ctx}"), &m, &want_m, tol::<T>());
        max.iter_mut().zip(&m).for_each(|(a, b)| *a = a.max(b.to_f64()));

        // The sum of exponentials against the global maximum, summed across shards.
        let mut s = cast::<T>(&vec![GARBAGE; n]);
        row_sum_exp(&mut s, &local_t, &m_t, v_local, valid);
        let want_s: Vec<f64> =
            local.chunks(v_local).zip(&want.max).map(|(r, mx)| r[..valid].iter().map(|x| (x - mx).exp()).sum()).collect();
        assert_close(&format!("row_sum_exp {ctx}"), &s, &want_s, tol::<T>());
        sum_exp.iter_mut().zip(&s).for_each(|(a, b)| *a += b.to_f64());

        // The target logit where this shard holds the target, else 0.
        let mut t = cast::<T>(&vec![GARBAGE; n]);
        target_logit(&mut t, &local_t, &targets, v_local, offset, valid);
        let held = |tg: u32| (offset..offset + valid).contains(&(tg as usize));
        let want_t: Vec<f64> = (0..n).map(|r| if held(targets[r]) { want.target[r] } else { 0.0 }).collect();
        assert_close(&format!("target_logit {ctx}"), &t, &want_t, tol::<T>());
        target.iter_mut().zip(&t).for_each(|(a, b)| *a += b.to_f64());

        // This shard's columns of scale·(softmax − onehot); padding columns 0.
        cross_entropy_bwd_inplace(&mut local_t, &lse_t, &targets, v_local, offset, valid, T::from_f64(scale));
        let want_d = vocab_shard(&want.dlogits, v, offset, valid, v_local, 0.0);
        assert_close(&format!("cross_entropy_bwd_inplace {ctx}"), &local_t, &want_d, tol::<T>());
    }
    assert_close(&format!("row_max across {tp} shards"), &cast::<T>(&max), &want.max, tol::<T>());
    assert_close(&format!("row_sum_exp across {tp} shards"), &cast::<T>(&sum_exp), &want.sum_exp, tol::<T>());
    assert_close(&format!("target_logit across {tp} shards"), &cast::<T>(&target), &want.target, tol::<T>());
}

#[test]
fn cross_entropy_kernels_match_whole_rows_unsharded_and_vocab_sharded() {
    // tp = 1 (no padding), 2 (one padding column), 3 (two), 4 (three).
    for tp in 1..=4 {
        check_cross_entropy::<f32>(tp);
        check_cross_entropy::<f64>(tp);
    }
}

fn check_add<T: Real>() {
    // 20 000 elements: three parallel chunks of 8192.
    let n = 20_000;
    let mut rng = Rng::new(7);
    let (a, b) = (rng.vec(n, -1.0, 1.0), rng.vec(n, -1.0, 1.0));
    let sum: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let mut dst = cast::<T>(&vec![GARBAGE; n]);
    add(&mut dst, &cast::<T>(&a), &cast::<T>(&b));
    assert_close("add", &dst, &sum, tol::<T>());
    let mut acc = cast::<T>(&a);
    add_assign(&mut acc, &cast::<T>(&b));
    assert_close("add_assign", &acc, &sum, tol::<T>());
}

#[test]
fn add_and_add_assign_match_reference() {
    check_add::<f32>();
    check_add::<f64>();
}

fn check_linear<T: Real>() {
    let (m, n, k) = (70, 33, 65);
    let mut rng = Rng::new(8);
    let (x, w, dy) = (rng.vec(m * k, -1.0, 1.0), rng.vec(n * k, -1.0, 1.0), rng.vec(m * n, -1.0, 1.0));
    let (xt, wt, dyt) = (cast::<T>(&x), cast::<T>(&w), cast::<T>(&dy));
    // y = x·wᵀ, dx = dy·w, dw = dyᵀ·x (w is [out, in] = [n, k]).
    let cases: [(&str, Vec<f64>, usize); 3] = [
        ("linear_fwd", ref_matmul(&x, &transpose(&w, n, k), m, n, k), m * n),
        ("linear_bwd_input", ref_matmul(&dy, &w, m, k, n), m * k),
        ("linear_bwd_weight", ref_matmul(&transpose(&dy, m, n), &x, n, k, m), n * k),
    ];
    for (name, want, len) in cases {
        let prior = rng.vec(len, -1.0, 1.0);
        for accumulate in [false, true] {
            let mut out = cast::<T>(&if accumulate { prior.clone() } else { vec![GARBAGE; len] });
            match name {
                "linear_fwd" => linear_fwd(&mut out, &xt, &wt, m, n, k, accumulate),
                "linear_bwd_input" => linear_bwd_input(&mut out, &dyt, &wt, m, n, k, accumulate),
                _ => linear_bwd_weight(&mut out, &dyt, &xt, m, n, k, accumulate),
            }
            let expect: Vec<f64> = if accumulate { want.iter().zip(&prior).map(|(a, b)| a + b).collect() } else { want.clone() };
            assert_close(&format!("{name} (accumulate = {accumulate})"), &out, &expect, tol::<T>());
        }
    }
}

#[test]
fn linear_kernels_match_naive_matmul() {
    check_linear::<f32>();
    check_linear::<f64>();
}

// ---------------------------------------------------------------------------------------------
// Attention

struct AttnInputs {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    d_o: Vec<f64>,
}

/// Scores spread over a few units (|q|, |k| ≤ 2) so the softmax is neither flat nor one-hot.
fn attn_inputs(rng: &mut Rng, dm: AttnDims) -> AttnInputs {
    let AttnDims { b, h, kv, sq, sk, hd } = dm;
    AttnInputs {
        q: rng.vec(b * h * sq * hd, -2.0, 2.0),
        k: rng.vec(b * kv * sk * hd, -2.0, 2.0),
        v: rng.vec(b * kv * sk * hd, -1.0, 1.0),
        d_o: rng.vec(b * h * sq * hd, -1.0, 1.0),
    }
}

/// Self-attention shapes: ragged query blocks (70 = 64 + 6, 130 = 2·64 + 2), GQA, MQA, MHA.
const SELF_ATTN: [AttnDims; 3] = [
    AttnDims { b: 2, h: 4, kv: 2, sq: 70, sk: 70, hd: 8 },
    AttnDims { b: 1, h: 3, kv: 1, sq: 5, sk: 5, hd: 4 },
    AttnDims { b: 1, h: 2, kv: 2, sq: 130, sk: 130, hd: 16 },
];

fn check_attention_self<T: Real>() {
    for (c, dm) in SELF_ATTN.into_iter().enumerate() {
        let x = attn_inputs(&mut Rng::new(10 + c as u64), dm);
        let pos: Vec<usize> = (0..dm.sq).collect();
        let (want_o, want_lse) = ref_attention(&x.q, &x.k, &x.v, &pos, &pos, dm);
        let (qt, kt, vt) = (cast::<T>(&x.q), cast::<T>(&x.k), cast::<T>(&x.v));
        let (mut o, mut lse) = (cast::<T>(&vec![GARBAGE; x.q.len()]), cast::<T>(&vec![GARBAGE; want_lse.len()]));
        attention_fwd(&mut o, &mut lse, &qt, &kt, &vt, &pos, &pos, dm);
        assert_close(&format!("attention_fwd o {dm:?}"), &o, &want_o, tol::<T>());
        assert_close(&format!("attention_fwd lse {dm:?}"), &lse, &want_lse, tol::<T>());

        let [want_dq, want_dk, want_dv] = ref_attention_bwd(&x.d_o, &x.q, &x.k, &x.v, &pos, &pos, dm);
        let (mut dq, mut dk, mut dv) =
            (cast::<T>(&vec![GARBAGE; dq_len(dm)]), cast::<T>(&vec![GARBAGE; kv_len(dm)]), cast::<T>(&vec![GARBAGE; kv_len(dm)]));
        attention_bwd(&mut dq, &mut dk, &mut dv, &cast::<T>(&x.d_o), &qt, &kt, &vt, &o, &lse, &pos, &pos, dm);
        assert_close(&format!("attention_bwd dq {dm:?}"), &dq, &want_dq, tol::<T>());
        assert_close(&format!("attention_bwd dk {dm:?}"), &dk, &want_dk, tol::<T>());
        assert_close(&format!("attention_bwd dv {dm:?}"), &dv, &want_dv, tol::<T>());
    }
}

fn dq_len(dm: AttnDims) -> usize {
    dm.b * dm.h * dm.sq * dm.hd
}

fn kv_len(dm: AttnDims) -> usize {
    dm.b * dm.kv * dm.sk * dm.hd
}

#[test]
fn causal_gqa_attention_matches_full_softmax() {
    check_attention_self::<f32>();
    check_attention_self::<f64>();
}

/// Context parallelism as the model runs it: each rank's zigzag queries against every rank's
/// key chunk in ring order. Checks each partial forward (queries that see none of a chunk),
/// the ring merge of the partials, one call over all keys in ring-arrival (unsorted) order, and
/// that the partial backwards (given the merged `o`, `lse`) sum to the whole-sequence gradient.
fn check_attention_zigzag<T: Real>(cp: usize, chunk: usize) {
    let (b, h, kv, hd) = (2, 4, 2, 8);
    let (s, s_local) = (2 * cp * chunk, 2 * chunk);
    let mut rng = Rng::new(20 + cp as u64);
    let full = attn_inputs(&mut rng, attn_dims(b, h, kv, s, s, hd));
    let all_pos: Vec<usize> = (0..s).collect();
    let part_dims = attn_dims(b, h, kv, s_local, s_local, hd);
    let whole_dims = attn_dims(b, h, kv, s_local, s, hd);
    for rank in 0..cp {
        let q_pos = zigzag_positions(s, cp, rank);
        let (q, d_o) = (gather_seq(&full.q, b, h, s, hd, &q_pos), gather_seq(&full.d_o, b, h, s, hd, &q_pos));
        let (qt, do_t) = (cast::<T>(&q), cast::<T>(&d_o));
        let (want_o, want_lse) = ref_attention(&q, &full.k, &full.v, &q_pos, &all_pos, whole_dims);
        let [want_dq, want_dk, want_dv] = ref_attention_bwd(&d_o, &q, &full.k, &full.v, &q_pos, &all_pos, whole_dims);
        let (o_glob, lse_glob) = (cast::<T>(&want_o), cast::<T>(&want_lse));

        let (mut o_run, mut lse_run) = (vec![T::ZERO; q.len()], vec![T::NEG_INFINITY; want_lse.len()]);
        let mut dq_sum = vec![T::ZERO; q.len()];
        let mut ring_pos = Vec::new();
        for step in 0..cp {
            let src = (rank + cp - step) % cp;
            let k_pos = zigzag_positions(s, cp, src);
            let (k, v) = (gather_seq(&full.k, b, kv, s, hd, &k_pos), gather_seq(&full.v, b, kv, s, hd, &k_pos));
            let (kt, vt) = (cast::<T>(&k), cast::<T>(&v));
            let ctx = format!("(cp {cp}, rank {rank}, keys of rank {src})");

            let (mut o, mut lse) = (cast::<T>(&vec![GARBAGE; q.len()]), cast::<T>(&vec![GARBAGE; want_lse.len()]));
            attention_fwd(&mut o, &mut lse, &qt, &kt, &vt, &q_pos, &k_pos, part_dims);
            let (part_o, part_lse) = ref_attention(&q, &k, &v, &q_pos, &k_pos, part_dims);
            assert_close(&format!("attention_fwd o {ctx}"), &o, &part_o, tol::<T>());
            assert_close(&format!("attention_fwd lse {ctx}"), &lse, &part_lse, tol::<T>());
            merge_partial(&mut o_run, &mut lse_run, &o, &lse, hd);

            let (mut dq, mut dk, mut dv) =
                (cast::<T>(&vec![GARBAGE; q.len()]), cast::<T>(&vec![GARBAGE; k.len()]), cast::<T>(&vec![GARBAGE; k.len()]));
            attention_bwd(&mut dq, &mut dk, &mut dv, &do_t, &qt, &kt, &vt, &o_glob, &lse_glob, &q_pos, &k_pos, part_dims);
            assert_close(&format!("attention_bwd dk {ctx}"), &dk, &gather_seq(&want_dk, b, kv, s, hd, &k_pos), tol::<T>());
            assert_close(&format!("attention_bwd dv {ctx}"), &dv, &gather_seq(&want_dv, b, kv, s, hd, &k_pos), tol::<T>());
            dq_sum.iter_mut().zip(&dq).for_each(|(a, &x)| *a += x);
            ring_pos.extend(k_pos);
        }
        let ctx = format!("(cp {cp}, rank {rank})");
        assert_close(&format!("ring of attention_fwd + merge_partial o {ctx}"), &o_run, &want_o, tol::<T>());
        assert_close(&format!("ring of attention_fwd + merge_partial lse {ctx}"), &lse_run, &want_lse, tol::<T>());
        assert_close(&format!("Σ attention_bwd dq over key chunks {ctx}"), &dq_sum, &want_dq, tol::<T>());

        // All keys in one call, in the order the ring delivers them (not ascending).
        assert!(ring_pos.windows(2).any(|w| w[0] > w[1]) || cp == 1);
        let (k, v) = (gather_seq(&full.k, b, kv, s, hd, &ring_pos), gather_seq(&full.v, b, kv, s, hd, &ring_pos));
        let (mut o, mut lse) = (cast::<T>(&vec![GARBAGE; q.len()]), cast::<T>(&vec![GARBAGE; want_lse.len()]));
        attention_fwd(&mut o, &mut lse, &qt, &cast::<T>(&k), &cast::<T>(&v), &q_pos, &ring_pos, whole_dims);
        assert_close(&format!("attention_fwd o, keys in ring order {ctx}"), &o, &want_o, tol::<T>());
        assert_close(&format!("attention_fwd lse, keys in ring order {ctx}"), &lse, &want_lse, tol::<T>());
    }
}

#[test]
fn attention_on_zigzag_chunks_matches_whole_sequence() {
    // cp 2: 70 local rows (a ragged second query block); cp 3: 46 local rows, keys from middle chunks.
    for (cp, chunk) in [(2, 35), (3, 23)] {
        check_attention_zigzag::<f32>(cp, chunk);
        check_attention_zigzag::<f64>(cp, chunk);
    }
}

fn check_attention_no_visible_key<T: Real>() {
    // Every query before every key (a whole query block with nothing to see).
    let dm = attn_dims(1, 2, 1, 10, 6, 4);
    let (q_pos, k_pos): (Vec<usize>, Vec<usize>) = ((0..10).collect(), (20..26).collect());
    let x = attn_inputs(&mut Rng::new(30), dm);
    let (qt, kt, vt) = (cast::<T>(&x.q), cast::<T>(&x.k), cast::<T>(&x.v));
    let (want_o, want_lse) = ref_attention(&x.q, &x.k, &x.v, &q_pos, &k_pos, dm);
    assert!(want_o.iter().all(|&v| v == 0.0) && want_lse.iter().all(|&l| l == f64::NEG_INFINITY));
    let (mut o, mut lse) = (cast::<T>(&vec![GARBAGE; x.q.len()]), cast::<T>(&vec![GARBAGE; want_lse.len()]));
    attention_fwd(&mut o, &mut lse, &qt, &kt, &vt, &q_pos, &k_pos, dm);
    assert_close("attention_fwd o, no visible key", &o, &want_o, tol::<T>());
    assert_close("attention_fwd lse, no visible key", &lse, &want_lse, tol::<T>());
    let (mut dq, mut dk, mut dv) =
        (cast::<T>(&vec![GARBAGE; dq_len(dm)]), cast::<T>(&vec![GARBAGE; kv_len(dm)]), cast::<T>(&vec![GARBAGE; kv_len(dm)]));
    attention_bwd(&mut dq, &mut dk, &mut dv, &cast::<T>(&x.d_o), &qt, &kt, &vt, &o, &lse, &q_pos, &k_pos, dm);
    for (name, got) in [("dq", &dq), ("dk", &dk), ("dv", &dv)] {
        assert!(got.iter().all(|&g| g == T::ZERO), "attention_bwd {name}, no visible key: not all zero");
    }
}

#[test]
fn attention_with_no_visible_key_is_empty() {
    check_attention_no_visible_key::<f32>();
    check_attention_no_visible_key::<f64>();
}

fn check_merge_partial<T: Real>() {
    // 80 rows (two parallel tasks of 64). Keys split three ways: late positions (the earliest
    // queries see none), then the even and the odd early positions. Starting from the empty
    // result (0, −∞), merging covers a running −∞ (copy), a partial −∞ (skip) and the general case.
    let dm = attn_dims(1, 2, 1, 40, 40, 8);
    let x = attn_inputs(&mut Rng::new(40), dm);
    let pos: Vec<usize> = (0..40).collect();
    let (want_o, want_lse) = ref_attention(&x.q, &x.k, &x.v, &pos, &pos, dm);
    let sets: [Vec<usize>; 3] = [(20..40).collect(), (0..20).step_by(2).collect(), (1..20).step_by(2).collect()];
    let (mut o, mut lse) = (vec![T::ZERO; x.q.len()], vec![T::NEG_INFINITY; want_lse.len()]);
    for k_pos in &sets {
        let sub = attn_dims(1, 2, 1, 40, k_pos.len(), 8);
        let (k, v) = (gather_seq(&x.k, 1, 1, 40, 8, k_pos), gather_seq(&x.v, 1, 1, 40, 8, k_pos));
        let (part_o, part_lse) = ref_attention(&x.q, &k, &v, &pos, k_pos, sub);
        merge_partial(&mut o, &mut lse, &cast::<T>(&part_o), &cast::<T>(&part_lse), dm.hd);
    }
    assert_close("merge_partial o", &o, &want_o, tol::<T>());
    assert_close("merge_partial lse", &lse, &want_lse, tol::<T>());
}

#[test]
fn merge_partial_over_disjoint_keys_equals_attention_over_their_union() {
    check_merge_partial::<f32>();
    check_merge_partial::<f64>();
}

#[test]
fn zigzag_positions_hold_chunks_c_and_2cp_minus_1_minus_c() {
    for (s, cp) in [(8, 1), (12, 3), (32, 4), (140, 2), (138, 3)] {
        let mut seen = vec![0; s];
        let mut work = Vec::new();
        for rank in 0..cp {
            let pos = zigzag_positions(s, cp, rank);
            assert_eq!(pos, ref_zigzag(s, cp, rank), "zigzag_positions({s}, {cp}, {rank})");
            pos.iter().for_each(|&p| seen[p] += 1);
            work.push((0..cp).map(|src| visible_pairs(&pos, &zigzag_positions(s, cp, src))).sum::<u64>());
        }
        assert!(seen.iter().all(|&n| n == 1), "S {s}, cp {cp}: every position on exactly one rank");
        assert!(work.iter().all(|&w| w == work[0]), "S {s}, cp {cp}: causal work per rank {work:?}");
    }
}

#[test]
fn visible_pairs_counts_causal_query_key_pairs() {
    let naive = |q: &[usize], k: &[usize]| q.iter().map(|&qp| k.iter().filter(|&&kp| kp <= qp).count() as u64).sum::<u64>();
    let mut rng = Rng::new(50);
    for _ in 0..20 {
        // Unsorted, with repeats.
        let q: Vec<usize> = (0..1 + rng.below(30)).map(|_| rng.below(40)).collect();
        let k: Vec<usize> = (0..1 + rng.below(30)).map(|_| rng.below(40)).collect();
        assert_eq!(visible_pairs(&q, &k), naive(&q, &k), "q {q:?}, k {k:?}");
    }
    let (q, k) = (zigzag_positions(64, 4, 1), zigzag_positions(64, 4, 3));
    assert_eq!(visible_pairs(&q, &k), naive(&q, &k));
    let all: Vec<usize> = (0..64).collect();
    assert_eq!(visible_pairs(&all, &all), 64 * 65 / 2);
}

// ---------------------------------------------------------------------------------------------
// Optimiser

fn check_adamw_slots<T: Real>() {
    // Decay and eps both matter: lr up to 0.1 with weight decay 0.5, and gradients from 1e-6 to 1
    // against eps = 1e-6. Two slots, one decayed; 70 000 elements span several parallel chunks.
    let cfg = OptimCfg { weight_decay: 0.5, beta1: 0.9, beta2: 0.95, eps: 1e-6, ..Default::default() };
    let slots = [(70_000, true), (300, false)];
    let lrs = [0.05, 0.1, 0.08, 0.03, 0.0, 0.01];
    let mut rng = Rng::new(60);
    let mut p: Vec<Vec<f64>> = slots.iter().map(|&(n, _)| rng.vec(n, -1.0, 1.0)).collect();
    let (mut m, mut v): (Vec<Vec<f64>>, Vec<Vec<f64>>) =
        (slots.iter().map(|&(n, _)| vec![0.0; n]).collect(), slots.iter().map(|&(n, _)| vec![0.0; n]).collect());
    let mut pt: Vec<Vec<T>> = p.iter().map(|x| cast(x)).collect();
    let mut opt = AdamW::<T>::for_slots(&slots, &cfg);
    for (step, &lr) in lrs.iter().enumerate() {
        let g: Vec<Vec<f64>> = slots
            .iter()
            .map(|&(n, _)| {
                (0..n)
                    .map(|i| if i % 97 == 0 { 0.0 } else { (rng.uniform(-1.0, 1.0) * 10f64.powf(rng.uniform(-6.0, 0.0))) as f32 as f64 })
                    .collect()
            })
            .collect();
        let gt: Vec<Vec<T>> = g.iter().map(|x| cast(x)).collect();
        opt.step_slots(pt.iter_mut().map(|x| x.as_mut_slice()).collect(), &gt.iter().map(|x| x.as_slice()).collect::<Vec<_>>(), lr);
        for s in 0..slots.len() {
            ref_adamw(&mut p[s], &mut m[s], &mut v[s], &g[s], step as i32 + 1, lr, slots[s].1, &cfg);
            let ctx = format!("slot {s} (decayed = {}), step {}", slots[s].1, step + 1);
            assert_close(&format!("AdamW param {ctx}"), &pt[s], &p[s], tol::<T>());
            assert_close(&format!("AdamW exp_avg {ctx}"), &opt.exp_avg[s], &m[s], tol::<T>());
            assert_close(&format!("AdamW exp_avg_sq {ctx}"), &opt.exp_avg_sq[s], &v[s], tol::<T>());
        }
        assert_eq!(opt.rule.t, step as u64 + 1);
    }
}

#[test]
fn adamw_step_matches_textbook_with_bias_correction_and_decoupled_decay() {
    check_adamw_slots::<f32>();
    check_adamw_slots::<f64>();
}

fn check_adamw_model<T: Real>(tie: bool) {
    let model = ModelCfg {
        vocab_size: 11,
        d_model: 8,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 1,
        ffn_hidden: 12,
        max_seq_len: 8,
        rope_theta: 10_000.0,
        norm_eps: 1e-5,
        tie_embeddings: tie,
    };
    let cfg = OptimCfg { weight_decay: 0.5, ..Default::default() };
    let mut rng = Rng::new(70);
    let (mut params, mut grads) = (ModelParams::<T>::zeros(&model), ModelParams::<T>::zeros(&model));
    let mut want = Vec::new();
    for ((name, decayed, p), (_, _, g)) in decay_table(&mut params).into_iter().zip(decay_table(&mut grads)) {
        let (p0, g0) = (rng.vec(p.len(), -1.0, 1.0), rng.vec(g.len(), -1.0, 1.0));
        *p = cast(&p0);
        *g = cast(&g0);
        want.push((name, decayed, p0, g0, vec![0.0; p.len()], vec![0.0; p.len()]));
    }
    let mut opt = AdamW::<T>::new(&model, &cfg);
    for (t, lr) in [(1, 0.1), (2, 0.05)] {
        opt.step(&mut params, &grads, lr);
        for (_, decayed, p, g, m, v) in want.iter_mut() {
            ref_adamw(p, m, v, g, t, lr, *decayed, &cfg);
        }
    }
    for ((name, decayed, got), (_, _, p, ..)) in decay_table(&mut params).into_iter().zip(&want) {
        assert_close(&format!("AdamW::step {name} (decayed = {decayed}, tie = {tie})"), got, p, tol::<T>());
    }
}

#[test]
fn adamw_decays_matrices_but_not_norm_weights() {
    for tie in [false, true] {
        check_adamw_model::<f32>(tie);
        check_adamw_model::<f64>(tie);
    }
}

#[test]
fn lr_at_follows_the_documented_schedules() {
    let (peak, min_lr) = (3e-3, 2e-4);
    for schedule in [Schedule::Cosine, Schedule::Linear, Schedule::Constant] {
        for (warmup, steps) in [(0, 10), (1, 10), (4, 37), (5, 5), (6, 3)] {
            // `cfg.lr` differs from the peak handed in (batch-size scaling): the peak must win.
            let cfg = OptimCfg { lr: 1.0, min_lr, schedule, warmup_steps: warmup, ..Default::default() };
            let got: Vec<f64> = (0..steps).map(|s| lr_at(&cfg, peak, s, steps)).collect();
            let want: Vec<f64> = (0..steps).map(|s| ref_lr(schedule, peak, min_lr, warmup, s, steps)).collect();
            assert_close(&format!("lr_at {schedule:?}, warmup {warmup}, {steps} steps"), &got, &want, F64_TOL);
        }
    }
    // Landmarks, by hand: warm-up ends at the peak; cosine and linear are halfway at p = ½.
    let cfg = OptimCfg { min_lr: 0.1, warmup_steps: 2, schedule: Schedule::Cosine, ..Default::default() };
    assert!((lr_at(&cfg, 1.0, 0, 10) - 0.5).abs() < F64_TOL);
    assert!((lr_at(&cfg, 1.0, 2, 10) - 1.0).abs() < F64_TOL);
    assert!((lr_at(&cfg, 1.0, 6, 10) - 0.55).abs() < F64_TOL);
    assert!((lr_at(&OptimCfg { schedule: Schedule::Linear, ..cfg }, 1.0, 6, 10) - 0.55).abs() < F64_TOL);
}

#[test]
fn clipping_matches_pytorch_clip_grad_norm() {
    for max_norm in [0.0f64, 0.3, 1.0, 5.0] {
        for norm in [0.0, 1e-7, 0.29, 0.3, 1.0, 4.0, 1e3] {
            let want = if max_norm == 0.0 { 1.0 } else { (max_norm / (norm + 1e-6)).min(1.0) };
            assert_close(&format!("clip_coefficient({norm}, {max_norm})"), &[clip_coefficient(norm, max_norm)], &[want], F64_TOL);
        }
    }
    // The norm over every tensor (lm_head counted when untied), and scaling by the coefficient.
    let model = ModelCfg { vocab_size: 11, d_model: 8, n_layers: 1, n_heads: 2, n_kv_heads: 1, ffn_hidden: 12, ..Default::default() };
    let mut rng = Rng::new(80);
    let mut grads = ModelParams::<f32>::zeros(&model);
    let mut all = Vec::new();
    for (_, _, g) in decay_table(&mut grads) {
        let x = rng.vec(g.len(), -1.0, 1.0);
        *g = cast(&x);
        all.extend(x);
    }
    let sq: f64 = all.iter().map(|x| x * x).sum();
    assert_close("grad_sq_sum", &[grad_sq_sum(&grads)], &[sq], F64_TOL);
    assert_close("global_grad_norm", &[global_grad_norm(&grads)], &[sq.sqrt()], F64_TOL);
    let coef = clip_coefficient(sq.sqrt(), 1.0);
    scale_grads(&mut grads, coef);
    let scaled: Vec<f32> = decay_table(&mut grads).into_iter().flat_map(|(_, _, g)| g.clone()).collect();
    assert_close("scale_grads", &scaled, &all.iter().map(|x| x * coef).collect::<Vec<_>>(), F32_TOL);
    assert!((global_grad_norm(&grads) - 1.0).abs() < F32_TOL, "clipped norm {}", global_grad_norm(&grads));
}
