//! One decoder block, forward beside backward, as one-rank maths: every tensor-parallel
//! boundary is a named hook (`tp.gather`, `tp.partial` / `tp.finish`, each with its backward
//! conjugate noted) and attention is the schedule's (`hooks.attention`), so the same code runs
//! on one rank, under tensor and sequence parallelism, and on a context-parallel ring.
//!
//! Legend: `B` micro-batch, `S` sequence (this rank's tokens of it), `N = B·S` tokens,
//! `N_local` rows of the residual stream on this rank, `D` width, `H`/`KV` query/kv heads on
//! this rank, `hd` head dim, `F` ffn hidden on this rank.

use super::activations::{BlockActs, BlockGrads, DeferredWeights};
use super::hooks::Hooks;
use super::moe::{moe_bwd, moe_bwd_weight, moe_fwd};
use super::params::{Dims, Layer};
use crate::backend::{AttnDims, Backend};
use crate::scalar::Real;

/// What every block of one micro-batch shares.
pub(super) struct BlockCtx<'a, T: Real, B: Backend<T>> {
    pub(super) be: &'a B,
    pub(super) m: &'a Dims,
    pub(super) hooks: Hooks<'a, T, B>,
    pub(super) cos: &'a B::Buf, // [S, hd/2]
    pub(super) sin: &'a B::Buf, // [S, hd/2]
    pub(super) pos: &'a B::Pos,
    pub(super) b: usize,
    pub(super) s: usize,
    /// The auxiliary loss's gradient of the router probabilities (`[E]`, the same for every
    /// row of a sequence), per sequence of the micro-batch; empty without the loss.
    pub(super) aux: &'a [Vec<f64>],
    /// The index among the micro-batch's `B·S` rows of this rank's first row (sequence
    /// parallelism gives each tp rank a contiguous part).
    pub(super) first_row: usize,
}

impl<T: Real, B: Backend<T>> BlockCtx<'_, T, B> {
    fn attn_dims(&self) -> AttnDims {
        AttnDims { b: self.b, h: self.m.heads_local, kv: self.m.kv_heads_local, sq: self.s, sk: self.s, hd: self.m.hd }
    }
}

