//! The Llama-style decoder written as one-rank maths: parameters, kernels, forward, backward.
//!
//! `Model<T, B>` owns the activations of one micro-batch on backend `B` (`backend::Cpu` by
//! default; the CUDA backend with feature `cuda`); the weights are passed in, so a parallel
//! strategy decides where they come from (local, gathered, sharded) without this module
//! knowing. Every operation goes through the backend ([`Backend`]), so the same code runs on
//! the host and on a GPU. Forward and backward are hand-written (llm.c style), side by side per
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

use crate::backend::{Backend, Cpu};
use crate::config::{ActCkpt, ModelCfg};
use crate::real::Real;
use attention::{zigzag_positions, AttnDims};
use kernels::rope_tables;
use params::{Dims, Layer, ModelParams, Params};

/// The tensors outside the blocks, as the model reads them (`V`: the backend's buffer).
pub struct Globals<'a, V> {
    pub embed_tokens: &'a V, // [V, D]
    pub norm: &'a V,         // [D]
    /// `lm_head`, or `embed_tokens` when tied.
    pub output: &'a V, // [V, D]
}

/// The gradients of the tensors outside the blocks.
pub struct GlobalsMut<'a, V> {
    pub embed_tokens: &'a mut V,    // [V, D]
    pub norm: &'a mut V,            // [D]
    pub lm_head: Option<&'a mut V>, // [V, D]; None when tied (its gradient joins embed_tokens')
}

/// Where the weights come from during a pass: held whole, or gathered block by block from
/// shards. The model asks for a block right before it uses it and says when it is done.
pub trait WeightSource<V> {
    fn globals(&self) -> Globals<'_, V>;
    /// Block `l`'s weights, ready to use.
    fn block(&mut self, l: usize) -> &Layer<V>;
    /// Block `l` is not needed until it is asked for again.
    fn block_done(&mut self, _l: usize) {}
}

/// Where the gradients go during backward. The model accumulates (`+=`) into what it is
/// handed and reports when a block's (and finally the global tensors') gradients of this
/// micro-batch are complete, so a parallel strategy can start reducing them.
pub trait GradSink<V> {
    fn globals_mut(&mut self) -> GlobalsMut<'_, V>;
    fn block_mut(&mut self, l: usize) -> &mut Layer<V>;
    fn block_done(&mut self, _l: usize) {}
    fn globals_done(&mut self) {}
}

impl<V> WeightSource<V> for &Params<V> {
    fn globals(&self) -> Globals<'_, V> {
        Globals { embed_tokens: &self.embed_tokens, norm: &self.norm, output: self.output_weight() }
    }
    fn block(&mut self, l: usize) -> &Layer<V> {
        &self.layers[l]
    }
}

impl<V> GradSink<V> for Params<V> {
    fn globals_mut(&mut self) -> GlobalsMut<'_, V> {
        GlobalsMut { embed_tokens: &mut self.embed_tokens, norm: &mut self.norm, lm_head: self.lm_head.as_mut() }
    }
    fn block_mut(&mut self, l: usize) -> &mut Layer<V> {
        &mut self.layers[l]
    }
}

/// The tensor-parallel collectives the model calls, over the `tp` group, on buffers `V`. Each
/// call site in the model names its backward conjugate.
pub trait TpComm<V> {
    fn all_reduce_sum(&self, buf: &mut V);
    fn all_reduce_max(&self, buf: &mut V);
    /// `recv = [send of tp rank 0, send of tp rank 1, …]`.
    fn all_gather(&self, send: &V, recv: &mut V);
    /// Sums `send` (`[tp][recv.len()]`) across tp; this rank's block lands in `recv`.
    fn reduce_scatter_sum(&self, send: &V, recv: &mut V);
}

/// One rank holds every head and the whole vocabulary: the collectives are identities.
pub struct NoTp;

impl<T: Copy> TpComm<Vec<T>> for NoTp {
    fn all_reduce_sum(&self, _buf: &mut Vec<T>) {}
    fn all_reduce_max(&self, _buf: &mut Vec<T>) {}
    fn all_gather(&self, send: &Vec<T>, recv: &mut Vec<T>) {
        recv.copy_from_slice(send);
    }
    fn reduce_scatter_sum(&self, send: &Vec<T>, recv: &mut Vec<T>) {
        recv.copy_from_slice(send);
    }
}

/// The context-parallel ring the attention uses, over the `cp` group, on buffers `V`.
pub trait RingComm<V> {
    fn degree(&self) -> usize;
    fn rank(&self) -> usize;
    /// Starts sending a copy of `buf` to the next rank of the ring (exchange `slot`); the
    /// caller may keep computing on `buf`.
    fn start_shift(&self, slot: usize, buf: &V);
    /// Completes exchange `slot`: `buf` becomes the previous rank's block.
    fn finish_shift(&self, slot: usize, buf: &mut V);
}

/// One rank holds the whole sequence: no ring.
pub struct NoCp;

