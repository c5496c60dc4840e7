#!/usr/bin/env python3
"""Summarises benches/pipeline_bubble.sh: per run and rank, the measured bubble beside the
schedule's formula, and whether zero bubble's is below 1F1B's for every m.

A rank's bubble in a step is the part of the step's pipeline phase in which it computed
nothing: 1 - busy / T, with busy = data_s + forward_s + backward_s of the rank and T the
pipeline phase's length, max over ranks of busy + pp.recv_s (the ranks start each step
together: the previous step ended with all-reduces over the pipeline). A rank idles either
waiting for a neighbour (pp.recv_s) or, done early, waiting for the others to finish.
Means over the steps after the first."""
import csv, glob, os, re, sys

out = sys.argv[1]
PP = 2

def formula(sched, m, pp=PP):
    ramp = pp - 1
    if sched == "zero_bubble":
        return ramp / (3 * m + ramp)
    v = 2 if sched == "interleaved" else 1
    return ramp / (v * m + ramp)

def measured(run):
    """Per rank: (bubble fraction, recv wait s/step), and the mean pipeline phase s/step."""
    logs = [list(csv.DictReader(open(f)))[1:] for f in sorted(glob.glob(os.path.join(run, "timing", "rank_*.csv")))]
    steps = len(logs[0])
    busy = [[float(r["data_s"]) + float(r["forward_s"]) + float(r["backward_s"]) for r in rows] for rows in logs]
    wait = [[float(r["pp.recv_s"]) for r in rows] for rows in logs]
    phase = [max(busy[k][i] + wait[k][i] for k in range(len(logs))) for i in range(steps)]
    ranks = [(sum(1 - busy[k][i] / phase[i] for i in range(steps)) / steps, sum(wait[k]) / steps) for k in range(len(logs))]
    return ranks, sum(phase) / steps

runs = {}
for run in sorted(glob.glob(os.path.join(out, "*_m*"))):
    if not os.path.isdir(run):
        continue
    sched, m = re.match(r"(.+)_m(\d+)$", os.path.basename(run)).groups()
    runs[(sched, int(m))] = measured(run)

print("| schedule | m | formula | rank 0 measured | rank 1 measured | largest distance (points) | pipeline phase s/step |")
print("|---|---|---|---|---|---|---|")
worst = 0.0
order = ["gpipe", "1f1b", "interleaved", "zero_bubble"]
for (sched, m) in sorted(runs, key=lambda k: (k[1], order.index(k[0]))):
    r, phase = runs[(sched, m)]
    f = formula(sched, m)
    delta = max(abs(x[0] - f) for x in r) * 100
    worst = max(worst, delta)
    print(f"| {sched} | {m} | {100 * f:.1f}% | {100 * r[0][0]:.1f}% | {100 * r[1][0]:.1f}% | {delta:.1f} | {phase:.2f} |")
print()
print(f"largest distance from the formula: {worst:.1f} percentage points")
for m in sorted({m for _, m in runs}):
    if ("zero_bubble", m) in runs and ("1f1b", m) in runs:
        zb = max(x[0] for x in runs[("zero_bubble", m)][0])
        ofob = min(x[0] for x in runs[("1f1b", m)][0])
        print(f"m = {m}: zero_bubble's bubble (worst rank) {100 * zb:.1f}% {'<' if zb < ofob else '>='} 1f1b's (best rank) {100 * ofob:.1f}%")
