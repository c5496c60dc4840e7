//! The model's parameters: Hugging Face names and shapes, and layout-independent initialisation.
//!
//! `ModelParams<T>` is used for the weights and, with the same shapes, for their gradients and
//! the AdamW moments. Shapes are `[out, in]` row-major as in PyTorch. Knows nothing of sharding:
//! a parallel strategy hands the model a full (or gathered) set of these tensors.
//!
//! Legend: `V` vocab, `D` d_model, `H` heads, `KV` kv heads, `hd` head dim, `F` ffn hidden.

use crate::config::ModelCfg;
use crate::real::Real;
use crate::rng;

/// The weights of one decoder block.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerParams<T> {
    pub input_layernorm: Vec<T>,          // [D]
    pub q_proj: Vec<T>,                   // [H*hd, D]
    pub k_proj: Vec<T>,                   // [KV*hd, D]
    pub v_proj: Vec<T>,                   // [KV*hd, D]
    pub o_proj: Vec<T>,                   // [D, H*hd]
    pub post_attention_layernorm: Vec<T>, // [D]
    pub gate_proj: Vec<T>,                // [F, D]
    pub up_proj: Vec<T>,                  // [F, D]
    pub down_proj: Vec<T>,                // [D, F]
}

/// All weights of `LlamaForCausalLM`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelParams<T> {
    pub embed_tokens: Vec<T>, // [V, D]
    pub layers: Vec<LayerParams<T>>,
    pub norm: Vec<T>,            // [D]
    pub lm_head: Option<Vec<T>>, // [V, D]; None when tied to embed_tokens
}

/// How a tensor is initialised and whether weight decay applies to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// A 2-D matrix (linear or embedding): N(0, 0.02), decayed.
    Matrix,
    /// A matrix feeding the residual stream (`o_proj`, `down_proj`): N(0, 0.02/sqrt(2L)), decayed.
    ResidualMatrix,
    /// A norm weight: ones, never decayed.
    Norm,
}

/// Name, shape and kind of one parameter tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: ParamKind,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// AdamW decays 2-D weights only.
    pub fn decayed(&self) -> bool {
        self.kind != ParamKind::Norm
    }
}

/// Every parameter of the model in a fixed order (the order of the `visit` methods).
pub fn param_specs(cfg: &ModelCfg) -> Vec<ParamSpec> {
    let (v, d, f) = (cfg.vocab_size, cfg.d_model, cfg.ffn_hidden);
    let hd = cfg.head_dim();
    let (q, kv) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
    let spec = |name: String, shape: Vec<usize>, kind| ParamSpec { name, shape, kind };
    let mut out = vec![spec("model.embed_tokens.weight".into(), vec![v, d], ParamKind::Matrix)];
    for i in 0..cfg.n_layers {
        let p = format!("model.layers.{i}.");
        out.push(spec(format!("{p}input_layernorm.weight"), vec![d], ParamKind::Norm));
        out.push(spec(format!("{p}self_attn.q_proj.weight"), vec![q, d], ParamKind::Matrix));
        out.push(spec(format!("{p}self_attn.k_proj.weight"), vec![kv, d], ParamKind::Matrix));
        out.push(spec(format!("{p}self_attn.v_proj.weight"), vec![kv, d], ParamKind::Matrix));
        out.push(spec(format!("{p}self_attn.o_proj.weight"), vec![d, q], ParamKind::ResidualMatrix));
        out.push(spec(format!("{p}post_attention_layernorm.weight"), vec![d], ParamKind::Norm));
        out.push(spec(format!("{p}mlp.gate_proj.weight"), vec![f, d], ParamKind::Matrix));
        out.push(spec(format!("{p}mlp.up_proj.weight"), vec![f, d], ParamKind::Matrix));
        out.push(spec(format!("{p}mlp.down_proj.weight"), vec![d, f], ParamKind::ResidualMatrix));
    }
    out.push(spec("model.norm.weight".into(), vec![d], ParamKind::Norm));
    if !cfg.tie_embeddings {
        out.push(spec("lm_head.weight".into(), vec![v, d], ParamKind::Matrix));
    }
    out
}

/// Standard deviation of the initial values of a tensor of this kind.
pub fn init_std(kind: ParamKind, n_layers: usize) -> f64 {
    match kind {
        ParamKind::Matrix => 0.02,
        ParamKind::ResidualMatrix => 0.02 / (2.0 * n_layers as f64).sqrt(),
        ParamKind::Norm => 0.0,
    }
}

/// Initial value of element `index` (row-major, of the logical full tensor) of parameter `spec`.
///
/// Depends only on `(seed, name, index)`, so any shard of any layout generates its own piece.
pub fn init_value(seed: u64, spec: &ParamSpec, n_layers: usize, index: u64) -> f64 {
    match spec.kind {
        ParamKind::Norm => 1.0,
        k => init_std(k, n_layers) * rng::normal(seed, rng::stream_id(&spec.name), index),
    }
}

impl<T: Real> LayerParams<T> {
    /// A block with no storage (a placeholder while a buffer is lent out).
    pub fn empty() -> Self {
        LayerParams {
            input_layernorm: vec![],
            q_proj: vec![],
            k_proj: vec![],
            v_proj: vec![],
            o_proj: vec![],
            post_attention_layernorm: vec![],
            gate_proj: vec![],
            up_proj: vec![],
            down_proj: vec![],
        }
    }

