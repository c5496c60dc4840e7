//! Attention kernels (`attention_fwd`, `attention_bwd`, `merge_partial`) and the context-parallel positions.
//!
//! Causal GQA self-attention with ragged query blocks, context-parallel zigzag chunks in ring
//! order, queries that see no key, the merge of partials over disjoint keys, and
//! `zigzag_positions` / `visible_pairs`.

use ndtrain::backend::cpu::attention::{attention_bwd, attention_fwd, merge_partial};
use ndtrain::backend::AttnDims;
use ndtrain::model::positions::visible_pairs;
use ndtrain::parallel::cp::zigzag_positions;
use ndtrain::scalar::Real;

use crate::reference::{attn_dims, ref_attention, ref_attention_bwd, ref_zigzag};
use crate::support::{assert_close, cast, tol, Rng, GARBAGE};

/// Rows `idx` of the sequence axis of a head-major `[B, heads, S, hd]` tensor.
fn gather_seq(x: &[f64], b: usize, heads: usize, s: usize, hd: usize, idx: &[usize]) -> Vec<f64> {
    let mut out = Vec::with_capacity(b * heads * idx.len() * hd);
    for bh in 0..b * heads {
        for &i in idx {
            out.extend_from_slice(&x[(bh * s + i) * hd..][..hd]);
        }
    }
    out
}

struct AttnInputs {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    d_o: Vec<f64>,
}

/// Scores spread over a few units (|q|, |k| ≤ 2) so the softmax is neither flat nor one-hot.
fn attn_inputs(rng: &mut Rng, dm: AttnDims) -> AttnInputs {
    let AttnDims { b, h, kv, sq, sk, hd } = dm;
    AttnInputs {
        q: rng.vec(b * h * sq * hd, -2.0, 2.0),
        k: rng.vec(b * kv * sk * hd, -2.0, 2.0),
        v: rng.vec(b * kv * sk * hd, -1.0, 1.0),
        d_o: rng.vec(b * h * sq * hd, -1.0, 1.0),
    }
}

/// Self-attention shapes: ragged query blocks (70 = 64 + 6, 130 = 2·64 + 2), GQA, MQA, MHA.
const SELF_ATTN: [AttnDims; 3] = [
    AttnDims { b: 2, h: 4, kv: 2, sq: 70, sk: 70, hd: 8 },
    AttnDims { b: 1, h: 3, kv: 1, sq: 5, sk: 5, hd: 4 },
    AttnDims { b: 1, h: 2, kv: 2, sq: 130, sk: 130, hd: 16 },
];

fn check_attention_self<T: Real>() {
    for (c, dm) in SELF_ATTN.into_iter().enumerate() {
        let x = attn_inputs(&mut Rng::new(10 + c as u64), dm);
        let pos: Vec<usize> = (0..dm.sq).collect();
        let (want_o, want_lse) = ref_attention(&x.q, &x.k, &x.v, &pos, &pos, dm);
        let (qt, kt, vt) = (cast::<T>(&x.q), cast::<T>(&x.k), cast::<T>(&x.v));
        let (mut o, mut lse) = (cast::<T>(&vec![GARBAGE; x.q.len()]), cast::<T>(&vec![GARBAGE; want_lse.len()]));
        attention_fwd(&mut o, &mut lse, &qt, &kt, &vt, &pos, &pos, dm);
        assert_close(&format!("attention_fwd o {dm:?}"), &o, &want_o, tol::<T>());
        assert_close(&format!("attention_fwd lse {dm:?}"), &lse, &want_lse, tol::<T>());

        let [want_dq, want_dk, want_dv] = ref_attention_bwd(&x.d_o, &x.q, &x.k, &x.v, &pos, &pos, dm);
        let (mut dq, mut dk, mut dv) =
            (cast::<T>(&vec![GARBAGE; dq_len(dm)]), cast::<T>(&vec![GARBAGE; kv_len(dm)]), cast::<T>(&vec![GARBAGE; kv_len(dm)]));
        attention_bwd(&mut dq, &mut dk, &mut dv, &cast::<T>(&x.d_o), &qt, &kt, &vt, &o, &lse, &pos, &pos, dm);
        assert_close(&format!("attention_bwd dq {dm:?}"), &dq, &want_dq, tol::<T>());
        assert_close(&format!("attention_bwd dk {dm:?}"), &dk, &want_dk, tol::<T>());
        assert_close(&format!("attention_bwd dv {dm:?}"), &dv, &want_dv, tol::<T>());
    }
}

