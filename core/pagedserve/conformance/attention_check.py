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

Attention-sink cases (`case.attention_sinks`) draw one sink logit per query head from
`SINK_RANGE` after every other tensor (so the other cases' inputs do not move), pass them as
`sinks=` (float32, on the device) and compare with the oracle computing the sink in float64.

An undeclared case is instead called once and must raise `UnsupportedCase`; an undeclared FP8 case
is called without `kv_scales`, as the engine would never pass them to such a backend.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from pagedserve.attention.layer import NewKV, sinks_keyword
from pagedserve.conformance.cases import FP8_KV_SCALES, SINK_RANGE, AttentionCase, dtype_name
from pagedserve.conformance.diagnosis import DiagnosisInputs, diagnose
from pagedserve.conformance.guards import POISON, GuardedTensor, bits, count_changed
from pagedserve.conformance.oracle import Oracle
from pagedserve.conformance.results import CaseResult, ErrorStats, Status
from pagedserve.conformance.tolerances import Tolerance, tolerance_for
from pagedserve.platforms.api import AttentionBackend, AttentionCapabilities, UnsupportedCase
from pagedserve.platforms.attention_metadata import AttentionMetadata

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
    sinks: torch.Tensor | None = None  # [num_q_heads] float32 on the device: `case.attention_sinks`


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
    sinks = None
    if case.attention_sinks:  # drawn last: the case's other tensors are those of its sink-less twin
        sinks = torch.empty(case.num_q_heads, dtype=torch.float64).uniform_(*SINK_RANGE, generator=gen)
        sinks[0] = SINK_RANGE[1]
        sinks = sinks.float().to(device)
    return _Inputs(query, kv_cache, metadata, out, cache_cpu, query_cpu, metadata_cpu, sinks)


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
        **sinks_keyword(None if inputs.sinks is None else inputs.sinks.cpu()),
    )
    return result[: inputs.metadata_cpu.num_actual_tokens]


def _call(
    backend: AttentionBackend,
    case: AttentionCase,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    out: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,  # [num_q_heads] float32: exactly for `case.attention_sinks`
) -> object:
    """`forward` as the engine calls it for `case` (`sinks=` only for a sink case, as
    `attention.layer.attend` passes it only for a layer with sinks). Returns whatever the backend
    returned (the caller checks it is a tensor)."""
    with torch.no_grad():
        if case.kv_cache_dtype in backend.capabilities.kv_cache_dtypes:
            return backend.forward(
                query,
                kv_cache,
                metadata,
                scale=scale,
                sliding_window=case.sliding_window,
                logit_softcap=case.logit_softcap,
                out=out,
                kv_scales=FP8_KV_SCALES,
                **sinks_keyword(sinks),
            )
        new_kv = NewKV()
        if backend.enable_new_kv_reads():
            # As `attention.layer.attend` calls it: the new tokens' cache rows passed beside it.
            rows = [kv_cache[i].flatten(0, 1)[metadata.slot_mapping] for i in (0, 1)]
            new_kv = NewKV(new_key=rows[0], new_value=rows[1])
        return backend.forward(
            query,
            kv_cache,
            metadata,
            scale=scale,
            sliding_window=case.sliding_window,
            logit_softcap=case.logit_softcap,
            out=out,
            **new_kv,
            **sinks_keyword(sinks),
        )


def _call_case(backend: AttentionBackend, case: AttentionCase, inputs: _Inputs, scale: float) -> object:
    out = inputs.out.tensor if case.pass_out else None
    return _call(
        backend, case, inputs.query, inputs.kv_cache.tensor, inputs.metadata, out, scale, inputs.sinks
    )


def tolerance_name(case: AttentionCase, exact_float32: bool = False) -> str:
    """The tolerance row a case is judged by, as people read it ("bfloat16", "bfloat16 + fp8 KV",
    "float32 without TF32")."""
    name = dtype_name(case.dtype)
    if exact_float32 and case.dtype == torch.float32:
        name += " without TF32"
    return name + (" + fp8 KV" if case.kv_cache_dtype is not None else "")


