"""`watch_triton_compiles`: Triton's runtime hooks installed for the run and restored after, an
existing hook kept in the chain, every build recorded with its name and time."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pagedserve.bench.compile_watch import CompileLog, watch_triton_compiles

knobs = pytest.importorskip("triton").knobs


def _triton_calls(hook_owner: Any, name: str, key: str) -> None:
    """What Triton's JITFunction does around building one kernel variant."""
    kwargs = {"key": key, "repr": f"{name}[...]", "fn": SimpleNamespace(name=name), "compile": {"key": key}}
    assert not hook_owner.jit_cache_hook(**kwargs)  # a true answer would skip the build
    hook_owner.jit_post_compile_hook(**kwargs)


def test_records_builds_and_restores_the_hooks_it_found() -> None:
    seen: list[str] = []

    def earlier(**kwargs: Any) -> None:
        seen.append(kwargs["fn"].name)

    runtime = knobs.runtime
    before = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    runtime.jit_cache_hook = runtime.jit_post_compile_hook = earlier
    try:
        with watch_triton_compiles() as log:
            _triton_calls(runtime, "unified_attention_2d_kernel", "a")
            _triton_calls(runtime, "skinny_gemm_kernel", "b")
        assert log.available
        assert [name for name, _ in log.kernels] == ["unified_attention_2d_kernel", "skinny_gemm_kernel"]
        assert all(seconds >= 0 for _, seconds in log.kernels)
        assert seen == ["unified_attention_2d_kernel"] * 2 + ["skinny_gemm_kernel"] * 2  # still called
        assert runtime.jit_cache_hook is earlier and runtime.jit_post_compile_hook is earlier
        _triton_calls(runtime, "after_the_watch", "c")
        assert len(log.kernels) == 2
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before


def test_hooks_are_restored_when_the_run_raises() -> None:
    runtime = knobs.runtime
    before = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    with pytest.raises(RuntimeError), watch_triton_compiles():
        raise RuntimeError("a failing run")
    assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == before


def test_summary_names_the_slowest_builds() -> None:
    log = CompileLog(available=True, kernels=[("a", 0.01), ("b", 2.5), ("c", 0.4)])
    summary = log.summary()
    assert summary["kernels_built"] == 3 and summary["watched"] is True
    assert summary["seconds"] == pytest.approx(2.91)
    assert [k["kernel"] for k in summary["slowest"]] == ["b", "c", "a"]
    assert CompileLog(available=False).summary()["watched"] is False
