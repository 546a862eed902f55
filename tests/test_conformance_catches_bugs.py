"""The conformance suite must catch real bugs: each backend here is cpu_reference with one planted
bug, registered as a platform through `PlatformRegistry.from_plugins` (the same checks as an
installed plugin), and the suite must fail it for the right reason. The unmodified reference must
pass, and an undeclared feature must come out as unsupported, not failed.
"""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

import pagedserve_cpu_reference.plugin as cpu_reference_plugin
from pagedserve.conformance.results import CaseResult, Status
from pagedserve.conformance.suite import ConformanceSuite
from pagedserve.platforms.api import (
    PLUGIN_API_VERSION,
    AttentionBackend,
    AttentionCapabilities,
    Availability,
    CacheOps,
    KVCacheScales,
    PlatformInfo,
)
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve.platforms.registry import PlatformRegistry
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps

PLATFORM = "under_test"


def _suite(
    backend: type[AttentionBackend],
    cache_ops: CacheOps | None = None,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16),
) -> ConformanceSuite:
    """The quick suite of a platform made of `backend` and `cache_ops` (default: the reference's),
    computing in `dtypes` (the engine smoke cases run in those the backend declares too)."""

    @hookimpl
    def pagedserve_platforms() -> list[PlatformInfo]:
        return [
            PlatformInfo(
                name=PLATFORM,
                priority=0,
                device_type="cpu",
                supported_dtypes=dtypes,
                is_available=lambda: Availability(True, "test platform"),
            )
        ]

    @hookimpl
    def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
        return [backend] if platform == PLATFORM else None

    @hookimpl
    def pagedserve_cache_ops(platform: str) -> CacheOps | None:
        return (cache_ops or ReferenceCacheOps()) if platform == PLATFORM else None

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


def _first_failure(suite: ConformanceSuite, component: str, group: str | None = None) -> CaseResult | None:
    """Run the suite's items of `component` (and `group`, if given) in order until one fails."""
    for item in suite.items():
        if item.component == component and group in (None, item.case.group):
            result = suite.run_item(item)
            if result.status is Status.FAILED:
                return result
    return None


# --- attention backends with one bug each ------------------------------------------------------


