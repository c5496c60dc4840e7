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
//! Two findings of the first runs are fixed and kept as tests with their inputs: `Loader::new`
//! panicked when `micro_batch × dp` overflowed, and `Deck::resolve` hung listing the divisors of
//! a huge prime head count for its hint.
//!
//! The committed corpus `tests/fuzz_corpus/` (seed decks under `deck/`, `.bin` shards under
//! `bin/`, HDF5 token files under `hdf5/`, the binary ones made by its `make_corpus.py`) is
//! replayed as it is, and its decks and `.bin` files are mutated byte by byte (flips, interesting
//! 32-bit values, insertions, deletions, truncation, splices from other seeds). HDF5 seeds are
//! replayed, not byte-mutated: that would fuzz the HDF5 C library's file parser, not this code.
//! An input that ever fails here is added to the corpus.
//!
//! Case counts are modest (the file runs in seconds); `PROPTEST_CASES=N` raises them all.

use std::path::Path;
use std::sync::OnceLock;

use ndtrain::config::{ConfigError, DataCfg, Deck, Order, Source};
use ndtrain::data::{
    open_source, DataError, Loader, BIN_HEADER_INTS, BIN_MAGIC_GPT2, BIN_MAGIC_LLAMA3, BIN_VERSION_GPT2, BIN_VERSION_LLAMA3,
};
use ndtrain::io::hdf5::{write_tokens, TokenSlice};
use proptest::prelude::*;
use proptest::sample::Index;

const TINY: &str = include_str!("../inputs/tiny.toml");

/// `with_cases(n)`, unless `PROPTEST_CASES` asks for more.
fn cases(n: u32) -> ProptestConfig {
    let env = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    // No regression files: proptest prints the minimal failing input, and the tests quote it.
    ProptestConfig { cases: n.max(env), failure_persistence: None, ..ProptestConfig::default() }
}

// ---------------------------------------------------------------------------------------------
// Decks.

/// The tables and keys of a deck (from the serialised default deck), plus the aliases.
fn names() -> &'static (Vec<String>, Vec<String>) {
    static NAMES: OnceLock<(Vec<String>, Vec<String>)> = OnceLock::new();
    NAMES.get_or_init(|| {
        let d = toml::Value::try_from(Deck::default()).expect("the default deck serialises");
        let root = d.as_table().expect("a table");
        let tables: Vec<String> = root.keys().cloned().collect();
        let mut keys: Vec<String> = root.values().flat_map(|t| t.as_table().into_iter().flat_map(|t| t.keys().cloned())).collect();
        keys.extend(
            ["dp_replicate_size", "dp_shard_size", "tp_size", "tensor_parallel_size", "cp_size", "context_parallel_size"].map(String::from),
        );
        (tables, keys)
    })
}

fn table_name() -> impl Strategy<Value = String> {
    prop_oneof![4 => prop::sample::select(names().0.clone()), 1 => "[a-z_]{0,8}", 1 => ".{0,6}"]
}

fn key_name() -> impl Strategy<Value = String> {
    prop_oneof![4 => prop::sample::select(names().1.clone()), 1 => "[a-z_]{0,12}", 1 => ".{0,6}"]
}

/// An integer as TOML text, biased to the edges.
fn int_value() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            0i64,
            1,
            -1,
            2,
            3,
            7,
            64,
            65,
            4096,
            i64::MAX,
            i64::MIN,
            1 << 31,
            (1 << 32) + 1,
            u32::MAX as i64,
            -(1 << 40)
        ]),
        -10i64..5000,
        any::<i64>(),
    ]
    .prop_map(|i| i.to_string())
}

/// A float as TOML text: NaN, infinities, signed zero, extremes, any bit pattern.
fn float_value() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec!["nan", "-nan", "+nan", "inf", "-inf", "+inf", "0.0", "-0.0", "1e308", "1e-320", "0.5", "1.0", "2.5e3"])
            .prop_map(String::from),
        any::<f64>().prop_map(|f| toml::Value::Float(f).to_string()),
    ]
}

