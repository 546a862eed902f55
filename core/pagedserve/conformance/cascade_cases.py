"""The cascade-attention cases (`CascadeCase`, plugin API 1.16), for backends declaring
`cascade_attention`: one step whose requests share a prefix, run through the backend's
`prefix_attention`, `suffix_attention` and `merge_attention_states`.

Groups (each at the backend's base shape unless it varies one property):

* `cascade_partial_block`: a prefix that ends inside a block (37 tokens in blocks of 16), decodes
  beside a chunked prefill and a speculative query.
* `cascade_whole_context`: the prefix is every request's whole cached context (the suffix is only
  the step's own tokens).
* `cascade_one_request`: one request, its context the prefix and a little more.
* `cascade_gqa`: GQA ratios 1, 3, 4 and MQA.
* `cascade_dtype`: every declared compute dtype.
* `cascade_softcap`: with a logit softcap (when declared).
* `cascade_sliding_window`: a sliding window, which the split cannot express: must be refused with
  `UnsupportedCase`.
* `cascade_merge`: the merge alone, on states where one part or both are empty (`lse = -inf`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedserve.conformance.cases import (
    QUICK_GQA_HEADS,
    _seed,
    base_shape,
    declared_compute_dtypes,
    dtype_name,
)
from pagedserve.platforms.api import AttentionCapabilities

CASCADE_SOFTCAP = 2.0


@dataclass(frozen=True, slots=True)
class CascadeCase:
    """One cascade step to check against the reference."""

    group: str  # "cascade_partial_block", "cascade_gqa", ...
    variant: str  # what distinguishes it within the group
    prefix_len: int  # tokens every request shares
    query_lens: tuple[int, ...]  # req index -> new tokens
    seq_lens: tuple[int, ...]  # req index -> context + new tokens; context >= prefix_len
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    seed: int
    logit_softcap: float | None = None
    sliding_window: int | None = None  # set only on the refusal probe
    merge_only: bool = False  # check `merge_attention_states` alone, on states with empty parts

    @property
    def case_id(self) -> str:
        return f"{self.group}[{self.variant}]"

    @property
    def description(self) -> str:
        options = f" softcap={self.logit_softcap}" if self.logit_softcap is not None else ""
        options += f" window={self.sliding_window}" if self.sliding_window is not None else ""
        options += " merge only" if self.merge_only else ""
        return (
            f"prefix={self.prefix_len} query_lens={list(self.query_lens)} seq_lens={list(self.seq_lens)} "
            f"heads={self.num_q_heads}/{self.num_kv_heads} head_size={self.head_size} "
            f"block_size={self.block_size} {dtype_name(self.dtype)}{options}"
        )


def cascade_cases(caps: AttentionCapabilities, *, seed: int = 0) -> list[CascadeCase]:
    """The cascade cases of a backend declaring `caps` (none unless it declares
    `cascade_attention`). Pure."""
    if not caps.cascade_attention:
        return []
    head_size, block, dtype = base_shape(caps)
    p = 37 if block > 1 else 5  # inside a block for every block size but 1
    base = CascadeCase(
        group="",
        variant="",
        prefix_len=p,
        # Decodes, a chunk after the prefix and more context, a speculative query.
        query_lens=(1, 1, 6, 3, 1),
        seq_lens=(p + 2, p + 30, p + 19, p + 8, p + 1 + 2 * block),
        num_q_heads=4,
        num_kv_heads=2,
        head_size=head_size,
        block_size=block,
        dtype=dtype,
        seed=0,
    )
    cases: list[CascadeCase] = []

    def add(group: str, variant: str, **changes: object) -> None:
        case = replace(base, group=group, variant=variant, **changes)  # type: ignore[arg-type]
        cases.append(replace(case, seed=_seed(case.case_id, seed)))

    add("cascade_partial_block", f"prefix{p}_block{block}")
    add(
        "cascade_whole_context",
        "decodes_and_chunk",
        query_lens=(1, 1, 4, 1),
        seq_lens=(p + 1, p + 1, p + 4, p + 1),
    )
    add("cascade_one_request", "decode", query_lens=(1,), seq_lens=(p + 9,))
    add("cascade_one_request", "chunk", query_lens=(5,), seq_lens=(p + 5,))
    for hq, hkv in QUICK_GQA_HEADS:
        add("cascade_gqa", f"ratio{hq // hkv}_kv{hkv}", num_q_heads=hq, num_kv_heads=hkv)
    for d in declared_compute_dtypes(caps):
        add("cascade_dtype", dtype_name(d), dtype=d)
    if caps.logit_softcap:
        add("cascade_softcap", str(CASCADE_SOFTCAP), logit_softcap=CASCADE_SOFTCAP)
    add("cascade_sliding_window", "refused", sliding_window=8)
    add("cascade_merge", "empty_parts", merge_only=True)
    return cases
