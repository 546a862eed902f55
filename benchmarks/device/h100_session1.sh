#!/usr/bin/env bash
# GPU session 1: engine on triton vs cpu_reference (greedy, float32), then issue 5's attention table.
set -uo pipefail
# Run from the repository root through the device tool with carry=[".gpu"]. .gpu/ (git-ignored) must hold
# pydantic and its dependencies as cp312 wheels in .gpu/triton-wheels (pip download them as the device
# tool's README describes) and, for session 2, ../shared/workloads/sharegpt_like_256.json.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/triton-wheels/*.whl || exit 1
mkdir -p /tmp/ep/pagedserve-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: pagedserve\nVersion: 0.1.0\n' > /tmp/ep/pagedserve-0.1.0.dist-info/METADATA
printf '[pagedserve.platforms]\ncpu_reference = pagedserve_cpu_reference.plugin\ntriton = pagedserve_triton.plugin\n' > /tmp/ep/pagedserve-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:/tmp/ep:$PWD/core:$PWD/plugins/cpu_reference:$PWD/plugins/triton PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
python3 -m pagedserve.cli.main platforms 2>&1 | head -8
start=$(date +%s)
timeout 200 python3 benchmarks/gpu_engine_check.py --platform triton > $OUT/engine_check.txt 2>&1
echo "engine check rc=$? took $(( $(date +%s) - start )) s"
grep -E "equal to|ALL|MISMATCH|Error|error" $OUT/engine_check.txt | tail -40
start=$(date +%s)
timeout 330 python3 benchmarks/attention.py --issue-cases --flex-budget-s 120 --json $OUT/issue5.json > $OUT/issue5.txt 2>&1
echo "attention rc=$? took $(( $(date +%s) - start )) s"
cat $OUT/issue5.txt | tail -60