/// A string as TOML text: any text, the deck's enum names and paths.
fn string_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>().prop_map(|s| toml::Value::String(s).to_string()),
        prop::sample::select(vec![
            "\"\"",
            "\"auto\"",
            "\"bin\"",
            "\"hdf5\"",
            "\"synthetic\"",
            "\"shuffled\"",
            "\"full\"",
            "\"/\"",
            "\"*\""
        ])
        .prop_map(String::from),
        "\"[a-z_/.*-]{0,12}\"",
    ]
}

/// A TOML value as text, of a random type, biased to the edges.
fn toml_value() -> impl Strategy<Value = String> {
    let (int, float, string) = (int_value(), float_value(), string_value());
    let other = prop_oneof![
        any::<bool>().prop_map(|b| b.to_string()),
        prop::sample::select(vec!["1979-05-27T07:32:00Z", "1979-05-27", "07:32:00", "[]", "{}", "'lit'", "\"\"\"multi\nline\"\"\""])
            .prop_map(String::from),
        "[a-zA-Z0-9_\\[\\]{}\"'=.,#+-]{0,10}",
    ];
    let leaf = prop_oneof![3 => int, 3 => float, 2 => string, 1 => other];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(", "))),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..3)
                .prop_map(|kv| { format!("{{ {} }}", kv.iter().map(|(k, v)| format!("{k} = {v}")).collect::<Vec<_>>().join(", ")) }),
        ]
    })
}

/// One edit of the tiny deck's lines.
#[derive(Debug, Clone)]
enum Edit {
    /// Replace the value of the chosen `key = value` line.
    SetValue(Index, String),
    /// Replace it by a value of the same TOML type (the deck still parses; validation decides).
    SetTyped(Index, Typed),
    Delete(Index),
    Duplicate(Index),
    Swap(Index, Index),
    Insert(Index, String),
}

/// One candidate value of each TOML type; the one matching the replaced value is used.
#[derive(Debug, Clone)]
struct Typed {
    int: String,
    float: String,
    string: String,
    boolean: bool,
}

fn typed() -> impl Strategy<Value = Typed> {
    (int_value(), float_value(), string_value(), any::<bool>()).prop_map(|(int, float, string, boolean)| Typed {
        int,
        float,
        string,
        boolean,
    })
}

impl Typed {
    /// The candidate of `old`'s type (a float key also takes an integer, as TOML allows).
    fn like(&self, old: &toml::Value) -> String {
        match old {
            toml::Value::Integer(_) => self.int.clone(),
            toml::Value::Float(_) if self.boolean => self.int.clone(),
            toml::Value::Float(_) => self.float.clone(),
            toml::Value::Boolean(_) => self.boolean.to_string(),
            _ => self.string.clone(),
        }
    }
}

fn inserted_line() -> impl Strategy<Value = String> {
    prop_oneof![
        table_name().prop_map(|t| format!("[{t}]")),
        table_name().prop_map(|t| format!("[[{t}]]")),
        (key_name(), toml_value()).prop_map(|(k, v)| format!("{k} = {v}")),
        (table_name(), key_name(), toml_value()).prop_map(|(t, k, v)| format!("{t}.{k} = {v}")),
        ".{0,30}",
    ]
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        3 => (any::<Index>(), toml_value()).prop_map(|(i, v)| Edit::SetValue(i, v)),
        4 => (any::<Index>(), typed()).prop_map(|(i, t)| Edit::SetTyped(i, t)),
        1 => any::<Index>().prop_map(Edit::Delete),
        1 => any::<Index>().prop_map(Edit::Duplicate),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Edit::Swap(a, b)),
        2 => (any::<Index>(), inserted_line()).prop_map(|(i, l)| Edit::Insert(i, l)),
    ]
}

