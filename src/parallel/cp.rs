//! Context parallelism over the `cp` group: the zigzag split of a micro-batch's sequences, ring
//! attention as the model's [`AttentionSchedule`], and the ring's byte formula.
//!
//! Each sequence is cut into `2·cp` chunks; rank `c` keeps chunks `c` and `2·cp − 1 − c` with
//! their global positions and targets, so every rank has the same causal work. The attention
//! of a rank's queries runs over the whole sequence as the key and value blocks travel around
//! the ring (`cp − 1` shifts, each posted before the compute on the current block so it
//! overlaps), the partial results merged by an online softmax. [`SequenceGroups`] sums what a
//! sequence's rows gather (a mixture of experts' load) over the ranks that share the sequence:
//! `cp`, and `tp` under sequence parallelism.

use super::collective::Collective;
use super::comm::Group;
use crate::backend::{AttnDims, Backend};
use crate::model::hooks::{AttentionSchedule, LocalAttention, SequenceShards};
use crate::model::params::Dims;
use crate::model::positions::visible_pairs;
use crate::scalar::Real;
use std::cell::RefCell;

/// The global positions a context-parallel rank holds: the sequence of `seq_len` tokens is cut
/// into `2·cp` chunks and rank `c` holds chunks `c` and `2·cp − 1 − c` ("zigzag"), so every
/// rank has the same amount of causal attention work.
/// With `cp = 1` the rank holds the whole sequence in order.
pub fn zigzag_positions(seq_len: usize, cp: usize, rank: usize) -> Vec<usize> {
    if cp == 1 {
        return (0..seq_len).collect();
    }
    let chunk = seq_len / (2 * cp);
    (rank * chunk..(rank + 1) * chunk).chain((2 * cp - 1 - rank) * chunk..(2 * cp - rank) * chunk).collect()
}

/// This cp rank's share of `[rows, seq_len]` tokens: `[rows, seq_len / cp]`, the zigzag
/// chunks in order, with their global positions.
fn local_tokens(tokens: &[u32], seq_len: usize, cp: usize, rank: usize) -> (Vec<u32>, Vec<usize>) {
    let positions = zigzag_positions(seq_len, cp, rank);
    let local = tokens.chunks(seq_len).flat_map(|row| positions.iter().map(move |&p| row[p])).collect();
    (local, positions)
}

/// The tokens of one micro-batch as a rank holds them: its share of the sequences (its
/// zigzag chunks) and their global positions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalBatch {
    /// `[rows, seq_len / cp]`
    pub inputs: Vec<u32>,
    /// `[rows, seq_len / cp]`
    pub targets: Vec<u32>,
    /// `[seq_len / cp]`: the same for every row.
    pub positions: Vec<usize>,
}

impl LocalBatch {
    /// Cp rank `rank`'s share of a micro-batch of `[rows, seq_len]` inputs and targets.
    pub fn of(inputs: &[u32], targets: &[u32], seq_len: usize, cp: usize, rank: usize) -> LocalBatch {
        let (inputs, positions) = local_tokens(inputs, seq_len, cp, rank);
        let (targets, _) = local_tokens(targets, seq_len, cp, rank);
        LocalBatch { inputs, targets, positions }
    }
}

/// Bytes the ring moves per optimiser step on one rank (the bytes each rank sends): per block
/// and micro-step, the key/value block `cp − 1` times in forward (again when `full` activation
/// checkpointing recomputes it: every block but the last), and in backward the key/value block `cp − 1` times and its
/// gradient `cp` times (the last step returns it to its owner).
pub fn predicted_ring_bytes(
    m: &Dims,
    micro_batch: usize,
    seq_local: usize,
    cp: usize,
    grad_accum: usize,
    recompute: bool,
    chunks: usize,
) -> u64 {
    if cp == 1 {
        return 0;
    }
    let kv = (2 * micro_batch * m.kv_heads_local * seq_local * m.hd * 4) as u64;
    let (c, l) = (cp as u64, m.layers as u64);
    // Forward: c − 1 shifts of K/V per block; backward: c − 1 of K/V and c of dK/dV; `full`
    // recomputes every block but the last of each piece of the model (`chunks`).
    let recomputed = if recompute { l.saturating_sub(chunks as u64) } else { 0 };
    grad_accum as u64 * kv * (l * (2 * (c - 1) + c) + recomputed * (c - 1))
}

