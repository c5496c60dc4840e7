//! `ndtrain probe`: what this machine's ranks can do, as the `[hardware]` lines the planner's
//! time model reads (`docs/planning.md`).
//!
//! Without a deck: the f32 GEMM rate, the cores' FMA peak and the memory bandwidth of one
//! process. With `--deck` it is an MPI program (`mpirun -n N ndtrain probe --deck DECK`):
//! every rank measures at the same time as the others, on the threads training would give it,
//! so that ranks sharing cores measure the shared rates. It times the deck's own GEMM shapes at
//! a few sizes and fits the rate curve `peak × f / (f + half)`, the real model's forward and
//! backward on one micro-batch (what the GEMMs leave is the attention's and the elementwise
//! work's time per token and block) and its AdamW step, a triad, and the program's own
//! all-reduce, all-gather and reduce-scatter over the node for latency and bandwidth.

use crate::backend::cpu::gemm::linear_fwd;
use crate::backend::cpu::probe::{fma_peak_of, gemm_flops, memory_bandwidth, FmaKernel};
use crate::backend::cpu::Cpu;
use crate::config::{Deck, ModelCfg};
use crate::metrics::{median, Phase};
use crate::parallel::collective::MeshCollectives;
use crate::parallel::comm::{Group, Runtime};
use crate::parallel::mesh::Mesh;
use crate::train::step::Trainer;
use std::path::Path;
use std::time::Instant;

/// Measures on `threads` threads (0: every core) and returns the report.
pub fn report(threads: usize) -> String {
    let threads = if threads > 0 { threads } else { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) };
    crate::backend::cpu::use_threads(threads);
    let flops = gemm_flops();
    let fma = fma_peak_of(FmaKernel::detect(), threads, 20, std::time::Duration::from_millis(20));
    let bw = memory_bandwidth();
    format!(
        "f32 GEMM (1024³, best of 4) on {threads} thread(s): {flops:.3e} FLOP/s\n\
         f32 FMA peak ({}, {}-bit, best of 20 × 20 ms) on {} thread(s): {:.3e} FLOP/s\n\
         GEMM / FMA peak: {:.3} (the GEMM's efficiency on this machine)\n\
         memory bandwidth (triad a = b + s·c over 3 × 64 MiB, best of 5) on {threads} thread(s): {bw:.3e} bytes/s\n\
         \n[hardware]\npeak_flops_per_rank = {flops:.4e}\n\
         # MFU against the silicon instead: peak_flops_per_rank = {:.4e} (the FMA peak; docs/model.md)\n",
        fma.kernel.name(),
        fma.width_bits,
        fma.threads,
        fma.flops,
        flops / fma.flops,
        fma.flops
    )
}

/// What `probe --deck` measured, as the `[hardware]` keys it prints.
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    pub ranks_per_node: usize,
    pub cores_per_node: usize,
    pub threads: usize,
    pub gemm_peak: f64,
    pub gemm_half: f64,
    pub block_other_s_per_token: f64,
    pub optimizer_bandwidth: f64,
    pub memory_bandwidth: f64,
    /// `(latency s, bandwidth bytes/s)` of the node's all-reduce, all-gather, reduce-scatter
    /// (`None` on one rank).
    pub collectives: Option<[(f64, f64); 3]>,
    /// What a blocking 8-byte all-reduce costs between compute chunks, beyond the chunks:
    /// the wait for peers that the scheduler has not run yet (0 on one rank).
    pub sync_wait_s: f64,
    /// One rank's measured forward + backward and optimiser seconds, for the report.
    pub model_fb_s: f64,
    pub model_opt_s: f64,
    /// `(FLOPs, FLOP/s)` of every timed GEMM.
    pub gemm_points: Vec<(f64, f64)>,
}

