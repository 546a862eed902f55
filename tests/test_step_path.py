"""The one decider of a step's path, `step_path`, on the CPU: a pure function of the step's metadata
(its host fields) and the `PathPlan` of what start-up built; and `StepForward`, which runs the
part it names. Capture and replay on a GPU are in `test_cuda_graphs_gpu.py`."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch

from pagedserve.attention.forward_context import ForwardContext, get_forward_context
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.compile.cpu_compile import MAX_COMPILED_TOKENS
from pagedserve.worker.graphs.cuda_graphs import default_graph_sizes
from pagedserve.worker.graphs.step_path import (
    EAGER,
    DecodeGraphCover,
    MixedGraphCover,
    PathPlan,
    StepPath,
    step_path,
)
from pagedserve.worker.step_forward import StepForward


def _step(query_lens: list[int], context: int = 3) -> AttentionMetadata:
    """A step of these query lengths, each request with `context` tokens before its query."""
    n = len(query_lens)
    table = torch.zeros(n, 64, dtype=torch.int32)
    return AttentionMetadata.build(query_lens, [q + context for q in query_lens], table, 4)


FULL = DecodeGraphCover(default_graph_sizes(8), max_seq_len=64)  # 1, 2, 4, 8 requests
PIECEWISE = default_graph_sizes(64)  # up to 64 tokens


def _mixed(*, elsewhere: bool = False, key: str = "k") -> MixedGraphCover:
    sizes = (2, 4, 8)
    return MixedGraphCover(sizes, 4, 64, elsewhere, lambda md: key, dict.fromkeys(sizes, "k"))


DEFAULT = PathPlan(full_decode=FULL, full_mixed=_mixed(), piecewise_sizes=PIECEWISE)  # cudagraph_mode="full"
AND_PIECEWISE = PathPlan(full_decode=FULL, piecewise_sizes=PIECEWISE)  # full_and_piecewise
DECODE_ONLY = PathPlan(full_decode=FULL)  # full_decode_only
GPU_COMPILED = PathPlan(full_decode=FULL, piecewise_sizes=PIECEWISE, compiled=True)
CPU_COMPILED = PathPlan(compiled=True, compiled_max_tokens=MAX_COMPILED_TOKENS)  # cpu_compile=True


@pytest.mark.parametrize(
    ("query_lens", "plan", "expected"),
    [
        ([1, 1, 1], DEFAULT, "full_decode"),  # decode: padded to the 4-request graph
        ([1] * 8, DEFAULT, "full_decode"),
        ([1] * 9, DEFAULT, "piecewise"),  # larger than every full graph
        ([1] * 9, DECODE_ONLY, "eager"),  # full_decode_only: no piecewise fallback
        ([5, 1, 1], DEFAULT, "full_mixed"),  # a prefill chunk among decodes: 8 tokens, 3 requests
        ([5, 1, 1], AND_PIECEWISE, "piecewise"),  # the same step without mixed graphs
        ([2, 2, 2, 2], AND_PIECEWISE, "piecewise"),  # uniform speculative batch
        ([1, 1, 1, 1, 2], DEFAULT, "piecewise"),  # 6 tokens fit 8, but 5 requests are more than 4
        ([65], DEFAULT, "eager"),  # beyond the piecewise ladder
        ([65], GPU_COMPILED, "compiled"),  # ... which the GPU's compiled forward takes whole
        ([1, 1, 1], PathPlan(piecewise_sizes=PIECEWISE), "piecewise"),  # piecewise mode
        ([1, 1, 1], EAGER, "eager"),  # none, or no GPU
        ([1, 1, 1], CPU_COMPILED, "compiled"),
        ([MAX_COMPILED_TOKENS], CPU_COMPILED, "compiled"),
        ([MAX_COMPILED_TOKENS + 1], CPU_COMPILED, "eager"),  # the CPU compile takes small steps only
    ],
)
def test_step_path(query_lens: list[int], plan: PathPlan, expected: StepPath) -> None:
    assert step_path(_step(query_lens), plan) == expected


def test_a_decode_longer_than_the_last_bucket_replays_no_full_graph() -> None:
    assert step_path(_step([1, 1], context=63), DEFAULT) == "full_decode"  # seq_len 64: the last bucket
    assert step_path(_step([1, 1], context=64), DEFAULT) == "piecewise"


def test_a_mixed_step_the_backend_plans_apart_keeps_its_own_path() -> None:
    assert step_path(_step([5, 1, 1]), PathPlan(full_mixed=_mixed(key="other"))) == "eager"
    # Prompt chunks only, where the backend reads the step's new keys and values: its own path.
    assert step_path(_step([3, 5]), PathPlan(full_mixed=_mixed(elsewhere=True))) == "eager"
    assert step_path(_step([3, 5]), PathPlan(full_mixed=_mixed())) == "full_mixed"


def test_the_backend_plan_is_asked_only_for_a_step_a_mixed_graph_could_replay() -> None:
    asked: list[int] = []

    def key(md: AttentionMetadata) -> Hashable:
        asked.append(md.num_actual_tokens)
        return "k"

    sizes = (2, 4, 8)
    plan = PathPlan(full_mixed=MixedGraphCover(sizes, 4, 64, False, key, dict.fromkeys(sizes, "k")))
    for query_lens in ([1, 1], [9, 1], [5, 1, 1]):  # a decode, too many tokens, one it replays
        step_path(_step(query_lens), plan)
    assert asked == [7]


# ----------------------------------------------------------------------------- running the part
class _Part:
    """A stand-in graph or compiled forward that records it ran; answers zeros."""

    def __init__(self, name: str, log: list[str], **attrs: object) -> None:
        self.name, self.log = name, log
        self.__dict__.update(attrs)

    def run(self, *args: object) -> torch.Tensor:
        self.log.append(self.name)
        return torch.zeros(1)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        get_forward_context()  # compiled and eager forwards run inside the step's context
        return self.run()


def test_step_forward_runs_the_part_step_path_names() -> None:
    log: list[str] = []
    mixed = _mixed()
    forward = StepForward(
        _Part("eager", log),  # type: ignore[arg-type]
        compiled=_Part("compiled", log, max_tokens=64),  # type: ignore[arg-type]
        full_decode=_Part("full_decode", log, cover=FULL),  # type: ignore[arg-type]
        full_mixed=_Part("full_mixed", log, cover=mixed),  # type: ignore[arg-type]
        piecewise=_Part("piecewise", log, sizes=(1, 2, 4, 8, 16)),  # type: ignore[arg-type]
    )
    assert forward.plan == PathPlan(FULL, mixed, (1, 2, 4, 8, 16), compiled=True, compiled_max_tokens=64)
    steps = {
        "full_decode": [1, 1],
        "full_mixed": [5, 1],
        "piecewise": [1] * 9,
        "compiled": [40],
        "eager": [65],
    }
    for query_lens in steps.values():
        ids = torch.zeros(sum(query_lens), dtype=torch.long)
        forward.run(ForwardContext(_step(query_lens), [], None, None), ids, ids)  # type: ignore[arg-type]
    assert log == list(steps)
    bare = forward.without_graphs()
    assert (bare.full_decode, bare.full_mixed, bare.piecewise) == (None, None, None)
    assert bare.plan == PathPlan(compiled=True, compiled_max_tokens=64)
