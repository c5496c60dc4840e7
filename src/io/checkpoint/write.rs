//! Writing a checkpoint beside training.
//!
//! At a checkpoint step every rank copies its shards into a [`Snapshot`] (the only part that
//! stops training) and hands it to a writer thread of its own. The file's structure and its
//! data are then written apart:
//!
//! 1. **layout** — rank 0's writer creates the file under its temporary name alone (serial
//!    HDF5): its groups and every tensor's contiguous dataset, its space allocated at once and
//!    never pre-filled, and reads where each dataset's data starts in the file. Every writer
//!    sums its part of each tensor's checksum meanwhile.
//! 2. **data** — the offsets go to every rank (one broadcast) and the parts of the checksums
//!    are summed (one all-reduce); each writer writes the rows of its blocks at their place in
//!    the file with positional writes (`pwrite`) and flushes them to the file system.
//! 3. **publish** — once every rank's data is down, rank 0's writer adds the checksums and the
//!    metadata as attributes, closes the file, syncs it, renames it into place, updates
//!    `latest` and prunes (`super::publish`).
//!
//! No MPI call leaves the training thread: between the stages the training thread of every
//! rank agrees, at a step boundary ([`InFlight::poll`]), on whether every writer has finished
//! the stage, and moves all of them on together. So MPI needs no thread support beyond the
//! default, and a checkpoint takes no collective HDF5 call at all, whatever its number of
//! tensors (rank 0's layout is serial HDF5, the data plain file I/O). The file is an ordinary
//! HDF5 file: the datasets' type is the host's native `f32`, whose bytes the writers copy.
//!
//! A crash at any moment leaves at most the temporary file, which resume never takes and the
//! next publish deletes; the previous checkpoint and `latest` stay as they were until the new
//! file is complete and synced.

use super::blocks::{block_checksum_serial, ShardBlock};
use super::{publish, write_meta, Meta, SaveReport, KINDS};
use crate::io::hdf5::{collective_calls, H5File};
use crate::parallel::comm::Group;
use crate::say;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// A copy of this rank's shards: per kind (`KINDS`), per tensor of the file, its block's
/// elements. Its buffers are kept from one checkpoint to the next, so that a copy reuses
/// memory already mapped and, on a device, already page-locked: the copy out of device memory
/// then runs at the bus's speed, and only once are the buffers locked.
#[derive(Debug, Default)]
pub struct Snapshot {
    kinds: [Vec<Vec<f32>>; 3],
    /// Whether each buffer is page-locked (by the source that filled it): it is unlocked
    /// before it is freed or resized.
    pinned: [Vec<bool>; 3],
}

/// Where a snapshot copies this rank's state from, and who page-locks its buffers.
pub trait SnapshotSource {
    /// Copies the first `dst.len()` elements of the block of tensor `tensor` (file order) of
    /// kind `KINDS[kind]` into `dst`.
    fn copy(&self, kind: usize, tensor: usize, dst: &mut [f32]);
    /// Page-locks `buf` for copies from a device; false where nothing is locked (the host).
    fn pin(&self, _buf: &mut [f32]) -> bool {
        false
    }
    /// Unlocks a buffer `pin` locked.
    fn unpin(&self, _buf: &mut [f32]) {}
}

/// A state in host memory, as [`super::save`] takes it: `state[k][i]` holds at least the
/// elements of block `i` of kind `k`.
pub struct HostState<'a>(pub [&'a [&'a [f32]]; 3]);

impl SnapshotSource for HostState<'_> {
    fn copy(&self, kind: usize, tensor: usize, dst: &mut [f32]) {
        dst.copy_from_slice(&self.0[kind][tensor][..dst.len()]);
    }
}

