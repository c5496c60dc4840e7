"""ndtrain against PyTorch + Hugging Face transformers on the same model, side by side.

For a deck (default inputs/bench_small.toml) and a thread count, runs the two programs
alternately (A B A B ...), each for a few optimiser steps after warm-up, and prints for each
the median seconds per step, tokens/s, MFU against the f32 GEMM ceiling measured in the same
run, and the pair-wise ratios. The ceiling is the faster of the two GEMMs on the same threads,
both measured every round: `torch.mm` (MKL) and `ndtrain probe` (the `gemm` crate ndtrain
uses). Which one wins depends on the CPU: MKL keeps AVX-512 to Intel CPUs, so on AMD the gemm
crate is the faster one. The machine is shared and drifts by 10-40 % within minutes, hence the interleaving.

PyTorch is a benchmark dependency only (never a test dependency). Install it in a venv:

    python3 -m venv /opt/refvenv && /opt/refvenv/bin/pip install torch transformers
    cargo build --release
    /opt/refvenv/bin/python benches/vs_pytorch.py --threads 2 --rounds 3 --steps 4

The PyTorch side is `LlamaForCausalLM` with the deck's shapes (SDPA attention, float32),
`torch.optim.AdamW` with the deck's hyper-parameters and fused=False/foreach=True (PyTorch's
CPU default), random token ids of the deck's vocabulary, micro batch × grad_accum sequences of
seq_len + 1 tokens per step: the same tokens per step and the same FLOPs as ndtrain's step.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flops_per_token(m, seq):
    """Training FLOPs per token, as ndtrain counts them (docs/model.md, "FLOPs and MFU"):
    6 N_matmul + 12 L D S (lm_head included, no causal halving)."""
    d, l, f, v = m["d_model"], m["n_layers"], m["ffn_hidden"], m["vocab_size"]
    hd = d // m["n_heads"]
    q, kv = m["n_heads"] * hd, m["n_kv_heads"] * hd
    n_matmul = l * (d * q + 2 * d * kv + q * d + 3 * d * f) + v * d
    return 6 * n_matmul + 12 * l * d * seq


def torch_worker(deck_path, threads, steps, warmup):
    """One PyTorch measurement in this process: prints a JSON line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    deck = tomllib.load(open(deck_path, "rb"))
    m, t, o = deck["model"], deck["train"], deck["optim"]
    cfg = LlamaConfig(
        vocab_size=m["vocab_size"], hidden_size=m["d_model"], intermediate_size=m["ffn_hidden"],
        num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"], num_key_value_heads=m["n_kv_heads"],
        max_position_embeddings=m["max_seq_len"], rms_norm_eps=m["norm_eps"], rope_theta=m["rope_theta"],
        tie_word_embeddings=m["tie_embeddings"], attn_implementation="sdpa", torch_dtype=torch.float32,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(o.get("beta1", 0.9), o.get("beta2", 0.95)),
                            eps=o.get("eps", 1e-8), weight_decay=o.get("weight_decay", 0.1))
    mb, seq = t["micro_batch"], t["seq_len"]
    accum = max(1, t["global_batch"] // mb)
    gen = torch.Generator().manual_seed(1)
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for _ in range(accum):
            ids = torch.randint(0, m["vocab_size"], (mb, seq + 1), generator=gen)
            out = model(input_ids=ids[:, :-1], labels=None)
            loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.get("grad_clip", 1.0))
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    # The GEMM ceiling on these threads: best of a few 1024^3 products through MKL.
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(6))
    print(json.dumps({"step_s": statistics.median(times), "steps": times, "gemm_flops": 2 * 1024**3 / best,
                      "tokens": mb * accum * seq, "torch": torch.__version__}))


def _timed(f):
    s = time.perf_counter()
    f()
    return time.perf_counter() - s


def ndtrain_gemm_flops(binary, threads):
    """`ndtrain probe`: the gemm crate's f32 1024^3 GEMM on these threads (FLOP/s)."""
    out = subprocess.run([binary, "probe", "--threads", str(threads)],
                         check=True, capture_output=True, text=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("f32 GEMM"))
    return float(line.split(":")[1].split()[0])


