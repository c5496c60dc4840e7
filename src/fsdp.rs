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
//! `FsdpParams` hands the model gathered weights block by block ([`WeightSource`]) and frees
//! them after use (`reshard_after_forward = true`, ZeRO-3) or keeps them from forward to
//! backward (`false`). `FsdpGrads` receives each block's full gradient ([`GradSink`]),
//! reduce-scatters it over `fsdp` into the rank's shard (summing micro-steps), and
//! `finish_step` all-reduces the shards over `dp_rep`. With degree 1 the same code holds the
//! whole model and every collective is a no-op. Knows nothing of attention or data.

use crate::comm::{Group, Pending};
use crate::model::params::{init_fill, param_specs_local, Dims, LayerParams, ModelParams, TpSplit};
use crate::model::{Globals, GlobalsMut, GradSink, WeightSource};
use std::collections::BTreeMap;
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
}

/// How every tensor of the model is cut across an `fsdp` group of `degree` ranks.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    pub units: Vec<Unit>,
    pub degree: usize,
    pub rank: usize,
}

impl ShardPlan {
    /// The plan for this tp rank's tensors (`m`) over an fsdp group of `degree` ranks.
    pub fn new(m: &Dims, degree: usize, rank: usize) -> ShardPlan {
        let mut units: Vec<Unit> = (0..=m.layers).map(|_| Unit { tensors: vec![], shard_len: 0 }).collect();
        for (i, spec) in param_specs_local(m).into_iter().enumerate() {
            let unit = spec
                .name
                .strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|l| l.parse::<usize>().ok())
                .map_or(0, |l| l + 1);
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
            };
            u.shard_len += t.shard_len();
            u.tensors.push(t);
        }
        ShardPlan { units, degree, rank }
    }

    /// AdamW slots: one per tensor shard, in unit order.
    pub fn optimizer_slots(&self) -> Vec<(usize, bool)> {
        self.units.iter().flat_map(|u| u.tensors.iter().map(|t| (t.shard_len(), t.decayed))).collect()
    }

    /// Elements this rank stores per copy of the model state (shards, padding included).
    pub fn shard_elements(&self) -> usize {
        self.units.iter().map(|u| u.shard_len).sum()
    }

    /// The largest unit shard.
    pub fn max_shard_len(&self) -> usize {
        self.units.iter().map(|u| u.shard_len).max().unwrap_or(0)
    }

    /// The largest gathered unit (`degree` shards, padding included): the gather buffer.
    pub fn max_gathered_len(&self) -> usize {
        self.max_shard_len() * self.degree
    }

    /// Elements of unit `unit`'s tensors held whole (no padding).
    pub fn unit_elements(&self, unit: usize) -> usize {
        self.units[unit].tensors.iter().map(|t| t.rows * t.cols).sum()
    }

    /// Copies the rows rank `rank` owns of every tensor of `unit` from whole tensors into a
    /// flat shard (zero padding).
    fn pack(&self, unit: usize, full: &[&[f32]], rank: usize, shard: &mut [f32]) {
        for (t, src) in self.units[unit].tensors.iter().zip(full) {
            let dst = &mut shard[t.offset..][..t.shard_len()];
            let rows = t.owned_rows(rank);
            let n = rows.len() * t.cols;
            dst[..n].copy_from_slice(&src[rows.start * t.cols..][..n]);
            dst[n..].iter_mut().for_each(|x| *x = 0.0);
        }
    }

    /// Copies a gathered unit (`[degree][shard_len]`) into whole tensors.
    fn unpack(&self, unit: usize, gathered: &[f32], full: &mut [&mut Vec<f32>]) {
        let u = &self.units[unit];
        for (t, dst) in u.tensors.iter().zip(full.iter_mut()) {
            for r in 0..self.degree {
                let rows = t.owned_rows(r);
                let n = rows.len() * t.cols;
                dst[rows.start * t.cols..][..n].copy_from_slice(&gathered[r * u.shard_len + t.offset..][..n]);
            }
        }
    }
}

