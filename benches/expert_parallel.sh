#!/usr/bin/env bash
# Expert parallelism against one rank and against FSDP without it, side by side: the mixture
# of experts of benches/moe_vs_dense.sh (inputs/bench_small.toml with 8 experts of 768, top-2,
# the auxiliary loss on) and a global batch of 8 sequences (so two ranks split it), one
# thread per rank. One rank alone; two ranks with ep 2 (each holds
# 4 of the 8 experts of every block, the routed rows cross by all-to-all); two ranks with
# FSDP 2 and every expert on both. The two ranks bound one per core. ROUNDS interleaved
# rounds of STEPS steps; per run the median step (steps 2 onwards), tokens/s, and from rank
# 0's timing log the all-to-all's exposed share of the step (it blocks: its seconds are
# exposed) and its bytes.
set -euo pipefail
NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
OUT="${OUT:-out/bench_ep}"
STEPS="${STEPS:-6}"
ROUNDS="${ROUNDS:-3}"
cargo build --release --quiet
rm -rf "$OUT"; mkdir -p "$OUT"
EXPERTS=(--set model.n_experts=8 --set model.experts_per_token=2 --set model.moe_ffn_hidden=768 --set model.router_aux_loss_coef=0.01
    --set train.global_batch=8)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
run() { local name=$1 ranks=$2; shift 2
    local args=(train inputs/bench_small.toml --set run.steps="$STEPS" --set run.threads=1 --set run.out_dir="\"$OUT/$name\"" "${EXPERTS[@]}" "$@")
    if [ "$ranks" = 1 ]; then "$NDTRAIN" "${args[@]}" > "$OUT/$name.log" 2>&1
    else mpirun -n "$ranks" --bind-to core "$NDTRAIN" "${args[@]}" > "$OUT/$name.log" 2>&1; fi
}
for r in $(seq 1 "$ROUNDS"); do
    run "one_$r" 1
    run "ep2_$r" 2 --set parallel.dp_shard=2 --set parallel.ep=2
    run "fsdp2_$r" 2 --set parallel.dp_shard=2
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import csv, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def run(name):
    rows = list(csv.DictReader(open(f"{out}/{name}/metrics.csv")))[1:]
    t = list(csv.DictReader(open(f"{out}/{name}/timing/rank_00000.csv")))[1:]
    share = statistics.median(float(x["ep.all_to_all_s"]) / float(x["step_s"]) for x in t)
    a2a = statistics.median(float(x["ep.all_to_all_bytes"]) for x in t)
    return statistics.median(float(r["step_s"]) for r in rows), statistics.median(float(r["tokens_per_s"]) for r in rows), share, a2a
print("| round | one rank tokens/s | ep 2 tokens/s | ep 2 / one | all-to-all share of the ep 2 step | all-to-all MB/step (rank 0) | FSDP 2 tokens/s | FSDP 2 / one |")
print("|---|---|---|---|---|---|---|---|")
speed, share, fsdp = [], [], []
for r in range(1, rounds + 1):
    (_, t1, _, _), (_, te, sh, b), (_, tf, _, _) = run(f"one_{r}"), run(f"ep2_{r}"), run(f"fsdp2_{r}")
    speed.append(te / t1); share.append(sh); fsdp.append(tf / t1)
    print(f"| {r} | {t1:.0f} | {te:.0f} | {te / t1:.3f} | {100 * sh:.1f} % | {b / 1e6:.1f} | {tf:.0f} | {tf / t1:.3f} |")
print(f"\nmedians over the rounds: ep 2 / one rank {statistics.median(speed):.3f}, "
      f"all-to-all share {100 * statistics.median(share):.1f} %, FSDP 2 / one rank {statistics.median(fsdp):.3f}")
PY
