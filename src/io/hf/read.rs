//! Reading tensors of a Hugging Face folder: a whole model ([`load_params`]) or any block of a
//! tensor with positional reads of only its bytes ([`SliceReader`]), converted from f32, bf16
//! or f16.

use super::{check_config, err, read_config, weight_files, HfError};
use crate::config::ModelCfg;
use crate::model::params::{param_specs, ModelParams};
use crate::scalar::Real;
use safetensors::Dtype;
use serde_json::Value;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Converts little-endian f32/f16/bf16/f64 `bytes` of dtype `dtype` into `dst`.
fn convert_bytes<T: Real>(name: &str, dtype: Dtype, bytes: &[u8], dst: &mut [T]) -> Result<(), HfError> {
    macro_rules! fill {
        ($n:expr, $f:expr) => {{
            debug_assert_eq!(bytes.len(), dst.len() * $n);
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact($n)) {
                *d = T::from_f64($f(c.try_into().expect("chunks_exact")));
            }
        }};
    }
    match dtype {
        Dtype::F32 => fill!(4, |c: [u8; 4]| f32::from_le_bytes(c) as f64),
        Dtype::F64 => fill!(8, f64::from_le_bytes),
        Dtype::BF16 => fill!(2, |c: [u8; 2]| bf16_to_f32(u16::from_le_bytes(c)) as f64),
        Dtype::F16 => fill!(2, |c: [u8; 2]| f16_to_f32(u16::from_le_bytes(c)) as f64),
        d => return err(format!("tensor {name} has dtype {d:?}; ndtrain reads F32, F16, BF16 or F64")),
    }
    Ok(())
}

/// bfloat16 is the upper half of an f32.
pub(super) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// IEEE 754 binary16 to f32, exact (every f16 value is an f32 value), incl. subnormals, ±inf, NaN.
pub(super) fn f16_to_f32(bits: u16) -> f32 {
    let sign = ((bits >> 15) as u32) << 31;
    let exp = ((bits >> 10) & 0x1f) as u32;
    let man = (bits & 0x3ff) as u32;
    let out = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: m · 2^-24, normalised into f32.
            let shift = m.leading_zeros() - 21; // bring the leading 1 to bit 10
            let m = (m << shift) & 0x3ff;
            sign | ((127 - 15 + 1 - shift) << 23) | (m << 13)
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(out)
}

/// Loads every parameter of a Hugging Face `LlamaForCausalLM` folder into a full [`ModelParams`].
///
/// Checks `config.json` with [`check_config`] first, then reads each tensor of
/// [`param_specs`] by its Hugging Face name (f32, f16, bf16 or f64 in the file, converted to `T`)
/// and checks its shape. A missing or mis-shaped tensor is an error naming it. With
/// `tie_embeddings` the file may omit `lm_head.weight` (if present it is ignored); an untied
/// deck needs it. A tensor the model does not have is an error too (old checkpoints'
/// `rotary_emb.inv_freq` buffers excepted), since it means the file is some other architecture.
pub fn load_params<T: Real>(dir: &Path, cfg: &ModelCfg) -> Result<ModelParams<T>, HfError> {
    let reader = SliceReader::open(dir, cfg)?;
    let mut params = ModelParams::<T>::zeros(cfg);
    for (spec, dst) in param_specs(cfg).iter().zip(params.tensors_mut()) {
        let start = vec![0; spec.shape.len()];
        reader.read_block(&spec.name, &start, &spec.shape, dst)?;
    }
    Ok(params)
}

/// Reads blocks of the tensors of a Hugging Face folder without reading or mapping the rest:
/// the safetensors headers are parsed once, then each block is fetched with positional reads
/// of just its bytes (a rank's slice of a model far larger than its memory).
pub struct SliceReader {
    tensors: HashMap<String, StoredTensor>,
}

struct StoredTensor {
    file: std::sync::Arc<File>,
    path: PathBuf,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute file offset of the tensor's first byte.
    data_start: u64,
}

