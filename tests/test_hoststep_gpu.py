"""The packed host -> device uploads on a real GPU: values arrive, views do not overlap, buffers grow,
and the fence lets the host rewrite the pinned buffer only after the copy ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.worker.buffers import PackedUpload, UploadFence

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_packed_upload_delivers_every_array_and_grows() -> None:
    device = torch.device("cuda")
    upload = PackedUpload(torch.int64, device, capacity=4)
    fence = UploadFence(device)
    arrays = [np.arange(3), np.array([7, 8]), np.arange(10, 16)]
    views = upload.upload(*arrays)  # 11 values: more than the capacity, so it grows
    fence.record()
    for (dev, host), want in zip(views, arrays, strict=True):
        assert dev.device.type == "cuda" and host.device.type == "cpu"
        assert dev.cpu().tolist() == want.tolist() == host.tolist()
    fence.wait()
    again = upload.upload(np.array([1, 2, 3]))
    assert again[0][0].cpu().tolist() == [1, 2, 3]


def test_fence_keeps_a_slow_copy_from_reading_rewritten_host_memory() -> None:
    device = torch.device("cuda")
    upload = PackedUpload(torch.int64, device, capacity=1 << 20)
    fence = UploadFence(device)
    # Queue enough device work that the copy below runs well after the host moves on.
    big = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        big = big @ big
        big /= big.norm()
    first = np.arange(1 << 20)
    ((dev, _),) = upload.upload(first)
    fence.record()
    # Queued after the copy and before the next one: what the first copy delivered.
    delivered = dev.clone()
    fence.wait()  # what the model runner does before writing the next step's inputs
    upload.upload(np.zeros(1 << 20, dtype=np.int64))
    assert torch.equal(delivered.cpu(), torch.from_numpy(first))
