"""The scheduler's configuration: how many requests and tokens a step may hold, how long a request
may grow, and how waiting and preempted requests are handled.

`max_model_len` and `max_num_batched_tokens` depend on each other and on the model (its trained
context length), so neither is a plain copy of what the user passed: both are resolved once, before
any worker starts (`engine_config.resolve_engine_config`), and every reader below (the scheduler, each
device's runner, its graphs and its profiling step) takes them from here as they are.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

DEFAULT_MAX_MODEL_LEN = 8192
"""`max_model_len` when none is given: the model's trained context length, at most this."""

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""`max_num_batched_tokens` when none is given (raised to `max_num_seqs` when that is larger)."""


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"  # free the victim's blocks; re-prefill it later (generated tokens kept)
    SWAP = "swap"  # copy the victim's blocks to the CPU swap pool; copy them back to resume


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"  # waiting requests start in arrival order; every step may take the whole budget
    # Offline batches: most tokens to generate first, prompt work spread over the steps that
    # remain while requests decode (`pagedserve.scheduler.makespan`).
    MAKESPAN = "makespan"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The V1 scheduler's limits: one token budget per step, shared by every kind of work. Set by
    `resolve_engine_config` only, so its invariants hold without being checked again."""

    max_num_seqs: int  # most requests running at once
    # Token budget of one step. At least max_num_seqs (every running request needs a token per
    # step); at least max_model_len without chunked prefill (a prompt is then scheduled whole).
    max_num_batched_tokens: int
    max_model_len: int  # longest prompt + output, in tokens
    enable_chunked_prefill: bool
    preemption_mode: PreemptionMode
    num_speculative_tokens: int  # draft tokens scored per step (any proposer; 0: none)
    policy: SchedulingPolicy
    # Makespan policy: the widest step the spread of prompt work asks for while requests decode
    # (None: max_num_batched_tokens). The engine sets `cuda_graph_max_tokens`: wider steps run
    # without CUDA graphs, where their host time shows.
    widest_decoding_step: int | None
    max_loras: int | None  # most distinct LoRA adapters running at once (None: LoRA is off)
    # Read by the engine core, not the scheduler: schedule step N+1 while step N runs.
    async_scheduling: bool
