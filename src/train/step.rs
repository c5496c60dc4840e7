//! One optimiser step, on any backend and any layout: the micro-steps with gradient
//! accumulation (run by the pipeline executor, `parallel::pp::executor`, in the schedule's
//! order), the global-batch loss, the gradient reduction, the global norm and clipping, and
//! AdamW. What the training loop runs each step and what the benches time.
//!
//! The loss is normalised by the number of target tokens in the whole global batch, reduced
//! before any backward, so every layout and every `grad_accum` computes the same gradient up
//! to summation order (`docs/model.md`).

use super::state::{ModelState, Start};
use crate::backend::Backend;
use crate::config::{OnNonFinite, OptimCfg, Resolved};
use crate::data::{open_sources, Loader, Sources};
use crate::metrics::{Phase, PhaseTimes};
use crate::model::hooks::{AttentionSchedule, Hooks, TensorParallel};
use crate::optim::{clip_coefficient, lr_at};
use crate::parallel::collective::MeshCollectives;
use crate::parallel::cp::{LocalBatch, SequenceGroups};
use crate::parallel::mesh::Mesh;
use crate::parallel::pp::executor::{Executor, LossSums, Pass, ScheduleTimes};
use crate::parallel::pp::{rank_pieces, sum_tied_embedding};
use crate::parallel::tp::Megatron;
use crate::run::faults::{self, Faults};
use crate::run::watchdog::beat;
use crate::run::{AgreedFailure, Error};
use crate::say;
use std::time::Instant;

mod evaluate;

/// What one step computed.
#[derive(Clone, Debug)]
pub struct StepOutcome {
    /// The global-batch loss, before the update.
    pub loss: f64,
    /// A mixture of experts' auxiliary loss: the mean over the global batch's sequences.
    pub aux_loss: Option<f64>,
    /// A mixture of experts: the step's choices of the whole global batch per expert block and
    /// expert (`[moe blocks × E]`), the same on every rank; empty without experts.
    pub expert_counts: Vec<u64>,
    /// The global gradient norm, before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    /// False when `on_nonfinite = "skip"` skipped the update.
    pub updated: bool,
    pub phases: PhaseTimes,
}

/// The shape of a step's batch on every rank.
#[derive(Clone, Copy, Debug)]
struct BatchShape {
    seq_len: usize,
    micro_batch: usize,
    grad_accum: usize,
}

impl BatchShape {
    /// The target tokens of `batches` global batches: this rank's (its cp share of its
    /// micro-batches') summed over the data-parallel ranks and the cp group, before any
    /// backward. The loss is the global sum over this count, exact for any layout.
    fn global_targets(&self, mesh: &Mesh, batches: usize) -> f64 {
        let mut n = [(batches * self.grad_accum * self.micro_batch * self.seq_len / mesh.cp.size()) as f64];
        mesh.batch.all_reduce_sum_f64(&mut n);
        mesh.cp.all_reduce_sum_f64(&mut n);
        n[0]
    }

    /// This rank's share of micro-batch `micro` of `loader`'s global batch `batch`.
    fn local_batch(&self, loader: &Loader, mesh: &Mesh, batch: u64, micro: usize) -> Result<LocalBatch, Error> {
        let b = loader.micro_batch(batch, micro)?;
        Ok(LocalBatch::of(&b.inputs, &b.targets, self.seq_len, mesh.cp.size(), mesh.cp.rank()))
    }
}

/// The global sum of the loss over every rank's tokens: over the data-parallel ranks and the
/// cp group, and over `pp`, where only the last stage computes a loss and the others add zero.
fn global_loss_sum(mesh: &Mesh, local: f64) -> f64 {
    let mut sum = [local];
    global_sums(mesh, &mut sum);
    sum[0]
}

/// [`global_loss_sum`] of several sums at once (the cross entropy and the auxiliary loss).
fn global_sums(mesh: &Mesh, sums: &mut [f64]) {
    mesh.batch.all_reduce_sum_f64(sums);
    mesh.cp.all_reduce_sum_f64(sums);
    mesh.pp.all_reduce_sum_f64(sums);
}

