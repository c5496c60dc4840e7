//! The 5-D process mesh: `pp × dp_replicate × dp_shard × cp × tp`, TP fastest-varying and the
//! pipeline slowest (its stages span nodes, its traffic is the lightest; tp stays in a node).
//!
//! `rank = (((p·dp_replicate + r)·dp_shard + s)·cp + c)·tp + t`. Builds one communicator per
//! group of the mesh (`docs/parallelism.md`) with `MPI_Comm_split` (through `comm`): `tp`
//! (ranks differing only in t), `cp` (only c), `fsdp` (s and c: FSDP shards over
//! `dp_shard × cp`), `dp_rep` (only r), `batch` (r and s: which samples a rank sees) and `pp`
//! (only p: one pipeline). Every group but `pp` lies inside one pipeline stage. Every group
//! exists at every degree, size 1 included. Knows nothing of what is communicated.

use super::comm::Group;
use crate::config::Layout;

/// A rank's coordinates in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coords {
    pub p: usize,
    pub r: usize,
    pub s: usize,
    pub c: usize,
    pub t: usize,
}

/// The groups of the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupKind {
    Tp,
    Cp,
    Fsdp,
    DpRep,
    Batch,
    Pp,
    Ep,
    ExpertFsdp,
}

impl Coords {
    pub fn of_rank(rank: usize, l: &Layout) -> Coords {
        let stage_size = l.dp_replicate * l.dp_shard * l.cp * l.tp;
        let in_stage = rank % stage_size;
        Coords {
            t: in_stage % l.tp,
            c: (in_stage / l.tp) % l.cp,
            s: (in_stage / (l.tp * l.cp)) % l.dp_shard,
            r: in_stage / (l.tp * l.cp * l.dp_shard),
            p: rank / stage_size,
        }
    }

    pub fn rank(&self, l: &Layout) -> usize {
        self.p * (l.dp_replicate * l.dp_shard * l.cp * l.tp) + self.in_stage(l)
    }

    /// The rank's index inside its pipeline stage (its rank when there is no pipeline).
    fn in_stage(&self, l: &Layout) -> usize {
        ((self.r * l.dp_shard + self.s) * l.cp + self.c) * l.tp + self.t
    }

    /// Data-parallel rank: which slice of each global batch this rank reads.
    pub fn dp_rank(&self, l: &Layout) -> usize {
        self.r * l.dp_shard + self.s
    }

    /// The rank's coordinate in its `fsdp` group: `s·cp + c`.
    fn flat_fsdp(&self, l: &Layout) -> usize {
        self.s * l.cp + self.c
    }

    /// `(color, key)` for `MPI_Comm_split`: equal colour = same group; key = coordinate in it.
    pub fn color_key(&self, g: GroupKind, l: &Layout) -> (usize, usize) {
        let Coords { p, r, s, c, t } = *self;
        // Every group but pp lies in one stage: its colours are numbered stage by stage.
        let stage = |colors: usize, color: usize| p * colors + color;
        let stage_size = l.dp_replicate * l.dp_shard * l.cp * l.tp;
        match g {
            GroupKind::Tp => (stage(stage_size / l.tp, ((r * l.dp_shard + s) * l.cp) + c), t),
            GroupKind::Cp => (stage(stage_size / l.cp, (r * l.dp_shard + s) * l.tp + t), c),
            GroupKind::Fsdp => (stage(l.dp_replicate * l.tp, r * l.tp + t), s * l.cp + c),
            GroupKind::DpRep => (stage(stage_size / l.dp_replicate, (s * l.cp + c) * l.tp + t), r),
            GroupKind::Batch => (stage(l.cp * l.tp, c * l.tp + t), r * l.dp_shard + s),
            GroupKind::Pp => (self.in_stage(l), p),
            GroupKind::Ep => {
                (stage(stage_size / l.ep, (r * l.tp + t) * (l.fsdp() / l.ep) + self.flat_fsdp(l) / l.ep), self.flat_fsdp(l) % l.ep)
            }
            GroupKind::ExpertFsdp => {
                (stage(l.dp_replicate * l.tp * l.ep, (r * l.tp + t) * l.ep + self.flat_fsdp(l) % l.ep), self.flat_fsdp(l) / l.ep)
            }
        }
    }
}