def run_ndtrain(binary, deck, threads, steps, warmup, out):
    args = [binary, "train", deck, "--set", f"run.steps={steps + warmup}",
            "--set", f"run.threads={threads}", "--set", f'run.out_dir="{out}"', "--set", "optim.warmup_steps=1",
            "--set", "log.every=1000"]
    env = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1")
    subprocess.run(args, check=True, capture_output=True, env=env)
    rows = list(open(os.path.join(out, "metrics.csv")))[1:]
    times = [float(r.split(",")[7]) for r in rows][warmup:]
    return statistics.median(times), times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--deck", default=os.path.join(REPO, "inputs/bench_small.toml"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ndtrain", default=os.path.join(REPO, "target/release/ndtrain"),
                    help="the ndtrain binary; several, comma-separated, run one after the other in every round "
                         "(e.g. two builds of ndtrain side by side); the first is the one the summary compares")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        torch_worker(a.deck, a.threads, a.steps, a.warmup)
        return
    deck = tomllib.load(open(a.deck, "rb"))
    m, t = deck["model"], deck["train"]
    tokens = t["global_batch"] * t["seq_len"]
    fpt = flops_per_token(m, t["seq_len"])
    print(f"deck {a.deck}: {tokens} tokens/step, {fpt * tokens / 1e9:.1f} GFLOP/step; {a.threads} thread(s), "
          f"{a.rounds} rounds of {a.steps} steps after {a.warmup} warm-up, A B A B ...")
    binaries = a.ndtrain.split(",")
    others = {b: [] for b in binaries[1:]}
    nd, pt, ceilings, mkl, crate, ratios = [], [], [], [], [], []
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    for r in range(a.rounds):
        s_nd, _ = run_ndtrain(binaries[0], a.deck, a.threads, a.steps, a.warmup, f"/tmp/vs_pytorch_nd_{r}")
        for i, b in enumerate(binaries[1:]):
            s_other, _ = run_ndtrain(b, a.deck, a.threads, a.steps, a.warmup, f"/tmp/vs_pytorch_nd{i + 1}_{r}")
            others[b].append(s_other)
            print(f"round {r + 1}: {b} {s_other:.3f} s/step", flush=True)
        res = subprocess.run([sys.executable, __file__, "--torch-worker", "--deck", a.deck, "--threads", str(a.threads),
                              "--steps", str(a.steps), "--warmup", str(a.warmup)], check=True, capture_output=True,
                             text=True, env=env)
        w = json.loads(res.stdout.strip().splitlines()[-1])
        g = ndtrain_gemm_flops(binaries[0], a.threads)
        nd.append(s_nd)
        pt.append(w["step_s"])
        mkl.append(w["gemm_flops"])
        crate.append(g)
        ceilings.append(max(w["gemm_flops"], g))
        ratios.append(w["step_s"] / s_nd)
        print(f"round {r + 1}: {binaries[0]} {s_nd:.3f} s/step, PyTorch {w['torch']} {w['step_s']:.3f} s/step, "
              f"ratio {w['step_s'] / s_nd:.3f}; GEMM 1024^3: MKL {w['gemm_flops'] / 1e9:.1f}, gemm crate {g / 1e9:.1f} GFLOP/s",
              flush=True)
    ceiling = statistics.median(ceilings)
    print(f"\nGEMM ceiling (median over rounds of the faster GEMM): {ceiling / 1e9:.1f} GFLOP/s "
          f"(MKL {statistics.median(mkl) / 1e9:.1f}, gemm crate {statistics.median(crate) / 1e9:.1f})")
    print("\n| program | median s/step | tokens/s | GFLOP/s | MFU vs GEMM ceiling |")
    print("|---|---|---|---|---|")
    for name, s in (("ndtrain", statistics.median(nd)), ("PyTorch + transformers", statistics.median(pt))):
        gf = fpt * tokens / s
        print(f"| {name} | {s:.3f} | {tokens / s:.0f} | {gf / 1e9:.1f} | {100 * gf / ceiling:.1f} % |")
    for b, times in others.items():
        pair = [o / n for o, n in zip(times, nd)]
        print(f"| {b} | {statistics.median(times):.3f} | {tokens / statistics.median(times):.0f} | | |  "
              f"(s/step over {binaries[0]}'s in the same round: median {statistics.median(pair):.3f}, "
              f"rounds {', '.join(f'{x:.3f}' for x in pair)})")
    print(f"\nceiling (median of rounds): {ceiling / 1e9:.1f} GFLOP/s on {a.threads} thread(s); "
          f"ndtrain speed-up over PyTorch: median of pair-wise ratios {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
