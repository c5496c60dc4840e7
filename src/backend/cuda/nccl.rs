//! NCCL, loaded at run time only when a job's collectives run over it, and its calls on the
//! GPU's buffers.
//!
//! The library is found by the names NCCL's packages install (`libnccl.so.2`, which the
//! runtime packages and the pip wheel ship, then `libnccl.so`) on the dynamic loader's search
//! path, then in `$NCCL_HOME/lib`, `$NCCL_ROOT/lib` and `$NCCL_DIR/lib`; when none loads, the
//! error names every name and folder tried. The functions are NCCL 2's C API (`nccl.h`):
//! `ncclGetUniqueId`, `ncclCommInitRank`, the collectives, `ncclSend`/`ncclRecv` in a group,
//! `ncclCommFinalize` + `ncclCommDestroy` to end a communicator cleanly, `ncclCommAbort` when
//! the run fails, and `ncclCommGetAsyncError`, which another thread may poll (the watchdog).

use super::backend::DevBuf;
use super::comm::CommStream;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The names tried, in order.
pub const LIBRARY_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// The environment variables whose `lib/` folders are searched after the loader's path.
pub const HOME_VARIABLES: [&str; 3] = ["NCCL_HOME", "NCCL_ROOT", "NCCL_DIR"];

type Result_ = c_int;
type Comm = *mut c_void;
type Stream = *mut c_void;

/// `ncclSuccess` and `ncclInProgress` of `ncclResult_t`.
const SUCCESS: Result_ = 0;
const IN_PROGRESS: Result_ = 7;
/// `ncclFloat32` of `ncclDataType_t`; `ncclSum`, `ncclMax` of `ncclRedOp_t`.
const FLOAT32: c_int = 7;
const SUM: c_int = 0;
const MAX: c_int = 2;

/// `ncclUniqueId`: 128 bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([c_char; 128]);

/// The entry points of a loaded NCCL.
struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> Result_,
    get_error_string: unsafe extern "C" fn(Result_) -> *const c_char,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Result_,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> Result_,
    comm_finalize: unsafe extern "C" fn(Comm) -> Result_,
    comm_destroy: unsafe extern "C" fn(Comm) -> Result_,
    comm_abort: unsafe extern "C" fn(Comm) -> Result_,
    comm_get_async_error: unsafe extern "C" fn(Comm, *mut Result_) -> Result_,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> Result_,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> Result_,
    reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> Result_,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, Stream) -> Result_,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, Stream) -> Result_,
    group_start: unsafe extern "C" fn() -> Result_,
    group_end: unsafe extern "C" fn() -> Result_,
}

/// The file names and paths tried for NCCL, in order: each name on the loader's search path,
/// then in each `lib/` folder the environment names.
pub fn candidates(env: impl Fn(&str) -> Option<String>) -> Vec<String> {
    let mut out: Vec<String> = LIBRARY_NAMES.iter().map(|n| n.to_string()).collect();
    for var in HOME_VARIABLES {
        if let Some(home) = env(var).filter(|h| !h.is_empty()) {
            for n in LIBRARY_NAMES {
                out.push(PathBuf::from(&home).join("lib").join(n).display().to_string());
            }
        }
    }
    out
}

/// The first of `candidates` that `opens`, or an error naming every one tried and the
/// loader's search path.
pub fn find(candidates: &[String], opens: impl Fn(&str) -> bool, ld_library_path: Option<String>) -> Result<String, String> {
    if let Some(c) = candidates.iter().find(|c| opens(c)) {
        return Ok(c.clone());
    }
    Err(format!(
        "cannot load NCCL: tried {} (LD_LIBRARY_PATH={}, then the system's library folders)\nHINT: put the folder of \
         libnccl.so.2 on LD_LIBRARY_PATH (`module load nccl`, or the pip wheel's nvidia/nccl/lib), set NCCL_HOME, or \
         [parallel] comm_backend = \"staged\"",
        candidates.join(", "),
        ld_library_path.unwrap_or_else(|| "(unset)".into())
    ))
}

