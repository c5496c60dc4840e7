//! Which ranks are gone, when a collective stops moving. A rank blocked in a collective whose
//! partner died (its node crashed, its link went down) learns nothing from MPI: the call just
//! never returns, and the watchdog's message would say only "waiting in a collective". So every
//! rank listens on a TCP port of its own for as long as it lives, the ranks exchange their
//! ports at start, and when a rank has waited in a collective for `[run] liveness_seconds`, or
//! when a stop signal arrives (a launcher that lost a node signals the ranks that remain), it
//! tries to connect to the ports of the ranks it shares a group with:
//!
//! * the connection is accepted: the rank lives (it is merely slow);
//! * it is refused: the host answers, but the process is gone;
//! * it times out or the host is unreachable: the node is down or its link is cut.
//!
//! A rank that finds peers lost ends the job with one line naming them and their hosts (a
//! health check of the watchdog, `docs/reliability.md`, *A node lost*). Peers not reachable at
//! start (a firewall between nodes) are left out of the check, with one warning.

use crate::parallel::comm::Group;
use crate::parallel::mesh::Mesh;
use crate::run::placement::Place;
use crate::run::watchdog;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a probe of a peer's port found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Probe {
    Alive,
    /// The host refused the connection: it is up, the process is gone.
    ProcessGone,
    /// No answer within the timeout, or no route: the node is down or its link is cut.
    HostUnreachable,
    /// The host name does not resolve.
    Unknown,
}

/// A rank this one shares a group with, and where it listens.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Peer {
    pub rank: usize,
    pub host: String,
    pub port: u16,
}

/// Opens this process's probe port (any free port, every interface) and accepts on it for the
/// process's lifetime. Port 0: none could be opened (this rank is then not probed).
pub fn listen() -> u16 {
    let Ok(listener) = TcpListener::bind("0.0.0.0:0") else { return 0 };
    let Ok(port) = listener.local_addr().map(|a| a.port()) else { return 0 };
    let spawned = std::thread::Builder::new().name("ndtrain-liveness".into()).spawn(move || {
        for stream in listener.incoming() {
            // Accepting is the answer: the connection closes at once.
            drop(stream);
        }
    });
    if spawned.is_ok() {
        port
    } else {
        0
    }
}

/// The host part of a placement's host name: pretend nodes (`host:nodeK`) live on `host`.
fn network_host(host: &str) -> &str {
    host.split_once(":node").map_or(host, |(h, _)| h)
}

/// Connects to `peer`'s port within `timeout`.
pub fn probe(peer: &Peer, timeout: Duration) -> Probe {
    let Ok(addrs) = (network_host(&peer.host), peer.port).to_socket_addrs() else { return Probe::Unknown };
    let addrs: Vec<SocketAddr> = addrs.collect();
    if addrs.is_empty() {
        return Probe::Unknown;
    }
    let mut found = Probe::HostUnreachable;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(_) => return Probe::Alive,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => found = Probe::ProcessGone,
            Err(_) => {}
        }
    }
    found
}

/// Probes every peer at once (in threads, 64 at a time), in the order given.
pub fn probe_all(peers: &[Peer], timeout: Duration) -> Vec<Probe> {
    let mut found = Vec::with_capacity(peers.len());
    for chunk in peers.chunks(64) {
        std::thread::scope(|s| {
            let handles: Vec<_> = chunk.iter().map(|p| s.spawn(move || probe(p, timeout))).collect();
            found.extend(handles.into_iter().map(|h| h.join().unwrap_or(Probe::Unknown)));
        });
    }
    found
}

/// `lost ranks 2, 3 on host cn2 (cn2 does not answer on the network: …)`, one clause per host
/// and finding, joined by `; `; `None` when every peer lives.
pub fn lost_line(peers: &[Peer], found: &[Probe]) -> Option<String> {
    let mut by_host: BTreeMap<(&str, Probe), Vec<usize>> = BTreeMap::new();
    for (peer, &probe) in peers.iter().zip(found) {
        if probe != Probe::Alive {
            by_host.entry((network_host(&peer.host), probe)).or_default().push(peer.rank);
        }
    }
    let clauses: Vec<String> = by_host
        .into_iter()
        .map(|((host, probe), ranks)| {
            let why = match probe {
                Probe::ProcessGone => format!("{host} answers, but the processes are gone"),
                Probe::HostUnreachable => format!("{host} does not answer on the network: the node is down or its link is cut"),
                Probe::Unknown | Probe::Alive => format!("the name {host} no longer resolves"),
            };
            let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
            let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
            format!("lost {noun} {} on host {host} ({why})", list.join(", "))
        })
        .collect();
    (!clauses.is_empty()).then(|| clauses.join("; "))
}

