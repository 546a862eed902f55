"""Step inputs on their way to the device: host buffers, their numpy views and device twins.

The model runner fills inputs on the host with numpy (fast, no per-element torch overhead) and
then copies them to the device, asynchronously out of pinned memory where there is a separate
device. Two shapes of buffer:
  * `StagedBuffer`: a fixed 2-D table that lives across steps (the block table); the runner
    edits rows in place and copies the used rows.
  * `PackedUpload`: the small 1-D arrays built fresh each step (token ids, positions, slot
    mapping, ...), packed back to back into one buffer so that all of them cost one transfer
    instead of one each.
Keeping the host, numpy and device views in one object is what stops them drifting apart.

An asynchronous copy reads the pinned buffer some time after it is issued, so the host must not
overwrite the buffer before the copy ran. A step that samples ends with a device -> host copy of
its tokens, which waits for everything before it, but a step that samples nothing (a chunk of a
long prompt) returns at once: `UploadFence` remembers the last copies and the next step waits
for them (normally long done) before it writes.
"""

from __future__ import annotations

import numpy as np
import torch


def _pinned(device: torch.device) -> bool:
    return device.type != "cpu" and torch.cuda.is_available()


class UploadFence:
    """The point, in the device's stream, after the last host -> device copies of a step.
    On a CPU device, and on devices without events, it is a no-op (copies there are synchronous)."""

    __slots__ = ("_event", "_pending")

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" and torch.cuda.is_available() else None
        self._pending = False

    def record(self) -> None:
        """Mark the copies issued so far on the current stream. Mutates the fence."""
        if self._event is not None:
            self._event.record()
            self._pending = True

    def wait(self) -> None:
        """Block the host until the recorded copies have run (they have, unless the device lags
        behind by a step). Mutates the fence."""
        if self._pending and self._event is not None:
            self._event.synchronize()
            self._pending = False


class StagedBuffer:
    """A preallocated host buffer (numpy view over a torch tensor) with a device copy.

    On a CPU platform the device tensor *is* the host tensor, so `to_device` costs nothing.
    """

    __slots__ = ("_device_is_host", "device", "host", "np")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self._device_is_host = device.type == "cpu"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=_pinned(device))
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


class PackedUpload:
    """Uploads several 1-D arrays of one dtype in one host -> device copy.

    The arrays are written back to back into a pinned host buffer, copied together, and handed
    out as device views (valid until the next `upload`). The buffers grow (doubling) when a step
    needs more. On a CPU device nothing is copied: the arrays are wrapped as they are."""

    __slots__ = ("_capacity", "_device", "_device_buf", "_dtype", "_host", "_np_dtype")

    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int = 1024) -> None:
        self._dtype = dtype
        self._np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        self._device = device
        self._capacity = 0
        self._host = torch.empty(0, dtype=dtype)
        self._device_buf = torch.empty(0, dtype=dtype)
        if device.type != "cpu":
            self._grow(capacity)

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._capacity)
        # Ordinary tensors even when a step grows them inside `torch.inference_mode`: the views
        # handed out are the compiled forward's inputs, and dynamo's guards tell inference
        # tensors apart, so an inference buffer would recompile the whole forward mid-serving.
        with torch.inference_mode(False):
            self._host = torch.empty(capacity, dtype=self._dtype, pin_memory=_pinned(self._device))
            self._device_buf = torch.empty(capacity, dtype=self._dtype, device=self._device)
        self._capacity = capacity

    def upload(self, *arrays: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device view, host view) of each array, in order. The caller must have waited for
        the previous upload's copy (`UploadFence.wait`) before calling. Mutates the buffers."""
        if self._device.type == "cpu":
            wrapped = [torch.from_numpy(np.ascontiguousarray(a, dtype=self._np_dtype)) for a in arrays]
            return [(t, t) for t in wrapped]
        total = sum(len(a) for a in arrays)
        if total > self._capacity:
            self._grow(total)
        host_np = self._host.numpy()
        offsets = []
        start = 0
        for a in arrays:
            host_np[start : start + len(a)] = a
            offsets.append((start, start + len(a)))
            start += len(a)
        self._device_buf[:total].copy_(self._host[:total], non_blocking=True)
        return [(self._device_buf[s:e], self._host[s:e]) for s, e in offsets]
