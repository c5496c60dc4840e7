//! Reading a run directory as `ndtrain train` leaves it: `deck.toml` (the resolved shape of the
//! run, from the `# Resolved by ...` comment that opens it, and `train.seq_len`), `metrics.csv`,
//! one `timing/rank_<5 digits>.csv` per rank and `checkpoint_io.csv`, each checked as it is read (a malformed row
//! names its file, line and column). Also the run names the tables and file names use.
//!
//! Owns the file formats only: columns are found by name in each header, so logs with more
//! columns still read. It computes no statistics (`stats.rs`) and writes nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A CSV log: the header and the rows' fields, parsed as numbers only in the columns asked
/// for (a column this report does not read may hold anything).
pub(super) struct CsvTable {
    pub(super) path: PathBuf,
    pub(super) header: Vec<String>,
    /// `(line number, fields)`, the line numbers 1-based as editors show them.
    rows: Vec<(usize, Vec<String>)>,
}

impl CsvTable {
    pub(super) fn read(path: &Path) -> Result<CsvTable, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut lines = text.lines().enumerate();
        let header: Vec<String> = match lines.next() {
            Some((_, h)) if !h.trim().is_empty() => h.split(',').map(|c| c.trim().to_string()).collect(),
            _ => return Err(format!("{}: empty file (no header line)", path.display())),
        };
        let mut rows = Vec::new();
        for (index, line) in lines.filter(|(_, l)| !l.trim().is_empty()) {
            let fields: Vec<String> = line.split(',').map(|f| f.trim().to_string()).collect();
            if fields.len() != header.len() {
                return Err(format!("{}:{}: {} fields, but the header has {}", path.display(), index + 1, fields.len(), header.len()));
            }
            rows.push((index + 1, fields));
        }
        Ok(CsvTable { path: path.to_path_buf(), header, rows })
    }

    /// `(line number, fields)` of every row.
    pub(super) fn rows(&self) -> impl Iterator<Item = (usize, &[String])> {
        self.rows.iter().map(|(line, f)| (*line, f.as_slice()))
    }

    pub(super) fn index_of(&self, name: &str) -> Option<usize> {
        self.header.iter().position(|h| h == name)
    }

    /// Column `name` as numbers, one per row; a field that is not a number is an error naming
    /// the file, the line and the column.
    pub(super) fn column(&self, name: &str) -> Result<Vec<f64>, String> {
        let i = self.index_of(name).ok_or_else(|| format!("{}: no column '{name}' in the header", self.path.display()))?;
        self.rows.iter().map(|(line, fields)| parse_field(&self.path, *line, name, &fields[i])).collect()
    }

    /// Column `name` where it has values: `None` for an empty field (a step without one),
    /// and for every row when the header has no such column (a log of an older run).
    pub(super) fn sparse_column(&self, name: &str) -> Result<Vec<Option<f64>>, String> {
        let Some(i) = self.index_of(name) else { return Ok(vec![None; self.rows.len()]) };
        self.rows
            .iter()
            .map(|(line, fields)| match fields[i].as_str() {
                "" => Ok(None),
                f => parse_field(&self.path, *line, name, f).map(Some),
            })
            .collect()
    }

    /// The `step` column as integers, one per row.
    pub(super) fn steps(&self) -> Result<Vec<u64>, String> {
        Ok(self.column("step")?.into_iter().map(|s| s as u64).collect())
    }
}

fn parse_field(path: &Path, line: usize, column: &str, field: &str) -> Result<f64, String> {
    field.parse::<f64>().map_err(|_| format!("{}:{line}: column '{column}': '{field}' is not a number", path.display()))
}

/// The mesh layout a finished run used, `pp × dp_replicate × dp_shard × cp × tp` ranks, as its
/// `deck.toml` records it (the trainer's own is `config::Layout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RunLayout {
    pub(super) pp: usize,
    pub(super) dp_replicate: usize,
    pub(super) dp_shard: usize,
    pub(super) cp: usize,
    pub(super) tp: usize,
}