impl<V> RingComm<V> for NoCp {
    fn degree(&self) -> usize {
        1
    }
    fn rank(&self) -> usize {
        0
    }
    // A ring of one rank returns each block to itself.
    fn start_shift(&self, _slot: usize, _buf: &V) {}
    fn finish_shift(&self, _slot: usize, _buf: &mut V) {}
}

/// Ring exchange slots (MPI tags): the key and value blocks and their gradients travel
/// concurrently.
const RING_K: usize = 1;
const RING_V: usize = 2;
const RING_DK: usize = 3;
const RING_DV: usize = 4;

/// The model's communication: tensor-parallel collectives and the context-parallel ring.
pub struct Par<'a, V> {
    pub tp: &'a dyn TpComm<V>,
    pub cp: &'a dyn RingComm<V>,
    /// Called between the large pieces of a block's compute, so communication started outside
    /// the model (the next block's all-gather, the last block's gradient reduction) moves while
    /// it computes: MPI progresses non-blocking operations only inside its calls.
    pub progress: fn(),
}

/// Nothing in flight to progress.
pub fn no_progress() {}

impl<V> Clone for Par<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<V> Copy for Par<'_, V> {}

impl<T: Copy> Par<'static, Vec<T>> {
    /// One rank: every collective is the identity.
    pub fn single() -> Self {
        Par { tp: &NoTp, cp: &NoCp, progress: no_progress }
    }
}

/// How rows of the residual stream meet the tensor-parallel projections. Without sequence
/// parallelism every tp rank holds all `N` rows: a column-parallel projection reads them as they
/// are, and a row-parallel projection's partial output is all-reduced. With it, a rank holds
/// `N/T` rows: they are all-gathered before a column-parallel projection and the partial output
/// is reduce-scattered back (each is the other's backward conjugate).
struct Seq<'a, V> {
    sp: bool,
    tp: &'a dyn TpComm<V>,
}

impl<V> Clone for Seq<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<V> Copy for Seq<'_, V> {}

impl<'a, V> Seq<'a, V> {
    /// The whole `[N, ·]` rows for a column-parallel projection (backward of a row-parallel
    /// output too): all-gathered into `full` with SP, `local` itself without.
    fn gather<'b>(&self, local: &'b V, full: &'b mut V) -> &'b V {
        if self.sp {
            self.tp.all_gather(local, full);
            full
        } else {
            local
        }
    }

    /// Where a partial sum across tp ranks is computed: the whole-row scratch with SP, the
    /// rank's rows themselves without.
    fn partial<'b>(&self, local: &'b mut V, full: &'b mut V) -> &'b mut V {
        if self.sp {
            full
        } else {
            local
        }
    }

