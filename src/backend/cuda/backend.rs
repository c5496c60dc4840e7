//! The CUDA backend: [`Backend`] on the rank's GPU. Every operation is one kernel of
//! `kernels.cu` or one cuBLAS call on device buffers, launched on the GPU's stream in order;
//! the host waits only where a value comes back (the loss, the gradient norm). The linear
//! layers' GEMMs run in fp32 or, with `precision = "bf16"`, on bf16 copies of their operands
//! with f32 accumulation (tensor cores); attention's batched GEMMs in fp32 or, under bf16, with
//! TF32 products; everything else stays f32.
//!
//! A failed CUDA call does not end the process here: the backend keeps the first failure
//! (naming the operation), skips every device call after it, and reports it from
//! [`Backend::synchronize`] — where an asynchronous failure of the device surfaces too — so the
//! caller turns it into the run's failure (exit 1, naming the rank). What can fail before the
//! first step — a missing library, no GPU — is an error from [`GpuBackend::open`].
//!
//! The `Backend` implementation is one list of every operation of the boundary, each a few
//! lines over a launch wrapper (`launch`).

use super::attention::{self, AttnDevice, AttnPlan, SCORES_CAP};
use super::comm::Event;
use super::order::{self, Marks};
use super::{Gpu, Operand};
use crate::backend::AttnDims;
use crate::backend::{AdamStep, Backend, Precision};
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::rc::Rc;

/// A device tensor of `len` elements. It has no allocation when its length is 0 (CUDA has no
/// zero-byte buffers) or when its allocation failed (the backend has then recorded the
/// failure and runs no further device call).
pub struct DevBuf<T> {
    slice: Option<CudaSlice<T>>,
    len: usize,
    /// The number of the last device call that read or wrote it (`order`).
    last_use: Cell<u64>,
}

impl<T> Default for DevBuf<T> {
    fn default() -> Self {
        DevBuf { slice: None, len: 0, last_use: Cell::new(0) }
    }
}

