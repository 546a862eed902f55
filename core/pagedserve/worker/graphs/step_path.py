"""Which forward one step runs: the one decider, `step_path`, over the step's attention metadata and
the `PathPlan` of what start-up built.

The paths, tried in this order, each only where start-up built it (`graph_modes.plan_graphs`):

1. `full_decode` — a decode batch (every request one new token) no larger than the largest full
   decode graph, whose longest sequence fits the graphs' last bucket (`full_cuda_graphs`), and,
   for a step that cascades (a shared prefix read once), whose size was captured with cascade;
2. `full_mixed` — any other step the mixed-step graphs hold: its padded token count has a graph,
   its requests fit that graph's, and the backend plans it as it planned the capture
   (`full_mixed_graphs`); steps of prompt chunks only stay off these graphs when the backend
   reads the step's new keys and values (its prefill kernel plans from host query lengths);
   a step that cascades never does (those graphs are captured without it);
3. `piecewise` — a step whose token count fits the piecewise graphs' ladder (`cuda_graphs`);
4. `compiled` — a step the compiled forward takes: any step on a GPU (`gpu_compile`), steps of at
   most 32 tokens on a CPU (`cpu_compile`);
5. `eager` — the model's own forward, for everything else.

Everything here is pure data and pure functions: the runner's step executor (`step_forward`) asks
`step_path` once per step, and the graphs check the step they are handed with it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.graphs.cuda_graphs import padded_size

StepPath = Literal["full_decode", "full_mixed", "piecewise", "compiled", "eager"]

GraphKey = Callable[[AttentionMetadata], Hashable]  # a step's metadata -> the plan of the whole forward


@dataclass(frozen=True, slots=True)
class DecodeGraphCover:
    """The decode batches the full decode graphs replay."""

    sizes: tuple[int, ...]  # ascending padded request counts with a graph; non-empty
    max_seq_len: int  # the last sequence-length bucket: no graph was planned for longer sequences
    # Padded request counts captured a second time for cascade steps (plugin API 1.16): a cascade
    # step's attention is other launches, so it replays only a graph captured with them.
    cascade_sizes: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class MixedGraphCover:
    """The mixed steps the full mixed-step graphs replay."""

    sizes: tuple[int, ...]  # ascending padded token counts with a graph (each >= 2); non-empty
    max_num_seqs: int  # the graph of T tokens holds min(T, max_num_seqs) requests
    max_seq_len: int  # the capture's max_seq_len bound (the engine's max_model_len)
    prompt_steps_elsewhere: bool  # steps of prompt chunks only keep the backend's own path
    graph_key: GraphKey = field(compare=False)  # the backend's plan of a step (host-only)
    capture_keys: Mapping[int, Hashable] = field(compare=False)  # padded num_tokens -> plan of its capture

    def num_reqs_of(self, size: int) -> int:
        """The padded request count of the graph of `size` tokens. Pure."""
        return min(size, self.max_num_seqs)


@dataclass(frozen=True, slots=True)
class PathPlan:
    """What each path serves, as start-up built it; a path start-up did not build is None / empty."""

    full_decode: DecodeGraphCover | None = None
    full_mixed: MixedGraphCover | None = None
    piecewise_sizes: tuple[int, ...] = ()  # ascending padded token counts with piecewise graphs
    compiled: bool = False  # a compiled forward exists
    compiled_max_tokens: int | None = None  # with `compiled`: the largest step it takes; None: any


EAGER = PathPlan()
"""The plan of a runner without graphs or a compiled forward: every step runs eagerly."""


def step_path(step: AttentionMetadata, plan: PathPlan) -> StepPath:
    """The path of one step (module docstring). Reads the metadata's host fields only; asks the
    backend's plan (`MixedGraphCover.graph_key`, host-only) only for a step a mixed-step graph
    could otherwise replay. Pure."""
    tokens, reqs = step.num_actual_tokens, step.num_reqs
    decode = step.max_query_len == 1 and tokens == reqs
    full = plan.full_decode
    if decode:
        size = padded_size(full.sizes, reqs) if full is not None else None
        if (
            full is not None
            and size is not None
            and step.max_seq_len <= full.max_seq_len
            and (step.cascade is None or size in full.cascade_sizes)
        ):
            return "full_decode"
    # Mixed-step graphs are captured without cascade: piecewise graphs run a cascading mixed step.
    elif plan.full_mixed is not None and step.cascade is None and _mixed_graph_replays(step, plan.full_mixed):
        return "full_mixed"
    if padded_size(plan.piecewise_sizes, tokens) is not None:
        return "piecewise"
    if plan.compiled and (plan.compiled_max_tokens is None or tokens <= plan.compiled_max_tokens):
        return "compiled"
    return "eager"


def _mixed_graph_replays(step: AttentionMetadata, cover: MixedGraphCover) -> bool:
    """Whether a step that is not a decode batch replays a mixed-step graph. Pure."""
    size = padded_size(cover.sizes, step.num_actual_tokens)
    if size is None or step.num_reqs > cover.num_reqs_of(size) or step.max_seq_len > cover.max_seq_len:
        return False
    if cover.prompt_steps_elsewhere and _shortest_query(step) > 1:
        return False
    return cover.graph_key(step) == cover.capture_keys[size]


def _shortest_query(step: AttentionMetadata) -> int:
    """The shortest query of the step, from the host twin of `query_start_loc`. Pure."""
    starts = step.query_start_loc_cpu.numpy()
    return int(np.diff(starts[: step.num_reqs + 1]).min())
