#!/usr/bin/env bash
# Everything fsdp-compile checks and measures on NVIDIA GPUs, in one command, for whoever has them:
#
#     bash bench/gpu.sh [--quick] [--parts tests,kernels,step,profile] [--no-traces]
#
#   1. pytest -m cuda tests: the four Triton copy kernels bitwise against their torch references on the
#      GPU (fp32/bf16/fp16, every src/dst pair, uneven shards), and the compiled step against eager FSDP2
#      on 1 NCCL rank and, with 8 GPUs, on 8, CUDA graphs and CPU offload (CPUOffloadPolicy(pin_memory=True),
#      test_cpu_offload_bitwise) against eager on 1 (tests/test_cuda.py) -> bench/results/gpu_tests.json
#   2. bench/kernels.py --device cuda: the kernels' GB/s against copy_ and FSDP2's own copy ops
#                                                                       -> bench/results/gpu_kernels.json
#   3. bench/compiled_vs_eager.py on a 0.95B Llama (bf16 mixed precision, 2 x 2048 tokens per rank):
#      step time, peak memory and first-step (compile) time of eager FSDP2, torch.compile, fc, fc with
#      CUDA graphs, the compute-only bound and torchtitan's SimpleFSDP (where torchtitan imports: carry it,
#      with spmd_types, tyro and docstring_parser, on PYTHONPATH), on 1 GPU and, with 8 or more, on 8 (torchrun)
#                                                          -> bench/results/gpu_step_llama-1b_w{1,8}.json
#      and with CPUOffloadPolicy(pin_memory=True), eager and fc on 1 GPU, fewer steps (issue 50's target: fc
#      within 1.3x eager)                                   -> bench/results/gpu_step_llama-1b_offload_w1.json
#   4. bench/profile_step.py on 1 GPU: host and device time per bucket (GPU idle), Chrome traces
#                                                  -> bench/results/gpu_profile_llama-1b.json, traces_llama-1b/
#
# Every JSON names the GPU (torch.cuda.get_device_name), the GPU count and the torch/CUDA/Triton versions.
# --quick: fewer kernel repeats, the tiny model and 10 steps (a few minutes; a check that it all runs).
# --parts: which of the four to run, comma-separated (default: all). --no-traces: no Chrome traces in 4.
# Environment: PYTHON (default python3), RESULTS (default bench/results), STEP_VARIANTS (3.'s variants beside eager,
# default "torch.compile fc fc:cudagraphs compute-only simplefsdp"), OFFLOAD=0 (3. without its CPU-offload run),
# PROFILE_VARIANTS (4.'s variants, default "eager torch.compile fc fc:cudagraphs compute-only"). Logs: $RESULTS/gpu_*.log.
# Exits 2 without a usable GPU (nothing run), 1 if a step failed (the later steps still run), else 0.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-bench/results}
QUICK=0
PARTS=tests,kernels,step,profile
TRACES=1
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --no-traces) TRACES=0 ;;
        --parts) PARTS=${2:?--parts needs a list, e.g. --parts tests,step}; shift ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        *) echo "bench/gpu.sh: unknown argument '$1' (usage: bash bench/gpu.sh [--quick] [--parts LIST] [--no-traces])" >&2; exit 2 ;;
    esac
    shift
done
for part in ${PARTS//,/ }; do
    case "$part" in
        tests|kernels|step|profile) ;;
        *) echo "bench/gpu.sh: unknown part '$part' in --parts (choose from tests,kernels,step,profile)" >&2; exit 2 ;;
    esac
done
want() { [[ ",$PARTS," == *",$1,"* ]]; }

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "bench/gpu.sh: nvidia-smi lists a GPU but $PYTHON's torch cannot use it (torch.cuda.is_available() is False):" >&2
        echo "  $("$PYTHON" -c 'import torch; print("torch", torch.__version__, "built for CUDA", torch.version.cuda)' 2>&1 | tail -1)" >&2
        echo "  install a CUDA build of torch>=2.13 and run again; nothing was run." >&2
    else
        echo "bench/gpu.sh: no CUDA GPU here (nvidia-smi lists none, torch.cuda.is_available() is False): nothing was run." >&2
        echo "  These tests and benchmarks need NVIDIA GPUs; on this machine run 'python3 -m pytest tests' instead." >&2
    fi
    exit 2
fi
GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's fsdp_compile, installed or not
mkdir -p "$RESULTS"
"$PYTHON" - <<'EOF'
import torch, triton
print(f"bench/gpu.sh: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), triton {triton.__version__}")
EOF

FAILED=()
run() {  # run NAME LOG COMMAND...: the command's output to the terminal and LOG; a failure is noted, not fatal
    local name=$1 log=$2
    shift 2
    echo
    echo "== $name"
    local rc=0
    "$@" 2>&1 | tee "$log" || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "== $name FAILED (exit $rc; log $log)"
        FAILED+=("$name")
    fi
}

