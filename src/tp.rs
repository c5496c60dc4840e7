//! Tensor parallelism over the `tp` group: the collectives the model calls, and moving whole
//! (Hugging Face) tensors to and from the TP-local pieces of `model::params::Dims`.
//!
//! The model itself holds the Megatron-style layout (column-parallel `q, k, v, gate, up`,
//! row-parallel `o, down`, vocab-parallel embedding and cross entropy) and calls `TpComm` at
//! each boundary; this module gives it the `tp` group. Knows nothing of data or context
//! parallelism.

use crate::comm::Group;
use crate::config::ModelCfg;
use crate::model::params::{param_specs_local, Dims, ModelParams};
use crate::model::TpComm;
use std::collections::BTreeMap;

impl TpComm<Vec<f32>> for Group {
    fn all_reduce_sum(&self, buf: &mut Vec<f32>) {
        self.all_reduce_sum_f32(buf);
    }
    fn all_reduce_max(&self, buf: &mut Vec<f32>) {
        self.all_reduce_max_f32(buf);
    }
    fn all_gather(&self, send: &Vec<f32>, recv: &mut Vec<f32>) {
        self.all_gather_f32(send, recv);
    }
    fn reduce_scatter_sum(&self, send: &Vec<f32>, recv: &mut Vec<f32>) {
        self.reduce_scatter_sum_f32(send, recv);
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
/// and always three `[tokens]` all-reduces of the vocab-parallel cross entropy. Once per step:
/// the 8-byte squared norm and, with sequence parallelism, the replicated (norm) tensors'
/// gradients (`replicated_shard_elems` elements on this rank).
pub fn predicted_tp_bytes(
    m: &Dims,
    tokens: usize,
    grad_accum: usize,
    recompute: bool,
    sequence_parallel: bool,
    replicated_shard_elems: usize,
) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    if m.tp == 1 {
        return out;
    }
    let (ga, l) = (grad_accum as u64, m.layers as u64);
    // Blocks recomputed in backward (`full`): all but the last, each without the down
    // projection, so with one gather pair and one reduction instead of two.
    let rl = if recompute { l.saturating_sub(1) } else { 0 };
    let nd4 = (tokens * m.d * 4) as u64;
    let ce = ga * 3 * tokens as u64 * 4;
    if sequence_parallel {
        out.insert("tp.all_gather".into(), ga * nd4 * (6 * l + 2 * rl + 2));
        out.insert("tp.reduce_scatter".into(), ga * nd4 * (4 * l + rl + 2));
        out.insert("tp.all_reduce".into(), ce + 8 + replicated_shard_elems as u64 * 4);
    } else {
        out.insert("tp.all_reduce".into(), ga * nd4 * (2 + 4 * l + rl) + ce + 8);
    }
    out
}
