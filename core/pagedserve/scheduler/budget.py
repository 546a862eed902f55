"""The per-step token budget: how many new tokens each request may still get."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenBudget:
    """Tokens left in the step being built (from max_num_batched_tokens). Mutated by `take`.

    The other limit, max_num_seqs, is a count of running requests, checked against the running
    list itself: a running request holds its seat even in a step that gives it no tokens."""

    tokens_left: int

    def grant(self, wanted: int) -> int:
        """How many of `wanted` tokens fit. Does not mutate."""
        return wanted if wanted <= self.tokens_left else self.tokens_left

    def take(self, num_tokens: int) -> None:
        """Charge `num_tokens`. Mutates."""
        self.tokens_left -= num_tokens