impl<T> DevBuf<T> {
    pub(super) fn of(slice: CudaSlice<T>) -> Self {
        DevBuf { len: slice.len(), slice: Some(slice), last_use: Cell::new(order::current()) }
    }
    fn without_memory(len: usize) -> Self {
        DevBuf { slice: None, len, last_use: Cell::new(0) }
    }
    /// The buffer's memory, for the device call in progress (which it records as its last use).
    pub(super) fn get(&self) -> Result<&CudaSlice<T>, String> {
        self.last_use.set(order::current());
        self.slice.as_ref().ok_or_else(|| format!("a GPU buffer of {} elements without memory was used", self.len))
    }
    pub(super) fn get_mut(&mut self) -> Result<&mut CudaSlice<T>, String> {
        self.last_use.set(order::current());
        let len = self.len;
        self.slice.as_mut().ok_or_else(|| format!("a GPU buffer of {len} elements without memory was used"))
    }
    /// The number of the last device call that used the buffer.
    pub fn last_use(&self) -> u64 {
        self.last_use.get()
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Token ids on the device, and for the embedding backward the same ids sorted: the distinct
/// ids, where each one's tokens start in `order`, and the token indices grouped by id (each
/// group ascending, so a row's gradient is summed in token order, as on the CPU).
#[derive(Default)]
pub struct DevIds {
    ids: DevBuf<u32>,
    uniq: DevBuf<u32>,
    starts: DevBuf<i32>,
    order: DevBuf<i32>,
}

/// The rank's GPU as a backend: a cheap handle (clones share the GPU and its scratch; each
/// clone has its own GEMM precision).
#[derive(Clone)]
pub struct GpuBackend {
    shared: Rc<Shared>,
    precision: Precision,
    /// Attention's products on TF32 tensor cores: by default exactly under bf16.
    tf32: Option<bool>,
}

struct Shared {
    gpu: Gpu,
    /// bf16 copies of a GEMM's two operands (grown to the largest seen).
    bf16: RefCell<(DevBuf<u16>, DevBuf<u16>)>,
    /// Attention backward's `rowsum(dO ∘ O)` scratch.
    rowdot: RefCell<DevBuf<f32>>,
    /// Attention's scores (then probabilities) and, in backward, their gradient, for one chunk
    /// of (batch, kv head) groups.
    scores: RefCell<DevBuf<f32>>,
    dscores: RefCell<DevBuf<f32>>,
    /// The gradient norm's per-block partial sums.
    partials: RefCell<DevBuf<f64>>,
    /// RMSNorm's weight gradient per tile of rows (grown to the largest seen).
    dw_partials: RefCell<DevBuf<f32>>,
    /// What `ndtrain plan` predicts this rank holds, for the message of a failed allocation.
    planned_bytes: std::cell::Cell<Option<usize>>,
    /// The first device call that failed, with what it was; no device call runs after it.
    failure: RefCell<Option<String>>,
    /// The compute stream's call marks, which collectives wait for (`order`).
    marks: RefCell<Marks>,
}

/// Blocks of the gradient-norm reduction (a fixed grid: the sum is deterministic).
const SUM_SQ_BLOCKS: usize = 1024;

/// The three GEMMs of a linear layer `y [m, n] = x [m, k] · wᵀ` (`cpu::gemm::linear_*`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Linear {
    /// `y = x · wᵀ`.
    Forward,
    /// `dx [m, k] = dy · w`.
    Input,
    /// `dw [n, k] = dyᵀ · x`.
    Weight,
}

/// The row-major product `(M, N, K)` and operand transposes of each.
pub(crate) fn linear_gemm(which: Linear, m: usize, n: usize, k: usize) -> ((usize, usize, usize), (bool, bool)) {
    match which {
        Linear::Forward => ((m, n, k), (false, true)),
        Linear::Input => ((m, k, n), (false, false)),
        Linear::Weight => ((n, k, m), (true, false)),
    }
}

/// The token indices grouped by id for the embedding backward: the distinct ids ascending,
/// where each one's tokens start in `order` (and a final end), and the token indices, each
/// group ascending (a stable sort), so `embed_bwd` adds a row's tokens in token order.
pub(crate) fn group_ids(ids: &[u32]) -> (Vec<u32>, Vec<i32>, Vec<i32>) {
    let mut order: Vec<i32> = (0..ids.len() as i32).collect();
    order.sort_by_key(|&i| ids[i as usize]);
    let (mut uniq, mut starts) = (Vec::new(), Vec::new());
    for (k, &i) in order.iter().enumerate() {
        let id = ids[i as usize];
        if uniq.last() != Some(&id) {
            uniq.push(id);
            starts.push(k as i32);
        }
    }
    starts.push(order.len() as i32);
    (uniq, starts, order)
}

impl GpuBackend {
    /// Opens visible GPU `ordinal` and compiles the kernels for it.
    pub fn open(ordinal: usize, precision: Precision) -> Result<GpuBackend, String> {
        let gpu = Gpu::open(ordinal)?;
        let partials = RefCell::new(DevBuf::of(gpu.zeros::<f64>(SUM_SQ_BLOCKS)?));
        let shared = Shared {
            gpu,
            bf16: RefCell::new(Default::default()),
            rowdot: RefCell::new(DevBuf::default()),
            scores: RefCell::new(DevBuf::default()),
            dscores: RefCell::new(DevBuf::default()),
            partials,
            dw_partials: RefCell::new(DevBuf::default()),
            planned_bytes: std::cell::Cell::new(None),
            failure: RefCell::new(None),
            marks: RefCell::new(Marks::new()),
        };
        Ok(GpuBackend { shared: Rc::new(shared), precision, tf32: None })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.shared.gpu
    }

    /// Whether the device's buffers come from CUDA's stream-ordered pool (which CUDA IPC, and
    /// so a CUDA-aware MPI between the ranks of a node, cannot map).
    pub fn pool_memory(&self) -> bool {
        super::device::pool_memory(self.gpu())
    }

    /// Runs the device call `call` unless one has failed before; a failure is recorded as
    /// `what` failed (the first one only), and [`Backend::synchronize`] reports it.
    pub fn run(&self, what: &str, call: impl FnOnce() -> Result<(), String>) {
        if self.has_failed() {
            return;
        }
        let marks = self.shared.marks.borrow();
        let n = marks.begin();
        let done = call().and_then(|_| marks.end(n, &self.gpu().stream));
        drop(marks);
        if let Err(e) = done {
            self.record_failure(what, e);
        }
    }

    /// From now on, every device call leaves a mark that a collective on another stream can
    /// wait for (`order`): called when such a stream is created.
    pub fn start_marks(&self) -> Result<(), String> {
        self.shared.marks.borrow_mut().start(self.gpu().stream.context())
    }

    /// The last device call that used any of `bufs`: what a collective on them waits for.
    pub fn last_use(&self, bufs: &[&DevBuf<f32>]) -> u64 {
        bufs.iter().map(|b| b.last_use()).max().unwrap_or(0)
    }

