//! NVIDIA GPUs through `cudarc` (Cargo feature `cuda`). The only module that names `cudarc`.
//!
//! What exists (issue 10, in pieces): opening the rank's GPU (chosen from its node-local
//! rank), cuBLAS GEMMs in fp32 and bf16 (f32 accumulation), every kernel of the decoder step
//! as CUDA C (`kernels.cu`: RMSNorm, RoPE with the head transposes, SwiGLU, residual adds,
//! cross entropy, flash-style attention forward and backward, AdamW, bf16 conversions)
//! compiled once at start by NVRTC for the device's architecture, NCCL communicators
//! bootstrapped over an MPI group, and `ndtrain gpu-check` ([`check`]), which runs each of
//! them against the CPU reference. The model does not run on it yet: the backend boundary that
//! lets the model, the parallel strategies and the optimiser run on either is the next piece
//! (`docs/gpu.md`).
//!
//! The CUDA libraries are loaded at run time (`dynamic-loading`), so this builds on machines
//! without CUDA; where a library is missing, [`Gpu::open`] returns an error that names it
//! instead of letting `cudarc` panic.

pub mod check;

use crate::comm::Group;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchArgs, LaunchConfig,
    PushKernelArg,
};
use cudarc::nccl::{Comm, Id};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::collections::HashMap;
use std::sync::Arc;

/// The kernels' CUDA C source; every `extern "C" __global__` in it is listed in [`KERNELS`].
pub const SOURCE: &str = include_str!("kernels.cu");

/// The entry points of [`SOURCE`], loaded by name at start.
pub const KERNELS: [&str; 17] = [
    "rmsnorm_fwd",
    "rmsnorm_bwd_dx",
    "rmsnorm_bwd_dw",
    "to_heads_rope",
    "from_heads_rope",
    "swiglu_fwd",
    "swiglu_bwd",
    "add_assign",
    "ce_row_stats",
    "ce_bwd_inplace",
    "attn_fwd",
    "attn_bwd_rowdot",
    "attn_bwd_dq",
    "attn_bwd_dkv",
    "adamw",
    "f32_to_bf16",
    "bf16_to_f32",
];

/// Threads per block of the elementwise kernels and of a row kernel (RMSNorm, cross entropy).
const BLOCK: u32 = 256;

/// Warps per block of the attention kernels (one warp per query or key row).
const ATTN_WARPS: u32 = 8;

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

/// The sizes of one attention call as the kernels take them (`model::attention::AttnDims`
/// plus the softmax scale), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub b: i32,
    pub h: i32,
    pub kv: i32,
    pub sq: i32,
    pub sk: i32,
    pub hd: i32,
    pub scale: f32,
}

// SAFETY: a plain `repr(C)` struct of 32-bit numbers, laid out as `struct AttnDims` in
// kernels.cu.
unsafe impl DeviceRepr for AttnDims {}

impl AttnDims {
    pub fn new(d: crate::model::attention::AttnDims) -> Result<AttnDims, String> {
        let hd_max = 256;
        if d.hd > hd_max || d.hd % 2 != 0 {
            return Err(format!("the GPU attention kernels take an even head_dim ≤ {hd_max}, not {}", d.hd));
        }
        let i = |x: usize| i32::try_from(x).map_err(|_| format!("attention size {x} does not fit the GPU kernels' 32-bit indices"));
        Ok(AttnDims { b: i(d.b)?, h: i(d.h)?, kv: i(d.kv)?, sq: i(d.sq)?, sk: i(d.sk)?, hd: i(d.hd)?, scale: 1.0 / (d.hd as f32).sqrt() })
    }

    fn q_rows(&self) -> usize {
        (self.b * self.h * self.sq) as usize
    }

    fn k_rows(&self) -> usize {
        (self.b * self.kv * self.sk) as usize
    }
}

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
    LaunchConfig { grid_dim: ((n as u32).div_ceil(BLOCK), 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

fn warp_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: ((rows as u32).div_ceil(ATTN_WARPS), 1, 1), block_dim: (32 * ATTN_WARPS, 1, 1), shared_mem_bytes: 0 }
}