def case_tolerance(case: AttentionCase, caps: AttentionCapabilities) -> Tolerance:
    """The tolerance `case` is judged by for a backend declaring `caps`."""
    return tolerance_for(case.dtype, case.kv_cache_dtype, exact_float32=caps.exact_float32)


def _error_stats(output: torch.Tensor, reference: torch.Tensor, tolerance: Tolerance) -> ErrorStats:
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
        returned = _call_case(backend, case, inputs, scale)
    except Exception as e:
        return CaseResult(name, case, Status.FAILED, (f"forward raised {type(e).__name__}: {e}",), None)
    problems = _memory_problems(inputs)
    out = inputs.out.tensor if case.pass_out else None
    problems += output_contract_problems(returned, inputs.query, out)
    # What the engine goes on with: `out` when it was given (the backend wrote it), else the
    # returned tensor, judged by value even when its dtype is wrong (the contract problem is
    # reported above) but only when its shape lets rows be compared.
    output: torch.Tensor | None = inputs.out.tensor
    if out is None:
        shaped = isinstance(returned, torch.Tensor) and tuple(returned.shape) == tuple(inputs.query.shape)
        output = returned if shaped and isinstance(returned, torch.Tensor) else None
    if output is None:
        return CaseResult(name, case, Status.FAILED, tuple(problems), None)
    n = inputs.metadata.num_actual_tokens
    tolerance = case_tolerance(case, backend.capabilities)
    reference = _reference(case, inputs, oracle, scale)
    errors = _compare(output[:n], reference, case, inputs, tolerance, backend.capabilities, scale, problems)
    if backend.capabilities.deterministic:
        problems += _determinism_problems(backend, case, inputs, output[:n], scale)
    if case.check_batch_invariance:
        problems += _batch_invariance_problems(backend, case, inputs, output[:n], reference, tolerance, scale)
    return CaseResult(name, case, Status.FAILED if problems else Status.PASSED, tuple(problems), errors)


def output_contract_problems(returned: object, query: torch.Tensor, out: torch.Tensor | None) -> list[str]:
    """What is wrong with what `forward` returned: it must be a tensor of the query's shape, dtype
    and device (the engine continues with it: a float32 result in a bfloat16 model fails the next
    layer's matmul), and `out` itself when `out` was given (the engine may hold on to either)."""
    expected = f"{tuple(query.shape)} {dtype_name(query.dtype)} on {query.device}"
    if not isinstance(returned, torch.Tensor):
        return [f"forward returned {type(returned).__name__}, not a tensor; expected {expected}"]
    problems = []
    got = f"{tuple(returned.shape)} {dtype_name(returned.dtype)} on {returned.device}"
    how = "with out=" if out is not None else "without out="
    if returned.dtype != query.dtype:
        problems.append(
            f"forward {how} returned {dtype_name(returned.dtype)}, expected the query's dtype "
            f"{dtype_name(query.dtype)} (returned {got}; expected {expected})"
        )
    elif (tuple(returned.shape), returned.device) != (tuple(query.shape), query.device):
        problems.append(f"forward {how} returned {got}, expected {expected}")
    if out is not None and not _is_same_view(returned, out):
        problems.append(
            "forward with out= returned a new tensor, not `out`: return the `out` it was given "
            f"(returned {got} at address {returned.data_ptr():#x}, out at {out.data_ptr():#x})"
        )
    return problems


