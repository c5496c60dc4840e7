//! Pipeline schedules: the order in which one pipeline rank runs the forwards and backwards of
//! its model chunks over a step's micro-batches, and the bubble each schedule leaves.
//!
//! Virtual stage `k·pp + p` is chunk `k` of pipeline rank `p` (with one chunk per rank, the
//! stage is the rank). GPipe runs every forward, then every backward. 1F1B runs `pp − p − 1`
//! warm-up forwards, then alternates one forward and one backward, then drains the
//! backwards: at most `pp − p` micro-batches in flight on rank `p`. Interleaved 1F1B
//! (Megatron-LM's order) walks the chunks in groups of `pp` micro-batches, forwards chunk by
//! chunk upwards and backwards downwards, with `2·(pp − p − 1) + (v − 1)·pp` warm-up forwards.
//! Zero bubble (ZB-H1, Qi et al. 2024) splits each backward into `B` (the input gradient, which
//! the previous stage waits for) and `W` (the weight gradient, which nobody waits for): a
//! rank runs a `B` as soon as its gradient has arrived, a forward when its activation has
//! arrived and fewer than `pp − p` micro-batches are in flight (forward run, `B` not yet), and
//! otherwise a pending `W` (first, if `pp` of them wait) — so the weight gradients fill the
//! idle slots 1F1B leaves; every rank idles `(pp − 1)/(3m + pp − 1)` of the step. Its order
//! is found by running that rule on the unit costs below (every rank derives the same orders).
//! Within one chunk every schedule runs micro-batches in increasing order, forwards and
//! backwards alike, so messages between two ranks on one tag arrive in the order they are
//! needed (MPI keeps that order).

use crate::config::PpSchedule;

/// One unit of a pipeline rank's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Forward {
        chunk: usize,
        micro: usize,
    },
    /// The backward: both gradients, or under zero bubble the input gradient only.
    Backward {
        chunk: usize,
        micro: usize,
    },
    /// Zero bubble's deferred weight gradient of a micro-batch's backward.
    Weight {
        chunk: usize,
        micro: usize,
    },
}

impl Action {
    pub fn chunk(self) -> usize {
        match self {
            Action::Forward { chunk, .. } | Action::Backward { chunk, .. } | Action::Weight { chunk, .. } => chunk,
        }
    }

    pub fn micro(self) -> usize {
        match self {
            Action::Forward { micro, .. } | Action::Backward { micro, .. } | Action::Weight { micro, .. } => micro,
        }
    }
}

/// Unit costs of the schedules' model: a chunk's forward of one micro-batch costs 1, its input
/// gradient 1 and its weight gradient 1 (a backward that computes both costs 2).
const F: u64 = 1;
const B_INPUT: u64 = 1;
const W: u64 = 1;

/// The actions of pipeline rank `rank` of `pp`, with `v` chunks per rank and `m` micro-batches,
/// in the order it runs them.
pub fn actions(schedule: PpSchedule, pp: usize, v: usize, rank: usize, m: usize) -> Vec<Action> {
    if schedule == PpSchedule::ZeroBubble {
        return zero_bubble(pp, m).swap_remove(rank);
    }
    let total = m * v;
    // The k-th forward and backward of this rank, as (chunk, micro) (with one chunk: micro k).
    let forward = |k: usize| {
        let group = k / (pp * v);
        (k / pp % v, group * pp + k % pp)
    };
    let backward = |k: usize| {
        let (chunk, micro) = forward(k);
        (v - 1 - chunk, micro)
    };
    let warmup = match schedule {
        PpSchedule::Gpipe => total,
        _ if v == 1 => pp - rank - 1,
        _ => 2 * (pp - rank - 1) + (v - 1) * pp,
    }
    .min(total);
    let f = |k: usize| {
        let (chunk, micro) = forward(k);
        Action::Forward { chunk, micro }
    };
    let b = |k: usize| {
        let (chunk, micro) = backward(k);
        Action::Backward { chunk, micro }
    };
    let mut out: Vec<Action> = (0..warmup).map(f).collect();
    for k in 0..total - warmup {
        out.push(f(warmup + k));
        out.push(b(k));
    }
    out.extend((total - warmup..total).map(b));
    out
}

