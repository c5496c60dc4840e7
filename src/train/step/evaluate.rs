//! The held-out loss: `[eval] batches` global batches of the held-out samples, run by the
//! pipeline executor as a forward-only schedule on the same pieces, groups and normalisation
//! as a training step — the summed token losses over the global number of target tokens — so
//! it is as layout-independent as the training loss. Nothing is accumulated and the optimiser
//! state is untouched.

use super::{global_loss_sum, Trainer};
use crate::backend::Backend;
use crate::model::hooks::Hooks;
use crate::parallel::pp::executor::Pass;
use crate::run::watchdog::beat;
use crate::run::Error;

impl<'g, B: Backend<f32> + Clone + 'g> Trainer<'g, B> {
    /// Whether the run has held-out samples (`[eval] every > 0`).
    pub fn evaluates(&self) -> bool {
        self.data.held_out.is_some()
    }

    /// The mean loss per target token over held-out global batches `0 .. batches` (the same
    /// samples at every evaluation). Every rank of the job calls it at the same step boundary.
    pub fn evaluate(&mut self, batches: usize) -> Result<f64, Error> {
        let held_out = self.data.held_out.as_ref().ok_or("evaluate: the run has no held-out samples ([eval] every = 0)")?;
        let (shape, mesh) = (self.shape, self.par.mesh);
        let n_tok = shape.global_targets(mesh, batches);
        let ga = shape.grad_accum;
        // Micro-batch k of the evaluation is micro-batch k mod ga of global batch k / ga.
        let mut batch = |k: usize| shape.local_batch(held_out, mesh, (k / ga) as u64, k % ga);
        let mut observe = |what: &dyn std::fmt::Display| beat(|| format!("evaluation of {batches} batch(es): {what}"));
        let hooks = Hooks { router_bias: &self.state.router_bias, ..self.par.hooks() };
        let (loss_sum, _) = self.pipeline.run(Pass::Evaluate, &mut self.state.params, hooks, batches * ga, &mut batch, &mut observe)?;
        Ok(global_loss_sum(mesh, loss_sum.cross_entropy) / n_tok)
    }
}
