#!/usr/bin/env bash
# Session 4, call B: `pagedserve bench throughput` on the shared 256-request workload (cuda
# platform, CUDA graphs), then HF transformers on the same requests in the same run
# (.gpu/hf_throughput.py is ../shared/peers/hf_throughput.py). From the repository root, carry=[".gpu"]:
#   bash benchmarks/device/h100_session4b.sh
set -uo pipefail
source benchmarks/device/env.sh || exit 1
export PAGEDSERVE_CUDA_CACHE=/tmp/pagedserve-cuda-cache
python3 - <<'PY'
from transformers import LlamaConfig
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                  architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
cfg.save_pretrained("/tmp/llama8b")
PY
COMMON="--model /tmp/llama8b --load-format dummy --dtype bfloat16 --skip-tokenizer-init --max-model-len 4096"
{
for platform in ${PLATFORMS:-cuda}; do
  t0=$(date +%s)
  timeout 200 python3 -m pagedserve.cli.main bench throughput $COMMON --platform $platform --max-num-seqs 256 --warmup-requests ${WARMUP:-0} \
      --workload .gpu/sharegpt_like_256.json --json $OUT/e2e_$platform.json > $OUT/e2e_$platform.txt 2>&1
  echo "$platform throughput rc=$? took $(( $(date +%s) - t0 )) s"; grep -v DEBUG $OUT/e2e_$platform.txt | tail -8
done
if [ -z "${SKIP_HF:-}" ]; then
  timeout 330 python3 .gpu/hf_throughput.py --methods cb --cb-timeout-s 150 --load-workload .gpu/sharegpt_like_256.json \
      --json $OUT/hf_peer.json 2>&1 | tail -15
fi
} 2>&1 | tee "$OUT/session4b.log"
