"""Sleep mode of one device's model runner (`LLM.sleep` / `LLM.wake_up`): the KV cache's memory
freed, and the weights' offloaded to host memory (level 1) or freed (level 2).

Freeing keeps every tensor object and its shape: the storage under it is resized to nothing
(`untyped_storage().resize_(0)`), so the model, the attention layers and a compiled forward hold
the same tensors throughout, and waking resizes the storages back and refills them (level 1: the
host copy; level 2: the checkpoint read again, through the loader the runner was built with). A
storage comes back at another device address, so CUDA graphs, which replay fixed addresses, are
dropped when the runner sleeps: after waking, steps run the compiled or eager forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

SleepLevel = Literal[1, 2]


@dataclass(frozen=True, slots=True)
class SleepingRunner:
    """What a sleeping runner needs to wake: the storages it freed and, at level 1, their bytes."""

    level: SleepLevel
    # The weights' storages, one per distinct storage (tied weights share one), in parameter order.
    weights: list[torch.UntypedStorage]
    weight_nbytes: list[int]  # storage i -> its size before it was freed
    host_copies: list[torch.Tensor] | None  # level 1: storage i -> its bytes on the host; 2: None
    kv_nbytes: list[int]  # layer -> its KV cache storage's size before it was freed


def put_to_sleep(runner: ModelRunner, level: SleepLevel) -> SleepingRunner:
    """Free the runner's KV cache and its weights (level 1: copied to host memory first). The
    caches' contents are gone: the caller resets the prefix cache. Drops the CUDA graphs.
    Mutates the runner's tensors."""
    if level not in (1, 2):
        raise ValueError(
            f"level must be 1 (weights offloaded to host memory) or 2 (weights freed), got {level!r}"
        )
    runner.drop_graphs()  # they replay the addresses the storages are about to lose
    storages: dict[int, torch.UntypedStorage] = {}
    for param in runner.model.parameters():
        storage = param.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    weights = list(storages.values())
    pinned = runner.device.type == "cuda"
    host = (
        [_bytes_of(s).to("cpu").pin_memory() if pinned else _bytes_of(s).clone() for s in weights]
        if level == 1
        else None
    )
    nbytes = [s.nbytes() for s in weights]
    kv_nbytes = [kv.untyped_storage().nbytes() for kv in runner.kv_caches]
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    for storage in weights:
        storage.resize_(0)
    for kv in runner.kv_caches:
        kv.untyped_storage().resize_(0)
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()  # hand the freed blocks back to the driver, for other processes
    return SleepingRunner(level, weights, nbytes, host, kv_nbytes)


def wake_weights(
    runner: ModelRunner,
    sleeping: SleepingRunner,
    reload_model: Callable[[], torch.nn.Module] | None,
) -> None:
    """Give the runner back its weights: level 1 from the host copy; level 2 from
    `reload_model()`, a freshly loaded model of the same structure whose parameters are copied in
    by name. Raises ValueError when a level-2 reload does not match. Mutates the runner's weights."""
    for storage, nbytes in zip(sleeping.weights, sleeping.weight_nbytes, strict=True):
        storage.resize_(nbytes)
    if sleeping.host_copies is not None:
        for storage, saved in zip(sleeping.weights, sleeping.host_copies, strict=True):
            _bytes_of(storage).copy_(saved, non_blocking=True)
    else:
        if reload_model is None:
            raise ValueError("level-2 sleep freed the weights; waking them needs the checkpoint loader")
        _copy_parameters(runner.model, reload_model())
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def wake_kv_cache(runner: ModelRunner, sleeping: SleepingRunner) -> None:
    """Give the runner back its KV cache, zeroed as at start-up (a backend may multiply
    never-written slots by zero: no garbage NaNs). Mutates the runner's caches."""
    for kv, nbytes in zip(runner.kv_caches, sleeping.kv_nbytes, strict=True):
        kv.untyped_storage().resize_(nbytes)
        kv.zero_()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _copy_parameters(model: torch.nn.Module, fresh: torch.nn.Module) -> None:
    mine, theirs = dict(model.named_parameters()), dict(fresh.named_parameters())
    if mine.keys() != theirs.keys():
        differ = sorted(set(mine) ^ set(theirs))[:5]
        raise ValueError(f"the reloaded model's parameters differ from the sleeping one's: {differ}")
    with torch.no_grad():
        for name, param in mine.items():
            param.copy_(theirs[name])
