"""Checks a mixture of experts' checkpoint written under expert parallelism against Hugging Face
transformers (run by hand; needs torch, transformers and h5py in a venv, never in CI):

    python tests/reference/check_moe_export.py [--family mixtral|qwen3_moe] [--ranks 4 --layout parallel.ep=4 ...]

1. trains the tiny deck's attention with 8 experts of width 48, top-2, the auxiliary loss on
   (Qwen3-MoE: q/k norms, no top-k renormalisation) for 3 steps on the given layout, with a
   checkpoint at the end;
2. `ndtrain ckpt export --hf` turns the checkpoint into a Hugging Face folder (Mixtral's or
   Qwen3-MoE's names);
3. `AutoModelForCausalLM.from_pretrained(folder)` loads it: every parameter must equal the
   checkpoint's logical tensor bit for bit (Mixtral's w1/w3/w2 mapped to gate/up/down);
4. in float64, transformers' mean cross entropy of the step-4 batch must equal ndtrain's step-4
   loss (it resumes the checkpoint for one step) to float32 rounding.
"""
import argparse, os, subprocess, tempfile
import h5py, numpy as np, torch
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--family", choices=["mixtral", "qwen3_moe"], default="mixtral")
ap.add_argument("--ranks", type=int, default=4)
ap.add_argument("--layout", action="append", default=[])
args = ap.parse_args()
layout = args.layout or ["parallel.dp_shard=4", "parallel.ep=4"]
repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
nd = os.path.join(repo, "target/release/ndtrain")
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1")
S, G = 64, 16
experts = ["model.n_experts=8", "model.experts_per_token=2", "model.moe_ffn_hidden=48", "model.router_aux_loss_coef=0.05"]
if args.family == "qwen3_moe":
    experts += ["model.qk_norm=true", "model.norm_topk_prob=false"]
with tempfile.TemporaryDirectory() as d:
    tokens = np.random.default_rng(0).integers(0, 128, size=100 * S + 1).astype(np.uint16)
    with h5py.File(f"{d}/tokens.h5", "w") as f:
        f["tokens"] = tokens
    common = ["optim.warmup_steps=2", 'data.source="hdf5"', f'data.path="{d}/tokens.h5"', "run.threads=1"] + experts + layout
    sets = lambda extra: [x for s in common + extra for x in ("--set", s)]
    launch = ["mpirun", "--oversubscribe", "-n", str(args.ranks), nd] if args.ranks > 1 else [nd]
    run = lambda *a: subprocess.run(launch + list(a), env=env, check=True, capture_output=True, text=True)
    run("train", f"{repo}/inputs/tiny.toml", *sets(["run.steps=3", "checkpoint.every=3", f'run.out_dir="{d}/a"']))
    ck = f"{d}/a/ckpt/step_00000003.h5"
    subprocess.run([nd, "ckpt", "export", ck, "--hf", f"{d}/hf"], env=env, check=True, capture_output=True)
    run("train", f"{repo}/inputs/tiny.toml", *sets(["run.steps=4", f'checkpoint.resume="{ck}"', f'run.out_dir="{d}/b"']))
    nd_loss = float(open(f"{d}/b/metrics.csv").read().splitlines()[-1].split(",")[1])

    model = AutoModelForCausalLM.from_pretrained(f"{d}/hf", torch_dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    print(f"loaded {type(model).__name__} from the export of a checkpoint written on {args.ranks} ranks ({' '.join(layout)})")
    # transformers 5 holds a block's experts fused: gate_up_proj [E, 2·Fe, D] (gate rows, then
    # up rows) and down_proj [E, D, Fe]; older versions one module per expert (Mixtral's
    # block_sparse_moe.experts.J.w1/w3/w2).
    mixtral = {"block_sparse_moe.gate": "mlp.gate", "block_sparse_moe.experts": "mlp.experts", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    worst, n = 0.0, 0
    with h5py.File(ck) as f:
        t = lambda name: np.asarray(f["model"][name])
        for name, p in model.state_dict().items():
            ours = name
            for a, b in mixtral.items():
                ours = ours.replace(a, b)
            if ours == "lm_head.weight" and "lm_head.weight" not in f["model"]:
                ours = "model.embed_tokens.weight"
            prefix = ours.rsplit("experts.", 1)[0] + "experts."
            if ours.endswith("experts.gate_up_proj"):
                want = np.stack([np.concatenate([t(f"{prefix}{j}.gate_proj.weight"), t(f"{prefix}{j}.up_proj.weight")]) for j in range(8)])
            elif ours.endswith("experts.down_proj"):
                want = np.stack([t(f"{prefix}{j}.down_proj.weight") for j in range(8)])
            else:
                want = t(ours)
            got = p.detach().numpy()
            assert got.shape == want.shape, (name, got.shape, want.shape)
            worst = max(worst, float(np.abs(got - want).max()))
            n += 1
    print(f"{n} tensors, max |transformers − checkpoint| = {worst:g}")
    assert worst == 0.0, "the exported tensors differ from the checkpoint's"

    model = model.double().eval()
    batch = np.stack([tokens[i * S : i * S + S + 1] for i in range(3 * G, 4 * G)]).astype(np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(batch[:, :-1])).logits
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(batch[:, 1:]).reshape(-1)).item()
    print(f"step-4 loss: ndtrain {nd_loss:.9f}, transformers (f64) {ce:.9f}, |Δ| {abs(nd_loss - ce):.2e}")
    assert abs(nd_loss - ce) < 1e-5
