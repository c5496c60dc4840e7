//! One optimiser step, on any backend and any layout: the micro-steps with gradient
//! accumulation (run in the pipeline schedule's order: forward then backward of each
//! micro-batch on one stage), the global-batch loss, the gradient reduction, the global norm
//! and clipping, and AdamW. What the training loop runs each step and what the benches time.
//!
//! The loss is normalised by the number of target tokens in the whole global batch, reduced
//! before any backward, so every layout and every `grad_accum` computes the same gradient up
//! to summation order (`docs/model.md`).

use super::state::{ModelState, Start};
use crate::backend::Backend;
use crate::config::{ActCkpt, OnNonFinite, OptimCfg, PpSchedule, Resolved};
use crate::data::{open_sources, Loader, Sources};
use crate::metrics::{Phase, PhaseTimes};
use crate::model::hooks::{AttentionSchedule, Hooks, TensorParallel};
use crate::model::params::Dims;
use crate::model::{Model, Tokens, WeightGradWork};
use crate::optim::{clip_coefficient, lr_at};
use crate::parallel::collective::MeshCollectives;
use crate::parallel::mesh::Mesh;
use crate::parallel::pp::schedule::{actions, Action};
use crate::parallel::pp::{chunks, rank_dims, Chunk, Direction, Offset, PipeComm};
use crate::parallel::tp::Megatron;
use crate::run::faults::{self, Fault};
use crate::run::watchdog::beat;
use crate::run::{AgreedFailure, Error};
use crate::say;
use std::time::Instant;

mod evaluate;

/// A micro-batch as this rank uses it: its index, this cp rank's inputs and targets, and
/// their global positions.
type LocalBatch = (usize, Vec<u32>, Vec<u32>, Vec<usize>);

/// A pipeline chunk and a micro-batch: what a model or kept work belongs to.
type ChunkMicro = (usize, usize);

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

/// This rank's pieces of the model (one per pipeline chunk; one without a pipeline) and the
/// activations of the micro-batches in flight: one `Model` per micro-batch a chunk holds at
/// once, reused from step to step (so the schedule's in-flight count is the memory held).
struct Pieces<'g, B: Backend<f32>> {
    be: B,
    chunks: Vec<Chunk>,
    dims: Vec<Dims>,
    ckpt: ActCkpt,
    /// Models of each chunk not holding a micro-batch.
    free: Vec<Vec<Model<f32, B>>>,
    /// Models holding a micro-batch's activations, with their (chunk, micro-batch).
    busy: Vec<(ChunkMicro, Model<f32, B>)>,
    /// Zero bubble: the weight-gradient operands of backwards whose weight gradient is still
    /// to come, with their (chunk, micro-batch), and spare ones.
    deferred: Vec<(ChunkMicro, WeightGradWork<B::Buf>)>,
    spare_work: Vec<WeightGradWork<B::Buf>>,
    /// This rank's actions in each step.
    schedule: Vec<Action>,
    comm: PipeComm<'g>,
    /// The received activation or gradient of the action being run.
    received: B::Buf,
}

impl<'g, B: Backend<f32> + Clone> Pieces<'g, B> {
    fn take(&mut self, chunk: usize) -> Model<f32, B> {
        self.free[chunk].pop().unwrap_or_else(|| Model::on(self.be.clone(), self.dims[chunk].clone(), self.ckpt))
    }

    fn models(&self) -> impl Iterator<Item = &Model<f32, B>> {
        self.free.iter().flatten().chain(self.busy.iter().map(|(_, m)| m))
    }

    fn works(&self) -> impl Iterator<Item = &WeightGradWork<B::Buf>> {
        self.spare_work.iter().chain(self.deferred.iter().map(|(_, w)| w))
    }

    /// Removes and returns the entry of `(chunk, micro)` from `list`.
    fn take_busy<X>(list: &mut Vec<(ChunkMicro, X)>, key: ChunkMicro) -> X {
        let k = list.iter().position(|(k, _)| *k == key).expect("the schedule runs forward, backward and weight gradient in order");
        list.swap_remove(k).1
    }
}

