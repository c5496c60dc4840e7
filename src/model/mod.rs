//! The Llama-style decoder written as one-rank maths: parameters, kernels, forward, backward.
//!
//! `Model<T>` owns the activations of one micro-batch; the weights (`ModelParams`) are passed
//! in, so a parallel strategy decides where they come from (local, gathered, sharded) without
//! this module knowing. Forward and backward are hand-written (llm.c style), side by side per
//! block. Activation checkpointing recomputes in backward, with the forward's own code (so the
//! results are bit-identical), either the whole block from its saved input (`full`) or only the
//! cheap elementwise outputs from the saved GEMM and attention outputs (`selective`). Either way
//! the last block is not recomputed: its activations are still in the recompute scratch.
//!
//! Legend: `B` micro-batch, `S` sequence, `N = B·S` tokens, `D` width, `H` query heads,
//! `KV` kv heads, `hd` head dim, `F` ffn hidden, `V` vocab.

pub mod attention;
pub mod kernels;
pub mod params;

use crate::config::{ActCkpt, ModelCfg};
use crate::real::{linear_bwd_input, linear_bwd_weight, linear_fwd, Real};
use attention::{attention_bwd, attention_fwd, merge_partial, zigzag_positions, AttnDims};
use kernels::*;
use params::{Dims, LayerParams, ModelParams};

/// The tensors outside the blocks, as the model reads them.
pub struct Globals<'a, T> {
    pub embed_tokens: &'a [T], // [V, D]
    pub norm: &'a [T],         // [D]
    /// `lm_head`, or `embed_tokens` when tied.
    pub output: &'a [T], // [V, D]
}

/// The gradients of the tensors outside the blocks.
pub struct GlobalsMut<'a, T> {
    pub embed_tokens: &'a mut [T],    // [V, D]
    pub norm: &'a mut [T],            // [D]
    pub lm_head: Option<&'a mut [T]>, // [V, D]; None when tied (its gradient joins embed_tokens')
}

/// Where the weights come from during a pass: held whole, or gathered block by block from
/// shards. The model asks for a block right before it uses it and says when it is done.
pub trait WeightSource<T> {
    fn globals(&self) -> Globals<'_, T>;
    /// Block `l`'s weights, ready to use.
    fn block(&mut self, l: usize) -> &LayerParams<T>;
    /// Block `l` is not needed until it is asked for again.
    fn block_done(&mut self, _l: usize) {}
}

/// Where the gradients go during backward. The model accumulates (`+=`) into what it is
/// handed and reports when a block's (and finally the global tensors') gradients of this
/// micro-batch are complete, so a parallel strategy can start reducing them.
pub trait GradSink<T> {
    fn globals_mut(&mut self) -> GlobalsMut<'_, T>;
    fn block_mut(&mut self, l: usize) -> &mut LayerParams<T>;
    fn block_done(&mut self, _l: usize) {}
    fn globals_done(&mut self) {}
}

impl<T: Real> WeightSource<T> for &ModelParams<T> {
    fn globals(&self) -> Globals<'_, T> {
        Globals { embed_tokens: &self.embed_tokens, norm: &self.norm, output: self.output_weight() }
    }
    fn block(&mut self, l: usize) -> &LayerParams<T> {
        &self.layers[l]
    }
}

impl<T: Real> GradSink<T> for ModelParams<T> {
    fn globals_mut(&mut self) -> GlobalsMut<'_, T> {
        GlobalsMut { embed_tokens: &mut self.embed_tokens, norm: &mut self.norm, lm_head: self.lm_head.as_deref_mut() }
    }
    fn block_mut(&mut self, l: usize) -> &mut LayerParams<T> {
        &mut self.layers[l]
    }
}

/// The tensor-parallel collectives the model calls, over the `tp` group. Each call site in the
/// model names its backward conjugate.
pub trait TpComm<T> {
    fn all_reduce_sum(&self, buf: &mut [T]);
    fn all_reduce_max(&self, buf: &mut [T]);
    /// `recv = [send of tp rank 0, send of tp rank 1, …]`.
    fn all_gather(&self, send: &[T], recv: &mut [T]);
    /// Sums `send` (`[tp][recv.len()]`) across tp; this rank's block lands in `recv`.
    fn reduce_scatter_sum(&self, send: &[T], recv: &mut [T]);
}

/// One rank holds every head and the whole vocabulary: the collectives are identities.
pub struct NoTp;

impl<T: Copy> TpComm<T> for NoTp {
    fn all_reduce_sum(&self, _buf: &mut [T]) {}
    fn all_reduce_max(&self, _buf: &mut [T]) {}
    fn all_gather(&self, send: &[T], recv: &mut [T]) {
        recv.copy_from_slice(send);
    }
    fn reduce_scatter_sum(&self, send: &[T], recv: &mut [T]) {
        recv.copy_from_slice(send);
    }
}

/// The context-parallel ring the attention uses, over the `cp` group.
pub trait RingComm<T> {
    fn degree(&self) -> usize;
    fn rank(&self) -> usize;
    /// Starts sending a copy of `buf` to the next rank of the ring (exchange `slot`); the
    /// caller may keep computing on `buf`.
    fn start_shift(&self, slot: usize, buf: &[T]);
    /// Completes exchange `slot`: `buf` becomes the previous rank's block.
    fn finish_shift(&self, slot: usize, buf: &mut [T]);
}

/// One rank holds the whole sequence: no ring.
pub struct NoCp;

impl<T> RingComm<T> for NoCp {
    fn degree(&self) -> usize {
        1
    }
    fn rank(&self) -> usize {
        0
    }
    // A ring of one rank returns each block to itself.
    fn start_shift(&self, _slot: usize, _buf: &[T]) {}
    fn finish_shift(&self, _slot: usize, _buf: &mut [T]) {}
}

