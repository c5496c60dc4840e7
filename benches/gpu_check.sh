#!/usr/bin/env bash
# Every GPU check of docs/gpu.md as one script, for a machine with one NVIDIA GPU or more. Each
# step runs under `timeout` with its own budget (PLAN below, 460 s in all, within 8 minutes), so a
# hang — in NCCL's start-up, say — costs that step, not the machine's time; a step that runs out
# is reported as `timeout`. In order:
#   gpu-check       every backend operation on the GPU against the host, a two-block model's
#                   forward and backward (fp32; bf16 with attention in f32 and with TF32), an
#                   all-reduce over the world (tolerances in src/tools/gpu_check/ops.rs);
#   gpu-check-mesh  4 ranks sharing the GPU, an all-reduce over each group of a 1,2,1,2 mesh,
#                   staged through host memory;
#   tiny            the tiny deck on the GPU against the host, fp32 and bf16 (max |Δloss|);
#   fsdp2 … hsdp2x2 2 or 4 ranks sharing the GPU, collectives staged: FSDP 2, TP 2 with SP, CP 2,
#                   PP 2, HSDP 2 × 2, each against the host's losses on the same layout;
#   nccl            NCCL on one rank, and FSDP over every GPU (up to 4) where there are several;
#   cuda-aware      CUDA-aware MPI on FSDP 2, where the installed Open MPI has it;
#   checkpoint      a checkpoint written on the GPU resumed on the host on FSDP 2;
#   gpu_1b          the 1.2 B-parameter deck inputs/gpu_1b.toml (bf16): s/step, tokens/s, MFU;
#   pytorch         last: the same deck side by side with PyTorch eager (benches/vs_pytorch_gpu.py).
# It ends with one table: check, result, figure. On a machine without a GPU it finds ndtrain,
# prints the plan and stops with exit code 3 and "no GPU" before any check (a dry run; nothing
# is written to benches/results). ndtrain comes from $NDTRAIN, else the bundle
# .gpu_bundle/ndtrain-gpu.tar.xz (benches/gpu_bundle.sh: ndtrain with Open MPI's mpirun and
# parallel HDF5, for a GPU machine without them), else target/release (built here with
# --features cuda when cargo exists). Output goes to $OUT (or benches/results/).
#   benches/gpu_check.sh
# The steps' inline scripts take their values as arguments, expanded there, not here.
# shellcheck disable=SC2016
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
FP32_LOSS_TOL="${FP32_LOSS_TOL:-1e-4}"   # the same f32 maths in another order, over the Adam steps
BF16_LOSS_TOL="${BF16_LOSS_TOL:-2e-2}"   # bf16 operands on both sides; TF32 attention products on the GPU
DEST="${OUT:-benches/results}"
mkdir -p "$DEST"
LOG="$DEST/gpu_check_$(date -u +%Y%m%dT%H%MZ).txt"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

# name:seconds, in the order the steps run; the budgets add up to at most 480 s.
PLAN=(gpu-check:60 gpu-check-mesh:45 tiny:45 fsdp2:24 tp2_sp:24 cp2:24 pp2:24 hsdp2x2:24 nccl:20 cuda-aware:15
      checkpoint:25 gpu_1b:50 pytorch:80)
