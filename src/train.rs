//! The training loop: micro-steps with gradient accumulation, the global-batch loss, gradient
//! reduction, clipping, the schedule and AdamW, and the logs of each step.
//!
//! Receives the resolved deck and the mesh; composes the model, the sharded model state
//! (`fsdp`: DP, FSDP and HSDP are its degrees), the data loader and the optimiser. Knows
//! nothing of MPI beyond the `comm::Group` calls.

use crate::comm::CommCount;
use crate::config::{ActCkpt, Resolved};
use crate::data::{open_source, Loader};
use crate::fsdp::{FsdpGrads, FsdpParams};
use crate::mesh::Mesh;
use crate::metrics::{flops_per_token, fmt_duration, MemoryStats, MetricsCsv, PhaseTimes, StepRecord, TimingLog, PHASES};
use crate::model::params::{Dims, ModelParams};
use crate::model::{Model, Par, Tokens};
use crate::optim::{clip_coefficient, lr_at, AdamW};
use crate::real::{matmul, Mat, MatMut};
use crate::say;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// What a finished run reports to its caller (tests read it; the console has printed it).
#[derive(Clone, Debug)]
pub struct RunSummary {
    pub losses: Vec<f64>,
    pub entropy_floor: Option<f64>,
    pub final_params: ModelParams<f32>,
    pub activation_bytes: usize,
    pub mean_step_s: f64,
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
    // sharded over fsdp.
    let reshard = deck.parallel.reshard_after_forward;
    let dims = Dims::new(mcfg, mesh.tp.size(), mesh.tp.rank());
    let mut params = if deck.checkpoint.init_from.is_empty() {
        FsdpParams::init(&dims, deck.run.seed, &mesh.fsdp, reshard)
    } else {
        let dir = Path::new(&deck.checkpoint.init_from);
        crate::hf::check_config(dir, mcfg)?;
        say!("init_from: {}", dir.display());
        let whole = crate::hf::load_params(dir, mcfg)?;
        FsdpParams::from_full(&crate::tp::local_from_global(&whole, &dims), &dims, &mesh.fsdp, reshard)
    };
    params.overlap = deck.parallel.overlap;
    let mut grads = FsdpGrads::new(&dims, &mesh.fsdp, &mesh.dp_rep);
    let mut opt = AdamW::<f32>::for_slots(&params.plan.optimizer_slots(), ocfg);
    let shard_bytes = params.plan.shard_elements() * 4;
    let n_params = crate::model::params::param_specs(mcfg).iter().map(|s| s.numel()).sum::<usize>();
    let cp = mesh.cp.size();
    let mut model =
        Model::<f32>::new_local(dims.clone(), tcfg.activation_checkpointing, deck.parallel.sequence_parallel).with_context_parallel(cp);
    let par = Par { tp: &mesh.tp, cp: &mesh.cp };
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

    // Logs.
    let mut metrics = if rank == 0 { Some(MetricsCsv::create(&out_dir.join("metrics.csv"))?) } else { None };
    let mut timing = TimingLog::create(&out_dir.join("timing"), rank)?;
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
    say!("{:>6} {:>12} {:>10} {:>9} {:>11} {:>6} {:>9} {:>8}", "step", "loss", "lr", "gnorm", "tok/s", "mfu", "elapsed", "eta");

    let tokens_per_step = (res.global_batch * s) as f64;
    let world = mesh.world.size() as f64;
    let steps = deck.run.steps;
    let mut losses = Vec::with_capacity(steps as usize);
    let mut totals = PhaseTimes::default();
    let run_start = Instant::now();
    let mut step_times = Vec::new();

