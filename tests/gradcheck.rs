//! Finite-difference checks of the hand-written backward, in f64, for every parameter tensor
//! (the backward whole, and split into input and weight gradients as the zero-bubble pipeline
//! runs it) and for the attention kernel on its own (several query blocks, GQA, causal mask).

use ndtrain::backend::cpu::attention::{attention_bwd, attention_fwd};
use ndtrain::backend::cpu::Cpu;
use ndtrain::backend::AttnDims;
use ndtrain::config::{ActCkpt, ModelCfg};
use ndtrain::model::hooks::Hooks;
use ndtrain::model::params::{param_specs, ModelParams};
use ndtrain::model::{Model, Tokens, WeightGradWork};
use ndtrain::rng;

/// Central differences in f64 with step 1e-5 have truncation error ~h²·f''' ≈ 1e-10 and
/// round-off ~1e-16/h ≈ 1e-11 relative to the loss; a correct backward lands near 1e-8.
/// A wrong term (a missing factor, a transposed index) shows up as 1e-2 or worse.
const FD_REL_TOL: f64 = 1e-6;
const FD_STEP: f64 = 1e-5;

fn small_cfg(tie: bool) -> ModelCfg {
    ModelCfg {
        vocab_size: 11,
        d_model: 16,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 0,
        qk_norm: false,
        ffn_hidden: 24,
        max_seq_len: 16,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        tie_embeddings: tie,
        ..ModelCfg::default()
    }
}

/// A model far from its initialisation (std 0.5, norm weights around 1) so every nonlinearity
/// is exercised, not only its linear regime.
fn perturbed_params(cfg: &ModelCfg) -> ModelParams<f64> {
    let mut p = ModelParams::<f64>::init(cfg, 5);
    for (spec, t) in param_specs(cfg).iter().zip(p.tensors_mut()) {
        let sid = rng::stream_id(&spec.name);
        for (i, x) in t.iter_mut().enumerate() {
            *x += 0.5 * rng::normal(99, sid, i as u64);
        }
    }
    p
}

/// How the gradient is computed: the backward whole, or its input-gradient half and then the
/// weight-gradient half from the kept operands.
#[derive(Clone, Copy, PartialEq)]
enum Backward {
    Whole,
    Split,
}

fn check_model(tie: bool, ckpt: ActCkpt) {
    check_model_with(tie, ckpt, Backward::Whole)
}

fn check_model_with(tie: bool, ckpt: ActCkpt, how: Backward) {
    check_cfg(&small_cfg(tie), ckpt, how)
}

fn check_cfg(cfg: &ModelCfg, ckpt: ActCkpt, how: Backward) {
    let cfg = cfg.clone();
    let (b, s) = (2, 7);
    let inputs: Vec<u32> = (0..b * s).map(|i| ((i * 7 + 3) % cfg.vocab_size) as u32).collect();
    let targets: Vec<u32> = (0..b * s).map(|i| ((i * 5 + 1) % cfg.vocab_size) as u32).collect();
    let positions: Vec<usize> = (0..s).collect();
    let tok = Tokens { inputs: &inputs, targets: &targets, positions: &positions, batch: b, seq: s };
    let scale = 1.0 / (b * s) as f64;
    // The objective: the mean cross entropy plus, with experts, the auxiliary loss averaged
    // over the micro-batch's sequences times its coefficient.
    let objective = |model: &mut Model<f64>, p: &ModelParams<f64>| {
        let ce = model.forward(p, &tok) * scale;
        ce + cfg.router_aux_loss_coef * model.aux_loss_sum() / b as f64
    };

    let params = perturbed_params(&cfg);
    let mut model = Model::<f64>::new(&cfg, ckpt);
    let mut grads = ModelParams::<f64>::zeros(&cfg);
    model.forward(&params, &tok);
    match how {
        Backward::Whole => model.backward(&params, &mut grads, scale),
        Backward::Split => {
            let mut work = WeightGradWork::default();
            model.backward_input_stage(&mut &params, &mut grads, scale, Hooks::one_rank(), None, &mut work);
            work.apply(&Cpu::default(), &mut grads);
        }
    }

    let specs = param_specs(&cfg);
    let mut probe = params.clone();
    for (ti, spec) in specs.iter().enumerate() {
        let analytic = grads.tensors()[ti].clone();
        let max_abs = analytic.iter().fold(0.0f64, |a, &x| a.max(x.abs()));
        assert!(max_abs > 1e-8, "{}: gradient is identically ~0, the check would be vacuous", spec.name);
        let mut worst = 0.0f64;
        for (i, &g) in analytic.iter().enumerate() {
            let orig = probe.tensors()[ti][i];
            probe.tensors_mut()[ti][i] = orig + FD_STEP;
            let lp = objective(&mut model, &probe);
            probe.tensors_mut()[ti][i] = orig - FD_STEP;
            let lm = objective(&mut model, &probe);
            probe.tensors_mut()[ti][i] = orig;
            let fd = (lp - lm) / (2.0 * FD_STEP);
            worst = worst.max((fd - g).abs() / max_abs);
        }
        assert!(worst < FD_REL_TOL, "{}: finite-difference relative error {worst:.3e} > {FD_REL_TOL:e}", spec.name);
    }
}

#[test]
fn every_parameter_gradient_matches_finite_differences() {
    check_model(false, ActCkpt::None);
}

