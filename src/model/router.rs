//! Token-choice top-k routing of a mixture-of-experts layer, as Hugging Face's
//! `MixtralSparseMoeBlock` and `Qwen3MoeSparseMoeBlock` compute it, with its backward, the
//! per-sequence expert load behind the auxiliary balancing loss, and the bias update of
//! balancing without an auxiliary loss (`docs/model.md`, *Mixture of experts*).
//!
//! Routing is dropless: every row goes to exactly `k` experts. Per row `r` with router logits
//! `z [E]`: `p = softmax(z)`; the `k` experts with the largest `z + b` (`b` the balancing bias,
//! zero without it; among equal scores the lower index first), in descending order; their gate
//! weights `w_j = p_{e_j}`, divided by `Σ_j p_{e_j}` when `norm_topk_prob`. The bias changes
//! which experts are chosen, never the weights.
//!
//! The auxiliary loss of one sequence is `load_balancing_loss_func`'s over that sequence's rows
//! of every MoE layer (`R = layers × tokens` rows): `E / R² · Σ_e c_e · P_e`, with `c_e` how
//! many of the `R·k` choices went to expert `e` and `P_e = Σ_r p_{r,e}`. The counts are
//! integers and the sums additive, so the load of a sequence can be gathered from any split of
//! its rows (micro-batches, context-parallel shards, pipeline stages) and give the same loss.
//!
//! Legend: `R` rows (tokens), `E` experts, `k` experts per row.

use crate::scalar::Real;

/// What a layer's router chooses between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterShape {
    /// Experts `E`.
    pub experts: usize,
    /// Experts per row `k` (`≤ E`).
    pub top_k: usize,
    /// Divide the chosen experts' probabilities by their sum (Mixtral always; Qwen3-MoE when its
    /// config says so).
    pub norm_topk_prob: bool,
}

/// The choice of every row of a micro-batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing<T> {
    /// `[R, k]`: each row's experts, in descending order of their selection score.
    pub experts: Vec<u32>,
    /// `[R, k]`: the gate weight of each chosen expert.
    pub weights: Vec<T>,
    /// `[R, E]`: the softmax of the router logits.
    pub probs: Vec<T>,
}

impl<T: Real> Routing<T> {
    /// Rows routed.
    pub fn rows(&self, shape: RouterShape) -> usize {
        self.experts.len() / shape.top_k
    }
}

/// Routes `rows` rows from their router logits `[rows, E]`; `bias [E]` (balancing without an
/// auxiliary loss) is added to the logits for the choice only.
pub fn route<T: Real>(shape: RouterShape, logits: &[T], bias: Option<&[f64]>) -> Routing<T> {
    let (e, k) = (shape.experts, shape.top_k);
    assert!(k >= 1 && k <= e, "top_k = {k} must be in 1..={e}");
    assert_eq!(logits.len() % e, 0, "logits are [rows, {e}]");
    let rows = logits.len() / e;
    let mut out = Routing { experts: Vec::with_capacity(rows * k), weights: Vec::with_capacity(rows * k), probs: vec![T::ZERO; rows * e] };
    let mut order: Vec<u32> = (0..e as u32).collect();
    for (z, p) in logits.chunks_exact(e).zip(out.probs.chunks_exact_mut(e)) {
        softmax(z, p);
        let score = |i: u32| z[i as usize].to_f64() + bias.map_or(0.0, |b| b[i as usize]);
        order.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
        let chosen = &order[..k];
        let sum: T = chosen.iter().map(|&i| p[i as usize]).sum();
        out.experts.extend_from_slice(chosen);
        out.weights.extend(chosen.iter().map(|&i| if shape.norm_topk_prob { p[i as usize] / sum } else { p[i as usize] }));
    }
    out
}

/// `p = softmax(z)`, max-subtracted.
fn softmax<T: Real>(z: &[T], p: &mut [T]) {
    let max = z.iter().fold(T::NEG_INFINITY, |m, &x| m.max(x));
    for (pi, &zi) in p.iter_mut().zip(z) {
        *pi = (zi - max).exp();
    }
    let sum: T = p.iter().copied().sum();
    p.iter_mut().for_each(|x| *x /= sum);
}

