//! `ndtrain data prepare`: tokenize a text file and write a token file the sources read — a 1-D
//! dataset in HDF5 (`.h5` / `.hdf5`) or an llm.c GPT-2 `.bin` shard.
//!
//! Tokenization is byte-level (ids = bytes, vocabulary 256) or a Hugging Face `tokenizer.json`,
//! applied without special tokens, truncation or padding. Owns only this conversion; the
//! command-line parsing is the CLI's.

use std::path::{Path, PathBuf};

use super::bin::write_bin;
use super::DataError;
use crate::io::hdf5::{write_tokens, TokenSlice};

/// The text is tokenized in blocks of at least this many bytes, each ending at a line break, so
/// memory stays bounded on large files. Pre-tokenizers split at whitespace, so a block boundary
/// after `\n` changes nothing except, for some regexes, a run of blank lines across the boundary.
const BLOCK_BYTES: usize = 1 << 20;

/// Blocks handed to the tokenizer at once (it encodes them in parallel).
const BLOCKS_PER_BATCH: usize = 32;

/// Byte-level vocabulary size.
const BYTE_VOCAB: usize = 256;

/// What `data prepare` reads and writes.
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareArgs {
    /// A text file.
    pub input: PathBuf,
    /// `.h5` / `.hdf5` (HDF5) or `.bin` (llm.c).
    pub output: PathBuf,
    /// A Hugging Face `tokenizer.json`; `None` = byte-level (ids = bytes, vocabulary 256).
    pub tokenizer: Option<PathBuf>,
    /// HDF5 dataset name (ignored for `.bin`).
    pub dataset: String,
}

#[derive(Clone, Copy, PartialEq)]
enum Format {
    Hdf5,
    Bin,
}

/// Tokenizes `args.input` and writes `args.output`; returns one summary line.
pub fn run(args: &PrepareArgs) -> Result<String, DataError> {
    let ext = args.output.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    let format = match ext.as_str() {
        "bin" => Format::Bin,
        "h5" | "hdf5" => Format::Hdf5,
        _ => {
            return Err(DataError(format!(
                "data prepare: output {} must end in .h5 or .hdf5 (HDF5) or .bin (llm.c)",
                args.output.display()
            )))
        }
    };
    if format == Format::Hdf5 && args.dataset.is_empty() {
        return Err(DataError("data prepare: the HDF5 dataset name is empty".into()));
    }
    let bytes = std::fs::read(&args.input).map_err(|e| DataError(format!("cannot read {}: {e}", args.input.display())))?;
    let (ids, vocab) = match &args.tokenizer {
        None => (bytes.iter().map(|&b| b as u32).collect::<Vec<u32>>(), BYTE_VOCAB),
        Some(tok) => hf_tokenize(&args.input, &bytes, tok)?,
    };
    if ids.is_empty() {
        return Err(DataError(format!("data prepare: {} yields no tokens", args.input.display())));
    }
    let narrow = vocab <= u16::MAX as usize + 1;
    let width = match format {
        Format::Bin => {
            if !narrow {
                return Err(DataError(format!(
                    "data prepare: vocabulary of {vocab} ids does not fit the uint16 tokens of an llm.c .bin ({})\nHINT: write HDF5 (.h5), which stores uint32",
                    args.output.display()
                )));
            }
            let t: Vec<u16> = ids.iter().map(|&i| i as u16).collect();
            write_bin(&args.output, &t)?;
            "uint16"
        }
        Format::Hdf5 if narrow => {
            let t: Vec<u16> = ids.iter().map(|&i| i as u16).collect();
            write_tokens(&args.output, &args.dataset, TokenSlice::U16(&t), vocab as u64)?;
            "uint16"
        }
        Format::Hdf5 => {
            write_tokens(&args.output, &args.dataset, TokenSlice::U32(&ids), vocab as u64)?;
            "uint32"
        }
    };
    let target = match format {
        Format::Bin => args.output.display().to_string(),
        Format::Hdf5 => format!("{}:/{}", args.output.display(), args.dataset),
    };
    let how = match &args.tokenizer {
        None => "byte-level".to_string(),
        Some(t) => format!("tokenizer {}", t.display()),
    };
    Ok(format!(
        "wrote {} {width} tokens (vocab {vocab}, {how}) from {} ({} bytes) to {target}",
        ids.len(),
        args.input.display(),
        bytes.len()
    ))
}

/// Token ids of `bytes` (UTF-8 text) under the Hugging Face tokenizer `tok`, and the vocabulary
/// size (added tokens included; at least the largest id + 1).
fn hf_tokenize(input: &Path, bytes: &[u8], tok: &Path) -> Result<(Vec<u32>, usize), DataError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        DataError(format!(
            "{}: not UTF-8 text at byte {} (a tokenizer needs text)\nHINT: omit the tokenizer for byte-level ids",
            input.display(),
            e.valid_up_to()
        ))
    })?;
    let mut tokenizer =
        tokenizers::Tokenizer::from_file(tok).map_err(|e| DataError(format!("cannot load tokenizer {}: {e}", tok.display())))?;
    tokenizer.with_truncation(None).map_err(|e| DataError(format!("tokenizer {}: cannot disable truncation: {e}", tok.display())))?;
    tokenizer.with_padding(None);

    let mut blocks: Vec<&str> = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + BLOCK_BYTES).min(text.len());
        if end < text.len() {
            // `\n` is one byte, so the byte after it is a character boundary.
            end = match text.as_bytes()[end..].iter().position(|&b| b == b'\n') {
                Some(i) => end + i + 1,
                None => text.len(),
            };
        }
        blocks.push(&text[start..end]);
        start = end;
    }
    let mut ids: Vec<u32> = Vec::with_capacity(text.len() / 4);
    for batch in blocks.chunks(BLOCKS_PER_BATCH) {
        let enc = tokenizer
            .encode_batch_fast(batch.to_vec(), false)
            .map_err(|e| DataError(format!("tokenizing {} with {}: {e}", input.display(), tok.display())))?;
        enc.iter().for_each(|e| ids.extend_from_slice(e.get_ids()));
    }
    let max_id = ids.iter().copied().max().map_or(0, |m| m as usize + 1);
    Ok((ids, tokenizer.get_vocab_size(true).max(max_id)))
}
