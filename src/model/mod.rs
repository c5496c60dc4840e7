//! The Llama-style decoder written as one-rank maths: parameters, forward, backward.
//!
//! `Model<T, B>` owns the activations of one micro-batch on backend `B` (`backend::cpu::Cpu`
//! by default; the CUDA backend with feature `cuda`); the weights are passed in, so a parallel
//! strategy decides where they come from (local, gathered, sharded) without this module
//! knowing. Every operation goes through the backend ([`Backend`]), so the same code runs on
//! the host and on a GPU; every meeting with other ranks is a named hook ([`hooks`]), applied
//! from outside by `parallel`. Forward and backward are hand-written (llm.c style), side by
//! side per block ([`block`]). Activation checkpointing recomputes in backward, with the
//! forward's own code (so the results are bit-identical), either the whole block from its
//! saved input (`full`) or only the cheap elementwise outputs from the saved GEMM and
//! attention outputs (`selective`). Either way the last block is not recomputed: its
//! activations are still in the recompute scratch.
//!
//! Legend: `B` micro-batch, `S` sequence (this rank's tokens of it), `N = B·S` tokens,
//! `N_local` rows of the residual stream on this rank, `D` width, `H` query heads, `KV` kv
//! heads, `hd` head dim, `F` ffn hidden, `V` vocab (`_local`: this rank's share).

mod activations;
mod block;
pub mod hooks;
mod moe;
pub mod params;
pub mod positions;
pub mod router;

pub use activations::{ActivationMemory, Rows};

use crate::backend::cpu::Cpu;
use crate::backend::Backend;
use crate::config::{ActCkpt, ModelCfg};
use crate::scalar::Real;
use activations::{block_acts_lens, block_grads_lens, deferred_lens, ActsRole, BlockActs, BlockGrads, DeferredWeights, Mlp};
use block::{block_bwd, block_bwd_weight, block_fwd, recompute_cheap, BlockCtx, WeightGrads};
use hooks::{GradSink, Hooks, WeightSource};
use params::{Dims, ModelParams};
use positions::rope_tables;
use router::ExpertLoad;

/// The tokens of one micro-batch.
#[derive(Clone, Copy, Debug)]
pub struct Tokens<'a> {
    pub inputs: &'a [u32],      // [B*S]
    pub targets: &'a [u32],     // [B*S]
    pub positions: &'a [usize], // [S] global positions of this rank's tokens
    pub batch: usize,
    pub seq: usize,
}

/// The decoder and the activations of its last forward, on backend `B`.
pub struct Model<T: Real, B: Backend<T> = Cpu> {
    be: B,
    m: Dims,
    /// Causally visible (query, key) pairs this rank's attention has processed, over all heads
    /// and blocks, since the last `take_attention_pairs` (shows the context-parallel balance).
    attn_pairs: u64,
    ckpt: ActCkpt,
    /// (B, S) and the residual stream's rows the buffers are sized for.
    bs: (usize, usize),
    rows: Rows,
    /// This rank's global positions (host), and on the backend.
    positions: Vec<usize>,
    pos: B::Pos,
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
    xf_full: B::Buf,   // [N, D] gathered final-norm output (where the tp hooks gather rows)
    logits: B::Buf,    // [N, V_local]; dlogits in place after backward
    lse_ce: B::Buf,    // [N] log-sum-exp of each logits row (over the whole vocabulary)
    ce_max: B::Buf,    // [N] row maxima (scratch)
    ce_target: B::Buf, // [N] target logits (scratch)
    dx: B::Buf,        // [N_local, D] gradient of the residual stream
    /// A mixture of experts: the expert load of each sequence of the last forward, over the
    /// blocks this rank holds.
    loads: Vec<ExpertLoad>,
    /// The auxiliary loss's gradient of the router probabilities, per sequence (backward).
    aux_grads: Vec<Vec<f64>>,
    /// This rank counts its sequences' auxiliary losses (`SequenceShards::counts`).
    counts_sequences: bool,
    /// A pipeline stage after the first: the loads of the stages before it, for the next
    /// forward ([`Model::add_earlier_loads`]).
    earlier_loads: Vec<f64>,
    /// Per block this rank holds: how many of this rank's rows chose each expert in the last
    /// forward (empty for a dense block).
    block_counts: Vec<Vec<u64>>,
    _t: std::marker::PhantomData<T>,
}

impl<T: Real> Model<T, Cpu> {
    /// The whole model on one rank, on the host.
    pub fn new(cfg: &ModelCfg, ckpt: ActCkpt) -> Self {
        Self::on(Cpu::default(), Dims::full(cfg), ckpt)
    }

