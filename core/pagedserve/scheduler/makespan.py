"""Makespan scheduling for offline batches: the order waiting requests start in, and how many
tokens a step may take while requests decode.

An offline batch (`LLM.generate`, `pagedserve bench throughput`) is done when its last request
is. No schedule finishes before the request with the most tokens left to generate has taken
one step per token, so two rules aim every step at that bound:

* **Most tokens to generate first.** Waiting requests start in order of the output tokens they
  may still produce (`max_tokens` minus what they have), ties in arrival order; preempted
  requests keep their place at the front. A long request that starts late stretches the batch
  by the steps it still needs after everything else has finished.
* **Prompt work spread over the steps that remain.** While requests decode and prompts wait,
  the running requests set a horizon: the steps their longest still needs, less the outputs of
  the shortest waiting request (which must still fit after its prompt). If the waiting prompt
  tokens, spread over that horizon with a margin of `SPREAD`, fit in steps no wider than the
  widest one CUDA graphs replay (`cuda_graph_max_tokens`), a step takes every running request's
  tokens plus that share of prompt tokens (at least `MIN_PROMPT_TOKENS`). Otherwise (no horizon,
  or more prompt work than thin steps carry) it takes the whole `max_num_batched_tokens`, as
  first come, first served does. A decode step of a few hundred rows is bound by streaming the
  weights, so prompt tokens added to it cost little, where a step of thousands of prompt tokens
  is bound by the tensor cores and delays every running request by its whole length; and a
  step wider than the graphs runs eagerly, where its host time shows (on an H100, steps of
  513-1,024 tokens took 25-32 ms on average against 15 ms for 257-512).

Output lengths are read from `max_tokens`. Where every request has the same `max_tokens` (the
usual case when outputs end at EOS) the order is arrival order and the horizon is zero, so steps
are as wide as first come, first served makes them; the policy pays off where `max_tokens` says
how long each request runs (benchmarks with fixed output lengths, batches of known lengths).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pagedserve.scheduler.request import Request, RequestStatus

# Prompt tokens a step takes beside its decodes, however thin the spread: admission keeps moving.
# Of {32, 64, 96, 128, 192} x SPREAD {1.5, 2, 3, 4}, 64 and 2.0 came within 0.01 s of the best
# on both ShareGPT-like workloads of `benchmarks/workloads/` (8.42 and 17.45 s) in
# `benchmarks/investigations/scheduling_model.py`, this scheduler timed by a model of the H100's steps.
MIN_PROMPT_TOKENS = 64
# How many times the even share of the waiting prompt work a step takes: above 1 so that the
# prompts are done with room to spare before the horizon.
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
    tokens before any prompt chunk; `widest_spread`: the widest step a spread may ask for.
    Does not mutate."""
    prompt_left = 0  # tokens to compute before sampling resumes: prompts, or a preemption's redo
    running_longest = 0  # outputs the longest running request still samples: steps left anyway
    waiting_shortest = -1  # outputs of the waiting request that can start last and still fit
    for request in requests:
        outputs_left = (
            request.stop.max_tokens - len(request.output_token_ids) - request.num_output_placeholders
        )
        uncomputed = len(request.all_token_ids) - request.num_computed_tokens
        if uncomputed > 1:  # one uncomputed token is a decode's last sample
            prompt_left += uncomputed
        if request.status is RequestStatus.RUNNING:
            running_longest = max(running_longest, outputs_left)
        elif waiting_shortest < 0 or outputs_left < waiting_shortest:
            waiting_shortest = outputs_left
    # Steps in which every waiting prompt can be computed with the last of them still
    # finishing before the longest running request does.
    horizon = running_longest - max(waiting_shortest, 0)
    if horizon <= 0:
        return max_budget  # the waiting requests set the end: start them as fast as possible
    floor = num_running * tokens_per_running + MIN_PROMPT_TOKENS
    spread = num_running * tokens_per_running + math.ceil(SPREAD * prompt_left / horizon)
    if spread > widest_spread:
        return max_budget  # more prompt work than thin steps carry: wide steps do it fastest
    return min(max_budget, max(floor, spread))


__all__ = ["MIN_PROMPT_TOKENS", "SPREAD", "admission_key", "step_token_budget"]
