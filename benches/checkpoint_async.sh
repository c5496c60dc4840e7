#!/usr/bin/env bash
# What a checkpoint costs training: asynchronous writes (`[checkpoint] async = true`) against
# synchronous ones of the same binary and against the synchronous collective-HDF5 writer of an
# earlier binary (BEFORE, optional), on the meshes of the scale check: 16 and 64 ranks
# oversubscribed on this machine's cores (the tiny deck), and 2 ranks on dedicated cores (a
# 48.3 M-parameter model, 579 MB per checkpoint).
#
# Per mesh and writer: one run with a checkpoint every EVERY steps and one without any
# (`every = 0`), interleaved, ROUNDS times. The cost of one checkpoint is the difference of the
# two runs' training-loop wall times (`run.json` `results.train_s`: the first step to the
# summary, the wait for the last write included) over the number of checkpoints, in steps of
# the run without; the stall and the snapshot copy are the medians of `checkpoint_io.csv`
# (`stall_s`, `snapshot_s`, the largest of any rank).
#
#   NDTRAIN=out/ndtrain-bench BEFORE=out/ndtrain-before benches/checkpoint_async.sh
#   MESHES="16" ROUNDS=1 benches/checkpoint_async.sh        # a quick try
set -euo pipefail
NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
BEFORE="${BEFORE:-}"
OUT="${OUT:-out/bench_checkpoint_async}"
MESHES="${MESHES:-2 16 64}"
ROUNDS="${ROUNDS:-2}"
STEPS="${STEPS:-40}"
EVERY="${EVERY:-5}"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_mpi_yield_when_idle=1
rm -rf "$OUT"; mkdir -p "$OUT"
big=(--set model.d_model=512 --set model.n_layers=10 --set model.vocab_size=16384 --set model.ffn_hidden=1536
     --set train.seq_len=32)

# run MESH WRITER EVERY NAME: one training run; its directory is $OUT/NAME.
run() {
    local n=$1 writer=$2 every=$3 name=$4 bin=$NDTRAIN extra=() launch=(--oversubscribe)
    case $writer in
        before) bin=$BEFORE ;;
        sync) extra=(--set checkpoint.async=false) ;;
        async) extra=(--set checkpoint.async=true) ;;
    esac
    [ "$n" = 2 ] && extra+=("${big[@]}") && launch=(--bind-to core)
    mpirun "${launch[@]}" -n "$n" "$bin" train inputs/tiny.toml --set run.threads=1 --set run.steps="$STEPS" \
        --set train.micro_batch=1 --set train.global_batch="$n" --set optim.warmup_steps=1 --set log.every=1000 \
        --set parallel.dp_shard=-1 --set checkpoint.every="$every" --set checkpoint.keep=2 "${extra[@]}" \
        --set run.out_dir="\"$OUT/$name\"" > "$OUT/$name.log" 2>&1
}

writers="sync async"
[ -n "$BEFORE" ] && writers="before $writers"
for round in $(seq 1 "$ROUNDS"); do
    for n in $MESHES; do
        for w in $writers; do
            echo "+ round $round: $n ranks, $w"
            run "$n" "$w" "$EVERY" "r${round}_${n}_${w}"
            run "$n" "$w" 0 "r${round}_${n}_${w}_none"
        done
    done
done

python3 - "$OUT" "$ROUNDS" "$STEPS" "$EVERY" "$MESHES" "$writers" <<'EOF'
import csv, json, statistics, sys
out, rounds, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
meshes, writers = sys.argv[5].split(), sys.argv[6].split()
checkpoints = steps // every
def train_s(name):
    return json.load(open(f"{out}/{name}/run.json"))["results"]["train_s"]
def writes(name):
    return [r for r in csv.DictReader(open(f"{out}/{name}/checkpoint_io.csv")) if r["event"] == "write"]
print("| ranks | writer | checkpoint MB | cost per checkpoint (s) | in steps | stall (s) | snapshot copy (s) | stall / snapshot | write (s) |")
print("|---|---|---|---|---|---|---|---|---|")
costs = {}
for n in meshes:
    for w in writers:
        runs = [f"r{r}_{n}_{w}" for r in range(1, rounds + 1)]
        cost = statistics.median((train_s(r) - train_s(r + "_none")) / checkpoints for r in runs)
        step = statistics.median(train_s(r + "_none") / steps for r in runs)
        rows = [x for r in runs for x in writes(r)]
        mb = float(rows[0]["bytes"]) / 1e6
        write = statistics.median(float(x["seconds"]) for x in rows)
        stall = [float(x["stall_s"]) for x in rows if x.get("stall_s")]
        snap = [float(x["snapshot_s"]) for x in rows if x.get("snapshot_s")]
        costs[(n, w)] = cost
        s = f"{statistics.median(stall):.4f}" if stall else "n/a"
        c = f"{statistics.median(snap):.4f}" if snap else "n/a"
        ratio = f"{statistics.median(stall) / statistics.median(snap):.2f}" if stall and snap else "n/a"
        print(f"| {n} | {w} | {mb:.0f} | {cost:.3f} | {cost / step:.2f} | {s} | {c} | {ratio} | {write:.3f} |")
print()
for n in meshes:
    base = costs.get((n, "before"))
    if base:
        print(f"- {n} ranks: asynchronous cost / the earlier synchronous writer's: {costs[(n, 'async')] / base:.1%}; "
              f"this binary's synchronous: {costs[(n, 'sync')] / base:.1%}")
EOF
