//! The MLP of a mixture-of-experts block, forward beside backward: dropless token-choice
//! routing ([`super::router`]), each expert's tokens gathered into one contiguous group, one
//! SwiGLU FFN per expert over its group (a grouped linear layer), and the weighted outputs
//! gathered back per chosen slot. `MixtralSparseMoeBlock` and `Qwen3MoeSparseMoeBlock`
//! compute the same sums (`docs/model.md`, *Mixture of experts*).
//!
//! Routing is decided on the host from the router logits (it is a sort of `E` numbers per
//! row); the rows themselves stay on the backend.
//!
//! Under expert parallelism (`hooks.experts` of degree `ep > 1`) the rank holds `E / ep`
//! experts: the routed rows, sorted by expert and so by the rank holding it, go there through
//! an all-to-all (first the counts, then the rows), are reordered expert by expert, pass the
//! local experts' FFNs, and come back the same way; backward sends the output gradients out
//! and the input gradients back along the same routes ([`Dispatch`]).
//!
//! Legend: `N` rows of this rank, `D` width, `E` experts, `k` experts per row, `Fe` each
//! expert's FFN width, `Nk = N·k` routed rows (sorted by expert).

use super::activations::{BlockActs, BlockGrads, DeferredWeights};
use super::block::{BlockCtx, WeightGrads};
use super::hooks::ExpertExchange;
use super::params::{Dims, Experts, MoeDims};
use super::router::{route, route_backward, ExpertLoad, Routing};
use crate::backend::{with_host, Backend};
use crate::scalar::Real;

/// The routing of one block's rows, sorted by expert: what backward needs to send gradients
/// back the way the rows came.
#[derive(Default)]
pub(super) struct RoutedRows {
    pub(super) routing: Routing<f64>,
    /// `[Nk]`: the row of each routed row, expert by expert, rows in order within an expert.
    rows: Vec<u32>,
    /// `[N·k]`: where row `r`'s `j`-th choice sits among the routed rows (`[r·k + j]`).
    position: Vec<u32>,
    /// `[Nk]`: each routed row's gate weight.
    weights: Vec<f64>,
    /// `[E + 1]`: expert `e`'s routed rows are `offsets[e]..offsets[e + 1]`.
    offsets: Vec<usize>,
    /// Under expert parallelism: where the routed rows went.
    dispatch: Option<Dispatch>,
}

/// The routes of one block's all-to-all under expert parallelism. The routed rows, sorted by
/// expert, are already grouped by the `ep` rank holding their expert; each rank receives, from
/// every rank in turn, its rows for each of its local experts (source-major), and computes
/// them expert-major.
#[derive(Default)]
pub(super) struct Dispatch {
    /// Elements (rows × D) sent to each ep rank, and received from each.
    send: Vec<usize>,
    recv: Vec<usize>,
    /// `[M]`: for each received row in expert-major order, its place in the received order.
    to_expert_major: Vec<u32>,
    /// `[M]`: the inverse permutation.
    to_source_major: Vec<u32>,
    /// `[E/ep + 1]`: local expert `j`'s rows in expert-major order.
    offsets: Vec<usize>,
}

impl Dispatch {
    /// Exchanges the counts of `offsets` (routed rows per global expert) with the ep group.
    fn new<V>(ex: &dyn ExpertExchange<V>, offsets: &[usize], d: usize) -> Dispatch {
        let (ep, experts) = (ex.degree(), offsets.len() - 1);
        let local = experts / ep;
        let counts: Vec<u64> = offsets.windows(2).map(|w| (w[1] - w[0]) as u64).collect();
        // Block q of `counts` is what this rank sends to q's experts; block p of `received` is
        // what rank p sends to this rank's experts.
        let received = ex.exchange_counts(&counts);
        let send = counts.chunks(local).map(|c| c.iter().sum::<u64>() as usize * d).collect();
        let recv = received.chunks(local).map(|c| c.iter().sum::<u64>() as usize * d).collect();
        let mut start = vec![0usize; received.len()];
        for i in 1..received.len() {
            start[i] = start[i - 1] + received[i - 1] as usize;
        }
        let m = start.last().copied().unwrap_or(0) + received.last().copied().unwrap_or(0) as usize;
        let (mut to_expert_major, mut to_source_major) = (Vec::with_capacity(m), vec![0u32; m]);
        let mut offsets = vec![0usize; local + 1];
        for j in 0..local {
            for p in 0..ep {
                for r in 0..received[p * local + j] as usize {
                    let src = start[p * local + j] + r;
                    to_source_major[src] = to_expert_major.len() as u32;
                    to_expert_major.push(src as u32);
                }
            }
            offsets[j + 1] = to_expert_major.len();
        }
        Dispatch { send, recv, to_expert_major, to_source_major, offsets }
    }