/// `ndtrain probe --deck DECK` on this rank: the report (rank 0) or `None` (other ranks).
pub fn run_deck(deck_path: &Path, set: &[String]) -> Result<Option<String>, String> {
    let rt = Runtime::init();
    let world = rt.world();
    let deck = world.agree(Deck::from_file(deck_path, set).and_then(|d| d.validate().map(|_| d)).map_err(|e| e.to_string()))?;
    let node = world.split_shared();
    let cpus = crate::run::placement::affinity();
    let threads = crate::run::placement::threads_on_node(&node, deck.run.threads, &cpus);
    crate::backend::cpu::use_threads(threads);
    let mut cal =
        Calibration { ranks_per_node: node.size(), cores_per_node: crate::run::placement::node_cpus(), threads, ..Calibration::default() };
    fit_gemm(&world, &deck.model, deck.train.micro_batch * deck.train.seq_len, &mut cal);
    let alone = world.split("probe_self", world.rank(), 0);
    let (fb, opt, params) = world.agree(model_step(&deck, alone).map_err(|e| format!("probe: the model's step failed: {e}")))?;
    cal.model_fb_s = world_max(&world, fb);
    cal.model_opt_s = world_max(&world, opt);
    let tokens = (deck.train.micro_batch * deck.train.seq_len) as f64;
    let gemm_s: f64 =
        model_gemms(&deck.model, tokens as usize, 1, deck.model.n_layers).iter().map(|&(f, n)| n * 3.0 * f / cal.rate(f)).sum();
    // The model's own step is the anchor: GEMMs timed alone slower than the whole step ran
    // (another load, colder caches) are rescaled to fit in it, leaving nothing for the rest.
    if gemm_s > cal.model_fb_s {
        cal.gemm_peak *= gemm_s / cal.model_fb_s.max(1e-9);
    }
    cal.block_other_s_per_token = ((cal.model_fb_s - gemm_s) / (tokens * deck.model.n_layers as f64)).max(0.0);
    cal.optimizer_bandwidth = 28.0 * params as f64 / cal.model_opt_s.max(1e-9);
    world.barrier();
    cal.memory_bandwidth = world_min(&world, memory_bandwidth());
    if world.size() > 1 {
        cal.collectives = Some(collectives(&world));
        cal.sync_wait_s = sync_wait(&world);
    }
    // The groups are freed before `rt` finalises MPI (locals drop in reverse order).
    Ok((world.rank() == 0).then(|| describe(&cal, deck_path)))
}

impl Calibration {
    /// The fitted GEMM rate of one GEMM of `flops` FLOPs.
    pub fn rate(&self, flops: f64) -> f64 {
        self.gemm_peak * flops / (flops + self.gemm_half)
    }
}

fn world_max(world: &Group, x: f64) -> f64 {
    world.min_max_sum_f64(x).1
}

fn world_min(world: &Group, x: f64) -> f64 {
    world.min_max_sum_f64(x).0
}

/// The forward GEMMs of one micro-batch of `tokens` tokens on one rank of `tp`, their
/// N-dimension split by `tp`, as `(FLOPs, how many)`: per block the q/k/v projection, the
/// output projection, gate and up, down; once the head. Backward runs two of each size.
pub fn model_gemms(m: &ModelCfg, tokens: usize, tp: usize, blocks: usize) -> Vec<(f64, f64)> {
    let (d, hd) = (m.d_model, m.head_dim());
    let f = |n: usize, k: usize| 2.0 * tokens as f64 * n as f64 * k as f64;
    let b = blocks as f64;
    vec![
        (f((m.n_heads + 2 * m.n_kv_heads) * hd / tp, d), b),
        (f(d, m.n_heads * hd / tp), b),
        (f(2 * m.ffn_hidden / tp, d), b),
        (f(d, m.ffn_hidden / tp), b),
        (f(m.vocab_size.div_ceil(tp), d), 1.0),
    ]
}

