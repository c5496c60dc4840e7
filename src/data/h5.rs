//! HDF5 token source: a 1-D integer dataset (any integer width) read one sample at a time by
//! hyperslab through `io::hdf5`, so a rank reads only the tokens of the samples it takes.
//! Knows nothing of the `hdf5` crate itself, of order or of batching.

use std::path::Path;

use super::{sample_range, samples_in, DataError, TokenSource};
use crate::io::hdf5::TokenDataset;

pub struct Hdf5Source {
    ds: TokenDataset,
    /// `file:/dataset`, for messages.
    name: String,
    vocab: usize,
}

impl Hdf5Source {
    pub fn open(path: &str, dataset: &str, vocab: usize) -> Result<Hdf5Source, DataError> {
        let ds = TokenDataset::open(Path::new(path), dataset)?;
        let name = format!("{path}:/{dataset}");
        if ds.len() < 2 {
            return Err(DataError(format!("{name} holds {} tokens; a sample needs at least 2", ds.len())));
        }
        Ok(Hdf5Source { ds, name, vocab })
    }
}

impl TokenSource for Hdf5Source {
    fn num_samples(&self, seq_len: usize) -> u64 {
        samples_in(self.ds.len(), seq_len)
    }

    fn sample(&self, k: u64, seq_len: usize, out: &mut Vec<u32>) -> Result<(), DataError> {
        let (start, end) = sample_range(&self.name, self.ds.len(), k, seq_len)?;
        self.ds.read_range(start, end, out)?;
        if let Some(i) = out.iter().position(|&t| t as usize >= self.vocab) {
            return Err(DataError(format!(
                "{}: token at position {} is {}, not below [model] vocab_size {}",
                self.name,
                start + i as u64,
                out[i],
                self.vocab
            )));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("HDF5 {}: {} {} tokens", self.name, self.ds.len(), self.ds.dtype())
    }

    fn entropy_floor(&self, _seq_len: usize) -> Option<f64> {
        None
    }
}
