//! NVIDIA GPUs through `cudarc` (Cargo feature `cuda`). The only module that names `cudarc`.
//!
//! This is the first piece of the GPU backend (issue 10): opening the rank's GPU (chosen from
//! its node-local rank), cuBLAS GEMMs, the NVRTC kernels compiled once at start for the
//! device's architecture, NCCL communicators bootstrapped over an MPI group, and `ndtrain
//! gpu-check`, which runs each of them against the CPU reference and says where they differ.
//! The model does not run on it yet: the backend boundary that lets the model, the parallel
//! strategies and the optimiser run on either is the next piece (`docs/gpu.md`).
//!
//! The CUDA libraries are loaded at run time (`dynamic-loading`), so this builds on machines
//! without CUDA; where a library is missing, [`Gpu::open`] returns an error that names it
//! instead of letting `cudarc` panic.

use crate::comm::Group;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nccl::{Comm, Id, ReduceOp};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use std::sync::Arc;

/// The kernels, compiled by NVRTC at start-up for the device's architecture. Each mirrors a CPU
/// kernel of `model::kernels` / `optim` (the reference `gpu-check` compares against).
const KERNELS: &str = r#"
extern "C" __global__ void rmsnorm_fwd(float* y, float* rstd, const float* x, const float* w, int n, int d, float eps) {
    int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + (size_t)row * d;
    float* yr = y + (size_t)row * d;
    float s = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) s += xr[j] * xr[j];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __shared__ float warp_sums[32];
    __shared__ float r;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    if (lane == 0) warp_sums[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < warps ? warp_sums[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) { r = 1.0f / sqrtf(s / (float)d + eps); rstd[row] = r; }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < d; j += blockDim.x) yr[j] = w[j] * (xr[j] * r);
}

extern "C" __global__ void swiglu_fwd(float* h, const float* gate, const float* up, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float g = gate[i]; h[i] = g / (1.0f + expf(-g)) * up[i]; }
}

extern "C" __global__ void swiglu_bwd(float* dgate, float* dup, const float* dh, const float* gate, const float* up, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i], sig = 1.0f / (1.0f + expf(-g));
        dup[i] = dh[i] * g * sig;
        dgate[i] = dh[i] * up[i] * sig * (1.0f + g * (1.0f - sig));
    }
}

extern "C" __global__ void adamw(float* p, float* m, float* v, const float* g, long long n, float decay, float b1, float b2,
                                 float step_size, float bc2_sqrt, float eps) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float gi = g[i];
        p[i] *= decay;
        m[i] = b1 * m[i] + (1.0f - b1) * gi;
        v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
        p[i] -= step_size * m[i] / (sqrtf(v[i]) / bc2_sqrt + eps);
    }
}
"#;

/// Threads per block of the elementwise kernels and of a RMSNorm row.
const BLOCK: u32 = 256;

/// The CUDA libraries this backend loads, with the names `cudarc` looks for.
const LIBRARIES: [(&str, &str); 4] = [("cuda", "the NVIDIA driver"), ("cublas", "cuBLAS"), ("nvrtc", "NVRTC"), ("nccl", "NCCL")];

