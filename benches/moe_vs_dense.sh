#!/usr/bin/env bash
# A mixture of experts against the dense model with the same active FLOPs per token, on
# inputs/bench_small.toml: the dense MLP of 1536 against 8 experts of 768 of which each token
# uses 2 (3·2·768·512 + 8·512 active weights per block against 3·1536·512), the auxiliary loss
# on. One rank × 2 threads, unbound, ROUNDS interleaved rounds of STEPS steps; the median step
# time of each run (steps 2 onwards) and tokens/s, and the experts' over the dense model's.
set -euo pipefail
NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
OUT="${OUT:-out/bench_moe}"
STEPS="${STEPS:-6}"
ROUNDS="${ROUNDS:-3}"
cargo build --release --quiet
rm -rf "$OUT"; mkdir -p "$OUT"
EXPERTS=(--set model.n_experts=8 --set model.experts_per_token=2 --set model.moe_ffn_hidden=768 --set model.router_aux_loss_coef=0.01)
run() { local name=$1; shift
    "$NDTRAIN" train inputs/bench_small.toml --set run.steps="$STEPS" --set run.threads=2 \
        --set run.out_dir="\"$OUT/$name\"" "$@" > "$OUT/$name.log" 2>&1
}
for r in $(seq 1 "$ROUNDS"); do
    run "dense_$r"
    run "experts_$r" "${EXPERTS[@]}"
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import csv, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def median_step(name):
    rows = list(csv.DictReader(open(f"{out}/{name}/metrics.csv")))[1:]
    return statistics.median(float(r["step_s"]) for r in rows), float(rows[0]["tokens_per_s"]) and statistics.median(float(r["tokens_per_s"]) for r in rows)
print("| round | dense s/step | dense tokens/s | experts s/step | experts tokens/s | experts / dense tokens/s |")
print("|---|---|---|---|---|---|")
ratios = []
for r in range(1, rounds + 1):
    (ds, dt), (es, et) = median_step(f"dense_{r}"), median_step(f"experts_{r}")
    ratios.append(et / dt)
    print(f"| {r} | {ds:.3f} | {dt:.0f} | {es:.3f} | {et:.0f} | {et / dt:.3f} |")
print(f"\nmedian ratio over the rounds: {statistics.median(ratios):.3f}")
PY
