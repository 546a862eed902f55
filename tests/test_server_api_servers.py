"""`pagedserve serve --api-server-count N`: how the API-server processes split the replicas (GPU
groups, CPU shares, refusals), and a real server of two API-server processes over two replicas on
the CPU: concurrent requests all answered, both processes serving, a SIGTERM stopping every
process, and one process's death stopping the others with a failed exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_support import build_tiny_model, pid_alive, start_server

from pagedserve.config import EngineArgs
from pagedserve.processes.api_servers import plan_api_servers


def _args(**fields: object) -> EngineArgs:
    return EngineArgs.model_validate({"model": "unused", **fields})


def test_each_process_gets_its_replicas_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0,1,2,3")
    plans = plan_api_servers(_args(data_parallel_size=4, tensor_parallel_size=2), 2, device_type="cuda")
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["4,5,6,7", "0,1,2,3"]
    assert all(p.engine_args.data_parallel_size == 2 for p in plans)
    assert all(p.engine_args.tensor_parallel_size == 2 and p.cpus is None for p in plans)
    assert plans[0].env["NCCL_NVLS_ENABLE"] == "0"  # multicast stays off in every replica
    with pytest.raises(ValueError, match="needs 8 GPUs but 4 are visible"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
        plan_api_servers(_args(data_parallel_size=4, tensor_parallel_size=2), 4, device_type="cuda")


def test_on_cpus_each_process_gets_its_share_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
    plans = plan_api_servers(_args(data_parallel_size=6), 3, device_type="cpu")
    assert [p.cpus for p in plans] == [(0, 1), (2, 3), (4, 5)]
    assert [p.engine_args.data_parallel_size for p in plans] == [2, 2, 2]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    shared = plan_api_servers(_args(data_parallel_size=2), 2, device_type="cpu")
    assert [p.cpus for p in shared] == [None, None]  # fewer CPUs than processes: all share them


def test_one_process_is_the_plain_server_and_uneven_shares_are_refused() -> None:
    args = _args(data_parallel_size=2)
    (only,) = plan_api_servers(args, 1, device_type="cuda")
    assert only.engine_args is args and only.env == {} and only.cpus is None
    for count in (0, 3):
        refusal = f"--api-server-count {count} must be a divisor of --data-parallel-size 2"
        with pytest.raises(ValueError, match=refusal):
            plan_api_servers(args, count, device_type="cpu")


def test_cli_refuses_a_count_that_does_not_divide_the_replicas(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pagedserve.cli.main", "serve", str(tmp_path), "--api-server-count", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--api-server-count 3 must be a divisor of --data-parallel-size 1" in done.stderr
    assert "Traceback" not in done.stderr


def _children(pid: int) -> list[int]:
    """The API-server processes of a server: its spawned children, not multiprocessing's helper."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().split(") ", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(int(entry))
    return found


def _complete(base_url: str, i: int) -> int:
    """The completion tokens of one request of 6."""
    body = {"model": "tiny", "prompt": [3, 5, 7 + i], "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    answer = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
    return int(answer["usage"]["completion_tokens"])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _serving_lines(log: list[str]) -> list[str]:
    return [line for line in log if "pagedserve: serving 'tiny'" in line]


def test_two_api_server_processes_serve_and_stop_together(model: Path) -> None:
    server = start_server(
        model, "--data-parallel-size", "2", "--api-server-count", "2", "--skip-tokenizer-init",
        "--max-model-len", "256", "--num-kv-blocks", "64", "--block-size", "16",
    )  # fmt: skip
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: _complete(server.base_url, i), range(16)))
        assert answers == [6] * 16
        deadline = time.monotonic() + 30
        while len(_serving_lines(server.log)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        serving = _serving_lines(server.log)
        assert len(serving) == 2 and serving[0] != serving[1]  # two processes, two engine cores
        processes = _children(server.proc.pid)
        assert len(processes) == 2
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in [*processes, server.core_pid]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in [*processes, server.core_pid])


def test_one_process_dying_stops_the_server(model: Path) -> None:
    server = start_server(
        model, "--data-parallel-size", "2", "--api-server-count", "2", "--skip-tokenizer-init",
        "--max-model-len", "256", "--num-kv-blocks", "64", "--block-size", "16",
    )  # fmt: skip
    try:
        processes = _children(server.proc.pid)
        assert len(processes) == 2
        os.kill(processes[0], signal.SIGKILL)
        assert server.proc.wait(timeout=60) == 1
        assert any("stopping the others" in line for line in server.log)
        deadline = time.monotonic() + 10
        while pid_alive(processes[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(processes[1])
    finally:
        server.stop()
