"""What the quantized layers share: the row ranges of the checkpoint projections a layer stacks
(q/k/v, gate/up), and copies that check a checkpoint tensor's shape before writing it."""

from __future__ import annotations

import torch


def row_ranges(shard_sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    """projection -> (first row, rows), stacked in the mapping's order. Pure."""
    ranges: dict[str, tuple[int, int]] = {}
    start = 0
    for name, size in shard_sizes.items():
        ranges[name] = (start, size)
        start += size
    return ranges


def copy_checked(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy checkpoint tensor `name` into `target`, or raise `ValueError` naming both shapes."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}: "
            "the config does not match the weights"
        )
    target.copy_(tensor)
