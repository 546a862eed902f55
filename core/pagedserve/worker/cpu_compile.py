"""Compiled forwards for small CPU steps (`cpu_compile=True`).

Why. Decoding one stream of a small model on a CPU is mostly per-operator overhead: a layer of
SmolLM2-135M runs about sixty torch calls (norms, rotary, residual adds, the MLP's activation,
views) around its four weight GEMVs, each paying Python and dispatcher costs that are larger than
its arithmetic. `torch.compile` (inductor's C++ backend) fuses the elementwise work into a few
loops per layer and replaces the module calls with one generated function for the whole forward.

What is compiled. The model's forward, whole (`fullgraph=True`), for steps of at most
`MAX_COMPILED_TOKENS` tokens: decode steps and small mixed steps, where that overhead dominates;
bigger steps (prefill) are matmul-bound and run eagerly. Attention is not compiled: under
compilation each call is the opaque operator `torch.ops.pagedserve.paged_attention`
(`pagedserve.attention.layer`), which runs the platform's backend eagerly with this step's
metadata. So the compiled graph depends on the token count only, like a piecewise CUDA graph.

Costs. Compiling needs a C++ compiler and takes tens of seconds per graph on a small machine
(three graphs at most: one token, a few tokens, more than the packed-weight row limit); inductor
caches the result on disk, so later processes load it in seconds. `warm_up` pays it at engine
start instead of on the first request. Guards on the model's modules and parameters are skipped
(`skip_guard_on_all_nn_modules_unsafe`): the engine never changes the model after loading, and
checking several hundred parameters on every call would cost more than it saves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.models.spec import ModelSpec, PagedCausalLM
from pagedserve.platforms.api import AttentionBackend, CacheOps

logger = logging.getLogger(__name__)

# Past a few dozen tokens the steps' GEMMs dwarf the per-operator overhead compiling removes.
MAX_COMPILED_TOKENS = 32
# Step sizes whose graphs cover every compiled step: dynamo specialises one token, then compiles
# one graph over a range of token counts; a model with packed weights branches on the count
# (`packed_int4.MAX_PACKED_ROWS`), which splits that range in two, and the largest size lands in
# the second part.
WARM_UP_SIZES = (1, 2, MAX_COMPILED_TOKENS)


def compile_reason(
    device: torch.device, spec: ModelSpec, cpu_compile: bool, enforce_eager: bool
) -> str | None:
    """Why this engine does not compile its forward, or None when it does. Pure."""
    if not cpu_compile:
        return "cpu_compile=False"
    if enforce_eager:
        return "enforce_eager=True"
    if device.type != "cpu":
        return f"the device is {device.type}; compiled forwards are for CPU platforms (GPUs use CUDA graphs)"
    if spec.implementation != "native":
        # transformers' modeling code may branch on tensor values or break the graph; native
        # models are written to trace whole.
        return "the model runs through the transformers fallback, which does not compile as one graph"
    return None


class CompiledForward:
    """The model forward compiled by inductor, for steps of at most `MAX_COMPILED_TOKENS` tokens.

    Call it inside an open forward context, exactly like the model. Holds the compiled callable;
    inductor's code and on-disk cache are torch's."""

    def __init__(self, model: PagedCausalLM) -> None:
        options: dict[str, str | int | bool | Callable[..., Any]] = {}
        skip_module_guards = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
        if skip_module_guards is not None:
            options["guard_filter_fn"] = skip_module_guards
        self._forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.compile(
            model, fullgraph=True, options=options
        )
        self.model = model

    @staticmethod
    def fits(num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs compiled. Pure."""
        return num_tokens <= MAX_COMPILED_TOKENS

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden_size]. Mutates the KV caches of
        the open forward context, as the model does (compiles first when this token count is new)."""
        return self._forward(input_ids, positions)

    @torch.inference_mode()  # as `ModelRunner.execute`, so that the graphs match its steps
    def warm_up(self, kv_caches: list[torch.Tensor], backend: AttentionBackend, cache_ops: CacheOps) -> None:
        """Compile every graph now (`WARM_UP_SIZES`), with attention answered by zeros (the KV
        caches are not touched). Slow: tens of seconds per graph unless inductor's disk cache
        already holds it."""
        device = kv_caches[0].device
        spec = self.model.spec
        for size in WARM_UP_SIZES:
            metadata = AttentionMetadata.build(
                query_lens=[1] * size,
                seq_lens=[1] * size,
                block_table=torch.zeros(size, 1, dtype=torch.int32),
                block_size=kv_caches[0].shape[2],
                device=device,
            )
            ctx = ForwardContext(metadata, kv_caches, backend, cache_ops, attention_hook=zero_attention)
            ids = torch.zeros(size, dtype=torch.long, device=device)
            start = time.perf_counter()
            try:
                with forward_context(ctx):
                    self(ids, ids.clone())
            except Exception as exc:  # inductor's failures have many types; all mean the same here
                first_line = (str(exc).strip().splitlines() or [""])[0]
                raise RuntimeError(
                    f"cpu_compile=True: compiling the {spec.architecture} forward for {size}-token steps "
                    f"failed ({type(exc).__name__}: {first_line}). "
                    "torch.compile's CPU backend needs a working C++ compiler (gcc or clang on PATH); "
                    "start without cpu_compile to run eagerly"
                ) from exc
            logger.info(
                "compiled the %s forward for %d-token steps in %.1f s",
                spec.architecture,
                size,
                time.perf_counter() - start,
            )


def zero_attention(
    layer_idx: int,
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_size]
    """Attention stand-in for warm-up forwards: the compiled graph is the same whatever attention
    returns, and a warm-up must not write the KV cache. Pure."""
    return torch.zeros_like(query)
