//! Token data: where samples come from (`TokenSource`: synthetic Markov chain, HDF5, llm.c
//! `.bin`) and which samples each data-parallel rank takes at each step (`Loader`).
//!
//! Sample `k` of a token stream is `tokens[k·S .. k·S + S + 1]` (input = first S, target =
//! last S). The loader is stateless: the samples of optimiser step `t` depend only on
//! `(t, global_batch, order, seed)`, so a run resumes at the same place under any layout.
//! Knows nothing of MPI (a rank is told its `dp_rank`), of context parallelism (it returns
//! whole sequences; the CP zigzag split is applied by the caller) or of the model. Only
//! `io::hdf5` touches the `hdf5` crate. `prepare` turns a text file into a token file; `split`
//! sets the held-out samples of `[eval]` apart from the training ones.
//!
//! Legend: `B` micro-batch (sequences per rank per micro-step), `S` sequence length,
//! `G` global batch (sequences per optimiser step), `dp` data-parallel degree.

mod bin;
mod h5;
mod order;
pub mod prepare;
mod split;
mod synthetic;

use std::fmt;

use crate::config::{DataCfg, Order, Source};

pub use bin::{BIN_HEADER_INTS, BIN_MAGIC_GPT2, BIN_MAGIC_LLAMA3, BIN_VERSION_GPT2, BIN_VERSION_LLAMA3};
pub use order::Permutation;
pub use split::{open_sources, Sources};
pub use synthetic::SYNTHETIC_SAMPLES;

/// A data error: one line naming the file, the position and the numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct DataError(pub String);

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DataError {}

impl From<crate::io::hdf5::Hdf5Error> for DataError {
    fn from(e: crate::io::hdf5::Hdf5Error) -> Self {
        DataError(e.0)
    }
}

/// One micro-batch of one data-parallel rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// [B, S] row-major: the first S tokens of each sample.
    pub inputs: Vec<u32>,
    /// [B, S] row-major: the last S tokens of each sample (inputs shifted by one).
    pub targets: Vec<u32>,
    pub micro_batch: usize,
    pub seq_len: usize,
}

/// A source of samples. Sample `k` is S+1 tokens (input = first S, target = last S).
pub trait TokenSource: Send {
    /// Samples in one epoch at sequence length `seq_len`; for files `(n_tokens − 1) / seq_len`.
    fn num_samples(&self, seq_len: usize) -> u64;
    /// Replaces `out` with sample `k`: `out.len() == seq_len + 1` afterwards.
    fn sample(&self, k: u64, seq_len: usize, out: &mut Vec<u32>) -> Result<(), DataError>;
    /// One line for the console.
    fn describe(&self) -> String;
    /// Mean loss (nats/token over the S targets) of the best possible model; `Some` where it is
    /// known exactly (synthetic).
    fn entropy_floor(&self, seq_len: usize) -> Option<f64>;
}

/// Opens the source `[data]` names. `vocab_size` bounds every token id (checked on read);
/// `seed` seeds the synthetic chain.
pub fn open_source(cfg: &DataCfg, vocab_size: usize, seed: u64) -> Result<Box<dyn TokenSource>, DataError> {
    if vocab_size == 0 {
        return Err(DataError("[model] vocab_size is 0; the data needs at least one token id".into()));
    }
    let need_path = |kind: &str| -> Result<(), DataError> {
        if cfg.path.is_empty() {
            Err(DataError(format!(
                "[data] source = \"{kind}\" but [data] path is empty\nHINT: set [data] path, or use source = \"synthetic\""
            )))
        } else {
            Ok(())
        }
    };
    Ok(match cfg.source {
        Source::Synthetic => Box::new(synthetic::Synthetic::new(vocab_size, cfg.synthetic_branching, seed)?),
        Source::Hdf5 => {
            need_path("hdf5")?;
            Box::new(h5::Hdf5Source::open(&cfg.path, &cfg.dataset, vocab_size)?)
        }
        Source::Bin => {
            need_path("bin")?;
            Box::new(bin::BinSource::open(&cfg.path, vocab_size)?)
        }
    })
}

