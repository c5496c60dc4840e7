#!/usr/bin/env python3
"""Where a training run's CPU time goes, from `perf script -F tid,time,ip,sym` output of a
`perf record -g --call-graph dwarf -e cpu-clock -F HZ` run (`benches/profile.sh`).

Each sample is charged to the first category its stack matches, leaf first: the GEMM library
(micro-kernels and packing), the kernel (page faults, scheduling), then the ndtrain function
that called into it (attention outside its GEMMs, norms, RoPE, SwiGLU, cross entropy, AdamW…),
then rayon's scheduling. Samples between FROM and TO seconds after the first one are counted
(the steady steps, without start-up); each thread's idle share is 1 − its samples / (HZ · span).

    profile_summary.py SCRIPT.txt --hz 499 [--from 5 --to 17]
"""
import argparse
import collections
import sys

# (category, substrings of a frame), tried in order on each frame from the leaf up; the first
# frame that matches any category names the sample's category.
CATEGORIES = [
    ("GEMM (gemm crate: micro-kernels, packing)", ["gemm_f32::", "gemm_common::", "gemm::gemm"]),
    ("attention outside its GEMMs (softmax, exp, masks, copies)", ["cpu::attention::"]),
    ("RMSNorm", ["kernels::rmsnorm"]),
    ("RoPE and head transposes", ["kernels::to_heads", "kernels::from_heads", "heads_rope"]),
    ("SwiGLU", ["kernels::swiglu"]),
    ("cross entropy", ["kernels::ce_", "cross_entropy", "::ce_"]),
    ("embedding", ["embed_fwd", "embed_bwd"]),
    ("AdamW", ["adamw"]),
    ("gradient norm, shard copies and adds (FSDP bookkeeping)", ["fsdp::", "sum_sq", "add_range", "copy_range", "add_assign"]),
    ("memset / memcpy", ["memset", "memmove", "memcpy"]),
]
KERNEL_LEAF = ("native_", "clear_page", "exc_page", "smp_call", "do_", "__handle", "handle_", "_raw_spin", "__lru",
               "memcg", "get_mem", "__list", "finish_task", "__schedule", "flush_tlb", "__folio", "folio")


def read(path):
    samples, cur = [], None
    for line in open(path, errors="replace"):
        if not line.strip():
            if cur:
                samples.append(cur)
            cur = None
            continue
        if cur is None:
            parts = line.split()
            cur = (parts[0], float(parts[1].rstrip(":")), [])
        else:
            sp = line.strip().split(None, 1)
            cur[2].append(sp[1] if len(sp) > 1 else "")
    if cur:
        samples.append(cur)
    return samples


def category(frames):
    if frames and frames[0].startswith(KERNEL_LEAF):
        return "Linux kernel (page faults, TLB, scheduling)"
    for f in frames:
        for name, keys in CATEGORIES:
            if any(k in f for k in keys):
                return name
    if any("rayon" in f for f in frames):
        return "rayon scheduling (spinning, stealing)"
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("script")
    ap.add_argument("--hz", type=float, required=True)
    ap.add_argument("--from", dest="t_from", type=float, default=0.0)
    ap.add_argument("--to", type=float, default=1e9)
    a = ap.parse_args()
    samples = read(a.script)
    if not samples:
        sys.exit("no samples")
    t0 = min(s[1] for s in samples)
    window = [s for s in samples if a.t_from <= s[1] - t0 < a.to]
    span = min(a.to, max(s[1] for s in samples) - t0) - a.t_from
    per_tid = collections.Counter(s[0] for s in window)
    # The worker threads: the ones that ran most (the rank's compute threads).
    busy = [t for t, n in per_tid.most_common() if n > 0.2 * a.hz * span]
    cats = collections.Counter(category(s[2]) for s in window if s[0] in busy)
    total = sum(cats.values())
    print(f"window {a.t_from:.1f}–{a.t_from + span:.1f} s after the first sample; {len(busy)} compute threads; "
          f"{total} samples at {a.hz:g} Hz\n")
    print("| where | share of the compute threads' samples |")
    print("|---|---:|")
    for name, n in cats.most_common():
        print(f"| {name} | {100.0 * n / total:.1f} % |")
    print("\n| thread | samples | busy share of the window (idle = the rest) |")
    print("|---|---:|---:|")
    for t in busy:
        print(f"| {t} | {per_tid[t]} | {100.0 * per_tid[t] / (a.hz * span):.1f} % |")


if __name__ == "__main__":
    main()
