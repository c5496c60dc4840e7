"""ndtrain against PyTorch + Hugging Face transformers on one GPU, side by side.

For a deck (default inputs/gpu_1b.toml, bf16), runs the two programs alternately (A B A B ...),
each for a few optimiser steps after warm-up, and prints for each the median seconds per step,
tokens/s and MFU against the deck's stated peak ([hardware] peak_flops_per_rank, the GPU's
dense bf16 datasheet figure) with ndtrain's FLOP count (docs/model.md), and the pair-wise ratios.

The PyTorch side is PyTorch eager (no torch.compile): `LlamaForCausalLM` with the deck's
shapes, f32 parameters under `torch.autocast(bfloat16)` (bf16 GEMMs and SDPA attention, f32
master weights, as ndtrain's `precision = "bf16"`), `torch.optim.AdamW` with the deck's
hyper-parameters (PyTorch's default foreach implementation), clipping, micro batch × grad_accum
sequences of seq_len + 1 random tokens per step: the same tokens and FLOPs per step.

PyTorch is a benchmark dependency only. On a machine with the NVIDIA image's python3 (torch and
transformers installed) and an ndtrain built with `--features cuda` on PATH:
    python3 benches/vs_pytorch_gpu.py --rounds 2 --steps 6
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_pytorch import flops_per_token  # noqa: E402  (ndtrain's FLOP count, one definition)


def torch_worker(deck_path, steps, warmup):
    """One PyTorch measurement in this process: prints a JSON line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    deck = tomllib.load(open(deck_path, "rb"))
    m, t, o = deck["model"], deck["train"], deck["optim"]
    cfg = LlamaConfig(
        vocab_size=m["vocab_size"], hidden_size=m["d_model"], intermediate_size=m["ffn_hidden"],
        num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"], num_key_value_heads=m["n_kv_heads"],
        max_position_embeddings=m["max_seq_len"], rms_norm_eps=m["norm_eps"], rope_theta=m["rope_theta"],
        tie_word_embeddings=m["tie_embeddings"], attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = LlamaForCausalLM(cfg).to(device=dev, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(o.get("beta1", 0.9), o.get("beta2", 0.95)),
                            eps=o.get("eps", 1e-8), weight_decay=o.get("weight_decay", 0.1))
    mb, seq = t["micro_batch"], t["seq_len"]
    accum = max(1, t["global_batch"] // mb)
    gen = torch.Generator(device=dev).manual_seed(1)
    times = []
    for step in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for _ in range(accum):
            ids = torch.randint(0, m["vocab_size"], (mb, seq + 1), generator=gen, device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.get("grad_clip", 1.0))
        opt.step()
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    print(json.dumps({"step_s": statistics.median(times), "steps": times, "tokens": mb * accum * seq,
                      "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                      "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}))


def run_ndtrain(ndtrain, deck, steps, warmup, out):
    args = [ndtrain, "train", deck, "--set", f"run.steps={steps + warmup}", "--set", f'run.out_dir="{out}"',
            "--set", "optim.warmup_steps=1", "--set", "log.every=1000"]
    subprocess.run(args, check=True, capture_output=True)
    rows = list(open(os.path.join(out, "metrics.csv")))[1:]
    times = [float(r.split(",")[7]) for r in rows][warmup:]
    return statistics.median(times), times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--deck", default=os.path.join(REPO, "inputs/gpu_1b.toml"))
    ap.add_argument("--ndtrain", default=shutil.which("ndtrain") or os.path.join(REPO, "target/release/ndtrain"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        torch_worker(a.deck, a.steps, a.warmup)
        return
    deck = tomllib.load(open(a.deck, "rb"))
    m, t = deck["model"], deck["train"]
    peak = float(deck.get("hardware", {}).get("peak_flops_per_rank", 0)) or 989e12
    tokens = t["global_batch"] * t["seq_len"]
    fpt = flops_per_token(m, t["seq_len"])
    print(f"deck {a.deck}: {tokens} tokens/step, {fpt * tokens / 1e12:.1f} TFLOP/step; MFU against {peak / 1e12:.0f} "
          f"TFLOP/s (dense bf16, stated); {a.rounds} rounds of {a.steps} steps after {a.warmup} warm-up, A B A B ...",
          flush=True)
    nd, pt, ratios = [], [], []
    for r in range(a.rounds):
        s_nd, _ = run_ndtrain(a.ndtrain, a.deck, a.steps, a.warmup, f"/tmp/vs_pytorch_gpu_nd_{r}")
        res = subprocess.run([sys.executable, __file__, "--torch-worker", "--deck", a.deck, "--steps", str(a.steps),
                              "--warmup", str(a.warmup)], check=True, capture_output=True, text=True)
        w = json.loads(res.stdout.strip().splitlines()[-1])
        nd.append(s_nd)
        pt.append(w["step_s"])
        ratios.append(w["step_s"] / s_nd)
        print(f"round {r + 1}: ndtrain {s_nd:.3f} s/step, PyTorch {w['torch']} eager {w['step_s']:.3f} s/step "
              f"(peak {w['peak_mem_gib']:.1f} GiB) on {w['gpu']}, ratio {w['step_s'] / s_nd:.3f}", flush=True)
    print("\n| program | median s/step | tokens/s | TFLOP/s | MFU |")
    print("|---|---|---|---|---|")
    for name, s in (("ndtrain (bf16)", statistics.median(nd)), ("PyTorch eager + transformers (bf16 autocast)", statistics.median(pt))):
        tf = fpt * tokens / s
        print(f"| {name} | {s:.3f} | {tokens / s:.0f} | {tf / 1e12:.1f} | {100 * tf / peak:.1f} % |")
    print(f"\nndtrain speed-up over PyTorch: median of pair-wise ratios {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