/// Whole tensors of unit 0.
fn globals_tensors_mut(p: &mut ModelParams<f32>) -> Vec<&mut Vec<f32>> {
    let mut v = vec![&mut p.embed_tokens, &mut p.norm];
    if let Some(h) = p.lm_head.as_mut() {
        v.push(h);
    }
    v
}

/// The whole tensors of a unit of a model held whole, in unit order.
fn unit_tensors(p: &ModelParams<f32>, unit: usize) -> Vec<&[f32]> {
    if unit == 0 {
        let mut v = vec![p.embed_tokens.as_slice(), p.norm.as_slice()];
        if let Some(h) = &p.lm_head {
            v.push(h);
        }
        v
    } else {
        p.layers[unit - 1].tensors().into_iter().map(|t| t.as_slice()).collect()
    }
}

/// Which pass the model is in: decides whether a block is freed after use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Backward,
}

/// The rank's parameter shards and the gathered copies the model reads.
pub struct FsdpParams<'g> {
    pub plan: ShardPlan,
    fsdp: &'g Group,
    m: Dims,
    /// `[unit][shard_len]`: what this rank owns and updates.
    pub shards: Vec<Vec<f32>>,
    pub reshard_after_forward: bool,
    /// Prefetch the next block's all-gather while the current one computes.
    pub overlap: bool,
    pass: Pass,
    /// Unit 0 gathered (only its global tensors are allocated), during a micro-step.
    globals: Option<ModelParams<f32>>,
    /// The global tensors' buffers between micro-steps, reused so no step allocates them.
    spare_globals: Option<ModelParams<f32>>,
    blocks: Vec<Option<LayerParams<f32>>>,
    spare: Vec<LayerParams<f32>>,
    gather_buf: Vec<f32>,
    /// The next block's all-gather, started while the current block computes.
    prefetch: Option<(usize, Pending)>,
    send_buf: Vec<f32>,
    gathered_bytes: usize,
    /// High-water mark of gathered (unsharded) parameter bytes.
    pub gathered_peak_bytes: usize,
}

impl<'g> FsdpParams<'g> {
    /// Zero shards, to be filled by a load (a checkpoint, or a Hugging Face model's slices).
    pub fn zeros(m: &Dims, fsdp: &'g Group, reshard_after_forward: bool) -> Self {
        let plan = ShardPlan::new(m, fsdp.size(), fsdp.rank());
        let shards = plan.units.iter().map(|u| vec![0.0; u.shard_len]).collect();
        FsdpParams {
            fsdp,
            m: m.clone(),
            shards,
            reshard_after_forward,
            overlap: true,
            pass: Pass::Forward,
            globals: None,
            spare_globals: None,
            blocks: (0..m.layers).map(|_| None).collect(),
            spare: vec![],
            // Sized once for the largest unit, so no collective ever reallocates them; none
            // with fsdp degree 1, where a unit's shard is the whole unit.
            gather_buf: Vec::with_capacity(if plan.degree > 1 { plan.max_gathered_len() } else { 0 }),
            prefetch: None,
            send_buf: Vec::with_capacity(if plan.degree > 1 { plan.max_shard_len() } else { 0 }),
            gathered_bytes: 0,
            gathered_peak_bytes: 0,
            plan,
        }
    }

    /// The seeded initial model; each rank generates only the rows it owns.
    pub fn init(m: &Dims, seed: u64, fsdp: &'g Group, reshard_after_forward: bool) -> Self {
        let mut p = Self::zeros(m, fsdp, reshard_after_forward);
        let specs = param_specs_local(m);
        for (unit, shard) in p.plan.units.iter().zip(p.shards.iter_mut()) {
            for t in &unit.tensors {
                let rows = t.owned_rows(p.plan.rank);
                let dst = &mut shard[t.offset..][..rows.len() * t.cols];
                init_fill(seed, &specs[t.spec_index], m.layers, rows.start * t.cols, dst);
            }
        }
        p
    }

