//! Opening the rank's GPU, its memory (uploads, downloads, device copies) and the stream's
//! synchronisation.

use super::{compile, err, libraries_present, need, Gpu, KERNELS};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchArgs, LaunchConfig};
use std::collections::HashMap;

/// The GPUs this process can see (within `CUDA_VISIBLE_DEVICES`).
pub fn device_count() -> Result<usize, String> {
    libraries_present()?;
    CudaContext::device_count().map(|n| n as usize).map_err(err("counting CUDA devices"))
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

    pub fn synchronize(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(err("synchronizing the stream"))
    }
}
