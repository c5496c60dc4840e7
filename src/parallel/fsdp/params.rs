//! The rank's parameter shards and the gathered copies the model reads: FSDP's
//! `WeightSource`. Each block is gathered (all-gather over `fsdp`) right before the model uses
//! it, the next one prefetched while it computes, and freed after use (ZeRO-3) or, with
//! `reshard_after_forward = false`, kept from forward to backward.

use super::ShardPlan;
use crate::backend::{with_host_mut, Backend};
use crate::model::hooks::{Globals, WeightSource};
use crate::model::params::{init_fill, param_specs_local, Dims, Layer, Params};
use crate::parallel::collective::Collective;
use crate::parallel::comm::Ticket;

/// The collectives of the parameter shards: `(fsdp, expert_fsdp)`.
pub type Groups<'g, V> = (&'g dyn Collective<V>, &'g dyn Collective<V>);

/// Which pass the model is in: decides whether a block is freed after use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Backward,
    /// A forward with no backward to follow (the held-out loss): every block is freed after use.
    Evaluate,
}

/// The rank's parameter shards and the gathered copies the model reads.
pub struct FsdpParams<'g, B: Backend<f32>> {
    pub plan: ShardPlan,
    be: B,
    fsdp: &'g dyn Collective<B::Buf>,
    /// Gathers the expert units (under expert parallelism).
    expert_fsdp: &'g dyn Collective<B::Buf>,
    m: Dims,
    /// `[unit][shard_len]`: what this rank owns and updates.
    pub shards: Vec<B::Buf>,
    pub reshard_after_forward: bool,
    /// Prefetch the next block's all-gather while the current one computes.
    pub overlap: bool,
    pass: Pass,
    /// Unit 0 gathered (only its global tensors are allocated), during a micro-step.
    globals: Option<Params<B::Buf>>,
    /// The global tensors' buffers between micro-steps, reused so no step allocates them.
    spare_globals: Option<Params<B::Buf>>,
    blocks: Vec<Option<Layer<B::Buf>>>,
    spare: Vec<Layer<B::Buf>>,
    gather_buf: B::Buf,
    /// The next block's all-gather, started while the current block computes.
    prefetch: Option<(usize, Ticket)>,
    send_buf: B::Buf,
    gathered_bytes: usize,
    /// High-water mark of gathered (unsharded) parameter bytes.
    pub gathered_peak_bytes: usize,
}

impl<'g, B: Backend<f32> + Clone> FsdpParams<'g, B> {
    /// Zero shards, to be filled by a load (a checkpoint, or a Hugging Face model's slices).
    pub fn zeros(be: &B, m: &Dims, (fsdp, expert_fsdp): Groups<'g, B::Buf>, reshard_after_forward: bool) -> Self {
        let plan = ShardPlan::with_experts(m, (fsdp.degree(), fsdp.rank()), (expert_fsdp.degree(), expert_fsdp.rank()));
        let _for = crate::backend::allocating("parameter shards and FSDP gather buffers", None);
        let shards = plan.units.iter().map(|u| be.zeros(u.shard_len)).collect();
        // Sized once for the largest unit, so no collective ever reallocates them; none with
        // fsdp degree 1, where a unit's shard is the whole unit.
        let scratch = |len: usize| {
            let mut b = be.zeros(if plan.degree > 1 { len } else { 0 });
            be.resize(&mut b, 0);
            b
        };
        FsdpParams {
            be: be.clone(),
            fsdp,
            expert_fsdp,
            m: m.clone(),
            shards,
            reshard_after_forward,
            overlap: true,
            pass: Pass::Forward,
            globals: None,
            spare_globals: None,
            blocks: (0..m.layers).map(|_| None).collect(),
            spare: vec![],
            gather_buf: scratch(plan.max_gathered_len()),
            prefetch: None,
            send_buf: scratch(plan.max_shard_len()),
            gathered_bytes: 0,
            gathered_peak_bytes: 0,
            plan,
        }
    }

