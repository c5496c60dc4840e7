#!/usr/bin/env bash
# Cost of the per-step logs (timing row, metrics row, console line) relative to the step, on
# inputs/bench_small.toml: the timing log's `log_s` (writing the previous step's logs) over its
# `step_s`, per rank, steps 2 onwards. Runs on 1 rank × 2 threads and on 2 ranks (FSDP, micro
# batch 2 so the global batch stays 4) × 1 thread.
set -euo pipefail
NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
OUT="${OUT:-out/bench_logging}"
STEPS="${STEPS:-8}"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_mpi_yield_when_idle=1
cargo build --release --quiet
rm -rf "$OUT"; mkdir -p "$OUT"
run() { local name=$1 n=$2; shift 2
    mpirun --oversubscribe -n "$n" "$NDTRAIN" train inputs/bench_small.toml --set run.steps="$STEPS" \
        --set run.out_dir="\"$OUT/$name\"" "$@" > "$OUT/$name.log" 2>&1
}
run one_rank 1 --set run.threads=2
run fsdp2 2 --set run.threads=1 --set train.micro_batch=2
echo "| run | rank | steps | mean step_s | mean log_s | log / step |"
echo "|---|---|---|---|---|---|"
for name in one_rank fsdp2; do
    for f in "$OUT/$name"/timing/rank_*.csv; do
        python3 - "$name" "$f" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[2])))[1:]
step = sum(float(r["step_s"]) for r in rows) / len(rows)
log = sum(float(r["log_s"]) for r in rows) / len(rows)
rank = sys.argv[2].rsplit("_", 1)[1].split(".")[0]
print(f"| {sys.argv[1]} | {int(rank)} | {len(rows)} | {step:.3f} | {log*1e6:.1f} µs | {100*log/step:.5f} % |")
PY
    done
done
