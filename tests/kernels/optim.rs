//! The optimiser: AdamW (on slots and on a whole model), the learning-rate schedules and gradient clipping.

use ndtrain::config::{ModelCfg, OptimCfg, Schedule};
use ndtrain::model::params::ModelParams;
use ndtrain::optim::{clip_coefficient, global_grad_norm, grad_sq_sum, lr_at, scale_grads, AdamW};
use ndtrain::scalar::Real;

use crate::reference::{decay_table, ref_adamw, ref_lr};
use crate::support::{assert_close, cast, tol, Rng, F32_TOL, F64_TOL};

fn check_adamw_slots<T: Real>() {
    // Decay and eps both matter: lr up to 0.1 with weight decay 0.5, and gradients from 1e-6 to 1
    // against eps = 1e-6. Two slots, one decayed; 70 000 elements span several parallel chunks.
    let cfg = OptimCfg { weight_decay: 0.5, beta1: 0.9, beta2: 0.95, eps: 1e-6, ..Default::default() };
    let slots = [(70_000, true), (300, false)];
    let lrs = [0.05, 0.1, 0.08, 0.03, 0.0, 0.01];
    let mut rng = Rng::new(60);
    let mut p: Vec<Vec<f64>> = slots.iter().map(|&(n, _)| rng.vec(n, -1.0, 1.0)).collect();
    let (mut m, mut v): (Vec<Vec<f64>>, Vec<Vec<f64>>) =
        (slots.iter().map(|&(n, _)| vec![0.0; n]).collect(), slots.iter().map(|&(n, _)| vec![0.0; n]).collect());
    let mut pt: Vec<Vec<T>> = p.iter().map(|x| cast(x)).collect();
    let mut opt = AdamW::<T>::for_slots(&slots, &cfg);
    for (step, &lr) in lrs.iter().enumerate() {
        let g: Vec<Vec<f64>> = slots
            .iter()
            .map(|&(n, _)| {
                (0..n)
                    .map(|i| if i % 97 == 0 { 0.0 } else { (rng.uniform(-1.0, 1.0) * 10f64.powf(rng.uniform(-6.0, 0.0))) as f32 as f64 })
                    .collect()
            })
            .collect();
        let gt: Vec<Vec<T>> = g.iter().map(|x| cast(x)).collect();
        opt.step_slots(pt.iter_mut().map(|x| x.as_mut_slice()).collect(), &gt.iter().map(|x| x.as_slice()).collect::<Vec<_>>(), lr);
        for s in 0..slots.len() {
            ref_adamw(&mut p[s], &mut m[s], &mut v[s], &g[s], step as i32 + 1, lr, slots[s].1, &cfg);
            let ctx = format!("slot {s} (decayed = {}), step {}", slots[s].1, step + 1);
            assert_close(&format!("AdamW param {ctx}"), &pt[s], &p[s], tol::<T>());
            assert_close(&format!("AdamW exp_avg {ctx}"), &opt.exp_avg[s], &m[s], tol::<T>());
            assert_close(&format!("AdamW exp_avg_sq {ctx}"), &opt.exp_avg_sq[s], &v[s], tol::<T>());
        }
        assert_eq!(opt.rule.t, step as u64 + 1);
    }
}

#[test]
fn adamw_step_matches_textbook_with_bias_correction_and_decoupled_decay() {
    check_adamw_slots::<f32>();
    check_adamw_slots::<f64>();
}

fn check_adamw_model<T: Real>(tie: bool) {
    let model = ModelCfg {
        vocab_size: 11,
        d_model: 8,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 0,
        qk_norm: false,
        ffn_hidden: 12,
        max_seq_len: 8,
        rope_theta: 10_000.0,
        norm_eps: 1e-5,
        tie_embeddings: tie,
        ..ModelCfg::default()
    };
    let cfg = OptimCfg { weight_decay: 0.5, ..Default::default() };
    let mut rng = Rng::new(70);
    let (mut params, mut grads) = (ModelParams::<T>::zeros(&model), ModelParams::<T>::zeros(&model));
    let mut want = Vec::new();
    for ((name, decayed, p), (_, _, g)) in decay_table(&mut params).into_iter().zip(decay_table(&mut grads)) {
        let (p0, g0) = (rng.vec(p.len(), -1.0, 1.0), rng.vec(g.len(), -1.0, 1.0));
        *p = cast(&p0);
        *g = cast(&g0);
        want.push((name, decayed, p0, g0, vec![0.0; p.len()], vec![0.0; p.len()]));
    }
    let mut opt = AdamW::<T>::new(&model, &cfg);
    for (t, lr) in [(1, 0.1), (2, 0.05)] {
        opt.step(&mut params, &grads, lr);
        for (_, decayed, p, g, m, v) in want.iter_mut() {
            ref_adamw(p, m, v, g, t, lr, *decayed, &cfg);
        }
    }
    for ((name, decayed, got), (_, _, p, ..)) in decay_table(&mut params).into_iter().zip(&want) {
        assert_close(&format!("AdamW::step {name} (decayed = {decayed}, tie = {tie})"), got, p, tol::<T>());
    }
}

