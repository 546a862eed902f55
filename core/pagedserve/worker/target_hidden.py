"""What the target's forward hands a drafter: the hidden states of one step, by request.

The model runner builds one after each forward for the drafters that read the target's states
(EAGLE heads, `spec_decode/`); it lives beside the runner so that the runner depends on no
proposer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.types import RequestId


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
