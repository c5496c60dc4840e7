//! What the model keeps between forward and backward, and the scratch of one block's
//! backward: the buffers, their element counts (one function each, shared by the allocation
//! and the planner's prediction, so the two cannot drift apart), and [`ActivationMemory`].
//!
//! Legend: `B` micro-batch, `S` sequence, `N = B·S` tokens, `N_local` rows of the residual
//! stream on this rank, `D` width, `H` query heads, `KV` kv heads, `hd` head dim, `F` ffn hidden.

use super::moe::RoutedRows;
use super::params::Dims;
use crate::backend::Backend;
use crate::config::ActCkpt;
use crate::scalar::Real;

/// Rows of the residual stream of a micro-batch of `N` tokens: this rank's (`local`: `N`, or
/// `N / tp` under sequence parallelism) and those of the gather scratch (`gathered`: `N` where
/// the tensor-parallel hooks gather rows, else 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    pub local: usize,
    pub gathered: usize,
}

/// What one block keeps from forward for backward.
#[derive(Default)]
pub(super) struct BlockActs<V> {
    pub(super) x: V,       // [N, D] block input
    pub(super) rstd1: V,   // [N]
    pub(super) xn1: V,     // [N, D]
    pub(super) q: V,       // [B, H, S, hd] after RoPE
    pub(super) k: V,       // [B, KV, S, hd] after RoPE
    pub(super) v: V,       // [B, KV, S, hd]
    pub(super) att: V,     // [B, H, S, hd] attention output, head-major
    pub(super) lse: V,     // [B, H, S]
    pub(super) att_tok: V, // [N, H*hd] attention output, token-major (o_proj input)
    pub(super) x1: V,      // [N, D] after the attention residual
    pub(super) rstd2: V,   // [N]
    pub(super) xn2: V,     // [N, D]
    pub(super) gate: V,    // [N, F]
    pub(super) up: V,      // [N, F]
    pub(super) h: V,       // [N, F] silu(gate)·up
    // With `qk_norm` (else empty): the q and k projections before their per-head norm.
    pub(super) q_raw: V,  // [N, H*hd]
    pub(super) k_raw: V,  // [N, KV*hd]
    pub(super) rstd_q: V, // [N·H]
    pub(super) rstd_k: V, // [N·KV]
    // In a mixture-of-experts block (else empty), the routed rows `Nk = N·k` sorted by expert.
    pub(super) moe_x: V,    // [Nk, D] each routed row's input
    pub(super) moe_gate: V, // [Nk, Fe]
    pub(super) moe_up: V,   // [Nk, Fe]
    pub(super) moe_h: V,    // [Nk, Fe] silu(gate)·up
    pub(super) moe_y: V,    // [Nk, D] the expert's output, before its gate weight
    /// Which rows went to which experts (host memory).
    pub(super) routed: RoutedRows,
}

/// The kinds of MLP a set of block buffers serves: a block's own, or (the recompute scratch
/// shared by every block) all the kinds of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Mlp {
    /// Width on this rank of the SwiGLU MLP every row passes: the dense MLP's, or a mixture
    /// of experts' shared experts' (0: none); the largest of the model's, for all kinds.
    pub(super) width: usize,
    /// Routed experts.
    pub(super) experts: bool,
}

impl Mlp {
    /// Block `layer`'s (global index).
    pub(super) fn of(m: &Dims, layer: usize) -> Mlp {
        Mlp { width: m.mlp_width(layer), experts: m.moe_layer(layer) }
    }

    /// Every kind among the blocks `m` holds.
    pub(super) fn all(m: &Dims) -> Mlp {
        let kinds = m.layer_ids.iter().map(|&l| Mlp::of(m, l));
        kinds.fold(Mlp { width: 0, experts: false }, |a, b| Mlp { width: a.width.max(b.width), experts: a.experts || b.experts })
    }

    /// Whether rows pass a SwiGLU MLP cut over tp (a dense one, or shared experts).
    fn dense(&self) -> usize {
        (self.width > 0) as usize
    }
}

/// Which of [`BlockActs`]' fields (in declaration order) `selective` recomputes: xn1, att_tok,
/// xn2, h — each one elementwise pass over tensors that are kept.
const CHEAP_TO_RECOMPUTE: [usize; 4] = [2, 8, 11, 14];

/// Which activations a buffer holds: what forward keeps per block, or the recompute scratch.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum ActsRole {
    Saved,
    Scratch,
}

