"""Turning `EngineArgs` into a running engine core: platform, model, backend, KV cache, scheduler.

Every choice made here is logged, because a user whose engine is slow or out of memory needs to
know which platform, backend, dtype and KV-cache size they got.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from pagedserve.config import CacheConfig, EngineArgs, SchedulerConfig
from pagedserve.engine.core import EngineCore
from pagedserve.engine.ngram_proposer import NgramProposer
from pagedserve.models.loader import LoadedModel, load_model, load_tokenizer
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import AttentionBackend, UnsupportedCase
from pagedserve.platforms.loaded_platform import LoadedPlatform
from pagedserve.platforms.registry import load_platforms
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.structured.backend import StructuredOutputBackend
from pagedserve.structured.checks import backend_available
from pagedserve.structured.manager import StructuredOutputManager
from pagedserve.worker.cpu_compile import compile_reason
from pagedserve.worker.cuda_graphs import default_graph_sizes, eager_reason
from pagedserve.worker.kv_sizing import kv_block_bytes, num_kv_blocks_for
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.profile import profile_activation_bytes

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """What was chosen, for logs, `LLM` attributes and tests."""

    platform: LoadedPlatform
    loaded: LoadedModel
    backend: AttentionBackend
    tokenizer: PreTrainedTokenizerBase | None  # None with skip_tokenizer_init
    eos_token_ids: frozenset[int]
    max_model_len: int
    num_kv_blocks: int
    core: EngineCore


def resolve_dtype(name: str, platform: LoadedPlatform, quantization: str | None = None) -> torch.dtype:
    """`"auto"` is float32 on CPU platforms (CPUs are slow at half precision) and bfloat16 on
    accelerators, and with packed 4-bit weights (whose kernels take bfloat16); an explicit dtype
    must be one the platform supports."""
    supported = platform.info.supported_dtypes
    if name == "auto":
        cpu = platform.info.device_type == "cpu"
        dtype = torch.float32 if cpu and quantization is None else torch.bfloat16
    else:
        dtype = _DTYPES[name]
    if dtype not in supported:
        raise ValueError(
            f"dtype {name!r} is not supported by platform {platform.name!r}; it supports "
            f"{', '.join(str(d).removeprefix('torch.') for d in supported)}"
        )
    return dtype


def choose_backend(platform: LoadedPlatform, spec: ModelSpec, block_size: int) -> AttentionBackend:
    """The platform's first attention backend that declares support for this model's shapes."""
    reasons = []
    for cls in platform.attention_backends():
        backend = cls()
        try:
            backend.check_supported(
                head_size=spec.head_size,
                dtype=spec.dtype,
                block_size=block_size,
                # Any sliding layer needs window support, even if other layers attend fully.
                sliding_window=next((w for w in spec.sliding_windows if w is not None), None),
                logit_softcap=spec.logit_softcap,
            )
        except UnsupportedCase as exc:
            reasons.append(str(exc))
            continue
        return backend
    raise ValueError(
        f"no attention backend of platform {platform.name!r} supports this model "
        f"(head_size={spec.head_size}, dtype={spec.dtype}, block_size={block_size}): " + "; ".join(reasons)
    )


def build_engine(args: EngineArgs) -> EngineSetup:
    """Select the platform, load the model and build the engine core. Slow (loads weights)."""
    platform = load_platforms().select(args.platform)
    device = platform.device
    dtype = resolve_dtype(args.dtype, platform, args.quantization)
    logger.info("platform %s (%s), dtype %s", platform.name, platform.availability.reason, dtype)
    loaded = load_model(
        args.model,
        gguf_file=args.gguf_file,
        dtype=dtype,
        device=device,
        load_format=args.load_format,  # type: ignore[arg-type]  # validated by EngineArgs' pattern
        seed=args.seed,
        quantization=args.quantization,
    )
    spec = loaded.spec
    max_model_len = _max_model_len(args, spec)
    backend = choose_backend(platform, spec, args.block_size)
    cache_ops = platform.cache_ops()
    max_batched = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs)
    if not args.enable_chunked_prefill:
        max_batched = max(max_batched, max_model_len)
    num_blocks = args.num_kv_blocks or num_kv_blocks_for(
        spec,
        args,
        device=device,
        max_model_len=max_model_len,
        profile_activation_bytes=lambda: profile_activation_bytes(
            loaded.model,
            backend,
            cache_ops,
            num_tokens=max_batched,
            num_reqs=min(args.max_num_seqs, max(1, max_batched // 256)),
            block_size=args.block_size,
            device=device,
        ),
    )
    min_blocks = -(-max_model_len // args.block_size)
    if num_blocks < min_blocks and args.num_kv_blocks is None:
        raise ValueError(
            f"only {num_blocks} KV blocks fit in memory but one max_model_len={max_model_len} request "
            f"needs {min_blocks}: lower max_model_len or free memory"
        )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB), attention backend %s",
        num_blocks,
        args.block_size,
        num_blocks * args.block_size,
        num_blocks * kv_block_bytes(spec, args.block_size) / 2**20,
        backend.name,
    )
    sched_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        preemption_mode=args.preemption_mode,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    swap_blocks = int(args.swap_space_gib * 2**30 // kv_block_bytes(spec, args.block_size))
    cache_config = CacheConfig(
        block_size=args.block_size,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        swap_space_blocks=swap_blocks,
    )
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer or loaded.source)
    eos = eos_token_ids(loaded.hf_config, tokenizer.eos_token_id if tokenizer is not None else None)
    runner = ModelRunner(
        loaded.model,
        backend,
        cache_ops,
        num_kv_blocks=num_blocks,
        block_size=args.block_size,
        max_num_reqs=args.max_num_seqs,
        max_model_len=max_model_len,
        eos_token_ids=eos,
        device=device,
        seed=args.seed,
    )
    if swap_blocks:
        runner.allocate_swap_space(swap_blocks)
    eager_why = eager_reason(device, spec, args.enforce_eager)
    if eager_why is None:
        runner.capture_cuda_graphs(list(default_graph_sizes(max_batched, args.cuda_graph_max_tokens)))
    else:
        logger.info("CUDA graphs off (every step runs eagerly): %s", eager_why)
    not_compiled_why = compile_reason(device, spec, args.cpu_compile, args.enforce_eager)
    if not_compiled_why is None:
        runner.compile_forward()
    elif args.cpu_compile:
        logger.warning("cpu_compile=True has no effect: %s", not_compiled_why)
    scheduler = Scheduler(sched_config, cache_config, num_blocks)
    proposer = NgramProposer(args.num_speculative_tokens) if args.num_speculative_tokens else None
    structured = structured_output_manager(tokenizer, spec.vocab_size, eos, args, device)
    core = EngineCore(
        scheduler, runner, max_model_len=max_model_len, proposer=proposer, structured=structured
    )
    return EngineSetup(platform, loaded, backend, tokenizer, eos, max_model_len, num_blocks, core)


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


def _max_model_len(args: EngineArgs, spec: ModelSpec) -> int:
    trained = spec.max_position_embeddings
    if args.max_model_len is None:
        return min(trained or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
    if trained is not None and args.max_model_len > trained:
        logger.warning(
            "max_model_len=%d is longer than the model's trained context (%d): quality may degrade",
            args.max_model_len,
            trained,
        )
    return args.max_model_len


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