/// Qwen3's attention: each head's q and k RMS-normed before RoPE, with a head width (6) apart
/// from d_model / n_heads (4); whole and split backward, the latter with selective
/// checkpointing (the raw projections are kept, not recomputed).
#[test]
fn qwen3_attention_gradient_matches_finite_differences() {
    let cfg = ModelCfg { qk_norm: true, head_dim: 6, ..small_cfg(false) };
    check_cfg(&cfg, ActCkpt::None, Backward::Whole);
    check_cfg(&cfg, ActCkpt::Selective, Backward::Split);
}

/// A mixture of experts (4 experts, top-2) after a dense block: the router through the softmax,
/// the top-k choice and its renormalisation (on and off), every expert's FFN, and the
/// auxiliary loss over both sparse blocks; full checkpointing recomputes the routing.
#[test]
fn mixture_of_experts_gradient_matches_finite_differences() {
    let moe = ModelCfg {
        n_layers: 3,
        n_experts: 4,
        experts_per_token: 2,
        moe_ffn_hidden: 12,
        first_dense_layers: 1,
        router_aux_loss_coef: 0.3,
        ..small_cfg(false)
    };
    check_cfg(&moe, ActCkpt::None, Backward::Whole);
    let qwen3_moe = ModelCfg { norm_topk_prob: false, qk_norm: true, head_dim: 6, ..moe };
    check_cfg(&qwen3_moe, ActCkpt::Full, Backward::Whole);
    // Zero bubble's split: the experts' and the router's weight gradients from kept operands.
    check_cfg(&qwen3_moe, ActCkpt::Selective, Backward::Split);
    // A shared expert (an FFN of 12 every row passes, beside the routed ones, narrower than the
    // dense first block's 24), whole, and split with full recomputation.
    let shared = ModelCfg { n_shared_experts: 1, ..moe };
    check_cfg(&shared, ActCkpt::None, Backward::Whole);
    check_cfg(&shared, ActCkpt::Full, Backward::Split);
}

/// Zero bubble's split backward, with the recomputation of full checkpointing (the kept
/// operands are copied out of the recompute scratch) and tied embeddings.
#[test]
fn split_backward_gradient_matches_finite_differences() {
    check_model_with(false, ActCkpt::None, Backward::Split);
    check_model_with(true, ActCkpt::Full, Backward::Split);
}

#[test]
fn tied_embeddings_gradient_matches_finite_differences() {
    check_model(true, ActCkpt::None);
}

#[test]
fn checkpointed_model_gradient_matches_finite_differences() {
    check_model(false, ActCkpt::Full);
}

#[test]
fn selectively_checkpointed_model_gradient_matches_finite_differences() {
    check_model(false, ActCkpt::Selective);
}

/// The attention kernel alone, with more query rows than one block (64) and positions that
/// are not contiguous (as a context-parallel rank holds them), against finite differences of
/// `sum(o ∘ r)` for a fixed random `r`.
#[test]
fn attention_kernel_matches_finite_differences() {
    let dm = AttnDims { b: 1, h: 4, kv: 2, sq: 70, sk: 70, hd: 4 };
    let q_pos: Vec<usize> = (0..35).chain(100..135).collect();
    let k_pos = q_pos.clone();
    let gen = |name: &str, len: usize| -> Vec<f64> { (0..len).map(|i| rng::normal(1, rng::stream_id(name), i as u64)).collect() };
    let q = gen("q", dm.b * dm.h * dm.sq * dm.hd);
    let k = gen("k", dm.b * dm.kv * dm.sk * dm.hd);
    let v = gen("v", dm.b * dm.kv * dm.sk * dm.hd);
    let r = gen("r", q.len());
    let objective = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        let mut o = vec![0.0; q.len()];
        let mut lse = vec![0.0; dm.b * dm.h * dm.sq];
        attention_fwd(&mut o, &mut lse, q, k, v, &q_pos, &k_pos, dm);
        o.iter().zip(&r).map(|(a, b)| a * b).sum()
    };
    let mut o = vec![0.0; q.len()];
    let mut lse = vec![0.0; dm.b * dm.h * dm.sq];
    attention_fwd(&mut o, &mut lse, &q, &k, &v, &q_pos, &k_pos, dm);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    attention_bwd(&mut dq, &mut dk, &mut dv, &r, &q, &k, &v, &o, &lse, &q_pos, &k_pos, dm);
    for (name, which, analytic) in [("q", 0, &dq), ("k", 1, &dk), ("v", 2, &dv)] {
        let max_abs = analytic.iter().fold(0.0f64, |a, &x| a.max(x.abs()));
        let mut worst = 0.0f64;
        // Every 7th element: enough to cover every head, block and mask edge, fast enough.
        for i in (0..analytic.len()).step_by(7) {
            let mut t = [q.clone(), k.clone(), v.clone()];
            t[which][i] += FD_STEP;
            let lp = objective(&t[0], &t[1], &t[2]);
            t[which][i] -= 2.0 * FD_STEP;
            let lm = objective(&t[0], &t[1], &t[2]);
            worst = worst.max(((lp - lm) / (2.0 * FD_STEP) - analytic[i]).abs() / max_abs);
        }
        assert!(worst < FD_REL_TOL, "attention d{name}: relative error {worst:.3e}");
    }
}