/// Ring exchange slots (MPI tags): the key/value block and its gradient travel concurrently.
const RING_KV: usize = 1;
const RING_DKV: usize = 2;

/// The model's communication: tensor-parallel collectives and the context-parallel ring.
#[derive(Clone, Copy)]
pub struct Par<'a, T> {
    pub tp: &'a dyn TpComm<T>,
    pub cp: &'a dyn RingComm<T>,
}

impl<T: Copy> Par<'static, T> {
    /// One rank: every collective is the identity.
    pub fn single() -> Self {
        Par { tp: &NoTp, cp: &NoCp }
    }
}

/// How rows of the residual stream meet the tensor-parallel projections. Without sequence
/// parallelism every tp rank holds all `N` rows: a column-parallel projection reads them as they
/// are, and a row-parallel projection's partial output is all-reduced. With it, a rank holds
/// `N/T` rows: they are all-gathered before a column-parallel projection and the partial output
/// is reduce-scattered back (each is the other's backward conjugate).
#[derive(Clone, Copy)]
struct Seq<'a, T> {
    sp: bool,
    tp: &'a dyn TpComm<T>,
}

impl<'a, T: Real> Seq<'a, T> {
    /// The whole `[N, ·]` rows for a column-parallel projection (backward of a row-parallel
    /// output too): all-gathered into `full` with SP, `local` itself without.
    fn gather<'b>(&self, local: &'b [T], full: &'b mut [T]) -> &'b [T] {
        if self.sp {
            self.tp.all_gather(local, full);
            full
        } else {
            local
        }
    }

    /// Where a partial sum across tp ranks is computed: the whole-row scratch with SP, the
    /// rank's rows themselves without.
    fn partial<'b>(&self, local: &'b mut [T], full: &'b mut [T]) -> &'b mut [T] {
        if self.sp {
            full
        } else {
            local
        }
    }

    /// Completes a partial sum into the rank's rows: reduce-scatter with SP (conjugate:
    /// all-gather), all-reduce without (conjugate: identity).
    fn finish(&self, local: &mut [T], full: &[T]) {
        if self.sp {
            self.tp.reduce_scatter_sum(full, local);
        } else {
            self.tp.all_reduce_sum(local);
        }
    }
}

/// The tokens of one micro-batch.
#[derive(Clone, Copy, Debug)]
pub struct Tokens<'a> {
    pub inputs: &'a [u32],      // [B*S]
    pub targets: &'a [u32],     // [B*S]
    pub positions: &'a [usize], // [S] global positions of this rank's tokens
    pub batch: usize,
    pub seq: usize,
}

/// What one block keeps from forward for backward.
#[derive(Default)]
struct BlockActs<T> {
    x: Vec<T>,       // [N, D] block input
    rstd1: Vec<T>,   // [N]
    xn1: Vec<T>,     // [N, D]
    q: Vec<T>,       // [B, H, S, hd] after RoPE
    k: Vec<T>,       // [B, KV, S, hd] after RoPE
    v: Vec<T>,       // [B, KV, S, hd]
    att: Vec<T>,     // [B, H, S, hd] attention output, head-major
    lse: Vec<T>,     // [B, H, S]
    att_tok: Vec<T>, // [N, H*hd] attention output, token-major (o_proj input)
    x1: Vec<T>,      // [N, D] after the attention residual
    rstd2: Vec<T>,   // [N]
    xn2: Vec<T>,     // [N, D]
    gate: Vec<T>,    // [N, F]
    up: Vec<T>,      // [N, F]
    h: Vec<T>,       // [N, F] silu(gate)·up
}

/// Which of [`BlockActs`]' fields (in declaration order) `selective` recomputes: xn1, att_tok,
/// xn2, h — each one elementwise pass over tensors that are kept.
const CHEAP_TO_RECOMPUTE: [usize; 4] = [2, 8, 11, 14];

/// Which activations a buffer holds: what forward keeps per block, or the recompute scratch.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ActsRole {
    Saved,
    Scratch,
}

impl<T: Real> BlockActs<T> {
    /// Element counts of every field, in declaration order: what `alloc` allocates and what
    /// the planner predicts (one function, so the two cannot drift apart).
    fn lens(m: &Dims, n: usize, nl: usize, ckpt: ActCkpt, role: ActsRole) -> [usize; 15] {
        let (d, f, hd) = (m.d, m.ffn, m.hd);
        let (qd, kvd) = (m.heads * hd, m.kv_heads * hd);
        let all = [nl * d, nl, nl * d, n * qd, n * kvd, n * kvd, n * qd, n * m.heads, n * qd, nl * d, nl, nl * d, n * f, n * f, n * f];
        let keep = |i: usize| match (ckpt, role) {
            (ActCkpt::None, ActsRole::Saved) | (ActCkpt::Full, ActsRole::Scratch) => true,
            (ActCkpt::None, ActsRole::Scratch) => false,
            (ActCkpt::Full, ActsRole::Saved) => i == 0,
            (ActCkpt::Selective, ActsRole::Saved) => !CHEAP_TO_RECOMPUTE.contains(&i),
            (ActCkpt::Selective, ActsRole::Scratch) => CHEAP_TO_RECOMPUTE.contains(&i),
        };
        std::array::from_fn(|i| if keep(i) { all[i] } else { 0 })
    }

    fn alloc(m: &Dims, n: usize, nl: usize, ckpt: ActCkpt, role: ActsRole) -> Self {
        let [x, rstd1, xn1, q, k, v, att, lse, att_tok, x1, rstd2, xn2, gate, up, h] =
            Self::lens(m, n, nl, ckpt, role).map(|len| vec![T::ZERO; len]);
        BlockActs { x, rstd1, xn1, q, k, v, att, lse, att_tok, x1, rstd2, xn2, gate, up, h }
    }