    /// Takes this rank's shards of a model held whole in this tp rank's shapes.
    pub fn from_full(full: &ModelParams<f32>, m: &Dims, fsdp: &'g Group, reshard_after_forward: bool) -> Self {
        let mut p = Self::zeros(m, fsdp, reshard_after_forward);
        for u in 0..p.plan.units.len() {
            p.plan.pack(u, &unit_tensors(full, u), p.plan.rank, &mut p.shards[u]);
        }
        p
    }

    fn gather_unit(&mut self, unit: usize) {
        let len = self.plan.units[unit].shard_len;
        self.gather_buf.resize(len * self.plan.degree, 0.0);
        self.fsdp.all_gather_f32(&self.shards[unit], &mut self.gather_buf);
    }

    /// Unit `unit` whole in packed order, once [`Self::gather_unit`] or a prefetch has filled
    /// `gather_buf`; with fsdp degree 1 the shard itself (nothing to gather, nothing copied).
    fn gathered(&self, unit: usize) -> &[f32] {
        if self.plan.degree == 1 {
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
        let mut send = std::mem::take(&mut self.send_buf);
        send.clear();
        send.extend_from_slice(&self.shards[unit]);
        let mut recv = std::mem::take(&mut self.gather_buf);
        recv.resize(self.plan.units[unit].shard_len * self.plan.degree, 0.0);
        self.prefetch = Some((l, self.fsdp.start_all_gather_f32(send, recv)));
    }

    /// Lets a prefetch in flight progress (MPI moves non-blocking collectives only inside MPI calls).
    fn progress(&mut self) {
        if let Some((_, p)) = self.prefetch.as_mut() {
            self.fsdp.test(p);
        }
    }

    /// Completes the prefetch of block `l` into `gather_buf`; false if none was in flight.
    fn finish_prefetch(&mut self, l: usize) -> bool {
        match self.prefetch.take() {
            Some((pl, p)) if pl == l => {
                let (send, recv) = self.fsdp.wait(p);
                self.send_buf = send;
                self.gather_buf = recv;
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
        if self.globals.is_none() {
            let mut g = match self.spare_globals.take() {
                Some(g) => g,
                None => ModelParams::<f32>::zeros_local(&Dims { layers: 0, ..self.m.clone() }),
            };
            if self.plan.degree > 1 {
                self.gather_unit(0);
            }
            self.plan.unpack(0, self.gathered(0), &mut globals_tensors_mut(&mut g));
            self.track((self.plan.unit_elements(0) * 4) as isize);
            self.globals = Some(g);
        }
    }

    pub fn begin_backward(&mut self) {
        self.pass = Pass::Backward;
    }

    /// Frees the global tensors after backward.
    pub fn end_micro_step(&mut self) {
        if let Some((_, p)) = self.prefetch.take() {
            let (send, recv) = self.fsdp.wait(p);
            self.send_buf = send;
            self.gather_buf = recv;
        }
        if let Some(g) = self.globals.take() {
            self.track(-((self.plan.unit_elements(0) * 4) as isize));
            self.spare_globals = Some(g);
        }
        debug_assert!(self.blocks.iter().all(|b| b.is_none()), "every block is freed after backward");
    }

    /// This tp rank's whole tensors, gathered on every rank of the `fsdp` group (for an export
    /// or a test; training never needs them).
    pub fn gather_full(&mut self) -> ModelParams<f32> {
        let mut full = ModelParams::<f32>::zeros_local(&self.m);
        for unit in 0..self.plan.units.len() {
            self.gather_unit(unit);
            let mut dst =
                if unit == 0 { globals_tensors_mut(&mut full) } else { full.layers[unit - 1].tensors_mut().into_iter().collect() };
            self.plan.unpack(unit, &self.gather_buf, &mut dst);
        }
        full
    }

    /// A fingerprint of the bits of the tensors every tp rank holds whole (norm weights): equal
    /// on every tp rank exactly when those tensors are bit-identical.
    pub fn replicated_fingerprint(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for (unit, shard) in self.plan.units.iter().zip(&self.shards) {
            for t in unit.tensors.iter().filter(|t| t.tp_replicated) {
                for x in &shard[t.offset..][..t.shard_len()] {
                    h = (h ^ x.to_bits() as u64).wrapping_mul(0x0000_0100_0000_01b3);
                }
            }
        }
        h
    }

    /// This rank's shard of every tensor, in slot order (what a checkpoint saves).
    pub fn slots(&self) -> Vec<&[f32]> {
        slots(&self.plan, &self.shards)
    }

    /// AdamW over this rank's shards.
    pub fn slots_mut(&mut self) -> Vec<&mut [f32]> {
        slots_mut(&self.plan, &mut self.shards)
    }
}

/// The shard of every tensor in `shards` (`[unit][shard_len]`), in slot order.
fn slots<'a>(plan: &ShardPlan, shards: &'a [Vec<f32>]) -> Vec<&'a [f32]> {
    let tensors = plan.units.iter().zip(shards).flat_map(|(unit, shard)| unit.tensors.iter().map(move |t| (t, shard)));
    tensors.map(|(t, shard)| &shard[t.offset..][..t.shard_len()]).collect()
}

/// [`slots`], writable (each unit's tensors lie one after another from offset 0).
fn slots_mut<'a>(plan: &ShardPlan, shards: &'a mut [Vec<f32>]) -> Vec<&'a mut [f32]> {
    let mut out = vec![];
    for (unit, shard) in plan.units.iter().zip(shards.iter_mut()) {
        let mut rest: &mut [f32] = shard;
        for t in &unit.tensors {
            let (a, b) = rest.split_at_mut(t.shard_len());
            out.push(a);
            rest = b;
        }
    }
    out
}

