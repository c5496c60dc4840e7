//! Run control, in one place: the checks every rank makes before the first collective
//! (`preflight`), stop signals (`preempt`), the watchdog that ends a stalled job (`watchdog`) and
//! its check for ranks lost with their node (`liveness`),
//! the debug options that inject faults for tests (`faults`) and the record of what a run was
//! and did (`provenance`: `run.json`). The exit codes they end a run with are `crate::exit`'s;
//! `docs/reliability.md` describes the policy. This file: the error a run returns, and a
//! failure every rank agreed on.

pub mod faults;
pub mod gpus;
pub mod job_limit;
pub mod launch;
pub mod liveness;
pub mod placement;
pub mod preempt;
pub mod preflight;
pub mod provenance;
pub mod stop;
pub mod watchdog;

/// An error that ends a run on this rank (the command line aborts the job with it).
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A failure every rank detected at the same point from the same globally reduced values (a
/// non-finite loss or gradient norm, a checkpoint write that failed somewhere): no rank is left
/// inside a collective, so they all finalise MPI and exit non-zero together. `message` is set
/// on the one rank that reports it, so the job prints it once.
#[derive(Debug)]
pub struct AgreedFailure {
    pub message: Option<String>,
}

impl std::fmt::Display for AgreedFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message.as_deref().unwrap_or("the run failed on every rank (reported by another rank)"))
    }
}

impl std::error::Error for AgreedFailure {}
