//! NVIDIA GPUs through `cudarc` (Cargo feature `cuda`). The only module that names `cudarc`.
//!
//! Opening the rank's GPU (chosen from its node-local rank), cuBLAS GEMMs (strided-batched,
//! f32 or bf16 operands, f32 accumulation, optionally TF32), the decoder's kernels as CUDA C
//! (`kernels.cu`: RMSNorm, RoPE with the head transposes, SwiGLU, residual adds, embedding,
//! cross entropy, attention's softmax and score gradients, AdamW, the gradient norm, bf16
//! conversions) compiled once at start by NVRTC for the device's architecture, the
//! [`backend::GpuBackend`] that runs the model and the training loop on them, NCCL
//! communicators bootstrapped over an MPI group, and `ndtrain gpu-check` ([`check`]), which
//! runs every backend operation against the host backend (`docs/gpu.md`).
//!
//! The CUDA libraries are loaded at run time (`dynamic-loading`), so this builds on machines
//! without CUDA; where a library is missing, [`Gpu::open`] returns an error that names it
//! instead of letting `cudarc` panic.

pub mod attention;
pub mod backend;
pub mod check;

use crate::parallel::comm::Group;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::{CudaBlas, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchArgs,
    LaunchConfig, PushKernelArg,
};
use cudarc::nccl::{Comm, Id};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::collections::HashMap;
use std::sync::Arc;

/// The kernels' CUDA C source; every `extern "C" __global__` in it is listed in [`KERNELS`].
pub const SOURCE: &str = include_str!("kernels.cu");

/// The entry points of [`SOURCE`], loaded by name at start.
pub const KERNELS: [&str; 25] = [
    "rmsnorm_fwd",
    "rmsnorm_bwd_dx",
    "rmsnorm_bwd_dw",
    "to_heads_rope",
    "from_heads_rope",
    "swiglu_fwd",
    "swiglu_bwd",
    "add_assign",
    "ce_row_max",
    "ce_row_sum_exp",
    "ce_target_logit",
    "ce_finish",
    "ce_bwd_inplace",
    "attn_softmax",
    "attn_probs",
    "attn_dscores",
    "attn_bwd_rowdot",
    "attn_merge",
    "embed_fwd",
    "embed_bwd",
    "fill_f32",
    "scale_f32",
    "sum_sq_partial",
    "adamw",
    "f32_to_bf16",
];

/// Threads per block of the elementwise kernels and of a row kernel (RMSNorm, cross entropy).
const BLOCK: u32 = 256;

/// Warps per block of the row kernels that give a warp to each row.
const ROW_WARPS: u32 = 8;

/// The CUDA libraries this backend loads, with the names `cudarc` looks for.
const LIBRARIES: [(&str, &str); 4] = [("cuda", "the NVIDIA driver"), ("cublas", "cuBLAS"), ("nvrtc", "NVRTC"), ("nccl", "NCCL")];

/// Every CUDA library the backend needs can be loaded, or an error naming the missing ones.
pub fn libraries_present() -> Result<(), String> {
    let missing: Vec<String> =
        LIBRARIES.iter().filter(|(lib, _)| !library_loadable(lib)).map(|(lib, what)| format!("{what} (lib{lib}.so)")).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "cannot load {}: run on a node with an NVIDIA GPU and its driver, with the CUDA 12 and NCCL \
             libraries on LD_LIBRARY_PATH (e.g. `module load cuda nccl`)",
            missing.join(", ")
        ))
    }
}

/// One of the names `cudarc` tries for `lib` can be opened by the dynamic loader.
pub fn library_loadable(lib: &str) -> bool {
    cudarc::get_lib_name_candidates(lib).iter().any(|name| loadable(name))
}

fn loadable(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else { return false };
    // SAFETY: dlopen with a valid C string; the handle is closed at once (the libraries are
    // loaded again by cudarc when used).
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if h.is_null() {
            return false;
        }
        libc::dlclose(h);
    }
    true
}

/// Compiles [`SOURCE`] to PTX for `arch` (e.g. `sm_90`). Needs only NVRTC, not a GPU: the
/// test suite compiles for the architectures of the machines the program targets wherever
/// NVRTC can be loaded.
pub fn compile(arch: &str) -> Result<Ptx, String> {
    if !library_loadable("nvrtc") {
        return Err("cannot load NVRTC (libnvrtc.so): put CUDA 12's lib64 on LD_LIBRARY_PATH".into());
    }
    // cudarc keeps the architecture as a `&'static str`; one leak per compile (once per run).
    let arch: &'static str = Box::leak(arch.to_string().into_boxed_str());
    compile_ptx_with_opts(SOURCE, CompileOptions { arch: Some(arch), name: Some("kernels.cu".into()), ..Default::default() })
        .map_err(|e| format!("NVRTC could not compile the kernels for {arch}: {e:?}"))
}

