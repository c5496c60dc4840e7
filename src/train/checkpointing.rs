//! Where the loop meets files of model state: resuming from a checkpoint (with `resume =
//! "auto"` the newest valid one), starting from a Hugging Face folder (`init_from`), writing a
//! checkpoint at a step boundary, and the record of each in `checkpoint_io.csv` and on the
//! console. Every rank reads and writes only its own slices.

use super::state::ModelState;
use crate::backend::Backend;
use crate::config::{ModelCfg, Resolved};
use crate::io::checkpoint::blocks::ShardBlock;
use crate::io::checkpoint::{self as ckpt, DataState, InFlight, LoadError, Meta, Snapshot, WriteControl, WriterLayout, Written};
use crate::metrics::{peak_rss_bytes, rss_bytes, CheckpointIo, CheckpointIoLog, WriteTimes};
use crate::model::params::param_specs;
use crate::parallel::mesh::Mesh;
use crate::run::faults::{self, Faults};
use crate::run::watchdog::beat;
use crate::run::{AgreedFailure, Error};
use crate::say;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Fills `state` from the first usable checkpoint of `candidates`, or else from `init_from`
/// when the deck names one, and records the load. Returns the step the run continues from.
pub(super) fn load<B: Backend<f32> + Clone>(
    state: &mut ModelState<'_, B>,
    candidates: &[PathBuf],
    res: &Resolved,
    mesh: &Mesh,
    log: &mut Option<CheckpointIoLog>,
    (start, rss_before): (Instant, u64),
) -> Result<u64, Error> {
    let deck = &res.deck;
    let state_bytes = state.shard_bytes();
    if !candidates.is_empty() {
        let (meta, path, bytes) = resume(state, candidates, deck.checkpoint.resume == "auto", res, mesh)?;
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
        log_load(mesh, log, meta.step, &path, bytes, (start, rss_before), 3 * state_bytes)?;
        return Ok(meta.step);
    }
    if !deck.checkpoint.init_from.is_empty() {
        let dir = Path::new(&deck.checkpoint.init_from);
        let reader = crate::io::hf::SliceReader::open(dir, &deck.model)?;
        let bytes = state.with_host_state_mut(|blocks, [params, _, _]| {
            let mut bytes = 0;
            for (slot, b) in params.into_iter().zip(blocks) {
                reader.read_block(&b.name, &b.start, &b.count, &mut slot[..b.len()])?;
                bytes += 4 * b.len() as u64;
            }
            Ok::<_, Error>(bytes)
        })?;
        say!("init_from: {} (each rank read only its slices)", dir.display());
        log_load(mesh, log, 0, dir, bytes, (start, rss_before), state_bytes)?;
    }
    Ok(0)
}

/// Loads the first usable checkpoint of `candidates` into the shards and moments. With
/// `auto`, a corrupt one is reported and the next older tried; a checkpoint that does not fit
/// the run (another model, batch or seed) is always an error.
fn resume<B: Backend<f32> + Clone>(
    state: &mut ModelState<'_, B>,
    candidates: &[PathBuf],
    auto: bool,
    res: &Resolved,
    mesh: &Mesh,
) -> Result<(Meta, PathBuf, u64), Error> {
    for path in candidates {
        let attempt = ckpt::Reader::open_parallel(path, &mesh.world).and_then(|r| {
            ckpt::check_compatible(&r.meta, &res.deck, res.global_batch, path)?;
            let meta = r.meta.clone();
            let report = state.with_host_state_mut(|blocks, slots| {
                let (all, own) = every_tensor(&res.deck.model, blocks);
                let slots = slots.map(|kind| {
                    let mut kind: Vec<Option<&mut [f32]>> = kind.into_iter().map(Some).collect();
                    own.iter().map(|i| i.and_then(|i| kind[i].take()).unwrap_or(&mut [])).collect()
                });
                r.read_into(&all, slots, &mesh.world)
            })?;
            Ok((meta, report.bytes))
        });
        match attempt {
            Ok((meta, bytes)) => {
                state.rule.t = meta.optim_step;
                if !state.router_bias.is_empty() && !meta.router_bias.is_empty() {
                    state.router_bias = meta.router_bias.clone();
                }
                return Ok((meta, path.clone(), bytes));
            }
            Err(LoadError::Corrupt(e)) if auto => say!("resume = \"auto\": skipping a checkpoint that is not valid: {e}"),
            Err(e) => return Err(e.into()),
        }
    }
    Err(format!("resume = \"auto\": no checkpoint in {} is valid (each failed as reported above)", res.deck.checkpoint_dir().display())
        .into())
}