impl Snapshot {
    /// Copies from `source` every block this rank writes (its primary ones; the others stay
    /// empty). A buffer is allocated, and locked, only where its length changes.
    pub fn fill(&mut self, blocks: &[ShardBlock], source: &dyn SnapshotSource) {
        for (kind, (bufs, pinned)) in self.kinds.iter_mut().zip(&mut self.pinned).enumerate() {
            for (buf, locked) in bufs.iter_mut().zip(pinned.iter_mut()).skip(blocks.len()) {
                Self::free(buf, locked, source);
            }
            bufs.resize_with(blocks.len(), Vec::new);
            pinned.resize(blocks.len(), false);
            for (i, b) in blocks.iter().enumerate() {
                let len = if b.primary { b.len() } else { 0 };
                if bufs[i].len() != len {
                    Self::free(&mut bufs[i], &mut pinned[i], source);
                    bufs[i] = vec![0.0; len];
                    pinned[i] = len > 0 && source.pin(&mut bufs[i]);
                }
                source.copy(kind, i, &mut bufs[i]);
            }
        }
    }

    /// Unlocks and frees every buffer (at the end of a run, while the device that locked them
    /// is still there).
    pub fn release(&mut self, source: &dyn SnapshotSource) {
        for (bufs, pinned) in self.kinds.iter_mut().zip(&mut self.pinned) {
            for (buf, locked) in bufs.iter_mut().zip(pinned.iter_mut()) {
                Self::free(buf, locked, source);
            }
            bufs.clear();
            pinned.clear();
        }
    }

    fn free(buf: &mut Vec<f32>, locked: &mut bool, source: &dyn SnapshotSource) {
        if std::mem::take(locked) {
            source.unpin(buf);
        }
        *buf = Vec::new();
    }

    /// The memory the snapshot holds.
    pub fn bytes(&self) -> u64 {
        self.kinds.iter().flatten().map(|v| 4 * v.capacity() as u64).sum()
    }

    /// The part of it that is page-locked.
    #[cfg(test)]
    fn pinned_bytes(&self) -> u64 {
        let kinds = self.kinds.iter().flatten().zip(self.pinned.iter().flatten());
        kinds.filter(|(_, &p)| p).map(|(v, _)| 4 * v.capacity() as u64).sum()
    }
}

