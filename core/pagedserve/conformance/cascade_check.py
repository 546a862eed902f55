"""Running one `CascadeCase` on a backend's cascade operations and judging it against the oracle.

The cache holds every token of every request; the shared prefix's blocks lead every request's
(shuffled) block table and `prefix_block_table` names them, and the rest of each table is the
request's own blocks, with gaps and a poisoned block in unused entries. Each part is compared
with the oracle's float64 state (output and log-sum-exp; the states must be float32, or float64
for float64 queries), and the merge of the backend's own states with the oracle's plain
`forward` over the whole context: the cascade step must be the step.

The merge-only case builds states directly: rows where the prefix part is empty, rows where the
suffix part is, and padding rows where both are (they must merge to zero).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from pagedserve.conformance.cascade_cases import CascadeCase
from pagedserve.conformance.oracle import Oracle
from pagedserve.conformance.results import CaseResult, ErrorStats, Status
from pagedserve.conformance.tolerances import TOLERANCES, Tolerance
from pagedserve.platforms.api import AttentionBackend, UnsupportedCase
from pagedserve.platforms.attention_metadata import AttentionMetadata, CascadeMetadata
from pagedserve.platforms.attention_states import AttentionState, merge_states_reference

POISON = 1e4  # never-written cache slots and unused table entries' block hold this


def _inputs(
    case: CascadeCase, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # query, cache (float64, CPU), block table
    """The query rows (two padding rows past the step's), the cache and the block table. The
    prefix's blocks are shared whole: when the prefix ends inside a block, that block's later
    tokens are shared too (the contract names a shared prefix, not the longest one)."""
    b, hkv, d = case.block_size, case.num_kv_heads, case.head_size
    shared = -(-case.prefix_len // b)
    own = [max(0, -(-s // b) - shared) for s in case.seq_lens]
    num_blocks = shared + sum(own) + 3
    perm = torch.randperm(num_blocks - 2, generator=gen) + 1  # block 0 and the last never used
    poisoned = num_blocks - 1
    width = shared + max(own) + 2
    table = torch.full((len(own), width), poisoned, dtype=torch.int32)
    table[:, :shared] = perm[:shared].to(torch.int32)
    start = shared
    for i, n in enumerate(own):
        table[i, shared : shared + n] = perm[start : start + n].to(torch.int32)
        start += n
    cache = torch.full((2, num_blocks, b, hkv, d), POISON, dtype=torch.float64)
    common = torch.randn(2, shared * b, hkv, d, generator=gen, dtype=torch.float64)
    cache[:, table[0, :shared].long()] = common.view(2, shared, b, hkv, d)
    for i, s in enumerate(case.seq_lens):
        if s > shared * b:
            pos = torch.arange(shared * b, s)
            kv = torch.randn(2, len(pos), hkv, d, generator=gen, dtype=torch.float64)
            cache[:, table[i].long()[pos // b], pos % b] = kv
    tokens = sum(case.query_lens)
    query = torch.randn(tokens + 2, case.num_q_heads, d, generator=gen, dtype=torch.float64)
    return query, cache, table


def _metadata(case: CascadeCase, table: torch.Tensor, device: torch.device) -> AttentionMetadata:
    metadata = AttentionMetadata.build(
        list(case.query_lens), list(case.seq_lens), table, case.block_size, device
    )
    prefix = CascadeMetadata.build(metadata.block_table[0], case.prefix_len, case.block_size)
    return dataclasses.replace(metadata, cascade=prefix)


def _stats(got: torch.Tensor, want: torch.Tensor, tolerance: Tolerance) -> ErrorStats:
    err = (got.double() - want).abs()
    finite = torch.isfinite(want)
    err = torch.where(finite, err, torch.where(got.double() == want, 0.0, math.inf))
    if not err.numel():
        return ErrorStats(0.0, 0.0, 0.0)
    bound = tolerance.bound(torch.where(finite, want, 0.0))
    return ErrorStats(
        max_abs_err=float(err.max()),
        max_rel_err=float((err / want.abs().clamp_min(tolerance.atol)).max()),
        worst_ratio=float((err / bound).max()),
    )


def _state_problems(
    name: str, state: object, want: AttentionState, rows: int, case: CascadeCase, tolerance: Tolerance
) -> tuple[list[str], ErrorStats | None]:
    if not isinstance(state, AttentionState):
        return [f"{name} returned {type(state).__name__}, not an AttentionState"], None
    expected_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    problems = []
    for field, tensor, shape in (
        ("out", state.out, (rows, case.num_q_heads, case.head_size)),
        ("lse", state.lse, (rows, case.num_q_heads)),
    ):
        if tensor.dtype != expected_dtype or tuple(tensor.shape[1:]) != shape[1:] or tensor.shape[0] < rows:
            problems.append(
                f"{name}.{field} must be {expected_dtype} [>= {rows}, ...{list(shape[1:])}], got "
                f"{tensor.dtype} {tuple(tensor.shape)}"
            )
    if problems:
        return problems, None
    out_stats = _stats(state.out[:rows].cpu(), want.out[:rows], tolerance)
    lse_stats = _stats(state.lse[:rows].cpu(), want.lse[:rows], tolerance)
    for field, stats in (("out", out_stats), ("lse", lse_stats)):
        if stats.worst_ratio > 1:
            problems.append(
                f"{name}.{field} differs from the reference beyond the {case.dtype} tolerance "
                f"(max abs err {stats.max_abs_err:.3g})"
            )
    worst = max((out_stats, lse_stats), key=lambda s: s.worst_ratio)
    return problems, worst


def _merge_states(case: CascadeCase, gen: torch.Generator) -> tuple[AttentionState, AttentionState]:
    """States of 8 rows: rows 0-3 both parts, 4-5 prefix only, 6 suffix only, 7 neither."""
    rows, hq, d = 8, case.num_q_heads, case.head_size
    dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    parts = []
    for empty in ((4, 5, 7), (6, 7)):
        out = torch.randn(rows, hq, d, generator=gen, dtype=torch.float64)
        lse = torch.randn(rows, hq, generator=gen, dtype=torch.float64) * 3
        lse[list(empty)] = -math.inf
        out[list(empty)] = 0.0
        parts.append(AttentionState(out.to(dtype), lse.to(dtype)))
    return parts[0], parts[1]


def check_cascade_case(
    backend: AttentionBackend, case: CascadeCase, device: torch.device, oracle: Oracle
) -> CaseResult:
    """Run `case` on `backend` (tensors on `device`) and judge it against `oracle` in float64.
    Never raises for a failure of the backend: exceptions become problems of a FAILED result."""
    gen = torch.Generator().manual_seed(case.seed)
    tolerance = TOLERANCES[case.dtype]
    if case.merge_only:
        return _check_merge(backend, case, device, gen, tolerance)
    query64, cache64, table = _inputs(case, gen)
    meta_cpu = _metadata(case, table, torch.device("cpu"))
    rows = meta_cpu.num_actual_tokens
    scale = 1 / math.sqrt(case.head_size)
    options: dict[str, Any] = {"scale": scale, "logit_softcap": case.logit_softcap}
    query, cache = query64.to(case.dtype), cache64.to(case.dtype)
    want_prefix = oracle.attention.prefix_attention(query.double(), cache.double(), meta_cpu, **options)
    want_suffix = oracle.attention.suffix_attention(query.double(), cache.double(), meta_cpu, **options)
    want = oracle.attention.forward(query.double(), cache.double(), meta_cpu, **options)
    problems: list[str] = []
    worst: ErrorStats | None = None
    try:
        with torch.no_grad():
            meta = _metadata(case, table, device)
            q, kv = query.to(device), cache.to(device)
            if case.sliding_window is not None:
                return _check_refused(backend, case, q, kv, meta, scale)
            prefix = backend.prefix_attention(q, kv, meta, **options)
            suffix = backend.suffix_attention(q, kv, meta, **options)
            for name, state, expected in (
                ("prefix_attention", prefix, want_prefix),
                ("suffix_attention", suffix, want_suffix),
            ):
                found, stats = _state_problems(name, state, expected, rows, case, tolerance)
                problems += found
                if stats is not None and (worst is None or stats.worst_ratio > worst.worst_ratio):
                    worst = stats
            if not problems:
                out = torch.full_like(q, POISON)
                merged = backend.merge_attention_states(prefix, suffix, out)
                stats = _stats(merged[:rows].cpu(), want[:rows], tolerance)
                if stats.worst_ratio > 1:
                    problems.append(
                        f"the merged cascade output differs from forward over the whole context beyond "
                        f"the {case.dtype} tolerance (max abs err {stats.max_abs_err:.3g})"
                    )
                worst = stats if worst is None or stats.worst_ratio > worst.worst_ratio else worst
            if not torch.equal(kv.cpu(), cache):
                problems.append("the KV cache (an input) was changed")
    except UnsupportedCase as e:
        problems.append(f"the backend declares cascade_attention but refused a declared case: {e}")
    except Exception as e:
        problems.append(f"raised {type(e).__name__}: {e}")
    status = Status.FAILED if problems else Status.PASSED
    return CaseResult(backend.name, case, status, tuple(problems), worst)


def _check_refused(
    backend: AttentionBackend,
    case: CascadeCase,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> CaseResult:
    """A sliding window: both parts must raise `UnsupportedCase`, nothing else."""
    problems = []
    for name in ("prefix_attention", "suffix_attention"):
        call = getattr(backend, name)
        try:
            call(query, kv_cache, metadata, scale=scale, sliding_window=case.sliding_window)
        except UnsupportedCase:
            continue
        except Exception as e:
            problems.append(
                f"{name} with a sliding window must raise UnsupportedCase; it raised {type(e).__name__}: {e}"
            )
            continue
        problems.append(f"{name} with a sliding window must raise UnsupportedCase; it returned normally")
    if problems:
        return CaseResult(backend.name, case, Status.FAILED, tuple(problems), None)
    return CaseResult(
        backend.name, case, Status.PASSED, (), None, note="sliding window refused, as it must be"
    )


def _check_merge(
    backend: AttentionBackend,
    case: CascadeCase,
    device: torch.device,
    gen: torch.Generator,
    tolerance: Tolerance,
) -> CaseResult:
    a, b = _merge_states(case, gen)
    want = merge_states_reference(a, b, torch.empty(a.out.shape, dtype=torch.float64))
    problems: list[str] = []
    stats = None
    try:
        on = [AttentionState(s.out.to(device), s.lse.to(device)) for s in (a, b)]
        out = torch.full(a.out.shape, POISON, dtype=case.dtype, device=device)
        merged = backend.merge_attention_states(on[0], on[1], out).cpu()
        stats = _stats(merged, want, tolerance)
        if not torch.isfinite(merged).all():
            problems.append(
                "non-finite merged rows (a part with lse = -inf weighs nothing; both empty: zero)"
            )
        elif stats.worst_ratio > 1:
            problems.append(f"the merge differs from the reference beyond the {case.dtype} tolerance")
    except Exception as e:
        problems.append(f"merge_attention_states raised {type(e).__name__}: {e}")
    status = Status.FAILED if problems else Status.PASSED
    return CaseResult(backend.name, case, status, tuple(problems), stats)
