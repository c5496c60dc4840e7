//! Cross entropy: the four row kernels on whole rows and on vocabulary shards with padding columns.

use ndtrain::backend::cpu::kernels::{cross_entropy_bwd_inplace, row_max, row_sum_exp, target_logit};
use ndtrain::scalar::Real;

use crate::reference::ref_cross_entropy;
use crate::support::{assert_close, cast, tol, Rng, GARBAGE};

/// Columns `offset .. offset + valid` of `x [N, V]` as a `[N, v_local]` shard whose columns
/// past `valid` (vocabulary padding) hold `pad`.
fn vocab_shard(x: &[f64], v: usize, offset: usize, valid: usize, v_local: usize, pad: f64) -> Vec<f64> {
    x.chunks(v).flat_map(|row| (0..v_local).map(move |j| if j < valid { row[offset + j] } else { pad })).collect()
}

/// Runs the four cross-entropy kernels on `tp` vocabulary shards of `logits [N, V]` as the
/// model does (each shard `ceil(V/tp)` columns, the last one padded), reduces across shards
/// like the tp all-reduces, and checks every shard's piece against whole-row cross entropy.
fn check_cross_entropy<T: Real>(tp: usize) {
    let (n, v, scale) = (70, 37, 0.37);
    let mut rng = Rng::new(6 + tp as u64);
    let logits = rng.vec(n * v, -4.0, 4.0);
    // Targets on every shard, including both ends of the vocabulary.
    let targets: Vec<u32> = (0..n).map(|r| if r < 2 { [0, v - 1][r] as u32 } else { rng.below(v) as u32 }).collect();
    let want = ref_cross_entropy(&logits, &targets, v, scale);
    let v_local = v.div_ceil(tp);
    let (mut max, mut sum_exp, mut target) = (vec![f64::NEG_INFINITY; n], vec![0.0; n], vec![0.0; n]);
    let (m_t, lse_t) = (cast::<T>(&want.max), cast::<T>(&want.lse));
    for shard in 0..tp {
        let (offset, valid) = (shard * v_local, v_local.min(v - shard * v_local));
        let local = vocab_shard(&logits, v, offset, valid, v_local, GARBAGE);
        let mut local_t = cast::<T>(&local);
        let ctx = format!("(tp {tp}, shard {shard}: offset {offset}, valid {valid} of {v_local})");

        let mut m = cast::<T>(&vec![GARBAGE; n]);
        row_max(&mut m, &local_t, v_local, valid);
        let want_m: Vec<f64> = local.chunks(v_local).map(|r| r[..valid].iter().copied().fold(f64::NEG_INFINITY, f64::max)).collect();
        assert_close(&format!("row_max {ctx}"), &m, &want_m, tol::<T>());
        max.iter_mut().zip(&m).for_each(|(a, b)| *a = a.max(b.to_f64()));

        // The sum of exponentials against the global maximum, summed across shards.
        let mut s = cast::<T>(&vec![GARBAGE; n]);
        row_sum_exp(&mut s, &local_t, &m_t, v_local, valid);
        let want_s: Vec<f64> =
            local.chunks(v_local).zip(&want.max).map(|(r, mx)| r[..valid].iter().map(|x| (x - mx).exp()).sum()).collect();
        assert_close(&format!("row_sum_exp {ctx}"), &s, &want_s, tol::<T>());
        sum_exp.iter_mut().zip(&s).for_each(|(a, b)| *a += b.to_f64());

        // The target logit where this shard holds the target, else 0.
        let mut t = cast::<T>(&vec![GARBAGE; n]);
        target_logit(&mut t, &local_t, &targets, v_local, offset, valid);
        let held = |tg: u32| (offset..offset + valid).contains(&(tg as usize));
        let want_t: Vec<f64> = (0..n).map(|r| if held(targets[r]) { want.target[r] } else { 0.0 }).collect();
        assert_close(&format!("target_logit {ctx}"), &t, &want_t, tol::<T>());
        target.iter_mut().zip(&t).for_each(|(a, b)| *a += b.to_f64());

        // This shard's columns of scale·(softmax − onehot); padding columns 0.
        cross_entropy_bwd_inplace(&mut local_t, &lse_t, &targets, v_local, offset, valid, T::from_f64(scale));
        let want_d = vocab_shard(&want.dlogits, v, offset, valid, v_local, 0.0);
        assert_close(&format!("cross_entropy_bwd_inplace {ctx}"), &local_t, &want_d, tol::<T>());
    }
    assert_close(&format!("row_max across {tp} shards"), &cast::<T>(&max), &want.max, tol::<T>());
    assert_close(&format!("row_sum_exp across {tp} shards"), &cast::<T>(&sum_exp), &want.sum_exp, tol::<T>());
    assert_close(&format!("target_logit across {tp} shards"), &cast::<T>(&target), &want.target, tol::<T>());
}

#[test]
fn cross_entropy_kernels_match_whole_rows_unsharded_and_vocab_sharded() {
    // tp = 1 (no padding), 2 (one padding column), 3 (two), 4 (three).
    for tp in 1..=4 {
        check_cross_entropy::<f32>(tp);
        check_cross_entropy::<f64>(tp);
    }
}
