//! Sharded checkpoints: one parallel-HDF5 file per checkpoint (`<dir>/step_<8 digits>.h5`).
//!
//! Every parameter and both AdamW moments are stored as their logical (Hugging Face) tensors;
//! each rank writes only the block it owns ([`blocks::shard_blocks`]), replicas write nothing,
//! and a layout-independent checksum per tensor is summed over the ranks without gathering any
//! data. [`write`] writes a file beside training, from a snapshot of the shards, with no
//! collective HDF5 call: rank 0 lays the file out, every rank writes its blocks at their
//! place in it. A file is written under a temporary name and renamed only after every rank
//! has written and synced its part, then `latest` is updated and checkpoints beyond `keep` are
//! deleted, so a crash at any moment leaves the previous checkpoint intact. Loading reads the
//! blocks the loading layout owns (one collective parallel-HDF5 transfer per tensor), so any
//! layout resumes any checkpoint of the same model and no rank ever holds the whole model.
//!
//! See `docs/checkpoint_format.md` for the file layout and every attribute. Knows nothing of
//! training: the loop hands it blocks of `f32` and a [`Meta`].

pub mod blocks;
pub mod tools;
pub mod write;

use crate::config::{Deck, ModelCfg};
use crate::io::hdf5::H5File;
use crate::parallel::comm::Group;
use crate::say;
use blocks::{block_checksum, ShardBlock};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Instant;
pub use write::{HostState, InFlight, Snapshot, SnapshotSource, WriteControl, Written};

/// Bumped whenever a reader of the previous version could misread a new file.
pub const FORMAT_VERSION: u64 = 1;

/// The groups holding the parameters and the two AdamW moments, in that order.
pub const KINDS: [&str; 3] = ["model", "optim/exp_avg", "optim/exp_avg_sq"];

/// What the per-tensor `checksum` attribute is (stored in the file too).
pub const CHECKSUM_ALGORITHM: &str = "ndtrain-additive-v1: sum mod 2^64 over elements of splitmix64_finalize(fnv1a64(dataset path) \
     + row_major_index * 0x9e3779b97f4a7c15 + f32_bits * 0xd6e8feb86659fd93)";

/// Where the data loader is: every sample order is a pure function of (seed, step), so the
/// next step, the batch geometry and the order restore it exactly.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataState {
    pub next_step: u64,
    pub samples_seen: u64,
    pub global_batch: usize,
    pub seq_len: usize,
    pub order: String,
}

impl DataState {
    /// The loader's position after `step` optimiser steps of `global_batch` sequences of `deck`.
    pub fn after(step: u64, global_batch: usize, deck: &Deck) -> DataState {
        DataState {
            next_step: step,
            samples_seen: step * global_batch as u64,
            global_batch,
            seq_len: deck.train.seq_len,
            // The deck's own spelling (`Order` serialises lowercase).
            order: serde_json::to_value(deck.data.order).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(),
        }
    }
}

/// The layout that wrote a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriterLayout {
    /// Pipeline stages (absent from checkpoints written before the pipeline existed: 1).
    #[serde(default = "one")]
    pub pp: usize,
    pub dp_replicate: usize,
    pub dp_shard: usize,
    pub cp: usize,
    pub tp: usize,
    /// Expert parallelism (absent from checkpoints written before it existed: 1).
    #[serde(default = "one")]
    pub ep: usize,
    pub world: usize,
}

fn one() -> usize {
    1
}

impl fmt::Display for WriterLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.pp > 1 {
            write!(f, "pp={} ", self.pp)?;
        }
        write!(f, "dp_replicate={} dp_shard={} cp={} tp={} ", self.dp_replicate, self.dp_shard, self.cp, self.tp)?;
        if self.ep > 1 {
            write!(f, "ep={} ", self.ep)?;
        }
        write!(f, "({} ranks)", self.world)
    }
}

/// A checkpoint's metadata (the root attributes).
#[derive(Clone, Debug, PartialEq)]
pub struct Meta {
    /// Optimiser steps taken.
    pub step: u64,
    pub tokens_seen: u64,
    /// AdamW's step count (its bias corrections).
    pub optim_step: u64,
    /// The run's seed: initialisation and data order derive from it and the step alone (no
    /// other random state exists).
    pub seed: u64,
    /// `[run] steps` of the run that wrote it (the LR schedule's length).
    pub run_steps: u64,
    pub data: DataState,
    /// The resolved deck, as `<out_dir>/deck.toml`.
    pub deck: String,
    pub layout: WriterLayout,
    pub model: ModelCfg,
    pub ndtrain_version: String,
    /// Balancing without an auxiliary loss: each expert block's selection bias (attribute
    /// `router_bias`, JSON; absent, and empty here, without it).
    pub router_bias: Vec<Vec<f64>>,
}

