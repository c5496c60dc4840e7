//! Stage one of the deck: text → `toml::Table` → one serde type per table.
//!
//! Owns everything that can go wrong before values are compared with each other: TOML syntax
//! (reported on one line with its line number), `--set table.key=value` overrides, the
//! `[parallel]` aliases that Accelerate and Axolotl users know, unknown tables and keys (named,
//! with the closest valid name), and wrong types (one line naming `[table] key`, what was given
//! and what is expected). Unknown names are checked here, before serde, so the message is ours;
//! each table is then deserialised on its own so an error always knows its table. Knows nothing
//! of the constraints between values: those live in `validate`.

use super::{CheckpointCfg, ConfigError, DataCfg, Deck, HardwareCfg, LogCfg, ModelCfg, OptimCfg, ParallelCfg};
use super::{EvalCfg, RunCfg, TrainCfg};
use serde::de::{self, DeserializeOwned, Visitor};
use std::collections::BTreeMap;
use toml::{Table, Value};

/// Alternative spellings accepted for a key: `(table, alias, canonical key)`.
pub(crate) const ALIASES: &[(&str, &str, &str)] = &[
    ("parallel", "pp_size", "pp"),
    ("parallel", "pipeline_parallel_size", "pp"),
    ("parallel", "dp_replicate_size", "dp_replicate"),
    ("parallel", "dp_shard_size", "dp_shard"),
    ("parallel", "tp_size", "tp"),
    ("parallel", "tensor_parallel_size", "tp"),
    ("parallel", "cp_size", "cp"),
    ("parallel", "context_parallel_size", "cp"),
    ("parallel", "ep_size", "ep"),
    ("parallel", "expert_parallel_size", "ep"),
    ("model", "num_local_experts", "n_experts"),
    ("model", "num_experts", "n_experts"),
    ("model", "num_experts_per_tok", "experts_per_token"),
    ("model", "moe_intermediate_size", "moe_ffn_hidden"),
];

/// The tables of a deck, in the order of `Deck`'s fields.
pub(crate) fn tables() -> &'static [&'static str] {
    fields_of::<Deck>()
}

/// The canonical keys of one table, in the order of its struct's fields; `None` for an unknown table.
pub(crate) fn keys_of(table: &str) -> Option<&'static [&'static str]> {
    Some(match table {
        "run" => fields_of::<RunCfg>(),
        "model" => fields_of::<ModelCfg>(),
        "parallel" => fields_of::<ParallelCfg>(),
        "train" => fields_of::<TrainCfg>(),
        "optim" => fields_of::<OptimCfg>(),
        "data" => fields_of::<DataCfg>(),
        "eval" => fields_of::<EvalCfg>(),
        "checkpoint" => fields_of::<CheckpointCfg>(),
        "log" => fields_of::<LogCfg>(),
        "hardware" => fields_of::<HardwareCfg>(),
        _ => return None,
    })
}

/// Where each value set by `--set` came from: `(table, canonical key)` → the override text.
type Origins = BTreeMap<(String, String), String>;

/// Parses deck text, applies the overrides and deserialises every table.
pub(super) fn parse(text: &str, overrides: &[String]) -> Result<Deck, ConfigError> {
    // Names and overrides are quoted as given: escape any control character to keep one line.
    parse_raw(text, overrides).map_err(|e| ConfigError { message: escape_controls(e.message), hint: e.hint.map(escape_controls) })
}

