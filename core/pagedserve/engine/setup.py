"""Turning `EngineArgs` into a running engine core: platform, configuration, model, backend, KV
cache, scheduler.

The order is the one a reader needs: choose the platform, read the model's config, resolve the
options once into the engine's configuration (`config.engine_config`), and only then load the model
(here, or in one worker process per tensor-parallel rank) with the configs each part needs. The KV
cache's size is the one value that comes back from the devices: each measures, and the engine agrees
on one pool by `CacheConfig`'s rules.

Every choice made here is logged, because a user whose engine is slow or out of memory needs to
know which platform, backend, dtype and KV-cache size they got.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from pagedserve.config import EngineArgs
from pagedserve.config.engine_config import EngineConfig, resolve_engine_config
from pagedserve.engine.core import EngineCore
from pagedserve.engine.process_layer_missing import missing
from pagedserve.lora.manager import LoRAManager
from pagedserve.models.loader import (
    LoadedModel,
    ModelSource,
    load_config,
    load_tokenizer,
    resolve_model_source,
)
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import AttentionBackend
from pagedserve.platforms.loaded_platform import LoadedPlatform
from pagedserve.platforms.registry import load_platforms
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.spec_decode.build import build_proposer, load_draft, split_kv_blocks
from pagedserve.spec_decode.ngram import NgramProposer
from pagedserve.spec_decode.proposer import Proposer
from pagedserve.structured.backend import StructuredOutputBackend
from pagedserve.structured.checks import backend_available
from pagedserve.structured.manager import StructuredOutputManager
from pagedserve.worker.startup.device_model import choose_backend, load_device_model
from pagedserve.worker.startup.kv_sizing import kv_block_bytes
from pagedserve.worker.startup.runner_setup import build_runner, fit_kv_blocks, swap_space_blocks
from pagedserve.worker.startup.startup_heap import freeze_startup_heap
from pagedserve.worker.step_runner import ExecutorLauncher, StepRunner, WorkerReport

# Re-exported: it lived here before the per-device half of the setup moved to `worker.startup`.
__all__ = ["EngineSetup", "build_engine", "choose_backend", "eos_token_ids"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """What was chosen, for logs, `LLM` attributes and tests."""

    config: EngineConfig  # what the options resolved to
    platform: LoadedPlatform
    spec: ModelSpec  # of the whole model (head counts unsharded)
    loaded: LoadedModel | None  # None with tensor_parallel_size > 1: the weights live in the ranks
    backend: AttentionBackend
    tokenizer: PreTrainedTokenizerBase | None  # None with skip_tokenizer_init
    eos_token_ids: frozenset[int]
    num_kv_blocks: int
    core: EngineCore
    lora: LoRAManager | None = None  # with enable_lora: the adapters and their slots

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len


def build_engine(
    args: EngineArgs, *, offline: bool, start_executor: ExecutorLauncher | None = None
) -> EngineSetup:
    """Select the platform, resolve the configuration, load the model and build the engine core.
    Slow (loads weights). With `tensor_parallel_size > 1` the model is loaded by one worker
    process per rank, which `start_executor` starts (the process layer's, handed down by the
    caller: `engine.process_layer`); without it such args raise `ProcessLayerMissing` before
    anything loads. `offline`: the engine runs batches handed to it whole (`LLMEngine`), not a
    server's stream of requests; it decides what `scheduling_policy="auto"` means."""
    if args.tensor_parallel_size > 1 and start_executor is None:
        raise missing("tensor_parallel_size", args.tensor_parallel_size, "one worker process per rank")
    platform = load_platforms().select(args.platform)
    source = resolve_model_source(args.model, args.gguf_file)
    # Read before anything loads: the model's trained context decides the default max_model_len,
    # and with it the step budget every device is set up for.
    hf_config = load_config(source, trust_remote_code=args.trust_remote_code)
    config = resolve_engine_config(
        args,
        platform=platform.info,
        trained_context_len=getattr(hf_config, "max_position_embeddings", None),
        offline=offline,
        target_vocab_size=getattr(hf_config, "vocab_size", None),
        draft_vocab_size=_draft_vocab_size(args),
    )
    logger.info("scheduling policy: %s", config.scheduler.policy.value)
    if config.parallel.tensor_parallel_size > 1:
        assert start_executor is not None  # refused above
        return _build_parallel_engine(config, platform, source, hf_config, start_executor)
    return _build_local_engine(config, platform)