/// Why a checkpoint could not be loaded.
#[derive(Debug, Clone, PartialEq)]
pub enum LoadError {
    /// The file is damaged or incomplete: `resume = "auto"` falls back to an older one.
    Corrupt(String),
    /// The file is fine but does not fit this run (another model, batch or data order).
    Incompatible(String),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Corrupt(m) | LoadError::Incompatible(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for LoadError {}

/// `step_<8 digits>.h5`.
pub fn file_name(step: u64) -> String {
    format!("step_{step:08}.h5")
}

/// The step of a complete checkpoint's file name (temporary files do not match).
pub fn step_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step_")?.strip_suffix(".h5")?;
    (digits.len() >= 8 && digits.bytes().all(|b| b.is_ascii_digit())).then(|| digits.parse().ok())?
}

/// The complete checkpoints in `dir`, newest first.
pub fn list(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().filter_map(|e| step_of(&e.file_name().to_string_lossy()).map(|s| (s, e.path()))).collect())
        .unwrap_or_default();
    v.sort_by_key(|e| std::cmp::Reverse(e.0));
    v
}

/// What a write cost.
#[derive(Clone, Debug)]
pub struct SaveReport {
    pub path: PathBuf,
    /// Logical bytes of every tensor in the file.
    pub bytes: u64,
    /// From the copy into the snapshot to the file in place, seconds.
    pub seconds: f64,
    /// Collective HDF5 calls this rank made for it (none: `write`).
    pub collective_hdf5_calls: u64,
}

/// Writes the checkpoint of `meta.step` into `dir` on every rank of `world` and waits until it
/// is in place (`write`, every stage at once). `state[k][i]` is this rank's shard of kind
/// `KINDS[k]` for block `blocks[i]`. Keeps the newest `keep` checkpoints (0 = all). Returns an
/// error on every rank if any rank failed; the previous checkpoint is then untouched and the
/// temporary file removed.
pub fn save(
    dir: &Path,
    keep: usize,
    meta: &Meta,
    blocks: &[ShardBlock],
    state: [&[&[f32]]; 3],
    world: &Group,
    control: WriteControl,
) -> Result<SaveReport, String> {
    let w = write::begin(dir, keep, meta.clone(), blocks.to_vec(), &HostState(state), Snapshot::default(), world, control)?;
    Ok(w.finish(world)?.report)
}