/// This rank's place in the mesh and its communicators.
pub struct Mesh {
    pub layout: Layout,
    pub coords: Coords,
    pub world: Group,
    pub tp: Group,
    pub cp: Group,
    pub fsdp: Group,
    pub dp_rep: Group,
    pub batch: Group,
    /// One pipeline: the ranks of every stage at this rank's place in its stage.
    pub pp: Group,
    /// The ranks that split the experts between them (`ep` of the `fsdp` group's).
    pub ep: Group,
    /// The ranks that shard the same experts' weights (`fsdp / ep` of them).
    pub expert_fsdp: Group,
    /// Ranks on this node (for threads per rank and the GPU each rank takes).
    pub node: Group,
}

impl Mesh {
    /// Splits the world into the mesh's groups. The layout must already be checked against
    /// the world size (`Deck::resolve`).
    pub fn new(world: Group, layout: Layout) -> Mesh {
        assert_eq!(layout.world_size(), world.size(), "layout was not resolved against this world");
        let coords = Coords::of_rank(world.rank(), &layout);
        let split = |name, g| {
            let (color, key) = coords.color_key(g, &layout);
            world.split(name, color, key)
        };
        let tp = split("tp", GroupKind::Tp);
        let cp = split("cp", GroupKind::Cp);
        let fsdp = split("fsdp", GroupKind::Fsdp);
        let dp_rep = split("dp_rep", GroupKind::DpRep);
        let batch = split("batch", GroupKind::Batch);
        let pp = split("pp", GroupKind::Pp);
        let ep = split("ep", GroupKind::Ep);
        let expert_fsdp = split("expert_fsdp", GroupKind::ExpertFsdp);
        let node = node_group(&world);
        Mesh { layout, coords, world, tp, cp, fsdp, dp_rep, batch, pp, ep, expert_fsdp, node }
    }

    /// Every group with its name, for counters and logs.
    pub fn groups(&self) -> [&Group; 8] {
        [&self.tp, &self.cp, &self.fsdp, &self.dp_rep, &self.batch, &self.pp, &self.ep, &self.expert_fsdp]
    }
}

/// Groups consecutive world ranks into this many pretend nodes, instead of the nodes the ranks
/// share memory on: the node communicator, the node-local ranks, the placement table's hosts
/// (`<host>:node<k>`) and the GPU-per-rank decision then behave as on that many real nodes,
/// so a test on one machine shows what spans nodes.
pub const PRETEND_NODES_ENV: &str = "NDTRAIN_DEBUG_PRETEND_NODES";

/// Ranks per pretend node on a world of `world_size` ranks, if `PRETEND_NODES_ENV` is set.
pub fn pretend_ranks_per_node(world_size: usize) -> Result<Option<usize>, String> {
    match std::env::var(PRETEND_NODES_ENV) {
        Err(_) => Ok(None),
        Ok(v) => ranks_per_pretend_node(&v, world_size).map(Some).map_err(|e| format!("{PRETEND_NODES_ENV}={v:?}: {e}")),
    }
}

fn ranks_per_pretend_node(spec: &str, world_size: usize) -> Result<usize, String> {
    let nodes: usize = spec.trim().parse().map_err(|_| "expected a whole number of nodes".to_string())?;
    if nodes == 0 || world_size % nodes != 0 {
        return Err(format!("{world_size} ranks do not split evenly into {nodes} node(s): use a divisor of {world_size}"));
    }
    Ok(world_size / nodes)
}

