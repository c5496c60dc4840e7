//! Where a layout's collectives meet the network: the planner's placement of ranks on nodes
//! (`[hardware] ranks_per_node` and `rank_placement`) and, for each group of the mesh, the
//! bandwidth and latency of the slowest hop of its ring (`docs/planning.md`, *Layouts across
//! nodes*).
//!
//! A group whose members sit on one node uses the intra-node rates; one that spans nodes
//! the network's, per collective (MPI picks another algorithm for each), as the probe measured
//! them with the program's own non-blocking calls and every group of a kind communicating at
//! once, and the blocking all-reduce tensor parallelism calls on its own: `inter_node_*` for
//! groups with one rank on each node, `inter_node_packed_*` for groups with several ranks on a
//! node, whose ring crosses between nodes on fewer of its hops (on the emulated cluster FSDP 4
//! over 2 nodes moved 1.1–5.6 times a pair's bytes per second, by collective:
//! `benches/results/multinode_layouts.md`).

use crate::config::{HardwareCfg, Layout};
use crate::parallel::mesh::{Coords, GroupKind};
use std::collections::BTreeMap;

/// The rates of one group kind's collectives on a layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Bytes/s of the slowest hop, for collectives that move (all-gather, send, all-to-all)
    /// and for the two that sum what they move.
    pub bandwidth: f64,
    pub all_reduce_bandwidth: f64,
    pub reduce_scatter_bandwidth: f64,
    /// The all-reduce called blocking (tensor parallelism's, the step's small reductions);
    /// the fields above are the non-blocking calls' rates, as FSDP and the bucketed gradient
    /// all-reduce make them.
    pub blocking_all_reduce_bandwidth: f64,
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

/// How the groups of a kind sit on the nodes: the most nodes any of them spans, and whether
/// one that spans nodes holds several ranks on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub nodes: usize,
    pub packed: bool,
}

/// Where the groups of `kind` sit, with ranks placed as `hw` says.
pub fn span(kind: GroupKind, l: &Layout, hw: &HardwareCfg) -> Span {
    let world = l.world_size();
    let per_node = hw.ranks_per_node.max(1);
    let nodes = world.div_ceil(per_node);
    if nodes <= 1 {
        return Span { nodes: 1, packed: false };
    }
    // Per group: its ranks on each node.
    let mut groups: BTreeMap<usize, BTreeMap<usize, usize>> = BTreeMap::new();
    for rank in 0..world {
        let (color, _) = Coords::of_rank(rank, l).color_key(kind, l);
        *groups.entry(color).or_default().entry(hw.rank_placement.node_of(rank, per_node, nodes)).or_default() += 1;
    }
    Span {
        nodes: groups.values().map(BTreeMap::len).max().unwrap_or(1),
        packed: groups.values().any(|on| on.len() > 1 && on.values().any(|&n| n > 1)),
    }
}

