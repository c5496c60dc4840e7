//! llm.c / nanoGPT `.bin` token shards: a header of 256 little-endian int32 (`[0]` magic,
//! `[1]` version, `[2]` token count), then the tokens. GPT-2 shards (magic 20240520, version 1)
//! hold uint16 tokens; llm.c's Llama-3 shards (magic 20240801, version 7) hold uint32 tokens and
//! are read too. Shards are memory-mapped; `path` may name one file or a pattern with `*` in the
//! file-name part, whose matches (sorted by name) form one concatenated stream.
//!
//! Owns reading and writing this format; knows nothing of samples' order or of HDF5.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{sample_range, samples_in, DataError, TokenSource};

/// Header length in int32 values (1024 bytes).
pub const BIN_HEADER_INTS: usize = 256;
/// llm.c GPT-2 shards: uint16 tokens.
pub const BIN_MAGIC_GPT2: i32 = 20240520;
pub const BIN_VERSION_GPT2: i32 = 1;
/// llm.c Llama-3 shards: uint32 tokens.
pub const BIN_MAGIC_LLAMA3: i32 = 20240801;
pub const BIN_VERSION_LLAMA3: i32 = 7;

const HEADER_BYTES: usize = BIN_HEADER_INTS * 4;

struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Bytes per token: 2 (uint16) or 4 (uint32).
    width: usize,
    n_tokens: u64,
    /// Global index (in the concatenated stream) of this shard's first token.
    first: u64,
}

impl Shard {
    fn open(path: &Path) -> Result<Shard, DataError> {
        if path.is_dir() {
            return Err(DataError(format!("{} is a directory, not an llm.c .bin token file", path.display())));
        }
        let file = File::open(path).map_err(|e| DataError(format!("cannot open {}: {e}", path.display())))?;
        // SAFETY: the mapping is only read. A token file is input that nothing rewrites during a
        // run; if another process truncated it anyway, reads would fault (SIGBUS) rather than
        // return wrong tokens. The sizes are checked below before any token is read.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError(format!("cannot map {}: {e}", path.display())))?;
        let len = map.len() as u64;
        if map.len() < HEADER_BYTES {
            return Err(DataError(format!("{}: {len} bytes, shorter than the {HEADER_BYTES}-byte llm.c .bin header", path.display())));
        }
        let header = |i: usize| i32::from_le_bytes([map[4 * i], map[4 * i + 1], map[4 * i + 2], map[4 * i + 3]]);
        let (magic, version, count) = (header(0), header(1), header(2));
        let width = match (magic, version) {
            (BIN_MAGIC_GPT2, BIN_VERSION_GPT2) => 2,
            (BIN_MAGIC_LLAMA3, BIN_VERSION_LLAMA3) => 4,
            (BIN_MAGIC_GPT2, v) | (BIN_MAGIC_LLAMA3, v) => {
                return Err(DataError(format!(
                    "{}: header version is {v} for magic {magic}; expected {BIN_VERSION_GPT2} for magic {BIN_MAGIC_GPT2} (uint16 tokens) or {BIN_VERSION_LLAMA3} for magic {BIN_MAGIC_LLAMA3} (uint32 tokens)",
                    path.display()
                )))
            }
            _ => {
                return Err(DataError(format!(
                    "{}: header magic is {magic}, expected {BIN_MAGIC_GPT2} (llm.c GPT-2 .bin) or {BIN_MAGIC_LLAMA3} (llm.c Llama-3 .bin); not an llm.c token file",
                    path.display()
                )))
            }
        };
        if count < 0 {
            return Err(DataError(format!("{}: header token count is {count}, negative", path.display())));
        }
        let expect = HEADER_BYTES as u64 + count as u64 * width as u64;
        if len != expect {
            return Err(DataError(format!(
                "{}: header says {count} tokens of {width} bytes, i.e. {expect} bytes with the {HEADER_BYTES}-byte header, but the file is {len} bytes",
                path.display()
            )));
        }
        Ok(Shard { path: path.to_path_buf(), map, width, n_tokens: count as u64, first: 0 })
    }

    /// Token `i` of this shard (`i < n_tokens`).
    fn token(&self, i: u64) -> u32 {
        let o = HEADER_BYTES + i as usize * self.width;
        let b = &self.map[o..o + self.width];
        if self.width == 2 {
            u16::from_le_bytes([b[0], b[1]]) as u32
        } else {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }
    }
}

/// One `.bin` file or a `*` pattern of shards, as one stream of tokens.
pub struct BinSource {
    pattern: String,
    shards: Vec<Shard>,
    n_tokens: u64,
    vocab: usize,
}

impl BinSource {
    pub fn open(pattern: &str, vocab: usize) -> Result<BinSource, DataError> {
        let paths = expand(pattern)?;
        let mut shards = Vec::with_capacity(paths.len());
        let mut n_tokens = 0u64;
        for p in &paths {
            let mut s = Shard::open(p)?;
            s.first = n_tokens;
            n_tokens += s.n_tokens;
            shards.push(s);
        }
        if n_tokens < 2 {
            return Err(DataError(format!(
                "[data] path '{pattern}': {} shard(s) hold {n_tokens} tokens; a sample needs at least 2",
                shards.len()
            )));
        }
        Ok(BinSource { pattern: pattern.to_string(), shards, n_tokens, vocab })
    }
}

