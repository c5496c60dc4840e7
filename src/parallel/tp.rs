//! Tensor parallelism over the `tp` group: Megatron's block boundaries as the model's
//! [`TensorParallel`] hooks (with or without sequence parallelism), moving whole (Hugging Face)
//! tensors to and from the TP-local pieces of `model::params::Dims`, and the `tp` byte formula.
//!
//! Which piece of each tensor a tp rank holds is `model::params` (column-parallel `q, k, v,
//! gate, up` and the vocabulary split by rows, row-parallel `o, down` by columns, norms
//! replicated). At each boundary the model calls a hook; this module realises it on the `tp`
//! group. Without sequence parallelism every tp rank holds all `N` rows of the residual
//! stream: a column-parallel projection reads them as they are, and a row-parallel
//! projection's partial output is all-reduced. With it a rank holds `N/tp` rows: they are
//! all-gathered before a column-parallel projection and the partial output is reduce-scattered
//! back (each is the other's backward conjugate). Knows nothing of data or context
//! parallelism.

use super::collective::Collective;
use super::comm::Group;
use crate::config::ModelCfg;
use crate::model::hooks::TensorParallel;
use crate::model::params::{param_specs_local, Dims, ModelParams};
use crate::model::Rows;
use std::collections::BTreeMap;

/// Rows of the residual stream of `n` tokens on a tp rank (`N_local`), and of the gather
/// scratch: all `n` without sequence parallelism; `n / tp` with it, gathered to `n`.
pub fn residual_rows(n: usize, tp: usize, sequence_parallel: bool) -> Rows {
    if sequence_parallel {
        assert!(n % tp == 0, "sequence parallelism needs B·S ({n}) divisible by tp ({tp})");
        Rows { local: n / tp, gathered: n }
    } else {
        Rows { local: n, gathered: 0 }
    }
}

/// Megatron-style tensor parallelism over one `tp` group, optionally with sequence
/// parallelism: the model's [`TensorParallel`] hooks.
pub struct Megatron<'a, V> {
    pub group: &'a dyn Collective<V>,
    pub sequence_parallel: bool,
}

impl<V> TensorParallel<V> for Megatron<'_, V> {
    fn local_rows(&self, n: usize) -> usize {
        residual_rows(n, self.group.degree(), self.sequence_parallel).local
    }

    fn first_row(&self, n: usize) -> usize {
        if self.sequence_parallel {
            self.group.rank() * self.local_rows(n)
        } else {
            0
        }
    }

    fn gathered_rows(&self, n: usize) -> usize {
        residual_rows(n, self.group.degree(), self.sequence_parallel).gathered
    }

    fn gather<'b>(&self, local: &'b V, full: &'b mut V) -> &'b V {
        if self.sequence_parallel {
            self.group.all_gather(local, full);
            full
        } else {
            local
        }
    }

    fn gathered<'b>(&self, local: &'b V, full: &'b V) -> &'b V {
        if self.sequence_parallel {
            full
        } else {
            local
        }
    }

    fn partial<'b>(&self, local: &'b mut V, full: &'b mut V) -> &'b mut V {
        if self.sequence_parallel {
            full
        } else {
            local
        }
    }

    /// Reduce-scatter under sequence parallelism (conjugate: all-gather), all-reduce without
    /// (conjugate: identity).
    fn finish(&self, local: &mut V, full: &V) {
        if self.sequence_parallel {
            self.group.reduce_scatter_sum(full, local);
        } else {
            self.group.all_reduce_sum(local);
        }
    }

    fn vocab_max(&self, buf: &mut V) {
        self.group.all_reduce_max(buf);
    }

    fn vocab_sum(&self, buf: &mut V) {
        self.group.all_reduce_sum(buf);
    }
}

/// This tp rank's piece of a whole model (e.g. one imported from Hugging Face); vocabulary
/// padding rows are zero.
pub fn local_from_global(full: &ModelParams<f32>, m: &Dims) -> ModelParams<f32> {
    let mut out = ModelParams::<f32>::zeros_local(m);
    for ((spec, dst), src) in param_specs_local(m).iter().zip(out.tensors_mut()).zip(full.tensors()) {
        for (i, x) in dst.iter_mut().enumerate() {
            *x = spec.global_index(i).map_or(0.0, |g| src[g]);
        }
    }
    out
}