/// What a write is told from outside: whom to report progress to, and the debug faults a test
/// injects (`docs/debugging.md`).
pub struct WriteControl {
    /// Called (on the writer's thread) before each tensor is written: the watchdog's beat.
    pub progress: Arc<dyn Fn(&str) + Send + Sync>,
    /// Abort the whole job while the writers write this step's data: `(the debug option, its
    /// value)`.
    pub abort: Option<(&'static str, u64)>,
    /// This rank's write fails with this message.
    pub fail: Option<String>,
    /// The writer sleeps this long before each tensor (a slow file system, for tests).
    pub delay: Option<std::time::Duration>,
}

/// What the training thread tells a writer.
enum Go {
    /// Write the data; the datasets start at these byte offsets (`KINDS` × tensors).
    Write(Vec<u64>),
    /// Rank 0: the summed checksums; finish the file and publish it.
    Publish(Vec<u64>),
}

/// What a writer reports at the end of each stage.
enum Done {
    /// This rank's parts of the checksums and, on rank 0, the datasets' offsets.
    Laid(Result<(Vec<u64>, Vec<u64>), String>),
    Written(Result<(), String>),
    Published(Result<(), String>),
    /// The writer ended without its report.
    Gone,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Layout,
    Data,
    Publish,
}

/// A checkpoint being written: the training thread's side of its writer.
pub struct InFlight {
    pub step: u64,
    final_path: PathBuf,
    tmp: PathBuf,
    stage: Stage,
    /// The writer's report of the current stage, once it came.
    report: Option<Done>,
    to_writer: Sender<Go>,
    from_writer: Receiver<Done>,
    writer: Option<JoinHandle<Snapshot>>,
    sums: Vec<u64>,
    abort: Option<(&'static str, u64)>,
    rank0: bool,
    started: Instant,
    /// Logical bytes of every tensor in the file.
    bytes: u64,
    /// The copy into the snapshot, seconds, and the memory it holds.
    pub snapshot_s: f64,
    pub snapshot_bytes: u64,
    /// What the training thread waited for the writer (in [`InFlight::finish`]), seconds.
    pub waited_s: f64,
    calls_before: u64,
}

/// A finished write: its report and the snapshot's buffers for the next one.
pub struct Written {
    pub step: u64,
    pub report: SaveReport,
    pub snapshot: Snapshot,
    /// What the training thread waited for it to finish, seconds.
    pub waited_s: f64,
}

/// Starts writing the checkpoint of `meta.step` into `dir` on every rank of `world`
/// (collective): copies this rank's shards (`blocks`, from `source`) into `snapshot` and hands
/// it to a new writer thread. Returns once the copy is made.
#[allow(clippy::too_many_arguments)]
pub fn begin(
    dir: &Path,
    keep: usize,
    meta: Meta,
    blocks: Vec<ShardBlock>,
    source: &dyn SnapshotSource,
    mut snapshot: Snapshot,
    world: &Group,
    control: WriteControl,
) -> Result<InFlight, String> {
    let started = Instant::now();
    let calls_before = collective_calls();
    let rank0 = world.rank() == 0;
    let name = super::file_name(meta.step);
    let (final_path, tmp) = (dir.join(&name), dir.join(format!("{name}.tmp")));
    world.agree(if rank0 { std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display())) } else { Ok(()) })?;
    let copy = Instant::now();
    snapshot.fill(&blocks, source);
    let (snapshot_s, snapshot_bytes) = (copy.elapsed().as_secs_f64(), snapshot.bytes());
    let bytes = blocks.iter().map(|b| 4 * b.global_shape.iter().product::<usize>() as u64).sum::<u64>() * KINDS.len() as u64;
    // HDF5 initialises itself on its first call, and a parallel build then registers a
    // callback with MPI: that call must come from this thread, the only one that calls MPI.
    crate::io::hdf5::library_version();
    let (to_writer, orders) = channel();
    let (reports, from_writer) = channel();
    let step = meta.step;
    let abort = control.abort;
    let job = Job { dir: dir.to_path_buf(), keep, tmp: tmp.clone(), final_path: final_path.clone(), meta, blocks, rank0, control };
    let writer = std::thread::Builder::new()
        .name(format!("checkpoint-{step}"))
        .spawn(move || job.run(snapshot, orders, reports))
        .map_err(|e| format!("cannot start the checkpoint writer thread: {e}"));
    let writer = world.agree(writer)?;
    Ok(InFlight {
        step,
        final_path,
        tmp,
        stage: Stage::Layout,
        report: None,
        to_writer,
        from_writer,
        writer: Some(writer),
        sums: vec![],
        abort,
        rank0,
        started,
        bytes,
        snapshot_s,
        snapshot_bytes,
        waited_s: 0.0,
        calls_before,
    })
}

impl InFlight {
    /// Moves the write on at a step boundary, on every rank of `world` together (collective):
    /// each stage every writer has finished is agreed and the next one started. Returns the
    /// finished write once it is published, `None` while a writer is still busy. An error is
    /// agreed on every rank; the temporary file is then removed and the previous checkpoint
    /// is untouched.
    pub fn poll(&mut self, world: &Group) -> Result<Option<Written>, String> {
        self.advance(world, false)
    }

    /// Waits for the write to be published (collective), counting the wait in `waited_s`.
    pub fn finish(mut self, world: &Group) -> Result<Written, String> {
        let t = Instant::now();
        let r = self.advance(world, true);
        self.waited_s += t.elapsed().as_secs_f64();
        let mut w = r?.expect("a blocking advance returns once the write is published");
        w.waited_s = self.waited_s;
        Ok(w)
    }

