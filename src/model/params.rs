//! The model's parameters: Hugging Face names and shapes, their tensor-parallel pieces, and
//! layout-independent initialisation.
//!
//! `ModelParams<T>` is used for the weights and, with the same shapes, for their gradients and
//! the AdamW moments. Shapes are `[out, in]` row-major as in PyTorch. Under tensor parallelism
//! a rank holds the TP-local piece of each tensor (`Dims`): `q, k, v, gate, up` and the
//! vocabulary tensors split by rows (output features), `o, down` by columns (input features),
//! norm weights replicated. Knows nothing of FSDP sharding: a strategy hands the model a whole
//! (or gathered) set of these tensors.
//!
//! Legend: `V` vocab, `D` d_model, `H` heads, `KV` kv heads, `hd` head dim, `F` ffn hidden;
//! `_local` = divided by the tp degree.

use super::router::RouterShape;
use crate::config::ModelCfg;
use crate::rng;
use crate::scalar::Real;

/// The weights of one decoder block, in any container `V`: host vectors (`LayerParams<T>`) or
/// a backend's buffers.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer<V> {
    pub input_layernorm: V,          // [D]
    pub q_proj: V,                   // [H*hd, D]
    pub k_proj: V,                   // [KV*hd, D]
    pub v_proj: V,                   // [KV*hd, D]
    pub o_proj: V,                   // [D, H*hd]
    pub q_norm: Option<V>,           // [hd], with `[model] qk_norm`
    pub k_norm: Option<V>,           // [hd], with `[model] qk_norm`
    pub post_attention_layernorm: V, // [D]
    /// The MLP `[F, D]`, `[F, D]`, `[D, F]`; in a mixture-of-experts block its shared experts
    /// (`[Fs, D]`, …, `Fs = n_shared_experts · Fe`), empty without.
    pub gate_proj: V,
    pub up_proj: V,
    pub down_proj: V,
    /// The router and experts that replace the MLP in a mixture-of-experts block.
    pub moe: Option<Experts<V>>,
}

/// A mixture-of-experts block's MLP: the router and every expert's SwiGLU FFN (names of
/// `Qwen3MoeForCausalLM`; `Fe` each expert's width, `E` experts).
#[derive(Clone, Debug, PartialEq)]
pub struct Experts<V> {
    pub gate: V, // [E, D] the router
    /// This rank's experts (all, or its `E / ep` under expert parallelism).
    pub experts: Vec<Expert<V>>,
    /// The block's `gate_proj`, `up_proj` and `down_proj` hold shared experts.
    pub shared: bool,
}

/// One expert's SwiGLU FFN.
#[derive(Clone, Debug, PartialEq)]
pub struct Expert<V> {
    pub gate_proj: V, // [Fe, D]
    pub up_proj: V,   // [Fe, D]
    pub down_proj: V, // [D, Fe]
}

impl<V> Experts<V> {
    /// The tensors in `param_specs` order: the router, then each expert's gate, up, down.
    pub fn tensors(&self) -> Vec<&V> {
        let mut out = vec![&self.gate];
        for e in &self.experts {
            out.extend([&e.gate_proj, &e.up_proj, &e.down_proj]);
        }
        out
    }

    /// [`Experts::tensors`], mutably.
    pub fn tensors_mut(&mut self) -> Vec<&mut V> {
        let mut out = vec![&mut self.gate];
        for e in &mut self.experts {
            out.extend([&mut e.gate_proj, &mut e.up_proj, &mut e.down_proj]);
        }
        out
    }

    fn map<W>(&self, f: &mut impl FnMut(&V) -> W) -> Experts<W> {
        Experts {
            gate: f(&self.gate),
            experts: self
                .experts
                .iter()
                .map(|e| Expert { gate_proj: f(&e.gate_proj), up_proj: f(&e.up_proj), down_proj: f(&e.down_proj) })
                .collect(),
            shared: self.shared,
        }
    }
}

/// A block's weights in host memory.
pub type LayerParams<T> = Layer<Vec<T>>;

/// All weights of `LlamaForCausalLM`, in any container `V` (see [`Layer`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Params<V> {
    pub embed_tokens: V, // [V, D]
    pub layers: Vec<Layer<V>>,
    pub norm: V,            // [D]
    pub lm_head: Option<V>, // [V, D]; None when tied to embed_tokens
}

