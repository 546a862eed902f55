"""The tensor-parallel all-reduce operator on CPUs: the path each message takes by size, dtype and
layout, the operator inside `torch.compile`, and a clear error for a group nobody installed."""

from __future__ import annotations

import pytest
import torch

from pagedserve.distributed.all_reduce import GroupAllReduce, PeerMemoryLimits, default_limits, installed
from pagedserve.distributed.group import destroy_process_group, init_process_group
from pagedserve.processes.tensor_parallel.multiproc import free_port


def test_paths_by_size_dtype_and_layout() -> None:
    reducer = GroupAllReduce("g", 2)
    x = torch.zeros(1024, dtype=torch.bfloat16)  # 2 KiB
    assert reducer.path(x) == "torch.distributed"  # peer memory not enabled
    reducer.limits = PeerMemoryLimits(one_shot_max_bytes=2048, two_shot_max_bytes=8192)
    assert reducer.path(x) == "one_shot"
    assert reducer.path(torch.zeros(2048, dtype=torch.bfloat16)) == "two_shot"
    assert reducer.path(torch.zeros(4097, dtype=torch.bfloat16)) == "torch.distributed"
    assert reducer.path(torch.zeros(16, dtype=torch.float16)) == "torch.distributed"  # no fp16 kernel
    assert reducer.path(torch.zeros(64, 4, dtype=torch.float32).t()) == "torch.distributed"  # strided


def test_default_limits_keep_one_buffer_for_both_kernels() -> None:
    for world in (2, 4, 8):
        limits = default_limits(world)
        assert limits.buffer_bytes == max(limits.one_shot_max_bytes, limits.two_shot_max_bytes) > 0


def test_operator_runs_compiled_and_names_a_missing_group() -> None:
    group = init_process_group(
        0, 1, backend="gloo", init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=30
    )
    try:
        assert installed(group.group_name).world_size == 1
        x = torch.arange(6, dtype=torch.float32)
        out = torch.ops.pagedserve.all_reduce(x, group.group_name)
        assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()  # out of place
        compiled = torch.compile(
            lambda t: torch.ops.pagedserve.all_reduce(t * 2, group.group_name) + 1,
            fullgraph=True,
            backend="aot_eager",
        )
        assert torch.equal(compiled(x), x * 2 + 1)
        with pytest.raises(RuntimeError, match="no all-reduce is installed for process group 'nope'"):
            torch.ops.pagedserve.all_reduce(x, "nope")
    finally:
        destroy_process_group()