fn escape_controls(s: String) -> String {
    if !s.chars().any(char::is_control) {
        return s;
    }
    s.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

fn parse_raw(text: &str, overrides: &[String]) -> Result<Deck, ConfigError> {
    let mut root = parse_toml(text)?;
    check_top_level(&root)?;
    for (name, value) in root.iter_mut() {
        if let Value::Table(t) = value {
            canonicalise(name, t)?;
        }
    }
    let mut origins = Origins::new();
    for o in overrides {
        apply_override(&mut root, o, &mut origins)?;
    }
    check_names(&root, &origins)?;
    build(root, &origins)
}

/// TOML text → table; a syntax error becomes one line with its line and column.
fn parse_toml(text: &str) -> Result<Table, ConfigError> {
    text.parse::<Table>().map_err(|e| {
        let what = one_line(e.message());
        match e.span() {
            Some(span) => {
                let (line, col) = line_col(text, span.start);
                ConfigError::new(format!("TOML syntax error at line {line}, column {col}: {what}"))
            }
            None => ConfigError::new(format!("TOML syntax error: {what}")),
        }
    })
}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    (line, col)
}

/// Joins a multi-line message into one line.
fn one_line(s: &str) -> String {
    s.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("; ")
}

/// Every top-level item must be a table; a bare key there most likely lost its `[table]` header.
fn check_top_level(root: &Table) -> Result<(), ConfigError> {
    for (name, value) in root {
        if value.is_table() {
            continue; // unknown table names are checked with the overrides, in `check_names`
        }
        if keys_of(name).is_some() {
            return Err(ConfigError::new(format!("[{name}] must be a table, but the deck gives {name} = {}", describe(value))));
        }
        let msg = format!("unknown key {name} at the top of the deck (outside any [table])");
        let owners = tables_with_key(name);
        return Err(match owners.first() {
            Some(t) => ConfigError::new(format!("{msg}; did you mean [{t}] {name}?"))
                .with_hint(format!("put `{name} = ...` under a `[{t}]` header")),
            None => ConfigError::new(format!("{msg}; every key belongs to one of the tables {}", table_list())),
        });
    }
    Ok(())
}

/// The canonical key for a name in a table (the name itself when it is no alias).
fn canonical<'a>(table: &str, key: &'a str) -> &'a str {
    ALIASES.iter().find(|(t, a, _)| *t == table && *a == key).map_or(key, |(_, _, c)| c)
}

/// Renames aliases to their canonical keys; two spellings of one key is an error naming both.
fn canonicalise(table: &str, t: &mut Table) -> Result<(), ConfigError> {
    for (tab, alias, canon) in ALIASES {
        if *tab != table || !t.contains_key(*alias) {
            continue;
        }
        let other = std::iter::once(*canon)
            .chain(ALIASES.iter().filter(|(t2, a2, c2)| t2 == tab && c2 == canon && a2 != alias).map(|x| x.1))
            .find(|k| t.contains_key(*k));
        if let Some(other) = other {
            return Err(ConfigError::new(format!(
                "[{table}] {alias} and {other} are both given, but both set {canon} ({alias} is an alias of {canon})"
            ))
            .with_hint(format!("keep only one of them, preferably `{canon}`")));
        }
        if let Some(v) = t.remove(*alias) {
            t.insert(canon.to_string(), v);
        }
    }
    Ok(())
}

/// Applies one `--set table.key=value`: the value is read as TOML, else taken as a string.
fn apply_override(root: &mut Table, o: &str, origins: &mut Origins) -> Result<(), ConfigError> {
    let malformed = |why: String| {
        ConfigError::new(format!("malformed override --set {o}: {why}"))
            .with_hint("write --set table.key=value, e.g. --set model.d_model=256")
    };
    let (path, raw) = o.split_once('=').ok_or_else(|| malformed("no `=` between key and value".into()))?;
    let (path, raw) = (path.trim(), raw.trim());
    let Some((table, key)) = path.split_once('.') else {
        let err = malformed(format!("`{path}` names no table (expected table.key)"));
        return Err(match tables_with_key(path).first() {
            Some(t) => err.with_hint(format!("did you mean --set {t}.{path}={raw}?")),
            None => err,
        });
    };
    let (table, key) = (table.trim(), key.trim());
    if table.is_empty() || key.is_empty() {
        return Err(malformed(format!("empty table or key name in `{path}`")));
    }
    if key.contains('.') {
        return Err(malformed(format!("`{path}` has more than one `.`; deck tables have one level (table.key)")));
    }
    let key = canonical(table, key);
    let mut value = parse_value(raw);
    // A string key (a name, a path, an enum) keeps the text as given, e.g. `run.name=123`.
    if !value.is_str() && default_is_string(table, key) {
        value = Value::String(raw.to_string());
    }
    let entry = root.entry(table.to_string()).or_insert_with(|| Value::Table(Table::new()));
    let Value::Table(t) = entry else {
        return Err(malformed(format!("[{table}] is not a table in the deck")));
    };
    t.insert(key.to_string(), value);
    origins.insert((table.to_string(), key.to_string()), o.to_string());
    Ok(())
}