    /// Runs `f` with what a stream must wait for before it uses buffers last used by call
    /// `last_use`.
    pub(super) fn with_wait<R>(&self, last_use: u64, f: impl FnOnce(order::Wait<'_>) -> R) -> R {
        f(self.shared.marks.borrow().wait_for(last_use))
    }

    /// Whether a device call has failed: every later one is skipped.
    pub fn has_failed(&self) -> bool {
        self.shared.failure.borrow().is_some()
    }

    /// Records that `what` failed with `e`, unless an earlier failure is recorded.
    pub fn record_failure(&self, what: &str, e: String) {
        let mut f = self.shared.failure.borrow_mut();
        if f.is_none() {
            *f = Some(format!("GPU {what}: {e}"));
        }
    }

    /// `n` zeros on the device; without memory (a recorded failure) when the allocation fails.
    fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> DevBuf<T> {
        if n == 0 || self.has_failed() {
            return DevBuf::without_memory(n);
        }
        let mut buf = None;
        // An allocation and its zeroing are a call on the stream, like any other.
        self.run("allocation", || {
            let bytes = n * std::mem::size_of::<T>();
            buf = Some(DevBuf::of(self.gpu().zeros::<T>(n).map_err(|e| self.allocation_failure(bytes, &e))?));
            Ok(())
        });
        buf.unwrap_or_else(|| DevBuf::without_memory(n))
    }

    /// What `ndtrain plan` predicts this rank holds (said when an allocation fails).
    pub fn set_planned_bytes(&self, bytes: usize) {
        self.shared.planned_bytes.set(Some(bytes));
    }

    /// The message of a failed allocation: the bytes asked, what the device has, what the plan
    /// predicted.
    fn allocation_failure(&self, bytes: usize, e: &str) -> String {
        let mib = |b: usize| b as f64 / 1048576.0;
        let device = match self.gpu().memory_info() {
            Ok((free, total)) => format!("; the device has {:.1} MiB free of {:.1} MiB", mib(free), mib(total)),
            Err(_) => String::new(),
        };
        let plan =
            self.shared.planned_bytes.get().map_or(String::new(), |p| {
                format!("; `ndtrain plan` predicts {:.1} MiB per rank for this deck (docs/planning.md)", mib(p))
            });
        let what = crate::backend::allocation_purpose().map_or(String::new(), |w| format!(" for {w}"));
        format!("GPU allocation of {:.1} MiB{what} failed: {e}{device}{plan}", mib(bytes))
    }

    fn put<T: DeviceRepr + Copy + ValidAsZeroBits>(&self, dst: &mut DevBuf<T>, host: &[T]) {
        if dst.len() != host.len() {
            *dst = self.alloc(host.len());
        }
        if let Some(d) = dst.slice.as_mut() {
            self.run("copy to the device", || self.gpu().stream.memcpy_htod(host, d).map_err(|e| format!("{e:?}")));
        }
    }

    /// Switches the GEMMs' precision (gpu-check runs both on one opened GPU).
    pub fn set_precision(&mut self, p: Precision) {
        self.precision = p;
    }

    /// Runs attention's products on TF32 tensor cores or not, whatever the precision
    /// (gpu-check compares bf16 GEMMs against the host with attention in exact f32).
    pub fn set_tf32(&mut self, on: bool) {
        self.tf32 = Some(on);
    }

    /// Row-major `c = op(a) · op(b) (+ c)` in the configured precision: f32, or bf16 copies
    /// of both operands.
    #[allow(clippy::too_many_arguments)]
    fn gemm(&self, c: &mut DevBuf<f32>, a: &DevBuf<f32>, b: &DevBuf<f32>, mnk: (usize, usize, usize), trans: (bool, bool), acc: bool) {
        if c.is_empty() {
            return;
        }
        let beta = if acc { 1.0 } else { 0.0 };
        if mnk.2 == 0 {
            if !acc {
                self.run("gemm", || self.gpu().fill(&mut c.get_mut()?.slice_mut(..), 0.0));
            }
            return;
        }
        match self.precision {
            Precision::Fp32 => {
                self.run("sgemm", || self.gpu().gemm(c.get_mut()?, Operand::F32(a.get()?, 0), Operand::F32(b.get()?, 0), mnk, trans, beta))
            }
            Precision::Bf16 => {
                let _for = crate::backend::allocating("bf16 copies of a GEMM's operands", None);
                let mut s = self.shared.bf16.borrow_mut();
                let (sa, sb) = &mut *s;
                for (scratch, x) in [(&mut *sa, a), (&mut *sb, b)] {
                    if scratch.len() < x.len() {
                        *scratch = self.alloc(x.len());
                    }
                }
                self.run("bf16 gemm", || {
                    self.gpu().to_bf16(sa.get_mut()?, a.get()?)?;
                    self.gpu().to_bf16(sb.get_mut()?, b.get()?)?;
                    self.gpu().gemm(c.get_mut()?, Operand::Bf16(sa.get()?, 0), Operand::Bf16(sb.get()?, 0), mnk, trans, beta)
                });
            }
        }
    }

    /// The attention orchestration's view of this GPU.
    fn attn(&self) -> GpuAttn<'_> {
        GpuAttn { be: self, tf32: self.tf32.unwrap_or(self.precision == Precision::Bf16) }
    }

