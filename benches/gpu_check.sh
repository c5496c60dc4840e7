#!/usr/bin/env bash
# Every GPU check of docs/gpu.md as one script, for a machine with an NVIDIA GPU (about 8
# minutes on one). It runs, in order:
#   1. `ndtrain gpu-check`: every operation of the backend boundary on the GPU against the host
#      backend, a whole forward + backward of a small model in fp32 and bf16, NCCL (tolerances
#      named in src/tools/gpu_check/ops.rs);
#   2. the tiny deck for 30 steps on the host and on the GPU, fp32 and bf16: the losses within
#      FP32_LOSS_TOL / BF16_LOSS_TOL of the host's (max |Δloss| over the steps);
#   3. 2 and 4 ranks sharing the GPU, collectives staged through host memory (FSDP 2, TP 2 with
#      SP, CP 2, FSDP 2 × TP 2, HSDP 2 × 2 with gradient accumulation), against the host's
#      losses on the same layout within FP32_LOSS_TOL;
#      and NCCL (one communicator per mesh group) on one rank, and on every GPU (up to 4) when
#      the machine has several;
#      and CUDA-aware MPI on FSDP 2 where the installed Open MPI has it;
#   4. a checkpoint written on the GPU (one rank) resumed on the host on FSDP 2: the resumed
#      steps' losses against the GPU run's within FP32_LOSS_TOL;
#   5. the 1.2 B-parameter deck inputs/gpu_1b.toml on the GPU (bf16): s/step, tokens/s, MFU;
#   6. where python3 has torch and transformers, the same deck side by side with PyTorch eager
#      (benches/vs_pytorch_gpu.py).
# On a machine without a GPU it finds ndtrain, says what it would run, and stops with exit
# code 3 and "no GPU" before any check (a dry run; nothing is written to benches/results).
# ndtrain comes from $NDTRAIN, else the bundle .gpu_bundle/ndtrain-gpu.tar.xz (benches/
# gpu_bundle.sh: for a GPU machine without Open MPI and HDF5), else target/release (built here
# with --features cuda when cargo exists). Output goes to $OUT (or benches/results/).
#   benches/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
FP32_LOSS_TOL="${FP32_LOSS_TOL:-1e-4}"   # the same f32 maths in another order, over 30 Adam steps
BF16_LOSS_TOL="${BF16_LOSS_TOL:-2e-2}"   # bf16 operands on both sides; TF32 attention products on the GPU
DEST="${OUT:-benches/results}"
mkdir -p "$DEST"
LOG="$DEST/gpu_check_$(date -u +%Y%m%dT%H%MZ).txt"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_mpi_yield_when_idle=1

if [ -z "${NDTRAIN:-}" ] && [ -f .gpu_bundle/ndtrain-gpu.tar.xz ]; then
    tar -C /tmp -xJf .gpu_bundle/ndtrain-gpu.tar.xz && . /tmp/ndtrain-gpu/env.sh && NDTRAIN="$(command -v ndtrain)"
fi
if [ -z "${NDTRAIN:-}" ]; then
    command -v cargo >/dev/null && cargo build --release --features cuda
    NDTRAIN=target/release/ndtrain
fi
echo "ndtrain: $NDTRAIN"
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "no GPU on this machine (nvidia-smi lists none): every check below needs one; stopping before any (a dry run)."
    echo "It would run: gpu-check; the tiny deck on the GPU vs the host (fp32, bf16); 2 and 4 ranks on one GPU, staged"
    echo "(FSDP 2, TP 2 + SP, CP 2, FSDP 2 x TP 2, HSDP 2 x 2); NCCL on one rank and across GPUs; a GPU checkpoint"
    echo "resumed on the host; inputs/gpu_1b.toml"
    echo "alone and side by side with PyTorch eager. Output would go to $DEST."
    exit 3
fi

