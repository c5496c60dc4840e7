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

impl TpComm<f32> for Group {
    fn all_reduce_sum(&self, buf: &mut [f32]) {
        self.all_reduce_sum_f32(buf);
    }
    fn all_reduce_max(&self, buf: &mut [f32]) {
        self.all_reduce_max_f32(buf);
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

/// Bytes the `tp` all-reduces move per optimiser step on one rank (the counting convention of
/// `comm`: the input size). Per micro-step of `tokens` tokens: the embedding's partial rows,
/// two all-reduces per block in forward (after `o_proj`, after `down_proj`) and two in backward
/// (the input gradients of the column-parallel projections), two more per block when activation
/// checkpointing recomputes the forward, the final norm's input gradient, and three `[tokens]`
/// vectors of the vocab-parallel cross entropy; plus the 8-byte squared norm once per step.
pub fn predicted_tp_bytes(m: &Dims, tokens: usize, grad_accum: usize, recompute: bool) -> u64 {
    if m.tp == 1 {
        return 0;
    }
    let per_block = if recompute { 6 } else { 4 };
    let nd = (tokens * m.d) as u64;
    let per_micro = nd + m.layers as u64 * per_block * nd + nd + 3 * tokens as u64;
    grad_accum as u64 * per_micro * 4 + 8
}