/// The model's weights (or gradients, or AdamW moments) in host memory.
pub type ModelParams<T> = Params<Vec<T>>;

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

/// The sizes of one rank's copy of the model: the deck's `[model]`, divided by the tp degree
/// where tensor parallelism splits it (those end in `_local`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dims {
    /// Vocabulary rows on this rank: `ceil(V / tp)` (the last rank's rows past `V` are padding).
    pub vocab_local: usize,
    /// The deck's vocabulary size `V`.
    pub vocab: usize,
    /// First global vocabulary row this rank holds.
    pub vocab_offset: usize,
    pub d: usize,
    /// Blocks this rank holds (`layer_ids.len()`).
    pub layers: usize,
    /// The global index of each block this rank holds, in the order it holds them (every
    /// block without a pipeline; a stage's, or its chunks' one after another, with one).
    pub layer_ids: Vec<usize>,
    /// The model's blocks, on all stages (`[model] n_layers`).
    pub n_layers: usize,
    /// This rank runs the token embedding (the pipeline's first stage).
    pub embed: bool,
    /// This rank runs the final norm, the output projection and the loss (the last stage).
    pub head: bool,
    /// Query heads on this rank (`H_local`).
    pub heads_local: usize,
    /// Key/value heads on this rank (`KV_local`).
    pub kv_heads_local: usize,
    pub hd: usize,
    /// Each head's q and k pass an RMSNorm before RoPE (Qwen3).
    pub qk_norm: bool,
    /// FFN hidden features on this rank (`F_local`).
    pub ffn_local: usize,
    /// The mixture of experts, where the deck has one.
    pub moe: Option<MoeDims>,
    pub rope_theta: f64,
    pub norm_eps: f64,
    pub tie: bool,
    pub tp: usize,
    pub tp_rank: usize,
}

impl Dims {
    /// This rank's sizes; the deck is already validated (`tp` divides the heads and the FFN).
    pub fn new(cfg: &ModelCfg, tp: usize, tp_rank: usize) -> Dims {
        let vocab_local = cfg.vocab_size.div_ceil(tp);
        Dims {
            vocab_local,
            vocab: cfg.vocab_size,
            vocab_offset: tp_rank * vocab_local,
            d: cfg.d_model,
            layers: cfg.n_layers,
            layer_ids: (0..cfg.n_layers).collect(),
            n_layers: cfg.n_layers,
            embed: true,
            head: true,
            heads_local: cfg.n_heads / tp,
            kv_heads_local: cfg.n_kv_heads / tp,
            hd: cfg.head_dim(),
            qk_norm: cfg.qk_norm,
            ffn_local: cfg.ffn_hidden / tp,
            moe: cfg.is_moe().then_some(MoeDims {
                router: RouterShape { experts: cfg.n_experts, top_k: cfg.experts_per_token, norm_topk_prob: cfg.norm_topk_prob },
                ffn: cfg.moe_ffn_hidden,
                first_dense: cfg.first_dense_layers,
                aux_coef: cfg.router_aux_loss_coef,
                bias_rate: cfg.router_bias_update_rate,
                shared_local: cfg.n_shared_experts * cfg.moe_ffn_hidden / tp,
                ep: 1,
                ep_rank: 0,
            }),
            rope_theta: cfg.rope_theta,
            norm_eps: cfg.norm_eps,
            tie: cfg.tie_embeddings,
            tp,
            tp_rank,
        }
    }

    /// The whole model on one rank.
    pub fn full(cfg: &ModelCfg) -> Dims {
        Dims::new(cfg, 1, 0)
    }

    /// The piece of a pipeline: the blocks `layer_ids`, with the embedding (`embed`) and the
    /// head (`head`) where this piece runs them.
    pub fn stage(&self, layer_ids: Vec<usize>, embed: bool, head: bool) -> Dims {
        Dims { layers: layer_ids.len(), layer_ids, embed, head, ..self.clone() }
    }

    /// Holds `embed_tokens`: to look tokens up, or as the tied output projection.
    pub fn holds_embedding(&self) -> bool {
        self.embed || (self.head && self.tie)
    }

    /// The same piece holding only the experts of rank `ep_rank` of an `ep` group
    /// (`n_experts / ep` consecutive experts of every expert block).
    pub fn with_expert_parallel(mut self, ep: usize, ep_rank: usize) -> Dims {
        if let Some(e) = self.moe.as_mut() {
            assert!(e.router.experts % ep == 0 && ep_rank < ep, "ep({ep}) divides the experts (the deck is checked)");
            (e.ep, e.ep_rank) = (ep, ep_rank);
        }
        self
    }

