//! The model state of one rank on its backend: the parameter and gradient shards (FSDP's; the
//! whole model at degree 1), the AdamW moments beside them in the same layout, the update
//! rule, and where each shard lies in the logical tensors (what a checkpoint reads and
//! writes). Host access — loading, saving, checks of the values — goes through
//! `backend::with_host*`, so it is direct on the host and staged through copies on a device.

use crate::backend::{with_host, with_host_mut, Backend};
use crate::config::OptimCfg;
use crate::io::checkpoint::blocks::{shard_blocks, ShardBlock};
use crate::io::checkpoint::SnapshotSource;
use crate::model::params::Dims;
use crate::optim::AdamRule;
use crate::parallel::collective::MeshCollectives;
use crate::parallel::fsdp::grads::FsdpGrads;
use crate::parallel::fsdp::params::FsdpParams;
use crate::parallel::fsdp::ShardPlan;

/// A rank's parameters and AdamW moments as a checkpoint's snapshot reads them
/// ([`ModelState::snapshot_source`]).
pub struct StateSource<'s, B: Backend<f32>> {
    be: &'s B,
    /// Per kind (`io::checkpoint::KINDS`), the unit buffers.
    kinds: [&'s [B::Buf]; 3],
    /// Per tensor of the file, its unit and where its block starts there.
    places: Vec<Option<(usize, usize)>>,
}

impl<B: Backend<f32>> SnapshotSource for StateSource<'_, B> {
    fn copy(&self, kind: usize, tensor: usize, dst: &mut [f32]) {
        match self.places[tensor] {
            Some((unit, start)) => self.be.download_range(&self.kinds[kind][unit], start..start + dst.len(), dst),
            None => assert!(dst.is_empty(), "tensor {tensor}: a block this rank does not hold"),
        }
    }

    fn pin(&self, buf: &mut [f32]) -> bool {
        self.be.pin_host(buf)
    }

    fn unpin(&self, buf: &mut [f32]) {
        self.be.unpin_host(buf)
    }
}

/// Where a rank's model state starts from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// The seeded initial model (`docs/model.md`).
    Seeded(u64),
    /// Zeros, to be filled by a load (a checkpoint or a Hugging Face folder).
    Empty,
}

/// One rank's parameters, gradients and AdamW state.
pub struct ModelState<'g, B: Backend<f32>> {
    pub params: FsdpParams<'g, B>,
    pub grads: FsdpGrads<'g, B>,
    /// The AdamW moments, `[unit][shard_len]` like the shards.
    exp_avg: Vec<B::Buf>,
    exp_avg_sq: Vec<B::Buf>,
    pub rule: AdamRule,
    /// Each slot's block of its logical tensor, in slot order.
    pub blocks: Vec<ShardBlock>,
    /// Balancing without an auxiliary loss (`[model] router_bias_update_rate > 0`): each expert
    /// block's selection bias `[E]`, the same on every rank; empty otherwise.
    pub router_bias: Vec<Vec<f64>>,
    /// `[model] router_bias_update_rate`.
    bias_rate: f64,
    be: B,
}

impl<'g, B: Backend<f32> + Clone> ModelState<'g, B> {
    /// The state of this tp rank's piece `dims`, sharded over the `fsdp` group, reduced over
    /// `dp_rep`. `replica_leader`: this rank is the `dp_rep` replica that writes checkpoints.
    pub fn new(
        be: &B,
        dims: &Dims,
        comms: &MeshCollectives<'g, B::Buf>,
        start: Start,
        (reshard_after_forward, overlap): (bool, bool),
        optim: &OptimCfg,
        replica_leader: bool,
    ) -> Self {
        let mut params = match start {
            Start::Seeded(seed) => FsdpParams::init(be, dims, seed, (comms.fsdp, comms.expert_fsdp), reshard_after_forward),
            Start::Empty => FsdpParams::zeros(be, dims, (comms.fsdp, comms.expert_fsdp), reshard_after_forward),
        };
        params.overlap = overlap;
        let mut grads = FsdpGrads::new(be, dims, (comms.fsdp, comms.expert_fsdp), comms.dp_rep);
        grads.overlap = overlap;
        let _for = crate::backend::allocating("AdamW moments", None);
        let moments = || params.plan.units.iter().map(|u| be.zeros(u.shard_len)).collect();
        ModelState {
            exp_avg: moments(),
            exp_avg_sq: moments(),
            rule: AdamRule::new(optim),
            blocks: shard_blocks(&params.plan, dims, replica_leader),
            router_bias: match &dims.moe {
                Some(e) if e.bias_rate > 0.0 => vec![vec![0.0; e.router.experts]; dims.moe_layers()],
                _ => vec![],
            },
            bias_rate: dims.moe.as_ref().map_or(0.0, |e| e.bias_rate),
            params,
            grads,
            be: be.clone(),
        }
    }