def _draft_vocab_size(args: EngineArgs) -> int | None:
    """The vocabulary (in the target's token ids) of `speculative_config`'s draft checkpoint, read
    from its config; None without one. An EAGLE-3 head's own smaller `draft_vocab_size` maps into
    the target's `vocab_size`, which is what must agree."""
    model = (args.speculative_config or {}).get("model")
    if not isinstance(model, str):
        return None
    vocab = getattr(load_config(resolve_model_source(model)), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def _build_local_engine(config: EngineConfig, platform: LoadedPlatform) -> EngineSetup:
    """The scheduler and the model in this process, on the platform's device."""
    device = platform.device
    dm = load_device_model(config.model, config.cache, config.forward, platform, device)
    # Before the KV cache is sized, so that the adapters' slots are counted as used memory.
    lora = (
        LoRAManager(
            dm.loaded.model,
            max_loras=config.lora.max_loras,
            max_rank=config.lora.max_lora_rank,
            max_tokens=config.lora.max_tokens,
            kernel=platform.lora_kernel(),
        )
        if config.lora is not None
        else None
    )
    spec = dm.loaded.spec
    speculative = config.speculative
    draft = None
    if speculative is not None and speculative.uses_draft_model:
        # Before the KV cache is sized: the draft's weights are used memory too.
        draft = load_draft(speculative, config, platform, dm.loaded.model, device)
    measured = fit_kv_blocks(dm, config.cache, config.scheduler, device)
    if draft is not None and speculative is not None:
        target_bytes = kv_block_bytes(spec, config.cache.block_size, dm.kv_cache_dtype)
        max_seqs = config.scheduler.max_num_seqs
        measured = split_kv_blocks(measured, draft, target_bytes, config.cache, speculative, max_seqs)
    num_blocks = config.cache.agreed_blocks([measured])
    _log_kv_cache(config, spec, num_blocks, dm.backend.name, dm.kv_cache_dtype)
    tokenizer = _tokenizer(config, dm.loaded.source)
    eos = eos_token_ids(dm.loaded.hf_config, tokenizer.eos_token_id if tokenizer is not None else None)
    drafter = None
    listener = None
    if draft is not None and speculative is not None:
        drafter, listener = build_proposer(
            draft, speculative, device, num_blocks, config.cache, config.scheduler.max_num_seqs
        )
        if draft.tap is not None:  # EAGLE-3 reads three target layers: the runner runs the tapped target
            dm = dataclasses.replace(dm, loaded=dataclasses.replace(dm.loaded, model=draft.tap))
    runner = build_runner(
        dm,
        device,
        cache=config.cache,
        scheduler=config.scheduler,
        forward=config.forward,
        seed=config.model.seed,
        num_kv_blocks=num_blocks,
        eos_token_ids=eos,
        lora=lora,
        forward_listener=listener,
    )
    scheduler = Scheduler(config.scheduler, config.cache, num_blocks, swap_space_blocks(dm, config.cache))
    core = _engine_core(config, scheduler, runner, tokenizer, spec.vocab_size, eos, device, drafter)
    if config.freeze_startup_heap:
        freeze_startup_heap()
    return EngineSetup(config, platform, spec, dm.loaded, dm.backend, tokenizer, eos, num_blocks, core, lora)


def _build_parallel_engine(
    config: EngineConfig,
    platform: LoadedPlatform,
    source: ModelSource,
    hf_config: Any,
    start_executor: ExecutorLauncher,
) -> EngineSetup:
    """The scheduler here, the model in `tensor_parallel_size` worker processes (or Ray actors)."""
    from pagedserve.distributed.group import TensorParallelGroup
    from pagedserve.distributed.sharding import ShardLayout
    from pagedserve.models.decoder import head_size_of

    # Refuse a model that does not split before starting a process per rank to find out.
    world = config.parallel.tensor_parallel_size
    ShardLayout.for_config(hf_config, TensorParallelGroup(0, world), head_size_of(hf_config))
    executor, reports = start_executor(config, platform)
    cache = config.cache
    try:
        first = reports[0]
        backend, kv_dtype = choose_backend(platform, first.local_spec, cache.block_size, cache.kv_cache_dtype)
        # Every rank sized its cache from its own free memory; all must hold the same block ids.
        num_blocks = cache.agreed_blocks([r.num_kv_blocks for r in reports])
        _log_kv_cache(config, first.local_spec, num_blocks, first.backend_name, kv_dtype)
        tokenizer = _tokenizer(config, source)
        eos = eos_token_ids(hf_config, tokenizer.eos_token_id if tokenizer is not None else None)
        executor.init_cache(num_blocks, eos)
    except BaseException:
        executor.shutdown()
        raise
    num_swap_blocks = cache.swap_blocks(kv_block_bytes(first.local_spec, cache.block_size, kv_dtype))
    scheduler = Scheduler(config.scheduler, cache, num_blocks, num_swap_blocks)
    # Grammars live here, beside the scheduler (a host device: no pinned bitmasks); the ranks
    # receive each constrained step's bitmask.
    vocab_size = first.local_spec.vocab_size
    core = _engine_core(config, scheduler, executor, tokenizer, vocab_size, eos, torch.device("cpu"))
    if config.freeze_startup_heap:
        freeze_startup_heap()  # the driver's; each rank freezes its own after it is ready
    spec = _whole_model_spec(first)
    return EngineSetup(config, platform, spec, None, backend, tokenizer, eos, num_blocks, core)


def _tokenizer(config: EngineConfig, source: ModelSource) -> PreTrainedTokenizerBase | None:
    """The front end's tokenizer: the `tokenizer` option's, else the model's; None with
    `skip_tokenizer_init`."""
    model = config.model
    if model.skip_tokenizer_init:
        return None
    return load_tokenizer(model.tokenizer or source, trust_remote_code=model.trust_remote_code)


def _engine_core(
    config: EngineConfig,
    scheduler: Scheduler,
    runner: StepRunner,  # this device's ModelRunner, or the executor over the ranks
    tokenizer: PreTrainedTokenizerBase | None,
    vocab_size: int,
    eos: frozenset[int],
    grammar_device: torch.device,  # where the structured-output bitmasks are filled for
    drafter: Proposer | None = None,  # a draft network's proposer (`spec_decode.build`), if any
) -> EngineCore:
    """The engine core over `runner`, with the proposer (n-gram lookup, or `drafter`),
    asynchronous scheduling and structured outputs that `config` gives it."""
    drafts = config.scheduler.num_speculative_tokens
    spec = config.speculative
    proposer = drafter
    if spec is not None and spec.method == "ngram":
        proposer = NgramProposer(drafts, max_ngram=spec.prompt_lookup_max, min_ngram=spec.prompt_lookup_min)
    _log_async_scheduling(config.scheduler.async_scheduling, proposer is not None)
    return EngineCore(
        scheduler,
        runner,
        max_model_len=config.scheduler.max_model_len,
        proposer=proposer,
        async_scheduling=config.scheduler.async_scheduling,
        structured=structured_output_manager(tokenizer, vocab_size, eos, drafts, grammar_device),
    )


def _whole_model_spec(report: WorkerReport) -> ModelSpec:
    return dataclasses.replace(
        report.local_spec, num_q_heads=report.num_q_heads, num_kv_heads=report.num_kv_heads
    )


def _log_kv_cache(
    config: EngineConfig, spec: ModelSpec, num_blocks: int, backend_name: str, kv_dtype: torch.dtype
) -> None:
    block_size = config.cache.block_size
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB%s, %s), attention backend %s",
        num_blocks,
        block_size,
        num_blocks * block_size,
        num_blocks * kv_block_bytes(spec, block_size, kv_dtype) / 2**20,
        " per rank" if config.parallel.tensor_parallel_size > 1 else "",
        str(kv_dtype).removeprefix("torch."),
        backend_name,
    )


def _log_async_scheduling(on: bool, drafts: bool) -> None:
    """Say whether the engine schedules ahead (see `engine.step_pipeline`) and, with n-gram
    drafts, that every step still runs synchronously."""
    if not on:
        logger.info("asynchronous scheduling off: every step is scheduled after the previous one's samples")
    elif drafts:
        logger.info(
            "asynchronous scheduling on, but every step runs synchronously: drafts are "
            "proposed from each step's sampled tokens"
        )
    else:
        logger.info("asynchronous scheduling on: step N+1 is scheduled while step N runs")


def structured_output_manager(
    tokenizer: PreTrainedTokenizerBase | None,
    vocab_size: int,
    eos: frozenset[int],
    max_rollback_tokens: int,  # draft tokens a step may reject (`num_speculative_tokens`)
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
        make_backend, max_rollback_tokens=max_rollback_tokens, pin_memory=device.type == "cuda"
    )


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