    /// The GEMM rate of this GPU in the configured precision (FLOP/s): a few 8192³ products
    /// after a warm-up, for the MFU line when the deck states no peak.
    pub fn gemm_probe(&self) -> Result<f64, String> {
        let n = 8192;
        let (a, b) = (DevBuf::of(self.gpu().zeros::<f32>(n * n)?), DevBuf::of(self.gpu().zeros::<f32>(n * n)?));
        let mut c = DevBuf::of(self.gpu().zeros::<f32>(n * n)?);
        self.gemm(&mut c, &a, &b, (n, n, n), (false, false), false);
        self.synchronize()?;
        let reps = 5;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            self.gemm(&mut c, &a, &b, (n, n, n), (false, false), false);
        }
        self.synchronize()?;
        Ok(reps as f64 * 2.0 * (n as f64).powi(3) / t.elapsed().as_secs_f64())
    }
}

impl Backend<f32> for GpuBackend {
    type Buf = DevBuf<f32>;
    type Ids = DevIds;
    type Fence = Event;
    type Pos = DevBuf<i32>;

    /// The first recorded failure, else the device's own (an asynchronous failure surfaces at
    /// the synchronisation).
    fn synchronize(&self) -> Result<(), String> {
        if let Some(e) = self.shared.failure.borrow().clone() {
            return Err(e);
        }
        self.gpu().synchronize()?;
        self.shared.marks.borrow_mut().synchronised();
        Ok(())
    }

    /// An event after everything queued so far on the compute stream.
    fn fence(&self) -> Option<Event> {
        let mut fence = None;
        self.run("recording a fence", || {
            fence = Some(Event::record_on(&self.gpu().stream)?);
            Ok(())
        });
        fence
    }

    fn describe(&self) -> String {
        {
            let g = self.gpu();
            format!("cuda:{} {} (sm_{}{})", g.ordinal, g.name, g.cc.0, g.cc.1)
        }
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn device_memory(&self) -> Option<(u64, u64)> {
        self.gpu().pool_memory().ok()
    }

    fn zeros(&self, n: usize) -> DevBuf<f32> {
        self.alloc(n)
    }

    fn len(&self, b: &DevBuf<f32>) -> usize {
        b.len()
    }

    fn upload(&self, dst: &mut DevBuf<f32>, host: &[f32]) {
        self.put(dst, host);
    }

    fn download(&self, src: &DevBuf<f32>, host: &mut [f32]) {
        assert_eq!(src.len(), host.len(), "download: lengths differ");
        if let Some(s) = src.slice.as_ref() {
            self.run("copy from the device", || {
                self.gpu().stream.memcpy_dtoh(s, host).map_err(|e| format!("{e:?}"))?;
                self.gpu().synchronize()
            });
        }
    }

    /// The copy goes on the stream like every other (`memcpy_dtoh` on a view of the range), so
    /// it follows the step's kernels; the stream is synchronised before the host reads `host`.
    fn download_range(&self, src: &DevBuf<f32>, from: Range<usize>, host: &mut [f32]) {
        assert_eq!(from.len(), host.len(), "download_range: lengths differ");
        assert!(from.end <= src.len(), "download_range: {from:?} outside a buffer of {}", src.len());
        if let (Some(s), false) = (src.slice.as_ref(), host.is_empty()) {
            self.run("copy from the device", || {
                self.gpu().stream.memcpy_dtoh(&s.slice(from.clone()), host).map_err(|e| format!("{e:?}"))?;
                self.gpu().synchronize()
            });
        }
    }

    fn copy(&self, dst: &mut DevBuf<f32>, src: &DevBuf<f32>) {
        assert_eq!(dst.len(), src.len(), "copy: lengths differ");
        if let (Some(d), Some(s)) = (dst.slice.as_mut(), src.slice.as_ref()) {
            self.run("device copy", || self.gpu().stream.memcpy_dtod(s, d).map_err(|e| format!("{e:?}")));
        }
    }

    fn resize(&self, b: &mut DevBuf<f32>, n: usize) {
        if b.len() == n {
            return;
        }
        let mut fresh = self.alloc(n);
        let kept = b.len().min(n);
        self.copy_range(&mut fresh, 0, b, 0..kept);
        *b = fresh;
    }

    fn copy_range(&self, dst: &mut DevBuf<f32>, at: usize, src: &DevBuf<f32>, from: Range<usize>) {
        if !from.is_empty() {
            let n = from.len();
            self.run("copy_range", || self.gpu().copy(&mut dst.get_mut()?.slice_mut(at..at + n), &src.get()?.slice(from)));
        }
    }

    fn add_range(&self, dst: &mut DevBuf<f32>, at: usize, src: &DevBuf<f32>, from: Range<usize>) {
        if !from.is_empty() {
            let n = from.len();
            self.run("add_range", || self.gpu().add_assign(&mut dst.get_mut()?.slice_mut(at..at + n), &src.get()?.slice(from)));
        }
    }

    fn fill_range(&self, dst: &mut DevBuf<f32>, range: Range<usize>, x: f32) {
        if !range.is_empty() {
            self.run("fill_range", || self.gpu().fill(&mut dst.get_mut()?.slice_mut(range), x));
        }
    }

    fn pin_host(&self, host: &mut [f32]) -> bool {
        use cudarc::driver::sys;
        if host.is_empty() || self.gpu().stream.context().bind_to_thread().is_err() {
            return false;
        }
        // SAFETY: registers the slice's own memory (valid for its length); the caller unpins
        // it before freeing it (`parallel::collective::Staged`).
        let r =
            unsafe { sys::cuMemHostRegister_v2(host.as_mut_ptr().cast(), std::mem::size_of_val(host), sys::CU_MEMHOSTREGISTER_PORTABLE) };
        r == sys::CUresult::CUDA_SUCCESS
    }

    fn unpin_host(&self, host: &mut [f32]) {
        if self.gpu().stream.context().bind_to_thread().is_ok() {
            // SAFETY: `host` was registered by `pin_host` and is still allocated.
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(host.as_mut_ptr().cast()) };
        }
    }

