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
checking several hundred parameters on every call would cost more than it saves. Each model is
compiled through a code object of its own (`_entry_of`), so that without those guards a graph
traced for another model of the process never runs for this one.

Saved graphs (`compile_cache=True`, opt-in). Even with inductor's cache warm, a start re-runs
dynamo's tracing, which is most of its compile time. So each size class's graph is compiled ahead
of time (`aot_compile`) and saved whole under the compile cache root
(`pagedserve.worker.compile.saved_compiles`); a later start with the same model, code and torch loads it
instead: a 32-layer model's start took 11-14 s instead of 24-27 s (docs/benchmarks.md, CPU). The
engine picks the graph by step size itself (`size_class`); each graph's guards (torch's, module
guards included) are checked at warm-up and at the first step of each token count.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.models.packed_int4 import MAX_PACKED_ROWS
from pagedserve.models.spec import ModelSpec, PagedCausalLM
from pagedserve.platforms.api import AttentionBackend, CacheOps
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.compile.saved_compiles import CompiledFn, GraphOrigin, graph_key, load_or_compile

logger = logging.getLogger(__name__)

# Past a few dozen tokens the steps' GEMMs dwarf the per-operator overhead compiling removes.
MAX_COMPILED_TOKENS = 32
# Step sizes whose graphs cover every compiled step: dynamo specialises one token, then compiles
# one graph over a range of token counts; a model with packed weights branches on the count
# (`packed_int4.MAX_PACKED_ROWS`), which splits that range in two, and the largest size lands in
# the second part.
WARM_UP_SIZES = (1, 2, MAX_COMPILED_TOKENS)


