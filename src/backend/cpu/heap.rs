//! Host memory policy: the mmap threshold the training command fixes, and the process's
//! allocator (the system's, plus a spare block per GEMM thread for the GEMM's packing buffers).
//!
//! The training command fixes glibc's mmap threshold at 1 MiB ([`fix_mmap_threshold`]), so
//! that every large buffer is a mapping of its own and goes back to the system when freed: the
//! resident set then tracks the live memory `ndtrain plan` predicts. The GEMM (`gemm` crate),
//! however, allocates its packing buffers (1–14 MiB on bench_small) in every call and frees
//! them on return; each call would map fresh pages, which the kernel faults in and zeroes on
//! first touch — 40 000 page faults per bench_small step, and on two threads every unmap also
//! interrupts the other core to flush its TLB (`benches/results/host_heap.md`).
//!
//! [`SpareBlockAlloc`], the process's allocator (the binary declares it in `main.rs`), keeps the largest blocks the GEMM's calls
//! freed ([`with_spare_blocks`]) — one per GEMM thread of the rank — and hands one back for the
//! next large request inside a GEMM call that it can hold, so the next product reuses the pages
//! of the last one. The rank thus retains at most its largest packing buffer per GEMM thread —
//! what its GEMMs need at once anyway — and every other allocation goes straight to the system,
//! so the resident set still tracks live memory.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Mutex;

/// Blocks of at least this many bytes are large: the mmap threshold [`fix_mmap_threshold`]
/// sets, below which glibc's heap reuses memory by itself.
const LARGE: usize = 1 << 20;

/// Makes glibc map every block of at least [`LARGE`] bytes by itself and unmap it on free.
/// Without a fixed threshold glibc raises it after the first such free, and the transient
/// buffers of later steps stay resident as heap fragments: the resident set would drift above
/// the live memory `ndtrain plan` predicts (measured: 6–10 MiB of noise per rank).
pub fn fix_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's tuning; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, LARGE as libc::c_int);
    }
}

thread_local! {
    /// Whether this thread's large blocks go through the spares: only inside
    /// [`with_spare_blocks`]. A const-initialised `Cell` without a destructor: reading it never
    /// allocates.
    static CACHING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread's large allocations served from, and freed into, the spare blocks:
/// for code that allocates and frees the same large scratch on every call (the GEMM).
pub fn with_spare_blocks<R>(f: impl FnOnce() -> R) -> R {
    let outer = CACHING.with(|c| c.replace(true));
    let r = f();
    CACHING.with(|c| c.set(outer));
    r
}

fn caching() -> bool {
    CACHING.try_with(|c| c.get()).unwrap_or(false)
}

/// The bytes a live block of the system allocator can hold (at least what was asked for).
fn capacity(ptr: *mut u8) -> usize {
    // SAFETY: callers pass live blocks of the system allocator (glibc's malloc family).
    unsafe { libc::malloc_usable_size(ptr.cast()) }
}

fn free(ptr: *mut u8) {
    // SAFETY: `ptr` is a block of the system allocator that nobody uses any more; on Linux
    // `System` allocates every block, aligned or not, with glibc's malloc family.
    unsafe { libc::free(ptr.cast()) }
}

/// The most spare blocks kept: one per GEMM thread, up to this many.
const MAX_SPARES: usize = 64;

/// Freed large blocks kept for reuse: at most `limit` of them, the largest seen.
struct Spares {
    blocks: [*mut u8; MAX_SPARES],
}

// SAFETY: the blocks are owned by the set (their users freed them) and only handed out once.
unsafe impl Send for Spares {}

impl Spares {
    const fn new() -> Self {
        Spares { blocks: [std::ptr::null_mut(); MAX_SPARES] }
    }

    /// Removes and returns a block that holds `layout` (the smallest such), if any.
    fn take(&mut self, layout: Layout) -> Option<*mut u8> {
        let fits = |p: *mut u8| !p.is_null() && p as usize % layout.align() == 0 && capacity(p) >= layout.size();
        let i = (0..MAX_SPARES).filter(|&i| fits(self.blocks[i])).min_by_key(|&i| capacity(self.blocks[i]))?;
        Some(std::mem::replace(&mut self.blocks[i], std::ptr::null_mut()))
    }

    /// Keeps the freed block `ptr` if fewer than `limit` are kept, else in place of the smallest
    /// kept block if that one is smaller; returns the block to give back to the system.
    fn put(&mut self, ptr: *mut u8, limit: usize) -> Option<*mut u8> {
        let limit = limit.clamp(1, MAX_SPARES);
        if let Some(i) = self.blocks[..limit].iter().position(|p| p.is_null()) {
            self.blocks[i] = ptr;
            return None;
        }
        let smallest = (0..limit).min_by_key(|&i| capacity(self.blocks[i])).unwrap();
        if capacity(self.blocks[smallest]) < capacity(ptr) {
            Some(std::mem::replace(&mut self.blocks[smallest], ptr))
        } else {
            Some(ptr)
        }
    }

    /// Bytes the kept blocks can hold.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.blocks.iter().filter(|p| !p.is_null()).map(|&p| capacity(p)).sum()
    }
}

