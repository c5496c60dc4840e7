//! cuBLAS on the rank's GPU: the row-major GEMMs of the linear layers and of attention,
//! f32 or bf16 operands, f32 accumulation, optionally TF32, through the column-major transpose
//! identity.

use super::{need, Gpu};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::GemmConfig;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

/// The column-major cuBLAS call that computes the row-major `c [m, n] = op(a) · op(b) + beta·c`
/// as `cᵀ = op(b)ᵀ · op(a)ᵀ` (its `A` is our `b`, its `B` our `a`).
pub fn gemm_config(m: usize, n: usize, k: usize, (ta, tb): (bool, bool), beta: f32) -> GemmConfig<f32> {
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
}