/// The ranks of `world` on this rank's node, ordered by world rank: those that share memory
/// (`MPI_Comm_split_type` shared), or with `NDTRAIN_DEBUG_PRETEND_NODES` the consecutive ranks
/// of this rank's pretend node. A malformed count ends the job with code 2 (every rank reads
/// the same environment; rank 0 says why).
pub fn node_group(world: &Group) -> Group {
    match pretend_ranks_per_node(world.size()) {
        Ok(None) => world.split_shared(),
        Ok(Some(per_node)) => world.split("node", world.rank() / per_node, world.rank()),
        Err(e) => {
            if world.rank() == 0 {
                crate::exit::report(&e);
            }
            // Rank 0's message is out before any rank ends the job.
            world.barrier();
            super::comm::abort(crate::exit::BAD_INPUT)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pretend_node_counts_divide_the_world_or_say_why_not() {
        assert_eq!(ranks_per_pretend_node("2", 4), Ok(2));
        assert_eq!(ranks_per_pretend_node(" 4 ", 4), Ok(1));
        assert_eq!(ranks_per_pretend_node("1", 3), Ok(3));
        assert!(ranks_per_pretend_node("3", 4).unwrap_err().contains("4 ranks do not split evenly into 3 node(s)"));
        assert!(ranks_per_pretend_node("0", 4).unwrap_err().contains("into 0 node(s)"));
        assert!(ranks_per_pretend_node("two", 4).unwrap_err().contains("whole number"));
    }

    fn layout() -> Layout {
        Layout { pp: 2, dp_replicate: 2, dp_shard: 3, cp: 2, tp: 2, ep: 3 }
    }

    #[test]
    fn coordinates_round_trip_and_tp_is_fastest() {
        let l = layout();
        for rank in 0..l.world_size() {
            assert_eq!(Coords::of_rank(rank, &l).rank(&l), rank);
        }
        assert_eq!(Coords::of_rank(1, &l), Coords { p: 0, r: 0, s: 0, c: 0, t: 1 });
        assert_eq!(Coords::of_rank(2, &l), Coords { p: 0, r: 0, s: 0, c: 1, t: 0 });
        assert_eq!(Coords::of_rank(24, &l), Coords { p: 1, r: 0, s: 0, c: 0, t: 0 });
    }

    /// Each group has the size `docs/parallelism.md` gives, its members differ exactly in the
    /// group's coordinates, and keys are 0..size within each colour.
    #[test]
    fn groups_have_their_documented_sizes_and_members() {
        let l = layout();
        let sizes = [
            (GroupKind::Tp, l.tp),
            (GroupKind::Cp, l.cp),
            (GroupKind::Fsdp, l.dp_shard * l.cp),
            (GroupKind::DpRep, l.dp_replicate),
            (GroupKind::Batch, l.dp_replicate * l.dp_shard),
            (GroupKind::Pp, l.pp),
            (GroupKind::Ep, l.ep),
            (GroupKind::ExpertFsdp, l.expert_fsdp()),
        ];
        for (g, size) in sizes {
            let mut by_color: std::collections::BTreeMap<usize, Vec<(usize, Coords)>> = Default::default();
            for rank in 0..l.world_size() {
                let c = Coords::of_rank(rank, &l);
                let (color, key) = c.color_key(g, &l);
                by_color.entry(color).or_default().push((key, c));
            }
            assert_eq!(by_color.len(), l.world_size() / size, "{g:?}");
            for members in by_color.values() {
                assert_eq!(members.len(), size, "{g:?}");
                let mut keys: Vec<usize> = members.iter().map(|m| m.0).collect();
                keys.sort();
                assert_eq!(keys, (0..size).collect::<Vec<_>>(), "{g:?}");
                let first = members[0].1;
                for (_, m) in members {
                    let same = match g {
                        GroupKind::Tp => (m.p, m.r, m.s, m.c) == (first.p, first.r, first.s, first.c),
                        GroupKind::Cp => (m.p, m.r, m.s, m.t) == (first.p, first.r, first.s, first.t),
                        GroupKind::Fsdp => (m.p, m.r, m.t) == (first.p, first.r, first.t),
                        GroupKind::DpRep => (m.p, m.s, m.c, m.t) == (first.p, first.s, first.c, first.t),
                        GroupKind::Batch => (m.p, m.c, m.t) == (first.p, first.c, first.t),
                        GroupKind::Pp => (m.r, m.s, m.c, m.t) == (first.r, first.s, first.c, first.t),
                        GroupKind::Ep => (m.p, m.r, m.t, m.flat_fsdp(&l) / l.ep) == (first.p, first.r, first.t, first.flat_fsdp(&l) / l.ep),
                        GroupKind::ExpertFsdp => {
                            (m.p, m.r, m.t, m.flat_fsdp(&l) % l.ep) == (first.p, first.r, first.t, first.flat_fsdp(&l) % l.ep)
                        }
                    };
                    assert!(same, "{g:?}: {m:?} vs {first:?}");
                }
            }
        }
    }
}