budget() { local e; for e in "${PLAN[@]}"; do [ "${e%%:*}" = "$1" ] && echo "${e##*:}"; done; }
plan_total() { local e t=0; for e in "${PLAN[@]}"; do t=$((t + ${e##*:})); done; echo "$t"; }

if [ -z "${NDTRAIN:-}" ] && [ -f .gpu_bundle/ndtrain-gpu.tar.xz ]; then
    # shellcheck disable=SC1091 # the bundle's own environment, unpacked just now
    tar -C /tmp -xJf .gpu_bundle/ndtrain-gpu.tar.xz && . /tmp/ndtrain-gpu/env.sh && NDTRAIN="$(command -v ndtrain)"
fi
if [ -z "${NDTRAIN:-}" ]; then
    command -v cargo >/dev/null && cargo build --release --features cuda
    NDTRAIN=target/release/ndtrain
fi
echo "ndtrain: $NDTRAIN"
echo "plan (step: timeout): ${PLAN[*]}; total $(plan_total) s (at most 480 s)"
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "no GPU on this machine (nvidia-smi lists none): every check above needs one; stopping before any (a dry run)."
    echo "Output would go to $DEST."
    exit 3
fi

SUMMARY=$(mktemp)

# The CUDA libraries of a toolkit under /usr/local/cuda or of pip's nvidia-* wheels, first on the
# loader's path: ndtrain opens them at run time by the names their packages install
# (libcublas.so.12, libnvrtc.so.12, libnccl.so.2), so nothing is linked or renamed.
search=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
mapfile -t wheels < <(python3 -c 'import glob, nvidia, os; print("\n".join(sorted({os.path.dirname(f) for p in nvidia.__path__ for f in glob.glob(p + "/**/lib/lib*.so*", recursive=True)})))' 2>/dev/null)
search+=("${wheels[@]}")
LD_LIBRARY_PATH="$(printf '%s:' "${search[@]}")${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH

# step NAME CMD...: runs CMD under the step's budget; its exit status, 124 when it ran out.
step() {
    local name=$1
    shift
    timeout --kill-after=5 "$(budget "$name")" "$@"
}

# record NAME STATUS FIGURE: one row of the summary table.
record() {
    local result=ok
    [ "$2" -eq 124 ] && result=timeout
    [ "$2" -ne 0 ] && [ "$2" -ne 124 ] && result=FAILED
    [ "$2" -eq 200 ] && result="not run"
    printf '| %s | %s | %s |\n' "$1" "$result" "$3" >> "$SUMMARY"
    [ "$result" = ok ] || [ "$result" = "not run" ]
}

compare() {  # compare CPU_DIR GPU_DIR TOL: max |Δloss| of two metrics.csv files, printed; exit 1 beyond TOL
    python3 - "$@" <<'EOF'
import sys
a, b, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
try:
    col = lambda p: [float(r.split(",")[1]) for r in list(open(p + "/metrics.csv"))[1:]]
    x, y = col(a), col(b)
    d = max(abs(p - q) for p, q in zip(x, y)) if len(x) == len(y) and x else float("inf")
except OSError:
    d = float("inf")
print(f"max |Δloss| {d:.2e} (tol {tol:.0e})")
sys.exit(0 if d <= tol else 1)
EOF
}

# layout NAME RANKS SETS...: the tiny deck on the host and on the GPU shared by RANKS ranks,
# collectives staged, compared.
layout() {
    local name=$1 ranks=$2
    shift 2
    step "$name" bash -c '
        set -e
        mpirun --oversubscribe -n "$1" "$2" train "${@:4}" --set run.threads=1 --set "run.out_dir=\"/tmp/gc_cpu_$3\"" >/dev/null
        mpirun --oversubscribe -n "$1" "$2" train "${@:4}" --set run.threads=1 --set "run.device=\"cuda\"" \
            --set "parallel.comm_backend=\"staged\"" --set "run.out_dir=\"/tmp/gc_gpu_$3\"" >/dev/null' \
        _ "$ranks" "$NDTRAIN" "$name" "${tiny[@]}" "$@"
    local s=$?
    record "$name on $ranks ranks, one GPU, staged, vs host" "$s" "$(compare "/tmp/gc_cpu_$name" "/tmp/gc_gpu_$name" "$FP32_LOSS_TOL")"
}

{
    echo "# ndtrain GPU check, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $NDTRAIN"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
    status=0
    tiny=(inputs/tiny.toml --set run.steps=10 --set log.every=10 --set hardware.peak_flops_per_rank=1e12)

    echo "## gpu-check"
    step gpu-check "$NDTRAIN" gpu-check > /tmp/gc_check.txt 2>&1
    s=$?
    cat /tmp/gc_check.txt
    record "gpu-check: every operation, model step, all-reduce" "$s" "$(grep -c ' ok$' /tmp/gc_check.txt) checks ok, $(grep -c 'FAILED$' /tmp/gc_check.txt) failed" || status=1

    echo "## gpu-check --layout 1,2,1,2 on 4 ranks sharing the GPU (staged)"
    step gpu-check-mesh mpirun --oversubscribe -n 4 "$NDTRAIN" gpu-check --layout 1,2,1,2 > /tmp/gc_mesh.txt 2>&1
    s=$?
    tail -n 12 /tmp/gc_mesh.txt
    record "gpu-check --layout 1,2,1,2, 4 ranks on one GPU" "$s" "$(grep -c 'staged all-reduce.*ok$' /tmp/gc_mesh.txt) group all-reduces ok" || status=1

    echo "## the tiny deck: host vs GPU, fp32 and bf16"
    step tiny bash -c '
        set -e
        for p in fp32 bf16; do
            "$1" train "${@:2}" --set "train.precision=\"$p\"" --set "run.out_dir=\"/tmp/gc_cpu_$p\"" >/dev/null
            "$1" train "${@:2}" --set "train.precision=\"$p\"" --set "run.device=\"cuda\"" --set "run.out_dir=\"/tmp/gc_gpu_$p\"" >/dev/null
        done' _ "$NDTRAIN" "${tiny[@]}"
    s=$?
    fp32=$(compare /tmp/gc_cpu_fp32 /tmp/gc_gpu_fp32 "$FP32_LOSS_TOL") || s=1
    bf16=$(compare /tmp/gc_cpu_bf16 /tmp/gc_gpu_bf16 "$BF16_LOSS_TOL") || s=1
    record "tiny deck on the GPU vs host" "$s" "fp32 $fp32; bf16 $bf16" || status=1

    echo "## several ranks on one GPU, collectives staged, against the host"
    layout fsdp2 2 --set parallel.dp_shard=2 || status=1
    layout tp2_sp 2 --set parallel.tp=2 --set parallel.sequence_parallel=true || status=1
    layout cp2 2 --set parallel.cp=2 || status=1
    layout pp2 2 --set parallel.pp=2 --set parallel.dp_shard=1 || status=1
    layout hsdp2x2 4 --set parallel.dp_replicate=2 --set parallel.dp_shard=2 || status=1

    echo "## NCCL: one rank, and FSDP over every GPU (up to 4) where there are several"
    gpus=$(nvidia-smi -L | grep -c '^GPU ')
    n=$((gpus < 4 ? gpus : 4))
    step nccl bash -c '
        set -e
        "$1" train "${@:3}" --set "run.device=\"cuda\"" --set "parallel.comm_backend=\"nccl\"" --set "run.out_dir=\"/tmp/gc_gpu_nccl1\"" >/dev/null
        if [ "$2" -ge 2 ]; then
            mpirun --oversubscribe -n "$2" "$1" train "${@:3}" --set run.threads=1 --set "run.out_dir=\"/tmp/gc_cpu_fsdp$2\"" >/dev/null
            mpirun --oversubscribe -n "$2" "$1" train "${@:3}" --set run.threads=1 --set "run.device=\"cuda\"" \
                --set "parallel.comm_backend=\"nccl\"" --set "run.out_dir=\"/tmp/gc_gpu_nccl$2\"" >/dev/null
        fi' _ "$NDTRAIN" "$n" "${tiny[@]}"
    s=$?
    figure="one rank: $(compare /tmp/gc_cpu_fp32 /tmp/gc_gpu_nccl1 "$FP32_LOSS_TOL")" || s=1
    if [ "$n" -ge 2 ]; then figure="$figure; FSDP $n on $n GPUs: $(compare "/tmp/gc_cpu_fsdp$n" "/tmp/gc_gpu_nccl$n" "$FP32_LOSS_TOL")" || s=1; fi
    record "NCCL vs host" "$s" "$figure" || status=1

    echo "## CUDA-aware MPI, where the installed MPI has it: FSDP 2 on one GPU"
    if ompi_info --parsable --all 2>/dev/null | grep -q 'mpi_built_with_cuda_support:value:true'; then
        step cuda-aware mpirun --oversubscribe -n 2 "$NDTRAIN" train "${tiny[@]}" --set run.threads=1 --set 'run.device="cuda"' \
            --set parallel.dp_shard=2 --set 'parallel.comm_backend="mpi"' --set 'run.out_dir="/tmp/gc_gpu_mpi"' >/dev/null
        s=$?
        record "CUDA-aware MPI, FSDP 2 on one GPU, vs host" "$s" "$(compare /tmp/gc_cpu_fsdp2 /tmp/gc_gpu_mpi "$FP32_LOSS_TOL")" || status=1
    else
        record "CUDA-aware MPI" 200 "this MPI is not built with CUDA support (ompi_info)"
    fi

    echo "## a checkpoint written on the GPU, resumed on the host on FSDP 2"
    step checkpoint bash -c '
        set -e
        "$1" train "${@:2}" --set run.steps=20 --set "run.device=\"cuda\"" --set checkpoint.every=10 --set "run.out_dir=\"/tmp/gc_ckpt_gpu\"" >/dev/null
        mpirun --oversubscribe -n 2 "$1" train "${@:2}" --set run.steps=20 --set run.threads=1 --set parallel.dp_shard=2 \
            --set "checkpoint.resume=\"/tmp/gc_ckpt_gpu/ckpt/step_00000010.h5\"" --set "run.out_dir=\"/tmp/gc_ckpt_cpu\"" >/dev/null' \
        _ "$NDTRAIN" "${tiny[@]}"
    s=$?
    figure=$(python3 - /tmp/gc_ckpt_gpu /tmp/gc_ckpt_cpu "$FP32_LOSS_TOL" <<'PY'
import sys
gpu, cpu, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
try:
    rows = lambda p: {int(r.split(",")[0]): float(r.split(",")[1]) for r in list(open(p + "/metrics.csv"))[1:]}
    g, c = rows(gpu), rows(cpu)
    steps = sorted(set(g) & set(c))
    d = max(abs(g[s] - c[s]) for s in steps) if steps == list(range(11, 21)) else float("inf")
except OSError:
    d = float("inf")
print(f"steps 11-20 after the resume: max |Δloss| {d:.2e} (tol {tol:.0e})")
sys.exit(0 if d <= tol else 1)
PY
) || s=1
    record "GPU checkpoint resumed on the host, FSDP 2" "$s" "$figure" || status=1

    echo "## inputs/gpu_1b.toml on the GPU"
    step gpu_1b "$NDTRAIN" train inputs/gpu_1b.toml --set run.steps=6 --set 'run.out_dir="/tmp/gc_1b"'
    s=$?
    figure=$(python3 -c 'import json; r = json.load(open("/tmp/gc_1b/run.json"))["results"]; print(f"{r[\"mean_step_s\"]:.3f} s/step, {r[\"tokens_per_s\"]:.0f} tokens/s, MFU {100 * r[\"mfu\"]:.1f} %")' 2>/dev/null || echo "no results")
    record "gpu_1b (1.2 B, bf16)" "$s" "$figure" || status=1

    echo "## side by side with PyTorch eager"
    if python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
        PYTHONUNBUFFERED=1 step pytorch python3 benches/vs_pytorch_gpu.py --ndtrain "$NDTRAIN" --rounds 1 --steps 4 --warmup 1 > /tmp/gc_torch.txt 2>&1
        s=$?
        cat /tmp/gc_torch.txt
        record "gpu_1b vs PyTorch eager (bf16)" "$s" "$(grep -m1 -i 'speed-up\|ratio' /tmp/gc_torch.txt || echo 'see the log')" || status=1
    else
        record "gpu_1b vs PyTorch eager" 200 "python3 has no CUDA torch + transformers here"
    fi

    echo "## summary"
    echo "| check | result | figure |"
    echo "|---|---|---|"
    cat "$SUMMARY"
    echo "overall: $([ $status -eq 0 ] && echo ok || echo FAILED)"
    exit $status
} 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
rm -f "$SUMMARY"
echo "saved $LOG"
exit "$status"
