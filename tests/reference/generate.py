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

Mixture of experts: ``mixtral`` is a ``MixtralForCausalLM`` and ``qwen3_moe`` a
``Qwen3MoeForCausalLM`` of the same shape (vocab 100, untied, eager attention, experts
implementation "eager"), every layer's MLP replaced by 8 experts of FFN width 48 with top-2
routing and ``router_aux_loss_coef`` 0.1. Mixtral renormalises the two gate weights to sum 1
(always); Qwen3-MoE here does not (``norm_topk_prob=False``) and has Qwen3's attention
(``head_dim`` 24, q/k norm). Their objective is not the dense one: it is ndtrain's MoE loss with
one sequence per micro-batch, ``(l_0 + l_1) / 2`` with ``l_q = CE_mean(seq q) + 0.1 * aux_q``,
``aux_q`` transformers' ``load_balancing_loss_func`` on that sequence alone (its router logits of
both layers; ``out.aux_loss`` of a batch of one: the raw value, not times the coefficient),
computed as gradient accumulation (backward of ``l_q / 2`` per sequence). ``loss`` and
``train_losses`` hold the CE part (mean over the 32 targets) only; the extra keys are
``aux_loss`` [2] (each sequence's aux of the one-batch forward), ``train_aux_losses`` [5] (each
step's mean over its 2 sequences, before the update), ``f64.aux_loss`` and
``f64.train_aux_losses``. ``logits`` stay those of the 2-sequence batch. ``check_hf_moe_loss()``
asserts, per sequence, that ``out.aux_loss`` is the raw balancing loss recomputed from
``out.router_logits``, that ``model(labels=input_ids).loss`` (transformers shifts internally:
15 targets) is CE over those 15 + 0.1 * aux, and that ``shift_labels=tokens[1:]`` gives exactly
``l_q``. Weight decay applies to every tensor with ndim >= 2 (the fused experts too), so an
expert that no token picked still moves (decay, and Adam's moments once it had a gradient).

transformers 5 holds the experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2F, D],
``mlp.experts.down_proj`` [E, D, F], router ``mlp.gate.weight`` [E, D]); ``save_pretrained``
writes legacy per-expert names, which ndtrain reads, so every ``grad.*``, ``final.*``,
``f64.grad_stats.*`` and ``f64.final_delta_stats.*`` key uses those names with per-expert
[out, in] tensors. Verified by ``check_saved_names()`` (written file == split in-memory tensors,
bit for bit, and each expert's forward == ``down(silu(gate x) * up x)`` of the written tensors):

* Mixtral: ``gate_up_proj[j][:F]`` -> ``model.layers.L.block_sparse_moe.experts.j.w1.weight``
  (gate), ``gate_up_proj[j][F:]`` -> ``...experts.j.w3.weight`` (up), ``down_proj[j]`` ->
  ``...experts.j.w2.weight`` (down), ``mlp.gate.weight`` -> ``...block_sparse_moe.gate.weight``;
* Qwen3-MoE: ``gate_up_proj[j][:F]`` -> ``model.layers.L.mlp.experts.j.gate_proj.weight``,
  ``[F:]`` -> ``...up_proj.weight``, ``down_proj[j]`` -> ``...down_proj.weight``, router
  ``model.layers.L.mlp.gate.weight`` (unchanged).

Both MoE cases store every ``final.*`` tensor (2.30 and 2.45 MB a folder). ``pure_f64()`` also
keeps the MoE router's softmax/top-k/gate weights and ``load_balancing_loss_func`` (patched in
the modelling modules, whose ForCausalLM calls it) in f64; ``meta.json`` records per MoE case a
``moe`` block (experts, top_k, FFN width, norm_topk_prob, head_dim, coefficient,
``micro_batch_sequences: 1``, the saved names and the smallest gap between a token's 2nd and 3rd
router probability over all forwards, i.e. how far the reference is from a routing tie).

``<out>/meta.json`` records versions, date, seed and every hyper-parameter; the Rust test reads
the optimiser settings from it, so they live in one place.

Run from the repository root (takes a few seconds):

    /opt/refvenv/bin/python tests/reference/generate.py            # writes tests/reference/data
    /opt/refvenv/bin/python tests/reference/generate.py --case qwen3
    /opt/refvenv/bin/python tests/reference/generate.py --case mixtral --case qwen3_moe
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
import re
import sys

