#!/usr/bin/env bash
# Runs ndtrain on this machine under mpirun.
#   jobscripts/local/train.sh DECK [--set table.key=value ...]
#   NRANKS=4 jobscripts/local/train.sh inputs/tiny.toml --set parallel.dp_replicate=4
#
# Each rank gets its own cores when there are at least as many cores as ranks
# (--map-by slot:PE=<cores/ranks>: the rank's threads run on its cores; ndtrain starts one
# thread per core of its affinity mask); with more ranks than cores they share the machine
# unbound (--bind-to none --oversubscribe). MPIRUN_ARGS replaces this choice.
# NDTRAIN is the binary [<prefix>/bin/ndtrain when this script is an installed one
# (<prefix>/share/ndtrain/jobscripts/local), else target/release/ndtrain of its source tree].
set -euo pipefail

NRANKS="${NRANKS:-1}"
# The folder that holds jobscripts/: a source tree, or <prefix>/share/ndtrain.
home_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [ -z "${NDTRAIN:-}" ]; then
    # Installed: <prefix>/share/ndtrain/jobscripts, the binary in <prefix>/bin.
    if [ "$(basename "$(dirname "$home_dir")")" = share ] && [ -x "$home_dir/../../bin/ndtrain" ]; then
        NDTRAIN=$(cd "$home_dir/../../bin" && pwd)/ndtrain
    else
        NDTRAIN=$home_dir/target/release/ndtrain
    fi
fi
MPIRUN="${MPIRUN:-mpirun}"
CORES="$(nproc)"
if [ -z "${MPIRUN_ARGS:-}" ]; then
    if [ "$NRANKS" -le "$CORES" ]; then
        MPIRUN_ARGS="--map-by slot:PE=$((CORES / NRANKS))"
    else
        MPIRUN_ARGS="--bind-to none --oversubscribe"
    fi
fi

if [ $# -lt 1 ]; then
    echo "usage: $0 DECK [--set table.key=value ...]" >&2
    exit 2
fi
# Open MPI refuses to run as root unless told; containers often run as root.
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Ranks waiting in a collective yield the core instead of spinning (matters when oversubscribed).
export OMPI_MCA_mpi_yield_when_idle="${OMPI_MCA_mpi_yield_when_idle:-1}"

echo "+ $MPIRUN $MPIRUN_ARGS -n $NRANKS $NDTRAIN train $*"
# shellcheck disable=SC2086
exec "$MPIRUN" $MPIRUN_ARGS -n "$NRANKS" "$NDTRAIN" train "$@"