fn dlopen(name: &str) -> Option<*mut c_void> {
    let c = CString::new(name).ok()?;
    // SAFETY: dlopen with a valid C string; a library loaded here stays loaded for the process.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    (!h.is_null()).then_some(h)
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

/// Whether this process has loaded NCCL.
fn loaded() -> bool {
    API.get().is_some_and(|a| a.is_ok())
}

/// NCCL's entry points, loaded on first use (the first communicator), or why not.
fn api() -> Result<&'static Api, String> {
    API.get_or_init(|| {
        let tried = candidates(|v| std::env::var(v).ok());
        let name = find(&tried, |c| dlopen(c).is_some(), std::env::var("LD_LIBRARY_PATH").ok())?;
        let h = dlopen(&name).ok_or_else(|| format!("cannot load NCCL from {name}"))?;
        let sym = |s: &str| -> Result<*mut c_void, String> {
            let c = CString::new(s).expect("a symbol name");
            // SAFETY: a live handle and a valid C string.
            let p = unsafe { libc::dlsym(h, c.as_ptr()) };
            if p.is_null() {
                Err(format!("{name} has no {s}: NCCL 2.14 or newer is needed"))
            } else {
                Ok(p)
            }
        };
        // SAFETY: each symbol is NCCL 2's function of that name, whose C signature is the
        // field's type (`nccl.h`).
        unsafe {
            Ok(Api {
                get_version: cast(sym("ncclGetVersion")?),
                get_error_string: cast(sym("ncclGetErrorString")?),
                get_unique_id: cast(sym("ncclGetUniqueId")?),
                comm_init_rank: cast(sym("ncclCommInitRank")?),
                comm_finalize: cast(sym("ncclCommFinalize")?),
                comm_destroy: cast(sym("ncclCommDestroy")?),
                comm_abort: cast(sym("ncclCommAbort")?),
                comm_get_async_error: cast(sym("ncclCommGetAsyncError")?),
                all_reduce: cast(sym("ncclAllReduce")?),
                all_gather: cast(sym("ncclAllGather")?),
                reduce_scatter: cast(sym("ncclReduceScatter")?),
                send: cast(sym("ncclSend")?),
                recv: cast(sym("ncclRecv")?),
                group_start: cast(sym("ncclGroupStart")?),
                group_end: cast(sym("ncclGroupEnd")?),
            })
        }
    })
    .as_ref()
    .map_err(|e| e.clone())
}

/// The function pointer of type `F` that `p`, a symbol of the library, points to.
///
/// # Safety
/// `F` is the pointer type of the C function the symbol names.
unsafe fn cast<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>(), "a function pointer");
    // SAFETY: as the caller guarantees; the sizes agree (asserted).
    unsafe { std::mem::transmute_copy(&p) }
}

/// `r` as a result naming `what` and NCCL's own words for it.
fn check(api: &Api, what: &str, r: Result_) -> Result<(), String> {
    if r == SUCCESS {
        return Ok(());
    }
    // SAFETY: NCCL returns a static string for every result code.
    let text = unsafe { CStr::from_ptr((api.get_error_string)(r)) }.to_string_lossy();
    Err(format!("{what}: {text} (ncclResult_t {r})"))
}

/// The version of the NCCL this process loaded, if it loaded one (never loads it).
pub fn loaded_version() -> Option<String> {
    loaded().then(version).and_then(Result::ok)
}

/// The loaded NCCL's version, `major.minor.patch` (loading it if need be).
pub fn version() -> Result<String, String> {
    let api = api()?;
    let mut v: c_int = 0;
    // SAFETY: writes one int.
    check(api, "ncclGetVersion", unsafe { (api.get_version)(&mut v) })?;
    // NCCL 2.9 and later encode major·10000 + minor·100 + patch.
    Ok(format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100))
}

/// The bytes of an NCCL unique id, created by one rank and handed to the others.
pub struct NcclId([u8; 128]);

impl NcclId {
    /// Bytes in an id.
    pub const BYTES: usize = 128;

