"""Engine options shared by `generate`, `serve` and `bench`: one flag per `EngineArgs` field."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import pydantic

from pagedserve.config import EngineArgs


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (vLLM's `--speculative-config '{"method": ...}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# flag -> (EngineArgs field, the flag's parser (a type or a function of its text), help)
_OPTIONS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "--platform": ("platform", str, "platform name (default: PAGEDSERVE_PLATFORM or the best available)"),
    "--gguf-file": ("gguf_file", str, "GGUF file inside the model directory"),
    "--tokenizer": ("tokenizer", str, "tokenizer directory (default: the model's)"),
    "--dtype": ("dtype", str, "auto, float32, float16 (half), bfloat16 or float64"),
    "--runner": ("runner", str, "auto (default), generate or pooling (embed, classify, score only)"),
    "--task": ("task", str, "vLLM's older --runner: generate, embed, classify or score"),
    "--max-model-len": ("max_model_len", int, "longest prompt + output in tokens"),
    "--block-size": ("block_size", int, "tokens per KV-cache block"),
    "--max-num-seqs": ("max_num_seqs", int, "most requests running at once"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "token budget of one step"),
    "--num-kv-blocks": ("num_kv_blocks", int, "exact number of KV blocks (default: sized from memory)"),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float, "share of GPU memory to use"),
    "--cpu-kv-cache-gib": ("cpu_kv_cache_gib", float, "KV budget on CPU platforms, GiB"),
    "--load-format": ("load_format", str, "auto, safetensors, gguf or dummy (random weights)"),
    "--quantization": (
        "quantization",
        str,
        "gguf: keep a GGUF's Q4_1/Q8_0 blocks packed (CPU, bfloat16); fp8: FP8 weights (sm_89+ GPUs)",
    ),
    "--kv-cache-dtype": ("kv_cache_dtype", str, "auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2"),
    "--cuda-graph-max-tokens": ("cuda_graph_max_tokens", int, "largest step replayed as CUDA graphs"),
    "--cudagraph-mode": (
        "cudagraph_mode",
        str,
        "none, piecewise, full_decode_only, full_and_piecewise or full (default)",
    ),
    "--gpu-compile-scope": (
        "gpu_compile_scope",
        str,
        "layer (default: each decoder stretch compiled once for all layers) or model (one whole graph)",
    ),
    "--attention-warmup-threads": (
        "attention_warmup_threads",
        int,
        "start-up: threads JIT-compiling attention kernels beside the forward's compile (1: serial)",
    ),
    "--scheduling-policy": (
        "scheduling_policy",
        str,
        "auto (default: makespan offline, fcfs in the server), fcfs, or makespan (most tokens to "
        "generate first, prompt work spread over the decode steps)",
    ),
    "--seed": ("seed", int, "engine seed"),
    "--num-speculative-tokens": ("num_speculative_tokens", int, "draft tokens per step (alone: n-gram)"),
    "--speculative-config": (
        "speculative_config",
        _json_object,
        'speculative decoding as JSON, vLLM\'s keys: {"method": "eagle3", "model": DIR, '
        '"num_speculative_tokens": 3} (methods: ngram, draft_model, eagle, eagle3)',
    ),
    "--tensor-parallel-size": ("tensor_parallel_size", int, "shard the model over this many devices"),
    "--distributed-executor-backend": (
        "distributed_executor_backend",
        str,
        "mp (one host, default) or ray (ranks as Ray actors, multi-node)",
    ),
    "--distributed-timeout-s": (
        "distributed_timeout_s",
        float,
        "seconds before a silent rank fails the engine",
    ),
    "--data-parallel-size": (
        "data_parallel_size",
        int,
        "engine replicas, each on its own GPU (or tensor-parallel group), behind one server",
    ),
    "--max-logprobs": ("max_logprobs", int, "most logprobs a request may ask for (default 20)"),
    "--max-loras": ("max_loras", int, "with --enable-lora: most distinct adapters running at once"),
    "--max-lora-rank": ("max_lora_rank", int, "with --enable-lora: the largest adapter rank (default 16)"),
}
_SWITCHES: dict[str, tuple[str, bool, str]] = {
    "--quantize-lm-head": (
        "quantize_lm_head",
        True,
        "with --quantization fp8: the LM head in FP8 too (per vocabulary row; logits take its error)",
    ),
    "--no-prefix-caching": ("enable_prefix_caching", False, "turn prefix caching off"),
    "--no-chunked-prefill": ("enable_chunked_prefill", False, "turn chunked prefill off"),
    "--enforce-eager": ("enforce_eager", True, "no CUDA graphs, no compilation"),
    "--cpu-compile": ("cpu_compile", True, "CPU: torch.compile steps of up to 32 tokens (slow first start)"),
    "--compile-cache": (
        "compile_cache",
        True,
        "CPU: with --cpu-compile, save the compiled graphs whole and load them at later starts",
    ),
    "--no-gpu-compile": ("gpu_compile", False, "GPU: run the forward's dense parts uncompiled"),
    "--no-platform-linear": (
        "platform_linear",
        False,
        "GPU: linear layers on torch's GEMMs, not the platform's",
    ),
    "--no-programmatic-launch": (
        "programmatic_launch",
        False,
        "GPU: launch kernels one after another (no programmatic dependent launches)",
    ),
    "--no-attention-new-kv": (
        "attention_reads_new_kv",
        False,
        "attention reads every key and value from the paged cache (no prefill kernel over the step's own)",
    ),
    "--disable-cascade-attn": (
        "disable_cascade_attn",
        True,
        "never run a shared prefix as cascade attention (read once for the step's requests)",
    ),
    "--no-freeze-startup-heap": (
        "freeze_startup_heap",
        False,
        "keep start-up objects in Python's full garbage collections",
    ),
    "--disable-custom-all-reduce": (
        "disable_custom_all_reduce",
        True,
        "tensor parallelism on NVIDIA: every all-reduce through NCCL (no peer-memory all-reduce)",
    ),
    "--enable-lora": ("enable_lora", True, "serve PEFT LoRA adapters per request (serve: --lora-modules)"),
    "--trust-remote-code": (
        "trust_remote_code",
        True,
        "let transformers run the checkpoint's own code for its config and tokenizer",
    ),
    "--skip-tokenizer-init": ("skip_tokenizer_init", True, "no tokenizer: token-id prompts only"),
    "--async-scheduling": ("async_scheduling", True, "schedule step N+1 while step N runs (default on GPUs)"),
    "--no-async-scheduling": ("async_scheduling", False, "every step synchronous (for debugging)"),
}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Add every engine flag to `parser` (defaults stay None: EngineArgs' own defaults apply)."""
    group = parser.add_argument_group("engine")
    for flag, (dest, kind, help_text) in _OPTIONS.items():
        group.add_argument(flag, dest=f"engine_{dest}", type=kind, default=None, help=help_text)
    for flag, (dest, value, help_text) in _SWITCHES.items():
        group.add_argument(
            flag, dest=f"engine_{dest}", action="store_const", const=value, default=None, help=help_text
        )


def engine_args_from(args: argparse.Namespace, model: str | None) -> EngineArgs:
    """Build EngineArgs from parsed flags. Raises SystemExit with a readable message when invalid."""
    values = {
        key.removeprefix("engine_"): value
        for key, value in vars(args).items()
        if key.startswith("engine_") and value is not None
    }
    try:
        return EngineArgs(model=model, **values)
    except pydantic.ValidationError as exc:
        problems = "; ".join(_problem(e["loc"], e["msg"]) for e in exc.errors())
        raise SystemExit(f"pagedserve: invalid engine options: {problems}") from None


def _problem(loc: tuple[int | str, ...], message: str) -> str:
    """One validation error as the command line names it: `--flag: message` for a field, the
    message alone for a rule across fields (which names its options itself). Pure."""
    message = message.removeprefix("Value error, ")  # pydantic's wrapping of a validator's ValueError
    if not loc:
        return message
    return f"--{'-'.join(str(p) for p in loc).replace('_', '-')}: {message}"
