"""Reference losses for ndtrain's own training loop (``tests/reference_train.rs``).

``generate.py`` checks the library's model and optimiser on one micro-batch per step; this
script makes what the *binary* is checked against: a few optimiser steps over a token file,
each over a global batch that ndtrain splits into micro-batches (gradient accumulation) and
over ranks. Written to ``<out>`` (default ``tests/reference/data/loop``):

* ``config.json``, ``model.safetensors``, ``generation_config.json``: the initial model, an
  untied ``LlamaForCausalLM`` built by ``generate.py``'s ``build()`` (same ``MODEL`` shape and
  initialisation: matrices N(0, 0.1), norm weights 1 + N(0, 0.1)) with ``VOCAB`` = 101 (prime:
  padded by ndtrain's vocabulary-parallel layers on every tp > 1), written by ``save_pretrained``.
  ndtrain starts from it with ``[checkpoint] init_from``.
* ``tokens.bin``: an llm.c token file (header of 256 int32: magic 20240520, version 1, token
  count; then uint16 tokens) of ``STEPS·G·S + 1`` tokens from a seeded first-order Markov chain
  (every token has 4 successors with probabilities proportional to 1, 1/2, 1/3, 1/4), so the
  model has something to learn in a few steps. ndtrain reads it with ``[data] source = "bin"``.
* ``losses.json``: versions, date, seed, every hyper-parameter, and per optimiser step the mean
  loss (before the step's update), the global gradient norm before clipping and the learning
  rate, for the f32 model (as ndtrain trains) and for the same model in f64.

Data and loss as docs/data.md and docs/model.md state them: sample ``k`` is
``tokens[k·S : k·S + S + 1]`` (inputs its first S, targets its last S), step ``t`` uses samples
``t·G .. t·G + G`` (``order = "sequential"``), and the step's loss is the sum of the
cross-entropy over the global batch divided by its ``G·S`` target tokens, i.e. the mean over
the whole batch, computed here in one forward of all G sequences. Optimiser as ``generate.py``'s
``train()``: ``torch.optim.AdamW`` (``foreach=False``), decay 0.1 on 2-D weights (embeddings
included), none on norm weights; ``LambdaLR`` with linear warm-up then cosine to ``min_lr``;
``clip_grad_norm_`` (active in every step; asserted). Order per step: ``zero_grad``, forward,
loss, backward, clip, ``optimizer.step()``, ``scheduler.step()``.

The f64 run (``.double()`` inside ``generate.py``'s ``pure_f64()``) has no f32 rounding: the
difference of the f32 run from it is PyTorch's own rounding noise over these steps, which
``tests/reference_train.rs`` uses to judge ndtrain's.

Run from the repository root (a few seconds):

    /opt/refvenv/bin/python tests/reference/generate_loop.py
"""

import argparse
import copy
import datetime
import json
import math
import os
import platform
import sys

import numpy as np
import torch
import torch.nn.functional as F
import transformers
import safetensors

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate  # noqa: E402  (the model construction, save_model and pure_f64 of the other reference)

SEED = 20240602
VOCAB = 101
SEQ = 16  # S, tokens per sequence
GLOBAL_BATCH = 8  # G, sequences per optimiser step
STEPS = 6
BRANCHING = 4  # successors per token in the Markov chain of tokens.bin
OPTIM = dict(
    lr=1e-2,
    min_lr=1e-3,
    warmup_steps=2,
    steps=STEPS,
    schedule="cosine",
    beta1=0.9,
    beta2=0.95,
    eps=1e-8,
    weight_decay=0.1,  # 2-D weights (incl. embeddings); norm weights get 0.0
    grad_clip=0.5,  # below every step's pre-clip norm (asserted), so clipping is exercised
)
BIN_MAGIC = 20240520
BIN_VERSION = 1
BIN_HEADER_INTS = 256


def lr_lambda(s: int) -> float:
    """docs/model.md's schedule for 0-based step s, as a multiplier of the peak LR."""
    lr, min_lr, warmup, steps = OPTIM["lr"], OPTIM["min_lr"], OPTIM["warmup_steps"], OPTIM["steps"]
    if s < warmup:
        return (s + 1) / warmup
    p = (s - warmup) / max(1, steps - warmup)
    return (min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * p))) / lr


