//! Training throughput of one rank: seconds per optimiser step, tokens/s, achieved FLOP/s and
//! MFU against a GEMM peak measured in the same process on the same threads.
//!
//! Runs full optimiser steps exactly as `train::train` does on one rank (`grad_accum`
//! micro-steps of data + forward + backward, global-norm clipping, the LR schedule, AdamW),
//! through the library, without MPI. Every thread count asked for gets its own rayon pool; the
//! steps of the thread counts are interleaved (T1 T2 T1 T2 …) on one model, so a load change
//! on this shared machine hits each of them alike. Knows nothing of data parallelism.
//!
//! `cargo bench --bench throughput -- [DECK] [--threads 1,2] [--steps 6] [--warmup 2]`
//!
//! Legend: `B` micro-batch, `S` sequence, `N = B·S`, `D` width, `F` ffn hidden.

use ndtrain::config::{Deck, Resolved};
use ndtrain::data::{open_source, Loader};
use ndtrain::metrics::median;
use ndtrain::metrics::{flops_per_token, matmul_params};
use ndtrain::model::params::ModelParams;
use ndtrain::model::{Model, Tokens};
use ndtrain::optim::{clip_coefficient, global_grad_norm, lr_at, scale_grads, AdamW};
use ndtrain::real::{linear_fwd, set_gemm_threads};
use ndtrain::train::probe_gemm_flops;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

type Error = Box<dyn std::error::Error + Send + Sync>;

const USAGE: &str = "usage: cargo bench --bench throughput -- [DECK] [--threads 1,2] [--steps N] [--warmup W]";

/// The model-shaped probe: the gate/up projection forward, `y [N, F] = x [N, D] · Wᵀ`, with
/// `bench_small`'s N = 2048, D = 512, F = 1536 (`[2048, 512] × [512, 1536]`).
const PROBE_M: usize = 2048;
const PROBE_K: usize = 512;
const PROBE_N: usize = 1536;
/// Repeats of each probe; the best counts (as `train::probe_gemm_flops`, best of 4).
const PROBE_REPS: usize = 4;

struct Args {
    deck: PathBuf,
    threads: Vec<usize>,
    steps: usize,
    warmup: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args { deck: PathBuf::from("inputs/bench_small.toml"), threads: vec![1, 2], steps: 6, warmup: 2 };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value\n{USAGE}"));
        match arg.as_str() {
            // `cargo bench` passes `--bench` to harness-less benches.
            "--bench" => {}
            "--threads" => {
                let v = value("--threads")?;
                a.threads = v
                    .split(',')
                    .map(|t| t.trim().parse::<usize>().ok().filter(|&t| t > 0))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| format!("--threads {v}: expected positive integers separated by commas, e.g. 1,2"))?;
            }
            "--steps" => a.steps = value("--steps")?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--warmup" => a.warmup = value("--warmup")?.parse().map_err(|e| format!("--warmup: {e}"))?,
            "-h" | "--help" => return Err(USAGE.into()),
            s if s.starts_with('-') => return Err(format!("unknown option {s}\n{USAGE}")),
            s => a.deck = PathBuf::from(s),
        }
    }
    if a.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    Ok(a)
}

/// Wall time of one optimiser step and of its phases, in seconds.
#[derive(Clone, Copy, Default)]
struct StepTimes {
    total: f64,
    data: f64,
    forward: f64,
    backward: f64,
    /// Grad norm, clipping and AdamW.
    optimizer: f64,
}

/// One rank's training state, stepped as `train::train` steps it (minus the communication).
struct Trainer {
    res: Resolved,
    params: ModelParams<f32>,
    grads: ModelParams<f32>,
    opt: AdamW<f32>,
    model: Model<f32>,
    loader: Loader,
    positions: Vec<usize>, // [S]
    step: u64,
    total_steps: u64,
    last_loss: f64,
}

impl Trainer {
    fn new(res: Resolved, total_steps: u64) -> Result<Self, Error> {
        let deck = &res.deck;
        let (mcfg, tcfg) = (&deck.model, &deck.train);
        let source = open_source(&deck.data, mcfg.vocab_size, deck.run.seed)?;
        let loader = Loader::new(&deck.data, source, tcfg.seq_len, tcfg.micro_batch, res.global_batch, 1, 0, deck.run.seed)?;
        Ok(Trainer {
            params: ModelParams::init(mcfg, deck.run.seed),
            grads: ModelParams::zeros(mcfg),
            opt: AdamW::new(mcfg, &deck.optim),
            model: Model::new(mcfg, tcfg.activation_checkpointing),
            loader,
            positions: (0..tcfg.seq_len).collect(),
            step: 0,
            total_steps,
            last_loss: f64::NAN,
            res,
        })
    }

