//! Where the model meets everything outside one rank's maths: where its weights come from
//! ([`WeightSource`]), where its gradients go ([`GradSink`]), the tensor-parallel boundaries of
//! a block ([`TensorParallel`]), the attention schedule over the sequence
//! ([`AttentionSchedule`]) and the progress call between large pieces of compute. The model
//! calls these named hooks; `parallel` implements them (FSDP's gathered weights and reduced
//! gradients, Megatron's tensor parallelism with sequence parallelism, the context-parallel
//! ring). [`OneRank`] and [`LocalAttention`] are the one-rank versions: every hook the identity
//! or the local kernel. All are written over the backend's buffer type `V`, so a strategy can
//! implement them on device buffers without the model changing.
//!
//! Legend: `N = B·S` tokens of the micro-batch, `N_local` the rows of the residual stream this
//! rank holds (`N`, or `N / tp` under sequence parallelism).

use super::params::{Layer, Params};
use crate::backend::{AttnDims, Backend};
use crate::scalar::Real;

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

/// The tensor-parallel boundaries of a block as the one-rank maths meets them (Megatron:
/// column-parallel `q, k, v, gate, up` read all `N` rows of their input; row-parallel `o, down`
/// produce partial sums over the heads or features this rank holds; the vocabulary is split
/// across ranks). Each call site in the model names its backward conjugate. One rank: every
/// hook is the identity ([`OneRank`]).
pub trait TensorParallel<V> {
    /// Rows of the residual stream this rank holds of `n` (`N_local`).
    fn local_rows(&self, n: usize) -> usize;
    /// The index among the `n` rows of the micro-batch of this rank's first row (its rows are
    /// contiguous).
    fn first_row(&self, n: usize) -> usize;
    /// Rows of the scratch that [`TensorParallel::gather`] fills (0 where it needs none).
    fn gathered_rows(&self, n: usize) -> usize;
    /// All `N` rows of `local` for a column-parallel projection: gathered into `full`, or
    /// `local` itself where the rank holds them all.
    fn gather<'b>(&self, local: &'b V, full: &'b mut V) -> &'b V;
    /// What the last [`TensorParallel::gather`] of `local` into `full` returned, without
    /// communicating again.
    fn gathered<'b>(&self, local: &'b V, full: &'b V) -> &'b V;
    /// Where a row-parallel projection writes its partial sums: `full` when they are reduced
    /// and scattered back to `local`'s rows, else `local` itself.
    fn partial<'b>(&self, local: &'b mut V, full: &'b mut V) -> &'b mut V;
    /// Completes the partial sums written where [`TensorParallel::partial`] said into this
    /// rank's rows `local` (summed across the tp ranks).
    fn finish(&self, local: &mut V, full: &V);
    /// The row maxima of vocabulary-parallel logits, over every rank's vocabulary rows.
    fn vocab_max(&self, buf: &mut V);
    /// Row sums over every rank's vocabulary rows (the cross entropy's sum of exponentials
    /// and its target logit).
    fn vocab_sum(&self, buf: &mut V);
}

/// The attention of this rank's queries over the whole causal sequence, whatever part of it
/// this rank holds. One rank: the attention kernel on the local keys ([`LocalAttention`]).
#[allow(clippy::too_many_arguments)]
pub trait AttentionSchedule<T: Real, B: Backend<T>> {
    /// `o [B, H, S_local, hd] =`, `lse [B, H, S_local] =`.
    fn forward(&self, be: &B, o: &mut B::Buf, lse: &mut B::Buf, q: &B::Buf, k: &B::Buf, v: &B::Buf, pos: &B::Pos, dm: AttnDims);
    /// `dq =`, `dk =`, `dv =` (the gradients of this rank's own keys and values).
    fn backward(
        &self,
        be: &B,
        grads: (&mut B::Buf, &mut B::Buf, &mut B::Buf),
        d_o: &B::Buf,
        q: &B::Buf,
        k: &B::Buf,
        v: &B::Buf,
        o: &B::Buf,
        lse: &B::Buf,
        pos: &B::Pos,
        dm: AttnDims,
    );
    /// Causally visible (query, key) pairs of one (sequence, head) for queries at `q_pos`: the
    /// attention work of one call.
    fn visible_pairs(&self, q_pos: &[usize]) -> u64;
}

/// Statistics each sequence of a micro-batch gathers from its rows, wherever they are (a
/// mixture of experts' expert load): rows of one sequence sit on several ranks under context
/// parallelism and under sequence parallelism. One rank: they are all here ([`WholeSequences`]).
pub trait SequenceShards {
    /// Sums `x` (host numbers, in the same order on every rank) over the ranks that hold rows
    /// of this rank's sequences.
    fn sum(&self, x: &mut [f64]);
    /// Whether this rank counts its sequences in the step's loss sums (exactly one of the
    /// ranks that share them does).
    fn counts(&self) -> bool;
}

/// Every row of a sequence is on this rank.
pub struct WholeSequences;

impl SequenceShards for WholeSequences {
    fn sum(&self, _x: &mut [f64]) {}
    fn counts(&self) -> bool {
        true
    }
}