# cudarc (built for CUDA 12) opens lib<name>.so or lib<name>.so.12: on a CUDA 13 machine (or
# with NCCL's libnccl.so.2 alone) link the unversioned names to what the machine has.
cuda_names() {
    local dir=/tmp/ndtrain-cuda-libs search=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
    mkdir -p "$dir"
    search+=($(python3 -c 'import glob, nvidia, os; print(" ".join(sorted(set(os.path.dirname(f) for p in nvidia.__path__ for f in glob.glob(p + "/**/lib/lib*.so*", recursive=True)))))' 2>/dev/null))
    search+=($(ldconfig -p 2>/dev/null | awk '/lib(cublas|nvrtc|nccl)/ {print $NF}' | xargs -r -n1 dirname | sort -u))
    for name in cublas cublasLt nvrtc nccl; do
        [ -e "$dir/lib$name.so" ] && continue
        for d in "${search[@]}"; do
            f=$(ls "$d"/lib$name.so* 2>/dev/null | head -1)
            if [ -n "$f" ]; then ln -sf "$(readlink -f "$f")" "$dir/lib$name.so"; break; fi
        done
    done
    export LD_LIBRARY_PATH="$dir:$(printf '%s:' "${search[@]}")${LD_LIBRARY_PATH:-}"
    ls -l "$dir"
}

compare() {  # compare NAME CPU_DIR GPU_DIR TOL: max |Δloss| of two metrics.csv files
    python3 - "$@" <<'EOF'
import sys
name, a, b, tol = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
col = lambda p: [float(r.split(",")[1]) for r in list(open(p + "/metrics.csv"))[1:]]
x, y = col(a), col(b)
d = max(abs(p - q) for p, q in zip(x, y)) if len(x) == len(y) and x else float("inf")
print(f"{name}: {len(y)} steps, first loss {y[0]:.6f} (host {x[0]:.6f}), last {y[-1]:.6f} (host {x[-1]:.6f}), "
      f"max |Δloss| {d:.3e} (tolerance {tol:.0e})  {'ok' if d <= tol else 'FAILED'}")
sys.exit(0 if d <= tol else 1)
EOF
}

