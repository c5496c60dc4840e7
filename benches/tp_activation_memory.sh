#!/usr/bin/env bash
# Activation memory per rank under tensor parallelism: one rank, TP=2, TP=2 + sequence
# parallelism, on a deck whose activations dominate (tiny model, micro batch 8 × 256 tokens).
# Reads `activation_bytes` (what the model holds between forward and backward) and the peak RSS
# from each rank's timing log.
set -euo pipefail
NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
OUT="${OUT:-out/bench_tp_memory}"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_mpi_yield_when_idle=1
cargo build --release --quiet
rm -rf "$OUT"; mkdir -p "$OUT"
common=(--set run.steps=2 --set run.threads=1 --set optim.warmup_steps=0 --set train.seq_len=256
        --set train.micro_batch=8 --set train.global_batch=8 --set model.d_model=256 --set model.ffn_hidden=768)
run() { local name=$1 n=$2; shift 2
    echo "+ mpirun -n $n $NDTRAIN train inputs/tiny.toml ${common[*]} $*"
    mpirun --oversubscribe -n "$n" "$NDTRAIN" train inputs/tiny.toml "${common[@]}" --set run.out_dir="\"$OUT/$name\"" "$@" > "$OUT/$name.log" 2>&1
}
run one 1
run tp2 2 --set parallel.tp=2
run tp2_sp 2 --set parallel.tp=2 --set parallel.sequence_parallel=true
echo "| layout | activation MiB per rank | peak RSS MiB (rank 0) | vs one rank |"
echo "|---|---|---|---|"
base=""
for name in one tp2 tp2_sp; do
    row=$(tail -1 "$OUT/$name/timing/rank_00000.csv")
    header=$(head -1 "$OUT/$name/timing/rank_00000.csv")
    act=$(python3 -c "import sys; h='$header'.split(','); r='$row'.split(','); print(int(r[h.index('activation_bytes')]))")
    rss=$(python3 -c "import sys; h='$header'.split(','); r='$row'.split(','); print(int(r[h.index('peak_rss_bytes')]))")
    [ -z "$base" ] && base=$act
    python3 -c "print(f'| $name | {$act/2**20:.1f} | {$rss/2**20:.1f} | {$act/$base:.3f} |')"
done
