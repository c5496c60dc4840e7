//! Fully sharded data parallelism (ZeRO-3) over the `fsdp` group, and the outer gradient
//! all-reduce over `dp_rep` that makes it HSDP (or plain DP when the `fsdp` degree is 1).
//!
//! Every parameter is cut along dim 0 into `fsdp` equal row blocks (the last padded with
//! zeros), so a rank's piece of each tensor is a rectangular slice of the logical tensor (a
//! hyperslab for checkpoints). Tensors are grouped into units that are gathered together:
//! unit 0 holds the tensors outside the blocks (embedding, final norm, output projection),
//! unit `1 + l` the tensors of block `l`. A unit's shard is one flat buffer, the concatenation
//! of its tensors' row blocks, so one all-gather and one reduce-scatter move a whole unit.
//!
//! Under expert parallelism (`ep > 1`) a rank holds only its `E / ep` experts of each expert
//! block, and cuts them over the smaller `expert_fsdp` group (the `fsdp` ranks that hold the
//! same experts): they form an expert unit of their own per expert block, after the block
//! units, gathered and reduced over that group. The router stays in its block's unit.
//!
//! This file is the plan ([`ShardPlan`]: which rows of which tensor a rank owns, where they
//! lie in its shards). [`params::FsdpParams`] hands the model gathered weights block by block
//! (`model::hooks::WeightSource`) and frees them after use (`reshard_after_forward = true`,
//! ZeRO-3) or keeps them from forward to backward (`false`). [`grads::FsdpGrads`] receives each
//! block's full gradient (`GradSink`), reduce-scatters it over `fsdp` into the rank's shard
//! (summing micro-steps), and `finish_step` all-reduces the shards over `dp_rep`. [`memory`]
//! predicts what they hold and move. With degree 1 the same code holds the whole model and
//! every collective is a no-op. Everything is written over the backend's buffers. Knows
//! nothing of attention or data.

pub mod grads;
pub mod memory;
pub mod params;

use crate::backend::Backend;
use crate::model::params::{param_specs_local, Dims, TpSplit};
use std::ops::Range;

/// One tensor's place in its unit's shard.
#[derive(Clone, Debug)]
pub struct TensorShard {
    pub name: String,
    /// Index in `param_specs` order.
    pub spec_index: usize,
    pub rows: usize,
    pub cols: usize,
    /// Rows per rank: `ceil(rows / degree)`; the last rank's block is padded.
    pub rows_per_rank: usize,
    /// Offset of this tensor's block in the unit's flat shard.
    pub offset: usize,
    pub decayed: bool,
    /// Held whole by every tp rank (norm weights): counted once in the global norm.
    pub tp_replicated: bool,
    /// Acts on this tp rank's heads only (`q_norm`, `k_norm`): its gradient is a partial sum
    /// over tp whether or not the sequence is split.
    pub per_head: bool,
    /// The last pipeline stage's copy of a tied `embed_tokens` (the first stage's is the
    /// one counted in the norm and written to checkpoints).
    pub tied_copy: bool,
}

impl TensorShard {
    pub fn shard_len(&self) -> usize {
        self.rows_per_rank * self.cols
    }

    /// The rows of the logical tensor that `fsdp` rank `rank` owns (empty past the end).
    pub fn owned_rows(&self, rank: usize) -> Range<usize> {
        let start = (rank * self.rows_per_rank).min(self.rows);
        start..((rank + 1) * self.rows_per_rank).min(self.rows)
    }
}

/// Tensors gathered and reduced together.
#[derive(Clone, Debug)]
pub struct Unit {
    pub tensors: Vec<TensorShard>,
    pub shard_len: usize,
    /// An expert unit: cut over `expert_fsdp`, not `fsdp`.
    pub experts: bool,
}

/// How every tensor of the model is cut across an `fsdp` group of `degree` ranks (and the
/// experts, under expert parallelism, across an `expert_fsdp` group of `expert_degree`).
#[derive(Clone, Debug)]
pub struct ShardPlan {
    pub units: Vec<Unit>,
    pub degree: usize,
    pub rank: usize,
    pub expert_degree: usize,
    pub expert_rank: usize,
    /// Per block this rank holds: its expert unit, under expert parallelism.
    pub expert_units: Vec<Option<usize>>,
}

impl ShardPlan {
    /// The plan for this tp rank's tensors (`m`) over an fsdp group of `degree` ranks, without
    /// expert parallelism.
    pub fn new(m: &Dims, degree: usize, rank: usize) -> ShardPlan {
        ShardPlan::with_experts(m, (degree, rank), (degree, rank))
    }

