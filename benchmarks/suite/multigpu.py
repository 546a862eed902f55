"""The GPU suite's multi-GPU stage and its scoreboard rows: tensor and data parallelism against one
GPU of the same host, in the same run (`python -m benchmarks.gpu_suite --stages multigpu`).

On a host with N >= 2 GPUs it runs, each in a process of its own:

  all_reduce  the all-reduce's paths (NCCL, one-shot and two-shot over peer memory) inside CUDA
              graphs at world sizes 2 and 4 (`benchmarks/kernel_benchmarks/all_reduce.py`)
  tp_8b_T     Llama-3.1-8B shapes at T = 1, 2 and 4 (those the host has): single-stream TTFT/TPOT,
              the decode step at 64 requests with its collective time, and output tok/s on the
              1,000-request workload (`benchmarks/tp_gpu.py`)
  tp_70b_T    Llama-3.1-70B shapes at T = 2 and 4: single stream and the decode step at 64
  dp          `pagedserve bench throughput --data-parallel-size N` on the 1,000-request workload,
              one replica per GPU, and the same command with one engine (both with 32 untimed
              warm-up requests)
  dp_serve    the same workload through `pagedserve serve --data-parallel-size N
              --api-server-count N` (one API-server process per replica), loaded by
              `pagedserve bench serve` with every request at once, and through a one-engine
              server (`benchmarks/serve_throughput.py`)

The GPU equality tests of tensor and data parallelism run in the suite's `tests` stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from benchmarks.suite.rows import Row, dig, fmt, judge


class Suite(Protocol):
    """What the stage needs of `gpu_suite.Suite`: where to write, and how to run a command."""

    out: Path
    python: str

    def run(self, name: str, argv: list[str], timeout_s: float) -> dict[str, Any]: ...


THROUGHPUT_WORKLOAD = "benchmarks/workloads/sharegpt_like_1000.json"
# Targets, each against TP=1 (or one GPU) of the same host in the same run.
TPOT_RATIO_TP2 = 0.68
THROUGHPUT_RATIO_TP2 = 1.5
THROUGHPUT_RATIO_DP2 = 1.9
TPOT_70B_TP4_MS = 15.0
ALL_REDUCE_70B_TP2_MS = 1.2
DP_WARMUP_REQUESTS = 32  # untimed, in both the data-parallel and the one-engine run


def stage_multigpu(suite: Suite) -> dict[str, Any]:
    import torch

    from benchmarks.gpu_latency import llama_8b_config

    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s) visible: tensor and data parallelism need two or more"}
    raw = suite.out / "raw"
    sizes = [t for t in (2, 4) if t <= gpus]
    out: dict[str, Any] = {"gpus": gpus}
    path = raw / "all_reduce.json"
    argv = [
        suite.python,
        "benchmarks/kernel_benchmarks/all_reduce.py",
        "--world",
        ",".join(map(str, sizes)),
        "--json",
        str(path),
    ]
    out["all_reduce"] = suite.run("multigpu_all_reduce", argv, timeout_s=600) | {"result": _read(path)}
    for shape, tps, workload in (("8b", [1, *sizes], THROUGHPUT_WORKLOAD), ("70b", sizes, None)):
        for tp in tps:
            path = raw / f"tp_{shape}_{tp}.json"
            argv = [
                suite.python,
                "benchmarks/tp_gpu.py",
                "--shape",
                shape,
                "--tp",
                str(tp),
                "--json",
                str(path),
            ]
            argv += ["--workload", workload] if workload else []
            res = suite.run(f"multigpu_tp_{shape}_{tp}", argv, timeout_s=1500)
            out[f"tp_{shape}_{tp}"] = res | {"result": _read(path)}
    model_dir = suite.out / "llama-3.1-8b-shapes"
    llama_8b_config().save_pretrained(model_dir)
    # Data parallelism against one engine, both by the same command with the same warm-up.
    for name, size in (("dp", gpus), ("dp_one_engine", 1)):
        path = raw / f"{name}_throughput.json"
        argv = [suite.python, "-m", "pagedserve.cli.main", "bench", "throughput", "--model", str(model_dir)]
        argv += ["--load-format", "dummy", "--dtype", "bfloat16", "--skip-tokenizer-init"]
        argv += ["--max-model-len", "4096", "--platform", "cuda", "--max-num-seqs", "256"]
        argv += ["--data-parallel-size", str(size), "--warmup-requests", str(DP_WARMUP_REQUESTS)]
        argv += ["--workload", THROUGHPUT_WORKLOAD, "--json", str(path)]
        res = suite.run(f"multigpu_{name}", argv, timeout_s=1500)
        out[name] = res | {"result": _read(path), "size": size}
    # The same through the OpenAI-compatible server, data-parallel and with one engine.
    for name, size in (("dp_serve", gpus), ("dp_serve_one_engine", 1)):
        path = raw / f"{name}.json"
        argv = [
            suite.python,
            "benchmarks/serve_throughput.py",
            str(model_dir),
            "--workload",
            THROUGHPUT_WORKLOAD,
        ]
        argv += ["--json", str(path)]
        server = ["--load-format=dummy", "--dtype=bfloat16", "--skip-tokenizer-init", "--max-model-len=4096"]
        server += ["--platform=cuda", "--max-num-seqs=256", f"--data-parallel-size={size}"]
        server += [f"--api-server-count={size}"]
        argv += [f"--server-arg={option}" for option in server]
        # The server has no tokenizer to tell the client its vocabulary; the workload's ids wrap.
        argv += ["--bench-arg=--wrap-token-ids"]
        res = suite.run(f"multigpu_{name}", argv, timeout_s=1500)
        out[name] = res | {"result": _read(path), "size": size}
    return out


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def multigpu_rows(stages: dict[str, Any]) -> list[Row]:
    """TP and DP rows of the scoreboard, each against TP=1 of the same run. Pure."""
    mg = stages.get("multigpu") or {}
    if not mg or "skipped" in mg:
        return [Row("tensor / data parallelism", "not run", "", "a host with 2+ GPUs", "not run")]

    def run(shape: str, tp: int, *keys: str) -> Any:
        return dig(mg, f"tp_{shape}_{tp}", "result", "runs", 0, *keys)

    rows = []
    tpot1 = run("8b", 1, "single_stream", "tpot_median_ms")
    thr1 = run("8b", 1, "throughput", "output_tokens_per_s")
    for tp in (2, 4):
        tpot = run("8b", tp, "single_stream", "tpot_median_ms")
        thr = run("8b", tp, "throughput", "output_tokens_per_s")
        if tpot is None and thr is None:
            continue
        tpot_ratio = tpot / tpot1 if tpot and tpot1 else None
        thr_ratio = thr / thr1 if thr and thr1 else None
        peer_tpot = f"TP=1 {fmt(tpot1, '.2f', ' ms')}"
        goal = TPOT_RATIO_TP2 if tp == 2 else None
        rows.append(
            Row(
                f"8B TP={tp} single-stream TPOT",
                fmt(tpot, ".2f", " ms"),
                peer_tpot,
                f"<= {goal}x TP=1" if goal else "",
                judge(tpot_ratio, "<=", goal) if goal else "n/a",
            )
        )
        goal = THROUGHPUT_RATIO_TP2 if tp == 2 else None
        rows.append(
            Row(
                f"8B TP={tp} output tok/s, 1,000 requests",
                fmt(thr, ",.0f", " tok/s"),
                f"TP=1 {fmt(thr1)}",
                f">= {goal}x TP=1" if goal else "",
                judge(thr_ratio, ">=", goal) if goal else "n/a",
            )
        )
    for tp in (2, 4):
        tpot = run("70b", tp, "single_stream", "tpot_median_ms")
        reduce_ms = run("70b", tp, "collectives", "all_reduce_ms_per_step")
        if tpot is None:
            continue
        goal = TPOT_70B_TP4_MS if tp == 4 else None
        rows.append(
            Row(
                f"70B TP={tp} single-stream TPOT",
                fmt(tpot, ".2f", " ms"),
                "",
                f"<= {goal} ms (H100)" if goal else "",
                judge(tpot, "<=", goal) if goal else "n/a",
            )
        )
        rows.append(
            Row(
                f"70B TP={tp} all-reduce per decode step, 64 requests",
                fmt(reduce_ms, ".2f", " ms"),
                "",
                f"<= {ALL_REDUCE_70B_TP2_MS} ms" if tp == 2 else "",
                judge(reduce_ms, "<=", ALL_REDUCE_70B_TP2_MS) if tp == 2 else "n/a",
            )
        )
    size = dig(mg, "dp", "size")
    dp = dig(mg, "dp", "result", "result", "output_tokens_per_s")
    one = dig(mg, "dp_one_engine", "result", "result", "output_tokens_per_s")
    ratio = dp / one if dp and one else None
    goal = THROUGHPUT_RATIO_DP2 if size == 2 else None
    rows.append(
        Row(
            f"8B DP={size} output tok/s, 1,000 requests",
            fmt(dp, ",.0f", " tok/s"),
            f"one engine {fmt(one)}",
            f">= {goal}x one GPU" if goal else "",
            judge(ratio, ">=", goal) if goal else "n/a",
        )
    )
    size = dig(mg, "dp_serve", "size")
    dp = dig(mg, "dp_serve", "result", "bench", "output_throughput")
    one = dig(mg, "dp_serve_one_engine", "result", "bench", "output_throughput")
    if dp is not None or one is not None:
        ratio = dp / one if dp and one else None
        goal = THROUGHPUT_RATIO_DP2 if size == 2 else None
        rows.append(
            Row(
                f"8B DP={size} through `serve`, output tok/s, 1,000 requests",
                fmt(dp, ",.0f", " tok/s"),
                f"one-engine server {fmt(one)}",
                f">= {goal}x one GPU" if goal else "",
                judge(ratio, ">=", goal) if goal else "n/a",
            )
        )
    return rows