{
    echo "# ndtrain GPU check, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $NDTRAIN"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
    status=0
    cuda_names
    echo "## 1. gpu-check"
    "$NDTRAIN" gpu-check || status=1

    echo "## 2. the tiny deck, 30 steps: host vs GPU"
    tiny=(inputs/tiny.toml --set run.steps=30 --set log.every=10 --set hardware.peak_flops_per_rank=1e12)
    for p in fp32 bf16; do
        "$NDTRAIN" train "${tiny[@]}" --set "train.precision=\"$p\"" --set "run.out_dir=\"/tmp/gc_cpu_$p\"" >/dev/null || status=1
        "$NDTRAIN" train "${tiny[@]}" --set "train.precision=\"$p\"" --set 'run.device="cuda"' --set "run.out_dir=\"/tmp/gc_gpu_$p\"" || status=1
    done
    compare "tiny deck fp32, GPU vs host" /tmp/gc_cpu_fp32 /tmp/gc_gpu_fp32 "$FP32_LOSS_TOL" || status=1
    compare "tiny deck bf16, GPU vs host bf16" /tmp/gc_cpu_bf16 /tmp/gc_gpu_bf16 "$BF16_LOSS_TOL" || status=1

    echo "## 3. several ranks on one GPU, collectives staged through host memory, against the host"
    layouts=(
        "fsdp2|2|--set parallel.dp_shard=2"
        "tp2_sp|2|--set parallel.tp=2 --set parallel.sequence_parallel=true"
        "cp2|2|--set parallel.cp=2"
        "fsdp2_tp2|4|--set parallel.dp_shard=2 --set parallel.tp=2"
        "hsdp2x2|4|--set parallel.dp_replicate=2 --set parallel.dp_shard=2"
    )
    for spec in "${layouts[@]}"; do
        IFS='|' read -r name ranks sets <<<"$spec"
        # shellcheck disable=SC2086
        mpirun --oversubscribe -n "$ranks" "$NDTRAIN" train "${tiny[@]}" $sets --set 'run.threads=1' \
            --set "run.out_dir=\"/tmp/gc_cpu_$name\"" >/dev/null || status=1
        # shellcheck disable=SC2086
        mpirun --oversubscribe -n "$ranks" "$NDTRAIN" train "${tiny[@]}" $sets --set 'run.threads=1' --set 'run.device="cuda"' \
            --set 'parallel.comm_backend="staged"' --set "run.out_dir=\"/tmp/gc_gpu_$name\"" >/dev/null || status=1
        compare "$name on $ranks ranks, one GPU, staged, vs host" "/tmp/gc_cpu_$name" "/tmp/gc_gpu_$name" "$FP32_LOSS_TOL" || status=1
    done

    echo "## 3b. NCCL: one rank, and FSDP over every GPU of the machine (up to 4) when there are several"
    "$NDTRAIN" train "${tiny[@]}" --set 'run.device="cuda"' --set 'parallel.comm_backend="nccl"' --set "run.out_dir=\"/tmp/gc_gpu_nccl1\"" >/dev/null || status=1
    compare "NCCL, one rank, vs host" /tmp/gc_cpu_fp32 /tmp/gc_gpu_nccl1 "$FP32_LOSS_TOL" || status=1
    gpus=$(nvidia-smi -L | grep -c '^GPU ')
    if [ "$gpus" -ge 2 ]; then
        n=$((gpus < 4 ? gpus : 4))
        mpirun --oversubscribe -n "$n" "$NDTRAIN" train "${tiny[@]}" --set 'run.threads=1' --set "run.out_dir=\"/tmp/gc_cpu_fsdp$n\"" >/dev/null || status=1
        mpirun --oversubscribe -n "$n" "$NDTRAIN" train "${tiny[@]}" --set 'run.threads=1' --set 'run.device="cuda"' \
            --set 'parallel.comm_backend="nccl"' --set "run.out_dir=\"/tmp/gc_gpu_nccl$n\"" >/dev/null || status=1
        compare "NCCL, FSDP $n on $n GPUs, vs host" "/tmp/gc_cpu_fsdp$n" "/tmp/gc_gpu_nccl$n" "$FP32_LOSS_TOL" || status=1
    else
        echo "one GPU here: NCCL across GPUs not run"
    fi

    echo "## 3c. CUDA-aware MPI, where the installed MPI has it: FSDP 2 on one GPU"
    if ompi_info --parsable --all 2>/dev/null | grep -q 'mpi_built_with_cuda_support:value:true'; then
        mpirun --oversubscribe -n 2 "$NDTRAIN" train "${tiny[@]}" --set 'run.threads=1' --set 'run.device="cuda"' \
            --set parallel.dp_shard=2 --set 'parallel.comm_backend="mpi"' --set "run.out_dir=\"/tmp/gc_gpu_mpi\"" >/dev/null || status=1
        compare "CUDA-aware MPI, FSDP 2 on one GPU, vs host" /tmp/gc_cpu_fsdp2 /tmp/gc_gpu_mpi "$FP32_LOSS_TOL" || status=1
    else
        echo "this MPI is not built with CUDA support (ompi_info): not run"
    fi

    echo "## 4. a checkpoint written on the GPU, resumed on the host on FSDP 2"
    "$NDTRAIN" train "${tiny[@]}" --set 'run.device="cuda"' --set checkpoint.every=15 --set "run.out_dir=\"/tmp/gc_ckpt_gpu\"" >/dev/null || status=1
    mpirun --oversubscribe -n 2 "$NDTRAIN" train "${tiny[@]}" --set 'run.threads=1' --set parallel.dp_shard=2 \
        --set "checkpoint.resume=\"/tmp/gc_ckpt_gpu/ckpt/step_00000015.h5\"" --set "run.out_dir=\"/tmp/gc_ckpt_cpu\"" >/dev/null || status=1
    python3 - /tmp/gc_ckpt_gpu /tmp/gc_ckpt_cpu "$FP32_LOSS_TOL" <<'PY' || status=1
import sys
gpu, cpu, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
rows = lambda p: {int(r.split(",")[0]): float(r.split(",")[1]) for r in list(open(p + "/metrics.csv"))[1:]}
g, c = rows(gpu), rows(cpu)
steps = sorted(set(g) & set(c))
d = max(abs(g[s] - c[s]) for s in steps) if steps == list(range(16, 31)) else float("inf")
print(f"GPU checkpoint of step 15 resumed on the host (FSDP 2): steps {steps[:1]}..{steps[-1:]}, max |Δloss| {d:.3e} "
      f"(tolerance {tol:.0e})  {'ok' if d <= tol else 'FAILED'}")
sys.exit(0 if d <= tol else 1)
PY

    echo "## 5. inputs/gpu_1b.toml on the GPU"
    "$NDTRAIN" train inputs/gpu_1b.toml --set run.steps=8 --set 'run.out_dir="/tmp/gc_1b"' || status=1

    echo "## 6. side by side with PyTorch eager"
    if python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
        PYTHONUNBUFFERED=1 python3 benches/vs_pytorch_gpu.py --ndtrain "$NDTRAIN" --rounds 2 --steps 5 --warmup 2 || status=1
    else
        echo "python3 has no CUDA torch + transformers here: not run"
    fi
    echo "## overall: $([ $status -eq 0 ] && echo ok || echo FAILED)"
    exit $status
} 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
echo "saved $LOG"
exit "$status"