/// The gradient of the router logits `[R, E]` (`=`), from that of the gate weights
/// `dweights [R, k]` and, where the auxiliary loss applies, a gradient of the probabilities that
/// is the same for every row of a sequence: `dprobs(row) -> [E]`.
pub fn route_backward<'a, T: Real>(
    shape: RouterShape,
    routing: &Routing<T>,
    dweights: &[T],
    dprobs: Option<&dyn Fn(usize) -> &'a [f64]>,
    dlogits: &mut [T],
) {
    let (e, k) = (shape.experts, shape.top_k);
    let mut dp = vec![0.0f64; e];
    for r in 0..routing.rows(shape) {
        let p = &routing.probs[r * e..][..e];
        let (chosen, w, dw) = (&routing.experts[r * k..][..k], &routing.weights[r * k..][..k], &dweights[r * k..][..k]);
        match dprobs {
            Some(f) => dp.copy_from_slice(f(r)),
            None => dp.fill(0.0),
        }
        if shape.norm_topk_prob {
            // w_j = p_j / s: dL/dp_j = (dw_j − Σ_i dw_i·w_i) / s.
            let s: f64 = chosen.iter().map(|&i| p[i as usize].to_f64()).sum();
            let dot: f64 = dw.iter().zip(w).map(|(&g, &x)| g.to_f64() * x.to_f64()).sum();
            for (&i, &g) in chosen.iter().zip(dw) {
                dp[i as usize] += (g.to_f64() - dot) / s;
            }
        } else {
            for (&i, &g) in chosen.iter().zip(dw) {
                dp[i as usize] += g.to_f64();
            }
        }
        // Softmax: dz = p ∘ (dp − Σ_e p_e·dp_e).
        let dot: f64 = p.iter().zip(&dp).map(|(&pe, &g)| pe.to_f64() * g).sum();
        for ((dz, &pe), &g) in dlogits[r * e..][..e].iter_mut().zip(p).zip(&dp) {
            *dz = T::from_f64(pe.to_f64() * (g - dot));
        }
    }
}

/// The expert load of one sequence over the rows seen so far: how many choices went to each
/// expert, and the sum of each expert's probability.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertLoad {
    /// `[E]`: choices per expert (`Σ_e = k × rows`).
    pub counts: Vec<u64>,
    /// `[E]`: `Σ_r p_{r,e}`.
    pub prob_sums: Vec<f64>,
    /// Rows added.
    pub rows: u64,
}

impl ExpertLoad {
    pub fn new(experts: usize) -> ExpertLoad {
        ExpertLoad { counts: vec![0; experts], prob_sums: vec![0.0; experts], rows: 0 }
    }

    /// Adds rows `first..first + n` of `routing`.
    pub fn add<T: Real>(&mut self, shape: RouterShape, routing: &Routing<T>, first: usize, n: usize) {
        let (e, k) = (shape.experts, shape.top_k);
        for &i in &routing.experts[first * k..(first + n) * k] {
            self.counts[i as usize] += 1;
        }
        for p in routing.probs[first * e..(first + n) * e].chunks_exact(e) {
            for (s, &pe) in self.prob_sums.iter_mut().zip(p) {
                *s += pe.to_f64();
            }
        }
        self.rows += n as u64;
    }

    /// Adds another part of the same sequence (another layer, stage or shard).
    pub fn merge(&mut self, other: &ExpertLoad) {
        self.counts.iter_mut().zip(&other.counts).for_each(|(a, b)| *a += b);
        self.prob_sums.iter_mut().zip(&other.prob_sums).for_each(|(a, b)| *a += b);
        self.rows += other.rows;
    }

    /// Appends the load as numbers (counts, probability sums, rows) for a sum across ranks:
    /// the counts stay exact integers in f64 up to 2^53.
    pub fn pack(&self, out: &mut Vec<f64>) {
        out.extend(self.counts.iter().map(|&c| c as f64));
        out.extend_from_slice(&self.prob_sums);
        out.push(self.rows as f64);
    }

