//! What FSDP holds and moves, predicted from the plan alone: the model-state memory of a rank
//! by category (the timing log's memory columns) and the bytes of each collective per step.
//! The planner and the tests share these formulas with the code they describe.

use super::{ShardPlan, Unit};
use std::collections::BTreeMap;

/// The model-state memory of one rank, in bytes, by category (what the timing log's memory
/// columns report), predicted from the plan alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateMemory {
    pub params: usize,
    pub grads: usize,
    pub optim: usize,
    /// High-water mark of gathered parameters: the global tensors, the blocks held at once
    /// (one with `reshard_after_forward`, all without) and the gather buffers.
    pub gathered_peak: usize,
    pub grad_scratch: usize,
}

impl StateMemory {
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optim + self.gathered_peak + self.grad_scratch
    }
}

/// What `FsdpParams`, `FsdpGrads` and AdamW hold on a rank with this `plan`.
pub fn predicted_memory(plan: &ShardPlan, dp_rep: usize, reshard: bool, overlap: bool) -> StateMemory {
    let shard = 4 * plan.shard_elements();
    let blocks = plan.expert_units.len();
    let block = (0..blocks).map(|l| plan.block_elements(l)).max().unwrap_or(0);
    // The gradient of a block in backward: one buffer per kind of block (dense, or a mixture
    // of experts: its unit holds the router), each as large as the largest of its kind.
    let moe = |l: usize| plan.units[l + 1].tensors.iter().any(|t| t.name.ends_with(".mlp.gate.weight"));
    let largest = |kind: bool| (0..blocks).filter(|&l| moe(l) == kind).map(|l| plan.block_elements(l)).max().unwrap_or(0);
    let block_grads = largest(false) + largest(true);
    let held = if reshard { blocks.min(1) } else { blocks };
    // The gather buffers (and the prefetch's send buffer); none with degree 1.
    let buffers = if plan.degree > 1 { plan.max_gathered_len() + if overlap { plan.max_shard_len() } else { 0 } } else { 0 };
    let reduce = if plan.degree > 1 { plan.max_gathered_len() + plan.max_shard_len() } else { 0 };
    let outer = if dp_rep > 1 { plan.shard_elements() } else { 0 };
    StateMemory {
        params: shard,
        grads: shard,
        optim: 2 * shard,
        gathered_peak: 4 * (plan.unit_elements(0) + held * block + buffers),
        grad_scratch: 4 * (plan.unit_elements(0) + block_grads + reduce + outer),
    }
}

/// Bytes each collective moves per optimiser step on one rank, by the counting convention of
/// `comm` (the input of an all-reduce or reduce-scatter, the output of an all-gather), keyed
/// `group.kind`. Per micro-step, ZeRO-3 gathers the global tensors once and every block twice
/// (once with `reshard_after_forward = false`) and reduces every unit once (expert units over
/// `expert_fsdp`); the outer
/// all-reduce over `dp_rep` runs once per step; the loss, the token count and the norm are
/// 8-byte scalars. Groups of degree 1 move nothing.
pub fn predicted_comm_bytes(plan: &ShardPlan, dp_rep: usize, batch: usize, grad_accum: usize, reshard: bool) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let (n, ne, ga) = (plan.degree as u64, plan.expert_degree as u64, grad_accum as u64);
    let unit = |u: &Unit| u.shard_len as u64 * 4;
    let globals = unit(&plan.units[0]);
    let blocks: u64 = plan.units[1..].iter().filter(|u| !u.experts).map(unit).sum();
    let experts: u64 = plan.units.iter().filter(|u| u.experts).map(unit).sum();
    let gathers = if reshard { 2 } else { 1 };
    if n > 1 {
        out.insert("fsdp.all_gather".into(), ga * (globals + gathers * blocks) * n);
        out.insert("fsdp.reduce_scatter".into(), ga * (globals + blocks) * n);
        out.insert("fsdp.all_reduce".into(), 8);
    }
    if ne > 1 && experts > 0 {
        out.insert("expert_fsdp.all_gather".into(), ga * gathers * experts * ne);
        out.insert("expert_fsdp.reduce_scatter".into(), ga * experts * ne);
    }
    if dp_rep > 1 {
        out.insert("dp_rep.all_reduce".into(), globals + blocks + experts);
    }
    if batch > 1 {
        out.insert("batch.all_reduce".into(), 16);
    }
    out
}
