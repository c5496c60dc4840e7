//! The boundary between the model's maths and the hardware that runs it.
//!
//! [`Backend`] is every operation a training step needs — buffers and copies, the linear
//! layers' GEMMs, the fused elementwise and row kernels, attention, the cross entropy, the
//! optimiser's update and the gradient norm — on the backend's own buffers. The model
//! (`model::Model`), the parallel strategies (`parallel`) and the training loop (`train`) are
//! written once against it. `cpu::Cpu` runs them on the host with the kernels of `cpu`; the
//! CUDA backend (`cuda::backend`, feature `cuda`) on an NVIDIA GPU with cuBLAS and
//! NVRTC-compiled kernels. Each operation's contract is the host kernel it names: `ndtrain
//! gpu-check` runs every operation on both backends with the same inputs and compares.
//!
//! Buffers are whole tensors; the operations on parts of a buffer (`*_range`, the optimiser's
//! update of one tensor inside a shard) take element ranges. A device keeps the first failure of
//! an operation (a GPU fault) and reports it from [`Backend::synchronize`], where an asynchronous
//! failure surfaces too; the caller ends the run with it. What can be checked before the first
//! step is checked there. Knows nothing of what the tensors mean, of the model, or of other
//! ranks: the layers above (`model`, `parallel`, `train`) use it, never the reverse.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::scalar::Real;
use std::ops::Range;

pub use crate::config::Precision;

/// A point in a device's queue of work: done once everything queued before it has finished
/// (a recorded CUDA event). What copies from host memory that the host must keep until they
/// have read it are waited for with.
pub trait Fence {
    /// Whether the work before the fence has finished (never blocks).
    fn done(&self) -> bool;
    /// Blocks until it has.
    fn wait(&self);
}

/// The host's fence: its copies finish before they return.
impl Fence for () {
    fn done(&self) -> bool {
        true
    }
    fn wait(&self) {}
}

/// A GPU this process can see: its ordinal among the visible ones, what names it across
/// processes (the UUID, the same whatever `CUDA_VISIBLE_DEVICES` renumbers), its PCI bus id
/// and the NUMA node its bus hangs off (from sysfs; `None` where the system does not say).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub uuid: String,
    pub pci_bus_id: String,
    pub numa_node: Option<usize>,
}

/// Sizes of one attention call. Tensors are head-major: `q [B, H, Sq, hd]`, `k, v [B, KV, Sk,
/// hd]`; query head `h` reads kv head `h / (H/KV)`.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub b: usize,
    pub h: usize,
    pub kv: usize,
    pub sq: usize,
    pub sk: usize,
    pub hd: usize,
}

/// The coefficients of one AdamW update, PyTorch's semantics (`optim::AdamW`): for each
/// element, `p ← p·decay`, `m ← b1·m + (1−b1)·g`, `v ← b2·v + (1−b2)·g²`,
/// `p ← p − step_size · m / (sqrt(v)/bc2_sqrt + eps)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    pub decay: f64,
    pub b1: f64,
    pub b2: f64,
    pub step_size: f64,
    pub bc2_sqrt: f64,
    pub eps: f64,
}

impl AdamStep {
    /// Update `t` (1-based) with learning rate `lr`; `decayed` says whether the tensor takes
    /// weight decay (2-D weights) or not (norm weights).
    pub fn new(t: u64, lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64, decayed: bool) -> AdamStep {
        let bc1 = 1.0 - beta1.powi(t as i32);
        let bc2 = 1.0 - beta2.powi(t as i32);
        // Multiplying by exactly 1 leaves an undecayed weight bit-identical.
        let decay = if decayed && weight_decay != 0.0 { 1.0 - lr * weight_decay } else { 1.0 };
        AdamStep { decay, b1: beta1, b2: beta2, step_size: lr / bc1, bc2_sqrt: bc2.sqrt(), eps }
    }
}

/// The operations of a decoder training step on one device, in element type `T`.
///
/// Shapes follow `model`: token-major activations `[N, D]` (`N = B·S`), head-major attention
/// tensors `[B, H, S, hd]`, weights `[out, in]` row-major. Every operation says whether it
/// overwrites (`=`) or accumulates (`+=`) its output.
#[allow(clippy::too_many_arguments)]
pub trait Backend<T: Real> {
    /// A tensor on the device.
    type Buf: Default;
    /// Token ids of a micro-batch (and whatever the embedding backward needs about them).
    type Ids: Default;
    /// A point in the device's queue ([`Backend::fence`]).
    type Fence: Fence;
    /// Global positions of a rank's tokens.
    type Pos: Default;