/// Every CUDA library the backend needs can be loaded, or an error naming the missing ones.
pub fn libraries_present() -> Result<(), String> {
    let missing: Vec<String> = LIBRARIES
        .iter()
        .filter(|(lib, _)| !cudarc::get_lib_name_candidates(lib).iter().any(|name| loadable(name)))
        .map(|(lib, what)| format!("{what} (lib{lib}.so)"))
        .collect();
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

fn err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

/// The rank's GPU: context, stream, cuBLAS handle and the compiled kernels.
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    rmsnorm_fwd: CudaFunction,
    swiglu_fwd: CudaFunction,
    swiglu_bwd: CudaFunction,
    adamw: CudaFunction,
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
        let arch: &'static str = Box::leak(format!("sm_{}{}", cc.0, cc.1).into_boxed_str());
        let ptx = compile_ptx_with_opts(KERNELS, CompileOptions { arch: Some(arch), ..Default::default() })
            .map_err(|e| format!("NVRTC could not compile the kernels for {arch}: {e:?}"))?;
        let module = ctx.load_module(ptx).map_err(err("loading the compiled kernels"))?;
        let f = |name: &str| module.load_function(name).map_err(err(name));
        Ok(Gpu {
            ordinal,
            name,
            cc,
            rmsnorm_fwd: f("rmsnorm_fwd")?,
            swiglu_fwd: f("swiglu_fwd")?,
            swiglu_bwd: f("swiglu_bwd")?,
            adamw: f("adamw")?,
            stream,
            blas,
        })
    }

    pub fn upload(&self, host: &[f32]) -> Result<CudaSlice<f32>, String> {
        self.stream.clone_htod(host).map_err(err("copying to the GPU"))
    }

    pub fn download(&self, dev: &CudaSlice<f32>) -> Result<Vec<f32>, String> {
        self.stream.clone_dtoh(dev).map_err(err("copying from the GPU"))
    }

    pub fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, String> {
        self.stream.alloc_zeros::<f32>(n).map_err(err("allocating on the GPU"))
    }

    fn elementwise(n: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: ((n as u32).div_ceil(BLOCK), 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
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
        assert!(b.len() >= k * n && a.len() >= m * k && c.len() >= m * n, "matmul: buffer too small");
        unsafe { self.blas.gemm(cfg, b, a, c) }.map_err(|e| format!("cuBLAS sgemm: {e:?}"))
    }

    /// RMSNorm forward of `n` rows of `d`, one block per row (as `model::kernels::rmsnorm_fwd`).
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
        let (n32, d32) = (n as i32, d as i32);
        let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        let mut l = self.stream.launch_builder(&self.rmsnorm_fwd);
        l.arg(y).arg(rstd).arg(x).arg(w).arg(&n32).arg(&d32).arg(&eps);
        // SAFETY: the argument list matches the kernel's signature; sizes are n·d, n, n·d, d.
        unsafe { l.launch(cfg) }.map(|_| ()).map_err(err("rmsnorm_fwd"))
    }

    pub fn swiglu_fwd(&self, h: &mut CudaSlice<f32>, gate: &CudaSlice<f32>, up: &CudaSlice<f32>) -> Result<(), String> {
        let n = h.len() as i64;
        let mut l = self.stream.launch_builder(&self.swiglu_fwd);
        l.arg(h).arg(gate).arg(up).arg(&n);
        // SAFETY: matches `swiglu_fwd(float*, const float*, const float*, long long)`.
        unsafe { l.launch(Self::elementwise(n as usize)) }.map(|_| ()).map_err(err("swiglu_fwd"))
    }

    pub fn swiglu_bwd(
        &self,
        dgate: &mut CudaSlice<f32>,
        dup: &mut CudaSlice<f32>,
        dh: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
    ) -> Result<(), String> {
        let n = dgate.len() as i64;
        let mut l = self.stream.launch_builder(&self.swiglu_bwd);
        l.arg(dgate).arg(dup).arg(dh).arg(gate).arg(up).arg(&n);
        // SAFETY: matches the kernel's signature; every buffer holds n elements.
        unsafe { l.launch(Self::elementwise(n as usize)) }.map(|_| ()).map_err(err("swiglu_bwd"))
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
        let n = p.len() as i64;
        let bc1 = 1.0 - beta1.powi(t as i32);
        let bc2 = 1.0 - beta2.powi(t as i32);
        let (decay, b1, b2) = ((1.0 - lr * weight_decay) as f32, beta1 as f32, beta2 as f32);
        let (step_size, bc2_sqrt, eps) = ((lr / bc1) as f32, bc2.sqrt() as f32, eps as f32);
        let mut l = self.stream.launch_builder(&self.adamw);
        l.arg(p).arg(m).arg(v).arg(g).arg(&n).arg(&decay).arg(&b1).arg(&b2).arg(&step_size).arg(&bc2_sqrt).arg(&eps);
        // SAFETY: matches the kernel's signature; p, m, v, g hold n elements each.
        unsafe { l.launch(Self::elementwise(n as usize)) }.map(|_| ()).map_err(err("adamw"))
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

/// The result of one `gpu-check` comparison.
pub struct Check {
    pub what: &'static str,
    /// Largest |gpu − cpu| over the largest |cpu|.
    pub rel_err: f64,
    pub tol: f64,
}

impl Check {
    pub fn ok(&self) -> bool {
        self.rel_err <= self.tol
    }
}

/// fp32 GPU kernels against the CPU reference: the same maths in another summation order
/// (cuBLAS's blocking, warp reductions) and with the GPU's `expf`/`sqrtf`.
pub const F32_TOL: f64 = 1e-5;

fn rel_err(gpu: &[f32], cpu: &[f32]) -> f64 {
    let scale = cpu.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64)).max(f64::MIN_POSITIVE);
    gpu.iter().zip(cpu).fold(0.0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs())) / scale
}

