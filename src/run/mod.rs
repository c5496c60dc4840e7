//! Run control, in one place: the checks every rank makes before the first collective
//! (`preflight`), stop signals (`preempt`), the watchdog that ends a stalled job (`watchdog`)
//! and the debug options that inject faults for tests (`faults`). The exit codes they end a
//! run with are `crate::exit`'s; `docs/reliability.md` describes the policy.

pub mod faults;
pub mod preempt;
pub mod preflight;
pub mod watchdog;
