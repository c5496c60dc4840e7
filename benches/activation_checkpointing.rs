//! What activation checkpointing (`selective` and `full`) costs and saves on one rank:
//! activation bytes held between forward and backward, the peak-RSS growth of a forward +
//! backward, the forward + backward time of one micro-step, and a bit-for-bit check that every
//! mode gives the same loss and the same gradients as `none`.
//!
//! Memory: each mode runs one forward + backward in a fresh child process of this bench
//! (re-executed with `--child-memory MODE`), so the two high-water marks (`VmHWM`) never mix.
//! Time and equality: the parent holds the three models on the same parameters and the same
//! batch and alternates them (none selective full none …), so a load change on this shared
//! machine hits all alike. Knows nothing of the optimiser or of parallelism.
//!
//! `cargo bench --bench activation_checkpointing -- [DECK] [--micro-batch 4] [--seq 512]
//! [--threads 1] [--reps 7] [--warmup 1]`
//!
//! Legend: `B` micro-batch, `S` sequence, `N = B·S`, `D` width, `F` ffn hidden, `V` vocab.

use ndtrain::backend::cpu::set_gemm_threads;
use ndtrain::config::{ActCkpt, Deck};
use ndtrain::data::{open_source, Batch, Loader};
use ndtrain::metrics::median;
use ndtrain::metrics::peak_rss_bytes;
use ndtrain::model::params::ModelParams;
use ndtrain::model::{Model, Tokens};
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Instant;

/// The allocator the `ndtrain` binary runs with (`src/main.rs`), so the bench measures what
/// training does: the GEMM's packing buffers kept for reuse (`backend::cpu::heap`).
#[global_allocator]
static HEAP: ndtrain::backend::cpu::heap::SpareBlockAlloc = ndtrain::backend::cpu::heap::SpareBlockAlloc::new();

type Error = Box<dyn std::error::Error + Send + Sync>;

const USAGE: &str = "usage: cargo bench --bench activation_checkpointing -- [DECK] [--micro-batch B] [--seq S] [--threads T] \
                     [--reps R] [--warmup W]";

/// The field's rule of thumb for full (per-block) recomputation, as a range: 60–80 % less
/// activation memory for 20–30 % more step time.
const RULE_MEMORY_SAVED: (f64, f64) = (60.0, 80.0);
const RULE_TIME_COST: (f64, f64) = (20.0, 30.0);

const MODES: [ActCkpt; 3] = [ActCkpt::None, ActCkpt::Selective, ActCkpt::Full];

struct Args {
    deck: PathBuf,
    micro_batch: usize,
    seq: usize,
    threads: usize,
    reps: usize,
    warmup: usize,
    /// Set in the child processes only: measure this mode's memory and exit.
    child_memory: Option<ActCkpt>,
}

fn mode_name(m: ActCkpt) -> &'static str {
    m.name()
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        deck: PathBuf::from("inputs/bench_small.toml"),
        micro_batch: 4,
        seq: 512,
        threads: 1,
        reps: 7,
        warmup: 1,
        child_memory: None,
    };
    let mut it = std::env::args().skip(1);
    let num = |name: &str, v: Option<String>| -> Result<usize, String> {
        let v = v.ok_or_else(|| format!("{name} needs a value\n{USAGE}"))?;
        v.parse().map_err(|e| format!("{name} {v}: {e}"))
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            // `cargo bench` passes `--bench` to harness-less benches.
            "--bench" => {}
            "--micro-batch" => a.micro_batch = num("--micro-batch", it.next())?,
            "--seq" => a.seq = num("--seq", it.next())?,
            "--threads" => a.threads = num("--threads", it.next())?,
            "--reps" => a.reps = num("--reps", it.next())?,
            "--warmup" => a.warmup = num("--warmup", it.next())?,
            "--child-memory" => {
                let v = it.next();
                a.child_memory = Some(
                    MODES
                        .into_iter()
                        .find(|m| Some(m.name()) == v.as_deref())
                        .ok_or_else(|| format!("--child-memory {v:?}: expected none, selective or full"))?,
                )
            }
            "-h" | "--help" => return Err(USAGE.into()),
            s if s.starts_with('-') => return Err(format!("unknown option {s}\n{USAGE}")),
            s => a.deck = PathBuf::from(s),
        }
    }
    if a.micro_batch == 0 || a.seq == 0 || a.threads == 0 || a.reps == 0 {
        return Err("--micro-batch, --seq, --threads and --reps must be at least 1".into());
    }
    Ok(a)
}