import torch
import torch.nn.functional as F
import transformers
import safetensors
from safetensors.torch import save_file, load_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

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
    # Mixture of experts (see the module docstring): 8 experts of FFN width 48, top-2, in every
    # layer. Mixtral renormalises the top-2 gate weights (always; it has no switch).
    "mixtral": dict(
        arch="mixtral", vocab_size=100, tie_word_embeddings=False, intermediate_size=48,
        num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.1,
        output_router_logits=True, router_jitter_noise=0.0,
    ),
    # Qwen3-MoE: Qwen3's attention (head_dim 24, q/k norm) and un-renormalised top-2 gate weights.
    "qwen3_moe": dict(
        arch="qwen3_moe", vocab_size=100, tie_word_embeddings=False, head_dim=24,
        moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.1,
        output_router_logits=True,
    ),
}
MOE_ARCHS = ("mixtral", "qwen3_moe")
# final.* kept per case where not every tensor (size budget; the f64 fingerprints cover all).
FINAL_TENSORS = {}
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
    arch = case.pop("arch", "llama")
    if arch == "qwen3":
        model_kwargs = {k: v for k, v in MODEL.items() if k != "mlp_bias"}  # Qwen3 has no MLP bias key
        cfg = Qwen3Config(**model_kwargs, **case, use_sliding_window=False, attn_implementation="eager")
        model = Qwen3ForCausalLM(cfg).to(torch.float32)
    elif arch == "mixtral":
        # No bias keys in Mixtral; the case's intermediate_size (one expert's width) replaces 160.
        skip = ("intermediate_size", "attention_bias", "mlp_bias")
        model_kwargs = {k: v for k, v in MODEL.items() if k not in skip}
        cfg = MixtralConfig(**model_kwargs, **case, sliding_window=None, attn_implementation="eager",
                            experts_implementation="eager")
        model = MixtralForCausalLM(cfg).to(torch.float32)
    elif arch == "qwen3_moe":
        # intermediate_size (the dense MLP of mlp_only_layers) is unused: every layer is MoE.
        skip = ("intermediate_size", "mlp_bias")
        model_kwargs = {k: v for k, v in MODEL.items() if k not in skip}
        cfg = Qwen3MoeConfig(**model_kwargs, **case, use_sliding_window=False, attn_implementation="eager",
                             experts_implementation="eager")
        model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    else:
        cfg = LlamaConfig(**MODEL, **case, attn_implementation="eager")
        model = LlamaForCausalLM(cfg).to(torch.float32)
    model.eval()  # no dropout (attention_dropout is 0.0 anyway)
    with torch.no_grad():
        for _, p in model.named_parameters():  # tied lm_head appears once, as embed_tokens
            if p.ndim >= 2:  # MoE experts are fused [E, out, in] tensors in memory: matrices too
                p.copy_(torch.randn(p.shape, generator=gen) * WEIGHT_STD)
            else:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * NORM_STD)
    return model


def mean_loss(model: LlamaForCausalLM, tokens: torch.Tensor):
    logits = model(input_ids=tokens[:, :-1]).logits  # [B, S, V]
    v = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, v), tokens[:, 1:].reshape(-1))  # mean over B*S
    return logits, loss


def moe_loss_backward(model, tokens: torch.Tensor, coef: float):
    """The MoE objective's forward + backward (see the module docstring), as gradient accumulation.

    Each sequence q is its own micro-batch of one: l_q = CE_mean(q) + coef * aux(q), with aux(q)
    transformers' load_balancing_loss_func over that sequence's router logits of all layers
    (``out.aux_loss``); backward of l_q / B accumulates into .grad, so the gradient is that of
    (l_0 + ... + l_{B-1}) / B. Returns (CE part: mean over all B*S targets, aux [B]).
    """
    b, v = tokens.shape[0], model.config.vocab_size
    ces, auxs = [], []
    for q in range(b):
        out = model(input_ids=tokens[q : q + 1, :-1])
        ce = F.cross_entropy(out.logits.reshape(-1, v), tokens[q, 1:])
        ((ce + coef * out.aux_loss) / b).backward()
        ces.append(ce.detach())
        auxs.append(out.aux_loss.detach())
        track_topk_margin(out.router_logits, model.config.num_experts_per_tok)
    return torch.stack(ces).mean(), torch.stack(auxs)


