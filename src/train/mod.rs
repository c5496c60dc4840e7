//! The training loop: one loop for every backend and every layout.
//!
//! [`train`] reads as its phases: load or resume the model state, then per step the step
//! itself ([`step::Trainer::step`]: micro-steps, reductions, clipping, AdamW), the stop check,
//! the checkpoint when one is due, and the logs; then the end-of-run summary. The model state
//! is this rank's shards on the backend ([`state::ModelState`]); the parallel strategies come
//! from `parallel`, applied through the model's hooks, with the mesh's collectives on the
//! backend's buffers. Knows nothing of MPI beyond the mesh's groups.

mod checkpointing;
mod summary;

pub mod state;
pub mod step;

use crate::backend::Backend;
use crate::config::Resolved;
use crate::io::checkpoint as ckpt;
use crate::metrics::{
    fmt_duration, rss_bytes, CheckpointIoLog, ExpertLoadCsv, MemoryStats, MetricsCsv, Phase, PhaseTimes, StepRecord, StepTiming, TimingLog,
};
use crate::parallel::collective::MeshCollectives;
use crate::parallel::comm::CommCount;
use crate::parallel::mesh::Mesh;
use crate::run::stop::{Stop, StopPolicy};
use crate::run::watchdog::{beat, Watchdog};
use crate::say;
use checkpointing::Stall;
use state::{ModelState, Start};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use step::{say_skipped, StepOutcome, Trainer};

pub use crate::run::{AgreedFailure, Error};

/// What a finished run reports to its caller (tests read it; the console has printed it).
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// The losses of the steps this invocation ran.
    pub losses: Vec<f64>,
    pub entropy_floor: Option<f64>,
    pub activation_bytes: usize,
    pub mean_step_s: f64,
    /// The run stopped early to be continued — a stop signal, `[run] max_walltime` or the
    /// batch job's time limit, or `[run] stop_after_steps` — after writing a checkpoint.
    pub preempted: bool,
    /// Steps whose update `on_nonfinite = "skip"` skipped.
    pub skipped_steps: u64,
    /// Steps taken before this invocation (the checkpoint it resumed from; 0 when fresh): the
    /// steps it ran are `first_step + 1 ..= first_step + losses.len()`.
    pub first_step: u64,
    /// The validation loss after the last step, where the run measured one.
    pub final_val_loss: Option<f64>,
    /// Tokens per step of the whole job.
    pub tokens_per_step: usize,
    pub flops_per_token: f64,
    /// The rate MFU is stated against, per rank.
    pub peak_flops: f64,
    pub world_size: usize,
    /// The checkpoints this invocation wrote: step and file.
    pub checkpoints: Vec<(u64, PathBuf)>,
    /// The training loop's wall time, from its first step to the summary, seconds.
    pub train_s: f64,
}

/// The FLOP rate per rank MFU is stated against, and where it comes from.
#[derive(Clone, Debug)]
pub struct Peak {
    pub flops: f64,
    pub source: String,
}