    fn zeros(cfg: &ModelCfg) -> Self {
        let (d, f, hd) = (cfg.d_model, cfg.ffn_hidden, cfg.head_dim());
        let (q, kv) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        LayerParams {
            input_layernorm: vec![T::ZERO; d],
            q_proj: vec![T::ZERO; q * d],
            k_proj: vec![T::ZERO; kv * d],
            v_proj: vec![T::ZERO; kv * d],
            o_proj: vec![T::ZERO; d * q],
            post_attention_layernorm: vec![T::ZERO; d],
            gate_proj: vec![T::ZERO; f * d],
            up_proj: vec![T::ZERO; f * d],
            down_proj: vec![T::ZERO; d * f],
        }
    }

    /// The block's tensors in `param_specs` order.
    pub fn tensors(&self) -> [&Vec<T>; 9] {
        [
            &self.input_layernorm,
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.post_attention_layernorm,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ]
    }

    pub fn tensors_mut(&mut self) -> [&mut Vec<T>; 9] {
        [
            &mut self.input_layernorm,
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
            &mut self.post_attention_layernorm,
            &mut self.gate_proj,
            &mut self.up_proj,
            &mut self.down_proj,
        ]
    }
}

impl<T: Real> ModelParams<T> {
    /// All tensors zero (the shape of gradients and optimiser moments).
    pub fn zeros(cfg: &ModelCfg) -> Self {
        let (v, d) = (cfg.vocab_size, cfg.d_model);
        ModelParams {
            embed_tokens: vec![T::ZERO; v * d],
            layers: (0..cfg.n_layers).map(|_| LayerParams::zeros(cfg)).collect(),
            norm: vec![T::ZERO; d],
            lm_head: if cfg.tie_embeddings { None } else { Some(vec![T::ZERO; v * d]) },
        }
    }

    /// The seeded, layout-independent initial model of DESIGN.md.
    pub fn init(cfg: &ModelCfg, seed: u64) -> Self {
        let mut p = Self::zeros(cfg);
        let specs = param_specs(cfg);
        for (spec, t) in specs.iter().zip(p.tensors_mut()) {
            for (i, x) in t.iter_mut().enumerate() {
                *x = T::from_f64(init_value(seed, spec, cfg.n_layers, i as u64));
            }
        }
        p
    }

    /// Every tensor in `param_specs` order.
    pub fn tensors(&self) -> Vec<&Vec<T>> {
        let mut out = vec![&self.embed_tokens];
        for l in &self.layers {
            out.extend(l.tensors());
        }
        out.push(&self.norm);
        if let Some(h) = &self.lm_head {
            out.push(h);
        }
        out
    }

    /// Every tensor in `param_specs` order, mutably.
    pub fn tensors_mut(&mut self) -> Vec<&mut Vec<T>> {
        let mut out = vec![&mut self.embed_tokens];
        for l in &mut self.layers {
            out.extend(l.tensors_mut());
        }
        out.push(&mut self.norm);
        if let Some(h) = &mut self.lm_head {
            out.push(h);
        }
        out
    }

    /// The output projection: `lm_head`, or `embed_tokens` when tied.
    pub fn output_weight(&self) -> &[T] {
        self.lm_head.as_deref().unwrap_or(&self.embed_tokens)
    }

    pub fn numel(&self) -> usize {
        self.tensors().iter().map(|t| t.len()).sum()
    }

    /// Sets every element to zero (gradients between optimiser steps).
    pub fn fill_zero(&mut self) {
        for t in self.tensors_mut() {
            t.iter_mut().for_each(|x| *x = T::ZERO);
        }
    }

    /// Converts element type (e.g. the f32 training model to f64 for a gradient check).
    pub fn cast<U: Real>(&self, cfg: &ModelCfg) -> ModelParams<U> {
        let mut out = ModelParams::<U>::zeros(cfg);
        for (dst, src) in out.tensors_mut().into_iter().zip(self.tensors()) {
            for (d, s) in dst.iter_mut().zip(src.iter()) {
                *d = U::from_f64(s.to_f64());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_match_tensors_and_hf_names() {
        let cfg = ModelCfg::default();
        let p = ModelParams::<f32>::init(&cfg, 1);
        let specs = param_specs(&cfg);
        assert_eq!(specs.len(), p.tensors().len());
        for (s, t) in specs.iter().zip(p.tensors()) {
            assert_eq!(s.numel(), t.len(), "{}", s.name);
        }
        assert_eq!(specs[2].name, "model.layers.0.self_attn.q_proj.weight");
        assert_eq!(specs.last().unwrap().name, "lm_head.weight");
    }

    #[test]
    fn init_statistics_follow_design() {
        let cfg = ModelCfg::default();
        let p = ModelParams::<f64>::init(&cfg, 3);
        let std = |v: &[f64]| (v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64).sqrt();
        assert!((std(&p.embed_tokens) - 0.02).abs() < 0.001);
        let resid = 0.02 / (2.0 * cfg.n_layers as f64).sqrt();
        assert!((std(&p.layers[0].o_proj) - resid).abs() < 0.05 * resid);
        assert!(p.norm.iter().all(|&x| x == 1.0));
    }
}