    /// Exchanges the fields `selective` recomputes (no copy: the buffers change hands).
    fn swap_cheap(&mut self, other: &mut Self) {
        std::mem::swap(&mut self.xn1, &mut other.xn1);
        std::mem::swap(&mut self.att_tok, &mut other.att_tok);
        std::mem::swap(&mut self.xn2, &mut other.xn2);
        std::mem::swap(&mut self.h, &mut other.h);
    }

    fn bytes(&self) -> usize {
        let v = [
            &self.x,
            &self.rstd1,
            &self.xn1,
            &self.q,
            &self.k,
            &self.v,
            &self.att,
            &self.lse,
            &self.att_tok,
            &self.x1,
            &self.rstd2,
            &self.xn2,
            &self.gate,
            &self.up,
            &self.h,
        ];
        v.iter().map(|t| t.len()).sum::<usize>() * std::mem::size_of::<T>()
    }
}

/// Gradient buffers of one block's backward, reused across layers.
#[derive(Default)]
struct BlockGrads<T> {
    dx1: Vec<T>,    // [N_local, D]
    dxn: Vec<T>,    // [N_local, D]
    full_a: Vec<T>, // [N, D] gathered rows (sequence parallelism only)
    full_b: Vec<T>, // [N, D] partial sums before reduce-scatter (sequence parallelism only)
    // Context parallelism only: the key/value block travelling around the ring and its
    // gradient, one block's partial attention output and log-sum-exp, and dq of one block.
    ring_kv: Vec<T>,  // [2, B, KV, S, hd]
    ring_dkv: Vec<T>, // [2, B, KV, S, hd]
    o_part: Vec<T>,   // [B, H, S, hd]
    lse_part: Vec<T>, // [B, H, S]
    dh: Vec<T>,       // [N, F]
    dgate: Vec<T>,    // [N, F]
    dup: Vec<T>,      // [N, F]
    d_tok: Vec<T>,    // [N, H*hd] token-major gradient (att_tok, then q)
    dkv_tok: Vec<T>,  // [N, KV*hd]
    datt: Vec<T>,     // [B, H, S, hd]
    dq: Vec<T>,       // [B, H, S, hd]
    dk: Vec<T>,       // [B, KV, S, hd]
    dv: Vec<T>,       // [B, KV, S, hd]
    // Projection outputs before the head-major transpose (forward scratch).
    q_tok: Vec<T>,  // [N, H*hd]
    kv_tok: Vec<T>, // [N, KV*hd]
}

impl<T: Real> BlockGrads<T> {
    /// Element counts of every field, in declaration order (see [`BlockActs::lens`]).
    fn lens(m: &Dims, n: usize, nl: usize, sp: bool, cp: bool) -> [usize; 19] {
        let (d, f, hd) = (m.d, m.ffn, m.hd);
        let (qd, kvd) = (m.heads * hd, m.kv_heads * hd);
        let full = if sp { n * d } else { 0 };
        let ring = |len: usize| if cp { len } else { 0 };
        [
            nl * d,
            nl * d,
            full,
            full,
            ring(2 * n * kvd),
            ring(2 * n * kvd),
            ring(n * qd),
            ring(n * m.heads),
            n * f,
            n * f,
            n * f,
            n * qd,
            n * kvd,
            n * qd,
            n * qd,
            n * kvd,
            n * kvd,
            n * qd,
            n * kvd,
        ]
    }

    fn alloc(m: &Dims, n: usize, nl: usize, sp: bool, cp: bool) -> Self {
        let [dx1, dxn, full_a, full_b, ring_kv, ring_dkv, o_part, lse_part, dh, dgate, dup, d_tok, dkv_tok, datt, dq, dk, dv, q_tok, kv_tok] =
            Self::lens(m, n, nl, sp, cp).map(|len| vec![T::ZERO; len]);
        BlockGrads {
            dx1,
            dxn,
            full_a,
            full_b,
            ring_kv,
            ring_dkv,
            o_part,
            lse_part,
            dh,
            dgate,
            dup,
            d_tok,
            dkv_tok,
            datt,
            dq,
            dk,
            dv,
            q_tok,
            kv_tok,
        }
    }
}

/// The buffers a [`Model`] allocates for micro-batches of `B × S` tokens, in bytes of `f32`, by
/// what they hold. `activations()` is what [`Model::activation_bytes`] reports once the buffers
/// exist; the planner predicts memory from this without allocating anything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActivationMemory {
    /// What forward keeps for backward: every block's activations (`none`), inputs (`full`),
    /// or all but the cheap elementwise outputs (`selective`).
    pub saved: usize,
    /// One block's recomputed activations: all of them (`full`) or the cheap ones (`selective`).
    pub recompute: usize,
    /// The logits `[N, V_local]` (the logit gradients overwrite them).
    pub logits: usize,
    /// The final norm's input, output and statistics, the loss's log-sum-exp.
    pub head: usize,
    /// Gradient buffers of one block's backward (reused across blocks) and of the residual.
    pub backward: usize,
}

impl ActivationMemory {
    /// Held between forward and backward (the measured `activation_bytes`).
    pub fn activations(&self) -> usize {
        self.saved + self.recompute + self.logits + self.head
    }

    pub fn total(&self) -> usize {
        self.activations() + self.backward
    }
}

