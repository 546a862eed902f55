"""Building one device's model runner from its loaded model (`device_model`) and the engine's
resolved configs: the KV cache and swap pool, then the forwards (CUDA graphs, a compiled forward)
built over that cache, then the runner, given all of them at construction.

The in-process engine calls these once; under tensor parallelism every rank's worker process calls
the same functions, so a rank is set up exactly as a single device would be. What is decided here
depends on the device, the loaded model or its attention backend, never on how the options were
given.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from pagedserve.config import CacheConfig, ForwardConfig, SchedulerConfig
from pagedserve.lora.manager import LoRAManager
from pagedserve.platforms.kv_cache_dtype import is_fp8
from pagedserve.quantization.kv_scales import kv_scales_for_cache
from pagedserve.worker.cascade_step import CascadeSteps
from pagedserve.worker.compile.cpu_compile import CompiledForward, compile_reason
from pagedserve.worker.compile.saved_compiles import saved_compiles_dir
from pagedserve.worker.graphs.graph_modes import GraphTarget, StepLimits, plan_graphs
from pagedserve.worker.kv_caches import KVCaches
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.startup.attention_sweep import attention_warmup_threads
from pagedserve.worker.startup.device_model import DeviceModel
from pagedserve.worker.startup.kv_sizing import kv_block_bytes, num_kv_blocks_for
from pagedserve.worker.startup.profile import profile_activation_bytes
from pagedserve.worker.startup.warmup import build_step_forward
from pagedserve.worker.startup_times import StartupTimes
from pagedserve.worker.step_forward import StepForward
from pagedserve.worker.target_hidden import TargetHidden

logger = logging.getLogger(__name__)


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
    lora: LoRAManager | None = None,
    forward_listener: Callable[[TargetHidden], None] | None = None,
) -> ModelRunner:
    """The model runner of this device: KV cache, swap pool, and CUDA graphs or a compiled forward
    where they apply, each built before the runner and given to it. `seed`: the sampler's, for
    unseeded requests (`ModelConfig.seed`); `lora`: the adapters' slots, with enable_lora. Slow
    (allocates the cache, compiles, captures graphs)."""
    spec = dm.loaded.spec
    kv = KVCaches.allocate(
        spec,
        num_blocks=num_kv_blocks,
        block_size=cache.block_size,
        device=device,
        dtype=dm.kv_cache_dtype,
        scales=kv_scales_for_cache(dm.loaded.model, spec.num_layers, is_fp8(dm.kv_cache_dtype)),
        num_swap_blocks=swap_space_blocks(dm, cache),
    )
    # Where the engine may cascade (plugin API 1.16): its decode graphs are captured for it too.
    cascade = (
        CascadeSteps.for_engine(spec, dm.backend, kv.layers[0].dtype, cache.block_size)
        if forward.cascade_attention
        else None
    )
    min_reqs = cascade.model.min_requests if cascade is not None else None
    step_forward, startup_times = _step_forward(dm, kv, forward, scheduler, device, tensor_parallel, min_reqs)
    return ModelRunner(
        dm.loaded.model,
        dm.backend,
        dm.cache_ops,
        kv=kv,
        max_num_reqs=scheduler.max_num_seqs,
        max_model_len=scheduler.max_model_len,
        eos_token_ids=eos_token_ids,
        device=device,
        seed=seed,
        new_kv_reads=dm.new_kv_reads,
        forward=step_forward,
        lora=lora,
        startup_times=startup_times,
        forward_listener=forward_listener,
        cascade=cascade,
    )


def _step_forward(
    dm: DeviceModel,
    kv: KVCaches,
    forward: ForwardConfig,
    scheduler: SchedulerConfig,
    device: torch.device,
    tensor_parallel: bool,
    cascade_min_reqs: int | None,
) -> tuple[StepForward, StartupTimes | None]:
    """The forwards this device serves with: on CUDA, the CUDA graphs (and GPU compile) `forward`
    asks for and the device and backend support, with what getting them ready cost; elsewhere
    the compiled CPU forward where it applies, or the model alone (the log says why)."""
    graph_plan = plan_graphs(forward, GraphTarget.of(device, dm.loaded.spec, dm.backend, dm.cache_ops))
    if device.type == "cuda":
        return build_step_forward(
            dm,
            kv,
            graph_plan,
            StepLimits.of(scheduler, forward),
            attention_warmup_threads=attention_warmup_threads(
                forward.attention_warmup_threads, dm.backend, os.cpu_count()
            ),
            cascade_min_reqs=cascade_min_reqs,
        )
    logger.info("no CUDA graphs: %s", graph_plan.describe())
    compiled = _compiled_cpu_forward(dm, kv, forward, device, tensor_parallel)
    return StepForward(dm.loaded.model, compiled=compiled), None


def _compiled_cpu_forward(
    dm: DeviceModel, kv: KVCaches, forward: ForwardConfig, device: torch.device, tensor_parallel: bool
) -> CompiledForward | None:
    """The CPU forward compiled for small steps (`cpu_compile`) and warmed up over `kv`, where it
    applies; None otherwise, with a warning when `cpu_compile=True` was asked for but cannot
    apply, so the setting is not silently ignored. Slow (compiles several graphs unless they were
    saved before)."""
    not_compiled_why = compile_reason(device, dm.loaded.spec, forward.cpu_compile, forward.enforce_eager)
    if not_compiled_why is None and tensor_parallel:
        # The CPU compilation (`cpu_compile`) swaps attention for its own hook and drops guards;
        # it has not been checked with the all-reduce operator inside, so ranks stay eager.
        not_compiled_why = "tensor_parallel_size > 1 runs eagerly on CPUs"
    if not_compiled_why is not None:
        if forward.cpu_compile:
            logger.warning("cpu_compile=True has no effect: %s", not_compiled_why)
        return None
    compiled = CompiledForward(dm.loaded.model, saved_compiles_dir() if forward.compile_cache else None)
    compiled.warm_up(kv.layers, dm.backend, dm.cache_ops)
    return compiled
