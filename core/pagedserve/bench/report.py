"""Presenting a benchmark: a text table, JSON, and an optional latency plot (matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedserve.bench.metrics import BenchSummary, RequestResult


def format_table(summary: BenchSummary, title: str) -> str:
    """The summary as an aligned text table."""
    rows: list[tuple[str, str]] = [
        ("Requests (completed / failed)", f"{summary.completed} / {summary.failed}"),
        ("Duration (s)", f"{summary.duration_s:.2f}"),
        ("Input tokens", str(summary.total_input_tokens)),
        ("Output tokens", str(summary.total_output_tokens)),
        ("Request throughput (req/s)", f"{summary.request_throughput:.3f}"),
        ("Output token throughput (tok/s)", f"{summary.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{summary.total_token_throughput:.2f}"),
    ]
    for name, dist in (
        ("TTFT (ms)", summary.ttft_ms),
        ("TPOT (ms)", summary.tpot_ms),
        ("ITL (ms)", summary.itl_ms),
        ("E2E latency (ms)", summary.e2e_ms),
    ):
        rows.append(
            (name, f"mean {dist.mean:.2f}  p50 {dist.p50:.2f}  p90 {dist.p90:.2f}  p99 {dist.p99:.2f}")
        )
    width = max(len(k) for k, _ in rows)
    lines = [f"=== {title} ===", *(f"{k:<{width}}  {v}" for k, v in rows)]
    lines += [f"error: {e}" for e in summary.errors]
    return "\n".join(lines)


def write_json(path: str | Path, summary: BenchSummary, config: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps({"config": config, "summary": summary.to_dict()}, indent=2) + "\n")


def plot_latencies(path: str | Path, results: list[RequestResult]) -> None:
    """TTFT and end-to-end latency of each completed request against its send time."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.scatter([r.start for r in ok], [r.e2e * 1000 for r in ok], s=10, label="end-to-end")
    ax.scatter([r.start for r in ok], [r.ttft * 1000 for r in ok], s=10, label="TTFT")
    ax.set_xlabel("request sent at (s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"{len(ok)} requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
