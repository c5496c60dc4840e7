//! Where a rank's tokens sit in their sequence: the rotary tables for their global positions,
//! and the causal attention work a set of query positions costs against a set of key
//! positions. Host-side maths; the tables go to the backend.

use crate::scalar::Real;

/// RoPE tables for the given global positions: `cos, sin [S, hd/2]`, Hugging Face convention
/// `inv_freq_i = theta^(−2i/hd)`, angle `pos · inv_freq_i` (computed in f64, then rounded).
pub fn rope_tables<T: Real>(positions: &[usize], hd: usize, theta: f64) -> (Vec<T>, Vec<T>) {
    let half = hd / 2;
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for i in 0..half {
            // Hugging Face computes inv_freq in f32 (`1.0 / base ** (arange(0, hd, 2).float() / hd)`);
            // reproduce its rounding so the frequencies agree bit for bit (up to f32 pow).
            let inv_freq = (1.0f32 / theta.powf(((2 * i) as f32 / hd as f32) as f64) as f32) as f64;
            let angle = p as f64 * inv_freq;
            cos.push(T::from_f64(angle.cos()));
            sin.push(T::from_f64(angle.sin()));
        }
    }
    (cos, sin)
}

/// Pairs (query, key) a rank's queries may attend to against a block of keys: the causal work
/// the block costs (counted to show the zigzag balance).
pub fn visible_pairs(q_pos: &[usize], k_pos: &[usize]) -> u64 {
    // Both are ascending per chunk; a merge-count keeps this O(|q| + |k|).
    let mut ks = k_pos.to_vec();
    ks.sort_unstable();
    q_pos.iter().map(|&p| ks.partition_point(|&k| k <= p) as u64).sum()
}
