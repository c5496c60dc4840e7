#!/usr/bin/env python3
"""Markdown tables from gemm_backends output.

    python3 summarize.py DIR [DIR ...]

Each DIR holds the t*.txt files of one ./run.sh. With one DIR: per-shape tables of that run.
With several: per-shape medians over the runs' medians, and one geomean line per process run
(every (run, tag, threads) process is an independent interleaved sample of all backends).
"""
import math, re, sys, glob, os
from collections import defaultdict, OrderedDict

BACKENDS = ["gemm-0.19", "matrixmultiply-0.3", "openblas"]
REF = "gemm-0.19"
kv = re.compile(r'(\w+)=("([^"]*)"|\S+)')

def parse(d):
    res = defaultdict(dict)  # (tag, threads) -> {(shape, backend): gflops median}
    shapes, checks, infos = OrderedDict(), [], []
    for f in sorted(glob.glob(os.path.join(d, "t*.txt"))):
        for line in open(f):
            kind, _, rest = line.partition(" ")
            fl = {m.group(1): (m.group(3) if m.group(3) is not None else m.group(2)) for m in kv.finditer(rest)}
            if kind == "RESULT":
                shapes[fl["shape"]] = (int(fl["m"]), int(fl["n"]), int(fl["k"]))
                res[(fl["tag"], int(fl["threads"]))][(fl["shape"], fl["backend"])] = float(fl["gflops_median"])
            elif kind == "CHECK":
                checks.append(fl)
            elif kind == "INFO" and not rest.startswith("reference"):
                infos.append((os.path.basename(f), rest.strip()))
    return res, shapes, checks, infos

def median(v):
    v = sorted(v); n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])

def geomean(v):
    return math.exp(sum(map(math.log, v)) / len(v))

def linear(s):
    return s.split()[0] in ("fwd", "dx", "dW")

dirs = sys.argv[1:] or ["out"]
runs = [(d, *parse(d)) for d in dirs]
shapes = OrderedDict()
for _, _, sh, _, _ in runs:
    shapes.update(sh)
tags = []
for _, res, _, _, _ in runs:
    for t, _ in res:
        if t not in tags:
            tags.append(t)
tags.sort(key=lambda x: (x.startswith("force-"), x != "env", x))

def pooled(tag, t):
    """(shape, backend) -> median over runs of the run's median GFLOP/s."""
    acc = defaultdict(list)
    for _, res, _, _, _ in runs:
        for key, v in res.get((tag, t), {}).items():
            acc[key].append(v)
    return {k: median(v) for k, v in acc.items()}, max((len(v) for v in acc.values()), default=0)

