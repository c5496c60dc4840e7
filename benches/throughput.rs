//! Training throughput of one rank: seconds per optimiser step, tokens/s, achieved FLOP/s and
//! MFU against GEMM peaks and the cores' FMA peak, measured in the same process on the same threads.
//!
//! Runs the training loop's own step (`train::step::Trainer::step`: `grad_accum` micro-steps
//! of data + forward + backward, global-norm clipping, the LR schedule, AdamW) on one rank, a
//! singleton MPI job. Every thread count asked for gets its own rayon pool; the
//! steps of the thread counts are interleaved (T1 T2 T1 T2 …) on one model, so a load change
//! on this shared machine hits each of them alike. Knows nothing of data parallelism.
//!
//! `cargo bench --bench throughput -- [DECK] [--threads 1,2] [--steps 6] [--warmup 2]`
//!
//! Legend: `B` micro-batch, `S` sequence, `N = B·S`, `D` width, `F` ffn hidden.

use ndtrain::backend::cpu::gemm::linear_fwd;
use ndtrain::backend::cpu::probe::{fma_peak_of, gemm_flops, FmaKernel};
use ndtrain::backend::cpu::set_gemm_threads;
use ndtrain::backend::cpu::Cpu;
use ndtrain::config::Deck;
use ndtrain::metrics::{flops_per_token, matmul_params, median, Phase};
use ndtrain::parallel::collective::MeshCollectives;
use ndtrain::parallel::comm::Runtime;
use ndtrain::parallel::mesh::Mesh;
use ndtrain::train::step::{StepOutcome, Trainer};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// The allocator the `ndtrain` binary runs with (`src/main.rs`), so the bench measures what
/// training does: the GEMM's packing buffers kept for reuse (`backend::cpu::heap`).
#[global_allocator]
static HEAP: ndtrain::backend::cpu::heap::SpareBlockAlloc = ndtrain::backend::cpu::heap::SpareBlockAlloc::new();

type Error = Box<dyn std::error::Error + Send + Sync>;

const USAGE: &str = "usage: cargo bench --bench throughput -- [DECK] [--threads 1,2] [--steps N] [--warmup W]";

/// The model-shaped probe: the gate/up projection forward, `y [N, F] = x [N, D] · Wᵀ`, with
/// `bench_small`'s N = 2048, D = 512, F = 1536 (`[2048, 512] × [512, 1536]`).
const PROBE_M: usize = 2048;
const PROBE_K: usize = 512;
const PROBE_N: usize = 1536;
/// Repeats of each probe; the best counts (as `backend::cpu::probe::gemm_flops`, best of 4).
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

/// The step's times from the training loop's own phase times (`comm`, the global norm's
/// reductions, counts as optimizer time here: one rank has nothing to communicate).
fn step_times(total: f64, out: &StepOutcome) -> StepTimes {
    let p = &out.phases;
    StepTimes {
        total,
        data: p[Phase::Data],
        forward: p[Phase::Forward],
        backward: p[Phase::Backward],
        optimizer: p[Phase::Comm] + p[Phase::Optimizer],
    }
}

/// One optimiser step of `trainer` on the current rayon pool and GEMM threads.
fn step(trainer: &mut Trainer<'_, Cpu>, index: &mut u64) -> Result<(StepTimes, f64), Error> {
    let start = Instant::now();
    let out = trainer.step(*index)?;
    *index += 1;
    Ok((step_times(start.elapsed().as_secs_f64(), &out), out.loss))
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
    /// The f32 FMA peak of these threads (`backend::cpu::probe::fma_peak_of`).
    probe_fma: Vec<f64>,
}

/// Carries the trainer into a rayon pool's thread for one step.
struct OnePool<T>(T);

// SAFETY: `ThreadPool::install` blocks the calling thread until the closure has run on one of
// the pool's threads, so the trainer is used by one thread at a time, never concurrently; and
// a one-rank step makes no MPI call (its groups have degree 1 and nothing is in flight).
unsafe impl<T> Send for OnePool<T> {}

impl PerThreads {
    /// Runs `f` on this thread count: its rayon pool, and as many GEMM threads.
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        set_gemm_threads(self.threads);
        self.pool.install(f)
    }

    /// One training step on this thread count.
    fn step(&self, trainer: &mut Trainer<'_, Cpu>, index: &mut u64) -> Result<(StepTimes, f64), Error> {
        let carried = OnePool((trainer, index));
        self.run(move || {
            // The whole wrapper moves into the closure (not its fields one by one).
            let whole = carried;
            let OnePool((trainer, index)) = whole;
            step(trainer, index).map_err(|e| e.to_string())
        })
        .map_err(Error::from)
    }

    fn probe(&mut self) {
        let (sq, md) = self.run(|| (gemm_flops(), probe_model_shape_flops()));
        self.probe_square.push(sq);
        self.probe_model.push(md);
        let fma = fma_peak_of(FmaKernel::detect(), self.threads, 20, Duration::from_millis(20));
        self.probe_fma.push(fma.flops);
    }
}

