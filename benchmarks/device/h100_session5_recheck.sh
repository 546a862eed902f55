#!/usr/bin/env bash
# Session 3 re-check on the GPU machine after the attention-operator change (from the repository
# root, carry=[".gpu"]): the operator registers under torch 2.11, the cuda GPU tests, the
# piecewise CUDA-graph tests and the engine check against cpu_reference still pass.
#   bash benchmarks/device/h100_session5_recheck.sh
set -uo pipefail
source benchmarks/device/env.sh || exit 1
export PAGEDSERVE_CUDA_CACHE=/tmp/pagedserve-cuda-cache
{
python3 -c "import torch, pagedserve.attention.layer; print(torch.__version__, torch.ops.pagedserve.paged_attention)"
timeout 300 python3 -m pytest -p no:cacheprovider -p no:xdist -q tests/test_cuda_gpu.py tests/test_cuda_graphs_gpu.py tests/test_cpu_compile.py 2>&1 | tail -8
timeout 200 python3 benchmarks/gpu_engine_check.py --platform cuda 2>&1 | tail -12
} 2>&1 | tee "$OUT/recheck.log"
