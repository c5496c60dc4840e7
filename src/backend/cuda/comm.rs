//! The device side of collectives: what a collective over NCCL (`super::nccl`) or a CUDA-aware
//! MPI needs of the GPU — a stream for communication, events that order it against the compute
//! stream and time it, and the raw device addresses an MPI library takes. Which collective runs
//! when, over which ranks, and how an NCCL unique id reaches them is `parallel::collective`'s;
//! nothing here knows of MPI.

use super::backend::{DevBuf, GpuBackend};
use super::order::Wait;
use cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use std::ops::Range;
use std::sync::Arc;

/// A stream for collectives, forked from the compute stream of the GPU.
pub struct CommStream(pub(super) Arc<CudaStream>);

/// A point in a stream's work: waited for by another stream, or read for timing.
pub struct Event(CudaEvent);

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

/// The staging buffers' fence: the copies queued before the event have finished.
impl crate::backend::Fence for Event {
    fn done(&self) -> bool {
        self.is_complete()
    }
    fn wait(&self) {
        // A failed wait leaves the fence to the next synchronisation, which reports the failure.
        let _ = self.0.synchronize();
    }
}

impl GpuBackend {
    /// A new stream for collectives on this GPU; from now on the compute stream leaves the
    /// marks a collective waits for (`order`).
    pub fn comm_stream(&self) -> Result<CommStream, String> {
        self.start_marks()?;
        self.gpu().stream.fork().map(CommStream).map_err(driver("creating a communication stream"))
    }

    /// The compute stream waits (on the device; the host does not) for `e`.
    pub fn compute_waits_for(&self, e: &Event) -> Result<(), String> {
        self.gpu().stream.wait(&e.0).map_err(driver("ordering the compute after a collective"))
    }

    /// Runs `f` on the raw device addresses of `send[from]` and of `recv`, after the device
    /// has finished every operation queued so far (an MPI library does not order its transfers
    /// against the GPU's stream).
    ///
    /// # Safety
    /// `f` may read `send[from]` and write `recv` through the addresses, and nothing else; it
    /// must be done with them when it returns.
    pub unsafe fn with_device_addresses<R>(
        &self,
        send: &DevBuf<f32>,
        from: Range<usize>,
        recv: &mut DevBuf<f32>,
        f: impl FnOnce(*const f32, *mut f32) -> R,
    ) -> Result<R, String> {
        self.gpu().synchronize()?;
        let stream = &self.gpu().stream;
        let view = send.get()?.slice(from);
        let (s, _s_done) = view.device_ptr(stream);
        let (r, _r_done) = recv.get_mut()?.device_ptr_mut(stream);
        Ok(f(s as *const f32, r as *mut f32))
    }
}

impl CommStream {
    /// The stream waits for the compute `be` queued up to call `last_use` — the last call that
    /// used a collective's buffers (`GpuBackend::last_use`): it wrote its input, or still reads
    /// what it is about to write — and for no later compute.
    pub fn after(&self, be: &GpuBackend, last_use: u64) -> Result<(), String> {
        let what = driver("ordering the communication stream after the compute");
        be.with_wait(last_use, |wait| match wait {
            Wait::Nothing => Ok(()),
            Wait::Mark(e) => self.0.wait(e).map_err(what),
            Wait::Everything => self.0.join(&be.gpu().stream).map_err(what),
        })
    }

    /// An event recorded now on this stream (timing enabled).
    pub fn record(&self) -> Result<Event, String> {
        self.0.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map(Event).map_err(driver("recording an event"))
    }
}

impl Event {
    /// An event recorded now on `stream`, without timing.
    pub(super) fn record_on(stream: &CudaStream) -> Result<Event, String> {
        stream.record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)).map(Event).map_err(driver("recording an event"))
    }

    /// Whether the work before the event has completed (never blocks).
    pub fn is_complete(&self) -> bool {
        self.0.is_complete()
    }

    /// Seconds from `start` to this event, both completed.
    pub fn seconds_since(&self, start: &Event) -> Result<f64, String> {
        start.0.elapsed_ms(&self.0).map(|ms| f64::from(ms) / 1e3).map_err(driver("reading a collective's time"))
    }
}
