//! Hugging Face model folders: `config.json` + `model.safetensors` of a `LlamaForCausalLM`,
//! `Qwen3ForCausalLM`, `MixtralForCausalLM` or `Qwen3MoeForCausalLM`.
//!
//! Reads a folder into a full, unsharded [`ModelParams`] (tensor names and `[out, in]` shapes are
//! the Hugging Face ones; only Mixtral's expert names are renamed, see [`Family`]) and writes
//! one that transformers' `from_pretrained` loads. The config check accepts both the
//! transformers 4.x layout (`rope_theta`, `rope_scaling`) and the 5.x one (`rope_parameters`).
//! A sharded checkpoint (`model.safetensors.index.json` + shards) is read too.
//!
//! [`SliceReader`] reads any block of a tensor with positional reads of only its bytes, so a rank
//! loads its shard of a model far larger than its memory; [`write_model`] streams a model out
//! one tensor at a time. This file checks `config.json` against the deck and finds the weight
//! files; `read` reads tensors, `write` writes a folder. Knows nothing of the mesh (the caller
//! says which block) nor of HDF5 checkpoints (`checkpoint`).

mod read;
mod write;

pub use read::{load_params, SliceReader};
pub use write::{save_params, write_model};

use crate::config::ModelCfg;
use serde_json::{json, Value};
use std::fmt;
use std::path::{Path, PathBuf};

/// What went wrong reading or writing a Hugging Face folder; the message names the file, the
/// key or tensor, and the numbers involved.
#[derive(Debug)]
pub struct HfError(pub String);

impl fmt::Display for HfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for HfError {}

fn err<T>(msg: impl Into<String>) -> Result<T, HfError> {
    Err(HfError(msg.into()))
}

/// Relative tolerance for the float keys of `config.json` (`rope_theta`, `rms_norm_eps`) against
/// the deck. Both sides are decimal text parsed to the nearest f64, so equal values agree
/// exactly; this only forgives a last-digit difference in how a writer formatted them.
const CONFIG_FLOAT_REL_TOL: f64 = 1e-12;

/// Defaults `transformers.LlamaConfig` uses for keys a `config.json` may omit.
const HF_DEFAULT_ROPE_THETA: f64 = 10000.0;
/// `Qwen3Config`'s `head_dim` when a `qwen3` config.json omits it.
const QWEN3_DEFAULT_HEAD_DIM: usize = 128;
const HF_DEFAULT_RMS_NORM_EPS: f64 = 1e-6;

/// The Hugging Face model a folder holds (its `model_type`). ndtrain's own tensor names are
/// those of Llama, Qwen3 and Qwen3-MoE; Mixtral names the same mixture-of-experts tensors
/// `block_sparse_moe.gate` (router) and `block_sparse_moe.experts.J.w1/w3/w2` (gate, up and
/// down projections), as transformers saves them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen3,
    Mixtral,
    Qwen3Moe,
}

impl Family {
    /// The family that writes a model of this `[model]`: a mixture of experts without q/k norm
    /// is Mixtral's, with it Qwen3-MoE's.
    pub fn of(cfg: &ModelCfg) -> Family {
        match (cfg.is_moe(), cfg.qk_norm) {
            (false, false) => Family::Llama,
            (false, true) => Family::Qwen3,
            (true, false) => Family::Mixtral,
            (true, true) => Family::Qwen3Moe,
        }
    }

    fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen3 => "qwen3",
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
        }
    }

    fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// The name this family's files give ndtrain's tensor `name`.
    pub fn file_name(self, name: &str) -> String {
        if self != Family::Mixtral || !name.contains(".mlp.") {
            return name.to_string();
        }
        let name = name.replace(".mlp.", ".block_sparse_moe.");
        name.replace(".gate_proj.weight", ".w1.weight").replace(".up_proj.weight", ".w3.weight").replace(".down_proj.weight", ".w2.weight")
    }

    /// ndtrain's name of this family's tensor `name` (the inverse of [`Family::file_name`]).
    pub fn own_name(self, name: &str) -> String {
        if self != Family::Mixtral || !name.contains(".block_sparse_moe.") {
            return name.to_string();
        }
        let name = name.replace(".block_sparse_moe.", ".mlp.");
        name.replace(".w1.weight", ".gate_proj.weight").replace(".w3.weight", ".up_proj.weight").replace(".w2.weight", ".down_proj.weight")
    }
}

