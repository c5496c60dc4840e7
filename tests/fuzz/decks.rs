//! Decks: arbitrary text and bytes, line edits of the tiny deck, `--set` overrides, deck files, `resolve`.

use std::sync::OnceLock;

use ndtrain::config::{ConfigError, Deck};
use proptest::prelude::*;
use proptest::sample::Index;

use crate::cases;

const TINY: &str = include_str!("../../inputs/tiny.toml");

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
pub(crate) fn worlds() -> impl Strategy<Value = Vec<usize>> {
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
pub(crate) fn exercise_deck(text: &str, sets: &[String], worlds: &[usize]) -> Result<(), TestCaseError> {
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
/// The error's hint lists divisors of gcd(n_heads, n_kv_heads, ffn_hidden) (src/config/validate.rs,
/// `check_layout`). Trying every number in 1..=gcd until 12 are found would loop ~2.3e18 times
/// for this gcd and hang `ndtrain train`/`plan` at start-up on
/// `--set model.n_heads=2305843009213693951 --set model.n_kv_heads=2305843009213693951
/// --set model.ffn_hidden=2305843009213693951 --set model.d_model=4611686018427387902
/// --set parallel.tp=2`, so the search stops at 65536.
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