/// The system allocator, with [`Spares`] for the large blocks allocated and freed inside
/// [`with_spare_blocks`]: as many as the rank has GEMM threads. The binary installs it as the
/// process's allocator (`main.rs`); a program that links the library without it keeps the
/// system's, and its GEMMs map their packing buffers afresh.
pub struct SpareBlockAlloc {
    spares: Mutex<Spares>,
}

impl SpareBlockAlloc {
    pub const fn new() -> Self {
        SpareBlockAlloc { spares: Mutex::new(Spares::new()) }
    }
}

impl Default for SpareBlockAlloc {
    fn default() -> Self {
        Self::new()
    }
}

impl SpareBlockAlloc {
    fn lock(&self) -> std::sync::MutexGuard<'_, Spares> {
        // Every change to the set is complete before the next one starts: a panic elsewhere
        // cannot leave it inconsistent.
        self.spares.lock().unwrap_or_else(|e| e.into_inner())
    }
}

// SAFETY: a spare block is a block of `System`'s that its user freed; it is handed out once, to
// a request it can hold (`malloc_usable_size` ≥ the size, its address a multiple of the
// alignment), and every block handed out comes back through `dealloc`, which keeps it or frees
// it with glibc's `free`, which needs no size.
unsafe impl GlobalAlloc for SpareBlockAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE && caching() {
            if let Some(p) = self.lock().take(layout) {
                return p;
            }
        }
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() < LARGE || !caching() {
            return System.dealloc(ptr, layout);
        }
        let spare = self.lock().put(ptr, super::gemm_threads());
        if let Some(p) = spare {
            free(p);
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        System.realloc(ptr, layout, new_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The unit tests run with the allocator the binary installs, so the test of the GEMM's
    /// reuse sees what training sees.
    #[global_allocator]
    static HEAP: SpareBlockAlloc = SpareBlockAlloc::new();

    fn block(mib: usize) -> *mut u8 {
        // SAFETY: a valid, non-zero layout.
        unsafe { System.alloc(Layout::from_size_align(mib << 20, 64).unwrap()) }
    }

    fn layout(mib: usize) -> Layout {
        Layout::from_size_align(mib << 20, 64).unwrap()
    }

    #[test]
    fn spares_keep_the_largest_blocks_up_to_the_limit_and_serve_what_they_can_hold() {
        let mut s = Spares::new();
        let (a, b, c) = (block(3), block(5), block(2));
        assert_eq!(s.put(a, 2), None);
        assert_eq!(s.put(b, 2), None);
        // Full at 2: a smaller block goes back, a larger one replaces the smallest kept.
        assert_eq!(s.put(c, 2), Some(c));
        free(c);
        let d = block(8);
        assert_eq!(s.put(d, 2), Some(a));
        free(a);
        assert!(s.bytes() >= 13 << 20 && s.bytes() < 14 << 20, "{}", s.bytes());
        // The smallest block that holds the request; none for a larger one or a stricter
        // alignment than the blocks' addresses offer.
        assert_eq!(s.take(layout(4)), Some(b));
        assert_eq!(s.take(layout(9)), None);
        assert_eq!(s.take(Layout::from_size_align(1 << 20, 1 << 22).unwrap()).filter(|p| *p as usize % (1 << 22) != 0), None);
        let got = s.take(layout(1)).unwrap();
        assert_eq!(got, d);
        // SAFETY: the whole block is there: it holds 8 MiB.
        unsafe { got.write_bytes(1, 8 << 20) };
        assert_eq!(s.bytes(), 0);
        free(b);
        free(d);
    }

    /// Minor page faults of the calling thread so far.
    fn minor_faults() -> i64 {
        // SAFETY: getrusage fills the struct it is given.
        unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &mut u);
            u.ru_minflt
        }
    }

    #[test]
    fn a_repeated_gemm_reuses_its_packing_buffers_instead_of_faulting_in_new_pages() {
        use crate::backend::cpu::gemm::{matmul_serial, Mat, MatMut};
        fix_mmap_threshold();
        // Shaped like bench_small's down projection: its packing buffers exceed 1 MiB.
        let (m, k, n) = (2048, 1536, 512);
        let (a, b) = (vec![0.5f32; m * k], vec![0.25f32; k * n]);
        let mut c = vec![0f32; m * n];
        let mut run = || matmul_serial(MatMut::rm(&mut c, m, n), Mat::rm(&a, m, k), Mat::rm(&b, n, k).t(), false);
        // The first call also faults in the output and this thread's GEMM scratch. Other tests'
        // GEMMs may take the spare meanwhile: the fewest faults of a few repeats counts.
        run();
        let faults = (0..4)
            .map(|_| {
                let before = minor_faults();
                run();
                minor_faults() - before
            })
            .min()
            .unwrap();
        assert_eq!(c[0], 0.5 * 0.25 * k as f32);
        // Without the spare each call maps its packing buffers afresh: 289 pages here.
        assert!(faults < 64, "a repeated GEMM faulted in {faults} pages");
    }
}
