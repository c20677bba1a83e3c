#!/usr/bin/env bash
# The CUDA check, for a machine with a CUDA GPU (none was available when this was written):
#   1. the CUDA test matrix: every device-parametrized test's cuda case and every test marked
#      `cuda` (pytest -k cuda: the keyword matches both), multi-process tests left out;
#   2. the benchmark families on CUDA (compile family at O0, O2, O5), JSON and tables;
#   2b. the update family on CUDA: the AdamW and the SGD-momentum update alone per level, fused and
#      eager, against its bound, with torch's fp32 AdamW/SGD and the peers beside them where their
#      libraries import (torchao SR AdamW and AdamW8bit, optimi Kahan AdamW/SGD, bitsandbytes
#      AdamW8bit/SGD8bit; a row that fails on CUDA is skipped with its error in the table); the fused
#      O7 rows run one torch.compile Triton kernel per tensor, _kernels/compiled_update.py (AdamW) and
#      _kernels/compiled_sgd.py (SGD), and torchao compiles its step, both on each row's first step
#      (their bits against the CPU reference are checked in step 1's cuda tests of
#      tests/kernels/test_compiled_update.py and test_compiled_sgd.py), JSON and tables;
#   3. the demo on CUDA with its default sizing;
#   4. a short frontier run on CUDA (benchmarks/frontier.py --quick: ampkit's bf16 levels and the
#      peer optimizers that import, O6), JSON and tables.
# Not covered: FSDP2's CPUOffloadPolicy on CUDA (initialize(fsdp=True, fsdp_kwargs={"offload_policy":
#   CPUOffloadPolicy()})). tests/parallel/test_fsdp_offload.py runs it on a CPU mesh, where nothing
#   moves; the CUDA path (shards, gradients, optimizer state and the update on the host, the found-inf
#   flag's one-element trip to the GPU under NCCL alone) needs 2 GPUs for 2 NCCL ranks and is unmeasured.
# Everything lands in OUT (default benchmarks/results/gpu); a summary in OUT/summary.json.
# Exits non-zero when there is no CUDA device, a test fails, or a step crashes or runs over its
# time limit. Each step's limit is its own or what is left of BUDGET seconds (default 780: 13 minutes
# for the whole script), whichever is less; a step with under 20 s left is not started (exit 124 in
# the summary). Missed benchmark targets are reported in the tables and JSON, not turned into a failure.
#
#   bash benchmarks/gpu_check.sh [OUT]        # PYTHON=/path/to/python to pick the interpreter, BUDGET=seconds
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-benchmarks/results/gpu}
BUDGET=${BUDGET:-780}
mkdir -p "$OUT"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)'))" >&2
    exit 2
fi
"$PY" -c "import torch, ampkit; print(ampkit.capabilities('cuda').summary())" | tee "$OUT/capabilities.txt"

declare -A STATUS
run_step() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS left=$((BUDGET - SECONDS))
    if [ "$left" -lt 20 ]; then
        STATUS[$name]=124
        echo "gpu_check: $name not started: ${left} s of the ${BUDGET} s budget left"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    STATUS[$name]=$?
    echo "gpu_check: $name exit ${STATUS[$name]} in $((SECONDS - start)) s (log: $OUT/$name.log)"
}

run_step tests 150 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" -k cuda --junitxml "$OUT/tests.xml" tests
run_step benchmarks 270 "$PY" benchmarks/run.py --device cuda --compile-levels O0,O2,O5 \
    --only overhead,speedup,unscale,memory,scaling,compile --json "$OUT/benchmarks.json"
run_step update 180 "$PY" benchmarks/run.py --device cuda --only update --json "$OUT/update.json"
run_step demo 60 "$PY" -m ampkit demo --device cuda --json "$OUT/demo.json"
run_step frontier 240 "$PY" benchmarks/frontier.py --quick --device cuda --json "$OUT/frontier.json"

failed=0
summary="{"
for name in tests benchmarks update demo frontier; do
    summary+="\"$name\": ${STATUS[$name]}, "
    [ "${STATUS[$name]}" -ne 0 ] && failed=1
done
summary+="\"failed\": $failed}"
echo "$summary" > "$OUT/summary.json"
echo "gpu_check: $summary"
exit $failed
