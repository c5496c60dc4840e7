//! The one module that touches the `hdf5` crate (hdf5-metno): everything else sees plain Rust
//! types and `Hdf5Error` messages that name the file, the dataset and the numbers.
//!
//! Owns, for now, the token functions used by the data pipeline: open a 1-D integer dataset,
//! report its length and dtype, read a range `[start, end)` of it by hyperslab (only those
//! elements are read from disk) converted to `u32`, and write a 1-D `u16`/`u32` token dataset
//! (for `ndtrain data prepare`). All of these use serial (non-MPI) file access, which works from
//! any rank without MPI-IO. It does not own what the tokens mean (vocabulary, samples, order:
//! `data`) nor checkpoints (the checkpoint module adds its parallel-HDF5 functions here).

use std::fmt;
use std::path::{Path, PathBuf};

/// An HDF5 failure, one line naming the file, the dataset and what was being done.
#[derive(Debug, Clone, PartialEq)]
pub struct Hdf5Error(pub String);

impl fmt::Display for Hdf5Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Hdf5Error {}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hdf5io_reads_any_integer_dtype_as_u32() {
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

    #[test]
    fn hdf5io_write_tokens_round_trip() {
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
