"""Turning `EngineArgs` into a running engine core: platform, model, backend, KV cache, scheduler.

Every choice made here is logged, because a user whose engine is slow or out of memory needs to
know which platform, backend, dtype and KV-cache size they got.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from pagedserve.config import CacheConfig, EngineArgs, SchedulerConfig, SchedulingPolicy
from pagedserve.engine.core import EngineCore
from pagedserve.engine.ngram_proposer import NgramProposer
from pagedserve.executor.base import StepRunner, WorkerReport
from pagedserve.lora.manager import LoRAManager
from pagedserve.models.loader import LoadedModel, load_config, load_tokenizer, resolve_model_source
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import AttentionBackend
from pagedserve.platforms.loaded_platform import LoadedPlatform
from pagedserve.platforms.registry import load_platforms
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.worker.kv_sizing import kv_block_bytes
from pagedserve.worker.runner_setup import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    build_runner,
    choose_backend,
    fit_kv_blocks,
    load_device_model,
    resolve_dtype,
    swap_space_blocks,
)
from pagedserve.worker.startup_heap import freeze_startup_heap

# Re-exported: they lived here before the per-device half of the setup moved to `runner_setup`.
__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "EngineSetup",
    "build_engine",
    "choose_backend",
    "eos_token_ids",
    "resolve_dtype",
    "scheduling_policy",
]
from pagedserve.structured.backend import StructuredOutputBackend
from pagedserve.structured.checks import backend_available
from pagedserve.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """What was chosen, for logs, `LLM` attributes and tests."""

    platform: LoadedPlatform
    spec: ModelSpec  # of the whole model (head counts unsharded)
    loaded: LoadedModel | None  # None with tensor_parallel_size > 1: the weights live in the ranks
    backend: AttentionBackend
    tokenizer: PreTrainedTokenizerBase | None  # None with skip_tokenizer_init
    eos_token_ids: frozenset[int]
    max_model_len: int
    num_kv_blocks: int
    core: EngineCore
    lora: LoRAManager | None = None  # with enable_lora: the adapters and their slots


def build_engine(args: EngineArgs, *, offline: bool) -> EngineSetup:
    """Select the platform, load the model and build the engine core. Slow (loads weights).
    With `tensor_parallel_size > 1` the model is loaded by one worker process per rank.
    `offline`: the engine runs batches handed to it whole (`LLMEngine`), not a server's stream of
    requests; it decides what `scheduling_policy="auto"` means."""
    platform = load_platforms().select(args.platform)
    policy = scheduling_policy(args.scheduling_policy, offline=offline)
    if args.tensor_parallel_size > 1:
        return _build_parallel_engine(args, platform, policy)
    device = platform.device
    dm = load_device_model(args, platform, device)
    # Before the KV cache is sized, so that the adapters' slots are counted as used memory.
    lora = (
        LoRAManager(
            dm.loaded.model,
            max_loras=args.max_loras,
            max_rank=args.max_lora_rank,
            # Every forward's tokens: the largest step, and the padded sizes graphs capture.
            max_tokens=max(dm.max_num_batched_tokens, args.max_num_seqs, args.cuda_graph_max_tokens),
            kernel=platform.lora_kernel(),
        )
        if args.enable_lora
        else None
    )
    spec = dm.loaded.spec
    num_blocks = args.num_kv_blocks or fit_kv_blocks(dm, args, device)
    _check_num_blocks(args, num_blocks, dm.max_model_len)
    _log_kv_cache(args, spec, num_blocks, dm.backend.name, dm.kv_cache_dtype)
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer or dm.loaded.source)
    eos = eos_token_ids(dm.loaded.hf_config, tokenizer.eos_token_id if tokenizer is not None else None)
    runner = build_runner(dm, args, device, num_kv_blocks=num_blocks, eos_token_ids=eos)
    runner.lora = lora
    scheduler = _scheduler(
        args, policy, spec, num_blocks, dm.max_model_len, dm.max_num_batched_tokens, dm.kv_cache_dtype
    )
    core = _engine_core(
        args, platform, scheduler, runner, tokenizer, spec.vocab_size, eos, dm.max_model_len, device
    )
    if args.freeze_startup_heap:
        freeze_startup_heap()
    return EngineSetup(
        platform, spec, dm.loaded, dm.backend, tokenizer, eos, dm.max_model_len, num_blocks, core, lora
    )


def _build_parallel_engine(
    args: EngineArgs, platform: LoadedPlatform, policy: SchedulingPolicy
) -> EngineSetup:
    """The scheduler here, the model in `tensor_parallel_size` worker processes (or Ray actors)."""
    from pagedserve.distributed.group import TensorParallelGroup
    from pagedserve.distributed.sharding import ShardLayout
    from pagedserve.executor.launch import start_executor
    from pagedserve.models.decoder import head_size_of

    source = resolve_model_source(args.model, args.gguf_file)
    config = load_config(source)
    # Refuse a model that does not split before starting a process per rank to find out.
    ShardLayout.for_config(config, TensorParallelGroup(0, args.tensor_parallel_size), head_size_of(config))
    executor, reports = start_executor(args, platform)
    try:
        first = reports[0]
        backend, kv_dtype = choose_backend(platform, first.local_spec, args.block_size, args.kv_cache_dtype)
        # Every rank sized its cache from its own free memory; all must hold the same block ids.
        num_blocks = args.num_kv_blocks or min(r.num_kv_blocks for r in reports)
        _check_num_blocks(args, num_blocks, first.max_model_len)
        _log_kv_cache(args, first.local_spec, num_blocks, first.backend_name, kv_dtype)
        tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer or source)
        eos = eos_token_ids(config, tokenizer.eos_token_id if tokenizer is not None else None)
        executor.init_cache(num_blocks, eos)
    except BaseException:
        executor.shutdown()
        raise
    scheduler = _scheduler(
        args,
        policy,
        first.local_spec,
        num_blocks,
        first.max_model_len,
        first.max_num_batched_tokens,
        kv_dtype,
    )
    # Grammars live here, beside the scheduler (a host device: no pinned bitmasks); the ranks
    # receive each constrained step's bitmask.
    vocab_size = first.local_spec.vocab_size
    core = _engine_core(
        args,
        platform,
        scheduler,
        executor,
        tokenizer,
        vocab_size,
        eos,
        first.max_model_len,
        torch.device("cpu"),
    )
    if args.freeze_startup_heap:
        freeze_startup_heap()  # the driver's; each rank freezes its own after it is ready
    spec = _whole_model_spec(first)
    return EngineSetup(platform, spec, None, backend, tokenizer, eos, first.max_model_len, num_blocks, core)


def _engine_core(
    args: EngineArgs,
    platform: LoadedPlatform,
    scheduler: Scheduler,
    runner: StepRunner,  # this device's ModelRunner, or the executor over the ranks
    tokenizer: PreTrainedTokenizerBase | None,
    vocab_size: int,
    eos: frozenset[int],
    max_model_len: int,
    grammar_device: torch.device,  # where the structured-output bitmasks are filled for
) -> EngineCore:
    """The engine core over `runner`, with the n-gram proposer, asynchronous scheduling and
    structured outputs that `args` and the platform give it."""
    proposer = NgramProposer(args.num_speculative_tokens) if args.num_speculative_tokens else None
    return EngineCore(
        scheduler,
        runner,
        max_model_len=max_model_len,
        proposer=proposer,
        async_scheduling=async_scheduling_choice(args.async_scheduling, platform, proposer is not None),
        structured=structured_output_manager(tokenizer, vocab_size, eos, args, grammar_device),
    )


def _whole_model_spec(report: WorkerReport) -> ModelSpec:
    return dataclasses.replace(
        report.local_spec, num_q_heads=report.num_q_heads, num_kv_heads=report.num_kv_heads
    )


def _check_num_blocks(args: EngineArgs, num_blocks: int, max_model_len: int) -> None:
    min_blocks = -(-max_model_len // args.block_size)
    if num_blocks < min_blocks and args.num_kv_blocks is None:
        raise ValueError(
            f"only {num_blocks} KV blocks fit in memory but one max_model_len={max_model_len} request "
            f"needs {min_blocks}: lower max_model_len or free memory"
        )


def _log_kv_cache(
    args: EngineArgs, spec: ModelSpec, num_blocks: int, backend_name: str, kv_dtype: torch.dtype
) -> None:
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB%s, %s), attention backend %s",
        num_blocks,
        args.block_size,
        num_blocks * args.block_size,
        num_blocks * kv_block_bytes(spec, args.block_size, kv_dtype) / 2**20,
        " per rank" if args.tensor_parallel_size > 1 else "",
        str(kv_dtype).removeprefix("torch."),
        backend_name,
    )


def scheduling_policy(choice: str, *, offline: bool) -> SchedulingPolicy:
    """The policy `EngineArgs.scheduling_policy` names; "auto" is makespan for an offline engine,
    whose batches end when their last request does, and first come, first served for a server,
    whose clients each wait for their own request."""
    if choice == "auto":
        return SchedulingPolicy.MAKESPAN if offline else SchedulingPolicy.FCFS
    return SchedulingPolicy(choice)


def _scheduler(
    args: EngineArgs,
    policy: SchedulingPolicy,
    spec: ModelSpec,
    num_blocks: int,
    max_model_len: int,
    max_batched: int,
    kv_dtype: torch.dtype,
) -> Scheduler:
    sched_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        preemption_mode=args.preemption_mode,
        num_speculative_tokens=args.num_speculative_tokens,
        policy=policy,
        # Steps wider than this run without CUDA graphs, where their host time shows.
        widest_decoding_step=args.cuda_graph_max_tokens,
        max_loras=args.max_loras if args.enable_lora else None,
    )
    logger.info("scheduling policy: %s", policy.value)
    cache_config = CacheConfig(
        block_size=args.block_size,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        swap_space_blocks=swap_space_blocks(spec, args, kv_dtype),
    )
    return Scheduler(sched_config, cache_config, num_blocks)


def structured_output_manager(
    tokenizer: PreTrainedTokenizerBase | None,
    vocab_size: int,
    eos: frozenset[int],
    args: EngineArgs,
    device: torch.device,
) -> StructuredOutputManager | None:
    """The structured-output manager, or None without a tokenizer or xgrammar (requests with
    structured_outputs are then refused with a message saying why). The backend itself is built
    on the first constrained request, so engines that never see one pay nothing."""
    if tokenizer is None or not backend_available():
        return None

    def make_backend() -> StructuredOutputBackend:
        from pagedserve.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, sorted(eos))

    return StructuredOutputManager(
        make_backend, max_rollback_tokens=args.num_speculative_tokens, pin_memory=device.type == "cuda"
    )


def async_scheduling_choice(requested: bool | None, platform: LoadedPlatform, drafts: bool) -> bool:
    """Whether the engine schedules ahead (see `engine.step_pipeline`): as requested, else on for
    accelerator platforms. Logs the choice."""
    on = requested if requested is not None else platform.info.device_type != "cpu"
    if not on:
        logger.info("asynchronous scheduling off: every step is scheduled after the previous one's samples")
    elif drafts:
        logger.info(
            "asynchronous scheduling on, but every step runs synchronously: n-gram drafts are "
            "proposed from each step's sampled tokens"
        )
    else:
        logger.info("asynchronous scheduling on: step N+1 is scheduled while step N runs")
    return on


def eos_token_ids(hf_config: object, tokenizer_eos: int | None) -> frozenset[int]:
    """Every id that ends a sequence: the config's (one or a list) and the tokenizer's."""
    ids: set[int] = set()
    config_eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif isinstance(config_eos, list | tuple):
        ids.update(int(e) for e in config_eos)
    if tokenizer_eos is not None:
        ids.add(int(tokenizer_eos))
    return frozenset(ids)