/// Trains for `[run] steps` optimiser steps on backend `be`, with the mesh's collectives on its
/// buffers `comms`, and writes the run's logs under `out_dir`.
pub fn train<B: Backend<f32> + Clone>(
    be: B,
    comms: MeshCollectives<'_, B::Buf>,
    res: &Resolved,
    mesh: &Mesh,
    out_dir: &Path,
    peak: Peak,
) -> Result<RunSummary, Error> {
    // Load or resume: the model state, the data, the logs.
    let mut run = Run::start(be, comms, res, mesh, out_dir, peak)?;
    for step in run.first_step..run.steps {
        let (s1, start) = (step + 1, Instant::now());
        run.injected_faults(s1)?;
        // Micro-steps, reductions, clipping, the optimiser step.
        let mut out = run.trainer.step(step)?;
        run.stepped(s1, &out, start);
        let stop = run.stop_requested(s1, &mut out.phases);
        run.advance_checkpoint(&mut out.phases)?;
        if run.checkpoint_due(s1) {
            run.checkpoint(s1, &mut out.phases)?;
        }
        if stop.is_some() {
            // The exit code says a checkpoint is in place: it must be, before the exit.
            run.drain_checkpoint(Some(&mut out.phases))?;
        }
        // No held-out loss on the way out: the stop may be short of time.
        let val_loss = if stop.is_none() { run.evaluate_if_due(s1, &mut out.phases)? } else { None };
        run.log(s1, &out, start, val_loss)?;
        if let Some(why) = stop {
            say!("{why}: checkpoint of step {s1} written; exiting with code {} so the job can be requeued", crate::exit::PREEMPTED);
            break;
        }
    }
    // The write of the last checkpoint; the summary across ranks, the invariants, the export.
    run.drain_checkpoint(None)?;
    run.finish()
}

/// The longest a run stays silent on the console, in seconds.
const CONSOLE_EVERY_S: f64 = 300.0;

/// The checkpoints of a run: where they go, their record (`checkpoint_io.csv`, rank 0), those
/// written so far (step and file), the one being written and what it stalled training at its
/// step, and the snapshot buffers between writes.
struct Checkpoints {
    dir: PathBuf,
    log: Option<CheckpointIoLog>,
    written: Vec<(u64, PathBuf)>,
    in_flight: Option<(ckpt::InFlight, Stall)>,
    snapshot: ckpt::Snapshot,
    snapshot_bytes: u64,
}

/// The run's logs: `metrics.csv` (rank 0), this rank's timing log, the time spent writing the
/// previous step's logs (the timing log's `log_s`), and when the console last had a line (one
/// at least every `CONSOLE_EVERY_S`).
struct Logs {
    metrics: Option<MetricsCsv>,
    /// Rank 0, with experts.
    expert_load: Option<ExpertLoadCsv>,
    timing: TimingLog,
    last_log_s: f64,
    last_line: Instant,
}

/// What the steps of this job measured: each step's loss and training time (no checkpoint,
/// no logging), the held-out losses with their step, the phase totals and the skipped updates.
#[derive(Default)]
struct History {
    losses: Vec<f64>,
    val_losses: Vec<(u64, f64)>,
    step_times: Vec<f64>,
    totals: PhaseTimes,
    skipped: u64,
}

/// This job's pace, for the ETA: when the loop started, and the job's elapsed seconds at the
/// end of its first step, which carries one-off costs (thread start-up, first touch of every
/// buffer) the ETA leaves out.
struct Pace {
    start: Instant,
    first_step_end_s: Option<f64>,
}

/// The rates MFU is computed from: FLOPs per token and the peak per rank.
struct Rates {
    flops_per_token: f64,
    peak: f64,
}

/// One rank's run: the trainer and everything the loop records around it.
struct Run<'g, B: Backend<f32>> {
    trainer: Trainer<'g, B>,
    res: &'g Resolved,
    mesh: &'g Mesh,
    /// The checkpoint this job resumed from (0 when fresh) and the run's last step.
    first_step: u64,
    steps: u64,
    stop: StopPolicy,
    /// The run stopped early (a signal, a time limit, the job's quota), after a checkpoint.
    preempted: bool,
    ckpt: Checkpoints,
    logs: Logs,
    history: History,
    pace: Pace,
    rates: Rates,
    entropy_floor: Option<f64>,
    watchdog: Option<Watchdog>,
}

