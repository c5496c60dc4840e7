#!/usr/bin/env bash
# cluster-local.sh - an emulated multi-node cluster on one Linux machine: N hosts cn1..cnN, each a
# network namespace with its own hostname (UTS namespace), address, /tmp and /dev/shm (mount
# namespace), joined by veth pairs on a bridge, resolvable by name through /etc/hosts. Open MPI
# launches across them with a launch agent that enters a host's namespaces instead of ssh, and a
# multi-node Slurm (slurmctld, one slurmd per host, one munged) runs `srun -N 2` / `sbatch --nodes=2`
# across them. `tc` shapes the hosts' links. tests/multinode.rs uses it (docs/cluster.md).
#
# Run as root on Debian 12 (iproute2, util-linux; Slurm is installed by slurm-local.sh install).
#
#   cluster-local.sh start N [--rate R] [--delay D] [--no-slurm]
#                                   N hosts (idempotent: a running cluster of N hosts is kept, its
#                                   links reshaped); R a tc rate (1gbit, 500mbit), D a delay (0.2ms,
#                                   needs the kernel's netem)
#   cluster-local.sh stop           end every process on the hosts, the daemons, remove the hosts
#   cluster-local.sh status         hosts, addresses, link shaping, Slurm nodes
#   cluster-local.sh shape [--rate R] [--delay D]   reshape every host's link (no option: unshaped)
#   cluster-local.sh env            "export ..." lines for Open MPI and Slurm on the cluster
#   cluster-local.sh hostfile       path of the Open MPI hostfile (2 slots per host)
#   cluster-local.sh exec HOST CMD  run the shell command CMD on HOST (the Open MPI launch agent)
#   cluster-local.sh run HOST PROG [ARGS...]   run PROG with ARGS as given on HOST (mpirun on cn1)
#   cluster-local.sh link HOST down|up   take a host's link down (a cut cable) or up again
#   cluster-local.sh kill HOST      SIGKILL every process on HOST (a crashed node)
#   cluster-local.sh selftest       mpirun and srun across two hosts, TCP between them
#
# Knobs: CLUSTER_LOCAL_DIR (state, logs; not under /tmp, which is per host) [/var/tmp/cluster-local],
# CLUSTER_LOCAL_SLOTS (Open MPI slots and Slurm CPUs per host) [2].
set -euo pipefail

DIR=${CLUSTER_LOCAL_DIR:-/var/tmp/cluster-local}
SLOTS=${CLUSTER_LOCAL_SLOTS:-2}
SELF=$(readlink -f "$0")
BRIDGE=ndtbr0
SUBNET=10.231.45
NS_PREFIX=ndt-
VETH_PREFIX=ndtv-
CTL_PORT=6917
SLURMD_PORT=6918
HOSTS_BEGIN="# BEGIN cluster-local.sh hosts"
HOSTS_END="# END cluster-local.sh hosts"

log() { printf '[cluster-local] %s\n' "$*" >&2; }
die() { printf 'cluster-local: error: %s\n' "$*" >&2; exit 1; }

need() {
  local c
  for c in "$@"; do
    command -v "$c" >/dev/null 2>&1 || die "$c not found (apt-get install iproute2 util-linux procps)"
  done
}

host_addr() { echo "$SUBNET.$((10 + ${1#cn}))"; }
hosts() { if [ -s "$DIR/hosts.list" ]; then cat "$DIR/hosts.list"; fi; }
ns_of() { echo "$NS_PREFIX$1"; }

