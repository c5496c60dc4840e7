//! The planner's time model of one rank's compute per optimiser step, calibrated by
//! `ndtrain probe --deck` (`docs/planning.md`, *Predicted step time*): each pipeline stage's
//! GEMMs at the fitted rate of their sides, the attention's and the elementwise work's seconds
//! per token and block (or the real block's, measured at the rank's micro-batch tokens), the
//! gradients' zeroing at the memory bandwidth and AdamW's traffic at the optimiser's rate; then
//! the pipeline's bubble, partly filled by the other ranks where the ranks of a node outnumber
//! its cores.

use super::RankPlan;
use crate::config::{ActCkpt, Deck, HardwareCfg, ModelCfg};

/// One stage's seconds per optimiser step, by part.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageTime {
    pub gemm_s: f64,
    pub other_s: f64,
    pub grad_s: f64,
    pub optimizer_s: f64,
}

impl StageTime {
    pub fn total(&self) -> f64 {
        self.gemm_s + self.other_s + self.grad_s + self.optimizer_s
    }
}

/// Whether `hw` carries the probe's calibration (else compute is FLOPs over the peak).
pub fn calibrated(hw: &HardwareCfg) -> bool {
    hw.block_other_s_per_token > 0.0 || hw.attention_s_per_token > 0.0 || hw.optimizer_bandwidth > 0.0 || !hw.block_s_per_token.is_empty()
}

/// One GEMM shape of a linear layer: `rows` tokens by `n` outputs by `k` inputs, `count` of
/// them per forward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmShape {
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    pub count: f64,
}

impl GemmShape {
    /// FLOPs of one forward GEMM of this shape (backward runs two of the same size).
    pub fn flops(&self) -> f64 {
        2.0 * self.rows as f64 * self.n as f64 * self.k as f64
    }
}

/// The linear layers of one micro-batch of `tokens` tokens on one rank of `tp`: per block the
/// q/k/v projection and gate-and-up (outputs split by `tp`), the output projection and down
/// (inputs split by `tp`); last, once, the head (vocabulary split by `tp`).
pub fn model_gemms(m: &ModelCfg, tokens: usize, tp: usize, blocks: usize) -> Vec<GemmShape> {
    let (d, hd) = (m.d_model, m.head_dim());
    let g = |n: usize, k: usize, count: f64| GemmShape { rows: tokens, n, k, count };
    let b = blocks as f64;
    vec![
        g((m.n_heads + 2 * m.n_kv_heads) * hd / tp, d, b),
        g(d, m.n_heads * hd / tp, b),
        g(2 * m.ffn_hidden / tp, d, b),
        g(d, m.ffn_hidden / tp, b),
        g(m.vocab_size.div_ceil(tp), d, 1.0),
    ]
}

/// The GEMM rate curve of [`rate_of`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RateCurve {
    pub peak: f64,
    pub half_rows: f64,
    pub half_cols: f64,
    pub half_inner: f64,
}

/// The rate of a linear layer's GEMMs of `rows` tokens, `n` outputs and `k` inputs:
/// `peak / (1 + half_rows/rows + half_cols/n + half_inner/k)` (`ndtrain probe --deck` fits the
/// curve, `docs/planning.md`).
pub fn rate_of(c: &RateCurve, rows: usize, n: usize, k: usize) -> f64 {
    let f = |half: f64, side: usize| half / side.max(1) as f64;
    c.peak / (1.0 + f(c.half_rows, rows) + f(c.half_cols, n) + f(c.half_inner, k))
}

/// The curve `[hardware]` gives, at the peak the planner is using.
pub fn curve_of(hw: &HardwareCfg, peak: f64) -> RateCurve {
    RateCurve { peak, half_rows: hw.gemm_half_rate_rows, half_cols: hw.gemm_half_rate_cols, half_inner: hw.gemm_half_rate_inner }
}