    fn advance(&mut self, world: &Group, block: bool) -> Result<Option<Written>, String> {
        loop {
            // Only rank 0's writer works in the last stage.
            let idle = self.stage == Stage::Publish && !self.rank0;
            if self.report.is_none() && !idle {
                // A writer that ended without its report (it panicked) is a failed stage.
                self.report = if block {
                    Some(self.from_writer.recv().unwrap_or(Done::Gone))
                } else {
                    match self.from_writer.try_recv() {
                        Ok(d) => Some(d),
                        Err(TryRecvError::Empty) => None,
                        Err(TryRecvError::Disconnected) => Some(Done::Gone),
                    }
                };
            }
            if world.count_true(idle || self.report.is_some()) < world.size() {
                return Ok(None);
            }
            let report = self.report.take();
            match self.stage {
                Stage::Layout => {
                    let laid = match report {
                        Some(Done::Laid(r)) => r,
                        _ => Err(self.writer_gone()),
                    };
                    let (mut sums, offsets) = world.agree(laid).map_err(|e| self.abandon(e))?;
                    world.all_reduce_wrapping_sum_u64(&mut sums);
                    let offsets = broadcast_u64(world, offsets);
                    if let Some((option, step)) = self.abort.filter(|&(_, s)| s == self.step && self.rank0) {
                        say!("{option}={step}: aborting the job in the middle of writing {}", self.tmp.display());
                        let _ = self.to_writer.send(Go::Write(offsets));
                        crate::parallel::comm::abort(crate::exit::RUN_FAILED);
                    }
                    let sent = self.to_writer.send(Go::Write(offsets)).map_err(|_| self.writer_gone());
                    world.agree(sent).map_err(|e| self.abandon(e))?;
                    self.sums = sums;
                    self.stage = Stage::Data;
                }
                Stage::Data => {
                    let written = match report {
                        Some(Done::Written(r)) => r,
                        _ => Err(self.writer_gone()),
                    };
                    world.agree(written).map_err(|e| self.abandon(e))?;
                    let sent = if self.rank0 {
                        self.to_writer.send(Go::Publish(std::mem::take(&mut self.sums))).map_err(|_| self.writer_gone())
                    } else {
                        Ok(())
                    };
                    world.agree(sent).map_err(|e| self.abandon(e))?;
                    self.stage = Stage::Publish;
                }
                Stage::Publish => {
                    let published = match report {
                        _ if !self.rank0 => Ok(()),
                        Some(Done::Published(r)) => r,
                        _ => Err(self.writer_gone()),
                    };
                    world.agree(published).map_err(|e| self.abandon(e))?;
                    let snapshot = self.writer.take().and_then(|h| h.join().ok()).unwrap_or_default();
                    let report = SaveReport {
                        path: self.final_path.clone(),
                        bytes: self.bytes,
                        seconds: self.started.elapsed().as_secs_f64(),
                        collective_hdf5_calls: collective_calls() - self.calls_before,
                    };
                    return Ok(Some(Written { step: self.step, report, snapshot, waited_s: self.waited_s }));
                }
            }
        }
    }

    /// Ends a failed write: stops this rank's writer, removes the temporary file (rank 0) and
    /// words the agreed error `e`.
    fn abandon(&mut self, e: String) -> String {
        // A writer waiting for its next order sees the channel close and returns.
        self.to_writer = channel().0;
        if let Some(h) = self.writer.take() {
            let _ = h.join();
        }
        if self.rank0 {
            let _ = std::fs::remove_file(&self.tmp);
        }
        format!("writing checkpoint {}: {e} (the previous checkpoint is untouched)", self.final_path.display())
    }

    fn writer_gone(&self) -> String {
        format!("the writer thread of checkpoint step {} ended before its write did", self.step)
    }
}