    /// One optimiser step on the current rayon pool and GEMM threads.
    fn step(&mut self) -> Result<StepTimes, Error> {
        let (tcfg, ocfg) = (&self.res.deck.train, &self.res.deck.optim);
        let (s, mb, ga) = (tcfg.seq_len, tcfg.micro_batch, self.res.grad_accum);
        let mut t = StepTimes::default();
        let start = Instant::now();
        self.grads.fill_zero();
        let n_tok = (ga * mb * s) as f64;
        let loss_scale = (1.0 / n_tok) as f32;
        let mut loss_sum = 0.0;
        for micro in 0..ga {
            let t0 = Instant::now();
            let batch = self.loader.micro_batch(self.step, micro)?;
            let t1 = Instant::now();
            let tok = Tokens { inputs: &batch.inputs, targets: &batch.targets, positions: &self.positions, batch: mb, seq: s };
            loss_sum += self.model.forward(&self.params, &tok);
            let t2 = Instant::now();
            self.model.backward(&self.params, &mut self.grads, loss_scale);
            let t3 = Instant::now();
            t.data += (t1 - t0).as_secs_f64();
            t.forward += (t2 - t1).as_secs_f64();
            t.backward += (t3 - t2).as_secs_f64();
        }
        let t_opt = Instant::now();
        let grad_norm = global_grad_norm(&self.grads);
        scale_grads(&mut self.grads, clip_coefficient(grad_norm, ocfg.grad_clip));
        let lr = lr_at(ocfg, self.res.lr, self.step, self.total_steps);
        self.opt.step(&mut self.params, &self.grads, lr);
        t.optimizer = t_opt.elapsed().as_secs_f64();
        t.total = start.elapsed().as_secs_f64();
        self.last_loss = loss_sum / n_tok;
        self.step += 1;
        Ok(t)
    }
}

/// Best FLOP/s of `PROBE_REPS` model-shaped GEMMs (`PROBE_M × PROBE_K × PROBE_N`, as a linear
/// layer forward) on the current GEMM threads.
fn probe_model_shape_flops() -> f64 {
    let x = vec![1.0f32; PROBE_M * PROBE_K]; // [N, D]
    let w = vec![0.5f32; PROBE_N * PROBE_K]; // [F, D]
    let mut y = vec![0.0f32; PROBE_M * PROBE_N]; // [N, F]
    let mut best = f64::MAX;
    for _ in 0..PROBE_REPS {
        let t = Instant::now();
        linear_fwd(&mut y, &x, &w, PROBE_M, PROBE_N, PROBE_K, false);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (PROBE_M * PROBE_K * PROBE_N) as f64 / best
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" ")).unwrap_or_default()
}

/// What one thread count measured.
struct PerThreads {
    threads: usize,
    pool: rayon::ThreadPool,
    steps: Vec<StepTimes>,
    probe_square: Vec<f64>,
    probe_model: Vec<f64>,
}

impl PerThreads {
    /// Runs `f` on this thread count: its rayon pool, and as many GEMM threads.
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        set_gemm_threads(self.threads);
        self.pool.install(f)
    }

    fn probe(&mut self) {
        let (sq, md) = self.run(|| (probe_gemm_flops(), probe_model_shape_flops()));
        self.probe_square.push(sq);
        self.probe_model.push(md);
    }
}

