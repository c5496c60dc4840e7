#!/usr/bin/env bash
# Progress calls vs a progress thread for non-blocking collectives with this machine's MPI
# (benches/mpi_progress.rs), on two ranks with one thread each:
#   benches/mpi_progress.sh [--reps 7] [--gemms 6]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench --bench mpi_progress --no-run 2>&1 | tail -1
BIN=$(ls -t target/release/deps/mpi_progress-* | grep -v '\.d$' | head -1)
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
echo "+ mpirun -n 2 $BIN $*   ($(date -u +%FT%TZ), $(nproc) cores, $(mpirun --version | head -1))"
RAYON_NUM_THREADS=1 mpirun --oversubscribe -n 2 "$BIN" "$@"
