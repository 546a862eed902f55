"""Planted bugs for the conformance kit's output contract, determinism, batch invariance, failure
diagnosis and engine smoke check: each backend is cpu_reference with one bug, and the kit must fail
it with a message naming the cause. The unmodified reference passes the same checks (see
test_conformance_catches_bugs.py's `test_unmodified_reference_passes_every_case`).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import ClassVar

import pytest
import torch
from test_conformance_catches_bugs import _first_failure, _suite

from pagedserve.conformance.cases import AttentionCase, attention_cases
from pagedserve.conformance.report import pattern_hints
from pagedserve.conformance.results import CaseResult, Status
from pagedserve.conformance.tolerances import tolerance_for
from pagedserve.platforms.api import AttentionBackend, AttentionCapabilities
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend

_ENGINE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Wrapped(ReferenceAttentionBackend):
    """The reference with `wrap` applied to what its forward computed."""

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
            metadata,
            scale=self.change_scale(scale),
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            out=out,
        )
        return self.wrap(result, out, metadata)

    def change_scale(self, scale: float) -> float:
        return scale

    def wrap(
        self, result: torch.Tensor, out: torch.Tensor | None, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return result


class Float32WithOut(_Wrapped):
    """Writes `out` correctly but returns a float32 copy under bfloat16 when `out=` is given."""

    name: ClassVar[str] = "float32_with_out"

    def wrap(
        self, result: torch.Tensor, out: torch.Tensor | None, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return result.float() if out is not None and result.dtype == torch.bfloat16 else result


class Float32WithoutOut(_Wrapped):
    """Returns float32 under bfloat16 when no `out=` is given (what an upcasting kernel does)."""

    name: ClassVar[str] = "float32_without_out"

    def wrap(
        self, result: torch.Tensor, out: torch.Tensor | None, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return result.float() if out is None and result.dtype == torch.bfloat16 else result


class ReturnsNewTensor(_Wrapped):
    """Writes `out` correctly but returns a copy of it."""

    name: ClassVar[str] = "returns_new_tensor"

    def wrap(
        self, result: torch.Tensor, out: torch.Tensor | None, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return result.clone() if out is not None else result


class NondeterministicInLargeBatches(_Wrapped):
    """Declares determinism (inherited), but in batches of more than 3 requests moves a random half
    of the output elements by one ulp, a different half each call (as an atomic reduction order
    would): within every tolerance, so only the repeated call shows it."""

    name: ClassVar[str] = "nondeterministic_large_batches"

    def wrap(
        self, result: torch.Tensor, out: torch.Tensor | None, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if metadata.num_reqs > 3:
            gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**62))
            rows = result[: metadata.num_actual_tokens]
            nudge = torch.rand(rows.shape, generator=gen) < 0.5
            rows[nudge] = torch.nextafter(rows[nudge], torch.full_like(rows[nudge], math.inf))
        return result


class BatchDependentError(_Wrapped):
    """Off by 0.7 of the tolerance, upwards in batches of more than 3 requests and downwards in
    smaller ones: every call passes against the reference, but a request's result depends on the
    rest of the batch by 1.4 tolerances."""

    name: ClassVar[str] = "batch_dependent_error"
    capabilities: ClassVar[AttentionCapabilities] = dataclasses.replace(
        ReferenceAttentionBackend.capabilities, deterministic=False
    )

    def wrap(
        self, result: torch.Tensor, out: torch.Tensor | None, metadata: AttentionMetadata
    ) -> torch.Tensor:
        tol = tolerance_for(result.dtype, exact_float32=self.capabilities.exact_float32)
        n = metadata.num_actual_tokens
        sign = 1.0 if metadata.num_reqs > 3 else -1.0
        rows = result[:n].double()
        result[:n] = (rows + sign * 0.7 * (tol.atol + tol.rtol * rows.abs())).to(result.dtype)
        return result


class WrongScale(_Wrapped):
    """Scales scores by 1.3 / sqrt(head_size)."""

    name: ClassVar[str] = "wrong_scale"

    def change_scale(self, scale: float) -> float:
        return scale * 1.3


class TF32Float32(ReferenceAttentionBackend):
    """Declares exact float32 (inherited) but rounds float32 queries and keys to TF32's 10-bit
    mantissa, as a GPU dot product in TF32 does."""

    name: ClassVar[str] = "tf32_float32"

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
        if query.dtype == torch.float32:
            query = _tf32(query)
            kv_cache = torch.stack((_tf32(kv_cache[0]), kv_cache[1]))
        return super().forward(
            query,
            kv_cache,
            metadata,
            scale=scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            out=out,
        )


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """`x` (float32) with its mantissa cut to 10 bits, NaN kept."""
    return torch.where(torch.isnan(x), x, (x.view(torch.int32) & ~0x1FFF).view(torch.float32))


_NO_OPTIONS = dataclasses.replace(
    ReferenceAttentionBackend.capabilities,
    sliding_window=False,
    logit_softcap=False,
    kv_cache_dtypes=frozenset(),
)


class CausalOffByOne(AttentionBackend):
    """Dense attention in which query position p also sees key p + 1 (when its request has one)."""

    name: ClassVar[str] = "causal_off_by_one"
    capabilities: ClassVar[AttentionCapabilities] = _NO_OPTIONS

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
        self.check_call(
            query, kv_cache, scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap
        )
        result = out if out is not None else torch.empty_like(query)
        group = query.shape[1] // kv_cache.shape[3]
        block_size = kv_cache.shape[2]
        starts = metadata.query_start_loc_cpu.tolist()
        for req in range(metadata.num_reqs):
            lo, hi, seq_len = starts[req], starts[req + 1], int(metadata.seq_lens_cpu[req])
            positions = torch.arange(seq_len)
            blocks = metadata.block_table[req].cpu().long()[positions // block_size]
            keys = kv_cache[0, blocks, positions % block_size].double().repeat_interleave(group, dim=1)
            values = kv_cache[1, blocks, positions % block_size].double().repeat_interleave(group, dim=1)
            q_pos = seq_len - (hi - lo) + torch.arange(hi - lo)
            scores = torch.einsum("qhd,khd->hqk", query[lo:hi].double(), keys) * scale
            visible = positions[None, :] <= q_pos[:, None] + 1  # the bug: should be <= q_pos
            probs = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
            result[lo:hi] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
        return result


def _failure(backend: type[AttentionBackend], group: str | None = None, **suite: object) -> CaseResult:
    failure = _first_failure(_suite(backend, **suite), backend.name, group)  # type: ignore[arg-type]
    assert failure is not None, f"the conformance kit passed {backend.__name__}"
    assert failure.status is Status.FAILED
    return failure


def test_float32_output_under_bfloat16_with_out() -> None:
    failure = _failure(Float32WithOut, "dtype")
    assert failure.case.dtype == torch.bfloat16, failure.summary()
    assert "forward with out= returned float32, expected the query's dtype bfloat16" in failure.summary()
    assert "returned a new tensor, not `out`" in failure.summary()


def test_float32_output_under_bfloat16_without_out() -> None:
    failure = _failure(Float32WithoutOut, "no_out")
    assert failure.case.dtype == torch.bfloat16, failure.summary()
    assert "forward without out= returned float32, expected the query's dtype bfloat16" in failure.summary()


def test_float32_output_crashes_the_engine_smoke_check() -> None:
    failure = _failure(Float32WithoutOut, "engine_smoke", dtypes=_ENGINE_DTYPES)
    assert failure.case.dtype == torch.bfloat16, failure.summary()
    assert "in the bfloat16 model" in failure.summary() and "the engine would crash here" in failure.summary()


def test_returning_a_new_tensor_instead_of_out() -> None:
    failure = _failure(ReturnsNewTensor)
    assert failure.group == "prefill", failure.summary()
    assert "forward with out= returned a new tensor, not `out`" in failure.summary()


def test_nondeterminism_in_large_batches() -> None:
    failure = _failure(NondeterministicInLargeBatches)
    assert failure.case.geometry.query_lens.__len__() > 3, failure.summary()
    assert failure.errors is not None and failure.errors.worst_ratio <= 1.0, "within tolerance by design"
    assert "not deterministic: a second identical call changed" in failure.summary()
    assert "deterministic=True" in failure.summary()


def test_batch_dependent_error() -> None:
    failure = _failure(BatchDependentError)
    assert failure.group == "mixed", failure.summary()
    assert failure.errors is not None and failure.errors.worst_ratio <= 1.0, "within tolerance by design"
    assert (
        "batch invariance: 5 of 5 requests computed alone differ from the same request in the batch of 5"
        in (failure.summary())
    )
    assert "The result depends on the rest of the batch" in failure.summary()


@pytest.mark.parametrize(
    ("backend", "cause"),
    [
        pytest.param(
            WrongScale, "hint: softmax scale: the output matches scores scaled by", id="wrong_scale"
        ),
        pytest.param(CausalOffByOne, "hint: causal mask off by one", id="causal_off_by_one"),
    ],
)
def test_failure_hint_names_the_cause(backend: type[AttentionBackend], cause: str) -> None:
    failure = _failure(backend)
    assert "worst element: request" in failure.summary() and "-> KV head" in failure.summary()
    assert cause in failure.summary(), failure.summary()


def test_causal_off_by_one_fails_only_rows_of_multi_token_queries() -> None:
    failure = _failure(CausalOffByOne, "mixed")
    assert "hint: only rows of requests with query_len > 1 fail" in failure.summary(), failure.summary()


def test_gqa_head_mapping_hint() -> None:
    from test_conformance_catches_bugs import WrongGqaMapping

    failure = _failure(WrongGqaMapping)
    assert "hint: GQA head mapping: query head" in failure.summary(), failure.summary()
    assert "hint: only query heads [1, 2] of 4 fail" in failure.summary(), failure.summary()


def test_tf32_under_a_declared_exact_float32() -> None:
    failure = _failure(TF32Float32)
    assert failure.case.dtype == torch.float32
    assert "beyond the float32 without TF32 tolerance" in failure.summary(), failure.summary()
    # The same backend without the promise passes its float32 cases (TF32 is allowed by default).
    relaxed = type(
        "TF32Undeclared",
        (TF32Float32,),
        {
            "name": "tf32_undeclared",
            "capabilities": dataclasses.replace(TF32Float32.capabilities, exact_float32=False),
        },
    )
    assert _first_failure(_suite(relaxed), relaxed.name, "prefill") is None


@pytest.mark.parametrize(
    ("failing", "hint"),
    [
        pytest.param(lambda c: c.sliding_window is not None, "only sliding-window cases fail", id="window"),
        pytest.param(
            lambda c: c.num_q_heads > c.num_kv_heads, "only cases with GQA ratio > 1 fail", id="gqa_ratio"
        ),
        pytest.param(lambda c: c.dtype == torch.bfloat16, "only bfloat16 cases fail", id="one_dtype"),
        pytest.param(lambda c: not c.pass_out, "only cases without out= fail", id="no_out"),
    ],
)
def test_pattern_of_failing_cases_gives_a_hint(failing: Callable[[AttentionCase], bool], hint: str) -> None:
    """The report's hints read which cases of a backend failed and which passed (no case is run)."""
    cases = attention_cases(ReferenceAttentionBackend.capabilities, quick=True)
    results = [
        CaseResult(
            "backend",
            c,
            Status.FAILED if failing(c) else Status.PASSED,
            ("problem",) if failing(c) else (),
            None,
        )
        for c in cases
    ]
    assert [h for h in pattern_hints(results) if hint in h], pattern_hints(results)
    assert pattern_hints([dataclasses.replace(r, status=Status.PASSED, problems=()) for r in results]) == []
