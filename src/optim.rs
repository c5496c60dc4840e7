//! AdamW with PyTorch semantics, gradient clipping by global norm, and the LR schedule.
//!
//! Works on whatever tensors it is given: the full model on one rank, or a rank's shards
//! under FSDP (the caller supplies the global norm, reduced across ranks). Knows nothing of
//! communication. The moments are kept in the parameters' element type (f32 in training).

use crate::backend::AdamStep;
use crate::config::{ModelCfg, OptimCfg, Schedule};
use crate::model::params::{param_specs, ModelParams};
use crate::real::Real;
use rayon::prelude::*;

/// Elements per parallel AdamW task.
const ADAMW_CHUNK: usize = 16384;

/// Learning rate of 0-based optimiser step `step` of `total_steps` for peak rate `peak_lr`:
/// linear warm-up `peak·(s+1)/warmup`, then cosine, linear or constant down to `min_lr`.
pub fn lr_at(cfg: &OptimCfg, peak_lr: f64, step: u64, total_steps: u64) -> f64 {
    let warmup = cfg.warmup_steps;
    if step < warmup {
        return peak_lr * (step + 1) as f64 / warmup as f64;
    }
    let p = (step - warmup) as f64 / (total_steps.saturating_sub(warmup)).max(1) as f64;
    let min_lr = cfg.min_lr;
    match cfg.schedule {
        Schedule::Cosine => min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + (std::f64::consts::PI * p).cos()),
        Schedule::Linear => peak_lr - (peak_lr - min_lr) * p,
        Schedule::Constant => peak_lr,
    }
}

/// Sum of squares of every gradient element, accumulated in f64 (one rank's contribution to
/// the global norm).
pub fn grad_sq_sum<T: Real>(grads: &ModelParams<T>) -> f64 {
    grads.tensors().iter().map(|t| t.iter().map(|&x| x.to_f64() * x.to_f64()).sum::<f64>()).sum()
}

/// The L2 norm of all gradients of a model held whole on one rank.
pub fn global_grad_norm<T: Real>(grads: &ModelParams<T>) -> f64 {
    grad_sq_sum(grads).sqrt()
}

/// PyTorch's `clip_grad_norm_` coefficient: `min(1, max_norm / (norm + 1e-6))`; 1 when
/// clipping is off (`max_norm == 0`).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 {
        1.0
    } else {
        (max_norm / (norm + 1e-6)).min(1.0)
    }
}

/// Multiplies every gradient by `coef` (skipped when it is exactly 1).
pub fn scale_grads<T: Real>(grads: &mut ModelParams<T>, coef: f64) {
    if coef == 1.0 {
        return;
    }
    let c = T::from_f64(coef);
    for t in grads.tensors_mut() {
        t.iter_mut().for_each(|x| *x *= c);
    }
}

/// AdamW state: the two moments of every slot (a tensor, or a rank's shard of one) and the
/// step count.
pub struct AdamW<T> {
    pub exp_avg: Vec<Vec<T>>,
    pub exp_avg_sq: Vec<Vec<T>>,
    /// Optimiser steps taken (PyTorch's `state['step']`).
    pub t: u64,
    /// Whether each slot is weight-decayed (2-D weights) or not (norm weights).
    decayed: Vec<bool>,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

impl<T: Real> AdamW<T> {
    /// One slot per parameter tensor of the model, in `param_specs` order.
    pub fn new(model: &ModelCfg, cfg: &OptimCfg) -> Self {
        let specs = param_specs(model);
        let slots: Vec<(usize, bool)> = specs.iter().map(|s| (s.numel(), s.decayed())).collect();
        Self::for_slots(&slots, cfg)
    }

    /// Slots of the given lengths and decay flags (e.g. the shards one rank owns).
    pub fn for_slots(slots: &[(usize, bool)], cfg: &OptimCfg) -> Self {
        AdamW {
            exp_avg: slots.iter().map(|&(n, _)| vec![T::ZERO; n]).collect(),
            exp_avg_sq: slots.iter().map(|&(n, _)| vec![T::ZERO; n]).collect(),
            t: 0,
            decayed: slots.iter().map(|&(_, d)| d).collect(),
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        }
    }