# 1. The cuda-marked tests, summarized (with the GPU) from pytest's JUnit XML. Other test modules are only
#    collected; one that cannot import here (a missing optional dependency) does not stop the cuda tests.
XML=$(mktemp --suffix .xml)
trap 'rm -f "$XML"' EXIT
if want tests; then
run "pytest -m cuda tests" "$RESULTS/gpu_tests.log" \
    "$PYTHON" -m pytest -m cuda tests -p no:cacheprovider -q --continue-on-collection-errors --junitxml "$XML"
if ! "$PYTHON" - "$XML" "$RESULTS/gpu_tests.json" <<'EOF'
import json, sys, time, xml.etree.ElementTree as ET
import torch, triton
xml, out = sys.argv[1:]
cases = []
for case in ET.parse(xml).getroot().iter("testcase"):
    outcome, message = "passed", None
    for child in case:
        if child.tag in ("failure", "error", "skipped"):
            outcome, message = {"failure": "failed"}.get(child.tag, child.tag), (child.get("message") or "")[:500]
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                  "seconds": float(case.get("time", 0)), "message": message})
counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
with open(out, "w") as f:
    json.dump({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
               "gpu_count": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "triton": triton.__version__, "counts": counts, "tests": cases}, f, indent=2)
print(f"wrote {out}: {counts}")
EOF
then
    FAILED+=("gpu_tests.json (no JUnit XML from pytest?)")
fi
fi

# 2. Kernel bandwidth.
KERNEL_ARGS=()
[ "$QUICK" = 1 ] && KERNEL_ARGS=(--repeats 5 --warmup 2)
want kernels && run "bench/kernels.py --device cuda" "$RESULTS/gpu_kernels.log" \
    "$PYTHON" bench/kernels.py --device cuda --out "$RESULTS/gpu_kernels.json" ${KERNEL_ARGS[@]+"${KERNEL_ARGS[@]}"}

# 3. Step time: one GPU, then eight (one node) where there are eight.
read -r -a VARIANTS <<< "${STEP_VARIANTS:-torch.compile fc fc:cudagraphs compute-only simplefsdp}"  # eager always runs first; simplefsdp where torchtitan imports
STEP_ARGS=(--device cuda --model llama-1b --mp bf16 --batch 2 --variants "${VARIANTS[@]}" --out "$RESULTS")
MODEL=llama-1b
if [ "$QUICK" = 1 ]; then
    STEP_ARGS=(--device cuda --quick --variants "${VARIANTS[@]}" --out "$RESULTS")
    MODEL=tiny
fi
for W in 1 8; do
    want step || break
    if [ "$GPUS" -lt "$W" ]; then
        echo
        echo "== step benchmark on $W GPUs: skipped, $GPUS GPU(s) here"
        continue
    fi
    run "bench/compiled_vs_eager.py on $W GPU(s)" "$RESULTS/gpu_step_${MODEL}_w$W.log" \
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$W" bench/compiled_vs_eager.py \
        "${STEP_ARGS[@]}" --stem "gpu_step_${MODEL}_w$W"
    if [ "$W" = 1 ] && [ "${OFFLOAD:-1}" != 0 ]; then  # CPU offload: the host optimizer makes each step seconds long, so fewer of them
        run "bench/compiled_vs_eager.py --offload on 1 GPU" "$RESULTS/gpu_step_${MODEL}_offload_w1.log" \
            "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 bench/compiled_vs_eager.py \
            "${STEP_ARGS[@]}" --offload --steps 6 --window 3 --peak-steps 2 --stem "gpu_step_${MODEL}_offload_w1"
    fi
done

# 4. Where one GPU's step goes: host and device time per bucket for eager, torch.compile, fc and the
#    compute-only bound, and each variant's Chrome trace (bench/profile_step.py).
PROFILE_ARGS=(--model llama-1b --mp bf16 --batch 2)
[ "$QUICK" = 1 ] && PROFILE_ARGS=(--model tiny --mp bf16)
[ "$TRACES" = 1 ] && PROFILE_ARGS+=(--trace-dir "$RESULTS/traces_$MODEL")
want profile && run "bench/profile_step.py on 1 GPU" "$RESULTS/gpu_profile_$MODEL.log" \
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 bench/profile_step.py "${PROFILE_ARGS[@]}" \
    --variants ${PROFILE_VARIANTS:-eager torch.compile fc fc:cudagraphs compute-only} --out "$RESULTS" --stem "gpu_profile_$MODEL"

echo
if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "bench/gpu.sh: failed: ${FAILED[*]} (logs in $RESULTS/gpu_*.log)"
    exit 1
fi
echo "bench/gpu.sh: done; results in $RESULTS/gpu_*.json"
