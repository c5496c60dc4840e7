//! The element- and row-wise kernels: RMSNorm, the RoPE tables and head transposes, SwiGLU, residual adds.
//!
//! Each forward with its backward, including the overwrite / accumulate contract of `rmsnorm_bwd`.

use ndtrain::backend::cpu::kernels::{add, add_assign, from_heads_rope, rmsnorm_bwd, rmsnorm_fwd, swiglu_bwd, swiglu_fwd, to_heads_rope};
use ndtrain::model::positions::rope_tables;
use ndtrain::scalar::Real;

use crate::reference::{ref_from_heads, ref_rmsnorm, ref_rmsnorm_bwd, ref_rope_tables, ref_swiglu, ref_swiglu_bwd, ref_to_heads};
use crate::support::{assert_close, cast, to_f64, tol, Rng, GARBAGE, ROPE_FREQ_ROUNDING};

/// 150 rows (three parallel tasks of 64), rows scaled from 0.2 to 2 so that `eps = 0.05` is a
/// visible part of `mean(x²)`.
fn rmsnorm_inputs(rng: &mut Rng, n: usize, d: usize) -> (Vec<f64>, Vec<f64>) {
    let mut x = rng.vec(n * d, -1.0, 1.0);
    for row in x.chunks_mut(d) {
        let s = rng.uniform(0.2, 2.0);
        row.iter_mut().for_each(|v| *v = (*v * s) as f32 as f64);
    }
    (x, rng.vec(d, 0.5, 1.5))
}

fn check_rmsnorm_fwd<T: Real>() {
    let (n, d, eps) = (150, 24, 0.05);
    let (x, w) = rmsnorm_inputs(&mut Rng::new(2), n, d);
    let (want_y, want_rstd) = ref_rmsnorm(&x, &w, d, eps);
    let (mut y, mut rstd) = (cast::<T>(&vec![GARBAGE; n * d]), cast::<T>(&vec![GARBAGE; n]));
    rmsnorm_fwd(&mut y, &mut rstd, &cast::<T>(&x), &cast::<T>(&w), d, eps);
    assert_close("rmsnorm_fwd y", &y, &want_y, tol::<T>());
    assert_close("rmsnorm_fwd rstd", &rstd, &want_rstd, tol::<T>());
}

#[test]
fn rmsnorm_fwd_matches_reference() {
    check_rmsnorm_fwd::<f32>();
    check_rmsnorm_fwd::<f64>();
}

fn check_rmsnorm_bwd<T: Real>() {
    let (n, d, eps) = (150, 24, 0.05);
    let mut rng = Rng::new(3);
    let (x, w) = rmsnorm_inputs(&mut rng, n, d);
    let (dy, dx0, dw0) = (rng.vec(n * d, -1.0, 1.0), rng.vec(n * d, -1.0, 1.0), rng.vec(d, -1.0, 1.0));
    let (want_dx, want_dw) = ref_rmsnorm_bwd(&dy, &x, &w, d, eps);
    let (_, rstd) = ref_rmsnorm(&x, &w, d, eps);
    let (xt, wt, dyt, rstdt) = (cast::<T>(&x), cast::<T>(&w), cast::<T>(&dy), cast::<T>(&rstd));
    let plus = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x + y).collect::<Vec<f64>>();
    for accumulate in [false, true] {
        // dx is overwritten (its old value ignored) or accumulated into; dw always accumulates.
        let mut dx = cast::<T>(&if accumulate { dx0.clone() } else { vec![GARBAGE; n * d] });
        let mut dw = cast::<T>(&dw0);
        rmsnorm_bwd(&mut dx, &mut dw, &dyt, &xt, &wt, &rstdt, d, accumulate);
        let want = if accumulate { plus(&dx0, &want_dx) } else { want_dx.clone() };
        assert_close(&format!("rmsnorm_bwd dx (accumulate = {accumulate})"), &dx, &want, tol::<T>());
        assert_close(&format!("rmsnorm_bwd dw += (accumulate = {accumulate})"), &dw, &plus(&dw0, &want_dw), tol::<T>());
    }
}

#[test]
fn rmsnorm_bwd_matches_jacobian_with_and_without_accumulate() {
    check_rmsnorm_bwd::<f32>();
    check_rmsnorm_bwd::<f64>();
}

