#!/usr/bin/env bash
# Runs the whole test suite (`cargo test`, the README's command) while another process keeps
# every core of the machine busy: `stress-ng --cpu N` with N the machine's cores, started first
# and stopped when the suite ends, whatever its outcome. No test asserts a wall time or a speed,
# so the suite must pass on a loaded machine too (docs/hpc.md, "Testing").
#
#   jobscripts/local/test-under-load.sh              # N = nproc
#   LOAD_CPUS=1 jobscripts/local/test-under-load.sh  # one busy core
#   jobscripts/local/test-under-load.sh --test checkpoint   # arguments go to cargo test
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v stress-ng > /dev/null; then
    [ "$(id -u)" -eq 0 ] || { echo "test-under-load.sh: stress-ng is missing (apt-get install stress-ng)" >&2; exit 2; }
    apt-get install -y -q stress-ng > /dev/null
fi
cpus="${LOAD_CPUS:-$(nproc)}"
stress-ng --cpu "$cpus" --quiet &
load=$!
trap 'kill "$load" 2> /dev/null || true; wait "$load" 2> /dev/null || true' EXIT
echo "+ stress-ng --cpu $cpus (pid $load) beside cargo test $*"
start=$(date +%s)
cargo test "$@"
echo "+ cargo test passed beside stress-ng --cpu $cpus in $(( $(date +%s) - start )) s"