    /// One update of a model held whole.
    pub fn step(&mut self, params: &mut ModelParams<T>, grads: &ModelParams<T>, lr: f64) {
        let p: Vec<&mut [T]> = params.tensors_mut().into_iter().map(|t| t.as_mut_slice()).collect();
        let g: Vec<&[T]> = grads.tensors().into_iter().map(|t| t.as_slice()).collect();
        self.step_slots(p, &g, lr);
    }

    /// One update with learning rate `lr`, as `torch.optim.AdamW` (decoupled decay first,
    /// then the bias-corrected Adam step); slots that are not decayed skip the decay.
    pub fn step_slots(&mut self, params: Vec<&mut [T]>, grads: &[&[T]], lr: f64) {
        assert_eq!(params.len(), self.exp_avg.len(), "AdamW: slot count changed");
        self.t += 1;
        let steps: Vec<AdamStep> = self.decayed.iter().map(|&d| self.coefficients(lr, d)).collect();
        let slots = params.into_iter().zip(grads).zip(self.exp_avg.iter_mut()).zip(self.exp_avg_sq.iter_mut());
        for (i, (((p, g), m), v)) in slots.enumerate() {
            assert_eq!(p.len(), m.len(), "AdamW: slot {i} changed length");
            adamw_update(p, g, m, v, &steps[i]);
        }
    }

    /// The coefficients of the current update (`t` already counts it) for one tensor.
    pub fn coefficients(&self, lr: f64, decayed: bool) -> AdamStep {
        AdamStep::new(self.t, lr, self.beta1, self.beta2, self.eps, self.weight_decay, decayed)
    }
}

/// One AdamW update of one tensor on the host (the CPU backend's `adamw` too).
pub fn adamw_update<T: Real>(p: &mut [T], g: &[T], m: &mut [T], v: &mut [T], step: &AdamStep) {
    let (step_size, bc2_sqrt, eps, d) =
        (T::from_f64(step.step_size), T::from_f64(step.bc2_sqrt), T::from_f64(step.eps), T::from_f64(step.decay));
    let (b1, b2) = (T::from_f64(step.b1), T::from_f64(step.b2));
    let (one_m_b1, one_m_b2) = (T::from_f64(1.0 - step.b1), T::from_f64(1.0 - step.b2));
    // Elementwise and independent: chunks run in parallel, each a straight loop the compiler
    // vectorises; the result does not depend on the thread count.
    p.par_chunks_mut(ADAMW_CHUNK)
        .zip(g.par_chunks(ADAMW_CHUNK))
        .zip(m.par_chunks_mut(ADAMW_CHUNK))
        .zip(v.par_chunks_mut(ADAMW_CHUNK))
        .for_each(|(((p, g), m), v)| {
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                *p *= d;
                *m = b1 * *m + one_m_b1 * g;
                *v = b2 * *v + one_m_b2 * g * g;
                *p -= step_size * *m / (v.sqrt() / bc2_sqrt + eps);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_follows_design() {
        let cfg = OptimCfg { lr: 1.0, min_lr: 0.1, warmup_steps: 2, schedule: Schedule::Cosine, ..Default::default() };
        assert!((lr_at(&cfg, 1.0, 0, 10) - 0.5).abs() < 1e-15);
        assert!((lr_at(&cfg, 1.0, 1, 10) - 1.0).abs() < 1e-15);
        assert!((lr_at(&cfg, 1.0, 2, 10) - 1.0).abs() < 1e-15);
        // p = (6-2)/8 = 0.5 → min + (peak-min)/2
        assert!((lr_at(&cfg, 1.0, 6, 10) - 0.55).abs() < 1e-12);
        let lin = OptimCfg { schedule: Schedule::Linear, ..cfg.clone() };
        assert!((lr_at(&lin, 1.0, 6, 10) - 0.55).abs() < 1e-12);
        let c = OptimCfg { schedule: Schedule::Constant, ..cfg };
        assert_eq!(lr_at(&c, 1.0, 9, 10), 1.0);
    }

    #[test]
    fn clip_coefficient_matches_pytorch() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert!((clip_coefficient(4.0, 1.0) - 1.0 / (4.0 + 1e-6)).abs() < 1e-15);
        assert_eq!(clip_coefficient(100.0, 0.0), 1.0);
    }
}
