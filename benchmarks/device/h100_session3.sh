#!/usr/bin/env bash
# GPU session 3: where a single-stream decode step's time goes (cProfile), 8B dummy on triton.
set -uo pipefail
# Run from the repository root through the device tool with carry=[".gpu"]. .gpu/ (git-ignored) must hold
# pydantic and its dependencies as cp312 wheels in .gpu/triton-wheels (pip download them as the device
# tool's README describes) and, for session 2, ../shared/workloads/sharegpt_like_256.json.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/triton-wheels/*.whl || exit 1
mkdir -p /tmp/ep/pagedserve-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: pagedserve\nVersion: 0.1.0\n' > /tmp/ep/pagedserve-0.1.0.dist-info/METADATA
printf '[pagedserve.platforms]\ncpu_reference = pagedserve_cpu_reference.plugin\ntriton = pagedserve_triton.plugin\n' > /tmp/ep/pagedserve-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:/tmp/ep:$PWD/core:$PWD/plugins/cpu_reference:$PWD/plugins/triton PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee $OUT/profile.txt
import cProfile, pstats, time, torch
from transformers import LlamaConfig
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, architectures=["LlamaForCausalLM"])
cfg.save_pretrained("/tmp/llama8b")
from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling.sampling_params import SamplingParams
e = LLMEngine(EngineArgs(model="/tmp/llama8b", load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                         max_model_len=2048, num_kv_blocks=2048, platform="triton"))
p = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0, detokenize=False)
def run(rid):
    e.add_request(rid, list(range(100, 612)), p)
    steps = []
    while e.has_unfinished_requests():
        torch.cuda.synchronize(); t = time.perf_counter(); e.step(); torch.cuda.synchronize(); steps.append(time.perf_counter() - t)
    return steps
run("warm")
steps = run("timed")
print("TTFT-ish first step ms", steps[0]*1e3, "median decode step ms", sorted(steps[1:])[len(steps[1:])//2]*1e3)
# model forward alone, one decode token, eager
runner = e.core.runner
pr = cProfile.Profile(); pr.enable(); run("prof"); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
pstats.Stats(pr).sort_stats("cumtime").print_stats(30)
PY
