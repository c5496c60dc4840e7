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
//! all-reduce, all-gather and reduce-scatter over the node for latency and bandwidth. On a job
//! that spans nodes the same collectives between nodes, called non-blocking as the gradient
//! reduction and FSDP call them — over the ranks of equal node-local rank, all such groups at
//! once, so each rank measures its share of its node's network, and over every rank, several
//! on each node — and the blocking all-reduce tensor parallelism calls, give the
//! `inter_node_*` and `inter_node_packed_*` keys.

use crate::backend::cpu::attention::{attention_bwd, attention_fwd};
use crate::backend::cpu::gemm::{linear_bwd, linear_fwd};
use crate::backend::cpu::kernels::{add_assign, rmsnorm_bwd, rmsnorm_fwd};
use crate::backend::cpu::probe::{fma_peak_of, gemm_flops, memory_bandwidth, FmaKernel};
use crate::backend::cpu::Cpu;
use crate::backend::AttnDims;
use crate::config::{Deck, HardwareCfg, ModelCfg};
use crate::metrics::{median, Phase};
use crate::parallel::collective::MeshCollectives;
use crate::parallel::comm::{Group, Runtime};
use crate::parallel::mesh::Mesh;
use crate::tools::plan::time::{model_gemms, rate_of, GemmShape, RateCurve};
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
    pub gemm_curve: RateCurve,
    pub block_other_s_per_token: f64,
    /// One block's attention (all heads) per token of the deck's micro-batch.
    pub attention_s_per_token: f64,
    /// One block's work on whole `[tokens, d_model]` rows (its two RMSNorms and residual adds,
    /// forward and backward), per token: every rank of a tensor-parallel group repeats it.
    pub replicated_s_per_token: f64,
    /// `[tokens, seconds per token]` of one block's forward + backward outside attention at
    /// micro-batches of the deck's length cut 1, 2, 4 and 8 times.
    pub block_s_per_token: Vec<[f64; 2]>,
    pub optimizer_bandwidth: f64,
    pub memory_bandwidth: f64,
    /// `(latency s, bandwidth bytes/s)` of the node's all-reduce, all-gather, reduce-scatter
    /// (`None` on one rank per node).
    pub collectives: Option<[(f64, f64); 3]>,
    /// Nodes of the job: the groups of MPI's shared-memory node communicator.
    pub nodes: usize,
    /// The same between nodes, over the ranks of equal node-local rank, every such group at
    /// once (so each rank gets its share of its node's network); `None` on one node.
    pub inter_node: Option<[(f64, f64); 3]>,
    /// The all-reduce between the same groups called blocking, as tensor parallelism calls it,
    /// on one of its activations.
    pub inter_node_blocking_all_reduce: Option<(f64, f64)>,
    /// The same over every rank of the job, several on each node (`None` on one node or one
    /// rank per node).
    pub inter_node_packed: Option<[(f64, f64); 3]>,
    /// What a blocking 8-byte all-reduce costs between compute chunks, beyond the chunks:
    /// the wait for peers that the scheduler has not run yet (0 on one rank).
    pub sync_wait_s: f64,
    /// One rank's measured forward + backward and optimiser seconds, for the report.
    pub model_fb_s: f64,
    pub model_opt_s: f64,
    /// Every timed GEMM shape.
    pub gemm_points: Vec<GemmPoint>,
    /// Per axis run on pairs of ranks (`tp`, `cp`): its seconds per micro-batch measured and
    /// as the model predicts it without the axis' extra term.
    pub pairs: Vec<(&'static str, f64, f64)>,
    /// What those runs took beyond the model, per token per block at degree 2.
    pub tp_extra_s_per_token: f64,
    pub cp_extra_s_per_token: f64,
    /// A non-blocking all-gather over every rank beside compute: `[alone s, compute s, both s]`
    /// and the share of it that moved while computing (`None` on one rank).
    pub overlap: Option<([f64; 3], f64)>,
    /// The real model's FSDP over every rank (`None` on one rank).
    pub fsdp_overlap: Option<FsdpOverlap>,
}

/// What the real model's FSDP over every rank of the job left exposed of its collectives, per
/// step, and the share of their time in flight that moved while computing which makes `plan`
/// predict the same.
#[derive(Clone, Copy, Debug, Default)]
pub struct FsdpOverlap {
    /// Seconds per step the ranks were blocked in FSDP's gathers and reduce-scatters: the
    /// mean over ranks, the median of the steps.
    pub measured_s: f64,
    /// `plan`'s exposed seconds with none of it hidden, and with all of it that can be.
    pub unhidden_s: f64,
    pub hidden_s: f64,
    pub share: f64,
}