/// The rates of `kind`'s collectives on layout `l`: the intra-node link's where every group
/// of the kind stays in a node, else the network's, one rank's share each (every rank of a node
/// communicates at once, as the probe measured it), at each collective's own measured rate, and
/// at the rates of groups with several ranks on a node where the kind's groups are so.
pub fn link(kind: GroupKind, l: &Layout, hw: &HardwareCfg) -> Link {
    let span = span(kind, l, hw);
    if span.nodes <= 1 {
        let reduce = if hw.intra_node_reduce_bandwidth > 0.0 { hw.intra_node_reduce_bandwidth } else { hw.intra_node_bandwidth };
        return Link {
            bandwidth: hw.intra_node_bandwidth,
            all_reduce_bandwidth: reduce,
            reduce_scatter_bandwidth: reduce,
            blocking_all_reduce_bandwidth: reduce,
            latency: hw.intra_node_latency,
            crosses_nodes: false,
        };
    }
    let or = |bw: f64, fallback: f64| if bw > 0.0 { bw } else { fallback };
    let spread = [
        hw.inter_node_bandwidth,
        or(hw.inter_node_all_reduce_bandwidth, hw.inter_node_bandwidth),
        or(hw.inter_node_reduce_scatter_bandwidth, hw.inter_node_bandwidth),
    ];
    let [bandwidth, all_reduce_bandwidth, reduce_scatter_bandwidth] = if span.packed {
        [
            or(hw.inter_node_packed_bandwidth, spread[0]),
            or(hw.inter_node_packed_all_reduce_bandwidth, spread[1]),
            or(hw.inter_node_packed_reduce_scatter_bandwidth, spread[2]),
        ]
    } else {
        spread
    };
    // Measured one rank per node only: a packed group's blocking all-reduce takes the packed
    // non-blocking rate.
    let blocking_all_reduce_bandwidth =
        if span.packed { all_reduce_bandwidth } else { or(hw.inter_node_blocking_all_reduce_bandwidth, all_reduce_bandwidth) };
    Link {
        bandwidth,
        all_reduce_bandwidth,
        reduce_scatter_bandwidth,
        blocking_all_reduce_bandwidth,
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
        assert_eq!(span(GroupKind::DpRep, &l, &hw), Span { nodes: 2, packed: false });
        let fsdp = link(GroupKind::Fsdp, &l, &hw);
        assert!(!fsdp.crosses_nodes);
        assert_eq!(fsdp.bandwidth, 1e9);
    }

    #[test]
    fn a_group_with_several_ranks_on_a_node_gets_the_packed_rates_where_they_were_measured() {
        let hw = HardwareCfg {
            inter_node_packed_bandwidth: 3e8,
            inter_node_packed_reduce_scatter_bandwidth: 2e8,
            ..two_nodes(RankPlacement::Block)
        };
        let fsdp4 = layout(1, 4, 1);
        assert_eq!(span(GroupKind::Fsdp, &fsdp4, &hw), Span { nodes: 2, packed: true });
        let fsdp = link(GroupKind::Fsdp, &fsdp4, &hw);
        // The all-reduce was not measured packed: the one-rank-per-node rate stands in.
        assert_eq!((fsdp.bandwidth, fsdp.reduce_scatter_bandwidth, fsdp.all_reduce_bandwidth), (3e8, 2e8, 1e8));
        // HSDP's replicas, one per node, keep the spread rates.
        assert_eq!(link(GroupKind::DpRep, &layout(2, 2, 1), &hw).bandwidth, 1e8);
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
    fn the_blocking_all_reduce_has_its_own_rate_one_rank_per_node() {
        let hw = HardwareCfg {
            inter_node_all_reduce_bandwidth: 4e7,
            inter_node_blocking_all_reduce_bandwidth: 9e7,
            inter_node_packed_all_reduce_bandwidth: 2e8,
            ..two_nodes(RankPlacement::Cyclic)
        };
        let tp = link(GroupKind::Tp, &layout(2, 1, 2), &hw);
        assert_eq!((tp.all_reduce_bandwidth, tp.blocking_all_reduce_bandwidth), (4e7, 9e7));
        // Unset, it is the non-blocking one's.
        let unset = HardwareCfg { inter_node_blocking_all_reduce_bandwidth: 0.0, ..hw.clone() };
        assert_eq!(link(GroupKind::Tp, &layout(2, 1, 2), &unset).blocking_all_reduce_bandwidth, 4e7);
        // A packed group was measured non-blocking only.
        let fsdp = link(GroupKind::Fsdp, &layout(1, 4, 1), &HardwareCfg { rank_placement: RankPlacement::Block, ..hw });
        assert_eq!(fsdp.blocking_all_reduce_bandwidth, 2e8);
    }

    #[test]
    fn one_node_keeps_every_group_inside() {
        let hw = HardwareCfg { ranks_per_node: 4, ..two_nodes(RankPlacement::Cyclic) };
        for kind in [GroupKind::Tp, GroupKind::Fsdp, GroupKind::DpRep, GroupKind::Batch] {
            assert!(!link(kind, &layout(2, 1, 2), &hw).crosses_nodes);
        }
    }
}
