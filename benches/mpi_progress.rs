//! Does Open MPI move a non-blocking collective while the ranks compute? Progress calls
//! against a progress thread, measured. Run on two ranks (`benches/mpi_progress.sh`).
//!
//! Each rank starts an `MPI_Iallreduce` of `bytes`, computes for a fixed amount of work (GEMMs
//! of the model's shape, about as long as one block's backward on bench_small), then waits.
//! The collective's **exposed** time is the step's time minus the same compute alone. Schedules:
//!
//! - `blocking`: compute, then a blocking `MPI_Allreduce` (nothing overlaps: the reference);
//! - `no progress`: `MPI_Iallreduce`, compute, `MPI_Wait` (only the library's own progress);
//! - `progress calls`: the same with `MPI_Test` between GEMMs (what `fsdp` does between blocks);
//! - `progress thread`: the same with a second thread calling `MPI_Test` in a loop
//!   (`MPI_THREAD_MULTIPLE`) while the compute thread computes; it shares the rank's cores.
//!
//! Arguments: `--reps N` (default 7, medians reported), `--gemms N` (compute per step).

use mpi::ffi;
use ndtrain::backend::cpu::gemm::{matmul_serial, Mat, MatMut};
use std::os::raw::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// The allocator the `ndtrain` binary runs with (`src/main.rs`), so the bench measures what
/// training does: the GEMM's packing buffers kept for reuse (`backend::cpu::heap`).
#[global_allocator]
static HEAP: ndtrain::backend::cpu::heap::SpareBlockAlloc = ndtrain::backend::cpu::heap::SpareBlockAlloc::new();

/// The gate/up projection of bench_small: `[2048, 512] · [512, 1536]`, 3.2 GFLOP.
const M: usize = 2048;
const K: usize = 512;
const N: usize = 1536;

struct Work {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

impl Work {
    fn gemm(&mut self) {
        matmul_serial(MatMut::rm(&mut self.c, M, N), Mat::rm(&self.a, M, K), Mat::rm(&self.b, K, N), false);
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Schedule {
    Blocking,
    NoProgress,
    ProgressCalls,
    ProgressThread,
}

impl Schedule {
    fn name(self) -> &'static str {
        match self {
            Schedule::Blocking => "blocking",
            Schedule::NoProgress => "no progress",
            Schedule::ProgressCalls => "progress calls",
            Schedule::ProgressThread => "progress thread",
        }
    }
}

/// A request shared with the progress thread (it only tests it; the main thread waits after
/// joining), so it crosses threads as a raw pointer.
struct Shared(*mut ffi::MPI_Request);
unsafe impl Send for Shared {}

fn step(s: Schedule, work: &mut Work, gemms: usize, send: &[f32], recv: &mut [f32], comm: ffi::MPI_Comm) -> f64 {
    let n = send.len() as i32;
    let start = Instant::now();
    // SAFETY (every call below): buffers outlive the request, which completes before return.
    unsafe {
        if s == Schedule::Blocking {
            for _ in 0..gemms {
                work.gemm();
            }
            ffi::MPI_Allreduce(send.as_ptr() as *const c_void, recv.as_mut_ptr() as *mut c_void, n, ffi::RSMPI_FLOAT, ffi::RSMPI_SUM, comm);
            return start.elapsed().as_secs_f64();
        }
        let mut req = ffi::RSMPI_REQUEST_NULL;
        ffi::MPI_Iallreduce(
            send.as_ptr() as *const c_void,
            recv.as_mut_ptr() as *mut c_void,
            n,
            ffi::RSMPI_FLOAT,
            ffi::RSMPI_SUM,
            comm,
            &mut req,
        );
        let mut flag = 0;
        match s {
            Schedule::NoProgress => (0..gemms).for_each(|_| work.gemm()),
            Schedule::ProgressCalls => {
                for _ in 0..gemms {
                    work.gemm();
                    if flag == 0 {
                        ffi::MPI_Test(&mut req, &mut flag, ffi::RSMPI_STATUS_IGNORE);
                    }
                }
            }
            Schedule::ProgressThread => {
                let done = AtomicBool::new(false);
                let shared = Shared(&mut req);
                std::thread::scope(|sc| {
                    let done = &done;
                    sc.spawn(move || {
                        let r = shared;
                        let mut f = 0;
                        while f == 0 && !done.load(Ordering::Relaxed) {
                            ffi::MPI_Test(r.0, &mut f, ffi::RSMPI_STATUS_IGNORE);
                        }
                    });
                    (0..gemms).for_each(|_| work.gemm());
                    done.store(true, Ordering::Relaxed);
                });
            }
            Schedule::Blocking => unreachable!(),
        }
        ffi::MPI_Wait(&mut req, ffi::RSMPI_STATUS_IGNORE);
    }
    start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: usize| {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
    };
    let (reps, gemms) = (arg("--reps", 7), arg("--gemms", 6));
    let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple).expect("MPI initialises");
    let world = universe.world();
    use mpi::traits::{AsRaw, Communicator};
    let (rank, size) = (world.rank(), world.size());
    let comm = world.as_raw();
    let mut work = Work { a: vec![0.5; M * K], b: vec![0.25; K * N], c: vec![0.0; M * N] };
    let barrier = || unsafe { ffi::MPI_Barrier(comm) };
    let compute_alone = |work: &mut Work| {
        barrier();
        let t = Instant::now();
        (0..gemms).for_each(|_| work.gemm());
        t.elapsed().as_secs_f64()
    };
    work.gemm();
    let schedules = [Schedule::Blocking, Schedule::NoProgress, Schedule::ProgressCalls, Schedule::ProgressThread];
    let schedules: Vec<Schedule> =
        schedules.into_iter().filter(|&s| s != Schedule::ProgressThread || threading == mpi::Threading::Multiple).collect();
    if rank == 0 {
        println!("{size} ranks, MPI threading {threading:?}; compute per step: {gemms} GEMMs [{M}×{K}]·[{K}×{N}]; {reps} rounds, each: the compute alone, then every schedule once (interleaved, so drift hits all alike); exposed = step − that round's compute alone, median over rounds\n");
        println!("| message | schedule | median step (s) | median compute alone (s) | exposed communication (s) | hidden vs blocking |");
        println!("|---|---|---|---|---|---|");
    }
    for mib in [1usize, 16, 64] {
        let len = mib * 1024 * 1024 / 4;
        let send = vec![1.0f32; len];
        let mut recv = vec![0.0f32; len];
        for &s in &schedules {
            step(s, &mut work, gemms, &send, &mut recv, comm);
        }
        let (mut steps, mut exposed, mut alone) = (vec![vec![]; schedules.len()], vec![vec![]; schedules.len()], vec![]);
        for _ in 0..reps {
            let c = compute_alone(&mut work);
            alone.push(c);
            for (i, &s) in schedules.iter().enumerate() {
                barrier();
                let t = step(s, &mut work, gemms, &send, &mut recv, comm);
                steps[i].push(t);
                exposed[i].push(t - c);
            }
        }
        let alone = median(alone);
        let blocking = median(exposed[0].clone());
        for (i, s) in schedules.iter().enumerate() {
            let e = median(exposed[i].clone());
            if rank == 0 {
                let hidden = if blocking > 1e-4 { format!("{:.0} %", 100.0 * (1.0 - e / blocking)) } else { "-".into() };
                println!("| {mib} MiB | {} | {:.4} | {alone:.4} | {e:.4} | {hidden} |", s.name(), median(steps[i].clone()));
            }
        }
    }
}
