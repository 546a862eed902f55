"""Which CUDA graphs and compilation an engine gets (`cudagraph_mode`), and which path a step takes.

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
Everything here is pure: the engine set-up and the model runner call it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pagedserve.models.spec import ModelSpec
from pagedserve.worker.graphs.cuda_graphs import padded_size


class CudaGraphMode(enum.Enum):
    NONE = "none"
    PIECEWISE = "piecewise"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"
    FULL = "full"


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


def plan_graphs(
    mode: str,
    *,
    enforce_eager: bool,
    gpu_compile: bool,
    device: torch.device,
    programmatic_launch: bool = False,
    spec: ModelSpec,
    backend_supports_full: bool,
    cache_ops_skip_padding: bool,
    backend_supports_full_mixed: bool = False,
    compile_scope: Literal["layer", "model"] = "layer",
) -> GraphPlan:
    """Turn the engine options into what is built. Raises ValueError for an unknown mode. Pure."""
    try:
        wanted = CudaGraphMode(mode)
    except ValueError:
        names = ", ".join(m.value for m in CudaGraphMode)
        raise ValueError(f"cudagraph_mode={mode!r} is not one of {names}") from None
    if enforce_eager:
        why = "enforce_eager=True turns off CUDA graphs, compilation and the kernel warm-up"
        return GraphPlan(False, False, False, (why,), warm_up_kernels=False)
    if device.type != "cuda":
        return GraphPlan(
            False, False, False, (f"the device is {device.type}, not CUDA",), warm_up_kernels=False
        )
    if spec.implementation != "native":
        # transformers models may sync with the host or branch on tensor values inside their
        # forward; a capture would fail or, worse, freeze one branch. Native models do neither.
        why = "the model runs through the transformers fallback, which is neither capture-safe nor traceable"
        return GraphPlan(False, False, False, (why,))
    notes: list[str] = []
    if not gpu_compile:
        notes.append("gpu_compile=False")
    piecewise = wanted in (CudaGraphMode.PIECEWISE, CudaGraphMode.FULL_AND_PIECEWISE, CudaGraphMode.FULL)
    full = wanted in (CudaGraphMode.FULL_DECODE_ONLY, CudaGraphMode.FULL_AND_PIECEWISE, CudaGraphMode.FULL)
    mixed = wanted is CudaGraphMode.FULL
    if full and not (backend_supports_full and cache_ops_skip_padding):
        missing = []
        if not backend_supports_full:
            missing.append("the attention backend does not declare supports_full_cuda_graph")
        if not cache_ops_skip_padding:
            missing.append("the cache ops do not declare skips_negative_slots")
        fallback = "piecewise graphs only" if piecewise else "no graphs"
        notes.append(f"cudagraph_mode={wanted.value}: {' and '.join(missing)}, so {fallback}")
        full = mixed = False
    if mixed and not backend_supports_full_mixed:
        why = "the attention backend does not declare supports_full_cuda_graph_mixed"
        notes.append(f"cudagraph_mode=full: {why}, so mixed steps replay piecewise graphs")
        mixed = False
    if wanted is CudaGraphMode.NONE:
        notes.append("cudagraph_mode=none")
    programmatic = programmatic_launch and gpu_compile
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
        compile_scope=compile_scope,
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


StepPath = Literal["full", "piecewise", "eager"]


def step_path(
    num_tokens: int,
    num_reqs: int,
    max_query_len: int,
    *,
    full_sizes: Sequence[int],  # ascending request counts with a full graph; empty: none
    piecewise_sizes: Sequence[int],  # ascending token counts with piecewise graphs; empty: none
) -> StepPath:
    """Which forward one step runs. A decode batch (every request one new token) replays the full
    graph of the smallest captured size that holds it; any other step, or a decode batch larger
    than every full graph, replays piecewise graphs when its token count fits their ladder, and
    otherwise runs the forward directly. Pure."""
    decode = max_query_len == 1 and num_tokens == num_reqs
    if decode and full_sizes and padded_size(full_sizes, num_reqs) is not None:
        return "full"
    if piecewise_sizes and padded_size(piecewise_sizes, num_tokens) is not None:
        return "piecewise"
    return "eager"
