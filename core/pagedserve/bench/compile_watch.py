"""Triton kernels compiled inside a timed run: the warm-up's blind spots, named.

The engine compiles every kernel variant it knows a run can hit before it serves; a variant it
missed is compiled the first time a step needs it, inside the timed loop, and costs that step
up to seconds. `watch_triton_compiles` records each Triton kernel this process builds while it is
active, through Triton's own runtime hooks (`triton.knobs.runtime.jit_cache_hook`, called before
a kernel is built or read from the disk cache, and `jit_post_compile_hook`, after): the kernel's
name and the seconds in between (milliseconds for a disk-cache read, seconds for a compile).
torch.compile's Triton kernels go through the same hooks. Without Triton, or with a Triton older
than its runtime hooks (3.5), nothing is recorded and the log says it could not watch.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompileLog:
    """What `watch_triton_compiles` saw. Mutated by the hooks while the watch is active."""

    available: bool  # whether Triton's runtime hooks could be installed
    kernels: list[tuple[str, float]] = field(default_factory=list)  # (kernel name, seconds), in order
    _started: dict[Any, float] = field(default_factory=dict)  # compile key -> perf_counter at the cache hook

    def summary(self) -> dict[str, Any]:
        """Counts and the slowest builds, for a benchmark's JSON. Pure."""
        slowest = sorted(self.kernels, key=lambda item: -item[1])[:5]
        return {
            "watched": self.available,
            "kernels_built": len(self.kernels),
            "seconds": sum(seconds for _, seconds in self.kernels),
            "slowest": [{"kernel": name, "seconds": seconds} for name, seconds in slowest],
        }


def _runtime_knobs() -> Any | None:
    """`triton.knobs.runtime`, or None without Triton or its hooks."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not all(
        hasattr(runtime, hook) for hook in ("jit_cache_hook", "jit_post_compile_hook")
    ):
        return None
    return runtime


def _chained(previous: Callable[..., Any] | None, own: Callable[..., Any]) -> Callable[..., Any]:
    """A hook calling `own`, then a hook that was installed before (whose answer it returns: a
    true answer from Triton's cache hook skips the build, which only that hook's owner decides)."""

    def hook(**kwargs: Any) -> Any:
        own(**kwargs)
        return previous(**kwargs) if previous is not None else None

    return hook


@contextmanager
def watch_triton_compiles() -> Iterator[CompileLog]:
    """Record every Triton kernel built in this process while inside. Restores the hooks that were
    installed before on exit. Mutates `triton.knobs.runtime` while active."""
    runtime = _runtime_knobs()
    log = CompileLog(available=runtime is not None)
    if runtime is None:
        yield log
        return

    def before(**kwargs: Any) -> None:
        log._started[_key(kwargs)] = time.perf_counter()

    def after(**kwargs: Any) -> None:
        started = log._started.pop(_key(kwargs), None)
        seconds = time.perf_counter() - started if started is not None else 0.0
        log.kernels.append((_name(kwargs), seconds))

    previous_before, previous_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    runtime.jit_cache_hook = _chained(previous_before, before)
    runtime.jit_post_compile_hook = _chained(previous_after, after)
    try:
        yield log
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = previous_before, previous_after


def _key(kwargs: dict[str, Any]) -> Any:
    compile_args = kwargs.get("compile") or {}
    return (_name(kwargs), repr(compile_args.get("key")))


def _name(kwargs: dict[str, Any]) -> str:
    fn = kwargs.get("fn")
    return str(getattr(fn, "name", None) or kwargs.get("repr", "?"))