fn dq_len(dm: AttnDims) -> usize {
    dm.b * dm.h * dm.sq * dm.hd
}

fn kv_len(dm: AttnDims) -> usize {
    dm.b * dm.kv * dm.sk * dm.hd
}

#[test]
fn causal_gqa_attention_matches_full_softmax() {
    check_attention_self::<f32>();
    check_attention_self::<f64>();
}

/// Context parallelism as the model runs it: each rank's zigzag queries against every rank's
/// key chunk in ring order. Checks each partial forward (queries that see none of a chunk),
/// the ring merge of the partials, one call over all keys in ring-arrival (unsorted) order, and
/// that the partial backwards (given the merged `o`, `lse`) sum to the whole-sequence gradient.
fn check_attention_zigzag<T: Real>(cp: usize, chunk: usize) {
    let (b, h, kv, hd) = (2, 4, 2, 8);
    let (s, s_local) = (2 * cp * chunk, 2 * chunk);
    let mut rng = Rng::new(20 + cp as u64);
    let full = attn_inputs(&mut rng, attn_dims(b, h, kv, s, s, hd));
    let all_pos: Vec<usize> = (0..s).collect();
    let part_dims = attn_dims(b, h, kv, s_local, s_local, hd);
    let whole_dims = attn_dims(b, h, kv, s_local, s, hd);
    for rank in 0..cp {
        let q_pos = zigzag_positions(s, cp, rank);
        let (q, d_o) = (gather_seq(&full.q, b, h, s, hd, &q_pos), gather_seq(&full.d_o, b, h, s, hd, &q_pos));
        let (qt, do_t) = (cast::<T>(&q), cast::<T>(&d_o));
        let (want_o, want_lse) = ref_attention(&q, &full.k, &full.v, &q_pos, &all_pos, whole_dims);
        let [want_dq, want_dk, want_dv] = ref_attention_bwd(&d_o, &q, &full.k, &full.v, &q_pos, &all_pos, whole_dims);
        let (o_glob, lse_glob) = (cast::<T>(&want_o), cast::<T>(&want_lse));

        let (mut o_run, mut lse_run) = (vec![T::ZERO; q.len()], vec![T::NEG_INFINITY; want_lse.len()]);
        let mut dq_sum = vec![T::ZERO; q.len()];
        let mut ring_pos = Vec::new();
        for step in 0..cp {
            let src = (rank + cp - step) % cp;
            let k_pos = zigzag_positions(s, cp, src);
            let (k, v) = (gather_seq(&full.k, b, kv, s, hd, &k_pos), gather_seq(&full.v, b, kv, s, hd, &k_pos));
            let (kt, vt) = (cast::<T>(&k), cast::<T>(&v));
            let ctx = format!("(cp {cp}, rank {rank}, keys of rank {src})");

            let (mut o, mut lse) = (cast::<T>(&vec![GARBAGE; q.len()]), cast::<T>(&vec![GARBAGE; want_lse.len()]));
            attention_fwd(&mut o, &mut lse, &qt, &kt, &vt, &q_pos, &k_pos, part_dims);
            let (part_o, part_lse) = ref_attention(&q, &k, &v, &q_pos, &k_pos, part_dims);
            assert_close(&format!("attention_fwd o {ctx}"), &o, &part_o, tol::<T>());
            assert_close(&format!("attention_fwd lse {ctx}"), &lse, &part_lse, tol::<T>());
            merge_partial(&mut o_run, &mut lse_run, &o, &lse, hd);

            let (mut dq, mut dk, mut dv) =
                (cast::<T>(&vec![GARBAGE; q.len()]), cast::<T>(&vec![GARBAGE; k.len()]), cast::<T>(&vec![GARBAGE; k.len()]));
            attention_bwd(&mut dq, &mut dk, &mut dv, &do_t, &qt, &kt, &vt, &o_glob, &lse_glob, &q_pos, &k_pos, part_dims);
            assert_close(&format!("attention_bwd dk {ctx}"), &dk, &gather_seq(&want_dk, b, kv, s, hd, &k_pos), tol::<T>());
            assert_close(&format!("attention_bwd dv {ctx}"), &dv, &gather_seq(&want_dv, b, kv, s, hd, &k_pos), tol::<T>());
            dq_sum.iter_mut().zip(&dq).for_each(|(a, &x)| *a += x);
            ring_pos.extend(k_pos);
        }
        let ctx = format!("(cp {cp}, rank {rank})");
        assert_close(&format!("ring of attention_fwd + merge_partial o {ctx}"), &o_run, &want_o, tol::<T>());
        assert_close(&format!("ring of attention_fwd + merge_partial lse {ctx}"), &lse_run, &want_lse, tol::<T>());
        assert_close(&format!("Σ attention_bwd dq over key chunks {ctx}"), &dq_sum, &want_dq, tol::<T>());

        // All keys in one call, in the order the ring delivers them (not ascending).
        assert!(ring_pos.windows(2).any(|w| w[0] > w[1]) || cp == 1);
        let (k, v) = (gather_seq(&full.k, b, kv, s, hd, &ring_pos), gather_seq(&full.v, b, kv, s, hd, &ring_pos));
        let (mut o, mut lse) = (cast::<T>(&vec![GARBAGE; q.len()]), cast::<T>(&vec![GARBAGE; want_lse.len()]));
        attention_fwd(&mut o, &mut lse, &qt, &cast::<T>(&k), &cast::<T>(&v), &q_pos, &ring_pos, whole_dims);
        assert_close(&format!("attention_fwd o, keys in ring order {ctx}"), &o, &want_o, tol::<T>());
        assert_close(&format!("attention_fwd lse, keys in ring order {ctx}"), &lse, &want_lse, tol::<T>());
    }
}