impl RunLayout {
    /// `dp_shard=2 tp=2`: the dimensions of degree above one (`serial` for one rank).
    pub(super) fn short(&self) -> String {
        let dims = [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)];
        let parts: Vec<String> = dims.iter().filter(|(_, d)| *d > 1).map(|(n, d)| format!("{n}={d}")).collect();
        if parts.is_empty() {
            "serial".into()
        } else {
            parts.join(" ")
        }
    }
}

/// What the report needs from `deck.toml`: the resolved shape of the run.
#[derive(Clone, Debug)]
pub(super) struct DeckFacts {
    pub(super) ranks: usize,
    pub(super) layout: RunLayout,
    pub(super) global_batch: usize,
    pub(super) seq_len: usize,
    /// `[model] n_experts` (0 for a dense model).
    pub(super) n_experts: usize,
}

impl DeckFacts {
    /// Reads the first-line comment (`# Resolved by ndtrain ... for 4 ranks: layout
    /// pp=1 dp_replicate=1 dp_shard=2 cp=1 tp=2, grad_accum=4, global_batch=16, ...`), which holds
    /// the resolved values (the TOML body keeps `dp_shard = -1` and friends as written), and
    /// `train.seq_len` from the TOML body.
    fn read(path: &Path) -> Result<DeckFacts, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let first = text.lines().next().unwrap_or("");
        let bad_comment = || {
            format!(
                "{}:1: expected the comment that ndtrain train writes, \
                 '# Resolved by ndtrain ... for N ranks: layout pp=.. dp_replicate=.. dp_shard=.. cp=.. tp=.., ... global_batch=..'",
                path.display()
            )
        };
        if !first.starts_with("# Resolved by") {
            return Err(bad_comment());
        }
        let words: Vec<&str> = first.split(|c: char| c.is_whitespace() || c == ',' || c == ':').filter(|w| !w.is_empty()).collect();
        let pairs: BTreeMap<&str, usize> =
            words.iter().filter_map(|w| w.split_once('=')).filter_map(|(k, v)| v.parse().ok().map(|v| (k, v))).collect();
        let get = |key: &str| pairs.get(key).copied().ok_or_else(bad_comment);
        // Runs from before the pipeline existed have no pp.
        let pp = pairs.get("pp").copied().unwrap_or(1);
        let layout = RunLayout { pp, dp_replicate: get("dp_replicate")?, dp_shard: get("dp_shard")?, cp: get("cp")?, tp: get("tp")? };
        let ranks = words
            .windows(3)
            .find(|w| w[0] == "for" && w[2].starts_with("rank"))
            .and_then(|w| w[1].parse().ok())
            .unwrap_or(layout.pp * layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp);
        let toml: toml::Value = text.parse().map_err(|e| format!("{}: not valid TOML: {e}", path.display()))?;
        let seq_len = toml
            .get("train")
            .and_then(|t| t.get("seq_len"))
            .and_then(|v| v.as_integer())
            .filter(|&v| v > 0)
            .ok_or_else(|| format!("{}: no positive [train] seq_len", path.display()))? as usize;
        let n_experts = toml.get("model").and_then(|m| m.get("n_experts")).and_then(|v| v.as_integer()).unwrap_or(0).max(0) as usize;
        Ok(DeckFacts { ranks, layout, global_batch: get("global_batch")?, seq_len, n_experts })
    }
}

/// The logs of one run directory, read and checked.
pub(super) struct RunLog {
    pub(super) dir: PathBuf,
    pub(super) deck: DeckFacts,
    pub(super) metrics: CsvTable,
    /// One timing log per rank, in rank order.
    pub(super) timing: Vec<CsvTable>,
    /// A mixture of experts' `expert_load.csv`, where the run wrote one.
    pub(super) expert_load: Option<CsvTable>,
    /// `checkpoint_io.csv`, where the run wrote one.
    pub(super) checkpoint_io: Option<CsvTable>,
}

