//! The device side of collectives: what a collective over NCCL or a CUDA-aware MPI needs of the
//! GPU — a stream for communication, events that order it against the compute stream and time
//! it, an NCCL communicator's calls on device buffers, and the raw device addresses an MPI
//! library takes. Which collective runs when, over which ranks, and how its unique id reaches
//! them is `parallel::collective`'s; nothing here knows of MPI.

use super::backend::{DevBuf, GpuBackend};
use cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{Comm, Id, ReduceOp};
use std::ops::Range;
use std::sync::Arc;

/// A stream for collectives, forked from the compute stream of the GPU.
pub struct CommStream(Arc<CudaStream>);

/// A point in a stream's work: waited for by another stream, or read for timing.
pub struct Event(CudaEvent);

/// An element-wise reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Max,
}

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

fn nccl(what: &str) -> impl Fn(cudarc::nccl::result::NcclError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

impl GpuBackend {
    /// A new stream for collectives on this GPU.
    pub fn comm_stream(&self) -> Result<CommStream, String> {
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
    /// The stream waits for the compute `be` has enqueued so far (which produced a
    /// collective's input).
    pub fn after_compute(&self, be: &GpuBackend) -> Result<(), String> {
        self.0.join(&be.gpu().stream).map_err(driver("ordering the communication stream after the compute"))
    }

    /// An event recorded now on this stream (timing enabled).
    pub fn record(&self) -> Result<Event, String> {
        self.0.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map(Event).map_err(driver("recording an event"))
    }
}

impl Event {
    /// Whether the work before the event has completed (never blocks).
    pub fn is_complete(&self) -> bool {
        self.0.is_complete()
    }

    /// Seconds from `start` to this event, both completed.
    pub fn seconds_since(&self, start: &Event) -> Result<f64, String> {
        start.0.elapsed_ms(&self.0).map(|ms| f64::from(ms) / 1e3).map_err(driver("reading a collective's time"))
    }
}

/// The bytes of an NCCL unique id, created by one rank and handed to the others.
pub struct NcclId(Id);

impl NcclId {
    /// Bytes in an id.
    pub const BYTES: usize = 128;

    pub fn new() -> Result<NcclId, String> {
        Id::new().map(NcclId).map_err(nccl("ncclGetUniqueId"))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.internal().iter().map(|&c| c as u8).collect()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<NcclId, String> {
        if bytes.len() != Self::BYTES {
            return Err(format!("an NCCL unique id has {} bytes, not {}", Self::BYTES, bytes.len()));
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, &s) in internal.iter_mut().zip(bytes) {
            *d = s as std::ffi::c_char;
        }
        Ok(NcclId(Id::uninit(internal)))
    }
}

/// One NCCL communicator, its collectives on `stream`.
pub struct NcclComm(Comm);

impl NcclComm {
    /// Joins the communicator of `size` ranks that `id` names, as rank `rank` (every rank of
    /// it joins at once: a collective call).
    pub fn join(id: NcclId, rank: usize, size: usize, stream: &CommStream) -> Result<NcclComm, String> {
        Comm::from_rank(stream.0.clone(), rank, size, id.0).map(NcclComm).map_err(nccl("ncclCommInitRank"))
    }

    /// `buf[range]` reduced across the ranks, in place.
    pub fn all_reduce_in_place(&self, buf: &mut DevBuf<f32>, range: Range<usize>, op: Reduce) -> Result<(), String> {
        let op = match op {
            Reduce::Sum => ReduceOp::Sum,
            Reduce::Max => ReduceOp::Max,
        };
        self.0.all_reduce_in_place(&mut buf.get_mut()?.slice_mut(range), &op).map(|_| ()).map_err(nccl("ncclAllReduce"))
    }

    /// `recv` = the sum of every rank's `send`.
    pub fn all_reduce_sum(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) -> Result<(), String> {
        self.0.all_reduce(send.get()?, recv.get_mut()?, &ReduceOp::Sum).map(|_| ()).map_err(nccl("ncclAllReduce"))
    }

    /// `recv` = every rank's `send`, in rank order.
    pub fn all_gather(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) -> Result<(), String> {
        self.0.all_gather(send.get()?, recv.get_mut()?).map(|_| ()).map_err(nccl("ncclAllGather"))
    }

    /// `recv` = this rank's block of the sum of every rank's `send`.
    pub fn reduce_scatter_sum(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) -> Result<(), String> {
        self.0.reduce_scatter(send.get()?, recv.get_mut()?, &ReduceOp::Sum).map(|_| ()).map_err(nccl("ncclReduceScatter"))
    }

    /// Sends `send` to rank `next` while `recv` is received from rank `prev` (one NCCL group,
    /// so neither waits for the other).
    pub fn shift(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>, (next, prev): (usize, usize)) -> Result<(), String> {
        let (send_view, recv_view) = (send.get()?.slice(..), recv.get_mut()?.slice_mut(..));
        let mut g = self.0.group();
        g.send(send_view, next as i32).map_err(nccl("ncclSend"))?;
        g.recv(recv_view, prev as i32).map(|_| ()).map_err(nccl("ncclRecv"))?;
        drop(g);
        Ok(())
    }
}
