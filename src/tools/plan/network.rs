//! Where a layout's collectives meet the network: the planner's placement of ranks on nodes
//! (`[hardware] ranks_per_node` and `rank_placement`) and, for each group of the mesh, the
//! bandwidth and latency of the slowest hop of its ring (`docs/planning.md`, *Layouts across
//! nodes*).
//!
//! A group whose members sit on one node uses the intra-node rates; one that spans nodes
//! the network's, at one rank's share of its node's network (`inter_node_*`, which the probe
//! measures with every rank of a node communicating at once, as every group of a kind does in
//! training) and each collective at its own measured rate: MPI picks another algorithm for
//! each, and on the emulated cluster a ring over 2 nodes of 2 ranks ran no faster per rank
//! than pairs of ranks across them (`benches/results/multinode_layouts.md`).

use crate::config::{HardwareCfg, Layout};
use crate::parallel::mesh::{Coords, GroupKind};
use std::collections::{BTreeMap, BTreeSet};

/// The rates of one group kind's collectives on a layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Bytes/s of the slowest hop, for collectives that move (all-gather, send, all-to-all)
    /// and for the two that sum what they move.
    pub bandwidth: f64,
    pub all_reduce_bandwidth: f64,
    pub reduce_scatter_bandwidth: f64,
    /// Seconds per hop of a message.
    pub latency: f64,
    /// Some hop of the group's ring runs between nodes.
    pub crosses_nodes: bool,
}

/// The mesh group behind a group name of the communication counters.
pub fn kind_of(group: &str) -> Option<GroupKind> {
    Some(match group {
        "tp" => GroupKind::Tp,
        "cp" => GroupKind::Cp,
        "fsdp" => GroupKind::Fsdp,
        "dp_rep" => GroupKind::DpRep,
        "batch" => GroupKind::Batch,
        "pp" => GroupKind::Pp,
        "ep" => GroupKind::Ep,
        "expert_fsdp" => GroupKind::ExpertFsdp,
        _ => return None,
    })
}

/// The most nodes any group of `kind` spans, with ranks placed as `hw` says.
pub fn nodes_spanned(kind: GroupKind, l: &Layout, hw: &HardwareCfg) -> usize {
    let world = l.world_size();
    let per_node = hw.ranks_per_node.max(1);
    let nodes = world.div_ceil(per_node);
    if nodes <= 1 {
        return 1;
    }
    let mut spanned: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for rank in 0..world {
        let (color, _) = Coords::of_rank(rank, l).color_key(kind, l);
        spanned.entry(color).or_default().insert(hw.rank_placement.node_of(rank, per_node, nodes));
    }
    spanned.values().map(BTreeSet::len).max().unwrap_or(1)
}

/// The rates of `kind`'s collectives on layout `l`: the intra-node link's where every group
/// of the kind stays in a node, else the network's, one rank's share each (every rank of a node
/// communicates at once, as the probe measured it), at each collective's own measured rate.
pub fn link(kind: GroupKind, l: &Layout, hw: &HardwareCfg) -> Link {
    if nodes_spanned(kind, l, hw) <= 1 {
        let reduce = if hw.intra_node_reduce_bandwidth > 0.0 { hw.intra_node_reduce_bandwidth } else { hw.intra_node_bandwidth };
        return Link {
            bandwidth: hw.intra_node_bandwidth,
            all_reduce_bandwidth: reduce,
            reduce_scatter_bandwidth: reduce,
            latency: hw.intra_node_latency,
            crosses_nodes: false,
        };
    }
    let or_gather = |bw: f64| if bw > 0.0 { bw } else { hw.inter_node_bandwidth };
    Link {
        bandwidth: hw.inter_node_bandwidth,
        all_reduce_bandwidth: or_gather(hw.inter_node_all_reduce_bandwidth),
        reduce_scatter_bandwidth: or_gather(hw.inter_node_reduce_scatter_bandwidth),
        latency: hw.inter_node_latency,
        crosses_nodes: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RankPlacement;

    fn layout(dp_replicate: usize, dp_shard: usize, tp: usize) -> Layout {
        Layout { pp: 1, dp_replicate, dp_shard, cp: 1, tp, ep: 1 }
    }

    fn two_nodes(placement: RankPlacement) -> HardwareCfg {
        HardwareCfg {
            ranks_per_node: 2,
            rank_placement: placement,
            inter_node_bandwidth: 1e8,
            intra_node_bandwidth: 1e9,
            inter_node_latency: 1e-5,
            intra_node_latency: 1e-6,
            ..HardwareCfg::default()
        }
    }

    #[test]
    fn groups_over_consecutive_ranks_cross_nodes_where_they_outgrow_one() {
        let hw = two_nodes(RankPlacement::Block);
        // FSDP 4 on 2 nodes of 2 spans both; HSDP 2 × 2 keeps its shards in a node and puts
        // its replicas across.
        let fsdp = link(GroupKind::Fsdp, &layout(1, 4, 1), &hw);
        assert!(fsdp.crosses_nodes);
        assert_eq!((fsdp.bandwidth, fsdp.reduce_scatter_bandwidth, fsdp.latency), (1e8, 1e8, 1e-5));
        let hw = HardwareCfg { inter_node_reduce_scatter_bandwidth: 5e7, ..hw };
        assert_eq!(link(GroupKind::Fsdp, &layout(1, 4, 1), &hw).reduce_scatter_bandwidth, 5e7);
        assert_eq!(link(GroupKind::Fsdp, &layout(1, 4, 1), &hw).all_reduce_bandwidth, 1e8);
        let l = layout(2, 2, 1);
        assert_eq!(nodes_spanned(GroupKind::DpRep, &l, &hw), 2);
        let fsdp = link(GroupKind::Fsdp, &l, &hw);
        assert!(!fsdp.crosses_nodes);
        assert_eq!(fsdp.bandwidth, 1e9);
    }

    #[test]
    fn a_cyclic_placement_puts_tensor_parallelism_across_nodes() {
        let l = layout(2, 1, 2);
        assert!(!link(GroupKind::Tp, &l, &two_nodes(RankPlacement::Block)).crosses_nodes);
        assert!(link(GroupKind::DpRep, &l, &two_nodes(RankPlacement::Block)).crosses_nodes);
        let hw = two_nodes(RankPlacement::Cyclic);
        let tp = link(GroupKind::Tp, &l, &hw);
        assert!(tp.crosses_nodes);
        assert_eq!(tp.bandwidth, 1e8);
        assert!(!link(GroupKind::DpRep, &l, &hw).crosses_nodes);
    }

    #[test]
    fn one_node_keeps_every_group_inside() {
        let hw = HardwareCfg { ranks_per_node: 4, ..two_nodes(RankPlacement::Cyclic) };
        for kind in [GroupKind::Tp, GroupKind::Fsdp, GroupKind::DpRep, GroupKind::Batch] {
            assert!(!link(kind, &layout(2, 1, 2), &hw).crosses_nodes);
        }
    }
}