/// An override's value: a TOML value if it parses as one, else the text as a string.
fn parse_value(raw: &str) -> Value {
    format!("v = {raw}")
        .parse::<Table>()
        .ok()
        .filter(|t| t.len() == 1)
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| Value::String(raw.to_string()))
}

/// Whether the default deck holds a string (or an enum, written as a string) at `[table] key`.
fn default_is_string(table: &str, key: &str) -> bool {
    Value::try_from(Deck::default()).ok().and_then(|d| d.get(table).and_then(|t| t.get(key)).map(Value::is_str)).unwrap_or(false)
}

/// `--set …` when the value came from an override, else "the deck".
fn origin(origins: &Origins, table: &str, key: &str) -> String {
    match origins.get(&(table.to_string(), key.to_string())) {
        Some(o) => format!("--set {o}"),
        None => "the deck".to_string(),
    }
}

/// Unknown tables and keys, each named with the closest valid one.
fn check_names(root: &Table, origins: &Origins) -> Result<(), ConfigError> {
    for (table, value) in root {
        let Value::Table(t) = value else { continue };
        let Some(keys) = keys_of(table) else {
            let from = match origins.iter().find(|((tab, _), _)| tab == table) {
                Some((_, o)) => format!(" (from --set {o})"),
                None => String::new(),
            };
            let msg = format!("unknown table [{table}]{from}");
            return Err(match closest(table, tables().iter().copied()) {
                Some(c) => ConfigError::new(format!("{msg}; did you mean [{c}]?")),
                None => ConfigError::new(format!("{msg}; the tables are {}", table_list())),
            });
        };
        for key in t.keys() {
            if keys.contains(&key.as_str()) {
                continue;
            }
            let from = match origins.get(&(table.clone(), key.clone())) {
                Some(o) => format!(" (from --set {o})"),
                None => String::new(),
            };
            let msg = format!("unknown key [{table}] {key}{from}");
            let aliases = ALIASES.iter().filter(|(t, ..)| t == table).map(|x| x.1);
            let elsewhere: Vec<_> = tables_with_key(key).into_iter().filter(|t| t != table).collect();
            return Err(if let Some(t) = elsewhere.first() {
                ConfigError::new(format!("{msg}; did you mean [{t}] {key}?")).with_hint(format!("{key} belongs to [{t}], not [{table}]"))
            } else if let Some(c) = closest(key, keys.iter().copied().chain(aliases)) {
                ConfigError::new(format!("{msg}; did you mean {c}?"))
            } else {
                ConfigError::new(format!("{msg}; the keys of [{table}] are {}", keys.join(", ")))
            });
        }
    }
    Ok(())
}

/// The tables that have `key` (canonical or alias).
fn tables_with_key(key: &str) -> Vec<&'static str> {
    tables().iter().copied().filter(|t| keys_of(t).is_some_and(|ks| ks.contains(&canonical(t, key)))).collect()
}

fn table_list() -> String {
    tables().iter().map(|t| format!("[{t}]")).collect::<Vec<_>>().join(", ")
}

