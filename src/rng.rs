//! Counter-based random numbers: every value is a pure function of `(seed, stream, index)`.
//!
//! Used for layout-independent initialisation (a rank generates exactly the elements of its own
//! shard, and they equal the one-rank values) and for seeded data (synthetic tokens, shuffles).
//! The mixer is SplitMix64's finaliser applied to a keyed counter; streams are named by a 64-bit
//! FNV-1a hash of a string such as a parameter name.

/// FNV-1a hash of a name, used as the stream id of a parameter or a data source.
pub fn stream_id(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[inline(always)]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The `index`-th 64 random bits of stream `stream` under `seed`.
#[inline(always)]
pub fn bits(seed: u64, stream: u64, index: u64) -> u64 {
    let key = mix(seed ^ mix(stream.wrapping_add(0x9e37_79b9_7f4a_7c15)));
    mix(key ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(0x632b_e59b_d9b4_e019))
}

/// A uniform number in the open interval (0, 1), 53 random bits.
#[inline(always)]
pub fn uniform(seed: u64, stream: u64, index: u64) -> f64 {
    ((bits(seed, stream, index) >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
}

/// A standard normal number (Box–Muller over two counter draws of one index).
#[inline(always)]
pub fn normal(seed: u64, stream: u64, index: u64) -> f64 {
    let u1 = uniform(seed, stream, 2 * index);
    let u2 = uniform(seed, stream, 2 * index + 1);
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// A small sequential generator for places that need a stream, not random access.
pub struct Stream {
    seed: u64,
    stream: u64,
    next: u64,
}

impl Stream {
    pub fn new(seed: u64, stream: u64) -> Self {
        Stream { seed, stream, next: 0 }
    }
    pub fn next_u64(&mut self) -> u64 {
        let v = bits(self.seed, self.stream, self.next);
        self.next += 1;
        v
    }
    pub fn next_f64(&mut self) -> f64 {
        let v = uniform(self.seed, self.stream, self.next);
        self.next += 1;
        v
    }
    /// Uniform in `0..n` (Lemire's multiply-shift; bias below 2⁻³² for the sizes used here).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_unit_moments() {
        let n = 200_000;
        let s = stream_id("test");
        let (mut m1, mut m2) = (0.0, 0.0);
        for i in 0..n {
            let x = normal(7, s, i);
            m1 += x;
            m2 += x * x;
        }
        m1 /= n as f64;
        m2 /= n as f64;
        // 5 standard errors of the mean (1/sqrt(n) ≈ 0.0022) and of the variance (sqrt(2/n) ≈ 0.0032).
        assert!(m1.abs() < 0.011, "mean {m1}");
        assert!((m2 - 1.0).abs() < 0.016, "variance {m2}");
    }

    #[test]
    fn streams_and_seeds_differ() {
        assert_ne!(bits(1, stream_id("a"), 0), bits(1, stream_id("b"), 0));
        assert_ne!(bits(1, stream_id("a"), 0), bits(2, stream_id("a"), 0));
        assert_eq!(bits(1, stream_id("a"), 5), bits(1, stream_id("a"), 5));
    }
}
