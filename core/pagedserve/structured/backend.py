"""The interface between the engine and a grammar engine: compile a constraint once, then one
matcher per request that accepts tokens and writes the next-token bitmask.

A bitmask is an int32 tensor [rows, ceil(vocab_size / 32)] on the host: bit `t % 32` of word
`t // 32` of a row is set when token `t` is allowed at that row's position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pagedserve.structured.params import StructuredOutputsParams


class GrammarMatcher(Protocol):
    """The state of one request in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        ...

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> bool:
        """Write the allowed next tokens into row `index` of `bitmask`."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """True once the output is complete and the stop token was accepted."""
        ...


class StructuredOutputBackend(Protocol):
    """A grammar engine bound to one tokenizer and vocabulary."""

    name: str
    vocab_size: int  # bitmask width in tokens (the logits' width)

    def compile(self, params: StructuredOutputsParams) -> object:
        """Compile a constraint (slow; runs on a worker thread). Raises ValueError if invalid."""
        ...

    def new_matcher(self, compiled: object, max_rollback_tokens: int) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""
        ...

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """Write `matchers[i]`'s allowed tokens into `bitmask[rows[i]]`, for the whole batch."""
        ...


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed host bitmask [num_rows, ceil(vocab_size / 32)] int32 (-1: every bit set)."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
