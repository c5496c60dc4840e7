//! Opening the rank's GPU, its memory (uploads, downloads, device copies) and the stream's
//! synchronisation.

use super::{compile_cubin, err, libraries_present, need, toolchain_fits, toolchain_versions, Gpu, KERNELS};
use crate::backend::GpuInfo;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{result, sys, CudaContext, CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchArgs, LaunchConfig};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;

/// The GPUs this process can see (within `CUDA_VISIBLE_DEVICES`).
pub fn device_count() -> Result<usize, String> {
    libraries_present()?;
    CudaContext::device_count().map(|n| n as usize).map_err(err("counting CUDA devices"))
}

/// Every GPU this process can see, with its UUID (as `nvidia-smi -L` writes it), PCI bus id
/// and NUMA node.
pub fn visible_gpus() -> Result<Vec<GpuInfo>, String> {
    let n = device_count()?;
    (0..n)
        .map(|ordinal| {
            let dev = result::device::get(ordinal as i32).map_err(err("reading a device"))?;
            let uuid = result::device::get_uuid(dev).map_err(err("reading a device's UUID"))?;
            let hex: Vec<String> = uuid.bytes.iter().map(|&b| format!("{:02x}", b as u8)).collect();
            let uuid = format!(
                "GPU-{}-{}-{}-{}-{}",
                hex[..4].concat(),
                hex[4..6].concat(),
                hex[6..8].concat(),
                hex[8..10].concat(),
                hex[10..].concat()
            );
            let mut bus = [0 as std::ffi::c_char; 32];
            // SAFETY: writes a NUL-terminated string of at most `bus.len()` bytes.
            unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev) }
                .result()
                .map_err(err("reading a device's PCI bus id"))?;
            // SAFETY: NUL-terminated above.
            let pci_bus_id = unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }.to_string_lossy().into_owned();
            Ok(GpuInfo { ordinal, uuid, numa_node: numa_node_of_pci(&pci_bus_id), pci_bus_id })
        })
        .collect()
}

/// Whether visible GPU `ordinal` has memory pools, so that cudarc allocates every buffer from
/// the stream-ordered pool (`cuMemAllocAsync`).
pub fn memory_pools(ordinal: usize) -> Result<bool, String> {
    let dev = result::device::get(ordinal as i32).map_err(err("reading a device"))?;
    let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED;
    // SAFETY: a device handle of this process and an attribute it defines.
    unsafe { result::device::get_attribute(dev, attr) }.map(|v| v > 0).map_err(err("reading a device's attributes"))
}

/// The NUMA node of the PCI device `bus_id` (`0000:17:00.0`), from sysfs; `None` where the
/// system does not say (`-1`, or no such file).
fn numa_node_of_pci(bus_id: &str) -> Option<usize> {
    let path = format!("/sys/bus/pci/devices/{}/numa_node", bus_id.to_lowercase());
    std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse::<i64>().ok()).and_then(|n| usize::try_from(n).ok())
}

impl Gpu {
    /// Opens visible GPU `ordinal` (`run::gpus` chose it) and compiles the kernels for it.
    pub fn open(ordinal: usize) -> Result<Gpu, String> {
        libraries_present()?;
        let (driver, nvrtc) = toolchain_versions()?;
        toolchain_fits(driver, nvrtc)?;
        let ctx = CudaContext::new(ordinal).map_err(err("creating a CUDA context"))?;
        // Ordering between the streams is explicit (`order`, the collectives' events): cudarc's
        // per-argument event tracking is off before any buffer exists.
        // SAFETY: no buffer or second stream exists yet; every later use is ordered explicitly.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().map_err(err("reading the device name"))?;
        let cc = ctx.compute_capability().map_err(err("reading the compute capability"))?;
        keep_pool_memory(&ctx)?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| format!("creating a cuBLAS handle: {e:?}"))?;
        // Compiled once, to machine code for this device's architecture.
        let module = ctx.load_module(Ptx::from_binary(compile_cubin(cc)?)).map_err(err("loading the compiled kernels"))?;
        let mut functions = HashMap::new();
        for name in KERNELS.iter() {
            functions.insert(*name, module.load_function(name).map_err(err(name))?);
        }
        Ok(Gpu { ordinal, name, cc, stream, blas: std::mem::ManuallyDrop::new(blas), functions, _module: module })
    }

    pub(super) fn launcher(&self, name: &str) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.functions[name])
    }

    pub(super) fn launch(what: &str, mut l: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<(), String> {
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

    /// Bytes in use in the stream-ordered allocator's pool (where every buffer of the backend
    /// comes from) now and at most so far, from the pool's own counters.
    pub fn pool_memory(&self) -> Result<(u64, u64), String> {
        use cudarc::driver::{result, sys::CUmemPool_attribute as Attr};
        let ctx = self.stream.context();
        ctx.bind_to_thread().map_err(err("binding the context"))?;
        // SAFETY: the device of this context; each attribute is a cuuint64_t written into a u64.
        unsafe {
            let pool = result::device::get_mem_pool(ctx.cu_device()).map_err(err("reading the memory pool"))?;
            let (mut now, mut high) = (0u64, 0u64);
            for (attr, v) in [(Attr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &mut now), (Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut high)] {
                result::mem_pool::get_attribute(pool, attr, (v as *mut u64).cast()).map_err(err("reading the memory pool's counters"))?;
            }
            Ok((now, high))
        }
    }

    /// The device's free and total memory, in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), String> {
        self.stream.context().mem_get_info().map_err(err("reading the device's free memory"))
    }

    /// `dst = src` on the device (same lengths).
    pub fn copy(&self, dst: &mut CudaViewMut<'_, f32>, src: &CudaView<'_, f32>) -> Result<(), String> {
        need("copy", src.len() == dst.len())?;
        self.stream.memcpy_dtod(src, dst).map_err(err("device copy"))
    }

    /// Waits for the stream, then reports an error cudarc recorded where it could not return
    /// one (in a drop: an asynchronous free).
    pub fn synchronize(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(err("synchronizing the stream"))?;
        self.stream.context().check_err().map_err(err("an earlier release of device memory"))
    }
}

/// The stream-ordered pool (where every buffer comes from) keeps the memory it has: with the
/// default release threshold of 0 it would trim at every synchronisation and map the step's
/// buffers afresh in the next.
fn keep_pool_memory(ctx: &std::sync::Arc<CudaContext>) -> Result<(), String> {
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    ctx.bind_to_thread().map_err(err("binding the context"))?;
    // SAFETY: the device's default pool; the attribute is a cuuint64_t read from a u64.
    unsafe {
        let pool = result::device::get_mem_pool(ctx.cu_device()).map_err(err("reading the memory pool"))?;
        let mut keep = u64::MAX;
        sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, (&mut keep as *mut u64).cast())
            .result()
            .map_err(err("setting the memory pool's release threshold"))
    }
}

/// Whether buffers come from the stream-ordered pool (`cuMemAllocAsync`): every device with
/// memory pools, where cudarc allocates from them.
pub fn pool_memory(gpu: &Gpu) -> bool {
    gpu.stream.context().has_async_alloc()
}

impl Drop for Gpu {
    /// Destroys the cuBLAS handle without cudarc's drop, which would panic on a failure; a
    /// failure here (the process ends anyway) is logged.
    fn drop(&mut self) {
        // SAFETY: the handle is live and not used again; the wrapper is never dropped.
        if let Err(e) = unsafe { cudarc::cublas::result::destroy_handle(*self.blas.handle()) } {
            log::warn!("destroying the cuBLAS handle: {e:?}");
        }
    }
}
