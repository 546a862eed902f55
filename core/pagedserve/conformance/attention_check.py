"""Running one `AttentionCase` on a backend and judging it against the float64 reference.

Inputs (all drawn from a generator seeded with the case's seed):

* A KV cache with more blocks than the batch uses. Each request's blocks are a random choice from
  the interior of the cache, in random order, with unused blocks between them; block 0 and the last
  block are never used. Every slot no token was written to, including the tails of partly filled
  blocks, holds the poison (NaN); the cache itself sits inside a poisoned allocation (`guards`).
  The keys and values are written by the oracle's `reshape_and_cache`.
* A block table wider than needed, whose unused entries name a poisoned block, passed as a view
  with a row stride larger than its width (backends must use the real stride).
* A query with padding rows past `num_actual_tokens` (as CUDA graphs add) holding NaN, and `out`
  inside a poisoned allocation.

Then the checks: `forward` must not raise; `out` must not be written out of bounds; the KV cache and
the query must be bit-for-bit unchanged; the real output rows must be finite and within the dtype's
tolerance of cpu_reference computed in float64 on the same (rounded) inputs. Rows past
`num_actual_tokens` are unspecified by the contract and not checked.

FP8 cases (`case.kv_cache_dtype`) write the keys and values through the oracle's quantizing
`reshape_and_cache` with `FP8_KV_SCALES`, pass the scales to the backend, and compare with the
oracle reading the same FP8 bits (dequantized exactly) in float64: the quantization error itself
is not the backend's and is measured end to end elsewhere (docs/fp8.md).

An undeclared case is instead called once and must raise `UnsupportedCase`; an undeclared FP8 case
is called without `kv_scales`, as the engine would never pass them to such a backend.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from pagedserve.attention.layer import NewKV
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.conformance.cases import FP8_KV_SCALES, AttentionCase, dtype_name
from pagedserve.conformance.guards import POISON, GuardedTensor, count_changed
from pagedserve.conformance.oracle import Oracle
from pagedserve.conformance.results import CaseResult, ErrorStats, Status
from pagedserve.conformance.tolerances import tolerance_for
from pagedserve.platforms.api import AttentionBackend, UnsupportedCase

PADDING_ROWS = 3  # query rows past num_actual_tokens
EXTRA_TABLE_COLUMNS = 2  # block-table entries past the longest request's last block
EXTRA_TABLE_STRIDE = 3  # the block table is a view whose row stride exceeds its width by this


@dataclass(frozen=True, slots=True)
class _Inputs:
    """One case's tensors for the backend under test and for the oracle."""

    query: torch.Tensor  # [num_tokens + PADDING_ROWS, num_q_heads, head_size], device
    kv_cache: GuardedTensor  # [2, num_blocks, block_size, num_kv_heads, head_size], device
    metadata: AttentionMetadata  # device tensors; strided block table
    out: GuardedTensor  # [num_tokens + PADDING_ROWS, num_q_heads, head_size], device, all poison
    cache_cpu: torch.Tensor  # the cache's expected contents, CPU, tested dtype
    query_cpu: torch.Tensor  # the query's expected contents, CPU, tested dtype
    metadata_cpu: AttentionMetadata  # the same batch on the CPU, plain block table


