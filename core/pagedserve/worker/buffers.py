"""One buffer abstraction for step inputs: a host tensor, its numpy view, and its device twin.

The model runner fills inputs on the host with numpy (fast, no per-element torch overhead) and
then copies only the rows it filled to the device, asynchronously where the host side is pinned.
Keeping the three views in one object is what stops them drifting apart.
"""

from __future__ import annotations

import numpy as np
import torch


class StagedBuffer:
    """A preallocated host buffer (numpy view over a torch tensor) with a device copy.

    On a CPU platform the device tensor *is* the host tensor, so `to_device` costs nothing.
    """

    __slots__ = ("_device_is_host", "device", "host", "np")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self._device_is_host = device.type == "cpu"
        pin = not self._device_is_host and torch.cuda.is_available()
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np: np.ndarray = self.host.numpy()
        self.device = self.host if self._device_is_host else torch.zeros(shape, dtype=dtype, device=device)

    def to_device(self, num_rows: int) -> torch.Tensor:
        """Copy the first `num_rows` rows to the device and return that device slice.
        Mutates the device tensor (not the host one)."""
        if self._device_is_host:
            return self.host[:num_rows]
        dst = self.device[:num_rows]
        dst.copy_(self.host[:num_rows], non_blocking=True)
        return dst