/// The decoder and the activations of its last forward.
pub struct Model<T> {
    m: Dims,
    /// Causally visible (query, key) pairs this rank's attention has processed, over all heads
    /// and blocks, since the last `take_attention_pairs` (shows the context-parallel balance).
    attn_pairs: u64,
    /// Context-parallel degree: this rank holds `S/cp` tokens of each sequence.
    cp: usize,
    /// Sequence parallelism: the residual stream and the norms hold `N/T` rows per tp rank.
    sp: bool,
    ckpt: ActCkpt,
    /// (B, S) the buffers are sized for.
    bs: (usize, usize),
    positions: Vec<usize>,
    targets: Vec<u32>,
    inputs: Vec<u32>,
    rope_cos: Vec<T>, // [S, hd/2]
    rope_sin: Vec<T>, // [S, hd/2]
    /// Per layer: what forward keeps for backward (see [`ActCkpt`]).
    saved: Vec<BlockActs<T>>,
    /// One block's recomputed activations (`full`: all; `selective`: the cheap ones).
    scratch: BlockActs<T>,
    /// The scratch holds the last block's activations from the last forward (backward starts
    /// with that block and need not recompute it).
    scratch_is_last_block: bool,
    grads: BlockGrads<T>,
    x_final: Vec<T>,   // [N_local, D] output of the last block
    rstd_f: Vec<T>,    // [N_local]
    xf: Vec<T>,        // [N_local, D] after the final norm
    xf_full: Vec<T>,   // [N, D] gathered final-norm output (sequence parallelism only)
    logits: Vec<T>,    // [N, V_local]; dlogits in place after backward
    lse_ce: Vec<T>,    // [N] log-sum-exp of each logits row (over the whole vocabulary)
    ce_max: Vec<T>,    // [N] row maxima (scratch)
    ce_target: Vec<T>, // [N] target logits (scratch)
    dx: Vec<T>,        // [N_local, D] gradient of the residual stream
}

impl<T: Real> Model<T> {
    /// The whole model on one rank.
    pub fn new(cfg: &ModelCfg, ckpt: ActCkpt) -> Self {
        Self::new_local(Dims::full(cfg), ckpt, false)
    }

    /// One tensor-parallel rank's piece of the model (`Dims::new(cfg, tp, tp_rank)`), with or
    /// without sequence parallelism.
    pub fn new_local(m: Dims, ckpt: ActCkpt, sequence_parallel: bool) -> Self {
        Model {
            m,
            attn_pairs: 0,
            cp: 1,
            sp: sequence_parallel,
            xf_full: vec![],
            ce_max: vec![],
            ce_target: vec![],
            ckpt,
            bs: (0, 0),
            positions: vec![],
            targets: vec![],
            inputs: vec![],
            rope_cos: vec![],
            rope_sin: vec![],
            saved: vec![],
            scratch: BlockActs::default(),
            scratch_is_last_block: false,
            grads: BlockGrads::default(),
            x_final: vec![],
            rstd_f: vec![],
            xf: vec![],
            logits: vec![],
            lse_ce: vec![],
            dx: vec![],
        }
    }

    /// What [`Model::ensure_buffers`] allocates for `B × S` tokens per rank, without allocating.
    pub fn memory(m: &Dims, b: usize, s: usize, ckpt: ActCkpt, sequence_parallel: bool, cp: usize) -> ActivationMemory {
        let n = b * s;
        let nl = if sequence_parallel { n / m.tp } else { n };
        let acts = |role| BlockActs::<f32>::lens(m, n, nl, ckpt, role).iter().sum::<usize>();
        let grads: usize = BlockGrads::<f32>::lens(m, n, nl, sequence_parallel, cp > 1).iter().sum();
        let head = nl * m.d + nl + nl * m.d + if sequence_parallel { n * m.d } else { 0 } + n;
        ActivationMemory {
            saved: 4 * m.layers * acts(ActsRole::Saved),
            recompute: 4 * acts(ActsRole::Scratch),
            logits: 4 * n * m.vocab,
            head: 4 * head,
            // Block gradients, the residual's gradient, and the loss's two row scratches.
            backward: 4 * (grads + nl * m.d + 2 * n),
        }
    }

    fn ensure_buffers(&mut self, b: usize, s: usize) {
        if self.bs == (b, s) {
            return;
        }
        let n = b * s;
        assert!(!self.sp || n % self.m.tp == 0, "sequence parallelism needs B·S divisible by tp");
        let nl = if self.sp { n / self.m.tp } else { n };
        let (d, v) = (self.m.d, self.m.vocab);
        self.saved = (0..self.m.layers).map(|_| BlockActs::alloc(&self.m, n, nl, self.ckpt, ActsRole::Saved)).collect();
        self.scratch = BlockActs::alloc(&self.m, n, nl, self.ckpt, ActsRole::Scratch);
        self.scratch_is_last_block = false;
        self.grads = BlockGrads::alloc(&self.m, n, nl, self.sp, self.cp > 1);
        self.ce_max = vec![T::ZERO; n];
        self.ce_target = vec![T::ZERO; n];
        self.x_final = vec![T::ZERO; nl * d];
        self.rstd_f = vec![T::ZERO; nl];
        self.xf = vec![T::ZERO; nl * d];
        self.xf_full = vec![T::ZERO; if self.sp { n * d } else { 0 }];
        self.logits = vec![T::ZERO; n * v];
        self.lse_ce = vec![T::ZERO; n];
        self.dx = vec![T::ZERO; nl * d];
        self.bs = (b, s);
    }

    /// Visible (query, key) pairs processed by attention forwards since the last call.
    pub fn take_attention_pairs(&mut self) -> u64 {
        std::mem::take(&mut self.attn_pairs)
    }

    /// Runs under context parallelism of degree `cp` (the ring's scratch is allocated for it).
    pub fn with_context_parallel(mut self, cp: usize) -> Self {
        self.cp = cp;
        self.bs = (0, 0);
        self
    }

    /// Bytes of activation memory this model holds between forward and backward (saved
    /// activations, recompute scratch, logits); the backward's gradient buffers are excluded.
    pub fn activation_bytes(&self) -> usize {
        let per = |v: &Vec<T>| v.len() * std::mem::size_of::<T>();
        self.saved.iter().map(|a| a.bytes()).sum::<usize>()
            + self.scratch.bytes()
            + per(&self.x_final)
            + per(&self.rstd_f)
            + per(&self.xf)
            + per(&self.xf_full)
            + per(&self.logits)
            + per(&self.lse_ce)
    }