/// One decoder block forward: `x1 = x + o(attn(rope(q(n1(x))), rope(k(..)), v(..)))` (with
/// `qk_norm`, `rope(q_norm(q(..)))` and `rope(k_norm(k(..)))`, each norm per head),
/// `out = x1 + down(silu(gate(n2(x1))) · up(n2(x1)))`. Fills `a` (its `x` is the input) and
/// overwrites `out [N, D]`; `g` lends its projection scratch. `out = None` is the recomputation
/// for backward, which needs every activation but not the block output: it skips the down
/// projection (a fifth of the block's FLOPs) and its tensor-parallel reduction.
pub(super) fn block_fwd<T: Real, B: Backend<T>>(
    ctx: &BlockCtx<T, B>,
    w: &Layer<B::Buf>,
    layer: usize,
    a: &mut BlockActs<B::Buf>,
    g: &mut BlockGrads<B::Buf>,
    out: Option<&mut B::Buf>,
) {
    let (be, m, tp) = (ctx.be, ctx.m, ctx.hooks.tp);
    let (b, s, n) = (ctx.b, ctx.s, ctx.b * ctx.s);
    let (d, f, hd) = (m.d, m.mlp_width(layer), m.hd);
    let (nh, nkv) = (m.heads_local, m.kv_heads_local);
    let rope = Some((ctx.cos, ctx.sin));
    // Between the block's large pieces of work, communication in flight moves.
    let poke = ctx.hooks.progress;

    be.rmsnorm_fwd(&mut a.xn1, &mut a.rstd1, &a.x, &w.input_layernorm, d, m.norm_eps);
    let xn1 = tp.gather(&a.xn1, &mut g.full_a); // [N, D]; backward: reduce of dxn1
                                                // With `qk_norm` the projections are kept as they come out and normed per head into the
                                                // scratch that feeds RoPE.
    let q_out = if m.qk_norm { &mut a.q_raw } else { &mut g.q_tok };
    be.linear_fwd(q_out, xn1, &w.q_proj, n, nh * hd, d, false);
    norm_heads(be, m, &mut g.q_tok, &mut a.rstd_q, &a.q_raw, w.q_norm.as_ref());
    poke();
    be.tokens_to_heads(&mut a.q, &g.q_tok, b, s, nh, hd, rope);
    // The value projection lands in `dkv_tok`, free until backward.
    let k_out = if m.qk_norm { &mut a.k_raw } else { &mut g.kv_tok };
    be.linear_fwd_pair(k_out, &w.k_proj, &mut g.dkv_tok, &w.v_proj, xn1, n, nkv * hd, d);
    norm_heads(be, m, &mut g.kv_tok, &mut a.rstd_k, &a.k_raw, w.k_norm.as_ref());
    poke();
    be.tokens_to_heads(&mut a.k, &g.kv_tok, b, s, nkv, hd, rope);
    be.tokens_to_heads(&mut a.v, &g.dkv_tok, b, s, nkv, hd, None);
    ctx.hooks.attention.forward(be, &mut a.att, &mut a.lse, &a.q, &a.k, &a.v, ctx.pos, ctx.attn_dims());
    poke();
    be.heads_to_tokens(&mut a.att_tok, &a.att, b, s, nh, hd, None);
    // Row-parallel o_proj: partial sums reduced into this rank's rows; backward: gather.
    be.linear_fwd(tp.partial(&mut a.x1, &mut g.full_b), &a.att_tok, &w.o_proj, n, d, nh * hd, false);
    tp.finish(&mut a.x1, &g.full_b);
    be.add_assign(&mut a.x1, &a.x);
    poke();

    be.rmsnorm_fwd(&mut a.xn2, &mut a.rstd2, &a.x1, &w.post_attention_layernorm, d, m.norm_eps);
    let mut out = out;
    if let Some(experts) = &w.moe {
        moe_fwd(ctx, experts, layer, a, g, out.as_deref_mut());
    }
    // The dense MLP, or a mixture of experts' shared experts beside its routed ones.
    if f > 0 {
        let xn2 = tp.gather(&a.xn2, &mut g.full_a); // [N, D]; backward: reduce of dxn2
        be.linear_fwd_pair(&mut a.gate, &w.gate_proj, &mut a.up, &w.up_proj, xn2, n, f, d);
        poke();
        be.swiglu_fwd(&mut a.h, &a.gate, &a.up);
        if let Some(out) = out.as_deref_mut() {
            // Row-parallel down_proj: partial sums reduced into this rank's rows; backward:
            // gather. Beside routed experts (which wrote `out`) into `dx1`, free until backward.
            let shared = w.moe.is_some();
            let dst = if shared { &mut g.dx1 } else { &mut *out };
            be.linear_fwd(tp.partial(dst, &mut g.full_b), &a.h, &w.down_proj, n, d, f, false);
            tp.finish(dst, &g.full_b);
            if shared {
                be.add_assign(out, &g.dx1);
            }
        }
    }
    if let Some(out) = out {
        be.add_assign(out, &a.x1);
    }
}

/// Qwen3's RMSNorm of each head of `raw` (token-major `[N, heads·hd]`) into `y`, statistics
/// into `rstd [N·heads]`; nothing without a norm weight (`qk_norm` off).
fn norm_heads<T: Real, B: Backend<T>>(be: &B, m: &Dims, y: &mut B::Buf, rstd: &mut B::Buf, raw: &B::Buf, w: Option<&B::Buf>) {
    if let Some(w) = w {
        be.rmsnorm_fwd(y, rstd, raw, w, m.hd, m.norm_eps);
    }
}

/// The backward of [`norm_heads`]: the gradient of the raw projection into `dx` from that of
/// the normed heads `dy` (its weight's gradient into `sink`), and which of the two holds the
/// projection's output gradient.
#[allow(clippy::too_many_arguments)]
fn norm_heads_bwd<'a, T: Real, B: Backend<T>>(
    be: &B,
    m: &Dims,
    sink: &mut WeightGrads<B::Buf>,
    which: Norm,
    dx: &'a mut B::Buf,
    dy: &'a B::Buf,
    raw: &B::Buf,
    rstd: &B::Buf,
    w: Option<&B::Buf>,
) -> &'a B::Buf {
    match w {
        None => dy,
        Some(w) => {
            be.rmsnorm_bwd(dx, norm_slot(be, sink, which), dy, raw, w, rstd, m.hd, false);
            dx
        }
    }
}