#[test]
fn attention_on_zigzag_chunks_matches_whole_sequence() {
    // cp 2: 70 local rows (a ragged second query block); cp 3: 46 local rows, keys from middle chunks.
    for (cp, chunk) in [(2, 35), (3, 23)] {
        check_attention_zigzag::<f32>(cp, chunk);
        check_attention_zigzag::<f64>(cp, chunk);
    }
}

fn check_attention_no_visible_key<T: Real>() {
    // Every query before every key (a whole query block with nothing to see).
    let dm = attn_dims(1, 2, 1, 10, 6, 4);
    let (q_pos, k_pos): (Vec<usize>, Vec<usize>) = ((0..10).collect(), (20..26).collect());
    let x = attn_inputs(&mut Rng::new(30), dm);
    let (qt, kt, vt) = (cast::<T>(&x.q), cast::<T>(&x.k), cast::<T>(&x.v));
    let (want_o, want_lse) = ref_attention(&x.q, &x.k, &x.v, &q_pos, &k_pos, dm);
    assert!(want_o.iter().all(|&v| v == 0.0) && want_lse.iter().all(|&l| l == f64::NEG_INFINITY));
    let (mut o, mut lse) = (cast::<T>(&vec![GARBAGE; x.q.len()]), cast::<T>(&vec![GARBAGE; want_lse.len()]));
    attention_fwd(&mut o, &mut lse, &qt, &kt, &vt, &q_pos, &k_pos, dm);
    assert_close("attention_fwd o, no visible key", &o, &want_o, tol::<T>());
    assert_close("attention_fwd lse, no visible key", &lse, &want_lse, tol::<T>());
    let (mut dq, mut dk, mut dv) =
        (cast::<T>(&vec![GARBAGE; dq_len(dm)]), cast::<T>(&vec![GARBAGE; kv_len(dm)]), cast::<T>(&vec![GARBAGE; kv_len(dm)]));
    attention_bwd(&mut dq, &mut dk, &mut dv, &cast::<T>(&x.d_o), &qt, &kt, &vt, &o, &lse, &q_pos, &k_pos, dm);
    for (name, got) in [("dq", &dq), ("dk", &dk), ("dv", &dv)] {
        assert!(got.iter().all(|&g| g == T::ZERO), "attention_bwd {name}, no visible key: not all zero");
    }
}

