#!/usr/bin/env bash
# Two ndtrain builds on one deck, one rank, in ABBA order: the fair way to compare their speed
# on a shared machine that drifts within minutes. For each run it prints the build, the median
# s/step of the steps after the first, and every step's time (from metrics.csv).
#
#   benches/ab_binaries.sh NEW_BINARY OLD_BINARY [ROUNDS]          # ABBA × ROUNDS (default 2)
#   T=1 STEPS=5 DECK=inputs/bench_small.toml benches/ab_binaries.sh …
set -euo pipefail

A="${1:?usage: $0 BINARY_A BINARY_B [ROUNDS]}"
B="${2:?usage: $0 BINARY_A BINARY_B [ROUNDS]}"
ROUNDS="${3:-2}"
DECK="${DECK:-inputs/bench_small.toml}"
T="${T:-2}"
STEPS="${STEPS:-7}"
OUT="${OUT:-out/ab_binaries}"
export OMPI_MCA_mpi_yield_when_idle=1
rm -rf "$OUT"; mkdir -p "$OUT"

run() { # binary label index
    local dir="$OUT/$2_$3"
    "$1" train "$DECK" --set run.steps="$STEPS" --set run.threads="$T" --set optim.warmup_steps=1 \
        --set log.every=1000 --set run.out_dir="\"$dir\"" > "$dir.log" 2>&1
    python3 - "$2" "$dir/metrics.csv" <<'PY'
import statistics, sys
rows = [l.split(",") for l in open(sys.argv[2]).read().splitlines()[1:] if l]
times = [float(r[7]) for r in rows][1:]  # step_s; the first step warms up
print(sys.argv[1], f"{statistics.median(times):.4f}", " ".join(f"{x:.3f}" for x in times), flush=True)
PY
}

echo "# $DECK, 1 rank × $T thread(s), $STEPS steps per run, ABBA × $ROUNDS; A = $A, B = $B"
i=0
for _ in $(seq 1 "$ROUNDS"); do
    for which in A B B A; do
        i=$((i + 1))
        if [ "$which" = A ]; then run "$A" A "$i"; else run "$B" B "$i"; fi
    done
done