fn run(args: &Args) -> Result<(), Error> {
    // The LR schedule spans every step the bench takes.
    let total_steps = (args.warmup + args.steps) * args.threads.len();
    let deck = Deck::from_file(&args.deck, &[format!("run.steps={total_steps}")])?;
    let res = deck.resolve(1)?;
    let (mcfg, tcfg) = (&res.deck.model, &res.deck.train);
    let tokens_per_step = (res.global_batch * tcfg.seq_len) as f64;
    let flops_tok = flops_per_token(mcfg, tcfg.seq_len);
    let flops_step = flops_tok * tokens_per_step;

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
    println!(
        "FLOPs (docs/model.md, 6·N_matmul + 12·L·D·S per token): {:.4} GFLOP/token, {:.1} GFLOP/step",
        flops_tok / 1e9,
        flops_step / 1e9
    );
    println!(
        "threads {:?}, {} warm-up + {} timed steps each, interleaved; loadavg at start {}",
        args.threads,
        args.warmup,
        args.steps,
        loadavg()
    );

    // One rank (a singleton MPI job): the training loop's own step on the host backend.
    let runtime = Runtime::init();
    let mesh = Mesh::new(runtime.world(), res.layout);
    let be = Cpu { precision: tcfg.precision, staged: false };
    let mut trainer = Trainer::seeded(be, MeshCollectives::host(&mesh), &res, &mesh)?;
    let mut index = 0;
    let mut per: Vec<PerThreads> = args
        .threads
        .iter()
        .map(|&t| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
            Ok(PerThreads { threads: t, pool, steps: vec![], probe_square: vec![], probe_model: vec![], probe_fma: vec![] })
        })
        .collect::<Result<_, rayon::ThreadPoolBuildError>>()?;

    let wall = Instant::now();
    // Warm-up (first touch of every buffer, AdamW state), then a first probe round.
    for i in 0..args.warmup {
        for p in per.iter_mut() {
            let (st, loss) = p.step(&mut trainer, &mut index)?;
            println!("warm-up {} T={} {:.3} s loss {:.4}", i + 1, p.threads, st.total, loss);
        }
    }
    for p in per.iter_mut() {
        p.probe();
    }
    for i in 0..args.steps {
        for p in per.iter_mut() {
            let (st, loss) = p.step(&mut trainer, &mut index)?;
            println!(
                "step {:>2} T={} {:.3} s (data {:.3}, fwd {:.3}, bwd {:.3}, opt {:.3}) loss {:.4}",
                i + 1,
                p.threads,
                st.total,
                st.data,
                st.forward,
                st.backward,
                st.optimizer,
                loss
            );
            p.steps.push(st);
        }
    }
    for p in per.iter_mut() {
        p.probe();
    }
    println!("loadavg at end {}; bench wall {:.1} s\n", loadavg(), wall.elapsed().as_secs_f64());

    println!(
        "| threads | median s/step | min s/step | tokens/s | achieved GFLOP/s | peak 1024³ GFLOP/s | peak 2048×512×1536 GFLOP/s | FMA peak GFLOP/s | MFU vs 1024³ | MFU vs 2048×512×1536 | MFU vs FMA peak |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in &per {
        let tot: Vec<f64> = p.steps.iter().map(|s| s.total).collect();
        let (med, lo) = (median(&tot), min(&tot));
        let achieved = flops_step / med;
        let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        let (pk_sq, pk_md, pk_fma) = (best(&p.probe_square), best(&p.probe_model), best(&p.probe_fma));
        println!(
            "| {} | {:.3} | {:.3} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} % | {:.1} % | {:.1} % |",
            p.threads,
            med,
            lo,
            tokens_per_step / med,
            achieved / 1e9,
            pk_sq / 1e9,
            pk_md / 1e9,
            pk_fma / 1e9,
            100.0 * achieved / pk_sq,
            100.0 * achieved / pk_md,
            100.0 * achieved / pk_fma
        );
    }
    println!("\nPeak = best of the probes before and after the timed steps (each best of {PROBE_REPS}); the samples (GFLOP/s):\n");
    println!("| threads | 1024³ before | 1024³ after | 2048×512×1536 before | 2048×512×1536 after | FMA peak before | FMA peak after |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for p in &per {
        let g = |v: &[f64], i: usize| v.get(i).map_or("-".to_string(), |x| format!("{:.1}", x / 1e9));
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            p.threads,
            g(&p.probe_square, 0),
            g(&p.probe_square, 1),
            g(&p.probe_model, 0),
            g(&p.probe_model, 1),
            g(&p.probe_fma, 0),
            g(&p.probe_fma, 1)
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