/// `selective` checkpointing's recomputation: the activations [`block_fwd`] derives by one
/// elementwise pass from tensors that were kept, with the same kernels (bit-identical).
pub(super) fn recompute_cheap<T: Real, B: Backend<T>>(ctx: &BlockCtx<T, B>, w: &Layer<B::Buf>, a: &mut BlockActs<B::Buf>) {
    let (be, m) = (ctx.be, ctx.m);
    be.rmsnorm_fwd(&mut a.xn1, &mut a.rstd1, &a.x, &w.input_layernorm, m.d, m.norm_eps);
    be.heads_to_tokens(&mut a.att_tok, &a.att, ctx.b, ctx.s, m.heads_local, m.hd, None);
    be.rmsnorm_fwd(&mut a.xn2, &mut a.rstd2, &a.x1, &w.post_attention_layernorm, m.d, m.norm_eps);
    be.swiglu_fwd(&mut a.h, &a.gate, &a.up);
}

/// A block's projections, in the order of [`DeferredWeights`]' `dy`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Proj {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Proj {
    const ALL: [Proj; 7] = [Proj::Q, Proj::K, Proj::V, Proj::O, Proj::Gate, Proj::Up, Proj::Down];

    /// Which of [`DeferredWeights`]' `x` is this projection's input.
    fn input(self) -> usize {
        match self {
            Proj::Q | Proj::K | Proj::V => 0,
            Proj::O => 1,
            Proj::Gate | Proj::Up => 2,
            Proj::Down => 3,
        }
    }

    /// Whether the input is first met by this projection in backward (the others share it).
    fn copies_input(self) -> bool {
        matches!(self, Proj::Q | Proj::O | Proj::Gate | Proj::Down)
    }

    fn of<V>(self, l: &mut Layer<V>) -> &mut V {
        match self {
            Proj::Q => &mut l.q_proj,
            Proj::K => &mut l.k_proj,
            Proj::V => &mut l.v_proj,
            Proj::O => &mut l.o_proj,
            Proj::Gate => &mut l.gate_proj,
            Proj::Up => &mut l.up_proj,
            Proj::Down => &mut l.down_proj,
        }
    }

    /// `(out, in)` of its weight `[out, in]` in a block whose MLP is `f` wide on this rank.
    fn shape(self, m: &Dims, f: usize) -> (usize, usize) {
        let (q, kv) = (m.heads_local * m.hd, m.kv_heads_local * m.hd);
        match self {
            Proj::Q => (q, m.d),
            Proj::K | Proj::V => (kv, m.d),
            Proj::O => (m.d, q),
            Proj::Gate | Proj::Up => (f, m.d),
            Proj::Down => (m.d, f),
        }
    }

    fn is_mlp(self) -> bool {
        matches!(self, Proj::Gate | Proj::Up | Proj::Down)
    }
}

