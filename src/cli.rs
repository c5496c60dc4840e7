//! The command line: argument parsing (clap) and the subcommands' top level.
//!
//! Stage one parses arguments; stage two turns them into a resolved deck and calls the
//! component that does the work. Owns the exit policy: an error found before any
//! communication (a bad deck, which every rank sees alike) ends every rank with a one-line
//! message and exit code 2; an error after the mesh exists may be one rank's alone, so it
//! ends the whole job with `MPI_Abort`.

use crate::backend::cpu::{probe, Cpu};
use crate::config::{Deck, Device, Resolved};
use crate::exit::{BAD_INPUT as EXIT_BAD_INPUT, PREEMPTED as EXIT_PREEMPTED, RUN_FAILED as EXIT_RUN_FAILED};
use crate::metrics::set_root;
use crate::parallel::collective::{MeshCollectives, StagedMesh};
use crate::parallel::comm::{self, Runtime};
use crate::parallel::mesh::Mesh;
use crate::say;
use crate::train::{Error, Peak, RunSummary};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(name = "ndtrain", version, about = "Train Llama-style transformers with N-D parallelism (DP, FSDP, TP, CP) over MPI")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Train the model an input deck describes.
    Train {
        /// The input deck (TOML).
        deck: PathBuf,
        /// Override a deck key: `--set table.key=value` (repeatable).
        #[arg(long = "set", value_name = "TABLE.KEY=VALUE")]
        set: Vec<String>,
    },
    /// Validate a deck for a world size and predict its memory, communication and FLOPs per
    /// rank, without training (or rank every layout of the world with `--all-layouts`).
    Plan {
        deck: PathBuf,
        /// Ranks the job will have.
        #[arg(long, default_value_t = 1)]
        ranks: usize,
        /// Ranks per node (default: the deck's `[hardware] ranks_per_node`).
        #[arg(long)]
        ranks_per_node: Option<usize>,
        /// Enumerate every valid (dp_replicate, dp_shard, cp, tp) and rank them by the cost model.
        #[arg(long)]
        all_layouts: bool,
        #[arg(long = "set", value_name = "TABLE.KEY=VALUE")]
        set: Vec<String>,
    },
    /// Measure this rank's f32 GEMM rate, its cores' f32 FMA peak and its memory bandwidth on
    /// its threads (the `[hardware]` peak for MFU and planning, and what the silicon can do).
    Probe {
        /// Threads (default: all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
    },
    /// Prepare token files.
    Data {
        #[command(subcommand)]
        cmd: DataCmd,
    },
    /// Summarise the logs of one or more runs: Markdown/CSV tables and PNG plots.
    Report {
        /// Run directories (each holding deck.toml, metrics.csv and timing/).
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        /// Where to write the report (default: `<first run>/report`).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Expand a scaling study into one deck and one job script per point (`docs/hpc.md`).
    Sweep {
        /// The study (TOML), e.g. inputs/studies/fsdp_strong.toml.
        study: PathBuf,
        /// Where to write (default: the study's `out`, else out/studies/<name>).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Check this rank's GPU against the CPU: cuBLAS, every NVRTC kernel, and an NCCL
    /// all-reduce over the job (run it under mpirun/srun with one rank per GPU). Needs a build
    /// with `--features cuda`.
    GpuCheck {
        /// Also build the mesh `dp_replicate,dp_shard,cp,tp` (its product = the ranks) and
        /// check one NCCL communicator per group of it (tp, cp, fsdp, dp_rep, batch).
        #[arg(long, value_name = "R,S,C,T")]
        layout: Option<String>,
    },
    /// Inspect, verify or convert a checkpoint (one process, no MPI job needed).
    Ckpt {
        #[command(subcommand)]
        cmd: CkptCmd,
    },
}

#[derive(Subcommand, Debug)]
enum CkptCmd {
    /// Print the metadata and every tensor with shape and checksum, and verify them.
    Inspect { file: PathBuf },
    /// Recompute every tensor's checksum; exit 0 if all match, 1 naming the corrupt ones.
    Verify { file: PathBuf },
    /// Write the parameters as a Hugging Face folder (config.json + model.safetensors).
    Export {
        file: PathBuf,
        /// The folder to write.
        #[arg(long)]
        hf: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum DataCmd {
    /// Tokenize a text file into an HDF5 (`.h5`) or llm.c (`.bin`) token file.
    Prepare {
        input: PathBuf,
        #[arg(short, long)]
        output: PathBuf,
        /// A Hugging Face `tokenizer.json`; without it, bytes are tokens (vocabulary 256).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// HDF5 dataset name.
        #[arg(long, default_value = "tokens")]
        dataset: String,
    },
}

/// Runs the program; returns the process exit code.
pub fn main() -> i32 {
    // A binary built for a newer CPU never gets here: the check before `main` ends it with one
    // line (`backend::cpu::features`). Asking for its verdict keeps it linked in.
    if !crate::backend::cpu::features::check_passed() {
        report_error(&"the start-up CPU feature check did not run");
        return EXIT_BAD_INPUT;
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_BAD_INPUT } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    if !matches!(cli.cmd, Cmd::Train { .. }) {
        // The one-process tools end quietly when their reader goes away (`ndtrain plan … | head`),
        // as Unix tools do, instead of panicking on a closed stdout. Ranks of a training job keep
        // Rust's default (SIGPIPE ignored) so that a closed pipe is an error they report.
        // SAFETY: resetting a signal's disposition to its default before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match cli.cmd {
        Cmd::Train { deck, set } => run_train(deck, set),
        Cmd::Plan { deck, ranks, ranks_per_node, all_layouts, set } => run_plan(deck, ranks, ranks_per_node, all_layouts, set),
        Cmd::Probe { threads } => run_probe(threads),
        Cmd::GpuCheck { layout } => run_gpu_check(layout),
        Cmd::Ckpt { cmd } => run_ckpt(cmd),
        Cmd::Sweep { study, out } => match crate::tools::sweep::run(&study, out.as_deref()) {
            Ok(points) => {
                for p in &points {
                    println!("{:<16} {:>5} ranks  {}  {}", p.label, p.ranks, p.deck.display(), p.job.display());
                }
                if let Some(dir) = points.first().and_then(|p| p.dir.parent()) {
                    println!("run or submit them all: {}/run_all.sh; then {}/report.sh", dir.display(), dir.display());
                }
                0
            }
            Err(e) => {
                report_error(&e);
                EXIT_BAD_INPUT
            }
        },
        Cmd::Report { runs, out } => {
            let out = out.unwrap_or_else(|| runs[0].join("report"));
            match crate::tools::report::run(&runs, &out) {
                Ok(files) => {
                    for f in files {
                        println!("wrote {}", f.display());
                    }
                    0
                }
                Err(e) => {
                    report_error(&e);
                    EXIT_RUN_FAILED
                }
            }
        }
        Cmd::Data { cmd: DataCmd::Prepare { input, output, tokenizer, dataset } } => {
            let args = crate::data::prepare::PrepareArgs { input, output, tokenizer, dataset };
            match crate::data::prepare::run(&args) {
                Ok(summary) => {
                    println!("{summary}");
                    0
                }
                Err(e) => {
                    report_error(&e);
                    EXIT_RUN_FAILED
                }
            }
        }
    }
}

fn run_ckpt(cmd: CkptCmd) -> i32 {
    use crate::io::checkpoint::tools;
    let result = match cmd {
        CkptCmd::Inspect { file } => tools::inspect(&file).map_err(|e| e.to_string()).map(|report| {
            print!("{report}");
            !report.contains("INVALID")
        }),
        CkptCmd::Verify { file } => tools::verify(&file).map_err(|e| e.to_string()).map(|n| {
            println!("{}: valid ({n} tensors, every checksum matches)", file.display());
            true
        }),
        CkptCmd::Export { file, hf } => tools::export_hf(&file, &hf).map(|_| {
            println!("exported the parameters of {} to {} (config.json + model.safetensors)", file.display(), hf.display());
            true
        }),
    };
    match result {
        Ok(true) => 0,
        Ok(false) => EXIT_RUN_FAILED,
        Err(e) => {
            report_error(&e);
            EXIT_RUN_FAILED
        }
    }
}

fn run_plan(deck: PathBuf, ranks: usize, ranks_per_node: Option<usize>, all_layouts: bool, set: Vec<String>) -> i32 {
    let parsed = match Deck::from_file(&deck, &set) {
        Ok(d) => d,
        Err(e) => {
            report_error(&e);
            return EXIT_BAD_INPUT;
        }
    };
    let mut hw = parsed.hardware.clone();
    if let Some(r) = ranks_per_node {
        hw.ranks_per_node = r.max(1);
    }
    let peak = if hw.peak_flops_per_rank > 0.0 { hw.peak_flops_per_rank } else { probe::gemm_flops() };
    if all_layouts {
        if let Err(e) = parsed.validate() {
            report_error(&e);
            return EXIT_BAD_INPUT;
        }
        let (ranked, refused) = crate::tools::plan::rank_layouts(&parsed, ranks, &hw, peak);
        if ranked.is_empty() {
            report_error(&format!("no layout of {ranks} ranks is valid for deck {} ({refused} refused)", deck.display()));
            return EXIT_BAD_INPUT;
        }
        print!("{}", crate::tools::plan::describe_ranking(&ranked, refused, &hw, peak));
        return 0;
    }
    let res = match parsed.resolve(ranks) {
        Ok(r) => r,
        Err(e) => {
            report_error(&e);
            return EXIT_BAD_INPUT;
        }
    };
    let m = &res.deck.model;
    let n = crate::model::params::param_specs(m).iter().map(|s| s.numel()).sum::<usize>();
    println!("deck {} is valid for {ranks} ranks", deck.display());
    for line in &res.summary {
        println!("{line}");
    }
    println!("parameters: {n} ({} in f32; with gradients and AdamW moments {})", plan_bytes(n * 4), plan_bytes(n * 16));
    let p = crate::tools::plan::plan(&res);
    print!("{}", crate::tools::plan::describe(&p, &res, &hw));
    let c = crate::tools::plan::cost(&p, &res.deck, &hw, peak);
    println!(
        "
cost model: {:.3} s compute + {:.3} s communication = {:.3} s per step, {:.0} tokens/s (peak {:.3e} FLOP/s per rank{})",
        c.compute_s,
        c.step_s - c.compute_s,
        c.step_s,
        c.tokens_per_s,
        peak,
        if hw.peak_flops_per_rank > 0.0 { ", [hardware]" } else { ", measured here by the GEMM probe" }
    );
    0
}

fn plan_bytes(b: usize) -> String {
    crate::metrics::fmt_bytes(b as f64)
}

#[cfg(not(feature = "cuda"))]
fn run_gpu_check(_layout: Option<String>) -> i32 {
    report_error(&"this ndtrain was built without the `cuda` feature: rebuild with `cargo build --release --features cuda`");
    EXIT_BAD_INPUT
}

/// Every rank opens the GPU of its node-local rank and checks it; rank 0 prints each rank's
/// lines in order. Exit 0 only if every check on every rank passed.
#[cfg(feature = "cuda")]
fn run_gpu_check(layout: Option<String>) -> i32 {
    let rt = Runtime::init();
    let world = rt.world();
    // A bad layout is bad input: every rank sees the same string and stops before any GPU work.
    let mesh = match layout.map(|l| crate::backend::cuda::check::parse_layout(&l, world.size())).transpose() {
        Ok(l) => l.map(|l| Mesh::new(rt.world(), l)),
        Err(e) => {
            if world.rank() == 0 {
                report_error(&e);
            }
            rt.finalize_and_exit(EXIT_BAD_INPUT);
        }
    };
    let node = world.split_shared();
    let opened = crate::backend::cuda::backend::GpuBackend::open(node.rank(), crate::backend::Precision::Fp32);
    let local: Result<Vec<String>, String> = opened.and_then(|be| {
        use crate::backend::Backend;
        let mut lines = vec![format!("rank {} (node rank {}): GPU {}", world.rank(), node.rank(), be.describe())];
        let mut checks = crate::backend::cuda::check::check_backend(&be);
        checks.push(crate::backend::cuda::check::check_nccl(&be, &world)?);
        for g in mesh.as_ref().map(|m| m.groups().to_vec()).unwrap_or_default() {
            checks.push(crate::backend::cuda::check::check_nccl(&be, g)?);
        }
        let mut failed = 0;
        for c in &checks {
            failed += !c.ok() as usize;
            let verdict = if c.ok() { "ok" } else { "FAILED" };
            lines.push(format!("  {:<64} relative error {:.2e} (tolerance {:.0e})  {verdict}", c.what, c.rel_err, c.tol));
        }
        if failed > 0 {
            return Err(format!("{failed} GPU check(s) failed:\n{}", lines.join("\n")));
        }
        Ok(lines)
    });
    let outcome = world.agree(local.map(|l| l.join("\n")));
    let mut text = outcome.as_ref().map(|t| t.clone().into_bytes()).unwrap_or_default();
    let mut all = vec![];
    for r in 0..world.size() {
        let mut mine = if r == world.rank() { text.clone() } else { vec![] };
        world.broadcast_bytes(r, &mut mine);
        all.push(String::from_utf8_lossy(&mine).to_string());
    }
    text.clear();
    let code = match &outcome {
        Ok(_) => {
            if world.rank() == 0 {
                println!("{}\nevery GPU check passed on {} rank(s)", all.join("\n"), world.size());
            }
            0
        }
        Err(e) => {
            if world.rank() == 0 {
                report_error(e);
            }
            EXIT_RUN_FAILED
        }
    };
    drop(node);
    drop(world);
    rt.finalize_and_exit(code)
}

fn run_probe(threads: usize) -> i32 {
    let threads = if threads > 0 { threads } else { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) };
    crate::backend::cpu::use_threads(threads);
    let flops = probe::gemm_flops();
    let fma = probe::fma_peak_of(probe::FmaKernel::detect(), threads, 20, std::time::Duration::from_millis(20));
    let bw = probe::memory_bandwidth();
    println!("f32 GEMM (1024³, best of 4) on {threads} thread(s): {:.3e} FLOP/s", flops);
    println!(
        "f32 FMA peak ({}, {}-bit, best of 20 × 20 ms) on {} thread(s): {:.3e} FLOP/s",
        fma.kernel.name(),
        fma.width_bits,
        fma.threads,
        fma.flops
    );
    println!("GEMM / FMA peak: {:.3} (the GEMM's efficiency on this machine)", flops / fma.flops);
    println!("memory bandwidth (triad a = b + s·c over 3 × 64 MiB, best of 5) on {threads} thread(s): {:.3e} bytes/s", bw);
    println!("\n[hardware]\npeak_flops_per_rank = {flops:.4e}");
    println!("# MFU against the silicon instead: peak_flops_per_rank = {:.4e} (the FMA peak; docs/model.md)", fma.flops);
    0
}

fn run_train(deck_path: PathBuf, set: Vec<String>) -> i32 {
    // The clock of `[run] max_walltime` starts now.
    crate::run::preempt::process_start();
    crate::backend::cpu::heap::fix_mmap_threshold();
    let rt = Runtime::init();
    let world = rt.world();
    set_root(world.rank() == 0);
    // Each rank parses the deck itself; a rank that cannot read it (a path one node does not
    // see) must not leave the others waiting, so the verdict is agreed like the checks below.
    let parsed = Deck::from_file(&deck_path, &set).and_then(|d| d.resolve(world.size()));
    let cuda_missing = matches!(&parsed, Ok(r) if r.deck.run.device == Device::Cuda && !cfg!(feature = "cuda"));
    let verdict = match &parsed {
        Err(e) => Err(e.to_string()),
        Ok(_) if cuda_missing => Err("[run] device = \"cuda\", but this ndtrain was built without the `cuda` feature: \
                                      rebuild with `cargo build --release --features cuda`"
            .to_string()),
        Ok(_) => Ok(()),
    };
    let res = match (bad_input_agreed(&world, verdict), parsed) {
        (false, Ok(r)) => r,
        _ => {
            drop(world);
            rt.finalize_and_exit(EXIT_BAD_INPUT);
        }
    };
    let out_dir = res.deck.run.out_dir();
    // The checks every rank can make before the first collective of training (output folders,
    // data, checkpoint, init_from): if any rank fails one, every rank stops here with code 2.
    let verdict = crate::run::preflight::check(&res, world.rank(), &out_dir);
    if bad_input_agreed(&world, verdict) {
        drop(world);
        rt.finalize_and_exit(EXIT_BAD_INPUT);
    }
    // Every rank gets rank 0's answer, so all take the same branch.
    let job_end_line = match res.deck.run.stop_before_job_end.then(|| job_end(&world)).transpose() {
        Ok(line) => line,
        Err(e) => {
            bad_input_agreed(&world, Err(e));
            drop(world);
            rt.finalize_and_exit(EXIT_BAD_INPUT);
        }
    };
    let mesh = Mesh::new(world, res.layout);
    // What only the job's devices can tell (NCCL needs a GPU per rank): bad input, agreed.
    let verdict = device_checks(&res, &mesh);
    if bad_input_agreed(&mesh.world, verdict) {
        drop(mesh);
        rt.finalize_and_exit(EXIT_BAD_INPUT);
    }
    let (threads, places) = place_rank(&res, &mesh);
    // run.json: what this run is, written by rank 0 before training and rewritten with the
    // outcome at the end. A file that cannot be written is a warning.
    let mut record = crate::run::provenance::RunRecord::start(&res, &places, &deck_path, threads);

    say!(
        "ndtrain {} ({}) | {} ranks × {threads} threads | deck {}",
        env!("CARGO_PKG_VERSION"),
        crate::backend::cpu::features::build_target(),
        mesh.world.size(),
        deck_path.display()
    );
    say!("{}", record.banner());
    let placement = crate::run::placement::table(&places, res.deck.run.threads == 0);
    for line in placement.iter().chain(&res.summary).chain(&job_end_line) {
        say!("{line}");
    }
    let deck_text = format!(
        "# Resolved by ndtrain {} for {} ranks: layout pp={} dp_replicate={} dp_shard={} cp={} tp={}, grad_accum={}, global_batch={}, peak lr={:e}\n{}",
        env!("CARGO_PKG_VERSION"),
        mesh.world.size(),
        res.layout.pp,
        res.layout.dp_replicate,
        res.layout.dp_shard,
        res.layout.cp,
        res.layout.tp,
        res.grad_accum,
        res.global_batch,
        res.lr,
        res.deck.to_toml()
    );
    say!("--- resolved deck ---\n{}---", deck_text);
    if mesh.world.rank() == 0 {
        if let Err(e) = std::fs::create_dir_all(&out_dir).and_then(|_| std::fs::write(out_dir.join("deck.toml"), &deck_text)) {
            report_error(&format!("rank 0: cannot write to {}: {e}", out_dir.display()));
            comm::abort(EXIT_RUN_FAILED);
        }
    }
    mesh.world.barrier();
    let save = |record: &crate::run::provenance::RunRecord| {
        if mesh.world.rank() == 0 {
            if let Err(e) = record.write(&out_dir) {
                eprintln!("warning: rank 0: cannot write {}: {e}", out_dir.join(crate::run::provenance::FILE).display());
            }
        }
    };
    save(&record);
    match train_on_device(&res, &mesh, &out_dir) {
        Ok(summary) => {
            let code = if summary.preempted { EXIT_PREEMPTED } else { 0 };
            record.finish(code, Some(summary.results()), None);
            save(&record);
            drop(mesh);
            rt.finalize_and_exit(code)
        }
        Err(e) => match e.downcast::<crate::train::AgreedFailure>() {
            // Every rank stopped at the same point: finalise together, report once.
            Ok(agreed) => {
                if let Some(m) = &agreed.message {
                    report_error(m);
                }
                record.finish(EXIT_RUN_FAILED, None, Some(agreed.to_string()));
                save(&record);
                drop(mesh);
                rt.finalize_and_exit(EXIT_RUN_FAILED)
            }
            Err(e) => {
                let message = format!("rank {}: {e}", mesh.world.rank());
                report_error(&message);
                record.finish(EXIT_RUN_FAILED, None, Some(message));
                save(&record);
                comm::abort(EXIT_RUN_FAILED)
            }
        },
    }
}

/// `[run] stop_before_job_end`: rank 0 asks the scheduler how long the job has left (one query
/// per job, not per rank) and every rank stops before that, counted from its own start.
/// Returns the console line that says so.
fn job_end(world: &comm::Group) -> Result<String, String> {
    use crate::run::{job_limit, preempt};
    let mut answer = match world.rank() {
        0 => match job_limit::seconds_left() {
            Ok(Some((secs, source))) => format!("{secs}\t{source}"),
            Ok(None) => "none".to_string(),
            Err(e) => format!("error\t{e}"),
        },
        _ => String::new(),
    }
    .into_bytes();
    world.broadcast_bytes(0, &mut answer);
    let answer = String::from_utf8_lossy(&answer).into_owned();
    match answer.split_once('\t') {
        Some(("error", e)) => Err(e.to_string()),
        Some((secs, source)) => {
            let secs: f64 = secs.parse().map_err(|_| format!("the scheduler's time left {secs:?} is not a number"))?;
            let at = crate::run::preempt::process_start().elapsed().as_secs_f64() + secs;
            preempt::set_job_end(at);
            Ok(format!(
                "walltime: {source}: {} left; the run stops with a checkpoint before it ([run] stop_before_job_end)",
                crate::metrics::fmt_duration(secs)
            ))
        }
        None => Ok("walltime: the batch job has no time limit ([run] stop_before_job_end has nothing to stop before)".into()),
    }
}

/// Starts this rank's threads on the CPUs of its affinity mask (shared with the node's ranks
/// that have the same mask); returns their number and every rank's place.
fn place_rank(res: &Resolved, mesh: &Mesh) -> (usize, Vec<crate::run::placement::Place>) {
    use crate::run::placement;
    let cpus = placement::affinity();
    let requested = res.deck.run.threads;
    let threads = placement::threads_on_node(&mesh.node, requested, &cpus);
    crate::backend::cpu::use_threads(threads);
    let gpu = match res.deck.run.device {
        Device::Cpu => "none".to_string(),
        #[cfg(feature = "cuda")]
        Device::Cuda => crate::backend::cuda::device_count()
            .ok()
            .filter(|&n| n > 0)
            .map_or_else(|| "unknown".into(), |n| (mesh.node.rank() % n).to_string()),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => "unknown".to_string(),
    };
    let mine =
        placement::Place { host: placement::hostname(), rank: mesh.world.rank(), cpus, threads, gpu, node_cpus: placement::node_cpus() };
    (threads, placement::gather(&mesh.world, &mine))
}

/// The rate MFU is stated against: the deck's `[hardware] peak_flops_per_rank`, else `probe`.
fn peak(res: &Resolved, probe: impl FnOnce() -> Result<(f64, String), Error>) -> Result<Peak, Error> {
    let stated = res.deck.hardware.peak_flops_per_rank;
    if stated > 0.0 {
        return Ok(Peak { flops: stated, source: "[hardware] peak_flops_per_rank".into() });
    }
    let (flops, source) = probe()?;
    Ok(Peak { flops, source })
}

/// Trains on the deck's `[run] device`: the host (MPI collectives on host memory), or the
/// rank's GPU. Under the debug option `NDTRAIN_DEBUG_DEVICE_PATH` the host runs the device's
/// path: its buffers treated as device memory, the collectives staged through host copies.
fn train_on_device(res: &Resolved, mesh: &Mesh, out_dir: &Path) -> Result<RunSummary, Error> {
    let precision = res.deck.train.precision;
    match res.deck.run.device {
        Device::Cpu => {
            let peak = peak(res, || Ok((probe::gemm_flops(), "measured f32 GEMM probe".into())))?;
            if crate::run::faults::device_path() {
                let be = Cpu { precision, staged: true };
                let staged = StagedMesh::new(&be, mesh);
                return crate::train::train(be, staged.collectives(), res, mesh, out_dir, peak);
            }
            crate::train::train(Cpu { precision, staged: false }, MeshCollectives::host(mesh), res, mesh, out_dir, peak)
        }
        Device::Cuda => train_on_gpu(res, mesh, out_dir),
    }
}

/// The collectives `[parallel] comm_backend` asks for on GPUs: what this node's GPUs allow.
#[cfg(feature = "cuda")]
fn gpu_collectives(res: &Resolved, mesh: &Mesh) -> Result<crate::config::CommBackend, String> {
    // Where no GPU can be counted, opening one reports why (a run-time error, not bad input).
    let gpus = crate::backend::cuda::device_count().unwrap_or(usize::MAX);
    crate::backend::cuda::nccl::choose(res.deck.parallel.comm_backend, mesh.node.size(), gpus, comm::cuda_aware())
}

/// The checks only the job's devices can answer, made on every rank before training.
fn device_checks(res: &Resolved, mesh: &Mesh) -> Result<(), String> {
    #[cfg(feature = "cuda")]
    if res.deck.run.device == Device::Cuda {
        gpu_collectives(res, mesh)?;
    }
    let _ = (res, mesh);
    Ok(())
}

/// The rank's GPU, the groups' collectives as `[parallel] comm_backend` chooses: NCCL on the
/// GPU's buffers, or staged through host memory.
#[cfg(feature = "cuda")]
fn train_on_gpu(res: &Resolved, mesh: &Mesh, out_dir: &Path) -> Result<RunSummary, Error> {
    use crate::config::CommBackend;
    let precision = res.deck.train.precision;
    let be = crate::backend::cuda::backend::GpuBackend::open(mesh.node.rank(), precision)?;
    let peak = peak(res, || Ok((be.gemm_probe()?, format!("measured {precision:?} GEMM probe on the GPU"))))?;
    be.set_planned_bytes(crate::tools::plan::plan(res).peak_bytes());
    let chosen = gpu_collectives(res, mesh)?;
    say!("collectives on the GPUs: {}", chosen.name());
    match chosen {
        CommBackend::Nccl => {
            let nccl = crate::backend::cuda::nccl::NcclMesh::new(&be, mesh)?;
            crate::train::train(be.clone(), nccl.collectives(), res, mesh, out_dir, peak)
        }
        CommBackend::Mpi => {
            let cuda_aware = crate::backend::cuda::cuda_aware::CudaAwareMesh::new(&be, mesh);
            crate::train::train(be.clone(), cuda_aware.collectives(), res, mesh, out_dir, peak)
        }
        _ => {
            let staged = StagedMesh::new(&be, mesh);
            crate::train::train(be.clone(), staged.collectives(), res, mesh, out_dir, peak)
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn train_on_gpu(_: &Resolved, _: &Mesh, _: &Path) -> Result<RunSummary, Error> {
    Err("[run] device = \"cuda\", but this ndtrain was built without the `cuda` feature: rebuild with `cargo build --release --features cuda`".into())
}

/// Prints `error: MESSAGE` as one write, so the lines of several ranks never interleave.
/// Control characters a message may carry from its input (a NUL in a path) are escaped.
/// Bad input each rank found on its own, agreed by the world: true when any rank failed (then
/// every rank exits with code 2). Each reason is said once: when every rank failed with the
/// same text only rank 0 prints it; otherwise each failing rank prints its own, prefixed with
/// its rank (a file one node cannot see). Every rank takes part, so none is left waiting.
fn bad_input_agreed(world: &comm::Group, verdict: Result<(), String>) -> bool {
    use std::hash::{Hash, Hasher};
    let failed = world.count_true(verdict.is_err());
    if failed == 0 {
        return false;
    }
    // `DefaultHasher::new()` has fixed keys: the same text hashes alike on every rank.
    let hash = verdict.as_ref().err().map_or(0, |e| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        e.hash(&mut h);
        h.finish()
    });
    let mut extremes = [hash, u64::MAX - hash];
    world.agree_max_u64(&mut extremes);
    let agreed = failed == world.size() && extremes[0] == u64::MAX - extremes[1];
    if let Err(e) = verdict {
        if !agreed {
            report_error(&format!("rank {}: {e}", world.rank()));
        } else if world.rank() == 0 {
            report_error(&e);
        }
    }
    true
}

fn report_error(e: &dyn std::fmt::Display) {
    use std::io::Write;
    let text: String =
        e.to_string().chars().map(|c| if c.is_control() && c != '\n' { c.escape_default().to_string() } else { c.to_string() }).collect();
    let line = format!("error: {text}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
