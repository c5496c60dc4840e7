//! One optimiser step, on any backend and any layout: the micro-steps with gradient
//! accumulation, the global-batch loss, the gradient reduction, the global norm and clipping,
//! and AdamW. What the training loop runs each step and what the benches time.
//!
//! The loss is normalised by the number of target tokens in the whole global batch, reduced
//! before any backward, so every layout and every `grad_accum` computes the same gradient up
//! to summation order (`docs/model.md`).

use super::state::{ModelState, Start};
use crate::backend::Backend;
use crate::config::{OnNonFinite, OptimCfg, Resolved};
use crate::data::{open_source, Loader, TokenSource};
use crate::metrics::{Phase, PhaseTimes};
use crate::model::hooks::{AttentionSchedule, Hooks};
use crate::model::params::Dims;
use crate::model::{Model, Tokens};
use crate::optim::{clip_coefficient, lr_at};
use crate::parallel::collective::MeshCollectives;
use crate::parallel::mesh::Mesh;
use crate::parallel::tp::Megatron;
use crate::run::faults::{self, Fault};
use crate::run::watchdog::beat;
use crate::run::{AgreedFailure, Error};
use crate::say;
use std::time::Instant;

/// What one step computed.
#[derive(Clone, Copy, Debug)]
pub struct StepOutcome {
    /// The global-batch loss, before the update.
    pub loss: f64,
    /// The global gradient norm, before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    /// False when `on_nonfinite = "skip"` skipped the update.
    pub updated: bool,
    pub phases: PhaseTimes,
}

/// The model, its state and its data on one rank, stepped together.
pub struct Trainer<'g, B: Backend<f32>> {
    pub model: Model<f32, B>,
    pub state: ModelState<'g, B>,
    pub loader: Loader,
    mesh: &'g Mesh,
    comms: MeshCollectives<'g, B::Buf>,
    tp: Megatron<'g, B::Buf>,
    attention: Box<dyn AttentionSchedule<f32, B> + 'g>,
    optim: OptimCfg,
    peak_lr: f64,
    steps: u64,
    seq_len: usize,
    micro_batch: usize,
    grad_accum: usize,
    /// `NDTRAIN_DEBUG_NAN_GRAD` and `NDTRAIN_DEBUG_DEVICE_ERROR` (`docs/debugging.md`).
    nan_grad: Option<Fault>,
    device_error: Option<Fault>,
}