/// This rank's piece of the model's tensors (its tp piece of its pipeline stage's blocks, and
/// the tensors outside the blocks where its stages run them), and its pipeline chunks.
pub fn rank_pieces(res: &Resolved, mesh: &Mesh) -> (Dims, Vec<Chunk>) {
    let whole = Dims::new(&res.deck.model, mesh.tp.size(), mesh.tp.rank());
    let chunks = chunks(&res.stage_layers, mesh.pp.size(), mesh.pp.rank());
    (rank_dims(&whole, &chunks), chunks)
}

/// The model, its state and its data on one rank, stepped together.
pub struct Trainer<'g, B: Backend<f32>> {
    pieces: Pieces<'g, B>,
    pub state: ModelState<'g, B>,
    pub loader: Loader,
    /// The held-out samples `[eval]` names, in sequential order.
    held_out: Option<Loader>,
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
        let (dims, chunks) = rank_pieces(res, mesh);
        let dp_rank = mesh.coords.dp_rank(&res.layout);
        let (s, mb) = (tcfg.seq_len, tcfg.micro_batch);
        let loader = Loader::new(&deck.data, sources.train, s, mb, res.global_batch, res.layout.dp(), dp_rank, deck.run.seed)?;
        let sequential = crate::config::DataCfg { order: crate::config::Order::Sequential, ..deck.data.clone() };
        let held_out = sources
            .held_out
            .map(|src| Loader::new(&sequential, src, s, mb, res.global_batch, res.layout.dp(), dp_rank, deck.run.seed))
            .transpose()?;
        let v = chunks.len();
        // Without a pipeline, 1F1B on one stage is forward and backward of each micro-batch.
        let schedule = if mesh.pp.size() == 1 { PpSchedule::OneFOneB } else { p.pp_schedule };
        let pieces = Pieces {
            dims: chunks.iter().map(|c| dims.stage(c.layer_ids.clone(), c.embed, c.head)).collect(),
            free: (0..v).map(|_| vec![]).collect(),
            busy: vec![],
            deferred: vec![],
            spare_work: vec![],
            schedule: actions(schedule, mesh.pp.size(), v, mesh.pp.rank(), res.grad_accum),
            comm: PipeComm::new(&mesh.pp, v),
            received: Default::default(),
            chunks,
            ckpt: tcfg.activation_checkpointing,
            be,
        };
        Ok(Trainer {
            pieces,
            state,
            loader,
            held_out,
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
        self.comms.settle();
        pt[Phase::Optimizer] += t_opt.elapsed().as_secs_f64();
        Ok(StepOutcome { loss, grad_norm, lr, updated, phases: pt })
    }

    /// The backend of this rank's model.
    pub fn backend(&self) -> &B {
        &self.pieces.be
    }

    /// Bytes of activation memory this rank's model pieces hold (every micro-batch in flight
    /// at the schedule's peak), with zero bubble's kept weight-gradient operands.
    pub fn activation_bytes(&self) -> usize {
        let p = &self.pieces;
        p.models().map(|m| m.activation_bytes()).sum::<usize>() + p.works().map(|w| w.bytes(&p.be)).sum::<usize>()
    }

    /// Visible (query, key) pairs processed by attention since the last call.
    pub fn take_attention_pairs(&mut self) -> u64 {
        let p = &mut self.pieces;
        p.free.iter_mut().flatten().map(|m| m.take_attention_pairs()).sum()
    }

    /// The step's micro-steps in the schedule's order: each micro-batch's forward and backward
    /// on this rank's pieces, activations and their gradients exchanged with the neighbouring
    /// pipeline stages, gradients accumulated into the shards. Returns the summed loss of this
    /// rank's tokens and the global number of target tokens.
    fn micro_steps(&mut self, step: u64, pt: &mut PhaseTimes) -> Result<(f64, f64), Error> {
        let (s, mb, ga) = (self.seq_len, self.micro_batch, self.grad_accum);
        let (cp, cp_rank) = (self.mesh.cp.size(), self.mesh.cp.rank());
        let s_local = s / cp;
        let start = Instant::now();
        let t_wait = start;
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
        let pieces = &mut self.pieces;
        // The residual stream's rows on this rank: what travels between stages.
        let rows = self.tp.local_rows(mb * s_local) * pieces.dims[0].d;
        let schedule = std::mem::take(&mut pieces.schedule);
        // Tokens of the micro-batches this rank has started, until its last action on them.
        let mut batches: Vec<LocalBatch> = vec![];
        let mut loss_sum = 0.0f64;
        // Zero bubble splits each backward: `Backward` is the input gradient, `Weight` the rest.
        let split = schedule.iter().any(|a| matches!(a, Action::Weight { .. }));
        for (i, &action) in schedule.iter().enumerate() {
            let (chunk, micro) = (action.chunk(), action.micro());
            let dir = match action {
                Action::Forward { .. } => Direction::Forward,
                Action::Backward { .. } | Action::Weight { .. } => Direction::Backward,
            };
            beat(|| format!("step {}: micro-step {} of {ga} ({action:?})", step + 1, micro + 1));
            let t0 = Instant::now();
            if !batches.iter().any(|b| b.0 == micro) {
                let batch = self.loader.micro_batch(step, micro)?;
                // This cp rank's chunks of every sequence, with their global positions.
                let (inputs, positions) = crate::parallel::cp::local_tokens(&batch.inputs, s, cp, cp_rank);
                let (targets, _) = crate::parallel::cp::local_tokens(&batch.targets, s, cp, cp_rank);
                batches.push((micro, inputs, targets, positions));
            }
            let c = &pieces.chunks[chunk];
            let (from_neighbour, to_neighbour) = match action {
                Action::Forward { .. } => (!c.embed, !c.head),
                Action::Backward { .. } => (!c.head, !c.embed),
                Action::Weight { .. } => (false, false),
            };
            // Post the next action's receive before this action computes, so it overlaps.
            if let Some(&next) = schedule.get(i + 1) {
                let nc = &pieces.chunks[next.chunk()];
                let receives = match next {
                    Action::Forward { .. } => Some(Direction::Forward).filter(|_| !nc.embed),
                    Action::Backward { .. } => Some(Direction::Backward).filter(|_| !nc.head),
                    Action::Weight { .. } => None,
                };
                if let Some(nd) = receives {
                    if !pieces.comm.posted(next.chunk(), nd) {
                        pieces.comm.post_recv(next.chunk(), nd, rows);
                    }
                }
            }
            let t1 = Instant::now();
            if from_neighbour {
                if !pieces.comm.posted(chunk, dir) {
                    pieces.comm.post_recv(chunk, dir, rows);
                }
                pieces.comm.recv(&pieces.be, chunk, dir, &mut pieces.received);
            }
            let t2 = Instant::now();
            let (_, inputs, targets, positions) = batches.iter().find(|b| b.0 == micro).expect("loaded above");
            let tok = Tokens { inputs, targets, positions, batch: mb, seq: s_local };
            let offset = pieces.chunks[chunk].offset;
            let received_buf = std::mem::take(&mut pieces.received);
            let received = from_neighbour.then_some(&received_buf);
            match action {
                Action::Forward { .. } => {
                    let mut model = pieces.take(chunk);
                    params.begin_micro_step();
                    loss_sum += model.forward_stage(&mut Offset { inner: params, offset }, &tok, hooks, received);
                    if to_neighbour {
                        pieces.comm.send(&pieces.be, chunk, dir, model.stage_output());
                    }
                    pieces.busy.push(((chunk, micro), model));
                }
                Action::Backward { .. } => {
                    let mut model = Pieces::<B>::take_busy(&mut pieces.busy, (chunk, micro));
                    params.begin_backward();
                    // Each chunk's last backward completes its units' gradients for the step.
                    grads.begin_micro_step(micro + 1 == ga);
                    let (mut w, mut g) = (Offset { inner: &mut *params, offset }, Offset { inner: &mut *grads, offset });
                    if split {
                        let mut work = pieces.spare_work.pop().unwrap_or_default();
                        model.backward_input_stage(&mut w, &mut g, loss_scale, hooks, received, &mut work);
                        pieces.deferred.push(((chunk, micro), work));
                    } else {
                        model.backward_stage(&mut w, &mut g, loss_scale, hooks, received);
                    }
                    params.end_micro_step();
                    if to_neighbour {
                        pieces.comm.send(&pieces.be, chunk, dir, model.input_grad());
                    }
                    pieces.free[chunk].push(model);
                    if chunk == 0 {
                        // Chunk 0's backward is this rank's last use of the micro-batch's tokens.
                        batches.retain(|b| b.0 != micro);
                    }
                }
                Action::Weight { .. } => {
                    let work = Pieces::<B>::take_busy(&mut pieces.deferred, (chunk, micro));
                    // The blocks' gradients of the micro-batch are complete only now.
                    grads.begin_micro_step(micro + 1 == ga);
                    work.apply(&pieces.be, &mut Offset { inner: &mut *grads, offset });
                    pieces.spare_work.push(work);
                }
            }
            pieces.received = received_buf;
            sync(&pieces.be)?;
            let t3 = Instant::now();
            // RUST_LOG=debug: each action's timeline, to see the schedule run.
            log::debug!(
                "step {} {action:?}: starts {:.4} s into the step, waited {:.4} s, computed {:.4} s",
                step + 1,
                (t1 - start).as_secs_f64(),
                (t2 - t1).as_secs_f64(),
                (t3 - t2).as_secs_f64()
            );
            pt[Phase::Data] += (t1 - t0).as_secs_f64();
            // Waiting for a neighbour's activation or gradient: the pipeline's bubble.
            pt[Phase::Wait] += (t2 - t1).as_secs_f64();
            pt[if dir == Direction::Forward { Phase::Forward } else { Phase::Backward }] += (t3 - t2).as_secs_f64();
        }
        pieces.schedule = schedule;
        let t_send = Instant::now();
        pieces.comm.finish();
        pt[Phase::Wait] += t_send.elapsed().as_secs_f64();
        debug_assert!(pieces.busy.is_empty(), "every micro-batch's backward ran");
        debug_assert!(params.all_released(), "every gathered block is freed by its last backward");
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
        // Only the last pipeline stage computes a loss: the others add zero.
        mesh.pp.all_reduce_sum_f64(&mut loss_buf);
        let loss = loss_buf[0] / n_tok;
        let grads = &mut self.state.grads;
        grads.finish_step();
        if self.tp.sequence_parallel {
            grads.sum_replicated_over(self.comms.tp);
        }
        self.state.sum_tied_embedding(&mesh.pp);
        if faults::fires(&self.nan_grad, mesh.world.rank(), step + 1) {
            let fault = self.nan_grad.clone().expect("it fired");
            self.poison(&fault)?;
        }
        // Global norm from the shards' squares, reduced once over the fsdp group (every dp_rep
        // replica already holds the same reduced shards).
        let mut sq = [self.state.grads.local_sq_sum(mesh.tp.rank() == 0)];
        mesh.fsdp.all_reduce_sum_f64(&mut sq);
        mesh.tp.all_reduce_sum_f64(&mut sq);
        mesh.pp.all_reduce_sum_f64(&mut sq);
        pt[Phase::Comm] += t_comm.elapsed().as_secs_f64();
        Ok((loss, sq[0].sqrt()))
    }

    /// Waits for the device's queued work; a failed device operation (or the injected one of
    /// `NDTRAIN_DEBUG_DEVICE_ERROR`) ends the run on this rank, naming the device.
    fn synchronize(&self, s1: u64) -> Result<(), Error> {
        let be = &self.pieces.be;
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