fn read_config(dir: &Path) -> Result<Value, HfError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| HfError(format!("cannot read {}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| HfError(format!("{}: not valid JSON: {e}", path.display())))
}

/// Reads `config.json` and checks it describes the same model as the deck's `[model]`.
///
/// Compares `vocab_size`, `hidden_size` (= `d_model`), `num_hidden_layers`,
/// `num_attention_heads`, `num_key_value_heads`, `intermediate_size` (= `ffn_hidden`),
/// `rope_theta`, `rms_norm_eps` and `tie_word_embeddings`; a mismatch names the HF key, the deck
/// key and both values. Also rejects what ndtrain does not implement: `hidden_act` other than
/// `silu`, attention or MLP biases, RoPE scaling and sliding windows; checks `model_type`,
/// `head_dim` and the q/k norm against `[model] head_dim` and `qk_norm`. Keys the file omits
/// take `LlamaConfig`'s defaults (`Qwen3Config`'s head width for `qwen3`).
pub fn check_config(dir: &Path, cfg: &ModelCfg) -> Result<(), HfError> {
    no_shared_experts(cfg)?;
    let c = read_config(dir)?;
    let file = dir.join("config.json");
    let file = file.display();

    let int = |key: &str| -> Result<Option<u64>, HfError> {
        match c.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| HfError(format!("{file}: {key} = {v} is not a count"))),
        }
    };
    let float = |v: &Value, key: &str| -> Result<f64, HfError> {
        v.as_f64().ok_or_else(|| HfError(format!("{file}: {key} = {v} is not a number")))
    };
    let flag = |key: &str, default: bool| -> Result<bool, HfError> {
        match c.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| HfError(format!("{file}: {key} = {v} is not true/false"))),
        }
    };

    // Integer geometry. num_key_value_heads defaults to num_attention_heads (no GQA), as in HF.
    let heads = int("num_attention_heads")?;
    let family = family_of(&c, &file.to_string())?;
    let mut counts: Vec<(&str, &str, Option<u64>, usize)> = vec![
        ("vocab_size", "vocab_size", int("vocab_size")?, cfg.vocab_size),
        ("hidden_size", "d_model", int("hidden_size")?, cfg.d_model),
        ("num_hidden_layers", "n_layers", int("num_hidden_layers")?, cfg.n_layers),
        ("num_attention_heads", "n_heads", heads, cfg.n_heads),
        ("num_key_value_heads", "n_kv_heads", int("num_key_value_heads")?.or(heads), cfg.n_kv_heads),
    ];
    match family {
        Family::Llama | Family::Qwen3 => counts.push(("intermediate_size", "ffn_hidden", int("intermediate_size")?, cfg.ffn_hidden)),
        // Mixtral's intermediate_size is each expert's width; every block is sparse.
        Family::Mixtral => {
            counts.push(("num_local_experts", "n_experts", int("num_local_experts")?, cfg.n_experts));
            counts.push(("num_experts_per_tok", "experts_per_token", int("num_experts_per_tok")?, cfg.experts_per_token));
            counts.push(("intermediate_size", "moe_ffn_hidden", int("intermediate_size")?, cfg.moe_ffn_hidden));
        }
        // transformers 5 saves Qwen3-MoE's num_experts as num_local_experts.
        Family::Qwen3Moe => {
            counts.push(("num_experts", "n_experts", int("num_experts")?.or(int("num_local_experts")?), cfg.n_experts));
            counts.push(("num_experts_per_tok", "experts_per_token", int("num_experts_per_tok")?, cfg.experts_per_token));
            counts.push(("moe_intermediate_size", "moe_ffn_hidden", int("moe_intermediate_size")?, cfg.moe_ffn_hidden));
            if cfg.first_dense_layers > 0 {
                counts.push(("intermediate_size", "ffn_hidden", int("intermediate_size")?, cfg.ffn_hidden));
            }
        }
    }
    for (hf_key, deck_key, hf, deck) in counts {
        match hf {
            None => return err(format!("{file}: {hf_key} is missing (the deck has [model] {deck_key} = {deck})")),
            Some(h) if h != deck as u64 => return err(format!("{file}: {hf_key} = {h}, but the deck has [model] {deck_key} = {deck}")),
            Some(_) => {}
        }
    }

    // RoPE: transformers 4.x writes rope_theta + rope_scaling, 5.x writes rope_parameters.
    if let Some(s) = c.get("rope_scaling").filter(|v| !v.is_null()) {
        return err(format!("{file}: rope_scaling = {s}; ndtrain implements only unscaled RoPE"));
    }
    let mut theta = match c.get("rope_theta") {
        None | Some(Value::Null) => None,
        Some(v) => Some(float(v, "rope_theta")?),
    };
    if let Some(rp) = c.get("rope_parameters").filter(|v| !v.is_null()) {
        match rp.get("rope_type").and_then(Value::as_str) {
            None | Some("default") => {}
            Some(t) => return err(format!("{file}: rope_parameters.rope_type = \"{t}\"; ndtrain implements only \"default\" RoPE")),
        }
        if let Some(v) = rp.get("rope_theta") {
            let t = float(v, "rope_parameters.rope_theta")?;
            if let Some(top) = theta.filter(|&top| !close(top, t)) {
                return err(format!("{file}: rope_theta = {top} disagrees with rope_parameters.rope_theta = {t}"));
            }
            theta = Some(t);
        }
    }
    let theta = theta.unwrap_or(HF_DEFAULT_ROPE_THETA);
    if !close(theta, cfg.rope_theta) {
        return err(format!("{file}: rope_theta = {theta}, but the deck has [model] rope_theta = {}", cfg.rope_theta));
    }

    let eps = match c.get("rms_norm_eps") {
        None | Some(Value::Null) => HF_DEFAULT_RMS_NORM_EPS,
        Some(v) => float(v, "rms_norm_eps")?,
    };
    if !close(eps, cfg.norm_eps) {
        return err(format!("{file}: rms_norm_eps = {eps}, but the deck has [model] norm_eps = {}", cfg.norm_eps));
    }

    let tied = flag("tie_word_embeddings", false)?;
    if tied != cfg.tie_embeddings {
        return err(format!("{file}: tie_word_embeddings = {tied}, but the deck has [model] tie_embeddings = {}", cfg.tie_embeddings));
    }

    match c.get("hidden_act") {
        None | Some(Value::Null) => {}
        Some(Value::String(a)) if a == "silu" => {}
        Some(a) => return err(format!("{file}: hidden_act = {a}; ndtrain implements only \"silu\"")),
    }
    for key in ["attention_bias", "mlp_bias"] {
        if flag(key, false)? {
            return err(format!("{file}: {key} = true; ndtrain's Llama has no biases"));
        }
    }
    check_attention(&c, cfg, &file.to_string(), int("head_dim")?)?;
    check_experts(&c, cfg, family, &file.to_string())
}