fn check_rope_tables<T: Real>() {
    // Zigzag positions of a context-parallel rank, and far positions where the angle is large.
    let positions = [4, 5, 6, 7, 24, 25, 26, 27, 0, 1, 300, 4095];
    for (hd, theta) in [(8, 10_000.0), (16, 500_000.0)] {
        let (cos, sin) = rope_tables::<T>(&positions, hd, theta);
        let (want_cos, want_sin, inv_freq) = ref_rope_tables(&positions, hd, theta);
        assert_eq!((cos.len(), sin.len()), (positions.len() * hd / 2, positions.len() * hd / 2));
        for (t, &pos) in positions.iter().enumerate() {
            for i in 0..hd / 2 {
                let e = t * hd / 2 + i;
                let allowed = tol::<T>() + pos as f64 * inv_freq[i] * ROPE_FREQ_ROUNDING;
                for (what, got, want) in [("cos", cos[e], want_cos[e]), ("sin", sin[e], want_sin[e])] {
                    let err = (got.to_f64() - want).abs();
                    assert!(
                        err <= allowed,
                        "rope_tables {what} (hd {hd}, pos {pos}, i {i}): {got} vs {want}, error {err:.3e} > {allowed:.3e}"
                    );
                }
            }
        }
    }
}

#[test]
fn rope_tables_match_hugging_face_frequencies() {
    check_rope_tables::<f32>();
    check_rope_tables::<f64>();
}

fn check_heads_rope<T: Real>() {
    let (b, s, nh, hd) = (2, 5, 3, 8);
    let positions = [3, 4, 9, 10, 100];
    let mut rng = Rng::new(4);
    let (x, g) = (rng.vec(b * s * nh * hd, -1.0, 1.0), rng.vec(b * s * nh * hd, -1.0, 1.0));
    let (cos, sin, _) = ref_rope_tables(&positions, hd, 10_000.0);
    // The kernel gets the tables in T; the reference uses the same rounded values.
    let (cos_t, sin_t) = (cast::<T>(&cos), cast::<T>(&sin));
    let (cos_r, sin_r) = (to_f64(&cos_t), to_f64(&sin_t));
    for rope in [false, true] {
        let (kernel_rope, ref_rope) = if rope { (Some((&cos_t[..], &sin_t[..])), Some((&cos_r[..], &sin_r[..]))) } else { (None, None) };
        let mut heads = cast::<T>(&vec![GARBAGE; x.len()]);
        to_heads_rope(&mut heads, &cast::<T>(&x), b, s, nh, hd, kernel_rope);
        assert_close(&format!("to_heads_rope (rope = {rope})"), &heads, &ref_to_heads(&x, b, s, nh, hd, ref_rope), tol::<T>());
        let mut tok = cast::<T>(&vec![GARBAGE; g.len()]);
        from_heads_rope(&mut tok, &cast::<T>(&g), b, s, nh, hd, kernel_rope);
        assert_close(&format!("from_heads_rope (rope = {rope})"), &tok, &ref_from_heads(&g, b, s, nh, hd, ref_rope), tol::<T>());
    }
}

#[test]
fn to_heads_and_from_heads_rope_match_rotate_half_and_its_transpose() {
    check_heads_rope::<f32>();
    check_heads_rope::<f64>();
}

fn check_swiglu<T: Real>() {
    // 5000 elements: two parallel chunks of 4096; a few gates far into both tails of σ.
    let n = 5000;
    let mut rng = Rng::new(5);
    let (mut gate, up, dh) = (rng.vec(n, -6.0, 6.0), rng.vec(n, -2.0, 2.0), rng.vec(n, -1.0, 1.0));
    gate[..4].copy_from_slice(&[-90.0, -30.0, 30.0, 90.0]);
    let (gt, ut) = (cast::<T>(&gate), cast::<T>(&up));
    let mut h = cast::<T>(&vec![GARBAGE; n]);
    swiglu_fwd(&mut h, &gt, &ut);
    assert_close("swiglu_fwd", &h, &ref_swiglu(&gate, &up), tol::<T>());
    let (want_dg, want_du) = ref_swiglu_bwd(&dh, &gate, &up);
    let (mut dg, mut du) = (cast::<T>(&vec![GARBAGE; n]), cast::<T>(&vec![GARBAGE; n]));
    swiglu_bwd(&mut dg, &mut du, &cast::<T>(&dh), &gt, &ut);
    assert_close("swiglu_bwd dgate", &dg, &want_dg, tol::<T>());
    assert_close("swiglu_bwd dup", &du, &want_du, tol::<T>());
}

#[test]
fn swiglu_fwd_and_bwd_match_reference() {
    check_swiglu::<f32>();
    check_swiglu::<f64>();
}

fn check_add<T: Real>() {
    // 20 000 elements: three parallel chunks of 8192.
    let n = 20_000;
    let mut rng = Rng::new(7);
    let (a, b) = (rng.vec(n, -1.0, 1.0), rng.vec(n, -1.0, 1.0));
    let sum: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let mut dst = cast::<T>(&vec![GARBAGE; n]);
    add(&mut dst, &cast::<T>(&a), &cast::<T>(&b));
    assert_close("add", &dst, &sum, tol::<T>());
    let mut acc = cast::<T>(&a);
    add_assign(&mut acc, &cast::<T>(&b));
    assert_close("add_assign", &acc, &sum, tol::<T>());
}

#[test]
fn add_and_add_assign_match_reference() {
    check_add::<f32>();
    check_add::<f64>();
}
