//! The built-in synthetic source: a seeded sparse first-order Markov chain over the vocabulary.
//! Needs no file, is learnable, and its entropy floor (the loss of the best possible model) is
//! known exactly, so a training run can be judged against it.
//!
//! Each token has `b = synthetic_branching` distinct successors chosen by the seed, taken with
//! probabilities proportional to `1, 1/2, …, 1/b` (the same vector in every row, in a seeded
//! order). Sample `k` starts from a uniform token and walks; every draw is a counter-based random
//! number keyed by `(seed, k, position)`, so any sample is produced on its own and sample `k` at
//! length S is a prefix of sample `k` at any longer length. Owns nothing of order or batching.

use super::{DataError, TokenSource};
use crate::rng;

/// Samples in one "epoch" of the synthetic source: effectively endless, but finite so that the
/// loader's epoch arithmetic and the shuffled permutation stay well defined.
pub const SYNTHETIC_SAMPLES: u64 = 1 << 48;

/// Largest successor table (`vocab_size × branching` entries, 4 bytes each) accepted: 1 GiB.
/// A larger one is a mistake in the deck (a branching near a big vocabulary), not a useful chain.
const MAX_TABLE_ENTRIES: usize = 1 << 28;

pub struct Synthetic {
    vocab: usize,
    branching: usize,
    seed: u64,
    /// [V, b] row-major: successors of each token, most probable first.
    succ: Vec<u32>,
    /// [b]: cumulative probabilities of the successor ranks; the last is exactly 1.
    cum: Vec<f64>,
    /// Entropy (nats) of one row's distribution.
    row_entropy: f64,
}

impl Synthetic {
    pub fn new(vocab: usize, branching: usize, seed: u64) -> Result<Synthetic, DataError> {
        if branching == 0 || branching > vocab {
            return Err(DataError(format!("[data] synthetic_branching = {branching} must be in 1..=vocab_size ({vocab})")));
        }
        if vocab > u32::MAX as usize + 1 {
            return Err(DataError(format!("[model] vocab_size = {vocab} does not fit 32-bit token ids")));
        }
        if vocab.saturating_mul(branching) > MAX_TABLE_ENTRIES {
            return Err(DataError(format!(
                "[data] synthetic_branching = {branching} × vocab_size {vocab} = {} successor entries, above the limit of {MAX_TABLE_ENTRIES}\nHINT: a small branching (e.g. 4) is what makes the chain learnable",
                vocab as u128 * branching as u128
            )));
        }
        let weights: Vec<f64> = (1..=branching).map(|j| 1.0 / j as f64).collect();
        let total: f64 = weights.iter().sum();
        let probs: Vec<f64> = weights.iter().map(|w| w / total).collect();
        let row_entropy = -probs.iter().map(|p| p * p.ln()).sum::<f64>();
        let mut cum: Vec<f64> = probs
            .iter()
            .scan(0.0, |acc, p| {
                *acc += p;
                Some(*acc)
            })
            .collect();
        cum[branching - 1] = 1.0;

        let mut succ = Vec::with_capacity(vocab * branching);
        let mut rng = rng::Stream::new(seed, rng::stream_id("data.synthetic.table"));
        let mut row = Vec::with_capacity(branching);
        // [V]: `in_row[t] == r` while token t is already a successor of row r (O(1) membership,
        // so building the table is O(V·b) even when b is large).
        let mut in_row = vec![usize::MAX; vocab];
        for r in 0..vocab {
            // Floyd's algorithm: `branching` distinct tokens from 0..vocab, then a Fisher–Yates
            // shuffle so which successor gets which probability is random too.
            row.clear();
            for j in (vocab - branching)..vocab {
                let t = rng.below(j as u64 + 1) as usize;
                let pick = if in_row[t] == r { j } else { t };
                in_row[pick] = r;
                row.push(pick as u32);
            }
            for i in (1..branching).rev() {
                row.swap(i, rng.below(i as u64 + 1) as usize);
            }
            succ.extend_from_slice(&row);
        }
        Ok(Synthetic { vocab, branching, seed, succ, cum, row_entropy })
    }
}

impl TokenSource for Synthetic {
    fn num_samples(&self, _seq_len: usize) -> u64 {
        SYNTHETIC_SAMPLES
    }

    fn sample(&self, k: u64, seq_len: usize, out: &mut Vec<u32>) -> Result<(), DataError> {
        // One counter stream per sample; draw i is the i-th token's randomness.
        let stream = rng::stream_id("data.synthetic.walk").wrapping_add(k);
        out.clear();
        let start = ((rng::bits(self.seed, stream, 0) as u128 * self.vocab as u128) >> 64) as u32;
        out.push(start);
        let mut cur = start as usize;
        for i in 1..=seq_len as u64 {
            let u = rng::uniform(self.seed, stream, i);
            let rank = self.cum.partition_point(|&c| c <= u).min(self.branching - 1);
            let next = self.succ[cur * self.branching + rank];
            out.push(next);
            cur = next as usize;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "synthetic Markov chain: vocab {}, {} successors per token, seed {}, entropy floor {:.4} nats/token",
            self.vocab, self.branching, self.seed, self.row_entropy
        )
    }

    /// Expected conditional entropy of the S targets given their prefixes. The chain is
    /// first-order, so the best model's loss at target `i` is `H(x_i | x_{i−1}) = Σ_s P(x_{i−1}=s)
    /// H(row s)`. Every row is a permutation of the same probability vector over distinct
    /// successors, so `H(row s)` is the same for all `s` and the average over any state
    /// distribution (uniform at the start, then propagated) is exactly that row entropy, at
    /// every position and for every S.
    fn entropy_floor(&self, _seq_len: usize) -> Option<f64> {
        Some(self.row_entropy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_synthetic_rows_are_distinct_successors() {
        for (v, b) in [(1, 1), (7, 7), (50, 4), (300, 3)] {
            let s = Synthetic::new(v, b, 9).unwrap();
            for row in s.succ.chunks(b) {
                let mut r = row.to_vec();
                r.sort();
                r.dedup();
                assert_eq!(r.len(), b);
                assert!(r.iter().all(|&t| (t as usize) < v));
            }
        }
    }

    #[test]
    fn data_synthetic_floor_of_known_rows() {
        // b = 1 is deterministic; b = 2 has probabilities 2/3, 1/3.
        assert_eq!(Synthetic::new(10, 1, 0).unwrap().entropy_floor(8), Some(0.0));
        let h2 = -(2.0f64 / 3.0 * (2.0f64 / 3.0).ln() + 1.0 / 3.0 * (1.0f64 / 3.0).ln());
        let got = Synthetic::new(10, 2, 0).unwrap().entropy_floor(8).unwrap();
        assert!((got - h2).abs() < 1e-15, "{got} vs {h2}");
    }
}
