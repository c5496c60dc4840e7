//! Shared by the token-file families: the loader geometries and `exercise_source` (open, build, read).

use std::path::Path;

use ndtrain::config::{DataCfg, Order, Source};
use ndtrain::data::{open_source, DataError, Loader};
use proptest::prelude::*;
use proptest::sample::Index;

/// How a loader is built and read: `Loader::new`'s geometry and the `(step, micro)` reads.
#[derive(Debug, Clone)]
pub(crate) struct Geometry {
    pub(crate) vocab: usize,
    pub(crate) seq_len: usize,
    pub(crate) micro_batch: usize,
    pub(crate) global_batch: usize,
    pub(crate) dp: usize,
    pub(crate) dp_rank: usize,
    pub(crate) order: Order,
    pub(crate) seed: u64,
    pub(crate) reads: Vec<(u64, usize)>,
    /// Direct `TokenSource::sample(k, seq_len)` calls.
    pub(crate) samples: Vec<(u64, usize)>,
}

pub(crate) fn geometry() -> impl Strategy<Value = Geometry> {
    prop_oneof![3 => valid_geometry(), 1 => any_geometry()]
}

/// A geometry `Loader::new` accepts, so that reads are what gets fuzzed.
fn valid_geometry() -> impl Strategy<Value = Geometry> {
    (
        prop::sample::select(vec![128usize, 128, 256, 65536, 1 << 32]),
        1usize..=32,
        1usize..=3,
        1usize..=3,
        1usize..=3,
        any::<Index>(),
        prop_oneof![Just(Order::Sequential), Just(Order::Shuffled)],
        any::<u64>(),
        prop::collection::vec((prop_oneof![4 => 0u64..8, 1 => any::<u64>()], prop_oneof![4 => Just(0usize), 1 => 0usize..4]), 1..5),
        prop::collection::vec((prop_oneof![0u64..64, any::<u64>()], 0usize..70), 0..4),
    )
        .prop_map(|(vocab, seq_len, micro_batch, dp, accum, rank, order, seed, reads, samples)| Geometry {
            vocab,
            seq_len,
            micro_batch,
            global_batch: micro_batch * dp * accum,
            dp,
            dp_rank: rank.index(dp),
            order,
            seed,
            reads,
            samples,
        })
}

/// Any geometry, most of it rejected by `Loader::new`.
fn any_geometry() -> impl Strategy<Value = Geometry> {
    let vocab = prop_oneof![prop::sample::select(vec![0usize, 1, 2, 128, 255, 256, 65535, 65536, usize::MAX]), 1usize..70000];
    let step = prop_oneof![0u64..8, any::<u64>(), Just(u64::MAX)];
    let k = prop_oneof![0u64..64, any::<u64>()];
    let direct_len = prop_oneof![0usize..70, Just(usize::MAX), Just(usize::MAX - 1)];
    (
        vocab,
        prop_oneof![1usize..=16, 0usize..=300],
        0usize..=4,
        prop_oneof![(1usize..=4).prop_map(|g| g * 4), 0usize..=20],
        0usize..=4,
        0usize..=4,
        prop_oneof![Just(Order::Sequential), Just(Order::Shuffled)],
        any::<u64>(),
        prop::collection::vec((step, 0usize..6), 1..5),
        prop::collection::vec((k, direct_len), 0..4),
    )
        .prop_map(|(vocab, seq_len, micro_batch, global_batch, dp, dp_rank, order, seed, reads, samples)| Geometry {
            vocab,
            seq_len,
            micro_batch,
            global_batch,
            dp,
            dp_rank,
            order,
            seed,
            reads,
            samples,
        })
}

pub(crate) fn check_data_error(what: &str, e: &DataError) -> Result<(), TestCaseError> {
    prop_assert!(!e.0.trim().is_empty(), "{what}: empty data error");
    Ok(())
}

/// Opens `cfg`, builds a loader and reads from it; only a panic or an empty message fails.
pub(crate) fn exercise_source(cfg: &DataCfg, g: &Geometry) -> Result<(), TestCaseError> {
    let src = match open_source(cfg, g.vocab, g.seed) {
        Ok(s) => s,
        Err(e) => return check_data_error("open", &e),
    };
    prop_assert!(!src.describe().is_empty());
    let _ = src.num_samples(g.seq_len);
    let _ = src.entropy_floor(g.seq_len);
    let mut buf = Vec::new();
    for &(k, len) in &g.samples {
        match src.sample(k, len, &mut buf) {
            Ok(()) => {
                prop_assert_eq!(buf.len(), len + 1);
                prop_assert!(buf.iter().all(|&t| (t as usize) < g.vocab), "sample {k}: a token ≥ vocab {}", g.vocab);
            }
            Err(e) => check_data_error("sample", &e)?,
        }
    }
    let loader = match Loader::new(cfg, src, g.seq_len, g.micro_batch, g.global_batch, g.dp, g.dp_rank, g.seed) {
        Ok(l) => l,
        Err(e) => return check_data_error("loader", &e),
    };
    let _ = loader.epoch(u64::MAX);
    for &(step, micro) in &g.reads {
        match loader.micro_batch(step, micro) {
            Ok(b) => {
                prop_assert_eq!((b.micro_batch, b.seq_len), (g.micro_batch, g.seq_len));
                prop_assert_eq!(b.inputs.len(), g.micro_batch * g.seq_len);
                prop_assert_eq!(b.targets.len(), g.micro_batch * g.seq_len);
                prop_assert!(b.inputs.iter().chain(&b.targets).all(|&t| (t as usize) < g.vocab), "a token ≥ vocab {}", g.vocab);
            }
            Err(e) => check_data_error("micro_batch", &e)?,
        }
    }
    Ok(())
}

pub(crate) fn data_cfg(source: Source, path: &Path, dataset: &str, order: Order) -> DataCfg {
    DataCfg { source, path: path.to_string_lossy().into_owned(), dataset: dataset.to_string(), order, ..DataCfg::default() }
}
