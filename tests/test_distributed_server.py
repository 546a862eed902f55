"""The server's engine with tensor parallelism: `AsyncLLMEngine` at TP=2 (gloo, cpu_reference)
serves, and when a rank dies it reports unhealthy, fails requests with `EngineDeadError`, and
leaves no rank process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from server_support import build_tiny_model, pid_alive

from pagedserve.config import EngineArgs
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.async_engine import AsyncLLMEngine, EngineDeadError


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def test_tp2_server_engine_serves_then_reports_a_dead_rank(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    args = EngineArgs(
        model=str(model), max_model_len=128, num_kv_blocks=32, block_size=16, tensor_parallel_size=2
    )
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)

    async def main() -> None:
        engine = await AsyncLLMEngine.launch(args)
        try:
            core_pid = engine.core_pid
            assert core_pid is not None and engine.is_healthy
            out = [o async for o in engine.generate("Hello", params, "a")][-1]
            assert out.finished and len(out.outputs[0].token_ids) == 4
            ranks = _children(core_pid)
            # Spawned ranks run multiprocessing's spawn_main (its resource tracker does not).
            rank_pids = [p for p in ranks if "spawn_main" in _cmdline(p)]
            assert len(rank_pids) == 2
            victim = rank_pids[0]
            os.kill(victim, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match=r"rank \d died: process \d+ was killed by signal 9"):
                await asyncio.wait_for(_drain(engine.generate("Hello again", params, "b")), 30)
            assert time.monotonic() - start < 15
            assert not engine.is_healthy
            for _ in range(50):
                if not any(pid_alive(p) for p in ranks if p != victim):
                    break
                await asyncio.sleep(0.1)
            assert not any(pid_alive(p) for p in ranks), "a rank outlived the failed engine"
        finally:
            await engine.shutdown()

    asyncio.run(main())


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


async def _drain(gen: object) -> None:
    async for _ in gen:  # type: ignore[attr-defined]
        pass