fn apply_edits(edits: &[Edit]) -> String {
    let mut lines: Vec<String> = TINY.lines().map(String::from).collect();
    for e in edits {
        if lines.is_empty() {
            lines.push(String::new());
        }
        match e {
            Edit::SetValue(i, v) => {
                let assignments: Vec<usize> = (0..lines.len()).filter(|&j| lines[j].contains('=')).collect();
                if !assignments.is_empty() {
                    let j = *i.get(&assignments);
                    let key = lines[j].split('=').next().unwrap_or("").trim().to_string();
                    lines[j] = format!("{key} = {v}");
                }
            }
            Edit::SetTyped(i, t) => {
                let assignments: Vec<usize> = (0..lines.len()).filter(|&j| lines[j].contains('=')).collect();
                if !assignments.is_empty() {
                    let j = *i.get(&assignments);
                    let (key, old) = lines[j].split_once('=').unwrap_or_default();
                    let old = format!("v = {old}").parse::<toml::Table>().ok().and_then(|mut t| t.remove("v"));
                    let v = t.like(&old.unwrap_or(toml::Value::Boolean(false)));
                    lines[j] = format!("{} = {v}", key.trim());
                }
            }
            Edit::Delete(i) => {
                lines.remove(i.index(lines.len()));
            }
            Edit::Duplicate(i) => {
                let j = i.index(lines.len());
                lines.insert(j, lines[j].clone());
            }
            Edit::Swap(a, b) => {
                let (a, b) = (a.index(lines.len()), b.index(lines.len()));
                lines.swap(a, b);
            }
            Edit::Insert(i, l) => lines.insert(i.index(lines.len() + 1), l.clone()),
        }
    }
    lines.join("\n") + "\n"
}

/// `(table, key, default value)` of every key of the default deck.
fn default_keys() -> &'static Vec<(String, String, toml::Value)> {
    static KEYS: OnceLock<Vec<(String, String, toml::Value)>> = OnceLock::new();
    KEYS.get_or_init(|| {
        let d = toml::Value::try_from(Deck::default()).expect("the default deck serialises");
        let mut out = Vec::new();
        for (t, v) in d.as_table().expect("a table") {
            for (k, v) in v.as_table().expect("each table is a table") {
                out.push((t.clone(), k.clone(), v.clone()));
            }
        }
        out
    })
}

/// A `--set` override: mostly `table.key=value`, sometimes malformed.
fn override_text() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => (any::<Index>(), typed()).prop_map(|(i, t)| {
            let (table, key, default) = i.get(default_keys());
            format!("{table}.{key}={}", t.like(default))
        }),
        4 => (table_name(), key_name(), toml_value()).prop_map(|(t, k, v)| format!("{t}.{k}={v}")),
        2 => (table_name(), key_name(), ".{0,12}").prop_map(|(t, k, v)| format!("{t}.{k}={v}")),
        1 => (key_name(), toml_value()).prop_map(|(k, v)| format!("{k}={v}")),
        1 => "[a-z_.= ]{0,20}",
        1 => ".{0,24}",
    ]
}

/// World sizes for `resolve`: the small ones the tiny deck fits, and any up to 4096.
fn worlds() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(prop_oneof![3 => 1usize..=8, 1 => 0usize..=4096], 1..4)
}

/// A rejected deck: a non-empty message, message and hint each one line.
fn check_config_error(what: &str, e: &ConfigError) -> Result<(), TestCaseError> {
    prop_assert!(!e.message.trim().is_empty(), "{what}: empty message {e:?}");
    prop_assert!(!e.message.contains('\n'), "{what}: message is not one line: {:?}", e.message);
    if let Some(h) = &e.hint {
        prop_assert!(!h.trim().is_empty() && !h.contains('\n'), "{what}: hint is empty or not one line: {h:?}");
    }
    Ok(())
}

