"""Loading one device's model: its weights (one rank's shard under tensor parallelism), its layers
routed onto the platform's kernels, and the attention backend chosen for it.

The in-process engine calls these once; under tensor parallelism every rank's worker process calls
the same functions. Each takes the configs of the concerns it reads (`pagedserve.config`), already
resolved.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedserve.config import CacheConfig, ForwardConfig, ModelConfig
from pagedserve.distributed.group import TensorParallelGroup
from pagedserve.models.decoder import DecoderForCausalLM
from pagedserve.models.loader import LoadedModel, load_model
from pagedserve.models.platform_linear import route_linear_layers, route_lm_head
from pagedserve.models.spec import ModelSpec, PagedCausalLM
from pagedserve.moe.layer import route_moe_layers
from pagedserve.platforms.api import AttentionBackend, CacheOps, UnsupportedCase
from pagedserve.platforms.errors import PlatformError
from pagedserve.platforms.kv_cache_dtype import resolve_kv_cache_dtype
from pagedserve.platforms.loaded_platform import LoadedPlatform
from pagedserve.platforms.registry import load_platforms
from pagedserve.worker.compile.gpu_compile import PROGRAMMATIC_MAX_TOKENS, configure_compile_caches
from pagedserve.worker.graphs.graph_modes import no_programmatic_launch

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
        trust_remote_code=model.trust_remote_code,
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