    /// Block `layer` (its global index) routes tokens to experts.
    pub fn moe_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|e| layer >= e.first_dense)
    }

    /// Width on this rank of block `layer`'s SwiGLU MLP that every row passes (cut over tp): the
    /// dense MLP's `F_local`, or in a mixture-of-experts block its shared experts' (0: none).
    pub fn mlp_width(&self, layer: usize) -> usize {
        match self.moe.as_ref().filter(|_| self.moe_layer(layer)) {
            Some(e) => e.shared_local,
            None => self.ffn_local,
        }
    }

    /// The mixture-of-experts blocks of the whole model (all stages).
    pub fn moe_layers(&self) -> usize {
        (0..self.n_layers).filter(|&l| self.moe_layer(l)).count()
    }

    /// Vocabulary rows of this rank that are real tokens (the rest is padding).
    pub fn vocab_valid(&self) -> usize {
        self.vocab.saturating_sub(self.vocab_offset).min(self.vocab_local)
    }
}

/// A mixture of experts' sizes, and which experts this rank holds (each one whole).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeDims {
    pub router: RouterShape,
    /// Each expert's FFN width `Fe`.
    pub ffn: usize,
    /// Blocks, from the first, that keep the dense MLP.
    pub first_dense: usize,
    /// `router_aux_loss_coef`.
    pub aux_coef: f64,
    /// `router_bias_update_rate`.
    pub bias_rate: f64,
    /// The shared experts' width on this rank (`n_shared_experts · Fe / tp`; 0: none).
    pub shared_local: usize,
    /// Ranks the experts are split over (`[parallel] ep`), and this rank's place among them.
    pub ep: usize,
    pub ep_rank: usize,
}

impl MoeDims {
    /// Experts each rank of the `ep` group holds.
    pub fn local_count(&self) -> usize {
        self.router.experts / self.ep
    }

    /// The experts this rank holds (global indices).
    pub fn local_experts(&self) -> std::ops::Range<usize> {
        let n = self.local_count();
        self.ep_rank * n..(self.ep_rank + 1) * n
    }
}

/// How tensor parallelism cuts a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpSplit {
    /// Every tp rank holds the whole tensor (norm weights).
    Replicated,
    /// Split by rows (output features; the vocabulary, padded to a multiple of `tp`).
    Rows,
    /// Split by columns (input features).
    Cols,
}

/// Name, shapes and kind of one parameter tensor, and which piece of it this rank holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    /// The shape this rank holds.
    pub shape: Vec<usize>,
    /// The logical (Hugging Face) shape.
    pub global_shape: Vec<usize>,
    pub kind: ParamKind,
    pub split: TpSplit,
    pub tp_rank: usize,
    /// A replicated tensor that acts on this rank's heads only (`q_norm`, `k_norm`): each tp
    /// rank's gradient is a partial sum over the heads, to be summed over `tp` whether or not
    /// the sequence is split.
    pub per_head: bool,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// AdamW decays 2-D weights only.
    pub fn decayed(&self) -> bool {
        self.kind != ParamKind::Norm
    }

    /// Row-major index in the logical tensor of local element `local`; `None` for a padding
    /// row of the vocabulary.
    pub fn global_index(&self, local: usize) -> Option<usize> {
        let cols = self.shape.get(1).copied().unwrap_or(1);
        let (row, col) = (local / cols, local % cols);
        let gcols = self.global_shape.get(1).copied().unwrap_or(1);
        match self.split {
            TpSplit::Replicated => Some(local),
            TpSplit::Rows => {
                let grow = self.tp_rank * self.shape[0] + row;
                (grow < self.global_shape[0]).then_some(grow * gcols + col)
            }
            TpSplit::Cols => Some(row * gcols + self.tp_rank * cols + col),
        }
    }
}

/// Every parameter of the whole model in a fixed order (the order of `tensors()`).
pub fn param_specs(cfg: &ModelCfg) -> Vec<ParamSpec> {
    param_specs_local(&Dims::full(cfg))
}