impl Calibration {
    /// The `[hardware]` table of what was measured (`deck`'s other keys as they are).
    pub fn hardware(&self) -> HardwareCfg {
        let mut h = HardwareCfg {
            ranks_per_node: self.ranks_per_node,
            cores_per_node: self.cores_per_node,
            peak_flops_per_rank: self.gemm_curve.peak,
            gemm_half_rate_rows: self.gemm_curve.half_rows,
            gemm_half_rate_cols: self.gemm_curve.half_cols,
            gemm_half_rate_inner: self.gemm_curve.half_inner,
            block_other_s_per_token: self.block_other_s_per_token,
            attention_s_per_token: self.attention_s_per_token,
            replicated_s_per_token: self.replicated_s_per_token,
            block_s_per_token: self.block_s_per_token.clone(),
            optimizer_bandwidth: self.optimizer_bandwidth,
            memory_bandwidth: self.memory_bandwidth,
            tp_extra_s_per_token: self.tp_extra_s_per_token,
            cp_extra_s_per_token: self.cp_extra_s_per_token,
            ..HardwareCfg::default()
        };
        if let Some(c) = &self.inter_node {
            // MPI picks its algorithm per collective: each its own rate.
            (h.inter_node_all_reduce_bandwidth, h.inter_node_bandwidth, h.inter_node_reduce_scatter_bandwidth) = (c[0].1, c[1].1, c[2].1);
            h.inter_node_latency = c.iter().map(|x| x.0).fold(0.0, f64::max);
        }
        if let Some((_, bandwidth)) = self.inter_node_blocking_all_reduce {
            h.inter_node_blocking_all_reduce_bandwidth = bandwidth;
        }
        if let Some(c) = &self.inter_node_packed {
            (h.inter_node_packed_all_reduce_bandwidth, h.inter_node_packed_bandwidth, h.inter_node_packed_reduce_scatter_bandwidth) =
                (c[0].1, c[1].1, c[2].1);
        }
        if let Some((_, share)) = self.overlap {
            h.overlap_efficiency = share;
        }
        if let Some(f) = self.fsdp_overlap {
            h.fsdp_overlap_efficiency = f.share;
        }
        if let Some(c) = &self.collectives {
            // Moving bytes (the all-gather) and moving and summing them (the others) differ by
            // the reduction's pass over memory.
            (h.intra_node_bandwidth, h.intra_node_reduce_bandwidth) = (c[1].1, c[0].1.min(c[2].1));
            // The all-reduce's cost counts 2(n−1) latencies: the wait between compute spread so.
            let steps = 2.0 * (self.ranks_per_node.max(2) - 1) as f64;
            h.intra_node_latency = c.iter().map(|x| x.0).fold(self.sync_wait_s / steps, f64::max);
        }
        h
    }
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
    let nodes = world.count_true(node.rank() == 0);
    let mut cal = Calibration {
        ranks_per_node: node.size(),
        cores_per_node: crate::run::placement::node_cpus(),
        threads,
        nodes,
        ..Calibration::default()
    };
    fit_gemm(&world, &deck.model, deck.train.micro_batch * deck.train.seq_len, &mut cal);
    let step = |seq_len: usize| {
        let alone = world.split("probe_self", world.rank(), 0);
        world.agree(model_step(&deck, alone, seq_len, (1, 1)).map_err(|e| format!("probe: the model's step failed: {e}")))
    };
    let own = step(deck.train.seq_len)?;
    cal.model_fb_s = world_max(&world, own.fb);
    cal.model_opt_s = world_max(&world, own.comm + own.optimizer);
    let tokens = (deck.train.micro_batch * deck.train.seq_len) as f64;
    let gemm_s: f64 =
        model_gemms(&deck.model, tokens as usize, 1, deck.model.n_layers).iter().map(|g| g.count * 3.0 * g.flops() / cal.rate(g)).sum();
    // The model's own step is the anchor: GEMMs timed alone slower than the whole step ran
    // (another load, colder caches) are rescaled to fit in it, leaving nothing for the rest.
    if gemm_s > cal.model_fb_s {
        cal.gemm_curve.peak *= gemm_s / cal.model_fb_s.max(1e-9);
    }
    let attention = |seq_len: usize| world_max(&world, attention_s(&world, &deck, seq_len)) / (deck.train.micro_batch * seq_len) as f64;
    cal.attention_s_per_token = attention(deck.train.seq_len);
    cal.replicated_s_per_token = world_max(&world, replicated_s(&world, &deck)) / tokens;
    let rest = (cal.model_fb_s - gemm_s) / (tokens * deck.model.n_layers as f64) - cal.attention_s_per_token;
    cal.block_other_s_per_token = rest.max(0.0);
    // The block at the shorter micro-batches context parallelism gives a rank: a GEMM library
    // has thresholds in the rows the fitted curve smooths over.
    for cut in [1, 2, 4, 8].into_iter().filter(|&c| deck.train.seq_len % c == 0 && deck.train.seq_len / c >= 32) {
        let fb = if cut == 1 { cal.model_fb_s } else { world_max(&world, step(deck.train.seq_len / cut)?.fb) };
        let rows = deck.train.micro_batch * deck.train.seq_len / cut;
        let head = model_gemms(&deck.model, rows, 1, 1).last().map_or(0.0, |g| 3.0 * g.flops() / cal.rate(g));
        let per_token = (fb - head) / (rows * deck.model.n_layers) as f64 - attention(deck.train.seq_len / cut);
        cal.block_s_per_token.push([rows as f64, per_token.max(0.0)]);
    }
    cal.optimizer_bandwidth = 28.0 * own.params as f64 / cal.model_opt_s.max(1e-9);
    world.barrier();
    cal.memory_bandwidth = world_min(&world, memory_bandwidth());
    if nodes > 1 {
        // Ranks of equal node-local rank, one per node: what a data-parallel axis across nodes
        // is, every node's ranks sending at once.
        let across = world.split("probe_across", node.rank(), world.rank());
        // Tensor parallelism's all-reduce moves one `[tokens, d_model]` activation per call
        // (at least 1 MiB, so that the bytes and not the latency set the time). Its groups
        // call it between their own compute, each at its own pace, so each group's calls
        // start at its own barrier; the non-blocking calls of FSDP and the bucketed gradient
        // reduction start at the end of the same backward on every rank, together.
        let tp_len = (deck.train.micro_batch * deck.train.seq_len * deck.model.d_model).max(1 << 18);
        let (spread, blocking) = world.agree(if across.size() == nodes {
            Ok((collectives(&across, &world, Call::NonBlocking), collective(&across, &across, Call::Blocking, 0, tp_len)))
        } else {
            Err(format!("probe: the nodes hold different numbers of ranks ({} on this one); give every node the same", node.size()))
        })?;
        (cal.inter_node, cal.inter_node_blocking_all_reduce) = (Some(spread), Some(blocking));
        // Every rank: a group with several ranks on each node, as FSDP over every rank is.
        if node.size() > 1 {
            cal.inter_node_packed = Some(collectives(&world, &world, Call::NonBlocking));
        }
    }
    if world.size() > 1 {
        cal.overlap = Some(overlap(&world));
    }
    if node.size() > 1 {
        cal.collectives = Some(collectives(&node, &node, Call::Blocking));
        cal.sync_wait_s = sync_wait(&node);
        calibrate_pairs(&world, &deck, &mut cal)?;
    }
    if world.size() > 1 {
        cal.fsdp_overlap = Some(calibrate_fsdp_overlap(&world, &deck, &cal)?);
    }
    // The groups are freed before `rt` finalises MPI (locals drop in reverse order).
    Ok((world.rank() == 0).then(|| describe(&cal, deck_path)))
}

