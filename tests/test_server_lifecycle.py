"""The server's process lifecycle: the engine core killed mid-request, and SIGTERM while a stream
is in flight. Each test starts (and always stops) its own tiny-model server."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_support import ServerProcess, build_tiny_model, pid_alive, start_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def server(model_dir: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        model_dir, "--max-model-len", "512", "--num-kv-blocks", "64", "--shutdown-timeout", "20"
    )
    try:
        yield proc
    finally:
        proc.stop()


def _stream_events(
    server: ServerProcess, body: dict[str, object], events: list[str], started: threading.Event
) -> None:
    """Read a completion stream's `data:` events into `events` (in a thread)."""
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line.removeprefix("data: "))
                started.set()
    started.set()


def test_engine_core_killed_mid_request(server: ServerProcess) -> None:
    body = {"model": server.model_name, "prompt": "a b c", "max_tokens": 400, "ignore_eos": True}
    events: list[str] = []
    started = threading.Event()
    reader = threading.Thread(target=_stream_events, args=(server, {**body, "stream": True}, events, started))
    reader.start()
    blocking: dict[str, httpx.Response] = {}

    def post() -> None:
        blocking["r"] = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)

    waiter = threading.Thread(target=post)
    waiter.start()
    assert started.wait(60), "the stream never started"
    time.sleep(0.3)  # let the non-streaming request reach the core too
    os.kill(server.core_pid, signal.SIGKILL)

    t0 = time.monotonic()
    reader.join(30)
    waiter.join(30)
    assert not reader.is_alive() and not waiter.is_alive(), "a request hung after the core died"
    assert time.monotonic() - t0 < 30
    # The stream ends with an error event and [DONE], not with a normal finish.
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "engine core" in error["message"]
    assert blocking["r"].status_code == 503
    assert blocking["r"].json()["error"]["type"] == "service_unavailable"

    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    again = httpx.post(f"{server.base_url}/v1/completions", json={**body, "max_tokens": 2}, timeout=10)
    assert again.status_code == 503
    # The server still shuts down cleanly.
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0


def test_sigterm_drains_streams(server: ServerProcess) -> None:
    body = {"model": server.model_name, "prompt": "x y", "max_tokens": 24, "ignore_eos": True, "stream": True}
    events: list[str] = []
    started = threading.Event()
    reader = threading.Thread(target=_stream_events, args=(server, body, events, started))
    reader.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    reader.join(60)
    assert not reader.is_alive()
    # The request in flight was drained: it finished normally before the server went down.
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while pid_alive(server.core_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(server.core_pid), "the engine core outlived the server"
