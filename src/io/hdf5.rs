//! The one module that touches the `hdf5` crate (hdf5-metno): everything else sees plain Rust
//! types and `Hdf5Error` messages that name the file, the dataset and the numbers.
//!
//! Owns two kinds of files:
//!
//! * token files for the data pipeline: open a 1-D integer dataset, report its length and
//!   dtype, read a range `[start, end)` of it by hyperslab (only those elements are read from
//!   disk) converted to `u32`, and write a 1-D `u16`/`u32` token dataset (for `ndtrain data
//!   prepare`), all with serial (non-MPI) file access, which works from any rank;
//! * checkpoint files ([`H5File`]): created or opened by every rank of a communicator with the
//!   MPI-IO driver (parallel HDF5), or by one process alone (the checkpoint writer's layout of
//!   a file, the `ckpt` tools); 2-D/1-D `f32`
//!   datasets read and written by rectangular block (hyperslab) with a **collective** transfer
//!   (the crate's own `write_slice` is independent I/O, so the block transfer calls
//!   `hdf5-sys`), scalar and string attributes. A block is an `ndarray` view whose shape is
//!   the hyperslab's count, or a flat row-major slice with the count beside it.
//!
//! It does not own what the tokens mean (`data`) nor what a checkpoint holds (`checkpoint`);
//! the communicator of a parallel file comes from `parallel::comm` as a raw handle.

use crate::parallel::comm::RawComm;
use ndarray::{ArrayView, ArrayViewMut, Dimension, IxDyn};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Calls on parallel files (every one collective: every rank of the file's communicator
/// makes it) since the process started.
static COLLECTIVE_CALLS: AtomicU64 = AtomicU64::new(0);

/// How many collective HDF5 calls this process has made (on files opened with MPI-IO).
pub fn collective_calls() -> u64 {
    COLLECTIVE_CALLS.load(Ordering::Relaxed)
}

/// An HDF5 failure, one line naming the file, the dataset and what was being done.
#[derive(Debug, Clone, PartialEq)]
pub struct Hdf5Error(pub String);

impl fmt::Display for Hdf5Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Hdf5Error {}

/// The HDF5 library's version the program runs with (`1.12.2`).
pub fn library_version() -> String {
    let (major, minor, micro) = hdf5::library_version();
    format!("{major}.{minor}.{micro}")
}

/// The integer type a token dataset is stored as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntDtype {
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
}

impl IntDtype {
    pub fn is_signed(self) -> bool {
        matches!(self, IntDtype::I8 | IntDtype::I16 | IntDtype::I32 | IntDtype::I64)
    }
}

impl fmt::Display for IntDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            IntDtype::I8 => "int8",
            IntDtype::I16 => "int16",
            IntDtype::I32 => "int32",
            IntDtype::I64 => "int64",
            IntDtype::U8 => "uint8",
            IntDtype::U16 => "uint16",
            IntDtype::U32 => "uint32",
            IntDtype::U64 => "uint64",
        };
        f.write_str(s)
    }
}

/// An open 1-D integer dataset of token ids, read by ranges.
pub struct TokenDataset {
    /// Kept open for the lifetime of the dataset handle.
    _file: hdf5::File,
    ds: hdf5::Dataset,
    path: PathBuf,
    name: String,
    /// Number of elements (tokens).
    len: u64,
    dtype: IntDtype,
}

