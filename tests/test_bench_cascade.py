"""`benchmarks/investigations/cascade.py`: its shared-prefix workload is what it says, and its CPU smoke run
goes through every measurement with cascade steps really taken."""

from __future__ import annotations

import json
from pathlib import Path

from bench_support import load_benchmark

from pagedserve.bench.datasets import load_workload

bench = load_benchmark("cascade", "investigations")


def test_shared_prefix_workload_shares_its_prompt_and_is_deterministic(tmp_path: Path) -> None:
    data = bench.shared_prefix_workload(num=50, prefix_len=128, seed=1)
    assert data == bench.shared_prefix_workload(num=50, prefix_len=128, seed=1)
    prompts = [r["prompt_ids"] for r in data["requests"]]
    assert all(p[:128] == prompts[0][:128] for p in prompts)
    assert len({tuple(p[128:]) for p in prompts}) == 50  # each its own suffix
    own = [len(p) - 128 for p in prompts]
    assert min(own) >= bench.MIN_LEN and max(own) <= bench.MAX_LEN
    assert data["meta"]["stats"]["num_requests"] == 50
    path = tmp_path / "shared.json"
    bench.main(["--write-workload", str(path), "--workload-requests", "20", "--workload-prefix", "32"])
    loaded = load_workload(path)
    assert len(loaded) == 20 and all(r.prompt_ids[:32] == loaded[0].prompt_ids[:32] for r in loaded)


def test_cpu_smoke_runs_every_measurement(tmp_path: Path) -> None:
    out = tmp_path / "cascade.json"
    results = bench.main(["--cpu-smoke", "--json", str(out)])
    assert json.loads(out.read_text()) == results
    decode = results["decode"]
    assert decode["steps_cascaded_on"] > 0 and decode["steps_cascaded_off"] == 0
    assert results["shared_prefix"]["steps_cascaded_on"] > 0
    assert results["sharegpt_like"]["steps_cascaded_on"] == 0  # nothing shares a prefix there
