//! The AdamW update of one tensor on the host, with the coefficients of [`AdamStep`]
//! (`torch.optim.AdamW`'s semantics; `docs/model.md`). Elementwise and independent: chunks run
//! in parallel, each a straight loop the compiler vectorises; the result does not depend on the
//! thread count.

use crate::backend::AdamStep;
use crate::scalar::Real;
use rayon::prelude::*;

/// Elements per parallel task of the update.
const ADAMW_CHUNK: usize = 16384;

/// `p ← p·decay`, `m ← b1·m + (1−b1)·g`, `v ← b2·v + (1−b2)·g²`,
/// `p ← p − step_size · m / (sqrt(v)/bc2_sqrt + eps)`, elementwise.
pub fn adamw_update<T: Real>(p: &mut [T], g: &[T], m: &mut [T], v: &mut [T], step: &AdamStep) {
    let (step_size, bc2_sqrt, eps, d) =
        (T::from_f64(step.step_size), T::from_f64(step.bc2_sqrt), T::from_f64(step.eps), T::from_f64(step.decay));
    let (b1, b2) = (T::from_f64(step.b1), T::from_f64(step.b2));
    let (one_m_b1, one_m_b2) = (T::from_f64(1.0 - step.b1), T::from_f64(1.0 - step.b2));
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
