//! Which GPU each rank of a node takes, and whether the node's ranks share GPUs.
//!
//! Each rank sees the GPUs `CUDA_VISIBLE_DEVICES` (or the launcher's binding: Slurm's
//! `--gpus-per-task`, `--gpu-bind`, a site's default) leaves it. The ranks of a node gather
//! what each sees — the GPUs by UUID, and the NUMA nodes of the rank's CPUs — and every rank
//! derives the same assignment ([`assign`]): a rank takes a GPU on a NUMA node of its CPUs
//! where there is one (the nearest), spreading the ranks that share a choice over it in node
//! rank order; then the ranks share GPUs exactly when two chose the same UUID. NCCL needs
//! distinct GPUs (`parallel::collective::choose`). The decision reads only what it is given,
//! so tests inject device lists as the CPU feature check injects features.

use crate::backend::GpuInfo;
use crate::parallel::comm::Group;
use std::collections::BTreeSet;

/// What a rank contributes to the node's decision.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankView {
    /// The GPUs this rank sees, by its own ordinals.
    pub visible: Vec<GpuInfo>,
    /// The NUMA nodes of the CPUs this rank may run on (empty: unknown).
    pub numa_nodes: BTreeSet<usize>,
}

/// A rank's GPU and what its node's ranks do together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The GPU this rank opens.
    pub gpu: GpuInfo,
    /// Two ranks of the node took the same GPU.
    pub shared: bool,
}

/// The GPUs of `view` nearest its CPUs: those on one of its NUMA nodes, or all it sees where
/// none is (or the system does not say).
fn nearest(view: &RankView) -> Vec<&GpuInfo> {
    let near: Vec<&GpuInfo> = view.visible.iter().filter(|g| g.numa_node.is_some_and(|n| view.numa_nodes.contains(&n))).collect();
    if near.is_empty() {
        view.visible.iter().collect()
    } else {
        near
    }
}

/// Every rank's GPU on a node whose ranks, in node-rank order, see `views`: rank `r` takes
/// the `k`-th of its nearest GPUs (modulo their number), `k` counting the ranks before it whose
/// nearest GPUs are the same ones. An error names a rank that sees no GPU.
pub fn assign(views: &[RankView]) -> Result<Vec<Assignment>, String> {
    let pools: Vec<Vec<&GpuInfo>> = views.iter().map(nearest).collect();
    let key = |pool: &[&GpuInfo]| pool.iter().map(|g| g.uuid.clone()).collect::<Vec<_>>();
    let mut chosen = vec![];
    for (r, pool) in pools.iter().enumerate() {
        if pool.is_empty() {
            return Err(format!("node-local rank {r} sees no GPU (CUDA_VISIBLE_DEVICES, or the launcher's GPU binding)"));
        }
        let k = pools[..r].iter().filter(|p| key(p) == key(pool)).count();
        chosen.push(pool[k % pool.len()].clone());
    }
    let distinct: BTreeSet<&str> = chosen.iter().map(|g| g.uuid.as_str()).collect();
    let shared = distinct.len() < chosen.len();
    Ok(chosen.into_iter().map(|gpu| Assignment { gpu, shared }).collect())
}

/// This rank's assignment: `mine` gathered over the node's ranks (`node`, a collective call),
/// every rank deciding alike.
pub fn assign_on_node(node: &Group, mine: &RankView) -> Result<Assignment, String> {
    let bytes = serde_json::to_vec(mine).map_err(|e| e.to_string())?;
    let views: Vec<RankView> = node
        .all_gather_bytes(&bytes)
        .iter()
        .map(|b| serde_json::from_slice(b).map_err(|e| format!("a node rank's GPU list: {e}")))
        .collect::<Result<_, _>>()?;
    Ok(assign(&views)?.swap_remove(node.rank()))
}

/// The NUMA nodes of `cpus`, from `/sys/devices/system/node/node*/cpulist` (empty where the
/// system has no such files).
pub fn numa_nodes_of(cpus: &[usize]) -> BTreeSet<usize> {
    let Ok(entries) = std::fs::read_dir("/sys/devices/system/node") else { return BTreeSet::new() };
    let mut out = BTreeSet::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(node) = name.strip_prefix("node").and_then(|n| n.parse::<usize>().ok()) else { continue };
        let list = std::fs::read_to_string(e.path().join("cpulist")).unwrap_or_default();
        if super::placement::parse_cpu_list(list.trim()).is_some_and(|l| l.iter().any(|c| cpus.contains(c))) {
            out.insert(node);
        }
    }
    out
}

/// The console's line on a node's GPUs: shared or one per rank, and what that allows; `source`
/// names where the device lists came from.
pub fn sharing_line(a: &Assignment, source: &str) -> String {
    if a.shared {
        format!("GPUs ({source}): ranks of a node share GPUs: collectives staged through host memory or over a CUDA-aware MPI, not NCCL")
    } else {
        format!("GPUs ({source}): every rank has a GPU of its own: NCCL can run the collectives")
    }
}

