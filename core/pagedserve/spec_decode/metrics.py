"""What speculative decoding did: drafts proposed and scored, accepted, and accepted per position.

The counters follow vLLM's (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`): a draft is one request's drafts of
one step; its accepted tokens are its leading drafts the target kept (the bonus token after them
is not counted); position j counts the drafts whose j-th token was accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedserve.types import RequestId


@dataclass(frozen=True, slots=True)
class SpecDecodeCounts:
    """A snapshot of the counters (totals since the engine started)."""

    num_drafts: int = 0  # request-steps that scored at least one draft
    num_draft_tokens: int = 0  # draft tokens scored
    num_accepted_tokens: int = 0  # draft tokens accepted
    # position j -> drafts whose token j was accepted; as long as the longest draft scored
    accepted_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Accepted / scored draft tokens (0 before any draft). Pure."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def __add__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + (0,) * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + (0,) * (n - len(other.accepted_per_pos))
        return SpecDecodeCounts(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            tuple(x + y for x, y in zip(a, b, strict=True)),
        )


@dataclass(slots=True)
class SpecDecodeStats:
    """The engine core's counters; `observe` after every step. Single-threaded."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(
        self, drafts: Mapping[RequestId, Sequence[int]], sampled: Mapping[RequestId, Sequence[int]]
    ) -> tuple[int, int]:
        """Count one step: `drafts` (req_id -> drafts scored), `sampled` (req_id -> tokens it
        emitted: accepted drafts, then one). Returns (drafted, accepted) of the step. Mutates."""
        drafted = accepted = 0
        for req_id, draft in drafts.items():
            if not draft:
                continue
            tokens = sampled.get(req_id)
            if tokens is None:  # finished or preempted before its tokens were applied
                continue
            n = min(len(tokens) - 1, len(draft))
            self.num_drafts += 1
            drafted += len(draft)
            accepted += n
            per_pos = self.accepted_per_pos
            if len(per_pos) < len(draft):
                per_pos.extend([0] * (len(draft) - len(per_pos)))
            for j in range(n):
                per_pos[j] += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        return drafted, accepted

    def snapshot(self) -> SpecDecodeCounts:
        """The counters now. Pure."""
        return SpecDecodeCounts(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, tuple(self.accepted_per_pos)
        )
