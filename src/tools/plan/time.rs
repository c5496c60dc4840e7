//! The planner's time model of one rank's compute per optimiser step, calibrated by
//! `ndtrain probe --deck` (`docs/planning.md`, *Predicted step time*): each pipeline stage's
//! GEMMs at the fitted rate of their size, the attention's and the elementwise work's seconds
//! per token and block, the gradients' zeroing at the memory bandwidth and AdamW's traffic at
//! the optimiser's rate; then the pipeline's bubble, partly filled by the other ranks where the
//! ranks of a node outnumber its cores.

use super::RankPlan;
use crate::config::{ActCkpt, Deck, HardwareCfg};
use crate::tools::probe::model_gemms;

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
    hw.block_other_s_per_token > 0.0 || hw.optimizer_bandwidth > 0.0
}

/// The GEMM rate of one GEMM of `flops` FLOPs: `peak × f / (f + half)`.
fn gemm_rate(hw: &HardwareCfg, peak: f64, flops: f64) -> f64 {
    peak * flops / (flops + hw.gemm_half_rate_flops)
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
        let gemm_s: f64 = gemms
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != last || head)
            .map(|(i, &(f, n))| n * f / gemm_rate(hw, peak, f) * if i == last { 3.0 } else { passes })
            .sum();
        let other_s = hw.block_other_s_per_token * (tokens * blocks) as f64 / l.tp as f64 * passes / 3.0;
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
