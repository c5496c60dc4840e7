//! Where a rank's shards lie in the logical tensors, and the layout-independent checksum.
//!
//! A rank holds, for every parameter, the rows its `fsdp` coordinate owns of the piece its `tp`
//! coordinate holds: always one rectangular block of the logical (Hugging Face) tensor, so
//! saving and loading are one hyperslab per tensor and rank, and resharding onto another
//! layout is reading other blocks. The checksum of a tensor is a sum modulo 2^64 of one hash
//! per element (of its index and bits), so any partition of the tensor into blocks sums to the
//! same value: writers and readers on different layouts agree without gathering anything.

use crate::model::params::{param_specs_local, Dims, TpSplit};
use crate::parallel::fsdp::ShardPlan;
use rayon::prelude::*;

/// One rank's shard of one tensor as a block of the logical tensor. The shard's first
/// `len()` elements are the block, row-major; the rest of the shard is padding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardBlock {
    /// The Hugging Face name.
    pub name: String,
    pub global_shape: Vec<usize>,
    pub start: Vec<usize>,
    pub count: Vec<usize>,
    /// Exactly one rank of the world is primary for each element: it writes the element and
    /// counts it in checksums (replicas over `dp_rep`, the norm weights every `tp` rank
    /// holds, and the last pipeline stage's copy of a tied embedding are written once).
    pub primary: bool,
}

