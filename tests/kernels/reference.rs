//! The f64 references every family is checked against, and their own check by central differences.

use ndtrain::backend::AttnDims;
use ndtrain::config::{OptimCfg, Schedule};
use ndtrain::model::params::ModelParams;

use crate::support::{assert_close, dot, fd_grad, Rng, FD_TOL};

/// RMSNorm of each `d`-row: `y = x / sqrt(mean(x²) + eps) * w`; also `rstd = 1 / sqrt(mean(x²) + eps)`.
pub(crate) fn ref_rmsnorm(x: &[f64], w: &[f64], d: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
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
pub(crate) fn ref_rmsnorm_bwd(dy: &[f64], x: &[f64], w: &[f64], d: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
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
pub(crate) fn ref_rope_tables(positions: &[usize], hd: usize, theta: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
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
pub(crate) fn ref_to_heads(src: &[f64], b: usize, s: usize, nh: usize, hd: usize, rope: Option<(&[f64], &[f64])>) -> Vec<f64> {
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
pub(crate) fn ref_from_heads(g: &[f64], b: usize, s: usize, nh: usize, hd: usize, rope: Option<(&[f64], &[f64])>) -> Vec<f64> {
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
pub(crate) fn ref_swiglu(g: &[f64], u: &[f64]) -> Vec<f64> {
    g.iter().zip(u).map(|(&g, &u)| g * sigmoid(g) * u).collect()
}

/// `∂h/∂u = silu(g)`; `∂h/∂g = u·(σ(g) + g·σ(g)·(1 − σ(g)))`, the product rule on `g·σ(g)`.
pub(crate) fn ref_swiglu_bwd(dh: &[f64], g: &[f64], u: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let dg = (0..g.len()).map(|i| dh[i] * u[i] * (sigmoid(g[i]) + g[i] * sigmoid(g[i]) * (1.0 - sigmoid(g[i])))).collect();
    let du = (0..g.len()).map(|i| dh[i] * g[i] * sigmoid(g[i])).collect();
    (dg, du)
}

/// Cross entropy of whole rows of `logits [N, V]`.
pub(crate) struct RefCe {
    pub(crate) max: Vec<f64>,
    /// `Σ_j exp(logit_j − max)`.
    pub(crate) sum_exp: Vec<f64>,
    pub(crate) lse: Vec<f64>,
    pub(crate) target: Vec<f64>,
    /// `scale · (softmax − onehot(target))`: the gradient of `scale · Σ_n (lse_n − logit_{n,t_n})`.
    pub(crate) dlogits: Vec<f64>,
}

pub(crate) fn ref_cross_entropy(logits: &[f64], targets: &[u32], v: usize, scale: f64) -> RefCe {
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
pub(crate) fn ref_matmul(a: &[f64], b: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
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

pub(crate) fn transpose(a: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..cols * rows).map(|i| a[(i % rows) * cols + i / rows]).collect()
}

pub(crate) fn attn_dims(b: usize, h: usize, kv: usize, sq: usize, sk: usize, hd: usize) -> AttnDims {
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
pub(crate) fn ref_attention(q: &[f64], k: &[f64], v: &[f64], q_pos: &[usize], k_pos: &[usize], dm: AttnDims) -> (Vec<f64>, Vec<f64>) {
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
pub(crate) fn ref_attention_bwd(
    d_o: &[f64],
    q: &[f64],
    k: &[f64],
    v: &[f64],
    q_pos: &[usize],
    k_pos: &[usize],
    dm: AttnDims,
) -> [Vec<f64>; 3] {
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

/// docs/parallelism.md: the sequence is cut into `2·cp` equal chunks; rank `c` holds chunks `c` and `2·cp − 1 − c`.
pub(crate) fn ref_zigzag(seq_len: usize, cp: usize, rank: usize) -> Vec<usize> {
    let all: Vec<usize> = (0..seq_len).collect();
    let chunks: Vec<&[usize]> = all.chunks(seq_len / (2 * cp)).collect();
    [chunks[rank], chunks[2 * cp - 1 - rank]].concat()
}

/// One `torch.optim.AdamW` step on one tensor as docs/model.md states it: `p ← p·(1 − lr·wd)` when
/// decayed, `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`,
/// `p ← p − lr · (m/(1−β1^t)) / (sqrt(v/(1−β2^t)) + eps)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn ref_adamw(p: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f64], t: i32, lr: f64, decayed: bool, cfg: &OptimCfg) {
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
pub(crate) fn ref_lr(schedule: Schedule, lr: f64, min_lr: f64, warmup: u64, s: u64, steps: u64) -> f64 {
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
pub(crate) fn decay_table<T>(p: &mut ModelParams<T>) -> Vec<(String, bool, &mut Vec<T>)> {
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
