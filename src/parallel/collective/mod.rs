//! The collectives of one mesh group on a backend's buffers: what the strategies (`fsdp`,
//! `tp`, `cp`) call, whatever memory the buffers live in.
//!
//! [`Collective`] is written over the buffer type `V`. A host vector's implementation is the
//! group itself (`comm::Group`, over MPI); [`staged::Staged`] runs the group's MPI collectives
//! on any backend's buffers through host copies (a device's, or the host's in the device path);
//! with feature `cuda`, [`nccl`] runs them over NCCL on the GPU's buffers and [`cuda_aware`]
//! hands the GPU's buffers to an MPI that takes them. [`choose`] decides which of them a GPU
//! job runs. Non-blocking collectives take their buffers and give them back when waited for, so
//! nothing touches a buffer in flight. Bytes and time are counted by the group (`comm`), per
//! kind.

#[cfg(feature = "cuda")]
pub mod cuda_aware;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod staged;

pub use staged::{Staged, StagedMesh};

use super::comm::{Group, Ticket};
use super::mesh::Mesh;
use crate::config::CommBackend;
use crate::model::hooks::ExpertExchange;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Range;

/// The send and receive buffers of a collective.
type Buffers<V> = (V, V);

/// One group's collectives on buffers `V` (`recv = [send of rank 0, send of rank 1, …]` for a
/// gather; a reduce-scatter leaves block `rank` of the sum).
pub trait Collective<V> {
    /// The group's degree.
    fn degree(&self) -> usize;
    /// This rank's coordinate in the group.
    fn rank(&self) -> usize;
    /// Element-wise sum across the group, in place.
    fn all_reduce_sum(&self, buf: &mut V);
    /// Element-wise sum across the group of `buf[range]`, in place.
    fn all_reduce_sum_range(&self, buf: &mut V, range: Range<usize>);
    /// Element-wise maximum across the group, in place.
    fn all_reduce_max(&self, buf: &mut V);
    /// `recv = [send of every rank]` (`recv` holds degree × `send`).
    fn all_gather(&self, send: &V, recv: &mut V);
    /// Sums `send` (`[degree][recv.len()]`) across the group; this rank's block lands in `recv`.
    fn reduce_scatter_sum(&self, send: &V, recv: &mut V);
    /// Starts [`Collective::all_gather`] of `send` into `recv`; the buffers come back from
    /// [`Collective::wait`].
    fn start_all_gather(&self, send: V, recv: V) -> Ticket;
    /// Starts [`Collective::reduce_scatter_sum`].
    fn start_reduce_scatter_sum(&self, send: V, recv: V) -> Ticket;
    /// Starts the sum of `send` across the group into `recv`.
    fn start_all_reduce_sum(&self, send: V, recv: V) -> Ticket;
    /// Lets the collective of `t` progress without blocking; true once it has completed.
    fn test(&self, t: &Ticket) -> bool;
    /// Completes the collective of `t`; returns its buffers `(send, recv)`.
    fn wait(&self, t: Ticket) -> (V, V);
    /// Starts sending a copy of `buf` to the next rank of the ring (exchange `slot`) while the
    /// previous rank's block is received; the caller may keep computing on `buf`.
    fn start_shift(&self, slot: usize, buf: &V);
    /// Completes exchange `slot`: `buf` becomes the previous rank's block.
    fn finish_shift(&self, slot: usize, buf: &mut V);
    /// Called once the device has finished the step's work: a group whose collectives run
    /// asynchronously on a device counts their time now (the host's collectives are counted
    /// as they run).
    fn settle(&self) {}
}

impl Collective<Vec<f32>> for Group {
    fn degree(&self) -> usize {
        self.size()
    }
    fn rank(&self) -> usize {
        Group::rank(self)
    }
    fn all_reduce_sum(&self, buf: &mut Vec<f32>) {
        self.all_reduce_sum_f32(buf);
    }
    fn all_reduce_sum_range(&self, buf: &mut Vec<f32>, range: Range<usize>) {
        self.all_reduce_sum_f32(&mut buf[range]);
    }
    fn all_reduce_max(&self, buf: &mut Vec<f32>) {
        self.all_reduce_max_f32(buf);
    }
    fn all_gather(&self, send: &Vec<f32>, recv: &mut Vec<f32>) {
        self.all_gather_f32(send, recv);
    }
    fn reduce_scatter_sum(&self, send: &Vec<f32>, recv: &mut Vec<f32>) {
        self.reduce_scatter_sum_f32(send, recv);
    }
    fn start_all_gather(&self, send: Vec<f32>, recv: Vec<f32>) -> Ticket {
        self.start_all_gather_f32(send, recv)
    }
    fn start_reduce_scatter_sum(&self, send: Vec<f32>, recv: Vec<f32>) -> Ticket {
        self.start_reduce_scatter_sum_f32(send, recv)
    }
    fn start_all_reduce_sum(&self, send: Vec<f32>, recv: Vec<f32>) -> Ticket {
        self.start_all_reduce_sum_f32(send, recv)
    }
    fn test(&self, t: &Ticket) -> bool {
        Group::test(self, t)
    }
    fn wait(&self, t: Ticket) -> (Vec<f32>, Vec<f32>) {
        Group::wait(self, t)
    }
    fn start_shift(&self, slot: usize, buf: &Vec<f32>) {
        self.start_ring_shift_f32(slot, buf);
    }
    fn finish_shift(&self, slot: usize, buf: &mut Vec<f32>) {
        self.finish_ring_shift_f32(slot, buf);
    }
}

