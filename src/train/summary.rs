//! What the loop tells people at the start and the end of a run (rank 0's console), and the
//! end-of-run duties: the LAMMPS-style table of each phase across ranks, the tensor-parallel
//! invariant, the Hugging Face export; and the results `run.json` records.

use super::state::ModelState;
use super::{Peak, RunSummary};
use crate::backend::Backend;
use crate::config::{ActCkpt, Deck, Resolved};
use crate::data::Sources;
use crate::metrics::{Phase, PhaseTimes};
use crate::parallel::mesh::Mesh;
use crate::run::provenance::{CheckpointWritten, Results};
use crate::run::Error;
use crate::say;
use std::path::Path;

pub(super) fn say_data(sources: &Sources, floor: Option<f64>) {
    say!("data: {}", sources.train.describe());
    if let Some(h) = &sources.held_out {
        say!("data: {}", h.describe());
    }
    if let Some(f) = floor {
        say!("data: entropy floor {f:.4} nats/token (the best loss any model can reach)");
    }
}

/// A warning when the run needs more samples than the data holds (it wraps around).
pub(super) fn warn_if_data_wraps(res: &Resolved, samples_per_epoch: u64) {
    let deck = &res.deck;
    let needed = deck.run.steps.saturating_mul(res.global_batch as u64);
    if needed > samples_per_epoch {
        say!(
            "warning: the data holds {} samples of seq_len {}; {} steps × global_batch {} need {needed}: the run wraps around \
             the data {:.1} times (epochs)",
            samples_per_epoch,
            deck.train.seq_len,
            deck.run.steps,
            res.global_batch,
            needed as f64 / samples_per_epoch as f64
        );
    }
}

