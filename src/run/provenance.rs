//! `run.json`: what a run was and what it did, as one JSON file beside `deck.toml` for
//! schedulers, regression harnesses and people. Rank 0 writes it when training starts
//! (`"status": "running"`) and rewrites it at the end with the results; each write goes to a
//! temporary name in the same folder and is renamed over the old file, so a reader never sees
//! half of one. The schema is `docs/timing_logs.md`'s.
//!
//! What it records: the program (version, git commit, profile, target, the CPU features and
//! cargo features it was built with, the compiler), the libraries it runs on (MPI's own
//! description, HDF5's version, the CUDA driver's on a GPU run), the job (scheduler and job id,
//! every host with its ranks, threads, device), the deck and the layout; at the end the
//! status, the steps, the losses, speed, MFU, the checkpoints written and the wall time.

use crate::config::{Device, Precision, Resolved};
use crate::parallel::comm;
use crate::run::placement::Place;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The file's name in the run's output folder.
pub const FILE: &str = "run.json";

/// The schema's version: raised when a field changes meaning or goes away (new fields do not).
pub const SCHEMA: u32 = 1;

/// The git commit the binary was built from (`build.rs`: read from `.git`, overridden by
/// `NDTRAIN_GIT_COMMIT` at build time, `unknown` from a source tree without either).
pub const GIT_COMMIT: &str = env!("NDTRAIN_GIT_COMMIT");

/// How a run ended, or that it has not yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Running,
    Finished,
    /// A stop signal or `[run] max_walltime`: a checkpoint was written, exit code 75.
    Preempted,
    /// Every rank stopped on an error (or rank 0 met one); a rank that aborted the job alone
    /// leaves `running` behind.
    Failed,
}

impl Status {
    /// The status an exit code means.
    pub fn of_exit_code(code: i32) -> Status {
        match code {
            0 => Status::Finished,
            crate::exit::PREEMPTED => Status::Preempted,
            _ => Status::Failed,
        }
    }
}

/// The binary itself.
#[derive(Clone, Debug, Serialize)]
pub struct Program {
    pub name: &'static str,
    pub version: &'static str,
    pub git_commit: &'static str,
    /// Cargo's profile: `release` or `debug`.
    pub profile: &'static str,
    /// The Rust target triple.
    pub target_triple: &'static str,
    /// The x86-64 level the build targets and what it has beyond (the banner's).
    pub build_target: String,
    /// The CPU features the build may use.
    pub cpu_features: Vec<&'static str>,
    /// The cargo features it was built with (`cuda`).
    pub cargo_features: Vec<&'static str>,
    pub rustc: &'static str,
}

impl Program {
    pub fn this() -> Program {
        Program {
            name: env!("CARGO_PKG_NAME"),
            version: env!("CARGO_PKG_VERSION"),
            git_commit: GIT_COMMIT,
            profile: env!("NDTRAIN_BUILD_PROFILE"),
            target_triple: env!("NDTRAIN_BUILD_TARGET"),
            build_target: crate::backend::cpu::features::build_target(),
            cpu_features: crate::backend::cpu::features::compiled(),
            cargo_features: if cfg!(feature = "cuda") { vec!["cuda"] } else { vec![] },
            rustc: env!("NDTRAIN_BUILD_RUSTC"),
        }
    }
}

/// The libraries the run loaded, as they describe themselves at run time.
#[derive(Clone, Debug, Serialize)]
pub struct Libraries {
    /// `MPI_Get_library_version`, whole (Open MPI's is one line, MPICH's several).
    pub mpi: String,
    pub hdf5: String,
    /// `cuDriverGetVersion` as `major.minor`, on a `cuda` build training on GPUs; else null.
    pub cuda_driver: Option<String>,
    /// `ncclGetVersion` as `major.minor.patch` where the run loaded NCCL (its collectives ran
    /// over it); else null.
    pub nccl: Option<String>,
}

/// The prefixes of the environment variables that steer the communication libraries, recorded
/// whole: NCCL's own, UCX's (Open MPI's and NCCL's transport on InfiniBand), libfabric's (HPE
/// Slingshot, with the aws-ofi-nccl plugin).
pub const COMMUNICATION_ENV: [&str; 3] = ["NCCL_", "UCX_", "FI_"];