/// Shared experts (`[model] n_shared_experts`) belong to none of the families read and
/// written here (Mixtral and Qwen3-MoE have none).
pub(crate) fn no_shared_experts(cfg: &ModelCfg) -> Result<(), HfError> {
    if cfg.n_shared_experts > 0 {
        return Err(HfError(format!(
            "[model] n_shared_experts = {}: no Hugging Face family ndtrain reads or writes (Llama, Qwen3, Mixtral, Qwen3-MoE) has shared experts; keep the model in ndtrain checkpoints",
            cfg.n_shared_experts
        )));
    }
    Ok(())
}

/// The folder's [`Family`] from `model_type` (`llama` when absent).
fn family_of(c: &Value, file: &str) -> Result<Family, HfError> {
    Ok(match c.get("model_type").and_then(Value::as_str).unwrap_or("llama") {
        "llama" => Family::Llama,
        "qwen3" => Family::Qwen3,
        "mixtral" => Family::Mixtral,
        "qwen3_moe" => Family::Qwen3Moe,
        other => {
            return err(format!(
                "{file}: model_type = \"{other}\"; ndtrain reads \"llama\", \"qwen3\", \"mixtral\" and \"qwen3_moe\" models"
            ))
        }
    })
}

/// A mixture of experts' routing: dense families need a dense deck; Mixtral always
/// renormalises its top-k and has no dense blocks; Qwen3-MoE's `norm_topk_prob` (false when
/// omitted) and its dense blocks (`mlp_only_layers`, `decoder_sparse_step`) must be the deck's.
fn check_experts(c: &Value, cfg: &ModelCfg, family: Family, file: &str) -> Result<(), HfError> {
    let moe = matches!(family, Family::Mixtral | Family::Qwen3Moe);
    if moe != cfg.is_moe() {
        return err(format!(
            "{file}: model_type = \"{}\" is {}, but the deck has [model] n_experts = {}",
            family.model_type(),
            if moe { "a mixture of experts" } else { "dense" },
            cfg.n_experts
        ));
    }
    if !moe {
        return Ok(());
    }
    let norm = match family {
        Family::Mixtral => true,
        _ => c.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(false),
    };
    if norm != cfg.norm_topk_prob {
        return err(format!("{file}: norm_topk_prob = {norm}, but the deck has [model] norm_topk_prob = {}", cfg.norm_topk_prob));
    }
    let dense: Vec<u64> = match family {
        Family::Qwen3Moe => {
            let step = c.get("decoder_sparse_step").and_then(Value::as_u64).unwrap_or(1);
            if step != 1 {
                return err(format!(
                    "{file}: decoder_sparse_step = {step}; ndtrain's sparse blocks are all those after first_dense_layers (step 1)"
                ));
            }
            c.get("mlp_only_layers").and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
        }
        _ => vec![],
    };
    let want: Vec<u64> = (0..cfg.first_dense_layers as u64).collect();
    if dense != want {
        return err(format!(
            "{file}: mlp_only_layers = {dense:?}, but the deck has [model] first_dense_layers = {} (blocks {want:?})",
            cfg.first_dense_layers
        ));
    }
    Ok(())
}

