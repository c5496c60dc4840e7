//! The command line: argument parsing (clap), which component each subcommand calls, and the
//! mapping of their outcomes to the process exit code (`crate::exit`, `docs/reliability.md`):
//! bad input (a deck, an argument, a file) is code 2 with one `error:` line; a failure during
//! the work is code 1. `ndtrain train` is an SPMD MPI job started in `run::launch`;
//! `gpu-check` an MPI program in `tools::gpu_check`; the other subcommands run as one process.

use crate::config::RankPlacement;
use crate::exit::{self, BAD_INPUT, OK, RUN_FAILED};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(name = "ndtrain", version, about = "Train Llama-style transformers with N-D parallelism (DP, FSDP, TP, CP, PP) over MPI")]
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
        /// How the launcher deals ranks to nodes: block or cyclic (default: the deck's
        /// `[hardware] rank_placement`).
        #[arg(long, value_parser = ["block", "cyclic"])]
        placement: Option<String>,
        /// Enumerate every valid (pp, dp_replicate, dp_shard, cp, tp) and rank them by the cost model.
        #[arg(long)]
        all_layouts: bool,
        #[arg(long = "set", value_name = "TABLE.KEY=VALUE")]
        set: Vec<String>,
    },
    /// Measure this rank's f32 GEMM rate, its cores' f32 FMA peak and its memory bandwidth on
    /// its threads (the `[hardware]` peak for MFU and planning, and what the silicon can do).
    /// With `--deck`, run under mpirun as training would: every rank measures at once the
    /// deck's GEMMs, its model's step, memory bandwidth and collectives, for `plan`'s time model.
    Probe {
        /// Threads (default: all cores; with `--deck`, training's choice).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Calibrate the planner on this deck's shapes and model (an MPI program).
        #[arg(long)]
        deck: Option<PathBuf>,
        /// Override a deck key: `--set table.key=value` (repeatable, with `--deck`).
        #[arg(long = "set", value_name = "TABLE.KEY=VALUE", requires = "deck")]
        set: Vec<String>,
    },
    /// Prepare token files.
    Data {
        #[command(subcommand)]
        cmd: DataCmd,
    },
    /// Summarise the logs of one or more runs: Markdown/CSV tables and PNG plots.
    Report {
        /// Run directories (each holding deck.toml, metrics.csv and timing/).
        #[arg(required_unless_present = "study", conflicts_with = "study")]
        runs: Vec<PathBuf>,
        /// A study folder of `ndtrain sweep` (its points.csv): every point's median over its
        /// repeats, the spread, and the planner's prediction beside it.
        #[arg(long)]
        study: Option<PathBuf>,
        /// Where to write the report (default: `<first run>/report`, `<study>/report`).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Expand a scaling study into one deck and one job per point and repeat (`docs/hpc.md`);
    /// `sweep submit DIR` queues them and the report after them, `sweep status DIR` tells where
    /// each one is.
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Sweep {
        #[command(subcommand)]
        action: Option<SweepCmd>,
        /// The study (TOML), e.g. inputs/studies/fsdp_strong.toml.
        #[arg(required = true)]
        study: Option<PathBuf>,
        /// Where to write (default: the study's `out`, else out/studies/<name>).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Check this rank's GPU against the CPU: cuBLAS, every NVRTC kernel, a model step, and an
    /// all-reduce over the job (NCCL with a GPU per rank, staged where ranks share one). Run it
    /// under mpirun/srun as training runs. Needs a build with `--features cuda`.
    GpuCheck {
        /// Also build the mesh `dp_replicate,dp_shard,cp,tp` (its product = the ranks) and
        /// check an all-reduce over each of its groups (tp, cp, fsdp, dp_rep, batch).
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
enum SweepCmd {
    /// Submit every job of a written study not yet in its jobs.csv (run them here with the
    /// local launcher), then the report chained after them all (afterany).
    Submit {
        /// The study's folder (what `ndtrain sweep` wrote).
        dir: PathBuf,
    },
    /// One line per point and repeat: not submitted, queued, running, done, failed (exit code),
    /// preempted or requeued.
    Status { dir: PathBuf },
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
        exit::report(&"the start-up CPU feature check did not run");
        return BAD_INPUT;
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { BAD_INPUT } else { OK };
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
        Cmd::Train { deck, set } => crate::run::launch::train(&deck, &set).code(),
        Cmd::Plan { deck, ranks, ranks_per_node, placement, all_layouts, set } => {
            let placement = placement.map(|p| if p == "cyclic" { RankPlacement::Cyclic } else { RankPlacement::Block });
            printed(crate::tools::plan::command(&deck, ranks, ranks_per_node, placement, all_layouts, &set), BAD_INPUT)
        }
        Cmd::Probe { threads, deck: None, .. } => printed(Ok::<_, String>(crate::tools::probe::report(threads)), RUN_FAILED),
        Cmd::Probe { threads, deck: Some(deck), mut set } => {
            if threads > 0 {
                set.push(format!("run.threads={threads}"));
            }
            printed(crate::tools::probe::run_deck(&deck, &set).map(Option::unwrap_or_default), BAD_INPUT)
        }
        Cmd::GpuCheck { layout } => match crate::tools::gpu_check::run(layout) {
            Ok(report) => printed(Ok::<_, String>(report.map(|r| r + "\n").unwrap_or_default()), RUN_FAILED),
            Err(f) => {
                if let Some(m) = f.message {
                    exit::report(&m);
                }
                f.code
            }
        },
        Cmd::Ckpt { cmd } => run_ckpt(cmd),
        Cmd::Sweep { action: Some(SweepCmd::Submit { dir }), .. } => match crate::tools::sweep::submit::submit(&dir) {
            Ok(o) => {
                o.lines.iter().for_each(|l| println!("{l}"));
                if o.failures > 0 {
                    exit::report(&format!("{} of the study's jobs or its report were not queued or failed: see above", o.failures));
                    RUN_FAILED
                } else {
                    OK
                }
            }
            Err(e) => {
                exit::report(&e);
                BAD_INPUT
            }
        },
        Cmd::Sweep { action: Some(SweepCmd::Status { dir }), .. } => {
            printed(crate::tools::sweep::status::status(&dir).map(|rows| status_lines(&rows)), BAD_INPUT)
        }
        Cmd::Sweep { action: None, study, out } => {
            let study = study.expect("clap requires the study without a subcommand");
            printed(crate::tools::sweep::run(&study, out.as_deref()).map(|points| sweep_lines(&points)), BAD_INPUT)
        }
        Cmd::Report { runs, study, out } => {
            let wrote = match study {
                Some(dir) => crate::tools::report::run_study(&dir, &out.unwrap_or_else(|| dir.join("report"))),
                None => crate::tools::report::run(&runs, &out.unwrap_or_else(|| runs[0].join("report"))),
            };
            printed(wrote.map(|files| files.iter().map(|f| format!("wrote {}\n", f.display())).collect::<String>()), RUN_FAILED)
        }
        Cmd::Data { cmd: DataCmd::Prepare { input, output, tokenizer, dataset } } => {
            let args = crate::data::prepare::PrepareArgs { input, output, tokenizer, dataset };
            printed(crate::data::prepare::run(&args).map(|summary| format!("{summary}\n")), RUN_FAILED)
        }
    }
}

/// Prints a command's text and exits 0, or reports its error and exits with `failure`.
fn printed<E: std::fmt::Display>(outcome: Result<String, E>, failure: i32) -> i32 {
    match outcome {
        Ok(text) => {
            print!("{text}");
            OK
        }
        Err(e) => {
            exit::report(&e);
            failure
        }
    }
}

/// What `ndtrain sweep` prints: each job's label, repeat, ranks, deck and script, and how to
/// submit them all.
fn sweep_lines(points: &[crate::tools::sweep::Expanded]) -> String {
    use crate::tools::sweep::shell_word;
    let mut s: String = points
        .iter()
        .map(|p| {
            format!(
                "{:<16} r{:<3} {:>5} ranks{}  {}  {}\n",
                p.label,
                p.repeat,
                p.ranks,
                if p.gpu { " (GPU)" } else { "" },
                p.deck.display(),
                p.job.display()
            )
        })
        .collect();
    if let Some(out) = points.first().and_then(|p| p.run_dir.ancestors().find(|a| a.ends_with("runs"))).and_then(|r| r.parent()) {
        s += &format!("submit (or run) them all and the report after them: ndtrain sweep submit {}\n", shell_word(out));
    }
    s
}

/// What `ndtrain sweep status` prints: one line per point and repeat.
fn status_lines(
    rows: &[(crate::tools::sweep::ManifestRow, Option<crate::tools::sweep::submit::Submitted>, crate::tools::sweep::status::State)],
) -> String {
    rows.iter()
        .map(|(r, job, state)| {
            format!(
                "{:<16} r{:<3} {:>5} ranks  job {:<14} {state}\n",
                r.label,
                r.repeat,
                r.ranks,
                job.as_ref().map_or("-", |j| j.job_id.as_str())
            )
        })
        .collect()
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
        Ok(true) => OK,
        Ok(false) => RUN_FAILED,
        Err(e) => {
            exit::report(&e);
            RUN_FAILED
        }
    }
}