/// The peers of `rank`: the other members of `groups` (each a list of world ranks), with their
/// hosts and ports; ranks without a port (0) are left out. Sorted, each once.
pub fn peers_of(rank: usize, groups: &[Vec<usize>], hosts: &[String], ports: &[u16]) -> Vec<Peer> {
    let ranks: BTreeSet<usize> = groups.iter().flatten().copied().filter(|&r| r != rank && ports[r] != 0).collect();
    ranks.into_iter().map(|r| Peer { rank: r, host: hosts[r].clone(), port: ports[r] }).collect()
}

/// How long a probe waits for an answer: half the wait that triggers it, within 0.2 to 2 s.
fn probe_timeout(after: Duration) -> Duration {
    (after / 2).clamp(Duration::from_millis(200), Duration::from_secs(2))
}

/// The state between the watchdog's ticks.
struct Monitor {
    peers: Vec<Peer>,
    /// This rank's network host: on a stop signal, peers on it are being stopped as well.
    host: String,
    after: Duration,
    last_probe: Option<Instant>,
    probed_on_signal: bool,
}

impl Monitor {
    /// A failure's line, or `None`: probes when a stop signal has just arrived (once), or when
    /// the rank has waited in a collective without progress for `after` (again every `after`).
    fn tick(&mut self, in_collective: bool, idle: Option<Duration>, stop_signal: bool) -> Option<String> {
        let on_signal = stop_signal && !self.probed_on_signal;
        let stalled = in_collective && idle.is_some_and(|i| i >= self.after) && self.last_probe.is_none_or(|t| t.elapsed() >= self.after);
        if !(on_signal || stalled) {
            return None;
        }
        self.probed_on_signal |= on_signal;
        self.last_probe = Some(Instant::now());
        let mut found = probe_all(&self.peers, probe_timeout(self.after));
        if on_signal {
            // The launcher signals every rank it still reaches, this node's among them: a
            // neighbour that is already gone here is stopping too, not lost.
            for (peer, f) in self.peers.iter().zip(found.iter_mut()) {
                if network_host(&peer.host) == self.host {
                    *f = Probe::Alive;
                }
            }
        }
        let when = if on_signal {
            ", found on a stop signal".to_string()
        } else {
            format!(
                ", found after {:.1} s in a collective without progress ([run] liveness_seconds = {})",
                idle.unwrap_or_default().as_secs_f64(),
                self.after.as_secs_f64()
            )
        };
        lost_line(&self.peers, &found).map(|line| line + &when)
    }
}

/// Every member of each of this rank's groups, as world ranks.
fn group_members(mesh: &Mesh) -> Vec<Vec<usize>> {
    let me = (mesh.world.rank() as u64).to_le_bytes();
    let decode = |b: &Vec<u8>| u64::from_le_bytes(b.as_slice().try_into().expect("8 bytes")) as usize;
    let members = |g: &Group| g.all_gather_bytes(&me).iter().map(decode).collect::<Vec<usize>>();
    mesh.groups().into_iter().map(members).collect()
}