/// The variables of `vars` whose names start with one of [`COMMUNICATION_ENV`], by name.
pub fn communication_env(vars: impl Iterator<Item = (String, String)>) -> BTreeMap<String, String> {
    vars.filter(|(k, _)| COMMUNICATION_ENV.iter().any(|p| k.starts_with(p))).collect()
}

/// Where the job ran.
#[derive(Clone, Debug, Serialize)]
pub struct Job {
    /// `slurm` (`SLURM_JOB_ID` set), `pbs` (`PBS_JOBID` set), else null.
    pub scheduler: Option<&'static str>,
    pub id: Option<String>,
    /// Every host of the job with the world ranks it ran.
    pub hosts: BTreeMap<String, Vec<usize>>,
    pub world_size: usize,
    pub threads_per_rank: usize,
    pub device: Device,
    /// Training on GPUs: each world rank's GPU as the placement table names it (ordinal, UUID,
    /// PCI bus id, NUMA node); else null.
    pub gpus: Option<Vec<String>>,
}

/// The deck: the path it was given as, its `[run] name`, the resolved copy beside this file.
#[derive(Clone, Debug, Serialize)]
pub struct DeckInfo {
    pub path: String,
    pub name: String,
    pub resolved: &'static str,
}

/// The mesh, and the batch it resolves to.
#[derive(Clone, Debug, Serialize)]
pub struct Layout {
    /// The degrees (`pp`, `dp_replicate`, `dp_shard`, `cp`, `tp`).
    #[serde(flatten)]
    pub mesh: crate::config::Layout,
    pub grad_accum: usize,
    pub global_batch: usize,
    pub seq_len: usize,
    pub tokens_per_step: usize,
    pub precision: Precision,
}

/// A checkpoint this invocation wrote.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CheckpointWritten {
    pub step: u64,
    pub path: PathBuf,
}

/// What a run did (steps are 1-based counts of optimiser steps, as in `metrics.csv`). A value
/// that is not finite is written as null.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Results {
    /// Optimiser steps this invocation ran.
    pub steps_run: u64,
    /// The first and the last of them (null when none ran, e.g. a resume at the last step).
    pub first_step: Option<u64>,
    pub last_step: Option<u64>,
    /// Steps taken before this invocation (the checkpoint it resumed from; 0 when fresh).
    pub resumed_from_step: u64,
    pub final_loss: Option<f64>,
    pub final_val_loss: Option<f64>,
    /// Mean training time of a step (no checkpoint, no logging), seconds.
    pub mean_step_s: Option<f64>,
    /// Tokens per second over the whole job: tokens per step / `mean_step_s`.
    pub tokens_per_s: Option<f64>,
    /// `tokens_per_s × flops_per_token / (peak_flops_per_rank × world_size)`.
    pub mfu: Option<f64>,
    pub flops_per_token: f64,
    pub peak_flops_per_rank: f64,
    /// Steps whose update `on_nonfinite = "skip"` skipped.
    pub skipped_steps: u64,
    pub checkpoints_written: usize,
    pub checkpoints: Vec<CheckpointWritten>,
    /// The training loop's wall time (from its first step to its summary), seconds.
    pub train_s: f64,
}

/// The contents of `run.json`.
#[derive(Clone, Debug, Serialize)]
pub struct RunRecord {
    pub schema: u32,
    pub status: Status,
    /// The process's exit code (null while running).
    pub exit_code: Option<i32>,
    /// Why a failed run failed, as rank 0 knows it.
    pub error: Option<String>,
    /// UTC, RFC 3339, to the second.
    pub start_time: String,
    pub end_time: Option<String>,
    /// From the program's start to the end of training, seconds (null while running).
    pub wall_s: Option<f64>,
    pub program: Program,
    pub libraries: Libraries,
    /// The communication libraries' environment at start ([`COMMUNICATION_ENV`]), by name.
    pub environment: BTreeMap<String, String>,
    pub job: Job,
    pub deck: DeckInfo,
    pub layout: Layout,
    /// Null while running and after a failure.
    pub results: Option<Results>,
}

