//! Debug options: environment variables that inject delays and faults so that tests (and
//! operators reproducing a problem) can exercise the failure paths of a real job. None of them
//! is read by a normal run; each is documented in `docs/debugging.md`.

use std::time::Duration;

/// Sleeps this many milliseconds at the end of every training step on every rank: a slow step
/// on a fast machine, so that a signal or a kill sent "mid-run" lands while the run is still
/// running.
pub const STEP_DELAY_ENV: &str = "NDTRAIN_DEBUG_STEP_DELAY_MS";

/// The step delay asked for, if any (unparsable values are an error, not silently ignored).
pub fn step_delay() -> Result<Option<Duration>, String> {
    match std::env::var(STEP_DELAY_ENV) {
        Err(_) => Ok(None),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .map(|ms| Some(Duration::from_millis(ms)))
            .map_err(|_| format!("{STEP_DELAY_ENV}={v:?}: expected a whole number of milliseconds")),
    }
}

/// When writing the checkpoint of this step, world rank 0 aborts the job (`MPI_Abort`) after
/// the parameters are written and before the optimiser moments: a crash in the middle of a
/// checkpoint, which must leave the previous one intact.
pub const ABORT_DURING_CHECKPOINT_ENV: &str = "NDTRAIN_DEBUG_ABORT_DURING_CHECKPOINT";

/// The step whose checkpoint write is to be aborted, if any.
pub fn abort_during_checkpoint() -> Option<u64> {
    std::env::var(ABORT_DURING_CHECKPOINT_ENV).ok().and_then(|v| v.trim().parse().ok())
}
