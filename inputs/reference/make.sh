#!/usr/bin/env bash
# Regenerates the reference logs beside the decks (LAMMPS-style): for each shipped deck small
# enough to run on a workstation, the per-step losses of the whole run on 1 and on 4 ranks,
# with the date, the machine, the commit and the command. tests/reference_logs.rs reruns the
# first steps of each and compares.
#   inputs/reference/make.sh            # after cargo build --release
set -euo pipefail
cd "$(dirname "$0")/../.."

NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_mpi_yield_when_idle=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
machine="$(lscpu | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) CPUs, $(uname -sr)"
commit="$(git rev-parse HEAD)$(git diff --quiet HEAD -- src Cargo.toml Cargo.lock || echo ' (with uncommitted changes to src/)')"

# reference DECK RANKS [--set table.key=value ...]
reference() {
    local name="$1" ranks="$2"
    shift 2
    local out="$work/$name.$ranks"
    local cmd=(mpirun --oversubscribe --bind-to none -n "$ranks" "$NDTRAIN" train "inputs/$name.toml" --set run.threads=1 "$@")
    echo "+ ${cmd[*]}"
    "${cmd[@]}" --set "run.out_dir=\"$out\"" >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
    {
        echo "# reference losses: inputs/$name.toml on $ranks rank(s)"
        echo "# date: $(date -u +%F)"
        echo "# machine: $machine"
        echo "# commit: $commit"
        echo "# command: ${cmd[*]/#$NDTRAIN/ndtrain}"
        cut -d, -f1,2 "$out/metrics.csv"
    } >"inputs/reference/$name.$ranks.csv"
}

reference tiny 1
reference tiny 4
reference bench_small 1
# global_batch 4 over 4 data-parallel ranks: one sequence per rank and micro-step.
reference bench_small 4 --set train.micro_batch=1
