"""`LoRALinear`: a model's linear layer plus the per-token LoRA deltas of the adapters in its slots.

    y = base(x) + scaling * (x @ A.T) @ B.T     for each token, with its request's adapter

Every wrapped layer holds one stacked A [slots, shards * max_rank, in] and B [slots, out,
shards * max_rank] (the scaling folded into B). A fused projection (q/k/v, gate/up) gets one
rank block per checkpoint projection, with B block-diagonal so each projection's delta lands in
its own output rows: one pair of products per slot serves the whole fused layer. An adapter of
a smaller rank (or one that skips a projection) leaves its blocks zero, which adds nothing.

Tokens are grouped by slot once per step (`LoRAStep`, built on the host from the batch's rows),
so a layer loops over the slots in use with no device-to-host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class LoRAStep:
    """The step's token groups, shared by every `LoRALinear` of a model: (slot, token indices)
    per slot in use; empty when no scheduled token has an adapter. Set by the model runner
    before each forward."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, torch.Tensor]] = []
        self.num_tokens = 0


@dataclass(frozen=True, slots=True)
class SlotShape:
    """What every wrapped layer's slot buffers are sized and placed by."""

    max_loras: int
    max_rank: int
    device: torch.device
    dtype: torch.dtype


class LoRALinear(nn.Module):
    """`base` (any module mapping [n, in] to [n, out]) plus per-slot LoRA deltas.

    `shards`: the checkpoint projections stacked in `base`'s output rows, in order, with their
    row counts (one entry for an unfused layer)."""

    lora_a: torch.Tensor  # [max_loras, shards * max_rank, in_features]
    lora_b: torch.Tensor  # [max_loras, out_features, shards * max_rank], scaling included

    def __init__(
        self, base: nn.Module, in_features: int, shards: dict[str, int], shape: SlotShape, step: LoRAStep
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.shards = dict(shards)
        self.out_features = sum(shards.values())
        self.max_rank = shape.max_rank
        self.step = step
        width = len(shards) * shape.max_rank
        device, dtype = shape.device, shape.dtype
        # Buffers, not parameters: the adapters are data the engine swaps, never trained here.
        a = torch.zeros(shape.max_loras, width, in_features, device=device, dtype=dtype)
        b = torch.zeros(shape.max_loras, self.out_features, width, device=device, dtype=dtype)
        self.register_buffer("lora_a", a)
        self.register_buffer("lora_b", b)

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight, for code that reads it (the CPU relayout, FP8 checks)."""
        weight = self.base.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    @torch.no_grad()
    def set_slot(self, slot: int, pieces: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter into `slot`: shard name -> (A [r, in], scaling * B [out_shard, r]);
        shards it does not name stay zero. Mutates the buffers."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        row = 0
        for index, (shard, rows) in enumerate(self.shards.items()):
            pair = pieces.get(shard)
            if pair is not None:
                piece_a, piece_b = pair
                rank = piece_a.shape[0]
                col = index * self.max_rank
                a[col : col + rank].copy_(piece_a)
                b[row : row + rows, col : col + rank].copy_(piece_b)
            row += rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, out_features]
        """Does not mutate `x`."""
        y = self.base(x)
        step = self.step
        if not step.segments:
            return y
        for slot, tokens in step.segments:
            if tokens.numel() == step.num_tokens:  # every token on one adapter: no gather
                return y + (x @ self.lora_a[slot].t()) @ self.lora_b[slot].t()
            rows = x.index_select(0, tokens)
            y = y.index_add(0, tokens, (rows @ self.lora_a[slot].t()) @ self.lora_b[slot].t())
        return y

    def extra_repr(self) -> str:
        return f"shards={list(self.shards)}, max_rank={self.max_rank}"
