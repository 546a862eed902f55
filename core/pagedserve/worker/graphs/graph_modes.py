"""Which CUDA graphs and compilation an engine gets (`cudagraph_mode`), and the step limits they cover.

The modes follow vLLM's names:

* `none` — no graphs; every step runs the (compiled or eager) forward directly.
* `piecewise` — every step up to `cuda_graph_max_tokens` replays piecewise graphs
  (`cuda_graphs`): dense parts as graphs, attention eager between them.
* `full_decode_only` — batches whose requests all have one new token replay one whole graph,
  attention inside (`full_cuda_graphs`); every other step runs without graphs.
* `full_and_piecewise` — full graphs for decode batches, piecewise for the rest.
* `full` (the default) — full graphs for decode batches and for mixed steps (prefill chunks
  beside decodes, `full_mixed_graphs`), piecewise for the rest (steps the mixed graphs do not
  cover; unlike vLLM's `FULL`, which runs those without graphs). On an H200 (8B, 1,000
  ShareGPT-like requests) it cut one GPU's launch time per run from 9.5 to 6.6 s and lifted two
  GPUs from 1.44x to 1.53x one, for 3.6 s more capture and 420 MiB of graph memory.

Full graphs need an attention backend and cache ops that promise to be capturable whole
(`AttentionBackend.supports_full_cuda_graph`, `CacheOps.skips_negative_slots`); without them a
full mode falls back (`full` and `full_and_piecewise` to `piecewise`, `full_decode_only` to
`none`) and the log says why. Mixed-step graphs also need
`AttentionBackend.supports_full_cuda_graph_mixed`; without it `full` is `full_and_piecewise`.
The mode is parsed once, when the engine's config is resolved (`config.forward.CudaGraphMode`);
`plan_graphs` takes that config and what the device, model and backend allow (`GraphTarget`).
Everything here is pure: the runner's start-up calls it. Which path one step then takes is
`step_path.step_path`'s decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pagedserve.config import ForwardConfig, SchedulerConfig
from pagedserve.config.forward import CudaGraphMode
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import AttentionBackend, CacheOps
from pagedserve.worker.graphs.cuda_graphs import default_graph_sizes


@dataclass(frozen=True, slots=True)
class GraphTarget:
    """What the device, the model and its attention backend allow of the graphs and compilation
    `ForwardConfig` asks for: the part of `plan_graphs`' input that is not an option."""

    device: torch.device
    native_model: bool  # a native implementation (capture-safe, traceable), not the transformers fallback
    backend_supports_full: bool  # `AttentionBackend.supports_full_cuda_graph`
    cache_ops_skip_padding: bool  # `CacheOps.skips_negative_slots`
    backend_supports_full_mixed: bool = False  # `AttentionBackend.supports_full_cuda_graph_mixed`

    @classmethod
    def of(
        cls, device: torch.device, spec: ModelSpec, backend: AttentionBackend, cache_ops: CacheOps
    ) -> GraphTarget:
        """The target of one device's loaded model and chosen backend. Pure."""
        return cls(
            device,
            native_model=spec.implementation == "native",
            backend_supports_full=backend.supports_full_cuda_graph,
            cache_ops_skip_padding=cache_ops.skips_negative_slots,
            backend_supports_full_mixed=backend.supports_full_cuda_graph_mixed,
        )


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The largest steps the engine schedules and replays as graphs: the warm-up's sweep and every
    graph ladder are cut from these."""

    max_num_seqs: int  # most requests in one step
    max_num_batched_tokens: int  # most tokens in one step
    max_model_len: int  # longest sequence
    cuda_graph_max_tokens: int  # largest step replayed as CUDA graphs

    @classmethod
    def of(cls, scheduler: SchedulerConfig, forward: ForwardConfig) -> StepLimits:
        return cls(
            scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens,
            scheduler.max_model_len,
            forward.cuda_graph_max_tokens,
        )

    @property
    def request_ladder(self) -> tuple[int, ...]:
        """The padded request counts of the full decode graphs, ascending. Pure."""
        return default_graph_sizes(self.max_num_seqs, self.cuda_graph_max_tokens)

    @property
    def token_ladder(self) -> tuple[int, ...]:
        """The padded token counts of the piecewise (and mixed-step) graphs, ascending. Pure."""
        return default_graph_sizes(self.max_num_batched_tokens, self.cuda_graph_max_tokens)


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """What the engine builds at start: which graph kinds, whether the GPU forward is compiled,
    and why anything asked for is off (for the log)."""

    piecewise: bool  # capture piecewise graphs for steps up to the token ladder's cap
    full_decode: bool  # capture full graphs for decode batches up to the request ladder's cap
    compile: bool  # run the forward's dense parts through torch.compile on the GPU
    notes: tuple[str, ...]  # one sentence per thing requested but off, with the reason
    # JIT the attention kernels at start (`warmup`): on CUDA unless enforce_eager, which asks for
    # the plainest engine (a quick start for debugging)
    warm_up_kernels: bool = True
    # the compiled forward's kernels are programmatic dependent launches (`programmatic_launch`)
    programmatic_launch: bool = False
    # capture full graphs for mixed steps up to the token ladder's cap (`full_mixed_graphs`)
    full_mixed: bool = False
    # what one compilation covers (`gpu_compile.GpuCompiledForward`): a decoder stretch shared by
    # every layer, or the whole forward
    compile_scope: Literal["layer", "model"] = "layer"

    @property
    def captures(self) -> bool:
        """Whether any graph is captured at start. Pure."""
        return self.full_decode or self.full_mixed or self.piecewise

    def describe(self) -> str:
        """One line for the log. Pure."""
        wanted = {"full decode": self.full_decode, "full mixed": self.full_mixed, "piecewise": self.piecewise}
        kinds = [kind for kind, on in wanted.items() if on]
        graphs = " + ".join(kinds) if kinds else "no"
        compiled = f"compiled ({self.compile_scope} scope)" if self.compile else "not compiled"
        text = f"{graphs} CUDA graphs, forward {compiled}"
        if self.compile and self.programmatic_launch:
            text += " (programmatic dependent launches)"
        return text + ("" if not self.notes else " (" + "; ".join(self.notes) + ")")


def plan_graphs(forward: ForwardConfig, target: GraphTarget) -> GraphPlan:
    """What the forward options ask for, as far as `target` allows it. Pure."""
    if forward.enforce_eager:
        why = "enforce_eager=True turns off CUDA graphs, compilation and the kernel warm-up"
        return GraphPlan(False, False, False, (why,), warm_up_kernels=False)
    device = target.device
    if device.type != "cuda":
        return GraphPlan(
            False, False, False, (f"the device is {device.type}, not CUDA",), warm_up_kernels=False
        )
    if not target.native_model:
        # transformers models may sync with the host or branch on tensor values inside their
        # forward; a capture would fail or, worse, freeze one branch. Native models do neither.
        why = "the model runs through the transformers fallback, which is neither capture-safe nor traceable"
        return GraphPlan(False, False, False, (why,))
    mode = forward.cudagraph_mode
    # Under tensor parallelism too: the all-reduce is an opaque operator (`distributed.all_reduce`).
    gpu_compile = forward.gpu_compile
    notes: list[str] = []
    if not gpu_compile:
        notes.append("gpu_compile=False")
    piecewise, full, mixed = mode.piecewise, mode.full_decode, mode.full_mixed
    if full and not (target.backend_supports_full and target.cache_ops_skip_padding):
        missing = []
        if not target.backend_supports_full:
            missing.append("the attention backend does not declare supports_full_cuda_graph")
        if not target.cache_ops_skip_padding:
            missing.append("the cache ops do not declare skips_negative_slots")
        fallback = "piecewise graphs only" if piecewise else "no graphs"
        notes.append(f"cudagraph_mode={mode.value}: {' and '.join(missing)}, so {fallback}")
        full = mixed = False
    if mixed and not target.backend_supports_full_mixed:
        why = "the attention backend does not declare supports_full_cuda_graph_mixed"
        notes.append(f"cudagraph_mode=full: {why}, so mixed steps replay piecewise graphs")
        mixed = False
    if mode is CudaGraphMode.NONE:
        notes.append("cudagraph_mode=none")
    programmatic = forward.programmatic_launch and gpu_compile
    unavailable = no_programmatic_launch(device) if programmatic else None
    if unavailable is not None:
        notes.append(f"programmatic_launch: {unavailable}")
        programmatic = False
    return GraphPlan(
        piecewise,
        full,
        gpu_compile,
        tuple(notes),
        programmatic_launch=programmatic,
        full_mixed=mixed,
        compile_scope=forward.gpu_compile_scope,
    )


def no_programmatic_launch(device: torch.device) -> str | None:
    """Why kernels on `device` cannot be programmatic dependent launches, or None when they can
    (an NVIDIA GPU of compute capability 9.0+)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return "programmatic dependent launches are an NVIDIA GPU feature"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"sm_{major}{minor} has no programmatic dependent launch (sm_90+)"
    return None