    /// The load [`ExpertLoad::pack`] wrote at the start of `x`; returns what follows.
    pub fn unpack<'x>(&mut self, x: &'x [f64]) -> &'x [f64] {
        let e = self.counts.len();
        self.counts.iter_mut().zip(x).for_each(|(c, &v)| *c = v as u64);
        self.prob_sums.copy_from_slice(&x[e..2 * e]);
        self.rows = x[2 * e] as u64;
        &x[2 * e + 1..]
    }

    /// The sequence's auxiliary loss `E / R² · Σ_e c_e·P_e` (0 for no rows).
    pub fn aux_loss(&self) -> f64 {
        if self.rows == 0 {
            return 0.0;
        }
        let r = self.rows as f64;
        let dot: f64 = self.counts.iter().zip(&self.prob_sums).map(|(&c, &p)| c as f64 * p).sum();
        self.counts.len() as f64 * dot / (r * r)
    }

    /// `∂ aux_loss / ∂ p_{r,e}` for any row of the sequence, times `scale` (the loss's
    /// coefficient over the global batch's sequences): `scale · E · c_e / R²`. The counts are
    /// constants of the choice, as in Hugging Face (the one-hot mask carries no gradient).
    pub fn prob_grad(&self, scale: f64) -> Vec<f64> {
        let r = (self.rows as f64).max(1.0);
        let e = self.counts.len() as f64;
        self.counts.iter().map(|&c| scale * e * c as f64 / (r * r)).collect()
    }
}

