"""Reference losses for ndtrain's own training loop (``tests/reference_train.rs``).

``generate.py`` checks the library's model and optimiser on one micro-batch per step; this
script makes what the *binary* is checked against: a few optimiser steps over a token file,
each over a global batch that ndtrain splits into micro-batches (gradient accumulation) and
over ranks. Written to ``<out>`` (default ``tests/reference/data/loop``; ``--moe``: see below):

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

Mixture of experts (``--moe``, default ``<out>`` ``tests/reference/data/loop_moe``): the same
files for a ``MixtralForCausalLM`` of the same shape and vocabulary (``MOE_CASE``: generate.py's
``mixtral`` case with ``VOCAB``; 8 experts of FFN width 48 (``intermediate_size``), top-2,
``router_aux_loss_coef`` 0.1, ``router_jitter_noise`` 0, eager attention and experts), built by
``build()`` from its own seed ``MOE_SEED`` and written by ``save_pretrained`` (legacy per-expert
names ``block_sparse_moe.experts.J.w1/w2/w3`` and ``block_sparse_moe.gate``, checked by
``generate.check_saved_names()``). ``tokens.bin`` is byte-identical to the dense loop's (the
tokens are drawn from the same generator state). Steps, G, S, schedule and optimiser as above;
weight decay covers every tensor of ndim >= 2 (the fused [E, out, in] experts too). The objective
is ndtrain's: cross entropy averaged over all G·S targets plus ``router_aux_loss_coef`` times the
mean over the G sequences of each sequence's own load-balancing loss (``out.aux_loss`` of a
forward of that sequence alone), computed as G micro-batches of one sequence
(``generate.moe_loss_backward()``: backward of ``(CE_mean(q) + coef·aux_q) / G``).
``losses.json`` has the dense keys, ``loss`` being the cross entropy alone (as ``metrics.csv``
logs it), plus per step ``aux_loss`` (mean over the batch's sequences, before the update) in
``f32`` and ``f64``, ``model_seed``, ``experts_implementation`` and a ``moe`` block (experts, top_k,
moe_intermediate_size, norm_topk_prob, router_aux_loss_coef, ...; ``min_topk_prob_margin``: the
smallest gap between a token's 2nd and 3rd router probability over every training forward, f32
and f64). The f64 run's ``pure_f64()`` also keeps the router softmax and the load-balancing loss
in f64. Before training, ``generate.check_hf_moe_loss()`` asserts on the first batch that
transformers' own loss is ``CE + coef · out.aux_loss`` per sequence (f32 and f64).

Run from the repository root (a few seconds each):

    /opt/refvenv/bin/python tests/reference/generate_loop.py          # data/loop
    /opt/refvenv/bin/python tests/reference/generate_loop.py --moe    # data/loop_moe
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
# --moe: a MixtralForCausalLM of the same shape (generate.py's ``mixtral`` case with VOCAB), its
# initial weights from MOE_SEED; its tokens are the dense loop's (SEED), so tokens.bin is the same.
# MOE_SEED was picked among 20240603 .. 20240619 for the widest gap between a token's 2nd and 3rd
# router probability (5.8e-5 over every forward, f32 and f64) relative to PyTorch's own f32-vs-f64
# difference of those probabilities (2.1e-6), so that no routing decision is near a tie.
MOE_SEED = 20240617
MOE_CASE = dict(
    arch="mixtral",  # generate.build(): eager attention, experts_implementation="eager", no sliding window
    vocab_size=VOCAB,
    tie_word_embeddings=False,
    intermediate_size=48,  # one expert's FFN width
    num_local_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.1,
    output_router_logits=True,
    router_jitter_noise=0.0,
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


def train(model, samples: torch.Tensor, label: str, coef: float | None = None):
    """STEPS AdamW steps, step t on samples[t·G : t·G + G]; each step's loss, pre-clip norm, LR,
    and (MoE objective when coef is set, else empty) the step's aux loss, mean over its G sequences."""
    # ndim >= 2: every matrix, including Mixtral's fused [E, out, in] experts (the dense model
    # has no tensor of ndim > 2, so its groups are the 2-D weights and the norms as before).
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
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
    losses, norms, lrs, auxs = [], [], [], []
    for s in range(STEPS):
        batch = samples[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]  # [G, S+1]
        opt.zero_grad(set_to_none=True)
        if coef is None:
            _, loss = generate.mean_loss(model, batch)  # mean over the G·S targets
            loss.backward()
        else:
            # G micro-batches of one sequence: backward of (CE_mean(q) + coef·aux_q) / G each;
            # loss is the CE part (mean over the G·S targets), aux the G per-sequence aux losses.
            loss, aux = generate.moe_loss_backward(model, batch, coef)
            auxs.append(aux.mean().item())
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), OPTIM["grad_clip"])
        assert norm.item() > OPTIM["grad_clip"], f"[{label}] step {s}: norm {norm.item()} does not clip"
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        losses.append(loss.item())
        norms.append(norm.item())
        extra = f"  aux {auxs[-1]:.12f}" if auxs else ""
        print(f"[{label}] step {s}: loss {loss.item():.12f}{extra}  grad_norm {norm.item():.9f}  lr {lrs[-1]:.6e}")
    return losses, norms, lrs, auxs


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moe", action="store_true",
                    help="the MixtralForCausalLM variant (default out: data/loop_moe)")
    ap.add_argument("--out", help="output folder (default data/loop, with --moe data/loop_moe)")
    args = ap.parse_args()
    if args.out is None:
        args.out = os.path.join(here, "data", "loop_moe" if args.moe else "loop")

    torch.set_num_threads(1)  # one summation order, independent of the machine's core count
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)

    gen = torch.Generator().manual_seed(SEED)
    case = dict(vocab_size=VOCAB, tie_word_embeddings=False)
    model = generate.build(case, gen)  # with --moe only to draw the tokens below from the same gen
    coef = None
    if args.moe:
        case = MOE_CASE
        coef = case["router_aux_loss_coef"]
        model = generate.build(case, torch.Generator().manual_seed(MOE_SEED))
    generate.save_model(model, args.out)
    if args.moe:
        generate.check_saved_names(model, case["arch"], args.out)  # legacy per-expert names
    initial = copy.deepcopy(model)

    n_samples = STEPS * GLOBAL_BATCH
    n_tokens = n_samples * SEQ + 1
    tokens = markov_tokens(n_tokens, gen)
    write_bin(os.path.join(args.out, "tokens.bin"), tokens)
    samples = torch.stack([tokens[k * SEQ : k * SEQ + SEQ + 1] for k in range(n_samples)])

    if args.moe:
        # transformers' own loss (CE + coef · out.aux_loss) per sequence of the first batch.
        generate.check_hf_moe_loss(model, samples[:GLOBAL_BATCH], coef, "f32")
        generate.TOPK_MARGIN["min"] = math.inf  # tracked over every training forward, f32 and f64
    losses, norms, lrs, auxs = train(model, samples, "f32", coef)
    m64 = initial.double()
    with generate.pure_f64():
        if args.moe:
            generate.check_hf_moe_loss(m64, samples[:GLOBAL_BATCH], coef, "f64")
        losses64, norms64, lrs64, auxs64 = train(m64, samples, "f64", coef)
    assert lrs64 == lrs
    # Step 0 starts from the same weights: f32 and f64 may differ by rounding only.
    assert abs(losses64[0] - losses[0]) < 1e-5 * losses64[0], "pure_f64() broke the model"
    if args.moe:
        assert abs(auxs64[0] - auxs[0]) < 1e-5 * auxs64[0], "pure_f64() broke the router"

    meta = dict(
        generator=("tests/reference/generate_loop.py" + (" --moe" if args.moe else "")
                   + " (model construction from tests/reference/generate.py)"),
        date=datetime.date.today().isoformat(),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        safetensors=safetensors.__version__,
        numpy=np.__version__,
        seed=SEED,
        **(dict(model_seed=MOE_SEED) if args.moe else {}),
        device="cpu",
        machine=platform.machine(),
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        attn_implementation="eager",
        **(dict(experts_implementation="eager") if args.moe else {}),
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
    if args.moe:
        meta["moe"] = dict(
            experts=case["num_local_experts"],
            top_k=case["num_experts_per_tok"],
            moe_intermediate_size=case["intermediate_size"],
            norm_topk_prob=True,  # Mixtral always renormalises the top-k gate weights
            router_aux_loss_coef=coef,
            router_jitter_noise=case["router_jitter_noise"],
            micro_batch_sequences=1,
            objective=("CE mean over all G·S targets + router_aux_loss_coef · mean over the G "
                       "sequences of each sequence's own aux loss (out.aux_loss of that sequence alone)"),
            saved_block=generate.SAVED_MOE[case["arch"]][0],
            saved_expert_names=generate.SAVED_MOE[case["arch"]][1],
            min_topk_prob_margin=generate.TOPK_MARGIN["min"],
        )
        # loss stays the cross entropy alone (as metrics.csv's loss); aux_loss the step's mean.
        meta["f32"]["aux_loss"] = auxs
        meta["f64"]["aux_loss"] = auxs64
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    worst = max(abs(a - b) for a, b in zip(losses, losses64))
    print(f"f32 vs f64 (PyTorch): max |Δloss| {worst:.3e}")
    if args.moe:
        worst_aux = max(abs(a - b) for a, b in zip(auxs, auxs64))
        worst_norm = max(abs(a - b) / b for a, b in zip(norms, norms64))
        print(f"f32 vs f64 (PyTorch): max |Δaux| {worst_aux:.3e}, max rel Δgrad_norm {worst_norm:.3e}, "
              f"min top-k margin {generate.TOPK_MARGIN['min']:.3e}")
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out} ({total / 1e3:.0f} KB)")


if __name__ == "__main__":
    sys.exit(main())