fn err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

/// A device buffer of f32.
pub type Buf = CudaSlice<f32>;

/// The rank's GPU: context, stream, cuBLAS handle and the compiled kernels.
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    functions: HashMap<&'static str, CudaFunction>,
    _module: Arc<CudaModule>,
}

/// Launch configurations.
fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(BLOCK as usize) as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

fn warp_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows.div_ceil(ROW_WARPS as usize) as u32, 1, 1), block_dim: (32 * ROW_WARPS, 1, 1), shared_mem_bytes: 0 }
}

/// Buffer-size preconditions of a launch: the kernels index by the sizes they are given.
fn need(what: &str, ok: bool) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(format!("{what}: a buffer is smaller than the sizes passed"))
    }
}

/// The column-major cuBLAS call that computes the row-major `c [m, n] = op(a) · op(b) + beta·c`
/// as `cᵀ = op(b)ᵀ · op(a)ᵀ` (its `A` is our `b`, its `B` our `a`).
pub(crate) fn gemm_config(m: usize, n: usize, k: usize, (ta, tb): (bool, bool), beta: f32) -> GemmConfig<f32> {
    let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
    GemmConfig {
        transa: op(tb),
        transb: op(ta),
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: 1.0f32,
        lda: if tb { k } else { n } as i32,
        ldb: if ta { m } else { k } as i32,
        beta,
        ldc: n as i32,
    }
}

/// A GEMM operand: a device buffer of f32, or of bf16 bit patterns, from element `.1` on.
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    F32(&'a CudaSlice<f32>, usize),
    Bf16(&'a CudaSlice<u16>, usize),
}

impl Operand<'_> {
    /// Elements from the offset to the end of the buffer.
    fn available(&self) -> usize {
        match *self {
            Operand::F32(s, o) => s.len().saturating_sub(o),
            Operand::Bf16(s, o) => s.len().saturating_sub(o),
        }
    }

    fn is_f32(&self) -> bool {
        matches!(self, Operand::F32(..))
    }

    fn dtype(&self) -> cudaDataType {
        if self.is_f32() {
            cudaDataType::CUDA_R_32F
        } else {
            cudaDataType::CUDA_R_16BF
        }
    }

    fn device_ptr<'s>(&'s self, stream: &'s Arc<CudaStream>) -> (u64, cudarc::driver::SyncOnDrop<'s>) {
        match *self {
            Operand::F32(s, o) => {
                let (p, g) = s.device_ptr(stream);
                (p + (4 * o) as u64, g)
            }
            Operand::Bf16(s, o) => {
                let (p, g) = s.device_ptr(stream);
                (p + (2 * o) as u64, g)
            }
        }
    }
}

