//! Expert parallelism: the experts of every expert block split over an `ep` group cut out of
//! the `fsdp` ranks (`mesh`), each expert's weights sharded over the `expert_fsdp` group
//! (`fsdp`'s expert units), the routed rows moved by an all-to-all (`model::moe`, through
//! the `ep` group's `ExpertExchange`). This file holds its byte formula and the gathering of
//! every expert for an export.

use super::comm::Group;
use crate::model::params::{Dims, Expert, ModelParams};

/// Bytes the `ep` all-to-all sends off this rank per optimiser step, for `rows` routed rows
/// per micro-step per block (this rank's residual rows), when each rank receives its even
/// share: every exchange moves `rows · k · (ep − 1) / ep` rows of `D` floats off the rank
/// (its own experts' rows stay). Per micro-step each expert block exchanges four times (the
/// rows out and their outputs back in forward, the output gradients out and the input
/// gradients back in backward), two more when `full` checkpointing recomputes its forward
/// (every block but the last of the piece). With `k = E` every row goes to every expert and
/// the formula is exact for any routing.
pub fn predicted_all_to_all_bytes(m: &Dims, rows: usize, grad_accum: usize, recompute: bool) -> u64 {
    let Some(e) = m.moe.as_ref().filter(|e| e.ep > 1) else { return 0 };
    let blocks = m.layer_ids.iter().filter(|&&id| m.moe_layer(id)).count();
    let last = m.layer_ids.last().is_some_and(|&id| m.moe_layer(id)) as usize;
    let exchanges = grad_accum * (4 * blocks + if recompute { 2 * (blocks - last) } else { 0 });
    let routed = rows * e.router.top_k;
    // Off-rank rows of an even split: the (ep − 1)/ep share, exact when ep divides them.
    (exchanges * routed * (e.ep - 1) / e.ep * m.d * 4) as u64
}

/// This rank's tp piece of the model with every expert: each ep rank's experts gathered over
/// `ep` (rank q holds experts `q·E/ep..`), for an export.
pub fn with_every_expert(mut local: ModelParams<f32>, ep: &Group) -> ModelParams<f32> {
    if ep.size() == 1 {
        return local;
    }
    for layer in &mut local.layers {
        let Some(x) = layer.moe.as_mut() else { continue };
        let mine = std::mem::take(&mut x.experts);
        let (g, u) = (mine[0].gate_proj.len(), mine[0].up_proj.len());
        let each = g + u + mine[0].down_proj.len();
        let flat: Vec<f32> = mine.iter().flat_map(|e| e.gate_proj.iter().chain(&e.up_proj).chain(&e.down_proj)).copied().collect();
        let mut all = vec![0.0; flat.len() * ep.size()];
        ep.all_gather_f32(&flat, &mut all);
        x.experts = all
            .chunks(each)
            .map(|c| Expert { gate_proj: c[..g].to_vec(), up_proj: c[g..g + u].to_vec(), down_proj: c[g + u..].to_vec() })
            .collect();
    }
    local
}