impl WeightSource<Vec<f32>> for FsdpParams<'_> {
    fn globals(&self) -> Globals<'_, Vec<f32>> {
        let g = self.globals.as_ref().expect("begin_micro_step gathers the global tensors");
        Globals { embed_tokens: &g.embed_tokens, norm: &g.norm, output: g.output_weight() }
    }

    fn block(&mut self, l: usize) -> &LayerParams<f32> {
        if self.blocks[l].is_none() {
            let mut buf = match self.spare.pop() {
                Some(b) => b,
                None => LayerParams::zeros(&self.m),
            };
            if self.plan.degree > 1 && !self.finish_prefetch(l) {
                self.gather_unit(l + 1);
            }
            self.plan.unpack(l + 1, self.gathered(l + 1), &mut buf.tensors_mut());
            self.track((self.plan.unit_elements(l + 1) * 4) as isize);
            self.blocks[l] = Some(buf);
        }
        // Overlap: the block the model will ask for next is gathered while this one computes.
        match self.pass {
            Pass::Forward => self.start_prefetch(l + 1),
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
            self.track(-((self.plan.unit_elements(l + 1) * 4) as isize));
            self.spare.push(b);
        }
    }
}

/// The rank's gradient shards, and the whole-tensor scratch the model writes into.
pub struct FsdpGrads<'g> {
    plan: ShardPlan,
    fsdp: &'g Group,
    dp_rep: &'g Group,
    /// `[unit][shard_len]`: summed over the micro-steps of the step, then over `dp_rep`.
    pub shards: Vec<Vec<f32>>,
    globals: ModelParams<f32>,
    block: LayerParams<f32>,
    current: Option<usize>,
    pack_buf: Vec<f32>,
    recv_buf: Vec<f32>,
    /// True in the step's last micro-step: each unit's outer all-reduce starts as soon as its
    /// reduce-scatter is done, while backward continues on earlier blocks.
    last_micro: bool,
    /// Leave each reduction in flight while backward goes on (reduce-scatter over `fsdp`,
    /// then in the last micro-step the all-reduce over `dp_rep`); `false` blocks on each.
    pub overlap: bool,
    /// The reduce-scatter in flight (one at a time: it owns `pack_buf` and `recv_buf`).
    /// With its unit, and whether it is of the step's last micro-step.
    reduce_scatter: Option<(usize, bool, Pending)>,
    /// Per unit: the `dp_rep` all-reduce in flight, and the spare buffer it will return.
    inflight: Vec<Option<Pending>>,
    spare: Vec<Vec<f32>>,
}