/// Balancing without an auxiliary loss (DeepSeek-V3): after a step, each expert's bias moves by
/// `rate` towards an even load, up when the expert got fewer than the mean number of choices,
/// down when more, unchanged when exactly the mean. `counts` are the step's global counts (the
/// same integers on every rank, so every rank makes the same update).
pub fn update_bias(bias: &mut [f64], counts: &[u64], rate: f64) {
    let total: u64 = counts.iter().sum();
    let e = counts.len() as u64;
    for (b, &c) in bias.iter_mut().zip(counts) {
        // c vs total / E, compared as integers: c·E vs total.
        match (c * e).cmp(&total) {
            std::cmp::Ordering::Less => *b += rate,
            std::cmp::Ordering::Greater => *b -= rate,
            std::cmp::Ordering::Equal => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng;

    fn logits(rows: usize, e: usize, seed: u64) -> Vec<f64> {
        (0..rows * e).map(|i| 1.5 * rng::normal(seed, 7, i as u64)).collect()
    }

    #[test]
    fn the_k_largest_are_chosen_in_descending_order_with_their_gates() {
        for norm in [false, true] {
            let shape = RouterShape { experts: 8, top_k: 3, norm_topk_prob: norm };
            let z = logits(5, 8, 1);
            let r = route(shape, &z, None);
            for row in 0..5 {
                let (zr, p) = (&z[row * 8..][..8], &r.probs[row * 8..][..8]);
                assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
                let mut by_logit: Vec<usize> = (0..8).collect();
                by_logit.sort_by(|&a, &b| zr[b].total_cmp(&zr[a]));
                let chosen: Vec<usize> = r.experts[row * 3..][..3].iter().map(|&i| i as usize).collect();
                assert_eq!(chosen, by_logit[..3]);
                let w = &r.weights[row * 3..][..3];
                let s: f64 = chosen.iter().map(|&i| p[i]).sum();
                for (j, &i) in chosen.iter().enumerate() {
                    let want = if norm { p[i] / s } else { p[i] };
                    assert!((w[j] - want).abs() < 1e-15);
                }
            }
        }
    }

    #[test]
    fn the_bias_changes_the_choice_not_the_gates() {
        let shape = RouterShape { experts: 4, top_k: 1, norm_topk_prob: false };
        let z = [2.0, 1.0, 0.0, -1.0];
        let plain = route(shape, &z, None);
        assert_eq!(plain.experts, [0]);
        let biased = route(shape, &z, Some(&[0.0, 1.5, 0.0, 0.0]));
        assert_eq!(biased.experts, [1]);
        assert_eq!(biased.probs, plain.probs);
        assert_eq!(biased.weights, [plain.probs[1]]);
        // Equal scores: the lower index first.
        assert_eq!(route(shape, &[0.5, 0.5, 0.0, 0.0], None).experts, [0]);
    }

    /// `L = Σ c·w + Σ a·p` (random `c`, and `a` as the auxiliary loss's per-expert gradient)
    /// against central differences of the logits in f64, with and without renormalisation.
    #[test]
    fn the_backward_matches_finite_differences() {
        let (rows, e, k) = (4, 6, 2);
        let c: Vec<f64> = (0..rows * k).map(|i| rng::normal(3, 1, i as u64)).collect();
        let a: Vec<f64> = (0..e).map(|i| rng::normal(3, 2, i as u64)).collect();
        for norm in [false, true] {
            let shape = RouterShape { experts: e, top_k: k, norm_topk_prob: norm };
            let z = logits(rows, e, 2);
            let loss = |z: &[f64]| {
                let r = route(shape, z, None);
                let gates: f64 = r.weights.iter().zip(&c).map(|(w, c)| w * c).sum();
                let aux: f64 = r.probs.chunks_exact(e).map(|p| p.iter().zip(&a).map(|(p, a)| p * a).sum::<f64>()).sum();
                gates + aux
            };
            let r = route(shape, &z, None);
            let mut dz = vec![0.0; rows * e];
            let aux_grad = |_row: usize| a.as_slice();
            route_backward(shape, &r, &c, Some(&aux_grad), &mut dz);
            let h = 1e-6;
            for i in 0..rows * e {
                let (mut zp, mut zm) = (z.clone(), z.clone());
                zp[i] += h;
                zm[i] -= h;
                let fd = (loss(&zp) - loss(&zm)) / (2.0 * h);
                assert!((fd - dz[i]).abs() < 1e-8, "norm {norm}, logit {i}: {fd} vs {}", dz[i]);
            }
        }
    }

    /// The load gathered from any split of a sequence's rows gives Hugging Face's
    /// `load_balancing_loss_func` over all of them: `E · Σ_e mean_rows(one-hot counts) ·
    /// mean_rows(p)`, computed here as it does.
    #[test]
    fn the_auxiliary_loss_is_hugging_faces_over_any_split() {
        let shape = RouterShape { experts: 5, top_k: 2, norm_topk_prob: false };
        let rows = 12;
        let z = logits(rows, 5, 4);
        let r = route(shape, &z, None);
        let mut tokens_per_expert = [[0.0f64; 5]; 2];
        let mut prob_per_expert = [0.0f64; 5];
        for row in 0..rows {
            for j in 0..2 {
                tokens_per_expert[j][r.experts[row * 2 + j] as usize] += 1.0 / rows as f64;
            }
            for (e, p) in prob_per_expert.iter_mut().enumerate() {
                *p += r.probs[row * 5 + e] / rows as f64;
            }
        }
        let hf: f64 = 5.0 * tokens_per_expert.iter().map(|t| t.iter().zip(&prob_per_expert).map(|(t, p)| t * p).sum::<f64>()).sum::<f64>();
        let mut whole = ExpertLoad::new(5);
        whole.add(shape, &r, 0, rows);
        assert!((whole.aux_loss() - hf).abs() < 1e-14, "{} vs {hf}", whole.aux_loss());
        let (mut a, mut b) = (ExpertLoad::new(5), ExpertLoad::new(5));
        a.add(shape, &r, 0, 5);
        b.add(shape, &r, 5, 7);
        a.merge(&b);
        assert_eq!(a.counts, whole.counts);
        assert_eq!(a.rows, whole.rows);
        assert!((a.aux_loss() - hf).abs() < 1e-14);
        // The probability gradient is the loss's derivative with the counts held.
        let g = whole.prob_grad(1.0);
        let dot: f64 = g.iter().zip(&whole.prob_sums).map(|(g, p)| g * p).sum();
        assert!((dot - whole.aux_loss()).abs() < 1e-14, "the loss is linear in the probability sums");
    }

    #[test]
    fn the_bias_moves_towards_an_even_load() {
        let mut b = vec![0.0; 4];
        update_bias(&mut b, &[5, 3, 4, 4], 0.01);
        assert_eq!(b, [-0.01, 0.01, 0.0, 0.0]);
    }
}