case "$DIR" in /tmp|/tmp/*) die "CLUSTER_LOCAL_DIR=$DIR is under /tmp, which each host replaces with its own" ;; esac

# in_host HOST CMD...: CMD inside HOST's network, UTS and mount namespaces, in the caller's folder.
# From inside a host (an mpirun on cn1 launching on cn2) the namespace files are only visible from
# the machine's own mount namespace, which the anchor process holds: enter it first.
in_host() {
  local h=$1 root=() pid
  shift
  pid=$(cat "$DIR/anchor.pid" 2>/dev/null || true)
  if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = sleep ]; then root=(nsenter "--mount=/proc/$pid/ns/mnt" --); fi
  "${root[@]}" test -e "/run/netns/$(ns_of "$h")" || die "no host $h (cluster-local.sh start first)"
  "${root[@]}" nsenter --net="/run/netns/$(ns_of "$h")" --uts="$DIR/ns/$h.uts" --mount="$DIR/ns/$h.mnt" \
    --wd="$PWD" -- "$@"
}

# The anchor: a process that lives in the machine's own namespaces as long as the cluster does.
start_anchor() {
  pid_alive "$DIR/anchor.pid" sleep && return 0
  setsid sleep infinity </dev/null >/dev/null 2>&1 9>&- &
  echo $! > "$DIR/anchor.pid"
}

# ---------------------------------------------------------------- link shaping
# shape_dev NETNS|- DEV RATE DELAY: tbf for the rate, netem for the delay (both optional).
shape_dev() {
  local ns=$1 dev=$2 rate=$3 delay=$4 tcx=(tc)
  [ "$ns" = - ] || tcx=(ip netns exec "$ns" tc)
  "${tcx[@]}" qdisc del dev "$dev" root 2>/dev/null || true
  if [ -n "$delay" ]; then
    local args=(delay "$delay")
    [ -n "$rate" ] && args+=(rate "$rate")
    "${tcx[@]}" qdisc add dev "$dev" root netem limit 100000 "${args[@]}" 2>/dev/null \
      || die "--delay $delay needs the kernel's netem qdisc (sch_netem), which this kernel lacks; shape with --rate only"
  elif [ -n "$rate" ]; then
    # A burst of 1 ms at the rate (at least 64 KiB) keeps the bucket from throttling below it.
    local bytes burst
    bytes=$(tc_rate_bytes "$rate")
    burst=$(( bytes / 1000 > 65536 ? bytes / 1000 : 65536 ))
    "${tcx[@]}" qdisc add dev "$dev" root tbf rate "$rate" burst "$burst" latency 100ms \
      || die "tc tbf rate $rate on $dev failed"
  fi
}

# tc_rate_bytes RATE: bytes per second of a tc rate (10gbit, 500mbit, 100kbit, 1000bit).
tc_rate_bytes() {
  awk -v r="$1" 'BEGIN {
    n = r + 0; u = tolower(substr(r, length(n "") + 1)); m = 1
    if (u == "kbit") m = 1e3 / 8; else if (u == "mbit") m = 1e6 / 8; else if (u == "gbit") m = 1e9 / 8
    else if (u == "bit" || u == "") m = 1 / 8
    else if (u == "kbps") m = 1e3; else if (u == "mbps") m = 1e6; else if (u == "gbps") m = 1e9
    else { print "bad"; exit }
    printf "%d", n * m }'
}

cmd_shape() {
  local rate="" delay="" h
  while [ $# -gt 0 ]; do
    case "$1" in
      --rate) rate=${2:?--rate needs a value}; shift 2 ;;
      --delay) delay=${2:?--delay needs a value}; shift 2 ;;
      *) die "shape: unknown option $1" ;;
    esac
  done
  [ -z "$rate" ] || [ "$(tc_rate_bytes "$rate")" != bad ] || die "--rate $rate is not a tc rate (e.g. 1gbit, 500mbit)"
  [ -n "$(hosts)" ] || die "no cluster running"
  for h in $(hosts); do
    # Both directions: what the host sends (its eth0) and what it receives (the bridge's side).
    shape_dev "$(ns_of "$h")" eth0 "$rate" "$delay"
    shape_dev - "$VETH_PREFIX$h" "$rate" "$delay"
  done
  printf '%s %s\n' "${rate:-unshaped}" "${delay:-0}" > "$DIR/shape"
  log "links: rate ${rate:-unshaped}, delay ${delay:-none}"
}

# ---------------------------------------------------------------- hosts
add_host() {
  local h=$1 ns addr
  ns=$(ns_of "$h"); addr=$(host_addr "$h")
  mkdir -p "$DIR/hosts/$h/tmp"
  chmod 1777 "$DIR/hosts/$h/tmp"
  ip netns add "$ns"
  ip link add "$VETH_PREFIX$h" type veth peer name eth0 netns "$ns"
  ip link set "$VETH_PREFIX$h" master "$BRIDGE" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  # A connection with data in flight to a host that is gone fails after 5 retransmissions
  # (about 13 s) instead of Linux's 15 (about 15 minutes): mpirun, ending a job, waits on its
  # connection to every node's daemon (docs/reliability.md, *A node lost*).
  ip netns exec "$ns" sysctl -qw net.ipv4.tcp_retries2=5
  # A UTS namespace (the hostname) and a mount namespace (its own /tmp and /dev/shm, so no two
  # hosts share memory segments or Open MPI session folders), kept alive by bind mounts.
  : > "$DIR/ns/$h.uts"; : > "$DIR/ns/$h.mnt"
  nsenter --net="/run/netns/$ns" -- unshare --uts="$DIR/ns/$h.uts" --mount="$DIR/ns/$h.mnt" \
    --propagation private /bin/sh -c \
    "hostname $h && mount --bind '$DIR/hosts/$h/tmp' /tmp && mount -t tmpfs -o mode=1777 tmpfs /dev/shm" \
    || die "could not make the namespaces of $h (unshare --uts --mount)"
}

write_etc_hosts() {
  local tmp h
  tmp=$(mktemp /etc/hosts.cluster-local.XXXXXX)
  sed "/^$HOSTS_BEGIN\$/,/^$HOSTS_END\$/d" /etc/hosts > "$tmp"
  if [ $# -gt 0 ]; then
    {
      echo "$HOSTS_BEGIN"
      echo "$SUBNET.1 cluster-local-head"
      for h in "$@"; do echo "$(host_addr "$h") $h"; done
      echo "$HOSTS_END"
    } >> "$tmp"
  fi
  # In place (cat, not mv): /etc/hosts may be a bind mount.
  cat "$tmp" > /etc/hosts
  rm -f "$tmp"
}

write_agent() {
  mkdir -p "$DIR/bin"
  cat > "$DIR/bin/rsh" <<EOF
#!/bin/sh
# Open MPI's launch agent on the emulated cluster: "rsh HOST COMMAND..." runs COMMAND on HOST.
host=\$1; shift
exec "$SELF" exec "\$host" "\$*"
EOF
  chmod 755 "$DIR/bin/rsh"
  : > "$DIR/hostfile"
  local h
  for h in $(hosts); do echo "$h slots=$SLOTS" >> "$DIR/hostfile"; done
}

# ---------------------------------------------------------------- Slurm
write_slurm_conf() {
  local n=$1 mem
  mem=$(awk '/^MemTotal:/ { print int($2 / 1024 / '"$n"') }' /proc/meminfo)
  mkdir -p "$DIR/etc" "$DIR/slurm/state" "$DIR/slurm/log" "$DIR/slurm/run"
  cat > "$DIR/etc/slurm.conf" <<EOF
# generated by cluster-local.sh: an emulated cluster on one machine; not for production
ClusterName=cluster-local
SlurmctldHost=$(hostname -s)($SUBNET.1)
SlurmctldPort=$CTL_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket=$DIR/munge/munge.socket
MailProg=/bin/true
MpiDefault=pmix
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
EnforcePartLimits=ALL
SlurmdParameters=config_overrides
ReturnToService=2
# A node that stops answering is DOWN after 30 s, and its job ends (docs/cluster.md).
SlurmdTimeout=30
MinJobAge=5
KillWait=5
InactiveLimit=0
StateSaveLocation=$DIR/slurm/state
SlurmdSpoolDir=$DIR/slurm/spool/%n
SlurmctldPidFile=$DIR/slurm/run/slurmctld.pid
SlurmdPidFile=$DIR/slurm/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurm/log/slurmctld.log
SlurmdLogFile=$DIR/slurm/log/slurmd-%n.log
NodeName=cn[1-$n] NodeAddr=$SUBNET.[11-$((10 + n))] CPUs=$SLOTS Sockets=1 CoresPerSocket=$SLOTS ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN
PartitionName=cluster Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

pid_alive() {
  local f=$1 comm=$2 pid
  [ -s "$f" ] || return 1
  pid=$(cat "$f")
  kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ] \
    && ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null   # a killed daemon not yet reaped
}

stop_pid() {
  local f=$1 comm=$2 pid i
  if pid_alive "$f" "$comm"; then
    pid=$(cat "$f")
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

start_munge() {
  pid_alive "$DIR/munge/munged.pid" munged && return 0
  command -v munged >/dev/null || die "munged not found (jobscripts/local/slurm-local.sh install)"
  mkdir -p "$DIR/munge"
  chmod 700 "$DIR/munge"
  [ -s "$DIR/munge/munge.key" ] || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  chmod 600 "$DIR/munge/munge.key"
  munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munged.seed" 9>&- || die "munged did not start (see $DIR/munge/munged.log)"
}

start_slurm() {
  local n=$1 h i states
  local slurm_local
  slurm_local="$(dirname "$SELF")/slurm-local.sh"
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then "$slurm_local" install; fi
  export SLURM_CONF=$DIR/etc/slurm.conf
  write_slurm_conf "$n"
  start_munge
  if ! pid_alive "$DIR/slurm/run/slurmctld.pid" slurmctld; then
    rm -rf "$DIR/slurm/state"; mkdir -p "$DIR/slurm/state"
    slurmctld -i 9>&- || die "slurmctld did not start (see $DIR/slurm/log/slurmctld.log)"
  fi
  for h in $(hosts); do
    mkdir -p "$DIR/slurm/spool/$h"
    pid_alive "$DIR/slurm/run/slurmd-$h.pid" slurmd && continue
    in_host "$h" slurmd -N "$h" 9>&- || die "slurmd on $h did not start (see $DIR/slurm/log/slurmd-$h.log)"
  done
  for i in $(seq 1 300); do
    states=$(sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ' || true)
    [ "$states" = "idle " ] && return 0
    if [ $((i % 20)) = 10 ]; then scontrol update NodeName=ALL State=RESUME >/dev/null 2>&1 || true; fi
    sleep 0.2
  done
  sinfo -N -l >&2 || true
  die "Slurm nodes not idle after 60 s (states: ${states:-no answer}; logs in $DIR/slurm/log)"
}

stop_slurm() {
  local f
  export SLURM_CONF=$DIR/etc/slurm.conf
  if [ -e "$SLURM_CONF" ] && scontrol ping >/dev/null 2>&1; then
    scancel --full "$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')" >/dev/null 2>&1 || true
  fi
  for f in "$DIR"/slurm/run/slurmd-*.pid; do [ -e "$f" ] && stop_pid "$f" slurmd; done
  stop_pid "$DIR/slurm/run/slurmctld.pid" slurmctld
  stop_pid "$DIR/munge/munged.pid" munged
}

# ---------------------------------------------------------------- start / stop
running_hosts() {
  local n=0 h
  for h in $(hosts); do [ -e "/run/netns/$(ns_of "$h")" ] && n=$((n + 1)); done
  echo "$n"
}

cmd_start() {
  local n=${1:-} rate="" delay="" slurm=1 h i
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "start needs the number of hosts (start N), got '${n}'"
  shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --rate) rate=${2:?--rate needs a value}; shift 2 ;;
      --delay) delay=${2:?--delay needs a value}; shift 2 ;;
      --no-slurm) slurm=0; shift ;;
      *) die "start: unknown option $1" ;;
    esac
  done
  [ "$n" -le 200 ] || die "start $n: at most 200 hosts on $SUBNET.0/24"
  need ip nsenter unshare tc flock mount sysctl
  # Every host has a /tmp and /dev/shm of its own: a launch agent or binary there is not on the others.
  case "$SELF" in /tmp/* | /dev/shm/*) die "this checkout ($(dirname "$SELF")) is under /tmp or /dev/shm, which each emulated host has its own of: clone it elsewhere" ;; esac
  if [ "$(running_hosts)" = "$n" ] && [ "$(wc -l < "$DIR/hosts.list")" = "$n" ] \
     && ip link show "$BRIDGE" >/dev/null 2>&1; then
    log "$n hosts already running"
    # A whole cluster: every link up again (after `link HOST down`).
    for h in $(hosts); do ip link set "$VETH_PREFIX$h" up; done
  else
    [ -z "$(hosts)" ] || cmd_stop_locked
    # A start that fails half-way removes what it made.
    trap 'cmd_stop_locked' EXIT
    mkdir -p "$DIR/ns"
    # The namespace files live on a private mount: a mount namespace cannot be bound into a
    # shared one.
    if ! mountpoint -q "$DIR/ns"; then mount --bind "$DIR/ns" "$DIR/ns"; fi
    mount --make-private "$DIR/ns"
    ip link add "$BRIDGE" type bridge 2>/dev/null || true
    ip addr replace "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    : > "$DIR/hosts.list"
    for i in $(seq 1 "$n"); do
      add_host "cn$i"
      echo "cn$i" >> "$DIR/hosts.list"
    done
    # shellcheck disable=SC2046 # host names, one word each
    write_etc_hosts $(hosts)
    write_agent
  fi
  trap 'cmd_stop_locked' EXIT
  start_anchor
  cmd_shape ${rate:+--rate "$rate"} ${delay:+--delay "$delay"}
  if [ "$slurm" = 1 ]; then start_slurm "$n"; fi
  trap - EXIT
  local what="hostfile $DIR/hostfile"
  if [ "$slurm" = 1 ]; then what="$what, Slurm partition cluster"; fi
  log "up: $(hosts | tr '\n' ' ')($what)"
}

cmd_stop_locked() {
  local h pids
  stop_slurm
  for h in $(hosts) $(ip netns list 2>/dev/null | awk -v p="$NS_PREFIX" 'index($1, p) == 1 { print substr($1, length(p) + 1) }'); do
    if [ -e "/run/netns/$(ns_of "$h")" ]; then
      pids=$(ip netns pids "$(ns_of "$h")" 2>/dev/null || true)
      # shellcheck disable=SC2086 # a list of pids
      [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
      ip netns del "$(ns_of "$h")" 2>/dev/null || true
    fi
    ip link del "$VETH_PREFIX$h" 2>/dev/null || true
    umount "$DIR/ns/$h.uts" "$DIR/ns/$h.mnt" 2>/dev/null || true
    rm -f "$DIR/ns/$h.uts" "$DIR/ns/$h.mnt"
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  if pid_alive "$DIR/anchor.pid" sleep; then kill "$(cat "$DIR/anchor.pid")" 2>/dev/null || true; fi
  rm -f "$DIR/anchor.pid"
  if mountpoint -q "$DIR/ns" 2>/dev/null; then umount "$DIR/ns" 2>/dev/null || true; fi
  write_etc_hosts
  rm -f "$DIR/hosts.list" "$DIR/hostfile" "$DIR/shape"
  rm -rf "$DIR/hosts"
}

cmd_status() {
  local h
  [ -n "$(hosts)" ] || { echo "no cluster running"; return 0; }
  echo "hosts: $(hosts | tr '\n' ' ')"
  echo "links: $(cat "$DIR/shape" 2>/dev/null || echo unshaped)"
  for h in $(hosts); do
    printf '%s %s link %s\n' "$h" "$(host_addr "$h")" \
      "$(ip -o link show "$VETH_PREFIX$h" 2>/dev/null | grep -q 'state UP' && echo up || echo down)"
  done
  if [ -e "$DIR/etc/slurm.conf" ]; then SLURM_CONF=$DIR/etc/slurm.conf sinfo -N 2>&1 || true; fi
}

cmd_env() {
  cat <<EOF
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_plm_rsh_agent=$DIR/bin/rsh
export OMPI_MCA_oob_tcp_if_include=$SUBNET.0/24 OMPI_MCA_btl_tcp_if_include=$SUBNET.0/24
# mpirun learns that a daemon's link is gone only from TCP keepalive on its connection to
# that daemon: 10 s idle, then 3 probes 2 s apart (Linux's defaults wait over 2 hours).
export OMPI_MCA_oob_tcp_keepalive_time=10 OMPI_MCA_oob_tcp_keepalive_intvl=2 OMPI_MCA_oob_tcp_keepalive_probes=3
export CLUSTER_LOCAL_HOSTFILE=$DIR/hostfile
export SLURM_CONF=$DIR/etc/slurm.conf
EOF
}

cmd_selftest() {
  local d=$DIR/selftest out
  [ "$(running_hosts)" -ge 2 ] || die "selftest needs a running cluster of at least 2 hosts"
  eval "$(cmd_env)"
  mkdir -p "$d"
  cat > "$d/where.c" <<'EOF'
#include <mpi.h>
#include <stdio.h>
int main(int argc, char **argv) {
  int rank, size, len;
  char name[MPI_MAX_PROCESSOR_NAME];
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Get_processor_name(name, &len);
  double x = rank, y = 0;
  MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  printf("rank %d of %d on %s sum %g\n", rank, size, name, y);
  MPI_Finalize();
  return 0;
}
EOF
  mpicc -O2 -o "$d/where" "$d/where.c" || die "mpicc failed (apt-get install libopenmpi-dev)"
  out=$(cd "$d" && timeout 60 mpirun --hostfile "$CLUSTER_LOCAL_HOSTFILE" -n 4 ./where | sort)
  echo "$out"
  [ "$(echo "$out" | awk '{ print $6 }' | sort -u | wc -l)" = 2 ] || die "mpirun: ranks not on 2 hosts"
  if [ -e "$SLURM_CONF" ] && pid_alive "$DIR/slurm/run/slurmctld.pid" slurmctld; then
    out=$(cd "$d" && timeout 60 srun -N 2 -n 4 ./where | sort)
    echo "$out"
    [ "$(echo "$out" | awk '{ print $6 }' | sort -u | wc -l)" = 2 ] || die "srun -N 2: ranks not on 2 hosts"
  fi
  log "selftest OK"
}

[ "$(id -u)" = 0 ] || die "must run as root (network namespaces, bridges and tc need it)"
cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  exec)
    h=${1:?exec HOST COMMAND}; shift
    in_host "$h" /bin/sh -c "$*" ;;
  run)
    h=${1:?run HOST PROGRAM [ARGS...]}; shift
    in_host "$h" "$@" ;;
  env) cmd_env ;;
  hostfile) echo "$DIR/hostfile" ;;
  status) cmd_status ;;
  start|stop|shape|link|kill|selftest)
    mkdir -p "$(dirname "$DIR")" "$DIR"
    exec 9> "$DIR.lock"
    flock 9
    case "$cmd" in
      start) cmd_start "$@" ;;
      stop) cmd_stop_locked; log "stopped" ;;
      shape) cmd_shape "$@" ;;
      link)
        h=${1:?link HOST down|up}
        case "${2:-}" in down|up) ;; *) die "link $h: say down or up" ;; esac
        ip link show "$VETH_PREFIX$h" >/dev/null 2>&1 || die "no host $h"
        ip link set "$VETH_PREFIX$h" "$2"
        log "$h: link $2" ;;
      kill)
        h=${1:?kill HOST}
        [ -e "/run/netns/$(ns_of "$h")" ] || die "no host $h"
        pids=$(ip netns pids "$(ns_of "$h")" || true)
        # shellcheck disable=SC2086 # a list of pids
        [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
        log "$h: killed $(echo "$pids" | wc -w) processes" ;;
      selftest) exec 9>&-; cmd_selftest ;;
    esac ;;
  *) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2 ;;
esac
