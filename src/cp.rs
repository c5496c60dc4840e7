//! Context parallelism over the `cp` group: the ring the attention uses, the zigzag split of a
//! micro-batch's sequences, and the ring's byte formula.
//!
//! The model runs ring attention through [`RingComm`]; this module gives it the `cp` group and
//! cuts each sequence into `2·cp` chunks, rank `c` keeping chunks `c` and `2·cp − 1 − c` with
//! their global positions and targets. Knows nothing of tensor or data parallelism.

use crate::comm::Group;
use crate::model::attention::zigzag_positions;
use crate::model::params::Dims;
use crate::model::RingComm;

impl RingComm<Vec<f32>> for Group {
    fn degree(&self) -> usize {
        self.size()
    }
    fn rank(&self) -> usize {
        Group::rank(self)
    }
    fn start_shift(&self, slot: usize, buf: &Vec<f32>) {
        self.start_ring_shift_f32(slot, buf);
    }
    fn finish_shift(&self, slot: usize, buf: &mut Vec<f32>) {
        self.finish_ring_shift_f32(slot, buf);
    }
}

/// This cp rank's share of `[rows, seq_len]` tokens: `[rows, seq_len / cp]`, the zigzag
/// chunks in order, with their global positions.
pub fn local_tokens(tokens: &[u32], seq_len: usize, cp: usize, rank: usize) -> (Vec<u32>, Vec<usize>) {
    let positions = zigzag_positions(seq_len, cp, rank);
    let local = tokens.chunks(seq_len).flat_map(|row| positions.iter().map(move |&p| row[p])).collect();
    (local, positions)
}

/// Bytes the ring moves per optimiser step on one rank (the bytes each rank sends): per block
/// and micro-step, the key/value block `cp − 1` times in forward (again when `full` activation
/// checkpointing recomputes it: every block but the last), and in backward the key/value block `cp − 1` times and its
/// gradient `cp` times (the last step returns it to its owner).
pub fn predicted_ring_bytes(m: &Dims, micro_batch: usize, seq_local: usize, cp: usize, grad_accum: usize, recompute: bool) -> u64 {
    if cp == 1 {
        return 0;
    }
    let kv = (2 * micro_batch * m.kv_heads * seq_local * m.hd * 4) as u64;
    let (c, l) = (cp as u64, m.layers as u64);
    // Forward: c − 1 shifts of K/V per block; backward: c − 1 of K/V and c of dK/dV; `full`
    // recomputes every block but the last (its forward again).
    let recomputed = if recompute { l.saturating_sub(1) } else { 0 };
    grad_accum as u64 * kv * (l * (2 * (c - 1) + c) + recomputed * (c - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zigzag_chunks_cover_the_sequence_once() {
        let (s, cp) = (32, 4);
        let mut all: Vec<usize> = (0..cp).flat_map(|c| zigzag_positions(s, cp, c)).collect();
        all.sort();
        assert_eq!(all, (0..s).collect::<Vec<_>>());
        assert_eq!(zigzag_positions(s, cp, 0), [0, 1, 2, 3, 28, 29, 30, 31]);
        let tokens: Vec<u32> = (0..2 * s as u32).collect();
        let (local, pos) = local_tokens(&tokens, s, cp, 1);
        assert_eq!(pos, [4, 5, 6, 7, 24, 25, 26, 27]);
        assert_eq!(&local[8..12], &[36, 37, 38, 39]);
    }

    #[test]
    fn zigzag_balances_causal_work() {
        use crate::model::attention::visible_pairs;
        let (s, cp) = (64, 4);
        let work: Vec<u64> = (0..cp)
            .map(|c| {
                let q = zigzag_positions(s, cp, c);
                (0..cp).map(|src| visible_pairs(&q, &zigzag_positions(s, cp, src))).sum()
            })
            .collect();
        assert!(work.iter().all(|&w| w == work[0]), "{work:?}");
    }
}
