"""What FP8 costs in accuracy: FP8 KV caches, FP8 weights and an FP8 LM head against the same model
in bfloat16.

For each model the bfloat16 run generates greedy continuations of a fixed prompt set; then every
variant (FP8 KV e4m3 / e5m2, FP8 weights, FP8 weights and LM head, each of the weight variants
with an e4m3 cache too) is scored teacher-forced on exactly those sequences, so the numbers
compare the same tokens:

* logprob error: |log p_fp8(token) - log p_bf16(token)| over every continuation token (mean, max);
* top-1 agreement: the share of continuation positions where the bfloat16 run's greedy token is
  still the FP8 variant's top-1;
* greedy match: the share of prompts whose free-running FP8 greedy continuation equals bfloat16's.

Models: `--tiny` (random Llama and Qwen2 configs, the tests' shapes) and the embedded SmolLM2-135M
(`--smollm2`, real weights, real text prompts). CPU (cpu_reference, torch 2.13's CPU `_scaled_mm`):

    python benchmarks/investigations/fp8_accuracy.py --tiny --smollm2

On a GPU add `--platform cuda` (or `triton`). Variants a platform cannot run are reported as such.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve import LLM, SamplingParams

VARIANTS: dict[str, dict[str, str | bool]] = {  # name -> EngineArgs changes against the bfloat16 run
    "kv fp8_e4m3": {"kv_cache_dtype": "fp8"},
    "kv fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "weights fp8": {"quantization": "fp8"},
    "weights fp8 + kv fp8_e4m3": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    "weights + head fp8": {"quantization": "fp8", "quantize_lm_head": True},
    "weights + head fp8 + kv fp8_e4m3": {
        "quantization": "fp8",
        "quantize_lm_head": True,
        "kv_cache_dtype": "fp8",
    },
}

_NAME_WIDTH = max(map(len, VARIANTS))  # the variant column of the printed tables

SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
    "To make a good cup of coffee, you should",
    "In 1969, the Apollo 11 mission",
    "The difference between a list and a tuple in Python is",
]


@dataclass(frozen=True, slots=True)
class Score:
    """One variant against the bfloat16 run."""

    mean_abs_logprob_err: float
    max_abs_logprob_err: float
    top1_agreement: float  # share of continuation positions
    greedy_match: float  # share of prompts
    positions: int


def _greedy(llm: LLM, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, detokenize=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _teacher_forced(
    llm: LLM, sequences: list[list[int]], first: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob, rank) of every token of `sequences[i]` from position `first[i]` on."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    logprobs, ranks = [], []
    for out, seq, start in zip(
        llm.generate(sequences, params, use_tqdm=False), sequences, first, strict=True
    ):
        assert out.prompt_logprobs is not None
        for i in range(start, len(seq)):
            entry = out.prompt_logprobs[i]
            assert entry is not None
            logprobs.append(entry[seq[i]].logprob)
            ranks.append(entry[seq[i]].rank or 0)
    return torch.tensor(logprobs, dtype=torch.float64), torch.tensor(ranks)


def score_model(
    model: str | None, prompts: list[list[int]], max_new: int, engine: dict[str, Any]
) -> dict[str, Score | str]:
    """variant -> its score, or why it could not run."""
    base_llm = LLM(model, **engine)
    continuations = _greedy(base_llm, prompts, max_new)
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    first = [len(p) for p in prompts]
    base_lp, _ = _teacher_forced(base_llm, sequences, first)
    del base_llm
    results: dict[str, Score | str] = {}
    for name, change in VARIANTS.items():
        try:
            llm = LLM(model, **engine, **change)
        except ValueError as exc:
            results[name] = f"not run: {exc}"
            continue
        lp, ranks = _teacher_forced(llm, sequences, first)
        greedy = _greedy(llm, prompts, max_new)
        err = (lp - base_lp).abs()
        results[name] = Score(
            mean_abs_logprob_err=float(err.mean()),
            max_abs_logprob_err=float(err.max()),
            top1_agreement=float((ranks == 1).double().mean()),
            greedy_match=sum(g == c for g, c in zip(greedy, continuations, strict=True)) / len(prompts),
            positions=int(err.numel()),
        )
        del llm
    return results


def _tiny_checkpoints(directory: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shapes = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    out = {}
    for seed, (name, config) in enumerate(
        (("tiny llama", LlamaConfig(**shapes)), ("tiny qwen2", Qwen2Config(**shapes)))
    ):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        path = directory / name.replace(" ", "_")
        model.save_pretrained(path)
        out[name] = path
    return out


def _print(title: str, results: dict[str, Score | str]) -> None:
    print(f"\n{title}")
    print(
        f"  {'variant':{_NAME_WIDTH}} {'mean |dlogp|':>13} {'max |dlogp|':>12} "
        f"{'top-1 agree':>12} {'greedy match':>13}"
    )
    for name, result in results.items():
        if isinstance(result, str):
            print(f"  {name:{_NAME_WIDTH}} {result}")
        else:
            print(
                f"  {name:{_NAME_WIDTH}} {result.mean_abs_logprob_err:13.4f} "
                f"{result.max_abs_logprob_err:12.4f} "
                f"{result.top1_agreement:12.1%} {result.greedy_match:13.1%}   ({result.positions} positions)"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="the random tiny Llama and Qwen2 models")
    parser.add_argument("--smollm2", action="store_true", help="the embedded SmolLM2-135M")
    parser.add_argument("--platform", default=None, help="platform (default: automatic)")
    parser.add_argument("--max-new", type=int, default=32, help="greedy tokens per prompt")
    args = parser.parse_args(argv)
    if not (args.tiny or args.smollm2):
        parser.error("choose --tiny and/or --smollm2")
    engine: dict[str, Any] = {
        "dtype": "bfloat16",
        "platform": args.platform,
        "enable_prefix_caching": False,  # every prompt position reports its logprob
        "max_model_len": 256,
        "max_num_seqs": 16,
    }
    print(f"torch {torch.__version__}, platform {args.platform or 'automatic'}, {args.max_new} new tokens")
    if args.tiny:
        with tempfile.TemporaryDirectory() as tmp:
            gen = torch.Generator().manual_seed(7)
            prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (5, 17, 30, 3, 12, 24)]
            for name, path in _tiny_checkpoints(Path(tmp)).items():
                tiny_engine = {**engine, "skip_tokenizer_init": True, "block_size": 16}
                _print(name, score_model(str(path), prompts, args.max_new, tiny_engine))
    if args.smollm2:
        from pagedserve.models.loader import load_tokenizer, resolve_model_source

        tokenizer = load_tokenizer(resolve_model_source(None, None))
        prompts = [tokenizer(p)["input_ids"] for p in SMOLLM2_PROMPTS]
        _print(
            "SmolLM2-135M (embedded GGUF, dense bfloat16)", score_model(None, prompts, args.max_new, engine)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