/// The model line (size, backend, FLOPs, the MFU peak and, on the host, the FMA peak of the
/// rank's threads: what the silicon can do, for reading the MFU against it) and the header of
/// the step lines. The FMA probe takes about 0.1 s; every rank runs it at once, so that rank 0
/// measures its threads beside its node's other ranks as in training.
pub(super) fn say_model(res: &Resolved, backend: String, peak: &Peak, flops_per_token: f64) {
    let m = &res.deck.model;
    let n_params = crate::model::params::param_specs(m).iter().map(|s| s.numel()).sum::<usize>();
    let fma = match res.deck.run.device {
        crate::config::Device::Cpu => {
            let p = crate::backend::cpu::probe::fma_peak(crate::backend::cpu::gemm_threads());
            format!("; FMA peak {:.1} GFLOP/s per rank ({} on {} thread(s))", p.flops / 1e9, p.kernel.name(), p.threads)
        }
        crate::config::Device::Cuda => String::new(),
    };
    say!(
        "model: {} parameters ({} matmul) on {backend} ({:?} GEMMs), {:.3} GFLOP/token; MFU peak {:.1} GFLOP/s per rank ({}){fma}",
        n_params,
        crate::metrics::matmul_params(m),
        res.deck.train.precision,
        flops_per_token / 1e9,
        peak.flops / 1e9,
        peak.source
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
}

/// LAMMPS-style summary: each phase's min / avg / max across ranks, its share of the ranks' mean total,
/// and the load imbalance (max − avg) / avg; `other` is the rest of the wall time (start-up,
/// logging).
pub(super) fn say_phase_table(mesh: &Mesh, totals: &PhaseTimes, total_s: f64) {
    let world = mesh.world.size() as f64;
    // Shares of the ranks' mean total: each rank's phases and "other" add up to its own total,
    // so the column adds up to 100 % whichever rank started its clock first.
    let mean_total = mesh.world.min_max_sum_f64(total_s).2 / world;
    say!("\nphase        min (s)    avg (s)    max (s)   %total  %imbal");
    let row = |name: &str, x: f64| {
        let (lo, hi, sum) = mesh.world.min_max_sum_f64(x);
        let avg = sum / world;
        let imbalance = if avg > 0.0 { 100.0 * (hi - avg) / avg } else { 0.0 };
        say!("{name:<10} {lo:>9.3} {avg:>10.3} {hi:>10.3} {:>8.1} {imbalance:>7.1}", 100.0 * avg / mean_total.max(1e-12));
    };
    let mut phases_sum = 0.0;
    for p in Phase::ALL {
        row(p.name(), totals[p]);
        phases_sum += totals[p];
    }
    row("other", (total_s - phases_sum).max(0.0));
}

/// The run's total and median step time, and the final loss against the data's floor.
pub(super) fn say_totals(res: &Resolved, total_s: f64, step_times: &[f64], floor: Option<f64>, losses: &[f64]) {
    let tokens_per_step = (res.global_batch * res.deck.train.seq_len) as f64;
    let mut sorted = step_times.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    say!("total {:.3} s, median step {:.4} s, {:.0} tokens/s", total_s, median, tokens_per_step / median.max(1e-12));
    if let (Some(f), Some(last)) = (floor, losses.last()) {
        say!("final loss {last:.4} vs entropy floor {f:.4} (gap {:.4})", last - f);
    }
}

pub(super) fn say_memory<B: Backend<f32> + Clone>(state: &ModelState<'_, B>, activation_bytes: usize) {
    let mib = |b: usize| b as f64 / 1048576.0;
    let shard = state.shard_bytes();
    say!(
        "model state per rank: params {:.1} MiB + grads {:.1} MiB + AdamW {:.1} MiB; gathered peak {:.1} MiB; activations {:.1} MiB",
        mib(shard),
        mib(shard),
        mib(2 * shard),
        mib(state.params.gathered_peak_bytes),
        mib(activation_bytes)
    );
}

/// The invariant of tensor parallelism: the tensors every tp rank holds whole stayed
/// bit-identical.
pub(super) fn check_tp_replicas<B: Backend<f32> + Clone>(mesh: &Mesh, state: &ModelState<'_, B>) -> Result<(), Error> {
    let fp = state.replicated_fingerprint();
    let mut hi_lo = [fp, u64::MAX - fp];
    mesh.tp.all_reduce_max_u64(&mut hi_lo);
    if hi_lo[0] != u64::MAX - hi_lo[1] {
        return Err("replicated tensors (norm weights) differ across tp ranks: tensor-parallel updates diverged".into());
    }
    Ok(())
}

/// Gathers the whole model on every rank and writes it as a Hugging Face folder from rank 0:
/// an export for small models and tests; for large ones, `ndtrain ckpt export` converts a
/// checkpoint one tensor at a time.
pub(super) fn export_hf<B: Backend<f32> + Clone>(res: &Resolved, mesh: &Mesh, state: &mut ModelState<'_, B>) -> Result<(), Error> {
    let be = state.backend().clone();
    let gathered = state.params.gather_full();
    let local = gathered.map(|t| {
        let mut host = vec![0.0f32; be.len(t)];
        be.download(t, &mut host);
        host
    });
    let local = crate::parallel::ep::with_every_expert(local, &mesh.ep);
    let full = crate::parallel::tp::global_from_local(&local, &res.deck.model, &mesh.tp);
    if mesh.world.rank() == 0 {
        let dir = Path::new(&res.deck.checkpoint.export_hf);
        crate::io::hf::save_params(dir, &res.deck.model, &full)?;
        say!("exported the final model to {} (Hugging Face format)", dir.display());
    }
    Ok(())
}

pub(super) fn say_closing(deck: &Deck, skipped: u64, activation_bytes: usize) {
    if skipped > 0 {
        say!("{skipped} step(s) skipped: loss or gradient norm not finite ([optim] on_nonfinite = \"skip\")");
    }
    let ckpt = deck.train.activation_checkpointing;
    if ckpt != ActCkpt::None {
        say!("activation checkpointing: {} ({:.1} MiB held)", ckpt.name(), activation_bytes as f64 / 1048576.0);
    }
}

impl RunSummary {
    /// What `run.json` records of the run: the steps, the last losses, the mean step time and
    /// the throughput and MFU it gives, the checkpoints written.
    pub fn results(&self) -> Results {
        let steps_run = self.losses.len() as u64;
        let ran = steps_run > 0;
        let finite = |x: f64| Some(x).filter(|x| x.is_finite());
        let tokens_per_s = if ran { finite(self.tokens_per_step as f64 / self.mean_step_s) } else { None };
        Results {
            steps_run,
            first_step: ran.then_some(self.first_step + 1),
            last_step: ran.then_some(self.first_step + steps_run),
            resumed_from_step: self.first_step,
            final_loss: self.losses.last().copied().and_then(finite),
            final_val_loss: self.final_val_loss.and_then(finite),
            mean_step_s: if ran { finite(self.mean_step_s) } else { None },
            tokens_per_s,
            mfu: tokens_per_s.and_then(|t| finite(t * self.flops_per_token / (self.peak_flops * self.world_size as f64))),
            flops_per_token: self.flops_per_token,
            peak_flops_per_rank: self.peak_flops,
            skipped_steps: self.skipped_steps,
            checkpoints_written: self.checkpoints.len(),
            checkpoints: self.checkpoints.iter().map(|(step, path)| CheckpointWritten { step: *step, path: path.clone() }).collect(),
            train_s: self.train_s,
        }
    }
}
