"""The forwards a step can run, built at start-up and handed to the model runner whole: the model's
eager forward, a compiled forward, and the captured piecewise, full decode and full mixed-step
CUDA graphs. `StepForward.run` asks the one decider (`graphs.step_path.step_path`) which of them
serves a step, and runs it.

Start-up (`startup.warmup.build_step_forward`, `startup.runner_setup`) builds every part before
the runner exists; the runner only replaces its `StepForward` with `without_graphs()` when its
graphs are dropped."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.models.spec import PagedCausalLM
from pagedserve.worker.compile.cpu_compile import CompiledForward
from pagedserve.worker.compile.gpu_compile import GpuCompiledForward
from pagedserve.worker.graphs.cuda_graphs import PiecewiseCudaGraphs
from pagedserve.worker.graphs.full_cuda_graphs import FullDecodeGraphs
from pagedserve.worker.graphs.full_mixed_graphs import FullMixedGraphs
from pagedserve.worker.graphs.step_path import PathPlan, step_path


@dataclass(frozen=True, slots=True)
class StepForward:
    """One device's forwards; None: that path was not built (`graph_modes.plan_graphs` says why).
    The graphs are captured and the compiled forward warmed up before this is made."""

    model: PagedCausalLM  # the eager forward, for every step no other path serves
    compiled: CompiledForward | GpuCompiledForward | None = None  # `cpu_compile` or `gpu_compile`
    full_decode: FullDecodeGraphs | None = None
    full_mixed: FullMixedGraphs | None = None
    piecewise: PiecewiseCudaGraphs | None = None
    plan: PathPlan = field(init=False)  # what each path serves, read off the parts

    def __post_init__(self) -> None:
        compiled = self.compiled
        plan = PathPlan(
            full_decode=None if self.full_decode is None else self.full_decode.cover,
            full_mixed=None if self.full_mixed is None else self.full_mixed.cover,
            piecewise_sizes=() if self.piecewise is None else self.piecewise.sizes,
            compiled=compiled is not None,
            compiled_max_tokens=None if compiled is None else compiled.max_tokens,
        )
        object.__setattr__(self, "plan", plan)  # derived once: the parts never change

    def run(
        self,
        ctx: ForwardContext,  # the step's: its metadata, the KV caches, the backend
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden_size]; a graph's output is valid until its next replay
        """The model forward of one step, on the path `step_path` picks. Mutates the KV caches (the
        step's new keys and values), and the graphs' buffers when one replays."""
        metadata = ctx.metadata
        path = step_path(metadata, self.plan)
        # Each path below exists: `plan` names only the parts that were built.
        if path == "full_decode":
            assert self.full_decode is not None
            return self.full_decode.run(metadata, input_ids, positions)
        if path == "full_mixed":
            assert self.full_mixed is not None
            return self.full_mixed.run(metadata, input_ids, positions)
        if path == "piecewise":
            assert self.piecewise is not None
            return self.piecewise.run(ctx, input_ids, positions)
        forward = self.compiled if path == "compiled" and self.compiled is not None else self.model
        with forward_context(ctx):
            hidden: torch.Tensor = forward(input_ids, positions)
        return hidden

    def without_graphs(self) -> StepForward:
        """The same forwards with every CUDA graph gone: later steps run compiled or eagerly. Pure."""
        return dataclasses.replace(self, full_decode=None, full_mixed=None, piecewise=None)
