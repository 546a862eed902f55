"""`EngineConfig`: one engine core's configuration, a frozen config per concern, and
`resolve_engine_config`, the one function that makes it from `EngineArgs`.

Resolution happens once, in the process that builds the engine, before any worker starts: the
engine's set-up selects the platform, reads the model's config, and calls `resolve_engine_config`.
Every default that depends on the model or the platform is decided here and every rule between
options is checked here, so a bad combination fails before a device is touched. Below it, each part
of the engine receives the config of its concern, never `EngineArgs`, and reads it as it is: the
scheduler its `SchedulerConfig`, a device's runner its model, cache, scheduler and forward configs,
a tensor-parallel rank the whole `EngineConfig`. Nothing travels back up to be resolved again. The
one value left open is the KV cache's size in blocks, which waits for each device's measurement:
`CacheConfig` holds the rules that turn that measurement into the pool's size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch

from pagedserve.config.cache import CacheConfig
from pagedserve.config.engine_args import EngineArgs
from pagedserve.config.forward import CudaGraphMode, ForwardConfig
from pagedserve.config.lora import LoRAConfig
from pagedserve.config.model import LoadFormat, ModelConfig
from pagedserve.config.parallel import ParallelConfig
from pagedserve.config.scheduler import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    SchedulerConfig,
    SchedulingPolicy,
)
from pagedserve.config.speculative import SpeculativeConfig, resolve_speculative_config
from pagedserve.platforms.api import PlatformInfo

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one engine core is built from, resolved (`resolve_engine_config`)."""

    platform: str  # the chosen platform's name: every tensor-parallel rank selects the same one
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    forward: ForwardConfig
    lora: LoRAConfig | None  # None: LoRA is off
    freeze_startup_heap: bool  # start-up objects out of the garbage collector's full collections
    speculative: SpeculativeConfig | None = None  # None: nothing is drafted


def resolve_engine_config(
    args: EngineArgs,
    *,
    platform: PlatformInfo,
    trained_context_len: int | None,
    offline: bool,
    target_vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
) -> EngineConfig:
    """The configuration `args` asks for, on `platform`, for a model trained on contexts of
    `trained_context_len` tokens (its config's `max_position_embeddings`; None: it names none).
    `offline`: the engine runs batches handed to it whole (`LLMEngine`), not a server's stream of
    requests; it decides what `scheduling_policy="auto"` means. `target_vocab_size`,
    `draft_vocab_size`: the vocabularies of the model and of `speculative_config`'s draft (None:
    not checked). Raises ValueError naming the option when a value cannot hold. Pure but for a
    warning (a max_model_len past the trained context)."""
    speculative = resolve_speculative_config(
        args.speculative_config,
        args.num_speculative_tokens,
        target_vocab_size=target_vocab_size,
        draft_vocab_size=draft_vocab_size,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    drafts = speculative.num_speculative_tokens if speculative is not None else 0
    scheduler = _scheduler_config(args, platform, trained_context_len, offline, drafts)
    return EngineConfig(
        platform=platform.name,
        model=_model_config(args, platform),
        cache=_cache_config(args, scheduler),
        scheduler=scheduler,
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            distributed_timeout_s=args.distributed_timeout_s,
            disable_custom_all_reduce=args.disable_custom_all_reduce,
        ),
        forward=ForwardConfig(
            enforce_eager=args.enforce_eager,
            cudagraph_mode=CudaGraphMode.parse(args.cudagraph_mode),
            cuda_graph_max_tokens=args.cuda_graph_max_tokens,
            gpu_compile=args.gpu_compile,
            gpu_compile_scope=args.gpu_compile_scope,
            cpu_compile=args.cpu_compile,
            compile_cache=args.compile_cache,
            attention_warmup_threads=args.attention_warmup_threads,
            platform_linear=args.platform_linear,
            programmatic_launch=args.programmatic_launch,
            attention_reads_new_kv=args.attention_reads_new_kv,
            cascade_attention=not args.disable_cascade_attn,
        ),
        lora=_lora_config(args, scheduler) if args.enable_lora else None,
        freeze_startup_heap=args.freeze_startup_heap,
        speculative=speculative,
    )


