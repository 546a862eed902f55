#!/usr/bin/env bash
# GPU session 2: end-to-end offline throughput on the triton platform, Llama-3.1-8B shapes, dummy bf16
# weights, the shared 256-request workload; then single-stream 512 in / 128 out.
set -uo pipefail
# Run from the repository root through the device tool with carry=[".gpu"]. .gpu/ (git-ignored) must hold
# pydantic and its dependencies as cp312 wheels in .gpu/triton-wheels (pip download them as the device
# tool's README describes) and, for session 2, ../shared/workloads/sharegpt_like_256.json.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/triton-wheels/*.whl || exit 1
mkdir -p /tmp/ep/pagedserve-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: pagedserve\nVersion: 0.1.0\n' > /tmp/ep/pagedserve-0.1.0.dist-info/METADATA
printf '[pagedserve.platforms]\ncpu_reference = pagedserve_cpu_reference.plugin\ntriton = pagedserve_triton.plugin\n' > /tmp/ep/pagedserve-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:/tmp/ep:$PWD/core:$PWD/plugins/cpu_reference:$PWD/plugins/triton PYTHONUNBUFFERED=1
python3 - <<'PY'
import json
from transformers import LlamaConfig
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                  architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
cfg.save_pretrained("/tmp/llama8b")
import random
random.seed(0)
json.dump([{"prompt_ids": [random.randrange(100, 128000) for _ in range(512)], "output_len": 128}],
          open("/tmp/single.json", "w"))
PY
COMMON="--model /tmp/llama8b --load-format dummy --dtype bfloat16 --skip-tokenizer-init --max-model-len 4096 --platform triton"
start=$(date +%s)
timeout 330 python3 -m pagedserve.cli.main -v bench throughput $COMMON --max-num-seqs 256 --workload .gpu/sharegpt_like_256.json --json $OUT/e2e_throughput.json > $OUT/e2e_throughput.txt 2>&1
echo "throughput rc=$? took $(( $(date +%s) - start )) s"; grep -v DEBUG $OUT/e2e_throughput.txt | tail -15
start=$(date +%s)
timeout 150 python3 -m pagedserve.cli.main bench throughput $COMMON --max-num-seqs 8 --workload /tmp/single.json --json $OUT/e2e_single.json > $OUT/e2e_single.txt 2>&1
echo "single rc=$? took $(( $(date +%s) - start )) s"; tail -12 $OUT/e2e_single.txt