class WrongGqaMapping(ReferenceAttentionBackend):
    """Query head h reads kv head h % num_kv_heads (interleaved) instead of h // group (grouped)."""

    name: ClassVar[str] = "wrong_gqa_mapping"

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_q_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        group = num_q_heads // num_kv_heads
        # Position of head h in an order where the reference's grouped mapping gives h % num_kv_heads.
        slot = [(h % num_kv_heads) * group + h // num_kv_heads for h in range(num_q_heads)]
        reordered = torch.empty_like(query)
        reordered[:, slot] = query
        result = super().forward(
            reordered,
            kv_cache,
            metadata,
            scale=scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )[:, slot]
        if out is None:
            return result
        n = metadata.num_actual_tokens
        out[:n] = result[:n]
        return out


class _PlantedBug(ReferenceAttentionBackend):
    """The reference with hooks to corrupt its inputs or memory; each subclass overrides one."""

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        result = super().forward(
            query,
            kv_cache,
            self.change_metadata(metadata),
            scale=scale,
            sliding_window=self.change_window(sliding_window),
            logit_softcap=logit_softcap,
            out=out,
        )
        self.after(result, kv_cache)
        return result

    def change_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        return metadata

    def change_window(self, sliding_window: int | None) -> int | None:
        return sliding_window

    def after(self, result: torch.Tensor, kv_cache: torch.Tensor) -> None:
        return None


def _with_seq_lens(metadata: AttentionMetadata, seq_lens: torch.Tensor) -> AttentionMetadata:
    return dataclasses.replace(
        metadata,
        seq_lens=seq_lens.to(metadata.seq_lens.device),
        seq_lens_cpu=seq_lens,
        max_seq_len=int(seq_lens.max()),
    )


class ContextOneShort(_PlantedBug):
    """Requests with cached context are computed as if one context token fewer were cached."""

    name: ClassVar[str] = "context_one_short"

    def change_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        seq = metadata.seq_lens_cpu
        has_context = (seq > metadata.query_start_loc_cpu.diff()).to(torch.int32)
        return _with_seq_lens(metadata, (seq - has_context).to(torch.int32))


class ContextOneLong(_PlantedBug):
    """Every request reads one key past its sequence (a slot nobody wrote)."""

    name: ClassVar[str] = "context_one_long"

    def change_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        return _with_seq_lens(metadata, (metadata.seq_lens_cpu + 1).to(torch.int32))


class WindowIgnored(_PlantedBug):
    """Declares sliding-window support (inherited) but attends to the whole context."""

    name: ClassVar[str] = "window_ignored"

    def change_window(self, sliding_window: int | None) -> int | None:
        return None


class WritesPastOut(_PlantedBug):
    """Computes correctly, then writes one row past the end of `out`."""

    name: ClassVar[str] = "writes_past_out"

    def after(self, result: torch.Tensor, kv_cache: torch.Tensor) -> None:
        shape = (result.shape[0] + 1, *result.shape[1:])
        torch.as_strided(result, shape, result.stride(), result.storage_offset())[-1] = 0.0


class WritesCacheBlock(_PlantedBug):
    """Computes correctly, then uses the cache's last block (which no request owns) as scratch."""

    name: ClassVar[str] = "writes_cache_block"

    def after(self, result: torch.Tensor, kv_cache: torch.Tensor) -> None:
        kv_cache[:, -1] = 0.0


class AssumesPackedBlockTable(_PlantedBug):
    """Reads the block table as if its rows were packed (row stride == width), ignoring its stride."""

    name: ClassVar[str] = "wrong_block_table_stride"

    def change_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        table = metadata.block_table
        packed = torch.as_strided(table, table.shape, (table.shape[1], 1), table.storage_offset())
        return dataclasses.replace(metadata, block_table=packed)


_NO_WINDOW = dataclasses.replace(ReferenceAttentionBackend.capabilities, sliding_window=False)


class SilentlyAcceptsUndeclaredWindow(ReferenceAttentionBackend):
    """Declares no sliding window, yet computes window cases instead of raising UnsupportedCase."""

    name: ClassVar[str] = "accepts_undeclared_window"
    capabilities: ClassVar[AttentionCapabilities] = _NO_WINDOW

    def check_supported(
        self,
        *,
        head_size: int,
        dtype: torch.dtype,
        block_size: int,
        sliding_window: int | None,
        logit_softcap: float | None,
    ) -> None:
        super().check_supported(
            head_size=head_size,
            dtype=dtype,
            block_size=block_size,
            sliding_window=None,
            logit_softcap=logit_softcap,
        )


class DeclaresNoWindow(ReferenceAttentionBackend):
    """Correct: declares no sliding window and refuses it (the inherited check_supported raises)."""

    name: ClassVar[str] = "declares_no_window"
    capabilities: ClassVar[AttentionCapabilities] = _NO_WINDOW


class _MisreadsKVScales(ReferenceAttentionBackend):
    """The reference reading an FP8 cache with the wrong scales (`_misread` says which)."""

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,
        kv_scales: KVCacheScales | None = None,
    ) -> torch.Tensor:
        return super().forward(
            query,
            kv_cache,
            metadata,
            scale=scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            out=out,
            kv_scales=None if kv_scales is None else self._misread(kv_scales),
        )

    def _misread(self, scales: KVCacheScales) -> KVCacheScales:
        raise NotImplementedError


class ForgetsKVScales(_MisreadsKVScales):
    """Reads FP8 keys and values as if they were stored unscaled."""

    name: ClassVar[str] = "forgets_kv_scales"

    def _misread(self, scales: KVCacheScales) -> KVCacheScales:
        return KVCacheScales(k_scale=1.0, v_scale=1.0)


