//! The training loop of a model held whole on one device, on any [`Backend`]: the GPU path of
//! `[run] device = "cuda"` (one rank, one GPU), and — through the debug option
//! `NDTRAIN_DEBUG_DEVICE_LOOP` — the same loop on the host backend, so that a CPU test checks
//! this loop against the main one (`train`) and only the backend's operations are left for a
//! GPU to check (`ndtrain gpu-check`).
//!
//! Parameters, gradients and both AdamW moments live on the device, one buffer per tensor; the
//! data, the schedule, the loss normalisation, clipping and the logs are the main loop's
//! (DESIGN.md). What the main loop has and this one not yet: checkpoints, the sharded layouts
//! and the per-rank timing log's collective columns (`docs/gpu.md`).

use crate::backend::{AdamStep, Backend};
use crate::comm::Group;
use crate::config::{OnNonFinite, Resolved};
use crate::data::{open_source, Loader};
use crate::metrics::{flops_per_token, fmt_duration, MetricsCsv, StepRecord};
use crate::model::params::{param_specs, Dims, ModelParams, Params};
use crate::model::{Model, Par, RingComm, Tokens, TpComm};
use crate::optim::{clip_coefficient, lr_at};
use crate::say;
use crate::train::{Error, RunSummary};
use std::path::Path;
use std::time::Instant;

