#!/usr/bin/env bash
# The pipeline's bubble, measured: two ranks × one thread (pp = 2) on bench_small with a
# vocabulary of 512 (so the head — output projection and loss, on the last stage — is small
# and the two stages cost the same; with bench_small's 4096 the last stage is ~20 % heavier
# and waits on it would measure the imbalance, not the schedule), for 2, 4 and 8
# micro-batches per step under every schedule (gpipe, 1f1b, interleaved with 2 chunks per
# rank, zero_bubble), against each schedule's formula (docs/parallelism.md). The measured
# bubble of a rank is the time it waited for its neighbour, `pp.recv_s`, as a fraction of the
# pipeline's part of its step (`data_s + forward_s + backward_s + pp.recv_s`), mean over the
# steps after the first — what `ndtrain report` shows per stage. Runs are interleaved (every
# schedule for one m, then the next m) because the machine drifts.
#   benches/pipeline_bubble.sh                  # bench_small, vocab 512, micro_batch 2, 4 steps
#   MB=1 STEPS=6 benches/pipeline_bubble.sh
set -euo pipefail

DECK="${DECK:-inputs/bench_small.toml}"
STEPS="${STEPS:-4}"
MB="${MB:-2}"
VOCAB="${VOCAB:-512}"
MICROS="${MICROS:-2 4 8}"
NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
OUT="${OUT:-out/bench_pipeline_bubble}"

if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_mpi_yield_when_idle=1
cargo build --release --quiet
rm -rf "$OUT"; mkdir -p "$OUT"

common=(--set run.steps="$STEPS" --set model.vocab_size="$VOCAB" --set run.threads=1 --set log.every=1000 --set train.micro_batch="$MB"
        --set optim.warmup_steps=1 --set parallel.pp=2)
for m in $MICROS; do
    for sched in gpipe 1f1b interleaved zero_bubble; do
        extra=(--set "parallel.pp_schedule=\"$sched\"")
        if [ "$sched" = interleaved ]; then extra+=(--set parallel.pp_virtual=2); fi
        dir="$OUT/${sched}_m$m"
        echo "+ mpirun -n 2 $NDTRAIN train $DECK ${common[*]} --set train.global_batch=$((m * MB)) ${extra[*]} (-> $dir)"
        # One core per rank (Open MPI binds each of two ranks to a core): one thread each.
        mpirun -n 2 "$NDTRAIN" train "$DECK" "${common[@]}" --set train.global_batch=$((m * MB)) "${extra[@]}" \
            --set run.out_dir="\"$dir\"" > "$dir.log" 2>&1
    done
done
python3 benches/pipeline_bubble_summary.py "$OUT"