/// The actions of an evaluation on a pipeline rank with `v` chunks: the forward of each of
/// `m` micro-batches through every chunk in turn. A stage waits only for the chunk before it,
/// which every rank runs in the same (micro-batch, chunk) order, so the pipeline cannot stall.
pub fn forward_only(v: usize, m: usize) -> Vec<Action> {
    (0..m).flat_map(|micro| (0..v).map(move |chunk| Action::Forward { chunk, micro })).collect()
}

/// For each of `m` micro-batches, the index in `actions` of the last action on it: after it,
/// the micro-batch's tokens are no longer needed.
pub fn last_use(actions: &[Action], m: usize) -> Vec<usize> {
    let mut last = vec![0; m];
    for (i, a) in actions.iter().enumerate() {
        last[a.micro()] = i;
    }
    last
}

/// Every rank's zero-bubble order (one chunk per rank): the rule of the module's comment run
/// in unit time steps on the unit costs; ties go to `B`, then the forward, then `W` — unless
/// `pp` weight gradients wait already, which bounds their operands' memory.
fn zero_bubble(pp: usize, m: usize) -> Vec<Vec<Action>> {
    let mut out = vec![vec![]; pp];
    // Finish times of each rank's forwards and input gradients, per micro-batch.
    let mut f_done = vec![vec![u64::MAX; m]; pp];
    let mut b_done = vec![vec![u64::MAX; m]; pp];
    let (mut nf, mut nb, mut nw) = (vec![0usize; pp], vec![0usize; pp], vec![0usize; pp]);
    let mut free_at = vec![0u64; pp];
    let mut t = 0u64;
    while (0..pp).any(|p| nw[p] < m) {
        for p in 0..pp {
            if free_at[p] > t {
                continue;
            }
            let arrived = |done: u64| done <= t;
            let b_ready = nb[p] < nf[p] && arrived(if p + 1 == pp { f_done[p][nb[p]] } else { b_done[p + 1][nb[p]] });
            let f_ready = nf[p] < m && nf[p] - nb[p] < pp - p && (p == 0 || arrived(f_done[p - 1][nf[p]]));
            let w_due = nw[p] < nb[p] && nb[p] - nw[p] >= pp;
            let (action, cost) = if b_ready {
                b_done[p][nb[p]] = t + B_INPUT;
                nb[p] += 1;
                (Action::Backward { chunk: 0, micro: nb[p] - 1 }, B_INPUT)
            } else if f_ready && !w_due {
                f_done[p][nf[p]] = t + F;
                nf[p] += 1;
                (Action::Forward { chunk: 0, micro: nf[p] - 1 }, F)
            } else if nw[p] < nb[p] {
                nw[p] += 1;
                (Action::Weight { chunk: 0, micro: nw[p] - 1 }, W)
            } else {
                continue;
            };
            out[p].push(action);
            free_at[p] = t + cost;
        }
        t += 1;
    }
    out
}

/// The fraction of a step a rank idles under `schedule`, in the unit-cost model (forward 1,
/// input gradient 1, weight gradient 1): `(pp − 1) / (v·m + pp − 1)` for the 1F1B family
/// (GPipe's is the same; it keeps more micro-batches in flight instead), and for zero bubble,
/// whose weight gradients fill all but the forward-and-input-gradient part of the ramp,
/// `(pp − 1)(F + B − W) / (m(F + B + W) + (pp − 1)(F + B − W)) = (pp − 1) / (3m + pp − 1)`.
pub fn bubble_fraction(schedule: PpSchedule, pp: usize, v: usize, m: usize) -> f64 {
    let ramp = (pp - 1) as f64;
    match schedule {
        PpSchedule::ZeroBubble => {
            let (f, b, w) = (F as f64, B_INPUT as f64, W as f64);
            ramp * (f + b - w) / (m as f64 * (f + b + w) + ramp * (f + b - w))
        }
        _ => ramp / ((v * m) as f64 + ramp),
    }
}

/// Micro-batches whose activations each chunk of a pipeline rank holds at once at most: the
/// models each chunk keeps, from a micro-batch's forward to its backward (`gpipe`: all `m`;
/// `1f1b` and `zero_bubble`: `pp − rank`).
pub fn peak_in_flight(schedule: PpSchedule, pp: usize, v: usize, rank: usize, m: usize) -> Vec<usize> {
    peak_held(schedule, pp, v, rank, m, |a| match a {
        Action::Forward { .. } => 1,
        Action::Backward { .. } => -1,
        Action::Weight { .. } => 0,
    })
}

