//! Pipeline schedules: the order in which one pipeline rank runs the forwards and backwards of
//! its model chunks over a step's micro-batches, and the bubble each schedule leaves.
//!
//! Virtual stage `k·pp + p` is chunk `k` of pipeline rank `p` (with one chunk per rank, the
//! stage is the rank). GPipe runs every forward, then every backward. 1F1B runs `pp − p − 1`
//! warm-up forwards, then alternates one forward and one backward, then drains the
//! backwards: at most `pp − p` micro-batches in flight on rank `p`. Interleaved 1F1B
//! (Megatron-LM's order) walks the chunks in groups of `pp` micro-batches, forwards chunk by
//! chunk upwards and backwards downwards, with `2·(pp − p − 1) + (v − 1)·pp` warm-up forwards.
//! Within one chunk every schedule runs micro-batches in increasing order, forwards and
//! backwards alike, so messages between two ranks on one tag arrive in the order they are
//! needed (MPI keeps that order).

use crate::config::PpSchedule;

/// One unit of a pipeline rank's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Forward { chunk: usize, micro: usize },
    Backward { chunk: usize, micro: usize },
}

/// The actions of pipeline rank `rank` of `pp`, with `v` chunks per rank and `m` micro-batches,
/// in the order it runs them.
pub fn actions(schedule: PpSchedule, pp: usize, v: usize, rank: usize, m: usize) -> Vec<Action> {
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

/// The fraction of a step a rank idles under `schedule` when every chunk's forward of one
/// micro-batch costs 1 and its backward 2: `(pp − 1) / (v·m + pp − 1)` for the 1F1B family
/// (GPipe's is the same; it keeps more micro-batches in flight instead).
pub fn bubble_fraction(pp: usize, v: usize, m: usize) -> f64 {
    (pp - 1) as f64 / ((v * m) as f64 + (pp - 1) as f64)
}

/// Micro-batches whose activations each chunk of a pipeline rank holds at once at most: the
/// models each chunk keeps (`gpipe`: all `m`; `1f1b`: `pp − rank`).
pub fn peak_in_flight(schedule: PpSchedule, pp: usize, v: usize, rank: usize, m: usize) -> Vec<usize> {
    let mut held = vec![0usize; v];
    let mut peak = vec![0usize; v];
    for a in actions(schedule, pp, v, rank, m) {
        match a {
            Action::Forward { chunk, .. } => {
                held[chunk] += 1;
                peak[chunk] = peak[chunk].max(held[chunk]);
            }
            Action::Backward { chunk, .. } => held[chunk] -= 1,
        }
    }
    peak
}

/// Runs every rank's actions against the pipeline's dependencies (a forward needs the previous
/// stage's forward of its micro-batch, a backward the next stage's backward, the last stage's
/// backward its own forward), forward costing 1 time unit and backward 2, each rank in its
/// own order. Returns each rank's idle time units and the makespan; `None` if the ranks would
/// wait for each other forever.
pub fn simulate(schedule: PpSchedule, pp: usize, v: usize, m: usize) -> Option<(Vec<u64>, u64)> {
    let stages = pp * v;
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
            let (ready, cost) = match a {
                Action::Forward { chunk, micro } => {
                    let vs = chunk * pp + p;
                    (if vs == 0 { Some(0) } else { f_done[vs - 1][micro] }, 1)
                }
                Action::Backward { chunk, micro } => {
                    let vs = chunk * pp + p;
                    let dep = if vs + 1 == stages { f_done[vs][micro] } else { b_done[vs + 1][micro] };
                    (dep, 2)
                }
            };
            let Some(ready) = ready else { continue };
            let start = clock[p].max(ready);
            clock[p] = start + cost;
            busy[p] += cost;
            match a {
                Action::Forward { chunk, micro } => f_done[chunk * pp + p][micro] = Some(clock[p]),
                Action::Backward { chunk, micro } => b_done[chunk * pp + p][micro] = Some(clock[p]),
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

    /// Every rank runs each chunk's forward and backward of every micro-batch exactly once,
    /// the forward first, and within a chunk in increasing micro-batch order.
    #[test]
    fn every_schedule_runs_each_piece_once_in_order() {
        for (sched, v) in [(Gpipe, 1), (OneFOneB, 1), (Interleaved, 2), (Interleaved, 3)] {
            for pp in 1..=4 {
                for m in [pp, 2 * pp, 3 * pp] {
                    for rank in 0..pp {
                        let a = actions(sched, pp, v, rank, m);
                        assert_eq!(a.len(), 2 * m * v);
                        for chunk in 0..v {
                            let f: Vec<usize> = a
                                .iter()
                                .filter_map(|x| match *x {
                                    Action::Forward { chunk: c, micro } if c == chunk => Some(micro),
                                    _ => None,
                                })
                                .collect();
                            let b: Vec<usize> = a
                                .iter()
                                .filter_map(|x| match *x {
                                    Action::Backward { chunk: c, micro } if c == chunk => Some(micro),
                                    _ => None,
                                })
                                .collect();
                            assert_eq!(f, (0..m).collect::<Vec<_>>(), "{sched:?} pp {pp} v {v} m {m} rank {rank}");
                            assert_eq!(b, (0..m).collect::<Vec<_>>(), "{sched:?} pp {pp} v {v} m {m} rank {rank}");
                        }
                        for (i, x) in a.iter().enumerate() {
                            if let Action::Backward { chunk, micro } = *x {
                                assert!(a[..i].contains(&Action::Forward { chunk, micro }));
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

    /// No schedule deadlocks, and the simulated idle fraction of the ranks equals the formula
    /// (for 1F1B and interleaved exactly on every rank; GPipe's makespan is the same).
    #[test]
    fn simulated_bubble_matches_the_formula() {
        for (sched, v) in [(Gpipe, 1), (OneFOneB, 1), (Interleaved, 2), (Interleaved, 4)] {
            for pp in 2..=4 {
                for m in [pp, 2 * pp, 4 * pp] {
                    let (idle, makespan) = simulate(sched, pp, v, m).unwrap_or_else(|| panic!("{sched:?} pp {pp} v {v} m {m} deadlocks"));
                    // Unit forward 1, backward 2 per chunk; a chunk is 1/v of a stage.
                    let work = (3 * m * v) as f64;
                    let ideal = work / (work + 3.0 * (pp - 1) as f64);
                    let measured = 1.0 - idle[0] as f64 / makespan as f64;
                    if sched != Gpipe || v == 1 {
                        assert!((measured - ideal).abs() < 1e-9, "{sched:?} pp {pp} v {v} m {m}: {measured} vs {ideal}");
                        assert!((1.0 - ideal - bubble_fraction(pp, v, m)).abs() < 1e-9);
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
    }
}
