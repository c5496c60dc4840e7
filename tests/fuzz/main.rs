//! Property-based fuzzing (proptest) of the two readers of untrusted input: the deck (text,
//! `--set` overrides, the world size) and the token files (llm.c `.bin` shards, HDF5 token
//! datasets, the synthetic source's parameters).
//!
//! The rule for every input: no panic. A deck is either accepted or rejected with a
//! `ConfigError` whose message is non-empty and one line (as `ConfigError` documents); a data
//! source either opens, builds a loader and yields micro-batches of the right shape with every
//! token below the vocabulary, or fails with a `DataError` whose message is non-empty.
//!
//! Decks are fuzzed as (a) arbitrary text and bytes, (b) the tiny deck (`inputs/tiny.toml`)
//! mutated line by line — values replaced by random TOML values of random types (huge,
//! negative and zero integers, NaN and infinite floats, strings, arrays, inline tables, dates),
//! lines deleted, duplicated, swapped, random tables and keys inserted —, (c) random
//! `table.key=value` overrides; each accepted deck is validated, resolved for random world sizes
//! (0..=4096) and written back to TOML, which must parse to the same deck. Token files are
//! random bytes, `.bin` headers with random or inconsistent magic, version, count and body
//! (truncated, extra bytes, ids ≥ vocab), `*` patterns of several shards, and HDF5 files with
//! random dataset names, empty, 2-D, scalar, float, signed and 64-bit datasets; each is opened
//! through `data::open_source`, given to `Loader::new` with random geometry and read at random
//! (also huge) steps. The loader's overflowing degrees and the shuffled order's permutation are
//! fuzzed on their own.
//!
//! Two inputs the strategies reach only by chance have tests of their own: a `micro_batch × dp`
//! that overflows in `Loader::new`, and a huge prime head count, whose divisors `Deck::resolve`
//! lists in its hint.
//!
//! The committed corpus `tests/fuzz_corpus/` (seed decks under `deck/`, `.bin` shards under
//! `bin/`, HDF5 token files under `hdf5/`, the binary ones made by its `make_corpus.py`) is
//! replayed as it is, and its decks and `.bin` files are mutated byte by byte (flips, interesting
//! 32-bit values, insertions, deletions, truncation, splices from other seeds). HDF5 seeds are
//! replayed, not byte-mutated: that would fuzz the HDF5 C library's file parser, not this code.
//! An input that ever fails here is added to the corpus.
//!
//! Case counts are modest (the suite runs in seconds); `PROPTEST_CASES=N` raises them all.
//!
//! One file per family: `decks.rs` (deck text, line edits, overrides, deck files, `resolve`),
//! `bin_files.rs` (llm.c `.bin` shards, `*` patterns, odd paths), `hdf5_files.rs` (HDF5 token
//! datasets), `loader.rs` (the synthetic source, the loader's overflowing degrees, the shuffled
//! order's permutation) and `corpus.rs` (the committed corpus, replayed and byte-mutated);
//! `sources.rs` holds the loader geometries and the check every token source goes through.

use proptest::prelude::ProptestConfig;

mod bin_files;
mod corpus;
mod decks;
mod hdf5_files;
mod loader;
mod sources;

/// `with_cases(n)`, unless `PROPTEST_CASES` asks for more.
pub(crate) fn cases(n: u32) -> ProptestConfig {
    let env = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    // No regression files: proptest prints the minimal failing input, and the tests quote it.
    ProptestConfig { cases: n.max(env), failure_persistence: None, ..ProptestConfig::default() }
}
