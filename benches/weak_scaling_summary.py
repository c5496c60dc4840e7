#!/usr/bin/env python3
"""Summarises benches/weak_scaling_dp.sh: tokens/s per layout (median over steps after the
first two, then over rounds), speed-up against one rank, and the communication each rank spent
blocked (exposed) with and without overlap."""
import csv, glob, os, statistics, sys

out = sys.argv[1]
WARM = 2

def metrics(run):
    rows = list(csv.DictReader(open(os.path.join(run, "metrics.csv"))))[WARM:]
    return statistics.median(float(r["tokens_per_s"]) for r in rows), statistics.median(float(r["step_s"]) for r in rows)

def exposed(run):
    """Median over steps of (max over ranks of seconds blocked in collectives) and step time."""
    per_rank = []
    for f in sorted(glob.glob(os.path.join(run, "timing", "rank_*.csv"))):
        rows = list(csv.DictReader(open(f)))[WARM:]
        per_rank.append([sum(float(v) for k, v in r.items() if k.endswith("_s") and "." in k) for r in rows])
    steps = zip(*per_rank)
    return statistics.median(max(s) for s in steps)

names = ["one", "dp2", "fsdp2", "dp2_blocking", "fsdp2_blocking"]
res = {}
for n in names:
    runs = sorted(glob.glob(os.path.join(out, f"{n}.r*")))
    runs = [r for r in runs if os.path.isdir(r)]
    tps = [metrics(r)[0] for r in runs]
    step = [metrics(r)[1] for r in runs]
    comm = [exposed(r) for r in runs]
    res[n] = (statistics.median(tps), statistics.median(step), statistics.median(comm))

base = res["one"][0]
print(f"| layout | tokens/s | s/step | speed-up vs 1 rank | exposed comm s/step | exposed % of step |")
print(f"|---|---|---|---|---|---|")
for n in names:
    tps, step, comm = res[n]
    print(f"| {n} | {tps:.0f} | {step:.3f} | {tps / base:.3f} | {comm:.4f} | {100 * comm / step:.1f} |")
for n in ["dp2", "fsdp2"]:
    blocking = res[n + "_blocking"][2]
    hidden = 1 - res[n][2] / blocking if blocking > 0 else float("nan")
    print(f"{n}: overlap hides {100 * hidden:.0f}% of the blocking schedule's exposed communication")