/// Renames the finished file into place, makes the rename durable, updates `latest` (itself
/// by rename) and deletes what `keep` no longer covers (older checkpoints and stale
/// temporaries of crashed writes).
fn publish(dir: &Path, tmp: &Path, final_path: &Path, keep: usize, step: u64) -> Result<(), String> {
    let io = |what: &str, e: std::io::Error| format!("{what}: {e}");
    // The data must be durable before the name is: MPI_File_sync is not a guaranteed fsync on
    // every MPI-IO implementation, so sync the file explicitly (all of its dirty pages).
    std::fs::File::open(tmp).and_then(|f| f.sync_all()).map_err(|e| io(&format!("syncing {}", tmp.display()), e))?;
    std::fs::rename(tmp, final_path).map_err(|e| io(&format!("renaming {} to {}", tmp.display(), final_path.display()), e))?;
    let sync_dir = || std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io(&format!("syncing {}", dir.display()), e));
    sync_dir()?;
    let latest_tmp = dir.join("latest.tmp");
    std::fs::write(&latest_tmp, format!("{}\n", file_name(step))).map_err(|e| io(&format!("writing {}", latest_tmp.display()), e))?;
    std::fs::rename(&latest_tmp, dir.join("latest")).map_err(|e| io("updating latest", e))?;
    sync_dir()?;
    if keep > 0 {
        for (s, p) in list(dir).into_iter().skip(keep) {
            if s < step {
                std::fs::remove_file(&p).map_err(|e| io(&format!("deleting {} (keep = {keep})", p.display()), e))?;
            }
        }
    }
    for e in std::fs::read_dir(dir).map_err(|e| io(&format!("listing {}", dir.display()), e))?.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(s) = name.strip_suffix(".tmp").and_then(step_of) {
            if s <= step {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(())
}

fn write_meta(file: &H5File, m: &Meta) -> Result<(), String> {
    fn json<T: Serialize>(v: &T) -> String {
        serde_json::to_string(v).expect("metadata structs always serialise")
    }
    let r = (|| {
        file.set_attr_u64("format_version", FORMAT_VERSION)?;
        file.set_attr_u64("step", m.step)?;
        file.set_attr_u64("tokens_seen", m.tokens_seen)?;
        file.set_attr_u64("optim_step", m.optim_step)?;
        file.set_attr_u64("rng_seed", m.seed)?;
        file.set_attr_u64("run_steps", m.run_steps)?;
        file.set_attr_str("data_state", &json(&m.data))?;
        file.set_attr_str("deck", &m.deck)?;
        file.set_attr_str("layout", &json(&m.layout))?;
        file.set_attr_str("model", &json(&m.model))?;
        file.set_attr_str("ndtrain_version", &m.ndtrain_version)?;
        if !m.router_bias.is_empty() {
            file.set_attr_str("router_bias", &json(&m.router_bias))?;
        }
        file.set_attr_str("checksum_algorithm", CHECKSUM_ALGORITHM)
    })();
    r.map_err(|e| e.to_string())
}

fn read_meta(file: &H5File, path: &Path) -> Result<Meta, LoadError> {
    let corrupt = |e: String| LoadError::Corrupt(format!("checkpoint {}: {e}", path.display()));
    let version = file.attr_u64("format_version").map_err(|e| corrupt(e.to_string()))?;
    if version > FORMAT_VERSION {
        return Err(LoadError::Incompatible(format!(
            "checkpoint {} has format_version {version}; this ndtrain reads versions up to {FORMAT_VERSION}",
            path.display()
        )));
    }
    let u = |k: &str| file.attr_u64(k).map_err(|e| corrupt(e.to_string()));
    let s = |k: &str| file.attr_str(k).map_err(|e| corrupt(e.to_string()));
    fn parse<T: serde::de::DeserializeOwned>(k: &str, text: &str) -> Result<T, String> {
        serde_json::from_str(text).map_err(|e| format!("attribute {k} is not valid: {e}"))
    }
    Ok(Meta {
        step: u("step")?,
        tokens_seen: u("tokens_seen")?,
        optim_step: u("optim_step")?,
        seed: u("rng_seed")?,
        run_steps: u("run_steps")?,
        data: parse("data_state", &s("data_state")?).map_err(corrupt)?,
        deck: s("deck")?,
        layout: parse("layout", &s("layout")?).map_err(corrupt)?,
        model: parse("model", &s("model")?).map_err(corrupt)?,
        ndtrain_version: s("ndtrain_version")?,
        router_bias: match file.attr_str("router_bias") {
            Ok(text) => parse("router_bias", &text).map_err(corrupt)?,
            Err(_) => vec![],
        },
    })
}

/// Whether a checkpoint can continue this run: the same model (all of `[model]` but
/// `max_seq_len`), seed, global batch, sequence length and data order. A different `[run]
/// steps` is allowed (it lengthens the schedule). Errors name the key and both values.
pub fn check_compatible(meta: &Meta, deck: &Deck, global_batch: usize, path: &Path) -> Result<(), LoadError> {
    let bad = |what: String| Err(LoadError::Incompatible(format!("checkpoint {} cannot continue this run: {what}", path.display())));
    let mine = serde_json::to_value(&deck.model).expect("ModelCfg serialises");
    let theirs = serde_json::to_value(&meta.model).expect("ModelCfg serialises");
    for (k, v) in mine.as_object().expect("a table") {
        let w = &theirs[k.as_str()];
        if k != "max_seq_len" && v != w {
            return bad(format!("the deck has [model] {k} = {v}, the checkpoint's model has {k} = {w}"));
        }
    }
    if meta.seed != deck.run.seed {
        return bad(format!("the deck has [run] seed = {}, the checkpoint was written with seed = {}", deck.run.seed, meta.seed));
    }
    let d = &meta.data;
    let mine = DataState::after(meta.step, global_batch, deck);
    if d.global_batch != global_batch {
        return bad(format!(
            "the deck has [train] global_batch = {global_batch}, the checkpoint was written with global_batch = {} (the data position would not carry over)",
            d.global_batch
        ));
    }
    if d.seq_len != deck.train.seq_len {
        return bad(format!(
            "the deck has [train] seq_len = {}, the checkpoint was written with seq_len = {}",
            deck.train.seq_len, d.seq_len
        ));
    }
    if d.order != mine.order {
        return bad(format!("the deck has [data] order = \"{}\", the checkpoint was written with order = \"{}\"", mine.order, d.order));
    }
    Ok(())
}

/// A checkpoint opened for reading, its metadata already read.
pub struct Reader {
    file: H5File,
    path: PathBuf,
    pub meta: Meta,
}

/// What a load cost on this rank.
#[derive(Clone, Debug)]
pub struct LoadReport {
    /// Bytes this rank read.
    pub bytes: u64,
    pub seconds: f64,
}

impl Reader {
    /// Opens `path` on every rank of `world` (collective).
    pub fn open_parallel(path: &Path, world: &Group) -> Result<Reader, LoadError> {
        let file = H5File::open_parallel(path, world.raw()).map_err(|e| LoadError::Corrupt(e.to_string()))?;
        let meta = read_meta(&file, path)?;
        Ok(Reader { file, path: path.to_path_buf(), meta })
    }

    /// Opens `path` in this process alone (the `ckpt` tools).
    pub fn open_serial(path: &Path) -> Result<Reader, LoadError> {
        let file = H5File::open_serial(path).map_err(|e| LoadError::Corrupt(e.to_string()))?;
        let meta = read_meta(&file, path)?;
        Ok(Reader { file, path: path.to_path_buf(), meta })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn file(&self) -> &H5File {
        &self.file
    }

    /// Reads this rank's blocks of every tensor into `state[k][i]` (collective over `world`,
    /// each rank reading only its blocks) and verifies every tensor's checksum: the primary
    /// blocks' parts, summed over the world, against the stored value.
    pub fn read_into(self, blocks: &[ShardBlock], mut state: [Vec<&mut [f32]>; 3], world: &Group) -> Result<LoadReport, LoadError> {
        let start = Instant::now();
        let at = |name: &str| format!("checkpoint {}: tensor {name}", self.path.display());
        let n = blocks.len();
        let mut sums = vec![0u64; 3 * n];
        let mut stored = vec![0u64; 3 * n];
        let mut bytes = 0u64;
        for (k, kind) in KINDS.iter().enumerate() {
            for (i, b) in blocks.iter().enumerate() {
                let path = format!("{kind}/{}", b.name);
                let ds = self.file.dataset(&path).map_err(|_| LoadError::Corrupt(format!("{} is missing", at(&path))))?;
                let shape = ds.shape();
                if shape != b.global_shape {
                    return Err(LoadError::Incompatible(format!(
                        "{} has shape {shape:?}, this run's model needs {:?}",
                        at(&path),
                        b.global_shape
                    )));
                }
                stored[k * n + i] = ds.attr_u64("checksum").map_err(|e| LoadError::Corrupt(e.to_string()))?;
                let dst = &mut state[k][i][..b.len()];
                ds.read_block(&b.start, &b.count, dst).map_err(|e| LoadError::Corrupt(e.to_string()))?;
                bytes += 4 * b.len() as u64;
                if b.primary {
                    sums[k * n + i] = block_checksum(&path, b, dst);
                }
            }
        }
        world.all_reduce_wrapping_sum_u64(&mut sums);
        let bad: Vec<String> = (0..3 * n)
            .filter(|&j| sums[j] != stored[j])
            .map(|j| format!("{}/{} (stored {:#018x}, read {:#018x})", KINDS[j / n], blocks[j % n].name, stored[j], sums[j]))
            .collect();
        if !bad.is_empty() {
            return Err(LoadError::Corrupt(format!(
                "checkpoint {}: checksum mismatch in {} tensor(s): {}",
                self.path.display(),
                bad.len(),
                bad.join(", ")
            )));
        }
        self.file.close().map_err(|e| LoadError::Corrupt(e.to_string()))?;
        Ok(LoadReport { bytes, seconds: start.elapsed().as_secs_f64() })
    }
}

/// The checkpoints `[checkpoint] resume` asks for, in the order to try them: none (`""`),
/// the newest first (`"auto"`), or the one named. A named file that does not exist is an error.
pub fn resume_candidates(resume: &str, dir: &Path) -> Result<Vec<PathBuf>, String> {
    match resume {
        "" => Ok(vec![]),
        "auto" => {
            let found = list(dir);
            if found.is_empty() {
                say!("resume = \"auto\": no checkpoint in {}, starting from step 0", dir.display());
            }
            Ok(found.into_iter().map(|(_, p)| p).collect())
        }
        path => {
            let p = PathBuf::from(path);
            if !p.is_file() {
                return Err(format!("[checkpoint] resume = \"{path}\": no such checkpoint file"));
            }
            Ok(vec![p])
        }
    }
}
