//! Where each rank's threads run. A launcher that binds (Open MPI binds each rank to a core for
//! up to two ranks, `srun --cpu-bind=cores -c N` to its N CPUs) has already narrowed a rank's
//! affinity mask to the rank's own CPUs; one that does not leaves every rank of a node the same
//! whole mask. The automatic thread count is therefore the CPUs of the rank's mask divided by
//! the ranks of its node that share that same mask — never the mask divided again by all the
//! node's ranks. At start rank 0 prints one line per rank (host, CPUs, threads, GPU) and a
//! warning when ranks share cores or cores sit idle (`docs/hpc.md`).

use crate::parallel::comm::Group;
use std::collections::{BTreeMap, BTreeSet};

/// The CPUs this process may run on (its affinity mask), in ascending order.
pub fn affinity() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    // SAFETY: `set` is a plain bit set the kernel fills; its size is passed with it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            return (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
        }
    }
    let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (0..n).collect()
}

/// Threads for a rank with affinity mask `mine` on a node whose ranks have masks `node` (this
/// rank's included): `requested` when the deck sets `[run] threads`, else the mask's CPUs
/// shared evenly among the ranks with the very same mask.
pub fn threads_for_rank(requested: usize, mine: &[usize], node: &[Vec<usize>]) -> usize {
    if requested > 0 {
        return requested;
    }
    let sharing = node.iter().filter(|m| m.as_slice() == mine).count().max(1);
    (mine.len() / sharing).max(1)
}

/// `0-3,8,10-11`: a CPU list as Linux, Slurm and `taskset` write it.
pub fn cpu_list(cpus: &[usize]) -> String {
    let mut parts = vec![];
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if j == i { cpus[i].to_string() } else { format!("{}-{}", cpus[i], cpus[j]) });
        i = j + 1;
    }
    parts.join(",")
}

/// Parses a CPU list (`0-3,8`); `None` when it is not one.
pub fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let mut cpus = BTreeSet::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().ok()?..=b.parse::<usize>().ok()?),
            None => {
                cpus.insert(part.parse::<usize>().ok()?);
            }
        }
    }
    Some(cpus.into_iter().collect())
}

/// How many CPUs this job may use on this node: the cgroup's cpuset (what Slurm allocated to
/// the job; cgroup v2), else every online CPU.
pub fn node_cpus() -> usize {
    let from_cgroup = || -> Option<usize> {
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
        let cpus = std::fs::read_to_string(format!("/sys/fs/cgroup{path}/cpuset.cpus.effective")).ok()?;
        parse_cpu_list(&cpus).map(|c| c.len()).filter(|&n| n > 0)
    };
    from_cgroup().unwrap_or_else(|| {
        // SAFETY: sysconf only reads a system constant.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        if online > 0 {
            online as usize
        } else {
            affinity().len()
        }
    })
}

/// One rank's place.
#[derive(Clone, Debug, PartialEq)]
pub struct Place {
    pub host: String,
    pub rank: usize,
    pub cpus: Vec<usize>,
    pub threads: usize,
    /// The GPU's ordinal among the visible ones, or `none`.
    pub gpu: String,
    /// The CPUs the job may use on the rank's node.
    pub node_cpus: usize,
}

impl Place {
    fn encode(&self) -> Vec<u8> {
        format!("{}\t{}\t{}\t{}\t{}\t{}", self.host, self.rank, cpu_list(&self.cpus), self.threads, self.gpu, self.node_cpus).into_bytes()
    }

    fn decode(bytes: &[u8]) -> Option<Place> {
        let text = String::from_utf8_lossy(bytes);
        let f: Vec<&str> = text.split('\t').collect();
        let [host, rank, cpus, threads, gpu, node_cpus] = f.as_slice() else { return None };
        Some(Place {
            host: host.to_string(),
            rank: rank.parse().ok()?,
            cpus: parse_cpu_list(cpus)?,
            threads: threads.parse().ok()?,
            gpu: gpu.to_string(),
            node_cpus: node_cpus.parse().ok()?,
        })
    }

