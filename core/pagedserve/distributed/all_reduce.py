"""The tensor-parallel all-reduce: one operator, `torch.ops.pagedserve.all_reduce`, that sums a
tensor over the ranks of this process's group through peer memory or through torch.distributed.

Why an operator. The row-parallel layers and the vocab-parallel embedding sum partial results
inside the forward that inductor compiles and CUDA graphs capture. An opaque out-of-place operator
(with a shape-only fake) is traced by dynamo like any other op, so the compiled forward, full
decode graphs and piecewise graphs all hold the collective: the tensor-parallel forward is the
single-device forward plus these calls.

Why peer memory. A decode step all-reduces a few KiB to a few MiB per layer (tokens x hidden x 2
bytes). NCCL's ring moves such a message in several latency-bound hops; on GPUs linked by NVLink a
*one-shot* all-reduce lets every rank read the others' buffers directly and sum them (one kernel,
one barrier), and a *two-shot* one (reduce-scatter, then all-gather, through the same buffers)
halves the bytes each link carries once messages grow. Both are torch's symmetric-memory kernels
(`torch.ops.symm_mem`): buffers allocated once and exchanged through CUDA IPC, no host work per
call, capturable in CUDA graphs. Above a size threshold NCCL's bandwidth wins and takes over.
NVLink multicast (NVLS) objects are never created: `TORCH_SYMM_MEM_DISABLE_MULTICAST=1` is set
before the first symmetric allocation, and no `multimem` operator is used, because a program that
creates them can take a shared host's GPUs out of service.

The size thresholds (`default_limits`) come from `benchmarks/kernel_benchmarks/all_reduce.py`, which times the
three paths inside CUDA graphs on the host it runs on; `docs/distributed.md` lists the table.
`disable_custom_all_reduce=True` sends every message through NCCL (for debugging, or hosts where
peer memory misbehaves).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MiB = 2**20


@dataclass(frozen=True, slots=True)
class PeerMemoryLimits:
    """The largest message (bytes) each peer-memory kernel takes; larger ones go to NCCL."""

    one_shot_max_bytes: int
    two_shot_max_bytes: int  # <= one_shot_max_bytes: two-shot never chosen

    @property
    def buffer_bytes(self) -> int:
        """The symmetric buffer every rank allocates: room for the largest peer-memory message."""
        return max(self.one_shot_max_bytes, self.two_shot_max_bytes)


def default_limits(world_size: int) -> PeerMemoryLimits:
    """The thresholds of `world_size` ranks. Two ranks: measured on two H200s linked by 18 NVLinks
    (`benchmarks/kernel_benchmarks/all_reduce.py`, bfloat16 inside CUDA graphs, docs/distributed.md):
    one-shot is fastest up to 1 MiB (15.6 us there against NCCL's 16.8), two-shot from 2 to 32 MiB (147 us at
    32 MiB against NCCL's 157). Larger groups are not measured yet: one-shot reads every peer's
    whole message, so its range is halved per doubling of the group, and two-shot keeps NCCL's
    side of 8 MiB. Pure."""
    if world_size <= 2:
        return PeerMemoryLimits(one_shot_max_bytes=1 * MiB, two_shot_max_bytes=32 * MiB)
    if world_size <= 4:
        return PeerMemoryLimits(one_shot_max_bytes=512 * 1024, two_shot_max_bytes=8 * MiB)
    return PeerMemoryLimits(one_shot_max_bytes=256 * 1024, two_shot_max_bytes=8 * MiB)


PEER_MEMORY_DTYPES = (torch.bfloat16, torch.float32)  # what torch's symmetric-memory kernels sum


class GroupAllReduce:
    """Sums tensors over one process group: peer memory for small messages where available, else
    torch.distributed (NCCL on GPUs, gloo on CPUs). Out of place. Not thread-safe."""

    def __init__(self, group_name: str, world_size: int) -> None:
        self.group_name = group_name
        self.world_size = world_size
        self.limits: PeerMemoryLimits | None = None  # None: every message through torch.distributed
        self._buffer: torch.Tensor | None = None  # [limits.buffer_bytes] uint8, symmetric

    def enable_peer_memory(self, device: torch.device, limits: PeerMemoryLimits) -> str | None:
        """Allocate and exchange the symmetric buffer (collective: every rank calls it). Returns
        why peer memory stays off, or None when it is on. Mutates self."""
        why = _peer_memory_unavailable(device, self.world_size)
        if why is None:
            try:
                self._buffer = _symmetric_buffer(limits.buffer_bytes, device, self.group_name)
            except Exception as exc:  # driver, IPC or topology failures all mean "not here"
                why = f"symmetric memory could not be set up ({type(exc).__name__}: {exc})"
        # Every rank must take the same path for every message, or the collectives never meet.
        ok = torch.tensor([1 if why is None else 0], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if int(ok.item()) == 0:
            self._buffer = None
            return why or "another rank could not set up symmetric memory"
        self.limits = limits
        return None

    def path(self, x: torch.Tensor) -> str:
        """Which kernel sums `x`: "one_shot", "two_shot" or "torch.distributed". Pure."""
        limits = self.limits
        if limits is None or x.dtype not in PEER_MEMORY_DTYPES or not x.is_contiguous():
            return "torch.distributed"
        nbytes = x.numel() * x.element_size()
        if nbytes <= limits.one_shot_max_bytes:
            return "one_shot"
        if nbytes <= limits.two_shot_max_bytes:
            return "two_shot"
        return "torch.distributed"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over every rank, as a new tensor. Does not mutate `x`."""
        path = self.path(x)
        if path == "torch.distributed":
            out = x.clone()
            dist.all_reduce(out)
            return out
        buffer = self._buffer
        assert buffer is not None  # limits are set only once the buffer exists
        staged = buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        if path == "one_shot":
            return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x, "sum", self.group_name)
        staged.copy_(x)
        out = torch.empty_like(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out


def _peer_memory_unavailable(device: torch.device, world_size: int) -> str | None:
    """Why torch's symmetric-memory all-reduce cannot run here, or None when it can."""
    if device.type != "cuda" or torch.version.hip is not None:
        return "peer-memory all-reduce is built for NVIDIA GPUs"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return f"torch {torch.__version__} has no symmetric-memory one-shot all-reduce"
    if world_size > 8:
        return f"peer memory spans one host's GPUs (at most 8), not {world_size} ranks"
    return None


def _symmetric_buffer(nbytes: int, device: torch.device, group_name: str) -> torch.Tensor:
    """A `nbytes` buffer every rank of `group_name` can read and write, exchanged now (collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    # Set before the first symmetric allocation of the process, which reads it: no multicast object.
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    # IPC handles between local GPUs; NVSHMEM is not needed. Raises when an earlier allocation of
    # this process chose already (then that choice stands).
    with contextlib.suppress(Exception):
        symm_mem.set_backend("CUDA")
    name: Any = group_name  # newer torch types it as its GroupName (a str)
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, name)
    return buffer


# This process's all-reduce per group name, as the operator finds it: a custom operator takes
# tensors, numbers and strings only, so the group is named (as torch's own collectives name theirs).
_GROUPS: dict[str, GroupAllReduce] = {}


def install(group_name: str, world_size: int) -> GroupAllReduce:
    """Register the all-reduce of the process group `group_name` (once the group exists); the
    operator routes calls naming it there. Returns it, to enable peer memory. Mutates the registry."""
    reducer = GroupAllReduce(group_name, world_size)
    _GROUPS[group_name] = reducer
    return reducer


def installed(group_name: str) -> GroupAllReduce:
    """The all-reduce `install` registered for `group_name`. Raises RuntimeError when none is."""
    reducer = _GROUPS.get(group_name)
    if reducer is None:
        raise RuntimeError(
            f"no all-reduce is installed for process group {group_name!r}: a tensor-parallel rank "
            "joins its group through distributed.group.init_process_group, which installs it"
        )
    return reducer


def uninstall(group_name: str) -> None:
    """Forget `group_name`'s all-reduce (the process left the group). Mutates the registry."""
    _GROUPS.pop(group_name, None)


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return installed(group_name)(x)


def _all_reduce_shape(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _register_operator() -> None:
    if hasattr(torch.ops.pagedserve, "all_reduce"):
        return
    library = torch.library.Library("pagedserve", "FRAGMENT")
    library.define("all_reduce(Tensor x, str group_name) -> Tensor")
    library.impl("all_reduce", _all_reduce, "CompositeExplicitAutograd")
    torch.library.register_fake("pagedserve::all_reduce", _all_reduce_shape, lib=library)
    _LIBRARIES.append(library)


# A `Library` unregisters its operators when garbage-collected: keep it for the process lifetime.
_LIBRARIES: list[torch.library.Library] = []
_register_operator()
