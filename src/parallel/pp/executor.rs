//! The pipeline executor: runs one rank's actions of a schedule on its model chunks — the
//! forwards, the backwards (whole, or zero bubble's input gradient) and the deferred weight
//! gradients — with the activations and their gradients exchanged between neighbouring stages.
//!
//! A training step runs the schedule of `[parallel] pp_schedule` ([`schedule::actions`]); an
//! evaluation runs the forward-only schedule ([`schedule::forward_only`]) through the same
//! loop, without gradients. Without a pipeline (one stage, one chunk) the training schedule is
//! the forward and backward of each micro-batch in turn, which is gradient accumulation.
//!
//! The executor keeps one `Model` per micro-batch a chunk holds at once, reused from step to
//! step, so the schedule's in-flight count is the activation memory held; zero bubble's
//! weight-gradient operands are kept the same way. Before an action computes, the receive of
//! the next action's activation or gradient is posted, so the transfer overlaps the compute.

use super::schedule::{self, Action};
use super::{Chunk, Direction, Offset, PipeComm};
use crate::backend::Backend;
use crate::config::{ActCkpt, PpSchedule};
use crate::model::hooks::Hooks;
use crate::model::params::Dims;
use crate::model::{Model, Tokens, WeightGradWork};
use crate::parallel::comm::Group;
use crate::parallel::cp::LocalBatch;
use crate::parallel::fsdp::grads::FsdpGrads;
use crate::parallel::fsdp::params::FsdpParams;
use std::time::Instant;

/// An error that ends the run on this rank.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// What a schedule runs: a training step's forwards and backwards, accumulating gradients
/// scaled by `loss_scale` (1 / the global number of target tokens) into `grads`, or the
/// forwards of an evaluation.
pub enum Pass<'a, 'g, B: Backend<f32>> {
    Train { grads: &'a mut FsdpGrads<'g, B>, loss_scale: f32 },
    Evaluate,
}

/// What a schedule's forwards summed over this rank's sequences: the cross entropy of their
/// tokens, and a mixture of experts' auxiliary loss of each sequence (zero off the last stage).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossSums {
    pub cross_entropy: f64,
    pub aux: f64,
}

impl std::ops::AddAssign for LossSums {
    fn add_assign(&mut self, o: LossSums) {
        self.cross_entropy += o.cross_entropy;
        self.aux += o.aux;
    }
}

/// Seconds a schedule spent, by what it did: loading micro-batches and posting receives,
/// waiting for a neighbour's activation or gradient (the pipeline's bubble), and computing
/// forwards and backwards (weight gradients count as backward).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScheduleTimes {
    pub data_s: f64,
    pub wait_s: f64,
    pub forward_s: f64,
    pub backward_s: f64,
}

impl ScheduleTimes {
    /// Adds an action's times from its four instants: start, inputs ready (its micro-batch
    /// loaded, the next receive posted), its neighbour's message received, done.
    fn add(&mut self, action: Action, [t0, t1, t2, t3]: [Instant; 4]) {
        self.data_s += (t1 - t0).as_secs_f64();
        self.wait_s += (t2 - t1).as_secs_f64();
        let compute = (t3 - t2).as_secs_f64();
        match action {
            Action::Forward { .. } => self.forward_s += compute,
            Action::Backward { .. } | Action::Weight { .. } => self.backward_s += compute,
        }
    }
}

/// What one forward or backward runs on: its chunk, micro-batch, the input a neighbour sent
/// (none where the chunk runs the embedding, or the head in backward), and the model's hooks.
struct Step<'a, 'h, B: Backend<f32>> {
    chunk: usize,
    micro: usize,
    input: Option<&'a B::Buf>,
    hooks: Hooks<'h, f32, B>,
}

/// A pipeline chunk and a micro-batch: what a model or kept work belongs to.
type ChunkMicro = (usize, usize);

