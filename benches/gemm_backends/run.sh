#!/usr/bin/env bash
# Reruns the whole f32 GEMM backend comparison (about 3 minutes on 2 quiet cores, more if shared).
# Usage: ./run.sh [OUTDIR]   (default out/run-<UTC timestamp>)
# Raw output goes to OUTDIR/*.txt, the markdown tables to OUTDIR/summary.md.
# Several runs pool with: python3 summarize.py out/run-A out/run-B ...
set -euo pipefail
cd "$(dirname "$0")"
REPS="${REPS:-9}"
OUT="${1:-out/run-$(date -u +%Y%m%dT%H%M%SZ)}"
BIN=./target/release/gemm_backends
cargo build --release            # .cargo/config.toml adds -C target-cpu=native
mkdir -p "$OUT" out/refcache
export GEMM_REF_CACHE="$PWD/out/refcache"   # f64 reference results, shared by all runs
{
  date -u
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|L1d|L2|L3|Flags'
  dpkg -l libopenblas-dev libopenblas0-pthread | tail -2
  echo "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE-<unset>} OPENBLAS_L2_SIZE=${OPENBLAS_L2_SIZE-<unset>}"
  echo "loadavg_start: $(cat /proc/loadavg)"
} > "$OUT/machine.txt"

# 1-2: OpenBLAS as the environment has it (OPENBLAS_* left as set, or unset, by the environment).
MATMUL_NUM_THREADS=1 $BIN --threads 1 --reps "$REPS" --tag env   > "$OUT/t1_env.txt"
MATMUL_NUM_THREADS=2 $BIN --threads 2 --reps "$REPS" --tag env   > "$OUT/t2_env.txt"
# 3-4: same with OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE removed (OpenBLAS autodetects the core).
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE MATMUL_NUM_THREADS=1 $BIN --threads 1 --reps "$REPS" --tag unset > "$OUT/t1_unset.txt"
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE MATMUL_NUM_THREADS=2 $BIN --threads 2 --reps "$REPS" --tag unset > "$OUT/t2_unset.txt"
# 5: diagnostics, OpenBLAS kernel forced (gemm crate interleaved as an anchor), 1 thread.
if [ "${SKIP_FORCED:-0}" != 1 ]; then
  for core in Haswell SkylakeX; do
    env -u OPENBLAS_L2_SIZE OPENBLAS_CORETYPE=$core MATMUL_NUM_THREADS=1 \
      $BIN --threads 1 --reps 5 --backends gemm,openblas --tag "force-$core" > "$OUT/t1_force_$core.txt"
  done
fi
echo "loadavg_end: $(cat /proc/loadavg)" >> "$OUT/machine.txt"
echo "total_wall_s=$SECONDS" >> "$OUT/machine.txt"
python3 summarize.py "$OUT" > "$OUT/summary.md"
echo "wrote $OUT/summary.md"