    pub fn new() -> Result<NcclId, String> {
        let api = api()?;
        let mut id = UniqueId([0; 128]);
        // SAFETY: fills the 128 bytes of `id`.
        check(api, "ncclGetUniqueId", unsafe { (api.get_unique_id)(&mut id) })?;
        Ok(NcclId(id.0.map(|c| c as u8)))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.to_vec()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<NcclId, String> {
        let b: [u8; 128] = bytes.try_into().map_err(|_| format!("an NCCL unique id has {} bytes, not {}", Self::BYTES, bytes.len()))?;
        Ok(NcclId(b))
    }
}

/// The state of a communicator's asynchronous work, from another thread's point of view: what
/// the watchdog polls. It holds the raw handle; the communicator outlives every poll (its
/// owner stops the polling before ending it).
#[derive(Clone, Copy)]
pub struct AsyncErrors {
    comm: usize,
}

impl AsyncErrors {
    /// The communicator's asynchronous error (a peer gone, a network failure), if any.
    pub fn poll(&self) -> Option<String> {
        let api = api().ok()?;
        let mut state: Result_ = SUCCESS;
        // SAFETY: a live communicator (see the type's comment); NCCL lets another thread query it.
        let r = unsafe { (api.comm_get_async_error)(self.comm as Comm, &mut state) };
        let bad = if r != SUCCESS { r } else { state };
        (bad != SUCCESS && bad != IN_PROGRESS).then(|| check(api, "NCCL", bad).unwrap_err())
    }
}

/// One NCCL communicator, its work on one stream. Dropped without [`NcclComm::finish`] (a
/// failed run), it is aborted: `ncclCommAbort` returns whatever the peers do.
pub struct NcclComm {
    api: &'static Api,
    comm: Comm,
    stream: std::sync::Arc<CudaStream>,
    finished: bool,
}

impl NcclComm {
    /// Joins the communicator of `size` ranks that `id` names, as rank `rank` (every rank of
    /// it joins at once: a collective call), its work on `stream`.
    pub fn join(id: &NcclId, rank: usize, size: usize, stream: &CommStream) -> Result<NcclComm, String> {
        let (api, stream) = (api()?, &stream.0);
        let mut comm: Comm = std::ptr::null_mut();
        let uid = UniqueId(id.0.map(|b| b as c_char));
        stream.context().bind_to_thread().map_err(|e| format!("binding the CUDA context: {e:?}"))?;
        let (n, r) = (c_int::try_from(size).map_err(|e| e.to_string())?, c_int::try_from(rank).map_err(|e| e.to_string())?);
        // SAFETY: writes the new communicator into `comm`; the id came from ncclGetUniqueId.
        check(api, "ncclCommInitRank", unsafe { (api.comm_init_rank)(&mut comm, n, uid, r) })?;
        Ok(NcclComm { api, comm, stream: stream.clone(), finished: false })
    }

    /// What another thread polls for this communicator's asynchronous errors.
    pub fn async_errors(&self) -> AsyncErrors {
        AsyncErrors { comm: self.comm as usize }
    }

    fn raw_stream(&self) -> Stream {
        self.stream.cu_stream() as Stream
    }

    /// Ends the communicator cleanly once every rank is done with it (the caller has agreed
    /// that over MPI): `ncclCommFinalize` completes its operations, `ncclCommDestroy` frees it.
    pub fn finish(mut self) -> Result<(), String> {
        self.finished = true;
        // SAFETY: a live communicator, not used again.
        check(self.api, "ncclCommFinalize", unsafe { (self.api.comm_finalize)(self.comm) })?;
        check(self.api, "ncclCommDestroy", unsafe { (self.api.comm_destroy)(self.comm) })
    }

    /// `buf[range]` reduced across the ranks, in place.
    pub fn all_reduce_in_place(&self, buf: &mut DevBuf<f32>, range: std::ops::Range<usize>, max: bool) -> Result<(), String> {
        let n = range.len();
        let mut view = buf.get_mut()?.slice_mut(range);
        let (p, _done) = view.device_ptr_mut(&self.stream);
        let op = if max { MAX } else { SUM };
        // SAFETY: `n` f32 at `p` on this rank's GPU, read and written in stream order.
        check(self.api, "ncclAllReduce", unsafe {
            (self.api.all_reduce)(p as *const c_void, p as *mut c_void, n, FLOAT32, op, self.comm, self.raw_stream())
        })
    }

    /// `recv` = the sum of every rank's `send` (the same lengths).
    pub fn all_reduce_sum(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>) -> Result<(), String> {
        fits("ncclAllReduce", recv.len(), send.len())?;
        let n = send.len();
        let (s, _s_done) = send.get()?.device_ptr(&self.stream);
        let (r, _r_done) = recv.get_mut()?.device_ptr_mut(&self.stream);
        // SAFETY: `n` f32 at each address on this rank's GPU (checked above).
        check(self.api, "ncclAllReduce", unsafe {
            (self.api.all_reduce)(s as *const c_void, r as *mut c_void, n, FLOAT32, SUM, self.comm, self.raw_stream())
        })
    }

    /// `recv` = every rank's `send`, in rank order (`recv` holds `ranks × send`).
    pub fn all_gather(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>, ranks: usize) -> Result<(), String> {
        fits("ncclAllGather", recv.len(), send.len() * ranks)?;
        let n = send.len();
        let (s, _s_done) = send.get()?.device_ptr(&self.stream);
        let (r, _r_done) = recv.get_mut()?.device_ptr_mut(&self.stream);
        // SAFETY: `n` f32 at `s`, `ranks · n` at `r` (checked above).
        check(self.api, "ncclAllGather", unsafe {
            (self.api.all_gather)(s as *const c_void, r as *mut c_void, n, FLOAT32, self.comm, self.raw_stream())
        })
    }

