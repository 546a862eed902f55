"""The LoRA adapters' configuration: how many at once, how large, for steps how wide."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Serving PEFT LoRA adapters per request; an engine without them has none of this
    (`EngineConfig.lora` is None). Set by `resolve_engine_config`."""

    max_loras: int  # adapter slots: most distinct adapters running at once
    max_lora_rank: int  # the largest adapter rank a slot holds
    # Tokens of the widest forward the slots' per-token buffers serve: the largest step, and the
    # padded sizes graphs capture (max of max_num_batched_tokens, max_num_seqs, cuda_graph_max_tokens).
    max_tokens: int