/// The attention's family: `model_type` `llama` (or absent) has no q/k norm and a head width of
/// `hidden_size / num_attention_heads` unless `head_dim` says otherwise; `qwen3` has the
/// per-head q/k norm and `head_dim` (128 when omitted, as `Qwen3Config`), and no sliding window.
fn check_attention(c: &Value, cfg: &ModelCfg, file: &str, head_dim: Option<u64>) -> Result<(), HfError> {
    let family = family_of(c, file)?;
    let model_type = family.model_type();
    let (qk_norm, default_hd) = match family {
        Family::Llama | Family::Mixtral => (false, cfg.d_model / cfg.n_heads),
        Family::Qwen3 | Family::Qwen3Moe => (true, QWEN3_DEFAULT_HEAD_DIM),
    };
    if qk_norm != cfg.qk_norm {
        return err(format!(
            "{file}: model_type = \"{model_type}\" {} a per-head q/k norm, but the deck has [model] qk_norm = {}",
            if qk_norm { "has" } else { "has no" },
            cfg.qk_norm
        ));
    }
    if c.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
        return err(format!("{file}: use_sliding_window = true; ndtrain implements only full causal attention"));
    }
    let hd = head_dim.unwrap_or(default_hd as u64);
    if hd != cfg.head_dim() as u64 {
        let deck = if cfg.head_dim > 0 { String::new() } else { format!(" = d_model({}) / n_heads({})", cfg.d_model, cfg.n_heads) };
        return err(format!("{file}: head_dim = {hd}, but the deck has [model] head_dim{deck} = {}", cfg.head_dim()));
    }
    Ok(())
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= CONFIG_FLOAT_REL_TOL * a.abs().max(b.abs())
}