impl<'g> FsdpGrads<'g> {
    pub fn new(m: &Dims, fsdp: &'g Group, dp_rep: &'g Group) -> Self {
        let plan = ShardPlan::new(m, fsdp.size(), fsdp.rank());
        let shards = plan.units.iter().map(|u| vec![0.0; u.shard_len]).collect();
        FsdpGrads {
            fsdp,
            dp_rep,
            shards,
            globals: ModelParams::zeros_local(&Dims { layers: 0, ..m.clone() }),
            block: LayerParams::zeros(m),
            current: None,
            pack_buf: Vec::with_capacity(if plan.degree > 1 { plan.max_gathered_len() } else { 0 }),
            recv_buf: Vec::with_capacity(if plan.degree > 1 { plan.max_shard_len() } else { 0 }),
            last_micro: false,
            overlap: true,
            reduce_scatter: None,
            inflight: (0..=m.layers).map(|_| None).collect(),
            spare: (0..=m.layers).map(|_| vec![]).collect(),
            plan,
        }
    }

    /// Declares whether the coming backward is the step's last micro-step.
    pub fn begin_micro_step(&mut self, last: bool) {
        self.last_micro = last;
    }

    /// Starts unit `unit`'s outer all-reduce (its shard is final for this step).
    fn start_outer_reduce(&mut self, unit: usize) {
        if self.dp_rep.size() == 1 {
            return;
        }
        assert!(self.inflight[unit].is_none(), "unit {unit}: outer all-reduce started twice in one step");
        let send = std::mem::take(&mut self.shards[unit]);
        let mut recv = std::mem::take(&mut self.spare[unit]);
        recv.resize(send.len(), 0.0);
        self.inflight[unit] = Some(self.dp_rep.start_all_reduce_sum_f32(send, recv));
    }

    fn progress(&mut self) {
        for p in self.inflight.iter_mut().flatten() {
            self.dp_rep.test(p);
        }
    }

    /// Zeroes the shards before the step's first micro-step.
    pub fn zero(&mut self) {
        self.shards.iter_mut().for_each(|s| s.iter_mut().for_each(|x| *x = 0.0));
    }

    /// Reduce-scatters a unit's whole gradient over `fsdp` into its shard (`+=`): conjugate
    /// of the forward all-gather. With `overlap` the reduce-scatter is left in flight while
    /// backward computes the next block, and completed by the next call (or by
    /// [`Self::finish_step`]); without, it completes here.
    fn reduce_unit(&mut self, unit: usize, full: &[&[f32]]) {
        self.finish_reduce_scatter();
        let len = self.plan.units[unit].shard_len;
        if self.plan.degree == 1 {
            // The whole gradient is this rank's shard: add it in place, no copies.
            for (t, src) in self.plan.units[unit].tensors.iter().zip(full) {
                for (a, &b) in self.shards[unit][t.offset..][..src.len()].iter_mut().zip(src.iter()) {
                    *a += b;
                }
            }
            self.reduced(unit, self.last_micro);
            return;
        }
        let mut send = std::mem::take(&mut self.pack_buf);
        send.resize(len * self.plan.degree, 0.0);
        for r in 0..self.plan.degree {
            self.plan.pack(unit, full, r, &mut send[r * len..][..len]);
        }
        let mut recv = std::mem::take(&mut self.recv_buf);
        recv.resize(len, 0.0);
        if self.overlap {
            self.reduce_scatter = Some((unit, self.last_micro, self.fsdp.start_reduce_scatter_sum_f32(send, recv)));
        } else {
            self.fsdp.reduce_scatter_sum_f32(&send, &mut recv);
            (self.pack_buf, self.recv_buf) = (send, recv);
            self.add_reduced(unit, self.last_micro);
        }
    }