/// The all-to-all of expert parallelism: the ranks of an `ep` group each hold
/// `n_experts / ep` experts, and send every routed row to the rank holding its expert.
/// One rank ([`AllExpertsHere`]): degree 1, and the model never exchanges.
pub trait ExpertExchange<V> {
    /// Ranks the experts are split over.
    fn degree(&self) -> usize;
    /// This rank's place among them (it holds experts `rank·E/degree..(rank+1)·E/degree`).
    fn rank(&self) -> usize;
    /// `send [degree][k]` host integers, block q to rank q; returns `[degree][k]`, block p
    /// from rank p (the routed counts each rank sends to each expert).
    fn exchange_counts(&self, send: &[u64]) -> Vec<u64>;
    /// Sends `send_counts[q]` elements of `send` (rank by rank) to rank q, and receives
    /// `recv_counts[p]` elements from rank p into `recv` (rank by rank; resized to their sum).
    fn exchange_rows(&self, send: &V, send_counts: &[usize], recv: &mut V, recv_counts: &[usize]);
}

/// Every expert is on this rank.
pub struct AllExpertsHere;

impl<V> ExpertExchange<V> for AllExpertsHere {
    fn degree(&self) -> usize {
        1
    }
    fn rank(&self) -> usize {
        0
    }
    fn exchange_counts(&self, send: &[u64]) -> Vec<u64> {
        send.to_vec()
    }
    fn exchange_rows(&self, _send: &V, _send_counts: &[usize], _recv: &mut V, _recv_counts: &[usize]) {
        panic!("a rank holding every expert routes its rows locally: the model never exchanges them at degree 1");
    }
}

/// How one rank's model meets the other ranks during a pass.
pub struct Hooks<'a, T: Real, B: Backend<T>> {
    pub tp: &'a dyn TensorParallel<B::Buf>,
    pub attention: &'a dyn AttentionSchedule<T, B>,
    pub sequences: &'a dyn SequenceShards,
    /// Where the routed rows of a mixture of experts go: to the `ep` rank holding the expert.
    pub experts: &'a dyn ExpertExchange<B::Buf>,
    /// Balancing without an auxiliary loss: each expert block's selection bias `[E]`, by its
    /// index among the expert blocks (empty: no bias).
    pub router_bias: &'a [Vec<f64>],
    /// Called between the large pieces of a block's compute, so communication started outside
    /// the model (the next block's all-gather, the last block's gradient reduction) moves while
    /// it computes: MPI progresses non-blocking operations only inside its calls.
    pub progress: fn(),
}

impl<T: Real, B: Backend<T>> Clone for Hooks<'_, T, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: Real, B: Backend<T>> Copy for Hooks<'_, T, B> {}

/// Nothing in flight to progress.
pub fn no_progress() {}

impl<T: Real, B: Backend<T>> Hooks<'static, T, B> {
    /// One rank: every hook is the identity or the local kernel.
    pub fn one_rank() -> Self {
        Hooks {
            tp: &OneRank,
            attention: &LocalAttention,
            sequences: &WholeSequences,
            experts: &AllExpertsHere,
            router_bias: &[],
            progress: no_progress,
        }
    }
}

/// One rank holds every head, the whole vocabulary and all rows: the tensor-parallel hooks
/// are identities.
pub struct OneRank;

impl<V> TensorParallel<V> for OneRank {
    fn local_rows(&self, n: usize) -> usize {
        n
    }
    fn first_row(&self, _n: usize) -> usize {
        0
    }
    fn gathered_rows(&self, _n: usize) -> usize {
        0
    }
    fn gather<'b>(&self, local: &'b V, _full: &'b mut V) -> &'b V {
        local
    }
    fn gathered<'b>(&self, local: &'b V, _full: &'b V) -> &'b V {
        local
    }
    fn partial<'b>(&self, local: &'b mut V, _full: &'b mut V) -> &'b mut V {
        local
    }
    fn finish(&self, _local: &mut V, _full: &V) {}
    fn vocab_max(&self, _buf: &mut V) {}
    fn vocab_sum(&self, _buf: &mut V) {}
}

/// One rank holds the whole sequence: attention over its own keys.
pub struct LocalAttention;

impl<T: Real, B: Backend<T>> AttentionSchedule<T, B> for LocalAttention {
    fn forward(&self, be: &B, o: &mut B::Buf, lse: &mut B::Buf, q: &B::Buf, k: &B::Buf, v: &B::Buf, pos: &B::Pos, dm: AttnDims) {
        be.attention_fwd(o, lse, q, k, v, pos, pos, dm);
    }

    fn backward(
        &self,
        be: &B,
        (dq, dk, dv): (&mut B::Buf, &mut B::Buf, &mut B::Buf),
        d_o: &B::Buf,
        q: &B::Buf,
        k: &B::Buf,
        v: &B::Buf,
        o: &B::Buf,
        lse: &B::Buf,
        pos: &B::Pos,
        dm: AttnDims,
    ) {
        be.attention_bwd(dq, dk, dv, d_o, q, k, v, o, lse, pos, pos, dm);
    }

    fn visible_pairs(&self, q_pos: &[usize]) -> u64 {
        super::positions::visible_pairs(q_pos, q_pos)
    }
}