# Smallest gap, over every token of every MoE forward made so far in this process (f32 and f64),
# between a token's k-th and (k+1)-th router probability: how far the reference is from a tie.
TOPK_MARGIN = {"min": math.inf}


def track_topk_margin(router_logits, k: int) -> None:
    for g in router_logits:
        p = torch.softmax(g.detach().double(), dim=-1).sort(dim=-1, descending=True).values
        TOPK_MARGIN["min"] = min(TOPK_MARGIN["min"], (p[:, k - 1] - p[:, k]).min().item())


def train(model: LlamaForCausalLM, train_tokens: torch.Tensor, label: str, coef: float | None = None):
    """STEPS AdamW steps on train_tokens[s]; returns each step's loss, pre-clip norm and LR, and
    (MoE objective when coef is set, else empty) each step's aux loss averaged over sequences."""
    # ndim >= 2: every matrix, including the MoE's fused [E, out, in] expert tensors.
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
        opt.zero_grad(set_to_none=True)
        if coef is None:
            _, loss = mean_loss(model, train_tokens[s])
            loss.backward()
        else:
            loss, aux = moe_loss_backward(model, train_tokens[s], coef)
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


def load_balancing_loss_any_dtype(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' load_balancing_loss_func (5.25), accumulating in the router logits' dtype.

    The original sums the per-expert counts and probabilities in f32 (histc on the CPU); this is
    the same computation, in the same order, in the input's dtype (the counts are exact either
    way). Used by pure_f64() only; no attention mask (the reference has no padding).
    """
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    assert attention_mask is None
    dtype = gate_logits[0].dtype
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=dtype)
    router_prob_sum = torch.zeros(num_experts, dtype=dtype)
    total_rows = 0.0
    for layer_gate in gate_logits:
        routing_weights = torch.nn.functional.softmax(layer_gate, dim=-1)
        _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
        counts = F.one_hot(selected_experts.reshape(-1), num_experts).sum(dim=0).to(dtype)
        tokens_per_expert_sum = tokens_per_expert_sum + counts
        router_prob_sum = router_prob_sum + routing_weights.sum(dim=0)
        total_rows = total_rows + routing_weights.shape[0]
    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


@contextlib.contextmanager
def pure_f64():
    """Lets a .double() Llama, Qwen3, Mixtral or Qwen3-MoE ForCausalLM compute everything in f64.

    transformers computes RMSNorm, the attention softmax and the RoPE angles in f32 whatever
    the model's dtype (right for bf16 training, but it caps a f64 model at f32 precision). Inside
    this block those three compute in the input's dtype instead; for an f32 model nothing
    changes. RoPE keeps inv_freq rounded to f32 (as transformers, and ndtrain, compute it).
    For the MoE families also the router (softmax, top-k and gate weights: f32 in transformers)
    and load_balancing_loss_func (f32 accumulators) keep the input's dtype.
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

    def router(self, hidden_states):
        # MixtralTopKRouter / Qwen3MoeTopKRouter.forward with softmax in the input's dtype
        # (transformers: softmax(logits.float()), resp. softmax(..., dtype=torch.float)).
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = torch.nn.functional.softmax(router_logits, dim=-1)
        top_value, top_index = torch.topk(router_probs, self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):  # Mixtral has no switch: it always renormalises
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return router_logits, top_value, top_index

    families = [
        (modeling_llama, "Llama"),
        (modeling_qwen3, "Qwen3"),
        (modeling_mixtral, "Mixtral"),
        (modeling_qwen3_moe, "Qwen3Moe"),
    ]
    saved = []
    for m, prefix in families:
        norm, rope = getattr(m, prefix + "RMSNorm"), getattr(m, prefix + "RotaryEmbedding")
        saved.append((m, norm, rope, norm.forward, rope.forward, m.eager_attention_forward))
        norm.forward, rope.forward, m.eager_attention_forward = rmsnorm, rotary, attention_of(m)
    moe_saved = []
    for m, prefix in [(modeling_mixtral, "Mixtral"), (modeling_qwen3_moe, "Qwen3Moe")]:
        top_k_router = getattr(m, prefix + "TopKRouter")
        moe_saved.append((m, top_k_router, top_k_router.forward, m.load_balancing_loss_func))
        top_k_router.forward = router
        # The ForCausalLM forward looks the function up in its module's globals at call time.
        m.load_balancing_loss_func = load_balancing_loss_any_dtype
    try:
        yield
    finally:
        for m, norm, rope, norm_fwd, rope_fwd, attention in saved:
            norm.forward, rope.forward, m.eager_attention_forward = norm_fwd, rope_fwd, attention
        for m, top_k_router, router_fwd, lb_loss in moe_saved:
            top_k_router.forward, m.load_balancing_loss_func = router_fwd, lb_loss


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