/// The candidate closest to `name` by edit distance, if any is close enough to be a likely typo.
pub(crate) fn closest<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (name.chars().count() / 3).clamp(1, 3);
    candidates
        .filter_map(|c| {
            let d = edit_distance(&name.to_lowercase(), &c.to_lowercase());
            // A name that contains the other (`hidden` / `ffn_hidden`) is close too.
            let contained = name.len().min(c.len()) >= 3 && (c.contains(name) || name.contains(c));
            (d <= limit || contained).then_some((d, c))
        })
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// Edit distance in characters (insertions, deletions, substitutions and swaps of neighbours,
/// so that `modle` is one edit from `model`).
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // d[i][j]: distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let subst = d[i - 1][j - 1] + usize::from(a[i - 1] != b[j - 1]);
            let mut best = subst.min(d[i - 1][j] + 1).min(d[i][j - 1] + 1);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// Deserialises every table on its own, so that a type error knows its table.
fn build(mut root: Table, origins: &Origins) -> Result<Deck, ConfigError> {
    Ok(Deck {
        run: section(&mut root, "run", origins)?,
        model: section(&mut root, "model", origins)?,
        parallel: section(&mut root, "parallel", origins)?,
        train: section(&mut root, "train", origins)?,
        optim: section(&mut root, "optim", origins)?,
        data: section(&mut root, "data", origins)?,
        eval: section(&mut root, "eval", origins)?,
        checkpoint: section(&mut root, "checkpoint", origins)?,
        log: section(&mut root, "log", origins)?,
        hardware: section(&mut root, "hardware", origins)?,
    })
}

fn section<T: DeserializeOwned + Default>(root: &mut Table, table: &str, origins: &Origins) -> Result<T, ConfigError> {
    let t = match root.remove(table) {
        None => return Ok(T::default()),
        Some(Value::Table(t)) => t,
        Some(v) => return Err(ConfigError::new(format!("[{table}] must be a table, but it is {}", describe(&v)))),
    };
    Value::Table(t.clone()).try_into::<T>().map_err(|e| type_error::<T>(table, &t, &e, origins))
}

/// One line for a table that failed to deserialise: finds the key at fault by trying each alone.
fn type_error<T: DeserializeOwned>(table: &str, t: &Table, e: &toml::de::Error, origins: &Origins) -> ConfigError {
    let alone = |key: &str, v: Value| Value::Table(Table::from_iter([(key.to_string(), v)])).try_into::<T>();
    for (key, value) in t {
        let Err(e) = alone(key, value.clone()) else {
            continue;
        };
        let msg = e.message();
        // An enum says which variants it has when given a string it does not know.
        let variants = if msg.starts_with("unknown variant") {
            Some(msg.to_string())
        } else {
            alone(key, Value::String("\u{1}".into())).err().map(|p| p.message().to_string()).filter(|p| p.starts_with("unknown variant"))
        };
        let expected = match variants {
            Some(v) => {
                let list = v.split_once("expected ").map_or("", |x| x.1);
                format!("one of {}", list.trim_start_matches("one of ").replace('`', "\""))
            }
            None => friendly_expected(msg),
        };
        return ConfigError::new(format!(
            "[{table}] {key} must be {expected}, but {} gives {} ({})",
            origin(origins, table, key),
            describe(value),
            kind(value)
        ));
    }
    ConfigError::new(format!("[{table}]: {}", one_line(e.message())))
}

/// serde's "expected …" in words for people.
fn friendly_expected(msg: &str) -> String {
    let expected = msg.rsplit_once("expected ").map_or(msg, |x| x.1).trim();
    match expected {
        "usize" | "u64" | "u32" | "u16" | "u8" => "a whole number ≥ 0".into(),
        "i64" | "i32" | "i16" | "i8" | "isize" => "a whole number".into(),
        "f64" | "f32" => "a number".into(),
        "a boolean" => "true or false".into(),
        other => one_line(other),
    }
}

