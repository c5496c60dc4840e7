#!/usr/bin/env bash
# Weak scaling of data parallelism on one node: one rank × 1 thread against two ranks × 1
# thread (DP=2 and FSDP=2), same micro batch and grad_accum per rank, so the global batch
# doubles. Each multi-rank layout also runs with `parallel.overlap=false` to measure how much
# of the communication the overlap hides. Runs are interleaved (A B C … A B C …) because the
# machine is shared and drifts; medians over steps after warm-up.
#   benches/weak_scaling_dp.sh                     # bench_small, 6 steps, 2 rounds
#   DECK=inputs/tiny.toml STEPS=20 benches/weak_scaling_dp.sh
set -euo pipefail

DECK="${DECK:-inputs/bench_small.toml}"
STEPS="${STEPS:-6}"
ROUNDS="${ROUNDS:-2}"
NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
OUT="${OUT:-out/bench_weak_scaling}"
MB="${MB:-4}"

if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_mpi_yield_when_idle=1
cargo build --release --quiet
rm -rf "$OUT"; mkdir -p "$OUT"

common=(--set run.steps="$STEPS" --set run.threads=1 --set log.every=1000 --set train.micro_batch="$MB" --set optim.warmup_steps=1)
run() { # name ranks global_batch extra-sets...
    local name=$1 ranks=$2 gb=$3; shift 3
    local dir="$OUT/$name.r$round"
    echo "+ mpirun -n $ranks $NDTRAIN train $DECK ${common[*]} --set train.global_batch=$gb $* (-> $dir)"
    mpirun --oversubscribe --bind-to none -n "$ranks" "$NDTRAIN" train "$DECK" "${common[@]}" \
        --set train.global_batch="$gb" --set run.out_dir="\"$dir\"" "$@" > "$dir.log" 2>&1
}
for round in $(seq 1 "$ROUNDS"); do
    mkdir -p "$OUT"
    run one 1 "$MB" --set parallel.dp_shard=1
    run dp2 2 $((2 * MB)) --set parallel.dp_replicate=2 --set parallel.dp_shard=1
    run fsdp2 2 $((2 * MB)) --set parallel.dp_shard=2
    run dp2_blocking 2 $((2 * MB)) --set parallel.dp_replicate=2 --set parallel.dp_shard=1 --set parallel.overlap=false
    run fsdp2_blocking 2 $((2 * MB)) --set parallel.dp_shard=2 --set parallel.overlap=false
done
python3 benches/weak_scaling_summary.py "$OUT"