    for step in 0..steps {
        let step_start = Instant::now();
        let mut pt = PhaseTimes::default();
        grads.zero();
        // Global number of target tokens, reduced before any backward (DESIGN.md: loss is the
        // global sum over the global token count, exact for any layout and accumulation).
        let mut n_tok = [(ga * mb * s_local) as f64];
        mesh.batch.all_reduce_sum_f64(&mut n_tok);
        mesh.cp.all_reduce_sum_f64(&mut n_tok);
        let loss_scale = (1.0 / n_tok[0]) as f32;
        let mut loss_sum = 0.0f64;
        for micro in 0..ga {
            let t0 = Instant::now();
            let batch = loader.micro_batch(step, micro)?;
            let t1 = Instant::now();
            // This cp rank's zigzag chunks of every sequence, with their global positions.
            let (inputs, positions) = crate::cp::local_tokens(&batch.inputs, s, cp, mesh.cp.rank());
            let (targets, _) = crate::cp::local_tokens(&batch.targets, s, cp, mesh.cp.rank());
            let tok = Tokens { inputs: &inputs, targets: &targets, positions: &positions, batch: mb, seq: s_local };
            params.begin_micro_step();
            grads.begin_micro_step(deck.parallel.overlap && micro + 1 == ga);
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
        let t_comm = Instant::now();
        let mut loss_buf = [loss_sum];
        mesh.batch.all_reduce_sum_f64(&mut loss_buf);
        mesh.cp.all_reduce_sum_f64(&mut loss_buf);
        let loss = loss_buf[0] / n_tok[0];
        grads.finish_step();
        if deck.parallel.sequence_parallel {
            grads.sum_replicated_over(&mesh.tp);
        }
        // Global norm from the shards' squares, reduced once over the fsdp group (every dp_rep
        // replica already holds the same reduced shards).
        let mut sq = [grads.local_sq_sum(mesh.tp.rank() == 0)];
        mesh.fsdp.all_reduce_sum_f64(&mut sq);
        mesh.tp.all_reduce_sum_f64(&mut sq);
        pt.0[3] += t_comm.elapsed().as_secs_f64();

        let t_opt = Instant::now();
        let grad_norm = sq[0].sqrt();
        grads.scale(clip_coefficient(grad_norm, ocfg.grad_clip));
        let lr = lr_at(ocfg, res.lr, step, steps);
        opt.step_slots(params.slots_mut(), &grads.slots(), lr);
        pt.0[4] += t_opt.elapsed().as_secs_f64();

        let step_s = step_start.elapsed().as_secs_f64();
        step_times.push(step_s);
        totals.add(&pt);
        losses.push(loss);
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
        timing.append(step + 1, step_s, &pt, &comm, &mem, model.take_attention_pairs())?;
        let elapsed = run_start.elapsed().as_secs_f64();
        let tps = tokens_per_step / step_s;
        let rec = StepRecord {
            step: step + 1,
            loss,
            lr,
            grad_norm,
            tokens_per_s: tps,
            mfu: tps * flops_tok / (peak * world),
            step_s,
            elapsed_s: elapsed,
        };
        if let Some(m) = metrics.as_mut() {
            m.append(&rec)?;
        }
        if (step + 1) % deck.log.every == 0 || step + 1 == steps {
            let eta = elapsed / (step + 1) as f64 * (steps - step - 1) as f64;
            say!(
                "{:>6} {:>12.6} {:>10.3e} {:>9.4} {:>11.0} {:>5.1}% {:>9} {:>8}",
                step + 1,
                loss,
                lr,
                grad_norm,
                tps,
                100.0 * rec.mfu,
                fmt_duration(elapsed),
                fmt_duration(eta)
            );
        }
    }

    // LAMMPS-style summary: each phase's min / avg / max across ranks and share of the total.
    let total_s = run_start.elapsed().as_secs_f64();
    say!("\nphase        min (s)    avg (s)    max (s)   %total");
    for (i, name) in PHASES.iter().enumerate() {
        let (lo, hi, sum) = mesh.world.min_max_sum_f64(totals.0[i]);
        let avg = sum / world;
        say!("{name:<10} {lo:>9.3} {avg:>10.3} {hi:>10.3} {:>8.1}", 100.0 * avg / total_s.max(1e-12));
    }
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
    let final_params = crate::tp::global_from_local(&params.gather_full(), mcfg, &mesh.tp);
    if !deck.checkpoint.export_hf.is_empty() && rank == 0 {
        let dir = Path::new(&deck.checkpoint.export_hf);
        crate::hf::save_params(dir, mcfg, &final_params)?;
        say!("exported the final model to {} (Hugging Face format)", dir.display());
    }
    if tcfg.activation_checkpointing == ActCkpt::Full {
        say!("activation checkpointing: full ({:.1} MiB held)", act as f64 / 1048576.0);
    }
    Ok(RunSummary {
        losses,
        entropy_floor: floor,
        final_params,
        activation_bytes: act,
        mean_step_s: step_times.iter().sum::<f64>() / step_times.len().max(1) as f64,
    })
}