/// Zero bubble: micro-batches whose weight-gradient operands each chunk of a pipeline rank
/// holds at once at most, from a backward's input gradient to its weight gradient (0 under
/// the other schedules).
pub fn peak_deferred(schedule: PpSchedule, pp: usize, v: usize, rank: usize, m: usize) -> Vec<usize> {
    let split = schedule == PpSchedule::ZeroBubble;
    peak_held(schedule, pp, v, rank, m, |a| match a {
        Action::Forward { .. } => 0,
        Action::Backward { .. } => split as i64,
        Action::Weight { .. } => -1,
    })
}

/// The peak per chunk of a count that each action changes by `delta`.
fn peak_held(schedule: PpSchedule, pp: usize, v: usize, rank: usize, m: usize, delta: impl Fn(Action) -> i64) -> Vec<usize> {
    let mut held = vec![0i64; v];
    let mut peak = vec![0usize; v];
    for a in actions(schedule, pp, v, rank, m) {
        held[a.chunk()] += delta(a);
        peak[a.chunk()] = peak[a.chunk()].max(held[a.chunk()] as usize);
    }
    peak
}

/// Runs every rank's actions against the pipeline's dependencies (a forward needs the previous
/// stage's forward of its micro-batch, a backward the next stage's backward, the last stage's
/// backward its own forward, a weight gradient its own backward), with the unit costs (a
/// backward not split costs `B + W`), each rank in its own order. Returns each rank's idle
/// time units and the makespan; `None` if the ranks would wait for each other forever.
pub fn simulate(schedule: PpSchedule, pp: usize, v: usize, m: usize) -> Option<(Vec<u64>, u64)> {
    let stages = pp * v;
    let backward_cost = if schedule == PpSchedule::ZeroBubble { B_INPUT } else { B_INPUT + W };
    let lists: Vec<Vec<Action>> = (0..pp).map(|p| actions(schedule, pp, v, p, m)).collect();
    // Finish times, per virtual stage and micro-batch.
    let mut f_done = vec![vec![None::<u64>; m]; stages];
    let mut b_done = vec![vec![None::<u64>; m]; stages];
    let mut next = vec![0usize; pp];
    let mut clock = vec![0u64; pp];
    let mut busy = vec![0u64; pp];
    loop {
        let mut progressed = false;
        for p in 0..pp {
            let Some(&a) = lists[p].get(next[p]) else { continue };
            let vs = a.chunk() * pp + p;
            let micro = a.micro();
            let (ready, cost) = match a {
                Action::Forward { .. } => (if vs == 0 { Some(0) } else { f_done[vs - 1][micro] }, F),
                Action::Backward { .. } => {
                    let dep = if vs + 1 == stages { f_done[vs][micro] } else { b_done[vs + 1][micro] };
                    (dep, backward_cost)
                }
                Action::Weight { .. } => (b_done[vs][micro], W),
            };
            let Some(ready) = ready else { continue };
            let start = clock[p].max(ready);
            clock[p] = start + cost;
            busy[p] += cost;
            match a {
                Action::Forward { .. } => f_done[vs][micro] = Some(clock[p]),
                Action::Backward { .. } => b_done[vs][micro] = Some(clock[p]),
                Action::Weight { .. } => {}
            }
            next[p] += 1;
            progressed = true;
        }
        if (0..pp).all(|p| next[p] == lists[p].len()) {
            let makespan = *clock.iter().max().expect("pp ≥ 1");
            return Some(((0..pp).map(|p| makespan - busy[p]).collect(), makespan));
        }
        if !progressed {
            return None;
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use PpSchedule::*;

    /// Every rank runs each chunk's forward and backward (and under zero bubble its weight
    /// gradient) of every micro-batch exactly once, the forward first, the weight gradient after
    /// the backward, and within a chunk in increasing micro-batch order.
    #[test]
    fn every_schedule_runs_each_piece_once_in_order() {
        for (sched, v) in [(Gpipe, 1), (OneFOneB, 1), (Interleaved, 2), (Interleaved, 3), (ZeroBubble, 1)] {
            for pp in 1..=4 {
                for m in [pp, 2 * pp, 3 * pp] {
                    for rank in 0..pp {
                        let a = actions(sched, pp, v, rank, m);
                        let split = sched == ZeroBubble;
                        assert_eq!(a.len(), if split { 3 } else { 2 } * m * v);
                        let order = |chunk: usize, kind: fn(Action) -> bool| -> Vec<usize> {
                            a.iter().filter(|x| x.chunk() == chunk && kind(**x)).map(|x| x.micro()).collect()
                        };
                        for chunk in 0..v {
                            let all: Vec<usize> = (0..m).collect();
                            let what = format!("{sched:?} pp {pp} v {v} m {m} rank {rank}");
                            assert_eq!(order(chunk, |x| matches!(x, Action::Forward { .. })), all, "{what}");
                            assert_eq!(order(chunk, |x| matches!(x, Action::Backward { .. })), all, "{what}");
                            let weights = order(chunk, |x| matches!(x, Action::Weight { .. }));
                            assert_eq!(weights, if split { all } else { vec![] }, "{what}");
                        }
                        for (i, x) in a.iter().enumerate() {
                            match *x {
                                Action::Backward { chunk, micro } => assert!(a[..i].contains(&Action::Forward { chunk, micro })),
                                Action::Weight { chunk, micro } => assert!(a[..i].contains(&Action::Backward { chunk, micro })),
                                Action::Forward { .. } => {}
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_alternates_after_the_warm_up() {
        let a = actions(OneFOneB, 4, 1, 1, 6);
        use Action::{Backward as B, Forward as F};
        let want = [
            F { chunk: 0, micro: 0 },
            F { chunk: 0, micro: 1 },
            F { chunk: 0, micro: 2 },
            B { chunk: 0, micro: 0 },
            F { chunk: 0, micro: 3 },
            B { chunk: 0, micro: 1 },
        ];
        assert_eq!(&a[..6], &want);
    }

    /// No schedule deadlocks, and the simulated idle fraction of the first rank (every rank
    /// under 1F1B and zero bubble) equals the formula; GPipe's makespan is 1F1B's.
    #[test]
    fn simulated_bubble_matches_the_formula() {
        for (sched, v) in [(Gpipe, 1), (OneFOneB, 1), (Interleaved, 2), (Interleaved, 4), (ZeroBubble, 1)] {
            for pp in 2..=8 {
                for m in [pp, pp + 1, 2 * pp, 4 * pp] {
                    if sched == Interleaved && m % pp != 0 {
                        continue;
                    }
                    let (idle, makespan) = simulate(sched, pp, v, m).unwrap_or_else(|| panic!("{sched:?} pp {pp} v {v} m {m} deadlocks"));
                    let formula = bubble_fraction(sched, pp, v, m);
                    // Under 1F1B and zero bubble every rank idles the same.
                    let ranks = if matches!(sched, OneFOneB | ZeroBubble) { pp } else { 1 };
                    for (rank, &idle) in idle.iter().enumerate().take(ranks) {
                        let measured = idle as f64 / makespan as f64;
                        assert!((measured - formula).abs() < 1e-9, "{sched:?} pp {pp} v {v} m {m} rank {rank}: {measured} vs {formula}");
                    }
                    if sched == ZeroBubble {
                        assert!(formula < bubble_fraction(OneFOneB, pp, 1, m));
                    }
                }
            }
        }
    }

    #[test]
    fn in_flight_micro_batches_are_what_each_schedule_promises() {
        assert_eq!(peak_in_flight(Gpipe, 4, 1, 0, 8), vec![8]);
        assert_eq!(peak_in_flight(OneFOneB, 4, 1, 0, 8), vec![4]);
        assert_eq!(peak_in_flight(OneFOneB, 4, 1, 3, 8), vec![1]);
        assert_eq!(peak_in_flight(OneFOneB, 1, 1, 0, 8), vec![1]);
        // Zero bubble keeps 1F1B's bound on activations (freed by the input gradient); the
        // weight-gradient operands wait at most pp micro-batches.
        for pp in 2..=8 {
            for rank in 0..pp {
                for m in [pp, 4 * pp] {
                    assert_eq!(peak_in_flight(ZeroBubble, pp, 1, rank, m), vec![pp - rank], "pp {pp} rank {rank} m {m}");
                    let deferred = peak_deferred(ZeroBubble, pp, 1, rank, m)[0];
                    assert!((1..=pp).contains(&deferred), "pp {pp} rank {rank} m {m}: {deferred}");
                }
            }
            assert_eq!(peak_deferred(OneFOneB, pp, 1, 0, 8), vec![0]);
        }
    }
}