fn run(args: &Args) -> Result<(), Error> {
    let deck = Deck::from_file(&args.deck, &[])?;
    let res = deck.resolve(1)?;
    let (mcfg, tcfg) = (&res.deck.model, &res.deck.train);
    let tokens_per_step = (res.global_batch * tcfg.seq_len) as f64;
    let flops_tok = flops_per_token(mcfg, tcfg.seq_len);
    let flops_step = flops_tok * tokens_per_step;
    let n_threads = args.threads.len() as u64;
    let total_steps = (args.warmup + args.steps) as u64 * n_threads;

    println!("# throughput bench: {}", args.deck.display());
    println!(
        "model: d_model {} × {} layers, ffn {}, vocab {}, {} matmul params; B {} × S {} × grad_accum {} = {} tokens/step; \
         activation checkpointing {:?}",
        mcfg.d_model,
        mcfg.n_layers,
        mcfg.ffn_hidden,
        mcfg.vocab_size,
        matmul_params(mcfg),
        tcfg.micro_batch,
        tcfg.seq_len,
        res.grad_accum,
        tokens_per_step,
        tcfg.activation_checkpointing
    );
    println!("FLOPs (DESIGN.md, 6·N_matmul + 12·L·D·S per token): {:.4} GFLOP/token, {:.1} GFLOP/step", flops_tok / 1e9, flops_step / 1e9);
    println!(
        "threads {:?}, {} warm-up + {} timed steps each, interleaved; loadavg at start {}",
        args.threads,
        args.warmup,
        args.steps,
        loadavg()
    );

    let mut trainer = Trainer::new(res.clone(), total_steps)?;
    let mut per: Vec<PerThreads> = args
        .threads
        .iter()
        .map(|&t| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
            Ok(PerThreads { threads: t, pool, steps: vec![], probe_square: vec![], probe_model: vec![] })
        })
        .collect::<Result<_, rayon::ThreadPoolBuildError>>()?;

    let wall = Instant::now();
    // Warm-up (first touch of every buffer, AdamW state), then a first probe round.
    for i in 0..args.warmup {
        for p in per.iter_mut() {
            let st = p.run(|| trainer.step())?;
            println!("warm-up {} T={} {:.3} s loss {:.4}", i + 1, p.threads, st.total, trainer.last_loss);
        }
    }
    for p in per.iter_mut() {
        p.probe();
    }
    for i in 0..args.steps {
        for p in per.iter_mut() {
            let st = p.run(|| trainer.step())?;
            println!(
                "step {:>2} T={} {:.3} s (data {:.3}, fwd {:.3}, bwd {:.3}, opt {:.3}) loss {:.4}",
                i + 1,
                p.threads,
                st.total,
                st.data,
                st.forward,
                st.backward,
                st.optimizer,
                trainer.last_loss
            );
            p.steps.push(st);
        }
    }
    for p in per.iter_mut() {
        p.probe();
    }
    println!("loadavg at end {}; bench wall {:.1} s\n", loadavg(), wall.elapsed().as_secs_f64());

    println!("| threads | median s/step | min s/step | tokens/s | achieved GFLOP/s | peak 1024³ GFLOP/s | peak 2048×512×1536 GFLOP/s | MFU vs 1024³ | MFU vs 2048×512×1536 |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in &per {
        let tot: Vec<f64> = p.steps.iter().map(|s| s.total).collect();
        let (med, lo) = (median(&tot), min(&tot));
        let achieved = flops_step / med;
        let (pk_sq, pk_md) = (p.probe_square.iter().copied().fold(0.0, f64::max), p.probe_model.iter().copied().fold(0.0, f64::max));
        println!(
            "| {} | {:.3} | {:.3} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} % | {:.1} % |",
            p.threads,
            med,
            lo,
            tokens_per_step / med,
            achieved / 1e9,
            pk_sq / 1e9,
            pk_md / 1e9,
            100.0 * achieved / pk_sq,
            100.0 * achieved / pk_md
        );
    }
    println!("\nPeak = best of the probes before and after the timed steps (each best of {PROBE_REPS}); the samples (GFLOP/s):\n");
    println!("| threads | 1024³ before | 1024³ after | 2048×512×1536 before | 2048×512×1536 after |");
    println!("|---:|---:|---:|---:|---:|");
    for p in &per {
        let g = |v: &[f64], i: usize| v.get(i).map_or("-".to_string(), |x| format!("{:.1}", x / 1e9));
        println!(
            "| {} | {} | {} | {} | {} |",
            p.threads,
            g(&p.probe_square, 0),
            g(&p.probe_square, 1),
            g(&p.probe_model, 0),
            g(&p.probe_model, 1)
        );
    }
    println!("\nPhase medians per step (s) and their share of the median step:\n");
    println!("| threads | data | forward | backward | optimizer | sum of phase medians | forward % | backward % | optimizer % |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in &per {
        let m = |f: fn(&StepTimes) -> f64| median(&p.steps.iter().map(f).collect::<Vec<_>>());
        let (d, f, b, o, tot) = (m(|s| s.data), m(|s| s.forward), m(|s| s.backward), m(|s| s.optimizer), m(|s| s.total));
        println!(
            "| {} | {:.5} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1} | {:.1} | {:.1} |",
            p.threads,
            d,
            f,
            b,
            o,
            d + f + b + o,
            100.0 * f / tot,
            100.0 * b / tot,
            100.0 * o / tot
        );
    }
    // Speed-up: the ratio within each round (the thread counts ran back to back, so they saw
    // the same load), then its median.
    if per.len() >= 2 {
        for p in &per[1..] {
            let ratios: Vec<f64> = per[0].steps.iter().zip(&p.steps).map(|(a, b)| a.total / b.total).collect();
            let s = median(&ratios);
            println!(
                "\nspeed-up T={} over T={}: {:.2}× (median of {} per-round ratios; {:.0} % parallel efficiency)",
                p.threads,
                per[0].threads,
                s,
                ratios.len(),
                100.0 * s / (p.threads as f64 / per[0].threads as f64)
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