    /// Logits `[N, V_local]` of the last forward (before backward overwrites them).
    pub fn logits(&self) -> &[T] {
        &self.logits
    }

    /// Forward of one micro-batch with weights held whole. Returns the SUM over its tokens of
    /// the cross-entropy loss.
    pub fn forward(&mut self, params: &ModelParams<T>, tok: &Tokens) -> f64 {
        self.forward_with(&mut &*params, tok, Par::single())
    }

    /// Backward of the last forward with weights and gradients held whole; ACCUMULATES (`+=`)
    /// into `grads`. `loss_scale` is `dloss/dloss_token` (1 / the global number of targets).
    pub fn backward(&mut self, params: &ModelParams<T>, grads: &mut ModelParams<T>, loss_scale: T) {
        self.backward_with(&mut &*params, grads, loss_scale, Par::single())
    }

    /// Forward of one micro-batch, asking `w` for each block's weights when it needs them.
    /// Returns the SUM over its tokens of the cross-entropy loss.
    /// Tensor-parallel collectives and the context-parallel ring go through `par`
    /// (`Par::single()` on one rank). `tok.positions` are the global positions of this rank's
    /// tokens (the zigzag chunks under context parallelism).
    pub fn forward_with<W: WeightSource<T>>(&mut self, w: &mut W, tok: &Tokens, par: Par<'_, T>) -> f64 {
        let tp = par.tp;
        let (b, s) = (tok.batch, tok.seq);
        assert_eq!(tok.inputs.len(), b * s, "inputs must be [B*S]");
        assert_eq!(tok.targets.len(), b * s, "targets must be [B*S]");
        assert_eq!(tok.positions.len(), s, "positions must be [S]");
        self.ensure_buffers(b, s);
        if self.positions != tok.positions {
            let (c, sn) = rope_tables(tok.positions, self.m.hd, self.m.rope_theta);
            self.rope_cos = c;
            self.rope_sin = sn;
            self.positions = tok.positions.to_vec();
        }
        self.inputs.clear();
        self.inputs.extend_from_slice(tok.inputs);
        self.targets.clear();
        self.targets.extend_from_slice(tok.targets);
        let (d, v, nl) = (self.m.d, self.m.vocab, self.m.layers);
        let seq = Seq { sp: self.sp, tp };
        let ctx = BlockCtx { m: &self.m, cos: &self.rope_cos, sin: &self.rope_sin, pos: &self.positions, b, s, seq, cp: par.cp };

        // Vocab-parallel embedding: rows this rank holds, zero elsewhere, summed across tp
        // (into this rank's rows of the residual stream).
        let (off, valid) = (self.m.vocab_offset, self.m.vocab_valid());
        let x0 = if nl > 0 { &mut self.saved[0].x } else { &mut self.x_final };
        let partial = seq.partial(x0, &mut self.grads.full_b);
        let embed = w.globals().embed_tokens;
        for (row, &t) in partial.chunks_mut(d).zip(tok.inputs) {
            let local = (t as usize).wrapping_sub(off);
            if local < valid {
                row.copy_from_slice(&embed[local * d..][..d]);
            } else {
                row.iter_mut().for_each(|x| *x = T::ZERO);
            }
        }
        seq.finish(x0, &self.grads.full_b);
        for l in 0..nl {
            let (saved_l, rest) = self.saved[l..].split_first_mut().expect("layer exists");
            let out = match rest.first_mut() {
                Some(next) => &mut next.x,
                None => &mut self.x_final,
            };
            match self.ckpt {
                ActCkpt::None => block_fwd(&ctx, w.block(l), saved_l, &mut self.grads, Some(out)),
                ActCkpt::Full => {
                    self.scratch.x.copy_from_slice(&saved_l.x);
                    block_fwd(&ctx, w.block(l), &mut self.scratch, &mut self.grads, Some(out));
                }
                ActCkpt::Selective => {
                    // The cheap outputs are written into the scratch and not kept.
                    saved_l.swap_cheap(&mut self.scratch);
                    block_fwd(&ctx, w.block(l), saved_l, &mut self.grads, Some(out));
                    saved_l.swap_cheap(&mut self.scratch);
                }
            }
            w.block_done(l);
        }
        self.scratch_is_last_block = nl > 0;
        let seq_total = s * self.cp;
        let q_pos = &self.positions;
        let pairs: u64 = if self.cp == 1 {
            attention::visible_pairs(q_pos, q_pos)
        } else {
            (0..self.cp).map(|src| attention::visible_pairs(q_pos, &zigzag_positions(seq_total, self.cp, src))).sum()
        };
        self.attn_pairs += pairs * (b * self.m.heads * nl) as u64;
        let g = w.globals();
        // Final norm, output projection [N, V_local], vocab-parallel cross entropy: the row
        // maximum, the sum of exponentials and the target logit are each reduced across tp, so
        // the whole logits row never exists on one rank.
        rmsnorm_fwd(&mut self.xf, &mut self.rstd_f, &self.x_final, g.norm, d, self.m.norm_eps);
        let xf = seq.gather(&self.xf, &mut self.xf_full);
        linear_fwd(&mut self.logits, xf, g.output, b * s, v, d, false);
        row_max(&mut self.ce_max, &self.logits, v, valid);
        tp.all_reduce_max(&mut self.ce_max);
        row_sum_exp(&mut self.lse_ce, &self.logits, &self.ce_max, v, valid);
        tp.all_reduce_sum(&mut self.lse_ce);
        target_logit(&mut self.ce_target, &self.logits, &self.targets, v, off, valid);
        tp.all_reduce_sum(&mut self.ce_target);
        let mut loss = 0.0f64;
        for ((lse, &m), &t) in self.lse_ce.iter_mut().zip(&self.ce_max).zip(&self.ce_target) {
            *lse = m + lse.ln();
            loss += (*lse - t).to_f64();
        }
        loss
    }

