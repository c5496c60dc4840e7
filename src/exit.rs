//! The process exit codes and the error line, one definition every layer may use (a leaf:
//! imports nothing). `docs/reliability.md` says when each code is used.

/// Success.
pub const OK: i32 = 0;

/// A failure during the run (a rank's error, a panic, an agreed failure, a watchdog timeout).
pub const RUN_FAILED: i32 = 1;

/// Bad input: the deck, the arguments or a file the deck names; nothing was trained.
pub const BAD_INPUT: i32 = 2;

/// The run stopped early to be continued — a stop signal (SIGTERM, SIGUSR1), `[run]
/// max_walltime` or the batch job's time limit, or `[run] stop_after_steps` — after writing a
/// checkpoint, so the job can be requeued (`EX_TEMPFAIL` of sysexits.h).
pub const PREEMPTED: i32 = 75;

/// Prints `error: MESSAGE` to stderr as one write, so the lines of several ranks never
/// interleave. Control characters a message may carry from its input (a NUL in a path) are
/// escaped; line breaks (a `HINT:` line) are kept.
pub fn report(message: &dyn std::fmt::Display) {
    use std::io::Write;
    let text: String = message
        .to_string()
        .chars()
        .map(|c| if c.is_control() && c != '\n' { c.escape_default().to_string() } else { c.to_string() })
        .collect();
    let _ = std::io::stderr().lock().write_all(format!("error: {text}\n").as_bytes());
}
