//! Pipeline parallelism over the `pp` group: which blocks each rank holds, the point-to-point
//! traffic between neighbouring stages, and the schedules ([`schedule`]).
//!
//! The model's blocks are divided over `pp × pp_virtual` virtual stages (`[parallel]
//! pp_layers`, or the balanced split of `config`); virtual stage `k·pp + p` is chunk `k` of
//! pipeline rank `p`, so with `pp_virtual = 1` a rank is one contiguous stage. The first stage
//! also runs the embedding, the last the final norm, the output projection and the loss. A
//! forward sends its output activation (`[N_local, D]`, this rank's rows under tp/sp and its
//! tokens under cp) to the next stage; a backward sends the gradient w.r.t. its input to the
//! previous one. With tied embeddings both ends hold `embed_tokens` and their gradients are
//! summed over the two before the update (Megatron's embedding group), so both copies stay
//! bit-identical. Each piece of the model is an ordinary `Model` built on `Dims::stage`; the
//! weights and gradients of all of a rank's chunks live in one FSDP state, each chunk seeing
//! its blocks through [`Offset`].

pub mod executor;
pub mod schedule;

use super::comm::{Group, Ticket};
use super::fsdp::grads::FsdpGrads;
use super::mesh::Mesh;
use crate::backend::{with_host_mut, Backend};
use crate::config::Resolved;
use crate::model::hooks::{Globals, GlobalsMut, GradSink, WeightSource};
use crate::model::params::{Dims, Layer};
use std::collections::VecDeque;

/// One model chunk of a pipeline rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Global indices of its blocks.
    pub layer_ids: Vec<usize>,
    /// Where its blocks start in the rank's blocks (the rank holds its chunks one after another).
    pub offset: usize,
    /// It runs the embedding (virtual stage 0).
    pub embed: bool,
    /// It runs the head and the loss (the last virtual stage).
    pub head: bool,
}

/// The chunks of pipeline rank `rank` of `pp`, for `stage_layers` blocks per virtual stage
/// (`pp × v` entries, `v` chunks per rank).
pub fn chunks(stage_layers: &[usize], pp: usize, rank: usize) -> Vec<Chunk> {
    let stages = stage_layers.len();
    let first: Vec<usize> = stage_layers.iter().scan(0, |acc, &n| Some(std::mem::replace(acc, *acc + n))).collect();
    let mut offset = 0;
    (rank..stages)
        .step_by(pp)
        .map(|vs| {
            let c =
                Chunk { layer_ids: (first[vs]..first[vs] + stage_layers[vs]).collect(), offset, embed: vs == 0, head: vs + 1 == stages };
            offset += stage_layers[vs];
            c
        })
        .collect()
}

/// This rank's piece of the model's tensors (its tp piece of its pipeline stage's blocks, and
/// the tensors outside the blocks where its stages run them), and its pipeline chunks.
pub fn rank_pieces(res: &Resolved, mesh: &Mesh) -> (Dims, Vec<Chunk>) {
    let whole = Dims::new(&res.deck.model, mesh.tp.size(), mesh.tp.rank()).with_expert_parallel(mesh.ep.size(), mesh.ep.rank());
    let chunks = chunks(&res.stage_layers, mesh.pp.size(), mesh.pp.rank());
    (rank_dims(&whole, &chunks), chunks)
}

/// The dims of the state a pipeline rank holds (every chunk's blocks), from the whole model's
/// `m` (its tp piece).
pub fn rank_dims(m: &Dims, chunks: &[Chunk]) -> Dims {
    let ids = chunks.iter().flat_map(|c| c.layer_ids.iter().copied()).collect();
    m.stage(ids, chunks.iter().any(|c| c.embed), chunks.iter().any(|c| c.head))
}

/// A chunk's view of the rank's weights or gradients: its block `l` is the rank's `offset + l`.
pub struct Offset<'a, W> {
    pub inner: &'a mut W,
    pub offset: usize,
}

