#!/usr/bin/env python3
"""Generates the Hugging Face reference state that `tests/reference.rs` checks ndtrain against.

For each case (``untied``: vocab 100; ``tied``: vocab 96 with ``tie_word_embeddings``) it builds a
small ``LlamaForCausalLM`` (hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 160), seeded,
on the CPU in f32 with eager attention; the ``qwen3`` case is the same shape as a
``Qwen3ForCausalLM`` (vocab 100, untied) with ``head_dim`` 24 (not hidden / heads = 16) and
Qwen3's per-head q/k RMSNorm. Each case writes under ``<out>/<case>/``:

* ``config.json`` + ``model.safetensors``: the model, via ``save_pretrained`` (what
  ``ndtrain::hf::load_params`` reads);
* ``reference.safetensors``: ``tokens`` [2, 17] int64, ``logits`` [2, 16, V] of
  ``model(tokens[:, :16])``, ``loss`` (scalar mean cross entropy over the 32 targets
  ``tokens[:, 1:]``), ``grad.<name>`` (gradient of that mean loss, every parameter);
  then five AdamW steps: ``train_tokens`` [5, 2, 17] (one batch per step), ``train_losses`` [5]
  (each step's loss before its update), ``train_grad_norms`` [5] (global L2 norm before
  clipping), ``train_lrs`` [5] (the LR each step used) and ``final.<name>`` (parameters after the
  five steps).

Then the same, from the same initial values and tokens, with the model in f64 (``.double()``
inside ``pure_f64()``, which stops transformers from computing RMSNorm, the attention softmax
and the RoPE angles in f32), stored as f64 fingerprints to stay small: ``f64.loss``,
``f64.grad_stats.<name>`` ([sum g, sum g^2, sum g*w0] with w0 the initial tensor),
``f64.train_losses`` [5], ``f64.train_grad_norms`` [5] and ``f64.final_delta_stats.<name>``
(the same fingerprint of final - initial). Without f32 rounding the run is reproducible to
~1e-14, so the Rust test can hold ndtrain's maths and optimiser semantics to that; the f32 run
after a few Adam steps only to rounding noise (1e-3 on some parameters, see README.md).

With a tied model ``lm_head.weight`` is the same tensor as ``model.embed_tokens.weight``; only
the latter appears in ``grad.*`` / ``final.*``. To keep the committed data under 2 MB, the tied
case stores ``final.*`` only for ``model.embed_tokens.weight`` (the tensor tying changes: one
AdamW update driven by the summed gradient of both uses); its ``train_losses`` after step 0
still depend on every updated parameter. The untied case stores every ``final.*``.

``<out>/meta.json`` records versions, date, seed and every hyper-parameter; the Rust test reads
the optimiser settings from it, so they live in one place.

Run from the repository root (takes a few seconds):

    /opt/refvenv/bin/python tests/reference/generate.py            # writes tests/reference/data
    /opt/refvenv/bin/python tests/reference/generate.py --case qwen3
        # (re)writes only that case; meta.json keeps the others and records, per case, the
        # versions and date it was made with
    /opt/refvenv/bin/python tests/reference/generate.py --check-load DIR
        # loads a folder written by ndtrain::hf::save_params with from_pretrained and prints
        # its logits on the untied case's tokens next to the reference (manual interop check).
"""

import argparse
import contextlib
import copy
import datetime
import inspect
import json
import math
import os
import platform
import sys

import torch
import torch.nn.functional as F
import transformers
import safetensors
from safetensors.torch import save_file, load_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

SEED = 20240601
BATCH = 2
SEQ = 16
STEPS = 5
# Initial weights: N(0, WEIGHT_STD) for every matrix, 1 + N(0, NORM_STD) for norm weights. Larger
# than Llama's 0.02 and not all-ones so that attention, the softmax and the norm weights all
# carry signal (with 0.02 the model is nearly uniform and the test would be weak).
WEIGHT_STD = 0.1
NORM_STD = 0.1