# transformers 5 holds each MoE layer's experts fused (mlp.experts.gate_up_proj [E, 2F, D], whose
# expert j is cat(gate_j, up_j) along dim 0, and mlp.experts.down_proj [E, D, F]) and the router as
# mlp.gate.weight [E, D]; save_pretrained writes the legacy per-expert names below, which is what
# ndtrain reads. check_saved_names() verifies this mapping against the written file.
SAVED_MOE = {
    # arch: (block, {role: per-expert name}); gate is silu'd, times up, then down.
    "mixtral": ("block_sparse_moe", dict(gate="w1", up="w3", down="w2")),
    "qwen3_moe": ("mlp", dict(gate="gate_proj", up="up_proj", down="down_proj")),
}


def saved_named(arch: str, named):
    """(in-memory name, tensor) pairs -> (save_pretrained name, tensor), splitting fused experts."""
    for n, t in named:
        m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)", n)
        if arch not in SAVED_MOE or m is None:
            yield n, t
            continue
        layer, what = m.groups()
        block, role = SAVED_MOE[arch]
        if what == "gate.weight":
            yield f"{layer}.{block}.gate.weight", t
        elif what == "experts.gate_up_proj":
            f = t.shape[1] // 2
            for j in range(t.shape[0]):
                yield f"{layer}.{block}.experts.{j}.{role['gate']}.weight", t[j, :f]
                yield f"{layer}.{block}.experts.{j}.{role['up']}.weight", t[j, f:]
        else:
            for j in range(t.shape[0]):
                yield f"{layer}.{block}.experts.{j}.{role['down']}.weight", t[j]


def check_saved_names(model, arch: str, path: str) -> None:
    """The written model.safetensors holds exactly saved_named() of the in-memory parameters, and
    the per-expert gate/up/down roles are what the experts' forward computes."""
    written = load_file(os.path.join(path, "model.safetensors"))
    mine = {n: t.detach() for n, t in saved_named(arch, model.named_parameters())}
    assert set(written) == set(mine), sorted(set(written) ^ set(mine))
    for n, t in mine.items():
        assert torch.equal(written[n], t), f"{n}: written tensor differs from the split in-memory one"
    block, role = SAVED_MOE[arch]
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for layer in range(model.config.num_hidden_layers):
        experts = model.model.layers[layer].mlp.experts
        for j in range(experts.num_experts):
            with torch.no_grad():
                got = experts(x, torch.full((5, 1), j), torch.ones(5, 1))
            w = {r: written[f"model.layers.{layer}.{block}.experts.{j}.{nm}.weight"] for r, nm in role.items()}
            want = F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"])
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"layer {layer} expert {j}: roles differ"
    print(f"[{arch}] saved names verified: {len(written)} tensors, roles {role}")


