#!/usr/bin/env bash
# Checkpoint write and read bandwidth against plain sequential I/O on the same file system.
# A 48.3 M-parameter model (579 MB of parameters + AdamW moments) is written by 1, 2 and 4
# ranks (FSDP) after each of 3 steps (keep = 1) and read back by a resume on the same layout;
# `dd` writes the same number of bytes to a new file with conv=fsync 3 times (ndtrain fsyncs
# before the rename) and reads one back. Writes are the median of the 3; bandwidth is logical
# bytes over the slowest rank's seconds, from <run>/checkpoint_io.csv. The page cache is not
# dropped (no root needed), for either side.
set -euo pipefail
NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
OUT="${OUT:-out/bench_checkpoint}"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_mpi_yield_when_idle=1
cargo build --release --quiet
rm -rf "$OUT"; mkdir -p "$OUT"
model=(--set model.d_model=512 --set model.n_layers=10 --set model.vocab_size=16384 --set model.ffn_hidden=1536
       --set train.seq_len=32 --set train.micro_batch=1 --set train.global_batch=4 --set run.steps=3
       --set optim.warmup_steps=1 --set run.threads=1)
col() { python3 -c "import csv,sys; r=[x for x in csv.DictReader(open('$1')) if x['event']=='$2'][-1]; print(r['$3'])"; }
median_write() { python3 -c "import csv,statistics; print(statistics.median(float(x['mb_per_s']) for x in csv.DictReader(open('$1')) if x['event']=='write'))"; }
dd_mbps() { python3 -c "import sys,re; l=sys.stdin.read().strip().splitlines()[-1]; print(int(l.split()[0]) / float(re.search(r', ([0-9.e+-]+) s,', l).group(1)) / 1e6)"; }
echo "| ranks | write MB/s | dd write MB/s | write ratio | read MB/s | dd read MB/s | read ratio | collective | state MiB/rank | load RSS growth MiB/rank |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for n in 1 2 4; do
    mpirun --oversubscribe -n "$n" "$NDTRAIN" train inputs/tiny.toml "${model[@]}" --set checkpoint.every=1 --set checkpoint.keep=1 \
        --set run.out_dir="\"$OUT/w$n\"" > "$OUT/w$n.log" 2>&1
    ck="$OUT/w$n/ckpt/step_00000003.h5"
    mpirun --oversubscribe -n "$n" "$NDTRAIN" train inputs/tiny.toml "${model[@]}" --set checkpoint.resume="\"$ck\"" \
        --set run.out_dir="\"$OUT/r$n\"" > "$OUT/r$n.log" 2>&1
    bytes=$(col "$OUT/w$n/checkpoint_io.csv" write bytes)
    w=$(median_write "$OUT/w$n/checkpoint_io.csv")
    r=$(col "$OUT/r$n/checkpoint_io.csv" load mb_per_s)
    coll=$(col "$OUT/w$n/checkpoint_io.csv" write collective)
    count=$(( (bytes + 4194303) / 4194304 ))
    ddws=()
    for rep in 1 2 3; do
        rm -f "$OUT/dd.bin"
        ddws+=("$(dd if=/dev/zero of="$OUT/dd.bin" bs=4M count="$count" conv=fsync 2>&1 | dd_mbps)")
    done
    ddw=$(python3 -c "import statistics; print(f'{statistics.median([${ddws[0]}, ${ddws[1]}, ${ddws[2]}]):.0f}')")
    ddr=$(dd if="$OUT/dd.bin" of=/dev/null bs=4M 2>&1 | dd_mbps | python3 -c "print(f'{float(input()):.0f}')")
    rm -f "$OUT/dd.bin"
    state=$(col "$OUT/r$n/checkpoint_io.csv" load state_bytes_per_rank)
    before=$(col "$OUT/r$n/checkpoint_io.csv" load rss_before_bytes)
    peak=$(col "$OUT/r$n/checkpoint_io.csv" load peak_rss_bytes)
    python3 -c "print(f'| $n | {float($w):.0f} | $ddw | {float($w)/$ddw:.2f} | {float($r):.0f} | $ddr | {float($r)/$ddr:.2f} | $coll | {$state/2**20:.1f} | {($peak-$before)/2**20:.1f} |')"
done
echo "(checkpoint of $(python3 -c "print(f'{$bytes/1e6:.0f}')") MB; $(date -u +%F), $(nproc) cores, $(df -T "$OUT" | awk 'NR==2{print $2}') file system)"
