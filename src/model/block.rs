//! One decoder block, forward beside backward, as one-rank maths: every tensor-parallel
//! boundary is a named hook (`tp.gather`, `tp.partial` / `tp.finish`, each with its backward
//! conjugate noted) and attention is the schedule's (`hooks.attention`), so the same code runs
//! on one rank, under tensor and sequence parallelism, and on a context-parallel ring.
//!
//! Legend: `B` micro-batch, `S` sequence (this rank's tokens of it), `N = B·S` tokens,
//! `N_local` rows of the residual stream on this rank, `D` width, `H`/`KV` query/kv heads on
//! this rank, `hd` head dim, `F` ffn hidden on this rank.

use super::activations::{BlockActs, BlockGrads};
use super::hooks::Hooks;
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
}

impl<T: Real, B: Backend<T>> BlockCtx<'_, T, B> {
    fn attn_dims(&self) -> AttnDims {
        AttnDims { b: self.b, h: self.m.heads_local, kv: self.m.kv_heads_local, sq: self.s, sk: self.s, hd: self.m.hd }
    }
}

/// One decoder block forward: `x1 = x + o(attn(rope(q(n1(x))), rope(k(..)), v(..)))`,
/// `out = x1 + down(silu(gate(n2(x1))) · up(n2(x1)))`. Fills `a` (its `x` is the input) and
/// overwrites `out [N, D]`; `g` lends its projection scratch. `out = None` is the recomputation
/// for backward, which needs every activation but not the block output: it skips the down
/// projection (a fifth of the block's FLOPs) and its tensor-parallel reduction.
pub(super) fn block_fwd<T: Real, B: Backend<T>>(
    ctx: &BlockCtx<T, B>,
    w: &Layer<B::Buf>,
    a: &mut BlockActs<B::Buf>,
    g: &mut BlockGrads<B::Buf>,
    out: Option<&mut B::Buf>,
) {
    let (be, m, tp) = (ctx.be, ctx.m, ctx.hooks.tp);
    let (b, s, n) = (ctx.b, ctx.s, ctx.b * ctx.s);
    let (d, f, hd) = (m.d, m.ffn_local, m.hd);
    let (nh, nkv) = (m.heads_local, m.kv_heads_local);
    let rope = Some((ctx.cos, ctx.sin));
    // Between the block's large pieces of work, communication in flight moves.
    let poke = ctx.hooks.progress;

    be.rmsnorm_fwd(&mut a.xn1, &mut a.rstd1, &a.x, &w.input_layernorm, d, m.norm_eps);
    let xn1 = tp.gather(&a.xn1, &mut g.full_a); // [N, D]; backward: reduce of dxn1
    be.linear_fwd(&mut g.q_tok, xn1, &w.q_proj, n, nh * hd, d, false);
    poke();
    be.tokens_to_heads(&mut a.q, &g.q_tok, b, s, nh, hd, rope);
    // The value projection lands in `dkv_tok`, free until backward.
    be.linear_fwd_pair(&mut g.kv_tok, &w.k_proj, &mut g.dkv_tok, &w.v_proj, xn1, n, nkv * hd, d);
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
    let xn2 = tp.gather(&a.xn2, &mut g.full_a); // [N, D]; backward: reduce of dxn2
    be.linear_fwd_pair(&mut a.gate, &w.gate_proj, &mut a.up, &w.up_proj, xn2, n, f, d);
    poke();
    be.swiglu_fwd(&mut a.h, &a.gate, &a.up);
    let Some(out) = out else { return };
    // Row-parallel down_proj: partial sums reduced into this rank's rows; backward: gather.
    be.linear_fwd(tp.partial(out, &mut g.full_b), &a.h, &w.down_proj, n, d, f, false);
    tp.finish(out, &g.full_b);
    be.add_assign(out, &a.x1);
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

/// One decoder block backward. `dx` holds the gradient of the block output on entry and of
/// the block input on exit; weight gradients ACCUMULATE (`+=`) into `dw`.
pub(super) fn block_bwd<T: Real, B: Backend<T>>(
    ctx: &BlockCtx<T, B>,
    w: &Layer<B::Buf>,
    dw: &mut Layer<B::Buf>,
    a: &BlockActs<B::Buf>,
    g: &mut BlockGrads<B::Buf>,
    dx: &mut B::Buf,
) {
    let (be, m, tp) = (ctx.be, ctx.m, ctx.hooks.tp);
    let (b, s, n) = (ctx.b, ctx.s, ctx.b * ctx.s);
    let (d, f, hd) = (m.d, m.ffn_local, m.hd);
    let (nh, nkv) = (m.heads_local, m.kv_heads_local);
    let rope = Some((ctx.cos, ctx.sin));
    let poke = ctx.hooks.progress;

    // MLP: out = x1 + down(h). The output gradient, gathered to all N rows.
    let dout = tp.gather(dx, &mut g.full_a);
    be.linear_bwd(&mut g.dh, false, &mut dw.down_proj, dout, &a.h, &w.down_proj, n, d, f);
    poke();
    be.swiglu_bwd(&mut g.dgate, &mut g.dup, &g.dh, &a.gate, &a.up);
    // xn2 is gathered again rather than kept. dxn2: partial sums of the column-parallel
    // gate/up, reduced into this rank's rows.
    let xn2 = tp.gather(&a.xn2, &mut g.full_a);
    let partial = tp.partial(&mut g.dxn, &mut g.full_b);
    be.linear_bwd(partial, false, &mut dw.gate_proj, &g.dgate, xn2, &w.gate_proj, n, f, d);
    poke();
    be.linear_bwd(partial, true, &mut dw.up_proj, &g.dup, xn2, &w.up_proj, n, f, d);
    poke();
    tp.finish(&mut g.dxn, &g.full_b);
    // dx1 = dout (residual) + norm2 backward.
    be.copy(&mut g.dx1, dx);
    be.rmsnorm_bwd(&mut g.dx1, &mut dw.post_attention_layernorm, &g.dxn, &a.x1, &w.post_attention_layernorm, &a.rstd2, d, true);

    // Attention: x1 = x + o(att_tok).
    let dx1 = tp.gather(&g.dx1, &mut g.full_a);
    be.linear_bwd(&mut g.d_tok, false, &mut dw.o_proj, dx1, &a.att_tok, &w.o_proj, n, d, nh * hd);
    poke();
    be.tokens_to_heads(&mut g.datt, &g.d_tok, b, s, nh, hd, None);
    let grads = (&mut g.dq, &mut g.dk, &mut g.dv);
    ctx.hooks.attention.backward(be, grads, &g.datt, &a.q, &a.k, &a.v, &a.att, &a.lse, ctx.pos, ctx.attn_dims());
    poke();
    // Projections: q, k, v = xn1 · W{q,k,v}ᵀ (RoPE on q and k undone by its transpose); dxn1
    // is a partial sum over the column-parallel heads, reduced into this rank's rows.
    let xn1 = tp.gather(&a.xn1, &mut g.full_a);
    let partial = tp.partial(&mut g.dxn, &mut g.full_b);
    be.heads_to_tokens(&mut g.d_tok, &g.dq, b, s, nh, hd, rope);
    be.linear_bwd(partial, false, &mut dw.q_proj, &g.d_tok, xn1, &w.q_proj, n, nh * hd, d);
    poke();
    be.heads_to_tokens(&mut g.dkv_tok, &g.dk, b, s, nkv, hd, rope);
    be.linear_bwd(partial, true, &mut dw.k_proj, &g.dkv_tok, xn1, &w.k_proj, n, nkv * hd, d);
    poke();
    be.heads_to_tokens(&mut g.dkv_tok, &g.dv, b, s, nkv, hd, None);
    be.linear_bwd(partial, true, &mut dw.v_proj, &g.dkv_tok, xn1, &w.v_proj, n, nkv * hd, d);
    tp.finish(&mut g.dxn, &g.full_b);
    // dx = dx1 (residual) + norm1 backward.
    be.copy(dx, &g.dx1);
    be.rmsnorm_bwd(dx, &mut dw.input_layernorm, &g.dxn, &a.x, &w.input_layernorm, &a.rstd1, d, true);
}