class SwapsKVScales(_MisreadsKVScales):
    """Dequantizes keys with the value scale and values with the key scale."""

    name: ClassVar[str] = "swaps_kv_scales"

    def _misread(self, scales: KVCacheScales) -> KVCacheScales:
        return KVCacheScales(k_scale=scales.v_scale, v_scale=scales.k_scale)


DIFFERS = "differs from the float64 reference"
FP8_DIFFERS = "beyond the float32 without TF32 + fp8 KV tolerance"  # the reference declares exact float32


@pytest.mark.parametrize(
    ("backend", "only_group", "expected_group", "expected_problem"),
    [
        pytest.param(WrongGqaMapping, None, "prefill", DIFFERS, id="wrong_gqa_mapping"),
        pytest.param(ContextOneShort, None, "chunked_prefill", DIFFERS, id="context_one_short"),
        pytest.param(ContextOneLong, None, "prefill", "non-finite output", id="context_one_long"),
        pytest.param(WritesPastOut, None, "prefill", "outside `out`", id="writes_past_out"),
        pytest.param(WritesCacheBlock, None, "prefill", "of the KV cache", id="writes_cache_block"),
        pytest.param(
            AssumesPackedBlockTable, None, "prefill", "non-finite output", id="wrong_block_table_stride"
        ),
        # The window cases come late in the suite's order; run only them to keep the test fast.
        pytest.param(WindowIgnored, "sliding_window", "sliding_window", DIFFERS, id="window_ignored"),
        # FP8 cases come last in the suite's order; run only them.
        pytest.param(ForgetsKVScales, "fp8_kv_cache", "fp8_kv_cache", FP8_DIFFERS, id="forgets_kv_scales"),
        pytest.param(SwapsKVScales, "fp8_kv_cache", "fp8_kv_cache", FP8_DIFFERS, id="swaps_kv_scales"),
        pytest.param(
            SilentlyAcceptsUndeclaredWindow,
            "sliding_window",
            "sliding_window",
            "must raise UnsupportedCase; it returned normally",
            id="accepts_undeclared_window",
        ),
    ],
)
def test_suite_fails_a_broken_backend(
    backend: type[AttentionBackend], only_group: str | None, expected_group: str, expected_problem: str
) -> None:
    failure = _first_failure(_suite(backend), backend.name, only_group)
    assert failure is not None, f"the conformance suite passed {backend.__name__}"
    assert failure.status is Status.FAILED
    assert failure.group == expected_group, failure.summary()
    assert expected_problem in "\n".join(failure.problems), failure.summary()


def test_undeclared_feature_is_unsupported_not_failed() -> None:
    suite = _suite(DeclaresNoWindow)
    window_items = [i for i in suite.items() if i.case.group == "sliding_window"]
    assert window_items
    for item in window_items:
        result = suite.run_item(item)
        assert result.status is Status.UNSUPPORTED, result.summary()
        assert result.note.startswith("unsupported: sliding window is not declared")
        assert "sliding window attention is not supported" in result.note  # the backend's own message


# --- cache ops with one bug each ----------------------------------------------------------------


class CopiesKeysOnly(ReferenceCacheOps):
    def copy_blocks(self, kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        for cache in kv_caches:
            cache[0, dst] = cache[0, src]


class WritesNextSlot(ReferenceCacheOps):
    def reshape_and_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        shifted = slot_mapping.clone()
        shifted[-1] += 1
        super().reshape_and_cache(key, value, kv_cache, shifted)


class QuantizesWithoutScales(ReferenceCacheOps):
    """Writes into an FP8 cache as if both scales were 1."""

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVCacheScales | None = None,
    ) -> None:
        unit = None if kv_scales is None else KVCacheScales(k_scale=1.0, v_scale=1.0)
        super().reshape_and_cache(key, value, kv_cache, slot_mapping, kv_scales=unit)