impl RunRecord {
    /// The record of a run about to train on `places` (every rank's, `run::placement`).
    pub fn start(res: &Resolved, places: &[Place], deck_path: &Path, threads: usize) -> RunRecord {
        let mut hosts: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for p in places {
            hosts.entry(p.host.clone()).or_default().push(p.rank);
        }
        let (scheduler, id) = scheduler_job(|k| std::env::var(k).ok());
        let device = res.deck.run.device;
        RunRecord {
            schema: SCHEMA,
            status: Status::Running,
            exit_code: None,
            error: None,
            start_time: rfc3339_utc(SystemTime::now()),
            end_time: None,
            wall_s: None,
            program: Program::this(),
            libraries: Libraries {
                mpi: comm::library_version(),
                hdf5: crate::io::hdf5::library_version(),
                cuda_driver: if device == Device::Cuda { cuda_driver_version() } else { None },
                nccl: None,
            },
            environment: communication_env(std::env::vars()),
            job: Job {
                scheduler,
                id,
                hosts,
                world_size: places.len(),
                threads_per_rank: threads,
                device,
                gpus: (device == Device::Cuda).then(|| places.iter().map(|p| p.gpu.clone()).collect()),
            },
            deck: DeckInfo { path: deck_path.display().to_string(), name: res.deck.run.name.clone(), resolved: "deck.toml" },
            layout: Layout {
                mesh: res.layout,
                grad_accum: res.grad_accum,
                global_batch: res.global_batch,
                seq_len: res.deck.train.seq_len,
                tokens_per_step: res.tokens_per_step,
                precision: res.deck.train.precision,
            },
            results: None,
        }
    }

    /// The console's line under the banner: the commit, the profile and the first line of MPI's
    /// description.
    pub fn banner(&self) -> String {
        let commit: String = self.program.git_commit.chars().take(12).collect();
        let mpi = self.libraries.mpi.lines().next().unwrap_or("").trim();
        format!("commit {commit} ({}) | {mpi}", self.program.profile)
    }

    /// The end of the run: the status its exit code means, the results when there are any, the
    /// error when it failed.
    pub fn finish(&mut self, exit_code: i32, results: Option<Results>, error: Option<String>) {
        self.status = Status::of_exit_code(exit_code);
        self.exit_code = Some(exit_code);
        self.error = error;
        self.end_time = Some(rfc3339_utc(SystemTime::now()));
        self.wall_s = Some(crate::run::preempt::process_start().elapsed().as_secs_f64());
        if self.libraries.cuda_driver.is_none() && self.job.device == Device::Cuda {
            self.libraries.cuda_driver = cuda_driver_version();
        }
        self.libraries.nccl = nccl_version();
        self.results = results;
    }

    /// The record as the file holds it: pretty-printed JSON with a final newline.
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).expect("the record serialises");
        s.push('\n');
        s
    }

    /// Writes `out_dir/run.json` atomically: a temporary name in the same folder, then renamed
    /// over the old file.
    pub fn write(&self, out_dir: &Path) -> std::io::Result<()> {
        write_atomically(&out_dir.join(FILE), self.to_json().as_bytes())
    }
}

/// Writes `path` under a temporary name beside it, flushes it to disk and renames it into
/// place: a reader sees the old file or the new one, never a part.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    match written.and_then(|_| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// The scheduler and job id from the environment a job runs in (`var` reads a variable).
pub fn scheduler_job(var: impl Fn(&str) -> Option<String>) -> (Option<&'static str>, Option<String>) {
    let set = |k: &str| var(k).filter(|v| !v.is_empty());
    if let Some(id) = set("SLURM_JOB_ID") {
        (Some("slurm"), Some(id))
    } else if let Some(id) = set("PBS_JOBID") {
        (Some("pbs"), Some(id))
    } else {
        (None, None)
    }
}

/// `t` as UTC in RFC 3339 to the second: `2025-12-03T09:13:05Z`.
pub fn rfc3339_utc(t: SystemTime) -> String {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, day_s) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", day_s / 3600, day_s % 3600 / 60, day_s % 60)
}