def shape_table(tag):
    out = []
    per_t = {t: pooled(tag, t) for t in (1, 2)}
    cols = [(t, b) for t in (1, 2) for b in BACKENDS if any((s, b) in per_t[t][0] for s in shapes)]
    nruns = max(n for _, n in per_t.values())
    out.append(f"Median GFLOP/s{' (median over ' + str(nruns) + ' runs of each run' + chr(39) + 's median)' if nruns > 1 else ''}; best per thread count in bold.\n")
    out.append("| shape | M | N | K | " + " | ".join(f"T={t} {b}" for t, b in cols) + " |")
    out.append("|---|---:|---:|---:|" + "---:|" * len(cols))
    for s, (m, n, k) in shapes.items():
        cells = []
        for t in (1, 2):
            vals = {b: per_t[t][0][(s, b)] for tt, b in cols if tt == t and (s, b) in per_t[t][0]}
            best = max(vals.values()) if vals else None
            for b in BACKENDS:
                if (t, b) in cols:
                    v = vals.get(b)
                    cells.append("-" if v is None else (f"**{v:.1f}**" if v == best else f"{v:.1f}"))
        out.append(f"| {s} | {m} | {n} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(out)

def aggregate_rows():
    """One row per (run, tag, threads) process: geomean GFLOP/s over all shapes and summed time
    of the 12 linear-layer GEMMs, relative to gemm-0.19."""
    out = ["| run | tag | T | " + " | ".join(f"{b} geomean" for b in BACKENDS) + " | " +
           " | ".join(f"{b} 12-linear ms" for b in BACKENDS) + " | fastest (12-linear time) |",
           "|---|---|---:|" + "---:|" * (2 * len(BACKENDS)) + "---|"]
    ratios = defaultdict(list)  # (tag, t, b) -> [time(gemm)/time(b)] for each process
    for d, res, sh, _, _ in runs:
        for tag in tags:
            if tag.startswith("force-"):
                continue
            for t in (1, 2):
                r = res.get((tag, t))
                if not r or not all((s, b) in r for s in sh for b in BACKENDS):
                    continue
                gm = {b: geomean([r[(s, b)] for s in sh]) for b in BACKENDS}
                ms = {b: sum(2 * m * n * k / (r[(s, b)] * 1e9) * 1e3 for s, (m, n, k) in sh.items() if linear(s)) for b in BACKENDS}
                for b in BACKENDS:
                    ratios[(tag, t, b)].append((ms[REF] / ms[b], gm[b] / gm[REF]))
                fastest = min(BACKENDS, key=lambda b: ms[b])
                out.append(f"| {os.path.basename(d.rstrip('/'))} | {tag} | {t} | " +
                           " | ".join(f"{gm[b]:.1f}" for b in BACKENDS) + " | " +
                           " | ".join(f"{ms[b]:.0f}" for b in BACKENDS) + f" | {fastest} |")
    return "\n".join(out), ratios

for tag in tags:
    if tag.startswith("force-"):
        continue
    print(f"\n### `{tag}` runs: per shape\n")
    print(shape_table(tag))

txt, ratios = aggregate_rows()
print("\n### Per process run: geomean GFLOP/s over the 15 shapes, and time of the 12 linear-layer GEMMs (each once)\n")
print(txt)
print("\n### Relative to gemm-0.19, over all process runs above (median [min .. max])\n")
print("| T | backend | speed vs gemm-0.19 on the 12 linear GEMMs (time ratio) | geomean GFLOP/s ratio | processes |")
print("|---:|---|---|---|---:|")
for t in (1, 2):
    for b in BACKENDS:
        v = [x for tag in tags for x in ratios.get((tag, t, b), [])]
        if not v or b == REF:
            continue
        tr, gr = [x[0] for x in v], [x[1] for x in v]
        print(f"| {t} | {b} | {median(tr):.2f}x [{min(tr):.2f} .. {max(tr):.2f}] | {median(gr):.2f}x [{min(gr):.2f} .. {max(gr):.2f}] | {len(v)} |")

forced = [t for t in tags if t.startswith("force-")]
if forced:
    print("\n### Diagnostics: OpenBLAS kernel forced with OPENBLAS_CORETYPE, 1 thread (gemm-0.19 interleaved as anchor)\n")
    print("| shape | " + " | ".join(f"{t} {b}" for t in forced for b in (REF, "openblas")) + " |")
    print("|---|" + "---:|" * (2 * len(forced)))
    pf = {t: pooled(t, 1)[0] for t in forced}
    for s in shapes:
        print(f"| {s} | " + " | ".join(f"{pf[t][(s, b)]:.1f}" if (s, b) in pf[t] else "-" for t in forced for b in (REF, "openblas")) + " |")

print("\n### Correctness vs naive f64 reference\n")
print("max over shapes of max|c - ref| / max|ref| (c poisoned with NaN before each call; OK if < 1e-4 and no NaN/Inf).\n")
agg = OrderedDict()
for d, _, _, checks, _ in runs:
    for c in checks:
        key = (c["tag"], int(c["threads"]), c["backend"])
        e, nf, n, fail = agg.get(key, (0.0, 0, 0, False))
        bad = float(c["max_rel_err"]) >= 1e-4 or int(c["nonfinite"]) > 0
        agg[key] = (max(e, float(c["max_rel_err"])), nf + int(c["nonfinite"]), n + 1, fail or bad)
print("| tag | T | backend | checks | worst max_rel_err | non-finite | verdict |")
print("|---|---:|---|---:|---:|---:|---|")
for (tag, t, b), (e, nf, n, fail) in sorted(agg.items(), key=lambda x: (x[0][0].startswith("force-"), x[0][0] != "env", x[0])):
    print(f"| {tag} | {t} | {b} | {n} | {e:.2e} | {nf} | {'FAIL' if fail else 'OK'} |")
for d, _, _, checks, _ in runs:
    for c in checks:
        if float(c["max_rel_err"]) >= 1e-4 or int(c["nonfinite"]) > 0:
            print(f"- FAIL {d} {c['tag']} T={c['threads']} {c['backend']} {c['shape']}: {c['max_rel_err']} nonfinite={c['nonfinite']}")

print("\n### Run info\n")
for d, _, _, _, infos in runs:
    mt = os.path.join(d, "machine.txt")
    if os.path.exists(mt):
        for l in open(mt):
            if l.startswith(("loadavg", "total_wall")):
                print(f"- `{os.path.basename(d.rstrip('/'))}`: {l.strip()}")
    for f, l in infos:
        if l.startswith(("loadavg", "elapsed", "openblas")):
            print(f"- `{os.path.basename(d.rstrip('/'))}/{f}`: {l}")