    /// `placement: HOST rank R: cpus LIST, T threads, gpu G`.
    pub fn line(&self) -> String {
        format!("placement: {} rank {}: cpus {}, {} threads, gpu {}", self.host, self.rank, cpu_list(&self.cpus), self.threads, self.gpu)
    }
}

/// This host's name.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok && end > 0 {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown-host".into()
    }
}

/// This rank's thread count, agreed with the other ranks of its `node`: every rank's mask is
/// gathered on the node, so ranks that share a mask split it.
pub fn threads_on_node(node: &Group, requested: usize, mine: &[usize]) -> usize {
    let bytes: Vec<u8> = mine.iter().flat_map(|&c| (c as u32).to_le_bytes()).collect();
    let masks: Vec<Vec<usize>> = node
        .all_gather_bytes(&bytes)
        .iter()
        .map(|b| b.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as usize).collect())
        .collect();
    threads_for_rank(requested, mine, &masks)
}

/// Every rank's place, on every rank of `world` (in rank order). With pretend nodes
/// (`NDTRAIN_DEBUG_PRETEND_NODES`, validated where the node communicator is formed) each
/// rank's host becomes `<host>:node<k>`, its pretend node, as the node communicator has it.
pub fn gather(world: &Group, mine: &Place) -> Vec<Place> {
    let mut places: Vec<Place> =
        world.all_gather_bytes(&mine.encode()).iter().map(|b| Place::decode(b).expect("a place this program encoded")).collect();
    if let Ok(Some(per_node)) = crate::parallel::mesh::pretend_ranks_per_node(world.size()) {
        pretend_hosts(&mut places, per_node);
    }
    places
}

/// Names each rank's host after its pretend node: ranks `k·per_node ..` are on node `k`.
pub fn pretend_hosts(places: &mut [Place], per_node: usize) {
    for p in places {
        p.host = format!("{}:node{}", p.host, p.rank / per_node);
    }
}

/// The ranks of each node (host), in rank order, nodes in the order of their first rank.
fn nodes(places: &[Place]) -> Vec<(&str, Vec<usize>)> {
    let mut nodes: Vec<(&str, Vec<usize>)> = vec![];
    let mut sorted: Vec<&Place> = places.iter().collect();
    sorted.sort_by_key(|p| p.rank);
    for p in sorted {
        match nodes.iter_mut().find(|(h, _)| *h == p.host) {
            Some((_, ranks)) => ranks.push(p.rank),
            None => nodes.push((&p.host, vec![p.rank])),
        }
    }
    nodes
}

/// `nodes: N, R ranks per node; HOST: ranks A-B (node-local 0-K); …`: the line of the
/// placement table that says how the ranks fall on nodes (the node-local rank is a rank's
/// place among its node's ranks, which picks its GPU).
pub fn nodes_line(places: &[Place]) -> String {
    let nodes = nodes(places);
    let mut counts: Vec<usize> = nodes.iter().map(|(_, r)| r.len()).collect();
    counts.sort();
    counts.dedup();
    let per_node = match counts.as_slice() {
        [one] => format!("{one} ranks per node"),
        _ => format!("{} to {} ranks per node", counts.first().unwrap_or(&0), counts.last().unwrap_or(&0)),
    };
    let each: Vec<String> = nodes
        .iter()
        .map(|(host, ranks)| format!("{host}: ranks {} (node-local {})", cpu_list(ranks), cpu_list(&(0..ranks.len()).collect::<Vec<_>>())))
        .collect();
    format!("nodes: {}, {per_node}; {}", nodes.len(), each.join("; "))
}

