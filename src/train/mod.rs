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
    fmt_duration, rss_bytes, CheckpointIoLog, MemoryStats, MetricsCsv, Phase, PhaseTimes, StepRecord, StepTiming, TimingLog,
};
use crate::parallel::collective::MeshCollectives;
use crate::parallel::comm::CommCount;
use crate::parallel::mesh::Mesh;
use crate::run::faults::{self, fires, Fault};
use crate::run::watchdog::{beat, Watchdog};
use crate::say;
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
    /// A stop signal ended the run early, after writing a checkpoint.
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
        if run.checkpoint_due(s1) {
            run.checkpoint(s1, &mut out.phases)?;
        }
        // No held-out loss on the way out: the stop may be short of time.
        let val_loss = if stop.is_none() { run.evaluate_if_due(s1, &mut out.phases)? } else { None };
        run.log(s1, &out, start, val_loss)?;
        if let Some(why) = stop {
            say!("{why}: checkpoint of step {s1} written; exiting with code {} so the job can be requeued", crate::exit::PREEMPTED);
            break;
        }
    }
    // The summary across ranks, the invariants, the export.
    run.finish()
}

/// The longest a run stays silent on the console, in seconds.
const CONSOLE_EVERY_S: f64 = 300.0;

/// One rank's run: the trainer and everything the loop records around it.
struct Run<'g, B: Backend<f32>> {
    trainer: Trainer<'g, B>,
    res: &'g Resolved,
    mesh: &'g Mesh,
    first_step: u64,
    steps: u64,
    ckpt_dir: PathBuf,
    ckpt_log: Option<CheckpointIoLog>,
    metrics: Option<MetricsCsv>,
    timing: TimingLog,
    peak: f64,
    flops_per_token: f64,
    entropy_floor: Option<f64>,
    run_start: Instant,
    /// The job's elapsed seconds at the end of its first step, which carries one-off costs
    /// (thread start-up, first touch of every buffer) the ETA leaves out.
    first_step_end_s: Option<f64>,
    /// Per step: the loss, the training time (no checkpoint, no logging).
    losses: Vec<f64>,
    /// The held-out losses computed so far, with their step.
    val_losses: Vec<(u64, f64)>,
    step_times: Vec<f64>,
    totals: PhaseTimes,
    /// Time spent writing the previous step's logs (the timing log's `log_s`).
    last_log_s: f64,
    /// When the last console line was printed (one at least every `CONSOLE_EVERY_S`).
    last_line: Instant,
    skipped: u64,
    preempted: bool,
    /// The checkpoints written so far: step and file.
    written: Vec<(u64, PathBuf)>,
    /// For `[run] max_walltime`: the last step boundary, the longest a step took from one
    /// boundary to the next (its checkpoint left out), the checkpoint time since the last
    /// boundary, and the last checkpoint's time.
    last_boundary: Instant,
    slowest_step_s: f64,
    ckpt_since_boundary_s: f64,
    last_ckpt_s: Option<f64>,
    /// The stop-signal lead-time warning was printed.
    lead_warned: bool,
    debug_delay: Option<Duration>,
    fail: Option<Fault>,
    hang: Option<Fault>,
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
        let (dims, _) = step::rank_pieces(res, mesh);
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
        summary::warn_if_data_wraps(res, trainer.loader.samples_per_epoch());

        let metrics = rank0.then(|| MetricsCsv::create(&out_dir.join("metrics.csv"), first_step)).transpose()?;
        let timing = TimingLog::create(&out_dir.join("timing"), mesh.world.rank(), first_step, rss_before_load)?;
        let flops_per_token = crate::metrics::flops_per_token(&deck.model, deck.train.seq_len);
        summary::say_model(res, trainer.backend().describe(), &peak, flops_per_token);
        crate::run::preempt::install()?;
        faults::fault(faults::CHECKPOINT_WRITE_ERROR_ENV)?;
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
            ckpt_dir,
            ckpt_log,
            metrics,
            timing,
            peak: peak.flops,
            flops_per_token,
            entropy_floor,
            run_start: Instant::now(),
            first_step_end_s: None,
            losses: Vec::with_capacity(steps as usize),
            val_losses: vec![],
            step_times: vec![],
            totals: PhaseTimes::default(),
            last_log_s: 0.0,
            last_line: Instant::now(),
            last_boundary: Instant::now(),
            slowest_step_s: 0.0,
            ckpt_since_boundary_s: 0.0,
            last_ckpt_s: None,
            lead_warned: false,
            skipped: 0,
            preempted: false,
            written: vec![],
            debug_delay: faults::step_delay()?,
            fail: faults::fault(faults::FAIL_ENV)?,
            hang: faults::fault(faults::HANG_ENV)?,
            watchdog: Watchdog::start(Duration::from_secs_f64(deck.run.watchdog_seconds), mesh.world.rank()),
        })
    }

    /// The debug options that make this rank fail or hang at step `s1` (`docs/debugging.md`).
    fn injected_faults(&self, s1: u64) -> Result<(), Error> {
        beat(|| format!("step {s1}: start"));
        let rank = self.mesh.world.rank();
        if fires(&self.fail, rank, s1) {
            return Err(format!("injected failure ({}) at step {s1}", faults::FAIL_ENV).into());
        }
        if fires(&self.hang, rank, s1) {
            eprintln!("rank {rank}: {} at step {s1}: this rank stops making progress", faults::HANG_ENV);
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        Ok(())
    }

    /// Records step `s1`'s training time and loss.
    fn stepped(&mut self, s1: u64, out: &StepOutcome, start: Instant) {
        if !out.updated {
            self.skipped += 1;
            say_skipped(s1, out, self.skipped);
        }
        self.step_times.push(start.elapsed().as_secs_f64());
        self.losses.push(out.loss);
        if let Some(d) = self.debug_delay {
            std::thread::sleep(d);
        }
    }

    /// Whether the run stops after step `s1`, and why: a stop signal reached a rank, or (before
    /// the last step) the next step and a checkpoint would end past `[run] max_walltime` on a
    /// rank. Agreed at this step boundary, so every rank stops here, with a checkpoint.
    fn stop_requested(&mut self, s1: u64, pt: &mut PhaseTimes) -> Option<String> {
        use crate::run::preempt;
        let t = Instant::now();
        let step_s = (t - self.last_boundary).as_secs_f64() - std::mem::take(&mut self.ckpt_since_boundary_s);
        self.slowest_step_s = self.slowest_step_s.max(step_s);
        self.last_boundary = t;
        let (limit, what) = preempt::limit(self.res.deck.run.max_walltime);
        let elapsed = preempt::process_start().elapsed().as_secs_f64();
        // Until a checkpoint has been timed, one is taken to cost as much as a step.
        let ckpt_s = self.last_ckpt_s.unwrap_or(self.slowest_step_s);
        let walltime = s1 < self.steps && preempt::walltime_exceeded(limit, elapsed, self.slowest_step_s, ckpt_s);
        let lead = self.res.deck.run.signal_lead_time;
        if lead > 0.0 && !self.lead_warned && self.slowest_step_s + ckpt_s > lead {
            self.lead_warned = true;
            say!(
                "warning: a step (up to {:.1} s) and a checkpoint (~{ckpt_s:.1} s) take longer than the scheduler's stop-signal \
                 lead time ([run] signal_lead_time = {lead} s): a job stopped by that signal may be killed before its \
                 checkpoint is complete; ask for the signal earlier (sbatch --signal=USR1@{:.0}) or set [run] \
                 stop_before_job_end = true",
                self.slowest_step_s,
                2.0 * (self.slowest_step_s + ckpt_s).ceil()
            );
        }
        let quota = self.res.deck.run.stop_after_steps;
        let quota_done = quota > 0 && s1 < self.steps && s1 - self.first_step >= quota;
        let mut stop = [preempt::requested() as u64, walltime as u64, quota_done as u64];
        self.mesh.world.agree_max_u64(&mut stop);
        pt[Phase::Wait] += t.elapsed().as_secs_f64();
        self.preempted = stop != [0, 0, 0];
        match stop {
            [1, _, _] => Some("stop signal (SIGTERM/SIGUSR1)".into()),
            [_, 1, _] => Some(format!(
                "{what}: {elapsed:.1} s in, a step (up to {:.2} s) and a checkpoint (~{ckpt_s:.2} s) \
                 would end past it",
                self.slowest_step_s
            )),
            [_, _, 1] => Some(format!("[run] stop_after_steps = {quota}: this job's share of the run is done")),
            _ => None,
        }
    }

    /// A checkpoint after step `s1`: every `[checkpoint] every` steps, at the last step, and
    /// when the run stops on a signal.
    fn checkpoint_due(&self, s1: u64) -> bool {
        let every = self.res.deck.checkpoint.every;
        self.preempted || (every > 0 && (s1 % every == 0 || s1 == self.steps))
    }

    fn checkpoint(&mut self, s1: u64, pt: &mut PhaseTimes) -> Result<(), Error> {
        beat(|| format!("step {s1}: writing a checkpoint"));
        let t = Instant::now();
        checkpointing::save(&self.trainer.state, self.res, self.mesh, &self.ckpt_dir, s1, &mut self.ckpt_log)?;
        let secs = t.elapsed().as_secs_f64();
        pt[Phase::Checkpoint] += secs;
        self.ckpt_since_boundary_s += secs;
        self.last_ckpt_s = Some(secs);
        self.written.push((s1, self.ckpt_dir.join(ckpt::file_name(s1))));
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
        self.val_losses.push((s1, loss));
        Ok(Some(loss))
    }

    /// The step's row of the timing log and of `metrics.csv`, and its console line.
    fn log(&mut self, s1: u64, out: &StepOutcome, start: Instant, val_loss: Option<f64>) -> Result<(), Error> {
        let step_s = start.elapsed().as_secs_f64();
        self.totals.add(&out.phases);
        let t_log = Instant::now();
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
        };
        let attention_pairs = self.trainer.take_attention_pairs();
        let device_memory = self.trainer.backend().device_memory();
        let timing = StepTiming {
            step: s1,
            step_s,
            phases: &out.phases,
            log_s: self.last_log_s,
            comm: &comm,
            mem: &mem,
            attention_pairs,
            device_memory,
        };
        self.timing.append(&timing)?;
        let elapsed = self.run_start.elapsed().as_secs_f64();
        self.first_step_end_s.get_or_insert(elapsed);
        let train_s = *self.step_times.last().expect("the step was recorded");
        let tps = (self.res.global_batch * self.res.deck.train.seq_len) as f64 / train_s;
        let world = self.mesh.world.size();
        let rec = StepRecord {
            step: s1,
            loss: out.loss,
            lr: out.lr,
            grad_norm: out.grad_norm,
            tokens_per_s: tps,
            mfu: tps * self.flops_per_token / (self.peak * world as f64),
            step_s: train_s,
            elapsed_s: elapsed,
            world,
            val_loss,
        };
        if let Some(m) = self.metrics.as_mut() {
            m.append(&rec)?;
        }
        // Every `log.every` steps, and the first step of the job, the last, a stop, and at
        // least every few minutes of a slow run.
        let due = s1 % self.res.deck.log.every == 0 || s1 == self.first_step + 1 || s1 == self.steps || self.preempted;
        if due || self.last_line.elapsed().as_secs_f64() >= CONSOLE_EVERY_S {
            self.last_line = Instant::now();
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
        self.last_log_s = t_log.elapsed().as_secs_f64();
        Ok(())
    }

    /// The seconds left after step `s1`, `elapsed` seconds into the job, at this job's own
    /// pace: after a resume the steps before `first_step` took no time here. Past the job's
    /// first step the pace leaves that step out, as its one-off costs do not recur.
    fn eta(&self, s1: u64, elapsed: f64) -> f64 {
        let ran = s1 - self.first_step;
        let first_end = self.first_step_end_s.unwrap_or(elapsed);
        let per_step = if ran > 1 { (elapsed - first_end) / (ran - 1) as f64 } else { elapsed };
        per_step * (self.steps - s1) as f64
    }

    /// The end of the run: the summary across ranks, the invariants, the export.
    fn finish(mut self) -> Result<RunSummary, Error> {
        drop(self.watchdog.take());
        let total_s = self.run_start.elapsed().as_secs_f64();
        summary::say_phase_table(self.mesh, &self.totals, total_s);
        summary::say_totals(self.res, total_s, &self.step_times, self.entropy_floor, &self.losses);
        let act = self.trainer.activation_bytes();
        summary::say_memory(&self.trainer.state, act);
        summary::check_tp_replicas(self.mesh, &self.trainer.state)?;
        if !self.res.deck.checkpoint.export_hf.is_empty() && !self.preempted {
            summary::export_hf(self.res, self.mesh, &mut self.trainer.state)?;
        }
        summary::say_closing(&self.res.deck, self.skipped, act);
        Ok(RunSummary {
            losses: self.losses,
            entropy_floor: self.entropy_floor,
            activation_bytes: act,
            mean_step_s: self.step_times.iter().sum::<f64>() / self.step_times.len().max(1) as f64,
            preempted: self.preempted,
            skipped_steps: self.skipped,
            first_step: self.first_step,
            final_val_loss: self.val_losses.last().map(|&(_, l)| l),
            tokens_per_step: self.res.tokens_per_step,
            flops_per_token: self.flops_per_token,
            peak_flops: self.peak,
            world_size: self.mesh.world.size(),
            checkpoints: self.written,
            train_s: total_s,
        })
    }
}