class SkipsPaddingSlots(ReferenceCacheOps):
    """Keeps the `skips_negative_slots` promise: padding tokens (slot -1) are not written."""

    skips_negative_slots = True

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVCacheScales | None = None,
    ) -> None:
        real = slot_mapping >= 0
        n = slot_mapping.shape[0]
        super().reshape_and_cache(
            key[:n][real], value[:n][real], kv_cache, slot_mapping[real], kv_scales=kv_scales
        )


class WritesPaddingSlots(SkipsPaddingSlots):
    """Promises to skip slot -1 but writes it, wrapped around to the cache's last slot (what a
    kernel computing `slot % block_size` on a negative slot does to the value half)."""

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVCacheScales | None = None,
    ) -> None:
        total = kv_cache.shape[1] * kv_cache.shape[2]
        wrapped = torch.where(slot_mapping < 0, slot_mapping + total, slot_mapping)
        ReferenceCacheOps.reshape_and_cache(self, key, value, kv_cache, wrapped, kv_scales=kv_scales)


class DropsLastSwap(ReferenceCacheOps):
    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
        super().swap_blocks(src, dst, block_mapping[:-1])


@pytest.mark.parametrize(
    ("ops", "expected_group"),
    [
        (CopiesKeysOnly(), "copy_blocks"),
        (WritesNextSlot(), "reshape_and_cache"),
        (DropsLastSwap(), "swap_blocks_same_device"),
        (QuantizesWithoutScales(), "reshape_and_cache"),
        (WritesPaddingSlots(), "reshape_and_cache"),
    ],
    ids=[
        "copies_keys_only",
        "writes_next_slot",
        "drops_last_swap",
        "quantizes_without_scales",
        "writes_padding",
    ],
)
def test_suite_fails_broken_cache_ops(ops: CacheOps, expected_group: str) -> None:
    failure = _first_failure(_suite(ReferenceAttentionBackend, ops), "cache_ops")
    assert failure is not None, f"the conformance suite passed {type(ops).__name__}"
    assert failure.group == expected_group, failure.summary()
    if isinstance(ops, WritesNextSlot):
        # The failure names the token and both slots, read back from the cache.
        assert re.search(r"token 12 went to slot (\d+), expected slot (\d+)", failure.summary()), (
            failure.summary()
        )
        found = re.search(r"went to slot (\d+), expected slot (\d+)", failure.summary())
        assert found is not None and int(found[1]) == int(found[2]) + 1, failure.summary()
    if isinstance(ops, QuantizesWithoutScales):
        assert failure.case.kv_cache_dtype is not None, failure.summary()


def test_cache_ops_that_skip_padding_pass_the_padding_cases() -> None:
    """The padded reshape_and_cache cases run for ops declaring `skips_negative_slots`, and an op
    that keeps the promise passes them (FP8 caches included)."""
    results = [
        r for r in _suite(ReferenceAttentionBackend, SkipsPaddingSlots()).run() if r.component == "cache_ops"
    ]
    assert any(r.group == "reshape_and_cache" for r in results)
    assert {r.status for r in results} == {Status.PASSED}, "\n".join(r.summary() for r in results)


def test_unmodified_reference_passes_every_case() -> None:
    suite = ConformanceSuite.for_platform("cpu_reference", quick=True)  # the installed entry point
    results = suite.run()
    # cpu_fast declares no FP8 cache (the engine serves FP8 with the oracle): those are its refusals.
    refused = [r for r in results if r.component == "cpu_fast" and r.group == "fp8_kv_cache"]
    assert refused and {r.status for r in refused} == {Status.UNSUPPORTED}
    rest = [r for r in results if r not in refused]
    assert {r.status for r in rest} == {Status.PASSED}, "\n".join(
        r.summary() for r in rest if r.status is not Status.PASSED
    )
    compared = [r for r in results if r.errors is not None]
    assert compared and all(r.errors is not None and r.errors.worst_ratio <= 1.0 for r in compared)