/// A TOML value as the user wrote it, on one line.
fn describe(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Float(f) if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 => format!("{f:.1}"),
        other => {
            let s = other.to_string();
            if s.len() <= 40 && !s.contains('\n') {
                s
            } else {
                kind(other).to_string()
            }
        }
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Boolean(_) => "a boolean",
        Value::Datetime(_) => "a date-time",
        Value::Array(_) => "an array",
        Value::Table(_) => "a table",
    }
}

/// The field names of a `#[derive(Deserialize)]` struct, read from what it asks a deserializer for.
fn fields_of<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Fields(&'static [&'static str]);
    impl<'de> de::Deserializer<'de> for &mut Fields {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            self.0 = fields;
            Err(de::Error::custom("fields read"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
        }
    }
    let mut f = Fields(&[]);
    let _ = T::deserialize(&mut f);
    f.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str, overrides: &[&str]) -> String {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        parse(text, &o).expect_err("the deck should be rejected").to_string()
    }

    #[test]
    fn every_table_and_key_is_known() {
        assert_eq!(tables(), ["run", "model", "parallel", "train", "optim", "data", "eval", "checkpoint", "log", "hardware"]);
        let defaults = Value::try_from(Deck::default()).unwrap();
        for t in tables() {
            let keys = keys_of(t).unwrap();
            let mut serialised: Vec<&str> = defaults[*t].as_table().unwrap().keys().map(String::as_str).collect();
            let mut sorted = keys.to_vec();
            sorted.sort();
            serialised.sort();
            assert_eq!(sorted, serialised, "[{t}]");
        }
        assert!(ALIASES.iter().all(|(t, _, c)| keys_of(t).unwrap().contains(c)));
    }

    #[test]
    fn docs_describe_every_key() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/input_deck.md")).unwrap();
        for t in tables() {
            assert!(doc.contains(&format!("## `[{t}]`")), "docs/input_deck.md lacks a section for [{t}]");
            for k in keys_of(t).unwrap() {
                assert!(doc.contains(&format!("| `{k}` |")), "docs/input_deck.md lacks a row for [{t}] {k}");
            }
        }
        for (_, a, _) in ALIASES {
            assert!(doc.contains(&format!("`{a}`")), "docs/input_deck.md does not list the alias {a}");
        }
    }

    #[test]
    fn edit_distance_and_closest() {
        assert_eq!(edit_distance("n_head", "n_heads"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("modle", "model"), 1);
        let keys = keys_of("model").unwrap();
        assert_eq!(closest("n_head", keys.iter().copied()), Some("n_heads"));
        assert_eq!(closest("dmodel", keys.iter().copied()), Some("d_model"));
        assert_eq!(closest("hidden", keys.iter().copied()), Some("ffn_hidden"));
        assert_eq!(closest("zzz", keys.iter().copied()), None);
        assert_eq!(closest("N_HEADS", keys.iter().copied()), Some("n_heads"));
    }

    #[test]
    fn empty_deck_is_the_default() {
        assert_eq!(parse("", &[]).unwrap(), Deck::default());
    }

    #[test]
    fn syntax_error_is_one_line_with_its_line() {
        let e = err("[run]\nname = \"a\"\n[model\nd_model = 3\n", &[]);
        assert!(e.starts_with("TOML syntax error at line 3, column"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let e = err("[run]\nsteps = 1\nsteps = 2\n", &[]);
        assert!(e.contains("line 3") && e.contains("duplicate key"), "{e}");
    }

    #[test]
    fn unknown_names() {
        assert_eq!(err("[model]\nn_head = 4\n", &[]), "unknown key [model] n_head; did you mean n_heads?");
        assert_eq!(err("[modle]\nd_model = 4\n", &[]), "unknown table [modle]; did you mean [model]?");
        let e = err("[train]\nlr = 0.1\n", &[]);
        assert!(e.starts_with("unknown key [train] lr; did you mean [optim] lr?"), "{e}");
        let e = err("[model]\nqqqq = 1\n", &[]);
        assert!(e.contains("the keys of [model] are vocab_size, d_model,"), "{e}");
        let e = err("steps = 10\n", &[]);
        assert!(e.contains("did you mean [run] steps?"), "{e}");
        let e = err("[parallel]\ntp_sise = 2\n", &[]);
        assert!(e.contains("did you mean tp_size?"), "{e}");
        let e = err("", &["model.n_head=4"]);
        assert!(e.contains("unknown key [model] n_head (from --set model.n_head=4); did you mean n_heads?"), "{e}");
    }

    #[test]
    fn control_characters_are_escaped() {
        let e = err("[model]\n\"n_\\nhead\" = 4\n", &[]);
        assert_eq!(e, "unknown key [model] n_\\nhead; did you mean n_heads?");
    }

    #[test]
    fn wrong_types_are_one_line() {
        let e = err("[model]\nd_model = \"big\"\n", &[]);
        assert_eq!(e, "[model] d_model must be a whole number ≥ 0, but the deck gives \"big\" (a string)");
        let e = err("[run]\nsteps = -3\n", &[]);
        assert_eq!(e, "[run] steps must be a whole number ≥ 0, but the deck gives -3 (an integer)");
        let e = err("[optim]\nschedule = \"exp\"\n", &[]);
        assert_eq!(e, "[optim] schedule must be one of \"cosine\", \"linear\", \"constant\", but the deck gives \"exp\" (a string)");
        let e = err("[optim]\nschedule = 3\n", &[]);
        assert!(e.starts_with("[optim] schedule must be one of \"cosine\""), "{e}");
        let e = err("[run]\nsteps = 1e3\n", &[]);
        assert!(e.ends_with("gives 1000.0 (a float)"), "{e}");
        let e = err("[model]\ntie_embeddings = 1\n", &[]);
        assert!(e.contains("must be true or false"), "{e}");
        let e = err("", &["optim.lr=fast"]);
        assert_eq!(e, "[optim] lr must be a number, but --set optim.lr=fast gives \"fast\" (a string)");
    }

    #[test]
    fn aliases_and_overrides() {
        let d = parse("[parallel]\ntp_size = 2\ncontext_parallel_size = 2\ndp_shard_size = 3\ndp_replicate_size = 4\n", &[]).unwrap();
        assert_eq!((d.parallel.tp, d.parallel.cp, d.parallel.dp_shard, d.parallel.dp_replicate), (2, 2, 3, 4));
        let e = err("[parallel]\ntp = 2\ntp_size = 2\n", &[]);
        assert!(e.contains("tp_size and tp are both given"), "{e}");
        let e = err("[parallel]\ntp_size = 2\ntensor_parallel_size = 2\n", &[]);
        assert!(e.contains("tp_size") && e.contains("tensor_parallel_size"), "{e}");
        // An override replaces the key whatever its spelling in the deck.
        let d = parse("[parallel]\ntp_size = 2\n", &["parallel.tensor_parallel_size=4".into()]).unwrap();
        assert_eq!(d.parallel.tp, 4);
        let d = parse("", &["run.name=123".into(), "data.path=/a/b.bin".into(), "optim.lr=1".into()]).unwrap();
        assert_eq!((d.run.name.as_str(), d.data.path.as_str(), d.optim.lr), ("123", "/a/b.bin", 1.0));
    }

    #[test]
    fn malformed_overrides() {
        assert!(err("", &["model.d_model"]).starts_with("malformed override --set model.d_model: no `=`"));
        let e = parse("", &["d_model=3".into()]).unwrap_err();
        assert!(e.message.contains("names no table"), "{e}");
        assert_eq!(e.hint.as_deref(), Some("did you mean --set model.d_model=3?"));
        assert!(err("", &["a.b.c=1"]).contains("more than one `.`"));
        assert!(err("", &[".x=1"]).contains("empty table or key name"));
        assert!(err("", &["modle.d_model=3"]).contains("unknown table [modle] (from --set modle.d_model=3); did you mean [model]?"));
    }
}