    /// Backward of the last forward, with `dloss/dloss_token = loss_scale` for every token.
    /// ACCUMULATES (`+=`) into the gradients `gs` hands out; tells `gs` when each block's and
    /// finally the global tensors' gradients of this micro-batch are complete.
    pub fn backward_with<W: WeightSource<T>, G: GradSink<T>>(&mut self, w: &mut W, gs: &mut G, loss_scale: T, par: Par<'_, T>) {
        let tp = par.tp;
        let (b, s) = self.bs;
        let n = b * s;
        let (d, v, nl) = (self.m.d, self.m.vocab, self.m.layers);
        let (off, valid) = (self.m.vocab_offset, self.m.vocab_valid());
        let seq = Seq { sp: self.sp, tp };
        let ctx = BlockCtx { m: &self.m, cos: &self.rope_cos, sin: &self.rope_sin, pos: &self.positions, b, s, seq, cp: par.cp };

        // Loss and output projection: dlogits = scale·(softmax − onehot) [N, V_local].
        cross_entropy_bwd_inplace(&mut self.logits, &self.lse_ce, &self.targets, v, off, valid, loss_scale);
        {
            let (g, dg) = (w.globals(), gs.globals_mut());
            let dw_out = match dg.lm_head {
                Some(h) => h,
                None => &mut *dg.embed_tokens,
            };
            let xf = if self.sp { &self.xf_full } else { &self.xf };
            linear_bwd_weight(dw_out, &self.logits, xf, n, v, d, true);
            // dxf [N_local, D]: the partial sums of every vocab shard, reduced across tp
            // (conjugate of the replicated / gathered xf feeding every shard).
            let dxf = &mut self.grads.dxn;
            linear_bwd_input(seq.partial(dxf, &mut self.grads.full_b), &self.logits, g.output, n, v, d, false);
            seq.finish(dxf, &self.grads.full_b);
            rmsnorm_bwd(&mut self.dx, dg.norm, dxf, &self.x_final, g.norm, &self.rstd_f, d, false);
        }

        for l in (0..nl).rev() {
            let wl = w.block(l);
            // The last block's activations are still in the scratch from forward.
            let recompute = !std::mem::take(&mut self.scratch_is_last_block);
            let acts = match self.ckpt {
                ActCkpt::None => &self.saved[l],
                ActCkpt::Full => {
                    // The block again from its saved input, with the forward's own code.
                    if recompute {
                        self.scratch.x.copy_from_slice(&self.saved[l].x);
                        block_fwd(&ctx, wl, &mut self.scratch, &mut self.grads, None);
                    }
                    &self.scratch
                }
                ActCkpt::Selective => {
                    let saved_l = &mut self.saved[l];
                    saved_l.swap_cheap(&mut self.scratch);
                    if recompute {
                        recompute_cheap(&ctx, wl, saved_l);
                    }
                    &self.saved[l]
                }
            };
            // dx: gradient w.r.t. the block output in, w.r.t. the block input out.
            block_bwd(&ctx, wl, gs.block_mut(l), acts, &mut self.grads, &mut self.dx);
            if self.ckpt == ActCkpt::Selective {
                self.saved[l].swap_cheap(&mut self.scratch);
            }
            w.block_done(l);
            gs.block_done(l);
        }
        // Embedding: dE[token[n]] += dx[n] for the vocabulary rows this rank holds (dx gathered
        // to all N rows: conjugate of the reduce-scatter after the lookup).
        let de = gs.globals_mut().embed_tokens;
        let dx = seq.gather(&self.dx, &mut self.grads.full_a);
        for (row, &t) in dx.chunks(d).zip(&self.inputs) {
            let local = (t as usize).wrapping_sub(off);
            if local < valid {
                for (g, &x) in de[local * d..][..d].iter_mut().zip(row) {
                    *g += x;
                }
            }
        }
        gs.globals_done();
    }
}

/// What every block of one micro-batch shares.
struct BlockCtx<'a, T> {
    m: &'a Dims,
    seq: Seq<'a, T>,
    cp: &'a dyn RingComm<T>,
    cos: &'a [T], // [S, hd/2]
    sin: &'a [T], // [S, hd/2]
    pos: &'a [usize],
    b: usize,
    s: usize,
}

impl<T> BlockCtx<'_, T> {
    fn attn_dims(&self) -> AttnDims {
        AttnDims { b: self.b, h: self.m.heads, kv: self.m.kv_heads, sq: self.s, sk: self.s, hd: self.m.hd }
    }
}

