//! llm.c `.bin` token shards: random and structured files, `*` patterns, odd paths, fixed edge cases.

use ndtrain::config::{Order, Source};
use ndtrain::data::{open_source, Loader, BIN_HEADER_INTS, BIN_MAGIC_GPT2, BIN_MAGIC_LLAMA3, BIN_VERSION_GPT2, BIN_VERSION_LLAMA3};
use proptest::prelude::*;

use crate::cases;
use crate::sources::{data_cfg, exercise_source, geometry, Geometry};

/// A `.bin` shard: header fields, token width and body, any of them inconsistent.
#[derive(Debug, Clone)]
struct BinFile {
    magic: i32,
    version: i32,
    /// `None`: the true count of the body's tokens.
    count: Option<i32>,
    /// Tokens written 2 or 4 bytes wide (independent of the header's claim).
    wide: bool,
    tokens: Vec<u32>,
    /// Bytes cut from the end (a truncated file) or appended (extra bytes).
    cut: usize,
    extra: Vec<u8>,
    /// Replace the whole file by this many bytes of the header (a file shorter than its header).
    header_only: Option<usize>,
}

impl BinFile {
    fn bytes(&self) -> Vec<u8> {
        let width = if self.wide { 4 } else { 2 };
        let mut header = [0i32; BIN_HEADER_INTS];
        header[0] = self.magic;
        header[1] = self.version;
        header[2] = self.count.unwrap_or(self.tokens.len() as i32);
        let mut b: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
        if let Some(n) = self.header_only {
            b.truncate(n);
            return b;
        }
        for &t in &self.tokens {
            b.extend_from_slice(&t.to_le_bytes()[..width]);
        }
        b.truncate(b.len().saturating_sub(self.cut));
        b.extend_from_slice(&self.extra);
        b
    }
}

fn bin_file() -> impl Strategy<Value = BinFile> {
    let magic = prop_oneof![4 => Just(BIN_MAGIC_GPT2), 2 => Just(BIN_MAGIC_LLAMA3), 1 => any::<i32>(), 1 => Just(0)];
    let version = prop_oneof![4 => Just(BIN_VERSION_GPT2), 2 => Just(BIN_VERSION_LLAMA3), 1 => any::<i32>()];
    let count = prop_oneof![
        4 => Just(None),
        1 => prop::sample::select(vec![0, 1, 2, -1, i32::MIN, i32::MAX, 1 << 20]).prop_map(Some),
        1 => (0i32..400).prop_map(Some),
    ];
    let token = prop_oneof![8 => 0u32..128, 1 => 128u32..70000, 1 => any::<u32>()];
    (
        magic,
        version,
        count,
        any::<bool>(),
        prop::collection::vec(token, 0..300),
        prop_oneof![4 => Just(0usize), 1 => 0usize..8],
        prop_oneof![4 => Just(vec![]), 1 => prop::collection::vec(any::<u8>(), 0..8)],
        prop_oneof![8 => Just(None), 1 => (0usize..1024).prop_map(Some)],
    )
        .prop_map(|(magic, version, count, wide, tokens, cut, extra, header_only)| BinFile {
            magic,
            version,
            count,
            wide,
            tokens,
            cut,
            extra,
            header_only,
        })
}

/// A file that is consistent by construction: the magic and version of its width, the true count.
fn consistent_bin_file() -> impl Strategy<Value = BinFile> {
    (any::<bool>(), prop::collection::vec(prop_oneof![9 => 0u32..128, 1 => 128u32..300], 0..400)).prop_map(|(wide, tokens)| BinFile {
        magic: if wide { BIN_MAGIC_LLAMA3 } else { BIN_MAGIC_GPT2 },
        version: if wide { BIN_VERSION_LLAMA3 } else { BIN_VERSION_GPT2 },
        count: None,
        wide,
        tokens,
        cut: 0,
        extra: vec![],
        header_only: None,
    })
}