def _is_same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` is `b` or a view of exactly the same elements."""
    return a is b or (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.device == b.device
        and tuple(a.shape) == tuple(b.shape)
        and a.stride() == b.stride()
    )


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
    reference: torch.Tensor,  # the same, float64 on the CPU
    case: AttentionCase,
    inputs: _Inputs,
    tolerance: Tolerance,
    caps: AttentionCapabilities,
    scale: float,
    problems: list[str],
) -> ErrorStats:
    """Error statistics of `output` against the reference; appends to `problems` (mutates it) for
    non-finite elements and for errors beyond the tolerance, with where the error is largest and
    what it looks like (`diagnosis`)."""
    actual = output.detach().to("cpu", torch.float64)
    bad = ~torch.isfinite(actual)
    if bool(bad.any()):
        rows = sorted({int(r) for r in bad.nonzero()[:, 0]})
        problems.append(
            f"{int(bad.sum())} non-finite output elements in rows {rows[:8]}{'...' if len(rows) > 8 else ''} "
            "(unwritten rows, or reads of poisoned cache slots, guard blocks or padding rows)"
        )
    finite = torch.where(bad, torch.zeros_like(actual), actual)
    errors = _error_stats(finite, reference, tolerance)
    if errors.worst_ratio > 1.0:
        problems.append(
            "output differs from the float64 reference beyond the "
            f"{tolerance_name(case, caps.exact_float32)} tolerance (max abs err {errors.max_abs_err:.3g}, "
            f"err/tol {errors.worst_ratio:.3g})"
        )
        problems += diagnose(case, _diagnosis_inputs(case, inputs), finite, reference, tolerance, scale)
    return errors


def _diagnosis_inputs(case: AttentionCase, inputs: _Inputs) -> DiagnosisInputs:
    """The case's query and cache in float64 on the CPU (an FP8 cache dequantized), for `diagnose`."""
    cache = inputs.cache_cpu.double()
    if case.kv_cache_dtype is not None:
        cache = torch.stack((cache[0] * FP8_KV_SCALES.k_scale, cache[1] * FP8_KV_SCALES.v_scale))
    sinks = None if inputs.sinks is None else inputs.sinks.cpu().double()
    return DiagnosisInputs(
        query=inputs.query_cpu.double(), kv_cache=cache, metadata=inputs.metadata_cpu, sinks=sinks
    )


def _where(metadata: AttentionMetadata, row: int) -> str:
    """Flat query row `row` for people: "request 2, query row 3 of 6"."""
    starts = metadata.query_start_loc_cpu.tolist()
    req = max(i for i in range(metadata.num_reqs) if starts[i] <= row)
    return f"request {req}, query row {row - starts[req]} of {starts[req + 1] - starts[req]}"


def _determinism_problems(
    backend: AttentionBackend, case: AttentionCase, inputs: _Inputs, first: torch.Tensor, scale: float
) -> list[str]:
    """The backend declares `deterministic`: the same call again, into a fresh `out`, must give the
    same bits in every real row."""
    out = GuardedTensor(tuple(inputs.query.shape), case.dtype, inputs.query.device, margin=1)
    try:
        again = _call(
            backend,
            case,
            inputs.query,
            inputs.kv_cache.tensor,
            inputs.metadata,
            out.tensor if case.pass_out else None,
            scale,
            inputs.sinks,
        )
    except Exception as e:
        return [f"the second identical call (determinism check) raised {type(e).__name__}: {e}"]
    second = out.tensor if case.pass_out else again
    if (
        not isinstance(second, torch.Tensor)
        or second.shape != inputs.query.shape
        or second.dtype != case.dtype
    ):
        return []  # the first call's contract problems already say what is wrong with it
    n = inputs.metadata.num_actual_tokens
    differs = bits(first) != bits(second[:n])
    if not bool(differs.any()):
        return []
    row, head, dim = (int(i) for i in differs.nonzero()[0])
    return [
        f"not deterministic: a second identical call changed {int(differs.sum())} of {differs.numel()} "
        f"output elements, compared bit for bit (first at {_where(inputs.metadata_cpu, row)}, head {head}, "
        f"dim {dim}: "
        f"{float(first[row, head, dim])!r} then {float(second[row, head, dim])!r}); the backend declares "
        f"deterministic=True in its capabilities (with {inputs.metadata.num_reqs} requests in the batch)"
    ]


def _batch_invariance_problems(
    backend: AttentionBackend,
    case: AttentionCase,
    inputs: _Inputs,
    batched: torch.Tensor,  # [num_actual_tokens, num_q_heads, head_size], the backend's
    reference: torch.Tensor,  # the same, float64 reference
    tolerance: Tolerance,
    scale: float,
) -> list[str]:
    """Each request run alone (a batch of one, same cache and blocks) must match its rows of the
    batched call within the tolerance: a result must not depend on the rest of the batch."""
    problems = []
    failing: list[str] = []  # one line per request whose alone result differs
    meta = inputs.metadata_cpu
    starts = meta.query_start_loc_cpu.tolist()
    table = inputs.metadata.block_table
    batched_cpu = batched.detach().to("cpu", torch.float64)
    for req in range(meta.num_reqs):
        lo, hi = starts[req], starts[req + 1]
        seq_len = int(meta.seq_lens_cpu[req])
        query = torch.full(
            (hi - lo + PADDING_ROWS, *inputs.query.shape[1:]),
            POISON,
            dtype=case.dtype,
            device=inputs.query.device,
        )
        query[: hi - lo] = inputs.query[lo:hi]
        metadata = AttentionMetadata.build(
            [hi - lo], [seq_len], table[req : req + 1], case.block_size, table.device
        )
        out = GuardedTensor(tuple(query.shape), case.dtype, query.device, margin=1)
        try:
            returned = _call(
                backend,
                case,
                query,
                inputs.kv_cache.tensor,
                metadata,
                out.tensor if case.pass_out else None,
                scale,
                inputs.sinks,
            )
        except Exception as e:
            problems.append(
                f"request {req} run alone (batch-invariance check) raised {type(e).__name__}: {e}"
            )
            continue
        alone_t = out.tensor if case.pass_out else returned
        if not isinstance(alone_t, torch.Tensor) or alone_t.shape != query.shape:
            problems.append(f"request {req} run alone: forward returned no [tokens, heads, head_size] tensor")
            continue
        alone = alone_t[: hi - lo].detach().to("cpu", torch.float64)
        ratio = (alone - batched_cpu[lo:hi]).abs() / tolerance.bound(reference[lo:hi])
        ratio = torch.where(torch.isfinite(ratio), ratio, torch.full_like(ratio, math.inf))
        worst = float(ratio.max())
        if worst > 1.0:
            row, head, dim = (int(i) for i in (ratio == ratio.max()).nonzero()[0])
            failing.append(
                f"request {req} (diff/tol {worst:.3g} at its query row {row}, head {head}, dim {dim}: alone "
                f"{float(alone[row, head, dim]):.6g}, in the batch "
                f"{float(batched_cpu[lo + row, head, dim]):.6g})"
            )
    if failing:
        shown = "; ".join(failing[:2]) + (f"; and {len(failing) - 2} more" if len(failing) > 2 else "")
        problems.append(
            f"batch invariance: {len(failing)} of {meta.num_reqs} requests computed alone differ from the "
            f"same request in the batch of {meta.num_reqs} beyond the "
            f"{tolerance_name(case, backend.capabilities.exact_float32)} tolerance: {shown}. The result "
            "depends on the rest of the batch"
        )
    return problems


def _check_refused(
    backend: AttentionBackend, case: AttentionCase, inputs: _Inputs, scale: float, reason: str
) -> CaseResult:
    """An undeclared case: the backend must raise `UnsupportedCase`, nothing else."""
    try:
        _call_case(backend, case, inputs, scale)
    except UnsupportedCase as e:
        return CaseResult(
            backend.name, case, Status.UNSUPPORTED, (), None, note=f"unsupported: {reason} ({e})"
        )
    except Exception as e:
        problem = f"{reason}, so forward must raise UnsupportedCase; it raised {type(e).__name__}: {e}"
        return CaseResult(backend.name, case, Status.FAILED, (problem,), None)
    problem = f"{reason}, so forward must raise UnsupportedCase; it returned normally"
    return CaseResult(backend.name, case, Status.FAILED, (problem,), None)
