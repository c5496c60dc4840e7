//! The rank's gradient shards and the whole-tensor scratch the model writes into: FSDP's
//! `GradSink`. Each block's gradient is reduce-scattered over `fsdp` into the rank's shard as
//! soon as the model hands it over (left in flight over the next block's backward), summed
//! over the micro-steps of the step, and in the step's last micro-step all-reduced over
//! `dp_rep` unit by unit (HSDP's outer reduction, or DP's all-reduce when `fsdp` has degree 1).

use super::params::Groups;
use super::ShardPlan;
use crate::backend::Backend;
use crate::model::hooks::{GlobalsMut, GradSink};
use crate::model::params::{Dims, Layer, Params};
use crate::parallel::collective::Collective;
use crate::parallel::comm::Ticket;

/// The rank's gradient shards, and the whole-tensor scratch the model writes into.
pub struct FsdpGrads<'g, B: Backend<f32>> {
    plan: ShardPlan,
    m: Dims,
    be: B,
    fsdp: &'g dyn Collective<B::Buf>,
    /// Reduces the expert units (under expert parallelism).
    expert_fsdp: &'g dyn Collective<B::Buf>,
    dp_rep: &'g dyn Collective<B::Buf>,
    /// `[unit][shard_len]`: summed over the micro-steps of the step, then over `dp_rep`.
    pub shards: Vec<B::Buf>,
    /// Whole-tensor gradients of the global tensors and of the block in backward (lent out
    /// while a unit is reduced).
    globals: Option<Params<B::Buf>>,
    block: Option<Layer<B::Buf>>,
    /// The block gradient of the other kind (dense or mixture of experts), where the model
    /// has both.
    other_block: Option<Layer<B::Buf>>,
    current: Option<usize>,
    pack_buf: B::Buf,
    recv_buf: B::Buf,
    /// True in the step's last micro-step: each unit's outer all-reduce starts as soon as its
    /// reduce-scatter is done, while backward continues on earlier blocks.
    last_micro: bool,
    /// Leave each reduction in flight while backward goes on (reduce-scatter over `fsdp`,
    /// then in the last micro-step the all-reduce over `dp_rep`); `false` blocks on each.
    pub overlap: bool,
    /// The reduce-scatter in flight (one at a time: it owns `pack_buf` and `recv_buf`).
    /// With its unit, and whether it is of the step's last micro-step.
    reduce_scatter: Option<(usize, bool, Ticket)>,
    /// Per unit: the `dp_rep` all-reduce in flight, and the spare buffer it will return.
    in_flight: Vec<Option<Ticket>>,
    spare: Vec<B::Buf>,
}

impl<'g, B: Backend<f32> + Clone> FsdpGrads<'g, B> {
    pub fn new(be: &B, m: &Dims, (fsdp, expert_fsdp): Groups<'g, B::Buf>, dp_rep: &'g dyn Collective<B::Buf>) -> Self {
        let plan = ShardPlan::with_experts(m, (fsdp.degree(), fsdp.rank()), (expert_fsdp.degree(), expert_fsdp.rank()));
        let _for = crate::backend::allocating("gradient shards and whole-tensor gradient scratch", None);
        let shards = plan.units.iter().map(|u| be.zeros(u.shard_len)).collect();
        let scratch = |len: usize| {
            let mut b = be.zeros(if plan.degree > 1 { len } else { 0 });
            be.resize(&mut b, 0);
            b
        };
        FsdpGrads {
            m: m.clone(),
            be: be.clone(),
            fsdp,
            expert_fsdp,
            dp_rep,
            shards,
            globals: Some(Params::alloc(&Dims { layers: 0, layer_ids: vec![], ..m.clone() }, |n| be.zeros(n))),
            block: m.layer_ids.first().map(|&i| Layer::alloc(m, i, |n| be.zeros(n))),
            other_block: None,
            current: None,
            pack_buf: scratch(plan.max_gathered_len()),
            recv_buf: scratch(plan.max_shard_len()),
            last_micro: false,
            overlap: true,
            reduce_scatter: None,
            in_flight: plan.units.iter().map(|_| None).collect(),
            spare: plan.units.iter().map(|_| B::Buf::default()).collect(),
            plan,
        }
    }

    /// Declares whether the coming backward is the step's last micro-step.
    pub fn begin_micro_step(&mut self, last: bool) {
        self.last_micro = last;
    }