    /// `recv` = this rank's block of the sum of every rank's `send` (`send` holds `ranks ×
    /// recv`).
    pub fn reduce_scatter_sum(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>, ranks: usize) -> Result<(), String> {
        fits("ncclReduceScatter", send.len(), recv.len() * ranks)?;
        let n = recv.len();
        let (s, _s_done) = send.get()?.device_ptr(&self.stream);
        let (r, _r_done) = recv.get_mut()?.device_ptr_mut(&self.stream);
        // SAFETY: `ranks · n` f32 at `s`, `n` at `r` (checked above).
        check(self.api, "ncclReduceScatter", unsafe {
            (self.api.reduce_scatter)(s as *const c_void, r as *mut c_void, n, FLOAT32, SUM, self.comm, self.raw_stream())
        })
    }

    /// Sends `send` to rank `next` while `recv` is received from rank `prev`, in one NCCL group
    /// so that neither waits for the other. NCCL writes as many elements as the sender sends:
    /// `recv` must hold `send`'s length (every rank of a ring sends the same).
    pub fn shift(&self, send: &DevBuf<f32>, recv: &mut DevBuf<f32>, (next, prev): (usize, usize)) -> Result<(), String> {
        fits("ncclRecv", recv.len(), send.len())?;
        let n = send.len();
        let (s, _s_done) = send.get()?.device_ptr(&self.stream);
        let (r, _r_done) = recv.get_mut()?.device_ptr_mut(&self.stream);
        let (next, prev) = (next as c_int, prev as c_int);
        let api = self.api;
        // SAFETY: `n` f32 at each address (checked above); the group brackets the pair, and its
        // end is called whatever the pair returned.
        unsafe {
            check(api, "ncclGroupStart", (api.group_start)())?;
            let sent = check(api, "ncclSend", (api.send)(s as *const c_void, n, FLOAT32, next, self.comm, self.raw_stream()));
            let got = check(api, "ncclRecv", (api.recv)(r as *mut c_void, n, FLOAT32, prev, self.comm, self.raw_stream()));
            let ended = check(api, "ncclGroupEnd", (api.group_end)());
            sent.and(got).and(ended)
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.finished {
            // SAFETY: a live communicator, not used again; the error of an abort has no reader.
            let _ = unsafe { (self.api.comm_abort)(self.comm) };
        }
    }
}

/// A receive buffer of `have` elements for a collective that writes `need`: an error, not a
/// write past its end.
fn fits(what: &str, have: usize, need: usize) -> Result<(), String> {
    if have == need {
        Ok(())
    } else {
        Err(format!("{what}: a buffer of {have} elements where the collective moves {need}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NCCL's runtime packages and pip wheel install `libnccl.so.2`: it is tried first, then the
    /// development name, then the same names under each home variable's `lib/`.
    #[test]
    fn nccl_is_searched_as_libnccl_so_2_then_libnccl_so_and_under_its_home_variables() {
        let env = |v: &str| match v {
            "NCCL_HOME" => Some("/opt/nccl".to_string()),
            "NCCL_DIR" => Some(String::new()),
            _ => None,
        };
        assert_eq!(candidates(env), ["libnccl.so.2", "libnccl.so", "/opt/nccl/lib/libnccl.so.2", "/opt/nccl/lib/libnccl.so"]);
        assert_eq!(find(&candidates(env), |c| c.ends_with(".so.2"), None), Ok("libnccl.so.2".to_string()));
        assert_eq!(find(&candidates(env), |c| c.starts_with("/opt"), None), Ok("/opt/nccl/lib/libnccl.so.2".to_string()));
    }

    #[test]
    fn a_missing_nccl_names_every_name_and_folder_tried() {
        let tried = candidates(|v| (v == "NCCL_ROOT").then(|| "/sw/nccl".to_string()));
        let e = find(&tried, |_| false, Some("/usr/local/cuda/lib64".into())).unwrap_err();
        for part in ["libnccl.so.2", "libnccl.so", "/sw/nccl/lib/libnccl.so.2", "LD_LIBRARY_PATH=/usr/local/cuda/lib64", "HINT"] {
            assert!(e.contains(part), "{part} not in: {e}");
        }
        assert!(find(&tried, |_| false, None).unwrap_err().contains("LD_LIBRARY_PATH=(unset)"));
    }

    #[test]
    fn a_receive_buffer_must_hold_what_the_collective_writes() {
        assert!(fits("ncclRecv", 8, 8).is_ok());
        let e = fits("ncclRecv", 4, 8).unwrap_err();
        assert!(e.contains("4 elements") && e.contains("moves 8"), "{e}");
    }
}
