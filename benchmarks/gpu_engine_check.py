"""On a GPU: the engine on an accelerator platform gives the same greedy tokens as cpu_reference.

Tiny random float32 models (Llama, Mistral with a sliding window, Qwen2, Qwen3) are saved as
safetensors checkpoints; each is served by `LLM(platform="cpu_reference")` and by
`LLM(platform=PLATFORM)` in every CUDA-graph mode of `--graph-modes` (each compiled, plus
`enforce_eager`) on the same prompts, with chunked prefill forced small and a KV pool small
enough to preempt, and the greedy token ids must be equal. The line of each accelerator run also
says how many steps replayed full and piecewise graphs, so a mode that silently fell back shows.

    python benchmarks/gpu_engine_check.py --platform triton
    python benchmarks/gpu_engine_check.py --platform cuda --graph-modes full_and_piecewise,piecewise
    python benchmarks/gpu_engine_check.py --platform cuda --archs mistral,qwen3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from pagedserve import LLM, SamplingParams

VOCAB = 512


def _config(cls: type, **extra: object) -> object:
    return cls(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        **extra,
    )


CONFIGS = {
    "llama": lambda: _config(LlamaConfig),
    "mistral": lambda: _config(MistralConfig, sliding_window=48),
    "qwen2": lambda: _config(Qwen2Config),
    "qwen3": lambda: _config(Qwen3Config),
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--platform", default="triton")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--graph-modes",
        default="full_and_piecewise,full_decode_only,piecewise,none",
        help="comma-separated cudagraph_mode values to run the platform in, and/or 'eager' "
        "(enforce_eager=True)",
    )
    parser.add_argument(
        "--archs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}"
    )
    args = parser.parse_args()
    archs = args.archs.split(",")
    unknown = [a for a in archs if a not in CONFIGS]
    if unknown:
        parser.error(f"unknown --archs {unknown}: choose from {', '.join(CONFIGS)}")
    runs = [("cpu_reference", "eager")] + [(args.platform, m) for m in args.graph_modes.split(",")]
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 33, 100, 260, 17, 64]
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (arch, make) in enumerate(CONFIGS.items()):
            if arch not in archs:
                continue  # the seed stays tied to the architecture's place in CONFIGS
            torch.manual_seed(i)
            hf = AutoModelForCausalLM.from_config(make(), dtype=torch.float32)
            path = Path(tmp) / arch
            hf.save_pretrained(path)
            results = {}
            for platform, mode in runs:
                graph_options = {"enforce_eager": True} if mode == "eager" else {"cudagraph_mode": mode}
                for label, engine in (
                    ("plain", {"num_kv_blocks": 256}),
                    (
                        "chunked+preempt",
                        {"num_kv_blocks": 28, "max_num_batched_tokens": 64, "max_num_seqs": 4},
                    ),
                ):
                    llm = LLM(
                        str(path),
                        platform=platform,
                        skip_tokenizer_init=True,
                        dtype="float32",
                        max_model_len=512,
                        block_size=16,
                        **graph_options,
                        **engine,
                    )
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    results[(platform, mode, label)] = [o.outputs[0].token_ids for o in outs]
                    runner = llm.engine.core.runner
                    preempted = llm.engine.core.scheduler.num_preemptions
                    full = runner.full_graphs.num_replays if runner.full_graphs is not None else 0
                    piecewise = runner.cuda_graphs.num_replays if runner.cuda_graphs is not None else 0
                    print(
                        f"{arch:8s} {platform:14s} {mode:18s} {label:16s} preemptions={preempted} "
                        f"full-graph steps={full} piecewise steps={piecewise}",
                        flush=True,
                    )
                    del llm, runner
            reference = results[("cpu_reference", "eager", "plain")]
            for key, tokens in results.items():
                same = sum(a == b for a, b in zip(tokens, reference, strict=True))
                ok = same == len(reference)
                failures += not ok
                print(
                    f"  {arch:8s} {key[0]:14s} {key[1]:18s} {key[2]:16s} equal to cpu_reference: "
                    f"{same}/{len(reference)}" + ("" if ok else "  <-- MISMATCH")
                )
    print("ALL EQUAL" if failures == 0 else f"{failures} MISMATCHES")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