/// Every tensor of the model in `param_specs` order, as this rank's block of it (`own`, its
/// slot order) or, where it holds none (another pipeline stage's), an empty block: every rank
/// then makes the same collective calls for every tensor of the file. Also returns each
/// tensor's index in `own`.
fn every_tensor(cfg: &ModelCfg, own: &[ShardBlock]) -> (Vec<ShardBlock>, Vec<Option<usize>>) {
    param_specs(cfg)
        .into_iter()
        .map(|spec| match own.iter().position(|b| b.name == spec.name) {
            Some(i) => (own[i].clone(), Some(i)),
            None => {
                let dims = spec.global_shape.len();
                (
                    ShardBlock {
                        name: spec.name,
                        global_shape: spec.global_shape,
                        start: vec![0; dims],
                        count: vec![0; dims],
                        primary: false,
                    },
                    None,
                )
            }
        })
        .unzip()
}

/// Records a load (a resume or `init_from`) in `checkpoint_io.csv`: bytes read by all ranks,
/// the slowest rank's time, and the largest resident memory before and after.
fn log_load(
    mesh: &Mesh,
    log: &mut Option<CheckpointIoLog>,
    step: u64,
    file: &Path,
    bytes: u64,
    (start, rss_before): (Instant, u64),
    state_bytes: usize,
) -> Result<(), Error> {
    let seconds = mesh.world.min_max_sum_f64(start.elapsed().as_secs_f64()).1;
    let total = mesh.world.min_max_sum_f64(bytes as f64).2 as u64;
    let before = mesh.world.min_max_sum_f64(rss_before as f64).1 as u64;
    let peak = mesh.world.min_max_sum_f64(peak_rss_bytes() as f64).1 as u64;
    // Every collective HDF5 call so far was the load's (and any candidate's it skipped).
    let calls = mesh.world.min_max_sum_f64(crate::io::hdf5::collective_calls() as f64).1 as u64;
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
            collective_hdf5_calls: calls,
            writing: None,
        })?;
    }
    Ok(())
}

/// Starts the checkpoint after `step` optimiser steps into `dir`: every rank copies its shards
/// into `snapshot` and a writer thread writes them (`io::checkpoint::write`). A failure on any
/// rank is agreed on every rank and ends the run; the previous checkpoint and `latest` are
/// untouched.
pub(super) fn begin<B: Backend<f32> + Clone>(
    state: &ModelState<'_, B>,
    res: &Resolved,
    mesh: &Mesh,
    (dir, step): (&Path, u64),
    snapshot: Snapshot,
    faults: &Faults,
) -> Result<InFlight, Error> {
    let deck = &res.deck;
    let l = res.layout;
    let data = DataState::after(step, res.global_batch, deck);
    let meta = Meta {
        step,
        tokens_seen: data.samples_seen * deck.train.seq_len as u64,
        optim_step: state.rule.t,
        seed: deck.run.seed,
        run_steps: deck.run.steps,
        data,
        deck: deck.to_toml(),
        layout: WriterLayout {
            pp: l.pp,
            dp_replicate: l.dp_replicate,
            dp_shard: l.dp_shard,
            cp: l.cp,
            tp: l.tp,
            ep: l.ep,
            world: mesh.world.size(),
        },
        model: deck.model.clone(),
        ndtrain_version: env!("CARGO_PKG_VERSION").to_string(),
        router_bias: state.router_bias.clone(),
    };
    let rank = mesh.world.rank();
    let control = WriteControl {
        progress: Arc::new(|what: &str| beat(|| what.to_string())),
        abort: faults::abort_during_checkpoint().map(|s| (faults::ABORT_DURING_CHECKPOINT_ENV, s)),
        fail: faults::fires(&faults.checkpoint_write_error, rank, step)
            .then(|| format!("rank {rank}: injected write error ({})", faults::CHECKPOINT_WRITE_ERROR_ENV)),
        delay: faults.checkpoint_write_delay,
    };
    let (all, own) = every_tensor(&deck.model, &state.blocks);
    let in_flight = ckpt::write::begin(dir, deck.checkpoint.keep, meta, all, &state.snapshot_source(&own), snapshot, &mesh.world, control);
    in_flight.map_err(|e| write_failed(mesh, e))
}

