"""Building one device's model runner from the engine's resolved configs: its model (one rank's
shard under tensor parallelism), attention backend, KV-cache size, swap pool, CUDA graphs or
compiled forward.

The in-process engine calls these once; under tensor parallelism every rank's worker process calls
the same functions, so a rank is set up exactly as a single device would be. Each function takes
the configs of the concerns it reads (`pagedserve.config`), already resolved: what is decided here
depends on the device, the loaded model or its attention backend, never on how the options were
given.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedserve.config import CacheConfig, ForwardConfig, ModelConfig, SchedulerConfig
from pagedserve.distributed.group import TensorParallelGroup
from pagedserve.models.decoder import DecoderForCausalLM
from pagedserve.models.loader import LoadedModel, load_model
from pagedserve.models.platform_linear import route_linear_layers, route_lm_head
from pagedserve.models.spec import ModelSpec, PagedCausalLM
from pagedserve.moe.layer import route_moe_layers
from pagedserve.platforms.api import AttentionBackend, CacheOps, UnsupportedCase
from pagedserve.platforms.errors import PlatformError
from pagedserve.platforms.kv_cache_dtype import is_fp8, resolve_kv_cache_dtype
from pagedserve.platforms.loaded_platform import LoadedPlatform
from pagedserve.platforms.registry import load_platforms
from pagedserve.quantization.kv_scales import kv_scales_for_cache
from pagedserve.worker.attention_sweep import attention_warmup_threads
from pagedserve.worker.cascade_step import CascadeSteps
from pagedserve.worker.cpu_compile import compile_reason
from pagedserve.worker.gpu_compile import PROGRAMMATIC_MAX_TOKENS, configure_compile_caches
from pagedserve.worker.graph_modes import no_programmatic_launch, plan_graphs
from pagedserve.worker.kv_sizing import kv_block_bytes, num_kv_blocks_for
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.profile import profile_activation_bytes
from pagedserve.worker.saved_compiles import saved_compiles_dir
from pagedserve.worker.warmup import prepare_runner

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """A model loaded on one device, with what was chosen for it."""

    platform: LoadedPlatform
    loaded: LoadedModel  # under tensor parallelism: this rank's shard (its spec has local head counts)
    backend: AttentionBackend
    cache_ops: CacheOps
    kv_cache_dtype: torch.dtype  # the model's dtype, or an FP8 dtype (`kv_cache_dtype` option)
    new_kv_reads: bool = False  # the backend takes the step's new keys and values (API 1.7)


def choose_backend(
    platform: LoadedPlatform, spec: ModelSpec, block_size: int, kv_cache_dtype: str = "auto"
) -> tuple[AttentionBackend, torch.dtype]:
    """The platform's first attention backend that declares support for this model's shapes and
    the requested KV-cache dtype (and attention sinks, where the model has them), with the cache
    dtype that name means for it."""
    reasons = []
    for cls in platform.attention_backends():
        backend = cls()
        if spec.attention_sinks and not backend.capabilities.attention_sinks:
            # Asked of the capabilities, not of check_supported: a backend of plugin API < 1.13 may
            # override check_supported without the `attention_sinks` keyword.
            reasons.append(f"{backend.name}: attention sinks are not supported")
            continue
        try:
            cache_dtype = resolve_kv_cache_dtype(
                kv_cache_dtype,
                spec.dtype,
                backend.capabilities.kv_cache_dtypes,
                where=f"platform {platform.name!r}, attention backend {backend.name!r}",
            )
            # Backends of plugin API 1.0 may override check_supported without `kv_cache_dtype`.
            extra: dict[str, Any] = {"kv_cache_dtype": cache_dtype} if cache_dtype != spec.dtype else {}
            if spec.attention_sinks:
                extra["attention_sinks"] = True  # a declaring backend is of API 1.13 or later
            backend.check_supported(
                head_size=spec.head_size,
                dtype=spec.dtype,
                block_size=block_size,
                # Any sliding layer needs window support, even if other layers attend fully.
                sliding_window=next((w for w in spec.sliding_windows if w is not None), None),
                logit_softcap=spec.logit_softcap,
                **extra,
            )
        except (UnsupportedCase, ValueError) as exc:
            reasons.append(str(exc))
            continue
        return backend, cache_dtype
    sinks_hint = ""
    if spec.attention_sinks and not any(
        cls.capabilities.attention_sinks for cls in platform.attention_backends()
    ):
        sinks_hint = (
            f". {spec.architecture} adds attention sinks to every softmax (plugin API 1.13), which no "
            f"backend of platform {platform.name!r} computes; platforms whose backends do: "
            f"{_sink_backends()} (choose one with the `platform` option)"
        )
    raise ValueError(
        f"no attention backend of platform {platform.name!r} supports this model "
        f"(head_size={spec.head_size}, dtype={spec.dtype}, block_size={block_size}, "
        f"kv_cache_dtype={kv_cache_dtype!r}"
        + (", attention sinks" if spec.attention_sinks else "")
        + "): "
        + "; ".join(reasons)
        + sinks_hint
    )


def _sink_backends() -> str:
    """The installed platforms and their backends declaring attention sinks, for an error message:
    "triton (triton_unified), cpu_reference (cpu_fast, cpu_reference)", or a note that none does.
    Asks every installed plugin for its backends (only on this error path)."""
    found = []
    for other in load_platforms().platforms():
        try:
            names = [cls.name for cls in other.attention_backends() if cls.capabilities.attention_sinks]
        except PlatformError:
            continue  # a platform without backends here: it declares nothing
        if names:
            found.append(f"{other.name} ({', '.join(names)})")
    return ", ".join(found) if found else "none among the installed platforms"


def load_device_model(
    model: ModelConfig,
    cache: CacheConfig,
    forward: ForwardConfig,
    platform: LoadedPlatform,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
) -> DeviceModel:
    """Load the model (this rank's shard when `tp` has several ranks) on `device` and pick its
    attention backend. Slow (reads weights)."""
    logger.info("platform %s (%s), dtype %s", platform.name, platform.availability.reason, model.dtype)
    if device.type == "cuda":
        configure_compile_caches()  # before anything JIT-compiles, so every kernel lands on disk
    load_start = time.perf_counter()
    loaded = load_model(
        model.model,
        gguf_file=model.gguf_file,
        dtype=model.dtype,
        device=device,
        load_format=model.load_format,
        seed=model.seed,
        quantization=model.quantization,
        tp=tp,
        quantize_lm_head=model.quantize_lm_head,
    )
    logger.info("model loaded in %.1f s", time.perf_counter() - load_start)
    programmatic = _programmatic(forward, device)
    if forward.platform_linear and device.type == "cuda":
        _route_linear_layers(loaded.model, platform, model.dtype, programmatic)
    _route_moe_layers(loaded.model, platform)
    _route_int_weight_layers(loaded.model, platform)
    backend, kv_dtype = choose_backend(platform, loaded.spec, cache.block_size, cache.kv_cache_dtype)
    cache_ops = platform.cache_ops()
    if programmatic:
        _launch_attention_programmatically(backend, cache_ops)
    new_kv_reads = forward.attention_reads_new_kv and backend.enable_new_kv_reads()
    if forward.attention_reads_new_kv:
        how = "read from the step's projections where the backend chooses" if new_kv_reads else "cache only"
        logger.info("attention: new tokens' keys and values %s", how)
    return DeviceModel(platform, loaded, backend, cache_ops, kv_dtype, new_kv_reads=new_kv_reads)


def _launch_attention_programmatically(backend: AttentionBackend, cache_ops: CacheOps) -> None:
    """Ask the attention backend and the cache ops (API 1.6) to launch the kernels of the steps
    the compiled forward launches programmatically (`PROGRAMMATIC_MAX_TOKENS`) the same way, so a
    decode step's chain of kernels is programmatic from one product to the next. Mutates both."""
    answers = {
        "attention": backend.enable_programmatic_launch(PROGRAMMATIC_MAX_TOKENS),
        "cache writes": cache_ops.enable_programmatic_launch(PROGRAMMATIC_MAX_TOKENS),
    }
    for what, enabled in answers.items():
        how = "programmatic dependent launches" if enabled else "plain launches (the plugin has none)"
        logger.info("%s: %s for steps of <= %d tokens", what, how, PROGRAMMATIC_MAX_TOKENS)


def _programmatic(forward: ForwardConfig, device: torch.device) -> bool:
    """Whether the linear layers take the platform's programmatic-dependent-launch operator: asked
    for, and the kernels between them are launched that way too (the compiled forward, which
    `plan_graphs` gives them; alone, the products were measured slower)."""
    asked = forward.programmatic_launch and forward.compiles_gpu_forward
    return asked and no_programmatic_launch(device) is None


def _route_linear_layers(
    model: PagedCausalLM, platform: LoadedPlatform, dtype: torch.dtype, programmatic: bool
) -> None:
    """Run the decoder's linear layers on the platform's `LinearKernel`, if it has one, through
    its programmatic-dependent-launch operator when `programmatic` and it offers one. Mutates
    `model`."""
    kernel = platform.linear_kernel()
    if kernel is None or not isinstance(model, DecoderForCausalLM):
        return
    if programmatic and kernel.dependent_op is not None:
        name = f"{kernel.name}, programmatic dependent launches"
        silu_gate = kernel.dependent_silu_gate_op or kernel.silu_gate_op
        kernel = replace(kernel, name=name, op=kernel.dependent_op, silu_gate_op=silu_gate)
    routed = route_linear_layers(model.model, kernel, dtype) + int(route_lm_head(model, kernel, dtype))
    logger.info("linear layers: %d on %s", routed, kernel.name)


def _route_moe_layers(model: PagedCausalLM, platform: LoadedPlatform) -> None:
    """Run the model's mixture-of-experts blocks on the platform's `MoEKernel` where it takes
    them, else on the core's torch formulation. Mutates `model`."""
    kernel = platform.moe_kernel()
    routed, fallback = route_moe_layers(model, kernel)
    if routed and kernel is not None:
        logger.info("MoE layers: %d on %s", routed, kernel.name)
    if fallback:
        logger.info("MoE layers: the others on %s (the platform's kernel does not take them)", fallback)


def _route_int_weight_layers(model: PagedCausalLM, platform: LoadedPlatform) -> None:
    """Run a quantized checkpoint's integer-weight layers on the platform's `IntLinearKernel`
    where it takes them, else on the core's formulation. Mutates `model`."""
    from pagedserve.quantization.int_linear import route_int_weight_layers

    kernel = platform.int_linear_kernel()
    routed, left = route_int_weight_layers(model, kernel)
    if routed and kernel is not None:
        logger.info("integer-weight layers: %d on %s", routed, kernel.name)
    if left:
        logger.info("integer-weight layers: %d on the core's dequantize-then-multiply formulation", left)


def fit_kv_blocks(
    dm: DeviceModel, cache: CacheConfig, scheduler: SchedulerConfig, device: torch.device
) -> int:
    """How many KV blocks this device holds: `num_kv_blocks` when it was given, else what fits in
    its memory by `cache`'s rules (on a GPU after profiling the largest step). The engine agrees
    on one size for every device (`CacheConfig.agreed_blocks`)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks  # asked for exactly: nothing to measure
    budget = scheduler.max_num_batched_tokens
    return num_kv_blocks_for(
        dm.loaded.spec,
        cache,
        device=device,
        profile_activation_bytes=lambda: profile_activation_bytes(
            dm.loaded.model,
            dm.backend,
            dm.cache_ops,
            num_tokens=budget,
            num_reqs=min(scheduler.max_num_seqs, max(1, budget // 256)),
            block_size=cache.block_size,
            device=device,
        ),
        kv_cache_dtype=dm.kv_cache_dtype,
    )


def swap_space_blocks(dm: DeviceModel, cache: CacheConfig) -> int:
    """Blocks of this device's CPU swap pool (`swap_space_gib`; per rank under tensor parallelism)."""
    return cache.swap_blocks(kv_block_bytes(dm.loaded.spec, cache.block_size, dm.kv_cache_dtype))


def build_runner(
    dm: DeviceModel,
    device: torch.device,
    *,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    forward: ForwardConfig,
    seed: int,
    num_kv_blocks: int,
    eos_token_ids: frozenset[int],
    tensor_parallel: bool = False,
) -> ModelRunner:
    """The model runner of this device: KV cache, swap pool, and CUDA graphs or a compiled forward
    where they apply. `seed`: the sampler's, for unseeded requests (`ModelConfig.seed`). Slow
    (allocates the cache, captures graphs)."""
    spec = dm.loaded.spec
    runner = ModelRunner(
        dm.loaded.model,
        dm.backend,
        dm.cache_ops,
        num_kv_blocks=num_kv_blocks,
        block_size=cache.block_size,
        max_num_reqs=scheduler.max_num_seqs,
        max_model_len=scheduler.max_model_len,
        eos_token_ids=eos_token_ids,
        device=device,
        kv_cache_dtype=dm.kv_cache_dtype,
        kv_scales=kv_scales_for_cache(dm.loaded.model, spec.num_layers, is_fp8(dm.kv_cache_dtype)),
        seed=seed,
        new_kv_reads=dm.new_kv_reads,
    )
    if forward.cascade_attention:
        runner.cascade = CascadeSteps.for_engine(
            spec, dm.backend, runner.kv_caches[0].dtype, cache.block_size
        )
    swap_blocks = swap_space_blocks(dm, cache)
    if swap_blocks:
        runner.allocate_swap_space(swap_blocks)
    _prepare_graphs(runner, dm, forward, scheduler, device)
    _compile_cpu_forward(runner, spec, forward, device, tensor_parallel)
    return runner


def _prepare_graphs(
    runner: ModelRunner,
    dm: DeviceModel,
    forward: ForwardConfig,
    scheduler: SchedulerConfig,
    device: torch.device,
) -> None:
    """Capture the CUDA graphs (and compile the GPU forward) that `forward` asks for and the device
    and backend support; on other devices, log why there are none."""
    graph_plan = plan_graphs(
        forward.cudagraph_mode,
        enforce_eager=forward.enforce_eager,
        # Under tensor parallelism too: the all-reduce is an opaque operator (`distributed.all_reduce`).
        gpu_compile=forward.gpu_compile,
        device=device,
        programmatic_launch=forward.programmatic_launch,
        spec=dm.loaded.spec,
        backend_supports_full=dm.backend.supports_full_cuda_graph,
        cache_ops_skip_padding=dm.cache_ops.skips_negative_slots,
        backend_supports_full_mixed=dm.backend.supports_full_cuda_graph_mixed,
        compile_scope=forward.gpu_compile_scope,
    )
    if device.type == "cuda":
        runner.startup_times = prepare_runner(
            runner,
            graph_plan,
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            max_model_len=scheduler.max_model_len,
            cuda_graph_max_tokens=forward.cuda_graph_max_tokens,
            attention_warmup_threads=attention_warmup_threads(
                forward.attention_warmup_threads, dm.backend, os.cpu_count()
            ),
        )
    else:
        logger.info("no CUDA graphs: %s", graph_plan.describe())


def _compile_cpu_forward(
    runner: ModelRunner, spec: ModelSpec, forward: ForwardConfig, device: torch.device, tensor_parallel: bool
) -> None:
    """Compile the runner's CPU forward where it applies; warn when `cpu_compile=True` was asked
    for but cannot apply, so the setting is not silently ignored."""
    not_compiled_why = compile_reason(device, spec, forward.cpu_compile, forward.enforce_eager)
    if not_compiled_why is None and tensor_parallel:
        # The CPU compilation (`cpu_compile`) swaps attention for its own hook and drops guards;
        # it has not been checked with the all-reduce operator inside, so ranks stay eager.
        not_compiled_why = "tensor_parallel_size > 1 runs eagerly on CPUs"
    if not_compiled_why is None:
        runner.compile_forward(saved_compiles_dir() if forward.compile_cache else None)
    elif forward.cpu_compile:
        logger.warning("cpu_compile=True has no effect: %s", not_compiled_why)