    /// Rows this rank's experts compute.
    fn rows(&self) -> usize {
        self.to_expert_major.len()
    }
}

impl RoutedRows {
    /// Sorts the choices of `routing` by expert (a counting sort: rows stay in order).
    fn new(e: &MoeDims, routing: Routing<f64>) -> RoutedRows {
        let k = e.router.top_k;
        let mut offsets = vec![0usize; e.router.experts + 1];
        for &x in &routing.experts {
            offsets[x as usize + 1] += 1;
        }
        for i in 0..e.router.experts {
            offsets[i + 1] += offsets[i];
        }
        let mut next = offsets.clone();
        let nk = routing.experts.len();
        let (mut rows, mut position, mut weights) = (vec![0u32; nk], vec![0u32; nk], vec![0.0; nk]);
        for (c, (&x, &w)) in routing.experts.iter().zip(&routing.weights).enumerate() {
            let at = next[x as usize];
            next[x as usize] += 1;
            rows[at] = (c / k) as u32;
            position[c] = at as u32;
            weights[at] = w;
        }
        RoutedRows { routing, rows, position, weights, offsets, dispatch: None }
    }

    /// The row offsets of each expert this rank computes: every expert's, or the local
    /// experts' among the received rows.
    fn local_offsets(&self) -> &[usize] {
        self.dispatch.as_ref().map_or(&self.offsets, |x| &x.offsets)
    }

    /// The routed rows of every row's `j`-th choice, in row order.
    fn slot(&self, j: usize, k: usize) -> Vec<u32> {
        self.position.iter().skip(j).step_by(k).copied().collect()
    }

    /// The gate weights of every row's `j`-th choice, in row order.
    fn slot_weights<T: Real>(&self, j: usize, k: usize) -> Vec<T> {
        self.routing.weights.iter().skip(j).step_by(k).map(|&w| T::from_f64(w)).collect()
    }

    /// The expert load of rows `first..first + n`.
    pub(super) fn add_load(&self, e: &MoeDims, load: &mut ExpertLoad, first: usize, n: usize) {
        load.add(e.router, &self.routing, first, n);
    }
}

/// The routing of rows `x [N, D]` by the router `w [E, D]` (with the selection bias `bias`);
/// `logits [N, E]` is scratch.
#[allow(clippy::too_many_arguments)]
fn route_rows<T: Real, B: Backend<T>>(
    be: &B,
    e: &MoeDims,
    logits: &mut B::Buf,
    x: &B::Buf,
    w: &B::Buf,
    n: usize,
    d: usize,
    bias: Option<&[f64]>,
) -> RoutedRows {
    be.linear_fwd(logits, x, w, n, e.router.experts, d, false);
    let z: Vec<f64> = with_host(be, &[&*logits], |v| v[0][..n * e.router.experts].iter().map(|x| x.to_f64()).collect());
    RoutedRows::new(e, route(e.router, &z, bias))
}