/// A failed write, agreed on every rank: the run ends (the documented policy: the previous
/// checkpoint and `latest` are untouched, `resume = "auto"` continues from them).
pub(super) fn write_failed(mesh: &Mesh, e: String) -> Error {
    let first = mesh.world.rank() == 0;
    AgreedFailure { message: first.then(|| format!("{e}; the run stops here (checkpoint write failures end the run)")) }.into()
}

/// What the training thread spent on one checkpoint before it finished: the copy into the
/// snapshot, and all of it (the copy, agreeing at its step and at the boundaries after).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Stall {
    pub snapshot_s: f64,
    pub stall_s: f64,
}

/// Records the finished write `w` of the checkpoint after `step` in `checkpoint_io.csv` and on
/// the console: its bytes, its whole time, and what it stalled training (`stall`, and the wait
/// for it to finish, at the next checkpoint, a stop or the end of the run: `w.waited_s`).
pub(super) fn record<B: Backend<f32> + Clone>(
    w: &Written,
    stall: Stall,
    state: &ModelState<'_, B>,
    mesh: &Mesh,
    log: &mut Option<CheckpointIoLog>,
) -> Result<(), Error> {
    let world = &mesh.world;
    let r = &w.report;
    let seconds = world.min_max_sum_f64(r.seconds).1;
    let stall_s = world.min_max_sum_f64(stall.stall_s + w.waited_s).1;
    let snapshot_s = world.min_max_sum_f64(stall.snapshot_s).1;
    let waited_s = world.min_max_sum_f64(w.waited_s).1;
    let calls = world.min_max_sum_f64(r.collective_hdf5_calls as f64).1 as u64;
    let rss = world.min_max_sum_f64(rss_bytes() as f64).1 as u64;
    let peak = world.min_max_sum_f64(peak_rss_bytes() as f64).1 as u64;
    let snapshot_bytes = world.min_max_sum_f64(w.snapshot.bytes() as f64).1 as u64;
    say!(
        "checkpoint {}: {:.1} MiB in {:.2} s ({:.0} MB/s), training stalled {:.3} s (snapshot {:.3} s)",
        r.path.display(),
        r.bytes as f64 / 1048576.0,
        seconds,
        r.bytes as f64 / 1e6 / seconds.max(1e-9),
        stall_s,
        snapshot_s,
    );
    if let Some(l) = log.as_mut() {
        l.append(&CheckpointIo {
            event: "write",
            step: w.step,
            file: &r.path,
            bytes: r.bytes,
            seconds,
            collective: false,
            rss_before_bytes: rss,
            peak_rss_bytes: peak,
            state_bytes_per_rank: 3 * state.shard_bytes() as u64,
            collective_hdf5_calls: calls,
            writing: Some(WriteTimes { stall_s, snapshot_s, waited_s, snapshot_bytes }),
        })?;
    }
    Ok(())
}
