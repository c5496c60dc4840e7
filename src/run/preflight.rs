//! What a run checks before its first collective, on every rank: everything that would
//! otherwise fail minutes or hours in — the output folders can be written, the data opens and
//! this rank's first samples hold valid token ids, the checkpoint to resume is compatible with
//! the deck, the Hugging Face folder to start from matches `[model]`.
//!
//! Every rank runs the same checks on its own view of the file systems (a file missing on one
//! node is found there), then the world agrees on the outcome: if any rank failed, every rank
//! exits with the bad-input code and each failing rank prints its reason. Nothing has been
//! written but empty folders, and no rank waits in a collective for one that stopped.

use std::path::{Path, PathBuf};

use crate::config::Resolved;
use crate::data::{open_sources, Loader};
use crate::io::checkpoint as ckpt;
use crate::parallel::mesh::Coords;

/// The checks of one rank; the first failure's message.
pub fn check(res: &Resolved, world_rank: usize, out_dir: &Path) -> Result<(), String> {
    let deck = &res.deck;
    // Every rank writes its timing log under out_dir/timing; rank 0 also the run's files.
    writable(&out_dir.join("timing"), world_rank, "[run] out_dir")?;
    if deck.checkpoint.every > 0 {
        writable(&deck.checkpoint_dir(), world_rank, "[checkpoint] dir")?;
    }
    if !deck.checkpoint.export_hf.is_empty() {
        writable(Path::new(&deck.checkpoint.export_hf), world_rank, "[checkpoint] export_hf")?;
    }
    let start_step = resume_point(res)?;
    if !deck.checkpoint.init_from.is_empty() && start_step.is_none() {
        crate::io::hf::SliceReader::open(Path::new(&deck.checkpoint.init_from), &deck.model).map_err(|e| e.to_string())?;
    }
    first_samples(res, world_rank, start_step.unwrap_or(0))
}

/// Creates `dir` and writes and removes a probe file in it, so that a read-only or full file
/// system, or a regular file in the way, is found now rather than at the first write.
fn writable(dir: &Path, world_rank: usize, key: &str) -> Result<(), String> {
    let fail = |e: std::io::Error| format!("{key}: cannot write to {}: {e}", dir.display());
    std::fs::create_dir_all(dir).map_err(fail)?;
    let probe: PathBuf = dir.join(format!(".ndtrain_write_test_rank_{world_rank:05}"));
    std::fs::write(&probe, b"ndtrain preflight\n").map_err(fail)?;
    std::fs::remove_file(&probe).map_err(fail)
}

/// The step a resume would start from (`None`: no checkpoint to resume), after checking that
/// checkpoint's format version and its model, batch and data against the deck. `auto` passes
/// over candidates that cannot be opened (training reports and skips them the same way) and
/// checks the first one that opens; its checksums are verified collectively when it is read.
fn resume_point(res: &Resolved) -> Result<Option<u64>, String> {
    let deck = &res.deck;
    let candidates = ckpt::resume_candidates(&deck.checkpoint.resume, &deck.checkpoint_dir())?;
    let auto = deck.checkpoint.resume == "auto";
    for path in &candidates {
        match ckpt::Reader::open_serial(path) {
            Ok(r) => {
                ckpt::check_compatible(&r.meta, deck, res.global_batch, path).map_err(|e| e.to_string())?;
                return Ok(Some(r.meta.step));
            }
            Err(ckpt::LoadError::Corrupt(_)) if auto => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(None)
}

/// Opens the data and reads this rank's micro-batches of the first step it will train: the
/// file's header, size and dtype, the loader's geometry and those samples' token ids (every id
/// below `[model] vocab_size`) are checked, and the same for the first held-out batch of
/// `[eval]`. Later samples are checked as they are read.
fn first_samples(res: &Resolved, world_rank: usize, step: u64) -> Result<(), String> {
    let deck = &res.deck;
    let (mcfg, tcfg) = (&deck.model, &deck.train);
    let sources =
        open_sources(&deck.data, &deck.eval, mcfg.vocab_size, deck.run.seed, tcfg.seq_len, res.global_batch).map_err(|e| e.to_string())?;
    let dp_rank = Coords::of_rank(world_rank, &res.layout).dp_rank(&res.layout);
    let loader = |data: &crate::config::DataCfg, source| {
        Loader::new(data, source, tcfg.seq_len, tcfg.micro_batch, res.global_batch, res.layout.dp(), dp_rank, deck.run.seed)
            .map_err(|e| e.to_string())
    };
    let train = loader(&deck.data, sources.train)?;
    let held_out = sources.held_out.map(|src| loader(&deck.data, src)).transpose()?;
    if step < deck.run.steps {
        for micro in 0..res.grad_accum {
            train.micro_batch(step, micro).map_err(|e| e.to_string())?;
            // The first held-out batch (every evaluation reads the same ones).
            if let Some(h) = &held_out {
                h.micro_batch(0, micro).map_err(|e| format!("[eval]: {e}"))?;
            }
        }
    }
    Ok(())
}