/// Parses, validates, resolves and writes back a deck; every outcome but a panic or an empty
/// message is fine.
fn exercise_deck(text: &str, sets: &[String], worlds: &[usize]) -> Result<(), TestCaseError> {
    let deck = match Deck::from_str_with(text, sets) {
        Ok(d) => d,
        Err(e) => return check_config_error("parse", &e),
    };
    // The resolved deck is saved as TOML by every run: it must parse back to the same deck
    // (compared as text, so NaN equals NaN).
    let written = deck.to_toml();
    match Deck::from_str_with(&written, &[]) {
        Ok(again) => prop_assert_eq!(again.to_toml(), written.clone(), "to_toml round trip"),
        Err(e) => prop_assert!(false, "to_toml output does not parse: {e}\n{written}"),
    }
    if let Err(e) = deck.validate() {
        check_config_error("validate", &e)?;
    }
    for &w in worlds {
        match deck.resolve(w) {
            Ok(r) => {
                prop_assert_eq!(r.layout.world_size(), w);
                prop_assert_eq!(r.global_batch, r.deck.train.micro_batch * r.grad_accum * r.layout.dp());
                prop_assert!(r.lr.is_finite() && r.lr > 0.0, "resolved lr {}", r.lr);
                prop_assert!(r.summary.iter().all(|l| !l.is_empty()));
            }
            Err(e) => check_config_error("resolve", &e)?,
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn deck_arbitrary_text_never_panics(text in any::<String>(), w in worlds()) {
        exercise_deck(&text, &[], &w)?;
    }

    #[test]
    fn deck_toml_alphabet_never_panics(text in "[\\[\\]a-z_ =\"'.,0-9{}#\n+-]{0,200}", w in worlds()) {
        exercise_deck(&text, &[], &w)?;
    }

    #[test]
    fn deck_arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400), w in worlds()) {
        exercise_deck(&String::from_utf8_lossy(&bytes), &[], &w)?;
    }

    #[test]
    fn mutated_tiny_deck_never_panics(edits in prop::collection::vec(edit(), 1..6), w in worlds()) {
        exercise_deck(&apply_edits(&edits), &[], &w)?;
    }

    #[test]
    fn random_overrides_never_panic(sets in prop::collection::vec(override_text(), 0..5), w in worlds()) {
        exercise_deck(TINY, &sets, &w)?;
    }

    #[test]
    fn mutated_deck_with_overrides_never_panics(
        edits in prop::collection::vec(edit(), 0..3),
        sets in prop::collection::vec(override_text(), 1..3),
        w in worlds(),
    ) {
        exercise_deck(&apply_edits(&edits), &sets, &w)?;
    }
}

proptest! {
    #![proptest_config(cases(64))]

    /// `Deck::from_file` on bytes that need not be UTF-8 (what `ndtrain train` reads).
    #[test]
    fn deck_file_of_random_bytes_never_panics(
        bytes in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..300),
            (any::<Index>(), prop::collection::vec(any::<u8>(), 1..8)).prop_map(|(i, junk)| {
                let mut b = TINY.as_bytes().to_vec();
                let at = i.index(b.len());
                b.splice(at..at, junk);
                b
            }),
        ],
        sets in prop::collection::vec(override_text(), 0..2),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("deck.toml");
        std::fs::write(&path, &bytes).unwrap();
        match Deck::from_file(&path, &sets) {
            Ok(d) => {
                if let Err(e) = d.resolve(1) {
                    check_config_error("resolve", &e)?;
                }
            }
            Err(e) => {
                prop_assert!(!e.message.trim().is_empty());
                if std::str::from_utf8(&bytes).is_err() {
                    prop_assert!(e.message.contains("cannot read deck"), "non-UTF-8 deck: {e}");
                }
            }
        }
    }
}

/// `Deck::resolve` must finish, whatever the numbers: this deck is valid up to the layout
/// check, where tp = 2 divides none of n_heads = n_kv_heads = ffn_hidden = 2^61 − 1 (a prime).
///
/// Found by this file (fixed in src/config/validate.rs, `check_layout`): the hint listed the
/// divisors of gcd(n_heads, n_kv_heads, ffn_hidden) by trying every number in 1..=gcd until 12
/// were found, so for a large prime gcd the loop ran ~2.3e18 times and `ndtrain train`/`plan`
/// hung at start-up on
/// `--set model.n_heads=2305843009213693951 --set model.n_kv_heads=2305843009213693951
/// --set model.ffn_hidden=2305843009213693951 --set model.d_model=4611686018427387902
/// --set parallel.tp=2`. The search now stops at 65536.
#[test]
fn resolve_finishes_on_a_huge_prime_head_count() {
    let p = "2305843009213693951";
    let sets: Vec<String> = [
        format!("model.n_heads={p}"),
        format!("model.n_kv_heads={p}"),
        format!("model.ffn_hidden={p}"),
        "model.d_model=4611686018427387902".into(),
        "parallel.tp=2".into(),
    ]
    .into();
    let deck = Deck::from_str_with(TINY, &sets).expect("the deck parses");
    let (tx, rx) = std::sync::mpsc::channel();
    // A hang must fail the test, not stall the suite: the resolving thread is left behind.
    std::thread::spawn(move || tx.send(deck.resolve(2).map(|_| ()).map_err(|e| e.to_string())));
    match rx.recv_timeout(std::time::Duration::from_secs(10)) {
        Ok(r) => assert!(r.unwrap_err().contains("tp(2) does not divide")),
        Err(_) => panic!("Deck::resolve did not return within 10 s"),
    }
}

