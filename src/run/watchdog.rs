//! The watchdog: a thread per rank that ends the job when the training loop stops making
//! progress. A collective whose partner never arrives (a rank stuck in I/O, a wedged network)
//! would otherwise hold the whole allocation until the batch system's time limit.
//!
//! The loop calls [`beat`] at every point where progress is visible (each micro-step, each
//! collective phase of a step, each tensor of a checkpoint write); with no watchdog running a
//! beat does nothing. When no beat arrives
//! for `[run] watchdog_seconds`, the thread prints which rank stalled and where, and exits the
//! process with [`crate::exit::RUN_FAILED`] without unwinding (`_exit`): the launcher
//! (`mpirun`, `srun --kill-on-bad-exit`) then ends every other rank. It does not call
//! `MPI_Abort`, which MPI only allows from the thread that initialised it. A rank blocked in a
//! collective (waiting for a partner, as `parallel::comm::in_collective` says) allows itself
//! twice the limit, so the rank that stalled outside any collective reports first and the
//! message names it.
//!
//! It also runs the health checks registered with [`add_check`] at every tick — the NCCL
//! communicators' asynchronous errors, which are how NCCL reports a peer that is gone while the
//! rank waits inside it — and ends the job the same way, with the check's message, when one
//! reports a failure.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

struct Shared {
    start: Instant,
    /// Milliseconds since `start` of the last beat.
    last_ms: AtomicU64,
    what: Mutex<String>,
    stop: AtomicBool,
}

/// The running watchdog of this process, if any: what [`beat`] reports to.
static ACTIVE: Mutex<Option<Arc<Shared>>> = Mutex::new(None);

/// A health check: a failure's message, or `None` while all is well.
type CheckFn = Box<dyn Fn() -> Option<String> + Send>;

/// The registered health checks, by number.
static CHECKS: Mutex<Vec<(u64, CheckFn)>> = Mutex::new(Vec::new());

/// A registered health check; dropping it unregisters it (before what it checks goes away).
pub struct Check(u64);

/// Registers `check`, which the watchdog thread runs at every tick while a watchdog runs.
pub fn add_check(check: impl Fn() -> Option<String> + Send + 'static) -> Check {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    if let Ok(mut c) = CHECKS.lock() {
        c.push((id, Box::new(check)));
    }
    Check(id)
}

impl Drop for Check {
    fn drop(&mut self) {
        if let Ok(mut c) = CHECKS.lock() {
            c.retain(|(id, _)| *id != self.0);
        }
    }
}

/// The first registered check that reports a failure, with its message.
fn failed_check() -> Option<String> {
    CHECKS.lock().ok()?.iter().find_map(|(_, check)| check())
}

/// Stops its thread when dropped.
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts watching; `None` when `timeout` is zero (disabled).
    pub fn start(timeout: Duration, rank: usize) -> Option<Watchdog> {
        if timeout.is_zero() {
            return None;
        }
        let shared = Arc::new(Shared {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            what: Mutex::new("start of training".into()),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ndtrain-watchdog".into())
            .spawn(move || {
                // Check a few times per timeout, at least four times a second: a launcher's stop
                // signal leaves about a second before SIGKILL, and the health checks must
                // have their say within it.
                let tick = (timeout / 4).clamp(Duration::from_millis(50), Duration::from_millis(250));
                while !s.stop.load(Ordering::Relaxed) {
                    std::thread::park_timeout(tick);
                    let now = s.start.elapsed().as_millis() as u64;
                    let idle = Duration::from_millis(now.saturating_sub(s.last_ms.load(Ordering::Relaxed)));
                    // A rank waiting in a collective is usually waiting for a rank that is stuck
                    // elsewhere: the stuck rank's own watchdog fires first and names it.
                    let in_collective = crate::parallel::comm::in_collective();
                    let limit = if in_collective { 2 * timeout } else { timeout };
                    if let Some(failure) = failed_check().filter(|_| !s.stop.load(Ordering::Relaxed)) {
                        end_job(&format!("error: rank {rank}: {failure}; ending the job\n"));
                    }
                    if idle > limit && !s.stop.load(Ordering::Relaxed) {
                        let mut what = s.what.lock().map(|w| w.clone()).unwrap_or_default();
                        if in_collective {
                            what.push_str(", waiting in a collective for another rank");
                        }
                        fire(rank, idle, timeout, &what);
                    }
                }
            })
            .expect("the watchdog thread starts");
        if let Ok(mut a) = ACTIVE.lock() {
            *a = Some(shared.clone());
        }
        Some(Watchdog { shared, thread: Some(thread) })
    }
}

/// Progress: `what` says where the loop is now (printed if the next beat never comes).
pub fn beat(what: impl FnOnce() -> String) {
    let Some(s) = ACTIVE.lock().ok().and_then(|a| a.clone()) else { return };
    if let Ok(mut w) = s.what.lock() {
        *w = what();
    }
    s.last_ms.store(s.start.elapsed().as_millis() as u64, Ordering::Relaxed);
}

/// How long since the last beat, while a watchdog runs.
pub fn idle() -> Option<Duration> {
    let s = ACTIVE.lock().ok()?.clone()?;
    let now = s.start.elapsed().as_millis() as u64;
    Some(Duration::from_millis(now.saturating_sub(s.last_ms.load(Ordering::Relaxed))))
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Ok(mut a) = ACTIVE.lock() {
            *a = None;
        }
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

fn fire(rank: usize, idle: Duration, timeout: Duration, what: &str) -> ! {
    end_job(&format!(
        "error: rank {rank}: watchdog: no progress for {:.1} s (limit [run] watchdog_seconds = {}) since: {what}; \
         ending the job (a rank is stuck, e.g. in I/O, or a collective's partner is gone)\n",
        idle.as_secs_f64(),
        timeout.as_secs_f64()
    ))
}

/// Prints `line` as one write and ends the process with the run-failure code.
fn end_job(line: &str) -> ! {
    use std::io::Write;
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
    // SAFETY: _exit ends the process at once; nothing is left half-done that matters more
    // than ending a hung job (checkpoints are only ever published complete).
    unsafe { libc::_exit(crate::exit::RUN_FAILED) }
}