    /// The seeded initial model; each rank generates only the rows it owns.
    pub fn init(be: &B, m: &Dims, seed: u64, groups: Groups<'g, B::Buf>, reshard_after_forward: bool) -> Self {
        let mut p = Self::zeros(be, m, groups, reshard_after_forward);
        let specs = param_specs_local(m);
        let plan = &p.plan;
        with_host_mut(be, p.shards.iter_mut().collect(), |shards| {
            for (u, (unit, shard)) in plan.units.iter().zip(shards).enumerate() {
                for t in &unit.tensors {
                    let rows = t.owned_rows(plan.unit_rank(u));
                    let dst = &mut shard[t.offset..][..rows.len() * t.cols];
                    init_fill(seed, &specs[t.spec_index], m.n_layers, rows.start * t.cols, dst);
                }
            }
        });
        p
    }

    /// The sizes of the tensors this rank holds (its tp piece of its pipeline stages).
    pub fn dims(&self) -> &Dims {
        &self.m
    }

    fn gather_unit(&mut self, unit: usize) {
        let len = self.plan.units[unit].shard_len;
        let _for = crate::backend::allocating("gathered parameters of unit", Some(unit));
        self.be.resize(&mut self.gather_buf, len * self.plan.unit_degree(unit));
        let group = if self.plan.units[unit].experts { self.expert_fsdp } else { self.fsdp };
        group.all_gather(&self.shards[unit], &mut self.gather_buf);
    }

    /// Block `l`'s expert unit, where it has one, into its expert tensors `experts`: gathered
    /// (blocking) after the block's own unit was unpacked, as they share the gather buffer.
    fn unpack_experts(&mut self, l: usize, experts: &mut [&mut B::Buf]) {
        if let Some(u) = self.plan.expert_units[l] {
            if self.plan.expert_degree > 1 {
                self.gather_unit(u);
            }
            self.plan.unpack(&self.be, u, self.gathered(u), experts);
        }
    }

    /// Unit `unit` whole in packed order, once [`Self::gather_unit`] or a prefetch has filled
    /// `gather_buf`; with degree 1 the shard itself (nothing to gather, nothing copied).
    fn gathered(&self, unit: usize) -> &B::Buf {
        if self.plan.unit_degree(unit) == 1 {
            &self.shards[unit]
        } else {
            &self.gather_buf
        }
    }

    /// Starts gathering block `l` in the background, unless it is there or on its way.
    fn start_prefetch(&mut self, l: usize) {
        let alone = self.plan.degree == 1;
        if alone || !self.overlap || l >= self.blocks.len() || self.blocks[l].is_some() || self.prefetch.is_some() {
            return;
        }
        let unit = l + 1;
        let _for = crate::backend::allocating("prefetched parameters of unit", Some(unit));
        let mut send = std::mem::take(&mut self.send_buf);
        self.be.resize(&mut send, self.plan.units[unit].shard_len);
        self.be.copy(&mut send, &self.shards[unit]);
        let mut recv = std::mem::take(&mut self.gather_buf);
        self.be.resize(&mut recv, self.plan.units[unit].shard_len * self.plan.degree);
        self.prefetch = Some((l, self.fsdp.start_all_gather(send, recv)));
    }

    /// Lets a prefetch in flight progress (MPI moves non-blocking collectives only inside MPI
    /// calls).
    fn progress(&mut self) {
        if let Some((_, t)) = self.prefetch.as_ref() {
            self.fsdp.test(t);
        }
    }

    /// Completes the prefetch of block `l` into `gather_buf`; false if none was in flight.
    fn finish_prefetch(&mut self, l: usize) -> bool {
        match self.prefetch.take() {
            Some((pl, t)) if pl == l => {
                (self.send_buf, self.gather_buf) = self.fsdp.wait(t);
                true
            }
            other => {
                self.prefetch = other;
                false
            }
        }
    }

    /// Tracks unpacked (gathered) bytes; the peak also counts the gather buffers, which hold a
    /// prefetched block while another is in use (the send buffer only with overlap).
    fn track(&mut self, delta: isize) {
        self.gathered_bytes = (self.gathered_bytes as isize + delta) as usize;
        let plan = &self.plan;
        let buffers = if plan.degree > 1 { 4 * (plan.max_gathered_len() + if self.overlap { plan.max_shard_len() } else { 0 }) } else { 0 };
        self.gathered_peak_bytes = self.gathered_peak_bytes.max(self.gathered_bytes + buffers);
    }

    /// Gathers the global tensors for a micro-step and enters the forward pass.
    pub fn begin_micro_step(&mut self) {
        self.pass = Pass::Forward;
        self.ensure_globals();
    }