    /// Device memory: the host stages through copies.
    fn host<'b>(&self, _b: &'b DevBuf<f32>) -> Option<&'b [f32]> {
        None
    }

    fn host_mut<'b>(&self, _b: &'b mut DevBuf<f32>) -> Option<&'b mut [f32]> {
        None
    }

    fn fill(&self, dst: &mut DevBuf<f32>, x: f32) {
        if let Some(d) = dst.slice.as_mut() {
            self.run("fill", || self.gpu().fill(&mut d.slice_mut(..), x));
        }
    }

    fn set_ids(&self, dst: &mut DevIds, host: &[u32]) {
        self.put(&mut dst.ids, host);
        let (uniq, starts, order) = group_ids(host);
        self.put(&mut dst.uniq, &uniq);
        self.put(&mut dst.starts, &starts);
        self.put(&mut dst.order, &order);
    }

    fn set_positions(&self, dst: &mut DevBuf<i32>, host: &[usize]) {
        let p: Vec<i32> = host.iter().map(|&x| i32::try_from(x).expect("a position beyond 2³¹")).collect();
        self.put(dst, &p);
    }

    fn linear_fwd(&self, y: &mut DevBuf<f32>, x: &DevBuf<f32>, w: &DevBuf<f32>, m: usize, n: usize, k: usize, acc: bool) {
        let (mnk, trans) = linear_gemm(Linear::Forward, m, n, k);
        self.gemm(y, x, w, mnk, trans, acc);
    }

    fn linear_bwd_input(&self, dx: &mut DevBuf<f32>, dy: &DevBuf<f32>, w: &DevBuf<f32>, m: usize, n: usize, k: usize, acc: bool) {
        let (mnk, trans) = linear_gemm(Linear::Input, m, n, k);
        self.gemm(dx, dy, w, mnk, trans, acc);
    }

    fn linear_bwd_weight(&self, dw: &mut DevBuf<f32>, dy: &DevBuf<f32>, x: &DevBuf<f32>, m: usize, n: usize, k: usize, acc: bool) {
        let (mnk, trans) = linear_gemm(Linear::Weight, m, n, k);
        self.gemm(dw, dy, x, mnk, trans, acc);
    }

    fn rmsnorm_fwd(&self, y: &mut DevBuf<f32>, rstd: &mut DevBuf<f32>, x: &DevBuf<f32>, w: &DevBuf<f32>, d: usize, eps: f64) {
        if x.is_empty() {
            return;
        }
        let n = x.len() / d;
        self.run("rmsnorm_fwd", || self.gpu().rmsnorm_fwd(y.get_mut()?, rstd.get_mut()?, x.get()?, w.get()?, n, d, eps as f32));
    }

    fn rmsnorm_bwd(
        &self,
        dx: &mut DevBuf<f32>,
        dw: &mut DevBuf<f32>,
        dy: &DevBuf<f32>,
        x: &DevBuf<f32>,
        w: &DevBuf<f32>,
        rstd: &DevBuf<f32>,
        d: usize,
        acc: bool,
    ) {
        if x.is_empty() {
            return;
        }
        let n = x.len() / d;
        let mut partial = self.shared.dw_partials.borrow_mut();
        if partial.len() < super::dw_tiles(n) * d {
            let _for = crate::backend::allocating("RMSNorm's weight-gradient partial sums", None);
            *partial = self.alloc(super::dw_tiles(n) * d);
        }
        self.run("rmsnorm_bwd", || {
            let grads = (dx.get_mut()?, dw.get_mut()?, partial.get_mut()?);
            self.gpu().rmsnorm_bwd(grads, dy.get()?, x.get()?, w.get()?, rstd.get()?, (n, d), acc)
        });
    }

    fn tokens_to_heads(
        &self,
        dst: &mut DevBuf<f32>,
        src: &DevBuf<f32>,
        b: usize,
        s: usize,
        nh: usize,
        hd: usize,
        rope: Option<(&DevBuf<f32>, &DevBuf<f32>)>,
    ) {
        if src.is_empty() {
            return;
        }
        self.run("to_heads", || {
            let tables = rope.map(|(c, s)| Ok::<_, String>((c.get()?, s.get()?))).transpose()?;
            self.gpu().heads_rope(dst.get_mut()?, src.get()?, tables, (b, s, nh, hd), true)
        });
    }

    fn heads_to_tokens(
        &self,
        dst: &mut DevBuf<f32>,
        src: &DevBuf<f32>,
        b: usize,
        s: usize,
        nh: usize,
        hd: usize,
        rope: Option<(&DevBuf<f32>, &DevBuf<f32>)>,
    ) {
        if src.is_empty() {
            return;
        }
        self.run("from_heads", || {
            let tables = rope.map(|(c, s)| Ok::<_, String>((c.get()?, s.get()?))).transpose()?;
            self.gpu().heads_rope(dst.get_mut()?, src.get()?, tables, (b, s, nh, hd), false)
        });
    }

    fn swiglu_fwd(&self, h: &mut DevBuf<f32>, gate: &DevBuf<f32>, up: &DevBuf<f32>) {
        if !h.is_empty() {
            self.run("swiglu_fwd", || self.gpu().swiglu_fwd(h.get_mut()?, gate.get()?, up.get()?));
        }
    }

    fn swiglu_bwd(&self, dgate: &mut DevBuf<f32>, dup: &mut DevBuf<f32>, dh: &DevBuf<f32>, gate: &DevBuf<f32>, up: &DevBuf<f32>) {
        if !dgate.is_empty() {
            self.run("swiglu_bwd", || self.gpu().swiglu_bwd(dgate.get_mut()?, dup.get_mut()?, dh.get()?, gate.get()?, up.get()?));
        }
    }

    fn add_assign(&self, dst: &mut DevBuf<f32>, src: &DevBuf<f32>) {
        if !dst.is_empty() {
            self.run("add_assign", || self.gpu().add_assign(&mut dst.get_mut()?.slice_mut(..), &src.get()?.slice(..)));
        }
    }

    fn embed_fwd(&self, x: &mut DevBuf<f32>, table: &DevBuf<f32>, ids: &DevIds, offset: usize, valid: usize, d: usize) {
        if !x.is_empty() {
            self.run("embed_fwd", || self.gpu().embed_fwd(x.get_mut()?, table.get()?, ids.ids.get()?, (ids.ids.len(), d, offset, valid)));
        }
    }

    fn embed_bwd(&self, dtable: &mut DevBuf<f32>, dx: &DevBuf<f32>, ids: &DevIds, offset: usize, valid: usize, d: usize) {
        if !ids.uniq.is_empty() {
            self.run("embed_bwd", || {
                let groups = (ids.uniq.get()?, ids.starts.get()?, ids.order.get()?);
                self.gpu().embed_bwd(dtable.get_mut()?, dx.get()?, groups, (d, offset, valid))
            });
        }
    }

    fn ce_row_max(&self, m: &mut DevBuf<f32>, logits: &DevBuf<f32>, v: usize, valid: usize) {
        if !m.is_empty() {
            let n = m.len();
            self.run("ce_row_max", || self.gpu().ce_row_max(m.get_mut()?, logits.get()?, (n, v, valid)));
        }
    }

    fn ce_row_sum_exp(&self, s: &mut DevBuf<f32>, logits: &DevBuf<f32>, m: &DevBuf<f32>, v: usize, valid: usize) {
        if !s.is_empty() {
            let n = s.len();
            self.run("ce_row_sum_exp", || self.gpu().ce_row_sum_exp(s.get_mut()?, logits.get()?, m.get()?, (n, v, valid)));
        }
    }

    fn ce_target_logit(&self, t: &mut DevBuf<f32>, logits: &DevBuf<f32>, targets: &DevIds, v: usize, offset: usize, valid: usize) {
        if !t.is_empty() {
            let n = t.len();
            self.run("ce_target_logit", || {
                self.gpu().ce_target_logit(t.get_mut()?, logits.get()?, targets.ids.get()?, (n, v, offset, valid))
            });
        }
    }

    fn ce_finish(&self, lse: &mut DevBuf<f32>, m: &DevBuf<f32>, t: &DevBuf<f32>) -> f64 {
        if lse.is_empty() {
            return 0.0;
        }
        let mut sum = 0.0;
        self.run("ce_finish", || {
            self.gpu().ce_finish(lse.get_mut()?, m.get()?)?;
            // Summed on the host in row order from the f32 row losses, as the CPU does.
            let (l, t) = (self.gpu().download(lse.get()?)?, self.gpu().download(t.get()?)?);
            sum = l.iter().zip(&t).map(|(&a, &b)| (a - b) as f64).sum();
            Ok(())
        });
        sum
    }

    fn ce_bwd_inplace(
        &self,
        logits: &mut DevBuf<f32>,
        lse: &DevBuf<f32>,
        targets: &DevIds,
        v: usize,
        offset: usize,
        valid: usize,
        scale: f32,
    ) {
        if !lse.is_empty() {
            self.run("ce_bwd", || {
                self.gpu().ce_bwd_inplace(logits.get_mut()?, lse.get()?, targets.ids.get()?, (lse.len(), v, offset, valid), scale)
            });
        }
    }

    /// Batched-GEMM attention (`cuda::attention`): fp32 products, or TF32 under bf16.
    fn attention_fwd(
        &self,
        o: &mut DevBuf<f32>,
        lse: &mut DevBuf<f32>,
        q: &DevBuf<f32>,
        k: &DevBuf<f32>,
        v: &DevBuf<f32>,
        q_pos: &DevBuf<i32>,
        k_pos: &DevBuf<i32>,
        dm: AttnDims,
    ) {
        if q.is_empty() {
            return;
        }
        let plan = AttnPlan::new(dm, SCORES_CAP);
        let _for = crate::backend::allocating("attention's scores", None);
        let mut s = self.shared.scores.borrow_mut();
        attention::forward(&self.attn(), &plan, &mut s, (o, lse), (q, k, v), (q_pos, k_pos));
    }

    fn attention_bwd(
        &self,
        dq: &mut DevBuf<f32>,
        dk: &mut DevBuf<f32>,
        dv: &mut DevBuf<f32>,
        d_o: &DevBuf<f32>,
        q: &DevBuf<f32>,
        k: &DevBuf<f32>,
        v: &DevBuf<f32>,
        o: &DevBuf<f32>,
        lse: &DevBuf<f32>,
        q_pos: &DevBuf<i32>,
        k_pos: &DevBuf<i32>,
        dm: AttnDims,
    ) {
        if q.is_empty() {
            return;
        }
        let plan = AttnPlan::new(dm, SCORES_CAP);
        let _for = crate::backend::allocating("attention's scores and their gradients", None);
        let (mut s, mut ds, mut dd) = (self.shared.scores.borrow_mut(), self.shared.dscores.borrow_mut(), self.shared.rowdot.borrow_mut());
        let scratch = (&mut *s, &mut *ds, &mut *dd);
        attention::backward(&self.attn(), &plan, scratch, (dq, dk, dv), (d_o, q, k, v, o, lse), (q_pos, k_pos));
    }

    fn attention_merge(&self, o: &mut DevBuf<f32>, lse: &mut DevBuf<f32>, o_part: &DevBuf<f32>, lse_part: &DevBuf<f32>, hd: usize) {
        if !lse.is_empty() {
            self.run("attention_merge", || self.gpu().attn_merge(o.get_mut()?, lse.get_mut()?, o_part.get()?, lse_part.get()?, hd));
        }
    }

    fn sum_sq(&self, x: &DevBuf<f32>, range: Range<usize>) -> f64 {
        let mut sum = 0.0;
        if let Some(x) = x.slice.as_ref().filter(|_| !range.is_empty()) {
            self.run("sum_sq", || {
                sum = self.gpu().sum_sq(&x.slice(range), self.shared.partials.borrow_mut().get_mut()?)?;
                Ok(())
            });
        }
        sum
    }

    fn scale(&self, x: &mut DevBuf<f32>, c: f32) {
        if let Some(x) = x.slice.as_mut() {
            self.run("scale", || self.gpu().scale(&mut x.slice_mut(..), c));
        }
    }

    fn adamw(&self, p: &mut DevBuf<f32>, m: &mut DevBuf<f32>, v: &mut DevBuf<f32>, g: &DevBuf<f32>, range: Range<usize>, step: &AdamStep) {
        if !range.is_empty() {
            let r = range;
            self.run("adamw", || {
                let (mut p, mut m, mut v) =
                    (p.get_mut()?.slice_mut(r.clone()), m.get_mut()?.slice_mut(r.clone()), v.get_mut()?.slice_mut(r.clone()));
                self.gpu().adamw(&mut p, &mut m, &mut v, &g.get()?.slice(r), step)
            });
        }
    }
}