/// The deck with this bench's batch geometry: one micro-step of `B × S` tokens.
fn load_deck(args: &Args) -> Result<Deck, Error> {
    let b = args.micro_batch;
    let overrides: Vec<String> = vec![
        format!("train.micro_batch={b}"),
        format!("train.global_batch={b}"),
        format!("train.seq_len={}", args.seq),
        "train.grad_accum=0".into(),
    ];
    let deck = Deck::from_file(&args.deck, &overrides)?;
    deck.resolve(1)?;
    Ok(deck)
}

/// The first micro-batch of the deck's data.
fn first_batch(deck: &Deck) -> Result<Batch, Error> {
    let (mcfg, tcfg) = (&deck.model, &deck.train);
    let src = open_source(&deck.data, mcfg.vocab_size, deck.run.seed)?;
    let loader = Loader::new(&deck.data, src, tcfg.seq_len, tcfg.micro_batch, tcfg.micro_batch, 1, 0, deck.run.seed)?;
    Ok(loader.micro_batch(0, 0)?)
}

fn setup_threads(t: usize) -> Result<(), Error> {
    rayon::ThreadPoolBuilder::new().num_threads(t).build_global()?;
    set_gemm_threads(t);
    Ok(())
}

/// Resident set size now (`VmRSS`), 0 where `/proc` is absent.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

fn mib(b: f64) -> f64 {
    b / 1048576.0
}

/// Child: parameters, gradients and the batch first (the baseline), then one forward +
/// backward of `mode`; prints one `MEMORY` line for the parent.
fn child_memory(args: &Args, mode: ActCkpt) -> Result<(), Error> {
    setup_threads(args.threads)?;
    let deck = load_deck(args)?;
    let mcfg = &deck.model;
    let batch = first_batch(&deck)?;
    let params = ModelParams::<f32>::init(mcfg, deck.run.seed);
    let mut grads = ModelParams::<f32>::zeros(mcfg);
    grads.fill_zero(); // touch every page, so the baseline holds them
    let positions: Vec<usize> = (0..deck.train.seq_len).collect();
    let tok = Tokens {
        inputs: &batch.inputs,
        targets: &batch.targets,
        positions: &positions,
        batch: deck.train.micro_batch,
        seq: deck.train.seq_len,
    };
    let (rss0, hwm0) = (rss_bytes(), peak_rss_bytes());
    let mut model = Model::<f32>::new(mcfg, mode);
    let loss = model.forward(&params, &tok);
    let hwm_fwd = peak_rss_bytes();
    model.backward(&params, &mut grads, (1.0 / tok.inputs.len() as f64) as f32);
    let hwm_bwd = peak_rss_bytes();
    println!(
        "MEMORY mode={} rss_before={rss0} hwm_before={hwm0} hwm_after_forward={hwm_fwd} hwm_after_backward={hwm_bwd} activation_bytes={} loss_per_token={:.9e}",
        mode_name(mode),
        model.activation_bytes(),
        loss / tok.inputs.len() as f64
    );
    Ok(())
}

/// What a child reported.
struct MemoryReport {
    rss_before: u64,
    hwm_after_forward: u64,
    hwm_after_backward: u64,
    activation_bytes: u64,
}

fn spawn_child(args: &Args, mode: ActCkpt) -> Result<MemoryReport, Error> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe)
        .arg(&args.deck)
        .args(["--micro-batch", &args.micro_batch.to_string(), "--seq", &args.seq.to_string()])
        .args(["--threads", &args.threads.to_string(), "--child-memory", mode_name(mode)])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!("child ({}) failed: {}\n{text}{}", mode_name(mode), out.status, String::from_utf8_lossy(&out.stderr)).into());
    }
    let line = text
        .lines()
        .find(|l| l.starts_with("MEMORY "))
        .ok_or_else(|| format!("child ({}) printed no MEMORY line:\n{text}", mode_name(mode)))?;
    println!("child: {line}");
    let field = |key: &str| -> Result<u64, Error> {
        let v =
            line.split_whitespace().find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')).ok_or_else(|| format!("no {key} in {line}"))?;
        Ok(v.parse()?)
    };
    Ok(MemoryReport {
        rss_before: field("rss_before")?,
        hwm_after_forward: field("hwm_after_forward")?,
        hwm_after_backward: field("hwm_after_backward")?,
        activation_bytes: field("activation_bytes")?,
    })
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" ")).unwrap_or_default()
}

