"""Checks `ndtrain ckpt export` against Hugging Face transformers (run by hand; needs torch and
transformers in a venv, never in CI):

    python tests/reference/check_ckpt_export.py [--ranks 4 --layout parallel.tp=2]

1. writes an HDF5 token file of random ids and trains the tiny model on it for 3 steps on the
   given layout with a checkpoint at the end;
2. `ndtrain ckpt export` turns the checkpoint into a Hugging Face folder;
3. `LlamaForCausalLM.from_pretrained(folder)` computes, in float64, the mean cross entropy of the
   global batch of step 4 (samples 48..63 in sequential order) and its logits;
4. ndtrain resumes the checkpoint for one step: its step-4 loss is computed with the same weights
   on the same samples before the update; the two must agree to float32 rounding.
"""
import argparse, os, subprocess, tempfile, sys
import h5py, numpy as np, torch
from transformers import LlamaForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--ranks", type=int, default=1)
ap.add_argument("--layout", action="append", default=[])
args = ap.parse_args()
repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
nd = os.path.join(repo, "target/release/ndtrain")
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1")
S, G = 64, 16
with tempfile.TemporaryDirectory() as d:
    tokens = np.random.default_rng(0).integers(0, 128, size=100 * S + 1).astype(np.uint16)
    with h5py.File(f"{d}/tokens.h5", "w") as f:
        f["tokens"] = tokens
    common = ["--set", "optim.warmup_steps=2", "--set", 'data.source="hdf5"', "--set", f'data.path="{d}/tokens.h5"', "--set", "run.threads=1"]
    for l in args.layout:
        common += ["--set", l]
    launch = ["mpirun", "--oversubscribe", "-n", str(args.ranks), nd] if args.ranks > 1 else [nd]
    run = lambda *a: subprocess.run(launch + list(a), env=env, check=True, capture_output=True, text=True)
    run("train", f"{repo}/inputs/tiny.toml", *common, "--set", "run.steps=3", "--set", "checkpoint.every=3",
        "--set", f'run.out_dir="{d}/a"')
    ck = f"{d}/a/ckpt/step_00000003.h5"
    subprocess.run([nd, "ckpt", "export", ck, "--hf", f"{d}/hf"], env=env, check=True)
    run("train", f"{repo}/inputs/tiny.toml", *common, "--set", "run.steps=4", "--set", f'checkpoint.resume="{ck}"',
        "--set", f'run.out_dir="{d}/b"')
    nd_loss = float(open(f"{d}/b/metrics.csv").read().splitlines()[-1].split(",")[1])
    model = LlamaForCausalLM.from_pretrained(f"{d}/hf", torch_dtype=torch.float64).eval()
    samples = np.stack([tokens[k * S: k * S + S + 1] for k in range(3 * G, 4 * G)]).astype(np.int64)
    with torch.no_grad():
        x = torch.from_numpy(samples)
        logits = model(x[:, :-1]).logits
        hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item()
    rel = abs(hf_loss - nd_loss) / hf_loss
    print(f"layout {args.ranks} ranks {args.layout}: transformers loss {hf_loss:.9f}, ndtrain loss {nd_loss:.9f}, rel diff {rel:.2e}")
    print(f"logits shape {tuple(logits.shape)}, finite {bool(torch.isfinite(logits).all())}")
    sys.exit(0 if rel < 1e-6 else 1)
