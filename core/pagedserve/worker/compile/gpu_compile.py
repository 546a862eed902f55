"""`gpu_compile=True` (default on GPUs): the forward compiled by inductor, attention left to the backend.

Why. Between two attention calls a decoder layer is a chain of small memory-bound operators:
RMSNorm with the residual add, the rotary embedding, the SiLU-times-up of the MLP, views and
casts. Eagerly each one reads and writes its whole activation; inductor fuses each chain into one
or two Triton kernels, so a step moves less memory and launches fewer kernels, and the CUDA graphs
captured from the compiled code (piecewise and full) replay the fused kernels.

What is compiled (`gpu_compile_scope`). By default ("layer") each stretch of the forward between
two attention calls (`PagedCausalLM.regional_forward`: the embedding, a layer's norm, projections
and rotary up to attention, its output projection and MLP after it, the final norm), each once,
as a function of the layer it reads: torch.compile lifts the layer's parameters to inputs, so the
graph traced for one layer runs every layer, and the attention between them runs as the platform
wrote it. A 32-layer model then compiles about as fast as a 1-layer one, where a whole-model
trace ("model") grows with the depth (on a CPU, a 32-layer model's regions compile in 35 s on
empty caches; 16 layers compiled whole took 78 s). The residual add each layer ends with is
carried into the next layer's norm (`DecoderLayer`), so the stretches fuse what a whole-model
graph fuses. Between stretches the host runs a few lines of Python per layer; CUDA graphs
replay them away, and steps too large for a graph are bound by their matrix products.
Models without regions (the transformers fallback) and "model" compile the whole forward
(`fullgraph=True`), attention being the opaque operator `torch.ops.pagedserve.paged_attention`
(`pagedserve.attention.layer`), as for `cpu_compile`. Either way the token count is dynamic, so
one graph serves every step size (dynamo specialises a one-token step, a second graph).

Programmatic dependent launches (`programmatic_launch`, NVIDIA sm_90+). Steps of at most
`PROGRAMMATIC_MAX_TOKENS` tokens run a second compilation whose kernels inductor launches so
that each is set up while the previous one drains, as the platform's linear-layer kernels are
(`LinearKernel.dependent_op`): a one-request decode step is about ten kernels per layer, and the
gap between two of them is otherwise idle. Longer steps keep the plain compilation (see the
constant for why). The second compilation costs start-up time once, then inductor's disk cache.

Cold start. Compiling an 8B model's forward takes tens of seconds; `warm_up` pays it at engine
start (before any capture, which cannot compile) and inductor's and Triton's caches on disk
(`configure_compile_caches`) bring a later start down to seconds.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.models.spec import PagedCausalLM
from pagedserve.platforms.api import AttentionBackend, CacheOps
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.compile.cpu_compile import zero_attention
from pagedserve.worker.compile.saved_compiles import compile_cache_root

logger = logging.getLogger(__name__)

# Token counts whose graphs cover every step: dynamo specialises 1, then one dynamic graph for >= 2.
WARM_UP_SIZES = (2, 1)
# Steps of at most this many tokens run the forward compiled for programmatic dependent launches
# (`programmatic_launch`); longer ones a compilation without. Measured on an H100 (8B shapes, FP8
# weights, 256-request workload): with every step's kernels launched that way, steps of 1, 2-8
# and 9-32 requests took 0.10, 0.11 and 0.08 ms less, 33-128 the same, and 129-256 0.6 ms more
# (the pointwise kernels after cuBLAS's products, launched early, ran about twice as long).
PROGRAMMATIC_MAX_TOKENS = 16
# Compiled entries dynamo may keep per code object. A model adds two per compilation to each code
# object it compiles (the one-token specialisation and the dynamic graph), twice with programmatic
# launches, and a layer's first stretch has two forms (the first layer has no residual yet): up to
# eight per model; a process may build engines of several shapes (tests, benchmarks).
RECOMPILE_LIMIT = 256


def configure_compile_caches(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Point inductor's and Triton's on-disk caches at a persistent directory unless the user
    chose one (`TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`): `$PAGEDSERVE_CACHE_DIR`, else
    `$XDG_CACHE_HOME/pagedserve`, else `~/.cache/pagedserve` (beside the cuda platform's cubin
    cache). Inductor's own default lives under /tmp, which a reboot empties. Returns variable ->
    directory in effect. Mutates `environ` (default: `os.environ`)."""
    env: Any = os.environ if environ is None else environ
    root = compile_cache_root(env)
    chosen = {}
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        if not env.get(var):
            env[var] = str(root / sub)
        chosen[var] = env[var]
    return chosen


def programmatic_options() -> dict[str, str | int | bool | Callable[..., Any]] | None:
    """`torch.compile` options that make inductor's kernels programmatic dependent launches
    (`triton.enable_pdl`: each waits on the device for the previous kernel before its first
    dependent access and lets the next launch after its last load; NVIDIA sm_90+), or None when
    this torch's inductor has no such option. Pure."""
    from torch._inductor import config as inductor_config  # imported by torch.compile anyway

    return {"triton.enable_pdl": True} if hasattr(inductor_config.triton, "enable_pdl") else None


Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _no_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