/// Starts the check on every rank (collective over every group of `mesh`): the probe port, the
/// exchange of ports, a probe of each peer now (peers that do not answer are left out, and
/// rank 0 warns once), and the watchdog's health check. `after` zero: off (no port, no check).
pub fn start(mesh: &Mesh, places: &[Place], after: Duration) -> Option<watchdog::Check> {
    if after.is_zero() || mesh.world.size() == 1 {
        return None;
    }
    let port = listen();
    let ports: Vec<u16> = mesh
        .world
        .all_gather_bytes(&port.to_le_bytes())
        .iter()
        .map(|b| u16::from_le_bytes(b.as_slice().try_into().expect("2 bytes")))
        .collect();
    let hosts: Vec<String> = places.iter().map(|p| p.host.clone()).collect();
    let all = peers_of(mesh.world.rank(), &group_members(mesh), &hosts, &ports);
    let found = probe_all(&all, probe_timeout(after));
    let reachable = found.iter().filter(|f| **f == Probe::Alive).count();
    let blind = mesh.world.count_true(reachable < all.len() || port == 0);
    if blind > 0 && mesh.world.rank() == 0 {
        eprintln!(
            "warning: liveness: {blind} rank(s) cannot open or reach a peer's probe port at start (a firewall between \
             nodes?): a lost node is found only by the watchdog ([run] watchdog_seconds) for those peers"
        );
    }
    let monitor = Arc::new(Mutex::new(Monitor {
        peers: all.into_iter().zip(found).filter(|(_, f)| *f == Probe::Alive).map(|(p, _)| p).collect(),
        host: network_host(&hosts[mesh.world.rank()]).to_string(),
        after,
        last_probe: None,
        probed_on_signal: false,
    }));
    Some(watchdog::add_check(move || {
        let mut m = monitor.lock().ok()?;
        m.tick(crate::parallel::comm::in_collective(), watchdog::idle(), crate::run::preempt::requested())
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(rank: usize, host: &str, port: u16) -> Peer {
        Peer { rank, host: host.into(), port }
    }

    #[test]
    fn a_probe_tells_a_live_port_from_a_closed_one_and_an_unknown_host() {
        let port = listen();
        assert_ne!(port, 0);
        let t = Duration::from_secs(2);
        assert_eq!(probe(&peer(1, "127.0.0.1", port), t), Probe::Alive);
        assert_eq!(probe(&peer(1, "localhost:node3", port), t), Probe::Alive, "a pretend node is its host");
        // A port that was open and is closed now: refused.
        let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        assert_eq!(probe(&peer(2, "127.0.0.1", closed), t), Probe::ProcessGone);
        assert_eq!(probe(&peer(3, "no-such-host.invalid", 1), t), Probe::Unknown);
        let all = probe_all(&[peer(1, "127.0.0.1", port), peer(2, "127.0.0.1", closed)], t);
        assert_eq!(all, [Probe::Alive, Probe::ProcessGone]);
    }

    #[test]
    fn the_lost_line_names_ranks_and_hosts_and_why() {
        let peers = [peer(1, "cn1", 9), peer(2, "cn2", 9), peer(3, "cn2", 9), peer(4, "cn3:node1", 9)];
        let found = [Probe::Alive, Probe::HostUnreachable, Probe::HostUnreachable, Probe::ProcessGone];
        assert_eq!(
            lost_line(&peers, &found).unwrap(),
            "lost ranks 2, 3 on host cn2 (cn2 does not answer on the network: the node is down or its link is cut); \
             lost rank 4 on host cn3 (cn3 answers, but the processes are gone)"
        );
        assert_eq!(lost_line(&peers, &[Probe::Alive; 4]), None);
    }

    #[test]
    fn peers_are_the_other_members_of_the_groups_each_once() {
        let hosts: Vec<String> = ["a", "a", "b", "b"].iter().map(|h| h.to_string()).collect();
        let ports = [7, 8, 0, 9];
        let peers = peers_of(0, &[vec![0, 1], vec![0, 2], vec![0, 1, 3]], &hosts, &ports);
        assert_eq!(peers, [peer(1, "a", 8), peer(3, "b", 9)], "rank 2 has no port; rank 1 once");
    }

    /// The monitor probes on a stop signal once, and in a collective only after the wait.
    #[test]
    fn the_monitor_probes_when_stalled_or_signalled() {
        let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let after = Duration::from_millis(300);
        let mut m = Monitor {
            peers: vec![peer(5, "127.0.0.1", closed), peer(6, "localhost", closed)],
            host: "localhost".into(),
            after,
            last_probe: None,
            probed_on_signal: false,
        };
        assert_eq!(m.tick(false, Some(Duration::from_secs(9)), false), None, "not in a collective");
        assert_eq!(m.tick(true, Some(Duration::from_millis(100)), false), None, "not long enough");
        let line = m.tick(true, Some(Duration::from_millis(400)), false).unwrap();
        assert!(
            line.starts_with(
                "lost rank 5 on host 127.0.0.1 (127.0.0.1 answers, but the processes are gone); lost rank 6 on host localhost"
            ),
            "{line}"
        );
        assert!(line.contains(", found after 0.4 s"), "{line}");
        assert_eq!(m.tick(true, Some(Duration::from_millis(500)), false), None, "not again within `after`");
        let line = m.tick(false, None, true).unwrap();
        assert_eq!(
            line, "lost rank 5 on host 127.0.0.1 (127.0.0.1 answers, but the processes are gone), found on a stop signal",
            "a neighbour on this rank's own host is being stopped too"
        );
        assert_eq!(m.tick(false, None, true), None, "once per signal");
    }
}
