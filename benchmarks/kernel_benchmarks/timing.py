"""Timing GPU work for the kernel scripts: CUDA-graph replays (the kernels alone, no launch cost,
as the engine replays its decode steps) and CUDA events over plain launches where a call cannot
be captured. Every kernel script times through these, so their numbers share one method.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def time_graph(fn: Callable[[], object], iters: int = 50) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph (median of 5 rounds)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(rounds)[2]


def time_events(fn: Callable[[], object], iters: int = 50) -> float:
    """Microseconds per call of `fn` from CUDA events over `iters` launches (median of 5 rounds)."""
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(rounds)[2]


def graph_ms(step: Callable[[], None], repeats: int = 7, replays: int = 10) -> float:
    """Milliseconds per replay of `step` captured as one CUDA graph: the best of `repeats` rounds
    of `replays` back-to-back replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # where the warm-up ran: its lazy state is reused
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / replays)
    return best


L2_BYTES = 60 << 20  # more than any current GPU's L2: weight copies beyond it stream from memory
REPEAT = 20  # calls per captured graph in `cycled_graph_us`


def cycled_graph_us(fn: Callable[[int], object], copies: int, repeats: int = 5) -> float:
    """Mean microseconds of one call of `fn(i)` replayed inside a CUDA graph of REPEAT calls,
    `i` cycling through `copies` weight copies (so each call streams its weight from memory, as
    a decode step does): the best of `repeats` rounds of 5 replays."""

    def calls() -> None:
        for i in range(REPEAT):
            fn(i % copies)

    return graph_ms(calls, repeats=repeats, replays=5) * 1e3 / REPEAT