/// One mode's model, its gradients of the last micro-step, and its timings.
struct Run {
    mode: ActCkpt,
    model: Model<f32>,
    grads: ModelParams<f32>,
    loss: f64,
    forward: Vec<f64>,
    backward: Vec<f64>,
}

impl Run {
    /// One micro-step from zeroed gradients; returns (forward s, backward s).
    fn micro_step(&mut self, params: &ModelParams<f32>, tok: &Tokens) -> (f64, f64) {
        self.grads.fill_zero();
        let t0 = Instant::now();
        self.loss = self.model.forward(params, tok);
        let t1 = Instant::now();
        self.model.backward(params, &mut self.grads, (1.0 / tok.inputs.len() as f64) as f32);
        let t2 = Instant::now();
        ((t1 - t0).as_secs_f64(), (t2 - t1).as_secs_f64())
    }
}

/// Index and values of the first gradient element whose bits differ, or `None`.
fn first_difference(a: &ModelParams<f32>, b: &ModelParams<f32>) -> Option<(usize, usize, f32, f32)> {
    for (ti, (ta, tb)) in a.tensors().iter().zip(b.tensors()).enumerate() {
        if let Some(j) = ta.iter().zip(tb.iter()).position(|(x, y)| x.to_bits() != y.to_bits()) {
            return Some((ti, j, ta[j], tb[j]));
        }
    }
    None
}

