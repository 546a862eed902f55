"""The conformance case matrix, tolerance table and guard regions: what the suite promises to cover
and to detect, checked without running any backend."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from pagedserve.conformance.cases import (
    AttentionCase,
    CacheOp,
    attention_cases,
    base_shape,
    cache_op_cases,
)
from pagedserve.conformance.guards import POISON, GuardedTensor, count_changed
from pagedserve.conformance.tolerances import TOLERANCES, tolerance_for
from pagedserve.platforms.api import AttentionCapabilities
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend

EVERYTHING = ReferenceAttentionBackend.capabilities
NARROW = AttentionCapabilities(
    head_sizes=frozenset({128}), dtypes=frozenset({torch.float16}), block_sizes=frozenset({32})
)


def _by_group(cases: list[AttentionCase]) -> dict[str, list[AttentionCase]]:
    groups: dict[str, list[AttentionCase]] = {}
    for c in cases:
        groups.setdefault(c.group, []).append(c)
    return groups


@pytest.mark.parametrize("quick", [True, False])
def test_matrix_has_every_required_group(quick: bool) -> None:
    groups = _by_group(attention_cases(EVERYTHING, quick=quick))
    for name in (
        "prefill",
        "chunked_prefill",
        "decode",
        "spec_decode",
        "mixed",
        "block_boundaries",
        "gqa",
        "head_size",
        "block_size",
        "dtype",
        "sliding_window",
        "softcap",
        "no_out",
    ):
        assert name in groups, name
    [chunked] = [c for c in groups["chunked_prefill"] if c.dtype == torch.float32]
    q, s = chunked.geometry.query_lens[0], chunked.geometry.seq_lens[0]
    assert s - q >= 10 * q and (s - q) % chunked.block_size != 0  # long context, not a block multiple
    for decode in groups["decode"]:
        assert set(decode.geometry.query_lens) == {1}
        assert any(s % decode.block_size for s in decode.geometry.seq_lens)
    spec = {q for c in groups["spec_decode"] for q in c.geometry.query_lens}
    assert min(spec) == 2 and max(spec) == 8
    for mixed in groups["mixed"]:
        pairs = list(zip(mixed.geometry.query_lens, mixed.geometry.seq_lens, strict=True))
        assert any(q == 1 and s > 1 for q, s in pairs)  # decode
        assert any(q == s > 1 for q, s in pairs)  # whole prefill
        assert any(1 < q < s for q, s in pairs)  # chunked prefill or speculative query
    ratios = {(c.num_q_heads // c.num_kv_heads, c.num_kv_heads == 1) for c in groups["gqa"]}
    assert {1, 3, 4, 8} <= {r for r, _ in ratios} and any(mqa for _, mqa in ratios)


def test_quick_is_small_and_full_runs_every_declared_small_set() -> None:
    quick, full = attention_cases(EVERYTHING, quick=True), attention_cases(EVERYTHING, quick=False)
    # Windows, softcaps and the returned output run in each of the 4 declared dtypes (3 cases each).
    assert len(quick) <= 25 + 3 * 3 < len(full)
    assert max(max(c.geometry.seq_lens) for c in quick) < 200  # interpreter-sized
    block_sizes = {c.block_size for c in full}
    assert set(EVERYTHING.block_sizes) <= block_sizes  # 8 declared values: every one runs
    assert {32, 64, 80, 96, 112, 128, 192, 256} <= {c.head_size for c in full}
    assert {torch.float16, torch.bfloat16, torch.float32, torch.float64} <= {c.dtype for c in quick}


def test_ids_are_unique_and_inputs_reproducible() -> None:
    cases = attention_cases(EVERYTHING, quick=False)
    assert len({c.case_id for c in cases}) == len(cases)
    assert cases == attention_cases(EVERYTHING, quick=False)
    assert [c.seed for c in cases] != [c.seed for c in attention_cases(EVERYTHING, quick=False, seed=1)]
    ops = cache_op_cases([torch.float32, torch.float16], [16, 32], quick=False)
    assert len({c.case_id for c in ops}) == len(ops)


def test_undeclared_values_become_unsupported_probes() -> None:
    assert base_shape(NARROW) == (128, 32, torch.float16)
    cases = attention_cases(NARROW, quick=True)
    declared = [c for c in cases if c.unsupported_reason(NARROW) is None]
    probes = [c for c in cases if c.unsupported_reason(NARROW) is not None]
    assert all((c.head_size, c.block_size, c.dtype) == (128, 32, torch.float16) for c in declared)
    assert all(c.sliding_window is None and c.logit_softcap is None for c in declared)
    reasons = {c.unsupported_reason(NARROW) for c in probes}
    assert "head_size=64 is not declared" in reasons
    assert "block_size=16 is not declared" in reasons
    assert "dtype=float32 is not declared" in reasons
    assert {"sliding window is not declared", "logit softcap is not declared"} <= reasons
    assert {"gqa", "prefill", "decode"} <= {c.group for c in declared}


def test_max_query_len_is_a_capability() -> None:
    decode_only = dataclasses.replace(EVERYTHING, max_query_len=1)
    groups = _by_group(attention_cases(decode_only, quick=True))
    assert groups["decode"][0].unsupported_reason(decode_only) is None
    assert groups["prefill"][0].unsupported_reason(decode_only) == (
        "query_len=17 exceeds the declared max_query_len=1"
    )


def test_cache_cases_cover_every_dtype_and_direction() -> None:
    ops = cache_op_cases([torch.float16, torch.bfloat16, torch.int8], [16, 64], quick=True)
    for dtype in (torch.float16, torch.bfloat16):
        assert {c.op for c in ops if c.dtype == dtype} == set(CacheOp)
    assert all(c.dtype != torch.int8 for c in ops)  # no tolerance entry, no reference semantics
    assert any(c.strided_inputs and c.head_size == 80 for c in ops)
    assert any(c.op is CacheOp.COPY_BLOCKS and c.num_layers > 1 for c in ops)


def test_tolerance_table_has_one_entry_per_dtype() -> None:
    assert set(TOLERANCES) == {torch.float64, torch.float32, torch.float16, torch.bfloat16}
    ordered = [tolerance_for(d).atol for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)]
    assert ordered == sorted(ordered)  # coarser dtypes are allowed more
    with pytest.raises(KeyError, match=r"no tolerance for torch\.int8"):
        tolerance_for(torch.int8)


def test_guard_margins_catch_writes_just_outside_the_tensor() -> None:
    guarded = GuardedTensor((3, 4), torch.float32, torch.device("cpu"), margin=5)
    t = guarded.tensor
    t.fill_(1.0)
    assert guarded.margins_changed() == 0
    torch.as_strided(t, (13,), (1,), t.storage_offset())[12] = 0.0  # one element past the end
    torch.as_strided(t, (2,), (1,), t.storage_offset() - 2)[0] = 0.0  # two before the start
    assert guarded.margins_changed() == 2


def test_bitwise_comparison_treats_nan_as_equal() -> None:
    a = torch.tensor([POISON, 1.0, -0.0], dtype=torch.bfloat16)
    assert count_changed(a, a.clone()) == 0
    assert count_changed(a, torch.tensor([POISON, 1.0, 0.0], dtype=torch.bfloat16)) == 1  # -0.0 vs 0.0


def test_documented_tolerance_table_is_the_code_table() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "conformance.md").read_text()
    documented = {
        name: (float(atol), float(rtol))
        for name, atol, rtol in re.findall(
            r"^\| (float64|float32|float16|bfloat16) \| ([0-9e.\-]+) \| ([0-9e.\-]+) \|$", doc, re.M
        )
    }
    assert len(documented) == len(TOLERANCES)
    for dtype, tolerance in TOLERANCES.items():
        assert documented[str(dtype).removeprefix("torch.")] == (tolerance.atol, tolerance.rtol)