impl TokenSource for BinSource {
    fn num_samples(&self, seq_len: usize) -> u64 {
        samples_in(self.n_tokens, seq_len)
    }

    fn sample(&self, k: u64, seq_len: usize, out: &mut Vec<u32>) -> Result<(), DataError> {
        let (start, end) = sample_range(&format!("[data] path '{}'", self.pattern), self.n_tokens, k, seq_len)?;
        out.clear();
        // The last shard whose first token is <= start; empty shards are skipped by the walk.
        let mut si = self.shards.partition_point(|s| s.first <= start) - 1;
        let mut g = start;
        while g < end {
            let sh = &self.shards[si];
            let stop = end.min(sh.first + sh.n_tokens);
            for i in g - sh.first..stop - sh.first {
                let t = sh.token(i);
                if t as usize >= self.vocab {
                    return Err(DataError(format!(
                        "{}: token at position {i} is {t}, not below [model] vocab_size {}",
                        sh.path.display(),
                        self.vocab
                    )));
                }
                out.push(t);
            }
            g = stop;
            si += 1;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        let bits = if self.shards.iter().all(|s| s.width == 2) { "uint16" } else { "uint32" };
        format!("llm.c .bin '{}': {} shard(s), {} {bits} tokens", self.pattern, self.shards.len(), self.n_tokens)
    }

    fn entropy_floor(&self, _seq_len: usize) -> Option<f64> {
        None
    }
}

/// The files `pattern` names: itself, or with `*` in the file-name part, the matches sorted.
fn expand(pattern: &str) -> Result<Vec<PathBuf>, DataError> {
    let path = Path::new(pattern);
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if !name.contains('*') {
        if pattern.contains('*') {
            return Err(DataError(format!("[data] path '{pattern}': '*' is only supported in the file-name part")));
        }
        return Ok(vec![path.to_path_buf()]);
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if dir.to_str().is_some_and(|d| d.contains('*')) {
        return Err(DataError(format!("[data] path '{pattern}': '*' is only supported in the file-name part")));
    }
    let entries = std::fs::read_dir(&dir).map_err(|e| DataError(format!("[data] path '{pattern}': cannot list {}: {e}", dir.display())))?;
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(|n| wildcard(name, n)))
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    if out.is_empty() {
        return Err(DataError(format!("[data] path '{pattern}' matches no file in {}", dir.display())));
    }
    Ok(out)
}

/// Whether `name` matches `pat`, where `*` matches any run of characters (greedy with backtrack).
fn wildcard(pat: &str, name: &str) -> bool {
    let parts: Vec<&str> = pat.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// Writes `tokens` as an llm.c GPT-2 `.bin` (magic 20240520, version 1, uint16 tokens).
pub fn write_bin(path: &Path, tokens: &[u16]) -> Result<(), DataError> {
    let count = i32::try_from(tokens.len()).map_err(|_| {
        DataError(format!(
            "{}: {} tokens do not fit the int32 count of an llm.c .bin header (max {})\nHINT: split the text into several shards, or write HDF5 (.h5)",
            path.display(),
            tokens.len(),
            i32::MAX
        ))
    })?;
    let mut header = [0i32; BIN_HEADER_INTS];
    header[0] = BIN_MAGIC_GPT2;
    header[1] = BIN_VERSION_GPT2;
    header[2] = count;
    let mut bytes = Vec::with_capacity(HEADER_BYTES + 2 * tokens.len());
    header.iter().for_each(|h| bytes.extend_from_slice(&h.to_le_bytes()));
    tokens.iter().for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
    let mut f = File::create(path).map_err(|e| DataError(format!("cannot create {}: {e}", path.display())))?;
    f.write_all(&bytes).and_then(|_| f.sync_all()).map_err(|e| DataError(format!("writing {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_bin_wildcard() {
        assert!(wildcard("train_*.bin", "train_000.bin"));
        assert!(wildcard("*", "x"));
        assert!(wildcard("a*b*c", "aXbYc"));
        assert!(!wildcard("a*b*c", "aXcYb"));
        assert!(!wildcard("ab*ba", "aba"));
        assert!(!wildcard("train_*.bin", "val_000.bin"));
    }

    #[test]
    fn data_bin_shards_concatenate() {
        let dir = tempfile::tempdir().unwrap();
        let a: Vec<u16> = (0..10).collect();
        let b: Vec<u16> = vec![];
        let c: Vec<u16> = (10..25).collect();
        write_bin(&dir.path().join("s_00.bin"), &a).unwrap();
        write_bin(&dir.path().join("s_01.bin"), &b).unwrap();
        write_bin(&dir.path().join("s_02.bin"), &c).unwrap();
        std::fs::write(dir.path().join("other.bin"), b"junk").unwrap();
        let pat = dir.path().join("s_*.bin");
        let src = BinSource::open(pat.to_str().unwrap(), 100).unwrap();
        assert_eq!(src.num_samples(4), 6);
        let mut out = Vec::new();
        for k in 0..6 {
            src.sample(k, 4, &mut out).unwrap();
            let want: Vec<u32> = (4 * k as u32..4 * k as u32 + 5).collect();
            assert_eq!(out, want);
        }
        assert!(src.sample(6, 4, &mut out).is_err());
    }
}