impl ExpertExchange<Vec<f32>> for Group {
    fn degree(&self) -> usize {
        self.size()
    }
    fn rank(&self) -> usize {
        Group::rank(self)
    }
    fn exchange_counts(&self, send: &[u64]) -> Vec<u64> {
        self.all_to_all_u64(send)
    }
    fn exchange_rows(&self, send: &Vec<f32>, send_counts: &[usize], recv: &mut Vec<f32>, recv_counts: &[usize]) {
        recv.resize(recv_counts.iter().sum(), 0.0);
        self.all_to_all_v_f32(send, send_counts, recv, recv_counts);
    }
}

/// The buffers of collectives whose completion is ordered by other means than MPI requests —
/// run blocking, or on a device ordered by its events: the buffers until waited for, and each
/// ring exchange's received block until finished.
pub struct Finished<V> {
    done: RefCell<BTreeMap<u64, Buffers<V>>>,
    next: std::cell::Cell<u64>,
    ring: RefCell<BTreeMap<usize, V>>,
}

impl<V> Default for Finished<V> {
    fn default() -> Self {
        Finished { done: RefCell::new(BTreeMap::new()), next: std::cell::Cell::new(0), ring: RefCell::new(BTreeMap::new()) }
    }
}

impl<V> Finished<V> {
    /// Holds a finished collective's buffers; its ticket.
    pub fn keep(&self, send: V, recv: V) -> Ticket {
        let id = self.next.get();
        self.next.set(id + 1);
        self.done.borrow_mut().insert(id, (send, recv));
        Ticket(id)
    }

    /// The buffers of the collective of `t`.
    pub fn take(&self, t: Ticket) -> Buffers<V> {
        self.done.borrow_mut().remove(&t.0).expect("a ticket of this group, waited for once")
    }

    /// Holds the block ring exchange `slot` received.
    pub fn hold_shift(&self, slot: usize, received: V) {
        let old = self.ring.borrow_mut().insert(slot, received);
        assert!(old.is_none(), "ring slot {slot} already in flight");
    }

    /// The block ring exchange `slot` received.
    pub fn take_shift(&self, slot: usize) -> V {
        self.ring.borrow_mut().remove(&slot).expect("finish_shift after start_shift")
    }
}

/// Every mesh group's collectives on buffers `V`, as the strategies use them.
pub struct MeshCollectives<'a, V> {
    pub tp: &'a dyn Collective<V>,
    pub cp: &'a dyn Collective<V>,
    pub fsdp: &'a dyn Collective<V>,
    pub dp_rep: &'a dyn Collective<V>,
    /// Shards each expert's weights (the `fsdp` group's ranks that hold the same experts).
    pub expert_fsdp: &'a dyn Collective<V>,
    /// Moves the routed rows between the ranks holding different experts.
    pub ep: &'a dyn ExpertExchange<V>,
}

impl<V> MeshCollectives<'_, V> {
    /// Every group's [`Collective::settle`].
    pub fn settle(&self) {
        for c in [self.tp, self.cp, self.fsdp, self.dp_rep, self.expert_fsdp] {
            c.settle();
        }
    }
}

impl<'g> MeshCollectives<'g, Vec<f32>> {
    /// The mesh's groups themselves: MPI on host vectors.
    pub fn host(mesh: &'g Mesh) -> Self {
        MeshCollectives { tp: &mesh.tp, cp: &mesh.cp, fsdp: &mesh.fsdp, dp_rep: &mesh.dp_rep, expert_fsdp: &mesh.expert_fsdp, ep: &mesh.ep }
    }
}

/// What a GPU job's devices and MPI allow its collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuFacts {
    /// Two ranks of a node opened the same GPU (`run::gpus`).
    pub shared: bool,
    /// The MPI library says it takes device buffers (`comm::cuda_aware`).
    pub cuda_aware: bool,
    /// The device buffers come from CUDA's stream-ordered pool (`cuMemAllocAsync`), which CUDA
    /// IPC — how a CUDA-aware MPI moves device buffers between the ranks of a node — cannot map.
    pub pool_memory: bool,
}