/// The mesh's groups that span more than one node, one line each: `tp` and `cp` as warnings
/// (their collectives run inside every layer, and across the network they dominate the step),
/// the others as notes (the data-parallel and pipeline traffic is made to cross nodes). Empty
/// on one node.
pub fn groups_across_nodes(places: &[Place], layout: &crate::config::Layout) -> Vec<String> {
    let host_of: BTreeMap<usize, &str> = places.iter().map(|p| (p.rank, p.host.as_str())).collect();
    spanning_groups(|rank| host_of.get(&rank).map(|h| h.to_string()), layout)
}

/// [`groups_across_nodes`] for a job not yet placed: nodes of `ranks_per_node` ranks, dealt
/// as `placement` says, as `ndtrain plan` assumes.
pub fn groups_across_planned_nodes(
    ranks_per_node: usize,
    placement: crate::config::RankPlacement,
    layout: &crate::config::Layout,
) -> Vec<String> {
    let nodes = layout.world_size().div_ceil(ranks_per_node.max(1));
    spanning_groups(|rank| Some(format!("node{}", placement.node_of(rank, ranks_per_node, nodes))), layout)
}

fn spanning_groups(host_of: impl Fn(usize) -> Option<String>, layout: &crate::config::Layout) -> Vec<String> {
    use crate::parallel::mesh::{Coords, GroupKind};
    let kinds = [
        (GroupKind::Tp, "tp"),
        (GroupKind::Cp, "cp"),
        (GroupKind::Fsdp, "fsdp"),
        (GroupKind::DpRep, "dp_replicate"),
        (GroupKind::Batch, "batch"),
        (GroupKind::Pp, "pp"),
    ];
    let mut lines = vec![];
    for (kind, name) in kinds {
        let mut groups: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
        for rank in 0..layout.world_size() {
            let (color, _) = Coords::of_rank(rank, layout).color_key(kind, layout);
            if let Some(host) = host_of(rank) {
                groups.entry(color).or_default().insert(host);
            }
        }
        let spanning = groups.values().filter(|h| h.len() > 1).count();
        if spanning == 0 {
            continue;
        }
        let widest = groups.values().map(BTreeSet::len).max().unwrap_or(0);
        let what = format!("{spanning} of {} {name} group(s) span nodes (up to {widest} nodes each)", groups.len());
        lines.push(match kind {
            GroupKind::Tp | GroupKind::Cp => format!(
                "warning: {what}: their collectives run inside every layer and cross the network; keep {name} within a node (ranks per node a multiple of tp × cp)"
            ),
            _ => format!("nodes: {what}"),
        });
    }
    lines
}