    /// The plan over an fsdp group `(degree, rank)` whose experts, under expert parallelism
    /// (`m`'s `ep > 1`), are cut over an expert_fsdp group `(degree, rank)`.
    pub fn with_experts(m: &Dims, (degree, rank): (usize, usize), (expert_degree, expert_rank): (usize, usize)) -> ShardPlan {
        let ep = m.moe.as_ref().map_or(1, |e| e.ep);
        let mut units: Vec<Unit> = (0..=m.layers).map(|_| Unit { tensors: vec![], shard_len: 0, experts: false }).collect();
        let mut expert_units = vec![None; m.layers];
        for (i, spec) in param_specs_local(m).into_iter().enumerate() {
            let block = spec
                .name
                .strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|l| l.parse::<usize>().ok())
                // Block names carry the global index; units follow the order this rank holds them.
                .map(|l| m.layer_ids.iter().position(|&id| id == l).expect("a block this rank holds"));
            let unit = match block {
                None => 0,
                Some(b) if ep > 1 && spec.name.contains(".mlp.experts.") => *expert_units[b].get_or_insert_with(|| {
                    units.push(Unit { tensors: vec![], shard_len: 0, experts: true });
                    units.len() - 1
                }),
                Some(b) => 1 + b,
            };
            let degree = if units[unit].experts { expert_degree } else { degree };
            let rows = spec.shape[0];
            let cols = spec.shape.get(1).copied().unwrap_or(1);
            let rows_per_rank = rows.div_ceil(degree);
            let u = &mut units[unit];
            let t = TensorShard {
                name: spec.name.clone(),
                spec_index: i,
                rows,
                cols,
                rows_per_rank,
                offset: u.shard_len,
                decayed: spec.decayed(),
                tp_replicated: spec.split == TpSplit::Replicated,
                per_head: spec.per_head,
                tied_copy: spec.name == "model.embed_tokens.weight" && !m.embed,
            };
            u.shard_len += t.shard_len();
            u.tensors.push(t);
        }
        ShardPlan { units, degree, rank, expert_degree, expert_rank, expert_units }
    }

    /// The ranks unit `unit` is cut over.
    pub fn unit_degree(&self, unit: usize) -> usize {
        if self.units[unit].experts {
            self.expert_degree
        } else {
            self.degree
        }
    }

    /// This rank's place among them.
    pub fn unit_rank(&self, unit: usize) -> usize {
        if self.units[unit].experts {
            self.expert_rank
        } else {
            self.rank
        }
    }

    /// Units gathered through a buffer (those cut over more than one rank).
    fn communicated(&self) -> impl Iterator<Item = (usize, &Unit)> + '_ {
        self.units.iter().enumerate().filter(|&(u, _)| self.unit_degree(u) > 1)
    }

    /// Elements of block `l`'s tensors held whole (its expert unit included).
    pub fn block_elements(&self, l: usize) -> usize {
        self.unit_elements(l + 1) + self.expert_units[l].map_or(0, |u| self.unit_elements(u))
    }

    /// AdamW slots: one per tensor shard, in unit order.
    pub fn optimizer_slots(&self) -> Vec<(usize, bool)> {
        self.units.iter().flat_map(|u| u.tensors.iter().map(|t| (t.shard_len(), t.decayed))).collect()
    }

    /// Elements this rank stores per copy of the model state (shards, padding included).
    pub fn shard_elements(&self) -> usize {
        self.units.iter().map(|u| u.shard_len).sum()
    }

    /// The largest shard of a unit cut over more than one rank: the send buffer.
    pub fn max_shard_len(&self) -> usize {
        self.communicated().map(|(_, u)| u.shard_len).max().unwrap_or(0)
    }

    /// The largest gathered unit (its degree's shards, padding included): the gather buffer.
    pub fn max_gathered_len(&self) -> usize {
        self.communicated().map(|(i, u)| u.shard_len * self.unit_degree(i)).max().unwrap_or(0)
    }

    /// Elements of unit `unit`'s tensors held whole (no padding).
    pub fn unit_elements(&self, unit: usize) -> usize {
        self.units[unit].tensors.iter().map(|t| t.rows * t.cols).sum()
    }

    /// Block `l`'s tensors split between its units: `(block unit, expert unit)`, the latter
    /// empty without one (the expert tensors come last in a block's order).
    pub fn split_block<'a, V>(&self, l: usize, mut tensors: Vec<&'a V>) -> (Vec<&'a V>, Vec<&'a V>) {
        let experts = tensors.split_off(self.units[l + 1].tensors.len());
        (tensors, experts)
    }

    /// [`ShardPlan::split_block`], writable.
    pub fn split_block_mut<'a, V>(&self, l: usize, mut tensors: Vec<&'a mut V>) -> (Vec<&'a mut V>, Vec<&'a mut V>) {
        let experts = tensors.split_off(self.units[l + 1].tensors.len());
        (tensors, experts)
    }

    /// Copies the rows rank `rank` owns of every tensor of `unit` from whole tensors `full`
    /// into a flat shard at `dst[at..]` (zero padding).
    pub(super) fn pack<B: Backend<f32>>(&self, be: &B, unit: usize, full: &[&B::Buf], rank: usize, dst: &mut B::Buf, at: usize) {
        for (t, src) in self.units[unit].tensors.iter().zip(full) {
            let rows = t.owned_rows(rank);
            let n = rows.len() * t.cols;
            let start = at + t.offset;
            be.copy_range(dst, start, src, rows.start * t.cols..rows.start * t.cols + n);
            be.fill_range(dst, start + n..start + t.shard_len(), 0.0);
        }
    }

    /// Copies a gathered unit (`[degree][shard_len]`) into whole tensors.
    pub(super) fn unpack<B: Backend<f32>>(&self, be: &B, unit: usize, gathered: &B::Buf, full: &mut [&mut B::Buf]) {
        let u = &self.units[unit];
        for (t, dst) in u.tensors.iter().zip(full.iter_mut()) {
            for r in 0..self.unit_degree(unit) {
                let rows = t.owned_rows(r);
                let from = r * u.shard_len + t.offset;
                be.copy_range(dst, rows.start * t.cols, gathered, from..from + rows.len() * t.cols);
            }
        }
    }

    /// Splits this rank's unit shards (`[unit][shard_len]`, host slices) into the shard of
    /// every tensor, in slot order (what a checkpoint saves and AdamW updates).
    pub fn slots<'a>(&self, units: Vec<&'a [f32]>) -> Vec<&'a [f32]> {
        let tensors = self.units.iter().zip(units).flat_map(|(unit, shard)| unit.tensors.iter().map(move |t| (t, shard)));
        tensors.map(|(t, shard)| &shard[t.offset..][..t.shard_len()]).collect()
    }

    /// [`ShardPlan::slots`], writable (each unit's tensors lie one after another from offset 0).
    pub fn slots_mut<'a>(&self, units: Vec<&'a mut [f32]>) -> Vec<&'a mut [f32]> {
        let mut out = vec![];
        for (unit, shard) in self.units.iter().zip(units) {
            let mut rest: &mut [f32] = shard;
            for t in &unit.tensors {
                let (a, b) = std::mem::take(&mut rest).split_at_mut(t.shard_len());
                out.push(a);
                rest = b;
            }
        }
        out
    }

    /// The element range of every tensor's shard in its unit's shard, with its unit, in slot
    /// order.
    pub fn slot_ranges(&self) -> impl Iterator<Item = (usize, &TensorShard, Range<usize>)> + '_ {
        self.units.iter().enumerate().flat_map(|(u, unit)| unit.tensors.iter().map(move |t| (u, t, t.offset..t.offset + t.shard_len())))
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::config::ModelCfg;
    use crate::model::params::{ModelParams, Params};

    /// The whole tensors of a unit of a model held whole, in unit order.
    fn unit_tensors<V>(p: &Params<V>, unit: usize) -> Vec<&V> {
        if unit == 0 {
            let mut v = vec![&p.embed_tokens, &p.norm];
            if let Some(h) = &p.lm_head {
                v.push(h);
            }
            v
        } else {
            p.layers[unit - 1].tensors().into_iter().collect()
        }
    }

    #[test]
    fn shards_tile_every_tensor_exactly() {
        let cfg = ModelCfg { vocab_size: 257, ..ModelCfg::default() };
        let m = Dims::full(&cfg);
        for degree in [1, 2, 3, 4, 7] {
            let plan = ShardPlan::new(&m, degree, 0);
            let specs = param_specs_local(&m);
            let mut seen = vec![0usize; specs.len()];
            for u in &plan.units {
                for t in &u.tensors {
                    let rows: usize = (0..degree).map(|r| t.owned_rows(r).len()).sum();
                    assert_eq!(rows, t.rows, "{} degree {degree}", t.name);
                    assert_eq!(t.rows * t.cols, specs[t.spec_index].numel());
                    seen[t.spec_index] += 1;
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "every tensor in exactly one unit");
        }
    }

    #[test]
    fn pack_then_unpack_round_trips() {
        let cfg = ModelCfg { vocab_size: 37, d_model: 16, n_heads: 4, n_kv_heads: 2, ffn_hidden: 24, ..ModelCfg::default() };
        let full = ModelParams::<f32>::init(&cfg, 9);
        let degree = 3;
        let be = Cpu::default();
        let plans: Vec<ShardPlan> = (0..degree).map(|r| ShardPlan::new(&Dims::full(&cfg), degree, r)).collect();
        for unit in 0..plans[0].units.len() {
            let len = plans[0].units[unit].shard_len;
            let mut gathered = vec![f32::NAN; len * degree];
            for (r, plan) in plans.iter().enumerate() {
                plan.pack(&be, unit, &unit_tensors(&full, unit), r, &mut gathered, r * len);
            }
            let mut back = ModelParams::<f32>::zeros(&cfg);
            let mut dst =
                if unit == 0 { back.globals_mut(&Dims::full(&cfg)) } else { back.layers[unit - 1].tensors_mut().into_iter().collect() };
            plans[0].unpack(&be, unit, &gathered, &mut dst);
            let want = unit_tensors(&full, unit);
            let got = unit_tensors(&back, unit);
            assert_eq!(want, got, "unit {unit}");
        }
    }
}
