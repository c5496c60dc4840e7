//! Writing a Hugging Face folder that `transformers.LlamaForCausalLM.from_pretrained` loads:
//! `config.json` and `model.safetensors`, streamed one tensor at a time.

use super::{config_json, err, Family, HfError};
use crate::config::ModelCfg;
use crate::model::params::{param_specs, ModelParams};
use crate::scalar::Real;
use serde_json::{json, Value};
use std::fs::File;
use std::path::Path;

/// Writes `config.json` + `model.safetensors` (f32) into `dir` (created if needed) such that
/// `transformers.LlamaForCausalLM.from_pretrained(dir)` loads the same model. A tied model
/// writes no `lm_head.weight`, as Hugging Face does.
pub fn save_params<T: Real>(dir: &Path, cfg: &ModelCfg, params: &ModelParams<T>) -> Result<(), HfError> {
    super::no_shared_experts(cfg)?;
    let specs = param_specs(cfg);
    let tensors = params.tensors();
    if tensors.len() != specs.len() {
        return err(format!(
            "save_params: the parameters hold {} tensors, but the deck's [model] has {} (tie_embeddings = {})",
            tensors.len(),
            specs.len(),
            cfg.tie_embeddings
        ));
    }
    write_model(dir, cfg, |i, out| {
        let t = tensors[i];
        if t.len() != specs[i].numel() {
            return err(format!("save_params: {} has {} elements, expected {:?}", specs[i].name, t.len(), specs[i].shape));
        }
        out.clear();
        out.extend(t.iter().map(|x| x.to_f64() as f32));
        Ok(())
    })
}

/// Writes a Hugging Face folder one tensor at a time: `fill(i, buf)` puts tensor `i` of
/// [`param_specs`] into `buf` just before it is written, so only one tensor is ever held (an
/// export of a model larger than memory). The safetensors header is written first from the
/// known shapes, then the data, in name order with contiguous offsets.
pub fn write_model(dir: &Path, cfg: &ModelCfg, mut fill: impl FnMut(usize, &mut Vec<f32>) -> Result<(), HfError>) -> Result<(), HfError> {
    use std::io::Write;
    std::fs::create_dir_all(dir).map_err(|e| HfError(format!("cannot create {}: {e}", dir.display())))?;
    let specs = param_specs(cfg);
    // The family's own names (Mixtral renames the experts), in name order.
    let family = Family::of(cfg);
    let names: Vec<String> = specs.iter().map(|s| family.file_name(&s.name)).collect();
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by(|&a, &b| names[a].cmp(&names[b]));
    let mut header = serde_json::Map::new();
    // transformers refuses a safetensors file whose metadata lacks format = "pt".
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for &i in &order {
        let end = offset + 4 * specs[i].numel();
        header.insert(names[i].clone(), json!({"dtype": "F32", "shape": specs[i].shape, "data_offsets": [offset, end]}));
        offset = end;
    }
    let mut text = serde_json::to_string(&Value::Object(header)).expect("a JSON value always serialises");
    // The data starts 8-byte aligned, as the format recommends.
    while (8 + text.len()) % 8 != 0 {
        text.push(' ');
    }
    let path = dir.join("model.safetensors");
    let werr = |e: std::io::Error| HfError(format!("cannot write {}: {e}", path.display()));
    let mut out = std::io::BufWriter::with_capacity(1 << 22, File::create(&path).map_err(werr)?);
    out.write_all(&(text.len() as u64).to_le_bytes()).and_then(|_| out.write_all(text.as_bytes())).map_err(werr)?;
    let mut buf = Vec::new();
    for &i in &order {
        fill(i, &mut buf)?;
        if buf.len() != specs[i].numel() {
            return err(format!("{}: {} values given for {} of shape {:?}", path.display(), buf.len(), specs[i].name, specs[i].shape));
        }
        for chunk in buf.chunks(1 << 16) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
            out.write_all(&bytes).map_err(werr)?;
        }
    }
    out.into_inner().map_err(|e| werr(e.into_error()))?.sync_all().map_err(werr)?;
    let cfg_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config_json(cfg)).expect("a JSON value always serialises");
    std::fs::write(&cfg_path, text + "\n").map_err(|e| HfError(format!("cannot write {}: {e}", cfg_path.display())))
}
