"""Failures that point: where a failing attention output is worst, and what it looks like.

A failing case reports the worst element (request, query row and position, query head and the KV
head it should read, dimension) and then tries to explain the backend's output at that query row
and head with a handful of *alternative* attentions, each one bug that paged attention kernels
actually have: the causal mask off by one, no causal mask, the query head reading another KV head,
a wrong softmax scale, the sliding window ignored or off by one, the softcap ignored, the
attention sink ignored, counted twice (once per KV split of two) or scaled like a score, and one
key position included or left out. An alternative that reproduces the output far better than the
reference does names the likely cause. The pattern of failing rows and heads is reported too
(only rows of requests with more than one query token; only some query heads).

Everything here is float64 on the CPU, on one query row: cheap next to the case itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from pagedserve.conformance.cases import AttentionCase
from pagedserve.conformance.tolerances import Tolerance
from pagedserve.platforms.attention_metadata import AttentionMetadata

EXPLAINED = 0.2  # an alternative explains the output when it leaves at most this share of the error
SCALE_FACTORS = tuple(math.exp(x / 40) for x in range(-120, 121) if abs(x) >= 2)  # e^-3 .. e^3


@dataclass(frozen=True, slots=True)
class DiagnosisInputs:
    """The case's inputs as the reference saw them: float64, on the CPU."""

    query: torch.Tensor  # [num_tokens + padding, num_q_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size], dequantized
    metadata: AttentionMetadata  # CPU tensors, plain block table
    sinks: torch.Tensor | None = None  # [num_q_heads] float64 sink logits; None: no sinks


@dataclass(frozen=True, slots=True)
class _Row:
    """One query row of one request with its request's keys and values."""

    request: int
    row: int  # within the request
    query_len: int
    seq_len: int
    position: int  # absolute position of the query token
    keys: torch.Tensor  # [seq_len, num_kv_heads, head_size]
    values: torch.Tensor  # [seq_len, num_kv_heads, head_size]


def _row(inputs: DiagnosisInputs, token: int, block_size: int) -> _Row:
    meta = inputs.metadata
    starts = meta.query_start_loc_cpu.tolist()
    req = max(i for i in range(meta.num_reqs) if starts[i] <= token)
    query_len = starts[req + 1] - starts[req]
    seq_len = int(meta.seq_lens_cpu[req])
    positions = torch.arange(seq_len)
    blocks = meta.block_table[req].long()[positions // block_size]
    offsets = positions % block_size
    row = token - starts[req]
    return _Row(
        request=req,
        row=row,
        query_len=query_len,
        seq_len=seq_len,
        position=seq_len - query_len + row,
        keys=inputs.kv_cache[0, blocks, offsets],
        values=inputs.kv_cache[1, blocks, offsets],
    )


def _attend(
    q: torch.Tensor,  # [head_size]
    keys: torch.Tensor,  # [n, head_size]
    values: torch.Tensor,  # [n, head_size]
    visible: torch.Tensor,  # [n] bool
    scale: float,
    softcap: float | None,
    sink: float | None = None,  # the head's sink logit: one more softmax entry, with no value
) -> torch.Tensor:  # [head_size]
    scores = (keys @ q) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, -math.inf)
    if sink is None:
        return torch.softmax(scores, 0) @ values
    probs = torch.softmax(torch.cat((scores, scores.new_full((1,), sink))), 0)
    return probs[:-1] @ values


def _visible(n: int, last: int, window: int | None) -> torch.Tensor:
    """Keys `[last - window + 1, last]` (or `[0, last]`) of `n`, as a mask."""
    k = torch.arange(n)
    mask = k <= last
    if window is not None:
        mask &= k > last - window
    return mask


