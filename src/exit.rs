//! The process exit codes, one definition every layer may use (a leaf: imports nothing).
//! `docs/reliability.md` says when each is used.

/// Success.
pub const OK: i32 = 0;

/// A failure during the run (a rank's error, a panic, an agreed failure, a watchdog timeout).
pub const RUN_FAILED: i32 = 1;

/// Bad input: the deck, the arguments or a file the deck names; nothing was trained.
pub const BAD_INPUT: i32 = 2;

/// A stop signal (SIGTERM, SIGUSR1) or `[run] max_walltime` was honoured: a checkpoint was
/// written and the job can be requeued (`EX_TEMPFAIL` of sysexits.h).
pub const PREEMPTED: i32 = 75;