/// Times every distinct GEMM shape of the deck (as the linear layer's forward) on 1, ½ and ¼
/// of a micro-batch's tokens, all ranks at once, and fits `1/rate = 1/peak + half/(peak·f)`
/// by least squares over the slowest rank's rates.
fn fit_gemm(world: &Group, m: &ModelCfg, tokens: usize, cal: &mut Calibration) {
    let (d, hd) = (m.d_model, m.head_dim());
    let shapes =
        [((m.n_heads + 2 * m.n_kv_heads) * hd, d), (d, m.n_heads * hd), (2 * m.ffn_hidden, d), (d, m.ffn_hidden), (m.vocab_size, d)];
    for rows in [tokens, tokens / 2, tokens / 4].into_iter().filter(|&r| r >= 1) {
        for &(n, k) in &shapes {
            let x = vec![0.5f32; rows * k];
            let w = vec![0.25f32; n * k];
            let mut y = vec![0.0f32; rows * n];
            let mut best = f64::MAX;
            for _ in 0..3 {
                world.barrier();
                let t = Instant::now();
                linear_fwd(&mut y, &x, &w, rows, n, k, false);
                best = best.min(t.elapsed().as_secs_f64());
            }
            let flops = 2.0 * (rows * n * k) as f64;
            cal.gemm_points.push((flops, flops / world_max(world, best)));
        }
    }
    let pts: Vec<(f64, f64)> = cal.gemm_points.iter().map(|&(f, r)| (1.0 / f, 1.0 / r)).collect();
    let n = pts.len() as f64;
    let (mx, my) = (pts.iter().map(|p| p.0).sum::<f64>() / n, pts.iter().map(|p| p.1).sum::<f64>() / n);
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
    let intercept = my - slope * mx;
    // A curve that does not flatten within the sizes measured: the best rate seen is the peak.
    let best = cal.gemm_points.iter().map(|p| p.1).fold(0.0, f64::max);
    cal.gemm_peak = if intercept > 0.0 { (1.0 / intercept).min(4.0 * best) } else { best };
    cal.gemm_half = slope * cal.gemm_peak;
}

/// One micro-batch of the real model on this rank alone (`alone`: a group of one): the median
/// forward + backward and optimiser seconds of 5 steps after one warm-up, and the parameters.
fn model_step(deck: &Deck, alone: Group) -> Result<(f64, f64, usize), String> {
    let mut d = deck.clone();
    let p = &mut d.parallel;
    (p.pp, p.pp_virtual, p.pp_layers, p.tp, p.cp, p.dp_replicate, p.dp_shard) = (1, 1, vec![], 1, 1, 1, 1);
    d.train.global_batch = d.train.micro_batch;
    d.train.grad_accum = 0;
    d.run.steps = d.run.steps.max(8);
    let res = d.resolve(1).map_err(|e| e.to_string())?;
    let mesh = Mesh::new(alone, res.layout);
    let be = Cpu { precision: res.deck.train.precision, staged: false };
    let mut trainer = Trainer::seeded(be, MeshCollectives::host(&mesh), &res, &mesh).map_err(|e| e.to_string())?;
    let (mut fb, mut opt) = (vec![], vec![]);
    for step in 0..6u64 {
        let out = trainer.step(step).map_err(|e| e.to_string())?;
        if step > 0 {
            let ph = &out.phases;
            fb.push(ph[Phase::Data] + ph[Phase::Forward] + ph[Phase::Backward]);
            opt.push(ph[Phase::Comm] + ph[Phase::Optimizer]);
        }
    }
    let params = crate::model::params::param_specs(&res.deck.model).iter().map(|s| s.numel()).sum();
    Ok((median(&fb), median(&opt), params))
}

/// Latency and bandwidth of the program's all-reduce, all-gather and reduce-scatter over
/// `world`: from the median of 30 calls of 8 bytes per rank and of 5 calls of 8 MiB, under the
/// ring's cost `a·(n−1)·latency + a·(n−1)/n·bytes/bandwidth` (`a` = 2 for the all-reduce).
fn collectives(world: &Group) -> [(f64, f64); 3] {
    let n = world.size();
    let time = |kind: usize, len: usize, reps: usize| -> f64 {
        let send = vec![1.0f32; len];
        let mut out = vec![0.0f32; if kind == 1 { len * n } else { len }];
        let rs_in = vec![1.0f32; len * n];
        let mut times = vec![];
        for _ in 0..reps {
            world.barrier();
            let t = Instant::now();
            match kind {
                0 => world.all_reduce_sum_f32(&mut out),
                1 => world.all_gather_f32(&send, &mut out),
                _ => world.reduce_scatter_sum_f32(&rs_in, &mut out),
            }
            times.push(world_max(world, t.elapsed().as_secs_f64()));
        }
        median(&times)
    };
    let big = 2 << 20;
    [0usize, 1, 2].map(|kind| {
        let a = if kind == 0 { 2.0 } else { 1.0 };
        let steps = a * (n - 1) as f64;
        let small = time(kind, 2, 30);
        let latency = small / steps;
        // The bytes a ring moves per rank: the whole buffer's (n−1)/n, `a` times.
        let buffer = 4.0 * (if kind == 0 { big } else { big * n }) as f64;
        let large = time(kind, big, 5);
        let bandwidth = steps / n as f64 * buffer / (large - small).max(1e-9);
        (latency, bandwidth)
    })
}

