#!/usr/bin/env bash
# Session 4, call A: GPU tests of the final tree, the engine on the cuda platform against
# cpu_reference (tiny float32 models), and single-stream latency + GPU idle on Llama-3.1-8B shapes
# for the cuda and triton platforms (CUDA graphs on). From the repository root, carry=[".gpu"]:
#   bash benchmarks/device/h100_session4.sh
set -uo pipefail
source benchmarks/device/env.sh || exit 1
export PAGEDSERVE_CUDA_CACHE=/tmp/pagedserve-cuda-cache
{
t0=$(date +%s)
timeout 240 python3 -m pytest -p no:cacheprovider -p no:xdist -q tests/test_hoststep_gpu.py tests/test_cuda_graphs_gpu.py tests/test_triton_gpu.py tests/test_cuda_gpu.py 2>&1 | tail -15
echo "gpu tests: $(( $(date +%s) - t0 )) s"
timeout 120 python3 benchmarks/gpu_engine_check.py --platform cuda 2>&1 | grep -v Warning | tail -12
for platform in cuda triton; do
  timeout 120 python3 benchmarks/gpu_latency.py --platform $platform --modes graphs --what latency,profile \
      --json $OUT/latency_$platform.json 2>&1 | grep -v -i warn | tail -12
done
} 2>&1 | tee "$OUT/session4a.log"