#[test]
fn adamw_decays_matrices_but_not_norm_weights() {
    for tie in [false, true] {
        check_adamw_model::<f32>(tie);
        check_adamw_model::<f64>(tie);
    }
}

#[test]
fn lr_at_follows_the_documented_schedules() {
    let (peak, min_lr) = (3e-3, 2e-4);
    for schedule in [Schedule::Cosine, Schedule::Linear, Schedule::Constant] {
        for (warmup, steps) in [(0, 10), (1, 10), (4, 37), (5, 5), (6, 3)] {
            // `cfg.lr` differs from the peak handed in (batch-size scaling): the peak must win.
            let cfg = OptimCfg { lr: 1.0, min_lr, schedule, warmup_steps: warmup, ..Default::default() };
            let got: Vec<f64> = (0..steps).map(|s| lr_at(&cfg, peak, s, steps)).collect();
            let want: Vec<f64> = (0..steps).map(|s| ref_lr(schedule, peak, min_lr, warmup, s, steps)).collect();
            assert_close(&format!("lr_at {schedule:?}, warmup {warmup}, {steps} steps"), &got, &want, F64_TOL);
        }
    }
    // Landmarks, by hand: warm-up ends at the peak; cosine and linear are halfway at p = ½.
    let cfg = OptimCfg { min_lr: 0.1, warmup_steps: 2, schedule: Schedule::Cosine, ..Default::default() };
    assert!((lr_at(&cfg, 1.0, 0, 10) - 0.5).abs() < F64_TOL);
    assert!((lr_at(&cfg, 1.0, 2, 10) - 1.0).abs() < F64_TOL);
    assert!((lr_at(&cfg, 1.0, 6, 10) - 0.55).abs() < F64_TOL);
    assert!((lr_at(&OptimCfg { schedule: Schedule::Linear, ..cfg }, 1.0, 6, 10) - 0.55).abs() < F64_TOL);
}

#[test]
fn clipping_matches_pytorch_clip_grad_norm() {
    for max_norm in [0.0f64, 0.3, 1.0, 5.0] {
        for norm in [0.0, 1e-7, 0.29, 0.3, 1.0, 4.0, 1e3] {
            let want = if max_norm == 0.0 { 1.0 } else { (max_norm / (norm + 1e-6)).min(1.0) };
            assert_close(&format!("clip_coefficient({norm}, {max_norm})"), &[clip_coefficient(norm, max_norm)], &[want], F64_TOL);
        }
    }
    // The norm over every tensor (lm_head counted when untied), and scaling by the coefficient.
    let model = ModelCfg { vocab_size: 11, d_model: 8, n_layers: 1, n_heads: 2, n_kv_heads: 1, ffn_hidden: 12, ..Default::default() };
    let mut rng = Rng::new(80);
    let mut grads = ModelParams::<f32>::zeros(&model);
    let mut all = Vec::new();
    for (_, _, g) in decay_table(&mut grads) {
        let x = rng.vec(g.len(), -1.0, 1.0);
        *g = cast(&x);
        all.extend(x);
    }
    let sq: f64 = all.iter().map(|x| x * x).sum();
    assert_close("grad_sq_sum", &[grad_sq_sum(&grads)], &[sq], F64_TOL);
    assert_close("global_grad_norm", &[global_grad_norm(&grads)], &[sq.sqrt()], F64_TOL);
    let coef = clip_coefficient(sq.sqrt(), 1.0);
    scale_grads(&mut grads, coef);
    let scaled: Vec<f32> = decay_table(&mut grads).into_iter().flat_map(|(_, _, g)| g.clone()).collect();
    assert_close("scale_grads", &scaled, &all.iter().map(|x| x * coef).collect::<Vec<_>>(), F32_TOL);
    assert!((global_grad_norm(&grads) - 1.0).abs() < F32_TOL, "clipped norm {}", global_grad_norm(&grads));
}