impl Calibration {
    /// The fitted rate of a linear layer of shape `g`.
    pub fn rate(&self, g: &GemmShape) -> f64 {
        rate_of(&self.gemm_curve, g.rows, g.n, g.k)
    }
}

fn world_max(world: &Group, x: f64) -> f64 {
    world.min_max_sum_f64(x).1
}

fn world_min(world: &Group, x: f64) -> f64 {
    world.min_max_sum_f64(x).0
}

/// One timed GEMM shape: its rows, outputs and inputs, and the FLOP/s of its forward and
/// backward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmPoint {
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    pub rate: f64,
}

/// Times every distinct linear-layer shape of the deck, forward and backward (`dx` and `dw`),
/// on 1, ½ and ¼ of a micro-batch's tokens and as tensor parallelism of 1, 2 and 4 cuts them
/// (where the heads and the FFN divide), all ranks at once ([`contended`]), and fits the rate
/// curve
/// `1/rate = (1 + half_rows/rows + half_cols/n + half_inner/k) / peak` ([`fit_rate_curve`]) to
/// the slowest rank's rates. The rate follows the GEMM's sides, not the FLOPs alone: a GEMM
/// library packs each operand once per call, so fewer tokens (context parallelism, smaller
/// micro-batches) or narrower weights per rank (tensor parallelism) leave less work to spread
/// that cost over.
fn fit_gemm(world: &Group, m: &ModelCfg, tokens: usize, cal: &mut Calibration) {
    let cuts = [1, 2, 4].into_iter().filter(|&tp| m.n_kv_heads % tp == 0 && m.ffn_hidden % tp == 0);
    let mut shapes: Vec<GemmShape> = cuts.flat_map(|tp| model_gemms(m, tokens, tp, 1)).collect();
    shapes.sort_by_key(|s| (s.n, s.k));
    shapes.dedup_by_key(|s| (s.n, s.k));
    for rows in [tokens, tokens / 2, tokens / 4].into_iter().filter(|&r| r >= 1) {
        for s in &shapes {
            let (n, k) = (s.n, s.k);
            let x = vec![0.5f32; rows * k];
            let w = vec![0.25f32; n * k];
            let mut y = vec![0.0f32; rows * n];
            let (mut dx, mut dw) = (vec![0.0f32; rows * k], vec![0.0f32; n * k]);
            let best = contended(world, || {
                linear_fwd(&mut y, &x, &w, rows, n, k, false);
                linear_bwd(&mut dx, false, &mut dw, &y, &x, &w, rows, n, k);
            });
            let flops = 3.0 * GemmShape { rows, ..*s }.flops();
            cal.gemm_points.push(GemmPoint { rows, n, k, rate: flops / world_max(world, best) });
        }
    }
    cal.gemm_curve = fit_rate_curve(&cal.gemm_points);
}

/// The curve `1/rate = a + b/rows + c/n + e/k` (`peak = 1/a`, each half its coefficient over
/// `a`) by least squares on the relative error (weights `rate²`), every coefficient `≥ 0`: of
/// the fits with the terms kept, the best whose coefficients are all non-negative. A curve that
/// does not flatten within the sizes measured keeps its peak within 4 × the best rate seen.
pub fn fit_rate_curve(points: &[GemmPoint]) -> RateCurve {
    let best = points.iter().map(|p| p.rate).fold(0.0, f64::max);
    let a: Vec<[f64; 4]> = points.iter().map(|p| [1.0, 1.0 / p.rows as f64, 1.0 / p.n as f64, 1.0 / p.k as f64]).collect();
    let y: Vec<f64> = points.iter().map(|p| 1.0 / p.rate).collect();
    let w: Vec<f64> = points.iter().map(|p| p.rate * p.rate).collect();
    let residual = |x: &[f64; 4]| -> f64 {
        a.iter().zip(&y).zip(&w).map(|((row, yi), wi)| wi * (row.iter().zip(x).map(|(r, c)| r * c).sum::<f64>() - yi).powi(2)).sum()
    };
    // The intercept always; every subset of the three size terms.
    let fits = (0..8u32).filter_map(|mask| {
        let keep = [true, mask & 1 != 0, mask & 2 != 0, mask & 4 != 0];
        weighted_least_squares(&a, &y, &w, keep).filter(|x| x[0] > 0.0 && x[1..].iter().all(|&c| c >= 0.0))
    });
    match fits.min_by(|p, q| residual(p).total_cmp(&residual(q))) {
        Some(x) => {
            let peak = (1.0 / x[0]).min(4.0 * best);
            RateCurve { peak, half_rows: x[1] / x[0], half_cols: x[2] / x[0], half_inner: x[3] / x[0] }
        }
        None => RateCurve { peak: best, ..RateCurve::default() },
    }
}