/// Deterministic inputs in [−1, 1).
fn inputs(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Runs every kernel on the GPU and on the CPU with the same inputs.
pub fn check_kernels(gpu: &Gpu) -> Result<Vec<Check>, String> {
    use crate::model::kernels;
    use crate::real::{matmul, Mat, MatMut};
    let mut out = vec![];

    let (m, n, k) = (257, 384, 193);
    let (a, b) = (inputs(m * k, 1), inputs(k * n, 2));
    let mut c_cpu = vec![0.0f32; m * n];
    matmul(MatMut::rm(&mut c_cpu, m, n), Mat::rm(&a, m, k), Mat::rm(&b, k, n), false);
    let mut c = gpu.zeros(m * n)?;
    gpu.matmul(&mut c, &gpu.upload(&a)?, &gpu.upload(&b)?, m, n, k)?;
    out.push(Check { what: "cuBLAS sgemm [257×193]·[193×384]", rel_err: rel_err(&gpu.download(&c)?, &c_cpu), tol: F32_TOL });

    let (rows, d, eps) = (64, 1000, 1e-5f32);
    let (x, w) = (inputs(rows * d, 3), inputs(d, 4));
    let (mut y_cpu, mut r_cpu) = (vec![0.0f32; rows * d], vec![0.0f32; rows]);
    kernels::rmsnorm_fwd(&mut y_cpu, &mut r_cpu, &x, &w, d, eps as f64);
    let (mut y, mut r) = (gpu.zeros(rows * d)?, gpu.zeros(rows)?);
    gpu.rmsnorm_fwd(&mut y, &mut r, &gpu.upload(&x)?, &gpu.upload(&w)?, rows, d, eps)?;
    out.push(Check { what: "rmsnorm_fwd y", rel_err: rel_err(&gpu.download(&y)?, &y_cpu), tol: F32_TOL });
    out.push(Check { what: "rmsnorm_fwd rstd", rel_err: rel_err(&gpu.download(&r)?, &r_cpu), tol: F32_TOL });

    let len = 100_003;
    let (g, u, dh) = (inputs(len, 5).iter().map(|x| 8.0 * x).collect::<Vec<_>>(), inputs(len, 6), inputs(len, 7));
    let mut h_cpu = vec![0.0f32; len];
    kernels::swiglu_fwd(&mut h_cpu, &g, &u);
    let (gd, ud) = (gpu.upload(&g)?, gpu.upload(&u)?);
    let mut h = gpu.zeros(len)?;
    gpu.swiglu_fwd(&mut h, &gd, &ud)?;
    out.push(Check { what: "swiglu_fwd", rel_err: rel_err(&gpu.download(&h)?, &h_cpu), tol: F32_TOL });
    let (mut dg_cpu, mut du_cpu) = (vec![0.0f32; len], vec![0.0f32; len]);
    kernels::swiglu_bwd(&mut dg_cpu, &mut du_cpu, &dh, &g, &u);
    let (mut dg, mut du) = (gpu.zeros(len)?, gpu.zeros(len)?);
    gpu.swiglu_bwd(&mut dg, &mut du, &gpu.upload(&dh)?, &gd, &ud)?;
    out.push(Check { what: "swiglu_bwd dgate", rel_err: rel_err(&gpu.download(&dg)?, &dg_cpu), tol: F32_TOL });
    out.push(Check { what: "swiglu_bwd dup", rel_err: rel_err(&gpu.download(&du)?, &du_cpu), tol: F32_TOL });

    // Three AdamW steps of one decayed tensor, against `optim::AdamW`.
    let cfg = crate::config::OptimCfg::default();
    let mut opt = crate::optim::AdamW::<f32>::for_slots(&[(len, true)], &cfg);
    let mut p_cpu = inputs(len, 8);
    let (mut p, mut mm, mut vv) = (gpu.upload(&p_cpu)?, gpu.zeros(len)?, gpu.zeros(len)?);
    for t in 1..=3u64 {
        let grad = inputs(len, 100 + t);
        let lr = 1e-3 * t as f64;
        opt.step_slots(vec![&mut p_cpu[..]], &[&grad[..]], lr);
        gpu.adamw(&mut p, &mut mm, &mut vv, &gpu.upload(&grad)?, t, lr, (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay))?;
    }
    out.push(Check { what: "adamw, 3 steps: parameters", rel_err: rel_err(&gpu.download(&p)?, &p_cpu), tol: F32_TOL });
    out.push(Check { what: "adamw, 3 steps: exp_avg_sq", rel_err: rel_err(&gpu.download(&vv)?, &opt.exp_avg_sq[0]), tol: F32_TOL });
    gpu.synchronize()?;
    Ok(out)
}

/// An NCCL all-reduce over `group` against the sum every rank can compute: rank `r` sends
/// `r + 1 + i/n`; the result must be `Σ_r (r + 1) + size·i/n` exactly (small integers and
/// the same fraction on every rank).
pub fn check_nccl(gpu: &Gpu, group: &Group) -> Result<Check, String> {
    let comm = gpu.nccl(group)?;
    let n = 1 << 20;
    let mine: Vec<f32> = (0..n).map(|i| (group.rank() + 1) as f32 + (i % 8) as f32 / 8.0).collect();
    let mut buf = gpu.upload(&mine)?;
    comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum).map_err(|e| format!("ncclAllReduce: {e:?}"))?;
    let got = gpu.download(&buf)?;
    let size = group.size();
    let want: Vec<f32> = (0..n).map(|i| (size * (size + 1) / 2) as f32 + size as f32 * (i % 8) as f32 / 8.0).collect();
    Ok(Check { what: "NCCL all-reduce (sum) over the world, 4 MiB", rel_err: rel_err(&got, &want), tol: 0.0 })
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
                for c in check_kernels(&gpu).unwrap() {
                    assert!(c.ok(), "{}: relative error {:e} > {:e}", c.what, c.rel_err, c.tol);
                }
            }
            Err(e) => assert!(e.contains("cannot load") || e.contains("no GPU"), "{e}"),
        }
    }

    #[test]
    fn test_inputs_are_deterministic_and_in_range() {
        let a = inputs(1000, 9);
        assert_eq!(a, inputs(1000, 9));
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        assert!(rel_err(&[1.0, 2.0], &[1.0, 2.0]) == 0.0 && rel_err(&[1.0, 2.5], &[1.0, 2.0]) == 0.25);
    }
}