def check_hf_moe_loss(model, tokens: torch.Tensor, coef: float, label: str) -> None:
    """moe_loss_backward's per-sequence terms are what transformers' ForCausalLM returns."""
    cfg = model.config
    e, k, v = cfg.num_local_experts if hasattr(cfg, "num_local_experts") else cfg.num_experts, cfg.num_experts_per_tok, cfg.vocab_size
    assert model.router_aux_loss_coef == coef
    tol = dict(rtol=1e-12, atol=0) if model.dtype == torch.float64 else dict(rtol=1e-6, atol=0)
    tol_hf = dict(rtol=1e-6, atol=0)  # transformers' loss_function computes the CE in f32 (logits.float())
    with torch.no_grad():
        for q in range(tokens.shape[0]):
            x, targets = tokens[q : q + 1, :-1], tokens[q, 1:]
            out = model(input_ids=x)  # labels=None
            assert out.loss is None and len(out.router_logits) == cfg.num_hidden_layers
            assert out.aux_loss.dtype == model.dtype, (out.aux_loss.dtype, model.dtype)
            # out.aux_loss is the raw load-balancing loss (not times coef): E * sum_e f_e * P_e,
            # f_e = fraction of (token, layer) top-k slots on e, P_e = mean router probability of e.
            probs = torch.cat([torch.softmax(g, dim=-1) for g in out.router_logits])  # [L*S, E]
            top = torch.topk(probs, k, dim=-1).indices
            f = F.one_hot(top.reshape(-1), e).sum(0).to(probs.dtype) / probs.shape[0]
            raw = e * (f * probs.mean(0)).sum()
            assert torch.allclose(out.aux_loss, raw, **tol), (out.aux_loss.item(), raw.item())
            ce = F.cross_entropy(out.logits.reshape(-1, v), targets)
            # labels=input_ids: transformers shifts internally, so it scores logits[:15] against
            # tokens[1:16] (the 16th position has no label): our explicit shift, one target short.
            with_labels = model(input_ids=x, labels=x)
            ce15 = F.cross_entropy(out.logits[0, :-1], targets[:-1])
            assert torch.allclose(with_labels.loss.to(ce.dtype), ce15 + coef * out.aux_loss, **tol_hf)
            # shift_labels (no internal shift) scores all 16: exactly l_q of moe_loss_backward.
            with_shift = model(input_ids=x, labels=x, shift_labels=targets[None])
            assert torch.allclose(with_shift.loss.to(ce.dtype), ce + coef * out.aux_loss, **tol_hf), (
                with_shift.loss.item(), (ce + coef * out.aux_loss).item())
    print(f"[{label}] transformers' loss = CE + {coef} * aux_loss per sequence: verified")