// ---------------------------------------------------------------------------------------------
// Token files.

/// How a loader is built and read: `Loader::new`'s geometry and the `(step, micro)` reads.
#[derive(Debug, Clone)]
struct Geometry {
    vocab: usize,
    seq_len: usize,
    micro_batch: usize,
    global_batch: usize,
    dp: usize,
    dp_rank: usize,
    order: Order,
    seed: u64,
    reads: Vec<(u64, usize)>,
    /// Direct `TokenSource::sample(k, seq_len)` calls.
    samples: Vec<(u64, usize)>,
}

fn geometry() -> impl Strategy<Value = Geometry> {
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

fn check_data_error(what: &str, e: &DataError) -> Result<(), TestCaseError> {
    prop_assert!(!e.0.trim().is_empty(), "{what}: empty data error");
    Ok(())
}

/// Opens `cfg`, builds a loader and reads from it; only a panic or an empty message fails.
fn exercise_source(cfg: &DataCfg, g: &Geometry) -> Result<(), TestCaseError> {
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

fn data_cfg(source: Source, path: &Path, dataset: &str, order: Order) -> DataCfg {
    DataCfg { source, path: path.to_string_lossy().into_owned(), dataset: dataset.to_string(), order, ..DataCfg::default() }
}

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
    /// Found by this file (src/data/mod.rs, `Loader::new`: `let per_micro = micro_batch * dp;` was an
    /// unchecked product): proptest's minimal failing input
    /// `micro_batch = 9223372036854775808, dp = 2, global_batch = 1, dp_rank = 0, step = 0,
    /// order = Sequential` panics with "attempt to multiply with overflow" (with overflow
    /// checks, as in the test profile; without them the product wraps to 0 and
    /// `global_batch % per_micro` panicked dividing by zero). Not reachable from a deck. Fixed:
    /// `Loader::new` uses `checked_mul`.
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

// ---------------------------------------------------------------------------------------------
// HDF5.

/// What the HDF5 file holds.
#[derive(Debug, Clone)]
enum H5Content {
    /// `ndtrain`'s own writer (`data prepare`): a 1-D uint16 or uint32 dataset.
    U16(Vec<u16>),
    U32(Vec<u32>),
    /// Datasets the writer never makes, through the `hdf5` crate.
    I64(Vec<i64>),
    U64(Vec<u64>),
    I8(Vec<i8>),
    F32(Vec<f32>),
    TwoD(usize, Vec<u32>),
    Scalar(u32),
    /// A group where the dataset should be.
    Group,
    /// Not an HDF5 file at all.
    Junk(Vec<u8>),
}

fn h5_content() -> impl Strategy<Value = H5Content> {
    let tok = || prop_oneof![9 => 0u32..128, 1 => any::<u32>()];
    prop_oneof![
        4 => prop::collection::vec(prop_oneof![9 => 0u16..128, 1 => any::<u16>()], 0..200).prop_map(H5Content::U16),
        2 => prop::collection::vec(tok(), 0..200).prop_map(H5Content::U32),
        1 => prop::collection::vec(prop_oneof![9 => 0i64..128, 1 => any::<i64>()], 0..100).prop_map(H5Content::I64),
        1 => prop::collection::vec(prop_oneof![9 => 0u64..128, 1 => any::<u64>()], 0..100).prop_map(H5Content::U64),
        1 => prop::collection::vec(any::<i8>(), 0..100).prop_map(H5Content::I8),
        1 => prop::collection::vec(any::<f32>(), 0..50).prop_map(H5Content::F32),
        1 => (1usize..4, prop::collection::vec(tok(), 0..60)).prop_map(|(r, v)| H5Content::TwoD(r, v)),
        1 => tok().prop_map(H5Content::Scalar),
        1 => Just(H5Content::Group),
        1 => prop::collection::vec(any::<u8>(), 0..600).prop_map(H5Content::Junk),
    ]
}

fn write_h5(path: &Path, name: &str, content: &H5Content) -> Result<(), String> {
    let e = |e: hdf5::Error| e.to_string();
    let create = || hdf5::File::create(path).map_err(e);
    match content {
        H5Content::U16(t) => return write_tokens(path, name, TokenSlice::U16(t), 65536).map_err(|e| e.0),
        H5Content::U32(t) => return write_tokens(path, name, TokenSlice::U32(t), 1 << 32).map_err(|e| e.0),
        H5Content::Junk(b) => return std::fs::write(path, b).map_err(|x| x.to_string()),
        _ => {}
    }
    let f = create()?;
    match content {
        H5Content::I64(v) => f.new_dataset::<i64>().shape([v.len()]).create(name).and_then(|d| d.write_raw(&v[..])).map_err(e)?,
        H5Content::U64(v) => f.new_dataset::<u64>().shape([v.len()]).create(name).and_then(|d| d.write_raw(&v[..])).map_err(e)?,
        H5Content::I8(v) => f.new_dataset::<i8>().shape([v.len()]).create(name).and_then(|d| d.write_raw(&v[..])).map_err(e)?,
        H5Content::F32(v) => f.new_dataset::<f32>().shape([v.len()]).create(name).and_then(|d| d.write_raw(&v[..])).map_err(e)?,
        H5Content::TwoD(rows, v) => {
            let cols = v.len() / rows;
            let d = f.new_dataset::<u32>().shape([*rows, cols]).create(name).map_err(e)?;
            if cols > 0 {
                // write_raw takes a 1-D view; the crate writes it over the whole 2-D extent.
                d.write_raw(&v[..rows * cols]).map_err(e)?;
            }
        }
        H5Content::Scalar(t) => f.new_dataset::<u32>().create(name).and_then(|d| d.write_scalar(t)).map_err(e)?,
        H5Content::Group => {
            f.create_group(name).map_err(e)?;
        }
        _ => unreachable!(),
    }
    f.close().map_err(e)
}

fn dataset_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => Just("tokens".to_string()),
        1 => prop::sample::select(vec!["", "/", "//", ".", "/tokens", "tokens/", "a/b", "grp/tokens", "tok ens", "\u{e9}t\u{e9}", "a\0b"])
            .prop_map(String::from),
        1 => ".{0,10}",
    ]
}

proptest! {
    #![proptest_config(cases(64))]

    /// A file written with one dataset name and read with another (often the same).
    #[test]
    fn hdf5_token_files_never_panic(
        content in h5_content(),
        written in dataset_name(),
        read in prop_oneof![2 => Just(None), 1 => dataset_name().prop_map(Some)],
        g in geometry(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.h5");
        // Names HDF5 itself refuses to create (empty, ".", a NUL byte, a missing group) leave
        // no file or an empty one: reading that is fuzzed too.
        let _ = write_h5(&path, &written, &content);
        let dataset = read.unwrap_or(written);
        exercise_source(&data_cfg(Source::Hdf5, &path, &dataset, g.order), &g)?;
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

// ---------------------------------------------------------------------------------------------
// The committed corpus (tests/fuzz_corpus/): seed decks and token files, replayed as they are
// and mutated byte by byte. An input that ever made a test here fail is added to the corpus.

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fuzz_corpus");

/// The files of one corpus folder, sorted by name; at least `min`, so an emptied or moved
/// corpus fails the test instead of passing it.
/// (file name, bytes) of every file of one corpus folder.
type Seeds = Vec<(String, Vec<u8>)>;

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