def size_class(num_tokens: int) -> int:
    """Index into `WARM_UP_SIZES` of the graph that runs a step of `num_tokens` tokens when the
    graphs are compiled ahead of time: one token, up to `MAX_PACKED_ROWS`, more. Pure."""
    if num_tokens == 1:
        return 0
    return 1 if num_tokens <= MAX_PACKED_ROWS else 2


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

    # The largest step it runs (`graphs.step_path`): longer steps run the model eagerly.
    max_tokens: ClassVar[int | None] = MAX_COMPILED_TOKENS

    def __init__(self, model: PagedCausalLM, saved_dir: Path | None = None) -> None:
        """`saved_dir`: the folder of saved graphs (`saved_compiles`), each size class's graph
        compiled ahead of time at `warm_up` and loaded from there when saved before; None: one
        `torch.compile` of the module whose graphs dynamo makes on first use."""
        options: dict[str, str | int | bool | Callable[..., Any]] = {}
        skip_module_guards = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
        if skip_module_guards is not None:
            options["guard_filter_fn"] = skip_module_guards
        self.saved_dir = saved_dir
        self.model = model
        # One graph per entry of `WARM_UP_SIZES` once `warm_up` ran (ahead-of-time path only).
        self._graphs: list[CompiledFn] = []
        self._checked_sizes: set[int] = set()  # token counts whose guards were checked
        self._eager_sizes: set[int] = set()  # token counts a saved graph's guards refused
        self.origins: list[GraphOrigin] = []  # how each graph became ready, for logs and tests
        self._forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
        if saved_dir is None:
            self._forward = torch.compile(_entry_of(model), fullgraph=True, options=options)
        else:
            self._forward = self._run_saved

    def _run_saved(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        graph = self._graphs[size_class(num_tokens)]
        if num_tokens not in self._checked_sizes:
            # Guards depend on the inputs' shapes and types, which the engine builds the same way
            # at every step: checked once per token count, not at every call (a millisecond per
            # forward of a 32-layer model, most of it on the parameters').
            if not graph.guard_check(self.model, input_ids, positions):  # type: ignore[attr-defined]
                # A saved graph cannot recompile; serving goes on eagerly for this size rather than
                # failing the request.
                logger.warning(
                    "the saved compiled forward does not accept %d-token steps; they run eagerly",
                    num_tokens,
                )
                self._eager_sizes.add(num_tokens)
            self._checked_sizes.add(num_tokens)
        if num_tokens in self._eager_sizes:
            eager: torch.Tensor = self.model(input_ids, positions)
            return eager
        out: torch.Tensor = graph(self.model, input_ids, positions)
        return out

    def _warm_call(self, ids: torch.Tensor, graph: CompiledFn) -> None:
        graph(self.model, ids, ids.clone())

    def _aot_compile(self, ids: torch.Tensor) -> CompiledFn:
        # torch's own guard filter for saved graphs: skipping the module guards as `__init__` does
        # saves guards that refer to module attributes never recorded, and the file then fails to
        # load. specialize_float: otherwise dynamo restarts its analysis to turn float scalars
        # into tensors, and an ahead-of-time compile cannot restart.
        with torch._dynamo.config.patch(specialize_float=True):
            compiler = torch.compile(type(self.model).forward, fullgraph=True, dynamic=True)
            return compiler.aot_compile(((self.model, ids, ids.clone()), {}))  # type: ignore[attr-defined]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden_size]. Mutates the KV caches of
        the open forward context, as the model does (compiles first when this token count is new)."""
        return self._forward(input_ids, positions)

    @torch.inference_mode()  # as `ModelRunner.execute`, so that the graphs match its steps
    def warm_up(self, kv_caches: list[torch.Tensor], backend: AttentionBackend, cache_ops: CacheOps) -> None:
        """Compile every graph now (`WARM_UP_SIZES`), or load it from `saved_dir`, with attention
        answered by zeros (the KV caches are not touched). Slow: tens of seconds per graph unless
        a saved graph or inductor's disk cache holds it. Records `origins`; saves new graphs."""
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
                    if self.saved_dir is None:
                        self(ids, ids.clone())
                        origin = GraphOrigin(size, "compiled", time.perf_counter() - start)
                    else:
                        key = graph_key(self.model, spec, device.type, f"tokens-class-{size}")
                        path = self.saved_dir / f"{key}.pt2"
                        graph, origin = load_or_compile(
                            path,
                            size,
                            partial(self._aot_compile, ids),
                            partial(self._warm_call, ids),
                        )
                        graph.disable_guard_check()  # type: ignore[attr-defined]  # see `_run_saved`
                        self._graphs.append(graph)
                        self._checked_sizes.add(size)
            except Exception as exc:  # inductor's failures have many types; all mean the same here
                first_line = (str(exc).strip().splitlines() or [""])[0]
                raise RuntimeError(
                    f"cpu_compile=True: compiling the {spec.architecture} forward for {size}-token steps "
                    f"failed ({type(exc).__name__}: {first_line}). "
                    "torch.compile's CPU backend needs a working C++ compiler (gcc or clang on PATH); "
                    "start without cpu_compile to run eagerly"
                ) from exc
            self.origins.append(origin)
            logger.info(
                "%s the %s forward for %d-token steps in %.1f s%s",
                origin.how,
                spec.architecture,
                size,
                origin.seconds,
                "" if self.saved_dir is None else f" (saved graphs: {self.saved_dir})",
            )


def _entry_of(model: PagedCausalLM) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A function calling `model` whose code object belongs to this model alone. Dynamo keeps its
    compiled graphs per code object and, with the module guards skipped, would run a graph traced
    for another model of the same class in this process (one without LoRA layers, say, whose
    weights sit elsewhere) on this one; a code object of its own keeps their graphs apart."""

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(input_ids, positions)
        return out

    code = forward.__code__.replace()  # a new code object: a cache of its own
    return types.FunctionType(code, forward.__globals__, forward.__name__, None, forward.__closure__)


def zero_attention(
    layer_idx: int,
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    sinks: torch.Tensor | None = None,  # [num_q_heads]: ignored, as everything attention reads
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_size]
    """Attention stand-in for warm-up forwards: the compiled graph is the same whatever attention
    returns, and a warm-up must not write the KV cache. Pure."""
    return torch.zeros_like(query)