/// The attention schedule over a `cp` group: the local kernel on one rank, the ring otherwise.
pub fn attention_schedule<'a, T: Real, B: Backend<T> + 'a>(ring: &'a dyn Collective<B::Buf>) -> Box<dyn AttentionSchedule<T, B> + 'a> {
    if ring.degree() == 1 {
        Box::new(LocalAttention)
    } else {
        Box::new(RingAttention::new(ring))
    }
}

/// The ranks that hold rows of the same sequences: the `cp` group, and the `tp` group where
/// sequence parallelism splits the rows (`tp` is `None` otherwise: every tp rank holds them
/// all). Host sums of a few numbers per sequence, skipped on groups of one.
pub struct SequenceGroups<'a> {
    pub tp: Option<&'a Group>,
    pub cp: &'a Group,
}

impl SequenceShards for SequenceGroups<'_> {
    fn sum(&self, x: &mut [f64]) {
        for g in self.tp.iter().chain([&self.cp]) {
            if g.size() > 1 {
                g.all_reduce_sum_f64(x);
            }
        }
    }

    /// The first rank of the `cp` group: the loss sums reduce over `cp` (never over `tp`, whose
    /// ranks each hold the whole loss).
    fn counts(&self) -> bool {
        self.cp.rank() == 0
    }
}

/// Ring exchange slots (MPI tags): the key and value blocks and their gradients travel
/// concurrently.
const RING_K: usize = 1;
const RING_V: usize = 2;
const RING_DK: usize = 3;
const RING_DV: usize = 4;

/// Elements of the ring's scratch for a micro-batch of `b` sequences of `s_local` tokens per
/// rank (`N = B·S_local`): the key and value blocks travelling around the ring and their
/// gradients (`[B, KV, S_local, hd]` each), one block's partial attention output
/// (`[B, H, S_local, hd]`) and log-sum-exp (`[B, H, S_local]`); none at `cp = 1`.
pub fn ring_scratch_elements(m: &Dims, b: usize, s_local: usize, cp: usize) -> usize {
    if cp == 1 {
        return 0;
    }
    let n = b * s_local;
    4 * n * m.kv_heads_local * m.hd + n * m.heads_local * m.hd + n * m.heads_local
}

/// The ring's buffers (see [`ring_scratch_elements`]) and the positions every rank of the ring
/// holds, on the backend; sized on first use.
struct RingBuffers<V, P> {
    dm: Option<(usize, usize, usize, usize, usize)>,
    /// `positions[src]`: the global positions ring rank `src` holds.
    positions: Vec<P>,
    k: V,
    v: V,
    dk: V,
    dv: V,
    o_part: V,
    lse_part: V,
}

/// Ring attention over the `cp` group: the model's [`AttentionSchedule`] under context
/// parallelism.
pub struct RingAttention<'a, T: Real, B: Backend<T>> {
    ring: &'a dyn Collective<B::Buf>,
    buffers: RefCell<RingBuffers<B::Buf, B::Pos>>,
}

impl<'a, T: Real, B: Backend<T>> RingAttention<'a, T, B> {
    pub fn new(ring: &'a dyn Collective<B::Buf>) -> Self {
        let buffers = RingBuffers {
            dm: None,
            positions: vec![],
            k: B::Buf::default(),
            v: B::Buf::default(),
            dk: B::Buf::default(),
            dv: B::Buf::default(),
            o_part: B::Buf::default(),
            lse_part: B::Buf::default(),
        };
        RingAttention { ring, buffers: RefCell::new(buffers) }
    }

    /// The ring's buffers, sized for `dm` (this rank's `sq = sk = S_local` tokens).
    fn buffers(&self, be: &B, dm: AttnDims) -> std::cell::RefMut<'_, RingBuffers<B::Buf, B::Pos>> {
        let mut r = self.buffers.borrow_mut();
        let key = (dm.b, dm.h, dm.kv, dm.sq, dm.hd);
        if r.dm != Some(key) {
            let cp = self.ring.degree();
            let (kv, q) = (dm.b * dm.kv * dm.sq * dm.hd, dm.b * dm.h * dm.sq * dm.hd);
            r.positions = (0..cp)
                .map(|src| {
                    let mut p = B::Pos::default();
                    be.set_positions(&mut p, &zigzag_positions(dm.sq * cp, cp, src));
                    p
                })
                .collect();
            let _for = crate::backend::allocating("ring attention's K/V blocks in flight", None);
            (r.k, r.v, r.dk, r.dv) = (be.zeros(kv), be.zeros(kv), be.zeros(kv), be.zeros(kv));
            (r.o_part, r.lse_part) = (be.zeros(q), be.zeros(dm.b * dm.h * dm.sq));
            r.dm = Some(key);
        }
        r
    }
}

