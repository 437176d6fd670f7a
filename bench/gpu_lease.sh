#!/usr/bin/env bash
# make gpu-check and the GPU benchmark in one call of a short GPU lease (this workplace
# lends 15 minutes of device time, 10 a command), so every step is bounded by one
# deadline and what it measured is in $OUT even when a step runs out of time:
#
#   PAGEDSERVE_COMMIT=<git rev-parse --short HEAD, here> bash bench/gpu_lease.sh SECONDS [BENCH_SECONDS]
#
# (the copy there may carry stale git metadata: name the commit from here)
#
# 7 files come back in $OUT; carry .cache/gpu-check (from `make gpu-wheels`). The
# timed benchmark gets the last BENCH_SECONDS (default 330) to itself.
#
# The correctness steps (tests, sanitizer, resources, smoke) run side by side: they
# compile Triton kernels on the CPU, a GPU machine has many cores, and none of them
# times anything it judges; the timed benchmark then has the machine to itself.
set -u
budget=${1:-540}
bench=${2:-330}
deadline=$((SECONDS + budget))
out=${OUT:-/tmp/gpu-lease}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PAGEDSERVE_CPU_KERNELS=0
py=${GPU_PY:-python3}
left() { local s=$((deadline - SECONDS - $1)); echo $((s > 5 ? s : 5)); }  # seconds to the deadline, less a reserve

{ nvidia-smi; $py -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'; } \
    >"$out/machine.txt" 2>&1
$py -c 'from bench.gpu_check import install_carried; print(*install_carried(), sep="\n")' >>"$out/machine.txt" 2>&1
export PYTHONPATH=/tmp/pagedserve-gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}

timeout "$(left "$bench")" $py -m bench.gpu_check --only tests --timeout-s "$(left $((bench + 10)))" >"$out/tests.log" 2>&1 &
tests=$!
timeout "$(left "$bench")" $py -m bench.gpu_check --only sanitizer --timeout-s "$(left $((bench + 10)))" >"$out/sanitizer.log" 2>&1 &
sanitizer=$!
timeout "$(left "$bench")" $py -m bench.gpu_check --only resources --timeout-s "$(left $((bench + 10)))" >"$out/resources.log" 2>&1 &
resources=$!
$py -c 'from bench.gpu_serving import ensure_checkpoint; ensure_checkpoint()' >>"$out/machine.txt" 2>&1
timeout "$(left "$bench")" $py -m bench.gpu_check --only smoke --timeout-s "$(left $((bench + 10)))" >"$out/smoke.log" 2>&1
wait $tests $sanitizer $resources

timeout "$(left 15)" $py -m bench.gpu_check --only bench wquant gguf kvcopy --timeout-s "$(left 25)" >"$out/bench.log" 2>&1

tar czf "$out/results.tgz" bench/results/gpu_serving.* bench/results/gguf_gemm.* bench/results/wquant_gemm_gpu.* bench/results/kv_offload_copy.* bench/results/gpu_check.* 2>/dev/null
tail -n 12 bench/results/gpu_check.md 2>/dev/null
