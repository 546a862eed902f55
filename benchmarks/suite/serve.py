"""The GPU suite's serve stage and its scoreboard rows: `pagedserve serve` against the offline
engine on the same GPU, in the same run (`python -m benchmarks.gpu_suite --stages serve`).

With Llama-3.1-8B shapes (dummy bfloat16 weights, no tokenizer: the client sends token ids) and
`sharegpt_like_1000.json`, each in a process of its own and with the kernel caches of one folder:

  serve_cold   a server started on empty caches (its time to ready is the cold start), loaded by
               `pagedserve bench serve` three times (`benchmarks/serve_throughput.py --load`):
               the first 48 requests after ready one at a time (first-request outliers), every
               request at once (output tok/s, ITL and TPOT under a burst), and 20 requests/s
               (Poisson, 600 requests)
  serve_warm   the same server started again, caches warm (the warm start), loaded at once
  budget_N     a server with `--max-num-batched-tokens N` for each N of `BUDGETS`, loaded at once
               and at 20 requests/s: what the token budget trades (TTFT against ITL)
  offline      `pagedserve bench throughput --scheduling-policy fcfs` on the workload: the
               output tok/s the server's burst is held to
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Protocol

from benchmarks.suite.rows import Row, dig, fmt, judge


class Suite(Protocol):
    """What the stage needs of `gpu_suite.Suite`: where to write, and how to run a command."""

    out: Path
    python: str

    def run(
        self, name: str, argv: list[str], timeout_s: float, cache: Path | None = None
    ) -> dict[str, Any]: ...


WORKLOAD = "benchmarks/workloads/sharegpt_like_1000.json"
ENGINE = ["--load-format=dummy", "--dtype=bfloat16", "--skip-tokenizer-init", "--max-model-len=4096"]
ENGINE += ["--platform=cuda", "--max-num-seqs=256"]
LOADS = {
    "first_48": "--max-concurrency=1 --num-prompts=48",
    "at_once": "",
    "rate_20": "--request-rate=20 --num-prompts=600",
}
BUDGETS = (2048, 4096)  # besides the engine's default
# Targets (8B shapes, one GPU).
READY_COLD_S = 60.0
READY_WARM_S = 20.0
ITL_P99_MS = 100.0
TPOT_P99_MS = 30.0
SERVE_OVER_OFFLINE = 0.97
FIRST_TTFT_P99_OVER_P50 = 2.0
RATE_20_TTFT_P99_MS = 60.0


def _serve(
    suite: Suite, name: str, model_dir: Path, cache: Path, loads: list[str], engine: list[str]
) -> dict[str, Any]:
    path = suite.out / "raw" / f"serve_{name}.json"
    argv = [suite.python, "benchmarks/serve_throughput.py", str(model_dir), "--workload", WORKLOAD]
    argv += ["--json", str(path), "--log", str(suite.out / "logs" / f"serve_{name}.server.log")]
    argv += [f"--load={load}:{LOADS[load]}" for load in loads]
    argv += [f"--server-arg={option}" for option in [*ENGINE, *engine]]
    # The server has no tokenizer to tell the client its vocabulary; the workload's ids wrap.
    argv += ["--bench-arg=--wrap-token-ids"]
    res = suite.run(f"serve_{name}", argv, timeout_s=1200, cache=cache)
    return res | {"result": json.loads(path.read_text()) if path.is_file() else None}


def stage_serve(suite: Suite) -> dict[str, Any]:
    from benchmarks.gpu_latency import llama_8b_config

    model_dir = suite.out / "llama-3.1-8b-shapes"
    llama_8b_config().save_pretrained(model_dir)
    cache = suite.out / "cache-serve"
    shutil.rmtree(cache, ignore_errors=True)  # the first server starts on empty caches
    out: dict[str, Any] = {"cold": _serve(suite, "cold", model_dir, cache, list(LOADS), [])}
    out["warm"] = _serve(suite, "warm", model_dir, cache, ["at_once"], [])
    for budget in BUDGETS:
        engine = [f"--max-num-batched-tokens={budget}"]
        out[f"budget_{budget}"] = _serve(
            suite, f"budget_{budget}", model_dir, cache, ["at_once", "rate_20"], engine
        )
    path = suite.out / "raw" / "serve_offline_fcfs.json"
    argv = [suite.python, "-m", "pagedserve.cli.main", "bench", "throughput", "--model", str(model_dir)]
    argv += [*ENGINE, "--scheduling-policy=fcfs", "--warmup-requests=16", "--workload", WORKLOAD]
    argv += ["--wrap-token-ids", "--json", str(path)]
    res = suite.run("serve_offline_fcfs", argv, timeout_s=900, cache=cache)
    out["offline_fcfs"] = res | {"result": json.loads(path.read_text()) if path.is_file() else None}
    return out


def serve_rows(stages: dict[str, Any]) -> list[Row]:
    """The serve stage's rows, each with the offline engine of the same run where it compares. Pure."""
    serve = stages.get("serve") or {}
    if not serve:
        return [Row("pagedserve serve, 8B shapes", "not run", "", "", "not run")]

    def load(run: str, name: str, *keys: str) -> Any:
        return dig(serve, run, "result", "loads", name, "summary", *keys)

    def at_most(benchmark: str, value: float | None, goal: float, unit: str) -> Row:
        return Row(
            benchmark, fmt(value, ".1f", f" {unit}"), "", f"<= {goal:.0f} {unit}", judge(value, "<=", goal)
        )

    rows = [
        at_most(f"serve ready, {kind} caches", dig(serve, kind, "result", "ready_s"), goal, "s")
        for kind, goal in (("cold", READY_COLD_S), ("warm", READY_WARM_S))
    ]
    offline = dig(serve, "offline_fcfs", "result", "result", "output_tokens_per_s")
    served = load("cold", "at_once", "output_throughput")
    ratio = None if served is None or not offline else served / offline
    rows.append(
        Row(
            "serve, 1,000 requests at once, output tok/s",
            fmt(served, ",.0f", " tok/s"),
            f"offline engine, FCFS, same GPU: {fmt(offline)} tok/s",
            f">= {SERVE_OVER_OFFLINE:.0%} of offline",
            judge(ratio, ">=", SERVE_OVER_OFFLINE),
        )
    )
    itl, tpot = load("cold", "at_once", "itl_ms", "p99"), load("cold", "at_once", "tpot_ms", "p99")
    rows.append(at_most("serve, 1,000 at once, ITL p99", itl, ITL_P99_MS, "ms"))
    rows.append(at_most("serve, 1,000 at once, TPOT p99", tpot, TPOT_P99_MS, "ms"))
    p50, p99 = load("cold", "first_48", "ttft_ms", "p50"), load("cold", "first_48", "ttft_ms", "p99")
    spread = None if p50 is None or p99 is None or not p50 else p99 / p50
    rows.append(
        Row(
            "serve, first 48 requests one at a time, TTFT p99",
            fmt(p99, ".1f", " ms"),
            f"p50 of the same requests {fmt(p50, '.1f', ' ms')}",
            f"<= {FIRST_TTFT_P99_OVER_P50:.0f}x p50",
            judge(spread, "<=", FIRST_TTFT_P99_OVER_P50),
        )
    )
    rate = load("cold", "rate_20", "ttft_ms", "p99")
    rows.append(at_most("serve, 20 requests/s, TTFT p99", rate, RATE_20_TTFT_P99_MS, "ms"))
    # What the token budget trades, each beside the default budget's number of the same load.
    for budget in BUDGETS:
        run, name = f"budget_{budget}", f"serve, --max-num-batched-tokens {budget}"
        for label, value, default, unit in (
            ("1,000 at once, output", load(run, "at_once", "output_throughput"), served, "tok/s"),
            ("1,000 at once, ITL p99", load(run, "at_once", "itl_ms", "p99"), itl, "ms"),
            ("20 requests/s, TTFT p99", load(run, "rate_20", "ttft_ms", "p99"), rate, "ms"),
        ):
            spec = ",.0f" if unit == "tok/s" else ".1f"
            peer = f"default budget {fmt(default, spec, f' {unit}')}"
            rows.append(Row(f"{name}, {label}", fmt(value, spec, f" {unit}"), peer, "", "n/a"))
    return rows