impl<V, W: WeightSource<V>> WeightSource<V> for Offset<'_, W> {
    fn globals(&self) -> Globals<'_, V> {
        self.inner.globals()
    }
    fn block(&mut self, l: usize) -> &Layer<V> {
        self.inner.block(self.offset + l)
    }
    fn block_done(&mut self, l: usize) {
        self.inner.block_done(self.offset + l)
    }
}

impl<V, G: GradSink<V>> GradSink<V> for Offset<'_, G> {
    fn globals_mut(&mut self) -> GlobalsMut<'_, V> {
        self.inner.globals_mut()
    }
    fn block_mut(&mut self, l: usize) -> &mut Layer<V> {
        self.inner.block_mut(self.offset + l)
    }
    fn block_done(&mut self, l: usize) {
        self.inner.block_done(self.offset + l)
    }
    fn globals_done(&mut self) {
        self.inner.globals_done()
    }
}

/// Which way a message goes: an activation to the next stage, or a gradient to the previous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Forward,
    Backward,
}

/// The pipeline's point-to-point traffic on one rank, on the backend's buffers (staged through
/// host memory: MPI on host vectors). Sends are posted when their data exists and completed
/// later; a receive is posted ahead of the action that needs it. Messages of one chunk and
/// direction share a tag: MPI keeps their order, and every schedule consumes them in order.
pub struct PipeComm<'g> {
    group: &'g Group,
    /// Virtual stages per rank.
    v: usize,
    sends: VecDeque<Ticket>,
    /// Posted receives, by (chunk, direction), in the order they will be used.
    recvs: Vec<((usize, Direction), Ticket)>,
    /// Host buffers of finished transfers, reused.
    spare: Vec<Vec<f32>>,
}

impl<'g> PipeComm<'g> {
    pub fn new(group: &'g Group, v: usize) -> Self {
        PipeComm { group, v, sends: VecDeque::new(), recvs: vec![], spare: vec![] }
    }

    /// The tag of the messages to chunk `chunk` travelling in direction `dir`: below
    /// [`TIED_EMBEDDING_TAG`] for every chunk count a deck allows (a chunk holds a block).
    fn tag(chunk: usize, dir: Direction) -> usize {
        let tag = 2 * chunk + (dir == Direction::Backward) as usize;
        debug_assert!(tag < TIED_EMBEDDING_TAG);
        tag
    }

    /// The rank and chunk of the neighbour that chunk `chunk` of this rank exchanges with.
    fn neighbour(&self, chunk: usize, dir: Direction) -> (usize, usize) {
        let pp = self.group.size();
        let vs = chunk * pp + self.group.rank();
        let other = match dir {
            Direction::Forward => vs + 1,
            Direction::Backward => vs - 1,
        };
        debug_assert!(other < pp * self.v);
        (other % pp, other / pp)
    }

    fn buffer(&mut self, len: usize) -> Vec<f32> {
        let mut b = self.spare.pop().unwrap_or_default();
        b.clear();
        b.resize(len, 0.0);
        b
    }

    /// Sends `data` from chunk `chunk` in direction `dir` (forward: to the next stage), with
    /// `trailer` after it in the same message (a mixture of experts' loads; empty without).
    pub fn send<B: Backend<f32>>(&mut self, be: &B, chunk: usize, dir: Direction, data: &B::Buf, trailer: &[f32]) {
        let (rank, their_chunk) = self.neighbour(chunk, dir);
        let n = be.len(data);
        let mut host = self.buffer(n + trailer.len());
        be.download(data, &mut host[..n]);
        host[n..].copy_from_slice(trailer);
        // The receiver matches on its own chunk and the direction of travel.
        let t = self.group.start_send_f32(rank, Self::tag(their_chunk, dir), host);
        self.sends.push_back(t);
        self.reap();
    }

    /// Posts the receive of `len` elements that chunk `chunk` will take from direction `dir`
    /// (forward: the activation from the previous stage).
    pub fn post_recv(&mut self, chunk: usize, dir: Direction, len: usize) {
        let from = match dir {
            Direction::Forward => Direction::Backward,
            Direction::Backward => Direction::Forward,
        };
        let (rank, _) = self.neighbour(chunk, from);
        let buf = self.buffer(len);
        let t = self.group.start_recv_f32(rank, Self::tag(chunk, dir), buf);
        self.recvs.push(((chunk, dir), t));
    }