/// One rank's model chunks, the activations of the micro-batches in flight, and its actions.
pub struct Executor<'g, B: Backend<f32>> {
    be: B,
    chunks: Vec<Chunk>,
    /// Each chunk's piece of the model.
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
    /// This rank's actions in a training step, of `micro_batches` micro-batches.
    train: Vec<Action>,
    micro_batches: usize,
    /// The training schedule splits each backward (zero bubble): `Backward` is the input
    /// gradient, `Weight` the rest.
    split_backward: bool,
    comm: PipeComm<'g>,
    /// The received activation or gradient of the action being run.
    received: B::Buf,
    /// Elements of an activation between stages (this rank's rows of the residual stream).
    message_len: usize,
    /// A mixture of experts: elements of the expert loads that travel after each activation
    /// and gradient (each f64 as two f32, [`f64_pairs`]); 0 without experts.
    loads_len: usize,
    /// The loads received with [`Self::received`].
    received_loads: Vec<f32>,
    /// A mixture of experts: this step's choices of this rank's rows, per expert block of the
    /// model (`Dims::moe_layers` of them, in model order) and expert; empty without experts.
    expert_counts: Vec<u64>,
}

impl<'g, B: Backend<f32> + Clone> Executor<'g, B> {
    /// The executor of this rank's `chunks` (the stage pieces of the rank's model `dims`) under
    /// `schedule` with `micro_batches` per step, exchanging `message_len` elements per
    /// activation (and `loads_len` of expert loads after it) with its neighbours in the
    /// pipeline group `pp`.
    pub fn new(
        be: B,
        (dims, chunks): (&Dims, Vec<Chunk>),
        ckpt: ActCkpt,
        (schedule, micro_batches): (PpSchedule, usize),
        pp: &'g Group,
        (message_len, loads_len): (usize, usize),
    ) -> Self {
        let (rank, v) = (pp.rank(), chunks.len());
        let pp_size = pp.size();
        // Without a pipeline, 1F1B on one stage is forward and backward of each micro-batch.
        let schedule = if pp_size == 1 { PpSchedule::OneFOneB } else { schedule };
        let train = schedule::actions(schedule, pp_size, v, rank, micro_batches);
        Executor {
            split_backward: train.iter().any(|a| matches!(a, Action::Weight { .. })),
            train,
            micro_batches,
            dims: chunks.iter().map(|c| dims.stage(c.layer_ids.clone(), c.embed, c.head)).collect(),
            free: (0..v).map(|_| vec![]).collect(),
            busy: vec![],
            deferred: vec![],
            spare_work: vec![],
            comm: PipeComm::new(pp, v),
            received: Default::default(),
            chunks,
            ckpt,
            be,
            message_len,
            loads_len,
            received_loads: vec![],
            expert_counts: vec![],
        }
    }

    /// The backend the chunks run on.
    pub fn backend(&self) -> &B {
        &self.be
    }

    /// Bytes of activation memory the chunks' models hold (every micro-batch in flight at the
    /// schedule's peak), with zero bubble's kept weight-gradient operands.
    pub fn activation_bytes(&self) -> usize {
        let models = self.free.iter().flatten().chain(self.busy.iter().map(|(_, m)| m));
        let works = self.spare_work.iter().chain(self.deferred.iter().map(|(_, w)| w));
        models.map(|m| m.activation_bytes()).sum::<usize>() + works.map(|w| w.bytes(&self.be)).sum::<usize>()
    }

    /// Visible (query, key) pairs processed by attention since the last call.
    pub fn take_attention_pairs(&mut self) -> u64 {
        self.free.iter_mut().flatten().map(|m| m.take_attention_pairs()).sum()
    }

    /// Runs a training step's schedule (`micro_batches` is then the step's), or with
    /// [`Pass::Evaluate`] the forward-only schedule of `micro_batches` micro-batches. `batch(m)`
    /// loads micro-batch `m` (called once, before its first action); `observe` hears of each
    /// action before it runs, as text for people (the watchdog's heartbeat). Returns the summed
    /// losses of this rank's tokens (zero off the last stage) and where the time went.
    pub fn run(
        &mut self,
        mut pass: Pass<'_, 'g, B>,
        params: &mut FsdpParams<'g, B>,
        hooks: Hooks<'_, f32, B>,
        micro_batches: usize,
        batch: &mut dyn FnMut(usize) -> Result<LocalBatch, Error>,
        observe: &mut dyn FnMut(&dyn std::fmt::Display),
    ) -> Result<(LossSums, ScheduleTimes), Error> {
        let training = matches!(pass, Pass::Train { .. });
        let actions = if training { std::mem::take(&mut self.train) } else { schedule::forward_only(self.chunks.len(), micro_batches) };
        let outcome = self.run_actions(&actions, (&mut pass, params, hooks), micro_batches, batch, observe);
        if training {
            self.train = actions;
        }
        let (loss_sum, mut times) = outcome?;
        let t = Instant::now();
        self.comm.finish();
        times.wait_s += t.elapsed().as_secs_f64();
        debug_assert!(self.busy.is_empty(), "every micro-batch's backward ran");
        debug_assert!(params.all_released(), "every gathered block is freed by its last use");
        Ok((loss_sum, times))
    }