impl<'g, B: Backend<f32> + Clone + 'g> Run<'g, B> {
    /// Load or resume: the model state (seeded, resumed or imported), the data, the logs.
    fn start(
        be: B,
        comms: MeshCollectives<'g, B::Buf>,
        res: &'g Resolved,
        mesh: &'g Mesh,
        out_dir: &Path,
        peak: Peak,
    ) -> Result<Self, Error> {
        let deck = &res.deck;
        let ckpt_dir = deck.checkpoint_dir();
        let candidates = ckpt::resume_candidates(&deck.checkpoint.resume, &ckpt_dir)?;
        let from_files = !candidates.is_empty() || !deck.checkpoint.init_from.is_empty();
        let rss_before_load = rss_bytes();
        let load_start = Instant::now();
        // This rank's shards (the whole model when the fsdp degree is 1): tensors are first cut
        // for tensor parallelism (this tp rank's piece), then sharded over fsdp. A resumed or
        // imported model is read slice by slice into zero shards.
        let (dims, _) = crate::parallel::pp::rank_pieces(res, mesh);
        let start = if from_files { Start::Empty } else { Start::Seeded(deck.run.seed) };
        let overlap = (deck.parallel.reshard_after_forward, deck.parallel.overlap);
        let mut state = ModelState::new(&be, &dims, &comms, start, overlap, &deck.optim, mesh.dp_rep.rank() == 0);
        let rank0 = mesh.world.rank() == 0;
        let resumed_at = if candidates.is_empty() { 0 } else { u64::MAX };
        let mut ckpt_log = rank0.then(|| CheckpointIoLog::create(&out_dir.join("checkpoint_io.csv"), resumed_at)).transpose()?;
        let first_step = checkpointing::load(&mut state, &candidates, res, mesh, &mut ckpt_log, (load_start, rss_before_load))?;

        let sources = Trainer::<B>::open_data(res)?;
        let entropy_floor = sources.train.entropy_floor(deck.train.seq_len);
        summary::say_data(&sources, entropy_floor);
        let trainer = Trainer::new(be, comms, res, mesh, state, sources)?;
        summary::warn_if_data_wraps(res, trainer.data.loader.samples_per_epoch());

        let metrics = rank0.then(|| MetricsCsv::create(&out_dir.join("metrics.csv"), first_step)).transpose()?;
        let m = &deck.model;
        let expert_load = (rank0 && m.is_moe())
            .then(|| ExpertLoadCsv::create(&out_dir.join("expert_load.csv"), first_step, m.first_dense_layers, m.n_experts))
            .transpose()?;
        let timing = TimingLog::create(&out_dir.join("timing"), mesh.world.rank(), first_step, rss_before_load)?;
        let flops_per_token = crate::metrics::flops_per_token(&deck.model, deck.train.seq_len);
        summary::say_model(res, trainer.backend().describe(), &peak, flops_per_token);
        crate::run::preempt::install()?;
        let steps = deck.run.steps;
        if first_step >= steps {
            say!("the checkpoint is at step {first_step}, [run] steps = {steps}: nothing left to train");
        }
        Ok(Run {
            trainer,
            res,
            mesh,
            first_step,
            steps,
            stop: StopPolicy::new(&deck.run, first_step),
            preempted: false,
            ckpt: Checkpoints {
                dir: ckpt_dir,
                log: ckpt_log,
                written: vec![],
                in_flight: None,
                snapshot: ckpt::Snapshot::default(),
                snapshot_bytes: 0,
            },
            logs: Logs { metrics, expert_load, timing, last_log_s: 0.0, last_line: Instant::now() },
            history: History { losses: Vec::with_capacity(steps as usize), ..Default::default() },
            pace: Pace { start: Instant::now(), first_step_end_s: None },
            rates: Rates { flops_per_token, peak: peak.flops },
            entropy_floor,
            watchdog: Watchdog::start(Duration::from_secs_f64(deck.run.watchdog_seconds), mesh.world.rank()),
        })
    }

    /// The debug options that make this rank fail or hang at step `s1` (`docs/debugging.md`).
    fn injected_faults(&self, s1: u64) -> Result<(), Error> {
        beat(|| format!("step {s1}: start"));
        Ok(self.trainer.faults.at_step_start(self.mesh.world.rank(), s1)?)
    }

    /// Records step `s1`'s training time and loss.
    fn stepped(&mut self, s1: u64, out: &StepOutcome, start: Instant) {
        let h = &mut self.history;
        if !out.updated {
            h.skipped += 1;
            say_skipped(s1, out, h.skipped);
        }
        h.step_times.push(start.elapsed().as_secs_f64());
        h.losses.push(out.loss);
        if let Some(d) = self.trainer.faults.step_delay {
            std::thread::sleep(d);
        }
    }

    /// Whether the run stops after step `s1`, and why (`run::stop`): agreed at this step
    /// boundary, so every rank stops here, with a checkpoint.
    fn stop_requested(&mut self, s1: u64, pt: &mut PhaseTimes) -> Option<Stop> {
        let t = Instant::now();
        let stop = self.stop.at_boundary(s1, &self.mesh.world);
        pt[Phase::Wait] += t.elapsed().as_secs_f64();
        self.preempted = stop.is_some();
        stop
    }

    /// A checkpoint after step `s1`: every `[checkpoint] every` steps, at the last step, and
    /// when the run stops early.
    fn checkpoint_due(&self, s1: u64) -> bool {
        let every = self.res.deck.checkpoint.every;
        self.preempted || (every > 0 && (s1 % every == 0 || s1 == self.steps))
    }

    /// The checkpoint after step `s1`: the write before it, if still in flight, is waited for
    /// (at most one is in flight); then the snapshot, and with `[checkpoint] async = false`
    /// the write itself.
    fn checkpoint(&mut self, s1: u64, pt: &mut PhaseTimes) -> Result<(), Error> {
        beat(|| format!("step {s1}: writing a checkpoint"));
        let t = Instant::now();
        self.drain_checkpoint(None)?;
        let own = Instant::now();
        let c = &mut self.ckpt;
        let snapshot = std::mem::take(&mut c.snapshot);
        let in_flight = checkpointing::begin(&self.trainer.state, self.res, self.mesh, (&c.dir, s1), snapshot, &self.trainer.faults)?;
        c.snapshot_bytes = in_flight.snapshot_bytes;
        let stall = Stall { snapshot_s: in_flight.snapshot_s, stall_s: own.elapsed().as_secs_f64() };
        c.in_flight = Some((in_flight, stall));
        if !self.res.deck.checkpoint.asynchronous {
            self.drain_checkpoint(None)?;
        }
        let secs = t.elapsed().as_secs_f64();
        pt[Phase::Checkpoint] += secs;
        self.stop.stalled(secs);
        Ok(())
    }

    /// Moves the checkpoint in flight on at this step boundary (every rank together), and
    /// records it once it is in place.
    fn advance_checkpoint(&mut self, pt: &mut PhaseTimes) -> Result<(), Error> {
        let Some((w, _)) = self.ckpt.in_flight.as_mut() else { return Ok(()) };
        let t = Instant::now();
        let done = w.poll(&self.mesh.world).map_err(|e| checkpointing::write_failed(self.mesh, e))?;
        let polled = t.elapsed().as_secs_f64();
        if let Some(done) = done {
            let (_, stall) = self.ckpt.in_flight.take().expect("in flight");
            self.recorded(done, Stall { stall_s: stall.stall_s + polled, ..stall })?;
        }
        // Recording it is part of what the checkpoint cost the step.
        let secs = t.elapsed().as_secs_f64();
        pt[Phase::Checkpoint] += secs;
        self.stop.stalled(secs);
        Ok(())
    }

    /// Waits for the checkpoint in flight, if any, and records it; returns the seconds waited
    /// (counted in `pt` when given).
    fn drain_checkpoint(&mut self, pt: Option<&mut PhaseTimes>) -> Result<f64, Error> {
        let Some((w, stall)) = self.ckpt.in_flight.take() else { return Ok(0.0) };
        let t = Instant::now();
        let done = w.finish(&self.mesh.world).map_err(|e| checkpointing::write_failed(self.mesh, e))?;
        self.recorded(done, stall)?;
        let secs = t.elapsed().as_secs_f64();
        if let Some(pt) = pt {
            pt[Phase::Checkpoint] += secs;
            self.stop.stalled(secs);
        }
        Ok(secs)
    }

    /// A write in place: its record, its file among those written, its buffers kept.
    fn recorded(&mut self, done: ckpt::Written, stall: Stall) -> Result<(), Error> {
        let c = &mut self.ckpt;
        checkpointing::record(&done, stall, &self.trainer.state, self.mesh, &mut c.log)?;
        self.stop.checkpoint_took(done.report.seconds);
        c.written.push((done.step, done.report.path.clone()));
        c.snapshot = done.snapshot;
        Ok(())
    }

    /// The held-out loss after step `s1`: every `[eval] every` steps and after the last.
    fn evaluate_if_due(&mut self, s1: u64, pt: &mut PhaseTimes) -> Result<Option<f64>, Error> {
        let eval = &self.res.deck.eval;
        if !self.trainer.evaluates() || !(s1 % eval.every == 0 || s1 == self.steps) {
            return Ok(None);
        }
        beat(|| format!("step {s1}: held-out loss"));
        let t = Instant::now();
        let loss = self.trainer.evaluate(eval.batches)?;
        let secs = t.elapsed().as_secs_f64();
        pt[Phase::Eval] += secs;
        say!("  eval after step {s1}: val_loss {loss:.6} over {} held-out batch(es) ({secs:.2} s)", eval.batches);
        self.history.val_losses.push((s1, loss));
        Ok(Some(loss))
    }

    /// The step's row of the timing log and of `metrics.csv`, and its console line.
    fn log(&mut self, s1: u64, out: &StepOutcome, start: Instant, val_loss: Option<f64>) -> Result<(), Error> {
        let step_s = start.elapsed().as_secs_f64();
        self.history.totals.add(&out.phases);
        let t_log = Instant::now();
        self.append_timing(s1, step_s, &out.phases)?;
        let elapsed = self.pace.start.elapsed().as_secs_f64();
        self.pace.first_step_end_s.get_or_insert(elapsed);
        let train_s = *self.history.step_times.last().expect("the step was recorded");
        let tps = (self.res.global_batch * self.res.deck.train.seq_len) as f64 / train_s;
        let world = self.mesh.world.size();
        let rec = StepRecord {
            step: s1,
            loss: out.loss,
            lr: out.lr,
            grad_norm: out.grad_norm,
            tokens_per_s: tps,
            mfu: tps * self.rates.flops_per_token / (self.rates.peak * world as f64),
            step_s: train_s,
            elapsed_s: elapsed,
            world,
            val_loss,
            aux_loss: out.aux_loss,
        };
        if let Some(m) = self.logs.metrics.as_mut() {
            m.append(&rec)?;
        }
        if let Some(e) = self.logs.expert_load.as_mut() {
            e.append(s1, &out.expert_counts)?;
        }
        // Every `log.every` steps, and the first step of the job, the last, a stop, and at
        // least every few minutes of a slow run.
        let due = s1 % self.res.deck.log.every == 0 || s1 == self.first_step + 1 || s1 == self.steps || self.preempted;
        if due || self.logs.last_line.elapsed().as_secs_f64() >= CONSOLE_EVERY_S {
            self.logs.last_line = Instant::now();
            let eta = self.eta(s1, elapsed);
            say!(
                "{:>6} {:>12.6} {:>10.3e} {:>9.4} {:>11.0} {:>10.0} {:>5.1}% {:>9} {:>8}",
                s1,
                out.loss,
                out.lr,
                out.grad_norm,
                tps,
                tps / world as f64,
                100.0 * rec.mfu,
                fmt_duration(elapsed),
                fmt_duration(eta)
            );
        }
        self.logs.last_log_s = t_log.elapsed().as_secs_f64();
        Ok(())
    }

    /// Step `s1`'s row of this rank's timing log: its phases, every group's collectives since
    /// the last row, and its memory.
    fn append_timing(&mut self, s1: u64, step_s: f64, phases: &PhaseTimes) -> Result<(), Error> {
        let comm: BTreeMap<String, CommCount> = self
            .mesh
            .groups()
            .iter()
            .flat_map(|g| g.take_counts().into_iter().map(move |(k, c)| (format!("{}.{k}", g.name()), c)))
            .collect();
        let state = &self.trainer.state;
        let shard_bytes = state.shard_bytes();
        let mem = MemoryStats {
            param_bytes: shard_bytes,
            grad_bytes: shard_bytes,
            optim_bytes: 2 * shard_bytes,
            gathered_peak_bytes: state.params.gathered_peak_bytes,
            grad_scratch_bytes: state.grads.scratch_bytes(),
            activation_bytes: self.trainer.activation_bytes(),
            snapshot_bytes: self.ckpt.snapshot_bytes as usize,
        };
        let attention_pairs = self.trainer.take_attention_pairs();
        let device_memory = self.trainer.backend().device_memory();
        let timing =
            StepTiming { step: s1, step_s, phases, log_s: self.logs.last_log_s, comm: &comm, mem: &mem, attention_pairs, device_memory };
        Ok(self.logs.timing.append(&timing)?)
    }

    /// The seconds left after step `s1`, `elapsed` seconds into the job, at this job's own
    /// pace: after a resume the steps before `first_step` took no time here. Past the job's
    /// first step the pace leaves that step out, as its one-off costs do not recur.
    fn eta(&self, s1: u64, elapsed: f64) -> f64 {
        let ran = s1 - self.first_step;
        let first_end = self.pace.first_step_end_s.unwrap_or(elapsed);
        let per_step = if ran > 1 { (elapsed - first_end) / (ran - 1) as f64 } else { elapsed };
        per_step * (self.steps - s1) as f64
    }

    /// The end of the run: the summary across ranks, the invariants, the export.
    fn finish(mut self) -> Result<RunSummary, Error> {
        drop(self.watchdog.take());
        // The snapshot's buffers are unlocked while the device that locked them is still there.
        self.ckpt.snapshot.release(&self.trainer.state.snapshot_source(&[]));
        let total_s = self.pace.start.elapsed().as_secs_f64();
        let h = &self.history;
        summary::say_phase_table(self.mesh, &h.totals, total_s);
        summary::say_totals(self.res, total_s, &h.step_times, self.entropy_floor, &h.losses);
        let act = self.trainer.activation_bytes();
        summary::say_memory(&self.trainer.state, act);
        summary::check_tp_replicas(self.mesh, &self.trainer.state)?;
        if !self.res.deck.checkpoint.export_hf.is_empty() && !self.preempted {
            summary::export_hf(self.res, self.mesh, &mut self.trainer.state)?;
        }
        summary::say_closing(&self.res.deck, h.skipped, act);
        let h = self.history;
        Ok(RunSummary {
            losses: h.losses,
            entropy_floor: self.entropy_floor,
            activation_bytes: act,
            mean_step_s: h.step_times.iter().sum::<f64>() / h.step_times.len().max(1) as f64,
            preempted: self.preempted,
            skipped_steps: h.skipped,
            first_step: self.first_step,
            final_val_loss: h.val_losses.last().map(|&(_, l)| l),
            tokens_per_step: self.res.tokens_per_step,
            flops_per_token: self.rates.flops_per_token,
            peak_flops: self.rates.peak,
            world_size: self.mesh.world.size(),
            checkpoints: self.ckpt.written,
            train_s: total_s,
        })
    }
}