    /// Completes the reduce-scatter in flight, if any, and adds its block into the shard.
    fn finish_reduce_scatter(&mut self) {
        if let Some((unit, last, p)) = self.reduce_scatter.take() {
            (self.pack_buf, self.recv_buf) = self.fsdp.wait(p);
            self.add_reduced(unit, last);
        }
    }

    fn add_reduced(&mut self, unit: usize, last: bool) {
        for (a, &b) in self.shards[unit].iter_mut().zip(&self.recv_buf) {
            *a += b;
        }
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
            if self.inflight[unit].is_none() && self.dp_rep.size() > 1 {
                self.start_outer_reduce(unit);
            }
            if let Some(p) = self.inflight[unit].take() {
                let (send, recv) = self.dp_rep.wait(p);
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
        let g: usize = [&self.globals.embed_tokens, &self.globals.norm].iter().map(|t| t.len()).sum::<usize>()
            + self.globals.lm_head.as_ref().map_or(0, |h| h.len());
        let b: usize = self.block.tensors().iter().map(|t| t.len()).sum();
        let reduce = if self.plan.degree > 1 { self.plan.max_gathered_len() + self.plan.max_shard_len() } else { 0 };
        let outer = if self.dp_rep.size() > 1 { self.plan.shard_elements() } else { 0 };
        (g + b + reduce + outer) * 4
    }

    /// This rank's part of the squared global norm (padding is zero and adds nothing). A
    /// tensor every tp rank holds whole is counted by tp rank 0 only (`count_replicated`).
    pub fn local_sq_sum(&self, count_replicated: bool) -> f64 {
        let mut sum = 0.0;
        for (unit, shard) in self.plan.units.iter().zip(&self.shards) {
            for t in unit.tensors.iter().filter(|t| count_replicated || !t.tp_replicated) {
                sum += shard[t.offset..][..t.shard_len()].iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
            }
        }
        sum
    }

    /// With sequence parallelism each tp rank's gradient of a replicated tensor (norm
    /// weights) covers only its rows of the sequence: sum them across `tp`.
    pub fn sum_replicated_over(&mut self, tp: &Group) {
        for (unit, shard) in self.plan.units.iter().zip(self.shards.iter_mut()) {
            for t in unit.tensors.iter().filter(|t| t.tp_replicated) {
                tp.all_reduce_sum_f32(&mut shard[t.offset..][..t.shard_len()]);
            }
        }
    }

    pub fn scale(&mut self, coef: f64) {
        if coef != 1.0 {
            let c = coef as f32;
            self.shards.iter_mut().for_each(|s| s.iter_mut().for_each(|x| *x *= c));
        }
    }

    pub fn slots(&self) -> Vec<&[f32]> {
        slots(&self.plan, &self.shards)
    }

    pub fn slots_mut(&mut self) -> Vec<&mut [f32]> {
        slots_mut(&self.plan, &mut self.shards)
    }
}

impl GradSink<Vec<f32>> for FsdpGrads<'_> {
    fn globals_mut(&mut self) -> GlobalsMut<'_, Vec<f32>> {
        let g = &mut self.globals;
        GlobalsMut { embed_tokens: &mut g.embed_tokens, norm: &mut g.norm, lm_head: g.lm_head.as_mut() }
    }

    fn block_mut(&mut self, l: usize) -> &mut LayerParams<f32> {
        if self.current != Some(l) {
            self.block.tensors_mut().into_iter().for_each(|t| t.iter_mut().for_each(|x| *x = 0.0));
            self.current = Some(l);
        }
        &mut self.block
    }

    fn block_done(&mut self, l: usize) {
        let block = std::mem::replace(&mut self.block, LayerParams::empty());
        {
            let full: Vec<&[f32]> = block.tensors().into_iter().map(|t| t.as_slice()).collect();
            self.reduce_unit(l + 1, &full);
        }
        self.block = block;
        self.current = None;
        self.progress();
    }

    fn globals_done(&mut self) {
        let mut g = std::mem::replace(&mut self.globals, ModelParams { embed_tokens: vec![], layers: vec![], norm: vec![], lm_head: None });
        {
            let mut full: Vec<&[f32]> = vec![&g.embed_tokens, &g.norm];
            if let Some(h) = &g.lm_head {
                full.push(h);
            }
            self.reduce_unit(0, &full);
        }
        globals_tensors_mut(&mut g).into_iter().for_each(|t| t.iter_mut().for_each(|x| *x = 0.0));
        self.globals = g;
    }
}

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

