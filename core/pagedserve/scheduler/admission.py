"""Admission control: reject at once what could never run, instead of leaving it waiting."""

from __future__ import annotations

from pagedserve.config import SchedulerConfig
from pagedserve.scheduler.request import Request


class RequestRejected(ValueError):
    """A request that can never be scheduled; the message says why and what to change."""


def check_admissible(request: Request, config: SchedulerConfig, num_blocks: int, block_size: int) -> None:
    """Raise `RequestRejected` if `request` could not finish even alone on the engine. Does not
    mutate. Alone, a request can always run (preemption frees everyone else), so these checks
    are the only way a request can be stuck forever."""
    prompt_len = request.num_prompt_tokens
    if prompt_len == 0:
        raise RequestRejected(f"request {request.id!r} has an empty prompt: give at least one token")
    low, high = min(request.prompt_token_ids), max(request.prompt_token_ids)  # C speed, no Python loop
    if low < 0 or high >= 2**32:
        raise RequestRejected(
            f"request {request.id!r} has token id {low if low < 0 else high} outside [0, 2**32): "
            "token ids must come from the model's vocabulary"
        )
    # A pooling request generates nothing: its prompt alone must fit.
    longest = prompt_len + (0 if request.pooling_params is not None else request.stop.max_tokens)
    if longest > config.max_model_len:
        raise RequestRejected(
            f"request {request.id!r}: prompt ({prompt_len} tokens) + max_tokens "
            f"({request.stop.max_tokens}) = {longest} exceeds max_model_len ({config.max_model_len}): "
            "shorten the prompt or lower max_tokens"
        )
    blocks_needed = (longest + block_size - 1) // block_size
    if blocks_needed > num_blocks:
        raise RequestRejected(
            f"request {request.id!r} needs up to {blocks_needed} KV blocks of {block_size} tokens, "
            f"but the whole cache has {num_blocks}: shorten the prompt, lower max_tokens or give "
            "the KV cache more memory"
        )
