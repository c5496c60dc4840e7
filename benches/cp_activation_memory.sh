#!/usr/bin/env bash
# Activation memory per rank under context parallelism for a long sequence: the tiny model on
# one sequence of SEQ tokens (default 8192), cp = 1, 2, 4. Reads `activation_bytes` and the peak
# RSS of rank 0 from the timing logs after one optimiser step.
set -euo pipefail
NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
OUT="${OUT:-out/bench_cp_memory}"
SEQ="${SEQ:-8192}"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_mpi_yield_when_idle=1
cargo build --release --quiet
rm -rf "$OUT"; mkdir -p "$OUT"
common=(--set run.steps=1 --set run.threads=1 --set optim.warmup_steps=0 --set train.seq_len="$SEQ"
        --set model.max_seq_len="$SEQ" --set train.micro_batch=1 --set train.global_batch=1)
echo "| cp | activation MiB per rank | peak RSS MiB (rank 0) | activations vs cp=1 | step s |"
echo "|---|---|---|---|---|"
base=""
for cp in 1 2 4; do
    echo "+ mpirun -n $cp $NDTRAIN train inputs/tiny.toml ${common[*]} --set parallel.cp=$cp" >&2
    mpirun --oversubscribe -n "$cp" "$NDTRAIN" train inputs/tiny.toml "${common[@]}" --set parallel.cp="$cp" \
        --set run.out_dir="\"$OUT/cp$cp\"" > "$OUT/cp$cp.log" 2>&1
    read -r act rss step < <(python3 - "$OUT/cp$cp/timing/rank_00000.csv" <<'PY'
import csv, sys
row = list(csv.DictReader(open(sys.argv[1])))[-1]
print(row["activation_bytes"], row["peak_rss_bytes"], row["step_s"])
PY
)
    [ -z "$base" ] && base=$act
    python3 -c "print(f'| $cp | {$act/2**20:.1f} | {$rss/2**20:.1f} | {$act/$base:.3f} | {$step:.2f} |')"
done