/// Every parameter as this tp rank holds it, in the order of `tensors()`.
pub fn param_specs_local(m: &Dims) -> Vec<ParamSpec> {
    let (d, tp) = (m.d, m.tp);
    let (q, kv, f) = (m.heads_local * m.hd, m.kv_heads_local * m.hd, m.ffn_local);
    let vg = m.vocab;
    let spec = |name: String, shape: Vec<usize>, split: TpSplit, kind| {
        let global_shape = match split {
            TpSplit::Replicated => shape.clone(),
            TpSplit::Rows if name.contains("embed_tokens") || name.starts_with("lm_head") => vec![vg, shape[1]],
            TpSplit::Rows => vec![shape[0] * tp, shape[1]],
            TpSplit::Cols => vec![shape[0], shape[1] * tp],
        };
        ParamSpec { name, shape, global_shape, kind, split, tp_rank: m.tp_rank, per_head: false }
    };
    use TpSplit::*;
    let mut out = vec![];
    if m.holds_embedding() {
        out.push(spec("model.embed_tokens.weight".into(), vec![m.vocab_local, d], Rows, ParamKind::Matrix));
    }
    for &i in &m.layer_ids {
        let p = format!("model.layers.{i}.");
        out.push(spec(format!("{p}input_layernorm.weight"), vec![d], Replicated, ParamKind::Norm));
        out.push(spec(format!("{p}self_attn.q_proj.weight"), vec![q, d], Rows, ParamKind::Matrix));
        out.push(spec(format!("{p}self_attn.k_proj.weight"), vec![kv, d], Rows, ParamKind::Matrix));
        out.push(spec(format!("{p}self_attn.v_proj.weight"), vec![kv, d], Rows, ParamKind::Matrix));
        out.push(spec(format!("{p}self_attn.o_proj.weight"), vec![d, q], Cols, ParamKind::ResidualMatrix));
        if m.qk_norm {
            for which in ["q_norm", "k_norm"] {
                let norm = spec(format!("{p}self_attn.{which}.weight"), vec![m.hd], Replicated, ParamKind::Norm);
                out.push(ParamSpec { per_head: true, ..norm });
            }
        }
        out.push(spec(format!("{p}post_attention_layernorm.weight"), vec![d], Replicated, ParamKind::Norm));
        match m.moe.as_ref().filter(|_| m.moe_layer(i)) {
            Some(e) => {
                let (n, fe, fs) = (e.router.experts, e.ffn, e.shared_local);
                if fs > 0 {
                    // DeepSeek's names; one FFN cut over tp like the dense MLP.
                    let x = format!("{p}mlp.shared_experts.");
                    out.push(spec(format!("{x}gate_proj.weight"), vec![fs, d], Rows, ParamKind::Matrix));
                    out.push(spec(format!("{x}up_proj.weight"), vec![fs, d], Rows, ParamKind::Matrix));
                    out.push(spec(format!("{x}down_proj.weight"), vec![d, fs], Cols, ParamKind::ResidualMatrix));
                }
                out.push(spec(format!("{p}mlp.gate.weight"), vec![n, d], Replicated, ParamKind::Matrix));
                for j in e.local_experts() {
                    let x = format!("{p}mlp.experts.{j}.");
                    out.push(spec(format!("{x}gate_proj.weight"), vec![fe, d], Replicated, ParamKind::Matrix));
                    out.push(spec(format!("{x}up_proj.weight"), vec![fe, d], Replicated, ParamKind::Matrix));
                    out.push(spec(format!("{x}down_proj.weight"), vec![d, fe], Replicated, ParamKind::ResidualMatrix));
                }
            }
            None => {
                out.push(spec(format!("{p}mlp.gate_proj.weight"), vec![f, d], Rows, ParamKind::Matrix));
                out.push(spec(format!("{p}mlp.up_proj.weight"), vec![f, d], Rows, ParamKind::Matrix));
                out.push(spec(format!("{p}mlp.down_proj.weight"), vec![d, f], Cols, ParamKind::ResidualMatrix));
            }
        }
    }
    if m.head {
        out.push(spec("model.norm.weight".into(), vec![d], Replicated, ParamKind::Norm));
        if !m.tie {
            out.push(spec("lm_head.weight".into(), vec![m.vocab_local, d], Rows, ParamKind::Matrix));
        }
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

/// Fills `out` with the initial values of local elements `first..first + out.len()` of the
/// piece `spec` describes (in parallel; the same values as [`init_value`]).
pub fn init_fill<T: Real>(seed: u64, spec: &ParamSpec, n_layers: usize, first: usize, out: &mut [T]) {
    use rayon::prelude::*;
    let stream = rng::stream_id(&spec.name);
    let std = init_std(spec.kind, n_layers);
    out.par_chunks_mut(4096).enumerate().for_each(|(c, chunk)| {
        for (i, x) in chunk.iter_mut().enumerate() {
            let local = first + c * 4096 + i;
            *x = T::from_f64(match (spec.global_index(local), spec.kind) {
                (None, _) => 0.0,
                (Some(_), ParamKind::Norm) => 1.0,
                (Some(g), _) => std * rng::normal(seed, stream, g as u64),
            });
        }
    });
}

/// Initial value of local element `local` (row-major, of the piece `spec` describes).
///
/// Depends only on `(seed, name, index in the logical tensor)`, so any shard of any layout
/// generates its own piece; vocabulary padding rows are 0.
pub fn init_value(seed: u64, spec: &ParamSpec, n_layers: usize, local: u64) -> f64 {
    let Some(index) = spec.global_index(local as usize) else { return 0.0 };
    match spec.kind {
        ParamKind::Norm => 1.0,
        k => init_std(k, n_layers) * rng::normal(seed, rng::stream_id(&spec.name), index as u64),
    }
}

impl<T: Real> LayerParams<T> {
    /// Block `layer` (its global index) in this rank's shapes, all zero.
    pub fn zeros(m: &Dims, layer: usize) -> Self {
        Layer::alloc(m, layer, |n| vec![T::ZERO; n])
    }
}

impl<V> Layer<V> {
    /// Block `layer` (its global index: dense or a mixture of experts) in this rank's shapes,
    /// each tensor from `alloc(elements)` (host vectors, or a backend's buffers).
    pub fn alloc(m: &Dims, layer: usize, mut alloc: impl FnMut(usize) -> V) -> Self {
        let moe = m.moe.as_ref().filter(|_| m.moe_layer(layer));
        let (d, f) = (m.d, m.mlp_width(layer));
        let (q, kv) = (m.heads_local * m.hd, m.kv_heads_local * m.hd);
        Layer {
            input_layernorm: alloc(d),
            q_proj: alloc(q * d),
            k_proj: alloc(kv * d),
            v_proj: alloc(kv * d),
            o_proj: alloc(d * q),
            q_norm: m.qk_norm.then(|| alloc(m.hd)),
            k_norm: m.qk_norm.then(|| alloc(m.hd)),
            post_attention_layernorm: alloc(d),
            gate_proj: alloc(f * d),
            up_proj: alloc(f * d),
            down_proj: alloc(d * f),
            moe: moe.map(|e| Experts {
                gate: alloc(e.router.experts * d),
                experts: e
                    .local_experts()
                    .map(|_| Expert { gate_proj: alloc(e.ffn * d), up_proj: alloc(e.ffn * d), down_proj: alloc(d * e.ffn) })
                    .collect(),
                shared: e.shared_local > 0,
            }),
        }
    }

    /// Whether this block holds the same kind of MLP as block `layer` of `m` (a buffer of one
    /// can hold the other).
    pub fn fits(&self, m: &Dims, layer: usize) -> bool {
        self.moe.is_some() == m.moe_layer(layer)
    }

    /// The block's tensors in `param_specs` order.
    pub fn tensors(&self) -> Vec<&V> {
        let mut out = vec![&self.input_layernorm, &self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj];
        out.extend(self.q_norm.iter().chain(&self.k_norm));
        out.push(&self.post_attention_layernorm);
        if self.moe.as_ref().is_none_or(|e| e.shared) {
            out.extend([&self.gate_proj, &self.up_proj, &self.down_proj]);
        }
        out.extend(self.moe.iter().flat_map(|e| e.tensors()));
        out
    }

    /// [`Layer::tensors`], mutably.
    pub fn tensors_mut(&mut self) -> Vec<&mut V> {
        let mut out = vec![&mut self.input_layernorm, &mut self.q_proj, &mut self.k_proj, &mut self.v_proj, &mut self.o_proj];
        out.extend(self.q_norm.iter_mut().chain(&mut self.k_norm));
        out.push(&mut self.post_attention_layernorm);
        if self.moe.as_ref().is_none_or(|e| e.shared) {
            out.extend([&mut self.gate_proj, &mut self.up_proj, &mut self.down_proj]);
        }
        out.extend(self.moe.iter_mut().flat_map(|e| e.tensors_mut()));
        out
    }

    /// The same block with `f` applied to every tensor (e.g. copied to a device).
    pub fn map<W>(&self, mut f: impl FnMut(&V) -> W) -> Layer<W> {
        Layer {
            input_layernorm: f(&self.input_layernorm),
            q_proj: f(&self.q_proj),
            k_proj: f(&self.k_proj),
            v_proj: f(&self.v_proj),
            o_proj: f(&self.o_proj),
            q_norm: self.q_norm.as_ref().map(&mut f),
            k_norm: self.k_norm.as_ref().map(&mut f),
            post_attention_layernorm: f(&self.post_attention_layernorm),
            gate_proj: f(&self.gate_proj),
            up_proj: f(&self.up_proj),
            down_proj: f(&self.down_proj),
            moe: self.moe.as_ref().map(|e| e.map(&mut f)),
        }
    }
}

impl<V> Params<V> {
    /// This rank's tensors (`m.layers` blocks), each from `alloc(elements)` (host vectors, or
    /// a backend's buffers). A pipeline stage's tensors outside its pieces are empty.
    pub fn alloc(m: &Dims, mut alloc: impl FnMut(usize) -> V) -> Self {
        let (v, d) = (m.vocab_local, m.d);
        let (e, h) = (m.holds_embedding() as usize, m.head as usize);
        Params {
            embed_tokens: alloc(e * v * d),
            layers: m.layer_ids.iter().map(|&i| Layer::alloc(m, i, &mut alloc)).collect(),
            norm: alloc(h * d),
            lm_head: if m.tie { None } else { Some(alloc(h * v * d)) },
        }
    }

    /// The tensors outside the blocks that `m` holds, in `param_specs_local` order.
    pub fn globals_mut(&mut self, m: &Dims) -> Vec<&mut V> {
        let mut v = vec![];
        if m.holds_embedding() {
            v.push(&mut self.embed_tokens);
        }
        if m.head {
            v.push(&mut self.norm);
            if let Some(h) = self.lm_head.as_mut() {
                v.push(h);
            }
        }
        v
    }

    /// [`Params::globals_mut`], read-only.
    pub fn globals(&self, m: &Dims) -> Vec<&V> {
        let mut v = vec![];
        if m.holds_embedding() {
            v.push(&self.embed_tokens);
        }
        if m.head {
            v.push(&self.norm);
            if let Some(h) = self.lm_head.as_ref() {
                v.push(h);
            }
        }
        v
    }

    /// Every tensor in `param_specs` order.
    pub fn tensors(&self) -> Vec<&V> {
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
    pub fn tensors_mut(&mut self) -> Vec<&mut V> {
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
    pub fn output_weight(&self) -> &V {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// The same model with `f` applied to every tensor (e.g. copied to a device).
    pub fn map<W>(&self, mut f: impl FnMut(&V) -> W) -> Params<W> {
        Params {
            embed_tokens: f(&self.embed_tokens),
            layers: self.layers.iter().map(|l| l.map(&mut f)).collect(),
            norm: f(&self.norm),
            lm_head: self.lm_head.as_ref().map(&mut f),
        }
    }
}

impl<T: Real> ModelParams<T> {
    /// All tensors zero (the shape of gradients and optimiser moments).
    pub fn zeros(cfg: &ModelCfg) -> Self {
        Self::zeros_local(&Dims::full(cfg))
    }

    /// All tensors zero, in this rank's (TP-local) shapes.
    pub fn zeros_local(m: &Dims) -> Self {
        Params::alloc(m, |n| vec![T::ZERO; n])
    }

    /// The seeded, layout-independent initial model (`docs/model.md`).
    pub fn init(cfg: &ModelCfg, seed: u64) -> Self {
        Self::init_local(&Dims::full(cfg), seed)
    }

    /// This tp rank's piece of the initial model.
    pub fn init_local(m: &Dims, seed: u64) -> Self {
        let mut p = Self::zeros_local(m);
        let specs = param_specs_local(m);
        for (spec, t) in specs.iter().zip(p.tensors_mut()) {
            init_fill(seed, spec, m.n_layers, 0, t);
        }
        p
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
