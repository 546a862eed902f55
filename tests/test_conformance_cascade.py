"""The cascade cases of the conformance kit (plugin API 1.16): the oracle passes them, a backend
that does not declare cascade attention gets none, and each group catches its planted bug (the
reference's cascade operations with one thing wrong)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

import pagedserve_cpu_reference.plugin as cpu_reference_plugin
from pagedserve.conformance.cascade_cases import CascadeCase
from pagedserve.conformance.results import Status
from pagedserve.conformance.suite import ConformanceSuite
from pagedserve.platforms.api import (
    PLUGIN_API_VERSION,
    AttentionBackend,
    AttentionCapabilities,
    Availability,
    CacheOps,
    PlatformInfo,
)
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.attention_states import AttentionState
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve.platforms.registry import PlatformRegistry
from pagedserve_cpu_reference import cascade
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps

PLATFORM = "under_test"


def _suite(backend: type[AttentionBackend]) -> ConformanceSuite:
    @hookimpl
    def pagedserve_platforms() -> list[PlatformInfo]:
        return [
            PlatformInfo(
                name=PLATFORM,
                priority=0,
                device_type="cpu",
                supported_dtypes=(torch.float32, torch.bfloat16),
                is_available=lambda: Availability(True, "test platform"),
            )
        ]

    @hookimpl
    def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
        return [backend] if platform == PLATFORM else None

    @hookimpl
    def pagedserve_cache_ops(platform: str) -> CacheOps | None:
        return ReferenceCacheOps() if platform == PLATFORM else None

    plugin = SimpleNamespace(
        PAGEDSERVE_PLUGIN_API=PLUGIN_API_VERSION,
        pagedserve_platforms=pagedserve_platforms,
        pagedserve_attention_backends=pagedserve_attention_backends,
        pagedserve_cache_ops=pagedserve_cache_ops,
    )
    registry = PlatformRegistry.from_plugins(
        [("cpu_reference", cpu_reference_plugin), ("planted_bug", plugin)], strict=True
    )
    return ConformanceSuite.for_platform(PLATFORM, registry=registry, quick=True)


def _cascade_results(backend: type[AttentionBackend]) -> dict[str, list[Status]]:
    """group -> the statuses of its cascade cases."""
    suite = _suite(backend)
    found: dict[str, list[Status]] = {}
    for item in suite.items():
        if isinstance(item.case, CascadeCase):
            found.setdefault(item.case.group, []).append(suite.run_item(item).status)
    return found


def test_the_oracle_passes_every_cascade_group() -> None:
    results = _cascade_results(ReferenceAttentionBackend)
    assert set(results) == {
        "cascade_partial_block",
        "cascade_whole_context",
        "cascade_one_request",
        "cascade_gqa",
        "cascade_dtype",
        "cascade_softcap",
        "cascade_sliding_window",
        "cascade_merge",
    }
    assert len(results["cascade_dtype"]) == 4  # every declared dtype
    for group, statuses in results.items():
        assert statuses == [Status.PASSED] * len(statuses), group


class NoCascade(ReferenceAttentionBackend):
    name: ClassVar[str] = "no_cascade"
    capabilities: ClassVar[AttentionCapabilities] = dataclasses.replace(
        ReferenceAttentionBackend.capabilities, cascade_attention=False
    )


def test_a_backend_without_the_capability_gets_no_cascade_case() -> None:
    assert _cascade_results(NoCascade) == {}


# --- planted bugs: the reference's cascade operations with one thing wrong --------------------


class SuffixFromBlockBoundary(ReferenceAttentionBackend):
    """The suffix starts at the prefix's last block boundary: a partial block's prefix tokens count twice."""

    name: ClassVar[str] = "suffix_from_block_boundary"

    def suffix_attention(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, **kw: Any
    ) -> AttentionState:
        assert metadata.cascade is not None
        start = metadata.cascade.prefix_len // kv_cache.shape[2] * kv_cache.shape[2]
        kw.pop("sliding_window", None)
        return cascade.suffix_attention(query, kv_cache, metadata, start, **kw)


class EmptySuffixWhenContextIsThePrefix(ReferenceAttentionBackend):
    """A request whose cached context is exactly the prefix is treated as having no suffix."""

    name: ClassVar[str] = "empty_suffix"

    def suffix_attention(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, **kw: Any
    ) -> AttentionState:
        state = super().suffix_attention(query, kv_cache, metadata, **kw)
        assert metadata.cascade is not None
        qsl = metadata.query_start_loc_cpu.tolist()
        for i, s in enumerate(metadata.seq_lens_cpu.tolist()):
            if s - (qsl[i + 1] - qsl[i]) == metadata.cascade.prefix_len:
                state.lse[qsl[i] : qsl[i + 1]] = -torch.inf
                state.out[qsl[i] : qsl[i + 1]] = 0
        return state


class LastRequestSkipped(ReferenceAttentionBackend):
    """The suffix loop stops one request early (a bound written for num_reqs - 1)."""

    name: ClassVar[str] = "last_request_skipped"

    def suffix_attention(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, **kw: Any
    ) -> AttentionState:
        state = super().suffix_attention(query, kv_cache, metadata, **kw)
        last = int(metadata.query_start_loc_cpu[-2])
        state.out[last:] = 0
        return state


class InterleavedGqaInPrefix(ReferenceAttentionBackend):
    """Prefix attention maps query head h to kv head h % num_kv_heads instead of h // group."""

    name: ClassVar[str] = "interleaved_gqa_prefix"

    def prefix_attention(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, **kw: Any
    ) -> AttentionState:
        hq, hkv = query.shape[1], kv_cache.shape[3]
        group = hq // hkv
        slot = [(h % hkv) * group + h // hkv for h in range(hq)]
        reordered = torch.empty_like(query)
        reordered[:, slot] = query
        state = super().prefix_attention(reordered, kv_cache, metadata, **kw)
        return AttentionState(state.out[:, slot], state.lse[:, slot])


class StatesInQueryDtype(ReferenceAttentionBackend):
    """The partial results are rounded to the query's dtype (their LSE loses the merge's precision)."""

    name: ClassVar[str] = "states_in_query_dtype"

    def prefix_attention(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, **kw: Any
    ) -> AttentionState:
        state = super().prefix_attention(query, kv_cache, metadata, **kw)
        return AttentionState(state.out.to(query.dtype), state.lse.to(query.dtype))


class SoftcapIgnoredInPrefix(ReferenceAttentionBackend):
    name: ClassVar[str] = "softcap_ignored_prefix"

    def prefix_attention(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, **kw: Any
    ) -> AttentionState:
        kw["logit_softcap"] = None
        return super().prefix_attention(query, kv_cache, metadata, **kw)


class WindowIgnored(ReferenceAttentionBackend):
    """Computes a sliding-window cascade as if there were no window, instead of refusing."""

    name: ClassVar[str] = "window_ignored"

    def prefix_attention(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, **kw: Any
    ) -> AttentionState:
        kw.pop("sliding_window", None)
        return super().prefix_attention(query, kv_cache, metadata, **kw)

    def suffix_attention(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, **kw: Any
    ) -> AttentionState:
        kw.pop("sliding_window", None)
        return super().suffix_attention(query, kv_cache, metadata, **kw)


class MergeWithoutWeights(ReferenceAttentionBackend):
    """The merge averages the parts, ignoring their log-sum-exp."""

    name: ClassVar[str] = "merge_without_weights"

    def merge_attention_states(
        self, prefix: AttentionState, suffix: AttentionState, out: torch.Tensor
    ) -> torch.Tensor:
        n = prefix.out.shape[0]
        out[:n] = ((prefix.out + suffix.out) / 2).to(out.dtype)
        return out


@pytest.mark.parametrize(
    ("bug", "group"),
    [
        (SuffixFromBlockBoundary, "cascade_partial_block"),
        (EmptySuffixWhenContextIsThePrefix, "cascade_whole_context"),
        (LastRequestSkipped, "cascade_one_request"),
        (InterleavedGqaInPrefix, "cascade_gqa"),
        (StatesInQueryDtype, "cascade_dtype"),
        (SoftcapIgnoredInPrefix, "cascade_softcap"),
        (WindowIgnored, "cascade_sliding_window"),
        (MergeWithoutWeights, "cascade_merge"),
    ],
)
def test_each_group_catches_its_planted_bug(bug: type[AttentionBackend], group: str) -> None:
    assert Status.FAILED in _cascade_results(bug)[group]


def test_the_cuda_backend_runs_its_cascade_steps_without_a_triton_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cuda backend's cascade operations are the Triton plugin's own (the kernels, in
    Triton's interpreter here), reached without the Triton backend it builds for prefill."""
    from pagedserve_cuda.attention import CudaPagedAttentionBackend

    def no_triton_backend(self: CudaPagedAttentionBackend) -> AttentionBackend:
        raise AssertionError("a cascade step built the cuda backend's Triton backend")

    monkeypatch.setattr(CudaPagedAttentionBackend, "_triton_backend", no_triton_backend)
    results = _cascade_results(CudaPagedAttentionBackend)
    assert {"cascade_partial_block", "cascade_gqa", "cascade_softcap", "cascade_merge"} <= set(results)
    for group, statuses in results.items():
        assert statuses == [Status.PASSED] * len(statuses), (group, statuses)
