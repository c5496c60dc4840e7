//! AdamW with PyTorch semantics, gradient clipping by global norm, and the LR schedule
//! (`docs/model.md`).
//!
//! [`AdamRule`] is the update rule any holder of moments applies (the training state on a
//! backend, or [`AdamW`] on host tensors); the host helpers work on a model held whole on one
//! rank (the caller of a sharded state supplies the global norm, reduced across ranks). Knows
//! nothing of communication. The moments are kept in the parameters' element type.

use crate::backend::cpu::adamw::adamw_update;
use crate::backend::AdamStep;
use crate::config::{ModelCfg, OptimCfg, Schedule};
use crate::model::params::{param_specs, ModelParams};
use crate::scalar::Real;

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

/// AdamW's update rule with PyTorch's semantics: the hyper-parameters and the count of
/// updates taken, which give each update's coefficients ([`AdamStep`]). Whoever holds the
/// moments (a host model here, a rank's shards on a backend in `train`) applies them.
#[derive(Clone, Debug)]
pub struct AdamRule {
    /// Optimiser steps taken (PyTorch's `state['step']`).
    pub t: u64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

impl AdamRule {
    pub fn new(cfg: &OptimCfg) -> Self {
        AdamRule { t: 0, beta1: cfg.beta1, beta2: cfg.beta2, eps: cfg.eps, weight_decay: cfg.weight_decay }
    }

    /// Counts one more update.
    pub fn advance(&mut self) {
        self.t += 1;
    }

    /// The coefficients of the current update (`t` already counts it) with learning rate
    /// `lr` for a tensor that is weight-decayed (2-D weights) or not (norm weights).
    pub fn coefficients(&self, lr: f64, decayed: bool) -> AdamStep {
        AdamStep::new(self.t, lr, self.beta1, self.beta2, self.eps, self.weight_decay, decayed)
    }
}

/// AdamW over tensors held in host memory: the two moments of every slot (a tensor, or a
/// rank's shard of one) and the rule. The host reference of the optimiser (tests, benches).
pub struct AdamW<T> {
    pub exp_avg: Vec<Vec<T>>,
    pub exp_avg_sq: Vec<Vec<T>>,
    pub rule: AdamRule,
    /// Whether each slot is weight-decayed (2-D weights) or not (norm weights).
    decayed: Vec<bool>,
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
            rule: AdamRule::new(cfg),
            decayed: slots.iter().map(|&(_, d)| d).collect(),
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
        self.rule.advance();
        let slots = params.into_iter().zip(grads).zip(self.exp_avg.iter_mut()).zip(self.exp_avg_sq.iter_mut());
        for (i, (((p, g), m), v)) in slots.enumerate() {
            assert_eq!(p.len(), m.len(), "AdamW: slot {i} changed length");
            adamw_update(p, g, m, v, &self.rule.coefficients(lr, self.decayed[i]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_follows_the_documented_formulas() {
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
