//! Preemption: SIGTERM or SIGUSR1 (what Slurm sends before a time limit with `--signal`, and
//! what `scancel` sends) only sets a flag; the training loop agrees on it across ranks at the
//! next step boundary, writes a checkpoint and exits with [`crate::exit::PREEMPTED`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::sync::OnceLock;

static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Installs the handlers (once per process; later calls do nothing).
pub fn install() -> std::io::Result<()> {
    if FLAG.get().is_some() {
        return Ok(());
    }
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGUSR1] {
        signal_hook::flag::register(sig, flag.clone())?;
    }
    let _ = FLAG.set(flag);
    Ok(())
}

/// Whether this process has received a stop signal.
pub fn requested() -> bool {
    FLAG.get().is_some_and(|f| f.load(Ordering::Relaxed))
}