def _model_config(args: EngineArgs, platform: PlatformInfo) -> ModelConfig:
    return ModelConfig(
        model=args.model,
        gguf_file=args.gguf_file,
        tokenizer=args.tokenizer,
        skip_tokenizer_init=args.skip_tokenizer_init,
        trust_remote_code=args.trust_remote_code,
        dtype=resolve_dtype(args.dtype, platform, args.quantization),
        load_format=cast(LoadFormat, args.load_format),  # EngineArgs' pattern admits these names only
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        seed=args.seed,
        max_logprobs=args.max_logprobs,
    )


def _scheduler_config(
    args: EngineArgs, platform: PlatformInfo, trained_context_len: int | None, offline: bool, drafts: int
) -> SchedulerConfig:
    max_model_len = _max_model_len(args.max_model_len, trained_context_len)
    budget = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs)
    if not args.enable_chunked_prefill:
        budget = max(budget, max_model_len)  # a prompt is then scheduled whole: the longest must fit
    if budget < args.max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be at least max_num_seqs ({args.max_num_seqs}): "
            "every running request needs a token per step"
        )
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        preemption_mode=args.preemption_mode,
        num_speculative_tokens=drafts,
        policy=scheduling_policy(args.scheduling_policy, offline=offline),
        widest_decoding_step=args.cuda_graph_max_tokens,
        max_loras=args.max_loras if args.enable_lora else None,
        # On accelerators the host's work hides behind the device's; on a CPU nothing runs beside it.
        async_scheduling=(
            args.async_scheduling if args.async_scheduling is not None else platform.device_type != "cpu"
        ),
    )


def _max_model_len(requested: int | None, trained: int | None) -> int:
    if requested is None:
        return min(trained or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
    if trained is not None and requested > trained:
        logger.warning(
            "max_model_len=%d is longer than the model's trained context (%d): quality may degrade",
            requested,
            trained,
        )
    return requested


def _cache_config(args: EngineArgs, scheduler: SchedulerConfig) -> CacheConfig:
    min_blocks = -(-scheduler.max_model_len // args.block_size)
    return CacheConfig(
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_gib=args.cpu_kv_cache_gib,
        swap_space_gib=args.swap_space_gib,
        min_blocks=min_blocks,
        max_useful_blocks=scheduler.max_num_seqs * min_blocks,
    )


def _lora_config(args: EngineArgs, scheduler: SchedulerConfig) -> LoRAConfig:
    return LoRAConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_tokens=max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs, args.cuda_graph_max_tokens),
    )


def scheduling_policy(choice: str, *, offline: bool) -> SchedulingPolicy:
    """The policy `EngineArgs.scheduling_policy` names; "auto" is makespan for an offline engine,
    whose batches end when their last request does, and first come, first served for a server,
    whose clients each wait for their own request."""
    if choice == "auto":
        return SchedulingPolicy.MAKESPAN if offline else SchedulingPolicy.FCFS
    return SchedulingPolicy(choice)


def resolve_dtype(name: str, platform: PlatformInfo, quantization: str | None = None) -> torch.dtype:
    """`"auto"` is float32 on CPU platforms (CPUs are slow at half precision) and bfloat16 on
    accelerators, and with packed 4-bit weights (whose kernels take bfloat16); an explicit dtype
    must be one the platform supports."""
    if name == "auto":
        cpu = platform.device_type == "cpu"
        dtype = torch.float32 if cpu and quantization is None else torch.bfloat16
    else:
        dtype = _DTYPES[name]
    if dtype not in platform.supported_dtypes:
        raise ValueError(
            f"dtype {name!r} is not supported by platform {platform.name!r}; it supports "
            f"{', '.join(str(d).removeprefix('torch.') for d in platform.supported_dtypes)}"
        )
    return dtype
