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
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.types import RequestId


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


@dataclass(frozen=True, slots=True)
class TargetHidden:
    """The target's hidden states of one forward, for the drafters that read them (EAGLE).
    Set by the model runner after the forward; read before the next step is scheduled."""

    req_ids: list[RequestId]  # the step's requests, in the order of their tokens
    query_start: np.ndarray  # [num_reqs + 1] where each request's tokens start in `hidden`
    positions: np.ndarray  # [num_tokens] absolute position of every token of the step
    hidden: torch.Tensor  # [num_tokens, width] the states the drafter reads (see `HiddenTap`)

    def rows_of(self) -> dict[RequestId, tuple[int, int, int]]:
        """req_id -> (first row, row count, absolute position of the first row). Pure."""
        starts = self.query_start.tolist()
        first = self.positions[self.query_start[:-1]].tolist() if len(self.req_ids) else []
        return {
            req_id: (starts[i], starts[i + 1] - starts[i], first[i]) for i, req_id in enumerate(self.req_ids)
        }
