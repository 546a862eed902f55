#!/usr/bin/env bash
# The cuda platform on the GPU machine, in one device-tool call (from the repository root,
# carry=[".gpu"]): versions, the cuda GPU tests, the decode-attention sweep (which writes the
# fitted tuned-config file under $OUT/tuned and installs it in this copy of the tree), the
# CUDA-vs-Triton comparison, then the conformance suite with the fitted file in place.
#   bash benchmarks/device/cuda_platform_check.sh
set -uo pipefail
source benchmarks/device/env.sh || exit 1
export PAGEDSERVE_CUDA_CACHE=/tmp/pagedserve-cuda-cache
mkdir -p "$OUT/tuned"
{
python3 - <<'PY'
import torch, cuda.bindings, cuda.pathfinder
print("torch", torch.__version__, "CUDA", torch.version.cuda, "| cuda.bindings", cuda.bindings.__version__)
print("nvrtc:", cuda.pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path)
print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
from pagedserve_cuda.plugin import availability
print("availability:", availability())
PY
t0=$(date +%s)
timeout 200 python3 -m pytest -p no:cacheprovider -p no:xdist -q --durations=5 tests/test_cuda_gpu.py tests/test_cuda_plugin.py 2>&1 | tail -30
echo "pytest (cold NVRTC cache): $(( $(date +%s) - t0 )) s"
timeout 150 python3 benchmarks/cuda_decode_attention.py --tune-out "$OUT/tuned"
cp "$OUT"/tuned/*.json plugins/cuda/pagedserve_cuda/configs/
t0=$(date +%s)
timeout 180 python3 -m pagedserve.cli.main conformance --platform cuda > "$OUT/conformance.txt" 2>&1; echo "conformance exit $?"; tail -30 "$OUT/conformance.txt"
echo "conformance: $(( $(date +%s) - t0 )) s"
python3 -m pagedserve.cli.main platforms --explain --platform cuda --batch 1x1x8192
python3 -m pagedserve.cli.main platforms --explain --platform cuda --batch 64x1x2048
echo "cached cubins: $(ls $PAGEDSERVE_CUDA_CACHE | wc -l)"
} 2>&1 | tee "$OUT/cuda_check.log"