    /// Forward of one micro-batch with weights held whole. Returns the SUM over its tokens of
    /// the cross-entropy loss.
    pub fn forward(&mut self, params: &ModelParams<T>, tok: &Tokens) -> f64 {
        self.forward_with(&mut &*params, tok, Hooks::one_rank())
    }

    /// Backward of the last forward with weights and gradients held whole; ACCUMULATES (`+=`)
    /// into `grads`. `loss_scale` is `dloss/dloss_token` (1 / the global number of targets).
    pub fn backward(&mut self, params: &ModelParams<T>, grads: &mut ModelParams<T>, loss_scale: T) {
        self.backward_with(&mut &*params, grads, loss_scale, Hooks::one_rank())
    }

    /// Logits `[N, V_local]` of the last forward (before backward overwrites them).
    pub fn logits(&self) -> &[T] {
        &self.logits
    }
}

impl<T: Real, B: Backend<T>> Model<T, B> {
    /// A tensor-parallel rank's piece of the model (`Dims`) on backend `be`.
    pub fn on(be: B, m: Dims, ckpt: ActCkpt) -> Self {
        Model {
            be,
            m,
            attn_pairs: 0,
            ckpt,
            bs: (0, 0),
            rows: Rows { local: 0, gathered: 0 },
            positions: vec![],
            pos: Default::default(),
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
            loads: vec![],
            aux_grads: vec![],
            counts_sequences: true,
            earlier_loads: vec![],
            block_counts: vec![],
            _t: std::marker::PhantomData,
        }
    }

    pub fn backend(&self) -> &B {
        &self.be
    }

    /// What [`Model::ensure_buffers`] allocates for `B × S` tokens per rank whose residual
    /// stream has `rows`, without allocating.
    pub fn memory(m: &Dims, b: usize, s: usize, ckpt: ActCkpt, rows: Rows) -> ActivationMemory {
        let n = b * s;
        let nl = rows.local;
        let acts = |role, mlp| block_acts_lens(m, n, rows, ckpt, role, mlp).iter().sum::<usize>();
        let grads: usize = block_grads_lens(m, n, rows, Mlp::all(m)).iter().sum();
        let h = m.head as usize;
        let head = nl * m.d + h * (nl + nl * m.d + rows.gathered * m.d + n);
        ActivationMemory {
            saved: 4 * m.layer_ids.iter().map(|&l| acts(ActsRole::Saved, Mlp::of(m, l))).sum::<usize>(),
            recompute: 4 * acts(ActsRole::Scratch, Mlp::all(m)),
            logits: 4 * h * n * m.vocab_local,
            head: 4 * head,
            // Block gradients, the residual's gradient, and the loss's two row scratches.
            backward: 4 * (grads + nl * m.d + h * 2 * n),
            deferred: 0,
        }
    }

    /// Bytes of the weight-gradient operands zero bubble keeps per micro-batch (every block's
    /// [`DeferredWeights`]), for `B × S` tokens per rank.
    pub fn deferred_memory(m: &Dims, b: usize, s: usize, rows: Rows) -> usize {
        4 * m.layer_ids.iter().map(|&l| deferred_lens(m, b * s, rows.local, Mlp::of(m, l)).iter().sum::<usize>()).sum::<usize>()
    }

    fn ensure_buffers(&mut self, b: usize, s: usize, rows: Rows) {
        if self.bs == (b, s) && self.rows == rows {
            return;
        }
        let n = b * s;
        let nl = rows.local;
        let (d, v) = (self.m.d, self.m.vocab_local);
        let be = &self.be;
        let m = &self.m;
        self.saved = (0..m.layers)
            .map(|l| {
                let _for = crate::backend::allocating("saved activations of block", Some(l));
                BlockActs::alloc(be, m, n, rows, self.ckpt, ActsRole::Saved, Mlp::of(m, m.layer_ids[l]))
            })
            .collect();
        let _for = crate::backend::allocating("a block's recomputed activations and activation gradients", None);
        self.scratch = BlockActs::alloc(be, m, n, rows, self.ckpt, ActsRole::Scratch, Mlp::all(m));
        self.scratch_is_last_block = false;
        self.grads = BlockGrads::alloc(be, m, n, rows, Mlp::all(m));
        // The head's buffers exist on the stage that runs it (every rank without a pipeline).
        let _for = crate::backend::allocating("the final norm, logits and cross entropy", None);
        let h = self.m.head as usize;
        self.ce_max = be.zeros(h * n);
        self.ce_target = be.zeros(h * n);
        self.x_final = be.zeros(nl * d);
        self.rstd_f = be.zeros(h * nl);
        self.xf = be.zeros(h * nl * d);
        self.xf_full = be.zeros(h * rows.gathered * d);
        self.logits = be.zeros(h * n * v);
        self.lse_ce = be.zeros(h * n);
        self.dx = be.zeros(nl * d);
        self.bs = (b, s);
        self.rows = rows;
    }