/// The table's value at `x`: linear in `ln x` between its neighbouring points, the nearest
/// point's outside them; `None` for an empty table.
pub fn interpolate(table: &[[f64; 2]], x: f64) -> Option<f64> {
    let mut t: Vec<[f64; 2]> = table.to_vec();
    t.sort_by(|a, b| a[0].total_cmp(&b[0]));
    let (first, last) = (t.first()?, t.last()?);
    if x <= first[0] {
        return Some(first[1]);
    }
    if x >= last[0] {
        return Some(last[1]);
    }
    let i = t.iter().position(|p| p[0] >= x)?;
    let ([x0, y0], [x1, y1]) = (t[i - 1], t[i]);
    let f = (x.ln() - x0.ln()) / (x1.ln() - x0.ln());
    Some(y0 + f * (y1 - y0))
}

/// Rank 0 of each stage (one without a pipeline): its predicted compute per step.
pub fn stage_times(p: &RankPlan, deck: &Deck, hw: &HardwareCfg, peak: f64) -> Vec<StageTime> {
    let l = &p.layout;
    let tokens = deck.train.micro_batch * deck.train.seq_len / l.cp;
    let m = p.grad_accum as f64;
    // Full activation checkpointing runs every block's forward twice.
    let passes = if deck.train.activation_checkpointing == ActCkpt::Full { 4.0 } else { 3.0 };
    let stage = |blocks: usize, head: bool, params_bytes: usize, grads_bytes: usize| {
        let gemms = model_gemms(&deck.model, tokens, l.tp, blocks);
        let last = gemms.len() - 1;
        let curve = curve_of(hw, peak);
        let rate = |g: &GemmShape| rate_of(&curve, g.rows, g.n, g.k);
        let mut gemm_s: f64 = gemms
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != last || head)
            .map(|(i, g)| g.count * g.flops() / rate(g) * if i == last { 3.0 } else { passes })
            .sum();
        // Token-blocks of work, each pass counted: attention, the GEMMs and the rest of the
        // elementwise work are cut over tp (heads, weights, FFN columns); the work on whole
        // rows (norms, residuals) is not, unless sequence parallelism cuts the tokens.
        let work = (tokens * blocks) as f64 * passes / 3.0;
        let tp = l.tp as f64;
        let whole_rows = hw.replicated_s_per_token.min(hw.block_other_s_per_token);
        let whole_rows_s = whole_rows * work / if deck.parallel.sequence_parallel { tp } else { 1.0 };
        // What the real step on pairs of ranks took beyond this model, per token-block at degree
        // 2: under tp it grows as the work every rank repeats, `2(1 − 1/tp)`; under cp with the
        // ring's exchanges and merges, `cp − 1`.
        let tp_extra = if l.tp > 1 { hw.tp_extra_s_per_token * 2.0 * (1.0 - 1.0 / tp) } else { 0.0 };
        let cp_extra = if l.cp > 1 { hw.cp_extra_s_per_token * (l.cp - 1) as f64 } else { 0.0 };
        let other_s =
            (hw.attention_s_per_token + hw.block_other_s_per_token - whole_rows) * work / tp + whole_rows_s + (tp_extra + cp_extra) * work;
        if let Some(per_token) = interpolate(&hw.block_s_per_token, tokens as f64) {
            // The measured block (outside attention) replaces the curve's blocks: what it holds
            // beyond the rest is its GEMMs.
            let head_s = if head { gemms[last].flops() / rate(&gemms[last]) * 3.0 } else { 0.0 };
            let blocks_gemm_s = ((per_token - hw.block_other_s_per_token) * work).max(0.0) / tp;
            gemm_s = head_s + blocks_gemm_s;
        }
        let per = |bytes: usize, rate: f64| if rate > 0.0 { bytes as f64 / rate } else { 0.0 };
        StageTime {
            gemm_s: m * gemm_s,
            other_s: m * other_s,
            grad_s: per(grads_bytes, hw.memory_bandwidth),
            optimizer_s: per(7 * params_bytes, hw.optimizer_bandwidth),
        }
    };
    if p.stages.is_empty() {
        return vec![stage(deck.model.n_layers, true, p.state.params, p.state.grads)];
    }
    p.stages.iter().map(|s| stage(s.blocks.iter().map(Vec::len).sum(), s.head, s.state.params, s.state.grads)).collect()
}