    /// Whether a receive for chunk `chunk` and direction `dir` is posted and not yet taken.
    pub fn posted(&self, chunk: usize, dir: Direction) -> bool {
        self.recvs.iter().any(|(k, _)| *k == (chunk, dir))
    }

    /// Completes the oldest posted receive of (`chunk`, `dir`) into `out`, its last
    /// `trailer_len` elements into `trailer`.
    pub fn recv<B: Backend<f32>>(
        &mut self,
        be: &B,
        chunk: usize,
        dir: Direction,
        out: &mut B::Buf,
        trailer: &mut Vec<f32>,
        trailer_len: usize,
    ) {
        let i = self.recvs.iter().position(|(k, _)| *k == (chunk, dir)).expect("post_recv before recv");
        let (_, t) = self.recvs.remove(i);
        let (_, host) = self.group.wait(t);
        let n = host.len() - trailer_len;
        be.resize(out, n);
        be.upload(out, &host[..n]);
        trailer.clear();
        trailer.extend_from_slice(&host[n..]);
        self.spare.push(host);
    }

    /// Completes the sends that have finished, keeping their buffers.
    fn reap(&mut self) {
        while let Some(t) = self.sends.front() {
            if !self.group.test(t) {
                break;
            }
            let t = self.sends.pop_front().expect("just seen");
            self.spare.push(self.group.wait(t).0);
        }
    }

    /// Completes every send (at the end of a step: the neighbours have received everything).
    pub fn finish(&mut self) {
        while let Some(t) = self.sends.pop_front() {
            self.spare.push(self.group.wait(t).0);
        }
        assert!(self.recvs.is_empty(), "every posted receive is used within its step");
    }
}

/// The tag of the tied embedding's gradient exchange between the pipeline's two ends, apart
/// from the activations' tags (two per chunk).
const TIED_EMBEDDING_TAG: usize = 1 << 14;

/// With tied embeddings on a pipeline, the first stage (the lookup) and the last (the output
/// projection) each hold `embed_tokens`: sums their gradients over the two ends of `pp`
/// (Megatron's embedding group), so both copies take the same update. `a + b` on one end and
/// `b + a` on the other are the same bits. Nothing to do elsewhere.
pub fn sum_tied_embedding<B: Backend<f32> + Clone>(grads: &mut FsdpGrads<'_, B>, pp: &Group) {
    let m = grads.dims();
    if !m.tie || m.embed == m.head {
        return;
    }
    let partner = if m.embed { pp.size() - 1 } else { 0 };
    let (u, range) = grads.tensor_range("model.embed_tokens.weight").expect("both ends hold the embedding");
    let be = grads.backend().clone();
    with_host_mut(&be, vec![&mut grads.shards[u]], |mut shard| {
        let mine = &mut shard[0][range];
        let sent = pp.start_send_f32(partner, TIED_EMBEDDING_TAG, mine.to_vec());
        let got = pp.start_recv_f32(partner, TIED_EMBEDDING_TAG, vec![0.0; mine.len()]);
        let (_, theirs) = pp.wait(got);
        pp.wait(sent);
        mine.iter_mut().zip(&theirs).for_each(|(a, b)| *a += b);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_stages_of_a_rank() {
        let c = chunks(&[2, 1, 1, 2], 2, 0);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0], Chunk { layer_ids: vec![0, 1], offset: 0, embed: true, head: false });
        assert_eq!(c[1], Chunk { layer_ids: vec![3], offset: 2, embed: false, head: false });
        let c = chunks(&[2, 1, 1, 2], 2, 1);
        assert_eq!(c[0], Chunk { layer_ids: vec![2], offset: 0, embed: false, head: false });
        assert_eq!(c[1], Chunk { layer_ids: vec![4, 5], offset: 1, embed: false, head: true });
        assert_eq!(chunks(&[4], 1, 0), vec![Chunk { layer_ids: vec![0, 1, 2, 3], offset: 0, embed: true, head: true }]);
    }
}
