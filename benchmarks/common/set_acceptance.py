"""For measurement only: a proposer whose drafts the target accepts at a rate the benchmark sets.

With random (dummy) weights a draft network agrees with the target almost never, so a latency
benchmark of speculative decoding could only measure the all-rejected case. `SetAcceptanceProposer`
wraps the engine's own proposer: the draft network still runs every forward it would run (its
cost is the real one), then each draft token is replaced by the token the target is known to emit
at that position (accepted) or by another one (rejected). The target verifies as always, so what
is accepted is decided by the engine's own verification, not assumed.

The tokens the target emits come from `expect`: the greedy output of the same prompt on the same
engine. Acceptance follows the chain model the cost model assumes (`spec_decode/cost_model.py`):
each draft whose predecessors were all accepted is accepted with probability `acceptance`,
independently, so k drafts give (1 - a^(k+1)) / (1 - a) tokens per step on average. Greedy
requests only (temperature 0): a sampled target has no single token to agree with.

It lives with the benchmarks and is installed on a built engine by `install`; serving never
constructs it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pagedserve.engine.core import EngineCore
from pagedserve.scheduler.request import Request
from pagedserve.spec_decode.proposer import Proposer
from pagedserve.types import RequestId


class SetAcceptanceProposer(Proposer):
    """Drafts with `inner`, then rewrites each draft so that the target accepts it with
    probability `acceptance` (0: every draft rejected; 1: every draft accepted). Single-threaded;
    `propose` mutates the requests (as every proposer does) and this object's random stream."""

    def __init__(self, inner: Proposer, acceptance: float, vocab_size: int, seed: int = 0) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1] (a probability per draft), got {acceptance}")
        if vocab_size < 2:
            raise ValueError(
                f"vocab_size must be >= 2 so that a rejected draft has a token to be, got {vocab_size}"
            )
        self.inner = inner
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self._expected: dict[RequestId, list[int]] = {}  # req_id -> the target's greedy output tokens
        # Drafts left as the network made them: their position is past the expected output.
        self.num_unplanted = 0

    def expect(self, req_id: RequestId, output_token_ids: Sequence[int]) -> None:
        """Plant drafts for request `req_id` from `output_token_ids`, its greedy output on this
        engine. Mutates."""
        self._expected[req_id] = list(output_token_ids)

    def restart(self, seed: int) -> None:
        """Start the accept/reject draws again from `seed` (a run repeated with the same seed
        sees the same pattern). Mutates."""
        self._rng = random.Random(seed)

    def propose(self, requests: Sequence[Request]) -> None:
        self.inner.propose(requests)
        for request in requests:
            expected = self._expected.get(request.id)
            if expected is None or not request.spec_token_ids:
                continue
            request.spec_token_ids = self._plant(
                request.spec_token_ids, expected, len(request.output_token_ids)
            )

    def _plant(self, drafts: list[int], expected: list[int], num_output: int) -> list[int]:
        """Drafts for the output positions num_output, num_output + 1, ...: the expected token
        while every draw so far accepted, another token from the first rejection on. One draw per
        draft that the target's verification reaches (those after a rejection are never scored)."""
        planted = []
        accepting = True
        for j in range(len(drafts)):
            position = num_output + j
            if position >= len(expected):
                self.num_unplanted += len(drafts) - j
                return planted + drafts[j:]
            accepting = accepting and self._rng.random() < self.acceptance
            truth = expected[position]
            planted.append(truth if accepting else (truth + 1) % self.vocab_size)
        return planted

    def observe_step(self, num_tokens: int, seconds: float, drafted: int, accepted: int) -> None:
        self.inner.observe_step(num_tokens, seconds, drafted, accepted)


def install(core: EngineCore, acceptance: float, vocab_size: int, seed: int = 0) -> SetAcceptanceProposer:
    """Wrap `core`'s proposer (the one the synchronous loop and the step pipeline both call) in a
    `SetAcceptanceProposer`. Raises ValueError for an engine built without speculation. Mutates
    `core`."""
    inner = core.proposer
    if inner is None:
        raise ValueError("the engine drafts nothing: build it with a speculative_config to set an acceptance")
    wrapper = SetAcceptanceProposer(inner, acceptance, vocab_size, seed)
    core.proposer = wrapper
    if core.pipeline is not None:
        core.pipeline.proposer = wrapper
    return wrapper