/// What [`FsdpParams`], [`FsdpGrads`] and AdamW hold on a rank with this `plan`.
pub fn predicted_memory(plan: &ShardPlan, dp_rep: usize, reshard: bool, overlap: bool) -> StateMemory {
    let shard = 4 * plan.shard_elements();
    let blocks = plan.units.len() - 1;
    let block = (1..=blocks).map(|u| plan.unit_elements(u)).max().unwrap_or(0);
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
        grad_scratch: 4 * (plan.unit_elements(0) + block + reduce + outer),
    }
}

/// Bytes each collective moves per optimiser step on one rank, by the counting convention of
/// `comm` (the input of an all-reduce or reduce-scatter, the output of an all-gather), keyed
/// `group.kind`. Per micro-step, ZeRO-3 gathers the global tensors once and every block twice
/// (once with `reshard_after_forward = false`) and reduce-scatters every unit once; the outer
/// all-reduce over `dp_rep` runs once per step; the loss, the token count and the norm are
/// 8-byte scalars. Groups of degree 1 move nothing.
pub fn predicted_comm_bytes(plan: &ShardPlan, dp_rep: usize, batch: usize, grad_accum: usize, reshard: bool) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let (n, ga) = (plan.degree as u64, grad_accum as u64);
    let unit = |u: &Unit| u.shard_len as u64 * 4;
    let globals = unit(&plan.units[0]);
    let blocks: u64 = plan.units[1..].iter().map(unit).sum();
    if n > 1 {
        let gathers = if reshard { 2 } else { 1 };
        out.insert("fsdp.all_gather".into(), ga * (globals + gathers * blocks) * n);
        out.insert("fsdp.reduce_scatter".into(), ga * (globals + blocks) * n);
        out.insert("fsdp.all_reduce".into(), 8);
    }
    if dp_rep > 1 {
        out.insert("dp_rep.all_reduce".into(), globals + blocks);
    }
    if batch > 1 {
        out.insert("batch.all_reduce".into(), 16);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelCfg;

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
        let plans: Vec<ShardPlan> = (0..degree).map(|r| ShardPlan::new(&Dims::full(&cfg), degree, r)).collect();
        for unit in 0..plans[0].units.len() {
            let len = plans[0].units[unit].shard_len;
            let mut gathered = vec![0.0; len * degree];
            for (r, plan) in plans.iter().enumerate() {
                plan.pack(unit, &unit_tensors(&full, unit), r, &mut gathered[r * len..][..len]);
            }
            let mut back = ModelParams::<f32>::zeros(&cfg);
            let mut dst =
                if unit == 0 { globals_tensors_mut(&mut back) } else { back.layers[unit - 1].tensors_mut().into_iter().collect() };
            plans[0].unpack(unit, &gathered, &mut dst);
            let want = unit_tensors(&full, unit);
            let got = unit_tensors(&back, unit);
            assert_eq!(want, got, "unit {unit}");
        }
    }
}
