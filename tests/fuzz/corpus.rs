//! The committed corpus `tests/fuzz_corpus/`, replayed as it is and mutated byte by byte.
//!
//! An input that ever makes a test here fail is added to the corpus.

use std::path::Path;
use std::sync::OnceLock;

use ndtrain::config::{Deck, Order, Source};
use ndtrain::data::open_source;
use proptest::prelude::*;
use proptest::sample::Index;

use crate::cases;
use crate::decks::{exercise_deck, worlds};
use crate::sources::{data_cfg, exercise_source, Geometry};

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fuzz_corpus");

/// (file name, bytes) of every file of one corpus folder.
type Seeds = Vec<(String, Vec<u8>)>;

/// The files of one corpus folder, sorted by name; at least `min`, so an emptied or moved
/// corpus fails the test instead of passing it.
fn corpus(kind: &str, min: usize) -> &'static [(String, Vec<u8>)] {
    static ALL: OnceLock<std::collections::HashMap<String, Seeds>> = OnceLock::new();
    let all = ALL.get_or_init(|| {
        ["deck", "bin", "hdf5"]
            .into_iter()
            .map(|k| {
                let mut files: Seeds = std::fs::read_dir(Path::new(CORPUS).join(k))
                    .unwrap_or_else(|e| panic!("{CORPUS}/{k}: {e}"))
                    .map(|e| e.unwrap().path())
                    .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
                    .collect();
                files.sort();
                (k.to_string(), files)
            })
            .collect()
    });
    let files = &all[kind];
    assert!(files.len() >= min, "{CORPUS}/{kind} holds {} files, expected at least {min}", files.len());
    files
}

/// One byte-level edit of a seed (what coverage-guided fuzzers do to their corpus).
#[derive(Debug, Clone)]
enum ByteEdit {
    Flip(Index, u8),
    /// An interesting 32-bit value (0, −1, extremes, powers of two) written little-endian.
    Int(Index, i32),
    Insert(Index, Vec<u8>),
    Delete(Index, usize),
    Truncate(Index),
    /// A chunk of another seed of the same kind spliced in.
    Splice(Index, Index, Index, usize),
}

fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    let ints = prop::sample::select(vec![0, 1, -1, 2, 255, 256, 65535, 65536, i32::MAX, i32::MIN, 20240520, 20240801, 7, 1 << 20]);
    prop_oneof![
        4 => (any::<Index>(), 1u8..=255).prop_map(|(i, x)| ByteEdit::Flip(i, x)),
        2 => (any::<Index>(), ints).prop_map(|(i, v)| ByteEdit::Int(i, v)),
        2 => (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, b)| ByteEdit::Insert(i, b)),
        2 => (any::<Index>(), 1usize..64).prop_map(|(i, n)| ByteEdit::Delete(i, n)),
        1 => any::<Index>().prop_map(ByteEdit::Truncate),
        1 => (any::<Index>(), any::<Index>(), any::<Index>(), 1usize..80).prop_map(|(f, a, b, n)| ByteEdit::Splice(f, a, b, n)),
    ]
}

fn mutate(seeds: &[(String, Vec<u8>)], seed: &[u8], edits: &[ByteEdit]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        let at = |i: &Index, len: usize| if len == 0 { 0 } else { i.index(len) };
        match e {
            ByteEdit::Flip(i, x) if !b.is_empty() => {
                let k = at(i, b.len());
                b[k] ^= x;
            }
            ByteEdit::Int(i, v) if b.len() >= 4 => {
                let k = at(i, b.len() - 3);
                b[k..k + 4].copy_from_slice(&v.to_le_bytes());
            }
            ByteEdit::Insert(i, x) => {
                let k = at(i, b.len() + 1);
                b.splice(k..k, x.iter().copied());
            }
            ByteEdit::Delete(i, n) if !b.is_empty() => {
                let k = at(i, b.len());
                b.drain(k..(k + n).min(b.len()));
            }
            ByteEdit::Truncate(i) => b.truncate(at(i, b.len() + 1)),
            ByteEdit::Splice(f, a, dst, n) => {
                let other = &seeds[f.index(seeds.len())].1;
                if !other.is_empty() {
                    let s = a.index(other.len());
                    let chunk = other[s..(s + n).min(other.len())].to_vec();
                    let k = at(dst, b.len() + 1);
                    b.splice(k..k, chunk);
                }
            }
            _ => {}
        }
    }
    b
}

/// The geometry the corpus' token files were made for (vocabulary 128, short sequences).
fn corpus_geometry(order: Order) -> Geometry {
    Geometry {
        vocab: 128,
        seq_len: 8,
        micro_batch: 2,
        global_batch: 4,
        dp: 2,
        dp_rank: 1,
        order,
        seed: 3,
        reads: vec![(0, 0), (0, 1), (5, 1), (1 << 40, 0)],
        samples: vec![(0, 8), (3, 1), (u64::MAX, 8)],
    }
}

/// Every seed as it is: decks parse or fail with a message; token files open and read or fail
/// with a message. The valid seeds must be accepted (the corpus is what it says it is).
#[test]
fn corpus_seeds_replay_cleanly() {
    for (name, bytes) in corpus("deck", 10) {
        let text = String::from_utf8_lossy(bytes);
        exercise_deck(&text, &[], &[1, 2, 4, 8, 16]).unwrap_or_else(|e| panic!("deck/{name}: {e}"));
        let parsed = Deck::from_str_with(&text, &[]);
        if ["tiny.toml", "every_key.toml", "aliases.toml", "bench_small.toml"].contains(&name.as_str()) {
            parsed.unwrap_or_else(|e| panic!("deck/{name} is a valid seed: {e}")).validate().unwrap();
        }
    }
    let dir = tempfile::tempdir().unwrap();
    for (kind, source, min) in [("bin", Source::Bin, 12), ("hdf5", Source::Hdf5, 8)] {
        for (name, bytes) in corpus(kind, min) {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            for order in [Order::Sequential, Order::Shuffled] {
                let cfg = data_cfg(source, &path, "tokens", order);
                exercise_source(&cfg, &corpus_geometry(order)).unwrap_or_else(|e| panic!("{kind}/{name}: {e}"));
                let opened = open_source(&cfg, 128, 1);
                if name.contains("valid") || ["tokens_u16.h5", "tokens_i64.h5", "tokens_u8_and_other.h5"].contains(&name.as_str()) {
                    opened.unwrap_or_else(|e| panic!("{kind}/{name} is a valid seed: {e}"));
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn corpus_decks_mutated_never_panic(pick in any::<Index>(), edits in prop::collection::vec(byte_edit(), 1..8), w in worlds()) {
        let seeds = corpus("deck", 10);
        let bytes = mutate(seeds, &seeds[pick.index(seeds.len())].1, &edits);
        exercise_deck(&String::from_utf8_lossy(&bytes), &[], &w)?;
    }

    #[test]
    fn corpus_bin_files_mutated_never_panic(
        pick in any::<Index>(),
        edits in prop::collection::vec(byte_edit(), 1..8),
        shuffled in any::<bool>(),
    ) {
        let seeds = corpus("bin", 12);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bin");
        std::fs::write(&path, mutate(seeds, &seeds[pick.index(seeds.len())].1, &edits)).unwrap();
        let order = if shuffled { Order::Shuffled } else { Order::Sequential };
        exercise_source(&data_cfg(Source::Bin, &path, "", order), &corpus_geometry(order))?;
    }
}