    /// Gathers the global tensors unless they are there (a pipeline may run several passes
    /// between two [`Self::end_micro_step`]s, or a backward right after one).
    fn ensure_globals(&mut self) {
        if self.globals.is_none() {
            let mut g = match self.spare_globals.take() {
                Some(g) => g,
                None => Params::alloc(&Dims { layers: 0, layer_ids: vec![], ..self.m.clone() }, |n| self.be.zeros(n)),
            };
            if self.plan.degree > 1 {
                self.gather_unit(0);
            }
            self.plan.unpack(&self.be, 0, self.gathered(0), &mut g.globals_mut(&self.m));
            self.track((self.plan.unit_elements(0) * 4) as isize);
            self.globals = Some(g);
        }
    }

    /// Gathers the global tensors for a forward pass without a backward (evaluation); end it
    /// with [`Self::end_micro_step`].
    pub fn begin_evaluation(&mut self) {
        self.pass = Pass::Evaluate;
        self.ensure_globals();
    }

    /// Enters the backward pass (the global tensors gathered).
    pub fn begin_backward(&mut self) {
        self.pass = Pass::Backward;
        self.ensure_globals();
    }

    /// Frees the global tensors after backward.
    pub fn end_micro_step(&mut self) {
        if let Some((_, t)) = self.prefetch.take() {
            (self.send_buf, self.gather_buf) = self.fsdp.wait(t);
        }
        if let Some(g) = self.globals.take() {
            self.track(-((self.plan.unit_elements(0) * 4) as isize));
            self.spare_globals = Some(g);
        }
    }

    /// Whether every gathered block has been freed (true after each step: every block's last
    /// use in a step is a backward, which frees it).
    pub fn all_released(&self) -> bool {
        self.blocks.iter().all(|b| b.is_none())
    }

    /// This tp rank's whole tensors, gathered on every rank of the `fsdp` group (for an export
    /// or a test; training never needs them).
    pub fn gather_full(&mut self) -> Params<B::Buf> {
        let mut full = Params::alloc(&self.m, |n| self.be.zeros(n));
        self.gather_unit(0);
        self.plan.unpack(&self.be, 0, self.gathered(0), &mut full.globals_mut(&self.m));
        for l in 0..self.m.layers {
            let (mut dense, mut experts) = self.plan.split_block_mut(l, full.layers[l].tensors_mut());
            self.gather_unit(l + 1);
            self.plan.unpack(&self.be, l + 1, self.gathered(l + 1), &mut dense);
            self.unpack_experts(l, &mut experts);
        }
        full
    }
}

impl<B: Backend<f32> + Clone> WeightSource<B::Buf> for FsdpParams<'_, B> {
    fn globals(&self) -> Globals<'_, B::Buf> {
        let g = self.globals.as_ref().expect("begin_micro_step gathers the global tensors");
        Globals { embed_tokens: &g.embed_tokens, norm: &g.norm, output: g.output_weight() }
    }

    fn block(&mut self, l: usize) -> &Layer<B::Buf> {
        if self.blocks[l].is_none() {
            let id = self.m.layer_ids[l];
            let mut buf = match self.spare.iter().position(|b| b.fits(&self.m, id)) {
                Some(i) => self.spare.swap_remove(i),
                None => Layer::alloc(&self.m, id, |n| self.be.zeros(n)),
            };
            if self.plan.degree > 1 && !self.finish_prefetch(l) {
                self.gather_unit(l + 1);
            }
            let (mut dense, mut experts) = self.plan.split_block_mut(l, buf.tensors_mut());
            self.plan.unpack(&self.be, l + 1, self.gathered(l + 1), &mut dense);
            self.unpack_experts(l, &mut experts);
            self.track((self.plan.block_elements(l) * 4) as isize);
            self.blocks[l] = Some(buf);
        }
        // Overlap: the block the model will ask for next is gathered while this one computes.
        match self.pass {
            Pass::Forward | Pass::Evaluate => self.start_prefetch(l + 1),
            Pass::Backward => {
                if l > 0 {
                    self.start_prefetch(l - 1)
                }
            }
        }
        self.blocks[l].as_ref().expect("just gathered")
    }

    fn block_done(&mut self, l: usize) {
        self.progress();
        if self.pass == Pass::Forward && !self.reshard_after_forward {
            return;
        }
        if let Some(b) = self.blocks[l].take() {
            self.track(-((self.plan.block_elements(l) * 4) as isize));
            self.spare.push(b);
        }
    }
}