fn parent(args: &Args) -> Result<(), Error> {
    let deck = load_deck(args)?;
    let (mcfg, tcfg) = (&deck.model, &deck.train);
    let (b, s) = (tcfg.micro_batch, tcfg.seq_len);
    println!("# activation checkpointing bench: {}", args.deck.display());
    println!(
        "model: d_model {} × {} layers, ffn {}, vocab {}; micro-batch B {b} × S {s} = {} tokens; {} threads; \
         {} warm-up + {} timed micro-steps per mode, interleaved; loadavg at start {}",
        mcfg.d_model,
        mcfg.n_layers,
        mcfg.ffn_hidden,
        mcfg.vocab_size,
        b * s,
        args.threads,
        args.warmup,
        args.reps,
        loadavg()
    );
    let wall = Instant::now();

    // Memory, one fresh process per mode.
    let mem: Vec<MemoryReport> = MODES.iter().map(|&m| spawn_child(args, m)).collect::<Result<_, _>>()?;

    // Time and equality, both modes in this process on the same parameters and batch.
    setup_threads(args.threads)?;
    let batch = first_batch(&deck)?;
    let params = ModelParams::<f32>::init(mcfg, deck.run.seed);
    let positions: Vec<usize> = (0..s).collect();
    let tok = Tokens { inputs: &batch.inputs, targets: &batch.targets, positions: &positions, batch: b, seq: s };
    let mut runs: Vec<Run> = MODES
        .iter()
        .map(|&mode| Run {
            mode,
            model: Model::new(mcfg, mode),
            grads: ModelParams::zeros(mcfg),
            loss: f64::NAN,
            forward: vec![],
            backward: vec![],
        })
        .collect();
    let mut mismatches = Vec::new();
    for rep in 0..args.warmup + args.reps {
        let timed = rep >= args.warmup;
        for r in runs.iter_mut() {
            let (f, bw) = r.micro_step(&params, &tok);
            println!(
                "{} {:>2} {}: forward {f:.3} s, backward {bw:.3} s, forward+backward {:.3} s, loss {:.9e}",
                if timed { "rep   " } else { "warmup" },
                if timed { rep - args.warmup + 1 } else { rep + 1 },
                mode_name(r.mode),
                f + bw,
                r.loss / (b * s) as f64
            );
            if timed {
                r.forward.push(f);
                r.backward.push(bw);
            }
        }
        // Bit-for-bit: the same loss and every gradient element, in every repetition.
        let none = &runs[0];
        for other in &runs[1..] {
            let name = mode_name(other.mode);
            if none.loss.to_bits() != other.loss.to_bits() {
                mismatches.push(format!("rep {}: loss none {:e} != {name} {:e}", rep + 1, none.loss, other.loss));
            }
            if let Some((t, j, x, y)) = first_difference(&none.grads, &other.grads) {
                mismatches.push(format!("rep {}: gradient tensor {t} element {j}: none {x:e} != {name} {y:e}", rep + 1));
            }
        }
    }
    let n_grad: usize = runs[0].grads.tensors().iter().map(|t| t.len()).sum();
    println!("loadavg at end {}; bench wall {:.1} s\n", loadavg(), wall.elapsed().as_secs_f64());

    println!("| mode | activation bytes held (MiB) | peak RSS growth, forward (MiB) | peak RSS growth, forward+backward (MiB) | median forward (s) | median backward (s) | median forward+backward (s) | min forward+backward (s) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut fb_med = [0.0; MODES.len()];
    for (i, r) in runs.iter().enumerate() {
        let fb: Vec<f64> = r.forward.iter().zip(&r.backward).map(|(f, b)| f + b).collect();
        fb_med[i] = median(&fb);
        let m = &mem[i];
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.3} | {:.3} | {:.3} | {:.3} |",
            mode_name(r.mode),
            mib(m.activation_bytes as f64),
            mib(m.hwm_after_forward.saturating_sub(m.rss_before) as f64),
            mib(m.hwm_after_backward.saturating_sub(m.rss_before) as f64),
            median(&r.forward),
            median(&r.backward),
            fb_med[i],
            fb.iter().copied().fold(f64::INFINITY, f64::min)
        );
    }
    let saved = |a: u64, b: u64| 100.0 * (1.0 - b as f64 / a as f64);
    // Time cost: the ratio within each repetition (the modes ran back to back, so they saw the
    // same load), then its median; the ratio of the medians and of the minima beside it.
    let fb = |r: &Run| r.forward.iter().zip(&r.backward).map(|(f, b)| f + b).collect::<Vec<f64>>();
    let pct = |x: f64| 100.0 * (x - 1.0);
    let min_of = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let fb_none = fb(&runs[0]);
    println!();
    for (i, r) in runs.iter().enumerate().skip(1) {
        let name = mode_name(r.mode);
        let (n, m) = (&mem[0], &mem[i]);
        println!(
            "memory saved by {name}: {:.1} % of activation bytes held, {:.1} % of peak RSS growth over forward+backward",
            saved(n.activation_bytes, m.activation_bytes),
            saved(n.hwm_after_backward - n.rss_before, m.hwm_after_backward - m.rss_before),
        );
        let fb_mode = fb(r);
        let ratios: Vec<f64> = fb_mode.iter().zip(&fb_none).map(|(f, n)| f / n).collect();
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        println!(
            "time cost of {name}: {:+.1} % forward+backward per micro-step (median of the {} per-repetition ratios, range {:+.1} .. {:+.1} %; \
             ratio of medians {:+.1} %, of minima {:+.1} %)",
            pct(median(&ratios)),
            ratios.len(),
            pct(lo),
            pct(hi),
            pct(fb_med[i] / fb_med[0]),
            pct(min_of(&fb_mode) / min_of(&fb_none)),
        );
    }
    println!(
        "rule of thumb for full: {}–{} % less activation memory for +{}–{} % step time",
        RULE_MEMORY_SAVED.0, RULE_MEMORY_SAVED.1, RULE_TIME_COST.0, RULE_TIME_COST.1
    );
    if mismatches.is_empty() {
        println!(
            "bit-identical: yes; loss {:.9e} and all {n_grad} gradient elements of every mode equal none's bit for bit in each of {} repetitions",
            runs[0].loss / (b * s) as f64,
            args.warmup + args.reps
        );
        Ok(())
    } else {
        for m in &mismatches {
            println!("MISMATCH {m}");
        }
        Err(format!("the modes differ from none in {} case(s)", mismatches.len()).into())
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let res = match args.child_memory {
        Some(mode) => child_memory(&args, mode),
        None => parent(&args),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