/// Samples of seq_len `seq_len` in a stream of `n_tokens` tokens: `(n_tokens − 1) / seq_len`
/// (consecutive samples share one token), 0 for an empty stream or `seq_len = 0`.
pub(crate) fn samples_in(n_tokens: u64, seq_len: usize) -> u64 {
    n_tokens.saturating_sub(1).checked_div(seq_len as u64).unwrap_or(0)
}

/// Token range `[k·S, k·S + S + 1)` of sample `k` of a finite stream of `n_tokens` tokens, or
/// an error naming `what` (the file) if `k` is past the last sample.
pub(crate) fn sample_range(what: &str, n_tokens: u64, k: u64, seq_len: usize) -> Result<(u64, u64), DataError> {
    let s = seq_len as u64;
    let n = samples_in(n_tokens, seq_len);
    if k >= n {
        return Err(DataError(format!("{what}: sample {k} is past the last of {n} samples of seq_len {seq_len} ({n_tokens} tokens)")));
    }
    Ok((k * s, k * s + s + 1))
}

/// Which samples each data-parallel rank takes at each step; see `docs/data.md`.
///
/// Global position `p` of row `j` of micro-step `m` of rank `d` at step `t` is
/// `t·G + m·dp·B + d·B + j`; epoch `p / n`, and the sample read is `p mod n` (sequential) or
/// the epoch's seeded permutation of it (shuffled), with `n` the samples per epoch.
pub struct Loader {
    source: Box<dyn TokenSource>,
    order: Order,
    seq_len: usize,
    micro_batch: usize,
    global_batch: usize,
    dp: usize,
    dp_rank: usize,
    grad_accum: usize,
    /// Samples per epoch at `seq_len`.
    n: u64,
    seed: u64,
}

