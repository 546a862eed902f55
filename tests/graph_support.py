"""What the graph tests share: a graph plan from a mode and a handful of overrides (the forward's
options and what the device, model and backend allow), without building an engine."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedserve.config import ForwardConfig
from pagedserve.config.forward import CudaGraphMode
from pagedserve.models.spec import ModelSpec
from pagedserve.worker.graphs.graph_modes import GraphPlan, GraphTarget, plan_graphs

CUDA = torch.device("cuda", 0)


def forward_config(mode: str = "full", **overrides: Any) -> ForwardConfig:
    """The forward options of a default engine, in `mode`, with `overrides` (ForwardConfig fields)."""
    config = ForwardConfig(
        enforce_eager=False,
        cudagraph_mode=CudaGraphMode.parse(mode),
        cuda_graph_max_tokens=2048,
        gpu_compile=True,
        cascade_attention=False,
        gpu_compile_scope="layer",
        cpu_compile=False,
        compile_cache=False,
        attention_warmup_threads=None,
        platform_linear=True,
        programmatic_launch=False,
        attention_reads_new_kv=False,
    )
    return dataclasses.replace(config, **overrides)


def plan(mode: str, spec: ModelSpec, **overrides: Any) -> GraphPlan:
    """`plan_graphs` for `mode` on a CUDA device whose backend and cache ops support every graph
    kind but the mixed-step one; `overrides` name ForwardConfig or GraphTarget fields."""
    targets = {f.name for f in dataclasses.fields(GraphTarget)}
    native = spec.implementation == "native"
    target = GraphTarget(CUDA, native_model=native, backend_supports_full=True, cache_ops_skip_padding=True)
    target = dataclasses.replace(target, **{k: v for k, v in overrides.items() if k in targets})
    forward = forward_config(mode, **{k: v for k, v in overrides.items() if k not in targets})
    return plan_graphs(forward, target)


def runner_with(llm: Any, forward: Any) -> Any:
    """Put a model runner with `forward` (a `StepForward`, its parts real or stand-ins) in place of
    the one `llm`'s engine core built: the same model, backend, KV cache and limits. Returns the
    new runner; the engine must step synchronously (no step pipeline holds the old one)."""
    from pagedserve.worker.kv_caches import KVCaches
    from pagedserve.worker.model_runner import ModelRunner

    core = llm.engine.core
    assert core.pipeline is None, "a step pipeline holds the old runner"
    old = core.runner
    runner = ModelRunner(
        old.model,
        old.backend,
        old.cache_ops,
        kv=KVCaches(old.kv_caches, old.block_size, old.kv_scales, old.swap_caches),
        max_num_reqs=old.batch.max_num_reqs,
        max_model_len=old.batch.max_model_len,
        eos_token_ids=old.extra_eos_ids,
        device=old.device,
        new_kv_reads=old.new_kv_reads,
        forward=forward,
        lora=old.lora,
    )
    core.runner = runner
    return runner
