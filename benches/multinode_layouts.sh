#!/usr/bin/env bash
# Layouts across nodes on shaped links: step times of bench_small on 2 emulated hosts × 2 ranks
# (jobscripts/local/cluster-local.sh) for FSDP 4, HSDP 2 × 2 (replicas across hosts), TP 2
# within a host × DP 2 across, and TP 2 across hosts × DP 2 within, at each link rate of RATES,
# against `ndtrain plan --all-layouts` with the rates `ndtrain probe --deck` measured on the
# same hosts and links (docs/planning.md, "Layouts across nodes"). Per rate: the probe under the
# same mpirun as training, its [hardware] table appended to the deck; then every layout trained
# for STEPS steps in interleaved rounds, the median of each run's steps after the first is its
# s/step (median over rounds), and each group's exposed communication (the seconds the ranks
# spent blocked in its collectives, `<group>.<kind>_s` of the timing logs) is the mean over ranks
# of its median step. TP across hosts is placed by `mpirun --map-by node` (ranks dealt to the
# hosts in turn), and planned with `--placement cyclic`.
# The 2 hosts share this machine's cores: 4 ranks unbound on them, mpi_yield_when_idle.
# Needs root (network namespaces, tc). The binary is `cargo build --release`'s.
#   benches/multinode_layouts.sh                          # the record, ~30 min on 2 quiet cores
#   RATES=1gbit STEPS=3 ROUNDS=1 benches/multinode_layouts.sh    # a quick try
#   REPLAN=1 benches/multinode_layouts.sh                 # the predictions again from the recorded
#                                                         # run's decks and measurements
set -euo pipefail

DECK="${DECK:-inputs/bench_small.toml}"
RATES="${RATES:-250mbit 1gbit 10gbit}"
STEPS="${STEPS:-5}"
ROUNDS="${ROUNDS:-2}"
NDTRAIN="${NDTRAIN:-target/release/ndtrain}"
OUT="${OUT:-out/bench_multinode_layouts}"
RESULT="${RESULT:-benches/results/multinode_layouts.md}"
REPLAN="${REPLAN:-0}"
CLUSTER=jobscripts/local/cluster-local.sh

variant=(--set train.micro_batch=1 --set train.global_batch=4 --set log.every=1000 --set optim.warmup_steps=1)
# name pp dp_replicate dp_shard cp tp placement
layouts="fsdp4 1 1 4 1 1 block
hsdp2x2 1 2 2 1 1 block
tp2_within_dp2_across 1 2 1 1 2 block
tp2_across_dp2_within 1 2 1 1 2 cyclic"

NDTRAIN=$(realpath "$NDTRAIN")
mkdir -p "$OUT"
OUT=$(realpath "$OUT")

# on_cluster PLACEMENT ARGS...: mpirun on cn1 over both hosts, 2 ranks each.
on_cluster() {
    local placement=$1; shift
    local map=()
    [ "$placement" = cyclic ] && map=(--map-by node)
    bash "$CLUSTER" run cn1 mpirun --hostfile "$CLUSTER_LOCAL_HOSTFILE" -n 4 --bind-to none "${map[@]}" "$@"
}

# predicted RATE: one line per layout: rate name step_s fsdp_s tp_s dp_s (plan's ranking
# columns), from `plan --all-layouts` of the rate's deck under each placement.
predicted() {
    local rate=$1 placement
    for placement in block cyclic; do
        "$NDTRAIN" plan "$OUT/deck_$rate.toml" --ranks 4 --all-layouts --placement "$placement" "${variant[@]}" \
            > "$OUT/plan_${rate}_$placement.txt"
    done
    while read -r name pp rep shard cp tp placement; do
        awk -v r="$rate" -v n="$name" -v k="$pp $rep $shard $cp $tp" \
            '$1 ~ /^[0-9]+$/ && ($2 " " $3 " " $4 " " $5 " " $6) == k { print r, n, $19, $12, $13, $17; exit }' \
            "$OUT/plan_${rate}_$placement.txt"
    done <<< "$layouts"
}

if [ "$REPLAN" != 1 ]; then
    [ "$(id -u)" -eq 0 ] || { echo "multinode_layouts.sh: needs root (network namespaces, tc)" >&2; exit 2; }
    rm -rf "$OUT"; mkdir -p "$OUT/runs"
    trap 'bash "$CLUSTER" stop > /dev/null 2>&1 || true' EXIT
    : > "$OUT/measured.txt"
    for rate in $RATES; do
        bash "$CLUSTER" start 2 --rate "$rate" --no-slurm
        eval "$(bash "$CLUSTER" env)"
        echo "+ probe at $rate"
        on_cluster block "$NDTRAIN" probe --deck "$(realpath "$DECK")" "${variant[@]}" > "$OUT/probe_$rate.txt" 2> "$OUT/probe_$rate.err"
        { cat "$DECK"; echo; sed -n '/^\[hardware\]/,$p' "$OUT/probe_$rate.txt"; } > "$OUT/deck_$rate.toml"
        for round in $(seq 1 "$ROUNDS"); do
            while read -r name pp rep shard cp tp placement; do
                dir="$OUT/runs/${rate}_${name}_round$round"
                echo "+ $rate round $round: $name"
                on_cluster "$placement" "$NDTRAIN" train "$OUT/deck_$rate.toml" "${variant[@]}" --set run.steps="$STEPS" \
                    --set parallel.pp="$pp" --set parallel.dp_replicate="$rep" --set parallel.dp_shard="$shard" \
                    --set parallel.cp="$cp" --set parallel.tp="$tp" --set run.out_dir="\"$dir\"" > "$dir.log" 2>&1 < /dev/null
                python3 - "$rate" "$name" "$dir" >> "$OUT/measured.txt" <<'EOF'