    pub fn backend(&self) -> &B {
        &self.be
    }

    /// After an update: every expert block's bias moves towards an even load by the step's
    /// global choices `[expert blocks × E]` (`router::update_bias`; integers, so every rank
    /// makes the same move).
    pub fn balance_experts(&mut self, counts: &[u64]) {
        if self.router_bias.is_empty() {
            return;
        }
        let experts = self.router_bias[0].len();
        for (bias, c) in self.router_bias.iter_mut().zip(counts.chunks(experts)) {
            crate::model::router::update_bias(bias, c, self.bias_rate);
        }
    }

    pub fn plan(&self) -> &ShardPlan {
        &self.params.plan
    }

    /// Bytes of one copy of this rank's shards (parameters, gradients and each moment alike).
    pub fn shard_bytes(&self) -> usize {
        self.plan().shard_elements() * 4
    }

    /// Runs `f` on the slots' blocks and host slices of this rank's parameter and moment
    /// shards, slot by slot, in the order of [`crate::io::checkpoint::KINDS`]; what `f` writes
    /// is kept.
    pub fn with_host_state_mut<R>(&mut self, f: impl FnOnce(&[ShardBlock], [Vec<&mut [f32]>; 3]) -> R) -> R {
        let (plan, blocks) = (&self.params.plan, &self.blocks);
        let units = plan.units.len();
        let bufs = self.params.shards.iter_mut().chain(self.exp_avg.iter_mut()).chain(self.exp_avg_sq.iter_mut()).collect();
        with_host_mut(&self.be, bufs, |mut all| {
            let v = all.split_off(2 * units);
            let m = all.split_off(units);
            f(blocks, [plan.slots_mut(all), plan.slots_mut(m), plan.slots_mut(v)])
        })
    }

    /// What a checkpoint's snapshot copies from: tensor `i` of the file is slot `own[i]` (none:
    /// a tensor this rank holds no block of), copied straight out of its unit's buffer, so a
    /// device copies each block once, into the snapshot's page-locked buffer.
    pub fn snapshot_source<'s>(&'s self, own: &[Option<usize>]) -> StateSource<'s, B> {
        let ranges: Vec<_> = self.params.plan.slot_ranges().map(|(u, _, range)| (u, range.start)).collect();
        StateSource {
            be: &self.be,
            kinds: [&self.params.shards, &self.exp_avg, &self.exp_avg_sq],
            places: own.iter().map(|s| s.map(|s| ranges[s])).collect(),
        }
    }

    /// Clips the gradients by `coef` and takes one AdamW step with learning rate `lr` on every
    /// shard this rank owns.
    pub fn update(&mut self, coef: f64, lr: f64) {
        self.grads.scale(coef);
        self.rule.advance();
        for (u, t, range) in self.params.plan.slot_ranges() {
            let step = self.rule.coefficients(lr, t.decayed);
            let (m, v) = (&mut self.exp_avg[u], &mut self.exp_avg_sq[u]);
            self.be.adamw(&mut self.params.shards[u], m, v, &self.grads.shards[u], range, &step);
        }
    }

    /// The first gradient element on this rank that is NaN or infinite: its slot, its index in
    /// the slot's shard, and its value.
    pub fn first_nonfinite_grad(&self) -> Option<(usize, usize, f32)> {
        let bufs: Vec<&B::Buf> = self.grads.shards.iter().collect();
        with_host(&self.be, &bufs, |units| {
            let slots = self.params.plan.slots(units);
            slots.iter().enumerate().find_map(|(s, g)| g.iter().position(|x| !x.is_finite()).map(|i| (s, i, g[i])))
        })
    }

    /// Sets the first gradient element this rank holds of slot `slot` to NaN (a debug fault);
    /// false when this rank holds none of it.
    pub fn poison_grad(&mut self, slot: usize) -> bool {
        let plan = &self.params.plan;
        with_host_mut(&self.be, self.grads.shards.iter_mut().collect(), |units| match plan.slots_mut(units).swap_remove(slot).first_mut() {
            Some(x) => {
                *x = f32::NAN;
                true
            }
            None => false,
        })
    }

    /// A fingerprint of the bits of the tensors every tp rank holds whole (norm weights): equal
    /// on every tp rank exactly when those tensors are bit-identical.
    pub fn replicated_fingerprint(&self) -> u64 {
        let plan = &self.params.plan;
        let bufs: Vec<&B::Buf> = self.params.shards.iter().collect();
        with_host(&self.be, &bufs, |units| {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for (u, t, range) in plan.slot_ranges() {
                if t.tp_replicated {
                    for x in &units[u][range] {
                        h = (h ^ x.to_bits() as u64).wrapping_mul(0x0000_0100_0000_01b3);
                    }
                }
            }
            h
        })
    }
}