/// The safetensors files of a folder: `model.safetensors`, or the shards its index names.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, HfError> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return err(format!("{}: neither model.safetensors nor model.safetensors.index.json exists", dir.display()));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| HfError(format!("cannot read {}: {e}", index.display())))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| HfError(format!("{}: not valid JSON: {e}", index.display())))?;
    let map =
        v.get("weight_map").and_then(Value::as_object).ok_or_else(|| HfError(format!("{}: no weight_map object", index.display())))?;
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, f) in map {
        let f = f.as_str().ok_or_else(|| HfError(format!("{}: weight_map[{name}] is not a file name", index.display())))?;
        let p = dir.join(f);
        if !files.contains(&p) {
            files.push(p);
        }
    }
    Ok(files)
}

/// The `config.json` [`save_params`] writes: the keys of both transformers 4.x (`rope_theta`,
/// `rope_scaling`) and 5.x (`rope_parameters`), so either loads it.
fn config_json(cfg: &ModelCfg) -> Value {
    let family = Family::of(cfg);
    let mut config = json!({
        "architectures": [family.architecture()],
        "model_type": family.model_type(),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim(),
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": null,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": true,
        "torch_dtype": "float32",
        "dtype": "float32",
    });
    if cfg.qk_norm {
        config["use_sliding_window"] = json!(false);
    }
    match family {
        Family::Llama | Family::Qwen3 => {}
        Family::Mixtral => {
            config["num_local_experts"] = json!(cfg.n_experts);
            config["num_experts_per_tok"] = json!(cfg.experts_per_token);
            config["intermediate_size"] = json!(cfg.moe_ffn_hidden);
            config["router_aux_loss_coef"] = json!(cfg.router_aux_loss_coef);
            config["router_jitter_noise"] = json!(0.0);
            config["sliding_window"] = Value::Null;
        }
        Family::Qwen3Moe => {
            config["num_experts"] = json!(cfg.n_experts);
            config["num_experts_per_tok"] = json!(cfg.experts_per_token);
            config["moe_intermediate_size"] = json!(cfg.moe_ffn_hidden);
            config["norm_topk_prob"] = json!(cfg.norm_topk_prob);
            config["decoder_sparse_step"] = json!(1);
            config["mlp_only_layers"] = json!((0..cfg.first_dense_layers).collect::<Vec<_>>());
            config["router_aux_loss_coef"] = json!(cfg.router_aux_loss_coef);
        }
    }
    config
}

#[cfg(test)]
mod tests {
    use super::read::{bf16_to_f32, f16_to_f32};
    use super::*;
    use crate::model::params::{param_specs, ModelParams};
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;

    fn small(tied: bool) -> ModelCfg {
        ModelCfg {
            vocab_size: 40,
            d_model: 16,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 0,
            qk_norm: false,
            ffn_hidden: 24,
            max_seq_len: 32,
            rope_theta: 500000.0,
            norm_eps: 1e-6,
            tie_embeddings: tied,
            ..ModelCfg::default()
        }
    }

    fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
        let mut v = read_config(dir).unwrap();
        f(v.as_object_mut().unwrap());
        std::fs::write(dir.join("config.json"), serde_json::to_string(&v).unwrap()).unwrap();
    }

    /// Blocks read by positional reads equal the same rows and columns of a whole load, for
    /// f32 and bf16 files, whole-row and column blocks, 1-D and 2-D tensors.
    #[test]
    fn slice_reader_reads_exactly_the_block() {
        let cfg = small(false);
        let p = ModelParams::<f32>::init(&cfg, 3);
        for bf16 in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            save_params(dir.path(), &cfg, &p).unwrap();
            if bf16 {
                // Rewrite the file in bf16 with the safetensors crate itself.
                let specs = param_specs(&cfg);
                let data: Vec<Vec<u8>> =
                    p.tensors().iter().map(|t| t.iter().flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes()).collect()).collect();
                let views: Vec<(String, TensorView<'_>)> = specs
                    .iter()
                    .zip(&data)
                    .map(|(s, b)| (s.name.clone(), TensorView::new(Dtype::BF16, s.shape.clone(), b).unwrap()))
                    .collect();
                safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
            }
            let whole: ModelParams<f32> = load_params(dir.path(), &cfg).unwrap();
            let r = SliceReader::open(dir.path(), &cfg).unwrap();
            for (spec, t) in param_specs(&cfg).iter().zip(whole.tensors()) {
                let rows = spec.shape[0];
                if spec.shape.len() == 1 {
                    let mut out = vec![0.0; 5];
                    r.read_block(&spec.name, &[3], &[5], &mut out).unwrap();
                    assert_eq!(out, t[3..8]);
                    continue;
                }
                let cols = spec.shape[1];
                for (start, count) in [([1, 0], [rows - 3, cols]), ([2, 4], [rows - 2, cols - 6])] {
                    let mut out = vec![0.0; count[0] * count[1]];
                    r.read_block(&spec.name, &start, &count, &mut out).unwrap();
                    let want: Vec<f32> = (0..count[0]).flat_map(|i| t[(start[0] + i) * cols + start[1]..][..count[1]].to_vec()).collect();
                    assert_eq!(out, want, "{} bf16={bf16} start {start:?}", spec.name);
                }
            }
            let mut out = vec![0.0; 4];
            let e = r.read_block("model.norm.weight", &[14], &[4], &mut out).unwrap_err();
            assert!(e.0.contains("outside model.norm.weight"), "{e}");
        }
    }

    #[test]
    fn save_then_load_round_trips_tied_and_untied() {
        for tied in [false, true] {
            let cfg = small(tied);
            let p = ModelParams::<f32>::init(&cfg, 7);
            let dir = tempfile::tempdir().unwrap();
            save_params(dir.path(), &cfg, &p).unwrap();
            check_config(dir.path(), &cfg).unwrap();
            let q: ModelParams<f32> = load_params(dir.path(), &cfg).unwrap();
            assert_eq!(p, q, "tied = {tied}");
            // f64 parameters are written as f32 and come back rounded to f32.
            let q64: ModelParams<f64> = load_params(dir.path(), &cfg).unwrap();
            assert_eq!(q64, p.cast::<f64>(&cfg));
        }
    }

    #[test]
    fn mismatched_config_is_an_error_naming_both_keys_and_values() {
        let cfg = small(false);
        let dir = tempfile::tempdir().unwrap();
        save_params(dir.path(), &cfg, &ModelParams::<f32>::init(&cfg, 1)).unwrap();
        let cases: Vec<(ModelCfg, &str)> = vec![
            (ModelCfg { n_kv_heads: 4, ..cfg.clone() }, "num_key_value_heads = 2, but the deck has [model] n_kv_heads = 4"),
            (ModelCfg { d_model: 32, ..cfg.clone() }, "hidden_size = 16, but the deck has [model] d_model = 32"),
            (ModelCfg { ffn_hidden: 8, ..cfg.clone() }, "intermediate_size = 24, but the deck has [model] ffn_hidden = 8"),
            (ModelCfg { vocab_size: 41, ..cfg.clone() }, "vocab_size = 40, but the deck has [model] vocab_size = 41"),
            (ModelCfg { n_layers: 3, ..cfg.clone() }, "num_hidden_layers = 2, but the deck has [model] n_layers = 3"),
            (ModelCfg { rope_theta: 10000.0, ..cfg.clone() }, "rope_theta = 500000, but the deck has [model] rope_theta = 10000"),
            (ModelCfg { norm_eps: 1e-5, ..cfg.clone() }, "rms_norm_eps = 0.000001, but the deck has [model] norm_eps = 0.00001"),
            (
                ModelCfg { tie_embeddings: true, ..cfg.clone() },
                "tie_word_embeddings = false, but the deck has [model] tie_embeddings = true",
            ),
        ];
        for (deck, want) in cases {
            let e = check_config(dir.path(), &deck).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
            // load_params checks the config before reading any tensor.
            let e = load_params::<f32>(dir.path(), &deck).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn unsupported_architectures_are_errors() {
        let cfg = small(false);
        let edits: [(&str, Value, &str); 9] = [
            ("hidden_act", json!("gelu"), "hidden_act = \"gelu\""),
            ("attention_bias", json!(true), "attention_bias = true"),
            ("mlp_bias", json!(true), "mlp_bias = true"),
            ("rope_scaling", json!({"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
            ("rope_parameters", json!({"rope_type": "yarn", "rope_theta": 500000.0}), "rope_type = \"yarn\""),
            ("head_dim", json!(8), "head_dim = 8"),
            ("model_type", json!("mistral"), "model_type = \"mistral\""),
            ("model_type", json!("qwen3"), "has a per-head q/k norm, but the deck has [model] qk_norm = false"),
            ("use_sliding_window", json!(true), "use_sliding_window = true"),
        ];
        for (key, value, want) in edits {
            let dir = tempfile::tempdir().unwrap();
            save_params(dir.path(), &cfg, &ModelParams::<f32>::init(&cfg, 1)).unwrap();
            edit_config(dir.path(), |c| {
                c.insert(key.into(), value);
            });
            let e = check_config(dir.path(), &cfg).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn transformers_4_and_5_rope_layouts_and_defaults_are_accepted() {
        let cfg = ModelCfg { rope_theta: 10000.0, norm_eps: 1e-6, n_kv_heads: 4, ..small(false) };
        let dir = tempfile::tempdir().unwrap();
        save_params(dir.path(), &cfg, &ModelParams::<f32>::init(&cfg, 1)).unwrap();
        // 4.x: only top-level rope_theta.
        edit_config(dir.path(), |c| {
            c.remove("rope_parameters");
        });
        check_config(dir.path(), &cfg).unwrap();
        // 5.x: only rope_parameters.
        edit_config(dir.path(), |c| {
            c.remove("rope_theta");
            c.remove("rope_scaling");
            c.insert("rope_parameters".into(), json!({"rope_type": "default", "rope_theta": 10000.0}));
        });
        check_config(dir.path(), &cfg).unwrap();
        // Omitted keys take LlamaConfig's defaults (theta 1e4, eps 1e-6, kv heads = heads, untied).
        edit_config(dir.path(), |c| {
            for k in ["rope_parameters", "rms_norm_eps", "num_key_value_heads", "tie_word_embeddings", "head_dim"] {
                c.remove(k);
            }
        });
        check_config(dir.path(), &cfg).unwrap();
    }

    #[test]
    fn missing_misshaped_and_foreign_tensors_are_named() {
        let cfg = small(false);
        let tied = small(true);
        let dir = tempfile::tempdir().unwrap();
        // A tied folder lacks lm_head.weight: an untied deck (with the config made to agree) needs it.
        save_params(dir.path(), &tied, &ModelParams::<f32>::init(&tied, 1)).unwrap();
        edit_config(dir.path(), |c| {
            c.insert("tie_word_embeddings".into(), json!(false));
        });
        let e = load_params::<f32>(dir.path(), &cfg).unwrap_err().to_string();
        assert!(e.contains("tensor lm_head.weight is missing"), "{e}");

        // A mis-shaped tensor: write a file by hand whose q_proj is transposed.
        let p = ModelParams::<f32>::init(&cfg, 1);
        save_params(dir.path(), &cfg, &p).unwrap();
        let specs = param_specs(&cfg);
        let raw: Vec<Vec<u8>> = p.tensors().iter().map(|t| t.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
        let write = |extra: Option<&str>, swap: bool| {
            let mut views: Vec<(String, TensorView<'_>)> = Vec::new();
            for (s, b) in specs.iter().zip(&raw) {
                let mut shape = s.shape.clone();
                if swap && s.name == "model.layers.1.self_attn.k_proj.weight" {
                    shape.reverse();
                }
                views.push((s.name.clone(), TensorView::new(Dtype::F32, shape, b).unwrap()));
            }
            if let Some(name) = extra {
                views.push((name.to_string(), TensorView::new(Dtype::F32, vec![16], &raw[1]).unwrap()));
            }
            safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        };
        write(None, true);
        let e = load_params::<f32>(dir.path(), &cfg).unwrap_err().to_string();
        assert!(e.contains("model.layers.1.self_attn.k_proj.weight has shape [16, 8], but"), "{e}");
        write(Some("model.layers.0.self_attn.q_proj.bias"), false);
        let e = load_params::<f32>(dir.path(), &cfg).unwrap_err().to_string();
        assert!(e.contains("model.layers.0.self_attn.q_proj.bias"), "{e}");
        write(Some("model.layers.0.self_attn.rotary_emb.inv_freq"), false);
        assert_eq!(load_params::<f32>(dir.path(), &cfg).unwrap(), p);
    }

    #[test]
    fn half_precision_files_convert_exactly() {
        // f16: 1, -2, 65504 (max), 2^-24 (smallest subnormal), 3·2^-16 (subnormal), +inf.
        let f16 = [0x3c00u16, 0xc000, 0x7bff, 0x0001, 0x0003, 0x7c00];
        let want = [1.0f32, -2.0, 65504.0, 2f32.powi(-24), 3.0 * 2f32.powi(-24), f32::INFINITY];
        for (b, w) in f16.iter().zip(want) {
            assert_eq!(f16_to_f32(*b), w, "{b:#06x}");
        }
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
        assert_eq!(f16_to_f32(0x0200), 2f32.powi(-15)); // largest-bit subnormal
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0xc040), -3.0);

        // A whole model stored as bf16 and as f16 loads to the values those types hold.
        let cfg = small(true);
        let p = ModelParams::<f32>::init(&cfg, 3);
        let dir = tempfile::tempdir().unwrap();
        save_params(dir.path(), &cfg, &p).unwrap();
        let specs = param_specs(&cfg);
        let bf: Vec<Vec<u8>> =
            p.tensors().iter().map(|t| t.iter().flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes()).collect()).collect();
        let views: Vec<_> =
            specs.iter().zip(&bf).map(|(s, b)| (s.name.clone(), TensorView::new(Dtype::BF16, s.shape.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        let q: ModelParams<f32> = load_params(dir.path(), &cfg).unwrap();
        for (a, b) in p.tensors().iter().zip(q.tensors()) {
            for (x, y) in a.iter().zip(b.iter()) {
                assert_eq!(f32::from_bits(x.to_bits() & 0xffff_0000), *y);
            }
        }
    }

    #[test]
    fn sharded_checkpoints_are_read_through_the_index() {
        let cfg = small(false);
        let p = ModelParams::<f32>::init(&cfg, 5);
        let dir = tempfile::tempdir().unwrap();
        save_params(dir.path(), &cfg, &p).unwrap();
        std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
        let specs = param_specs(&cfg);
        let raw: Vec<Vec<u8>> = p.tensors().iter().map(|t| t.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
        let mut map = serde_json::Map::new();
        for (k, file) in ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"].iter().enumerate() {
            let views: Vec<_> = specs
                .iter()
                .zip(&raw)
                .enumerate()
                .filter(|(i, _)| i % 2 == k)
                .map(|(_, (s, b))| {
                    map.insert(s.name.clone(), json!(file));
                    (s.name.clone(), TensorView::new(Dtype::F32, s.shape.clone(), b).unwrap())
                })
                .collect();
            safetensors::serialize_to_file(views, None, &dir.path().join(file)).unwrap();
        }
        let index = json!({"metadata": {}, "weight_map": map});
        std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
        assert_eq!(load_params::<f32>(dir.path(), &cfg).unwrap(), p);
    }
}
