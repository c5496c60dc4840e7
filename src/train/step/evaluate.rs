//! The held-out loss: `[eval] batches` global batches of the held-out samples, forward only,
//! on the same pieces, groups and normalisation as a training step — the summed token losses
//! over the global number of target tokens — so it is as layout-independent as the training
//! loss. Nothing is accumulated and the optimiser state is untouched.

use super::{sync, Trainer};
use crate::backend::Backend;
use crate::model::hooks::{Hooks, TensorParallel};
use crate::model::Tokens;
use crate::parallel::pp::{Direction, Offset};
use crate::run::watchdog::beat;
use crate::run::Error;

impl<'g, B: Backend<f32> + Clone + 'g> Trainer<'g, B> {
    /// Whether the run has held-out samples (`[eval] every > 0`).
    pub fn evaluates(&self) -> bool {
        self.held_out.is_some()
    }

    /// The mean loss per target token over held-out global batches `0 .. batches` (the same
    /// samples at every evaluation). Every rank of the job calls it at the same step boundary.
    pub fn evaluate(&mut self, batches: usize) -> Result<f64, Error> {
        let held_out = self.held_out.as_ref().ok_or("evaluate: the run has no held-out samples ([eval] every = 0)")?;
        let (s, mb, ga) = (self.seq_len, self.micro_batch, self.grad_accum);
        let (cp, cp_rank) = (self.mesh.cp.size(), self.mesh.cp.rank());
        let s_local = s / cp;
        let mut n_tok = [(batches * ga * mb * s_local) as f64];
        self.mesh.batch.all_reduce_sum_f64(&mut n_tok);
        self.mesh.cp.all_reduce_sum_f64(&mut n_tok);
        let hooks = Hooks { tp: &self.tp, attention: self.attention.as_ref(), progress: crate::parallel::comm::progress };
        let params = &mut self.state.params;
        let pieces = &mut self.pieces;
        let rows = self.tp.local_rows(mb * s_local) * pieces.dims[0].d;
        let mut loss_sum = 0.0f64;
        for b in 0..batches {
            for micro in 0..ga {
                beat(|| format!("evaluation: batch {} of {batches}, micro-batch {} of {ga}", b + 1, micro + 1));
                let batch = held_out.micro_batch(b as u64, micro)?;
                let (inputs, positions) = crate::parallel::cp::local_tokens(&batch.inputs, s, cp, cp_rank);
                let (targets, _) = crate::parallel::cp::local_tokens(&batch.targets, s, cp, cp_rank);
                let tok = Tokens { inputs: &inputs, targets: &targets, positions: &positions, batch: mb, seq: s_local };
                // Each chunk in turn: a stage waits only for the chunk before it, which every
                // rank runs in the same (micro-batch, chunk) order, so the pipeline cannot stall.
                for chunk in 0..pieces.chunks.len() {
                    let (embed, head, offset) = (pieces.chunks[chunk].embed, pieces.chunks[chunk].head, pieces.chunks[chunk].offset);
                    if !embed {
                        pieces.comm.post_recv(chunk, Direction::Forward, rows);
                        pieces.comm.recv(&pieces.be, chunk, Direction::Forward, &mut pieces.received);
                    }
                    let mut model = pieces.take(chunk);
                    params.begin_evaluation();
                    let input = (!embed).then_some(&pieces.received);
                    loss_sum += model.forward_stage(&mut Offset { inner: &mut *params, offset }, &tok, hooks, input);
                    params.end_micro_step();
                    if !head {
                        pieces.comm.send(&pieces.be, chunk, Direction::Forward, model.stage_output());
                    }
                    pieces.free[chunk].push(model);
                    sync(&pieces.be)?;
                }
            }
        }
        pieces.comm.finish();
        debug_assert!(params.all_released(), "an evaluation frees every block it gathers");
        let mesh = self.mesh;
        let mut loss = [loss_sum];
        mesh.batch.all_reduce_sum_f64(&mut loss);
        mesh.cp.all_reduce_sum_f64(&mut loss);
        // Only the last pipeline stage computes a loss: the others add zero.
        mesh.pp.all_reduce_sum_f64(&mut loss);
        Ok(loss[0] / n_tok[0])
    }
}