def diagnose(
    case: AttentionCase,
    inputs: DiagnosisInputs,
    actual: torch.Tensor,  # [num_actual_tokens, num_q_heads, head_size] float64, the backend's (finite)
    reference: torch.Tensor,  # the same, the reference's
    tolerance: Tolerance,
    scale: float,
) -> list[str]:
    """Lines for a failing case: where the error is largest, the pattern of failing rows and
    heads, and the likely cause when one alternative attention reproduces the output."""
    ratio = (actual - reference).abs() / tolerance.bound(reference)
    token, head, dim = (int(i) for i in (ratio == ratio.max()).nonzero()[0])
    group = case.num_q_heads // case.num_kv_heads
    row = _row(inputs, token, case.block_size)
    lines = [
        f"worst element: request {row.request} (query_len {row.query_len}, seq_len {row.seq_len}), query "
        f"row {row.row} (position {row.position}), query head {head} -> KV head {head // group}, dim {dim}: "
        f"got {float(actual[token, head, dim]):.6g}, expected {float(reference[token, head, dim]):.6g}"
    ]
    lines += _pattern(case, inputs.metadata, ratio > 1.0)
    cause = _explain(case, inputs, row, token, head, actual, reference, scale)
    if cause is not None:
        lines.append(f"hint: {cause}")
    return lines


def _pattern(case: AttentionCase, meta: AttentionMetadata, failing: torch.Tensor) -> list[str]:
    """The pattern of failing elements by request kind and by query head."""
    lines = []
    starts = meta.query_start_loc_cpu.tolist()
    rows = failing.any(dim=(1, 2))
    failing_reqs = [i for i in range(meta.num_reqs) if bool(rows[starts[i] : starts[i + 1]].any())]
    query_lens = [starts[i + 1] - starts[i] for i in range(meta.num_reqs)]
    if failing_reqs and all(query_lens[i] > 1 for i in failing_reqs) and any(q == 1 for q in query_lens):
        lines.append(
            f"hint: only rows of requests with query_len > 1 fail (requests {failing_reqs}); every decode "
            "(query_len 1) passes: look at the causal mask between a request's new tokens"
        )
    heads = sorted({int(h) for h in failing.any(dim=(0, 2)).nonzero()[:, 0]})
    if heads and len(heads) < case.num_q_heads and case.num_q_heads > case.num_kv_heads:
        lines.append(
            f"hint: only query heads {heads} of {case.num_q_heads} fail (GQA ratio "
            f"{case.num_q_heads // case.num_kv_heads}): look at the query-head -> KV-head mapping"
        )
    return lines


def _explain(
    case: AttentionCase,
    inputs: DiagnosisInputs,
    row: _Row,
    token: int,
    head: int,
    actual: torch.Tensor,
    reference: torch.Tensor,
    scale: float,
) -> str | None:
    """The alternative attention that best reproduces the backend's output at (`token`, `head`),
    when it leaves at most `EXPLAINED` of the reference's error; None when none does."""
    group = case.num_q_heads // case.num_kv_heads
    kv_head = head // group
    q = inputs.query[token, head]
    got = actual[token, head]
    base_err = float((got - reference[token, head]).abs().max())
    p, n, w, cap = row.position, row.seq_len, case.sliding_window, case.logit_softcap
    sink = None if inputs.sinks is None else float(inputs.sinks[head])

    def attend(
        visible: torch.Tensor,
        kv: int = kv_head,
        s: float = scale,
        c: float | None = cap,
        k: float | None = sink,
    ) -> torch.Tensor:
        return _attend(q, row.keys[:, kv], row.values[:, kv], visible, s, c, k)

    candidates: list[tuple[str, Callable[[], torch.Tensor]]] = []
    if sink is not None:
        visible_now = _visible(n, p, w)
        candidates += [
            (
                f"attention sink ignored: the output matches no sink (head {head}'s is {sink:.4g})",
                partial(attend, visible_now, k=None),
            ),
            (
                "attention sink counted twice (once per KV split, say): the output matches "
                f"2 * exp(sink) in the denominator (head {head}'s sink is {sink:.4g})",
                partial(attend, visible_now, k=sink + math.log(2.0)),
            ),
            (
                f"attention sink scaled like a score: the output matches sink * {scale:.4g} "
                "(the sink logit is used as it is)",
                partial(attend, visible_now, k=sink * scale),
            ),
        ]
    if p + 1 < n:
        candidates.append(
            (
                f"causal mask off by one: the output matches query position {p} also seeing key {p + 1} "
                "(the next token's)",
                partial(attend, _visible(n, p + 1, w)),
            )
        )
        candidates.append(
            (
                f"no causal mask: the output matches query position {p} seeing all {n} keys of its request",
                partial(attend, _visible(n, n - 1, w)),
            )
        )
    if p > 0 and w != 1:
        candidates.append(
            (
                f"causal mask off by one: the output matches query position {p} not seeing its own key",
                partial(attend, _visible(n, p - 1, w)),
            )
        )
    for other in range(case.num_kv_heads):
        if other != kv_head:
            candidates.append(
                (
                    f"GQA head mapping: query head {head} read KV head {other}; with {case.num_q_heads} "
                    f"query heads over {case.num_kv_heads} KV heads it must read KV head {kv_head} "
                    f"(= {head} // {group}; {head} % {case.num_kv_heads} = {head % case.num_kv_heads} "
                    "is the interleaved mapping)",
                    partial(attend, _visible(n, p, w), kv=other),
                )
            )
    if w is not None:
        candidates.append(
            (
                f"sliding window ignored: the output matches window {w} not applied",
                partial(attend, _visible(n, p, None)),
            )
        )
        for wrong in (w - 1, w + 1):
            if wrong >= 1:
                candidates.append(
                    (
                        f"sliding window off by one: the output matches a window of {wrong} keys, not {w}",
                        partial(attend, _visible(n, p, wrong)),
                    )
                )
    if cap is not None:
        candidates.append(
            (
                f"softcap ignored: the output matches no softcap (declared {cap})",
                partial(attend, _visible(n, p, w), c=None),
            )
        )
    best = _best(candidates, got, base_err)
    if best is not None:
        return best
    # A uniform scale error: one factor on every score, searched on a grid.
    visible = _visible(n, p, w)
    scaled: list[tuple[str, Callable[[], torch.Tensor]]] = [
        (
            f"softmax scale: the output matches scores scaled by {scale * f:.4g} instead of {scale:.4g} "
            f"(1/sqrt(head_size) times {f:.3g})",
            partial(attend, visible, s=scale * f),
        )
        for f in SCALE_FACTORS
    ]
    best = _best(scaled, got, base_err)
    if best is not None:
        return best
    return _key_attribution(row, q, got, base_err, kv_head, scale, cap, w, sink)


