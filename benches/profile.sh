#!/usr/bin/env bash
# Where a training step's CPU time goes: `perf record` (software clock, DWARF call graphs) of one
# rank training DECK on THREADS threads, then benches/profile_summary.py over the steady steps.
#
#   benches/profile.sh [DECK] [THREADS] [STEPS]      (defaults: inputs/bench_small.toml 2 8)
#
# Needs `perf` (Debian: linux-perf) and a release build with debug info (the default profile).
# Sampling costs about 10 % of the step; read the shares, not the step time. Output: the
# training console and the summary tables; perf.data and its script stay in $WORK.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
deck=${1:-$here/inputs/bench_small.toml}
threads=${2:-2}
steps=${3:-8}
hz=499
work=${WORK:-$(mktemp -d)}
bin=$here/target/release/ndtrain
command -v perf >/dev/null || { echo "perf not found (apt-get install linux-perf)" >&2; exit 2; }
[ -x "$bin" ] || { echo "build first: cargo build --release" >&2; exit 2; }
export OMPI_MCA_mpi_yield_when_idle=1
echo "# profile: $deck, $threads thread(s), $steps steps, $hz Hz; $(date -u '+%F %T') UTC; load $(cut -d' ' -f1-3 /proc/loadavg)"
perf record -q -F "$hz" -g --call-graph dwarf,16384 -e cpu-clock -o "$work/perf.data" -- \
    mpirun -n 1 --bind-to none "$bin" train "$deck" --set run.steps="$steps" --set run.threads="$threads" \
    --set run.out_dir="\"$work/out\"" > "$work/run.log" 2>&1
grep -E "^model:|^ +[0-9]+ +[0-9.]+ |median step" "$work/run.log"
perf script -i "$work/perf.data" -F tid,time,ip,sym 2>/dev/null > "$work/script.txt"
# The steady steps: from the end of the second step to the end of the run.
start=$(awk '/^ +2 +[0-9.]+ /{print $(NF-1)}' "$work/run.log" | tr -d s)
python3 "$here/benches/profile_summary.py" "$work/script.txt" --hz "$hz" --from "${start:-0}"
echo "(perf data: $work)"