/// `values` of rank 0 on every rank of `world`.
fn broadcast_u64(world: &Group, values: Vec<u64>) -> Vec<u64> {
    let mut bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    world.broadcast_bytes(0, &mut bytes);
    bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
}

/// What a writer thread needs to write one checkpoint.
struct Job {
    dir: PathBuf,
    keep: usize,
    tmp: PathBuf,
    final_path: PathBuf,
    meta: Meta,
    /// Every tensor of the file, as this rank's block of it (empty where it holds none).
    blocks: Vec<ShardBlock>,
    rank0: bool,
    control: WriteControl,
}

impl Job {
    /// The writer thread: each stage when the training thread orders it; returns the snapshot
    /// for the next checkpoint to reuse. A closed channel (the write was abandoned) ends it.
    fn run(self, snapshot: Snapshot, orders: Receiver<Go>, reports: Sender<Done>) -> Snapshot {
        if reports.send(Done::Laid(self.lay_out(&snapshot))).is_err() {
            return snapshot;
        }
        let Ok(Go::Write(offsets)) = orders.recv() else { return snapshot };
        let written = match &self.control.fail {
            Some(e) => Err(e.clone()),
            None => self.write_data(&snapshot, &offsets),
        };
        if reports.send(Done::Written(written)).is_err() || !self.rank0 {
            return snapshot;
        }
        let Ok(Go::Publish(sums)) = orders.recv() else { return snapshot };
        let _ = reports.send(Done::Published(self.publish(&sums)));
        snapshot
    }

    /// This rank's parts of every tensor's checksum and, on rank 0, the file's layout.
    fn lay_out(&self, snapshot: &Snapshot) -> Result<(Vec<u64>, Vec<u64>), String> {
        let n = self.blocks.len();
        let mut sums = vec![0u64; KINDS.len() * n];
        for (k, kind) in KINDS.iter().enumerate() {
            for (i, b) in self.blocks.iter().enumerate().filter(|(_, b)| b.primary) {
                sums[k * n + i] = block_checksum_serial(&format!("{kind}/{}", b.name), b, &snapshot.kinds[k][i]);
            }
        }
        let offsets = if self.rank0 { self.create_layout().map_err(|e| format!("rank 0: {e}"))? } else { vec![] };
        Ok((sums, offsets))
    }

    /// Creates the temporary file with every group and dataset, and returns where each
    /// dataset's data starts (`KINDS` × tensors).
    fn create_layout(&self) -> Result<Vec<u64>, String> {
        let file = H5File::create_serial(&self.tmp).map_err(|e| e.to_string())?;
        for g in ["model", "optim", "optim/exp_avg", "optim/exp_avg_sq"] {
            file.create_group(g).map_err(|e| e.to_string())?;
        }
        let mut offsets = Vec::with_capacity(KINDS.len() * self.blocks.len());
        for kind in KINDS {
            for b in &self.blocks {
                let path = format!("{kind}/{}", b.name);
                let ds = file.create_f32(&path, &b.global_shape).map_err(|e| e.to_string())?;
                let at =
                    ds.file_offset().ok_or_else(|| format!("{}: {path}: HDF5 gave its data no place in the file", self.tmp.display()))?;
                offsets.push(at);
            }
        }
        file.close().map_err(|e| e.to_string())?;
        Ok(offsets)
    }

    /// Writes this rank's primary blocks at their place in the file and flushes them to the
    /// file system.
    fn write_data(&self, snapshot: &Snapshot, offsets: &[u64]) -> Result<(), String> {
        let io = |what: &str, e: std::io::Error| format!("{}: {what}: {e}", self.tmp.display());
        let file = std::fs::OpenOptions::new().write(true).open(&self.tmp).map_err(|e| io("opening for writing", e))?;
        let n = self.blocks.len();
        for (k, kind) in KINDS.iter().enumerate() {
            for (i, b) in self.blocks.iter().enumerate().filter(|(_, b)| b.primary && !b.is_empty()) {
                (self.control.progress)(&format!("writing checkpoint step {}: {kind}/{}", self.meta.step, b.name));
                if let Some(d) = self.control.delay {
                    std::thread::sleep(d);
                }
                let data = &snapshot.kinds[k][i];
                for (src, at) in runs(b) {
                    file.write_all_at(as_bytes(&data[src]), offsets[k * n + i] + 4 * at as u64)
                        .map_err(|e| io(&format!("writing {kind}/{}", b.name), e))?;
                }
            }
        }
        file.sync_data().map_err(|e| io("syncing", e))
    }