impl Gpu {
    /// Opens GPU `node_rank % (GPUs on this node)`: each rank of a node takes its own when a
    /// node runs one rank per GPU, whatever the launcher (the node-local rank comes from
    /// `MPI_Comm_split_type`, not from launcher variables).
    pub fn open(node_rank: usize) -> Result<Gpu, String> {
        libraries_present()?;
        let count = CudaContext::device_count().map_err(err("counting CUDA devices"))?;
        if count < 1 {
            return Err("the NVIDIA driver is loaded but reports no GPU on this node".into());
        }
        let ordinal = node_rank % count as usize;
        let ctx = CudaContext::new(ordinal).map_err(err("creating a CUDA context"))?;
        let name = ctx.name().map_err(err("reading the device name"))?;
        let cc = ctx.compute_capability().map_err(err("reading the compute capability"))?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| format!("creating a cuBLAS handle: {e:?}"))?;
        // Compiled once, for this device's architecture.
        let module = ctx.load_module(compile(&format!("sm_{}{}", cc.0, cc.1))?).map_err(err("loading the compiled kernels"))?;
        let mut functions = HashMap::new();
        for name in KERNELS.iter() {
            functions.insert(*name, module.load_function(name).map_err(err(name))?);
        }
        Ok(Gpu { ordinal, name, cc, stream, blas, functions, _module: module })
    }

    fn launcher(&self, name: &str) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.functions[name])
    }

    fn launch(what: &str, mut l: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<(), String> {
        // Nothing to do for empty tensors (CUDA refuses a grid of 0 blocks).
        if cfg.grid_dim.0 == 0 {
            return Ok(());
        }
        // SAFETY: every caller pushes the arguments of the kernel it names, in its order and
        // with its types, and has checked the buffers against the sizes it passes.
        unsafe { l.launch(cfg) }.map(|_| ()).map_err(err(what))
    }

    pub fn upload<T: DeviceRepr + Copy>(&self, host: &[T]) -> Result<CudaSlice<T>, String> {
        self.stream.clone_htod(host).map_err(err("copying to the GPU"))
    }

    pub fn download<T: DeviceRepr + Copy + Default>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>, String> {
        self.stream.clone_dtoh(dev).map_err(err("copying from the GPU"))
    }

    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, String> {
        self.stream.alloc_zeros::<T>(n).map_err(err("allocating on the GPU"))
    }

    /// `count` row-major products `c_i [m, n] = op(a_i) · op(b_i) + beta · c_i` through
    /// `cublasGemmStridedBatchedEx`, the `i`-th operands `stride` elements after the first
    /// (`a_i` is stored `[m, k]`, or `[k, m]` when transposed; `b_i` `[k, n]` or `[n, k]`).
    /// Operands are f32 or bf16; accumulation and `c` are f32; `tf32` lets f32 operands use
    /// the tensor cores with TF32 (10-bit mantissa) products. cuBLAS is column-major, so it
    /// computes `cᵀ = op(b)ᵀ · op(a)ᵀ`, which is the same memory.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_batched(
        &self,
        c: (&mut CudaSlice<f32>, usize),
        a: Operand<'_>,
        b: Operand<'_>,
        (m, n, k): (usize, usize, usize),
        trans: (bool, bool),
        beta: f32,
        (count, strides): (usize, (usize, usize, usize)),
        tf32: bool,
    ) -> Result<(), String> {
        if m == 0 || n == 0 || count == 0 {
            return Ok(());
        }
        let last = |stride: usize, len: usize| (count - 1) * stride + len;
        need(
            "gemm",
            a.available() >= last(strides.0, m * k) && b.available() >= last(strides.1, k * n) && c.0.len() >= c.1 + last(strides.2, m * n),
        )?;
        let i32_ok = [m, n, k, count].iter().all(|&x| i32::try_from(x).is_ok());
        need("gemm (sizes beyond 32 bits)", i32_ok)?;
        let cfg = gemm_config(m, n, k, trans, beta);
        let alpha = 1.0f32;
        let (pa, _ga) = a.device_ptr(&self.stream);
        let (pb, _gb) = b.device_ptr(&self.stream);
        let (pc, _gc) = c.0.device_ptr_mut(&self.stream);
        let pc = pc + (4 * c.1) as u64;
        let compute =
            if tf32 && a.is_f32() { cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32 } else { cublasComputeType_t::CUBLAS_COMPUTE_32F };
        // SAFETY: device pointers of buffers holding every operand at the checked offsets and
        // strides, on the handle's stream; the scalars are f32 as the compute type requires.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                cfg.transa,
                cfg.transb,
                cfg.m,
                cfg.n,
                cfg.k,
                (&alpha) as *const f32 as *const _,
                pb as *const _,
                b.dtype(),
                cfg.lda,
                strides.1 as i64,
                pa as *const _,
                a.dtype(),
                cfg.ldb,
                strides.0 as i64,
                (&cfg.beta) as *const f32 as *const _,
                pc as *mut _,
                cudaDataType::CUDA_R_32F,
                cfg.ldc,
                strides.2 as i64,
                count as i32,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| format!("cublasGemmStridedBatchedEx ({m}×{n}×{k}, {count} products): {e:?}"))
    }

    /// One row-major product `c [m, n] = op(a) · op(b) + beta · c` (see [`Gpu::gemm_batched`]).
    pub fn gemm(
        &self,
        c: &mut CudaSlice<f32>,
        a: Operand<'_>,
        b: Operand<'_>,
        mnk: (usize, usize, usize),
        trans: (bool, bool),
        beta: f32,
    ) -> Result<(), String> {
        self.gemm_batched((c, 0), a, b, mnk, trans, beta, (1, (0, 0, 0)), false)
    }

    /// RMSNorm forward of `n` rows of `d` (`model::kernels::rmsnorm_fwd`).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_fwd(
        &self,
        y: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        n: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), String> {
        need("rmsnorm_fwd", y.len() >= n * d && x.len() >= n * d && rstd.len() >= n && w.len() >= d)?;
        let (n32, d32) = (n as i32, d as i32);
        let mut l = self.launcher("rmsnorm_fwd");
        l.arg(y).arg(rstd).arg(x).arg(w).arg(&n32).arg(&d32).arg(&eps);
        Self::launch("rmsnorm_fwd", l, per_row(n))
    }

    /// RMSNorm backward (`model::kernels::rmsnorm_bwd`): `dx` overwritten or accumulated,
    /// `dw +=` always.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_bwd(
        &self,
        dx: &mut CudaSlice<f32>,
        dw: &mut CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        (n, d): (usize, usize),
        accumulate: bool,
    ) -> Result<(), String> {
        need(
            "rmsnorm_bwd",
            dx.len() >= n * d && dy.len() >= n * d && x.len() >= n * d && rstd.len() >= n && w.len() >= d && dw.len() >= d,
        )?;
        let (n32, d32, acc) = (n as i32, d as i32, accumulate as i32);
        let mut l = self.launcher("rmsnorm_bwd_dx");
        l.arg(&mut *dx).arg(dy).arg(x).arg(w).arg(rstd).arg(&n32).arg(&d32).arg(&acc);
        Self::launch("rmsnorm_bwd_dx", l, per_row(n))?;
        let mut l = self.launcher("rmsnorm_bwd_dw");
        l.arg(dw).arg(dy).arg(x).arg(rstd).arg(&n32).arg(&d32);
        Self::launch("rmsnorm_bwd_dw", l, elementwise(d))
    }

    /// Token-major `[B, S, nh·hd]` → head-major `[B, nh, S, hd]`, RoPE-rotated when tables are
    /// given (`model::kernels::to_heads_rope`); `forward = false` is the backward
    /// (`from_heads_rope`: head-major gradient → token-major).
    #[allow(clippy::too_many_arguments)]
    pub fn heads_rope(
        &self,
        dst: &mut CudaSlice<f32>,
        src: &CudaSlice<f32>,
        tables: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
        (b, s, nh, hd): (usize, usize, usize, usize),
        forward: bool,
    ) -> Result<(), String> {
        let n = b * s * nh * hd;
        let half = hd / 2;
        need("heads_rope", dst.len() >= n && src.len() >= n && tables.is_none_or(|(c, sn)| c.len() >= s * half && sn.len() >= s * half))?;
        let name = if forward { "to_heads_rope" } else { "from_heads_rope" };
        // Without rotation the tables are not read; any buffer stands in for them.
        let (cos, sin) = tables.unwrap_or((src, src));
        let (b32, s32, nh32, hd32, rotate) = (b as i32, s as i32, nh as i32, hd as i32, tables.is_some() as i32);
        let mut l = self.launcher(name);
        l.arg(dst).arg(src).arg(cos).arg(sin).arg(&b32).arg(&s32).arg(&nh32).arg(&hd32).arg(&rotate);
        Self::launch(name, l, elementwise(n))
    }

    pub fn swiglu_fwd(&self, h: &mut CudaSlice<f32>, gate: &CudaSlice<f32>, up: &CudaSlice<f32>) -> Result<(), String> {
        need("swiglu_fwd", gate.len() >= h.len() && up.len() >= h.len())?;
        let n = h.len() as i64;
        let mut l = self.launcher("swiglu_fwd");
        l.arg(h).arg(gate).arg(up).arg(&n);
        Self::launch("swiglu_fwd", l, elementwise(n as usize))
    }

    pub fn swiglu_bwd(
        &self,
        dgate: &mut CudaSlice<f32>,
        dup: &mut CudaSlice<f32>,
        dh: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
    ) -> Result<(), String> {
        let n = dgate.len();
        need("swiglu_bwd", dup.len() >= n && dh.len() >= n && gate.len() >= n && up.len() >= n)?;
        let n64 = n as i64;
        let mut l = self.launcher("swiglu_bwd");
        l.arg(dgate).arg(dup).arg(dh).arg(gate).arg(up).arg(&n64);
        Self::launch("swiglu_bwd", l, elementwise(n))
    }

    /// `dst += src` (the residual adds, and a reduced shard added into another).
    pub fn add_assign(&self, dst: &mut CudaViewMut<'_, f32>, src: &CudaView<'_, f32>) -> Result<(), String> {
        need("add_assign", src.len() >= dst.len())?;
        let n = dst.len() as i64;
        let mut l = self.launcher("add_assign");
        l.arg(dst).arg(src).arg(&n);
        Self::launch("add_assign", l, elementwise(n as usize))
    }

    /// Each row's maximum over its first `valid` columns (`model::kernels::row_max`).
    pub fn ce_row_max(&self, m: &mut CudaSlice<f32>, logits: &CudaSlice<f32>, (n, v, valid): (usize, usize, usize)) -> Result<(), String> {
        need("ce_row_max", logits.len() >= n * v && m.len() >= n && valid <= v)?;
        let (n32, v32, va32) = (n as i32, v as i32, valid as i32);
        let mut l = self.launcher("ce_row_max");
        l.arg(m).arg(logits).arg(&n32).arg(&v32).arg(&va32);
        Self::launch("ce_row_max", l, per_row(n))
    }

    /// `s = Σ exp(logits − m)` over the valid columns (`model::kernels::row_sum_exp`).
    pub fn ce_row_sum_exp(
        &self,
        s: &mut CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        m: &CudaSlice<f32>,
        (n, v, valid): (usize, usize, usize),
    ) -> Result<(), String> {
        need("ce_row_sum_exp", logits.len() >= n * v && m.len() >= n && s.len() >= n && valid <= v)?;
        let (n32, v32, va32) = (n as i32, v as i32, valid as i32);
        let mut l = self.launcher("ce_row_sum_exp");
        l.arg(s).arg(logits).arg(m).arg(&n32).arg(&v32).arg(&va32);
        Self::launch("ce_row_sum_exp", l, per_row(n))
    }

    /// The target's logit where `offset ≤ target < offset + valid`, else 0 (`target_logit`).
    pub fn ce_target_logit(
        &self,
        t: &mut CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        targets: &CudaSlice<u32>,
        (n, v, offset, valid): (usize, usize, usize, usize),
    ) -> Result<(), String> {
        need("ce_target_logit", logits.len() >= n * v && targets.len() >= n && t.len() >= n && valid <= v)?;
        let (n32, v32, o32, va32) = (n as i32, v as i32, offset as i32, valid as i32);
        let mut l = self.launcher("ce_target_logit");
        l.arg(t).arg(logits).arg(targets).arg(&n32).arg(&v32).arg(&o32).arg(&va32);
        Self::launch("ce_target_logit", l, elementwise(n))
    }

    /// In place `lse = m + ln(lse)`.
    pub fn ce_finish(&self, lse: &mut CudaSlice<f32>, m: &CudaSlice<f32>) -> Result<(), String> {
        let n = lse.len();
        need("ce_finish", m.len() >= n)?;
        let n32 = n as i32;
        let mut l = self.launcher("ce_finish");
        l.arg(lse).arg(m).arg(&n32);
        Self::launch("ce_finish", l, elementwise(n))
    }

    /// In place: `logits` become `scale · (softmax − onehot)` (`cross_entropy_bwd_inplace`).
    #[allow(clippy::too_many_arguments)]
    pub fn ce_bwd_inplace(
        &self,
        logits: &mut CudaSlice<f32>,
        lse: &CudaSlice<f32>,
        targets: &CudaSlice<u32>,
        (n, v, offset, valid): (usize, usize, usize, usize),
        scale: f32,
    ) -> Result<(), String> {
        need("ce_bwd_inplace", logits.len() >= n * v && lse.len() >= n && targets.len() >= n && valid <= v)?;
        let (n32, v32, o32, va32) = (n as i32, v as i32, offset as i32, valid as i32);
        let mut l = self.launcher("ce_bwd_inplace");
        l.arg(logits).arg(lse).arg(targets).arg(&n32).arg(&v32).arg(&o32).arg(&va32).arg(&scale);
        Self::launch("ce_bwd_inplace", l, per_row(n))
    }

    /// `rows` rows of scores `[rows, sk]` (rows `row0..` of the attention) become, in place,
    /// the causal softmax of `scale · s`; `lse[row0..]` their log-sum-exps.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_softmax(
        &self,
        s: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
        (q_pos, k_pos): (&CudaSlice<i32>, &CudaSlice<i32>),
        (rows, row0, sq, sk): (usize, usize, usize, usize),
        scale: f32,
    ) -> Result<(), String> {
        need("attn_softmax", s.len() >= rows * sk && lse.len() >= row0 + rows && q_pos.len() >= sq && k_pos.len() >= sk)?;
        let (sq32, sk32, r0) = (sq as i32, sk as i32, row0 as i64);
        let mut l = self.launcher("attn_softmax");
        l.arg(s).arg(lse).arg(q_pos).arg(k_pos).arg(&sq32).arg(&sk32).arg(&r0).arg(&scale);
        Self::launch("attn_softmax", l, per_row(rows))
    }

    /// The backward's probabilities, in place, from the scores and the saved `lse`.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_probs(
        &self,
        s: &mut CudaSlice<f32>,
        lse: &CudaSlice<f32>,
        (q_pos, k_pos): (&CudaSlice<i32>, &CudaSlice<i32>),
        (rows, row0, sq, sk): (usize, usize, usize, usize),
        scale: f32,
    ) -> Result<(), String> {
        need("attn_probs", s.len() >= rows * sk && lse.len() >= row0 + rows && q_pos.len() >= sq && k_pos.len() >= sk)?;
        let (sq32, sk32, r0) = (sq as i32, sk as i32, row0 as i64);
        let mut l = self.launcher("attn_probs");
        l.arg(s).arg(lse).arg(q_pos).arg(k_pos).arg(&sq32).arg(&sk32).arg(&r0).arg(&scale);
        Self::launch("attn_probs", l, per_row(rows))
    }

    /// In place `dp ← scale · p ∘ (dp − dd[row])` over `rows` rows of `sk`.
    pub fn attn_dscores(
        &self,
        dp: &mut CudaSlice<f32>,
        p: &CudaSlice<f32>,
        dd: &CudaSlice<f32>,
        (rows, row0, sk): (usize, usize, usize),
        scale: f32,
    ) -> Result<(), String> {
        need("attn_dscores", dp.len() >= rows * sk && p.len() >= rows * sk && dd.len() >= row0 + rows)?;
        let (sk32, r0) = (sk as i32, row0 as i64);
        let mut l = self.launcher("attn_dscores");
        l.arg(dp).arg(p).arg(dd).arg(&sk32).arg(&r0).arg(&scale);
        Self::launch("attn_dscores", l, per_row(rows))
    }

    /// `dd [rows] = rowsum(d_o ∘ o)` over rows of `hd`.
    pub fn attn_rowdot(
        &self,
        dd: &mut CudaSlice<f32>,
        d_o: &CudaSlice<f32>,
        o: &CudaSlice<f32>,
        (rows, hd): (usize, usize),
    ) -> Result<(), String> {
        need("attn_rowdot", dd.len() >= rows && d_o.len() >= rows * hd && o.len() >= rows * hd)?;
        let (rows64, hd32) = (rows as i64, hd as i32);
        let mut l = self.launcher("attn_bwd_rowdot");
        l.arg(dd).arg(d_o).arg(o).arg(&rows64).arg(&hd32);
        Self::launch("attn_bwd_rowdot", l, warp_per_row(rows))
    }

    /// One AdamW update of one tensor with the coefficients `optim::AdamW` computes.
    pub fn adamw(
        &self,
        p: &mut CudaViewMut<'_, f32>,
        m: &mut CudaViewMut<'_, f32>,
        v: &mut CudaViewMut<'_, f32>,
        g: &CudaView<'_, f32>,
        step: &crate::backend::AdamStep,
    ) -> Result<(), String> {
        let n = p.len();
        need("adamw", m.len() >= n && v.len() >= n && g.len() >= n)?;
        let (decay, b1, b2) = (step.decay as f32, step.b1 as f32, step.b2 as f32);
        let (step_size, bc2_sqrt, eps) = (step.step_size as f32, step.bc2_sqrt as f32, step.eps as f32);
        let n64 = n as i64;
        let mut l = self.launcher("adamw");
        l.arg(p).arg(m).arg(v).arg(g).arg(&n64).arg(&decay).arg(&b1).arg(&b2).arg(&step_size).arg(&bc2_sqrt).arg(&eps);
        Self::launch("adamw", l, elementwise(n))
    }

    /// Online-softmax merge of `(o_part, lse_part)` into `(o, lse)` (`merge_partial`).
    pub fn attn_merge(
        &self,
        o: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
        o_part: &CudaSlice<f32>,
        lse_part: &CudaSlice<f32>,
        hd: usize,
    ) -> Result<(), String> {
        let rows = lse.len();
        need("attn_merge", o.len() >= rows * hd && o_part.len() >= rows * hd && lse_part.len() >= rows)?;
        let (rows64, hd32) = (rows as i64, hd as i32);
        let mut l = self.launcher("attn_merge");
        l.arg(o).arg(lse).arg(o_part).arg(lse_part).arg(&rows64).arg(&hd32);
        Self::launch("attn_merge", l, warp_per_row(rows))
    }

    /// `x [n, d] =` the rows `ids − offset` of `table` this rank holds, else 0.
    #[allow(clippy::too_many_arguments)]
    pub fn embed_fwd(
        &self,
        x: &mut CudaSlice<f32>,
        table: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        (n, d, offset, valid): (usize, usize, usize, usize),
    ) -> Result<(), String> {
        need("embed_fwd", x.len() >= n * d && ids.len() >= n && table.len() >= valid * d)?;
        let (n64, d32, o32, va32) = (n as i64, d as i32, offset as i32, valid as i32);
        let mut l = self.launcher("embed_fwd");
        l.arg(x).arg(table).arg(ids).arg(&n64).arg(&d32).arg(&o32).arg(&va32);
        Self::launch("embed_fwd", l, elementwise(n * d))
    }

    /// `dtable[uniq[u] − offset] += Σ dx[order[starts[u]..starts[u+1]]]`, in token order.
    #[allow(clippy::too_many_arguments)]
    pub fn embed_bwd(
        &self,
        dtable: &mut CudaSlice<f32>,
        dx: &CudaSlice<f32>,
        (uniq, starts, order): (&CudaSlice<u32>, &CudaSlice<i32>, &CudaSlice<i32>),
        (d, offset, valid): (usize, usize, usize),
    ) -> Result<(), String> {
        let u = uniq.len();
        need("embed_bwd", starts.len() > u && dtable.len() >= valid * d && dx.len() >= order.len() * d)?;
        let (d32, o32, va32) = (d as i32, offset as i32, valid as i32);
        let mut l = self.launcher("embed_bwd");
        l.arg(dtable).arg(dx).arg(uniq).arg(starts).arg(order).arg(&d32).arg(&o32).arg(&va32);
        Self::launch("embed_bwd", l, per_row(u))
    }

    pub fn fill(&self, x: &mut CudaViewMut<'_, f32>, v: f32) -> Result<(), String> {
        let n = x.len() as i64;
        let mut l = self.launcher("fill_f32");
        l.arg(x).arg(&v).arg(&n);
        Self::launch("fill_f32", l, elementwise(n as usize))
    }

    pub fn scale(&self, x: &mut CudaViewMut<'_, f32>, c: f32) -> Result<(), String> {
        let n = x.len() as i64;
        let mut l = self.launcher("scale_f32");
        l.arg(x).arg(&c).arg(&n);
        Self::launch("scale_f32", l, elementwise(n as usize))
    }

    /// `Σ x²` in f64: per-block partials on the GPU, added in block order here.
    pub fn sum_sq(&self, x: &CudaView<'_, f32>, partials: &mut CudaSlice<f64>) -> Result<f64, String> {
        let n = x.len();
        let blocks = partials.len().min(n.div_ceil(BLOCK as usize)).max(1);
        let n64 = n as i64;
        let mut l = self.launcher("sum_sq_partial");
        l.arg(&mut *partials).arg(x).arg(&n64);
        Self::launch("sum_sq_partial", l, LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 })?;
        let host = self.download(partials)?;
        Ok(host[..blocks].iter().sum())
    }

    /// The first `src.len()` elements of `dst` become `src` in bf16 (`dst` may be longer: a
    /// scratch sized for the largest operand).
    pub fn to_bf16(&self, dst: &mut CudaSlice<u16>, src: &CudaSlice<f32>) -> Result<(), String> {
        need("to_bf16", dst.len() >= src.len())?;
        let n = src.len() as i64;
        let mut l = self.launcher("f32_to_bf16");
        l.arg(dst).arg(src).arg(&n);
        Self::launch("f32_to_bf16", l, elementwise(n as usize))
    }

    /// One NCCL communicator over the ranks of `group`: its rank 0 creates the unique id and
    /// broadcasts it over the group's MPI communicator; every rank then joins.
    pub fn nccl(&self, group: &Group) -> Result<Comm, String> {
        let mut id = vec![0u8; 128];
        if group.rank() == 0 {
            let fresh = Id::new().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
            id = fresh.internal().iter().map(|&c| c as u8).collect();
        }
        group.broadcast_bytes(0, &mut id);
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, &s) in internal.iter_mut().zip(&id) {
            *d = s as std::ffi::c_char;
        }
        Comm::from_rank(self.stream.clone(), group.rank(), group.size(), Id::uninit(internal))
            .map_err(|e| format!("ncclCommInitRank ({} ranks in {}): {e:?}", group.size(), group.name()))
    }

    /// `dst = src` on the device (same lengths).
    pub fn copy(&self, dst: &mut CudaViewMut<'_, f32>, src: &CudaView<'_, f32>) -> Result<(), String> {
        need("copy", src.len() == dst.len())?;
        self.stream.memcpy_dtod(src, dst).map_err(err("device copy"))
    }

    pub fn synchronize(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(err("synchronizing the stream"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where there is no GPU (CI), opening one is an error that names what is missing, not a
    /// panic; where there is one, it opens and every backend operation matches the host's.
    #[test]
    fn opening_a_gpu_works_or_says_what_is_missing() {
        match backend::GpuBackend::open(0, crate::backend::Precision::Fp32) {
            Ok(gpu) => {
                for c in check::check_backend(&gpu) {
                    assert!(c.ok(), "{}: relative error {:e} > {:e}", c.what, c.rel_err, c.tol);
                }
            }
            Err(e) => assert!(e.contains("cannot load") || e.contains("no GPU"), "{e}"),
        }
    }

    /// Every `__global__` of the source is listed (so `Gpu::open` loads it) and nothing else.
    #[test]
    fn the_kernel_list_is_the_source_s_kernels() {
        let mut in_source: Vec<&str> =
            SOURCE.split("extern \"C\" __global__ void ").skip(1).map(|rest| rest.split('(').next().unwrap().trim()).collect();
        let mut listed = KERNELS.to_vec();
        in_source.sort_unstable();
        listed.sort_unstable();
        assert_eq!(in_source, listed);
    }

    /// NVRTC compiles every kernel for the GPUs this program targets (A100 `sm_80`, H100/H200
    /// `sm_90`), and `ptxas` assembles the PTX into machine code without spilling registers to
    /// local memory: checked wherever NVRTC can be loaded (and `ptxas` is on `PATH`), no GPU
    /// needed. CI installs both from PyPI (`nvidia-cuda-nvrtc-cu12`, `nvidia-cuda-nvcc-cu12`)
    /// and sets `NDTRAIN_REQUIRE_NVRTC=1`, so there the test cannot pass by finding no compiler.
    #[test]
    fn nvrtc_compiles_and_ptxas_assembles_every_kernel_for_sm80_and_sm90() {
        let required = std::env::var_os("NDTRAIN_REQUIRE_NVRTC").is_some();
        if !library_loadable("nvrtc") {
            assert!(!required, "NDTRAIN_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)");
            eprintln!("NVRTC not loadable here: compile check skipped (set NDTRAIN_REQUIRE_NVRTC=1 to require it)");
            return;
        }
        let ptxas = std::process::Command::new("ptxas").arg("--version").output().is_ok_and(|o| o.status.success());
        assert!(ptxas || !required, "NDTRAIN_REQUIRE_NVRTC is set but ptxas is not on PATH");
        let dir = tempfile::tempdir().unwrap();
        for arch in ["sm_80", "sm_90"] {
            let ptx = compile(arch).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            assert!(text.contains(&format!(".target {arch}")), "{arch}: PTX for another target");
            for k in KERNELS {
                assert!(text.contains(&format!(".entry {k}(")), "{arch}: no entry point {k} in the PTX");
            }
            if !ptxas {
                continue;
            }
            let file = dir.path().join(format!("kernels_{arch}.ptx"));
            std::fs::write(&file, &text).unwrap();
            let out = std::process::Command::new("ptxas")
                .args([&format!("-arch={arch}"), "-v", "-o"])
                .arg(dir.path().join(format!("kernels_{arch}.cubin")))
                .arg(&file)
                .output()
                .unwrap();
            let log = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{arch}: ptxas failed:\n{log}");
            eprintln!("ptxas {arch}:\n{log}");
            // Every kernel reports "0 bytes spill stores, 0 bytes spill loads".
            let spills: Vec<&str> =
                log.lines().filter(|l| l.contains("spill") && !l.contains("0 bytes spill stores, 0 bytes spill loads")).collect();
            assert!(spills.is_empty(), "{arch}: register spills:\n{}", spills.join("\n"));
        }
    }
}