def _best(
    candidates: list[tuple[str, Callable[[], torch.Tensor]]], got: torch.Tensor, base_err: float
) -> str | None:
    """The text of the candidate closest to `got`, if it leaves at most `EXPLAINED` of `base_err`."""
    scored = [(float((got - make()).abs().max()), text) for text, make in candidates]
    if not scored:
        return None
    err, text = min(scored, key=lambda t: t[0])
    return text if err <= EXPLAINED * base_err else None


def _key_attribution(
    row: _Row,
    q: torch.Tensor,
    got: torch.Tensor,
    base_err: float,
    kv_head: int,
    scale: float,
    cap: float | None,
    window: int | None,
    sink: float | None = None,
) -> str | None:
    """The one key position whose inclusion (a masked key) or exclusion (a visible key) best
    reproduces `got`, when it explains the error (the sink, if any, staying in the denominator)."""
    keys, values = row.keys[:, kv_head], row.values[:, kv_head]
    scores = (keys @ q) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    visible = _visible(row.seq_len, row.position, window)
    top = scores[visible].max() if sink is None else torch.clamp(scores[visible].max(), min=sink)
    weights = torch.exp(scores - top)
    num = (weights[visible, None] * values[visible]).sum(0)
    den = weights[visible].sum() + (0.0 if sink is None else math.exp(sink - float(top)))
    sign = torch.where(visible, -1.0, 1.0).double()  # remove a visible key, add a masked one
    alt_den = den + sign * weights
    alternatives = (num[None, :] + sign[:, None] * weights[:, None] * values) / alt_den[:, None]
    errs = (got[None, :] - alternatives).abs().amax(1)
    errs = torch.where(alt_den > 0, errs, torch.full_like(errs, math.inf))
    k = int(errs.argmin())
    if float(errs[k]) > EXPLAINED * base_err:
        return None
    if bool(visible[k]):
        return f"key position {k} (visible to query position {row.position}) is missing from the output"
    return (
        f"key position {k} (masked for query position {row.position}: "
        f"{'in its future' if k > row.position else 'outside its window'}) is included in the output"
    )