/// Minimises `Σ w·(a·x − y)²` over the coefficients `keep` marks (the others 0) by the normal
/// equations; `None` when they are singular (too few distinct sizes).
fn weighted_least_squares(a: &[[f64; 4]], y: &[f64], w: &[f64], keep: [bool; 4]) -> Option<[f64; 4]> {
    let idx: Vec<usize> = (0..4).filter(|&i| keep[i]).collect();
    let n = idx.len();
    let mut m = vec![vec![0.0; n + 1]; n];
    for ((row, &yi), &wi) in a.iter().zip(y).zip(w) {
        for (r, &i) in idx.iter().enumerate() {
            for (c, &j) in idx.iter().enumerate() {
                m[r][c] += wi * row[i] * row[j];
            }
            m[r][n] += wi * row[i] * yi;
        }
    }
    // Gauss-Jordan elimination with partial pivoting.
    for col in 0..n {
        let piv = (col..n).max_by(|&i, &j| m[i][col].abs().total_cmp(&m[j][col].abs()))?;
        if m[piv][col].abs() < 1e-12 * m[piv].iter().map(|v| v.abs()).fold(0.0, f64::max).max(f64::MIN_POSITIVE) {
            return None;
        }
        m.swap(col, piv);
        let pivot = m[col].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot[col];
                for (x, p) in row[col..].iter_mut().zip(&pivot[col..]) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut x = [0.0; 4];
    for (r, &i) in idx.iter().enumerate() {
        x[i] = m[r][n] / m[r][r];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// The seconds of one call of `work` with every rank of `world` running it at once: the best
/// of 2 rounds of 3 calls back to back (so that ranks sharing cores share them throughout,
/// rather than one running alone while the others wait), on this rank.
fn contended(world: &Group, mut work: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..2 {
        world.barrier();
        let t = Instant::now();
        for _ in 0..3 {
            work();
        }
        best = best.min(t.elapsed().as_secs_f64() / 3.0);
    }
    best
}

/// One block's attention forward and backward (the host kernels, every head) on a micro-batch
/// of the deck's sequences cut to `seq_len` tokens, causal, every rank at once ([`contended`]).
fn attention_s(world: &Group, deck: &Deck, seq_len: usize) -> f64 {
    let m = &deck.model;
    let dm = AttnDims { b: deck.train.micro_batch, h: m.n_heads, kv: m.n_kv_heads, sq: seq_len, sk: seq_len, hd: m.head_dim() };
    let (q_len, kv_len) = (dm.b * dm.h * seq_len * dm.hd, dm.b * dm.kv * seq_len * dm.hd);
    let (q, k, v) = (vec![0.01f32; q_len], vec![0.02f32; kv_len], vec![0.03f32; kv_len]);
    let (mut o, mut lse, mut dq) = (vec![0.0f32; q_len], vec![0.0f32; dm.b * dm.h * seq_len], vec![0.0f32; q_len]);
    let (mut dk, mut dv) = (vec![0.0f32; kv_len], vec![0.0f32; kv_len]);
    let pos: Vec<usize> = (0..seq_len).collect();
    contended(world, || {
        attention_fwd(&mut o, &mut lse, &q, &k, &v, &pos, &pos, dm);
        attention_bwd(&mut dq, &mut dk, &mut dv, &o, &q, &k, &v, &o, &lse, &pos, &pos, dm);
    })
}

/// One block's work on whole `[tokens, d_model]` rows for the deck's micro-batch, every rank
/// at once ([`contended`]): the two RMSNorms forward and backward and the residual adds (two
/// forward, two backward), the host kernels the block runs.
fn replicated_s(world: &Group, deck: &Deck) -> f64 {
    let (rows, d) = (deck.train.micro_batch * deck.train.seq_len, deck.model.d_model);
    let x = vec![0.5f32; rows * d];
    let w = vec![1.0f32; d];
    let (mut y, mut dx, mut acc) = (vec![0.0f32; rows * d], vec![0.0f32; rows * d], vec![0.0f32; rows * d]);
    let (mut rstd, mut dw) = (vec![0.0f32; rows], vec![0.0f32; d]);
    contended(world, || {
        for _ in 0..2 {
            rmsnorm_fwd(&mut y, &mut rstd, &x, &w, d, 1e-5);
            rmsnorm_bwd(&mut dx, &mut dw, &y, &x, &w, &rstd, d, true);
            add_assign(&mut acc, &x);
            add_assign(&mut acc, &dx);
        }
    })
}

/// One micro-batch of the real model on this rank alone (`alone`: a group of one): the median
/// forward + backward and optimiser seconds of 7 steps after one warm-up, and the parameters.
fn model_step(deck: &Deck, group: Group, seq_len: usize, (tp, cp): (usize, usize)) -> Result<StepTimes, String> {
    let mut d = deck.clone();
    d.train.seq_len = seq_len;
    let p = &mut d.parallel;
    (p.pp, p.pp_virtual, p.pp_layers, p.tp, p.cp, p.dp_replicate, p.dp_shard) = (1, 1, vec![], tp as i64, cp as i64, 1, 1);
    d.train.global_batch = d.train.micro_batch;
    d.train.grad_accum = 0;
    d.run.steps = d.run.steps.max(8);
    let res = d.resolve(group.size()).map_err(|e| e.to_string())?;
    let mesh = Mesh::new(group, res.layout);
    let be = Cpu { precision: res.deck.train.precision, staged: false };
    let mut trainer = Trainer::seeded(be, MeshCollectives::host(&mesh), &res, &mesh).map_err(|e| e.to_string())?;
    let (mut fb, mut comm, mut opt) = (vec![], vec![], vec![]);
    for step in 0..8u64 {
        let out = trainer.step(step).map_err(|e| e.to_string())?;
        if step > 0 {
            let ph = &out.phases;
            fb.push(ph[Phase::Data] + ph[Phase::Forward] + ph[Phase::Backward]);
            comm.push(ph[Phase::Comm]);
            opt.push(ph[Phase::Optimizer]);
        }
    }
    let params = crate::model::params::param_specs(&res.deck.model).iter().map(|s| s.numel()).sum();
    Ok(StepTimes { fb: median(&fb), comm: median(&comm), optimizer: median(&opt), params })
}

/// Medians of one micro-batch's steps: forward + backward (data included), the gradients'
/// reduction left after it, AdamW; and the model's parameters.
struct StepTimes {
    fb: f64,
    comm: f64,
    optimizer: f64,
    params: usize,
}

/// Runs the real model with `tp = 2` and then `cp = 2` (where the deck allows them) on pairs
/// of consecutive ranks, every pair at once, and records in `cal` what one micro-batch's
/// forward, backward and gradient reduction took beyond what the planner predicts for it from
/// the rest of the calibration: per token per block of the rank, the term `plan` adds for that
/// axis (`docs/planning.md`). Nothing on an odd number of ranks.
fn calibrate_pairs(world: &Group, deck: &Deck, cal: &mut Calibration) -> Result<(), String> {
    if world.size() < 2 || world.size() % 2 == 1 {
        return Ok(());
    }
    let m = &deck.model;
    let s = deck.train.seq_len;
    let axes = [("tp", (2, 1), m.n_kv_heads % 2 == 0 && m.ffn_hidden % 2 == 0), ("cp", (1, 2), s % 4 == 0)];
    for (axis, (tp, cp), allowed) in axes {
        if !allowed {
            continue;
        }
        let pair = world.split("probe_pair", world.rank() / 2, world.rank() % 2);
        let t = world.agree(model_step(deck, pair, s, (tp, cp)).map_err(|e| format!("probe: the model's step on {axis} 2 failed: {e}")))?;
        let measured = world_max(world, t.fb + t.comm);
        let mut d = deck.clone();
        let p = &mut d.parallel;
        (p.pp, p.pp_virtual, p.pp_layers, p.tp, p.cp, p.dp_replicate, p.dp_shard) = (1, 1, vec![], tp as i64, cp as i64, 1, 1);
        (d.train.global_batch, d.train.grad_accum) = (d.train.micro_batch, 0);
        d.hardware = HardwareCfg { tp_extra_s_per_token: 0.0, cp_extra_s_per_token: 0.0, ..cal.hardware() };
        let res = d.resolve(2).map_err(|e| e.to_string())?;
        let plan = crate::tools::plan::plan(&res);
        let c = crate::tools::plan::cost(&plan, &res.deck, &res.deck.hardware, d.hardware.peak_flops_per_rank);
        let predicted = c.step_s - c.stages.iter().map(|st| st.optimizer_s + st.grad_s).fold(0.0, f64::max);
        let token_blocks = (deck.train.micro_batch * s / cp * m.n_layers) as f64;
        let extra = ((measured - predicted) / token_blocks).max(0.0);
        if axis == "tp" {
            cal.tp_extra_s_per_token = extra;
        } else {
            cal.cp_extra_s_per_token = extra;
        }
        cal.pairs.push((axis, measured, predicted));
    }
    Ok(())
}

/// Runs the real model with FSDP over every rank of the job (across nodes where it spans
/// them), one micro-batch per rank, for 4 steps, and returns what its gathers and
/// reduce-scatters left exposed, as the timing log counts it (the seconds blocked in them),
/// against `plan`'s exposed seconds for the same layout under the rest of the calibration
/// `cal`: the share of the time in flight that moves while computing is the one at which
/// `plan` predicts the measured seconds (bisected; 0 when even none hidden predicts less, 1
/// when all of it predicts more). FSDP keeps a prefetched gather and a reduce-scatter in
/// flight through each unit's compute and MPI moves them only in the progress calls between
/// the model's pieces: how much moves depends on the link, the MPI and the model's cadence
/// together, which a lone collective beside other compute does not show.
fn calibrate_fsdp_overlap(world: &Group, deck: &Deck, cal: &Calibration) -> Result<FsdpOverlap, String> {
    let n = world.size();
    let mut d = deck.clone();
    let p = &mut d.parallel;
    (p.pp, p.pp_virtual, p.pp_layers, p.tp, p.cp, p.dp_replicate, p.dp_shard) = (1, 1, vec![], 1, 1, 1, n as i64);
    (d.train.global_batch, d.train.grad_accum) = (d.train.micro_batch * n, 0);
    d.run.steps = d.run.steps.max(4);
    d.hardware = cal.hardware();
    let res = world.agree(d.resolve(n).map_err(|e| format!("probe: FSDP over every rank: {e}")))?;
    let mesh = Mesh::new(world.split("probe_fsdp", 0, world.rank()), res.layout);
    let be = Cpu { precision: res.deck.train.precision, staged: false };
    let mut trainer = world.agree(Trainer::seeded(be, MeshCollectives::host(&mesh), &res, &mesh).map_err(|e| e.to_string()))?;
    let mut per_step = vec![];
    for step in 0..4u64 {
        world.agree(trainer.step(step).map(|_| ()).map_err(|e| format!("probe: the model's step on FSDP {n} failed: {e}")))?;
        let blocked: f64 =
            mesh.fsdp.take_counts().iter().filter(|(k, _)| matches!(**k, "all_gather" | "reduce_scatter")).map(|(_, c)| c.seconds).sum();
        if step > 0 {
            let mut sum = [blocked];
            world.all_reduce_sum_f64(&mut sum);
            per_step.push(sum[0] / n as f64);
        }
    }
    let plan = crate::tools::plan::plan(&res);
    let predicted = |share: f64| {
        let hw = HardwareCfg { fsdp_overlap_efficiency: share, ..res.deck.hardware.clone() };
        let c = crate::tools::plan::cost(&plan, &res.deck, &hw, hw.peak_flops_per_rank);
        c.comm_s.get("fsdp").copied().unwrap_or(0.0)
    };
    let measured_s = median(&per_step);
    let (unhidden_s, hidden_s) = (predicted(0.0), predicted(1.0));
    let share = if measured_s >= unhidden_s {
        0.0
    } else if measured_s <= hidden_s {
        1.0
    } else {
        let (mut lo, mut hi) = (0.0, 1.0);
        for _ in 0..40 {
            let mid = 0.5 * (lo + hi);
            if predicted(mid) > measured_s {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        0.5 * (lo + hi)
    };
    Ok(FsdpOverlap { measured_s, unhidden_s, hidden_s, share })
}

/// How a collective is called: the node's blocking calls, or the non-blocking ones the gradient
/// reduction and FSDP's gathers make (between nodes MPI runs other algorithms for them).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    Blocking,
    NonBlocking,
}

/// Latency and bandwidth of the program's all-reduce, all-gather and reduce-scatter over
/// `group`, called as `call` says ([`collective`]).
fn collectives(group: &Group, sync: &Group, call: Call) -> [(f64, f64); 3] {
    [0usize, 1, 2].map(|kind| collective(group, sync, call, kind, 2 << 20))
}

/// Latency and bandwidth of one collective over `group` (`kind` 0: all-reduce, 1: all-gather,
/// 2: reduce-scatter), called as `call` says: from the median of 30 calls of 8 bytes per rank
/// and of 11 calls of `len` floats (MPI picks its algorithm by the size too), under the ring's
/// cost `a·(n−1)·latency + a·(n−1)/n·bytes/bandwidth` (`a` = 2 for the all-reduce). Every rank of `sync` starts each call together, and the
/// slowest of them sets its time: the whole job for the non-blocking calls between nodes,
/// which training starts on every rank at the end of the same backward. Timed between its own
/// barriers, each pair of such an all-reduce drifts into the other half of Open MPI's
/// reduce-then-broadcast from the other pairs, and the link carries one direction for each:
/// twice the rate the bucketed all-reduce gets in training.
fn collective(group: &Group, sync: &Group, call: Call, kind: usize, len: usize) -> (f64, f64) {
    let n = group.size();
    let time = |count: usize, reps: usize| -> f64 {
        let send = vec![1.0f32; count];
        let mut out = vec![0.0f32; if kind == 1 { count * n } else { count }];
        let rs_in = vec![1.0f32; count * n];
        let mut times = vec![];
        for _ in 0..reps {
            sync.barrier();
            let t = Instant::now();
            match (call, kind) {
                (Call::Blocking, 0) => group.all_reduce_sum_f32(&mut out),
                (Call::Blocking, 1) => group.all_gather_f32(&send, &mut out),
                (Call::Blocking, _) => group.reduce_scatter_sum_f32(&rs_in, &mut out),
                (Call::NonBlocking, 0) => drop(group.wait(group.start_all_reduce_sum_f32(send.clone(), vec![0.0; count]))),
                (Call::NonBlocking, 1) => drop(group.wait(group.start_all_gather_f32(send.clone(), vec![0.0; count * n]))),
                (Call::NonBlocking, _) => drop(group.wait(group.start_reduce_scatter_sum_f32(rs_in.clone(), vec![0.0; count]))),
            }
            times.push(world_max(sync, t.elapsed().as_secs_f64()));
        }
        median(&times)
    };
    let a = if kind == 0 { 2.0 } else { 1.0 };
    let steps = a * (n - 1) as f64;
    let small = time(2, 30);
    let latency = small / steps;
    // The bytes a ring moves per rank: the whole buffer's (n−1)/n, `a` times.
    let buffer = 4.0 * (if kind == 0 { len } else { len * n }) as f64;
    let large = time(len, 11);
    let bandwidth = steps / n as f64 * buffer / (large - small).max(1e-9);
    (latency, bandwidth)
}

/// How much of a non-blocking collective moves while the ranks compute, as FSDP's prefetch
/// runs in training: every rank gathers 4 MiB from each rank of `group` (all of them at once,
/// over the network where the group spans nodes) while it runs GEMMs of a block piece's size
/// with a progress call after each, as the model makes between its pieces, for half as long
/// again as the gather alone takes. Slowest rank, medians of 3 rounds:
/// `([gather alone, compute alone, both], (alone + compute − both) / alone)`, the share in [0, 1].
fn overlap(group: &Group) -> ([f64; 3], f64) {
    let (len, n) = (1 << 20, group.size());
    let (rows, cols, inner) = (256, 1536, 512);
    let x = vec![0.5f32; rows * inner];
    let w = vec![0.25f32; cols * inner];
    let mut y = vec![0.0f32; rows * cols];
    let mut compute = |chunks: usize| {
        for _ in 0..chunks {
            linear_fwd(&mut y, &x, &w, rows, cols, inner, false);
            crate::parallel::comm::progress();
        }
    };
    let timed = |f: &mut dyn FnMut()| {
        group.barrier();
        let t = Instant::now();
        f();
        world_max(group, t.elapsed().as_secs_f64())
    };
    let send = vec![1.0f32; len];
    let mut recv = vec![0.0f32; len * n];
    let alone = median(&(0..3).map(|_| timed(&mut || group.all_gather_f32(&send, &mut recv))).collect::<Vec<_>>());
    let chunk = timed(&mut || compute(4)) / 4.0;
    // The same count on every rank: the slowest rank's chunk sets it.
    let chunks = ((1.5 * alone / chunk.max(1e-6)).ceil() as usize).clamp(4, 4000);
    let (mut computing, mut both) = (vec![], vec![]);
    for _ in 0..3 {
        computing.push(timed(&mut || compute(chunks)));
        both.push(timed(&mut || {
            let t = group.start_all_gather_f32(send.clone(), vec![0.0f32; len * n]);
            compute(chunks);
            group.wait(t);
        }));
    }
    let times = [alone, median(&computing), median(&both)];
    let share = ((times[0] + times[1] - times[2]) / times[0].max(1e-9)).clamp(0.0, 1.0);
    (times, share)
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

/// Latency and bandwidth of the all-reduce, all-gather and reduce-scatter, as [`collectives`]
/// returns them, in one line.
fn collectives_line(c: &[(f64, f64); 3]) -> String {
    format!(
        "all-reduce {:.2e} s + {:.3e} B/s, all-gather {:.2e} s + {:.3e} B/s, reduce-scatter {:.2e} s + {:.3e} B/s",
        c[0].0, c[0].1, c[1].0, c[1].1, c[2].0, c[2].1
    )
}

/// The report rank 0 prints: what was measured, then the `[hardware]` table.
fn describe(cal: &Calibration, deck: &Path) -> String {
    let mut s = format!(
        "probe of {} on {} node(s) (MPI's shared-memory node communicator has {} group(s)) of {} rank(s) at once, {} thread(s) each, {} core(s)\n",
        deck.display(),
        cal.nodes,
        cal.nodes,
        cal.ranks_per_node,
        cal.threads,
        cal.cores_per_node
    );
    s += "GEMM forward + backward (the deck's shapes, slowest rank): rows x outputs x inputs -> FLOP/s\n";
    for p in &cal.gemm_points {
        let fit = rate_of(&cal.gemm_curve, p.rows, p.n, p.k);
        s += &format!("  {:>6} x {:>6} x {:>6} {:>12.4e}  fit {fit:>12.4e}\n", p.rows, p.n, p.k, p.rate);
    }
    s += &format!("model, one micro-batch on each rank: forward + backward {:.4} s, AdamW {:.4} s\n", cal.model_fb_s, cal.model_opt_s);
    if let Some(c) = &cal.collectives {
        s += &format!("{}\n", collectives_line(c));
        s += &format!("a blocking all-reduce between compute chunks waits {:.2e} s\n", cal.sync_wait_s);
    }
    if let Some(c) = &cal.inter_node {
        s += &format!("between nodes, non-blocking (one rank per node, every node-local rank at once): {}\n", collectives_line(c));
    }
    if let Some((latency, bandwidth)) = cal.inter_node_blocking_all_reduce {
        s += &format!("between nodes, blocking, one activation (one rank per node, each group at its own pace): all-reduce {latency:.2e} s + {bandwidth:.3e} B/s\n");
    }
    if let Some(c) = &cal.inter_node_packed {
        s += &format!("between nodes, non-blocking (every rank, {} per node): {}\n", cal.ranks_per_node, collectives_line(c));
    }
    if let Some((t, share)) = cal.overlap {
        s += &format!(
            "a non-blocking all-gather of 4 MiB per rank over every rank beside compute: {:.4} s alone, compute {:.4} s, both {:.4} s: {:.0} % of it moved while computing\n",
            t[0],
            t[1],
            t[2],
            100.0 * share
        );
    }
    if let Some(f) = cal.fsdp_overlap {
        s += &format!(
            "FSDP {} over every rank, the real model: {:.4} s per step blocked in its gathers and reduce-scatters; plan {:.4} s with none of them hidden, {:.4} s with all that can be: {:.0} % of the time in flight moved while computing\n",
            cal.ranks_per_node * cal.nodes,
            f.measured_s,
            f.unhidden_s,
            f.hidden_s,
            100.0 * f.share
        );
    }
    for (axis, measured, predicted) in &cal.pairs {
        s += &format!("{axis} 2 on pairs of ranks, one micro-batch: {measured:.4} s measured, {predicted:.4} s by the model without it\n");
    }
    let h = cal.hardware();
    s += &format!("\n[hardware]\nranks_per_node = {}\ncores_per_node = {}\n", h.ranks_per_node, h.cores_per_node);
    s += &format!("peak_flops_per_rank = {:.4e}\n", h.peak_flops_per_rank);
    s += &format!("gemm_half_rate_rows = {:.4e}\ngemm_half_rate_cols = {:.4e}\n", h.gemm_half_rate_rows, h.gemm_half_rate_cols);
    s += &format!("gemm_half_rate_inner = {:.4e}\n", h.gemm_half_rate_inner);
    s += &format!("block_other_s_per_token = {:.4e}\n", h.block_other_s_per_token);
    s += &format!("attention_s_per_token = {:.4e}\n", h.attention_s_per_token);
    s += &format!("replicated_s_per_token = {:.4e}\n", h.replicated_s_per_token);
    let table: Vec<String> = h.block_s_per_token.iter().map(|[t, v]| format!("[{t}, {v:.4e}]")).collect();
    s += &format!("block_s_per_token = [{}]\n", table.join(", "));
    s += &format!("optimizer_bandwidth = {:.4e}\nmemory_bandwidth = {:.4e}\n", h.optimizer_bandwidth, h.memory_bandwidth);
    if cal.inter_node.is_some() {
        s += &format!("inter_node_bandwidth = {:.4e}\ninter_node_latency = {:.4e}\n", h.inter_node_bandwidth, h.inter_node_latency);
        s += &format!(
            "inter_node_all_reduce_bandwidth = {:.4e}\ninter_node_reduce_scatter_bandwidth = {:.4e}\n",
            h.inter_node_all_reduce_bandwidth, h.inter_node_reduce_scatter_bandwidth
        );
    }
    if cal.inter_node_blocking_all_reduce.is_some() {
        s += &format!("inter_node_blocking_all_reduce_bandwidth = {:.4e}\n", h.inter_node_blocking_all_reduce_bandwidth);
    }
    if cal.inter_node_packed.is_some() {
        s += &format!(
            "inter_node_packed_bandwidth = {:.4e}\ninter_node_packed_all_reduce_bandwidth = {:.4e}\ninter_node_packed_reduce_scatter_bandwidth = {:.4e}\n",
            h.inter_node_packed_bandwidth, h.inter_node_packed_all_reduce_bandwidth, h.inter_node_packed_reduce_scatter_bandwidth
        );
    }
    if cal.overlap.is_some() {
        s += &format!("overlap_efficiency = {:.4}\n", h.overlap_efficiency);
    }
    if cal.fsdp_overlap.is_some() {
        s += &format!("fsdp_overlap_efficiency = {:.4}\n", h.fsdp_overlap_efficiency);
    }
    if cal.collectives.is_some() {
        s += &format!(
            "intra_node_bandwidth = {:.4e}\nintra_node_reduce_bandwidth = {:.4e}\n",
            h.intra_node_bandwidth, h.intra_node_reduce_bandwidth
        );
        s += &format!("intra_node_latency = {:.4e}\n", h.intra_node_latency);
        s += &format!("tp_extra_s_per_token = {:.4e}\ncp_extra_s_per_token = {:.4e}\n", h.tp_extra_s_per_token, h.cp_extra_s_per_token);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn points(c: &RateCurve) -> Vec<GemmPoint> {
        let mut out = vec![];
        for rows in [512, 256, 128] {
            for (n, k) in [(1536, 512), (512, 512), (512, 1536), (768, 512), (512, 256)] {
                out.push(GemmPoint { rows, n, k, rate: rate_of(c, rows, n, k) });
            }
        }
        out
    }

    #[test]
    fn the_fit_recovers_the_curve_it_was_given() {
        let c = RateCurve { peak: 1e11, half_rows: 40.0, half_cols: 0.0, half_inner: 12.0 };
        let f = fit_rate_curve(&points(&c));
        assert!((f.peak / c.peak - 1.0).abs() < 1e-9, "{f:?}");
        assert!((f.half_rows - 40.0).abs() < 1e-6 && f.half_cols.abs() < 1e-6 && (f.half_inner - 12.0).abs() < 1e-6, "{f:?}");
    }

    #[test]
    fn a_term_that_would_fit_negative_is_dropped() {
        // Rates that rise as the outputs narrow: no non-negative `half_cols` explains them, so
        // the fit keeps the others (here the rows' term alone, exactly).
        let c = RateCurve { peak: 1e11, half_rows: 40.0, ..RateCurve::default() };
        let mut pts = points(&c);
        for p in &mut pts {
            p.rate *= 1.0 + 2.0 / p.n as f64;
        }
        let f = fit_rate_curve(&pts);
        assert_eq!(f.half_cols, 0.0, "{f:?}");
        assert!(f.half_rows > 0.0 && f.half_inner >= 0.0, "{f:?}");
    }
}