    /// The sum over the last forward's sequences of their auxiliary load-balancing loss (0
    /// for a dense model): each sequence's `E / R² · Σ_e c_e·P_e` over its rows in every
    /// mixture-of-experts block (`router::ExpertLoad`).
    pub fn aux_loss_sum(&self) -> f64 {
        if !self.counts_sequences {
            return 0.0;
        }
        self.loads.iter().map(ExpertLoad::aux_loss).sum()
    }

    /// Per block this rank holds (in `Dims::layer_ids` order): how many of this rank's rows
    /// chose each expert in the last forward; empty for a dense block.
    pub fn block_expert_counts(&self) -> &[Vec<u64>] {
        &self.block_counts
    }

    /// The expert load of each sequence of the last forward.
    pub fn expert_loads(&self) -> &[ExpertLoad] {
        &self.loads
    }

    /// A pipeline stage: the expert loads of the stages before this one (as
    /// [`Model::packed_loads`] of the previous stage gave them), added to this stage's in the
    /// next forward.
    pub fn add_earlier_loads(&mut self, packed: &[f64]) {
        self.earlier_loads = packed.to_vec();
    }

    /// A pipeline stage before the last: the whole model's expert loads of the micro-batch
    /// (the next stage's [`Model::packed_loads`] in backward), for this stage's backward.
    pub fn set_loads(&mut self, packed: &[f64]) {
        unpack_loads(&mut self.loads, packed);
    }

    /// The expert loads of the last forward as numbers (`ExpertLoad::pack`, sequence after
    /// sequence): those of this stage and the stages before it.
    pub fn packed_loads(&self) -> Vec<f64> {
        let mut out = vec![];
        self.loads.iter().for_each(|l| l.pack(&mut out));
        out
    }

