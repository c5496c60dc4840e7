#!/usr/bin/env bash
# Do two ndtrain binaries compute the same thing? Runs the reference set of training runs with
# each binary and compares, as text, the losses in metrics.csv (17 significant digits) and the
# checksum of every tensor of the final checkpoint (parameters and both AdamW moments). For a
# change that must not touch the numerics (a restructuring, a refactor of the loop): anything
# but "identical" is a failure.
#
#   benches/same_results.sh OLD_BINARY NEW_BINARY          # e.g. a build of main vs this tree
#
# The runs: inputs/tiny.toml (150 steps) on 1 rank, FSDP 2 × TP 2, CP 2 × TP 2, HSDP 2 × 2
# (grad_accum 2 there), PP 2 under 1F1B and under zero bubble with tied embeddings (8
# micro-batches each; both also evaluate a held-out loss every 50 steps, which runs the
# pipeline's forward-only schedule), and inputs/bench_small.toml for 3 steps on 1 rank; each
# writes a checkpoint at its last step. The losses compared are metrics.csv's `loss` and
# `val_loss` columns.
set -euo pipefail

OLD="${1:?usage: $0 OLD_BINARY NEW_BINARY}"
NEW="${2:?usage: $0 OLD_BINARY NEW_BINARY}"
OUT="${OUT:-out/same_results}"

if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_mpi_yield_when_idle=1
rm -rf "$OUT"; mkdir -p "$OUT"

# name ranks deck sets...
RUNS=(
    "tiny_1|1|inputs/tiny.toml|"
    "tiny_fsdp2_tp2|4|inputs/tiny.toml|--set parallel.dp_shard=2 --set parallel.tp=2"
    "tiny_cp2_tp2|4|inputs/tiny.toml|--set parallel.cp=2 --set parallel.tp=2"
    "tiny_hsdp2x2|4|inputs/tiny.toml|--set parallel.dp_replicate=2 --set parallel.dp_shard=2"
    "tiny_pp2_1f1b|2|inputs/tiny.toml|--set parallel.pp=2 --set parallel.pp_schedule=\"1f1b\" --set eval.every=50"
    "tiny_pp2_zb_tied|2|inputs/tiny.toml|--set parallel.pp=2 --set parallel.pp_schedule=\"zero_bubble\" --set model.tie_embeddings=true --set eval.every=50"
    "bench_small_1|1|inputs/bench_small.toml|--set run.steps=3 --set optim.warmup_steps=1"
)

# Every dataset's `checksum` attribute, one `path checksum` line each, sorted.
checksums() {
    "${PYTHON:-/usr/bin/python3}" - "$1" <<'EOF'
import sys, h5py
lines = []
def visit(name, obj):
    if isinstance(obj, h5py.Dataset):
        lines.append(f"{name} {int(obj.attrs['checksum']):#018x}")
with h5py.File(sys.argv[1], "r") as f:
    f.visititems(visit)
print("\n".join(sorted(lines)))
EOF
}

status=0
for spec in "${RUNS[@]}"; do
    IFS='|' read -r name ranks deck sets <<<"$spec"
    for which in old new; do
        bin=$OLD; [ "$which" = new ] && bin=$NEW
        dir="$OUT/$which/$name"
        # shellcheck disable=SC2086
        cmd=(mpirun --oversubscribe --bind-to none -n "$ranks" "$bin" train "$deck" $sets --set run.threads=1
             --set checkpoint.every=1000000 --set run.out_dir="\"$dir\"")
        echo "+ ${cmd[*]}"
        "${cmd[@]}" > "$OUT/$which.$name.log" 2>&1 || { echo "FAILED: see $OUT/$which.$name.log"; exit 1; }
        # The loss and val_loss columns, found by name in the header.
        awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i } { print $col["loss"] "," (col["val_loss"] ? $col["val_loss"] : "") }' \
            "$dir/metrics.csv" > "$dir/losses.txt"
        checksums "$(ls "$dir"/ckpt/step_*.h5 | tail -n 1)" > "$dir/checksums.txt"
    done
    for f in losses checksums; do
        if cmp -s "$OUT/old/$name/$f.txt" "$OUT/new/$name/$f.txt"; then
            echo "$name: $f identical ($(wc -l < "$OUT/new/$name/$f.txt") lines)"
        else
            echo "$name: $f DIFFER"; diff "$OUT/old/$name/$f.txt" "$OUT/new/$name/$f.txt" | head -5; status=1
        fi
    done
done
exit $status