import csv, glob, statistics, sys
rate, name, run = sys.argv[1:]
def steady(rows, col):
    return statistics.median(float(r[col]) for r in rows[1:])
steps = list(csv.DictReader(open(f"{run}/metrics.csv")))
exposed = {"fsdp": [], "tp": [], "dp_rep": []}
for path in sorted(glob.glob(f"{run}/timing/rank_*.csv")):
    rows = list(csv.DictReader(open(path)))
    for g in exposed:
        exposed[g].append(sum(steady(rows, c) for c in rows[0] if c.startswith(g + ".") and c.endswith("_s")))
print(rate, name, steady(steps, "step_s"), *(statistics.mean(v) for v in exposed.values()))
EOF
            done <<< "$layouts"
        done
    done
fi

: > "$OUT/predicted.txt"
while read -r rate; do
    predicted "$rate" >> "$OUT/predicted.txt"
done < <(awk '!seen[$1]++ { print $1 }' "$OUT/measured.txt")

{
    if [ "$REPLAN" = 1 ] && [ -s "$OUT/header.md" ]; then
        cat "$OUT/header.md"
        echo "- predictions recomputed $(date -u '+%Y-%m-%d %H:%M UTC') at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) from the recorded run's probe output; measurements as recorded"
    else
        {
            echo "# Layouts across nodes: planned against measured, bench_small on 2 emulated hosts × 2 ranks"
            echo
            echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
            echo "- machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores shared by both hosts; load at the end $(cut -d' ' -f1-3 /proc/loadavg)"
            echo "- links: cluster-local.sh start 2 --rate R (tc tbf on both ends of each host's veth; no delay: this kernel has no netem)"
            echo "- command: RATES=\"$RATES\" STEPS=$STEPS ROUNDS=$ROUNDS benches/multinode_layouts.sh (binary $NDTRAIN)"
            echo "- measured: the median over $ROUNDS interleaved round(s) of each run's median s/step after its first step; exposed communication per group: the mean over ranks of the median step's seconds in the group's collectives"
        } | tee "$OUT/header.md"
    fi
    echo
    python3 - "$OUT/measured.txt" "$OUT/predicted.txt" "$OUT" <<'EOF'
import statistics, sys
measured, predicted = {}, {}
for line in open(sys.argv[1]):
    rate, name, *v = line.split()
    measured.setdefault((rate, name), []).append([float(x) for x in v])
for line in open(sys.argv[2]):
    rate, name, *v = line.split()
    predicted[(rate, name)] = [float(x) for x in v]
rates = list(dict.fromkeys(r for r, _ in measured))
for rate in rates:
    probe = dict(l.split(" = ") for l in open(f"{sys.argv[3]}/deck_{rate}.toml") if l.startswith(("inter_node_", "intra_node_")))
    print(f"## Links at {rate}\n")
    rates = lambda k: " / ".join(f"{float(probe.get(f'inter_node{k}{c}bandwidth', 'nan')):.3e}" for c in ("_", "_all_reduce_", "_reduce_scatter_"))
    print(f"probed, per rank, all-gather / all-reduce / reduce-scatter: between nodes one rank per node {rates('')} B/s, "
          f"every rank {rates('_packed')} B/s, + {float(probe['inter_node_latency']):.2e} s; "
          f"intra-node {float(probe['intra_node_bandwidth']):.3e} B/s + {float(probe['intra_node_latency']):.2e} s\n")
    print("| layout | predicted s/step | measured s/step | error | fsdp exposed, predicted / measured | tp | dp_rep |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for (r, name), runs in measured.items():
        if r != rate:
            continue
        m = [statistics.median(col) for col in zip(*runs)]
        p = predicted[(r, name)]
        rows.append((name, p[0], m[0]))
        err = 100 * (p[0] - m[0]) / m[0]
        print(f"| {name} | {p[0]:.3f} | {m[0]:.3f} | {err:+.1f} % | {p[1]:.3f} / {m[1]:.3f} | {p[2]:.3f} / {m[2]:.3f} | {p[3]:.3f} / {m[3]:.3f} |")
    within = sum(1 for _, p, m in rows if abs(p - m) <= 0.2 * m)
    order_p = [n for n, _, _ in sorted(rows, key=lambda r: r[1])]
    order_m = [n for n, _, _ in sorted(rows, key=lambda r: r[2])]
    print(f"\n{within} of {len(rows)} within ±20 %. Predicted order: {' < '.join(order_p)}. "
          f"Measured order: {' < '.join(order_m)}: {'the same' if order_p == order_m else 'different'}.\n")
EOF
} > "$OUT/table.md"
cp "$OUT/table.md" "$RESULT"
cat "$RESULT"
