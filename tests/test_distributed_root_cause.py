"""The `mp` executor names a dead peer as the cause of a rank's broken collective, also when the
peer's exit status lags its closed pipes (a loaded host), and keeps a rank's own error otherwise."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from pagedserve.processes.tensor_parallel import multiproc
from pagedserve.processes.tensor_parallel.multiproc import MultiprocExecutor


class _Rank:
    """What the executor reads of a rank process: its sentinel, pid, exit status and `join`.
    `exiting` ranks have closed their end of the sentinel pipe, but their exit status shows only
    once they are joined (the window between a dying process's closed files and its reaping)."""

    def __init__(self, pid: int, exit_code: int | None, exiting: bool) -> None:
        self.sentinel, self._write_end = os.pipe()
        if exiting:
            os.close(self._write_end)
            self._write_end = -1
        self.pid = pid
        self._exit_code = exit_code
        self._joined = False

    @property
    def exitcode(self) -> int | None:
        return self._exit_code if self._joined else None

    def join(self, timeout: float | None = None) -> None:
        self._joined = self._write_end == -1

    def close(self) -> None:
        os.close(self.sentinel)
        if self._write_end != -1:
            os.close(self._write_end)


@pytest.fixture
def executor(monkeypatch: pytest.MonkeyPatch) -> Iterator[MultiprocExecutor]:
    monkeypatch.setattr(multiproc, "PEER_EXIT_WAIT_S", 0.05)
    executor = MultiprocExecutor.__new__(MultiprocExecutor)  # no ranks spawned: only procs is read
    yield executor
    for rank in executor.procs:
        rank.close()  # type: ignore[attr-defined]


def test_a_killed_peer_is_named_even_before_it_is_reaped(executor: MultiprocExecutor) -> None:
    executor.procs = [_Rank(4242, -9, exiting=True), _Rank(4243, None, exiting=False)]  # type: ignore[list-item]
    reason = executor._root_cause(1, "rank 1 failed: RuntimeError: Connection reset by peer\n  traceback")
    assert reason == (
        "rank 0 died: process 4242 was killed by signal 9 "
        "(then rank 1 failed: RuntimeError: Connection reset by peer)"
    )


def test_a_rank_error_stays_its_own_while_every_peer_lives(executor: MultiprocExecutor) -> None:
    executor.procs = [_Rank(4242, None, exiting=False), _Rank(4243, None, exiting=False)]  # type: ignore[list-item]
    reason = "rank 1 failed: ValueError: bad input"
    assert executor._root_cause(1, reason) == reason