impl Loader {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &DataCfg,
        source: Box<dyn TokenSource>,
        seq_len: usize,
        micro_batch: usize,
        global_batch: usize,
        dp: usize,
        dp_rank: usize,
        seed: u64,
    ) -> Result<Loader, DataError> {
        if seq_len == 0 || micro_batch == 0 || dp == 0 || global_batch == 0 {
            return Err(DataError(format!(
                "data loader: seq_len({seq_len}), micro_batch({micro_batch}), global_batch({global_batch}) and dp({dp}) must all be >= 1"
            )));
        }
        if dp_rank >= dp {
            return Err(DataError(format!("data loader: dp_rank {dp_rank} is not below dp {dp}")));
        }
        let per_micro = micro_batch
            .checked_mul(dp)
            .ok_or_else(|| DataError(format!("data loader: micro_batch({micro_batch}) × dp({dp}) overflows {} bits", usize::BITS)))?;
        if global_batch % per_micro != 0 {
            return Err(DataError(format!(
                "[train] global_batch({global_batch}) is not a multiple of micro_batch({micro_batch}) × dp({dp}) = {per_micro}"
            )));
        }
        let n = source.num_samples(seq_len);
        if n == 0 {
            return Err(DataError(format!("{} holds fewer tokens than one sample of seq_len {seq_len} + 1", source.describe())));
        }
        Ok(Loader {
            source,
            order: cfg.order,
            seq_len,
            micro_batch,
            global_batch,
            dp,
            dp_rank,
            grad_accum: global_batch / per_micro,
            n,
            seed,
        })
    }

    /// Micro-steps per optimiser step: `G / (B · dp)`.
    pub fn grad_accum(&self) -> usize {
        self.grad_accum
    }

    /// Samples per epoch.
    pub fn samples_per_epoch(&self) -> u64 {
        self.n
    }

    /// The epoch that optimiser step `step` starts in.
    pub fn epoch(&self, step: u64) -> u64 {
        step.saturating_mul(self.global_batch as u64) / self.n
    }

    /// Global position of row `row` of micro-step `micro` of this rank at step `step`.
    pub fn position(&self, step: u64, micro: usize, row: usize) -> Result<u64, DataError> {
        if micro >= self.grad_accum || row >= self.micro_batch {
            return Err(DataError(format!(
                "data loader: micro-step {micro} row {row} is outside grad_accum {} × micro_batch {}",
                self.grad_accum, self.micro_batch
            )));
        }
        let g = self.global_batch as u64;
        let within = (micro * self.dp * self.micro_batch + self.dp_rank * self.micro_batch + row) as u64;
        step.checked_mul(g)
            .and_then(|p| p.checked_add(within))
            .ok_or_else(|| DataError(format!("data loader: step {step} × global_batch {g} overflows 64 bits")))
    }

    /// The source sample read at global position `position`.
    pub fn sample_index(&self, position: u64) -> u64 {
        let (epoch, i) = (position / self.n, position % self.n);
        match self.order {
            Order::Sequential => i,
            Order::Shuffled => Permutation::new(self.n, self.seed, epoch).apply(i),
        }
    }

    /// This rank's micro-batch `micro` (0-based, `< grad_accum`) of optimiser step `step` (0-based).
    pub fn micro_batch(&self, step: u64, micro: usize) -> Result<Batch, DataError> {
        let (b, s) = (self.micro_batch, self.seq_len);
        let mut inputs = Vec::with_capacity(b * s); // [B, S]
        let mut targets = Vec::with_capacity(b * s); // [B, S]
        let mut buf = Vec::with_capacity(s + 1); // [S + 1]
        for row in 0..b {
            let k = self.sample_index(self.position(step, micro, row)?);
            self.source.sample(k, s, &mut buf)?;
            if buf.len() != s + 1 {
                return Err(DataError(format!(
                    "{}: sample {k} has {} tokens, expected seq_len + 1 = {}",
                    self.source.describe(),
                    buf.len(),
                    s + 1
                )));
            }
            inputs.extend_from_slice(&buf[..s]);
            targets.extend_from_slice(&buf[1..]);
        }
        Ok(Batch { inputs, targets, micro_batch: b, seq_len: s })
    }

    pub fn source(&self) -> &dyn TokenSource {
        self.source.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sample `k` is `[k, k, …]`, so a batch names the samples it holds.
    struct Ids(u64);

    impl TokenSource for Ids {
        fn num_samples(&self, _seq_len: usize) -> u64 {
            self.0
        }
        fn sample(&self, k: u64, seq_len: usize, out: &mut Vec<u32>) -> Result<(), DataError> {
            out.clear();
            out.resize(seq_len + 1, k as u32);
            Ok(())
        }
        fn describe(&self) -> String {
            "ids".into()
        }
        fn entropy_floor(&self, _seq_len: usize) -> Option<f64> {
            None
        }
    }

    fn cfg(order: Order) -> DataCfg {
        DataCfg { order, ..DataCfg::default() }
    }

    #[test]
    fn data_loader_rejects_bad_geometry() {
        let e = Loader::new(&cfg(Order::Sequential), Box::new(Ids(10)), 4, 2, 6, 2, 0, 1).err().unwrap();
        assert!(e.0.contains("global_batch(6)") && e.0.contains("= 4"), "{e}");
        let e = Loader::new(&cfg(Order::Sequential), Box::new(Ids(10)), 4, 2, 8, 2, 2, 1).err().unwrap();
        assert!(e.0.contains("dp_rank 2"), "{e}");
        let e = Loader::new(&cfg(Order::Sequential), Box::new(Ids(0)), 4, 2, 8, 2, 0, 1).err().unwrap();
        assert!(e.0.contains("fewer tokens than one sample"), "{e}");
        let l = Loader::new(&cfg(Order::Sequential), Box::new(Ids(10)), 4, 2, 8, 2, 0, 1).unwrap();
        assert!(l.micro_batch(0, 2).is_err());
    }

    #[test]
    fn data_loader_wraps_epochs_sequentially() {
        let l = Loader::new(&cfg(Order::Sequential), Box::new(Ids(5)), 3, 2, 2, 1, 0, 1).unwrap();
        let b = l.micro_batch(2, 0).unwrap(); // positions 4, 5 → samples 4, 0
        assert_eq!(b.inputs, vec![4, 4, 4, 0, 0, 0]);
        assert_eq!(l.epoch(2), 0);
        assert_eq!(l.epoch(3), 1);
    }
}
