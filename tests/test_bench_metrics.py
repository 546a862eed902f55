"""Benchmark bookkeeping without a server: datasets, metric aggregation, table / JSON / plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.bench.datasets import BenchRequest, fit_vocab, load_workload, random_requests
from pagedserve.bench.metrics import Distribution, RequestResult, summarize
from pagedserve.bench.report import format_table, plot_latencies, write_json
from pagedserve.bench.serve_client import default_client_processes, split_load


def test_random_requests_lengths_and_ids() -> None:
    reqs = random_requests(20, input_len=10, output_len=4, vocab_size=50, range_ratio=0.5, seed=1)
    assert len(reqs) == 20
    assert all(5 <= len(r.prompt_ids) <= 15 and 2 <= r.output_len <= 6 for r in reqs)
    assert all(0 <= t < 50 for r in reqs for t in r.prompt_ids)
    assert reqs == random_requests(20, input_len=10, output_len=4, vocab_size=50, range_ratio=0.5, seed=1)
    fixed = random_requests(3, input_len=7, output_len=3, vocab_size=50, range_ratio=0.0, seed=0)
    assert all(len(r.prompt_ids) == 7 and r.output_len == 3 for r in fixed)
    with pytest.raises(ValueError, match="range ratio"):
        random_requests(1, input_len=1, output_len=1, vocab_size=5, range_ratio=1.5, seed=0)


def test_load_workload_formats_and_errors(tmp_path: Path) -> None:
    shared = tmp_path / "w.json"
    shared.write_text(json.dumps({"meta": {}, "requests": [{"prompt_ids": [1, 2], "output_len": 3}] * 4}))
    assert load_workload(shared, 2) == [BenchRequest([1, 2], 3)] * 2
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([{"prompt_ids": [9], "output_len": 1}]))
    assert load_workload(bare) == [BenchRequest([9], 1)]
    with pytest.raises(ValueError, match="fewer than"):
        load_workload(bare, 5)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps([{"prompt_ids": [], "output_len": 1}]))
    with pytest.raises(ValueError, match="request 0: prompt_ids"):
        load_workload(broken)


@pytest.mark.parametrize(
    ("name", "num_requests"), [("sharegpt_like_256.json", 256), ("sharegpt_like_1000.json", 1000)]
)
def test_committed_workload_files_load(name: str, num_requests: int) -> None:
    reqs = load_workload(Path(__file__).resolve().parents[1] / "benchmarks" / "workloads" / name)
    assert len(reqs) == num_requests
    assert sum(r.output_len for r in reqs) == 200 * num_requests  # mean output 200, as generated
    assert max(r.output_len for r in reqs) <= 1024 and max(max(r.prompt_ids) for r in reqs) < 128000


def test_fit_vocab_refuses_or_wraps() -> None:
    reqs = [BenchRequest([1, 100, 250], 2)]
    with pytest.raises(ValueError, match="--wrap-token-ids"):
        fit_vocab(reqs, 100, wrap=False)
    assert fit_vocab(reqs, 100, wrap=True) == [BenchRequest([1, 0, 50], 2)]
    assert fit_vocab(reqs, 1000, wrap=False) is reqs


def _result(ttft: float, e2e: float, tokens: int, itl: list[float]) -> RequestResult:
    return RequestResult(
        prompt_len=10,
        expected_output_len=tokens,
        success=True,
        output_tokens=tokens,
        ttft=ttft,
        e2e=e2e,
        itl=itl,
    )


def test_summarize_computes_latencies_and_throughput() -> None:
    results = [
        _result(0.1, 1.1, 11, [0.1] * 10),  # TPOT = (1.1 - 0.1) / 10 = 100 ms
        _result(0.3, 0.7, 5, [0.1] * 4),  # TPOT = 0.4 / 4 = 100 ms
        RequestResult(prompt_len=10, expected_output_len=5, error="HTTP 400: bad"),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s.completed, s.failed) == (2, 1)
    assert s.total_input_tokens == 20 and s.total_output_tokens == 16
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(8.0)
    assert s.total_token_throughput == pytest.approx(18.0)
    assert s.ttft_ms.mean == pytest.approx(200.0)
    assert s.tpot_ms.p50 == pytest.approx(100.0)
    assert s.itl_ms.mean == pytest.approx(100.0)
    assert s.e2e_ms.p99 == pytest.approx(1096.0)  # numpy's linear interpolation between 700 and 1100
    assert s.errors == ["HTTP 400: bad"]


def test_split_load_deals_requests_rate_and_concurrency() -> None:
    shares = split_load(10, 3, 30.0, 7)
    assert [s.request_ids for s in shares] == [(0, 3, 6, 9), (1, 4, 7), (2, 5, 8)]
    assert [s.request_rate for s in shares] == [10.0] * 3
    assert [s.max_concurrency for s in shares] == [3, 2, 2]  # sums to 7
    assert len(split_load(10, 4, float("inf"), 1)) == 1  # one stream at a time: one process
    assert len(split_load(2, 4, float("inf"), None)) == 2
    assert [s.max_concurrency for s in split_load(5, 2, float("inf"), None)] == [None, None]


def test_default_client_processes() -> None:
    assert default_client_processes(1000, 1) == 1
    assert default_client_processes(48, None) == 1
    assert 1 <= default_client_processes(1000, None) <= 4


def test_distribution_of_nothing_is_zero() -> None:
    assert Distribution.of([]) == Distribution(0.0, 0.0, 0.0, 0.0)


def test_table_json_and_plot(tmp_path: Path) -> None:
    s = summarize([_result(0.1, 0.5, 5, [0.1] * 4)], duration_s=1.0)
    table = format_table(s, "run")
    for label in ("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "E2E latency (ms)", "Request throughput"):
        assert label in table
    write_json(tmp_path / "out.json", s, {"rate": "inf"})
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["config"] == {"rate": "inf"}
    assert data["summary"]["ttft_ms"]["mean"] == pytest.approx(100.0)
    plot_latencies(tmp_path / "plot.png", [_result(0.1, 0.5, 5, [0.1] * 4)])
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