/// Element counts of every field of [`BlockActs`], in declaration order: what `alloc`
/// allocates and what the planner predicts (one function, so the two cannot drift apart).
pub(super) fn block_acts_lens(m: &Dims, n: usize, rows: Rows, ckpt: ActCkpt, role: ActsRole, mlp: Mlp) -> [usize; 24] {
    let (d, hd) = (m.d, m.hd);
    let f = mlp.width;
    let nl = rows.local;
    // The experts act on this rank's rows.
    let (nk, fe) = routed_rows(m, nl, mlp);
    let (qd, kvd) = (m.heads_local * hd, m.kv_heads_local * hd);
    let qk = m.qk_norm as usize;
    let (h, kv) = (m.heads_local, m.kv_heads_local);
    let all = [
        nl * d,
        nl,
        nl * d,
        n * qd,
        n * kvd,
        n * kvd,
        n * qd,
        n * h,
        n * qd,
        nl * d,
        nl,
        nl * d,
        n * f,
        n * f,
        n * f,
        qk * n * qd,
        qk * n * kvd,
        qk * n * h,
        qk * n * kv,
        nk * d,
        nk * fe,
        nk * fe,
        nk * fe,
        nk * d,
    ];
    let keep = |i: usize| match (ckpt, role) {
        (ActCkpt::None, ActsRole::Saved) | (ActCkpt::Full, ActsRole::Scratch) => true,
        (ActCkpt::None, ActsRole::Scratch) => false,
        (ActCkpt::Full, ActsRole::Saved) => i == 0,
        (ActCkpt::Selective, ActsRole::Saved) => !CHEAP_TO_RECOMPUTE.contains(&i),
        (ActCkpt::Selective, ActsRole::Scratch) => CHEAP_TO_RECOMPUTE.contains(&i),
    };
    std::array::from_fn(|i| if keep(i) { all[i] } else { 0 })
}

/// Routed rows `n·k` of a rank's `n` rows, and the experts' width, where `mlp` has
/// experts (else zeros).
fn routed_rows(m: &Dims, n: usize, mlp: Mlp) -> (usize, usize) {
    match m.moe.as_ref().filter(|_| mlp.experts) {
        Some(e) => (n * e.router.top_k, e.ffn),
        None => (0, 0),
    }
}

impl<V> BlockActs<V> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn alloc<T: Real, B: Backend<T, Buf = V>>(
        be: &B,
        m: &Dims,
        n: usize,
        rows: Rows,
        ckpt: ActCkpt,
        role: ActsRole,
        mlp: Mlp,
    ) -> Self {
        let [x, rstd1, xn1, q, k, v, att, lse, att_tok, x1, rstd2, xn2, gate, up, h, q_raw, k_raw, rstd_q, rstd_k, moe_x, moe_gate, moe_up, moe_h, moe_y] =
            block_acts_lens(m, n, rows, ckpt, role, mlp).map(|len| be.zeros(len));
        BlockActs {
            x,
            rstd1,
            xn1,
            q,
            k,
            v,
            att,
            lse,
            att_tok,
            x1,
            rstd2,
            xn2,
            gate,
            up,
            h,
            q_raw,
            k_raw,
            rstd_q,
            rstd_k,
            moe_x,
            moe_gate,
            moe_up,
            moe_h,
            moe_y,
            routed: RoutedRows::default(),
        }
    }

    /// Exchanges the fields `selective` recomputes (no copy: the buffers change hands).
    pub(super) fn swap_cheap(&mut self, other: &mut Self) {
        std::mem::swap(&mut self.xn1, &mut other.xn1);
        std::mem::swap(&mut self.att_tok, &mut other.att_tok);
        std::mem::swap(&mut self.xn2, &mut other.xn2);
        std::mem::swap(&mut self.h, &mut other.h);
    }

    /// Elements held, over every field.
    pub(super) fn elements<T: Real, B: Backend<T, Buf = V>>(&self, be: &B) -> usize {
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
            &self.q_raw,
            &self.k_raw,
            &self.rstd_q,
            &self.rstd_k,
            &self.moe_x,
            &self.moe_gate,
            &self.moe_up,
            &self.moe_h,
            &self.moe_y,
        ]
        .iter()
        .map(|t| be.len(t))
        .sum()
    }
}