/// The median seconds a blocking 8-byte all-reduce adds between compute chunks of about a
/// block's GEMM (20 rounds with, 20 without, every rank at once): in training every exchange
/// comes between compute, and where ranks share cores a peer may not be running when it is
/// needed (the latency of a quiet probe misses that).
fn sync_wait(world: &Group) -> f64 {
    let (rows, n) = (256, 512);
    let x = vec![0.5f32; rows * n];
    let w = vec![0.25f32; n * n];
    let mut y = vec![0.0f32; rows * n];
    let mut tiny = [1.0f32; 2];
    let mut rounds = |sync: bool| {
        world.barrier();
        let t = Instant::now();
        for _ in 0..20 {
            linear_fwd(&mut y, &x, &w, rows, n, n, false);
            if sync {
                world.all_reduce_sum_f32(&mut tiny);
            }
        }
        world_max(world, t.elapsed().as_secs_f64()) / 20.0
    };
    let (mut with, mut without) = (vec![], vec![]);
    for _ in 0..3 {
        without.push(rounds(false));
        with.push(rounds(true));
    }
    (median(&with) - median(&without)).max(0.0)
}

/// The report rank 0 prints: what was measured, then the `[hardware]` table.
fn describe(cal: &Calibration, deck: &Path) -> String {
    let mut s = format!(
        "probe of {} on {} rank(s) of this node at once, {} thread(s) each, {} core(s)\n",
        deck.display(),
        cal.ranks_per_node,
        cal.threads,
        cal.cores_per_node
    );
    s += "GEMM (the deck's shapes, slowest rank): FLOPs -> FLOP/s\n";
    for (f, r) in &cal.gemm_points {
        s += &format!("  {f:>12.4e} {r:>12.4e}  fit {:>12.4e}\n", cal.rate(*f));
    }
    s += &format!("model, one micro-batch on each rank: forward + backward {:.4} s, AdamW {:.4} s\n", cal.model_fb_s, cal.model_opt_s);
    s += &format!("\n[hardware]\nranks_per_node = {}\ncores_per_node = {}\n", cal.ranks_per_node, cal.cores_per_node);
    s += &format!("peak_flops_per_rank = {:.4e}\ngemm_half_rate_flops = {:.4e}\n", cal.gemm_peak, cal.gemm_half);
    s += &format!("block_other_s_per_token = {:.4e}\n", cal.block_other_s_per_token);
    s += &format!("optimizer_bandwidth = {:.4e}\nmemory_bandwidth = {:.4e}\n", cal.optimizer_bandwidth, cal.memory_bandwidth);
    if let Some(c) = &cal.collectives {
        s += &format!(
            "# all-reduce {:.2e} s + {:.3e} B/s, all-gather {:.2e} s + {:.3e} B/s, reduce-scatter {:.2e} s + {:.3e} B/s\n",
            c[0].0, c[0].1, c[1].0, c[1].1, c[2].0, c[2].1
        );
        let bw = c.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
        // The all-reduce's cost counts 2(n−1) latencies: the wait between compute spread so.
        let steps = 2.0 * (cal.ranks_per_node.max(2) - 1) as f64;
        s += &format!("# a blocking all-reduce between compute chunks waits {:.2e} s\n", cal.sync_wait_s);
        let lat = c.iter().map(|x| x.0).fold(cal.sync_wait_s / steps, f64::max);
        s += &format!("intra_node_bandwidth = {bw:.4e}\nintra_node_latency = {lat:.4e}\n");
    }
    s
}