/// Trains `res` on backend `be` (the world is one rank: `config` checks it for `cuda`), with
/// the backend's identity collectives `par`. `peak` is the FLOP rate MFU is stated against.
pub fn train<B: Backend<f32>>(
    be: B,
    par: Par<'_, B::Buf>,
    res: &Resolved,
    world: &Group,
    out_dir: &Path,
    peak: (f64, &str),
) -> Result<RunSummary, Error> {
    let deck = &res.deck;
    let (mcfg, tcfg, ocfg) = (&deck.model, &deck.train, &deck.optim);
    assert_eq!(world.size(), 1, "the one-device loop runs on one rank");
    let (s, mb, ga) = (tcfg.seq_len, tcfg.micro_batch, res.grad_accum);

    // The model state on the device: the seeded initial model (or a Hugging Face folder),
    // built on the host once and copied over; zero gradients and moments.
    let host: ModelParams<f32> = if deck.checkpoint.init_from.is_empty() {
        ModelParams::init(mcfg, deck.run.seed)
    } else {
        let dir = Path::new(&deck.checkpoint.init_from);
        say!("init_from: {}", dir.display());
        crate::hf::load_params(dir, mcfg)?
    };
    let upload = |t: &Vec<f32>| {
        let mut b = B::Buf::default();
        be.upload(&mut b, t);
        b
    };
    let zeros = |t: &Vec<f32>| be.zeros(t.len());
    let mut params: Params<B::Buf> = host.map(upload);
    let mut grads: Params<B::Buf> = host.map(zeros);
    let mut exp_avg: Params<B::Buf> = host.map(zeros);
    let mut exp_avg_sq: Params<B::Buf> = host.map(zeros);
    let specs = param_specs(mcfg);
    let decayed: Vec<bool> = specs.iter().map(|p| p.decayed()).collect();
    let n_params: usize = specs.iter().map(|p| p.numel()).sum();
    drop(host);

    let mut model = Model::<f32, B>::on(be, Dims::full(mcfg), tcfg.activation_checkpointing, false);
    let source = open_source(&deck.data, mcfg.vocab_size, deck.run.seed)?;
    let floor = source.entropy_floor(s);
    say!("data: {}", source.describe());
    let loader = Loader::new(&deck.data, source, s, mb, res.global_batch, 1, 0, deck.run.seed)?;
    let positions: Vec<usize> = (0..s).collect();

    let mut metrics = MetricsCsv::create(&out_dir.join("metrics.csv"), 0)?;
    let flops_tok = flops_per_token(mcfg, s);
    say!(
        "model: {n_params} parameters on {} ({:?} GEMMs), {:.3} GFLOP/token; MFU peak {:.1} GFLOP/s ({})",
        model.backend().describe(),
        tcfg.precision,
        flops_tok / 1e9,
        peak.0 / 1e9,
        peak.1
    );
    say!("{:>6} {:>12} {:>10} {:>9} {:>11} {:>6} {:>9} {:>8}", "step", "loss", "lr", "gnorm", "tok/s", "mfu", "elapsed", "eta");

    let steps = deck.run.steps;
    let tokens_per_step = (res.global_batch * s) as f64;
    let n_tok = (ga * mb * s) as f64;
    let mut losses = Vec::with_capacity(steps as usize);
    let (mut step_times, mut skipped, mut t) = (Vec::new(), 0u64, 0u64);
    let run_start = Instant::now();
    for step in 0..steps {
        let step_start = Instant::now();
        let be = model.backend();
        for g in grads.tensors_mut() {
            be.fill(g, 0.0);
        }
        let mut loss_sum = 0.0;
        for micro in 0..ga {
            let batch = loader.micro_batch(step, micro)?;
            let tok = Tokens { inputs: &batch.inputs, targets: &batch.targets, positions: &positions, batch: mb, seq: s };
            loss_sum += model.forward_with(&mut &params, &tok, par);
            model.backward_with(&mut &params, &mut grads, (1.0 / n_tok) as f32, par);
        }
        let be = model.backend();
        let loss = loss_sum / n_tok;
        let grad_norm = grads.tensors().iter().map(|g| be.sum_sq(g)).sum::<f64>().sqrt();
        let lr = lr_at(ocfg, res.lr, step, steps);
        if loss.is_finite() && grad_norm.is_finite() {
            let coef = clip_coefficient(grad_norm, ocfg.grad_clip);
            t += 1;
            let tensors =
                params.tensors_mut().into_iter().zip(grads.tensors_mut()).zip(exp_avg.tensors_mut()).zip(exp_avg_sq.tensors_mut());
            for ((((p, g), m), v), &d) in tensors.zip(&decayed) {
                if coef != 1.0 {
                    be.scale(g, coef as f32);
                }
                be.adamw(p, m, v, g, &AdamStep::new(t, lr, ocfg.beta1, ocfg.beta2, ocfg.eps, ocfg.weight_decay, d));
            }
        } else if ocfg.on_nonfinite == OnNonFinite::Skip {
            skipped += 1;
            say!("step {}: loss {loss}, gradient norm {grad_norm}: not finite; update skipped ({skipped} so far)", step + 1);
        } else {
            return Err(format!(
                "rank 0: step {}: loss {loss}, gradient norm {grad_norm}: not finite ([optim] on_nonfinite = \"abort\")",
                step + 1
            )
            .into());
        }
        // The step's time includes the device finishing its work: sum_sq waited for it.
        let train_s = step_start.elapsed().as_secs_f64();
        step_times.push(train_s);
        losses.push(loss);
        let elapsed = run_start.elapsed().as_secs_f64();
        let tps = tokens_per_step / train_s;
        let rec = StepRecord {
            step: step + 1,
            loss,
            lr,
            grad_norm,
            tokens_per_s: tps,
            mfu: tps * flops_tok / peak.0,
            step_s: train_s,
            elapsed_s: elapsed,
            world: 1,
        };
        metrics.append(&rec)?;
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
    let mut sorted = step_times.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    say!(
        "total {:.3} s, median step {:.4} s, {:.0} tokens/s, MFU {:.1}%",
        run_start.elapsed().as_secs_f64(),
        median,
        tokens_per_step / median.max(1e-12),
        100.0 * tokens_per_step / median.max(1e-12) * flops_tok / peak.0
    );
    if let (Some(f), Some(last)) = (floor, losses.last()) {
        say!("final loss {last:.4} vs entropy floor {f:.4} (gap {:.4})", last - f);
    }
    Ok(RunSummary {
        losses,
        entropy_floor: floor,
        activation_bytes: model.activation_bytes(),
        mean_step_s: step_times.iter().sum::<f64>() / step_times.len().max(1) as f64,
        preempted: false,
        skipped_steps: skipped,
    })
}

/// The identity collectives of a single rank for buffers of type `V`, for backends whose
/// buffers are not host vectors (sequence parallelism is off without a tp group, so the
/// gather and scatter are never called).
pub struct Alone;

impl<V> TpComm<V> for Alone {
    fn all_reduce_sum(&self, _buf: &mut V) {}
    fn all_reduce_max(&self, _buf: &mut V) {}
    fn all_gather(&self, _send: &V, _recv: &mut V) {
        unreachable!("sequence parallelism is off on one rank")
    }
    fn reduce_scatter_sum(&self, _send: &V, _recv: &mut V) {
        unreachable!("sequence parallelism is off on one rank")
    }
}

impl<V> RingComm<V> for Alone {
    fn degree(&self) -> usize {
        1
    }
    fn rank(&self) -> usize {
        0
    }
    fn start_shift(&self, _slot: usize, _buf: &V) {}
    fn finish_shift(&self, _slot: usize, _buf: &mut V) {}
}