/// The whole model assembled from every tp rank's piece (an all-gather per tensor over `tp`;
/// for an export, never during training). Every tp rank gets it.
pub fn global_from_local(local: &ModelParams<f32>, cfg: &ModelCfg, tp: &Group) -> ModelParams<f32> {
    let mut full = ModelParams::<f32>::zeros(cfg);
    let pieces: Vec<_> = (0..tp.size()).map(|r| param_specs_local(&Dims::new(cfg, tp.size(), r))).collect();
    let mut gathered = vec![];
    for (ti, (dst, src)) in full.tensors_mut().into_iter().zip(local.tensors()).enumerate() {
        gathered.resize(src.len() * tp.size(), 0.0);
        tp.all_gather_f32(src, &mut gathered);
        for (r, specs) in pieces.iter().enumerate() {
            for (i, &x) in gathered[r * src.len()..][..src.len()].iter().enumerate() {
                if let Some(g) = specs[ti].global_index(i) {
                    dst[g] = x;
                }
            }
        }
    }
    full
}

/// Bytes the `tp` collectives move per optimiser step on one rank, keyed `tp.<kind>` (the
/// counting convention of `comm`: the input of an all-reduce or reduce-scatter, the output of
/// an all-gather). Per micro-step of `tokens` rows:
///
/// * without sequence parallelism, all-reduces of `[tokens, D]`: the embedding's partial rows,
///   two per block in forward (after `o_proj`, after `down_proj`), two in backward (the input
///   gradients of the column-parallel projections), one more per recomputed block when
///   `full` activation checkpointing recomputes the forward (every block but the last; the
///   recomputation skips the down projection), and the final norm's input gradient;
/// * with it, each of those becomes a reduce-scatter and each replicated input an all-gather:
///   per block two all-gathers and two reduce-scatters in forward, four all-gathers (two of them
///   re-gathering the norms' outputs) and two reduce-scatters in backward, two all-gathers
///   and one reduce-scatter per recomputed block, plus the embedding's reduce-scatter and all-gather and the final
///   norm's all-gather and reduce-scatter;
///
/// A mixture-of-experts block's routed experts run on this rank's rows without communicating
/// (its shared experts, where it has them, are cut over tp like the dense MLP): without
/// shared experts it drops
/// the MLP's share (with sequence parallelism one all-gather and one reduce-scatter in forward,
/// two all-gathers and one reduce-scatter in backward, one all-gather when recomputed; without,
/// one all-reduce in each direction),
/// and always three `[tokens]` all-reduces of the vocab-parallel cross entropy. Once per step:
/// the 8-byte squared norm and the gradients of the replicated tensors each tp rank computes in
/// part (`partial_shard_elems` elements on this rank: the per-head q/k norms, and with
/// sequence parallelism every norm).
pub fn predicted_tp_bytes(
    m: &Dims,
    tokens: usize,
    grad_accum: usize,
    recompute: bool,
    sequence_parallel: bool,
    partial_shard_elems: usize,
    chunks: usize,
) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    if m.tp == 1 {
        return out;
    }
    let (ga, l) = (grad_accum as u64, m.layers as u64);
    // Blocks recomputed in backward (`full`): all but the last of each piece of the model
    // (`chunks`: one, or a pipeline rank's chunks), each without the down projection, so with
    // one gather pair and one reduction instead of two.
    let rl = if recompute { l.saturating_sub(chunks as u64) } else { 0 };
    let nd4 = (tokens * m.d * 4) as u64;
    // The embedding's reduction (forward) and gather (backward), the head's gather (forward)
    // and reduction (backward), and the vocabulary-parallel loss, where this rank runs them.
    let (e, h) = (m.embed as u64, m.head as u64);
    let ce = h * ga * 3 * tokens as u64 * 4;
    // Blocks with no MLP cut over tp (mixtures of experts without shared experts), and those of
    // them recomputed (a block piece's last block is not).
    let lm = m.layer_ids.iter().filter(|&&id| m.mlp_width(id) == 0).count() as u64;
    let last_moe = m.layer_ids.last().is_some_and(|&id| m.mlp_width(id) == 0) as u64;
    let rlm = if recompute { lm - last_moe } else { 0 };
    if sequence_parallel {
        out.insert("tp.all_gather".into(), ga * nd4 * (6 * l + 2 * rl + e + h - 3 * lm - rlm));
        out.insert("tp.reduce_scatter".into(), ga * nd4 * (4 * l + rl + e + h - 2 * lm));
        out.insert("tp.all_reduce".into(), ce + 8 + partial_shard_elems as u64 * 4);
    } else {
        out.insert("tp.all_reduce".into(), ga * nd4 * (e + h + 4 * l + rl - 2 * lm) + ce + 8 + partial_shard_elems as u64 * 4);
    }
    out
}