/// Where a block's backward puts its weight gradients: accumulated into the gradients now, or
/// (zero bubble) their operands kept for [`block_bwd_weight`].
pub(super) enum WeightGrads<'a, V> {
    Now(&'a mut Layer<V>),
    Deferred(&'a mut DeferredWeights<V>),
}

/// `dx (=|+=) dy · w` of projection `p` (`acc`), and its weight gradient: `dw += dyᵀ · x` now,
/// or `dy` and `x` copied for later.
#[allow(clippy::too_many_arguments)]
fn proj_bwd<T: Real, B: Backend<T>>(
    ctx: &BlockCtx<T, B>,
    sink: &mut WeightGrads<B::Buf>,
    p: Proj,
    dx: &mut B::Buf,
    acc: bool,
    dy: &B::Buf,
    x: &B::Buf,
    w: &B::Buf,
) {
    let (be, n) = (ctx.be, ctx.b * ctx.s);
    let (out, inp) = p.shape(ctx.m, be.len(w) / ctx.m.d);
    match sink {
        WeightGrads::Now(dw) => be.linear_bwd(dx, acc, p.of(dw), dy, x, w, n, out, inp),
        WeightGrads::Deferred(k) => {
            be.linear_bwd_input(dx, dy, w, n, out, inp, acc);
            // The operands' first rows·width elements: a recompute scratch serving a wider MLP
            // elsewhere in the model is longer.
            let kept = &mut k.dy[p as usize];
            be.copy_range(kept, 0, dy, 0..n * out);
            if p.copies_input() {
                be.copy_range(&mut k.x[p.input()], 0, x, 0..n * inp);
            }
        }
    }
}

/// A block's norm weights.
#[derive(Clone, Copy)]
enum Norm {
    Input,
    PostAttention,
    Q,
    K,
}

/// A norm weight's gradient slot of a block's backward: the gradient now, or (zero bubble) the
/// kept one, zeroed.
fn norm_slot<'a, T: Real, B: Backend<T>>(be: &B, sink: &'a mut WeightGrads<B::Buf>, which: Norm) -> &'a mut B::Buf {
    const QK: &str = "a q/k norm gradient exists exactly with qk_norm";
    match sink {
        WeightGrads::Now(dw) => match which {
            Norm::Input => &mut dw.input_layernorm,
            Norm::PostAttention => &mut dw.post_attention_layernorm,
            Norm::Q => dw.q_norm.as_mut().expect(QK),
            Norm::K => dw.k_norm.as_mut().expect(QK),
        },
        WeightGrads::Deferred(k) => {
            let slot = match which {
                Norm::Input => &mut k.dnorm1,
                Norm::PostAttention => &mut k.dnorm2,
                Norm::Q => &mut k.dq_norm,
                Norm::K => &mut k.dk_norm,
            };
            be.fill(slot, T::ZERO);
            slot
        }
    }
}

/// Zero bubble's weight-gradient half of a block's backward: the seven weight-gradient GEMMs
/// from their kept operands, and the norms' kept gradients, ACCUMULATED (`+=`) into `dw`.
pub(super) fn block_bwd_weight<T: Real, B: Backend<T>>(be: &B, m: &Dims, n: usize, k: &DeferredWeights<B::Buf>, dw: &mut Layer<B::Buf>) {
    if let Some(e) = dw.moe.as_mut() {
        moe_bwd_weight(be, m, k, e);
    }
    // The MLP's projections where rows pass one (a dense block, or shared experts).
    let f = be.len(&dw.gate_proj) / m.d;
    for p in Proj::ALL.into_iter().filter(|&p| f > 0 || !p.is_mlp()) {
        let (out, inp) = p.shape(m, f);
        be.linear_bwd_weight(p.of(dw), &k.dy[p as usize], &k.x[p.input()], n, out, inp, true);
    }
    be.add_assign(&mut dw.input_layernorm, &k.dnorm1);
    be.add_assign(&mut dw.post_attention_layernorm, &k.dnorm2);
    if let (Some(q), Some(kn)) = (dw.q_norm.as_mut(), dw.k_norm.as_mut()) {
        be.add_assign(q, &k.dq_norm);
        be.add_assign(kn, &k.dk_norm);
    }
}

