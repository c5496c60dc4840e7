#!/usr/bin/env bash
# The planner's predicted step time against the measured one, for every valid 1-, 2- and
# 4-rank layout of bench_small (docs/planning.md, "Predicted step time"). The deck is varied
# so that DP and PP are allowed: micro_batch 1 and global_batch 4 (the same 2048 tokens per
# step; grad_accum 4 on one rank). Per rank count: `ndtrain probe --deck` once under the same
# mpirun as training (every rank busy at once), its [hardware] lines appended to the deck,
# `ndtrain plan --all-layouts` for the predictions; then every layout is trained for STEPS
# steps in interleaved rounds (every layout once per round, as the machine drifts), the median
# of each run's steps after the first is its s/step, and the median over rounds is measured.
# 1 rank runs unbound on both cores, 2 ranks bound one per core (Open MPI's default), 4 ranks
# oversubscribed and unbound with mpi_yield_when_idle.
# The binary is `cargo build --release`'s (NDTRAIN= another one; an optimised build with debug
# assertions, as the tests build it, runs several times slower).
#   benches/plan_vs_measured.sh                     # the record, ~15 min on 2 quiet cores
#   RANKS="1 2" STEPS=3 ROUNDS=1 LIMIT=2 benches/plan_vs_measured.sh    # a quick try
#   REPLAN=1 benches/plan_vs_measured.sh            # the predictions again from the recorded run's
#                                                   # decks (probe output included) and the same
#                                                   # measurements, after a change to the model
set -euo pipefail

DECK="${DECK:-inputs/bench_small.toml}"
STEPS="${STEPS:-4}"
ROUNDS="${ROUNDS:-2}"
RANKS="${RANKS:-1 2 4}"
LIMIT="${LIMIT:-0}"
NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
OUT="${OUT:-out/bench_plan_vs_measured}"
RESULT="${RESULT:-benches/results/plan_vs_measured.md}"

REPLAN="${REPLAN:-0}"

if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_mpi_yield_when_idle=1

launch() { # launch RANKS ARGS...: mpirun as this bench places that many ranks
    local n="$1"; shift
    case "$n" in
        1) mpirun -n 1 --bind-to none "$@" ;;
        2) mpirun -n 2 "$@" ;;
        *) mpirun -n "$n" --oversubscribe --bind-to none "$@" ;;
    esac
}

variant=(--set train.micro_batch=1 --set train.global_batch=4 --set log.every=1000 --set optim.warmup_steps=1)

# predicted N DECK: `plan --all-layouts` of deck DECK on N ranks, one line per layout:
# N pp dp_rep dp_sh cp tp step_s (the ranking's column before tokens/s).
predicted() {
    "$NDTRAIN" plan "$2" --ranks "$1" --all-layouts "${variant[@]}" > "$OUT/plan_$1.txt"
    awk -v n="$1" '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && NF >= 16 { print n, $2, $3, $4, $5, $6, $(NF-1) }' "$OUT/plan_$1.txt"
}

if [ "$REPLAN" = 1 ]; then
    [ -s "$OUT/measured.txt" ] || { echo "REPLAN=1: no $OUT/measured.txt of a recorded run" >&2; exit 2; }
    : > "$OUT/replanned.txt"
    awk '{ print $1 }' "$OUT/measured.txt" | sort -un | while read -r n; do
        predicted "$n" "$OUT/deck_$n.toml" >> "$OUT/replanned.txt"
    done
    # The recorded measurements with the new predictions (matched by ranks and layout).
    awk 'NR == FNR { p[$1 " " $2 " " $3 " " $4 " " $5 " " $6] = $7; next }
         { k = $1 " " $2 " " $3 " " $4 " " $5 " " $6; if (!(k in p)) { print "no prediction for " k > "/dev/stderr"; exit 1 }
           $7 = p[k]; print }' "$OUT/replanned.txt" "$OUT/measured.txt" > "$OUT/measured.new"
    mv "$OUT/measured.new" "$OUT/measured.txt"
    # The recorded run's header (its date, machine and command), and when and where the
    # predictions were made again.
    { awk 'NF == 0 && ++blank == 2 { exit } { print }' "$OUT/table.md"
      echo "- predictions recomputed $(date -u '+%Y-%m-%d %H:%M UTC') at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) from the recorded run's probe output; measurements as recorded"
      echo; } > "$OUT/header.md"