    /// Visible (query, key) pairs processed by attention forwards since the last call.
    pub fn take_attention_pairs(&mut self) -> u64 {
        std::mem::take(&mut self.attn_pairs)
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

    /// New positions: the RoPE tables and the positions on the backend.
    fn set_positions(&mut self, positions: &[usize]) {
        let (c, sn) = rope_tables::<T>(positions, self.m.hd, self.m.rope_theta);
        self.be.upload(&mut self.rope_cos, &c);
        self.be.upload(&mut self.rope_sin, &sn);
        self.be.set_positions(&mut self.pos, positions);
        self.positions = positions.to_vec();
    }

    /// Forward of one micro-batch, asking `w` for each block's weights when it needs them.
    /// Returns the SUM over its tokens of the cross-entropy loss. The tensor-parallel
    /// boundaries and the attention schedule are `hooks`' (`Hooks::one_rank()` on one rank).
    /// `tok.positions` are the global positions of this rank's tokens (under context
    /// parallelism, its chunks of the sequence).
    pub fn forward_with<W: WeightSource<B::Buf>>(&mut self, w: &mut W, tok: &Tokens, hooks: Hooks<'_, T, B>) -> f64 {
        self.forward_stage(w, tok, hooks, None)
    }

    /// [`Model::forward_with`] for a piece of a pipeline (`Dims::stage`): from the tokens where
    /// this piece runs the embedding, else from `input` (`[N_local, D]`, the previous stage's
    /// [`Model::stage_output`]); to the loss where it runs the head (returned), else to
    /// [`Model::stage_output`] (and 0 is returned).
    pub fn forward_stage<W: WeightSource<B::Buf>>(
        &mut self,
        w: &mut W,
        tok: &Tokens,
        hooks: Hooks<'_, T, B>,
        input: Option<&B::Buf>,
    ) -> f64 {
        let tp = hooks.tp;
        let (b, s) = (tok.batch, tok.seq);
        assert_eq!(tok.inputs.len(), b * s, "inputs must be [B*S]");
        assert_eq!(tok.targets.len(), b * s, "targets must be [B*S]");
        assert_eq!(tok.positions.len(), s, "positions must be [S]");
        self.ensure_buffers(b, s, Rows { local: tp.local_rows(b * s), gathered: tp.gathered_rows(b * s) });
        if self.positions != tok.positions {
            self.set_positions(tok.positions);
        }
        self.be.set_ids(&mut self.inputs, tok.inputs);
        self.be.set_ids(&mut self.targets, tok.targets);
        let be = &self.be;
        let (d, v, nl) = (self.m.d, self.m.vocab_local, self.m.layers);
        let first_row = tp.first_row(b * s);
        let ctx = BlockCtx { be, m: &self.m, hooks, cos: &self.rope_cos, sin: &self.rope_sin, pos: &self.pos, b, s, aux: &[], first_row };
        self.loads = match &self.m.moe {
            Some(e) => vec![ExpertLoad::new(e.router.experts); b],
            None => vec![],
        };
        self.block_counts = vec![vec![]; nl];

        // Vocab-parallel embedding: rows this rank holds, zero elsewhere, summed across tp
        // (into this rank's rows of the residual stream).
        let (off, valid) = (self.m.vocab_offset, self.m.vocab_valid());
        let x0 = if nl > 0 { &mut self.saved[0].x } else { &mut self.x_final };
        if self.m.embed {
            let partial = tp.partial(x0, &mut self.grads.full_b);
            be.embed_fwd(partial, w.globals().embed_tokens, &self.inputs, off, valid, d);
            tp.finish(x0, &self.grads.full_b);
        } else {
            be.copy(x0, input.expect("a stage without the embedding starts from the previous stage's output"));
        }
        for l in 0..nl {
            let (saved_l, rest) = self.saved[l..].split_first_mut().expect("layer exists");
            let out = match rest.first_mut() {
                Some(next) => &mut next.x,
                None => &mut self.x_final,
            };
            match self.ckpt {
                ActCkpt::None => block_fwd(&ctx, w.block(l), self.m.layer_ids[l], saved_l, &mut self.grads, Some(out)),
                ActCkpt::Full => {
                    be.copy(&mut self.scratch.x, &saved_l.x);
                    block_fwd(&ctx, w.block(l), self.m.layer_ids[l], &mut self.scratch, &mut self.grads, Some(out));
                }
                ActCkpt::Selective => {
                    // The cheap outputs are written into the scratch and not kept.
                    saved_l.swap_cheap(&mut self.scratch);
                    block_fwd(&ctx, w.block(l), self.m.layer_ids[l], saved_l, &mut self.grads, Some(out));
                    saved_l.swap_cheap(&mut self.scratch);
                }
            }
            if let Some(e) = self.m.moe.as_ref().filter(|_| self.m.moe_layer(self.m.layer_ids[l])) {
                let acts = if self.ckpt == ActCkpt::Full { &self.scratch } else { &self.saved[l] };
                let rows = first_row..first_row + tp.local_rows(b * s);
                let mut block = ExpertLoad::new(e.router.experts);
                acts.routed.add_load(e, &mut block, 0, rows.len());
                self.block_counts[l] = block.counts;
                for (q, load) in self.loads.iter_mut().enumerate() {
                    // This rank's rows of sequence q (all of them, or a part under SP).
                    let (lo, hi) = ((q * s).max(rows.start), ((q + 1) * s).min(rows.end));
                    if lo < hi {
                        acts.routed.add_load(e, load, lo - rows.start, hi - lo);
                    }
                }
            }
            w.block_done(l);
        }
        self.scratch_is_last_block = nl > 0;
        self.counts_sequences = gather_loads(&mut self.loads, hooks.sequences);
        if !self.earlier_loads.is_empty() {
            let mut earlier = self.loads.clone();
            unpack_loads(&mut earlier, &std::mem::take(&mut self.earlier_loads));
            self.loads.iter_mut().zip(&earlier).for_each(|(l, e)| l.merge(e));
        }
        self.attn_pairs += hooks.attention.visible_pairs(&self.positions) * (b * self.m.heads_local * nl) as u64;
        if !self.m.head {
            return 0.0;
        }
        let g = w.globals();
        // Final norm, output projection [N, V_local], vocab-parallel cross entropy: the row
        // maximum, the sum of exponentials and the target logit are each reduced across tp, so
        // the whole logits row never exists on one rank.
        be.rmsnorm_fwd(&mut self.xf, &mut self.rstd_f, &self.x_final, g.norm, d, self.m.norm_eps);
        let xf = tp.gather(&self.xf, &mut self.xf_full);
        be.linear_fwd(&mut self.logits, xf, g.output, b * s, v, d, false);
        (hooks.progress)();
        be.ce_row_max(&mut self.ce_max, &self.logits, v, valid);
        tp.vocab_max(&mut self.ce_max);
        be.ce_row_sum_exp(&mut self.lse_ce, &self.logits, &self.ce_max, v, valid);
        tp.vocab_sum(&mut self.lse_ce);
        be.ce_target_logit(&mut self.ce_target, &self.logits, &self.targets, v, off, valid);
        tp.vocab_sum(&mut self.ce_target);
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
        hooks: Hooks<'_, T, B>,
    ) {
        self.backward_stage(w, gs, loss_scale, hooks, None)
    }

    /// The output of the last forward of a stage without the head (`[N_local, D]`).
    pub fn stage_output(&self) -> &B::Buf {
        &self.x_final
    }

    /// The gradient of the loss w.r.t. the input of the last forward (`[N_local, D]`), after
    /// [`Model::backward_stage`] of a stage without the embedding.
    pub fn input_grad(&self) -> &B::Buf {
        &self.dx
    }

    /// [`Model::backward_with`] for a piece of a pipeline: from the loss where this piece runs
    /// the head, else from `output_grad` (the gradient w.r.t. its [`Model::stage_output`], from
    /// the next stage); into the embedding where it runs it, else to [`Model::input_grad`].
    pub fn backward_stage<W: WeightSource<B::Buf>, G: GradSink<B::Buf>>(
        &mut self,
        w: &mut W,
        gs: &mut G,
        loss_scale: T,
        hooks: Hooks<'_, T, B>,
        output_grad: Option<&B::Buf>,
    ) {
        self.backward_pass(w, gs, loss_scale, hooks, output_grad, None)
    }

    /// Zero bubble's input-gradient half of [`Model::backward_stage`]: everything but the
    /// blocks' weight gradients, whose operands go to `work` (the embedding's, the final
    /// norm's and the output projection's gradients are computed and handed to `gs` as
    /// usual). The model's activations are free again afterwards; the blocks' weight gradients
    /// follow with [`WeightGradWork::apply`].
    pub fn backward_input_stage<W: WeightSource<B::Buf>, G: GradSink<B::Buf>>(
        &mut self,
        w: &mut W,
        gs: &mut G,
        loss_scale: T,
        hooks: Hooks<'_, T, B>,
        output_grad: Option<&B::Buf>,
        work: &mut WeightGradWork<B::Buf>,
    ) {
        let n = self.bs.0 * self.bs.1;
        if work.n != n || work.m != self.m {
            *work = WeightGradWork {
                m: self.m.clone(),
                n,
                blocks: self
                    .m
                    .layer_ids
                    .iter()
                    .map(|&l| DeferredWeights::alloc(&self.be, &self.m, n, self.rows.local, Mlp::of(&self.m, l)))
                    .collect(),
            };
        }
        self.backward_pass(w, gs, loss_scale, hooks, output_grad, Some(&mut work.blocks))
    }

    fn backward_pass<W: WeightSource<B::Buf>, G: GradSink<B::Buf>>(
        &mut self,
        w: &mut W,
        gs: &mut G,
        loss_scale: T,
        hooks: Hooks<'_, T, B>,
        output_grad: Option<&B::Buf>,
        mut deferred: Option<&mut Vec<DeferredWeights<B::Buf>>>,
    ) {
        let tp = hooks.tp;
        let (b, s) = self.bs;
        let n = b * s;
        let be = &self.be;
        let (d, v, nl) = (self.m.d, self.m.vocab_local, self.m.layers);
        let (off, valid) = (self.m.vocab_offset, self.m.vocab_valid());
        // The auxiliary loss per sequence, `coef · aux_q / Q` over the global batch's `Q`
        // sequences: `1 / Q` is a sequence's targets times `loss_scale` (1 / all targets), and
        // a sequence's targets are its rows over the mixture-of-experts blocks.
        self.aux_grads = match &self.m.moe {
            Some(e) if e.aux_coef > 0.0 => {
                let blocks = self.m.moe_layers().max(1) as f64;
                self.loads.iter().map(|q| q.prob_grad(e.aux_coef * (q.rows as f64 / blocks) * loss_scale.to_f64())).collect()
            }
            _ => vec![],
        };
        let first_row = tp.first_row(n);
        let ctx = BlockCtx {
            be,
            m: &self.m,
            hooks,
            cos: &self.rope_cos,
            sin: &self.rope_sin,
            pos: &self.pos,
            b,
            s,
            aux: &self.aux_grads,
            first_row,
        };

        if !self.m.head {
            be.copy(&mut self.dx, output_grad.expect("a stage without the head starts from the next stage's gradient"));
        } else {
            // Loss and output projection: dlogits = scale·(softmax − onehot) [N, V_local].
            be.ce_bwd_inplace(&mut self.logits, &self.lse_ce, &self.targets, v, off, valid, loss_scale);
            let (g, dg) = (w.globals(), gs.globals_mut());
            let dw_out = match dg.lm_head {
                Some(h) => h,
                None => &mut *dg.embed_tokens,
            };
            let xf = tp.gathered(&self.xf, &self.xf_full);
            // dxf [N_local, D]: the partial sums of every vocab shard, reduced across tp
            // (conjugate of the replicated / gathered xf feeding every shard).
            let dxf = &mut self.grads.dxn;
            be.linear_bwd(tp.partial(dxf, &mut self.grads.full_b), false, dw_out, &self.logits, xf, g.output, n, v, d);
            (hooks.progress)();
            tp.finish(dxf, &self.grads.full_b);
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
                        block_fwd(&ctx, wl, self.m.layer_ids[l], &mut self.scratch, &mut self.grads, None);
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
            let dw = match deferred.as_deref_mut() {
                Some(kept) => WeightGrads::Deferred(&mut kept[l]),
                None => WeightGrads::Now(gs.block_mut(l)),
            };
            block_bwd(&ctx, wl, dw, acts, &mut self.grads, &mut self.dx);
            if self.ckpt == ActCkpt::Selective {
                self.saved[l].swap_cheap(&mut self.scratch);
            }
            w.block_done(l);
            if deferred.is_none() {
                gs.block_done(l);
            }
        }
        // Embedding: dE[token[n]] += dx[n] for the vocabulary rows this rank holds (dx gathered
        // to all N rows: conjugate of the reduce-scatter after the lookup).
        if self.m.embed {
            let de = gs.globals_mut().embed_tokens;
            let dx = tp.gather(&self.dx, &mut self.grads.full_a);
            be.embed_bwd(de, dx, &self.inputs, off, valid, d);
        }
        if self.m.embed || self.m.head {
            gs.globals_done();
        }
    }
}

/// Completes each sequence's expert load with its rows on other ranks (context and sequence
/// parallelism), so every rank holding part of a sequence has its whole load; returns whether
/// this rank counts the sequences' auxiliary losses.
fn gather_loads(loads: &mut [ExpertLoad], sequences: &dyn hooks::SequenceShards) -> bool {
    if !loads.is_empty() {
        let mut packed = vec![];
        loads.iter().for_each(|l| l.pack(&mut packed));
        sequences.sum(&mut packed);
        unpack_loads(loads, &packed);
    }
    sequences.counts()
}

/// Loads from what `ExpertLoad::pack` wrote for each of them, in order.
fn unpack_loads(loads: &mut [ExpertLoad], packed: &[f64]) {
    let mut rest = packed;
    for l in loads.iter_mut() {
        rest = l.unpack(rest);
    }
    debug_assert!(rest.is_empty(), "one packed load per sequence");
}

/// Zero bubble's weight-gradient operands of one micro-batch's backward on one model piece:
/// what [`Model::backward_input_stage`] keeps so that the blocks' weight gradients can be
/// computed later, by [`WeightGradWork::apply`].
pub struct WeightGradWork<V> {
    m: Dims,
    n: usize,
    blocks: Vec<DeferredWeights<V>>,
}

impl<V> Default for WeightGradWork<V> {
    fn default() -> Self {
        WeightGradWork { m: Dims::default(), n: 0, blocks: vec![] }
    }
}

impl<V> WeightGradWork<V> {
    /// Every block's weight gradients from the kept operands, ACCUMULATED (`+=`) into the
    /// gradients `gs` hands out, last block first, each handed back with `block_done`.
    pub fn apply<T: Real, B: Backend<T, Buf = V>, G: GradSink<V>>(&self, be: &B, gs: &mut G) {
        for l in (0..self.blocks.len()).rev() {
            block_bwd_weight(be, &self.m, self.n, &self.blocks[l], gs.block_mut(l));
            gs.block_done(l);
        }
    }

    /// Bytes held (`f32` elements).
    pub fn bytes<T: Real, B: Backend<T, Buf = V>>(&self, be: &B) -> usize {
        4 * self.blocks.iter().map(|k| k.elements(be)).sum::<usize>()
    }
}