def run_case(name: str, case: dict, out: str, meta: dict) -> None:
    gen = torch.Generator().manual_seed(SEED + CASE_SEED_OFFSET[name])
    model = build(case, gen)
    TOPK_MARGIN["min"] = math.inf  # this case's MoE forwards only
    v = case["vocab_size"]
    arch = case.get("arch", "llama")
    moe = arch in MOE_ARCHS
    coef = case["router_aux_loss_coef"] if moe else None
    path = os.path.join(out, name)
    os.makedirs(path, exist_ok=True)
    save_model(model, path)
    if moe:
        check_saved_names(model, arch, path)

    def named(m, what=lambda p: p):  # parameters (or their .grad) under the saved names
        return saved_named(arch, ((n, what(p)) for n, p in m.named_parameters()))

    ref = {}
    tokens = torch.randint(0, v, (BATCH, SEQ + 1), generator=gen, dtype=torch.int64)
    train_tokens = torch.randint(0, v, (STEPS, BATCH, SEQ + 1), generator=gen, dtype=torch.int64)
    ref["tokens"] = tokens
    ref["train_tokens"] = train_tokens

    initial = copy.deepcopy(model)  # for the f64 run (deepcopy keeps a tied lm_head tied)

    # Forward + backward of one batch.
    names = [n for n, _ in model.named_parameters()]
    model.zero_grad(set_to_none=True)
    if moe:
        check_hf_moe_loss(model, tokens, coef, name)
        with torch.no_grad():
            logits, batch_ce = mean_loss(model, tokens)  # logits (and CE) of the 2-sequence batch
        loss, aux = moe_loss_backward(model, tokens, coef)
        assert abs(loss.item() - batch_ce.item()) < 1e-5 * batch_ce.item(), (loss.item(), batch_ce.item())
        ref["aux_loss"] = aux.clone()
    else:
        logits, loss = mean_loss(model, tokens)
        loss.backward()
    ref["logits"] = logits.detach().clone()
    ref["loss"] = loss.detach().clone()
    for n, g in named(model, lambda p: p.grad):
        ref[f"grad.{n}"] = g.detach().clone()
    extra = f"  aux {ref['aux_loss'].tolist()}" if moe else ""
    print(f"[{name}] loss {loss.item():.9f}{extra}  params {names[0]} .. {names[-1]} ({len(names)})")

    # Five optimiser steps: zero_grad, forward, loss, backward, clip, step, scheduler step.
    losses, norms, lrs, auxs = train(model, train_tokens, name, coef)
    ref["train_losses"] = torch.tensor(losses, dtype=torch.float32)
    if moe:
        ref["train_aux_losses"] = torch.tensor(auxs, dtype=torch.float32)
    ref["train_grad_norms"] = torch.tensor(norms, dtype=torch.float32)
    ref["train_lrs"] = torch.tensor(lrs, dtype=torch.float64)
    final_tensors = case_final_tensors(name, case)
    for n, p in named(model):
        if final_tensors != "all" and not any(re.fullmatch(pat, n) for pat in final_tensors):
            continue  # size budget: see the module docstring
        ref[f"final.{n}"] = p.detach().clone()

    # The same in f64 (same initial f32 values, same tokens), summarised per tensor: with no f32
    # rounding the trajectory is reproducible to ~1e-14, which pins the optimiser's semantics
    # far more tightly than the f32 run can (see README.md).
    m64 = initial.double()
    w0 = {n: p.detach().clone() for n, p in named(m64)}
    with pure_f64():
        m64.zero_grad(set_to_none=True)
        if moe:
            check_hf_moe_loss(m64, tokens, coef, name + " f64")
            loss64, aux64 = moe_loss_backward(m64, tokens, coef)
            ref["f64.aux_loss"] = aux64.clone()
        else:
            _, loss64 = mean_loss(m64, tokens)
            loss64.backward()
        ref["f64.loss"] = loss64.detach().clone()
        for n, g in named(m64, lambda p: p.grad):
            ref[f"f64.grad_stats.{n}"] = stats(g, w0[n])
        print(f"[{name}] f64: loss {loss64.item():.15f} (f32 {ref['loss'].item():.9f})")
        rel = abs(loss64.item() - ref["loss"].item()) / loss64.item()
        assert rel < 1e-5, f"[{name}] f64 loss differs from f32 by {rel:.1e}: pure_f64() broke the model"
        if moe:
            assert aux64.dtype == torch.float64
            print(f"[{name}] f64: aux {aux64.tolist()} (f32 {ref['aux_loss'].tolist()})")
            rel = ((aux64 - ref["aux_loss"].double()).abs() / aux64).max().item()
            assert rel < 1e-5, f"[{name}] f64 aux loss differs from f32 by {rel:.1e}: pure_f64() broke the model"
        losses64, norms64, _, auxs64 = train(m64, train_tokens, name + " f64", coef)
    ref["f64.train_losses"] = torch.tensor(losses64, dtype=torch.float64)
    if moe:
        ref["f64.train_aux_losses"] = torch.tensor(auxs64, dtype=torch.float64)
    ref["f64.train_grad_norms"] = torch.tensor(norms64, dtype=torch.float64)
    for n, p in named(m64):
        ref[f"f64.final_delta_stats.{n}"] = stats(p.detach() - w0[n], w0[n])

    ref = {k: t.contiguous() for k, t in ref.items()}
    save_file(ref, os.path.join(path, "reference.safetensors"), metadata=meta_strings(meta, name))
    entry = dict(case)
    if moe:
        cfg = model.config
        entry["moe"] = dict(
            experts=case.get("num_local_experts", case.get("num_experts")),
            top_k=case["num_experts_per_tok"],
            moe_intermediate_size=case.get("moe_intermediate_size", case.get("intermediate_size")),
            norm_topk_prob=case.get("norm_topk_prob", True),  # Mixtral: always
            head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads,
            qk_norm=arch == "qwen3_moe",
            router_aux_loss_coef=coef,
            micro_batch_sequences=1,
            objective="mean over sequences of (CE_mean(seq) + router_aux_loss_coef * aux(seq))",
            saved_expert_names=SAVED_MOE[arch][1],
            saved_block=SAVED_MOE[arch][0],
            min_topk_prob_margin=TOPK_MARGIN["min"],
        )
    meta["cases"][name] = dict(
        entry,
        loss=ref["loss"].item(),
        **(dict(aux_loss=ref["aux_loss"].tolist()) if moe else {}),
        train_losses=losses,
        **(dict(train_aux_losses=auxs) if moe else {}),
        train_grad_norms=norms,
        train_lrs=lrs,
        f64_loss=loss64.item(),
        **(dict(f64_aux_loss=ref["f64.aux_loss"].tolist()) if moe else {}),
        f64_train_losses=losses64,
        **(dict(f64_train_aux_losses=auxs64) if moe else {}),
        f64_train_grad_norms=norms64,
        final_tensors=final_tensors,
        made_with={k: meta[k] for k in ("date", "torch", "transformers", "safetensors", "python")},
    )


def case_final_tensors(name: str, case: dict):
    """Which final.* tensors a case stores: "all", or a list of full-match name patterns."""
    if case["tie_word_embeddings"]:
        return ["model.embed_tokens.weight"]
    return FINAL_TENSORS.get(name, "all")


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