/// The proleptic Gregorian date of `days` after 1970-01-01. The calendar repeats every 400
/// years (146 097 days); counting from 0000-03-01 puts the leap day at the end of each year.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468; // days from 0000-03-01 to 1970-01-01
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097; // day of the era, 0..=146_096
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365; // year of the era, 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the year from March 1st
    let mp = (5 * doy + 2) / 153; // month from March, 0..=11
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The CUDA driver's version (`cuDriverGetVersion`, `12.8`), read from the driver library the
/// GPU backend loads; None where it cannot be loaded or on a build without `cuda`.
#[cfg(feature = "cuda")]
fn cuda_driver_version() -> Option<String> {
    // SAFETY: dlopen/dlsym only load and look up; `cuDriverGetVersion(int*)` writes one int and
    // may be called before cuInit. The handle is released after the call.
    unsafe {
        let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if lib.is_null() {
            return None;
        }
        let sym = libc::dlsym(lib, c"cuDriverGetVersion".as_ptr());
        let mut v: libc::c_int = 0;
        let ok = !sym.is_null() && {
            let get: extern "C" fn(*mut libc::c_int) -> libc::c_int = std::mem::transmute(sym);
            get(&mut v) == 0
        };
        libc::dlclose(lib);
        (ok && v > 0).then(|| format!("{}.{}", v / 1000, v % 1000 / 10))
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_driver_version() -> Option<String> {
    None
}

/// The version of the NCCL the run loaded, if it loaded one.
#[cfg(feature = "cuda")]
fn nccl_version() -> Option<String> {
    crate::backend::cuda::nccl::loaded_version()
}

#[cfg(not(feature = "cuda"))]
fn nccl_version() -> Option<String> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn utc_dates_follow_the_gregorian_calendar() {
        let at = |s: u64| rfc3339_utc(SystemTime::UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(951_868_799), "2000-02-29T23:59:59Z");
        assert_eq!(at(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(at(4_107_542_399), "2100-02-28T23:59:59Z");
        assert_eq!(at(4_107_542_400), "2100-03-01T00:00:00Z");
    }

    #[test]
    fn the_scheduler_is_slurm_then_pbs_else_none() {
        let env =
            |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        assert_eq!(scheduler_job(env(&[("SLURM_JOB_ID", "42"), ("PBS_JOBID", "7.pbs")])), (Some("slurm"), Some("42".into())));
        assert_eq!(scheduler_job(env(&[("PBS_JOBID", "7.pbs")])), (Some("pbs"), Some("7.pbs".into())));
        assert_eq!(scheduler_job(env(&[("SLURM_JOB_ID", "")])), (None, None));
        assert_eq!(scheduler_job(env(&[])), (None, None));
    }

    #[test]
    fn the_communication_libraries_environment_is_recorded_and_nothing_else() {
        let vars = [("NCCL_DEBUG", "INFO"), ("NCCL_IB_HCA", "mlx5_0"), ("UCX_TLS", "rc,sm"), ("FI_PROVIDER", "cxi"), ("HOME", "/root")];
        let got = communication_env(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        assert_eq!(got.keys().map(String::as_str).collect::<Vec<_>>(), ["FI_PROVIDER", "NCCL_DEBUG", "NCCL_IB_HCA", "UCX_TLS"]);
        assert_eq!(got["NCCL_IB_HCA"], "mlx5_0");
    }

    #[test]
    fn statuses_follow_the_exit_codes() {
        assert_eq!(Status::of_exit_code(0), Status::Finished);
        assert_eq!(Status::of_exit_code(crate::exit::PREEMPTED), Status::Preempted);
        assert_eq!(Status::of_exit_code(crate::exit::RUN_FAILED), Status::Failed);
        assert_eq!(serde_json::to_string(&Status::Preempted).unwrap(), "\"preempted\"");
    }

    #[test]
    fn an_atomic_write_replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(FILE);
        write_atomically(&p, b"old").unwrap();
        write_atomically(&p, b"new").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [std::ffi::OsString::from(FILE)]);
    }
}