    /// The loop of [`Self::run`] over `actions`: each action's micro-batch loaded at its first
    /// use and dropped after its last, the next action's receive posted, this action's input
    /// received, the action run, and the device waited for (so the host's clock times it).
    fn run_actions(
        &mut self,
        actions: &[Action],
        (pass, params, hooks): (&mut Pass<'_, 'g, B>, &mut FsdpParams<'g, B>, Hooks<'_, f32, B>),
        micro_batches: usize,
        batch: &mut dyn FnMut(usize) -> Result<LocalBatch, Error>,
        observe: &mut dyn FnMut(&dyn std::fmt::Display),
    ) -> Result<(LossSums, ScheduleTimes), Error> {
        let last_use = schedule::last_use(actions, micro_batches);
        // The tokens of the micro-batches started and not yet past their last action.
        let mut loaded: Vec<(usize, LocalBatch)> = vec![];
        let (mut loss_sum, mut times, start) = (LossSums::default(), ScheduleTimes::default(), Instant::now());
        for (i, &action) in actions.iter().enumerate() {
            observe(&Progress { action, of: micro_batches });
            let (t0, micro) = (Instant::now(), action.micro());
            if !loaded.iter().any(|(m, _)| *m == micro) {
                loaded.push((micro, batch(micro)?));
            }
            if let Some(&next) = actions.get(i + 1) {
                self.post_receive(next);
            }
            let t1 = Instant::now();
            let received = self.receive(action);
            let t2 = Instant::now();
            let (_, tokens) = loaded.iter().find(|(m, _)| *m == micro).expect("loaded above");
            loss_sum += self.act(action, pass, params, hooks, tokens, received);
            if last_use[micro] == i {
                loaded.retain(|(m, _)| *m != micro);
            }
            self.be.synchronize().map_err(|e| format!("{}: {e}", self.be.describe()))?;
            times.add(action, [t0, t1, t2, Instant::now()]);
            log_action(action, (t1 - start, t2 - t1, t2.elapsed()));
        }
        Ok((loss_sum, times))
    }

    /// Where an action's input comes from and its output goes: (from a neighbour, to one).
    fn neighbours(&self, action: Action) -> (bool, bool) {
        let c = &self.chunks[action.chunk()];
        match action {
            Action::Forward { .. } => (!c.embed, !c.head),
            Action::Backward { .. } => (!c.head, !c.embed),
            Action::Weight { .. } => (false, false),
        }
    }

    /// Posts the receive `action` will need, if it needs one not yet posted.
    fn post_receive(&mut self, action: Action) {
        let dir = direction(action);
        if self.neighbours(action).0 && !self.comm.posted(action.chunk(), dir) {
            self.comm.post_recv(action.chunk(), dir, self.message_len + self.loads_len);
        }
    }

    /// Completes the receive of `action`'s input into [`Self::received`]; whether it had one.
    fn receive(&mut self, action: Action) -> bool {
        if !self.neighbours(action).0 {
            return false;
        }
        self.post_receive(action);
        self.comm.recv(&self.be, action.chunk(), direction(action), &mut self.received, &mut self.received_loads, self.loads_len);
        true
    }

