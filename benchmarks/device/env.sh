#!/usr/bin/env bash
# Source this at the start of every device-tool command (from the repository root, carry=[".gpu"]):
#   source benchmarks/device/env.sh
# The GPU image has torch, triton, transformers and cuda-python but not pydantic; .gpu/triton-wheels
# (git-ignored) holds pydantic and its dependencies as cp312 wheels, fetched with `pip download`
# as the device tool's README describes. Registers the in-tree platforms through a dist-info
# folder, the same entry-point path an installed pagedserve uses.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/triton-wheels/*.whl || return 1
mkdir -p /tmp/ep/pagedserve-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: pagedserve\nVersion: 0.1.0\n' > /tmp/ep/pagedserve-0.1.0.dist-info/METADATA
printf '[pagedserve.platforms]\ncpu_reference = pagedserve_cpu_reference.plugin\ntriton = pagedserve_triton.plugin\ncuda = pagedserve_cuda.plugin\n' \
    > /tmp/ep/pagedserve-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:/tmp/ep:$PWD/core:$PWD/plugins/cpu_reference:$PWD/plugins/triton:$PWD/plugins/cuda
export PYTHONUNBUFFERED=1