impl TokenDataset {
    /// Opens `name` in the HDF5 file `path` read-only and checks it is a 1-D integer dataset.
    pub fn open(path: &Path, name: &str) -> Result<TokenDataset, Hdf5Error> {
        let file = hdf5::File::open(path).map_err(|e| Hdf5Error(format!("cannot open HDF5 file {}: {e}", path.display())))?;
        let ds = file.dataset(name).map_err(|e| {
            let names = file.member_names().map(|v| v.join(", ")).unwrap_or_default();
            Hdf5Error(format!("HDF5 file {} has no dataset '{name}' ({e}); top-level members: [{names}]", path.display()))
        })?;
        let shape = ds.shape();
        if shape.len() != 1 {
            return Err(Hdf5Error(format!("{}:/{name} has shape {shape:?}; token ids must be a 1-D dataset", path.display())));
        }
        let descr = ds
            .dtype()
            .and_then(|t| t.to_descriptor())
            .map_err(|e| Hdf5Error(format!("{}:/{name}: cannot read the datatype: {e}", path.display())))?;
        use hdf5::types::{IntSize, TypeDescriptor as T};
        let dtype = match descr {
            T::Integer(IntSize::U1) => IntDtype::I8,
            T::Integer(IntSize::U2) => IntDtype::I16,
            T::Integer(IntSize::U4) => IntDtype::I32,
            T::Integer(IntSize::U8) => IntDtype::I64,
            T::Unsigned(IntSize::U1) => IntDtype::U8,
            T::Unsigned(IntSize::U2) => IntDtype::U16,
            T::Unsigned(IntSize::U4) => IntDtype::U32,
            T::Unsigned(IntSize::U8) => IntDtype::U64,
            other => return Err(Hdf5Error(format!("{}:/{name} has datatype {other}; token ids must be integers", path.display()))),
        };
        Ok(TokenDataset { _file: file, ds, path: path.to_path_buf(), name: name.to_string(), len: shape[0] as u64, dtype })
    }

    /// Number of tokens in the dataset.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stored integer type.
    pub fn dtype(&self) -> IntDtype {
        self.dtype
    }

    /// Replaces `out` with the tokens `[start, end)` (`out.len() == end - start`), reading only
    /// that hyperslab. Errors if the range is outside the dataset or a value is negative or
    /// does not fit `u32`, naming the file, the dataset and the position.
    pub fn read_range(&self, start: u64, end: u64, out: &mut Vec<u32>) -> Result<(), Hdf5Error> {
        let where_ = || format!("{}:/{}", self.path.display(), self.name);
        if start > end || end > self.len {
            return Err(Hdf5Error(format!("{}: range [{start}, {end}) is outside the dataset of {} tokens", where_(), self.len)));
        }
        out.clear();
        if start == end {
            return Ok(());
        }
        let sel = start as usize..end as usize;
        let read_err = |e: hdf5::Error| Hdf5Error(format!("{}: reading tokens [{start}, {end}): {e}", where_()));
        if self.dtype.is_signed() {
            // The library converts any stored width to the memory type (a widening conversion).
            let vals = self.ds.read_slice_1d::<i64, _>(sel).map_err(read_err)?;
            for (i, &v) in vals.iter().enumerate() {
                match u32::try_from(v) {
                    Ok(t) => out.push(t),
                    Err(_) => return Err(bad_value(&where_(), start + i as u64, v as i128, self.dtype)),
                }
            }
        } else {
            let vals = self.ds.read_slice_1d::<u64, _>(sel).map_err(read_err)?;
            for (i, &v) in vals.iter().enumerate() {
                match u32::try_from(v) {
                    Ok(t) => out.push(t),
                    Err(_) => return Err(bad_value(&where_(), start + i as u64, v as i128, self.dtype)),
                }
            }
        }
        Ok(())
    }
}

fn bad_value(where_: &str, pos: u64, v: i128, dtype: IntDtype) -> Hdf5Error {
    Hdf5Error(format!("{where_}: token at position {pos} is {v} ({dtype}); token ids must be in 0..=4294967295"))
}

