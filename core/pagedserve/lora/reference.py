"""The torch formulation of batched LoRA: every adapter slot for every token, then a mask.

It is the oracle the conformance kit judges platforms' `LoRAKernel`s by (run in float64), the
kernel of the cpu_reference platform, and what the engine runs where a platform offers no
`LoRAKernel`. Its work grows with the number of slots rather than the adapters a step uses, but
its shapes depend only on the tensors' sizes, never on the mapping's values: it needs no sync and
records in CUDA graphs and compiled forwards like any other layer.
"""

from __future__ import annotations

import torch

from pagedserve.platforms.api import LoRAKernel


def add_lora_masked(
    y: torch.Tensor,  # [M, N], mutated: the rows of tokens with an adapter
    x: torch.Tensor,  # [M, K]
    lora_a: torch.Tensor,  # [S, R, K]
    lora_b: torch.Tensor,  # [S, N, R]
    token_slots: torch.Tensor,  # [T >= M] int32, -1: no adapter
    token_order: torch.Tensor,  # [T] int32 (unused here: the masks come from token_slots)
    slot_starts: torch.Tensor,  # [S + 1] int32 (unused here)
) -> None:
    """`LoRAKernel.op` in torch: adds `(x[t] @ A[s].T) @ B[s].T` to `y[t]` for every token `t` of
    slot `s`, accumulated in float32 (float64 inputs stay float64) and rounded once; rows of tokens
    without an adapter keep their bits."""
    del token_order, slot_starts
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    slots = token_slots[: y.shape[0]].to(torch.int64)
    xf = x.to(acc)
    delta = torch.zeros(y.shape, dtype=acc, device=y.device)
    for slot in range(lora_a.shape[0]):
        mask = (slots == slot).unsqueeze(1).to(acc)
        delta += mask * ((xf @ lora_a[slot].to(acc).t()) @ lora_b[slot].to(acc).t())
    y.copy_(torch.where((slots < 0).unsqueeze(1), y, (y.to(acc) + delta).to(y.dtype)))


MASKED_LORA_KERNEL = LoRAKernel(name="torch (every slot for every token, masked)", op=add_lora_masked)