/// Forward of the mixture of experts of block `layer` on `a.xn2 [N, D]` into `out [N, D]`
/// (`=`, before the residual); `out = None` is the recomputation for backward, which stops
/// before combining.
pub(super) fn moe_fwd<T: Real, B: Backend<T>>(
    ctx: &BlockCtx<T, B>,
    w: &Experts<B::Buf>,
    layer: usize,
    a: &mut BlockActs<B::Buf>,
    g: &mut BlockGrads<B::Buf>,
    out: Option<&mut B::Buf>,
) {
    let (be, m) = (ctx.be, ctx.m);
    let e = m.moe.as_ref().expect("a mixture-of-experts block has its sizes");
    let (d, fe, k) = (m.d, e.ffn, e.router.top_k);
    let n = be.len(&a.xn2) / d;
    let bias = ctx.hooks.router_bias.get(layer - e.first_dense).map(Vec::as_slice);
    let mut routed = route_rows(be, e, &mut g.moe_logits, &a.xn2, &w.gate, n, d, bias);
    let (gates, ups, downs) = weights(w);
    let ex = ctx.hooks.experts;
    if ex.degree() > 1 {
        // The rows go to the ranks holding their experts (through g's scratch), are computed
        // expert-major there, and their outputs come back in the routed order.
        let x = Dispatch::new(ex, &routed.offsets, d);
        let m = x.rows();
        be.resize(&mut g.moe_dy, routed.rows.len() * d);
        be.gather_rows(&mut g.moe_dy, &a.xn2, &routed.rows, d);
        ex.exchange_rows(&g.moe_dy, &x.send, &mut g.moe_dx, &x.recv);
        for (buf, width) in [(&mut a.moe_x, d), (&mut a.moe_gate, fe), (&mut a.moe_up, fe), (&mut a.moe_h, fe), (&mut g.moe_dy, d)] {
            be.resize(buf, m * width);
        }
        be.gather_rows(&mut a.moe_x, &g.moe_dx, &x.to_expert_major, d);
        be.grouped_linear_fwd_pair(&mut a.moe_gate, &gates, &mut a.moe_up, &ups, &a.moe_x, &x.offsets, fe, d);
        (ctx.hooks.progress)();
        be.swiglu_fwd(&mut a.moe_h, &a.moe_gate, &a.moe_up);
        be.grouped_linear_fwd(&mut g.moe_dy, &a.moe_h, &downs, &x.offsets, d, fe);
        be.gather_rows(&mut g.moe_dx, &g.moe_dy, &x.to_source_major, d);
        ex.exchange_rows(&g.moe_dx, &x.recv, &mut a.moe_y, &x.send);
        routed.dispatch = Some(x);
    } else {
        be.gather_rows(&mut a.moe_x, &a.xn2, &routed.rows, d);
        be.grouped_linear_fwd_pair(&mut a.moe_gate, &gates, &mut a.moe_up, &ups, &a.moe_x, &routed.offsets, fe, d);
        (ctx.hooks.progress)();
        be.swiglu_fwd(&mut a.moe_h, &a.moe_gate, &a.moe_up);
        be.grouped_linear_fwd(&mut a.moe_y, &a.moe_h, &downs, &routed.offsets, d, fe);
    }
    (ctx.hooks.progress)();
    if let Some(out) = out {
        // out[r] = Σ_j w_{r,j} · y[position(r, j)], the choices in order. (`moe_slot` may hold
        // another number of rows after expert parallelism's backward.)
        be.resize(&mut g.moe_slot, n * d);
        for j in 0..k {
            let dst = if j == 0 { &mut *out } else { &mut g.moe_slot };
            be.gather_rows(dst, &a.moe_y, &routed.slot(j, k), d);
            be.scale_rows(dst, &routed.slot_weights::<T>(j, k), d);
            if j > 0 {
                be.add_assign(out, &g.moe_slot);
            }
        }
    }
    a.routed = routed;
}