    /// Rank 0, once every rank's data is down: the checksums and the metadata, then the file
    /// in place of the previous checkpoint.
    fn publish(&self, sums: &[u64]) -> Result<(), String> {
        let file = H5File::open_serial_rw(&self.tmp).map_err(|e| e.to_string())?;
        let n = self.blocks.len();
        for (k, kind) in KINDS.iter().enumerate() {
            for (i, b) in self.blocks.iter().enumerate() {
                let ds = file.dataset(&format!("{kind}/{}", b.name)).map_err(|e| e.to_string())?;
                ds.set_attr_u64("checksum", sums[k * n + i]).map_err(|e| e.to_string())?;
            }
        }
        write_meta(&file, &self.meta)?;
        file.close().map_err(|e| e.to_string())?;
        publish(&self.dir, &self.tmp, &self.final_path, self.keep, self.meta.step)
    }
}

/// The contiguous runs of block `b` in its row-major tensor: `(elements of the block, index
/// of the first in the tensor)`. A run spans the last dimension and, while every dimension
/// after one is whole, that one too; a block of whole rows is one run.
fn runs(b: &ShardBlock) -> Vec<(std::ops::Range<usize>, usize)> {
    let d = b.count.len();
    let mut k = d - 1;
    while k > 0 && b.count[k] == b.global_shape[k] {
        k -= 1;
    }
    let run: usize = b.count[k..].iter().product();
    let mut strides = vec![1usize; d];
    for j in (0..d - 1).rev() {
        strides[j] = strides[j + 1] * b.global_shape[j + 1];
    }
    let n_runs: usize = b.count[..k].iter().product();
    (0..n_runs)
        .map(|r| {
            // `r` as a row-major index over the dimensions before `k`.
            let (mut rest, mut at) = (r, b.start[k] * strides[k]);
            for j in (0..k).rev() {
                at += (b.start[j] + rest % b.count[j]) * strides[j];
                rest /= b.count[j];
            }
            (r * run..(r + 1) * run, at)
        })
        .collect()
}