else
rm -rf "$OUT"; mkdir -p "$OUT/runs"
: > "$OUT/layouts.txt"
for n in $RANKS; do
    echo "+ probe on $n rank(s)"
    launch "$n" "$NDTRAIN" probe --deck "$DECK" "${variant[@]}" > "$OUT/probe_$n.txt"
    deck="$OUT/deck_$n.toml"
    { cat "$DECK"; echo; sed -n '/^\[hardware\]/,$p' "$OUT/probe_$n.txt"; } > "$deck"
    predicted "$n" "$deck" | { if [ "$LIMIT" -gt 0 ]; then head -n "$LIMIT"; else cat; fi } >> "$OUT/layouts.txt"
done

for round in $(seq 1 "$ROUNDS"); do
    while read -r n pp rep shard cp tp predicted; do
        name="r${n}_pp${pp}_rep${rep}_sh${shard}_cp${cp}_tp${tp}"
        dir="$OUT/runs/${name}_round$round"
        echo "+ round $round: $name"
        launch "$n" "$NDTRAIN" train "$OUT/deck_$n.toml" "${variant[@]}" --set run.steps="$STEPS" \
            --set parallel.pp="$pp" --set parallel.dp_replicate="$rep" --set parallel.dp_shard="$shard" \
            --set parallel.cp="$cp" --set parallel.tp="$tp" --set run.out_dir="\"$dir\"" > "$dir.log" 2>&1 < /dev/null
        # The median of the steps after the first.
        measured=$(awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == "step_s") c = i; next }
                            NR > 2 { print $c }' "$dir/metrics.csv" | sort -g | awk '{ v[NR] = $1 } END {
                            print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
        echo "$n $pp $rep $shard $cp $tp $predicted $measured" >> "$OUT/measured.txt"
    done < "$OUT/layouts.txt"
done
fi

if [ "$REPLAN" = 1 ]; then
    cp "$OUT/header.md" "$OUT/table.md"
else
    {
        echo "# Planned against measured step time, bench_small (micro_batch 1, global_batch 4)"
        echo
        echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
        echo "- machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; load at the end $(cut -d' ' -f1-3 /proc/loadavg)"
        echo "- command: RANKS=\"$RANKS\" STEPS=$STEPS ROUNDS=$ROUNDS benches/plan_vs_measured.sh (binary $NDTRAIN)"
        echo "- measured: the median over $ROUNDS interleaved round(s) of each run's median s/step after its first step"
        echo
    } > "$OUT/table.md"
fi
python3 - "$OUT/measured.txt" >> "$OUT/table.md" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    n, pp, rep, shard, cp, tp, pred, meas = line.split()
    key = (int(n), f"pp={pp} dp_rep={rep} dp_shard={shard} cp={cp} tp={tp}")
    runs.setdefault(key, [float(pred), []])[1].append(float(meas))
rows = [(n, layout, pred, statistics.median(m), len(m)) for (n, layout), (pred, m) in runs.items()]
print("| ranks | layout | predicted s/step | measured s/step | runs | error |")
print("|---|---|---|---|---|---|")
for n, layout, pred, meas, k in rows:
    print(f"| {n} | {layout} | {pred:.3f} | {meas:.3f} | {k} | {100 * (pred - meas) / meas:+.1f} % |")
within = sum(1 for r in rows if abs(r[2] - r[3]) <= 0.2 * r[3])
print(f"\n{within} of {len(rows)} layouts predicted within ±20 %.\n")
for n in sorted({r[0] for r in rows}):
    mine = [r for r in rows if r[0] == n]
    p, m = min(mine, key=lambda r: r[2]), min(mine, key=lambda r: r[3])
    verdict = "correctly" if p[1] == m[1] else "wrongly"
    print(f"- {n} rank(s): fastest predicted {p[1]} ({p[2]:.3f} s), fastest measured {m[1]} ({m[3]:.3f} s): predicted {verdict}")
EOF
cp "$OUT/table.md" "$RESULT"
cat "$RESULT"