/// Gradient buffers of one block's backward, reused across layers.
#[derive(Default)]
pub(super) struct BlockGrads<V> {
    pub(super) dx1: V,     // [N_local, D]
    pub(super) dxn: V,     // [N_local, D]
    pub(super) full_a: V,  // [N, D] gathered rows (only where the tp hooks gather: sequence parallelism)
    pub(super) full_b: V,  // [N, D] partial sums before they are scattered back (likewise)
    pub(super) dh: V,      // [N, F]
    pub(super) dgate: V,   // [N, F]
    pub(super) dup: V,     // [N, F]
    pub(super) d_tok: V,   // [N, H*hd] token-major gradient (att_tok, then q)
    pub(super) dkv_tok: V, // [N, KV*hd] (forward: the value projection)
    pub(super) datt: V,    // [B, H, S, hd]
    pub(super) dq: V,      // [B, H, S, hd]
    pub(super) dk: V,      // [B, KV, S, hd]
    pub(super) dv: V,      // [B, KV, S, hd]
    // Projection outputs before the head-major transpose (forward scratch).
    pub(super) q_tok: V,  // [N, H*hd]
    pub(super) kv_tok: V, // [N, KV*hd]
    // A mixture of experts' (else empty); `Nk` routed rows.
    pub(super) moe_logits: V, // [N, E] router logits, then their gradient
    pub(super) moe_slot: V,   // [N, D] one choice's weighted outputs
    pub(super) moe_dy: V,     // [Nk, D]
    pub(super) moe_dh: V,     // [Nk, Fe]
    pub(super) moe_dgate: V,  // [Nk, Fe]
    pub(super) moe_dup: V,    // [Nk, Fe]
    pub(super) moe_dx: V,     // [Nk, D]
}

/// Element counts of every field of [`BlockGrads`], in declaration order (see
/// [`block_acts_lens`]).
pub(super) fn block_grads_lens(m: &Dims, n: usize, rows: Rows, mlp: Mlp) -> [usize; 22] {
    let (d, hd) = (m.d, m.hd);
    let f = mlp.width;
    let (qd, kvd) = (m.heads_local * hd, m.kv_heads_local * hd);
    let full = rows.gathered * d;
    let nl = rows.local;
    let (nk, fe) = routed_rows(m, nl, mlp);
    let (ne, nd) = if nk > 0 { (nl * m.moe.as_ref().map_or(0, |e| e.router.experts), nl * d) } else { (0, 0) };
    [
        rows.local * d,
        rows.local * d,
        full,
        full,
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
        ne,
        nd,
        nk * d,
        nk * fe,
        nk * fe,
        nk * fe,
        nk * d,
    ]
}

impl<V> BlockGrads<V> {
    pub(super) fn alloc<T: Real, B: Backend<T, Buf = V>>(be: &B, m: &Dims, n: usize, rows: Rows, mlp: Mlp) -> Self {
        let [dx1, dxn, full_a, full_b, dh, dgate, dup, d_tok, dkv_tok, datt, dq, dk, dv, q_tok, kv_tok, moe_logits, moe_slot, moe_dy, moe_dh, moe_dgate, moe_dup, moe_dx] =
            block_grads_lens(m, n, rows, mlp).map(|len| be.zeros(len));
        BlockGrads {
            dx1,
            dxn,
            full_a,
            full_b,
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
            moe_logits,
            moe_slot,
            moe_dy,
            moe_dh,
            moe_dgate,
            moe_dup,
            moe_dx,
        }
    }
}

/// Zero bubble's deferred weight gradients of one block: the operands of its seven
/// weight-gradient GEMMs, kept from the input-gradient half of its backward (`B`) until the
/// weight-gradient half (`W`), and the norms' weight gradients (computed with `B`).
#[derive(Default)]
pub(super) struct DeferredWeights<V> {
    /// Per projection (`block::Proj` order: q, k, v, o, gate, up, down), the gradient of its
    /// output `[N, out]`, gathered to all `N` rows.
    pub(super) dy: [V; 7],
    /// The projections' inputs `[N, in]`, gathered: xn1 (q, k, v), att_tok (o), xn2 (gate,
    /// up), h (down).
    pub(super) x: [V; 4],
    pub(super) dnorm1: V,  // [D]
    pub(super) dnorm2: V,  // [D]
    pub(super) dq_norm: V, // [hd] with `qk_norm`, else empty
    pub(super) dk_norm: V, // [hd] with `qk_norm`, else empty
    /// A mixture-of-experts block's operands (else empty; the dense MLP's above are then
    /// empty): the experts' output gradients and inputs over the `Nk` routed rows (down:
    /// `dy [Nk, D]`, `h [Nk, Fe]`; gate and up: `dgate`, `dup [Nk, Fe]`, `x [Nk, D]`), and the
    /// router's (`dz [N_local, E]`, `xn [N_local, D]`).
    pub(super) moe: [V; 7],
    /// Each expert's routed rows (`offsets[e]..offsets[e + 1]`).
    pub(super) offsets: Vec<usize>,
}

