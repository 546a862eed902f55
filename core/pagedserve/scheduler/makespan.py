"""Makespan scheduling for offline batches: the order waiting requests start in, and how many
tokens a step may take while requests decode.

An offline batch (`LLM.generate`, `pagedserve bench throughput`) is done when its last request
is. No schedule finishes before the request with the most tokens left to generate has taken
one step per token, so two rules aim every step at that bound:

* **Most tokens to generate first.** Waiting requests start in order of the output tokens they
  may still produce (`max_tokens` minus what they have), ties in arrival order; preempted
  requests keep their place at the front. A long request that starts late stretches the batch
  by the steps it still needs after everything else has finished.
* **Prompt work spread over the steps that remain.** While requests decode, a step may take
  every running request's tokens plus `MIN_PROMPT_TOKENS` prompt tokens, or `SPREAD` times the
  remaining work divided by the longest request's remaining steps, whichever is more; the
  spread share stops at the widest step that replays CUDA graphs (`cuda_graph_max_tokens`), and
  nothing exceeds `max_num_batched_tokens`. A decode step of a few hundred rows is bound by
  streaming the weights, so prompt tokens added to it cost little; a step of thousands of prompt
  tokens is bound by the tensor cores and delays every running request by its whole length; and
  a step wider than the graphs runs eagerly, where its host time shows (on an H100, steps of
  513-1,024 tokens took 25-32 ms on average against 15 ms for 257-512).

Output lengths are read from `max_tokens`: a request that stops early at EOS only makes the
remaining work look larger, which widens the steps towards the plain token budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pagedserve.scheduler.request import Request, RequestStatus

# Prompt tokens a step takes beside its decodes while work is left, however thin the spread:
# admission keeps moving. 64 and SPREAD = 2.0 were the best of Pmin in {32..192} x SPREAD in
# {1.5..4} for both ShareGPT-like workloads of `benchmarks/workloads/` when the real scheduler was
# run against a step-time model fitted to H100 step traces (see docs/architecture.md).
MIN_PROMPT_TOKENS = 64
# How many times the even share of the remaining work a step may take: above 1 so that the work
# is done with room to spare before the longest request's last step.
SPREAD = 2.0


def admission_key(request: Request) -> tuple[int, ...]:
    """Sort key of the waiting queue (ascending; the sort is stable, so ties keep arrival order):
    preempted requests first, then the most output tokens left."""
    if request.status is RequestStatus.PREEMPTED:
        return (0,)
    return (1, len(request.output_token_ids) - request.stop.max_tokens)


def step_token_budget(
    requests: Iterable[Request],
    *,
    num_running: int,
    tokens_per_running: int,
    widest_spread: int,
    max_budget: int,
) -> int:
    """The token budget of a step while `num_running` requests hold seats and others wait.

    `requests`: every unfinished request (running and waiting); `tokens_per_running`: the most a
    running request can take in one step (1 + its draft tokens), so that each still gets its
    tokens before any prompt chunk; `widest_spread`: the widest step the spread share may ask
    for. Does not mutate."""
    work = 0  # tokens still to compute: uncomputed known tokens plus outputs still to sample
    longest = 0  # the most outputs any request may still sample: steps the batch needs at least
    for request in requests:
        outputs_left = (
            request.stop.max_tokens - len(request.output_token_ids) - request.num_output_placeholders
        )
        work += len(request.all_token_ids) - request.num_computed_tokens + outputs_left
        if outputs_left > longest:
            longest = outputs_left
    floor = num_running * tokens_per_running + MIN_PROMPT_TOKENS
    spread = math.ceil(SPREAD * work / longest) if longest > 0 else max_budget
    return min(max_budget, max(floor, min(spread, widest_spread)))


__all__ = ["MIN_PROMPT_TOKENS", "SPREAD", "admission_key", "step_token_budget"]