    /// A short name for logs (`cpu`, `cuda:0 NVIDIA H200`).
    fn describe(&self) -> String;
    /// The device allocator's own counters: bytes in use now and the most in use so far.
    /// `None` on the host, whose memory is the process's (`metrics::peak_rss_bytes`).
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }
    /// Waits until every operation queued so far has finished, and reports the first that
    /// failed (a device runs them asynchronously; the host has nothing to wait for). Phases are
    /// timed after it, so the host's clock measures the device's work.
    fn synchronize(&self) -> Result<(), String>;
    fn precision(&self) -> Precision;

    // ---- memory --------------------------------------------------------------------------
    fn zeros(&self, n: usize) -> Self::Buf;
    fn len(&self, b: &Self::Buf) -> usize;
    /// The buffer holds `n` elements afterwards, the first `min(n, old length)` kept and the
    /// rest zero. A scratch resized between a few lengths keeps its allocation on the host.
    fn resize(&self, b: &mut Self::Buf, n: usize);
    /// `dst` becomes a copy of `host` (reallocated when the length differs).
    fn upload(&self, dst: &mut Self::Buf, host: &[T]);
    /// `host = src`; the lengths agree.
    fn download(&self, src: &Self::Buf, host: &mut [T]);
    /// `host = src[from]`: part of a buffer copied into host memory (a checkpoint's snapshot of
    /// one tensor's block, straight into its page-locked buffer on a device).
    fn download_range(&self, src: &Self::Buf, from: Range<usize>, host: &mut [T]) {
        match self.host(src) {
            Some(all) => host.copy_from_slice(&all[from]),
            None => {
                let mut all = vec![T::ZERO; self.len(src)];
                self.download(src, &mut all);
                host.copy_from_slice(&all[from]);
            }
        }
    }
    /// `dst = src`; the lengths agree.
    fn copy(&self, dst: &mut Self::Buf, src: &Self::Buf);
    fn fill(&self, dst: &mut Self::Buf, x: T);
    /// `dst[at .. at + len] = src[from]` (`len` = the range's length).
    fn copy_range(&self, dst: &mut Self::Buf, at: usize, src: &Self::Buf, from: Range<usize>);
    /// `dst[at .. at + len] += src[from]`, elementwise.
    fn add_range(&self, dst: &mut Self::Buf, at: usize, src: &Self::Buf, from: Range<usize>);
    /// `dst[range] = x`.
    fn fill_range(&self, dst: &mut Self::Buf, range: Range<usize>, x: T);
    /// The buffer's elements where they live in host memory (the host backend); `None` for
    /// device memory, which [`with_host`] and [`with_host_mut`] stage through copies.
    fn host<'b>(&self, b: &'b Self::Buf) -> Option<&'b [T]>;
    fn host_mut<'b>(&self, b: &'b mut Self::Buf) -> Option<&'b mut [T]>;
    /// Page-locks `host` so copies between it and the device run at the bus's speed (the
    /// staging buffers of collectives that go through host memory); false where nothing is
    /// pinned (the host backend, or a device that refused). A pinned buffer is unpinned with
    /// [`Backend::unpin_host`] before its memory is freed.
    fn pin_host(&self, _host: &mut [T]) -> bool {
        false
    }
    fn unpin_host(&self, _host: &mut [T]) {}
    /// A fence after everything queued so far, where copies may still be reading host memory
    /// when they return (an upload from page-locked memory on a device); `None` where every
    /// copy has finished when it returns (the host).
    fn fence(&self) -> Option<Self::Fence> {
        None
    }
    fn set_ids(&self, dst: &mut Self::Ids, host: &[u32]);
    fn set_positions(&self, dst: &mut Self::Pos, host: &[usize]);

    // ---- linear layers (`cpu::gemm::linear_*`) -------------------------------------------
    /// `y [m, n] (=|+=) x [m, k] · wᵀ`, `w [n, k]`.
    fn linear_fwd(&self, y: &mut Self::Buf, x: &Self::Buf, w: &Self::Buf, m: usize, n: usize, k: usize, acc: bool);
    /// `dx [m, k] (=|+=) dy [m, n] · w`, `w [n, k]`.
    fn linear_bwd_input(&self, dx: &mut Self::Buf, dy: &Self::Buf, w: &Self::Buf, m: usize, n: usize, k: usize, acc: bool);
    /// `dw [n, k] (=|+=) dyᵀ · x`, `dy [m, n]`, `x [m, k]`.
    fn linear_bwd_weight(&self, dw: &mut Self::Buf, dy: &Self::Buf, x: &Self::Buf, m: usize, n: usize, k: usize, acc: bool);
    /// Two projections of one input with weights of one shape: `y1 = x · w1ᵀ`, `y2 = x · w2ᵀ`.
    /// Independent products, so a backend may run them concurrently.
    #[allow(clippy::too_many_arguments)]
    fn linear_fwd_pair(
        &self,
        y1: &mut Self::Buf,
        w1: &Self::Buf,
        y2: &mut Self::Buf,
        w2: &Self::Buf,
        x: &Self::Buf,
        m: usize,
        n: usize,
        k: usize,
    ) {
        self.linear_fwd(y1, x, w1, m, n, k, false);
        self.linear_fwd(y2, x, w2, m, n, k, false);
    }
    /// Both gradients of a linear layer: `dx (=|+=) dy · w` per `acc_dx` and `dw += dyᵀ · x`.
    /// Independent products, so a backend may run them concurrently.
    #[allow(clippy::too_many_arguments)]
    fn linear_bwd(
        &self,
        dx: &mut Self::Buf,
        acc_dx: bool,
        dw: &mut Self::Buf,
        dy: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        m: usize,
        n: usize,
        k: usize,
    ) {
        self.linear_bwd_weight(dw, dy, x, m, n, k, true);
        self.linear_bwd_input(dx, dy, w, m, n, k, acc_dx);
    }

    // ---- elementwise and row kernels (`cpu::kernels`) ------------------------------------
    /// `y = x / sqrt(mean(x²) + eps) · w` per row of `d`; `rstd =` the row's `1/sqrt(…)`.
    fn rmsnorm_fwd(&self, y: &mut Self::Buf, rstd: &mut Self::Buf, x: &Self::Buf, w: &Self::Buf, d: usize, eps: f64);
    /// `dx (=|+=)`, `dw +=`.
    fn rmsnorm_bwd(
        &self,
        dx: &mut Self::Buf,
        dw: &mut Self::Buf,
        dy: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        rstd: &Self::Buf,
        d: usize,
        acc: bool,
    );
    /// Token-major `[B, S, nh·hd]` → head-major `[B, nh, S, hd]` (`=`), RoPE-rotated with
    /// `(cos, sin) [S, hd/2]` when given.
    fn tokens_to_heads(
        &self,
        dst: &mut Self::Buf,
        src: &Self::Buf,
        b: usize,
        s: usize,
        nh: usize,
        hd: usize,
        rope: Option<(&Self::Buf, &Self::Buf)>,
    );
    /// Head-major → token-major (`=`), rotated by the transposed rotation when given: the
    /// backward of [`Backend::tokens_to_heads`], and the attention output's transpose.
    fn heads_to_tokens(
        &self,
        dst: &mut Self::Buf,
        src: &Self::Buf,
        b: usize,
        s: usize,
        nh: usize,
        hd: usize,
        rope: Option<(&Self::Buf, &Self::Buf)>,
    );
    /// `h = silu(gate) · up`.
    fn swiglu_fwd(&self, h: &mut Self::Buf, gate: &Self::Buf, up: &Self::Buf);
    /// `dgate =`, `dup =`.
    fn swiglu_bwd(&self, dgate: &mut Self::Buf, dup: &mut Self::Buf, dh: &Self::Buf, gate: &Self::Buf, up: &Self::Buf);
    /// `dst += src`.
    fn add_assign(&self, dst: &mut Self::Buf, src: &Self::Buf);
    /// `x [N, d] =` the rows `ids − offset` of `table` where `0 ≤ ids − offset < valid`, else 0
    /// (a vocabulary-parallel rank's share of the embedding).
    fn embed_fwd(&self, x: &mut Self::Buf, table: &Self::Buf, ids: &Self::Ids, offset: usize, valid: usize, d: usize);
    /// `dtable[ids[n] − offset] += dx[n]` for the tokens this rank's rows hold, in token order.
    fn embed_bwd(&self, dtable: &mut Self::Buf, dx: &Self::Buf, ids: &Self::Ids, offset: usize, valid: usize, d: usize);

    // ---- mixture of experts: rows routed to experts --------------------------------------
    // Each has a default built from the operations above, correct on every backend; a backend
    // overrides those it can do without the copies.
    /// `dst [rows.len(), d] =` the rows `rows` of `src [R, d]` (an expert's tokens, gathered).
    fn gather_rows(&self, dst: &mut Self::Buf, src: &Self::Buf, rows: &[u32], d: usize)
    where
        Self: Sized,
    {
        let mut ids = Self::Ids::default();
        self.set_ids(&mut ids, rows);
        self.embed_fwd(dst, src, &ids, 0, self.len(src) / d, d);
    }
    /// `dst[rows[i]] += src[i]` for every row `i` of `src [rows.len(), d]`, in row order.
    fn scatter_add_rows(&self, dst: &mut Self::Buf, src: &Self::Buf, rows: &[u32], d: usize)
    where
        Self: Sized,
    {
        let mut ids = Self::Ids::default();
        self.set_ids(&mut ids, rows);
        self.embed_bwd(dst, src, &ids, 0, self.len(dst) / d, d);
    }
    /// `x[r] *= s[r]` for every row of `x [s.len(), d]` (routed rows times their gate weights).
    fn scale_rows(&self, x: &mut Self::Buf, s: &[T], d: usize)
    where
        Self: Sized,
    {
        with_host_mut(self, vec![x], |mut v| {
            for (row, &c) in v[0].chunks_mut(d).zip(s) {
                row.iter_mut().for_each(|y| *y *= c);
            }
        })
    }
    /// `Σ_c a[r, c] · b[r, c]` of every row of `a, b [R, d]`, summed in f64 in column order
    /// (the gate weights' gradients).
    fn row_dots(&self, a: &Self::Buf, b: &Self::Buf, d: usize) -> Vec<f64>
    where
        Self: Sized,
    {
        with_host(self, &[a, b], |v| {
            v[0].chunks(d).zip(v[1].chunks(d)).map(|(x, y)| x.iter().zip(y).map(|(p, q)| p.to_f64() * q.to_f64()).sum()).collect()
        })
    }
    /// A new buffer holding rows `rows` of `src [_, width]` (one group of a grouped layer).
    fn rows_of(&self, src: &Self::Buf, rows: Range<usize>, width: usize) -> Self::Buf {
        let mut out = self.zeros(rows.len() * width);
        self.copy_range(&mut out, 0, src, rows.start * width..rows.end * width);
        out
    }
    /// One linear layer per group of rows (each expert's tokens): rows
    /// `offsets[g]..offsets[g + 1]` of `x [M, k]` times `ws[g]ᵀ` (`[n, k]`) into the same rows of
    /// `y [M, n]` (`=`).
    fn grouped_linear_fwd(&self, y: &mut Self::Buf, x: &Self::Buf, ws: &[&Self::Buf], offsets: &[usize], n: usize, k: usize)
    where
        Self: Sized,
    {
        for (g, w) in ws.iter().enumerate() {
            let (r0, r1) = (offsets[g], offsets[g + 1]);
            if r1 > r0 {
                let (xg, mut yg) = (self.rows_of(x, r0..r1, k), self.zeros((r1 - r0) * n));
                self.linear_fwd(&mut yg, &xg, w, r1 - r0, n, k, false);
                self.copy_range(y, r0 * n, &yg, 0..(r1 - r0) * n);
            }
        }
    }
    /// Two grouped projections of one input (each expert's gate and up): `y1` with `ws1`, `y2`
    /// with `ws2`, as [`Backend::linear_fwd_pair`] per group.
    #[allow(clippy::too_many_arguments)]
    fn grouped_linear_fwd_pair(
        &self,
        y1: &mut Self::Buf,
        ws1: &[&Self::Buf],
        y2: &mut Self::Buf,
        ws2: &[&Self::Buf],
        x: &Self::Buf,
        offsets: &[usize],
        n: usize,
        k: usize,
    ) where
        Self: Sized,
    {
        self.grouped_linear_fwd(y1, x, ws1, offsets, n, k);
        self.grouped_linear_fwd(y2, x, ws2, offsets, n, k);
    }
    /// Both gradients of [`Backend::grouped_linear_fwd`], as [`Backend::linear_bwd`] per
    /// group: `dx (=|+=)` per `acc_dx`, `dws[g] +=`.
    #[allow(clippy::too_many_arguments)]
    fn grouped_linear_bwd(
        &self,
        dx: &mut Self::Buf,
        acc_dx: bool,
        dws: &mut [&mut Self::Buf],
        dy: &Self::Buf,
        x: &Self::Buf,
        ws: &[&Self::Buf],
        offsets: &[usize],
        n: usize,
        k: usize,
    ) where
        Self: Sized,
    {
        self.grouped_linear_bwd_weight(dws, dy, x, offsets, n, k, true);
        self.grouped_linear_bwd_input(dx, dy, ws, offsets, n, k, acc_dx);
    }
    /// The input gradient of [`Backend::grouped_linear_fwd`]: `dx [M, k] (=|+=)` each group's
    /// `dy · ws[g]`.
    #[allow(clippy::too_many_arguments)]
    fn grouped_linear_bwd_input(
        &self,
        dx: &mut Self::Buf,
        dy: &Self::Buf,
        ws: &[&Self::Buf],
        offsets: &[usize],
        n: usize,
        k: usize,
        acc: bool,
    ) where
        Self: Sized,
    {
        for (g, w) in ws.iter().enumerate() {
            let (r0, r1) = (offsets[g], offsets[g + 1]);
            if r1 > r0 {
                let (dyg, mut dxg) = (self.rows_of(dy, r0..r1, n), self.zeros((r1 - r0) * k));
                self.linear_bwd_input(&mut dxg, &dyg, w, r1 - r0, n, k, false);
                if acc {
                    self.add_range(dx, r0 * k, &dxg, 0..(r1 - r0) * k);
                } else {
                    self.copy_range(dx, r0 * k, &dxg, 0..(r1 - r0) * k);
                }
            }
        }
    }
    /// The weight gradients of [`Backend::grouped_linear_fwd`]: `dws[g] (=|+=) dy_gᵀ · x_g`.
    #[allow(clippy::too_many_arguments)]
    fn grouped_linear_bwd_weight(
        &self,
        dws: &mut [&mut Self::Buf],
        dy: &Self::Buf,
        x: &Self::Buf,
        offsets: &[usize],
        n: usize,
        k: usize,
        acc: bool,
    ) where
        Self: Sized,
    {
        for (g, dw) in dws.iter_mut().enumerate() {
            let (r0, r1) = (offsets[g], offsets[g + 1]);
            if r1 > r0 {
                let (dyg, xg) = (self.rows_of(dy, r0..r1, n), self.rows_of(x, r0..r1, k));
                self.linear_bwd_weight(dw, &dyg, &xg, r1 - r0, n, k, acc);
            } else if !acc {
                self.fill(dw, T::ZERO);
            }
        }
    }

    // ---- cross entropy over (vocabulary-parallel) logits [N, v] --------------------------
    /// `m =` each row's maximum over its first `valid` columns.
    fn ce_row_max(&self, m: &mut Self::Buf, logits: &Self::Buf, v: usize, valid: usize);
    /// `s = Σ_j exp(logits − m)` over the valid columns.
    fn ce_row_sum_exp(&self, s: &mut Self::Buf, logits: &Self::Buf, m: &Self::Buf, v: usize, valid: usize);
    /// `t =` the target's logit where `offset ≤ target < offset + valid`, else 0.
    fn ce_target_logit(&self, t: &mut Self::Buf, logits: &Self::Buf, targets: &Self::Ids, v: usize, offset: usize, valid: usize);
    /// In place `lse ← m + ln(lse)` (the row sums become log-sum-exps); returns
    /// `Σ_n (lse_n − t_n)` in f64, summed in row order: the micro-batch's summed loss.
    fn ce_finish(&self, lse: &mut Self::Buf, m: &Self::Buf, t: &Self::Buf) -> f64;
    /// In place: `logits = scale · (softmax − onehot)`, padding columns 0.
    fn ce_bwd_inplace(&self, logits: &mut Self::Buf, lse: &Self::Buf, targets: &Self::Ids, v: usize, offset: usize, valid: usize, scale: T);

    // ---- attention (`cpu::attention`) ----------------------------------------------------
    /// `o [B, H, Sq, hd] =`, `lse [B, H, Sq] =`; causal by global position.
    fn attention_fwd(
        &self,
        o: &mut Self::Buf,
        lse: &mut Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        q_pos: &Self::Pos,
        k_pos: &Self::Pos,
        dm: AttnDims,
    );
    /// `dq =`, `dk =`, `dv =`.
    fn attention_bwd(
        &self,
        dq: &mut Self::Buf,
        dk: &mut Self::Buf,
        dv: &mut Self::Buf,
        d_o: &Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        o: &Self::Buf,
        lse: &Self::Buf,
        q_pos: &Self::Pos,
        k_pos: &Self::Pos,
        dm: AttnDims,
    );
    /// Online-softmax merge of a partial result over one block of keys into `(o, lse)`.
    fn attention_merge(&self, o: &mut Self::Buf, lse: &mut Self::Buf, o_part: &Self::Buf, lse_part: &Self::Buf, hd: usize);

    // ---- optimiser -----------------------------------------------------------------------
    /// `Σ x²` over `x[range]`, in f64.
    fn sum_sq(&self, x: &Self::Buf, range: Range<usize>) -> f64;
    /// `x *= c`.
    fn scale(&self, x: &mut Self::Buf, c: T);
    /// One AdamW update of one tensor: the elements `range` of the parameters `p`, the moments
    /// `m`, `v` and the gradient `g` (a tensor's place in a shard holding several).
    fn adamw(&self, p: &mut Self::Buf, m: &mut Self::Buf, v: &mut Self::Buf, g: &Self::Buf, range: Range<usize>, step: &AdamStep);
}