impl<T: Real, B: Backend<T>> AttentionSchedule<T, B> for RingAttention<'_, T, B> {
    /// The key and value blocks travel around the ring (`cp − 1` steps); each block's partial
    /// result is merged with an online softmax (running log-sum-exp in the element type, f32
    /// in training). Causality is by global position, so the zigzag chunks mask correctly.
    fn forward(&self, be: &B, o: &mut B::Buf, lse: &mut B::Buf, q: &B::Buf, k: &B::Buf, v: &B::Buf, pos: &B::Pos, dm: AttnDims) {
        let cp = self.ring.degree();
        let mut guard = self.buffers(be, dm);
        let r = &mut *guard;
        be.fill(o, T::ZERO);
        be.fill(lse, T::NEG_INFINITY);
        be.copy(&mut r.k, k);
        be.copy(&mut r.v, v);
        for step in 0..cp {
            let src = (self.ring.rank() + cp - step) % cp;
            // Post the next exchange before computing on the current block (overlap).
            if step + 1 < cp {
                self.ring.start_shift(RING_K, &r.k); // backward: dK/dV travel the same ring
                self.ring.start_shift(RING_V, &r.v);
            }
            be.attention_fwd(&mut r.o_part, &mut r.lse_part, q, &r.k, &r.v, pos, &r.positions[src], dm);
            be.attention_merge(o, lse, &r.o_part, &r.lse_part, dm.hd);
            if step + 1 < cp {
                self.ring.finish_shift(RING_K, &mut r.k);
                self.ring.finish_shift(RING_V, &mut r.v);
            }
        }
    }

    /// The key and value blocks travel the ring again with their accumulating `dK` and `dV`;
    /// after `cp` steps each block's gradient is back with the rank that owns it.
    fn backward(
        &self,
        be: &B,
        (dq, dk, dv): (&mut B::Buf, &mut B::Buf, &mut B::Buf),
        d_o: &B::Buf,
        q: &B::Buf,
        k: &B::Buf,
        v: &B::Buf,
        o: &B::Buf,
        lse: &B::Buf,
        pos: &B::Pos,
        dm: AttnDims,
    ) {
        let cp = self.ring.degree();
        let mut guard = self.buffers(be, dm);
        let r = &mut *guard;
        be.copy(&mut r.k, k);
        be.copy(&mut r.v, v);
        be.fill(&mut r.dk, T::ZERO);
        be.fill(&mut r.dv, T::ZERO);
        be.fill(dq, T::ZERO);
        for step in 0..cp {
            let src = (self.ring.rank() + cp - step) % cp;
            if step + 1 < cp {
                self.ring.start_shift(RING_K, &r.k);
                self.ring.start_shift(RING_V, &r.v);
            }
            // dq of this block into o_part (free in backward), dk/dv of this block into dk/dv.
            be.attention_bwd(&mut r.o_part, dk, dv, d_o, q, &r.k, &r.v, o, lse, pos, &r.positions[src], dm);
            be.add_assign(dq, &r.o_part);
            // The accumulating gradient of the block held in the previous step arrives now.
            if step > 0 {
                self.ring.finish_shift(RING_DK, &mut r.dk);
                self.ring.finish_shift(RING_DV, &mut r.dv);
            }
            be.add_assign(&mut r.dk, dk);
            be.add_assign(&mut r.dv, dv);
            // Pass it on; it travels while the next block computes.
            self.ring.start_shift(RING_DK, &r.dk);
            self.ring.start_shift(RING_DV, &r.dv);
            if step + 1 < cp {
                self.ring.finish_shift(RING_K, &mut r.k);
                self.ring.finish_shift(RING_V, &mut r.v);
            }
        }
        // After `cp` steps the gradient of this rank's own block is back.
        self.ring.finish_shift(RING_DK, &mut r.dk);
        self.ring.finish_shift(RING_DV, &mut r.dv);
        be.copy(dk, &r.dk);
        be.copy(dv, &r.dv);
    }

    /// Over every block of keys the ring brings.
    fn visible_pairs(&self, q_pos: &[usize]) -> u64 {
        let cp = self.ring.degree();
        let seq = q_pos.len() * cp;
        (0..cp).map(|src| visible_pairs(q_pos, &zigzag_positions(seq, cp, src))).sum()
    }
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
        use crate::model::positions::visible_pairs;
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
