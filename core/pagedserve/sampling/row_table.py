"""`RowTable`: the per-row columns of `SamplingRows`, laid out from the parameter declarations.

A column for each parameter declared with a `RowColumn` (`SAMPLING_PARAMS`: in declaration order,
named after the parameter, free rows holding its neutral value), then the facts `SamplingRows`
derives from several fields (`DERIVED`). Each column is an array of its own, so a batch's rows are
gathered from contiguous memory (a field of a numpy record array is strided, and gathering from
it costs about three times as much). Rows are still written and moved whole, through the one list
of every column (`write`, `move`): no column can fall out of step with the others, and a newly
declared parameter gets its column without a line here or in `SamplingRows` changing.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from pagedserve.sampling.declaration import RowColumn
from pagedserve.sampling.sampling_params import SAMPLING_PARAMS, SamplingParams

DECLARED: tuple[tuple[str, RowColumn], ...] = tuple(
    (d.name, d.row) for d in SAMPLING_PARAMS if d.row is not None
)
"""(column, how it is kept) of every parameter declared with a RowColumn, in declaration order."""

DERIVED: tuple[tuple[str, type[np.generic]], ...] = (
    ("greedy", np.bool_),  # sampling_type is GREEDY
    ("seeded", np.bool_),  # seed is not None
    ("seed_hash", np.uint64),  # request_seed_hash(seed, sample_index); 0 where not seeded
    ("wants_logprobs", np.bool_),
    ("num_logprobs", np.int64),  # 0 where not wanted
    ("wants_prompt_logprobs", np.bool_),
    ("has_bias", np.bool_),  # logit bias, allowed_token_ids or bad words
    ("bad_word_prefixes", np.bool_),  # a bad word of several tokens
    ("reads_generated", np.bool_),  # a penalty, or a bad word of several tokens
)
"""(column, dtype) of the facts of a row that follow from several fields, or from which of the
request's samples it is; `SamplingRows.add` computes them, in this order."""

NEUTRAL: dict[str, Any] = {name: row.dtype(row.neutral) for name, row in DECLARED}
"""declared column -> its neutral value, as a scalar of the column's dtype."""

# The declared fields of a SamplingParams as one tuple: attrgetter of several names, the fastest way.
_read_declared = operator.attrgetter(*(name for name, _ in DECLARED))


class RowTable:
    """Named columns of `num_rows` rows. `write` and `move` mutate; `columns` are views to read
    (writing one directly would bypass the whole-row rule)."""

    def __init__(self, num_rows: int) -> None:
        self.columns: dict[str, np.ndarray] = {}  # column -> [num_rows]
        for name, row in DECLARED:
            self.columns[name] = np.full(num_rows, row.neutral, dtype=row.dtype)
        for name, dtype in DERIVED:
            self.columns[name] = np.zeros(num_rows, dtype=dtype)
        self._every = list(self.columns.values())  # declared, then derived: `write`'s order

    def write(self, row: int, params: SamplingParams, derived: tuple[Any, ...]) -> None:
        """Set every column of `row`: the declared ones from `params`, then `derived` in
        `DERIVED`'s order. Raises ValueError when `derived` has another length."""
        if len(derived) != len(DERIVED):
            raise ValueError(f"a row has {len(DERIVED)} derived values, got {len(derived)}")
        # strict=False: the lengths are checked above (a strict zip costs a fifth of the write).
        for column, value in zip(self._every, (*_read_declared(params), *derived), strict=False):
            column[row] = value

    def move(self, src: int, dst: int) -> None:
        """Copy row `src` over row `dst`, every column."""
        for column in self._every:
            column[dst] = column[src]