impl ShardBlock {
    pub fn len(&self) -> usize {
        self.count.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row-major index in the logical tensor of element `i` of the block.
    fn global_index(&self, row: usize, col: usize) -> u64 {
        match self.global_shape.len() {
            1 => (self.start[0] + row) as u64,
            _ => ((self.start[0] + row) * self.global_shape[1] + self.start[1] + col) as u64,
        }
    }
}

/// The blocks of this rank's shards, in the slot order of [`ShardPlan::optimizer_slots`].
/// `replica_leader`: this rank is coordinate 0 of `dp_rep` (the one replica that writes).
pub fn shard_blocks(plan: &ShardPlan, m: &Dims, replica_leader: bool) -> Vec<ShardBlock> {
    let specs = param_specs_local(m);
    let mut out = vec![];
    let tensors = plan.units.iter().enumerate().flat_map(|(u, unit)| unit.tensors.iter().map(move |t| (u, t)));
    for (u, t) in tensors {
        let spec = &specs[t.spec_index];
        let rows = t.owned_rows(plan.unit_rank(u));
        let n = rows.len();
        let (start, count) = match (spec.split, spec.global_shape.len()) {
            (_, 1) => (vec![rows.start], vec![n]),
            (TpSplit::Replicated, _) => (vec![rows.start, 0], vec![n, t.cols]),
            (TpSplit::Rows, _) => {
                // The vocabulary is padded to a multiple of tp: rows past the end are not stored.
                let g0 = (spec.tp_rank * spec.shape[0] + rows.start).min(spec.global_shape[0]);
                let g1 = (spec.tp_rank * spec.shape[0] + rows.end).min(spec.global_shape[0]);
                (vec![g0, 0], vec![g1 - g0, t.cols])
            }
            (TpSplit::Cols, _) => (vec![rows.start, spec.tp_rank * t.cols], vec![n, t.cols]),
        };
        let primary = replica_leader && (spec.split != TpSplit::Replicated || spec.tp_rank == 0) && !t.tied_copy;
        out.push(ShardBlock { name: spec.name.clone(), global_shape: spec.global_shape.clone(), start, count, primary });
    }
    out
}

/// FNV-1a of a dataset's path: the checksum's per-tensor salt (a tensor stored under another
/// name does not verify).
pub fn salt(path: &str) -> u64 {
    path.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The hash of one element: SplitMix64's finaliser of `salt + index·φ + bits·K`. For a fixed
/// index it is a bijection of the bits, so changing any single element always changes the sum.
pub fn element_hash(salt: u64, index: u64, bits: u32) -> u64 {
    let mut z =
        salt.wrapping_add(index.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_add((bits as u64).wrapping_mul(0xd6e8_feb8_6659_fd93));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// This block's part of the checksum of the dataset at `path`: the wrapping sum of its
/// elements' hashes (`data` holds at least the block's elements).
pub fn block_checksum(path: &str, block: &ShardBlock, data: &[f32]) -> u64 {
    let s = salt(path);
    let cols = if block.count.len() == 1 { 1 } else { block.count[1] };
    if block.is_empty() {
        return 0;
    }
    data[..block.len()]
        .par_chunks(cols)
        .enumerate()
        .map(|(r, row)| {
            row.iter().enumerate().fold(0u64, |h, (c, x)| h.wrapping_add(element_hash(s, block.global_index(r, c), x.to_bits())))
        })
        .reduce(|| 0, u64::wrapping_add)
}

/// [`block_checksum`] on the calling thread alone: the checkpoint writer's thread runs beside
/// training and leaves the shared thread pool to it.
pub fn block_checksum_serial(path: &str, block: &ShardBlock, data: &[f32]) -> u64 {
    let s = salt(path);
    let cols = if block.count.len() == 1 { 1 } else { block.count[1] };
    if block.is_empty() {
        return 0;
    }
    data[..block.len()].chunks(cols).enumerate().fold(0u64, |h, (r, row)| {
        row.iter().enumerate().fold(h, |h, (c, x)| h.wrapping_add(element_hash(s, block.global_index(r, c), x.to_bits())))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelCfg;

    fn cfg() -> ModelCfg {
        ModelCfg {
            vocab_size: 30,
            d_model: 8,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 4,
            head_dim: 0,
            qk_norm: false,
            ffn_hidden: 12,
            max_seq_len: 16,
            rope_theta: 1e4,
            norm_eps: 1e-5,
            tie_embeddings: false,
            ..ModelCfg::default()
        }
    }

    /// Every element of every logical tensor is covered by exactly one primary block, for
    /// layouts with vocabulary and fsdp padding.
    #[test]
    fn primary_blocks_tile_every_tensor_exactly_once() {
        let cfg = cfg();
        let full = crate::model::params::param_specs(&cfg);
        for (tp, fsdp, rep) in [(1, 1, 1), (2, 3, 1), (4, 2, 2), (2, 7, 1)] {
            let mut hits: Vec<Vec<u32>> = full.iter().map(|s| vec![0; s.numel()]).collect();
            for t in 0..tp {
                let m = Dims::new(&cfg, tp, t);
                for f in 0..fsdp {
                    let plan = ShardPlan::new(&m, fsdp, f);
                    for r in 0..rep {
                        for b in shard_blocks(&plan, &m, r == 0) {
                            let i = full.iter().position(|s| s.name == b.name).unwrap();
                            assert_eq!(b.global_shape, full[i].shape);
                            if !b.primary {
                                continue;
                            }
                            let cols = b.count.get(1).copied().unwrap_or(1);
                            for row in 0..b.count[0] {
                                for c in 0..cols {
                                    hits[i][b.global_index(row, c) as usize] += 1;
                                }
                            }
                        }
                    }
                }
            }
            for (s, h) in full.iter().zip(&hits) {
                assert!(h.iter().all(|&n| n == 1), "tp={tp} fsdp={fsdp} rep={rep}: {} covered {:?}", s.name, h);
            }
        }
    }

    #[test]
    fn checksum_is_independent_of_the_partition_and_sees_one_flipped_bit() {
        let shape = [5usize, 3];
        let data: Vec<f32> = (0..15).map(|i| i as f32 * 0.37 - 2.0).collect();
        let whole = ShardBlock { name: "w".into(), global_shape: shape.to_vec(), start: vec![0, 0], count: vec![5, 3], primary: true };
        let total = block_checksum("model/w", &whole, &data);
        // Rows 0..2 and 2..5, then columns 0..1 and 1..3 of all rows.
        let top = ShardBlock { count: vec![2, 3], ..whole.clone() };
        let bottom = ShardBlock { start: vec![2, 0], count: vec![3, 3], ..whole.clone() };
        assert_eq!(block_checksum("model/w", &top, &data[..6]).wrapping_add(block_checksum("model/w", &bottom, &data[6..])), total);
        let left = ShardBlock { count: vec![5, 1], ..whole.clone() };
        let right = ShardBlock { start: vec![0, 1], count: vec![5, 2], ..whole.clone() };
        let l: Vec<f32> = (0..5).map(|r| data[r * 3]).collect();
        let rr: Vec<f32> = (0..5).flat_map(|r| [data[r * 3 + 1], data[r * 3 + 2]]).collect();
        assert_eq!(block_checksum("model/w", &left, &l).wrapping_add(block_checksum("model/w", &right, &rr)), total);
        let mut bad = data.clone();
        bad[7] = f32::from_bits(bad[7].to_bits() ^ 1);
        assert_ne!(block_checksum("model/w", &whole, &bad), total);
        assert_ne!(block_checksum("model/v", &whole, &data), total, "the salt binds the name");
    }
}
