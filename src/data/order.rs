//! The seeded per-epoch permutation of `shuffled` order: a keyed Feistel bijection on the
//! smallest power-of-four domain covering `0..n`, restricted to `0..n` by cycle-walking.
//!
//! Random access and O(1) memory: the sample at any position is computed on its own, so every
//! rank evaluates only its own positions and a resumed run needs no saved state beyond the step.
//! Owns only the permutation; which positions a rank takes is the `Loader`'s business.

use crate::rng;

/// Feistel rounds. Luby–Rackoff: 4 rounds of a pseudo-random function already give a strong
/// pseudo-random permutation; 6 leave a margin for the small half-widths (a few bits) of tiny
/// datasets at a cost of a few nanoseconds per sample.
const FEISTEL_ROUNDS: u64 = 6;

/// A bijection of `0..n`, fixed by `(seed, epoch)`.
#[derive(Debug, Clone, Copy)]
pub struct Permutation {
    n: u64,
    /// Bits in each Feistel half; the walk runs on `0..4^half_bits >= n`.
    half_bits: u32,
    /// Round key of this epoch.
    key: u64,
}

impl Permutation {
    /// The permutation of `0..n` (`n >= 1`) for `epoch` under `seed`.
    pub fn new(n: u64, seed: u64, epoch: u64) -> Permutation {
        // Bits needed for n − 1, rounded up to even; at least 1 per half. At most 32 per half.
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let key = rng::bits(seed, rng::stream_id("data.shuffle"), epoch);
        Permutation { n, half_bits, key }
    }

    /// One pass of the Feistel network on the power-of-four domain (a bijection of it).
    fn feistel(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut l, mut r) = (x >> self.half_bits, x & mask);
        for round in 0..FEISTEL_ROUNDS {
            let f = rng::bits(self.key, round, r) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half_bits) | r
    }

    /// The image of `i` (`i < n`). Cycle-walking: apply the bijection until the value falls in
    /// `0..n`; it terminates because the cycle through `i` returns to `i`, and takes fewer than
    /// 4 passes on average since the domain is below `4n`.
    pub fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        let mut x = self.feistel(i);
        while x >= self.n {
            x = self.feistel(x);
        }
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_permutation_is_a_bijection() {
        for n in [1u64, 2, 3, 7, 16, 17, 1000, 4097] {
            let p = Permutation::new(n, 42, 3);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = p.apply(i);
                assert!(j < n && !seen[j as usize], "n {n}: {i} -> {j}");
                seen[j as usize] = true;
            }
        }
    }

    #[test]
    fn data_permutation_handles_huge_domains() {
        let p = Permutation::new(u64::MAX, 1, 0);
        assert!(p.apply(u64::MAX - 1) < u64::MAX);
        let p = Permutation::new(1 << 48, 1, 0);
        assert_ne!(p.apply(5), p.apply(6));
    }
}