def _compiled_forward(
    model: PagedCausalLM, scope: Literal["layer", "model"], options: dict[str, Any] | None
) -> Forward:
    """`model`'s forward compiled with inductor `options`: region by region where `scope` is
    "layer" and the model has regions, else whole. Compiles lazily (at the first call)."""

    def compile_region(fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, fullgraph=True, dynamic=True, options=options)

    regional = model.regional_forward(compile_region) if scope == "layer" else None
    if regional is not None:
        return regional
    whole: Forward = torch.compile(model, fullgraph=True, dynamic=True, options=options)
    return whole


class GpuCompiledForward:
    """The model forward compiled by inductor for every step size, on a GPU.

    Call it inside an open forward context, exactly like the model."""

    # Every step runs compiled (`graphs.step_path`): the graph is dynamic in the token count.
    max_tokens: ClassVar[int | None] = None

    def __init__(
        self,
        model: PagedCausalLM,
        *,
        programmatic_launch: bool = False,
        scope: Literal["layer", "model"] = "layer",
    ) -> None:
        # Dynamo's guards on the model stay (unlike `cpu_compile`): graphs are cached per code
        # object, so without them a second model of the same class in the process (another
        # window size, say) could run the first one's graph. They cost about a millisecond per
        # call, and graph replays do not call the compiled forward at all.
        # Dynamo keeps its compiled entries per code object, and all native models share the
        # decoder's `forward`: each model in the process adds its own entries (the one-token
        # specialisation and the dynamic one, or three with programmatic launches), so a process
        # that builds several engines (tests, benchmarks, one model per window size) would pass
        # dynamo's default of 8 and fail.
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        self._forward = _compiled_forward(model, scope, None)
        # A second compilation for short steps (dynamo keeps the two apart: different backends).
        options = programmatic_options() if programmatic_launch else None
        self._short = None if options is None else _compiled_forward(model, scope, options)
        self.model = model
        self.scope: Literal["layer", "model"] = (
            scope if model.regional_forward(_no_compile) is not None else "model"
        )

    @property
    def programmatic(self) -> bool:
        """Whether steps of at most `PROGRAMMATIC_MAX_TOKENS` tokens run programmatic launches."""
        return self._short is not None

    def warm_up_sizes(self) -> tuple[int, ...]:
        """Token counts whose graphs cover every step: dynamo specialises 1, then one dynamic
        graph for >= 2; with programmatic launches both for short steps and one dynamic graph
        for the longer ones. Pure."""
        return WARM_UP_SIZES + ((PROGRAMMATIC_MAX_TOKENS + 1,) if self.programmatic else ())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden_size]. Mutates the KV caches of
        the open forward context, as the model does."""
        if self._short is not None and input_ids.shape[0] <= PROGRAMMATIC_MAX_TOKENS:
            return self._short(input_ids, positions)
        return self._forward(input_ids, positions)

    @torch.inference_mode()  # as `ModelRunner.execute`, so that the graphs match its steps
    def warm_up(self, kv_caches: list[torch.Tensor], backend: AttentionBackend, cache_ops: CacheOps) -> float:
        """Compile every graph now (`warm_up_sizes`) with attention answered by zeros (the KV
        caches are not touched). Returns the seconds it took. Slow on a cold cache."""
        device = kv_caches[0].device
        spec = self.model.spec
        start = time.perf_counter()
        for size in self.warm_up_sizes():
            metadata = AttentionMetadata.build(
                query_lens=[1] * size,
                seq_lens=[1] * size,
                block_table=torch.zeros(size, 1, dtype=torch.int32),
                block_size=kv_caches[0].shape[2],
                device=device,
            )
            ctx = ForwardContext(metadata, kv_caches, backend, cache_ops, attention_hook=zero_attention)
            with torch.inference_mode(False):
                # Ordinary tensors, like the runner's and the graphs' input buffers: dynamo's
                # guards tell inference tensors apart, and a mismatch would recompile later.
                ids = torch.zeros(size, dtype=torch.long, device=device)
                positions = torch.zeros(size, dtype=torch.long, device=device)  # distinct: no alias
            try:
                with forward_context(ctx):
                    self(ids, positions)
            except Exception as exc:  # inductor's failures have many types; all mean the same here
                first_line = (str(exc).strip().splitlines() or [""])[0]
                raise RuntimeError(
                    f"gpu_compile=True: compiling the {spec.architecture} forward for {size}-token steps "
                    f"failed ({type(exc).__name__}: {first_line}); start with gpu_compile=False "
                    "(--no-gpu-compile) to run the forward uncompiled"
                ) from exc
        torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        logger.info(
            "compiled the %s forward (torch.compile, %s scope, dynamic token count) in %.1f s",
            spec.architecture,
            self.scope,
            elapsed,
        )
        return elapsed
