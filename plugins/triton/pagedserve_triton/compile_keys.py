"""Which compiled variant a Triton launch needs, asked without launching (plugin API 1.9).

Why. Triton compiles a kernel once per *variant*, not once per launch: a variant is the kernel,
the value of every constexpr, the class Triton gives each other argument (an integer equal to 1,
a multiple of 16, or neither, unless the kernel opts out with `do_not_specialize`; a pointer's
dtype and whether its address is a multiple of 16, unless `do_not_specialize_on_alignment`; a
tensor descriptor's dtype, block shape and layout; floats not at all) and the launch options
(`num_warps`, `num_stages`, `launch_pdl`, ...). Launches of one variant run one compiled kernel,
so the engine's start-up warm-up needs one launch per variant, not one per batch shape of its
sweep: `AttentionBackend.compile_key` names the variants a call launches and the warm-up skips
calls whose variants have all run.

How. `launch_variant` runs Triton's own argument binder, the function `kernel[grid](...)` calls
to compute the key it looks its compiled kernels up by, on the launch's arguments: the answer
follows the installed Triton's rules instead of a copy of them. The binder is private Triton
(`triton.runtime.jit.create_function_from_signature`); where a release lacks it or it fails,
`launch_variant` answers None and the warm-up runs its whole sweep, as it did before keys.
Buffers a launch allocates itself (split-KV partials, tile plans) do not exist when the key is
asked: `StandIn` takes their place with what the binder reads of them (dtype, a fresh
allocation's aligned address).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch


class StandIn:
    """A tensor a launch will allocate, as Triton's binder sees it: its dtype, its strides (those
    of a contiguous tensor of `shape`) and a 16-byte aligned address (what a fresh allocation
    has), and a storage small enough for AMD's 32-bit buffer addressing (the split, tile and
    output buffers are). Never read or written."""

    __slots__ = ("_strides", "dtype")

    def __init__(self, dtype: torch.dtype, shape: Sequence[int] = (1,)) -> None:
        self.dtype = dtype
        strides = [1]
        for size in reversed(shape[1:]):
            strides.insert(0, strides[0] * size)
        self._strides = tuple(strides)

    def stride(self, dim: int) -> int:
        return self._strides[dim]

    def data_ptr(self) -> int:
        return 0

    def ptr_range(self) -> int:  # read by Triton's AMD backend only
        return 0


@functools.cache
def _specialization_backend() -> Any:
    """The compiler backend whose rules `kernel[grid](...)` specialises arguments with: the active
    GPU's, or Triton's base rules where there is none (the interpreter compiles nothing)."""
    from triton.backends.compiler import BaseBackend

    try:
        from triton.compiler import make_backend
        from triton.runtime import driver

        return make_backend(driver.active.get_current_target())
    except Exception:  # no GPU driver: any failure here means the base rules
        return BaseBackend


@functools.cache
def _binder(kernel: Any) -> Callable[..., Any] | None:
    """Triton's argument binder of `kernel` (a `triton.jit` function, or the interpreter's wrapper
    of one), or None where this Triton has no such internals. Cached per kernel."""
    try:
        from triton.runtime.jit import JITFunction, create_function_from_signature

        if not isinstance(kernel, JITFunction):
            # The interpreter's wrapper keeps the function and its `triton.jit` options.
            options = getattr(kernel, "kwargs", {})
            kernel = JITFunction(
                kernel.fn,
                do_not_specialize=options.get("do_not_specialize"),
                do_not_specialize_on_alignment=options.get("do_not_specialize_on_alignment"),
            )
        binder: Callable[..., Any] = create_function_from_signature(
            kernel.signature, kernel.params, _specialization_backend()
        )
        return binder
    except Exception:  # private API: any failure means "cannot say"
        return None


def kernel_name(kernel: Any) -> str:
    """`module.function` of a jit function (or the interpreter's wrapper). Pure."""
    fn = getattr(kernel, "fn", kernel)
    return f"{fn.__module__}.{fn.__qualname__}"


def launch_variant(kernel: Any, args: Sequence[object], kwargs: Mapping[str, object]) -> Hashable | None:
    """The compiled variant `kernel[grid](*args, **kwargs)` would run: the kernel's name, Triton's
    specialisation of every argument (constexpr values included) and the launch options, or None
    where this Triton cannot say. Two launches with equal answers run one compiled kernel. Reads
    only dtypes, strides, scalar values and addresses; launches and compiles nothing. Pure."""
    binder = _binder(kernel)
    if binder is None:
        return None
    try:
        _, specialization, options = binder(*args, **kwargs)
    except Exception:  # private API: any failure means "cannot say"
        return None
    # Triton's own key is the text of both (`triton.runtime.jit.compute_cache_key`).
    return (kernel_name(kernel), str(specialization), str(sorted(options.items())))