thread_local! {
    /// What the device allocations made now are for ([`allocating`]).
    static ALLOCATING: std::cell::Cell<(&'static str, Option<usize>)> = const { std::cell::Cell::new(("", None)) };
}

/// Says what the allocations made until the returned guard is dropped are for — `what`, of
/// unit or block `index` when given — so a device that runs out of memory names the tensor it
/// was asked for. Costs a thread-local write; the text is formatted only on failure.
pub fn allocating(what: &'static str, index: Option<usize>) -> Allocating {
    Allocating(ALLOCATING.replace((what, index)))
}

/// Restores the purpose said before it when dropped.
pub struct Allocating((&'static str, Option<usize>));

impl Drop for Allocating {
    fn drop(&mut self) {
        ALLOCATING.set(self.0);
    }
}

/// What the allocations made now are for, if a caller said so.
pub fn allocation_purpose() -> Option<String> {
    match ALLOCATING.get() {
        ("", _) => None,
        (what, None) => Some(what.to_string()),
        (what, Some(i)) => Some(format!("{what} {i}")),
    }
}

/// Runs `f` on host slices of `bufs`: the buffers themselves on the host backend, else copies
/// downloaded for it (for reading a model state out of device memory: checkpoints, exports).
pub fn with_host<T: Real, B: Backend<T>, R>(be: &B, bufs: &[&B::Buf], f: impl FnOnce(Vec<&[T]>) -> R) -> R {
    if let Some(direct) = bufs.iter().map(|b| be.host(b)).collect::<Option<Vec<_>>>() {
        return f(direct);
    }
    let staged: Vec<Vec<T>> = bufs
        .iter()
        .map(|b| {
            let mut v = vec![T::ZERO; be.len(b)];
            be.download(b, &mut v);
            v
        })
        .collect();
    f(staged.iter().map(|v| v.as_slice()).collect())
}

/// Runs `f` on mutable host slices of `bufs`: the buffers themselves on the host backend, else
/// copies that are downloaded before and uploaded after (loading a model state into device
/// memory: initialisation, checkpoints, Hugging Face imports).
pub fn with_host_mut<T: Real, B: Backend<T>, R>(be: &B, mut bufs: Vec<&mut B::Buf>, f: impl FnOnce(Vec<&mut [T]>) -> R) -> R {
    if bufs.iter_mut().all(|b| be.host_mut(b).is_some()) {
        return f(bufs.into_iter().map(|b| be.host_mut(b).expect("host memory")).collect());
    }
    let mut staged: Vec<Vec<T>> = bufs
        .iter()
        .map(|b| {
            let mut v = vec![T::ZERO; be.len(b)];
            be.download(b, &mut v);
            v
        })
        .collect();
    let r = f(staged.iter_mut().map(|v| v.as_mut_slice()).collect());
    for (b, v) in bufs.into_iter().zip(&staged) {
        be.upload(b, v);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A purpose holds while its guard lives, nested ones restore the outer one, and the index
    /// is said with it.
    #[test]
    fn an_allocation_purpose_is_scoped_and_nests() {
        assert_eq!(allocation_purpose(), None);
        {
            let _outer = allocating("AdamW moments", None);
            assert_eq!(allocation_purpose().as_deref(), Some("AdamW moments"));
            {
                let _inner = allocating("gathered parameters of unit", Some(3));
                assert_eq!(allocation_purpose().as_deref(), Some("gathered parameters of unit 3"));
            }
            assert_eq!(allocation_purpose().as_deref(), Some("AdamW moments"));
        }
        assert_eq!(allocation_purpose(), None);
    }
}