/// One decoder block backward. `dx` holds the gradient of the block output on entry and of
/// the block input on exit; weight gradients ACCUMULATE (`+=`) into `dw`'s layer, or are
/// deferred (see [`WeightGrads`]).
pub(super) fn block_bwd<T: Real, B: Backend<T>>(
    ctx: &BlockCtx<T, B>,
    w: &Layer<B::Buf>,
    mut dw: WeightGrads<B::Buf>,
    a: &BlockActs<B::Buf>,
    g: &mut BlockGrads<B::Buf>,
    dx: &mut B::Buf,
) {
    let (be, m, tp) = (ctx.be, ctx.m, ctx.hooks.tp);
    let (b, s) = (ctx.b, ctx.s);
    let (d, hd) = (m.d, m.hd);
    let (nh, nkv) = (m.heads_local, m.kv_heads_local);
    let rope = Some((ctx.cos, ctx.sin));
    let poke = ctx.hooks.progress;

    // The dense MLP (or the shared experts): out = x1 + down(h), dxn2 into g.dxn.
    let f = be.len(&w.gate_proj) / d;
    if f > 0 {
        // The scratch fits the model's widest MLP (dense blocks beside shared experts).
        for buf in [&mut g.dh, &mut g.dgate, &mut g.dup] {
            be.resize(buf, b * s * f);
        }
        // The output gradient, gathered to all N rows.
        let dout = tp.gather(dx, &mut g.full_a);
        proj_bwd(ctx, &mut dw, Proj::Down, &mut g.dh, false, dout, &a.h, &w.down_proj);
        poke();
        be.swiglu_bwd(&mut g.dgate, &mut g.dup, &g.dh, &a.gate, &a.up);
        // xn2 is gathered again rather than kept. dxn2: partial sums of the column-parallel
        // gate/up, reduced into this rank's rows.
        let xn2 = tp.gather(&a.xn2, &mut g.full_a);
        let partial = tp.partial(&mut g.dxn, &mut g.full_b);
        proj_bwd(ctx, &mut dw, Proj::Gate, partial, false, &g.dgate, xn2, &w.gate_proj);
        poke();
        proj_bwd(ctx, &mut dw, Proj::Up, partial, true, &g.dup, xn2, &w.up_proj);
        poke();
        tp.finish(&mut g.dxn, &g.full_b);
    }
    // The routed experts act on this rank's rows: their dxn2 into (or, beside shared
    // experts, onto) g.dxn.
    if let Some(experts) = &w.moe {
        moe_bwd(ctx, experts, &mut dw, a, g, dx, experts.shared);
    }
    // dx1 = dout (residual) + norm2 backward.
    be.copy(&mut g.dx1, dx);
    be.rmsnorm_bwd(&mut g.dx1, norm_slot(be, &mut dw, Norm::PostAttention), &g.dxn, &a.x1, &w.post_attention_layernorm, &a.rstd2, d, true);

    // Attention: x1 = x + o(att_tok).
    let dx1 = tp.gather(&g.dx1, &mut g.full_a);
    proj_bwd(ctx, &mut dw, Proj::O, &mut g.d_tok, false, dx1, &a.att_tok, &w.o_proj);
    poke();
    be.tokens_to_heads(&mut g.datt, &g.d_tok, b, s, nh, hd, None);
    let grads = (&mut g.dq, &mut g.dk, &mut g.dv);
    ctx.hooks.attention.backward(be, grads, &g.datt, &a.q, &a.k, &a.v, &a.att, &a.lse, ctx.pos, ctx.attn_dims());
    poke();
    // Projections: q, k, v = xn1 · W{q,k,v}ᵀ (RoPE on q and k undone by its transpose); dxn1
    // is a partial sum over the column-parallel heads, reduced into this rank's rows.
    let xn1 = tp.gather(&a.xn1, &mut g.full_a);
    let partial = tp.partial(&mut g.dxn, &mut g.full_b);
    // With `qk_norm` the per-head norms' backward turns the heads' gradients into the raw
    // projections' (in the forward scratch `q_tok` / `kv_tok`, free now).
    be.heads_to_tokens(&mut g.d_tok, &g.dq, b, s, nh, hd, rope);
    let dq = norm_heads_bwd(be, m, &mut dw, Norm::Q, &mut g.q_tok, &g.d_tok, &a.q_raw, &a.rstd_q, w.q_norm.as_ref());
    proj_bwd(ctx, &mut dw, Proj::Q, partial, false, dq, xn1, &w.q_proj);
    poke();
    be.heads_to_tokens(&mut g.dkv_tok, &g.dk, b, s, nkv, hd, rope);
    let dk = norm_heads_bwd(be, m, &mut dw, Norm::K, &mut g.kv_tok, &g.dkv_tok, &a.k_raw, &a.rstd_k, w.k_norm.as_ref());
    proj_bwd(ctx, &mut dw, Proj::K, partial, true, dk, xn1, &w.k_proj);
    poke();
    be.heads_to_tokens(&mut g.dkv_tok, &g.dv, b, s, nkv, hd, None);
    proj_bwd(ctx, &mut dw, Proj::V, partial, true, &g.dkv_tok, xn1, &w.v_proj);
    tp.finish(&mut g.dxn, &g.full_b);
    // dx = dx1 (residual) + norm1 backward.
    be.copy(dx, &g.dx1);
    be.rmsnorm_bwd(dx, norm_slot(be, &mut dw, Norm::Input), &g.dxn, &a.x, &w.input_layernorm, &a.rstd1, d, true);
}