impl SliceReader {
    /// Checks `config.json` against `[model]` and indexes every weight file's tensors, with the
    /// same checks as [`load_params`]: every tensor present once with the deck's shape, no
    /// tensor the model does not have.
    pub fn open(dir: &Path, cfg: &ModelCfg) -> Result<SliceReader, HfError> {
        check_config(dir, cfg)?;
        let family = super::family_of(&read_config(dir)?, &dir.join("config.json").display().to_string())?;
        let specs = param_specs(cfg);
        let mut tensors = HashMap::new();
        let mut unexpected = Vec::new();
        for path in weight_files(dir)? {
            let file = File::open(&path).map_err(|e| HfError(format!("cannot open {}: {e}", path.display())))?;
            let header = read_header(&file, &path)?;
            let data_base = 8 + header.0;
            let file = std::sync::Arc::new(file);
            for (file_name, info) in header.1 {
                // Tensors are indexed by ndtrain's names (Mixtral's experts renamed).
                let name = family.own_name(&file_name);
                let Some(spec) = specs.iter().find(|s| s.name == name) else {
                    let tied_head = cfg.tie_embeddings && name == "lm_head.weight";
                    if !tied_head && !name.ends_with("rotary_emb.inv_freq") {
                        unexpected.push(name);
                    }
                    continue;
                };
                if info.1 != spec.shape {
                    return err(format!(
                        "{}: tensor {name} has shape {:?}, but the deck's [model] needs {:?}",
                        path.display(),
                        info.1,
                        spec.shape
                    ));
                }
                let t =
                    StoredTensor { file: file.clone(), path: path.clone(), dtype: info.0, shape: info.1, data_start: data_base + info.2 };
                if tensors.insert(name.clone(), t).is_some() {
                    return err(format!("{}: tensor {name} appears twice", dir.display()));
                }
            }
        }
        if let Some(s) = specs.iter().find(|s| !tensors.contains_key(&s.name)) {
            let hint = if s.name == "lm_head.weight" { " (the deck has tie_embeddings = false)" } else { "" };
            return err(format!("{}: tensor {} is missing{hint}", dir.display(), s.name));
        }
        if !unexpected.is_empty() {
            unexpected.sort();
            return err(format!("{}: tensors that a Llama model of this [model] does not have: {}", dir.display(), unexpected.join(", ")));
        }
        Ok(SliceReader { tensors })
    }

    /// Reads the block of tensor `name` starting at `start` with `count` elements per
    /// dimension (row-major) into `out`, converted to `T`.
    pub fn read_block<T: Real>(&self, name: &str, start: &[usize], count: &[usize], out: &mut [T]) -> Result<(), HfError> {
        use std::os::unix::fs::FileExt;
        let t = self.tensors.get(name).ok_or_else(|| HfError(format!("tensor {name} is not in the model folder")))?;
        let es = dtype_size(t.dtype);
        let (rows, cols) = (count[0], count.get(1).copied().unwrap_or(1));
        let gcols = t.shape.get(1).copied().unwrap_or(1);
        if out.len() != rows * cols || start[0] + rows > t.shape[0] || start.get(1).copied().unwrap_or(0) + cols > gcols {
            return err(format!("{}: block start {start:?} count {count:?} is outside {name} of shape {:?}", t.path.display(), t.shape));
        }
        let c0 = start.get(1).copied().unwrap_or(0);
        // Whole rows are one contiguous read; a column block is one read per row.
        let (reads, per_read) = if cols == gcols { (1, rows * cols) } else { (rows, cols) };
        let mut bytes = vec![0u8; per_read * es];
        for r in 0..reads {
            let (row, n) = if reads == 1 { (start[0], per_read) } else { (start[0] + r, cols) };
            let at = t.data_start + ((row * gcols + c0) * es) as u64;
            t.file
                .read_exact_at(&mut bytes, at)
                .map_err(|e| HfError(format!("{}: reading {name} rows from {row}: {e}", t.path.display())))?;
            convert_bytes(name, t.dtype, &bytes, &mut out[r * n..][..n])?;
        }
        Ok(())
    }
}

/// The header of a safetensors file: its length and, per tensor, dtype, shape and data offset.
type Header = (u64, Vec<(String, (Dtype, Vec<usize>, u64))>);

fn read_header(file: &File, path: &Path) -> Result<Header, HfError> {
    use std::os::unix::fs::FileExt;
    let bad = |m: String| HfError(format!("{}: not a valid safetensors file: {m}", path.display()));
    let mut len = [0u8; 8];
    file.read_exact_at(&mut len, 0).map_err(|e| bad(e.to_string()))?;
    let n = u64::from_le_bytes(len);
    if n > 100 << 20 {
        return Err(bad(format!("header of {n} bytes")));
    }
    let mut text = vec![0u8; n as usize];
    file.read_exact_at(&mut text, 8).map_err(|e| bad(e.to_string()))?;
    let v: Value = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    let obj = v.as_object().ok_or_else(|| bad("the header is not a JSON object".into()))?;
    let mut out = vec![];
    for (name, info) in obj.iter().filter(|(k, _)| *k != "__metadata__") {
        let dtype: Dtype = serde_json::from_value(info["dtype"].clone()).map_err(|e| bad(format!("{name}: dtype: {e}")))?;
        let shape: Vec<usize> = serde_json::from_value(info["shape"].clone()).map_err(|e| bad(format!("{name}: shape: {e}")))?;
        let offsets: [u64; 2] =
            serde_json::from_value(info["data_offsets"].clone()).map_err(|e| bad(format!("{name}: data_offsets: {e}")))?;
        let want = shape.iter().product::<usize>() as u64 * dtype_size(dtype) as u64;
        if offsets[1] < offsets[0] || offsets[1] - offsets[0] != want {
            return Err(bad(format!("{name}: data_offsets {offsets:?} do not hold shape {shape:?} of {dtype:?}")));
        }
        out.push((name.clone(), (dtype, shape, offsets[0])));
    }
    Ok((n, out))
}

fn dtype_size(d: Dtype) -> usize {
    match d {
        Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
        Dtype::F16 | Dtype::BF16 | Dtype::I16 | Dtype::U16 => 2,
        _ => 1,
    }
}
