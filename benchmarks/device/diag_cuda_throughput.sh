#!/usr/bin/env bash
# Diagnosis: where the 256-request throughput run spends its time on one platform (cProfile of
# the step loop, step-time histogram by step size). From the repository root, carry=[".gpu"]:
#   PLATFORM=cuda bash benchmarks/device/diag_cuda_throughput.sh
set -uo pipefail
source benchmarks/device/env.sh || exit 1
export PAGEDSERVE_CUDA_CACHE=/tmp/pagedserve-cuda-cache
python3 - <<'PY' 2>&1 | grep -v -i warn | tee $OUT/diag.txt
import cProfile, pstats, time, os, logging, torch
logging.basicConfig(level=logging.INFO)
from transformers import LlamaConfig
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                  architectures=["LlamaForCausalLM"])
cfg.save_pretrained("/tmp/llama8b")
from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.bench.datasets import load_workload
from pagedserve.bench.throughput import run_throughput
reqs = load_workload(".gpu/sharegpt_like_256.json")
for platform in os.environ.get("PLATFORMS", "cuda triton").split():
    e = LLMEngine(EngineArgs(model="/tmp/llama8b", load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                             max_model_len=4096, max_num_seqs=256, platform=platform))
    print(platform, "backend", e.setup.backend.name, "blocks", e.setup.num_kv_blocks)
    run_throughput(e, reqs[:16])  # warm-up
    pr = cProfile.Profile(); pr.enable()
    r = run_throughput(e, reqs)
    pr.disable()
    print(platform, "duration", r.duration_s, "out tok/s", r.output_tokens_per_s)
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    del e; torch.cuda.empty_cache()
PY