    /// Completes a partial sum into the rank's rows: reduce-scatter with SP (conjugate:
    /// all-gather), all-reduce without (conjugate: identity).
    fn finish(&self, local: &mut V, full: &V) {
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
struct BlockActs<V> {
    x: V,       // [N, D] block input
    rstd1: V,   // [N]
    xn1: V,     // [N, D]
    q: V,       // [B, H, S, hd] after RoPE
    k: V,       // [B, KV, S, hd] after RoPE
    v: V,       // [B, KV, S, hd]
    att: V,     // [B, H, S, hd] attention output, head-major
    lse: V,     // [B, H, S]
    att_tok: V, // [N, H*hd] attention output, token-major (o_proj input)
    x1: V,      // [N, D] after the attention residual
    rstd2: V,   // [N]
    xn2: V,     // [N, D]
    gate: V,    // [N, F]
    up: V,      // [N, F]
    h: V,       // [N, F] silu(gate)·up
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

/// Element counts of every field of [`BlockActs`], in declaration order: what `alloc`
/// allocates and what the planner predicts (one function, so the two cannot drift apart).
fn block_acts_lens(m: &Dims, n: usize, nl: usize, ckpt: ActCkpt, role: ActsRole) -> [usize; 15] {
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

impl<V> BlockActs<V> {
    fn alloc<T: Real, B: Backend<T, Buf = V>>(be: &B, m: &Dims, n: usize, nl: usize, ckpt: ActCkpt, role: ActsRole) -> Self {
        let [x, rstd1, xn1, q, k, v, att, lse, att_tok, x1, rstd2, xn2, gate, up, h] =
            block_acts_lens(m, n, nl, ckpt, role).map(|len| be.zeros(len));
        BlockActs { x, rstd1, xn1, q, k, v, att, lse, att_tok, x1, rstd2, xn2, gate, up, h }
    }

    /// Exchanges the fields `selective` recomputes (no copy: the buffers change hands).
    fn swap_cheap(&mut self, other: &mut Self) {
        std::mem::swap(&mut self.xn1, &mut other.xn1);
        std::mem::swap(&mut self.att_tok, &mut other.att_tok);
        std::mem::swap(&mut self.xn2, &mut other.xn2);
        std::mem::swap(&mut self.h, &mut other.h);
    }

    /// Elements held, over every field.
    fn elements<T: Real, B: Backend<T, Buf = V>>(&self, be: &B) -> usize {
        [
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
        ]
        .iter()
        .map(|t| be.len(t))
        .sum()
    }
}

/// Gradient buffers of one block's backward, reused across layers.
#[derive(Default)]
struct BlockGrads<V> {
    dx1: V,    // [N_local, D]
    dxn: V,    // [N_local, D]
    full_a: V, // [N, D] gathered rows (sequence parallelism only)
    full_b: V, // [N, D] partial sums before reduce-scatter (sequence parallelism only)
    // Context parallelism only: the key and value blocks travelling around the ring and their
    // gradients, one block's partial attention output and log-sum-exp, and dq of one block.
    ring_k: V,   // [B, KV, S, hd]
    ring_v: V,   // [B, KV, S, hd]
    ring_dk: V,  // [B, KV, S, hd]
    ring_dv: V,  // [B, KV, S, hd]
    o_part: V,   // [B, H, S, hd]
    lse_part: V, // [B, H, S]
    dh: V,       // [N, F]
    dgate: V,    // [N, F]
    dup: V,      // [N, F]
    d_tok: V,    // [N, H*hd] token-major gradient (att_tok, then q)
    dkv_tok: V,  // [N, KV*hd] (forward: the value projection)
    datt: V,     // [B, H, S, hd]
    dq: V,       // [B, H, S, hd]
    dk: V,       // [B, KV, S, hd]
    dv: V,       // [B, KV, S, hd]
    // Projection outputs before the head-major transpose (forward scratch).
    q_tok: V,  // [N, H*hd]
    kv_tok: V, // [N, KV*hd]
}

/// Element counts of every field of [`BlockGrads`], in declaration order (see
/// [`block_acts_lens`]).
fn block_grads_lens(m: &Dims, n: usize, nl: usize, sp: bool, cp: bool) -> [usize; 21] {
    let (d, f, hd) = (m.d, m.ffn, m.hd);
    let (qd, kvd) = (m.heads * hd, m.kv_heads * hd);
    let full = if sp { n * d } else { 0 };
    let ring = |len: usize| if cp { len } else { 0 };
    [
        nl * d,
        nl * d,
        full,
        full,
        ring(n * kvd),
        ring(n * kvd),
        ring(n * kvd),
        ring(n * kvd),
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

impl<V> BlockGrads<V> {
    fn alloc<T: Real, B: Backend<T, Buf = V>>(be: &B, m: &Dims, n: usize, nl: usize, sp: bool, cp: bool) -> Self {
        let [dx1, dxn, full_a, full_b, ring_k, ring_v, ring_dk, ring_dv, o_part, lse_part, dh, dgate, dup, d_tok, dkv_tok, datt, dq, dk, dv, q_tok, kv_tok] =
            block_grads_lens(m, n, nl, sp, cp).map(|len| be.zeros(len));
        BlockGrads {
            dx1,
            dxn,
            full_a,
            full_b,
            ring_k,
            ring_v,
            ring_dk,
            ring_dv,
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

/// The decoder and the activations of its last forward, on backend `B`.
pub struct Model<T: Real, B: Backend<T> = Cpu> {
    be: B,
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
    /// This rank's global positions (host), and on the backend with, under context
    /// parallelism, the positions every rank of the ring holds (`ring_pos[src]`).
    positions: Vec<usize>,
    pos: B::Pos,
    ring_pos: Vec<B::Pos>,
    targets: B::Ids,
    inputs: B::Ids,
    rope_cos: B::Buf, // [S, hd/2]
    rope_sin: B::Buf, // [S, hd/2]
    /// Per layer: what forward keeps for backward (see [`ActCkpt`]).
    saved: Vec<BlockActs<B::Buf>>,
    /// One block's recomputed activations (`full`: all; `selective`: the cheap ones).
    scratch: BlockActs<B::Buf>,
    /// The scratch holds the last block's activations from the last forward (backward starts
    /// with that block and need not recompute it).
    scratch_is_last_block: bool,
    grads: BlockGrads<B::Buf>,
    x_final: B::Buf,   // [N_local, D] output of the last block
    rstd_f: B::Buf,    // [N_local]
    xf: B::Buf,        // [N_local, D] after the final norm
    xf_full: B::Buf,   // [N, D] gathered final-norm output (sequence parallelism only)
    logits: B::Buf,    // [N, V_local]; dlogits in place after backward
    lse_ce: B::Buf,    // [N] log-sum-exp of each logits row (over the whole vocabulary)
    ce_max: B::Buf,    // [N] row maxima (scratch)
    ce_target: B::Buf, // [N] target logits (scratch)
    dx: B::Buf,        // [N_local, D] gradient of the residual stream
    _t: std::marker::PhantomData<T>,
}

impl<T: Real> Model<T, Cpu> {
    /// The whole model on one rank, on the host.
    pub fn new(cfg: &ModelCfg, ckpt: ActCkpt) -> Self {
        Self::new_local(Dims::full(cfg), ckpt, false)
    }

    /// One tensor-parallel rank's piece of the model (`Dims::new(cfg, tp, tp_rank)`), with or
    /// without sequence parallelism, on the host.
    pub fn new_local(m: Dims, ckpt: ActCkpt, sequence_parallel: bool) -> Self {
        Self::on(Cpu::default(), m, ckpt, sequence_parallel)
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

    /// Logits `[N, V_local]` of the last forward (before backward overwrites them).
    pub fn logits(&self) -> &[T] {
        &self.logits
    }
}

impl<T: Real, B: Backend<T>> Model<T, B> {
    /// A tensor-parallel rank's piece of the model (`Dims`) on backend `be`.
    pub fn on(be: B, m: Dims, ckpt: ActCkpt, sequence_parallel: bool) -> Self {
        Model {
            be,
            m,
            attn_pairs: 0,
            cp: 1,
            sp: sequence_parallel,
            ckpt,
            bs: (0, 0),
            positions: vec![],
            pos: Default::default(),
            ring_pos: vec![],
            targets: Default::default(),
            inputs: Default::default(),
            rope_cos: Default::default(),
            rope_sin: Default::default(),
            saved: vec![],
            scratch: BlockActs::default(),
            scratch_is_last_block: false,
            grads: BlockGrads::default(),
            x_final: Default::default(),
            rstd_f: Default::default(),
            xf: Default::default(),
            xf_full: Default::default(),
            logits: Default::default(),
            lse_ce: Default::default(),
            ce_max: Default::default(),
            ce_target: Default::default(),
            dx: Default::default(),
            _t: std::marker::PhantomData,
        }
    }

    pub fn backend(&self) -> &B {
        &self.be
    }

    /// What [`Model::ensure_buffers`] allocates for `B × S` tokens per rank, without allocating.
    pub fn memory(m: &Dims, b: usize, s: usize, ckpt: ActCkpt, sequence_parallel: bool, cp: usize) -> ActivationMemory {
        let n = b * s;
        let nl = if sequence_parallel { n / m.tp } else { n };
        let acts = |role| block_acts_lens(m, n, nl, ckpt, role).iter().sum::<usize>();
        let grads: usize = block_grads_lens(m, n, nl, sequence_parallel, cp > 1).iter().sum();
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
        let be = &self.be;
        self.saved = (0..self.m.layers).map(|_| BlockActs::alloc(be, &self.m, n, nl, self.ckpt, ActsRole::Saved)).collect();
        self.scratch = BlockActs::alloc(be, &self.m, n, nl, self.ckpt, ActsRole::Scratch);
        self.scratch_is_last_block = false;
        self.grads = BlockGrads::alloc(be, &self.m, n, nl, self.sp, self.cp > 1);
        self.ce_max = be.zeros(n);
        self.ce_target = be.zeros(n);
        self.x_final = be.zeros(nl * d);
        self.rstd_f = be.zeros(nl);
        self.xf = be.zeros(nl * d);
        self.xf_full = be.zeros(if self.sp { n * d } else { 0 });
        self.logits = be.zeros(n * v);
        self.lse_ce = be.zeros(n);
        self.dx = be.zeros(nl * d);
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
        self.positions.clear();
        self
    }

    /// Bytes of activation memory this model holds between forward and backward (saved
    /// activations, recompute scratch, logits); the backward's gradient buffers are excluded.
    pub fn activation_bytes(&self) -> usize {
        let be = &self.be;
        let held = self.saved.iter().map(|a| a.elements(be)).sum::<usize>()
            + self.scratch.elements(be)
            + [&self.x_final, &self.rstd_f, &self.xf, &self.xf_full, &self.logits, &self.lse_ce].iter().map(|t| be.len(t)).sum::<usize>();
        held * std::mem::size_of::<T>()
    }

    /// New positions: the RoPE tables and the positions on the backend (and, under context
    /// parallelism, the positions of every rank of the ring).
    fn set_positions(&mut self, positions: &[usize]) {
        let (c, sn) = rope_tables::<T>(positions, self.m.hd, self.m.rope_theta);
        self.be.upload(&mut self.rope_cos, &c);
        self.be.upload(&mut self.rope_sin, &sn);
        self.be.set_positions(&mut self.pos, positions);
        let seq_total = positions.len() * self.cp;
        self.ring_pos = (0..self.cp)
            .map(|src| {
                let mut p = B::Pos::default();
                if self.cp > 1 {
                    self.be.set_positions(&mut p, &zigzag_positions(seq_total, self.cp, src));
                }
                p
            })
            .collect();
        self.positions = positions.to_vec();
    }

    /// Forward of one micro-batch, asking `w` for each block's weights when it needs them.
    /// Returns the SUM over its tokens of the cross-entropy loss.
    /// Tensor-parallel collectives and the context-parallel ring go through `par`
    /// (`Par::single()` on one rank). `tok.positions` are the global positions of this rank's
    /// tokens (the zigzag chunks under context parallelism).
    pub fn forward_with<W: WeightSource<B::Buf>>(&mut self, w: &mut W, tok: &Tokens, par: Par<'_, B::Buf>) -> f64 {
        let tp = par.tp;
        let (b, s) = (tok.batch, tok.seq);
        assert_eq!(tok.inputs.len(), b * s, "inputs must be [B*S]");
        assert_eq!(tok.targets.len(), b * s, "targets must be [B*S]");
        assert_eq!(tok.positions.len(), s, "positions must be [S]");
        self.ensure_buffers(b, s);
        if self.positions != tok.positions {
            self.set_positions(tok.positions);
        }
        self.be.set_ids(&mut self.inputs, tok.inputs);
        self.be.set_ids(&mut self.targets, tok.targets);
        let be = &self.be;
        let (d, v, nl) = (self.m.d, self.m.vocab, self.m.layers);
        let seq = Seq { sp: self.sp, tp };
        let ctx = BlockCtx {
            be,
            m: &self.m,
            cos: &self.rope_cos,
            sin: &self.rope_sin,
            pos: &self.pos,
            ring_pos: &self.ring_pos,
            b,
            s,
            seq,
            cp: par.cp,
            progress: par.progress,
        };

        // Vocab-parallel embedding: rows this rank holds, zero elsewhere, summed across tp
        // (into this rank's rows of the residual stream).
        let (off, valid) = (self.m.vocab_offset, self.m.vocab_valid());
        let x0 = if nl > 0 { &mut self.saved[0].x } else { &mut self.x_final };
        let partial = seq.partial(x0, &mut self.grads.full_b);
        be.embed_fwd(partial, w.globals().embed_tokens, &self.inputs, off, valid, d);
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
                    be.copy(&mut self.scratch.x, &saved_l.x);
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
        be.rmsnorm_fwd(&mut self.xf, &mut self.rstd_f, &self.x_final, g.norm, d, self.m.norm_eps);
        let xf = seq.gather(&self.xf, &mut self.xf_full);
        be.linear_fwd(&mut self.logits, xf, g.output, b * s, v, d, false);
        (par.progress)();
        be.ce_row_max(&mut self.ce_max, &self.logits, v, valid);
        tp.all_reduce_max(&mut self.ce_max);
        be.ce_row_sum_exp(&mut self.lse_ce, &self.logits, &self.ce_max, v, valid);
        tp.all_reduce_sum(&mut self.lse_ce);
        be.ce_target_logit(&mut self.ce_target, &self.logits, &self.targets, v, off, valid);
        tp.all_reduce_sum(&mut self.ce_target);
        be.ce_finish(&mut self.lse_ce, &self.ce_max, &self.ce_target)
    }

    /// Backward of the last forward, with `dloss/dloss_token = loss_scale` for every token.
    /// ACCUMULATES (`+=`) into the gradients `gs` hands out; tells `gs` when each block's and
    /// finally the global tensors' gradients of this micro-batch are complete.
    pub fn backward_with<W: WeightSource<B::Buf>, G: GradSink<B::Buf>>(
        &mut self,
        w: &mut W,
        gs: &mut G,
        loss_scale: T,
        par: Par<'_, B::Buf>,
    ) {
        let tp = par.tp;
        let (b, s) = self.bs;
        let n = b * s;
        let be = &self.be;
        let (d, v, nl) = (self.m.d, self.m.vocab, self.m.layers);
        let (off, valid) = (self.m.vocab_offset, self.m.vocab_valid());
        let seq = Seq { sp: self.sp, tp };
        let ctx = BlockCtx {
            be,
            m: &self.m,
            cos: &self.rope_cos,
            sin: &self.rope_sin,
            pos: &self.pos,
            ring_pos: &self.ring_pos,
            b,
            s,
            seq,
            cp: par.cp,
            progress: par.progress,
        };

        // Loss and output projection: dlogits = scale·(softmax − onehot) [N, V_local].
        be.ce_bwd_inplace(&mut self.logits, &self.lse_ce, &self.targets, v, off, valid, loss_scale);
        {
            let (g, dg) = (w.globals(), gs.globals_mut());
            let dw_out = match dg.lm_head {
                Some(h) => h,
                None => &mut *dg.embed_tokens,
            };
            let xf = if self.sp { &self.xf_full } else { &self.xf };
            // dxf [N_local, D]: the partial sums of every vocab shard, reduced across tp
            // (conjugate of the replicated / gathered xf feeding every shard).
            let dxf = &mut self.grads.dxn;
            be.linear_bwd(seq.partial(dxf, &mut self.grads.full_b), false, dw_out, &self.logits, xf, g.output, n, v, d);
            (par.progress)();
            seq.finish(dxf, &self.grads.full_b);
            be.rmsnorm_bwd(&mut self.dx, dg.norm, dxf, &self.x_final, g.norm, &self.rstd_f, d, false);
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
                        be.copy(&mut self.scratch.x, &self.saved[l].x);
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
        be.embed_bwd(de, dx, &self.inputs, off, valid, d);
        gs.globals_done();
    }
}

/// What every block of one micro-batch shares.
struct BlockCtx<'a, T: Real, B: Backend<T>> {
    be: &'a B,
    m: &'a Dims,
    seq: Seq<'a, B::Buf>,
    cp: &'a dyn RingComm<B::Buf>,
    cos: &'a B::Buf, // [S, hd/2]
    sin: &'a B::Buf, // [S, hd/2]
    pos: &'a B::Pos,
    /// Under context parallelism, the positions ring rank `src` holds.
    ring_pos: &'a [B::Pos],
    b: usize,
    s: usize,
    progress: fn(),
}

impl<T: Real, B: Backend<T>> BlockCtx<'_, T, B> {
    fn attn_dims(&self) -> AttnDims {
        AttnDims { b: self.b, h: self.m.heads, kv: self.m.kv_heads, sq: self.s, sk: self.s, hd: self.m.hd }
    }
}

/// One decoder block forward: `x1 = x + o(attn(rope(q(n1(x))), rope(k(..)), v(..)))`,
/// `out = x1 + down(silu(gate(n2(x1))) · up(n2(x1)))`. Fills `a` (its `x` is the input) and
/// overwrites `out [N, D]`; `g` lends its projection scratch. `out = None` is the recomputation
/// for backward, which needs every activation but not the block output: it skips the down
/// projection (a fifth of the block's FLOPs) and its tensor-parallel reduction.
fn block_fwd<T: Real, B: Backend<T>>(
    ctx: &BlockCtx<T, B>,
    w: &Layer<B::Buf>,
    a: &mut BlockActs<B::Buf>,
    g: &mut BlockGrads<B::Buf>,
    out: Option<&mut B::Buf>,
) {
    let (be, m, seq) = (ctx.be, ctx.m, ctx.seq);
    let (b, s, n) = (ctx.b, ctx.s, ctx.b * ctx.s);
    let (d, f, hd) = (m.d, m.ffn, m.hd);
    let (nh, nkv) = (m.heads, m.kv_heads);
    let rope = Some((ctx.cos, ctx.sin));
    // Between the block's large pieces of work, communication in flight moves.
    let poke = ctx.progress;

    be.rmsnorm_fwd(&mut a.xn1, &mut a.rstd1, &a.x, &w.input_layernorm, d, m.norm_eps);
    let xn1 = seq.gather(&a.xn1, &mut g.full_a); // [N, D]; backward: reduce of dxn1
    be.linear_fwd(&mut g.q_tok, xn1, &w.q_proj, n, nh * hd, d, false);
    poke();
    be.tokens_to_heads(&mut a.q, &g.q_tok, b, s, nh, hd, rope);
    // The value projection lands in `dkv_tok`, free until backward.
    be.linear_fwd_pair(&mut g.kv_tok, &w.k_proj, &mut g.dkv_tok, &w.v_proj, xn1, n, nkv * hd, d);
    poke();
    be.tokens_to_heads(&mut a.k, &g.kv_tok, b, s, nkv, hd, rope);
    be.tokens_to_heads(&mut a.v, &g.dkv_tok, b, s, nkv, hd, None);
    attention_forward(ctx, a, g);
    poke();
    be.heads_to_tokens(&mut a.att_tok, &a.att, b, s, nh, hd, None);
    // Row-parallel o_proj: partial sums reduced into this rank's rows; backward: gather.
    be.linear_fwd(seq.partial(&mut a.x1, &mut g.full_b), &a.att_tok, &w.o_proj, n, d, nh * hd, false);
    seq.finish(&mut a.x1, &g.full_b);
    be.add_assign(&mut a.x1, &a.x);
    poke();

    be.rmsnorm_fwd(&mut a.xn2, &mut a.rstd2, &a.x1, &w.post_attention_layernorm, d, m.norm_eps);
    let xn2 = seq.gather(&a.xn2, &mut g.full_a); // [N, D]; backward: reduce of dxn2
    be.linear_fwd_pair(&mut a.gate, &w.gate_proj, &mut a.up, &w.up_proj, xn2, n, f, d);
    poke();
    be.swiglu_fwd(&mut a.h, &a.gate, &a.up);
    let Some(out) = out else { return };
    // Row-parallel down_proj: partial sums reduced into this rank's rows; backward: gather.
    be.linear_fwd(seq.partial(out, &mut g.full_b), &a.h, &w.down_proj, n, d, f, false);
    seq.finish(out, &g.full_b);
    be.add_assign(out, &a.x1);
}

/// `selective` checkpointing's recomputation: the activations [`block_fwd`] derives by one
/// elementwise pass from tensors that were kept, with the same kernels (bit-identical).
fn recompute_cheap<T: Real, B: Backend<T>>(ctx: &BlockCtx<T, B>, w: &Layer<B::Buf>, a: &mut BlockActs<B::Buf>) {
    let (be, m) = (ctx.be, ctx.m);
    be.rmsnorm_fwd(&mut a.xn1, &mut a.rstd1, &a.x, &w.input_layernorm, m.d, m.norm_eps);
    be.heads_to_tokens(&mut a.att_tok, &a.att, ctx.b, ctx.s, m.heads, m.hd, None);
    be.rmsnorm_fwd(&mut a.xn2, &mut a.rstd2, &a.x1, &w.post_attention_layernorm, m.d, m.norm_eps);
    be.swiglu_fwd(&mut a.h, &a.gate, &a.up);
}

/// One decoder block backward. `dx` holds the gradient of the block output on entry and of
/// the block input on exit; weight gradients ACCUMULATE (`+=`) into `dw`.
fn block_bwd<T: Real, B: Backend<T>>(
    ctx: &BlockCtx<T, B>,
    w: &Layer<B::Buf>,
    dw: &mut Layer<B::Buf>,
    a: &BlockActs<B::Buf>,
    g: &mut BlockGrads<B::Buf>,
    dx: &mut B::Buf,
) {
    let (be, m, seq) = (ctx.be, ctx.m, ctx.seq);
    let (b, s, n) = (ctx.b, ctx.s, ctx.b * ctx.s);
    let (d, f, hd) = (m.d, m.ffn, m.hd);
    let (nh, nkv) = (m.heads, m.kv_heads);
    let rope = Some((ctx.cos, ctx.sin));
    let poke = ctx.progress;

    // MLP: out = x1 + down(h). The output gradient, gathered to all N rows.
    let dout = seq.gather(dx, &mut g.full_a);
    be.linear_bwd(&mut g.dh, false, &mut dw.down_proj, dout, &a.h, &w.down_proj, n, d, f);
    poke();
    be.swiglu_bwd(&mut g.dgate, &mut g.dup, &g.dh, &a.gate, &a.up);
    // xn2 is gathered again rather than kept. dxn2: partial sums of the column-parallel
    // gate/up, reduced into this rank's rows.
    let xn2 = seq.gather(&a.xn2, &mut g.full_a);
    let partial = seq.partial(&mut g.dxn, &mut g.full_b);
    be.linear_bwd(partial, false, &mut dw.gate_proj, &g.dgate, xn2, &w.gate_proj, n, f, d);
    poke();
    be.linear_bwd(partial, true, &mut dw.up_proj, &g.dup, xn2, &w.up_proj, n, f, d);
    poke();
    seq.finish(&mut g.dxn, &g.full_b);
    // dx1 = dout (residual) + norm2 backward.
    be.copy(&mut g.dx1, dx);
    be.rmsnorm_bwd(&mut g.dx1, &mut dw.post_attention_layernorm, &g.dxn, &a.x1, &w.post_attention_layernorm, &a.rstd2, d, true);

    // Attention: x1 = x + o(att_tok).
    let dx1 = seq.gather(&g.dx1, &mut g.full_a);
    be.linear_bwd(&mut g.d_tok, false, &mut dw.o_proj, dx1, &a.att_tok, &w.o_proj, n, d, nh * hd);
    poke();
    be.tokens_to_heads(&mut g.datt, &g.d_tok, b, s, nh, hd, None);
    attention_backward(ctx, a, g);
    poke();
    // Projections: q, k, v = xn1 · W{q,k,v}ᵀ (RoPE on q and k undone by its transpose); dxn1
    // is a partial sum over the column-parallel heads, reduced into this rank's rows.
    let xn1 = seq.gather(&a.xn1, &mut g.full_a);
    let partial = seq.partial(&mut g.dxn, &mut g.full_b);
    be.heads_to_tokens(&mut g.d_tok, &g.dq, b, s, nh, hd, rope);
    be.linear_bwd(partial, false, &mut dw.q_proj, &g.d_tok, xn1, &w.q_proj, n, nh * hd, d);
    poke();
    be.heads_to_tokens(&mut g.dkv_tok, &g.dk, b, s, nkv, hd, rope);
    be.linear_bwd(partial, true, &mut dw.k_proj, &g.dkv_tok, xn1, &w.k_proj, n, nkv * hd, d);
    poke();
    be.heads_to_tokens(&mut g.dkv_tok, &g.dv, b, s, nkv, hd, None);
    be.linear_bwd(partial, true, &mut dw.v_proj, &g.dkv_tok, xn1, &w.v_proj, n, nkv * hd, d);
    seq.finish(&mut g.dxn, &g.full_b);
    // dx = dx1 (residual) + norm1 backward.
    be.copy(dx, &g.dx1);
    be.rmsnorm_bwd(dx, &mut dw.input_layernorm, &g.dxn, &a.x, &w.input_layernorm, &a.rstd1, d, true);
}

/// Attention of this rank's queries over the whole sequence. One rank: the local keys. Context
/// parallelism: ring attention — the key and value blocks travel around the `cp` ring
/// (`cp − 1` steps), each block's partial result is merged with an online softmax (running
/// log-sum-exp in the element type, f32 in training). Causality is by global position, so the
/// zigzag chunks mask correctly. Overwrites `a.att` and `a.lse`.
fn attention_forward<T: Real, B: Backend<T>>(ctx: &BlockCtx<T, B>, a: &mut BlockActs<B::Buf>, g: &mut BlockGrads<B::Buf>) {
    let be = ctx.be;
    let cp = ctx.cp.degree();
    let dm = ctx.attn_dims();
    if cp == 1 {
        be.attention_fwd(&mut a.att, &mut a.lse, &a.q, &a.k, &a.v, ctx.pos, ctx.pos, dm);
        return;
    }
    be.fill(&mut a.att, T::ZERO);
    be.fill(&mut a.lse, T::NEG_INFINITY);
    be.copy(&mut g.ring_k, &a.k);
    be.copy(&mut g.ring_v, &a.v);
    for step in 0..cp {
        let src = (ctx.cp.rank() + cp - step) % cp;
        // Post the next exchange before computing on the current block (overlap).
        if step + 1 < cp {
            ctx.cp.start_shift(RING_K, &g.ring_k); // backward: dK/dV travel the same ring
            ctx.cp.start_shift(RING_V, &g.ring_v);
        }
        be.attention_fwd(&mut g.o_part, &mut g.lse_part, &a.q, &g.ring_k, &g.ring_v, ctx.pos, &ctx.ring_pos[src], dm);
        be.attention_merge(&mut a.att, &mut a.lse, &g.o_part, &g.lse_part, dm.hd);
        if step + 1 < cp {
            ctx.cp.finish_shift(RING_K, &mut g.ring_k);
            ctx.cp.finish_shift(RING_V, &mut g.ring_v);
        }
    }
}

/// Backward of [`attention_forward`]. Overwrites `g.dq`, `g.dk`, `g.dv`. Under context
/// parallelism the key and value blocks travel the ring again with their accumulating `dK`
/// and `dV`; after `cp` steps each block's gradient is back with the rank that owns it.
fn attention_backward<T: Real, B: Backend<T>>(ctx: &BlockCtx<T, B>, a: &BlockActs<B::Buf>, g: &mut BlockGrads<B::Buf>) {
    let be = ctx.be;
    let cp = ctx.cp.degree();
    let dm = ctx.attn_dims();
    if cp == 1 {
        be.attention_bwd(&mut g.dq, &mut g.dk, &mut g.dv, &g.datt, &a.q, &a.k, &a.v, &a.att, &a.lse, ctx.pos, ctx.pos, dm);
        return;
    }
    be.copy(&mut g.ring_k, &a.k);
    be.copy(&mut g.ring_v, &a.v);
    be.fill(&mut g.ring_dk, T::ZERO);
    be.fill(&mut g.ring_dv, T::ZERO);
    be.fill(&mut g.dq, T::ZERO);
    for step in 0..cp {
        let src = (ctx.cp.rank() + cp - step) % cp;
        if step + 1 < cp {
            ctx.cp.start_shift(RING_K, &g.ring_k);
            ctx.cp.start_shift(RING_V, &g.ring_v);
        }
        // dq of this block into o_part (free in backward), dk/dv of this block into dk/dv.
        let k_pos = &ctx.ring_pos[src];
        be.attention_bwd(&mut g.o_part, &mut g.dk, &mut g.dv, &g.datt, &a.q, &g.ring_k, &g.ring_v, &a.att, &a.lse, ctx.pos, k_pos, dm);
        be.add_assign(&mut g.dq, &g.o_part);
        // The accumulating gradient of the block held in the previous step arrives now.
        if step > 0 {
            ctx.cp.finish_shift(RING_DK, &mut g.ring_dk);
            ctx.cp.finish_shift(RING_DV, &mut g.ring_dv);
        }
        be.add_assign(&mut g.ring_dk, &g.dk);
        be.add_assign(&mut g.ring_dv, &g.dv);
        // Pass it on; it travels while the next block computes.
        ctx.cp.start_shift(RING_DK, &g.ring_dk);
        ctx.cp.start_shift(RING_DV, &g.ring_dv);
        if step + 1 < cp {
            ctx.cp.finish_shift(RING_K, &mut g.ring_k);
            ctx.cp.finish_shift(RING_V, &mut g.ring_v);
        }
    }
    // After `cp` steps the gradient of this rank's own block is back.
    ctx.cp.finish_shift(RING_DK, &mut g.ring_dk);
    ctx.cp.finish_shift(RING_DV, &mut g.ring_dv);
    be.copy(&mut g.dk, &g.ring_dk);
    be.copy(&mut g.dv, &g.ring_dv);
}
