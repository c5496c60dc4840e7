//! The GEMM-backed linear maps: forward, input and weight gradients, overwriting and accumulating.

use ndtrain::backend::cpu::gemm::{linear_bwd_input, linear_bwd_weight, linear_fwd};
use ndtrain::scalar::Real;

use crate::reference::{ref_matmul, transpose};
use crate::support::{assert_close, cast, tol, Rng, GARBAGE};

fn check_linear<T: Real>() {
    let (m, n, k) = (70, 33, 65);
    let mut rng = Rng::new(8);
    let (x, w, dy) = (rng.vec(m * k, -1.0, 1.0), rng.vec(n * k, -1.0, 1.0), rng.vec(m * n, -1.0, 1.0));
    let (xt, wt, dyt) = (cast::<T>(&x), cast::<T>(&w), cast::<T>(&dy));
    // y = x·wᵀ, dx = dy·w, dw = dyᵀ·x (w is [out, in] = [n, k]).
    let cases: [(&str, Vec<f64>, usize); 3] = [
        ("linear_fwd", ref_matmul(&x, &transpose(&w, n, k), m, n, k), m * n),
        ("linear_bwd_input", ref_matmul(&dy, &w, m, k, n), m * k),
        ("linear_bwd_weight", ref_matmul(&transpose(&dy, m, n), &x, n, k, m), n * k),
    ];
    for (name, want, len) in cases {
        let prior = rng.vec(len, -1.0, 1.0);
        for accumulate in [false, true] {
            let mut out = cast::<T>(&if accumulate { prior.clone() } else { vec![GARBAGE; len] });
            match name {
                "linear_fwd" => linear_fwd(&mut out, &xt, &wt, m, n, k, accumulate),
                "linear_bwd_input" => linear_bwd_input(&mut out, &dyt, &wt, m, n, k, accumulate),
                _ => linear_bwd_weight(&mut out, &dyt, &xt, m, n, k, accumulate),
            }
            let expect: Vec<f64> = if accumulate { want.iter().zip(&prior).map(|(a, b)| a + b).collect() } else { want.clone() };
            assert_close(&format!("{name} (accumulate = {accumulate})"), &out, &expect, tol::<T>());
        }
    }
}

#[test]
fn linear_kernels_match_naive_matmul() {
    check_linear::<f32>();
    check_linear::<f64>();
}