/// The collectives a GPU job runs, and a line saying why where it matters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chosen {
    pub backend: CommBackend,
    pub note: Option<String>,
}

/// The collectives `[parallel] comm_backend = asked` runs on GPUs with `facts`: `auto` is NCCL
/// when every rank has a GPU of its own, else CUDA-aware MPI where the library takes device
/// buffers and they are not pool memory, else staged. NCCL asked for with ranks sharing a GPU
/// (NCCL refuses two ranks on one device), or CUDA-aware MPI of an MPI that is not, is an error
/// with a hint; CUDA-aware MPI asked for on pool memory runs, with a warning.
pub fn choose(asked: CommBackend, facts: GpuFacts) -> Result<Chosen, String> {
    let chosen = |backend, note: Option<&str>| Ok(Chosen { backend, note: note.map(String::from) });
    const POOL: &str = "this MPI takes device buffers, but they come from CUDA's stream-ordered pool, which CUDA IPC (how a \
                        CUDA-aware MPI moves them between the ranks of a node) cannot map";
    match asked {
        CommBackend::Auto if !facts.shared => chosen(CommBackend::Nccl, None),
        CommBackend::Auto if facts.cuda_aware && !facts.pool_memory => chosen(CommBackend::Mpi, None),
        CommBackend::Auto if facts.cuda_aware => chosen(CommBackend::Staged, Some(&format!("CUDA-aware MPI not chosen: {POOL}"))),
        CommBackend::Auto => chosen(CommBackend::Staged, None),
        CommBackend::Nccl if facts.shared => Err("[parallel] comm_backend = \"nccl\": ranks of this node share a GPU, and NCCL needs \
             one GPU per rank\nHINT: run one rank per GPU, or comm_backend = \"staged\" (any number of ranks per GPU)"
            .into()),
        CommBackend::Mpi if !facts.cuda_aware => Err("[parallel] comm_backend = \"mpi\": this MPI does not say it takes device buffers \
             (MPIX_Query_cuda_support)\nHINT: comm_backend = \"nccl\" or \"staged\", or an MPI built with CUDA support"
            .into()),
        CommBackend::Mpi if facts.pool_memory => chosen(
            CommBackend::Mpi,
            Some(&format!("warning: [parallel] comm_backend = \"mpi\": {POOL}; transfers between ranks of one node may fail")),
        ),
        other => chosen(other, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(shared: bool, cuda_aware: bool, pool_memory: bool) -> GpuFacts {
        GpuFacts { shared, cuda_aware, pool_memory }
    }

    #[test]
    fn nccl_is_chosen_only_with_a_gpu_per_rank_and_mpi_only_where_it_takes_device_buffers() {
        let backend = |asked, f| choose(asked, f).map(|c| c.backend);
        assert_eq!(backend(CommBackend::Auto, facts(false, false, true)), Ok(CommBackend::Nccl));
        assert_eq!(backend(CommBackend::Auto, facts(true, false, true)), Ok(CommBackend::Staged));
        assert_eq!(backend(CommBackend::Auto, facts(true, true, false)), Ok(CommBackend::Mpi));
        assert_eq!(backend(CommBackend::Staged, facts(false, true, false)), Ok(CommBackend::Staged));
        let e = choose(CommBackend::Nccl, facts(true, true, false)).unwrap_err();
        assert!(e.contains("share a GPU") && e.contains("HINT"), "{e}");
        let e = choose(CommBackend::Mpi, facts(false, false, false)).unwrap_err();
        assert!(e.contains("MPIX_Query_cuda_support") && e.contains("HINT"), "{e}");
    }

    /// Pool memory (every GPU with memory pools, as cudarc allocates there) cannot go through
    /// CUDA IPC: `auto` never picks CUDA-aware MPI then, and says why; asked for, it warns.
    #[test]
    fn cuda_aware_mpi_is_not_auto_selected_on_stream_ordered_pool_memory() {
        let c = choose(CommBackend::Auto, facts(true, true, true)).unwrap();
        assert_eq!(c.backend, CommBackend::Staged);
        assert!(c.note.as_deref().is_some_and(|n| n.contains("stream-ordered pool") && n.contains("CUDA IPC")), "{c:?}");
        let c = choose(CommBackend::Mpi, facts(true, true, true)).unwrap();
        assert_eq!(c.backend, CommBackend::Mpi);
        assert!(c.note.as_deref().is_some_and(|n| n.starts_with("warning:")), "{c:?}");
        assert_eq!(choose(CommBackend::Auto, facts(true, true, false)).unwrap().note, None);
    }
}