    /// Starts unit `unit`'s outer all-reduce (its shard is final for this step).
    fn start_outer_reduce(&mut self, unit: usize) {
        if self.dp_rep.degree() == 1 {
            return;
        }
        assert!(self.in_flight[unit].is_none(), "unit {unit}: outer all-reduce started twice in one step");
        let send = std::mem::take(&mut self.shards[unit]);
        let mut recv = std::mem::take(&mut self.spare[unit]);
        self.be.resize(&mut recv, self.be.len(&send));
        self.in_flight[unit] = Some(self.dp_rep.start_all_reduce_sum(send, recv));
    }

    fn progress(&mut self) {
        for t in self.in_flight.iter().flatten() {
            self.dp_rep.test(t);
        }
    }

    /// Zeroes the shards before the step's first micro-step.
    pub fn zero(&mut self) {
        self.shards.iter_mut().for_each(|s| self.be.fill(s, 0.0));
    }

    /// Reduce-scatters a unit's whole gradient over `fsdp` into its shard (`+=`): conjugate
    /// of the forward all-gather. With `overlap` the reduce-scatter is left in flight while
    /// backward computes the next block, and completed by the next call (or by
    /// [`Self::finish_step`]); without, it completes here.
    fn reduce_unit(&mut self, unit: usize, full: &[&B::Buf]) {
        self.finish_reduce_scatter();
        let len = self.plan.units[unit].shard_len;
        let degree = self.plan.unit_degree(unit);
        if degree == 1 {
            // The whole gradient is this rank's shard: add it in place, no copies.
            for (t, src) in self.plan.units[unit].tensors.iter().zip(full) {
                self.be.add_range(&mut self.shards[unit], t.offset, src, 0..self.be.len(src));
            }
            self.reduced(unit, self.last_micro);
            return;
        }
        let _for = crate::backend::allocating("gradient reduce-scatter buffers of unit", Some(unit));
        let mut send = std::mem::take(&mut self.pack_buf);
        self.be.resize(&mut send, len * degree);
        for r in 0..degree {
            self.plan.pack(&self.be, unit, full, r, &mut send, r * len);
        }
        let mut recv = std::mem::take(&mut self.recv_buf);
        self.be.resize(&mut recv, len);
        let group = self.group_of(unit);
        if self.overlap {
            self.reduce_scatter = Some((unit, self.last_micro, group.start_reduce_scatter_sum(send, recv)));
        } else {
            group.reduce_scatter_sum(&send, &mut recv);
            (self.pack_buf, self.recv_buf) = (send, recv);
            self.add_reduced(unit, self.last_micro);
        }
    }