/// Element counts of [`DeferredWeights`]: `dy` in projection order, then `x`, then the norms,
/// then the experts' operands (`n` rows, `nl` of them this rank's).
pub(super) fn deferred_lens(m: &Dims, n: usize, nl: usize, mlp: Mlp) -> [usize; 22] {
    let d = m.d;
    let f = mlp.width;
    let (qd, kvd) = (m.heads_local * m.hd, m.kv_heads_local * m.hd);
    let qk = m.qk_norm as usize * m.hd;
    let (nk, fe) = routed_rows(m, nl, mlp);
    let (ne, nd) = if nk > 0 { (nl * m.moe.as_ref().map_or(0, |e| e.router.experts), nl * d) } else { (0, 0) };
    [
        n * qd,
        n * kvd,
        n * kvd,
        n * d,
        n * f,
        n * f,
        n * d * mlp.dense(),
        n * d,
        n * qd,
        n * d * mlp.dense(),
        n * f,
        d,
        d,
        qk,
        qk,
        nk * d,
        nk * fe,
        nk * fe,
        nk * fe,
        nk * d,
        ne,
        nd,
    ]
}

impl<V> DeferredWeights<V> {
    pub(super) fn alloc<T: Real, B: Backend<T, Buf = V>>(be: &B, m: &Dims, n: usize, nl: usize, mlp: Mlp) -> Self {
        let _for = crate::backend::allocating("zero bubble's deferred weight-gradient operands", None);
        let mut bufs = deferred_lens(m, n, nl, mlp).map(|len| be.zeros(len)).into_iter();
        let mut next = || bufs.next().expect("22 buffers");
        DeferredWeights {
            dy: std::array::from_fn(|_| next()),
            x: std::array::from_fn(|_| next()),
            dnorm1: next(),
            dnorm2: next(),
            dq_norm: next(),
            dk_norm: next(),
            moe: std::array::from_fn(|_| next()),
            offsets: vec![],
        }
    }

    pub(super) fn elements<T: Real, B: Backend<T, Buf = V>>(&self, be: &B) -> usize {
        let norms = [&self.dnorm1, &self.dnorm2, &self.dq_norm, &self.dk_norm];
        self.dy.iter().chain(&self.x).chain(norms).chain(&self.moe).map(|t| be.len(t)).sum()
    }
}

/// The buffers a [`super::Model`] allocates for micro-batches of `B × S` tokens, in bytes of `f32`, by
/// what they hold. `activations()` is what `Model::activation_bytes` reports once the buffers
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
    /// Zero bubble: every block's weight-gradient operands, kept from a micro-batch's input
    /// gradient to its weight gradient (0 under the other schedules).
    pub deferred: usize,
}

impl ActivationMemory {
    /// Held between forward and backward (the measured `activation_bytes`), and under zero
    /// bubble until the weight gradient.
    pub fn activations(&self) -> usize {
        self.saved + self.recompute + self.logits + self.head + self.deferred
    }

    pub fn total(&self) -> usize {
        self.activations() + self.backward
    }

    /// `k` copies of this (the models of `k` micro-batches in flight on a pipeline stage).
    pub fn times(self, k: usize) -> ActivationMemory {
        ActivationMemory {
            saved: k * self.saved,
            recompute: k * self.recompute,
            logits: k * self.logits,
            head: k * self.head,
            backward: k * self.backward,
            deferred: k * self.deferred,
        }
    }

    /// The sum of two (a pipeline rank's chunks).
    pub fn plus(self, o: ActivationMemory) -> ActivationMemory {
        ActivationMemory {
            saved: self.saved + o.saved,
            recompute: self.recompute + o.recompute,
            logits: self.logits + o.logits,
            head: self.head + o.head,
            backward: self.backward + o.backward,
            deferred: self.deferred + o.deferred,
        }
    }
}
