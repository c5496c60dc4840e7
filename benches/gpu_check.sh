#!/usr/bin/env bash
# The GPU checks of issue 10, as one script for a machine with NVIDIA GPUs: builds with the
# `cuda` feature, runs the backend's unit test, then `ndtrain gpu-check` on one rank and, if
# the node has more than one GPU, on one rank per GPU (NCCL over all of them), and saves the
# output under benches/results/.
#   benches/gpu_check.sh            # GPUS=<count from nvidia-smi>
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="benches/results/gpu_check_$(date -u +%Y%m%dT%H%MZ).txt"
GPUS="${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
{
    echo "# ndtrain GPU check, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -9
    set -x
    cargo build --release --features cuda
    cargo test --release --features cuda --lib gpu::
    target/release/ndtrain gpu-check
    if [ "$GPUS" -gt 1 ]; then mpirun --oversubscribe -n "$GPUS" target/release/ndtrain gpu-check; fi
} 2>&1 | tee "$OUT"
echo "saved $OUT"
