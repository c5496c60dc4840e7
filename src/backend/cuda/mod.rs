//! NVIDIA GPUs through `cudarc` (Cargo feature `cuda`). The only module that names `cudarc`.
//!
//! Opening the rank's GPU (chosen from its node-local rank), cuBLAS GEMMs (strided-batched,
//! f32 or bf16 operands, f32 accumulation, optionally TF32), the decoder's kernels as CUDA C
//! (`kernels.cu`: RMSNorm, RoPE with the head transposes, SwiGLU, residual adds, embedding,
//! cross entropy, attention's softmax and score gradients, AdamW, the gradient norm, bf16
//! conversions) compiled once at start by NVRTC for the device's architecture, the
//! [`backend::GpuBackend`] that runs the model and the training loop on them, and the device
//! side of collectives ([`comm`]: a communication stream, events, NCCL communicators' calls on
//! device buffers, device addresses for a CUDA-aware MPI). Which collectives run over which
//! ranks is `parallel::collective`'s; `ndtrain gpu-check` (`tools::gpu_check`) runs every
//! backend operation against the host backend (`docs/gpu.md`). Device ops only: nothing here
//! knows of MPI, the model or the training loop.
//!
//! This file: the kernel list, the libraries, NVRTC compilation and the [`Gpu`] handle; the
//! handle's operations are in `device` (opening, memory), `blas` (cuBLAS) and `launch` (one
//! launch wrapper per kernel of `kernels.cu`).
//!
//! The CUDA libraries are loaded at run time (`dynamic-loading`), so this builds on machines
//! without CUDA; where a library is missing, [`Gpu::open`] returns an error that names it
//! instead of letting `cudarc` panic.

pub mod attention;
pub mod backend;
mod blas;
pub mod comm;
mod device;
mod launch;
pub mod nccl;
mod order;

pub use blas::{gemm_config, Operand};
pub use device::{device_count, memory_pools, visible_gpus};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::collections::HashMap;
use std::sync::Arc;

/// The kernels' CUDA C source; every `extern "C" __global__` in it is listed in [`KERNELS`].
pub const SOURCE: &str = include_str!("kernels.cu");

/// The entry points of [`SOURCE`], loaded by name at start.
pub const KERNELS: [&str; 26] = [
    "rmsnorm_fwd",
    "rmsnorm_bwd_dx",
    "rmsnorm_bwd_dw_partial",
    "rmsnorm_bwd_dw_sum",
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

/// Rows per tile of RMSNorm's weight gradient (`rmsnorm_bwd_dw_partial`).
pub const DW_TILE_ROWS: usize = 128;

/// The tiles of RMSNorm's weight gradient over `n` rows (the partial sums' rows).
pub fn dw_tiles(n: usize) -> usize {
    n.div_ceil(DW_TILE_ROWS).max(1)
}

/// Warps per block of the row kernels that give a warp to each row.
const ROW_WARPS: u32 = 8;

/// The CUDA libraries every GPU run loads, with the names `cudarc` looks for. NCCL is loaded
/// only where a job's collectives run over it (`nccl`).
const LIBRARIES: [(&str, &str); 3] = [("cuda", "the NVIDIA driver"), ("cublas", "cuBLAS"), ("nvrtc", "NVRTC")];

/// Every CUDA library the backend needs can be loaded, or an error naming the missing ones.
pub fn libraries_present() -> Result<(), String> {
    let missing: Vec<String> =
        LIBRARIES.iter().filter(|(lib, _)| !library_loadable(lib)).map(|(lib, what)| format!("{what} (lib{lib}.so)")).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "cannot load {}: run on a node with an NVIDIA GPU and its driver, with the CUDA 12 libraries on \
             LD_LIBRARY_PATH (e.g. `module load cuda`)",
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

/// Compiles [`SOURCE`] for the GPU of compute capability `cc` to CUBIN, its machine code:
/// unlike PTX, which the driver compiles again and refuses when the NVRTC that wrote it is newer
/// than the driver, CUBIN loads on any driver of the same major CUDA version.
pub fn compile_cubin(cc: (i32, i32)) -> Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    if !library_loadable("nvrtc") {
        return Err("cannot load NVRTC (libnvrtc.so): put CUDA 12's lib64 on LD_LIBRARY_PATH".into());
    }
    let arch = format!("sm_{}{}", cc.0, cc.1);
    let src = std::ffi::CString::new(SOURCE).expect("the kernels' source holds no NUL");
    let prog = result::create_program(&src, Some(c"kernels.cu")).map_err(|e| format!("NVRTC: creating the program: {e:?}"))?;
    // SAFETY: `prog` is a live program until destroyed below; the CUBIN buffer holds the size
    // NVRTC reports.
    let cubin = unsafe {
        let compiled = result::compile_program(prog, &[format!("--gpu-architecture={arch}")]).map_err(|e| {
            let log = result::get_program_log(prog).map(|l| std::ffi::CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned());
            format!("NVRTC could not compile the kernels for {arch}: {e:?}\n{}", log.unwrap_or_default())
        });
        let cubin = compiled.and_then(|_| {
            let mut n = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut n).result().map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut buf = vec![0u8; n];
            sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()).result().map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
            Ok(buf)
        });
        let _ = result::destroy_program(prog);
        cubin?
    };
    if cubin.len() < 4 || cubin[..4] != *b"\x7fELF" {
        return Err(format!("NVRTC returned no CUBIN for {arch} (is it older than CUDA 11.1?)"));
    }
    Ok(cubin)
}