    /// Runs one action on `tokens` (`received`: its input came from a neighbour, in
    /// [`Self::received`]); returns the loss it computed (a forward of the last stage's last
    /// chunk, else zero).
    fn act(
        &mut self,
        action: Action,
        pass: &mut Pass<'_, 'g, B>,
        params: &mut FsdpParams<'g, B>,
        hooks: Hooks<'_, f32, B>,
        tokens: &LocalBatch,
        received: bool,
    ) -> LossSums {
        let input = std::mem::take(&mut self.received);
        let step = Step { chunk: action.chunk(), micro: action.micro(), input: received.then_some(&input), hooks };
        let loss = match (action, pass) {
            (Action::Forward { .. }, pass) => self.forward(step, matches!(pass, Pass::Train { .. }), params, tokens),
            (Action::Backward { .. }, Pass::Train { grads, loss_scale }) => {
                self.backward(step, params, grads, *loss_scale);
                LossSums::default()
            }
            (Action::Weight { .. }, Pass::Train { grads, .. }) => {
                let work = take_entry(&mut self.deferred, (step.chunk, step.micro));
                // The blocks' gradients of the micro-batch are complete only now.
                grads.begin_micro_step(step.micro + 1 == self.micro_batches);
                work.apply(&self.be, &mut Offset { inner: &mut **grads, offset: self.chunks[step.chunk].offset });
                self.spare_work.push(work);
                LossSums::default()
            }
            (_, Pass::Evaluate) => unreachable!("an evaluation runs forwards only"),
        };
        self.received = input;
        loss
    }

    /// A chunk's forward of a micro-batch, its output sent on where a stage follows. In
    /// training the model keeps the activations until its backward; in an evaluation it is
    /// free again at once and the gathered weights are released.
    fn forward(&mut self, step: Step<'_, '_, B>, training: bool, params: &mut FsdpParams<'g, B>, tokens: &LocalBatch) -> LossSums {
        let mut model = self.take_model(step.chunk);
        if training {
            params.begin_micro_step();
        } else {
            params.begin_evaluation();
        }
        let s_local = tokens.positions.len();
        let tok = Tokens {
            inputs: &tokens.inputs,
            targets: &tokens.targets,
            positions: &tokens.positions,
            batch: tokens.inputs.len() / s_local.max(1),
            seq: s_local,
        };
        let offset = self.chunks[step.chunk].offset;
        if step.input.is_some() && self.loads_len > 0 {
            // The expert loads of the stages before, completed by this stage's.
            model.add_earlier_loads(&from_f64_pairs(&self.received_loads));
        }
        let cross_entropy = model.forward_stage(&mut Offset { inner: params, offset }, &tok, step.hooks, step.input);
        let loss = LossSums { cross_entropy, aux: if self.chunks[step.chunk].head { model.aux_loss_sum() } else { 0.0 } };
        if !self.chunks[step.chunk].head {
            let loads = self.loads_trailer(&model);
            self.comm.send(&self.be, step.chunk, Direction::Forward, model.stage_output(), &loads);
        }
        if training {
            self.count_choices(step.chunk, &model);
            self.busy.push(((step.chunk, step.micro), model));
        } else {
            params.end_micro_step();
            self.free[step.chunk].push(model);
        }
        loss
    }

    /// A chunk's backward of a micro-batch (under zero bubble only its input gradient, the
    /// weight gradient's operands kept), the gradient w.r.t. its input sent back where a stage
    /// precedes.
    fn backward(&mut self, step: Step<'_, '_, B>, params: &mut FsdpParams<'g, B>, grads: &mut FsdpGrads<'g, B>, loss_scale: f32) {
        let (chunk, micro) = (step.chunk, step.micro);
        let offset = self.chunks[chunk].offset;
        let mut model = take_entry(&mut self.busy, (chunk, micro));
        params.begin_backward();
        // Each chunk's last backward completes its units' gradients for the step.
        grads.begin_micro_step(micro + 1 == self.micro_batches);
        let (mut w, mut g) = (Offset { inner: &mut *params, offset }, Offset { inner: grads, offset });
        if step.input.is_some() && self.loads_len > 0 {
            // The whole model's loads, back from the last stage.
            model.set_loads(&from_f64_pairs(&self.received_loads));
        }
        if self.split_backward {
            let mut work = self.spare_work.pop().unwrap_or_default();
            model.backward_input_stage(&mut w, &mut g, loss_scale, step.hooks, step.input, &mut work);
            self.deferred.push(((chunk, micro), work));
        } else {
            model.backward_stage(&mut w, &mut g, loss_scale, step.hooks, step.input);
        }
        params.end_micro_step();
        if !self.chunks[chunk].embed {
            let loads = self.loads_trailer(&model);
            self.comm.send(&self.be, chunk, Direction::Backward, model.input_grad(), &loads);
        }
        self.free[chunk].push(model);
    }