    /// The group unit `unit` is cut over.
    fn group_of(&self, unit: usize) -> &'g dyn Collective<B::Buf> {
        if self.plan.units[unit].experts {
            self.expert_fsdp
        } else {
            self.fsdp
        }
    }

    /// Completes the reduce-scatter in flight, if any, and adds its block into the shard.
    fn finish_reduce_scatter(&mut self) {
        if let Some((unit, last, t)) = self.reduce_scatter.take() {
            (self.pack_buf, self.recv_buf) = self.group_of(unit).wait(t);
            self.add_reduced(unit, last);
        }
    }

    fn add_reduced(&mut self, unit: usize, last: bool) {
        self.be.add_assign(&mut self.shards[unit], &self.recv_buf);
        self.reduced(unit, last);
    }

    /// Unit `unit`'s shard holds the whole contribution of a micro-step: of the step's last
    /// (`last`, which a reduce-scatter completing later remembers), it is final, and its outer
    /// all-reduce can start.
    fn reduced(&mut self, unit: usize, last: bool) {
        if last && self.overlap {
            self.start_outer_reduce(unit);
        }
    }

    /// After the step's last micro-step: completes the sum of the shards across `dp_rep`
    /// (HSDP's outer reduction, or DP's all-reduce when `fsdp` has degree 1), started bucket
    /// by bucket during that micro-step's backward.
    pub fn finish_step(&mut self) {
        self.finish_reduce_scatter();
        for unit in 0..self.shards.len() {
            if self.in_flight[unit].is_none() && self.dp_rep.degree() > 1 {
                self.start_outer_reduce(unit);
            }
            if let Some(t) = self.in_flight[unit].take() {
                let (send, recv) = self.dp_rep.wait(t);
                self.shards[unit] = recv;
                self.spare[unit] = send;
            }
        }
        self.last_micro = false;
    }

    /// Bytes of gradient scratch: the whole-tensor gradients of the global tensors and one
    /// block, the reduce-scatter's packed input and output (fsdp degree > 1), and the outer
    /// all-reduce's second copy of the shards (dp_rep degree > 1).
    pub fn scratch_bytes(&self) -> usize {
        let len = |t: &B::Buf| self.be.len(t);
        let g = self.globals.as_ref().map_or(0, |g| g.tensors().into_iter().map(len).sum::<usize>());
        let b: usize = self.block.iter().chain(&self.other_block).map(|b| b.tensors().into_iter().map(len).sum::<usize>()).sum();
        let reduce = if self.plan.degree > 1 { self.plan.max_gathered_len() + self.plan.max_shard_len() } else { 0 };
        let outer = if self.dp_rep.degree() > 1 { self.plan.shard_elements() } else { 0 };
        (g + b + reduce + outer) * 4
    }

    /// This rank's part of the squared global norm (padding is zero and adds nothing). A
    /// tensor every tp rank holds whole is counted by tp rank 0 only (`count_replicated`), a
    /// tied embedding by the first pipeline stage only.
    pub fn local_sq_sum(&self, count_replicated: bool) -> f64 {
        let mut sum = 0.0;
        for (u, t, range) in self.plan.slot_ranges() {
            if (count_replicated || !t.tp_replicated) && !t.tied_copy {
                sum += self.be.sum_sq(&self.shards[u], range);
            }
        }
        sum
    }

    /// Sums over `tp` the gradients of the replicated tensors that each tp rank computed only
    /// in part: every one under sequence parallelism (each rank saw only its rows of the
    /// sequence), and the per-head norms always (each rank saw only its heads).
    pub fn sum_partial_over_tp(&mut self, tp: &dyn Collective<B::Buf>, sequence_parallel: bool) {
        if tp.degree() == 1 {
            return;
        }
        for (u, t, range) in self.plan.slot_ranges() {
            if t.tp_replicated && (sequence_parallel || t.per_head) {
                tp.all_reduce_sum_range(&mut self.shards[u], range);
            }
        }
    }

    /// The model piece whose gradients these are.
    pub fn dims(&self) -> &Dims {
        &self.m
    }

    /// The backend the shards live on.
    pub fn backend(&self) -> &B {
        &self.be
    }

    /// The unit of the shard holding this rank's part of tensor `name`, and where it lies there.
    pub fn tensor_range(&self, name: &str) -> Option<(usize, std::ops::Range<usize>)> {
        self.plan.slot_ranges().find(|(_, t, _)| t.name == name).map(|(u, _, range)| (u, range))
    }

    pub fn scale(&mut self, coef: f64) {
        if coef != 1.0 {
            let c = coef as f32;
            self.shards.iter_mut().for_each(|s| self.be.scale(s, c));
        }
    }
}

impl<B: Backend<f32> + Clone> GradSink<B::Buf> for FsdpGrads<'_, B> {
    fn globals_mut(&mut self) -> GlobalsMut<'_, B::Buf> {
        let g = self.globals.as_mut().expect("not lent out");
        GlobalsMut { embed_tokens: &mut g.embed_tokens, norm: &mut g.norm, lm_head: g.lm_head.as_mut() }
    }

    fn block_mut(&mut self, l: usize) -> &mut Layer<B::Buf> {
        let id = self.m.layer_ids[l];
        if !self.block.as_ref().expect("not lent out").fits(&self.m, id) {
            let other = self.other_block.take().unwrap_or_else(|| Layer::alloc(&self.m, id, |n| self.be.zeros(n)));
            self.other_block = self.block.replace(other);
            self.current = None;
        }
        let block = self.block.as_mut().expect("not lent out");
        if self.current != Some(l) {
            block.tensors_mut().into_iter().for_each(|t| self.be.fill(t, 0.0));
            self.current = Some(l);
        }
        block
    }

    fn block_done(&mut self, l: usize) {
        let block = self.block.take().expect("not lent out");
        let (dense, experts) = self.plan.split_block(l, block.tensors());
        self.reduce_unit(l + 1, &dense);
        if let Some(u) = self.plan.expert_units[l] {
            self.reduce_unit(u, &experts);
        }
        self.block = Some(block);
        self.current = None;
        self.progress();
    }

    fn globals_done(&mut self) {
        let mut g = self.globals.take().expect("not lent out");
        self.reduce_unit(0, &g.globals(&self.m));
        g.globals_mut(&self.m).into_iter().for_each(|t| self.be.fill(t, 0.0));
        self.globals = Some(g);
    }
}