/// One decoder block forward: `x1 = x + o(attn(rope(q(n1(x))), rope(k(..)), v(..)))`,
/// `out = x1 + down(silu(gate(n2(x1))) · up(n2(x1)))`. Fills `a` (its `x` is the input) and
/// overwrites `out [N, D]`; `g` lends its projection scratch. `out = None` is the recomputation
/// for backward, which needs every activation but not the block output: it skips the down
/// projection (a fifth of the block's FLOPs) and its tensor-parallel reduction.
fn block_fwd<T: Real>(ctx: &BlockCtx<T>, w: &LayerParams<T>, a: &mut BlockActs<T>, g: &mut BlockGrads<T>, out: Option<&mut [T]>) {
    let m = ctx.m;
    let seq = ctx.seq;
    let (b, s, n) = (ctx.b, ctx.s, ctx.b * ctx.s);
    let (d, f, hd) = (m.d, m.ffn, m.hd);
    let (nh, nkv) = (m.heads, m.kv_heads);
    let rope = Some((ctx.cos, ctx.sin));

    rmsnorm_fwd(&mut a.xn1, &mut a.rstd1, &a.x, &w.input_layernorm, d, m.norm_eps);
    let xn1 = seq.gather(&a.xn1, &mut g.full_a); // [N, D]; backward: reduce of dxn1
    linear_fwd(&mut g.q_tok, xn1, &w.q_proj, n, nh * hd, d, false);
    to_heads_rope(&mut a.q, &g.q_tok, b, s, nh, hd, rope);
    linear_fwd(&mut g.kv_tok, xn1, &w.k_proj, n, nkv * hd, d, false);
    to_heads_rope(&mut a.k, &g.kv_tok, b, s, nkv, hd, rope);
    linear_fwd(&mut g.kv_tok, xn1, &w.v_proj, n, nkv * hd, d, false);
    to_heads_rope(&mut a.v, &g.kv_tok, b, s, nkv, hd, None);
    attention_forward(ctx, a, g);
    from_heads_rope(&mut a.att_tok, &a.att, b, s, nh, hd, None);
    // Row-parallel o_proj: partial sums reduced into this rank's rows; backward: gather.
    linear_fwd(seq.partial(&mut a.x1, &mut g.full_b), &a.att_tok, &w.o_proj, n, d, nh * hd, false);
    seq.finish(&mut a.x1, &g.full_b);
    add_assign(&mut a.x1, &a.x);

    rmsnorm_fwd(&mut a.xn2, &mut a.rstd2, &a.x1, &w.post_attention_layernorm, d, m.norm_eps);
    let xn2 = seq.gather(&a.xn2, &mut g.full_a); // [N, D]; backward: reduce of dxn2
    linear_fwd(&mut a.gate, xn2, &w.gate_proj, n, f, d, false);
    linear_fwd(&mut a.up, xn2, &w.up_proj, n, f, d, false);
    swiglu_fwd(&mut a.h, &a.gate, &a.up);
    let Some(out) = out else { return };
    // Row-parallel down_proj: partial sums reduced into this rank's rows; backward: gather.
    linear_fwd(seq.partial(out, &mut g.full_b), &a.h, &w.down_proj, n, d, f, false);
    seq.finish(out, &g.full_b);
    add_assign(out, &a.x1);
}

/// `selective` checkpointing's recomputation: the activations [`block_fwd`] derives by one
/// elementwise pass from tensors that were kept, with the same kernels (bit-identical).
fn recompute_cheap<T: Real>(ctx: &BlockCtx<T>, w: &LayerParams<T>, a: &mut BlockActs<T>) {
    let m = ctx.m;
    rmsnorm_fwd(&mut a.xn1, &mut a.rstd1, &a.x, &w.input_layernorm, m.d, m.norm_eps);
    from_heads_rope(&mut a.att_tok, &a.att, ctx.b, ctx.s, m.heads, m.hd, None);
    rmsnorm_fwd(&mut a.xn2, &mut a.rstd2, &a.x1, &w.post_attention_layernorm, m.d, m.norm_eps);
    swiglu_fwd(&mut a.h, &a.gate, &a.up);
}

/// One decoder block backward. `dx` holds the gradient of the block output on entry and of
/// the block input on exit; weight gradients ACCUMULATE (`+=`) into `dw`.
fn block_bwd<T: Real>(
    ctx: &BlockCtx<T>,
    w: &LayerParams<T>,
    dw: &mut LayerParams<T>,
    a: &BlockActs<T>,
    g: &mut BlockGrads<T>,
    dx: &mut [T],
) {
    let m = ctx.m;
    let seq = ctx.seq;
    let (b, s, n) = (ctx.b, ctx.s, ctx.b * ctx.s);
    let (d, f, hd) = (m.d, m.ffn, m.hd);
    let (nh, nkv) = (m.heads, m.kv_heads);
    let rope = Some((ctx.cos, ctx.sin));

    // MLP: out = x1 + down(h). The output gradient, gathered to all N rows.
    let dout = seq.gather(dx, &mut g.full_a);
    linear_bwd_weight(&mut dw.down_proj, dout, &a.h, n, d, f, true);
    linear_bwd_input(&mut g.dh, dout, &w.down_proj, n, d, f, false);
    swiglu_bwd(&mut g.dgate, &mut g.dup, &g.dh, &a.gate, &a.up);
    let xn2 = seq.gather(&a.xn2, &mut g.full_a); // gathered again rather than kept
    linear_bwd_weight(&mut dw.gate_proj, &g.dgate, xn2, n, f, d, true);
    linear_bwd_weight(&mut dw.up_proj, &g.dup, xn2, n, f, d, true);
    // dxn2: partial sums of the column-parallel gate/up, reduced into this rank's rows.
    let partial = seq.partial(&mut g.dxn, &mut g.full_b);
    linear_bwd_input(partial, &g.dgate, &w.gate_proj, n, f, d, false);
    linear_bwd_input(partial, &g.dup, &w.up_proj, n, f, d, true);
    seq.finish(&mut g.dxn, &g.full_b);
    // dx1 = dout (residual) + norm2 backward.
    g.dx1.copy_from_slice(dx);
    rmsnorm_bwd(&mut g.dx1, &mut dw.post_attention_layernorm, &g.dxn, &a.x1, &w.post_attention_layernorm, &a.rstd2, d, true);

    // Attention: x1 = x + o(att_tok).
    let dx1 = seq.gather(&g.dx1, &mut g.full_a);
    linear_bwd_weight(&mut dw.o_proj, dx1, &a.att_tok, n, d, nh * hd, true);
    linear_bwd_input(&mut g.d_tok, dx1, &w.o_proj, n, d, nh * hd, false);
    to_heads_rope(&mut g.datt, &g.d_tok, b, s, nh, hd, None);
    attention_backward(ctx, a, g);
    // Projections: q, k, v = xn1 · W{q,k,v}ᵀ (RoPE on q and k undone by its transpose); dxn1
    // is a partial sum over the column-parallel heads, reduced into this rank's rows.
    let xn1 = seq.gather(&a.xn1, &mut g.full_a);
    let partial = seq.partial(&mut g.dxn, &mut g.full_b);
    from_heads_rope(&mut g.d_tok, &g.dq, b, s, nh, hd, rope);
    linear_bwd_weight(&mut dw.q_proj, &g.d_tok, xn1, n, nh * hd, d, true);
    linear_bwd_input(partial, &g.d_tok, &w.q_proj, n, nh * hd, d, false);
    from_heads_rope(&mut g.dkv_tok, &g.dk, b, s, nkv, hd, rope);
    linear_bwd_weight(&mut dw.k_proj, &g.dkv_tok, xn1, n, nkv * hd, d, true);
    linear_bwd_input(partial, &g.dkv_tok, &w.k_proj, n, nkv * hd, d, true);
    from_heads_rope(&mut g.dkv_tok, &g.dv, b, s, nkv, hd, None);
    linear_bwd_weight(&mut dw.v_proj, &g.dkv_tok, xn1, n, nkv * hd, d, true);
    linear_bwd_input(partial, &g.dkv_tok, &w.v_proj, n, nkv * hd, d, true);
    seq.finish(&mut g.dxn, &g.full_b);
    // dx = dx1 (residual) + norm1 backward.
    dx.copy_from_slice(&g.dx1);
    rmsnorm_bwd(dx, &mut dw.input_layernorm, &g.dxn, &a.x, &w.input_layernorm, &a.rstd1, d, true);
}