MODEL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=160,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
)
CASES = {
    "untied": dict(vocab_size=100, tie_word_embeddings=False),
    "tied": dict(vocab_size=96, tie_word_embeddings=True),
    # Qwen3's attention: a head width apart from hidden / heads, and q/k normed per head.
    "qwen3": dict(arch="qwen3", vocab_size=100, tie_word_embeddings=False, head_dim=24),
}
# Each case's generator seed is SEED + its position here (the first two as they always were).
CASE_SEED_OFFSET = {name: i for i, name in enumerate(CASES)}
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
    # Small enough that clipping is active in every step of both cases (asserted below; the
    # pre-clip norms are printed and stored as train_grad_norms).
    grad_clip=0.5,
)


def lr_lambda(s: int) -> float:
    """docs/model.md's schedule for 0-based step s, as a multiplier of the peak LR (for LambdaLR)."""
    lr, min_lr, warmup, steps = OPTIM["lr"], OPTIM["min_lr"], OPTIM["warmup_steps"], OPTIM["steps"]
    if s < warmup:
        return (s + 1) / warmup
    p = (s - warmup) / max(1, steps - warmup)
    return (min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * p))) / lr


def build(case: dict, gen: torch.Generator) -> torch.nn.Module:
    case = dict(case)
    if case.pop("arch", "llama") == "qwen3":
        model_kwargs = {k: v for k, v in MODEL.items() if k != "mlp_bias"}  # Qwen3 has no MLP bias key
        cfg = Qwen3Config(**model_kwargs, **case, use_sliding_window=False, attn_implementation="eager")
        model = Qwen3ForCausalLM(cfg).to(torch.float32)
    else:
        cfg = LlamaConfig(**MODEL, **case, attn_implementation="eager")
        model = LlamaForCausalLM(cfg).to(torch.float32)
    model.eval()  # no dropout (attention_dropout is 0.0 anyway)
    with torch.no_grad():
        for _, p in model.named_parameters():  # tied lm_head appears once, as embed_tokens
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * WEIGHT_STD)
            else:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * NORM_STD)
    return model


def mean_loss(model: LlamaForCausalLM, tokens: torch.Tensor):
    logits = model(input_ids=tokens[:, :-1]).logits  # [B, S, V]
    v = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, v), tokens[:, 1:].reshape(-1))  # mean over B*S
    return logits, loss


def train(model: LlamaForCausalLM, train_tokens: torch.Tensor, label: str):
    """STEPS AdamW steps on train_tokens[s]; returns each step's loss, pre-clip norm and LR."""
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
        opt.zero_grad(set_to_none=True)
        _, loss = mean_loss(model, train_tokens[s])
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