/// Backward of [`moe_fwd`]: from `dout [N, D]` (the gradient of its output) into `dxn [N, D]`
/// (`g.dxn`: the gradient of `a.xn2`, `=`, or `+=` with `accumulate`); weight gradients
/// ACCUMULATE into `dw`; the auxiliary loss's gradient of the probabilities comes from
/// `ctx.aux`.
pub(super) fn moe_bwd<'c, T: Real, B: Backend<T>>(
    ctx: &BlockCtx<'c, T, B>,
    w: &Experts<B::Buf>,
    dw: &mut WeightGrads<B::Buf>,
    a: &BlockActs<B::Buf>,
    g: &mut BlockGrads<B::Buf>,
    dout: &B::Buf,
    accumulate: bool,
) {
    let (be, m) = (ctx.be, ctx.m);
    let e = m.moe.as_ref().expect("a mixture-of-experts block has its sizes");
    let (d, fe, k) = (m.d, e.ffn, e.router.top_k);
    let r = &a.routed;
    let n = r.position.len() / k;
    let (gates, ups, downs) = weights(w);
    // y = down(h) is scaled by its gate weight: dy = w·dout, and dw_{r,j} = dout[r] · y.
    be.resize(&mut g.moe_dy, r.rows.len() * d);
    be.gather_rows(&mut g.moe_dy, dout, &r.rows, d);
    let dweight_sorted = be.row_dots(&g.moe_dy, &a.moe_y, d);
    let dweights: Vec<f64> = r.position.iter().map(|&p| dweight_sorted[p as usize]).collect();
    let scale: Vec<T> = r.weights.iter().map(|&x| T::from_f64(x)).collect();
    be.scale_rows(&mut g.moe_dy, &scale, d);
    let ex = ctx.hooks.experts;
    // Under expert parallelism the output gradients go where the rows were computed
    // (expert-major into `moe_slot`), and the input gradients come back into `moe_slot`.
    let dy = match &r.dispatch {
        Some(x) => {
            ex.exchange_rows(&g.moe_dy, &x.send, &mut g.moe_dx, &x.recv);
            let m = x.rows();
            for (buf, width) in [(&mut g.moe_slot, d), (&mut g.moe_dh, fe), (&mut g.moe_dgate, fe), (&mut g.moe_dup, fe)] {
                be.resize(buf, m * width);
            }
            be.gather_rows(&mut g.moe_slot, &g.moe_dx, &x.to_expert_major, d);
            be.resize(&mut g.moe_dx, m * d);
            &g.moe_slot
        }
        None => &g.moe_dy,
    };
    let offsets = r.local_offsets();
    match dw {
        WeightGrads::Now(l) => {
            let dw = l.moe.as_mut().expect("the gradient of a mixture-of-experts block has experts");
            let mut ddowns: Vec<&mut B::Buf> = dw.experts.iter_mut().map(|x| &mut x.down_proj).collect();
            be.grouped_linear_bwd(&mut g.moe_dh, false, &mut ddowns, dy, &a.moe_h, &downs, offsets, d, fe);
            (ctx.hooks.progress)();
            be.swiglu_bwd(&mut g.moe_dgate, &mut g.moe_dup, &g.moe_dh, &a.moe_gate, &a.moe_up);
            let mut dgates: Vec<&mut B::Buf> = dw.experts.iter_mut().map(|x| &mut x.gate_proj).collect();
            be.grouped_linear_bwd(&mut g.moe_dx, false, &mut dgates, &g.moe_dgate, &a.moe_x, &gates, offsets, fe, d);
            let mut dups: Vec<&mut B::Buf> = dw.experts.iter_mut().map(|x| &mut x.up_proj).collect();
            be.grouped_linear_bwd(&mut g.moe_dx, true, &mut dups, &g.moe_dup, &a.moe_x, &ups, offsets, fe, d);
        }
        // Zero bubble: the input gradients now, the weight gradients' operands kept for
        // `moe_bwd_weight`.
        WeightGrads::Deferred(k) => {
            be.grouped_linear_bwd_input(&mut g.moe_dh, dy, &downs, offsets, d, fe, false);
            be.swiglu_bwd(&mut g.moe_dgate, &mut g.moe_dup, &g.moe_dh, &a.moe_gate, &a.moe_up);
            be.grouped_linear_bwd_input(&mut g.moe_dx, &g.moe_dgate, &gates, offsets, fe, d, false);
            be.grouped_linear_bwd_input(&mut g.moe_dx, &g.moe_dup, &ups, offsets, fe, d, true);
            let [kdy, h, dgate, dup, x, _, _] = &mut k.moe;
            for (dst, src) in [(kdy, dy), (h, &a.moe_h), (dgate, &g.moe_dgate), (dup, &g.moe_dup), (x, &a.moe_x)] {
                be.resize(dst, be.len(src));
                be.copy(dst, src);
            }
            k.offsets = offsets.to_vec();
        }
    }
    (ctx.hooks.progress)();
    let dx_routed = match &r.dispatch {
        Some(x) => {
            be.resize(&mut g.moe_dy, x.rows() * d);
            be.gather_rows(&mut g.moe_dy, &g.moe_dx, &x.to_source_major, d);
            ex.exchange_rows(&g.moe_dy, &x.recv, &mut g.moe_slot, &x.send);
            &g.moe_slot
        }
        None => &g.moe_dx,
    };
    if !accumulate {
        be.fill(&mut g.dxn, T::ZERO);
    }
    be.scatter_add_rows(&mut g.dxn, dx_routed, &r.rows, d);
    // The router: logits z = xn2 · Wᵀ, through the softmax and the gate weights (and the
    // probabilities' sums in the auxiliary loss).
    let experts = e.router.experts;
    let mut dz = vec![0.0f64; n * experts];
    let (per_sequence, s, first) = (ctx.aux, ctx.s, ctx.first_row);
    let row_grad = |row: usize| -> &'c [f64] { per_sequence[(first + row) / s].as_slice() };
    let aux: Option<&dyn Fn(usize) -> &'c [f64]> = if per_sequence.is_empty() { None } else { Some(&row_grad) };
    route_backward(e.router, &r.routing, &dweights, aux, &mut dz);
    let dz: Vec<T> = dz.into_iter().map(T::from_f64).collect();
    be.upload(&mut g.moe_logits, &dz);
    match dw {
        WeightGrads::Now(l) => {
            let dw = l.moe.as_mut().expect("the gradient of a mixture-of-experts block has experts");
            be.linear_bwd(&mut g.dxn, true, &mut dw.gate, &g.moe_logits, &a.xn2, &w.gate, n, experts, d);
        }
        WeightGrads::Deferred(k) => {
            be.linear_bwd_input(&mut g.dxn, &g.moe_logits, &w.gate, n, experts, d, true);
            be.copy(&mut k.moe[5], &g.moe_logits);
            be.copy(&mut k.moe[6], &a.xn2);
        }
    }
}