/// A CUDA version, (major, minor).
pub type CudaVersion = (i32, i32);

/// Whether kernels that NVRTC `nvrtc` = (major, minor) compiled load on a driver of CUDA
/// version `driver` = (major, minor), as `cuDriverGetVersion` reports it: CUBIN of a newer minor
/// version loads (CUDA's minor-version compatibility), of a newer major version does not. An
/// error names the two versions and which to change.
pub fn toolchain_fits(driver: CudaVersion, nvrtc: CudaVersion) -> Result<(), String> {
    if nvrtc.0 <= driver.0 {
        return Ok(());
    }
    Err(format!(
        "NVRTC is CUDA {}.{}, newer than the driver, which supports CUDA {}.{}: kernels it compiles do not load\nHINT: \
         put CUDA {}.x's libnvrtc first on LD_LIBRARY_PATH (e.g. `module load cuda/{}`), or run on a driver for CUDA {}",
        nvrtc.0, nvrtc.1, driver.0, driver.1, driver.0, driver.0, nvrtc.0
    ))
}

/// The CUDA versions of the driver and of NVRTC, (major, minor) each.
pub fn toolchain_versions() -> Result<(CudaVersion, CudaVersion), String> {
    let mut d = 0;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: each call writes the integers it is given.
    unsafe {
        cudarc::driver::sys::cuDriverGetVersion(&mut d).result().map_err(|e| format!("cuDriverGetVersion: {e:?}"))?;
        cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor).result().map_err(|e| format!("nvrtcVersion: {e:?}"))?;
    }
    Ok(((d / 1000, d % 1000 / 10), (major, minor)))
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
    /// Destroyed by `Gpu`'s drop, whose failure is not a panic (cudarc's own drop unwraps).
    blas: std::mem::ManuallyDrop<CudaBlas>,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Where there is no GPU (CI), opening one is an error that names what is missing, not a
    /// panic.
    #[test]
    fn opening_a_gpu_works_or_says_what_is_missing() {
        if let Err(e) = backend::GpuBackend::open(0, crate::backend::Precision::Fp32) {
            assert!(e.contains("cannot load") || e.contains("no GPU"), "{e}");
        }
    }

    /// Every `__global__` of the source is listed (so `Gpu::open` loads it) and nothing else.
    /// PTX a driver would compile again; CUBIN of a newer minor version loads, of a newer major
    /// version does not, and the error says which to change.
    #[test]
    fn kernels_of_a_newer_major_cuda_than_the_driver_are_refused_with_what_to_change() {
        assert!(toolchain_fits((12, 2), (12, 9)).is_ok());
        assert!(toolchain_fits((12, 9), (12, 2)).is_ok());
        assert!(toolchain_fits((13, 0), (12, 8)).is_ok());
        let e = toolchain_fits((12, 2), (13, 0)).unwrap_err();
        assert!(e.contains("NVRTC is CUDA 13.0") && e.contains("supports CUDA 12.2") && e.contains("HINT"), "{e}");
        assert!(e.contains("CUDA 12.x's libnvrtc"), "{e}");
    }

    /// NVRTC writes CUBIN for sm_80 and sm_90 (what `Gpu::open` loads), where NVRTC is present.
    #[test]
    fn nvrtc_writes_cubin_for_sm80_and_sm90() {
        if !library_loadable("nvrtc") {
            assert!(std::env::var_os("NDTRAIN_REQUIRE_NVRTC").is_none(), "NDTRAIN_REQUIRE_NVRTC is set but libnvrtc cannot be loaded");
            return;
        }
        for cc in [(8, 0), (9, 0)] {
            let cubin = compile_cubin(cc).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(&cubin[..4], b"\x7fELF", "sm_{}{}", cc.0, cc.1);
        }
    }

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
