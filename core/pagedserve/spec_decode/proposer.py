"""What every proposer is to the engine core, and what the target's forward hands a drafter.

A proposer is called once per step, before the scheduler runs, with the running requests; it sets
`spec_token_ids` on those that decode (the scheduler cuts them to its budget and to each request's
remaining length). Drafts must be greedy or otherwise deterministic: the runner verifies them as
one-hot proposals (`sampling/rejection.py`), which is exact for those. Proposers that run a network
(a draft model, an EAGLE head) read what the target computed from `TargetHidden`, which the model
runner hands over after each forward (`ModelRunner.forward_listener`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.worker.target_hidden import TargetHidden

__all__ = ["Proposer", "TargetHidden", "draft_room", "is_decoding"]


class Proposer(ABC):
    """Drafts tokens for running requests. Single-threaded; `propose` mutates the requests."""

    @abstractmethod
    def propose(self, requests: Sequence[Request]) -> None:
        """Set `spec_token_ids` on every request of `requests` that decodes (others keep none)."""

    def observe_step(self, num_tokens: int, seconds: float, drafted: int, accepted: int) -> None:
        """A step of `num_tokens` target tokens took `seconds` and accepted `accepted` of its
        `drafted` drafts (for proposers that choose how many to draft). Mutates; by default nothing."""
        return None  # an optional hook, not abstract: most proposers need no timings


def is_decoding(request: Request) -> bool:
    """Whether every known token but the last sampled one is computed: the request decodes, and
    drafts after its last token can be scored (one still prefilling has none). Pure."""
    return request.status is RequestStatus.RUNNING and request.num_computed_tokens == request.num_tokens - 1


def draft_room(request: Request, k: int) -> int:
    """How many drafts may follow the request's tokens: at most k, and never past max_tokens (the
    bonus token after accepted drafts counts too). Pure."""
    return max(0, min(k, request.stop.max_tokens - len(request.output_token_ids) - 1))