@contextlib.contextmanager
def pure_f64():
    """Lets a .double() LlamaForCausalLM or Qwen3ForCausalLM compute everything in f64.

    transformers computes RMSNorm, the attention softmax and the RoPE angles in f32 whatever
    the model's dtype (right for bf16 training, but it caps a f64 model at f32 precision). Inside
    this block those three compute in the input's dtype instead; for an f32 model nothing
    changes. RoPE keeps inv_freq rounded to f32 (as transformers, and ndtrain, compute it).
    """
    def rmsnorm(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    def rotary(self, x, position_ids):
        assert self.rope_type == "default" and self.attention_scaling == 1.0
        freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def attention_of(m):
        def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            k = m.repeat_kv(key, module.num_key_value_groups)
            v = m.repeat_kv(value, module.num_key_value_groups)
            w = torch.matmul(query, k.transpose(2, 3)) * scaling
            if attention_mask is not None:
                w = w + attention_mask
            w = torch.nn.functional.softmax(w, dim=-1)
            return torch.matmul(w, v).transpose(1, 2).contiguous(), w

        return attention

    families = [(modeling_llama, "Llama"), (modeling_qwen3, "Qwen3")]
    saved = []
    for m, prefix in families:
        norm, rope = getattr(m, prefix + "RMSNorm"), getattr(m, prefix + "RotaryEmbedding")
        saved.append((m, norm, rope, norm.forward, rope.forward, m.eager_attention_forward))
        norm.forward, rope.forward, m.eager_attention_forward = rmsnorm, rotary, attention_of(m)
    try:
        yield
    finally:
        for m, norm, rope, norm_fwd, rope_fwd, attention in saved:
            norm.forward, rope.forward, m.eager_attention_forward = norm_fwd, rope_fwd, attention


def stats(x: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
    """[sum x, sum x^2, sum x*w0] in f64: a fingerprint of a tensor that any error changes."""
    x, w0 = x.double(), w0.double()
    return torch.stack([x.sum(), (x * x).sum(), (x * w0).sum()])


def save_model(model: LlamaForCausalLM, path: str) -> None:
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(path, **kwargs)
    assert os.path.exists(os.path.join(path, "model.safetensors")), "expected one safetensors file"


def run_case(name: str, case: dict, out: str, meta: dict) -> None:
    gen = torch.Generator().manual_seed(SEED + CASE_SEED_OFFSET[name])
    model = build(case, gen)
    v = case["vocab_size"]
    path = os.path.join(out, name)
    os.makedirs(path, exist_ok=True)
    save_model(model, path)

    ref = {}
    tokens = torch.randint(0, v, (BATCH, SEQ + 1), generator=gen, dtype=torch.int64)
    train_tokens = torch.randint(0, v, (STEPS, BATCH, SEQ + 1), generator=gen, dtype=torch.int64)
    ref["tokens"] = tokens
    ref["train_tokens"] = train_tokens

    initial = copy.deepcopy(model)  # for the f64 run (deepcopy keeps a tied lm_head tied)

    # Forward + backward of one batch.
    names = [n for n, _ in model.named_parameters()]
    model.zero_grad(set_to_none=True)
    logits, loss = mean_loss(model, tokens)
    loss.backward()
    ref["logits"] = logits.detach().clone()
    ref["loss"] = loss.detach().clone()
    for n, p in model.named_parameters():
        ref[f"grad.{n}"] = p.grad.detach().clone()
    print(f"[{name}] loss {loss.item():.9f}  params {names[0]} .. {names[-1]} ({len(names)})")

    # Five optimiser steps: zero_grad, forward, loss, backward, clip, step, scheduler step.
    losses, norms, lrs = train(model, train_tokens, name)
    ref["train_losses"] = torch.tensor(losses, dtype=torch.float32)
    ref["train_grad_norms"] = torch.tensor(norms, dtype=torch.float32)
    ref["train_lrs"] = torch.tensor(lrs, dtype=torch.float64)
    for n, p in model.named_parameters():
        if case["tie_word_embeddings"] and n != "model.embed_tokens.weight":
            continue  # size budget: see the module docstring
        ref[f"final.{n}"] = p.detach().clone()

    # The same in f64 (same initial f32 values, same tokens), summarised per tensor: with no f32
    # rounding the trajectory is reproducible to ~1e-14, which pins the optimiser's semantics
    # far more tightly than the f32 run can (see README.md).
    m64 = initial.double()
    w0 = {n: p.detach().clone() for n, p in m64.named_parameters()}
    with pure_f64():
        m64.zero_grad(set_to_none=True)
        _, loss64 = mean_loss(m64, tokens)
        loss64.backward()
        ref["f64.loss"] = loss64.detach().clone()
        for n, p in m64.named_parameters():
            ref[f"f64.grad_stats.{n}"] = stats(p.grad, w0[n])
        print(f"[{name}] f64: loss {loss64.item():.15f} (f32 {ref['loss'].item():.9f})")
        rel = abs(loss64.item() - ref["loss"].item()) / loss64.item()
        assert rel < 1e-5, f"[{name}] f64 loss differs from f32 by {rel:.1e}: pure_f64() broke the model"
        losses64, norms64, _ = train(m64, train_tokens, name + " f64")
    ref["f64.train_losses"] = torch.tensor(losses64, dtype=torch.float64)
    ref["f64.train_grad_norms"] = torch.tensor(norms64, dtype=torch.float64)
    for n, p in m64.named_parameters():
        ref[f"f64.final_delta_stats.{n}"] = stats(p.detach() - w0[n], w0[n])

    ref = {k: t.contiguous() for k, t in ref.items()}
    save_file(ref, os.path.join(path, "reference.safetensors"), metadata=meta_strings(meta, name))
    meta["cases"][name] = dict(
        case,
        loss=ref["loss"].item(),
        train_losses=losses,
        train_grad_norms=norms,
        train_lrs=lrs,
        f64_loss=loss64.item(),
        f64_train_losses=losses64,
        f64_train_grad_norms=norms64,
        final_tensors="all" if not case["tie_word_embeddings"] else ["model.embed_tokens.weight"],
        made_with={k: meta[k] for k in ("date", "torch", "transformers", "safetensors", "python")},
    )


def meta_strings(meta: dict, case: str) -> dict:
    keys = ("generator", "date", "python", "torch", "transformers", "safetensors", "seed")
    out = {k: str(meta[k]) for k in keys}
    out["case"] = case
    return out


def check_load(path: str, out: str) -> None:
    """Manual interop check: from_pretrained on a folder written by ndtrain::hf::save_params."""
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    ref = load_file(os.path.join(out, "untied", "reference.safetensors"))
    with torch.no_grad():
        logits, loss = mean_loss(model, ref["tokens"])
    err = (logits - ref["logits"]).abs().max().item()
    want = ref["loss"].item()
    print(f"loaded {path}: loss {loss.item():.9f} (reference {want:.9f}), max |dlogits| {err:.3e}")


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "data"))
    ap.add_argument("--check-load", metavar="DIR", help="from_pretrained a save_params folder")
    ap.add_argument("--case", action="append", choices=list(CASES), help="only these cases (repeatable)")
    args = ap.parse_args()

    torch.set_num_threads(1)  # one summation order, independent of the machine's core count
    torch.use_deterministic_algorithms(True)
    if args.check_load:
        check_load(args.check_load, args.out)
        return

    meta = dict(
        generator="tests/reference/generate.py",
        date=datetime.date.today().isoformat(),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        safetensors=safetensors.__version__,
        seed=SEED,
        device="cpu",
        machine=platform.machine(),
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        dtype="float32",
        attn_implementation="eager",
        torch_threads=1,
        batch=BATCH,
        seq=SEQ,
        init=dict(weight_std=WEIGHT_STD, norm_std=NORM_STD),
        model=MODEL,
        optim=OPTIM,
        cases={},
    )
    os.makedirs(args.out, exist_ok=True)
    meta_path = os.path.join(args.out, "meta.json")
    if args.case:
        # Keep what the other cases were made with; top-level versions stay those of the last
        # full run, each case's own are in its made_with.
        with open(meta_path) as f:
            old = json.load(f)
        for k in ("generator", "date", "python", "torch", "transformers", "safetensors", "machine", "torch_cpu_capability"):
            meta[k] = old.get(k, meta[k])
        meta["cases"] = old["cases"]
        meta_now = dict(meta, date=datetime.date.today().isoformat(), python=platform.python_version(),
                        torch=torch.__version__, transformers=transformers.__version__,
                        safetensors=safetensors.__version__)
    else:
        meta_now = meta
    for name in args.case or list(CASES):
        run_case(name, CASES[name], args.out, meta_now)
        meta["cases"][name] = meta_now["cases"][name]
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    total = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.out) for f in fs
    )
    print(f"wrote {args.out} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    sys.exit(main())