/// How the placement table names a rank's GPU: its ordinal, UUID, bus id and NUMA node.
pub fn describe(g: &GpuInfo) -> String {
    let numa = g.numa_node.map_or("NUMA ?".to_string(), |n| format!("NUMA {n}"));
    format!("{} ({}, {}, {numa})", g.ordinal, g.uuid, g.pci_bus_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(ordinal: usize, uuid: &str, numa: Option<usize>) -> GpuInfo {
        GpuInfo { ordinal, uuid: uuid.into(), pci_bus_id: format!("0000:{:02x}:00.0", 0x10 + ordinal), numa_node: numa }
    }

    fn view(visible: Vec<GpuInfo>, numa: &[usize]) -> RankView {
        RankView { visible, numa_nodes: numa.iter().copied().collect() }
    }

    fn eight(numa_of: impl Fn(usize) -> usize) -> Vec<GpuInfo> {
        (0..8).map(|i| gpu(i, &format!("GPU-{i}"), Some(numa_of(i)))).collect()
    }

    /// `srun --gpus-per-task=1` or a per-rank `CUDA_VISIBLE_DEVICES`: each rank sees one GPU,
    /// ordinal 0, a different one on each rank. Not shared: NCCL is possible.
    #[test]
    fn per_task_binding_gives_each_rank_its_own_gpu() {
        let views: Vec<RankView> = (0..4).map(|r| view(vec![gpu(0, &format!("GPU-{r}"), Some(r / 2))], &[r / 2])).collect();
        let a = assign(&views).unwrap();
        assert!(a.iter().all(|x| x.gpu.ordinal == 0 && !x.shared));
        assert_eq!(a.iter().map(|x| x.gpu.uuid.as_str()).collect::<Vec<_>>(), ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]);
    }

    /// Eight GPUs visible to eight unbound ranks (every CPU, both NUMA nodes): rank k takes
    /// GPU k.
    #[test]
    fn eight_visible_gpus_go_one_per_rank_in_order() {
        let views: Vec<RankView> = (0..8).map(|_| view(eight(|i| i / 4), &[0, 1])).collect();
        let a = assign(&views).unwrap();
        assert_eq!(a.iter().map(|x| x.gpu.ordinal).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
        assert!(!a[0].shared);
    }

    /// Ranks bound to NUMA nodes whose GPUs are numbered the other way round (GPUs 0–3 on
    /// NUMA 1, 4–7 on NUMA 0): each rank takes a GPU of its own NUMA node, not `rank mod 8`.
    #[test]
    fn a_rank_takes_a_gpu_on_its_own_numa_node() {
        let gpus = eight(|i| 1 - i / 4);
        let views: Vec<RankView> = (0..8).map(|r| view(gpus.clone(), &[r / 4])).collect();
        let a = assign(&views).unwrap();
        assert_eq!(a.iter().map(|x| x.gpu.ordinal).collect::<Vec<_>>(), [4, 5, 6, 7, 0, 1, 2, 3]);
        for (r, x) in a.iter().enumerate() {
            assert_eq!(x.gpu.numa_node, Some(r / 4), "rank {r}");
            assert!(!x.shared);
        }
    }

    /// More ranks than GPUs (the staged path's case), or every rank seeing the one GPU: shared.
    #[test]
    fn ranks_on_one_gpu_share_it() {
        let views: Vec<RankView> = (0..2).map(|_| view(vec![gpu(0, "GPU-A", Some(0))], &[0])).collect();
        let a = assign(&views).unwrap();
        assert!(a.iter().all(|x| x.shared && x.gpu.uuid == "GPU-A"));
        let views: Vec<RankView> = (0..4).map(|_| view(eight(|_| 0)[..2].to_vec(), &[0])).collect();
        let a = assign(&views).unwrap();
        assert_eq!(a.iter().map(|x| x.gpu.ordinal).collect::<Vec<_>>(), [0, 1, 0, 1]);
        assert!(a[0].shared);
    }

    /// No NUMA information (a VM, a container without sysfs): every visible GPU is as near.
    #[test]
    fn without_numa_information_ranks_take_gpus_in_node_rank_order() {
        let gpus: Vec<GpuInfo> = (0..4).map(|i| gpu(i, &format!("GPU-{i}"), None)).collect();
        let views: Vec<RankView> = (0..4).map(|_| view(gpus.clone(), &[])).collect();
        let a = assign(&views).unwrap();
        assert_eq!(a.iter().map(|x| x.gpu.ordinal).collect::<Vec<_>>(), [0, 1, 2, 3]);
    }

    #[test]
    fn a_rank_without_a_gpu_is_an_error_naming_it() {
        let views = vec![view(vec![gpu(0, "GPU-0", None)], &[]), view(vec![], &[])];
        assert!(assign(&views).unwrap_err().contains("node-local rank 1 sees no GPU"));
    }

    #[test]
    fn the_placement_line_names_ordinal_uuid_bus_and_numa_node() {
        assert_eq!(describe(&gpu(3, "GPU-3", Some(1))), "3 (GPU-3, 0000:13:00.0, NUMA 1)");
        assert_eq!(describe(&gpu(0, "GPU-0", None)), "0 (GPU-0, 0000:10:00.0, NUMA ?)");
    }
}