/// The lines rank 0 prints: one per rank, grouped by host, then the warnings. `automatic`:
/// the thread count was the program's choice (idle cores are then worth a warning; a thread
/// count the deck set is deliberate).
pub fn table(places: &[Place], automatic: bool) -> Vec<String> {
    let mut by_host: BTreeMap<&str, Vec<&Place>> = BTreeMap::new();
    for p in places {
        by_host.entry(&p.host).or_default().push(p);
    }
    let mut lines: Vec<String> = by_host.values().flatten().map(|p| p.line()).collect();
    lines.push(nodes_line(places));
    for (host, ranks) in &by_host {
        let threads: usize = ranks.iter().map(|p| p.threads).sum();
        let used: BTreeSet<usize> = ranks.iter().flat_map(|p| p.cpus.iter().copied()).collect();
        let available = ranks.iter().map(|p| p.node_cpus).max().unwrap_or(0).max(used.len());
        if threads > used.len() {
            let remedy = if automatic {
                "more ranks than CPUs: run fewer ranks per node, or give the job more CPUs"
            } else {
                "set [run] threads = 0 (the CPUs of each rank's mask), or give each rank its own CPUs (srun -c N \
                 --cpu-bind=cores, mpirun --map-by slot:PE=N)"
            };
            lines.push(format!(
                "warning: {host}: {} rank(s) run {threads} threads on {} CPU(s) ({}): threads share cores and slow each other \
                 down; {remedy}",
                ranks.len(),
                used.len(),
                cpu_list(&used.into_iter().collect::<Vec<_>>())
            ));
        } else if automatic && threads < available {
            lines.push(format!(
                "warning: {host}: {} rank(s) run {threads} threads where the job may use {available} CPUs: {} sit idle; the \
                 launcher bound each rank to fewer CPUs than it has (mpirun binds to one core for up to 2 ranks: use \
                 --bind-to none or --map-by slot:PE=N; under Slurm: srun -c N --cpu-bind=cores)",
                ranks.len(),
                available - threads
            ));
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan's view of 4 ranks on nodes of 2: with tp 2 × cp 2 the cp groups span nodes (a
    /// warning), the tp groups do not; with tp 4 the tp group does; on one node of 4 nothing;
    /// dealt cyclically, tp 2 does.
    #[test]
    fn planned_nodes_name_the_groups_that_span_them() {
        use crate::config::Layout;
        let layout = |cp, tp| Layout { pp: 1, dp_replicate: 1, dp_shard: 4 / (cp * tp), cp, tp, ep: 1 };
        let lines = groups_across_planned_nodes(2, crate::config::RankPlacement::Block, &layout(2, 2));
        assert!(lines.iter().any(|l| l.starts_with("warning: 2 of 2 cp group(s) span nodes")), "{lines:?}");
        assert!(!lines.iter().any(|l| l.contains(" tp group")), "{lines:?}");
        let lines = groups_across_planned_nodes(2, crate::config::RankPlacement::Block, &layout(1, 4));
        assert!(lines.iter().any(|l| l.starts_with("warning: 1 of 1 tp group(s) span nodes (up to 2 nodes each)")), "{lines:?}");
        assert!(groups_across_planned_nodes(4, crate::config::RankPlacement::Block, &layout(2, 2)).is_empty());
        // Ranks dealt to the nodes in turn put each tp pair on two nodes.
        let lines = groups_across_planned_nodes(2, crate::config::RankPlacement::Cyclic, &layout(1, 2));
        assert!(lines.iter().any(|l| l.starts_with("warning: 2 of 2 tp group(s) span nodes")), "{lines:?}");
    }

    fn cpus(a: usize, b: usize) -> Vec<usize> {
        (a..b).collect()
    }

    #[test]
    fn a_bound_rank_gets_its_own_cpus_and_unbound_ranks_share_the_node() {
        // 8 CPUs, 2 ranks each bound to 4 (srun -c 4, --map-by slot:PE=4): 4 threads each, not 4/2.
        let node = vec![cpus(0, 4), cpus(4, 8)];
        assert_eq!(threads_for_rank(0, &node[0], &node), 4);
        assert_eq!(threads_for_rank(0, &node[1], &node), 4);
        // Unbound: both see all 8 and split them.
        let node = vec![cpus(0, 8), cpus(0, 8)];
        assert_eq!(threads_for_rank(0, &node[0], &node), 4);
        // Bound to one core each (Open MPI's default for ≤ 2 ranks): one thread each.
        let node = vec![vec![0], vec![1]];
        assert_eq!(threads_for_rank(0, &node[1], &node), 1);
        // More ranks than CPUs: at least one thread; the deck's own number wins.
        let node = vec![cpus(0, 2); 4];
        assert_eq!(threads_for_rank(0, &node[0], &node), 1);
        assert_eq!(threads_for_rank(3, &node[0], &node), 3);
    }

    #[test]
    fn cpu_lists_round_trip() {
        for (cpus, text) in [(vec![0, 1, 2, 3, 8, 10, 11], "0-3,8,10-11"), (vec![5], "5"), (vec![], "")] {
            assert_eq!(cpu_list(&cpus), text);
            assert_eq!(parse_cpu_list(text).unwrap(), cpus);
        }
        assert_eq!(parse_cpu_list("0-1,1-2\n").unwrap(), vec![0, 1, 2]);
        assert!(parse_cpu_list("0-x").is_none());
    }

    fn place(host: &str, rank: usize, cpus: Vec<usize>, threads: usize) -> Place {
        Place { host: host.into(), rank, cpus, threads, gpu: "none".into(), node_cpus: 2 }
    }

    #[test]
    fn the_table_warns_of_shared_and_idle_cores() {
        let shared = table(&[place("a", 0, vec![0, 1], 2), place("a", 1, vec![0, 1], 2)], true);
        assert_eq!(shared[0], "placement: a rank 0: cpus 0-1, 2 threads, gpu none");
        assert_eq!(shared[2], "nodes: 1, 2 ranks per node; a: ranks 0-1 (node-local 0-1)");
        assert!(shared[3].starts_with("warning: a: 2 rank(s) run 4 threads on 2 CPU(s) (0-1)"), "{shared:?}");
        let idle = table(&[place("a", 0, vec![0], 1)], true);
        assert!(idle[2].starts_with("warning: a: 1 rank(s) run 1 threads where the job may use 2 CPUs: 1 sit idle"), "{idle:?}");
        assert_eq!(table(&[place("a", 0, vec![0], 1)], false).len(), 2, "a thread count the deck set is deliberate");
        let whole = |host, rank| Place { node_cpus: 1, ..place(host, rank, vec![0], 1) };
        let two_hosts = table(&[whole("b", 1), whole("a", 0)], true);
        assert_eq!(two_hosts.len(), 3, "one line per rank and the nodes, no warning: {two_hosts:?}");
        assert_eq!(two_hosts[2], "nodes: 2, 1 ranks per node; a: ranks 0 (node-local 0); b: ranks 1 (node-local 0)");
        assert!(two_hosts[0].starts_with("placement: a rank 0"), "grouped by host");
        let p = place("h", 3, vec![0, 2], 2);
        assert_eq!(Place::decode(&p.encode()).unwrap(), p);
    }

    /// 8 ranks as 2 pretend nodes of 4: tp = 2 stays in a node, dp_shard = 4 spans both (a
    /// note); tp = 8 spans both (a warning); cp = 2 across nodes of 1 rank is a warning too.
    #[test]
    fn groups_that_span_nodes_are_named_and_tp_and_cp_warned_of() {
        use crate::config::Layout;
        let mut places: Vec<Place> = (0..8).map(|r| place("h", r, vec![r], 1)).collect();
        pretend_hosts(&mut places, 4);
        assert_eq!(places[5].host, "h:node1");
        assert_eq!(
            nodes_line(&places),
            "nodes: 2, 4 ranks per node; h:node0: ranks 0-3 (node-local 0-3); h:node1: ranks 4-7 (node-local 0-3)"
        );
        let fsdp = Layout { pp: 1, dp_replicate: 1, dp_shard: 4, cp: 1, tp: 2, ep: 1 };
        let lines = groups_across_nodes(&places, &fsdp);
        assert!(lines.iter().all(|l| !l.starts_with("warning")), "{lines:?}");
        assert!(lines.iter().any(|l| l == "nodes: 2 of 2 fsdp group(s) span nodes (up to 2 nodes each)"), "{lines:?}");
        let tp = Layout { pp: 1, dp_replicate: 1, dp_shard: 1, cp: 1, tp: 8, ep: 1 };
        assert!(groups_across_nodes(&places, &tp)[0].starts_with("warning: 1 of 1 tp group(s) span nodes (up to 2 nodes each)"));
        let mut two: Vec<Place> = (0..2).map(|r| place("h", r, vec![r], 1)).collect();
        pretend_hosts(&mut two, 1);
        let cp = Layout { pp: 1, dp_replicate: 1, dp_shard: 1, cp: 2, tp: 1, ep: 1 };
        assert!(groups_across_nodes(&two, &cp)[0].starts_with("warning: 1 of 1 cp group(s) span nodes"));
        let one_node: Vec<Place> = (0..8).map(|r| place("h", r, vec![r], 1)).collect();
        assert!(groups_across_nodes(&one_node, &tp).is_empty());
    }
}