def markov_tokens(n: int, gen: torch.Generator) -> torch.Tensor:
    """n tokens of a seeded first-order Markov chain over VOCAB with BRANCHING successors each."""
    succ = torch.stack([torch.randperm(VOCAB, generator=gen)[:BRANCHING] for _ in range(VOCAB)])
    probs = torch.tensor([1.0 / (j + 1) for j in range(BRANCHING)], dtype=torch.float64)
    probs = probs / probs.sum()
    choice = torch.multinomial(probs, n - 1, replacement=True, generator=gen)
    out = torch.empty(n, dtype=torch.int64)
    out[0] = torch.randint(0, VOCAB, (1,), generator=gen).item()
    for i in range(1, n):
        out[i] = succ[out[i - 1], choice[i - 1]]
    return out


def write_bin(path: str, tokens: torch.Tensor) -> None:
    """llm.c GPT-2 .bin: 256 little-endian int32 (magic, version, count, zeros), uint16 tokens."""
    header = np.zeros(BIN_HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = BIN_MAGIC, BIN_VERSION, tokens.numel()
    assert int(tokens.max()) < 2**16
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.numpy().astype("<u2").tobytes())


def train(model, samples: torch.Tensor, label: str):
    """STEPS AdamW steps, step t on samples[t·G : t·G + G]; each step's loss, pre-clip norm, LR."""
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim != 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": OPTIM["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=OPTIM["lr"],
        betas=(OPTIM["beta1"], OPTIM["beta2"]),
        eps=OPTIM["eps"],
        foreach=False,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    losses, norms, lrs = [], [], []
    for s in range(STEPS):
        batch = samples[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]  # [G, S+1]
        opt.zero_grad(set_to_none=True)
        _, loss = generate.mean_loss(model, batch)  # mean over the G·S targets
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), OPTIM["grad_clip"])
        assert norm.item() > OPTIM["grad_clip"], f"[{label}] step {s}: norm {norm.item()} does not clip"
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        losses.append(loss.item())
        norms.append(norm.item())
        print(f"[{label}] step {s}: loss {loss.item():.12f}  grad_norm {norm.item():.9f}  lr {lrs[-1]:.6e}")
    return losses, norms, lrs


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "data", "loop"))
    args = ap.parse_args()

    torch.set_num_threads(1)  # one summation order, independent of the machine's core count
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)

    gen = torch.Generator().manual_seed(SEED)
    case = dict(vocab_size=VOCAB, tie_word_embeddings=False)
    model = generate.build(case, gen)
    generate.save_model(model, args.out)
    initial = copy.deepcopy(model)

    n_samples = STEPS * GLOBAL_BATCH
    n_tokens = n_samples * SEQ + 1
    tokens = markov_tokens(n_tokens, gen)
    write_bin(os.path.join(args.out, "tokens.bin"), tokens)
    samples = torch.stack([tokens[k * SEQ : k * SEQ + SEQ + 1] for k in range(n_samples)])

    losses, norms, lrs = train(model, samples, "f32")
    m64 = initial.double()
    with generate.pure_f64():
        losses64, norms64, lrs64 = train(m64, samples, "f64")
    assert lrs64 == lrs

    meta = dict(
        generator="tests/reference/generate_loop.py (model construction from tests/reference/generate.py)",
        date=datetime.date.today().isoformat(),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        safetensors=safetensors.__version__,
        numpy=np.__version__,
        seed=SEED,
        device="cpu",
        machine=platform.machine(),
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        attn_implementation="eager",
        torch_threads=1,
        init=dict(weight_std=generate.WEIGHT_STD, norm_std=generate.NORM_STD),
        model=dict(generate.MODEL, **case),
        data=dict(
            file="tokens.bin",
            format="llm.c .bin, magic 20240520, version 1, uint16 tokens",
            n_tokens=n_tokens,
            markov_branching=BRANCHING,
            seq_len=SEQ,
            global_batch=GLOBAL_BATCH,
            order="sequential",
        ),
        optim=OPTIM,
        f32=dict(loss=losses, grad_norm=norms, lr=lrs),
        f64=dict(loss=losses64, grad_norm=norms64, lr=lrs64),
    )
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    worst = max(abs(a - b) for a, b in zip(losses, losses64))
    print(f"f32 vs f64 (PyTorch): max |Δloss| {worst:.3e}")
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out} ({total / 1e3:.0f} KB)")


if __name__ == "__main__":
    sys.exit(main())
