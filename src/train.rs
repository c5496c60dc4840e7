//! The training loop: micro-steps with gradient accumulation, the global-batch loss, gradient
//! reduction, clipping, the schedule and AdamW, and the logs of each step.
//!
//! Receives the resolved deck and the mesh; composes the model, the sharded model state
//! (`fsdp`: DP, FSDP and HSDP are its degrees), the data loader and the optimiser. Knows
//! nothing of MPI beyond the `comm::Group` calls.

use crate::checkpoint::blocks::{shard_blocks, ShardBlock};
use crate::checkpoint::{self as ckpt, DataState, LoadError, Meta, WriterLayout};
use crate::comm::CommCount;
use crate::config::{ActCkpt, OnNonFinite, Resolved};
use crate::data::{open_source, Loader};
use crate::debug::{fault, fires};
use crate::fsdp::{FsdpGrads, FsdpParams};
use crate::mesh::Mesh;
use crate::metrics::{
    flops_per_token, fmt_duration, peak_rss_bytes, rss_bytes, CheckpointIo, CheckpointIoLog, MemoryStats, MetricsCsv, PhaseTimes,
    StepRecord, StepTiming, TimingLog, PHASES,
};
use crate::model::params::Dims;
use crate::model::{Model, Par, Tokens};
use crate::optim::{clip_coefficient, lr_at, AdamW};
use crate::real::{matmul, Mat, MatMut};
use crate::say;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A failure every rank detected at the same point from the same globally reduced values (a
/// non-finite loss or gradient norm, a checkpoint write that failed somewhere): no rank is left
/// inside a collective, so they all finalise MPI and exit non-zero together. `message` is set
/// on the one rank that reports it, so the job prints it once.
#[derive(Debug)]
pub struct AgreedFailure {
    pub message: Option<String>,
}

impl std::fmt::Display for AgreedFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message.as_deref().unwrap_or("the run failed on every rank (reported by another rank)"))
    }
}

impl std::error::Error for AgreedFailure {}

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
}

/// Measured f32 GEMM rate of this rank on its threads (FLOP/s): the MFU denominator when the
/// deck gives no `[hardware] peak_flops_per_rank`. Best of a few 1024³ products.
pub fn probe_gemm_flops() -> f64 {
    let n = 1024;
    let a = vec![1.0f32; n * n];
    let b = vec![0.5f32; n * n];
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t = Instant::now();
        matmul(MatMut::rm(&mut c, n, n), Mat::rm(&a, n, n), Mat::rm(&b, n, n), false);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * n * n) as f64 / best
}