/// How many times over the node's ranks' threads outnumber its cores (1 when they do not, or
/// when the cores are unknown). Ranks unbound share the cores evenly, a thread at least each.
pub fn oversubscription(hw: &HardwareCfg) -> f64 {
    if hw.cores_per_node == 0 {
        return 1.0;
    }
    let threads = (hw.cores_per_node / hw.ranks_per_node.max(1)).max(1);
    ((hw.ranks_per_node * threads) as f64 / hw.cores_per_node as f64).max(1.0)
}

/// The idle seconds of a step with `busy` seconds of the slowest stage and the schedule's idle
/// `bubble` fraction. Where ranks share cores the probe measured every rank busy at once; while
/// a stage waits, the ranks that can run go up to `f = min(oversubscription, pp)` times faster.
/// So the step is the longer of the ranks' work (`busy`: the cores do not idle while enough
/// ranks can run) and the pipeline's critical path at that speed (`busy / (f·(1 − bubble))`).
/// With a core per rank (`f = 1`) the second is the whole bubble.
pub fn bubble_s(busy: f64, bubble: f64, pp: usize, hw: &HardwareCfg) -> f64 {
    if bubble <= 0.0 || bubble >= 1.0 {
        return 0.0;
    }
    let f = oversubscription(hw).min(pp as f64).max(1.0);
    (busy / (f * (1.0 - bubble)) - busy).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_table_interpolates_in_log_tokens_and_holds_its_ends() {
        let t = [[512.0, 2.0], [128.0, 4.0]];
        assert_eq!(interpolate(&[], 100.0), None);
        assert_eq!(interpolate(&t, 1024.0), Some(2.0));
        assert_eq!(interpolate(&t, 64.0), Some(4.0));
        // 256 lies halfway between 128 and 512 in ln tokens.
        assert!((interpolate(&t, 256.0).unwrap() - 3.0).abs() < 1e-12);
    }

    #[test]
    fn the_rate_curve_falls_with_each_side() {
        let c = RateCurve { peak: 1e11, half_rows: 64.0, half_cols: 0.0, half_inner: 32.0 };
        assert!((rate_of(&c, 64, 1000, 32) - 1e11 / 3.0).abs() < 1.0);
        assert!(rate_of(&c, 512, 512, 512) > rate_of(&c, 128, 512, 512));
        assert_eq!(rate_of(&c, 128, 512, 512), rate_of(&c, 128, 4096, 512));
    }

    #[test]
    fn oversubscribed_ranks_fill_the_bubble_up_to_the_critical_path() {
        let mut hw = HardwareCfg { ranks_per_node: 4, cores_per_node: 2, ..HardwareCfg::default() };
        assert_eq!(oversubscription(&hw), 2.0);
        // 1F1B on 2 stages with 4 micro-batches (bubble 1/5): the other pipeline's ranks fill
        // it; 4 stages with 2 micro-batches (bubble 3/5): the critical path at twice the speed
        // is 1.25 of the busy time.
        assert_eq!(bubble_s(1.0, 0.2, 2, &hw), 0.0);
        assert!((bubble_s(1.0, 0.6, 4, &hw) - 0.25).abs() < 1e-12);
        hw.ranks_per_node = 2;
        assert_eq!(oversubscription(&hw), 1.0);
        assert!((bubble_s(1.0, 0.2, 2, &hw) - 0.25).abs() < 1e-12);
        hw.cores_per_node = 0;
        assert_eq!(oversubscription(&hw), 1.0);
    }
}