/// The bytes of `x` as the host stores them: the datasets' type is the host's native `f32`.
fn as_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: `f32` has no padding and every byte of it is initialised; the slice covers
    // exactly `x`'s memory, borrowed for as long as `x`.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(global: &[usize], start: &[usize], count: &[usize]) -> ShardBlock {
        ShardBlock { name: "t".into(), global_shape: global.to_vec(), start: start.to_vec(), count: count.to_vec(), primary: true }
    }

    /// A source that counts the locks: every element is its kind × 1000 + its index.
    #[derive(Default)]
    struct Counting {
        pins: std::cell::Cell<usize>,
        unpins: std::cell::Cell<usize>,
    }

    impl SnapshotSource for Counting {
        fn copy(&self, kind: usize, _tensor: usize, dst: &mut [f32]) {
            for (i, x) in dst.iter_mut().enumerate() {
                *x = (kind * 1000 + i) as f32;
            }
        }
        fn pin(&self, _buf: &mut [f32]) -> bool {
            self.pins.set(self.pins.get() + 1);
            true
        }
        fn unpin(&self, _buf: &mut [f32]) {
            self.unpins.set(self.unpins.get() + 1);
        }
    }

    /// A snapshot locks each buffer once and reuses it at the next checkpoint; a block that
    /// changes length is unlocked before its buffer goes, a block another rank writes gets no
    /// buffer, and `release` unlocks every one.
    #[test]
    fn a_snapshot_locks_its_buffers_once_and_unlocks_each_before_freeing_it() {
        let mut other = block(&[4, 2], &[0, 0], &[4, 2]);
        other.primary = false;
        let blocks = vec![block(&[4, 3], &[0, 0], &[2, 3]), other, block(&[5], &[0], &[5])];
        let (source, mut snap) = (Counting::default(), Snapshot::default());
        snap.fill(&blocks, &source);
        assert_eq!((source.pins.get(), source.unpins.get()), (6, 0));
        assert_eq!(snap.kinds[2][0], [2000.0, 2001.0, 2002.0, 2003.0, 2004.0, 2005.0]);
        assert!(snap.kinds[1][1].is_empty());
        assert_eq!(snap.pinned_bytes(), 3 * 4 * (6 + 5));
        let first = snap.kinds[0][0].as_ptr();
        snap.fill(&blocks, &source);
        assert_eq!((source.pins.get(), source.unpins.get(), snap.kinds[0][0].as_ptr()), (6, 0, first));
        snap.fill(&blocks[..2], &source);
        assert_eq!((source.pins.get(), source.unpins.get()), (6, 3));
        snap.fill(&[block(&[4, 3], &[0, 0], &[4, 3])], &source);
        assert_eq!((source.pins.get(), source.unpins.get(), snap.kinds[0][0].len()), (9, 6, 12));
        snap.release(&source);
        assert_eq!((source.unpins.get(), snap.bytes()), (9, 0));
    }

    /// The host's source copies each block's first elements out of the state's slices.
    #[test]
    fn the_host_state_fills_the_primary_blocks() {
        let state: [Vec<f32>; 3] = [vec![1.0, 2.0, 3.0, 9.0], vec![4.0, 5.0, 6.0, 9.0], vec![7.0, 8.0, 0.5, 9.0]];
        let slots: Vec<Vec<&[f32]>> = state.iter().map(|v| vec![&v[..]]).collect();
        let mut snap = Snapshot::default();
        snap.fill(&[block(&[6], &[3], &[3])], &HostState([&slots[0], &slots[1], &slots[2]]));
        assert_eq!(snap.pinned_bytes(), 0);
        assert_eq!(snap.kinds.map(|k| k[0].clone()), [vec![1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0], vec![7.0, 8.0, 0.5]]);
    }

    /// Every element of a block lands where its row-major index in the tensor says, whatever
    /// the block's shape: whole rows in one run, a column slice row by row.
    #[test]
    fn runs_place_every_element_at_its_index_in_the_tensor() {
        for b in [
            block(&[10], &[3], &[4]),
            block(&[6, 5], &[2, 0], &[3, 5]),
            block(&[6, 5], &[1, 2], &[4, 2]),
            block(&[6, 5], &[0, 0], &[6, 5]),
            block(&[6, 5], &[5, 4], &[1, 1]),
        ] {
            let mut seen = vec![];
            for (src, at) in runs(&b) {
                seen.extend(src.clone().zip(at..at + src.len()));
            }
            let want: Vec<(usize, usize)> = (0..b.len())
                .map(|e| {
                    let (r, c) = if b.count.len() == 1 { (0, e) } else { (e / b.count[1], e % b.count[1]) };
                    let g = if b.count.len() == 1 { b.start[0] + c } else { (b.start[0] + r) * b.global_shape[1] + b.start[1] + c };
                    (e, g)
                })
                .collect();
            assert_eq!(seen, want, "{b:?}");
        }
        assert_eq!(runs(&block(&[6, 5], &[2, 0], &[3, 5])).len(), 1);
        assert_eq!(runs(&block(&[6, 5], &[1, 2], &[4, 2])).len(), 4);
    }
}