/// The learning rate and the update: the deck's `[optim]`, the peak rate after batch-size
/// scaling, and the run's length (for the schedule).
struct Schedule {
    optim: OptimCfg,
    peak_lr: f64,
    steps: u64,
}

/// The samples a trainer reads: the training loader, and the held-out samples `[eval]` names
/// (in sequential order).
pub struct Data {
    pub loader: Loader,
    held_out: Option<Loader>,
}

/// The parallel strategies a step runs under: the mesh, its groups' collectives on the
/// backend's buffers, and the model's tensor-parallel and attention hooks.
struct Strategies<'g, B: Backend<f32>> {
    mesh: &'g Mesh,
    comms: MeshCollectives<'g, B::Buf>,
    tp: Megatron<'g, B::Buf>,
    attention: Box<dyn AttentionSchedule<f32, B> + 'g>,
    sequences: SequenceGroups<'g>,
}

impl<'g, B: Backend<f32>> Strategies<'g, B> {
    fn hooks(&self) -> Hooks<'_, f32, B> {
        Hooks {
            tp: &self.tp,
            attention: self.attention.as_ref(),
            sequences: &self.sequences,
            experts: self.comms.ep,
            router_bias: &[],
            progress: crate::parallel::comm::progress,
        }
    }
}

/// The model, its state and its data on one rank, stepped together.
pub struct Trainer<'g, B: Backend<f32>> {
    pipeline: Executor<'g, B>,
    pub state: ModelState<'g, B>,
    pub data: Data,
    par: Strategies<'g, B>,
    shape: BatchShape,
    schedule: Schedule,
    /// The model has a mixture of experts (and an auxiliary loss to log).
    moe: bool,
    /// The debug options that inject faults (`docs/debugging.md`).
    pub faults: Faults,
}