    /// Adds a training forward's expert choices to the step's.
    fn count_choices(&mut self, chunk: usize, model: &Model<f32, B>) {
        let dims = &self.dims[chunk];
        let Some(e) = dims.moe.as_ref() else { return };
        let experts = e.router.experts;
        self.expert_counts.resize(dims.moe_layers() * experts, 0);
        for (&id, counts) in dims.layer_ids.iter().zip(model.block_expert_counts()) {
            // The expert blocks are the last ones: block `id` is the (id − first_dense)-th.
            if !counts.is_empty() {
                let at = (id - e.first_dense) * experts;
                self.expert_counts[at..at + experts].iter_mut().zip(counts).for_each(|(a, c)| *a += c);
            }
        }
    }

    /// This step's expert choices of this rank's rows (see `expert_counts`), reset for the
    /// next.
    pub fn take_expert_counts(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.expert_counts)
    }

    /// What travels after a chunk's activation or gradient: its model's expert loads.
    fn loads_trailer(&self, model: &Model<f32, B>) -> Vec<f32> {
        if self.loads_len == 0 {
            return vec![];
        }
        let t = to_f64_pairs(&model.packed_loads());
        debug_assert_eq!(t.len(), self.loads_len);
        t
    }

    fn take_model(&mut self, chunk: usize) -> Model<f32, B> {
        self.free[chunk].pop().unwrap_or_else(|| Model::on(self.be.clone(), self.dims[chunk].clone(), self.ckpt))
    }
}

/// The direction an action's input travels: forward for a forward's activation, backward for
/// a backward's gradient.
fn direction(action: Action) -> Direction {
    match action {
        Action::Forward { .. } => Direction::Forward,
        Action::Backward { .. } | Action::Weight { .. } => Direction::Backward,
    }
}

/// An action as people read it: "micro-batch 3 of 8: backward of chunk 0".
struct Progress {
    action: Action,
    of: usize,
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.action {
            Action::Forward { .. } => "forward",
            Action::Backward { .. } => "backward",
            Action::Weight { .. } => "weight gradient",
        };
        write!(f, "micro-batch {} of {}: {what} of chunk {}", self.action.micro() + 1, self.of, self.action.chunk())
    }
}

/// Each f64 as two f32, `hi = x` rounded and `lo = x − hi` rounded: their sum is `x` to about
/// 2⁻⁴⁸ relative (integers up to 2⁴⁸ exactly), so f64 statistics travel in the f32 messages.
fn to_f64_pairs(x: &[f64]) -> Vec<f32> {
    x.iter()
        .flat_map(|&v| {
            let hi = v as f32;
            [hi, (v - hi as f64) as f32]
        })
        .collect()
}

/// The inverse of [`to_f64_pairs`].
fn from_f64_pairs(x: &[f32]) -> Vec<f64> {
    x.chunks_exact(2).map(|p| p[0] as f64 + p[1] as f64).collect()
}

/// Removes and returns the entry of `key` from `list`.
fn take_entry<X>(list: &mut Vec<(ChunkMicro, X)>, key: ChunkMicro) -> X {
    let k = list.iter().position(|(k, _)| *k == key).expect("the schedule runs forward, backward and weight gradient in order");
    list.swap_remove(k).1
}

/// RUST_LOG=debug: each action's timeline (start into the step, wait, compute), to see the
/// schedule run.
fn log_action(action: Action, (at, waited, computed): (std::time::Duration, std::time::Duration, std::time::Duration)) {
    log::debug!(
        "{action:?}: starts {:.4} s into the schedule, waited {:.4} s, computed {:.4} s",
        at.as_secs_f64(),
        waited.as_secs_f64(),
        computed.as_secs_f64()
    );
}