/// Memory bandwidth of this rank on its threads (bytes/s): best of a few STREAM-style triads
/// `a = b + s·c` over three 64 MiB arrays (read b and c, write a: 3 × 64 MiB moved).
pub fn probe_memory_bandwidth() -> f64 {
    use rayon::prelude::*;
    let n = 16 << 20;
    let b = vec![1.0f32; n];
    let c = vec![2.0f32; n];
    let mut a = vec![0.0f32; n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        a.par_chunks_mut(1 << 16).zip(b.par_chunks(1 << 16)).zip(c.par_chunks(1 << 16)).for_each(|((a, b), c)| {
            for ((x, y), z) in a.iter_mut().zip(b).zip(c) {
                *x = y + 3.0 * z;
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&a);
    3.0 * 4.0 * n as f64 / best
}

/// Threads for this rank: the deck's, or the node's cores shared among the node's ranks.
pub fn threads_for_rank(requested: usize, ranks_on_node: usize) -> usize {
    if requested > 0 {
        return requested;
    }
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (cores / ranks_on_node.max(1)).max(1)
}

/// Trains for `[run] steps` optimiser steps and writes the run's logs under `out_dir`.
pub fn train(res: &Resolved, mesh: &Mesh, out_dir: &Path) -> Result<RunSummary, Error> {
    let deck = &res.deck;
    let (mcfg, tcfg, ocfg) = (&deck.model, &deck.train, &deck.optim);
    let rank = mesh.world.rank();
    let (s, mb, ga) = (tcfg.seq_len, tcfg.micro_batch, res.grad_accum);

    // Model state: this rank's shards (the whole model when the fsdp degree is 1).
    // Tensors are first cut for tensor parallelism (this tp rank's piece: `dims`), then
    // sharded over fsdp. A resumed or imported model is read slice by slice into zero shards.
    let reshard = deck.parallel.reshard_after_forward;
    let dims = Dims::new(mcfg, mesh.tp.size(), mesh.tp.rank());
    let ckpt_dir = res.deck.checkpoint_dir();
    let candidates = ckpt::resume_candidates(&deck.checkpoint.resume, &ckpt_dir)?;
    let load_from_files = !candidates.is_empty() || !deck.checkpoint.init_from.is_empty();
    let rss_before_load = rss_bytes();
    let load_start = Instant::now();
    let mut params = if load_from_files {
        FsdpParams::zeros(&dims, &mesh.fsdp, reshard)
    } else {
        FsdpParams::init(&dims, deck.run.seed, &mesh.fsdp, reshard)
    };
    params.overlap = deck.parallel.overlap;
    let blocks = shard_blocks(&params.plan, &dims, mesh.dp_rep.rank() == 0);
    let mut opt = AdamW::<f32>::for_slots(&params.plan.optimizer_slots(), ocfg);
    let shard_bytes = params.plan.shard_elements() * 4;
    let mut ckpt_log = if rank == 0 {
        Some(CheckpointIoLog::create(&out_dir.join("checkpoint_io.csv"), if candidates.is_empty() { 0 } else { u64::MAX })?)
    } else {
        None
    };
    let mut start_step = 0;
    if !candidates.is_empty() {
        let auto = deck.checkpoint.resume == "auto";
        let (meta, path, bytes) = resume(&candidates, auto, res, mesh, &blocks, &mut params, &mut opt)?;
        start_step = meta.step;
        say!(
            "resumed from {} (step {}, written by {}; {} tokens seen){}",
            path.display(),
            meta.step,
            meta.layout,
            meta.tokens_seen,
            if meta.run_steps != deck.run.steps {
                format!("; the LR schedule now spans {} steps (the checkpoint's run had {})", deck.run.steps, meta.run_steps)
            } else {
                String::new()
            }
        );
        log_load(mesh, &mut ckpt_log, start_step, &path, bytes, load_start, rss_before_load, 3 * shard_bytes)?;
    } else if !deck.checkpoint.init_from.is_empty() {
        let dir = Path::new(&deck.checkpoint.init_from);
        let reader = crate::hf::SliceReader::open(dir, mcfg)?;
        let mut bytes = 0;
        for (slot, b) in params.slots_mut().into_iter().zip(&blocks) {
            reader.read_block(&b.name, &b.start, &b.count, &mut slot[..b.len()])?;
            bytes += 4 * b.len() as u64;
        }
        say!("init_from: {} (each rank read only its slices)", dir.display());
        log_load(mesh, &mut ckpt_log, 0, dir, bytes, load_start, rss_before_load, shard_bytes)?;
    }
    let mut grads = FsdpGrads::new(&dims, &mesh.fsdp, &mesh.dp_rep);
    grads.overlap = deck.parallel.overlap;
    let n_params = crate::model::params::param_specs(mcfg).iter().map(|s| s.numel()).sum::<usize>();
    let cp = mesh.cp.size();
    let backend = crate::backend::Cpu { precision: tcfg.precision };
    let mut model =
        Model::<f32>::on(backend, dims.clone(), tcfg.activation_checkpointing, deck.parallel.sequence_parallel).with_context_parallel(cp);
    let par = Par { tp: &mesh.tp, cp: &mesh.cp, progress: crate::comm::progress };
    let s_local = s / cp;

    // Data.
    let source = open_source(&deck.data, mcfg.vocab_size, deck.run.seed)?;
    let floor = source.entropy_floor(s);
    say!("data: {}", source.describe());
    if let Some(f) = floor {
        say!("data: entropy floor {f:.4} nats/token (the best loss any model can reach)");
    }
    let dp_rank = mesh.coords.dp_rank(&res.layout);
    let loader = Loader::new(&deck.data, source, s, mb, res.global_batch, res.layout.dp(), dp_rank, deck.run.seed)?;
    let needed = deck.run.steps.saturating_mul(res.global_batch as u64);
    if needed > loader.samples_per_epoch() {
        say!(
            "warning: the data holds {} samples of seq_len {s}; {} steps × global_batch {} need {needed}: the run wraps around \
             the data {:.1} times (epochs)",
            loader.samples_per_epoch(),
            deck.run.steps,
            res.global_batch,
            needed as f64 / loader.samples_per_epoch() as f64
        );
    }

    // Logs.
    let mut metrics = if rank == 0 { Some(MetricsCsv::create(&out_dir.join("metrics.csv"), start_step)?) } else { None };
    let mut timing = TimingLog::create(&out_dir.join("timing"), rank, start_step, rss_before_load)?;
    let peak = if deck.hardware.peak_flops_per_rank > 0.0 { deck.hardware.peak_flops_per_rank } else { probe_gemm_flops() };
    let peak_src = if deck.hardware.peak_flops_per_rank > 0.0 { "[hardware] peak_flops_per_rank" } else { "measured f32 GEMM probe" };
    let flops_tok = flops_per_token(mcfg, s);
    say!(
        "model: {} parameters ({} matmul), {:.3} GFLOP/token; MFU peak {:.1} GFLOP/s per rank ({peak_src})",
        n_params,
        crate::metrics::matmul_params(mcfg),
        flops_tok / 1e9,
        peak / 1e9
    );
    say!(
        "{:>6} {:>12} {:>10} {:>9} {:>11} {:>10} {:>6} {:>9} {:>8}",
        "step",
        "loss",
        "lr",
        "gnorm",
        "tok/s",
        "tok/s/rank",
        "mfu",
        "elapsed",
        "eta"
    );

    let tokens_per_step = (res.global_batch * s) as f64;
    let world = mesh.world.size() as f64;
    let steps = deck.run.steps;
    let mut losses = Vec::with_capacity(steps as usize);
    let mut totals = PhaseTimes::default();
    let run_start = Instant::now();
    let mut step_times = Vec::new();
    let mut preempted = false;
    // Time spent writing the previous step's logs (the timing log's `log_s`).
    let mut last_log_s = 0.0;
    crate::preempt::install()?;
    let debug_delay = crate::debug::step_delay()?;
    let fail = fault(crate::debug::FAIL_ENV)?;
    let hang = fault(crate::debug::HANG_ENV)?;
    let nan_grad = fault(crate::debug::NAN_GRAD_ENV)?;
    fault(crate::debug::CHECKPOINT_WRITE_ERROR_ENV)?;
    let world_rank = mesh.world.rank();
    let mut skipped = 0u64;
    let watchdog = crate::watchdog::Watchdog::start(Duration::from_secs_f64(deck.run.watchdog_seconds), world_rank);
    if start_step >= steps {
        say!("the checkpoint is at step {start_step}, [run] steps = {steps}: nothing left to train");
    }

    for step in start_step..steps {
        let step_start = Instant::now();
        let s1 = step + 1; // the step as the logs count it
        crate::watchdog::beat(|| format!("step {s1}: start"));
        if fires(&fail, world_rank, s1) {
            return Err(format!("injected failure ({}) at step {s1}", crate::debug::FAIL_ENV).into());
        }
        if fires(&hang, world_rank, s1) {
            eprintln!("rank {world_rank}: {} at step {s1}: this rank stops making progress", crate::debug::HANG_ENV);
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        let mut pt = PhaseTimes::default();
        grads.zero();
        pt.0[2] += step_start.elapsed().as_secs_f64();
        let t_wait = Instant::now();
        // Global number of target tokens, reduced before any backward (DESIGN.md: loss is the
        // global sum over the global token count, exact for any layout and accumulation).
        let mut n_tok = [(ga * mb * s_local) as f64];
        mesh.batch.all_reduce_sum_f64(&mut n_tok);
        mesh.cp.all_reduce_sum_f64(&mut n_tok);
        // The first collective of the step: where a rank waits for the slowest of the last one.
        pt.0[6] += t_wait.elapsed().as_secs_f64();
        let loss_scale = (1.0 / n_tok[0]) as f32;
        let mut loss_sum = 0.0f64;
        for micro in 0..ga {
            crate::watchdog::beat(|| format!("step {s1}: micro-step {} of {ga}", micro + 1));
            let t0 = Instant::now();
            let batch = loader.micro_batch(step, micro)?;
            let t1 = Instant::now();
            // This cp rank's zigzag chunks of every sequence, with their global positions.
            let (inputs, positions) = crate::cp::local_tokens(&batch.inputs, s, cp, mesh.cp.rank());
            let (targets, _) = crate::cp::local_tokens(&batch.targets, s, cp, mesh.cp.rank());
            let tok = Tokens { inputs: &inputs, targets: &targets, positions: &positions, batch: mb, seq: s_local };
            params.begin_micro_step();
            grads.begin_micro_step(micro + 1 == ga);
            loss_sum += model.forward_with(&mut params, &tok, par);
            let t2 = Instant::now();
            params.begin_backward();
            model.backward_with(&mut params, &mut grads, loss_scale, par);
            params.end_micro_step();
            let t3 = Instant::now();
            pt.0[0] += (t1 - t0).as_secs_f64();
            pt.0[1] += (t2 - t1).as_secs_f64();
            pt.0[2] += (t3 - t2).as_secs_f64();
        }
        crate::watchdog::beat(|| format!("step {s1}: gradient reduction and norm"));
        let t_comm = Instant::now();
        let mut loss_buf = [loss_sum];
        mesh.batch.all_reduce_sum_f64(&mut loss_buf);
        mesh.cp.all_reduce_sum_f64(&mut loss_buf);
        let loss = loss_buf[0] / n_tok[0];
        grads.finish_step();
        if deck.parallel.sequence_parallel {
            grads.sum_replicated_over(&mesh.tp);
        }
        if let Some(f) = nan_grad.as_ref().filter(|_| fires(&nan_grad, world_rank, s1)) {
            inject_nan(&mut grads, &blocks, f)?;
        }
        // Global norm from the shards' squares, reduced once over the fsdp group (every dp_rep
        // replica already holds the same reduced shards).
        let mut sq = [grads.local_sq_sum(mesh.tp.rank() == 0)];
        mesh.fsdp.all_reduce_sum_f64(&mut sq);
        mesh.tp.all_reduce_sum_f64(&mut sq);
        pt.0[3] += t_comm.elapsed().as_secs_f64();

        let t_opt = Instant::now();
        let grad_norm = sq[0].sqrt();
        let lr = lr_at(ocfg, res.lr, step, steps);
        // The loss and the norm are global reductions: every rank takes the same branch.
        if loss.is_finite() && grad_norm.is_finite() {
            grads.scale(clip_coefficient(grad_norm, ocfg.grad_clip));
            opt.step_slots(params.slots_mut(), &grads.slots(), lr);
        } else if ocfg.on_nonfinite == OnNonFinite::Skip {
            skipped += 1;
            say!(
                "step {s1}: loss {loss}, gradient norm {grad_norm}: not finite; update skipped ([optim] on_nonfinite = \"skip\"; {skipped} skipped so far)"
            );
        } else {
            return Err(Box::new(nonfinite_failure(mesh, &grads, &blocks, s1, loss, grad_norm)));
        }
        pt.0[4] += t_opt.elapsed().as_secs_f64();

        // Training time of the step (what tokens/s and MFU use): no checkpoint, no logging.
        let train_s = step_start.elapsed().as_secs_f64();
        step_times.push(train_s);
        losses.push(loss);
        if let Some(d) = debug_delay {
            std::thread::sleep(d);
        }

        // A stop signal on any rank ends the run here, at a step boundary, with a checkpoint.
        let t_stop = Instant::now();
        let mut stop = [crate::preempt::requested() as u64];
        mesh.world.agree_max_u64(&mut stop);
        preempted = stop[0] != 0;
        pt.0[6] += t_stop.elapsed().as_secs_f64();
        let every = deck.checkpoint.every;
        if preempted || (every > 0 && ((step + 1) % every == 0 || step + 1 == steps)) {
            crate::watchdog::beat(|| format!("step {s1}: writing a checkpoint"));
            let t_ckpt = Instant::now();
            save_checkpoint(res, mesh, &ckpt_dir, step + 1, &opt, &params, &blocks, &mut ckpt_log, 3 * shard_bytes)?;
            pt.0[5] += t_ckpt.elapsed().as_secs_f64();
        }
        let step_s = step_start.elapsed().as_secs_f64();
        totals.add(&pt);
        let t_log = Instant::now();
        let comm: BTreeMap<String, CommCount> =
            mesh.groups().iter().flat_map(|g| g.take_counts().into_iter().map(move |(k, c)| (format!("{}.{k}", g.name()), c))).collect();
        let mem = MemoryStats {
            param_bytes: shard_bytes,
            grad_bytes: shard_bytes,
            optim_bytes: 2 * shard_bytes,
            gathered_peak_bytes: params.gathered_peak_bytes,
            grad_scratch_bytes: grads.scratch_bytes(),
            activation_bytes: model.activation_bytes(),
        };
        timing.append(&StepTiming {
            step: step + 1,
            step_s,
            phases: &pt,
            log_s: last_log_s,
            comm: &comm,
            mem: &mem,
            attention_pairs: model.take_attention_pairs(),
        })?;
        let elapsed = run_start.elapsed().as_secs_f64();
        let tps = tokens_per_step / train_s;
        let rec = StepRecord {
            step: step + 1,
            loss,
            lr,
            grad_norm,
            tokens_per_s: tps,
            mfu: tps * flops_tok / (peak * world),
            step_s: train_s,
            elapsed_s: elapsed,
            world: mesh.world.size(),
        };
        if let Some(m) = metrics.as_mut() {
            m.append(&rec)?;
        }
        if (step + 1) % deck.log.every == 0 || step + 1 == steps || preempted {
            let eta = elapsed / (step + 1) as f64 * (steps - step - 1) as f64;
            say!(
                "{:>6} {:>12.6} {:>10.3e} {:>9.4} {:>11.0} {:>10.0} {:>5.1}% {:>9} {:>8}",
                step + 1,
                loss,
                lr,
                grad_norm,
                tps,
                tps / world,
                100.0 * rec.mfu,
                fmt_duration(elapsed),
                fmt_duration(eta)
            );
        }
        last_log_s = t_log.elapsed().as_secs_f64();
        if preempted {
            say!(
                "stop signal (SIGTERM/SIGUSR1): checkpoint of step {} written; exiting with code {} so the job can be requeued",
                step + 1,
                crate::cli::EXIT_PREEMPTED
            );
            break;
        }
    }
    drop(watchdog);

    // LAMMPS-style summary: each phase's min / avg / max across ranks, its share of the total,
    // and the load imbalance (max − avg) / avg; `other` is the rest of the wall time (start-up,
    // logging).
    let total_s = run_start.elapsed().as_secs_f64();
    say!("\nphase        min (s)    avg (s)    max (s)   %total  %imbal");
    let mut phases_sum = 0.0;
    let row = |name: &str, x: f64| {
        let (lo, hi, sum) = mesh.world.min_max_sum_f64(x);
        let avg = sum / world;
        let imbalance = if avg > 0.0 { 100.0 * (hi - avg) / avg } else { 0.0 };
        say!("{name:<10} {lo:>9.3} {avg:>10.3} {hi:>10.3} {:>8.1} {imbalance:>7.1}", 100.0 * avg / total_s.max(1e-12));
    };
    for (i, name) in PHASES.iter().enumerate() {
        row(name, totals.0[i]);
        phases_sum += totals.0[i];
    }
    row("other", (total_s - phases_sum).max(0.0));
    let mut sorted = step_times.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    say!("total {:.3} s, median step {:.4} s, {:.0} tokens/s", total_s, median, tokens_per_step / median.max(1e-12));
    if let (Some(f), Some(last)) = (floor, losses.last()) {
        say!("final loss {last:.4} vs entropy floor {f:.4} (gap {:.4})", last - f);
    }
    let act = model.activation_bytes();
    say!(
        "model state per rank: params {:.1} MiB + grads {:.1} MiB + AdamW {:.1} MiB; gathered peak {:.1} MiB; activations {:.1} MiB",
        shard_bytes as f64 / 1048576.0,
        shard_bytes as f64 / 1048576.0,
        2.0 * shard_bytes as f64 / 1048576.0,
        params.gathered_peak_bytes as f64 / 1048576.0,
        act as f64 / 1048576.0
    );
    // Invariant of tensor parallelism: the tensors every tp rank holds whole stayed bit-identical.
    let fp = params.replicated_fingerprint();
    let mut hi_lo = [fp, u64::MAX - fp];
    mesh.tp.all_reduce_max_u64(&mut hi_lo);
    if hi_lo[0] != u64::MAX - hi_lo[1] {
        return Err("replicated tensors (norm weights) differ across tp ranks: tensor-parallel updates diverged".into());
    }
    if !deck.checkpoint.export_hf.is_empty() && !preempted {
        // Gathers the whole model on every rank: an export for small models and tests; for
        // large ones, `ndtrain ckpt export` converts a checkpoint one tensor at a time.
        let final_params = crate::tp::global_from_local(&params.gather_full(), mcfg, &mesh.tp);
        if rank == 0 {
            let dir = Path::new(&deck.checkpoint.export_hf);
            crate::hf::save_params(dir, mcfg, &final_params)?;
            say!("exported the final model to {} (Hugging Face format)", dir.display());
        }
    }
    if skipped > 0 {
        say!("{skipped} step(s) skipped: loss or gradient norm not finite ([optim] on_nonfinite = \"skip\")");
    }
    if tcfg.activation_checkpointing != ActCkpt::None {
        say!("activation checkpointing: {} ({:.1} MiB held)", tcfg.activation_checkpointing.name(), act as f64 / 1048576.0);
    }
    Ok(RunSummary {
        losses,
        entropy_floor: floor,
        activation_bytes: act,
        mean_step_s: step_times.iter().sum::<f64>() / step_times.len().max(1) as f64,
        preempted,
        skipped_steps: skipped,
    })
}

/// Loads the first usable checkpoint of `candidates` into the shards and moments. With
/// `auto`, a corrupt one is reported and the next older tried; a checkpoint that does not fit
/// the run (another model, batch or seed) is always an error.
fn resume(
    candidates: &[std::path::PathBuf],
    auto: bool,
    res: &Resolved,
    mesh: &Mesh,
    blocks: &[ShardBlock],
    params: &mut FsdpParams<'_>,
    opt: &mut AdamW<f32>,
) -> Result<(Meta, std::path::PathBuf, u64), Error> {
    for path in candidates {
        let attempt = ckpt::Reader::open_parallel(path, &mesh.world).and_then(|r| {
            ckpt::check_compatible(&r.meta, &res.deck, res.global_batch, path)?;
            let meta = r.meta.clone();
            let state = [
                params.slots_mut(),
                opt.exp_avg.iter_mut().map(|v| v.as_mut_slice()).collect(),
                opt.exp_avg_sq.iter_mut().map(|v| v.as_mut_slice()).collect(),
            ];
            let report = r.read_into(blocks, state, &mesh.world)?;
            Ok((meta, report.bytes))
        });
        match attempt {
            Ok((meta, bytes)) => {
                opt.t = meta.optim_step;
                return Ok((meta, path.clone(), bytes));
            }
            Err(LoadError::Corrupt(e)) if auto => say!("resume = \"auto\": skipping a checkpoint that is not valid: {e}"),
            Err(e) => return Err(e.into()),
        }
    }
    Err(format!("resume = \"auto\": no checkpoint in {} is valid (each failed as reported above)", res.deck.checkpoint_dir().display())
        .into())
}

/// Records a load (a resume or `init_from`) in `checkpoint_io.csv`: bytes read by all ranks,
/// the slowest rank's time, and the largest resident memory before and after.
#[allow(clippy::too_many_arguments)]
fn log_load(
    mesh: &Mesh,
    log: &mut Option<CheckpointIoLog>,
    step: u64,
    file: &Path,
    bytes: u64,
    start: Instant,
    rss_before: u64,
    state_bytes: usize,
) -> Result<(), Error> {
    let seconds = mesh.world.min_max_sum_f64(start.elapsed().as_secs_f64()).1;
    let total = mesh.world.min_max_sum_f64(bytes as f64).2 as u64;
    let before = mesh.world.min_max_sum_f64(rss_before as f64).1 as u64;
    let peak = mesh.world.min_max_sum_f64(peak_rss_bytes() as f64).1 as u64;
    say!(
        "loaded {:.1} MiB in {:.2} s; per rank: model state {:.1} MiB, resident {:.1} MiB before and peak {:.1} MiB after loading",
        total as f64 / 1048576.0,
        seconds,
        state_bytes as f64 / 1048576.0,
        before as f64 / 1048576.0,
        peak as f64 / 1048576.0
    );
    if let Some(l) = log.as_mut() {
        l.append(&CheckpointIo {
            event: "load",
            step,
            file,
            bytes: total,
            seconds,
            collective: true,
            rss_before_bytes: before,
            peak_rss_bytes: peak,
            state_bytes_per_rank: state_bytes as u64,
        })?;
    }
    Ok(())
}

/// `NDTRAIN_DEBUG_NAN_GRAD`: NaN into the first element this rank holds of the named tensor's
/// gradient.
fn inject_nan(grads: &mut FsdpGrads<'_>, blocks: &[ShardBlock], f: &crate::debug::Fault) -> Result<(), Error> {
    let name = f.tensor.as_deref().ok_or_else(|| format!("{} needs tensor=NAME", crate::debug::NAN_GRAD_ENV))?;
    let slot =
        blocks.iter().position(|b| b.name == name).ok_or_else(|| format!("{}: no tensor named {name}", crate::debug::NAN_GRAD_ENV))?;
    let g = grads.slots_mut().swap_remove(slot);
    let first = g.first_mut().ok_or_else(|| format!("{}: this rank holds no element of {name}", crate::debug::NAN_GRAD_ENV))?;
    *first = f32::NAN;
    Ok(())
}

/// `on_nonfinite = "abort"`: finds, on every rank, the first tensor whose gradient shard holds
/// a NaN or an infinity; the lowest rank that found one reports it (rank 0 if none did: then
/// only the loss was not finite).
fn nonfinite_failure(mesh: &Mesh, grads: &FsdpGrads<'_>, blocks: &[ShardBlock], step: u64, loss: f64, norm: f64) -> AgreedFailure {
    let rank = mesh.world.rank();
    let found = grads.slots().iter().zip(blocks).find_map(|(g, b)| g.iter().position(|x| !x.is_finite()).map(|i| (b, i, g[i])));
    // The lowest rank with a finding, as a max: u64::MAX − rank.
    let mut reporter = [if found.is_some() { u64::MAX - rank as u64 } else { 0 }];
    mesh.world.agree_max_u64(&mut reporter);
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

/// Writes the checkpoint after `step` optimiser steps and records it in `checkpoint_io.csv`.
#[allow(clippy::too_many_arguments)]
fn save_checkpoint(
    res: &Resolved,
    mesh: &Mesh,
    dir: &Path,
    step: u64,
    opt: &AdamW<f32>,
    params: &FsdpParams<'_>,
    blocks: &[ShardBlock],
    log: &mut Option<CheckpointIoLog>,
    state_bytes: usize,
) -> Result<(), Error> {
    let deck = &res.deck;
    let l = res.layout;
    let data = DataState::after(step, res.global_batch, deck);
    let meta = Meta {
        step,
        tokens_seen: data.samples_seen * deck.train.seq_len as u64,
        optim_step: opt.t,
        seed: deck.run.seed,
        run_steps: deck.run.steps,
        data,
        deck: deck.to_toml(),
        layout: WriterLayout { dp_replicate: l.dp_replicate, dp_shard: l.dp_shard, cp: l.cp, tp: l.tp, world: mesh.world.size() },
        model: deck.model.clone(),
        ndtrain_version: env!("CARGO_PKG_VERSION").to_string(),
    };
    let rss_before = mesh.world.min_max_sum_f64(rss_bytes() as f64).1 as u64;
    let p = params.slots();
    let m: Vec<&[f32]> = opt.exp_avg.iter().map(|v| v.as_slice()).collect();
    let v: Vec<&[f32]> = opt.exp_avg_sq.iter().map(|v| v.as_slice()).collect();
    // Every failure of `save` is agreed on every rank; the run ends (the documented policy: the
    // previous checkpoint and `latest` are untouched, `resume = "auto"` continues from them).
    let report = ckpt::save(dir, deck.checkpoint.keep, &meta, blocks, [&p, &m, &v], &mesh.world).map_err(|e| AgreedFailure {
        message: (mesh.world.rank() == 0).then(|| format!("{e}; the run stops here (checkpoint write failures end the run)")),
    })?;
    let seconds = mesh.world.min_max_sum_f64(report.seconds).1;
    let peak = mesh.world.min_max_sum_f64(peak_rss_bytes() as f64).1 as u64;
    say!(
        "checkpoint {}: {:.1} MiB in {:.2} s ({:.0} MB/s{})",
        report.path.display(),
        report.bytes as f64 / 1048576.0,
        seconds,
        report.bytes as f64 / 1e6 / seconds.max(1e-9),
        if report.collective { ", collective MPI-IO" } else { ", independent I/O" }
    );
    if let Some(l) = log.as_mut() {
        l.append(&CheckpointIo {
            event: "write",
            step,
            file: &report.path,
            bytes: report.bytes,
            seconds,
            collective: report.collective,
            rss_before_bytes: rss_before,
            peak_rss_bytes: peak,
            state_bytes_per_rank: state_bytes as u64,
        })?;
    }
    Ok(())
}