impl<'g, B: Backend<f32> + Clone + 'g> Trainer<'g, B> {
    /// Everything one rank needs to step `res` on `be`, with the state `state` (initialised or
    /// loaded) and the data `sources`.
    pub fn new(
        be: B,
        comms: MeshCollectives<'g, B::Buf>,
        res: &Resolved,
        mesh: &'g Mesh,
        state: ModelState<'g, B>,
        sources: Sources,
    ) -> Result<Self, Error> {
        let deck = &res.deck;
        let (tcfg, p) = (&deck.train, &deck.parallel);
        let shape = BatchShape { seq_len: tcfg.seq_len, micro_batch: tcfg.micro_batch, grad_accum: res.grad_accum };
        let tp = Megatron { group: comms.tp, sequence_parallel: p.sequence_parallel };
        let (dims, chunks) = rank_pieces(res, mesh);
        // The residual stream's rows on this rank: what travels between stages.
        let message_len = tp.local_rows(shape.micro_batch * shape.seq_len / mesh.cp.size()) * dims.d;
        let schedule = (p.pp_schedule, res.grad_accum);
        // A mixture of experts' loads follow each message: per sequence E counts, E sums and
        // the rows, each f64 as two f32.
        let loads_len = dims.moe.as_ref().map_or(0, |e| 2 * shape.micro_batch * (2 * e.router.experts + 1));
        let pipeline = Executor::new(be, (&dims, chunks), tcfg.activation_checkpointing, schedule, &mesh.pp, (message_len, loads_len));
        Ok(Trainer {
            pipeline,
            state,
            data: Data::open(res, mesh, sources)?,
            par: Strategies {
                mesh,
                tp,
                attention: crate::parallel::cp::attention_schedule(comms.cp),
                sequences: SequenceGroups { tp: p.sequence_parallel.then_some(&mesh.tp), cp: &mesh.cp },
                comms,
            },
            shape,
            schedule: Schedule { optim: deck.optim.clone(), peak_lr: res.lr, steps: deck.run.steps },
            moe: deck.model.is_moe(),
            faults: Faults::from_env()?,
        })
    }

    /// A trainer of the seeded initial model (no checkpoint, no import): what the benches
    /// step.
    pub fn seeded(be: B, comms: MeshCollectives<'g, B::Buf>, res: &Resolved, mesh: &'g Mesh) -> Result<Self, Error> {
        let deck = &res.deck;
        let (dims, _) = rank_pieces(res, mesh);
        let p = &deck.parallel;
        let start = Start::Seeded(deck.run.seed);
        let state = ModelState::new(&be, &dims, &comms, start, (p.reshard_after_forward, p.overlap), &deck.optim, mesh.dp_rep.rank() == 0);
        Self::new(be, comms, res, mesh, state, Self::open_data(res)?)
    }

    /// Opens the deck's data (the same on every rank) for [`Trainer::new`]: the training
    /// source and the held-out one of `[eval]`.
    pub fn open_data(res: &Resolved) -> Result<Sources, Error> {
        let deck = &res.deck;
        let (m, t) = (&deck.model, &deck.train);
        Ok(open_sources(&deck.data, &deck.eval, m.vocab_size, deck.run.seed, t.seq_len, res.global_batch)?)
    }

    /// Optimiser step `step` (0-based): micro-steps, reductions, clipping, AdamW.
    pub fn step(&mut self, step: u64) -> Result<StepOutcome, Error> {
        let start = Instant::now();
        let mut pt = PhaseTimes::default();
        self.state.grads.zero();
        pt[Phase::Backward] += start.elapsed().as_secs_f64();
        let (sums, n_tok) = self.micro_steps(step, &mut pt)?;
        let expert_counts = self.global_expert_counts();
        let (loss, aux, grad_norm) = self.reduce(step, sums, n_tok, &mut pt)?;
        // Every sequence has seq_len targets: the batch holds n_tok / seq_len of them.
        let aux_loss = aux.map(|a| a * self.shape.seq_len as f64 / n_tok);
        let t_opt = Instant::now();
        let lr = lr_at(&self.schedule.optim, self.schedule.peak_lr, step, self.schedule.steps);
        // The loss and the norm are global reductions: every rank takes the same branch.
        let updated = loss.is_finite() && grad_norm.is_finite();
        if updated {
            self.state.update(clip_coefficient(grad_norm, self.schedule.optim.grad_clip), lr);
            self.state.balance_experts(&expert_counts);
        } else if self.schedule.optim.on_nonfinite == OnNonFinite::Abort {
            return Err(Box::new(self.nonfinite_failure(step + 1, loss, grad_norm)));
        }
        self.synchronize(step + 1)?;
        self.par.comms.settle();
        pt[Phase::Optimizer] += t_opt.elapsed().as_secs_f64();
        Ok(StepOutcome { loss, aux_loss, expert_counts, grad_norm, lr, updated, phases: pt })
    }

    /// The step's expert choices over every rank: summed over the data-parallel ranks, `cp`,
    /// `pp` (each stage fills its own blocks) and, under sequence parallelism, `tp` (without,
    /// every tp rank routes the same rows). Integers, exact in f64.
    fn global_expert_counts(&mut self) -> Vec<u64> {
        let local = self.pipeline.take_expert_counts();
        if !self.moe {
            return local;
        }
        let mesh = self.par.mesh;
        let mut x: Vec<f64> = local.iter().map(|&c| c as f64).collect();
        let mut groups = vec![&mesh.batch, &mesh.cp, &mesh.pp];
        if self.par.tp.sequence_parallel {
            groups.push(&mesh.tp);
        }
        for g in groups.into_iter().filter(|g| g.size() > 1) {
            g.all_reduce_sum_f64(&mut x);
        }
        x.into_iter().map(|c| c as u64).collect()
    }

    /// The backend of this rank's model.
    pub fn backend(&self) -> &B {
        self.pipeline.backend()
    }

    /// Bytes of activation memory this rank's model pieces hold (every micro-batch in flight
    /// at the schedule's peak), with zero bubble's kept weight-gradient operands.
    pub fn activation_bytes(&self) -> usize {
        self.pipeline.activation_bytes()
    }

    /// Visible (query, key) pairs processed by attention since the last call.
    pub fn take_attention_pairs(&mut self) -> u64 {
        self.pipeline.take_attention_pairs()
    }

    /// The step's micro-steps, run by the pipeline executor in the schedule's order, their
    /// gradients accumulated into the shards. Returns the summed losses of this rank's tokens
    /// and the global number of target tokens.
    fn micro_steps(&mut self, step: u64, pt: &mut PhaseTimes) -> Result<(LossSums, f64), Error> {
        let t_wait = Instant::now();
        let mesh = self.par.mesh;
        let n_tok = self.shape.global_targets(mesh, 1);
        // The first collective of the step: where a rank waits for the slowest of the last one.
        pt[Phase::Wait] += t_wait.elapsed().as_secs_f64();
        let (shape, loader, ga) = (self.shape, &self.data.loader, self.shape.grad_accum);
        let mut batch = |micro| shape.local_batch(loader, mesh, step, micro);
        let mut observe = |what: &dyn std::fmt::Display| beat(|| format!("step {}: {what}", step + 1));
        let pass = Pass::Train { grads: &mut self.state.grads, loss_scale: (1.0 / n_tok) as f32 };
        let hooks = Hooks { router_bias: &self.state.router_bias, ..self.par.hooks() };
        let (loss_sum, times) = self.pipeline.run(pass, &mut self.state.params, hooks, ga, &mut batch, &mut observe)?;
        add_schedule_times(pt, &times);
        Ok((loss_sum, n_tok))
    }

    /// After the last micro-step: the global-batch loss, the gradients' reduction over the
    /// data-parallel groups (and the tied embedding's over the pipeline's ends), and the global
    /// norm.
    /// Returns the loss, the summed auxiliary loss of the batch's sequences (with experts) and
    /// the norm.
    fn reduce(&mut self, step: u64, sums: LossSums, n_tok: f64, pt: &mut PhaseTimes) -> Result<(f64, Option<f64>, f64), Error> {
        beat(|| format!("step {}: gradient reduction and norm", step + 1));
        let t_comm = Instant::now();
        let mesh = self.par.mesh;
        let mut both = [sums.cross_entropy, sums.aux];
        global_sums(mesh, &mut both[..1 + self.moe as usize]);
        let (loss, aux) = (both[0] / n_tok, self.moe.then_some(both[1]));
        let grads = &mut self.state.grads;
        grads.finish_step();
        grads.sum_partial_over_tp(self.par.comms.tp, self.par.tp.sequence_parallel);
        sum_tied_embedding(grads, &mesh.pp);
        if let Some(fault) = self.faults.nan_grad.clone().filter(|f| f.fires(mesh.world.rank(), step + 1)) {
            self.poison(&fault)?;
        }
        // Global norm from the shards' squares, reduced once over the fsdp group (every dp_rep
        // replica already holds the same reduced shards).
        let mut sq = [self.state.grads.local_sq_sum(mesh.tp.rank() == 0)];
        mesh.fsdp.all_reduce_sum_f64(&mut sq);
        mesh.tp.all_reduce_sum_f64(&mut sq);
        mesh.pp.all_reduce_sum_f64(&mut sq);
        pt[Phase::Comm] += t_comm.elapsed().as_secs_f64();
        Ok((loss, aux, sq[0].sqrt()))
    }

    /// Waits for the device's queued work; a failed device operation (or the injected one of
    /// `NDTRAIN_DEBUG_DEVICE_ERROR`) ends the run on this rank, naming the device.
    fn synchronize(&self, s1: u64) -> Result<(), Error> {
        let be = self.backend();
        if self.faults.device_error.as_ref().is_some_and(|f| f.fires(self.par.mesh.world.rank(), s1)) {
            return Err(format!("{}: a device operation failed ({} at step {s1})", be.describe(), faults::DEVICE_ERROR_ENV).into());
        }
        be.synchronize().map_err(|e| format!("{}: {e}", be.describe()).into())
    }

    /// `NDTRAIN_DEBUG_NAN_GRAD`: NaN into the first element this rank holds of the named
    /// tensor's gradient.
    fn poison(&mut self, f: &faults::Fault) -> Result<(), Error> {
        let env = faults::NAN_GRAD_ENV;
        let name = f.tensor.as_deref().ok_or_else(|| format!("{env} needs tensor=NAME"))?;
        let slot = self.state.blocks.iter().position(|b| b.name == name).ok_or_else(|| format!("{env}: no tensor named {name}"))?;
        if !self.state.poison_grad(slot) {
            return Err(format!("{env}: this rank holds no element of {name}").into());
        }
        Ok(())
    }

    /// `on_nonfinite = "abort"`: finds, on every rank, the first tensor whose gradient shard
    /// holds a NaN or an infinity; the lowest rank that found one reports it (rank 0 if none
    /// did: then only the loss was not finite).
    fn nonfinite_failure(&self, step: u64, loss: f64, norm: f64) -> AgreedFailure {
        let world = &self.par.mesh.world;
        let rank = world.rank();
        let found = self.state.first_nonfinite_grad().map(|(slot, i, x)| (&self.state.blocks[slot], i, x));
        // The lowest rank with a finding, as a max: u64::MAX − rank.
        let mut reporter = [if found.is_some() { u64::MAX - rank as u64 } else { 0 }];
        world.agree_max_u64(&mut reporter);
        let reporter = if reporter[0] == 0 { 0 } else { (u64::MAX - reporter[0]) as usize };
        let what = match found {
            Some((b, i, x)) => format!(
                "first offending tensor on this rank: {} (its shard's element {i}, at global offset {:?} of shape {:?}, is {x})",
                b.name, b.start, b.global_shape
            ),
            None => "every gradient element on every rank is finite: the loss itself is not".into(),
        };
        AgreedFailure {
            message: (rank == reporter).then(|| {
                format!(
                    "rank {rank}: step {step}: loss {loss}, gradient norm {norm}: not finite; {what}. \
                     [optim] on_nonfinite = \"abort\" (\"skip\" would skip the update and go on)"
                )
            }),
        }
    }
}