def _block_table(case: AttentionCase, gen: torch.Generator) -> tuple[torch.Tensor, int, int]:
    """(block_table [num_reqs, width] int32, num_blocks, poisoned block id). Requests own disjoint,
    shuffled interior blocks with gaps; unused entries name the last (poisoned) block."""
    b = case.block_size
    needed = [-(-s // b) for s in case.geometry.seq_lens]
    width = max(needed) + EXTRA_TABLE_COLUMNS
    used = sum(needed)
    num_blocks = used + max(2, used // 2) + 2  # gaps, plus the never-used first and last blocks
    poisoned = num_blocks - 1
    interior = (torch.randperm(num_blocks - 2, generator=gen) + 1)[:used]
    table = torch.full((len(needed), width), poisoned, dtype=torch.int32)
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = interior[start : start + n].to(torch.int32)
        start += n
    return table, num_blocks, poisoned


def _build_inputs(case: AttentionCase, device: torch.device, oracle: Oracle) -> _Inputs:
    gen = torch.Generator().manual_seed(case.seed)
    g = case.geometry
    b, hkv, d, dtype = case.block_size, case.num_kv_heads, case.head_size, case.dtype
    table, num_blocks, poisoned = _block_table(case, gen)

    # Every token of every sequence (context and new) is in the cache before forward runs.
    positions = [torch.arange(s) for s in g.seq_lens]
    slots = torch.cat([table[i].long()[p // b] * b + p % b for i, p in enumerate(positions)])
    total = int(slots.shape[0])
    keys = torch.randn(total, hkv, d, generator=gen, dtype=torch.float64).to(dtype)
    values = torch.randn(total, hkv, d, generator=gen, dtype=torch.float64).to(dtype)
    cache_cpu = torch.full((2, num_blocks, b, hkv, d), POISON, dtype=case.cache_dtype)
    if case.kv_cache_dtype is None:
        oracle.cache_ops.reshape_and_cache(keys, values, cache_cpu, slots)
    else:
        oracle.cache_ops.reshape_and_cache(keys, values, cache_cpu, slots, kv_scales=FP8_KV_SCALES)
    kv_cache = GuardedTensor(tuple(cache_cpu.shape), case.cache_dtype, device, margin=b * hkv * d)
    kv_cache.tensor.copy_(cache_cpu)

    num_tokens = sum(g.query_lens)
    query_cpu = torch.full((num_tokens + PADDING_ROWS, case.num_q_heads, d), POISON, dtype=dtype)
    query_cpu[:num_tokens] = torch.randn(
        num_tokens, case.num_q_heads, d, generator=gen, dtype=torch.float64
    ).to(dtype)
    query = query_cpu.to(device)
    out = GuardedTensor(tuple(query_cpu.shape), dtype, device, margin=2 * case.num_q_heads * d)

    metadata_cpu = AttentionMetadata.build(list(g.query_lens), list(g.seq_lens), table, b, "cpu")
    metadata = AttentionMetadata.build(list(g.query_lens), list(g.seq_lens), table, b, device)
    wide = torch.full(
        (table.shape[0], table.shape[1] + EXTRA_TABLE_STRIDE), poisoned, dtype=torch.int32, device=device
    )
    wide[:, : table.shape[1]] = table.to(device)
    metadata = dataclasses.replace(metadata, block_table=wide[:, : table.shape[1]])
    return _Inputs(query, kv_cache, metadata, out, cache_cpu, query_cpu, metadata_cpu)


def _reference(case: AttentionCase, inputs: _Inputs, oracle: Oracle, scale: float) -> torch.Tensor:
    """cpu_reference's output in float64 on the rounded inputs: [num_tokens, num_q_heads, head_size]."""
    fp8 = case.kv_cache_dtype is not None
    result = oracle.attention.forward(
        inputs.query_cpu.double(),
        inputs.cache_cpu if fp8 else inputs.cache_cpu.double(),  # FP8: dequantized in float64
        inputs.metadata_cpu,
        scale=scale,
        sliding_window=case.sliding_window,
        logit_softcap=case.logit_softcap,
        kv_scales=FP8_KV_SCALES if fp8 else None,
    )
    return result[: inputs.metadata_cpu.num_actual_tokens]


def _call(backend: AttentionBackend, case: AttentionCase, inputs: _Inputs, scale: float) -> torch.Tensor:
    with torch.no_grad():
        if case.kv_cache_dtype in backend.capabilities.kv_cache_dtypes:
            return backend.forward(
                inputs.query,
                inputs.kv_cache.tensor,
                inputs.metadata,
                scale=scale,
                sliding_window=case.sliding_window,
                logit_softcap=case.logit_softcap,
                out=inputs.out.tensor if case.pass_out else None,
                kv_scales=FP8_KV_SCALES,
            )
        new_kv = NewKV()
        if backend.enable_new_kv_reads():
            # As `attention.layer.attend` calls it: the new tokens' cache rows passed beside it.
            rows = [inputs.kv_cache.tensor[i].flatten(0, 1)[inputs.metadata.slot_mapping] for i in (0, 1)]
            new_kv = NewKV(new_key=rows[0], new_value=rows[1])
        return backend.forward(
            inputs.query,
            inputs.kv_cache.tensor,
            inputs.metadata,
            scale=scale,
            sliding_window=case.sliding_window,
            logit_softcap=case.logit_softcap,
            out=inputs.out.tensor if case.pass_out else None,
            **new_kv,
        )


def tolerance_name(case: AttentionCase) -> str:
    """The tolerance row a case is judged by, as people read it ("bfloat16", "bfloat16 + fp8 KV")."""
    return dtype_name(case.dtype) + (" + fp8 KV" if case.kv_cache_dtype is not None else "")


def _error_stats(output: torch.Tensor, reference: torch.Tensor, case: AttentionCase) -> ErrorStats:
    tolerance = tolerance_for(case.dtype, case.kv_cache_dtype)
    err = (output - reference).abs()
    return ErrorStats(
        max_abs_err=float(err.max()) if err.numel() else 0.0,
        max_rel_err=float((err / reference.abs().clamp_min(tolerance.atol)).max()) if err.numel() else 0.0,
        worst_ratio=float((err / tolerance.bound(reference)).max()) if err.numel() else 0.0,
    )


def check_attention_case(
    backend: AttentionBackend, case: AttentionCase, device: torch.device, oracle: Oracle
) -> CaseResult:
    """Run `case` on `backend` (tensors on `device`) and judge it. Never raises for a backend's
    failure: exceptions become problems of a FAILED result."""
    name = backend.name
    scale = 1.0 / math.sqrt(case.head_size)
    inputs = _build_inputs(case, device, oracle)
    unsupported = case.unsupported_reason(backend.capabilities)
    if unsupported is not None:
        return _check_refused(backend, case, inputs, scale, unsupported)
    try:
        returned = _call(backend, case, inputs, scale)
    except Exception as e:
        return CaseResult(name, case, Status.FAILED, (f"forward raised {type(e).__name__}: {e}",), None)
    problems = _memory_problems(inputs)
    output = inputs.out.tensor
    if not case.pass_out:
        expected = (tuple(inputs.query.shape), inputs.query.dtype, inputs.query.device)
        got = (tuple(returned.shape), returned.dtype, returned.device)
        if got != expected:
            problems.append(f"forward without out= returned {got}, expected {expected}")
            return CaseResult(name, case, Status.FAILED, tuple(problems), None)
        output = returned
    errors = _compare(output[: inputs.metadata.num_actual_tokens], case, inputs, oracle, scale, problems)
    return CaseResult(name, case, Status.FAILED if problems else Status.PASSED, tuple(problems), errors)


def _memory_problems(inputs: _Inputs) -> list[str]:
    """Writes the backend must not make: outside `out`, anywhere in the KV cache, into the query."""
    problems = []
    changed = inputs.out.margins_changed()
    if changed:
        problems.append(f"wrote {changed} elements outside `out` (out-of-bounds write)")
    changed = inputs.kv_cache.margins_changed() + count_changed(inputs.cache_cpu, inputs.kv_cache.tensor)
    if changed:
        problems.append(
            f"modified {changed} elements of the KV cache or its guard region (must not write it)"
        )
    changed = count_changed(inputs.query_cpu, inputs.query)
    if changed:
        problems.append(f"modified {changed} elements of the query (must not write it)")
    return problems


def _compare(
    output: torch.Tensor,  # [num_actual_tokens, num_q_heads, head_size], the backend's
    case: AttentionCase,
    inputs: _Inputs,
    oracle: Oracle,
    scale: float,
    problems: list[str],
) -> ErrorStats:
    """Error statistics of `output` against the reference; appends to `problems` (mutates it) for
    non-finite elements and for errors beyond the tolerance."""
    actual = output.detach().to("cpu", torch.float64)
    reference = _reference(case, inputs, oracle, scale)
    bad = ~torch.isfinite(actual)
    if bool(bad.any()):
        rows = sorted({int(r) for r in bad.nonzero()[:, 0]})
        problems.append(
            f"{int(bad.sum())} non-finite output elements in rows {rows[:8]}{'...' if len(rows) > 8 else ''} "
            "(unwritten rows, or reads of poisoned cache slots, guard blocks or padding rows)"
        )
    errors = _error_stats(torch.where(bad, torch.zeros_like(actual), actual), reference, case)
    if errors.worst_ratio > 1.0:
        problems.append(
            f"output differs from the float64 reference beyond the {tolerance_name(case)} tolerance "
            f"(max abs err {errors.max_abs_err:.3g}, err/tol {errors.worst_ratio:.3g})"
        )
    return errors


def _check_refused(
    backend: AttentionBackend, case: AttentionCase, inputs: _Inputs, scale: float, reason: str
) -> CaseResult:
    """An undeclared case: the backend must raise `UnsupportedCase`, nothing else."""
    try:
        _call(backend, case, inputs, scale)
    except UnsupportedCase as e:
        return CaseResult(
            backend.name, case, Status.UNSUPPORTED, (), None, note=f"unsupported: {reason} ({e})"
        )
    except Exception as e:
        problem = f"{reason}, so forward must raise UnsupportedCase; it raised {type(e).__name__}: {e}"
        return CaseResult(backend.name, case, Status.FAILED, (problem,), None)
    problem = f"{reason}, so forward must raise UnsupportedCase; it returned normally"
    return CaseResult(backend.name, case, Status.FAILED, (problem,), None)
