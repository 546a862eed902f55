"""The server's engine core started ahead of the API process's imports (`processes.engine_core.early_core`):
the front end adopts the running core and generates with it; a core nobody adopts is stopped, its
socket folder removed; and groups it cannot join refuse it by name."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from server_support import build_tiny_model, pid_alive

from pagedserve.config import EngineArgs
from pagedserve.processes.data_parallel.launch import LocalReplicas, open_replicas
from pagedserve.processes.engine_core.early_core import core_addresses, spawn_early_core
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.async_engine import AsyncLLMEngine


def _args(tmp_path: Path, **extra: object) -> EngineArgs:
    model = build_tiny_model(tmp_path / "tiny")
    return EngineArgs(model=str(model), max_model_len=128, num_kv_blocks=16, **extra)


def test_the_front_end_adopts_the_core_started_ahead(tmp_path: Path) -> None:
    args = _args(tmp_path)
    early = spawn_early_core(args.model_dump_json(), tensor_parallel_size=1)

    async def main() -> None:
        engine = await AsyncLLMEngine.launch(args, early=early)
        try:
            assert engine.core_pid == early.process.pid  # no second core was spawned
            params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
            outs = [o async for o in engine.generate("Hello", params, "a")]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        finally:
            await engine.shutdown()

    asyncio.run(main())
    early.process.join(30)
    assert not early.process.is_alive()
    assert not os.path.exists(early.ipc_dir)


def test_a_core_nobody_adopts_is_stopped(tmp_path: Path) -> None:
    early = spawn_early_core(_args(tmp_path).model_dump_json(), tensor_parallel_size=1)
    pid = early.process.pid
    assert pid is not None and pid_alive(pid)
    group = LocalReplicas(_args(tmp_path), early)
    group.close()  # closed before `start` adopted it
    assert not early.process.is_alive() and not pid_alive(pid)
    assert not os.path.exists(early.ipc_dir)


def test_groups_that_cannot_take_it_refuse_it(tmp_path: Path) -> None:
    early = spawn_early_core(_args(tmp_path).model_dump_json(), tensor_parallel_size=1)
    try:
        with pytest.raises(ValueError, match="one-replica engine only"):
            LocalReplicas(_args(tmp_path, data_parallel_size=2, platform="cpu_reference"), early)
        with pytest.raises(ValueError, match="cannot join a Ray data-parallel group"):
            open_replicas(_args(tmp_path, data_parallel_size=2, distributed_executor_backend="ray"), early)
    finally:
        early.stop()
    assert not early.process.is_alive() and not os.path.exists(early.ipc_dir)


def test_core_addresses_keep_the_one_replica_names() -> None:
    assert core_addresses("/d", 0) == ("ipc:///d/to_core", "ipc:///d/from_core")
    assert core_addresses("/d", 2) == ("ipc:///d/to_core_2", "ipc:///d/from_core_2")