/// Buffer-size preconditions of a launch: the kernels index by the sizes they are given.
fn need(what: &str, ok: bool) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(format!("{what}: a buffer is smaller than the sizes passed"))
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

    /// Row-major `c [m, n] = a [m, k] · b [k, n]` through cuBLAS (column-major, so it computes
    /// `cᵀ = bᵀ · aᵀ`, which is the same memory).
    pub fn matmul(
        &self,
        c: &mut CudaSlice<f32>,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), String> {
        need("matmul", b.len() >= k * n && a.len() >= m * k && c.len() >= m * n)?;
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n as i32,
            n: m as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: n as i32,
            ldb: k as i32,
            beta: 0.0f32,
            ldc: n as i32,
        };
        // SAFETY: the slices hold k·n, m·k and m·n elements (checked), as the config says.
        unsafe { self.blas.gemm(cfg, b, a, c) }.map_err(|e| format!("cuBLAS sgemm: {e:?}"))
    }

    /// Mixed precision: row-major `c [m, n] (f32) = a [m, k] · b [k, n]` with `a`, `b` in bf16
    /// (bit patterns in `u16`) and f32 accumulation (`cublasGemmEx`, tensor cores where the
    /// GPU has them).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_bf16(
        &self,
        c: &mut CudaSlice<f32>,
        a: &CudaSlice<u16>,
        b: &CudaSlice<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), String> {
        need("matmul_bf16", b.len() >= k * n && a.len() >= m * k && c.len() >= m * n)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (pa, _ra) = a.device_ptr(&self.stream);
        let (pb, _rb) = b.device_ptr(&self.stream);
        let (pc, _rc) = c.device_ptr_mut(&self.stream);
        // SAFETY: device pointers of buffers of the checked sizes, on the handle's stream; the
        // scalars are f32 as the compute type requires.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_N,
                cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                (&alpha) as *const f32 as *const _,
                pb as *const _,
                cudaDataType::CUDA_R_16BF,
                n as i32,
                pa as *const _,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                (&beta) as *const f32 as *const _,
                pc as *mut _,
                cudaDataType::CUDA_R_32F,
                n as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| format!("cublasGemmEx (bf16): {e:?}"))
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

    /// `dst += src` (the residual adds).
    pub fn add_assign(&self, dst: &mut CudaSlice<f32>, src: &CudaSlice<f32>) -> Result<(), String> {
        need("add_assign", src.len() >= dst.len())?;
        let n = dst.len() as i64;
        let mut l = self.launcher("add_assign");
        l.arg(dst).arg(src).arg(&n);
        Self::launch("add_assign", l, elementwise(n as usize))
    }

    /// Cross-entropy statistics of each row of `logits [n, v]` over its first `valid` columns:
    /// max, Σ exp(x − max), and the target's logit where `offset ≤ target < offset + valid`
    /// (`row_max`, `row_sum_exp`, `target_logit` of `model::kernels`).
    #[allow(clippy::too_many_arguments)]
    pub fn ce_row_stats(
        &self,
        (m, sum_exp, t_logit): (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &mut CudaSlice<f32>),
        logits: &CudaSlice<f32>,
        targets: &CudaSlice<u32>,
        (n, v, offset, valid): (usize, usize, usize, usize),
    ) -> Result<(), String> {
        need(
            "ce_row_stats",
            logits.len() >= n * v && targets.len() >= n && m.len() >= n && sum_exp.len() >= n && t_logit.len() >= n && valid <= v,
        )?;
        let (n32, v32, o32, va32) = (n as i32, v as i32, offset as i32, valid as i32);
        let mut l = self.launcher("ce_row_stats");
        l.arg(m).arg(sum_exp).arg(t_logit).arg(logits).arg(targets).arg(&n32).arg(&v32).arg(&o32).arg(&va32);
        Self::launch("ce_row_stats", l, per_row(n))
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

    /// Attention forward (`model::attention::attention_fwd`): `o [B, H, Sq, hd]`,
    /// `lse [B, H, Sq]`; positions are global, causality by position.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_fwd(
        &self,
        o: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
        (q, k, v): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        q_pos: &CudaSlice<i32>,
        k_pos: &CudaSlice<i32>,
        dm: AttnDims,
    ) -> Result<(), String> {
        let (rows, hd) = (dm.q_rows(), dm.hd as usize);
        let kr = dm.k_rows();
        need(
            "attention_fwd",
            o.len() >= rows * hd
                && lse.len() >= rows
                && q.len() >= rows * hd
                && k.len() >= kr * hd
                && v.len() >= kr * hd
                && q_pos.len() >= dm.sq as usize
                && k_pos.len() >= dm.sk as usize,
        )?;
        let mut l = self.launcher("attn_fwd");
        l.arg(o).arg(lse).arg(q).arg(k).arg(v).arg(q_pos).arg(k_pos).arg(&dm);
        Self::launch("attn_fwd", l, warp_per_row(rows))
    }

    /// Attention backward (`model::attention::attention_bwd`): overwrites `dq`, `dk`, `dv`;
    /// `dd [B, H, Sq]` is scratch for `rowsum(dO ∘ O)`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_bwd(
        &self,
        (dq, dk, dv, dd): (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &mut CudaSlice<f32>, &mut CudaSlice<f32>),
        d_o: &CudaSlice<f32>,
        (q, k, v, o, lse): (&Buf, &Buf, &Buf, &Buf, &Buf),
        q_pos: &CudaSlice<i32>,
        k_pos: &CudaSlice<i32>,
        dm: AttnDims,
    ) -> Result<(), String> {
        let (rows, kr, hd) = (dm.q_rows(), dm.k_rows(), dm.hd as usize);
        need(
            "attention_bwd",
            [dq.len(), q.len(), o.len(), d_o.len()].iter().all(|&x| x >= rows * hd)
                && [dk.len(), dv.len(), k.len(), v.len()].iter().all(|&x| x >= kr * hd)
                && lse.len() >= rows
                && dd.len() >= rows
                && q_pos.len() >= dm.sq as usize
                && k_pos.len() >= dm.sk as usize,
        )?;
        let (rows64, hd32) = (rows as i64, dm.hd);
        let mut l = self.launcher("attn_bwd_rowdot");
        l.arg(&mut *dd).arg(d_o).arg(o).arg(&rows64).arg(&hd32);
        Self::launch("attn_bwd_rowdot", l, warp_per_row(rows))?;
        let mut l = self.launcher("attn_bwd_dq");
        l.arg(dq).arg(q).arg(k).arg(v).arg(d_o).arg(lse).arg(&*dd).arg(q_pos).arg(k_pos).arg(&dm);
        Self::launch("attn_bwd_dq", l, warp_per_row(rows))?;
        let mut l = self.launcher("attn_bwd_dkv");
        l.arg(dk).arg(dv).arg(q).arg(k).arg(v).arg(d_o).arg(lse).arg(&*dd).arg(q_pos).arg(k_pos).arg(&dm);
        Self::launch("attn_bwd_dkv", l, warp_per_row(kr))
    }

    /// One AdamW update of one tensor, the coefficients computed as `optim::AdamW` does.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw(
        &self,
        p: &mut CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        t: u64,
        lr: f64,
        (beta1, beta2, eps, weight_decay): (f64, f64, f64, f64),
    ) -> Result<(), String> {
        let n = p.len();
        need("adamw", m.len() >= n && v.len() >= n && g.len() >= n)?;
        let bc1 = 1.0 - beta1.powi(t as i32);
        let bc2 = 1.0 - beta2.powi(t as i32);
        let (decay, b1, b2) = ((1.0 - lr * weight_decay) as f32, beta1 as f32, beta2 as f32);
        let (step_size, bc2_sqrt, eps) = ((lr / bc1) as f32, bc2.sqrt() as f32, eps as f32);
        let n64 = n as i64;
        let mut l = self.launcher("adamw");
        l.arg(p).arg(m).arg(v).arg(g).arg(&n64).arg(&decay).arg(&b1).arg(&b2).arg(&step_size).arg(&bc2_sqrt).arg(&eps);
        Self::launch("adamw", l, elementwise(n))
    }

    /// f32 → bf16 (round to nearest even), for the bf16 operands of mixed precision.
    pub fn to_bf16(&self, dst: &mut CudaSlice<u16>, src: &CudaSlice<f32>) -> Result<(), String> {
        need("to_bf16", src.len() >= dst.len())?;
        let n = dst.len() as i64;
        let mut l = self.launcher("f32_to_bf16");
        l.arg(dst).arg(src).arg(&n);
        Self::launch("f32_to_bf16", l, elementwise(n as usize))
    }

    pub fn from_bf16(&self, dst: &mut CudaSlice<f32>, src: &CudaSlice<u16>) -> Result<(), String> {
        need("from_bf16", src.len() >= dst.len())?;
        let n = dst.len() as i64;
        let mut l = self.launcher("bf16_to_f32");
        l.arg(dst).arg(src).arg(&n);
        Self::launch("bf16_to_f32", l, elementwise(n as usize))
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

    pub fn synchronize(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(err("synchronizing the stream"))
    }
}