impl RunLog {
    pub(super) fn read(dir: &Path) -> Result<RunLog, String> {
        if !dir.is_dir() {
            return Err(format!("{}: not a directory (expected a run directory of ndtrain train)", dir.display()));
        }
        let metrics_path = dir.join("metrics.csv");
        let timing_dir = dir.join("timing");
        let deck_path = dir.join("deck.toml");
        for (path, what) in [(&metrics_path, "metrics.csv"), (&timing_dir, "timing/"), (&deck_path, "deck.toml")] {
            if !path.exists() {
                return Err(format!("{}: no {what} in this directory: is it a run directory of ndtrain train?", dir.display()));
            }
        }
        let deck = DeckFacts::read(&deck_path)?;
        let metrics = CsvTable::read(&metrics_path)?;
        if metrics.rows.is_empty() {
            return Err(format!("{}: no steps logged", metrics_path.display()));
        }
        let timing = read_timing_logs(&timing_dir, deck.ranks)?;
        let load_path = dir.join("expert_load.csv");
        let expert_load = load_path.exists().then(|| CsvTable::read(&load_path)).transpose()?;
        let io_path = dir.join("checkpoint_io.csv");
        let checkpoint_io = io_path.exists().then(|| CsvTable::read(&io_path)).transpose()?;
        Ok(RunLog { dir: dir.to_path_buf(), deck, metrics, timing, expert_load, checkpoint_io })
    }
}

/// Reads `timing/rank_*.csv`; there must be exactly one per rank, 0 to `ranks - 1`.
fn read_timing_logs(dir: &Path, ranks: usize) -> Result<Vec<CsvTable>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut found: Vec<(usize, PathBuf)> = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(rank) = name.strip_prefix("rank_").and_then(|r| r.strip_suffix(".csv")).and_then(|r| r.parse().ok()) {
            found.push((rank, entry.path()));
        }
    }
    found.sort();
    let have: Vec<usize> = found.iter().map(|(r, _)| *r).collect();
    if have != (0..ranks).collect::<Vec<_>>() {
        return Err(format!("{}: expected the logs rank_00000.csv .. of {ranks} ranks (deck.toml), found ranks {have:?}", dir.display()));
    }
    let tables = found.iter().map(|(_, p)| CsvTable::read(p)).collect::<Result<Vec<_>, _>>()?;
    for t in &tables {
        if t.rows.is_empty() {
            return Err(format!("{}: no steps logged", t.path.display()));
        }
    }
    Ok(tables)
}

/// Run names for tables, legends and file names: the directory's name, made safe for a file
/// name and unique (a suffix `_2`, `_3`, ... when two directories share a name).
pub(super) fn unique_names(logs: &[RunLog]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for log in logs {
        let dir = std::fs::canonicalize(&log.dir).unwrap_or_else(|_| log.dir.clone());
        let raw = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into());
        let base: String = raw.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
        let mut name = base.clone();
        let mut k = 2;
        while names.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        names.push(name);
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_rows_name_file_and_line() {
        let dir = std::env::temp_dir().join(format!("ndtrain_report_unit_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.csv");
        std::fs::write(&path, "step,loss,note\n1,4.5,warm\n2,abc,x\n").unwrap();
        let table = CsvTable::read(&path).unwrap();
        assert_eq!(table.column("step").unwrap(), [1.0, 2.0]);
        let e = table.column("loss").unwrap_err();
        assert!(e.contains("m.csv:3") && e.contains("'loss'") && e.contains("abc"), "{e}");
        std::fs::write(&path, "step,loss\n1,4.5\n2\n").unwrap();
        let e = CsvTable::read(&path).err().unwrap();
        assert!(e.contains("m.csv:3") && e.contains("1 fields"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