/// The GPU as the attention orchestration's device (`cuda::attention`).
struct GpuAttn<'a> {
    be: &'a GpuBackend,
    tf32: bool,
}

impl AttnDevice for GpuAttn<'_> {
    type Buf = DevBuf<f32>;
    type Pos = DevBuf<i32>;

    fn ensure(&self, buf: &mut DevBuf<f32>, n: usize) {
        if buf.len() < n {
            *buf = self.be.alloc(n);
        }
    }

    fn gemm(
        &self,
        c: (&mut DevBuf<f32>, usize),
        a: (&DevBuf<f32>, usize),
        b: (&DevBuf<f32>, usize),
        mnk: (usize, usize, usize),
        trans: (bool, bool),
        batch: (usize, (usize, usize, usize)),
    ) {
        self.be.run("attention GEMM", || {
            let (a, b) = (Operand::F32(a.0.get()?, a.1), Operand::F32(b.0.get()?, b.1));
            self.be.gpu().gemm_batched((c.0.get_mut()?, c.1), a, b, mnk, trans, 0.0, batch, self.tf32)
        });
    }

    fn softmax(
        &self,
        s: &mut DevBuf<f32>,
        lse: &mut DevBuf<f32>,
        pos: (&DevBuf<i32>, &DevBuf<i32>),
        rows: (usize, usize, usize, usize),
        scale: f32,
    ) {
        self.be.run("attention softmax", || {
            self.be.gpu().attn_softmax(s.get_mut()?, lse.get_mut()?, (pos.0.get()?, pos.1.get()?), rows, scale)
        });
    }

    fn probs(
        &self,
        s: &mut DevBuf<f32>,
        lse: &DevBuf<f32>,
        pos: (&DevBuf<i32>, &DevBuf<i32>),
        rows: (usize, usize, usize, usize),
        scale: f32,
    ) {
        self.be.run("attention probabilities", || {
            self.be.gpu().attn_probs(s.get_mut()?, lse.get()?, (pos.0.get()?, pos.1.get()?), rows, scale)
        });
    }

    fn dscores(&self, dp: &mut DevBuf<f32>, p: &DevBuf<f32>, dd: &DevBuf<f32>, rows: (usize, usize, usize), scale: f32) {
        self.be.run("attention dS", || self.be.gpu().attn_dscores(dp.get_mut()?, p.get()?, dd.get()?, rows, scale));
    }

    fn rowdot(&self, dd: &mut DevBuf<f32>, d_o: &DevBuf<f32>, o: &DevBuf<f32>, rows: (usize, usize)) {
        self.be.run("attention rowsum(dO∘O)", || self.be.gpu().attn_rowdot(dd.get_mut()?, d_o.get()?, o.get()?, rows));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `embed_bwd` as the kernel computes it from `group_ids` (a row's tokens in order) is the
    /// host's embedding backward bit for bit, with repeated ids and ids outside this rank's rows.
    #[test]
    fn grouped_ids_reproduce_the_host_embedding_backward_bitwise() {
        let (n, d, offset, valid) = (200, 8, 10, 13);
        let ids: Vec<u32> = (0..n as u32).map(|i| 5 + (i * 7919) % 23).collect();
        let inputs = |n: usize, k: usize| (0..n).map(|i| ((i * 7 + k * 13) % 17) as f32 / 8.0 - 1.0).collect::<Vec<f32>>();
        let dx = inputs(n * d, 3);
        let table = inputs(valid * d, 4);
        let mut want = table.clone();
        Backend::<f32>::embed_bwd(&crate::backend::cpu::Cpu::default(), &mut want, &dx, &ids.to_vec(), offset, valid, d);
        let (uniq, starts, order) = group_ids(&ids);
        let mut got = table.clone();
        for (u, &id) in uniq.iter().enumerate() {
            let local = id.wrapping_sub(offset as u32) as usize;
            if local >= valid {
                continue;
            }
            for j in 0..d {
                let mut acc = got[local * d + j];
                for t in starts[u]..starts[u + 1] {
                    acc += dx[order[t as usize] as usize * d + j];
                }
                got[local * d + j] = acc;
            }
        }
        assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        assert!(uniq.windows(2).all(|w| w[0] < w[1]) && starts.len() == uniq.len() + 1);
    }
}
