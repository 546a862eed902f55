"""`pagedserve bench serve` against a live tiny-model server, and `pagedserve bench throughput`
on a small workload file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_support import ServerProcess, build_tiny_model, start_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    proc = start_server(model_dir, "--max-model-len", "256", "--num-kv-blocks", "128")
    try:
        yield proc
    finally:
        proc.stop()


def _pagedserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.cli.main", *args], capture_output=True, text=True, timeout=300
    )


def test_bench_serve_random(server: ServerProcess, tmp_path: Path) -> None:
    out = _pagedserve(
        "bench", "serve", "--base-url", server.base_url, "--dataset", "random", "--num-prompts", "12",
        "--request-rate", "inf", "--max-concurrency", "4", "--random-input-len", "16",
        "--random-output-len", "5", "--vocab-size", "49152",
        "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr + out.stdout
    assert "TTFT (ms)" in out.stdout
    assert re.search(r"Requests \(completed / failed\)\s+12 / 0", out.stdout)
    summary = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert summary["completed"] == 12
    assert summary["total_output_tokens"] == 12 * 5  # ignore_eos: exactly the asked length
    assert summary["total_input_tokens"] == 12 * 16
    assert 0 < summary["ttft_ms"]["mean"] <= summary["e2e_ms"]["mean"]
    assert summary["tpot_ms"]["mean"] > 0 and summary["itl_ms"]["p50"] > 0
    assert (tmp_path / "r.png").stat().st_size > 0


def test_bench_serve_workload_file_with_poisson_rate(server: ServerProcess, tmp_path: Path) -> None:
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": [{"prompt_ids": [60000, 5, 6], "output_len": 3}] * 4}))
    refused = _pagedserve("bench", "serve", "--base-url", server.base_url, "--dataset", str(workload),
                          "--num-prompts", "4", "--vocab-size", "49152")  # fmt: skip
    assert refused.returncode == 2 and "--wrap-token-ids" in refused.stderr
    ok = _pagedserve("bench", "serve", "--base-url", server.base_url, "--dataset", str(workload),
                     "--num-prompts", "4", "--vocab-size", "49152", "--wrap-token-ids",
                     "--request-rate", "20", "--json", str(tmp_path / "w_out.json"))  # fmt: skip
    assert ok.returncode == 0, ok.stderr + ok.stdout
    summary = json.loads((tmp_path / "w_out.json").read_text())["summary"]
    assert summary["completed"] == 4 and summary["total_output_tokens"] == 12


def test_bench_serve_over_two_client_processes(server: ServerProcess, tmp_path: Path) -> None:
    out = _pagedserve(
        "bench", "serve", "--base-url", server.base_url, "--num-prompts", "7", "--client-processes", "2",
        "--max-concurrency", "3", "--random-input-len", "8", "--random-output-len", "4",
        "--vocab-size", "49152", "--json", str(tmp_path / "p.json"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr + out.stdout
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["config"]["client_processes"] == 2
    summary = doc["summary"]
    assert summary["completed"] == 7 and summary["total_output_tokens"] == 7 * 4
    assert 0 < summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"] <= summary["duration_s"] * 1000


def test_bench_serve_client_processes_must_be_positive(server: ServerProcess) -> None:
    out = _pagedserve("bench", "serve", "--base-url", server.base_url, "--client-processes", "0")
    assert out.returncode == 2 and "--client-processes must be >= 1" in out.stderr


def test_bench_serve_reports_failures(server: ServerProcess) -> None:
    # 300 prompt tokens do not fit max_model_len 256: every request fails with the server's 400.
    out = _pagedserve("bench", "serve", "--base-url", server.base_url, "--num-prompts", "2",
                      "--random-input-len", "300", "--random-output-len", "2")  # fmt: skip
    assert out.returncode == 1
    assert re.search(r"Requests \(completed / failed\)\s+0 / 2", out.stdout)
    assert "HTTP 400" in out.stdout and "maximum context length" in out.stdout


def test_bench_serve_unreachable_server() -> None:
    out = _pagedserve("bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1")
    assert out.returncode == 1 and "cannot benchmark" in out.stderr
    split = _pagedserve("bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2",
                        "--client-processes", "2")  # fmt: skip
    assert split.returncode == 1 and "client process 0 of 2 failed" in split.stderr


def test_bench_throughput(model_dir: Path, tmp_path: Path) -> None:
    workload = tmp_path / "w.json"
    reqs = [{"prompt_ids": list(range(100 + i, 110 + i)), "output_len": 3 + i} for i in range(5)]
    workload.write_text(json.dumps({"meta": {}, "requests": reqs}))
    out = _pagedserve(
        "bench", "throughput", "--workload", str(workload), "--model", str(model_dir),
        "--num-kv-blocks", "64", "--max-model-len", "128", "--json", str(tmp_path / "t.json"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Output tokens/s" in out.stdout
    result = json.loads((tmp_path / "t.json").read_text())["result"]
    assert result["num_requests"] == 5
    assert result["output_tokens"] == sum(3 + i for i in range(5))
    assert result["input_tokens"] == 50
    assert result["requests_per_s"] > 0
