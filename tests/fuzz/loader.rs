//! The loader without a token file: synthetic-source parameters, overflowing degrees, the permutation.

use ndtrain::config::{DataCfg, Order, Source};
use ndtrain::data::{open_source, Loader};
use proptest::prelude::*;

use crate::cases;
use crate::sources::{check_data_error, exercise_source, geometry, Geometry};

proptest! {
    #![proptest_config(cases(128))]

    /// The synthetic source's parameters (no file); vocabularies stay small enough to build.
    #[test]
    fn synthetic_parameters_never_panic(
        vocab in prop_oneof![8 => 0usize..600, 1 => Just(1usize << 40), 1 => Just(usize::MAX)],
        branching in prop_oneof![8 => 0usize..8, 2 => 0usize..700, 1 => Just(usize::MAX)],
        g in geometry(),
    ) {
        let cfg = DataCfg { source: Source::Synthetic, synthetic_branching: branching, order: g.order, ..DataCfg::default() };
        // The synthetic chain is endless: a direct sample of length usize::MAX would never end.
        let samples = g.samples.iter().map(|&(k, len)| (k, len.min(64))).collect();
        let g = Geometry { vocab, seq_len: g.seq_len.min(64), samples, ..g };
        exercise_source(&cfg, &g)?;
    }
}

proptest! {
    #![proptest_config(cases(256))]

    /// `Loader::new` and `micro_batch` with degrees so large that their products overflow: the
    /// deck's `resolve` rejects those (checked products), but the loader is public API too.
    /// Reads use a 1-token sequence so that no case allocates much.
    ///
    /// With `micro_batch = 9223372036854775808, dp = 2, global_batch = 1, dp_rank = 0, step = 0,
    /// order = Sequential`, an unchecked `micro_batch * dp` panics with "attempt to multiply with
    /// overflow" under overflow checks (as in the test profile) and without them wraps to 0, so
    /// that `global_batch % per_micro` divides by zero; `Loader::new` (src/data/mod.rs) therefore
    /// uses `checked_mul`. No deck reaches this.
    #[test]
    fn loader_overflowing_geometry_never_panics(
        micro_batch in prop_oneof![1usize..4, Just(usize::MAX), Just(1usize << 32), Just(1usize << 63)],
        dp in prop_oneof![1usize..4, Just(usize::MAX), Just(1usize << 32), Just(1usize << 63)],
        global_batch in prop_oneof![1usize..16, Just(usize::MAX), Just(0usize), Just(1usize << 63)],
        dp_rank in prop_oneof![0usize..4, Just(usize::MAX - 1)],
        step in prop_oneof![0u64..4, Just(u64::MAX)],
        order in prop_oneof![Just(Order::Sequential), Just(Order::Shuffled)],
    ) {
        let cfg = DataCfg { order, ..DataCfg::default() };
        let src = open_source(&cfg, 16, 1).unwrap();
        match Loader::new(&cfg, src, 1, micro_batch, global_batch, dp, dp_rank, 1) {
            // A loader that accepted a batch it cannot hold would allocate it on read: only
            // small ones are read here.
            Ok(l) if micro_batch < 4 => {
                if let Err(e) = l.micro_batch(step, 0) {
                    check_data_error("micro_batch", &e)?;
                }
            }
            Ok(_) => {}
            Err(e) => check_data_error("loader", &e)?,
        }
    }

    /// The shuffled order's permutation maps `0..n` into `0..n` for any `n`, and is a bijection
    /// on small `n`.
    #[test]
    fn permutation_stays_in_range(n in prop_oneof![1u64..100, any::<u64>().prop_map(|n| n.max(1)), Just(u64::MAX), Just(1u64 << 48)], seed in any::<u64>(), epoch in any::<u64>(), i in any::<u64>()) {
        let p = ndtrain::data::Permutation::new(n, seed, epoch);
        prop_assert!(p.apply(i % n) < n);
        if n < 100 {
            let mut image: Vec<u64> = (0..n).map(|i| p.apply(i)).collect();
            image.sort_unstable();
            prop_assert_eq!(image, (0..n).collect::<Vec<_>>());
        }
    }
}