/// f32 → bf16 → f32 on the CPU, rounding to nearest even as `f32_to_bf16` does: the CPU side
/// of the bf16 checks.
pub fn round_bf16(x: f32) -> f32 {
    let u = x.to_bits();
    if x.is_nan() {
        return f32::from_bits((u | 0x0040_0000) & 0xffff_0000);
    }
    f32::from_bits((u.wrapping_add(0x7fff + ((u >> 16) & 1))) & 0xffff_0000)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where there is no GPU (CI), opening one is an error that names what is missing, not a
    /// panic; where there is one, it opens and every kernel matches the CPU.
    #[test]
    fn opening_a_gpu_works_or_says_what_is_missing() {
        match Gpu::open(0) {
            Ok(gpu) => {
                for c in check::check_kernels(&gpu).unwrap() {
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

    #[test]
    fn bf16_rounding_is_nearest_even() {
        assert_eq!(round_bf16(1.0), 1.0);
        // 1 + 2⁻⁸ lies halfway between 1 and 1 + 2⁻⁷: ties go to the even mantissa, 1.
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3·2⁻⁸ lies halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶: the even one is 1 + 2⁻⁶.
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert_eq!(round_bf16(-2.5), -2.5);
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
        for x in check::inputs(10_000, 3) {
            assert!(((round_bf16(x) - x) / x).abs() <= 1.0 / 256.0, "{x}");
        }
    }
}
