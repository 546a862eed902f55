"""`LoRALinear`: a model's linear layer plus the per-token LoRA deltas of the adapters in its slots.

    y = base(x) + scaling * (x @ A.T) @ B.T     for each token, with its request's adapter

Every wrapped layer holds one stacked A [slots, shards * max_rank, in] and B [slots, out,
shards * max_rank] (the scaling folded into B). A fused projection (q/k/v, gate/up) gets one
rank block per checkpoint projection, with B block-diagonal so each projection's delta lands in
its own output rows: one pair of products per slot serves the whole fused layer. An adapter of
a smaller rank (or one that skips a projection) leaves its blocks zero, which adds nothing.

The step's token -> slot mapping (`LoRAMapping`) lives in fixed device buffers every layer reads,
written once per step by the model runner; the platform's `LoRAKernel` reads it on the device, so
a step needs no sync and the same launches serve every step in CUDA graphs and compiled forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedserve.platforms.api import LoRAOp

NO_SLOT = -1
"""The token slot of a request without an adapter."""


class LoRAMapping:
    """Which adapter slot each token of a step uses, in one int32 device buffer shared by every
    `LoRALinear` of a model (fixed addresses, so CUDA graphs read the current step's mapping):

        slot_starts [max_loras + 1]: slot s's tokens are token_order[slot_starts[s]:slot_starts[s + 1]]
        token_slots [max_tokens]:    slot of token t, NO_SLOT for the base model (and padding)
        token_order [max_tokens]:    the tokens with an adapter, grouped by slot

    `pack` builds a step's buffer on the host; the runner uploads it into `buffer`."""

    def __init__(self, max_loras: int, max_tokens: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_tokens = max_tokens
        self.buffer = torch.from_numpy(self.pack(np.zeros(0, dtype=np.int64))).to(device)
        self.slot_starts = self.buffer[: max_loras + 1]
        self.token_slots = self.buffer[max_loras + 1 : max_loras + 1 + max_tokens]
        self.token_order = self.buffer[max_loras + 1 + max_tokens :]

    def pack(self, token_slots: np.ndarray) -> np.ndarray:  # [max_loras + 1 + 2 * max_tokens] int32
        """The buffer's contents for a step whose tokens use `token_slots` ([num_tokens], NO_SLOT
        for none). Raises ValueError for more tokens than the buffers hold. Pure."""
        n, s, cap = len(token_slots), self.max_loras, self.max_tokens
        if n > cap:
            raise ValueError(f"a step of {n} tokens exceeds the LoRA mapping's {cap} tokens")
        packed = np.empty(s + 1 + 2 * cap, dtype=np.int32)
        with_adapter = np.flatnonzero(token_slots != NO_SLOT)
        slots = token_slots[with_adapter]
        order = with_adapter[np.argsort(slots, kind="stable")]
        packed[0] = 0
        np.cumsum(np.bincount(slots, minlength=s)[:s], out=packed[1 : s + 1])
        packed[s + 1 : s + 1 + n] = token_slots
        packed[s + 1 + n : s + 1 + cap] = NO_SLOT
        packed[s + 1 + cap : s + 1 + cap + len(order)] = order
        packed[s + 1 + cap + len(order) :] = 0
        return packed


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
        self,
        base: nn.Module,
        in_features: int,
        shards: dict[str, int],
        shape: SlotShape,
        mapping: LoRAMapping,
        op: LoRAOp,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.shards = dict(shards)
        self.out_features = sum(shards.values())
        self.max_rank = shape.max_rank
        self.mapping = mapping
        self.op = op
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
        m = self.mapping
        self.op(y, x, self.lora_a, self.lora_b, m.token_slots, m.token_order, m.slot_starts)
        return y

    def extra_repr(self) -> str:
        return f"shards={list(self.shards)}, max_rank={self.max_rank}"
