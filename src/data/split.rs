//! The training samples and the held-out ones `[eval]` names: another file of the same kind,
//! or the last samples of the training source, which training then never reads.
//!
//! A tail split happens at the deck's sequence length: with `n` samples of `S + 1` tokens
//! (consecutive samples share one token) and a tail of `h`, training reads samples
//! `0 .. n − h` and the held-out set is samples `n − h .. n`. The last training sample ends on
//! the first held-out sample's first input token, never on a held-out target.

use super::{open_source, DataError, TokenSource};
use crate::config::{DataCfg, EvalCfg};

/// Samples `first .. first + count` of another source, as samples `0 .. count`.
pub struct Slice {
    inner: Box<dyn TokenSource>,
    first: u64,
    count: u64,
    seq_len: usize,
    what: &'static str,
}

impl TokenSource for Slice {
    fn num_samples(&self, seq_len: usize) -> u64 {
        // Sample boundaries move with the sequence length: the slice exists at its own only.
        if seq_len == self.seq_len {
            self.count
        } else {
            0
        }
    }

    fn sample(&self, k: u64, seq_len: usize, out: &mut Vec<u32>) -> Result<(), DataError> {
        if k >= self.count || seq_len != self.seq_len {
            return Err(DataError(format!(
                "{}: sample {k} at seq_len {seq_len} is outside its {} samples of seq_len {}",
                self.describe(),
                self.count,
                self.seq_len
            )));
        }
        self.inner.sample(self.first + k, seq_len, out)
    }

    fn describe(&self) -> String {
        format!("{} (samples {}..{} of {})", self.what, self.first, self.first + self.count, self.inner.describe())
    }

    fn entropy_floor(&self, seq_len: usize) -> Option<f64> {
        self.inner.entropy_floor(seq_len)
    }
}

/// What a run reads: the training source and, when `[eval]` is on, the held-out one.
pub struct Sources {
    pub train: Box<dyn TokenSource>,
    pub held_out: Option<Box<dyn TokenSource>>,
}

/// Opens the training source of `data` and the held-out source of `eval` at sequence length
/// `seq_len`; a tail (when `eval` names no file) is `eval.tail_samples`, or `global_batch ×
/// eval.batches` samples when that is 0.
pub fn open_sources(
    data: &DataCfg,
    eval: &EvalCfg,
    vocab_size: usize,
    seed: u64,
    seq_len: usize,
    global_batch: usize,
) -> Result<Sources, DataError> {
    let train = open_source(data, vocab_size, seed)?;
    if !eval.enabled() {
        return Ok(Sources { train, held_out: None });
    }
    if !eval.path.is_empty() {
        let held_out = open_source(&DataCfg { path: eval.path.clone(), ..data.clone() }, vocab_size, seed)?;
        if held_out.num_samples(seq_len) == 0 {
            return Err(DataError(format!(
                "[eval] path: {} holds fewer tokens than one sample of seq_len {seq_len} + 1",
                held_out.describe()
            )));
        }
        return Ok(Sources { train, held_out: Some(held_out) });
    }
    let n = train.num_samples(seq_len);
    let (tail, why) = match eval.tail_samples {
        0 => {
            ((eval.batches as u64).saturating_mul(global_batch as u64), format!("batches({}) × global_batch({global_batch})", eval.batches))
        }
        t => (t, format!("tail_samples({t})")),
    };
    if tail >= n {
        return Err(DataError(format!(
            "[eval] a held-out tail of {why} = {tail} samples leaves no training samples: {} holds {n} samples of seq_len {seq_len}",
            train.describe()
        )));
    }
    let held_out = open_source(data, vocab_size, seed)?;
    Ok(Sources {
        train: Box::new(Slice { inner: train, first: 0, count: n - tail, seq_len, what: "training" }),
        held_out: Some(Box::new(Slice { inner: held_out, first: n - tail, count: tail, seq_len, what: "held out" })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Order, Source};
    use crate::data::Loader;

    /// A `.bin` file whose token at position `i` is `i`, so every token read names its place.
    fn numbered_file(dir: &std::path::Path, n_tokens: u16) -> DataCfg {
        let path = dir.join("numbered.bin");
        crate::data::bin::write_bin(&path, &(0..n_tokens).collect::<Vec<_>>()).unwrap();
        DataCfg { source: Source::Bin, path: path.to_string_lossy().into_owned(), ..DataCfg::default() }
    }

    /// The highest and lowest token positions `loader` reads over `steps` steps of every rank
    /// (`dp` ranks, each its own loader over the same source).
    fn span(open: impl Fn() -> Box<dyn TokenSource>, data: &DataCfg, s: usize, dp: usize, steps: u64) -> (u32, u32) {
        let (mut lo, mut hi) = (u32::MAX, 0);
        for d in 0..dp {
            let loader = Loader::new(data, open(), s, 2, 4 * dp, dp, d, 7).unwrap();
            for step in 0..steps {
                for micro in 0..loader.grad_accum() {
                    let b = loader.micro_batch(step, micro).unwrap();
                    for &t in b.inputs.iter().chain(&b.targets) {
                        (lo, hi) = (lo.min(t), hi.max(t));
                    }
                }
            }
        }
        (lo, hi)
    }

    #[test]
    fn training_never_reads_a_held_out_tail() {
        let dir = tempfile::tempdir().unwrap();
        let s = 8;
        // 801 tokens: 100 samples of 9 tokens sharing one; a tail of 24 (3 batches of 8).
        let mut data = numbered_file(dir.path(), 801);
        let eval = EvalCfg { every: 5, batches: 3, ..EvalCfg::default() };
        for order in [Order::Sequential, Order::Shuffled] {
            data.order = order;
            let train = || open_sources(&data, &eval, 1000, 7, s, 8).unwrap().train;
            assert_eq!(train().num_samples(s), 76);
            // Many epochs of every rank of a dp = 2 run: the highest target is the first
            // held-out sample's first input token (76·8), never one of its targets.
            let (lo, hi) = span(train, &data, s, 2, 200);
            assert_eq!((lo, hi), (0, 76 * 8), "{order:?}");
            let held = || open_sources(&data, &eval, 1000, 7, s, 8).unwrap().held_out.unwrap();
            let sequential = DataCfg { order: Order::Sequential, ..data.clone() };
            assert_eq!(span(held, &sequential, s, 2, 3), (76 * 8, 800));
        }
        // An explicit tail, and one that leaves nothing to train on.
        let tail = EvalCfg { tail_samples: 10, ..eval.clone() };
        assert_eq!(open_sources(&data, &tail, 1000, 7, s, 8).unwrap().train.num_samples(s), 90);
        let all = EvalCfg { tail_samples: 100, ..eval.clone() };
        let e = open_sources(&data, &all, 1000, 7, s, 8).err().unwrap();
        assert!(e.0.contains("tail_samples(100) = 100 samples leaves no training samples") && e.0.contains("holds 100 samples"), "{e}");
        // Off: the whole file trains.
        let off = EvalCfg { every: 0, ..eval };
        let both = open_sources(&data, &off, 1000, 7, s, 8).unwrap();
        assert!(both.held_out.is_none());
        assert_eq!(both.train.num_samples(s), 100);
    }
}