/// Zero bubble's weight-gradient half of [`moe_bwd`]: every expert's and the router's
/// weight gradients from the operands it kept, ACCUMULATED (`+=`) into `dw`.
pub(super) fn moe_bwd_weight<T: Real, B: Backend<T>>(be: &B, m: &Dims, k: &DeferredWeights<B::Buf>, dw: &mut Experts<B::Buf>) {
    let e = m.moe.as_ref().expect("a mixture-of-experts block has its sizes");
    let (d, fe) = (m.d, e.ffn);
    let [dy, h, dgate, dup, x, dz, xn] = &k.moe;
    let mut ddowns: Vec<&mut B::Buf> = dw.experts.iter_mut().map(|x| &mut x.down_proj).collect();
    be.grouped_linear_bwd_weight(&mut ddowns, dy, h, &k.offsets, d, fe, true);
    let mut dgates: Vec<&mut B::Buf> = dw.experts.iter_mut().map(|x| &mut x.gate_proj).collect();
    be.grouped_linear_bwd_weight(&mut dgates, dgate, x, &k.offsets, fe, d, true);
    let mut dups: Vec<&mut B::Buf> = dw.experts.iter_mut().map(|x| &mut x.up_proj).collect();
    be.grouped_linear_bwd_weight(&mut dups, dup, x, &k.offsets, fe, d, true);
    let n = be.len(xn) / d;
    be.linear_bwd_weight(&mut dw.gate, dz, xn, n, e.router.experts, d, true);
}

/// Every expert's gate, up and down projections.
#[allow(clippy::type_complexity)]
fn weights<V>(w: &Experts<V>) -> (Vec<&V>, Vec<&V>, Vec<&V>) {
    (
        w.experts.iter().map(|x| &x.gate_proj).collect(),
        w.experts.iter().map(|x| &x.up_proj).collect(),
        w.experts.iter().map(|x| &x.down_proj).collect(),
    )
}