/// A token array to write, in the integer width it is stored with.
#[derive(Debug, Clone, Copy)]
pub enum TokenSlice<'a> {
    U16(&'a [u16]),
    U32(&'a [u32]),
}

impl TokenSlice<'_> {
    pub fn len(&self) -> usize {
        match self {
            TokenSlice::U16(t) => t.len(),
            TokenSlice::U32(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Creates (truncating) the HDF5 file `path` holding the 1-D dataset `name` with `tokens`
/// (contiguous layout, so any range is one hyperslab read) and a scalar `vocab_size` attribute
/// on the dataset recording the vocabulary the ids come from.
pub fn write_tokens(path: &Path, name: &str, tokens: TokenSlice<'_>, vocab_size: u64) -> Result<(), Hdf5Error> {
    let at = || format!("{}:/{name}", path.display());
    let file = hdf5::File::create(path).map_err(|e| Hdf5Error(format!("cannot create HDF5 file {}: {e}", path.display())))?;
    let builder = file.new_dataset_builder();
    let ds = match tokens {
        TokenSlice::U16(t) => builder.with_data(t).create(name),
        TokenSlice::U32(t) => builder.with_data(t).create(name),
    }
    .map_err(|e| Hdf5Error(format!("{}: writing {} tokens: {e}", at(), tokens.len())))?;
    ds.new_attr::<u64>()
        .create("vocab_size")
        .and_then(|a| a.write_scalar(&vocab_size))
        .map_err(|e| Hdf5Error(format!("{}: writing attribute vocab_size: {e}", at())))?;
    file.close().map_err(|e| Hdf5Error(format!("{}: closing the file: {e}", at())))
}

// ---------------------------------------------------------------------------------------------
// Checkpoint files.

/// An HDF5 file of `f32` datasets and attributes: parallel (every rank of a communicator opened
/// it and calls every metadata operation alike, in the same order) or serial (one process).
pub struct H5File {
    file: hdf5::File,
    path: PathBuf,
    parallel: bool,
}

/// One `f32` dataset of an [`H5File`].
pub struct H5Dataset {
    ds: hdf5::Dataset,
    at: String,
    parallel: bool,
}

/// How the MPI-IO layer actually moved a block (HDF5's `H5Pget_mpio_actual_io_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// One collective MPI-IO call over the contiguous dataset.
    Collective,
    /// Independent I/O (serial files, or HDF5 fell back from collective).
    Independent,
}

impl H5File {
    /// Creates (truncating) `path` collectively on every rank of `comm`.
    pub fn create_parallel(path: &Path, comm: RawComm) -> Result<H5File, Hdf5Error> {
        COLLECTIVE_CALLS.fetch_add(1, Ordering::Relaxed);
        let file = hdf5::File::with_options()
            .with_fapl(|p| p.mpio(comm, None))
            .create(path)
            .map_err(|e| Hdf5Error(format!("cannot create HDF5 file {} (MPI-IO): {e}", path.display())))?;
        Ok(H5File { file, path: path.to_path_buf(), parallel: true })
    }

    /// Opens `path` read-only collectively on every rank of `comm`.
    pub fn open_parallel(path: &Path, comm: RawComm) -> Result<H5File, Hdf5Error> {
        COLLECTIVE_CALLS.fetch_add(1, Ordering::Relaxed);
        let file = hdf5::File::with_options()
            .with_fapl(|p| p.mpio(comm, None))
            .open(path)
            .map_err(|e| Hdf5Error(format!("cannot open HDF5 file {} (MPI-IO): {e}", path.display())))?;
        Ok(H5File { file, path: path.to_path_buf(), parallel: true })
    }

    /// Opens `path` read-only in this process alone.
    pub fn open_serial(path: &Path) -> Result<H5File, Hdf5Error> {
        let file = hdf5::File::open(path).map_err(|e| Hdf5Error(format!("cannot open HDF5 file {}: {e}", path.display())))?;
        Ok(H5File { file, path: path.to_path_buf(), parallel: false })
    }

    /// Creates (truncating) `path` in this process alone.
    pub fn create_serial(path: &Path) -> Result<H5File, Hdf5Error> {
        let file = hdf5::File::create(path).map_err(|e| Hdf5Error(format!("cannot create HDF5 file {}: {e}", path.display())))?;
        Ok(H5File { file, path: path.to_path_buf(), parallel: false })
    }

    /// Opens `path` for reading and writing in this process alone.
    pub fn open_serial_rw(path: &Path) -> Result<H5File, Hdf5Error> {
        let file =
            hdf5::File::open_rw(path).map_err(|e| Hdf5Error(format!("cannot open HDF5 file {} for writing: {e}", path.display())))?;
        Ok(H5File { file, path: path.to_path_buf(), parallel: false })
    }

    /// Counts one call on a parallel file.
    fn collective(&self) {
        if self.parallel {
            COLLECTIVE_CALLS.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn at(&self, name: &str) -> String {
        format!("{}:/{}", self.path.display(), name.trim_start_matches('/'))
    }

    /// Creates group `name` (its parent must exist).
    pub fn create_group(&self, name: &str) -> Result<(), Hdf5Error> {
        self.collective();
        self.file.create_group(name).map(|_| ()).map_err(|e| Hdf5Error(format!("{}: cannot create group: {e}", self.at(name))))
    }

    /// Creates a contiguous `f32` dataset of `shape` whose space in the file is allocated now
    /// (so that [`H5Dataset::file_offset`] is known before any data is written) and never
    /// pre-filled (every element is written by some rank; a fill would write the file twice).
    pub fn create_f32(&self, name: &str, shape: &[usize]) -> Result<H5Dataset, Hdf5Error> {
        self.collective();
        let ds = self
            .file
            .new_dataset::<f32>()
            .shape(shape)
            .no_chunk()
            .alloc_time(Some(hdf5::dataset::AllocTime::Early))
            .fill_time(hdf5::dataset::FillTime::Never)
            .create(name)
            .map_err(|e| Hdf5Error(format!("{}: cannot create dataset of shape {shape:?}: {e}", self.at(name))))?;
        Ok(H5Dataset { ds, at: self.at(name), parallel: self.parallel })
    }

    /// The dataset `name`.
    pub fn dataset(&self, name: &str) -> Result<H5Dataset, Hdf5Error> {
        let ds = self.file.dataset(name).map_err(|e| Hdf5Error(format!("{}: no such dataset ({e})", self.at(name))))?;
        Ok(H5Dataset { ds, at: self.at(name), parallel: self.parallel })
    }

    /// Names of the members of group `group` (`"/"` for the root), sorted.
    pub fn members(&self, group: &str) -> Result<Vec<String>, Hdf5Error> {
        let g = self.file.group(group).map_err(|e| Hdf5Error(format!("{}: no such group ({e})", self.at(group))))?;
        let mut names = g.member_names().map_err(|e| Hdf5Error(format!("{}: cannot list members: {e}", self.at(group))))?;
        names.sort();
        Ok(names)
    }

    pub fn set_attr_u64(&self, key: &str, value: u64) -> Result<(), Hdf5Error> {
        self.collective();
        set_attr_u64(&self.file, key, value).map_err(|e| Hdf5Error(format!("{}: attribute {key}: {e}", self.at(""))))
    }

    pub fn set_attr_str(&self, key: &str, value: &str) -> Result<(), Hdf5Error> {
        self.collective();
        let v: hdf5::types::VarLenUnicode =
            value.parse().map_err(|e| Hdf5Error(format!("{}: attribute {key}: not storable text: {e}", self.at(""))))?;
        self.file
            .new_attr::<hdf5::types::VarLenUnicode>()
            .create(key)
            .and_then(|a| a.write_scalar(&v))
            .map_err(|e| Hdf5Error(format!("{}: attribute {key}: {e}", self.at(""))))
    }

    pub fn attr_u64(&self, key: &str) -> Result<u64, Hdf5Error> {
        attr_u64(&self.file, key).map_err(|e| Hdf5Error(format!("{}: attribute {key}: {e}", self.at(""))))
    }

    pub fn attr_str(&self, key: &str) -> Result<String, Hdf5Error> {
        self.file
            .attr(key)
            .and_then(|a| a.read_scalar::<hdf5::types::VarLenUnicode>())
            .map(|v| v.as_str().to_string())
            .map_err(|e| Hdf5Error(format!("{}: attribute {key}: {e}", self.at(""))))
    }

    /// Names of the root attributes, sorted.
    pub fn attr_names(&self) -> Result<Vec<String>, Hdf5Error> {
        let mut v = self.file.attr_names().map_err(|e| Hdf5Error(format!("{}: cannot list attributes: {e}", self.at(""))))?;
        v.sort();
        Ok(v)
    }

    /// Flushes every buffer to the file system (`MPI_File_sync` under MPI-IO) and closes the
    /// file; collective on a parallel file.
    pub fn close(self) -> Result<(), Hdf5Error> {
        self.collective();
        let at = self.at("");
        self.file.flush().map_err(|e| Hdf5Error(format!("{at}: flushing: {e}")))?;
        self.file.close().map_err(|e| Hdf5Error(format!("{at}: closing: {e}")))
    }
}

// In every parallel HDF5 since 1.8.10; `hdf5-sys` does not bind it.
extern "C" {
    fn H5Pget_mpio_actual_io_mode(
        plist_id: hdf5_sys::h5i::hid_t,
        actual_io_mode: *mut hdf5_sys::h5d::H5D_mpio_actual_io_mode_t,
    ) -> hdf5_sys::h5::herr_t;
}

fn set_attr_u64(loc: &hdf5::Location, key: &str, value: u64) -> hdf5::Result<()> {
    loc.new_attr::<u64>().create(key)?.write_scalar(&value)
}

fn attr_u64(loc: &hdf5::Location, key: &str) -> hdf5::Result<u64> {
    loc.attr(key)?.read_scalar::<u64>()
}

impl H5Dataset {
    pub fn shape(&self) -> Vec<usize> {
        self.ds.shape()
    }

    pub fn set_attr_u64(&self, key: &str, value: u64) -> Result<(), Hdf5Error> {
        if self.parallel {
            COLLECTIVE_CALLS.fetch_add(1, Ordering::Relaxed);
        }
        set_attr_u64(&self.ds, key, value).map_err(|e| Hdf5Error(format!("{}: attribute {key}: {e}", self.at)))
    }

    pub fn attr_u64(&self, key: &str) -> Result<u64, Hdf5Error> {
        attr_u64(&self.ds, key).map_err(|e| Hdf5Error(format!("{}: attribute {key}: {e}", self.at)))
    }

    /// Byte offset of the dataset's contiguous data in the file: the checkpoint writer writes
    /// each rank's blocks there, and tests corrupt it there.
    pub fn file_offset(&self) -> Option<u64> {
        self.ds.offset()
    }

    /// Writes `block` to the hyperslab starting at `start` whose count is the block's shape.
    /// The view must be in standard (row-major, contiguous) layout, since its memory goes to
    /// HDF5 as one contiguous buffer; another layout is an error, not a silent copy. On a
    /// parallel file every rank calls it (collective transfer); a rank with nothing to write
    /// passes an empty view (a zero in its shape) and selects nothing.
    pub fn write_slab<D: Dimension>(&self, start: &[usize], block: ArrayView<'_, f32, D>) -> Result<IoMode, Hdf5Error> {
        self.check_layout(start, block.shape(), block.is_standard_layout(), true)?;
        // Writing only reads through the pointer; `transfer` takes one pointer type for both ways.
        self.transfer(start, block.shape(), block.as_ptr() as *mut f32, true)
    }

    /// Reads the hyperslab starting at `start` whose count is `out`'s shape into `out`, which
    /// must be in standard layout; collective on a parallel file, where every rank calls it.
    pub fn read_slab<D: Dimension>(&self, start: &[usize], mut out: ArrayViewMut<'_, f32, D>) -> Result<IoMode, Hdf5Error> {
        self.check_layout(start, out.shape(), out.is_standard_layout(), false)?;
        let count = out.shape().to_vec();
        self.transfer(start, &count, out.as_mut_ptr(), false)
    }

    /// [`write_slab`](Self::write_slab) of `data` read as a row-major block of shape `count`:
    /// for callers that hold a shard as a flat slice (the checkpoint's save path).
    pub fn write_block(&self, start: &[usize], count: &[usize], data: &[f32]) -> Result<IoMode, Hdf5Error> {
        let mismatch = || self.buffer_mismatch(start, count, data.len(), true);
        // `from_shape` accepts a longer slice; the block must be all of it.
        if data.len() != count.iter().product::<usize>() {
            return Err(mismatch());
        }
        self.write_slab(start, ArrayView::from_shape(IxDyn(count), data).map_err(|_| mismatch())?)
    }

    /// [`read_slab`](Self::read_slab) into `out` seen as a row-major block of shape `count`
    /// (the checkpoint's load path, which fills flat shards).
    pub fn read_block(&self, start: &[usize], count: &[usize], out: &mut [f32]) -> Result<IoMode, Hdf5Error> {
        let len = out.len();
        let mismatch = || self.buffer_mismatch(start, count, len, false);
        if len != count.iter().product::<usize>() {
            return Err(mismatch());
        }
        self.read_slab(start, ArrayViewMut::from_shape(IxDyn(count), out).map_err(|_| mismatch())?)
    }

    fn buffer_mismatch(&self, start: &[usize], count: &[usize], len: usize, write: bool) -> Hdf5Error {
        let n: usize = count.iter().product();
        Hdf5Error(format!(
            "{}: {} block start {start:?} count {count:?} ({n} elements) with a buffer of {len}",
            self.at,
            if write { "writing" } else { "reading" }
        ))
    }

    fn check_layout(&self, start: &[usize], count: &[usize], standard: bool, write: bool) -> Result<(), Hdf5Error> {
        if standard {
            return Ok(());
        }
        Err(Hdf5Error(format!(
            "{}: {} block start {start:?} count {count:?}: the array view is not in standard (row-major, contiguous) layout",
            self.at,
            if write { "writing" } else { "reading" }
        )))
    }

    /// Moves the block at `start` of shape `count` between the dataset and `buf`, which holds
    /// its `count` product of elements contiguously, row-major.
    fn transfer(&self, start: &[usize], count: &[usize], buf: *mut f32, write: bool) -> Result<IoMode, Hdf5Error> {
        use hdf5_sys::h5d::{H5D_mpio_actual_io_mode_t, H5Dget_space, H5Dread, H5Dwrite};
        use hdf5_sys::h5i::hid_t;
        use hdf5_sys::h5p::{H5FD_mpio_xfer_t, H5Pclose, H5Pcreate, H5Pset_dxpl_mpio, H5P_CLS_DATASET_XFER};
        use hdf5_sys::h5s::{H5S_seloper_t, H5Sclose, H5Screate_simple, H5Sselect_hyperslab, H5Sselect_none};
        if self.parallel {
            COLLECTIVE_CALLS.fetch_add(1, Ordering::Relaxed);
        }
        let n: usize = count.iter().product();
        let what = if write { "writing" } else { "reading" };
        let fail = |step: &str| Hdf5Error(format!("{}: {what} block start {start:?} count {count:?}: {step} failed", self.at));
        if start.len() != count.len() || count.len() != self.ds.ndim() {
            return Err(Hdf5Error(format!("{}: {what} block start {start:?} count {count:?} of a {}-D dataset", self.at, self.ds.ndim())));
        }
        let dummy = [0.0f32];
        let ptr = if n == 0 { dummy.as_ptr() as *mut f32 } else { buf };
        hdf5::sync::sync(|| {
            // SAFETY: every id created here is closed before returning; `ptr` points at `n`
            // contiguous f32 (the callers pass standard-layout views of shape `count`), or at
            // `dummy` when the selection is empty and nothing is touched.
            unsafe {
                let fspace = H5Dget_space(self.ds.id());
                if fspace < 0 {
                    return Err(fail("H5Dget_space"));
                }
                let mdims = [n.max(1) as u64];
                let mspace = H5Screate_simple(1, mdims.as_ptr(), std::ptr::null());
                let dxpl = H5Pcreate(*H5P_CLS_DATASET_XFER);
                let close = |ids: [hid_t; 3]| {
                    H5Sclose(ids[0]);
                    H5Sclose(ids[1]);
                    H5Pclose(ids[2]);
                };
                let ids = [fspace, mspace, dxpl];
                if mspace < 0 || dxpl < 0 {
                    close(ids);
                    return Err(fail("creating the memory space"));
                }
                let selected = if n == 0 {
                    H5Sselect_none(fspace).min(H5Sselect_none(mspace))
                } else {
                    let st: Vec<u64> = start.iter().map(|&x| x as u64).collect();
                    let ct: Vec<u64> = count.iter().map(|&x| x as u64).collect();
                    H5Sselect_hyperslab(fspace, H5S_seloper_t::H5S_SELECT_SET, st.as_ptr(), std::ptr::null(), ct.as_ptr(), std::ptr::null())
                };
                if selected < 0 {
                    close(ids);
                    return Err(fail("selecting the hyperslab"));
                }
                if self.parallel && H5Pset_dxpl_mpio(dxpl, H5FD_mpio_xfer_t::H5FD_MPIO_COLLECTIVE) < 0 {
                    close(ids);
                    return Err(fail("H5Pset_dxpl_mpio(COLLECTIVE)"));
                }
                let memtype = *hdf5_sys::h5t::H5T_NATIVE_FLOAT;
                let rc = if write {
                    H5Dwrite(self.ds.id(), memtype, mspace, fspace, dxpl, ptr as *const std::ffi::c_void)
                } else {
                    H5Dread(self.ds.id(), memtype, mspace, fspace, dxpl, ptr as *mut std::ffi::c_void)
                };
                let mut mode = H5D_mpio_actual_io_mode_t::H5D_MPIO_NO_COLLECTIVE;
                if self.parallel {
                    H5Pget_mpio_actual_io_mode(dxpl, &mut mode);
                }
                close(ids);
                if rc < 0 {
                    return Err(fail(if write { "H5Dwrite" } else { "H5Dread" }));
                }
                Ok(if mode == H5D_mpio_actual_io_mode_t::H5D_MPIO_NO_COLLECTIVE { IoMode::Independent } else { IoMode::Collective })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_files_of_any_integer_dtype_read_as_u32() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.h5");
        {
            let f = hdf5::File::create(&path).unwrap();
            let a: Vec<u8> = (0..50).collect();
            f.new_dataset_builder().with_data(&a[..]).create("u8").unwrap();
            let b: Vec<i64> = (0..50).map(|i| i * 1000).collect();
            f.new_dataset_builder().with_data(&b[..]).create("i64").unwrap();
            let c: Vec<i32> = vec![1, 2, -3, 4];
            f.new_dataset_builder().with_data(&c[..]).create("neg").unwrap();
            let d: Vec<u64> = vec![1, 1 << 40];
            f.new_dataset_builder().with_data(&d[..]).create("big").unwrap();
            let e: Vec<f32> = vec![1.0];
            f.new_dataset_builder().with_data(&e[..]).create("float").unwrap();
        }
        let mut out = Vec::new();
        let u8s = TokenDataset::open(&path, "u8").unwrap();
        assert_eq!((u8s.len(), u8s.dtype()), (50, IntDtype::U8));
        u8s.read_range(10, 14, &mut out).unwrap();
        assert_eq!(out, vec![10, 11, 12, 13]);
        let i64s = TokenDataset::open(&path, "i64").unwrap();
        assert_eq!(i64s.dtype(), IntDtype::I64);
        i64s.read_range(48, 50, &mut out).unwrap();
        assert_eq!(out, vec![48_000, 49_000]);
        let e = TokenDataset::open(&path, "neg").unwrap().read_range(0, 4, &mut out).unwrap_err();
        assert!(e.0.contains("position 2") && e.0.contains("-3"), "{e}");
        let e = TokenDataset::open(&path, "big").unwrap().read_range(0, 2, &mut out).unwrap_err();
        assert!(e.0.contains("position 1") && e.0.contains("1099511627776"), "{e}");
        let e = u8s.read_range(45, 51, &mut out).unwrap_err();
        assert!(e.0.contains("[45, 51)") && e.0.contains("50 tokens"), "{e}");
        let e = TokenDataset::open(&path, "float").err().unwrap();
        assert!(e.0.contains("integers"), "{e}");
        let e = TokenDataset::open(&path, "missing").err().unwrap();
        assert!(e.0.contains("'missing'") && e.0.contains("u8"), "{e}");
    }

    /// A writable `f32` dataset in a serial file (the parallel constructors need an MPI job).
    fn scratch_dataset(path: &Path, shape: &[usize]) -> (hdf5::File, H5Dataset) {
        let file = hdf5::File::create(path).unwrap();
        let ds = file.new_dataset::<f32>().shape(shape).create("w").unwrap();
        (file, H5Dataset { ds, at: format!("{}:/w", path.display()), parallel: false })
    }

    #[test]
    fn slabs_move_as_array_views_of_their_count() {
        use ndarray::{array, s, Array1, Array2};
        let dir = tempfile::tempdir().unwrap();
        let (_file, ds) = scratch_dataset(&dir.path().join("c.h5"), &[4, 3]);
        let whole = Array2::from_shape_fn((4, 3), |(r, c)| (r * 3 + c) as f32);
        assert_eq!(ds.write_slab(&[0, 0], whole.view()).unwrap(), IoMode::Independent);
        let patch = array![[-1.0f32, -2.0], [-3.0, -4.0]];
        ds.write_slab(&[1, 1], patch.view()).unwrap();
        let mut want = whole.clone();
        want.slice_mut(s![1..3, 1..3]).assign(&patch);
        let mut back = Array2::<f32>::zeros((4, 3));
        ds.read_slab(&[0, 0], back.view_mut()).unwrap();
        assert_eq!(back, want);
        // The flat form reads the same rows, row-major.
        let mut rows = vec![0.0; 6];
        ds.read_block(&[2, 0], &[2, 3], &mut rows).unwrap();
        assert_eq!(rows, want.slice(s![2..4, ..]).iter().copied().collect::<Vec<_>>());
        // A rank with nothing to write selects nothing.
        ds.write_slab(&[0, 0], Array2::<f32>::zeros((0, 3)).view()).unwrap();
        ds.write_block(&[0, 0], &[0, 0], &[]).unwrap();

        let e = ds.write_slab(&[0, 0], whole.slice(s![0..3, ..]).t()).unwrap_err();
        assert!(e.0.contains("not in standard") && e.0.contains("c.h5:/w"), "{e}");
        let mut t = Array2::<f32>::zeros((3, 3));
        let e = ds.read_slab(&[0, 0], t.view_mut().reversed_axes()).unwrap_err();
        assert!(e.0.contains("reading") && e.0.contains("not in standard"), "{e}");
        let e = ds.write_block(&[0, 0], &[2, 3], &[0.0; 5]).unwrap_err();
        assert!(e.0.contains("(6 elements) with a buffer of 5"), "{e}");
        let e = ds.read_slab(&[0], Array1::<f32>::zeros(3).view_mut()).unwrap_err();
        assert!(e.0.contains("2-D dataset"), "{e}");
        ds.read_slab(&[0, 0], back.view_mut()).unwrap();
        assert_eq!(back, want, "the refused calls wrote nothing");
    }

    #[test]
    fn written_token_files_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.h5");
        let toks: Vec<u32> = vec![0, 70_000, 5, 4_000_000_000];
        write_tokens(&path, "tokens", TokenSlice::U32(&toks), 4_000_000_001).unwrap();
        let ds = TokenDataset::open(&path, "tokens").unwrap();
        assert_eq!(ds.dtype(), IntDtype::U32);
        let mut out = Vec::new();
        ds.read_range(0, 4, &mut out).unwrap();
        assert_eq!(out, toks);
        let small: Vec<u16> = vec![3, 2, 1];
        let path = dir.path().join("w16.h5");
        write_tokens(&path, "ids", TokenSlice::U16(&small), 4).unwrap();
        let ds = TokenDataset::open(&path, "ids").unwrap();
        assert_eq!((ds.dtype(), ds.len()), (IntDtype::U16, 3));
        ds.read_range(1, 3, &mut out).unwrap();
        assert_eq!(out, vec![2, 1]);
    }
}