#[test]
fn attention_with_no_visible_key_is_empty() {
    check_attention_no_visible_key::<f32>();
    check_attention_no_visible_key::<f64>();
}

fn check_merge_partial<T: Real>() {
    // 80 rows (two parallel tasks of 64). Keys split three ways: late positions (the earliest
    // queries see none), then the even and the odd early positions. Starting from the empty
    // result (0, −∞), merging covers a running −∞ (copy), a partial −∞ (skip) and the general case.
    let dm = attn_dims(1, 2, 1, 40, 40, 8);
    let x = attn_inputs(&mut Rng::new(40), dm);
    let pos: Vec<usize> = (0..40).collect();
    let (want_o, want_lse) = ref_attention(&x.q, &x.k, &x.v, &pos, &pos, dm);
    let sets: [Vec<usize>; 3] = [(20..40).collect(), (0..20).step_by(2).collect(), (1..20).step_by(2).collect()];
    let (mut o, mut lse) = (vec![T::ZERO; x.q.len()], vec![T::NEG_INFINITY; want_lse.len()]);
    for k_pos in &sets {
        let sub = attn_dims(1, 2, 1, 40, k_pos.len(), 8);
        let (k, v) = (gather_seq(&x.k, 1, 1, 40, 8, k_pos), gather_seq(&x.v, 1, 1, 40, 8, k_pos));
        let (part_o, part_lse) = ref_attention(&x.q, &k, &v, &pos, k_pos, sub);
        merge_partial(&mut o, &mut lse, &cast::<T>(&part_o), &cast::<T>(&part_lse), dm.hd);
    }
    assert_close("merge_partial o", &o, &want_o, tol::<T>());
    assert_close("merge_partial lse", &lse, &want_lse, tol::<T>());
}

#[test]
fn merge_partial_over_disjoint_keys_equals_attention_over_their_union() {
    check_merge_partial::<f32>();
    check_merge_partial::<f64>();
}

#[test]
fn zigzag_positions_hold_chunks_c_and_2cp_minus_1_minus_c() {
    for (s, cp) in [(8, 1), (12, 3), (32, 4), (140, 2), (138, 3)] {
        let mut seen = vec![0; s];
        let mut work = Vec::new();
        for rank in 0..cp {
            let pos = zigzag_positions(s, cp, rank);
            assert_eq!(pos, ref_zigzag(s, cp, rank), "zigzag_positions({s}, {cp}, {rank})");
            pos.iter().for_each(|&p| seen[p] += 1);
            work.push((0..cp).map(|src| visible_pairs(&pos, &zigzag_positions(s, cp, src))).sum::<u64>());
        }
        assert!(seen.iter().all(|&n| n == 1), "S {s}, cp {cp}: every position on exactly one rank");
        assert!(work.iter().all(|&w| w == work[0]), "S {s}, cp {cp}: causal work per rank {work:?}");
    }
}

#[test]
fn visible_pairs_counts_causal_query_key_pairs() {
    let naive = |q: &[usize], k: &[usize]| q.iter().map(|&qp| k.iter().filter(|&&kp| kp <= qp).count() as u64).sum::<u64>();
    let mut rng = Rng::new(50);
    for _ in 0..20 {
        // Unsorted, with repeats.
        let q: Vec<usize> = (0..1 + rng.below(30)).map(|_| rng.below(40)).collect();
        let k: Vec<usize> = (0..1 + rng.below(30)).map(|_| rng.below(40)).collect();
        assert_eq!(visible_pairs(&q, &k), naive(&q, &k), "q {q:?}, k {k:?}");
    }
    let (q, k) = (zigzag_positions(64, 4, 1), zigzag_positions(64, 4, 3));
    assert_eq!(visible_pairs(&q, &k), naive(&q, &k));
    let all: Vec<usize> = (0..64).collect();
    assert_eq!(visible_pairs(&all, &all), 64 * 65 / 2);
}