impl<'g, B: Backend<f32> + Clone + 'g> Trainer<'g, B> {
    /// Everything one rank needs to step `res` on `be`, with the state `state` (initialised or
    /// loaded) and the data `source`.
    pub fn new(
        be: B,
        comms: MeshCollectives<'g, B::Buf>,
        res: &Resolved,
        mesh: &'g Mesh,
        state: ModelState<'g, B>,
        source: Box<dyn TokenSource>,
    ) -> Result<Self, Error> {
        let deck = &res.deck;
        let (tcfg, p) = (&deck.train, &deck.parallel);
        let dims = Dims::new(&deck.model, mesh.tp.size(), mesh.tp.rank());
        let dp_rank = mesh.coords.dp_rank(&res.layout);
        let (s, mb) = (tcfg.seq_len, tcfg.micro_batch);
        let loader = Loader::new(&deck.data, source, s, mb, res.global_batch, res.layout.dp(), dp_rank, deck.run.seed)?;
        Ok(Trainer {
            model: Model::on(be, dims, tcfg.activation_checkpointing),
            state,
            loader,
            mesh,
            tp: Megatron { group: comms.tp, sequence_parallel: p.sequence_parallel },
            attention: crate::parallel::cp::attention_schedule(comms.cp),
            comms,
            optim: deck.optim.clone(),
            peak_lr: res.lr,
            steps: deck.run.steps,
            seq_len: s,
            micro_batch: mb,
            grad_accum: res.grad_accum,
            nan_grad: faults::fault(faults::NAN_GRAD_ENV)?,
            device_error: faults::fault(faults::DEVICE_ERROR_ENV)?,
        })
    }

    /// A trainer of the seeded initial model (no checkpoint, no import): what the benches
    /// step.
    pub fn seeded(be: B, comms: MeshCollectives<'g, B::Buf>, res: &Resolved, mesh: &'g Mesh) -> Result<Self, Error> {
        let deck = &res.deck;
        let dims = Dims::new(&deck.model, mesh.tp.size(), mesh.tp.rank());
        let p = &deck.parallel;
        let start = Start::Seeded(deck.run.seed);
        let state = ModelState::new(&be, &dims, &comms, start, (p.reshard_after_forward, p.overlap), &deck.optim, mesh.dp_rep.rank() == 0);
        Self::new(be, comms, res, mesh, state, Self::open_data(res)?)
    }

    /// Opens the deck's data source (the same on every rank) for [`Trainer::new`].
    pub fn open_data(res: &Resolved) -> Result<Box<dyn TokenSource>, Error> {
        let deck = &res.deck;
        Ok(open_source(&deck.data, deck.model.vocab_size, deck.run.seed)?)
    }

    /// Optimiser step `step` (0-based): micro-steps, reductions, clipping, AdamW.
    pub fn step(&mut self, step: u64) -> Result<StepOutcome, Error> {
        let start = Instant::now();
        let mut pt = PhaseTimes::default();
        self.state.grads.zero();
        pt[Phase::Backward] += start.elapsed().as_secs_f64();
        let (loss_sum, n_tok) = self.micro_steps(step, &mut pt)?;
        let (loss, grad_norm) = self.reduce(step, loss_sum, n_tok, &mut pt)?;
        let t_opt = Instant::now();
        let lr = lr_at(&self.optim, self.peak_lr, step, self.steps);
        // The loss and the norm are global reductions: every rank takes the same branch.
        let updated = loss.is_finite() && grad_norm.is_finite();
        if updated {
            self.state.update(clip_coefficient(grad_norm, self.optim.grad_clip), lr);
        } else if self.optim.on_nonfinite == OnNonFinite::Abort {
            return Err(Box::new(self.nonfinite_failure(step + 1, loss, grad_norm)));
        }
        self.synchronize(step + 1)?;
        pt[Phase::Optimizer] += t_opt.elapsed().as_secs_f64();
        Ok(StepOutcome { loss, grad_norm, lr, updated, phases: pt })
    }

    /// The step's micro-steps: each micro-batch forward and backward, gradients accumulated
    /// into the shards. Returns the summed loss of this rank's tokens and the global number of
    /// target tokens.
    fn micro_steps(&mut self, step: u64, pt: &mut PhaseTimes) -> Result<(f64, f64), Error> {
        let (s, mb, ga) = (self.seq_len, self.micro_batch, self.grad_accum);
        let (cp, cp_rank) = (self.mesh.cp.size(), self.mesh.cp.rank());
        let s_local = s / cp;
        let t_wait = Instant::now();
        // The global number of target tokens, reduced before any backward: the loss is the
        // global sum over the global token count, exact for any layout and accumulation.
        let mut n_tok = [(ga * mb * s_local) as f64];
        self.mesh.batch.all_reduce_sum_f64(&mut n_tok);
        self.mesh.cp.all_reduce_sum_f64(&mut n_tok);
        // The first collective of the step: where a rank waits for the slowest of the last one.
        pt[Phase::Wait] += t_wait.elapsed().as_secs_f64();
        let loss_scale = (1.0 / n_tok[0]) as f32;
        let hooks = Hooks { tp: &self.tp, attention: self.attention.as_ref(), progress: crate::parallel::comm::progress };
        let (params, grads) = (&mut self.state.params, &mut self.state.grads);
        let mut loss_sum = 0.0f64;
        for micro in 0..ga {
            beat(|| format!("step {}: micro-step {} of {ga}", step + 1, micro + 1));
            let t0 = Instant::now();
            let batch = self.loader.micro_batch(step, micro)?;
            let t1 = Instant::now();
            // This cp rank's chunks of every sequence, with their global positions.
            let (inputs, positions) = crate::parallel::cp::local_tokens(&batch.inputs, s, cp, cp_rank);
            let (targets, _) = crate::parallel::cp::local_tokens(&batch.targets, s, cp, cp_rank);
            let tok = Tokens { inputs: &inputs, targets: &targets, positions: &positions, batch: mb, seq: s_local };
            params.begin_micro_step();
            grads.begin_micro_step(micro + 1 == ga);
            loss_sum += self.model.forward_with(params, &tok, hooks);
            sync(self.model.backend())?;
            let t2 = Instant::now();
            params.begin_backward();
            self.model.backward_with(params, grads, loss_scale, hooks);
            params.end_micro_step();
            sync(self.model.backend())?;
            let t3 = Instant::now();
            pt[Phase::Data] += (t1 - t0).as_secs_f64();
            pt[Phase::Forward] += (t2 - t1).as_secs_f64();
            pt[Phase::Backward] += (t3 - t2).as_secs_f64();
        }
        Ok((loss_sum, n_tok[0]))
    }

    /// After the last micro-step: the global-batch loss, the gradients' reduction over the
    /// data-parallel groups, and the global norm.
    fn reduce(&mut self, step: u64, loss_sum: f64, n_tok: f64, pt: &mut PhaseTimes) -> Result<(f64, f64), Error> {
        beat(|| format!("step {}: gradient reduction and norm", step + 1));
        let t_comm = Instant::now();
        let mesh = self.mesh;
        let mut loss_buf = [loss_sum];
        mesh.batch.all_reduce_sum_f64(&mut loss_buf);
        mesh.cp.all_reduce_sum_f64(&mut loss_buf);
        let loss = loss_buf[0] / n_tok;
        let grads = &mut self.state.grads;
        grads.finish_step();
        if self.tp.sequence_parallel {
            grads.sum_replicated_over(self.comms.tp);
        }
        if faults::fires(&self.nan_grad, mesh.world.rank(), step + 1) {
            let fault = self.nan_grad.clone().expect("it fired");
            self.poison(&fault)?;
        }
        // Global norm from the shards' squares, reduced once over the fsdp group (every dp_rep
        // replica already holds the same reduced shards).
        let mut sq = [self.state.grads.local_sq_sum(mesh.tp.rank() == 0)];
        mesh.fsdp.all_reduce_sum_f64(&mut sq);
        mesh.tp.all_reduce_sum_f64(&mut sq);
        pt[Phase::Comm] += t_comm.elapsed().as_secs_f64();
        Ok((loss, sq[0].sqrt()))
    }

    /// Waits for the device's queued work; a failed device operation (or the injected one of
    /// `NDTRAIN_DEBUG_DEVICE_ERROR`) ends the run on this rank, naming the device.
    fn synchronize(&self, s1: u64) -> Result<(), Error> {
        let be = self.model.backend();
        if faults::fires(&self.device_error, self.mesh.world.rank(), s1) {
            return Err(format!("{}: a device operation failed ({} at step {s1})", be.describe(), faults::DEVICE_ERROR_ENV).into());
        }
        sync(be)
    }

    /// `NDTRAIN_DEBUG_NAN_GRAD`: NaN into the first element this rank holds of the named
    /// tensor's gradient.
    fn poison(&mut self, f: &Fault) -> Result<(), Error> {
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
        let world = &self.mesh.world;
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

/// Waits for `be`'s queued work (so the host's clock times it), naming the device if it failed.
fn sync<B: Backend<f32>>(be: &B) -> Result<(), Error> {
    be.synchronize().map_err(|e| format!("{}: {e}", be.describe()).into())
}

/// Says that a step's update was skipped (`on_nonfinite = "skip"`).
pub fn say_skipped(step: u64, out: &StepOutcome, skipped: u64) {
    say!(
        "step {step}: loss {}, gradient norm {}: not finite; update skipped ([optim] on_nonfinite = \"skip\"; {skipped} skipped so far)",
        out.loss,
        out.grad_norm
    );
}
