//! Which compute a collective must wait for.
//!
//! Every device call of the backend gets a number in queue order, and every buffer remembers
//! the number of the last call that read or wrote it. While a second stream runs collectives
//! (NCCL), the backend records an event on the compute stream after each call, kept in a ring;
//! a collective then makes its stream wait only for the event of the last call that used its
//! buffers — not for everything queued before it — and for nothing when that call finished
//! before the last synchronisation. An event overwritten by a later call's (the ring wrapped)
//! comes later in the queue, so waiting for it is still correct, only later. cudarc's own
//! per-buffer event tracking, which would add an event record and a wait per kernel argument,
//! is off: this ordering and the collectives' own events are explicit.

use cudarc::driver::{sys::CUevent_flags, CudaContext, CudaEvent, CudaStream};
use std::cell::Cell;
use std::sync::Arc;

thread_local! {
    /// The number of the device call in progress, or of the last one.
    static CALL: Cell<u64> = const { Cell::new(0) };
}

/// The number of the call in progress (or the last call): what a buffer used now records.
pub(super) fn current() -> u64 {
    CALL.with(Cell::get)
}

/// Events recorded in the ring: enough that a collective's buffers are rarely older than it.
const RING: usize = 256;

/// The compute stream's call marks.
pub(super) struct Marks {
    /// Empty while no second stream runs (nothing waits for compute then).
    events: Vec<CudaEvent>,
    /// Calls up to this number had finished at the last synchronisation.
    synced: u64,
}

/// What a collective's stream waits for before it starts.
pub(super) enum Wait<'a> {
    /// Nothing: the calls that used its buffers have finished.
    Nothing,
    /// The event after the last call that used its buffers.
    Mark(&'a CudaEvent),
    /// Everything queued on the compute stream (marks are off).
    Everything,
}

impl Marks {
    pub(super) fn new() -> Marks {
        Marks { events: vec![], synced: 0 }
    }

    /// Starts recording a mark after every call (a collective stream exists).
    pub(super) fn start(&mut self, ctx: &Arc<CudaContext>) -> Result<(), String> {
        if self.events.is_empty() {
            self.events = (0..RING)
                .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)))
                .collect::<Result<_, _>>()
                .map_err(|e| format!("creating the compute stream's events: {e:?}"))?;
        }
        Ok(())
    }

    /// Numbers a new call and makes it the current one.
    pub(super) fn begin(&self) -> u64 {
        CALL.with(|c| {
            c.set(c.get() + 1);
            c.get()
        })
    }

    /// Records the mark of call `n`, just queued on `stream`.
    pub(super) fn end(&self, n: u64, stream: &CudaStream) -> Result<(), String> {
        if self.events.is_empty() {
            return Ok(());
        }
        self.events[n as usize % RING].record(stream).map_err(|e| format!("recording a compute mark: {e:?}"))
    }

    /// Every call queued so far has finished (the stream was synchronised).
    pub(super) fn synchronised(&mut self) {
        self.synced = current();
    }

    /// What to wait for before a collective whose buffers call `last_use` used last.
    pub(super) fn wait_for(&self, last_use: u64) -> Wait<'_> {
        if last_use <= self.synced {
            Wait::Nothing
        } else if self.events.is_empty() {
            Wait::Everything
        } else {
            Wait::Mark(&self.events[last_use as usize % RING])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU: the numbering and the decision. Calls finished at the last
    /// synchronisation need no wait; later ones need the whole stream while marks are off.
    #[test]
    fn a_collective_waits_only_for_calls_after_the_last_synchronisation() {
        let mut m = Marks::new();
        let a = m.begin();
        let b = m.begin();
        assert_eq!((b, current()), (a + 1, a + 1));
        m.synchronised();
        assert!(matches!(m.wait_for(a), Wait::Nothing));
        assert!(matches!(m.wait_for(b), Wait::Nothing));
        let c = m.begin();
        assert!(matches!(m.wait_for(c), Wait::Everything));
    }
}