/// Attention of this rank's queries over the whole sequence. One rank: the local keys. Context
/// parallelism: ring attention — the key/value block travels around the `cp` ring (`cp − 1`
/// steps), each block's partial result is merged with an online softmax (running log-sum-exp in
/// the element type, f32 in training). Causality is by global position, so the zigzag chunks
/// mask correctly. Overwrites `a.att` and `a.lse`.
fn attention_forward<T: Real>(ctx: &BlockCtx<T>, a: &mut BlockActs<T>, g: &mut BlockGrads<T>) {
    let cp = ctx.cp.degree();
    let dm = ctx.attn_dims();
    if cp == 1 {
        attention_fwd(&mut a.att, &mut a.lse, &a.q, &a.k, &a.v, ctx.pos, ctx.pos, dm);
        return;
    }
    let kv_len = a.k.len();
    let seq_total = ctx.s * cp;
    a.att.iter_mut().for_each(|x| *x = T::ZERO);
    a.lse.iter_mut().for_each(|x| *x = T::NEG_INFINITY);
    g.ring_kv[..kv_len].copy_from_slice(&a.k);
    g.ring_kv[kv_len..].copy_from_slice(&a.v);
    for step in 0..cp {
        let src = (ctx.cp.rank() + cp - step) % cp;
        let k_pos = zigzag_positions(seq_total, cp, src);
        // Post the next exchange before computing on the current block (overlap).
        if step + 1 < cp {
            ctx.cp.start_shift(RING_KV, &g.ring_kv); // backward: dK/dV travel the same ring
        }
        let (k, v) = g.ring_kv.split_at(kv_len);
        attention_fwd(&mut g.o_part, &mut g.lse_part, &a.q, k, v, ctx.pos, &k_pos, dm);
        merge_partial(&mut a.att, &mut a.lse, &g.o_part, &g.lse_part, dm.hd);
        if step + 1 < cp {
            ctx.cp.finish_shift(RING_KV, &mut g.ring_kv);
        }
    }
}

/// Backward of [`attention_forward`]. Overwrites `g.dq`, `g.dk`, `g.dv`. Under context
/// parallelism the key/value block travels the ring again with its accumulating `dK`/`dV`;
/// after `cp` steps each block's gradient is back with the rank that owns it.
fn attention_backward<T: Real>(ctx: &BlockCtx<T>, a: &BlockActs<T>, g: &mut BlockGrads<T>) {
    let cp = ctx.cp.degree();
    let dm = ctx.attn_dims();
    if cp == 1 {
        attention_bwd(&mut g.dq, &mut g.dk, &mut g.dv, &g.datt, &a.q, &a.k, &a.v, &a.att, &a.lse, ctx.pos, ctx.pos, dm);
        return;
    }
    let kv_len = a.k.len();
    let seq_total = ctx.s * cp;
    g.ring_kv[..kv_len].copy_from_slice(&a.k);
    g.ring_kv[kv_len..].copy_from_slice(&a.v);
    g.ring_dkv.iter_mut().for_each(|x| *x = T::ZERO);
    g.dq.iter_mut().for_each(|x| *x = T::ZERO);
    for step in 0..cp {
        let src = (ctx.cp.rank() + cp - step) % cp;
        let k_pos = zigzag_positions(seq_total, cp, src);
        if step + 1 < cp {
            ctx.cp.start_shift(RING_KV, &g.ring_kv);
        }
        let (k, v) = g.ring_kv.split_at(kv_len);
        // dq of this block into o_part (free in backward), dk/dv of this block into dk/dv.
        attention_bwd(&mut g.o_part, &mut g.dk, &mut g.dv, &g.datt, &a.q, k, v, &a.att, &a.lse, ctx.pos, &k_pos, dm);
        add_assign(&mut g.dq, &g.o_part);
        // The accumulating gradient of the block held in the previous step arrives now.
        if step > 0 {
            ctx.cp.finish_shift(RING_DKV, &mut g.ring_dkv);
        }
        add_assign(&mut g.ring_dkv[..kv_len], &g.dk);
        add_assign(&mut g.ring_dkv[kv_len..], &g.dv);
        // Pass it on; it travels while the next block computes.
        ctx.cp.start_shift(RING_DKV, &g.ring_dkv);
        if step + 1 < cp {
            ctx.cp.finish_shift(RING_KV, &mut g.ring_kv);
        }
    }
    // After `cp` steps the gradient of this rank's own block is back.
    ctx.cp.finish_shift(RING_DKV, &mut g.ring_dkv);
    g.dk.copy_from_slice(&g.ring_dkv[..kv_len]);
    g.dv.copy_from_slice(&g.ring_dkv[kv_len..]);
}