proptest! {
    #![proptest_config(cases(128))]

    #[test]
    fn bin_random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2100), g in geometry()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bin");
        std::fs::write(&path, &bytes).unwrap();
        exercise_source(&data_cfg(Source::Bin, &path, "", g.order), &g)?;
    }

    #[test]
    fn bin_structured_header_never_panics(f in bin_file(), g in geometry()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bin");
        std::fs::write(&path, f.bytes()).unwrap();
        exercise_source(&data_cfg(Source::Bin, &path, "", g.order), &g)?;
    }

    /// Several shards behind a `*` pattern, valid and broken ones mixed, empty shards included.
    #[test]
    fn bin_shard_patterns_never_panic(
        shards in prop::collection::vec(prop_oneof![4 => consistent_bin_file(), 1 => bin_file()], 1..5),
        extra_dir in any::<bool>(),
        pattern in prop::sample::select(vec!["s_*.bin", "*", "s_*", "*.bin", "s_**.bin", "*_0*", "nomatch_*.bin", "s_0.bin", "*/s_0.bin", "s_0.bin*"]),
        g in geometry(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        for (i, s) in shards.iter().enumerate() {
            std::fs::write(dir.path().join(format!("s_{i}.bin")), s.bytes()).unwrap();
        }
        if extra_dir {
            // A directory that the pattern also matches: skipped, or an error for a plain path.
            std::fs::create_dir(dir.path().join("s_dir.bin")).unwrap();
        }
        exercise_source(&data_cfg(Source::Bin, &dir.path().join(pattern), "", g.order), &g)?;
    }

    /// Odd paths: empty, a directory, a missing file, NUL bytes, stars in the folder part.
    #[test]
    fn bin_odd_paths_never_panic(
        name in prop_oneof![
            prop::sample::select(vec!["", ".", "..", "/", "missing.bin", "*", "**", "*/*", "a*/b.bin", "sub/", "sub", "sub/*", "\0", "x\0*.bin"])
                .prop_map(String::from),
            ".{0,12}",
        ],
        source in prop_oneof![Just(Source::Bin), Just(Source::Hdf5)],
        dataset in ".{0,8}",
        g in geometry(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let mut cfg = data_cfg(source, &dir.path().join(&name), &dataset, g.order);
        if name.is_empty() {
            cfg.path.clear();
        }
        exercise_source(&cfg, &g)?;
    }
}

/// Fixed edge cases the strategies above reach only by chance: each must be an error (or, for
/// the valid one, a batch) with a message naming the problem.
#[test]
fn bin_edge_cases_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let valid = BinFile {
        magic: BIN_MAGIC_GPT2,
        version: BIN_VERSION_GPT2,
        count: None,
        wide: false,
        tokens: (0..200).map(|i| i % 128).collect(),
        cut: 0,
        extra: vec![],
        header_only: None,
    };
    let cases: Vec<(&str, BinFile, &str)> = vec![
        ("empty file", BinFile { header_only: Some(0), ..valid.clone() }, "shorter than the 1024-byte"),
        ("short header", BinFile { header_only: Some(1023), ..valid.clone() }, "shorter than the 1024-byte"),
        ("wrong magic", BinFile { magic: 7, ..valid.clone() }, "header magic is 7"),
        ("wrong version", BinFile { version: 2, ..valid.clone() }, "header version is 2"),
        ("negative count", BinFile { count: Some(-5), ..valid.clone() }, "negative"),
        ("count too large", BinFile { count: Some(201), ..valid.clone() }, "header says 201 tokens"),
        ("count too small", BinFile { count: Some(199), ..valid.clone() }, "header says 199 tokens"),
        ("truncated body", BinFile { cut: 1, ..valid.clone() }, "but the file is 1423 bytes"),
        ("one token", BinFile { tokens: vec![1], ..valid.clone() }, "a sample needs at least 2"),
        ("fewer than a sample", BinFile { tokens: vec![1; 64], ..valid.clone() }, "fewer tokens than one sample"),
    ];
    let g = Geometry {
        vocab: 128,
        seq_len: 64,
        micro_batch: 1,
        global_batch: 1,
        dp: 1,
        dp_rank: 0,
        order: Order::Sequential,
        seed: 1,
        reads: vec![(0, 0)],
        samples: vec![],
    };
    for (name, f, want) in cases {
        let path = dir.path().join(format!("{}.bin", name.replace(' ', "_")));
        std::fs::write(&path, f.bytes()).unwrap();
        let cfg = data_cfg(Source::Bin, &path, "", Order::Sequential);
        let e = open_source(&cfg, 128, 1)
            .and_then(|s| Loader::new(&cfg, s, g.seq_len, 1, 1, 1, 0, 1))
            .and_then(|l| l.micro_batch(0, 0))
            .expect_err(name);
        assert!(e.0.contains(want), "{name}: {e}");
    }
    // A token id ≥ vocab opens fine and fails when its sample is read, naming the position.
    let path = dir.path().join("oov.bin");
    let mut tokens: Vec<u32> = vec![5; 200];
    tokens[70] = 128;
    std::fs::write(&path, BinFile { tokens, ..valid.clone() }.bytes()).unwrap();
    let cfg = data_cfg(Source::Bin, &path, "", Order::Sequential);
    let l = Loader::new(&cfg, open_source(&cfg, 128, 1).unwrap(), 64, 1, 1, 1, 0, 1).unwrap();
    l.micro_batch(0, 0).unwrap();
    let e = l.micro_batch(1, 0).unwrap_err();
    assert!(e.0.contains("token at position 70 is 128"), "{e}");
    // And the valid file reads.
    let path = dir.path().join("valid.bin");
    std::fs::write(&path, valid.bytes()).unwrap();
    exercise_source(&data_cfg(Source::Bin, &path, "", Order::Shuffled), &g).unwrap();
}