impl Data {
    /// The loaders of this rank's data-parallel coordinate.
    fn open(res: &Resolved, mesh: &Mesh, sources: Sources) -> Result<Data, Error> {
        let deck = &res.deck;
        let (s, mb) = (deck.train.seq_len, deck.train.micro_batch);
        let (dp, dp_rank) = (res.layout.dp(), mesh.coords.dp_rank(&res.layout));
        let loader = Loader::new(&deck.data, sources.train, s, mb, res.global_batch, dp, dp_rank, deck.run.seed)?;
        let sequential = crate::config::DataCfg { order: crate::config::Order::Sequential, ..deck.data.clone() };
        let held_out =
            sources.held_out.map(|src| Loader::new(&sequential, src, s, mb, res.global_batch, dp, dp_rank, deck.run.seed)).transpose()?;
        Ok(Data { loader, held_out })
    }
}

/// Adds where a schedule's time went to the step's phases.
fn add_schedule_times(pt: &mut PhaseTimes, t: &ScheduleTimes) {
    pt[Phase::Data] += t.data_s;
    // Waiting for a neighbour's activation or gradient: the pipeline's bubble.
    pt[Phase::Wait] += t.wait_s;
    pt[Phase::Forward] += t.forward_s;
    pt[Phase::Backward] += t.backward_s;
}

/// Says that a step's update was skipped (`on_nonfinite = "skip"`).
pub fn say_skipped(step: u64, out: &StepOutcome, skipped: u64) {
    say!(
        "step {step}: loss {}, gradient norm {}: not finite; update skipped ([optim] on_nonfinite = \"skip\"; {skipped} skipped so far)",
        out.loss,
        out.grad_norm
    );
}
