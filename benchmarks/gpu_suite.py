"""Every GPU number of docs/benchmarks.md from one command, with the peers measured in the same run.

    python -m benchmarks.gpu_suite --out docs/results/DATE_GPU --peers PEERS_DIR

Run it from the repository root of a GPU host where pagedserve is installed with
`pip install -e ".[cuda]"` (docs/gpu_hosts.md, also for hosts without internet). Each stage runs
in a process of its own with its own time limit, so one failing stage is reported and the others
still run:

  env         GPU, driver, Python, torch, triton, transformers, the pagedserve revision
  tests       the GPU tests (`pytest -m gpu`)
  conformance every attention backend and cache op of the cuda and triton platforms against the
              cpu_reference oracle (`pagedserve conformance`)
  engine      greedy tokens on the cuda and triton platforms equal cpu_reference's (tiny models)
  attention   the attention case table (`benchmarks/kernel_benchmarks/attention.py --table`)
  variants    the prefill kernel variants' sweep (`benchmarks/kernel_benchmarks/attention.py
              --variants`), the winning configs written under OUT/variant_configs for review
              (not into the plugin)
  latency     single stream 512 -> 128 on Llama-3.1-8B shapes, GPU idle, the decode step at 256
              running requests, the engine as configured by default
              (`benchmarks/gpu_async_scheduling.py`)
  throughput  `pagedserve bench throughput` on each workload: first with empty kernel caches (a
              fresh machine's first run), then again with the caches it filled (warm)
  peers       HF transformers + static cache + torch.compile single stream, and HF continuous
              batching on the 256-request workload (scripts from PEERS_DIR)
  gemm        the linear layers of a decode step (1-128 rows, 8B shapes), the Triton GEMM the
              engine uses against cuBLAS and torch._scaled_mm
              (`benchmarks/kernel_benchmarks/skinny_gemm.py --fp8`),
              and 32 layers of them with and without programmatic dependent launches
              (`benchmarks/kernel_benchmarks/programmatic_launch.py`, sm_90+)
  fp8         FP8 weights + FP8 KV cache against bfloat16: KV tokens, TPOT, throughput on the
              256-request workload (`benchmarks/gpu_fp8.py`)
  moe         the Qwen3-30B-A3B shape (start-up on empty caches, streamed single stream, the
              1,000-request workload, decode profiles) beside the gpt-oss-20b shape's single
              stream (`benchmarks/gpu_latency.py --shape`), and the fused MoE op against
              `torch._grouped_mm` (`benchmarks/kernel_benchmarks/moe_op.py`)
  quantized   GPTQ W4A16 and compressed-tensors FP8 checkpoints of the 8B shape beside bf16 and
              load-time FP8: load, TPOT, the 1,000-request workload (`benchmarks/gpu_quantized.py`)
  serve       `pagedserve serve` loaded by `pagedserve bench serve` (at once, 20 requests/s, one at a
              time from the first request after ready), started on empty and on warm caches,
              beside the offline engine under FCFS (`benchmarks/suite/serve.py`)
  multigpu    on hosts with 2+ GPUs: the all-reduce's paths, Llama-3.1-8B at TP=1/2/4 and 70B at
              TP=2/4, data parallelism over every GPU (`benchmarks/suite/multigpu.py`)

Each stage writes `stage_NAME.json` and `logs/NAME.log` under OUT; stages can be run apart
(`--stages latency,peers`) into the same OUT, and every run rewrites `suite.json` (all stages
found in OUT) and `suite.md` (every row of the scoreboard, "not run" included). `--report` only
rewrites those two from the stage files already in OUT. `--docs` also rewrites the Today tables of
docs/benchmarks.md from OUT (`benchmarks/suite/today.py`): OUT must then be under docs/results/,
whose files the rows link to.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file (or loaded by path) as well as with `python -m`
    sys.path.insert(0, str(ROOT))

from benchmarks.suite.multigpu import multigpu_rows, stage_multigpu  # noqa: E402
from benchmarks.suite.rows import Row, dig, fmt, judge  # noqa: E402
from benchmarks.suite.serve import serve_rows, stage_serve  # noqa: E402
from benchmarks.suite.today import (  # noqa: E402
    Section,
    measured_from_env,
    record_measured,
    replace_today,
    today_block,
)

WORKLOADS = {
    "256": ROOT / "benchmarks" / "workloads" / "sharegpt_like_256.json",
    "1000": ROOT / "benchmarks" / "workloads" / "sharegpt_like_1000.json",
}
STAGES = (
    "env",
    "tests",
    "conformance",
    "engine",
    "attention",
    "variants",
    "latency",
    "throughput",
    "peers",
    "gemm",
    "fp8",
    "moe",
    "quantized",
    "serve",
    "multigpu",
)
PLATFORMS = ("cuda", "triton")
# Environment variables naming the on-disk caches of compiled kernels and graphs. A cold run gets
# all of them pointed at empty directories, which is what a fresh machine has.
CACHE_ENV = {
    "TRITON_CACHE_DIR": "triton",
    "PAGEDSERVE_CUDA_CACHE": "pagedserve-cuda",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "CUDA_CACHE_PATH": "cuda-driver",
    "PAGEDSERVE_CACHE_DIR": "pagedserve",
    "XDG_CACHE_HOME": "xdg",
}
# The latency stage measures the engine as configured by default (asynchronous scheduling, full
# and piecewise CUDA graphs, compiled forward), timing tokens by when the engine hands them out.
DEFAULT_MODE = "async"


@dataclass(slots=True)
class Suite:
    """Where one suite run writes, and how it starts processes."""

    out: Path
    peers: Path | None
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)

    def run(self, name: str, argv: list[str], timeout_s: float, cache: Path | None = None) -> dict[str, Any]:
        """Run `argv` from the repository root, its output to logs/NAME.log; never raises for
        the command's own failure: rc, seconds and the log's tail are the result."""
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1", "OUT": str(self.out / "raw")}
        (self.out / "raw").mkdir(exist_ok=True)
        env.update(cache_env(cache or self.out / "cache"))
        print(f"[gpu_suite] {name}: {' '.join(argv)}", flush=True)
        start = time.perf_counter()
        with log.open("w") as fh:
            try:
                rc = subprocess.run(
                    argv, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        seconds = time.perf_counter() - start
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print(f"[gpu_suite] {name}: rc {rc} in {seconds:.0f} s", flush=True)
        if rc != 0:
            print("\n".join("    " + line for line in tail), flush=True)
        return {"rc": rc, "seconds": round(seconds, 1), "log": str(log.relative_to(self.out)), "tail": tail}


def cache_env(root: Path) -> dict[str, str]:
    """The cache variables pointed at directories under `root` (created)."""
    env = {}
    for var, sub in CACHE_ENV.items():
        path = root / sub
        path.mkdir(parents=True, exist_ok=True)
        env[var] = str(path)
    return env


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


# ----------------------------------------------------------------------------------------------
# Stages: each returns what goes into stage_NAME.json.


def stage_env(suite: Suite, revision: str | None) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "host_cpus": os.cpu_count(),
    }
    for module in ("triton", "transformers"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        info["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    info["pagedserve_revision"] = revision or rev.stdout.strip() or None
    return info


def stage_tests(suite: Suite) -> dict[str, Any]:
    argv = [suite.python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    res = suite.run("tests", argv, timeout_s=900)
    res["summary"] = pytest_summary(res["tail"])
    return res


def stage_conformance(suite: Suite) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for plat in PLATFORMS:
        argv = [suite.python, "-m", "pagedserve.cli.main", "conformance", "--platform", plat]
        out[plat] = suite.run(f"conformance_{plat}", argv, timeout_s=600)
    return out


def stage_engine(suite: Suite) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for plat in PLATFORMS:
        argv = [suite.python, "benchmarks/gpu_engine_check.py", "--platform", plat]
        out[plat] = suite.run(f"engine_{plat}", argv, timeout_s=600)
    return out


def stage_attention(suite: Suite) -> dict[str, Any]:
    path = suite.out / "raw" / "attention_table.json"
    argv = [
        suite.python,
        "benchmarks/kernel_benchmarks/attention.py",
        "--table",
        "--flex-budget-s",
        "120",
        "--json",
        str(path),
    ]
    res = suite.run("attention", argv, timeout_s=900)
    res["table"] = read_json(path)
    return res


def stage_variants(suite: Suite) -> dict[str, Any]:
    path = suite.out / "raw" / "attention_variants.json"
    configs = suite.out / "variant_configs"
    configs.mkdir(parents=True, exist_ok=True)
    script = "benchmarks/kernel_benchmarks/attention.py"
    argv = [suite.python, script, "--variants", "--write-configs", str(configs)]
    res = suite.run("variants", [*argv, "--json", str(path)], timeout_s=900)
    res["result"] = read_json(path)
    return res


def stage_latency(suite: Suite) -> dict[str, Any]:
    path = suite.out / "raw" / "latency.json"
    argv = [suite.python, "benchmarks/gpu_async_scheduling.py", "--platform", "cuda", "--modes", DEFAULT_MODE]
    argv += ["--json", str(path)]
    res = suite.run("latency", argv, timeout_s=900)
    res["result"] = read_json(path)
    return res


def stage_throughput(suite: Suite, workloads: dict[str, Path]) -> dict[str, Any]:
    from benchmarks.gpu_latency import llama_8b_config

    model_dir = suite.out / "llama-3.1-8b-shapes"
    llama_8b_config().save_pretrained(model_dir)
    out: dict[str, Any] = {}
    for name, workload in workloads.items():
        # One cache directory per workload, empty before its first run: cold, then warm.
        cache = suite.out / f"cache-throughput-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        for kind in ("cold", "warm"):
            path = suite.out / "raw" / f"throughput_{name}_{kind}.json"
            argv = [suite.python, "-m", "pagedserve.cli.main", "bench", "throughput"]
            argv += ["--model", str(model_dir), "--load-format", "dummy", "--dtype", "bfloat16"]
            argv += ["--skip-tokenizer-init", "--max-model-len", "4096", "--platform", "cuda"]
            argv += ["--max-num-seqs", "256", "--warmup-requests", "16", "--workload", str(workload)]
            argv += ["--json", str(path)]
            res = suite.run(f"throughput_{name}_{kind}", argv, timeout_s=900, cache=cache)
            res["result"] = read_json(path)
            out[f"{name}_{kind}"] = res
    return out


def stage_peers(suite: Suite) -> dict[str, Any]:
    if suite.peers is None:
        return {"skipped": "no --peers directory given"}
    out: dict[str, Any] = {}
    script = suite.peers / "peer_compiled_latency.py"
    res = suite.run("peer_compiled_latency", [suite.python, str(script)], timeout_s=600)
    res["result"] = read_json(suite.out / "raw" / "peer_compiled.json")
    out["compiled_latency"] = res
    path = suite.out / "raw" / "hf_throughput_256.json"
    argv = [suite.python, str(suite.peers / "hf_throughput.py"), "--methods", "cb", "--cb-timeout-s", "150"]
    argv += ["--load-workload", str(WORKLOADS["256"]), "--json", str(path)]
    res = suite.run("peer_hf_throughput", argv, timeout_s=600)
    res["result"] = read_json(path)
    out["hf_throughput_256"] = res
    return out


def stage_gemm(suite: Suite) -> dict[str, Any]:
    path = suite.out / "raw" / "skinny_gemm.json"
    res = suite.run(
        "gemm",
        [suite.python, "benchmarks/kernel_benchmarks/skinny_gemm.py", "--fp8", "--json", str(path)],
        timeout_s=600,
    )
    res["result"] = read_json(path)
    launches = suite.out / "raw" / "programmatic_launch.json"
    argv = [suite.python, "benchmarks/kernel_benchmarks/programmatic_launch.py", "--json", str(launches)]
    res["programmatic_launch"] = suite.run("gemm_programmatic_launch", argv, timeout_s=600)
    res["programmatic_launch"]["result"] = read_json(launches)
    return res


def stage_fp8(suite: Suite) -> dict[str, Any]:
    path = suite.out / "raw" / "fp8.json"
    argv = [suite.python, "benchmarks/gpu_fp8.py", "--platform", "cuda", "--variants", "bf16,w_fp8+kv_fp8"]
    argv += ["--workload", str(WORKLOADS["256"]), "--json", str(path)]
    res = suite.run("fp8", argv, timeout_s=1200)
    res["result"] = read_json(path)
    return res


def stage_moe(suite: Suite) -> dict[str, Any]:
    raw = suite.out / "raw"
    common = ["--modes", "full_and_piecewise", "--prompt-len", "512", "--output-len", "128"]
    latency = [suite.python, "benchmarks/gpu_latency.py"]
    qwen = [*latency, "--platform", "cuda", "--shape", "qwen3-30b-a3b", *common]
    qwen += ["--what", "stream,profile,throughput", "--workload", str(WORKLOADS["1000"])]
    qwen += ["--num-kv-blocks", "6000", "--json", str(raw / "moe_qwen3_30b_a3b.json")]
    # Its own empty caches: the start-up row is a fresh machine's.
    res = suite.run("moe_qwen3", qwen, timeout_s=900, cache=suite.out / "cache_moe_cold")
    res["qwen3_30b_a3b"] = read_json(raw / "moe_qwen3_30b_a3b.json")
    # gpt-oss needs attention sinks, which the triton platform's backend has.
    oss = [*latency, "--platform", "triton", "--shape", "gpt-oss-20b", *common]
    oss += ["--what", "stream", "--json", str(raw / "moe_gpt_oss_20b.json")]
    res["gpt_oss_20b_run"] = suite.run("moe_gpt_oss", oss, timeout_s=900)
    res["gpt_oss_20b"] = read_json(raw / "moe_gpt_oss_20b.json")
    op = [suite.python, "benchmarks/kernel_benchmarks/moe_op.py", "--models", "qwen3_30b_a3b,gpt_oss_20b"]
    op += ["--tokens", "1,4,16,64,512,4096", "--check", "--json", str(raw / "moe_op.json")]
    res["op_run"] = suite.run("moe_op", op, timeout_s=600)
    res["op"] = read_json(raw / "moe_op.json")
    return res


def stage_quantized(suite: Suite) -> dict[str, Any]:
    path = suite.out / "raw" / "quantized.json"
    argv = [suite.python, "benchmarks/gpu_quantized.py", "--platform", "cuda", "--load-twice"]
    argv += ["--variants", "bf16,gptq_w4a16,ct_fp8,fp8_load_time", "--workload", str(WORKLOADS["1000"])]
    res = suite.run("quantized", [*argv, "--json", str(path)], timeout_s=2400)
    res["result"] = read_json(path)
    return res


def pytest_summary(tail: list[str]) -> str | None:
    """pytest's closing line ("12 passed, 1 skipped in 30.1s"), if the tail has one. Pure."""
    for line in reversed(tail):
        if re.search(r"\b\d+ (passed|failed|error|skipped)", line):
            return line.strip("= ").strip()
    return None


# ----------------------------------------------------------------------------------------------
# The scoreboard: one row per number docs/benchmarks.md quotes, with its peer and its target.


def throughput_rows(stages: dict[str, Any]) -> list[Row]:
    thr = stages.get("throughput") or {}
    hf = dig(stages, "peers", "hf_throughput_256", "result")
    hf_tok = dig(hf, "results", "cb", "output_tok_per_s") or dig(hf, "cb", "output_tok_per_s")
    peer_256 = f"HF transformers continuous batching {fmt(hf_tok)} tok/s" if hf_tok else "HF peer not run"
    goals = {"256": (7000.0, 6300.0), "1000": (8000.0, None)}
    rows = []
    for name, (warm_goal, cold_goal) in goals.items():
        warm = dig(thr, f"{name}_warm", "result", "result", "output_tokens_per_s")
        cold = dig(thr, f"{name}_cold", "result", "result", "output_tokens_per_s")
        warm_rps = dig(thr, f"{name}_warm", "result", "result", "requests_per_s")
        peer = peer_256 if name == "256" else "vLLM publishes ~37 req/s (Llama-3-8B, ShareGPT, one H100)"
        target = f">= {warm_goal:,.0f} tok/s"
        label = f"offline throughput, {name} requests, warm"
        rows.append(Row(label, fmt(warm, ",.0f", " tok/s"), peer, target, judge(warm, ">=", warm_goal)))
        if name == "1000":  # its target names the request rate too
            rps = fmt(warm_rps, ".1f", " req/s")
            rows.append(Row(f"{label}, requests/s", rps, "", ">= 40 req/s", judge(warm_rps, ">=", 40.0)))
        ratio = None if cold is None or not warm else cold / warm
        cold_target = "within 10% of warm" + (f" and >= {cold_goal:,.0f} tok/s" if cold_goal else "")
        cold_verdict = judge(ratio, ">=", 0.9)
        if cold_goal and cold_verdict == "met":
            cold_verdict = judge(cold, ">=", cold_goal)
        rows.append(
            Row(
                f"offline throughput, {name} requests, empty kernel caches",
                fmt(cold, ",.0f", " tok/s"),
                "" if warm is None else f"warm caches, same command: {fmt(warm)} tok/s",
                cold_target,
                cold_verdict,
            )
        )
    return rows + startup_rows(thr)


def startup_rows(thr: dict[str, Any]) -> list[Row]:
    """Engine start-up of the first workload's runs, cold (empty caches) and warm: the total, then
    its compile and graph-capture phases, one number a row. Pure."""
    rows = []
    for kind in ("cold", "warm"):
        startup = next((dig(thr, key, "result", "startup") for key in thr if key.endswith(f"_{kind}")), None)
        total = fmt(dig(startup, "total_s"), ".1f", " s")
        rows.append(Row(f"engine start-up, {kind} caches (8B shapes)", total, "", "", "n/a"))
        for key, label in (("compile_s", "compile"), ("capture_s", "graph capture")):
            value = fmt(dig(startup, key), ".1f", " s")
            rows.append(Row(f"engine start-up, {kind} caches: {label}", value, "", "", "n/a"))
    return rows


def latency_rows(stages: dict[str, Any]) -> list[Row]:
    lat = dig(stages, "latency", "result", DEFAULT_MODE)
    peer = dig(stages, "peers", "compiled_latency", "result")
    peer_tpot = min(peer["tpot_ms"]) if peer and peer.get("tpot_ms") else None
    peer_ttft = min(peer["ttft_ms"]) if peer and peer.get("ttft_ms") else None
    tpot = dig(lat, "single_stream", "tpot_median_ms")
    ttft = dig(lat, "single_stream", "ttft_ms")
    compiled = "HF + static cache + torch.compile"
    idle1 = dig(lat, "decode_b1", "idle_fraction")
    idle256 = dig(lat, "decode_batch", "idle_fraction")
    step256 = dig(lat, "decode_batch", "step_mean_ms")
    floor = None if tpot is None else 1024 * tpot / 1e3
    return [
        Row(
            "single stream 512 -> 128, TPOT",
            fmt(tpot, ".2f", " ms"),
            f"{compiled} {fmt(peer_tpot, '.2f', ' ms')}",
            "<= 6.0 ms",
            judge(tpot, "<=", 6.0),
        ),
        Row(
            "single stream 512 -> 128, TTFT",
            fmt(ttft, ".1f", " ms"),
            f"{compiled} {fmt(peer_ttft, '.1f', ' ms')}",
            "<= 15 ms",
            judge(ttft, "<=", 15.0),
        ),
        Row("GPU idle, 1 running request", fmt(idle1, ".0%"), "", "< 5%", judge(idle1, "<", 0.05)),
        Row("GPU idle, 256 running requests", fmt(idle256, ".0%"), "", "< 5%", judge(idle256, "<", 0.05)),
        Row(
            "decode step, 256 running requests",
            fmt(step256, ".1f", " ms"),
            "",
            "<= 12 ms",
            judge(step256, "<=", 12.0),
        ),
        Row("floor of a 1,024-step request (1,024 x TPOT)", fmt(floor, ".2f", " s"), "", "", "n/a"),
    ]


def attention_rows(stages: dict[str, Any]) -> list[Row]:
    results = dig(stages, "attention", "table", "results") or []
    rows = []
    for res in results:
        if res.get("q_heads") != 32 or not res.get("target"):
            continue
        ours = res.get("ours") or {}
        kind = res.get("kind")
        value = ours.get("tflops") if kind in ("prefill", "chunked") else ours.get("us")
        shown = fmt(value, ".0f", " TFLOP/s") if kind in ("prefill", "chunked") else fmt(value, ".1f", " us")
        cudnn = dig(res, "baselines", "cudnn", "us")
        verdict = {True: "met", False: "missed", None: "not run"}[res.get("target_met")]
        rows.append(
            Row(
                f"attention {res['case']} (32q/8kv)",
                shown,
                f"cuDNN SDPA {fmt(cudnn, '.1f', ' us')}",
                res["target"],
                verdict,
            )
        )
    return rows


def _exit_row(benchmark: str, rc: int | None, passed: str, target: str) -> Row:
    """A pass/fail row from a stage's exit status (None: the stage did not run). Pure."""
    if rc is None:
        return Row(benchmark, "not run", "", target, "not run")
    return Row(
        benchmark, passed if rc == 0 else f"failed (exit {rc})", "", target, "met" if rc == 0 else "missed"
    )


def conformance_rows(stages: dict[str, Any]) -> list[Row]:
    rows = []
    for plat in PLATFORMS:
        rc = dig(stages, "conformance", plat, "rc")
        rows.append(_exit_row(f"conformance of {plat} against cpu_reference", rc, "all pass", "all pass"))
    return rows


def engine_rows(stages: dict[str, Any]) -> list[Row]:
    rows = []
    for plat in PLATFORMS:
        rc = dig(stages, "engine", plat, "rc")
        rows.append(_exit_row(f"greedy tokens on {plat} equal cpu_reference's", rc, "equal", "equal"))
    return rows


def tests_rows(stages: dict[str, Any]) -> list[Row]:
    passed = re.search(r"\b(\d+) passed", dig(stages, "tests", "summary") or "")
    shown = f"{int(passed.group(1)):,} passed" if passed else "all pass"
    return [_exit_row("GPU tests (pytest -m gpu)", dig(stages, "tests", "rc"), shown, "all pass")]


def variant_rows(stages: dict[str, Any]) -> list[Row]:
    """The best prefill kernel variant of the sweep, per prefill case, against the targets."""
    result = dig(stages, "variants", "result") or {}
    winner, flops = result.get("winner") or {}, result.get("flops") or {}
    targets = {"prefill 4x2048": 450.0, "chunked q1024 ctx7168": 400.0}
    rows = []
    for case, goal in targets.items():
        us = dig(winner, "us", case)
        tflops = None if us is None or case not in flops else flops[case] / us / 1e6
        label = winner.get("variant", "")
        rows.append(
            Row(
                f"attention {case}, best kernel variant ({label or 'none'})",
                fmt(tflops, ".0f", " TFLOP/s"),
                "",
                f">= {goal:.0f} TFLOP/s",
                judge(tflops, ">=", goal),
            )
        )
    return rows


def gemm_rows(stages: dict[str, Any]) -> list[Row]:
    per_step = dig(stages, "gemm", "result", "per_step_us", "1") or {}
    ours, cublas = per_step.get("skinny_us"), per_step.get("torch_us")
    ours_fp8, scaled = per_step.get("skinny_fp8_us"), per_step.get("torch_fp8_us")
    return [
        Row(
            "GEMMs of a one-row decode step, bf16 weights (32 layers + LM head)",
            fmt(ours, ",.0f", " us"),
            f"cuBLAS {fmt(cublas, ',.0f', ' us')}",
            "faster than cuBLAS",
            judge(ours, "<", cublas) if cublas is not None else "not run",
        ),
        Row(
            "GEMMs of a one-row decode step, FP8 weights",
            fmt(ours_fp8, ",.0f", " us"),
            f"torch._scaled_mm {fmt(scaled, ',.0f', ' us')}",
            "",
            "n/a",
        ),
    ]


def fp8_rows(stages: dict[str, Any]) -> list[Row]:
    bf16 = dig(stages, "fp8", "result", "bf16") or {}
    fp8 = dig(stages, "fp8", "result", "w_fp8+kv_fp8") or {}
    tpot = dig(fp8, "single_stream", "tpot_median_ms")
    tput, base = dig(fp8, "throughput", "output_tokens_per_s"), dig(bf16, "throughput", "output_tokens_per_s")
    ratio = None if tput is None or not base else tput / base
    kv, kv_base = fp8.get("kv_tokens"), bf16.get("kv_tokens")
    return [
        Row(
            "FP8 weights + KV: single stream TPOT",
            fmt(tpot, ".2f", " ms"),
            "",
            "<= 3.6 ms",
            judge(tpot, "<=", 3.6),
        ),
        Row(
            "FP8 weights + KV: throughput, 256 requests",
            fmt(ratio, ".2f", "x bf16"),
            f"bf16 {fmt(base, ',.0f', ' tok/s')}",
            ">= 1.3x",
            judge(ratio, ">=", 1.3),
        ),
        Row(
            "FP8 weights + KV: KV tokens at 0.9 of GPU memory",
            fmt(kv, ",d"),
            f"bf16 {fmt(kv_base, ',d')}",
            "",
            "n/a",
        ),
    ]


def moe_rows(stages: dict[str, Any]) -> list[Row]:
    qwen = dig(stages, "moe", "qwen3_30b_a3b", "full_and_piecewise") or {}
    oss = dig(stages, "moe", "gpt_oss_20b", "full_and_piecewise") or {}
    points = dig(stages, "moe", "op", "points") or []
    qwen_op = {p["tokens"]: p for p in points if p.get("model") == "qwen3_30b_a3b"}
    start, tpot = qwen.get("build_s"), dig(qwen, "streamed_single_stream", "tpot_median_ms")
    tput = dig(qwen, "throughput", "output_tokens_per_s")
    oss_tpot = dig(oss, "streamed_single_stream", "tpot_median_ms")
    bound = dig(qwen_op, 1, "vs_bound")
    speedup = dig(qwen_op, 4096, "speedup")
    return [
        Row("Qwen3-30B-A3B shape: start-up on empty caches", fmt(start, ".1f", " s"), "", "<= 60 s",
            judge(start, "<=", 60.0)),
        Row("Qwen3-30B-A3B shape: single stream TPOT", fmt(tpot, ".2f", " ms"), "", "<= 3.0 ms",
            judge(tpot, "<=", 3.0)),
        Row("Qwen3-30B-A3B shape: 1,000 requests", fmt(tput, ",.0f", " tok/s"), "", ">= 8,000 tok/s",
            judge(tput, ">=", 8000.0)),
        Row("gpt-oss-20b shape (triton): single stream TPOT", fmt(oss_tpot, ".2f", " ms"), "", "<= 3.0 ms",
            judge(oss_tpot, "<=", 3.0)),
        Row("MoE op, Qwen3-30B-A3B experts, 1 token: time over the experts' bytes", fmt(bound, ".2f", "x"),
            "", "<= 1.25x", judge(bound, "<=", 1.25)),
        Row("MoE op, Qwen3-30B-A3B experts, 4,096 tokens", fmt(speedup, ".2f", "x torch._grouped_mm"),
            f"torch._grouped_mm {fmt(dig(qwen_op, 4096, 'grouped_mm_us'), '.0f', ' us')}", ">= 1.0x",
            judge(speedup, ">=", 1.0)),
    ]  # fmt: skip


def quantized_rows(stages: dict[str, Any]) -> list[Row]:
    variants = dig(stages, "quantized", "result", "variants") or {}

    def tpot(name: str) -> float | None:
        return dig(variants, name, "single_stream", "tpot_median_ms")

    def tput(name: str) -> float | None:
        return dig(variants, name, "throughput", "output_tokens_per_s")

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    w4, base = ratio(tput("gptq_w4a16"), tput("bf16")), tput("bf16")
    fp8 = ratio(tput("ct_fp8"), tput("fp8_load_time"))
    load = dig(variants, "bf16", "load_s")
    return [
        Row("GPTQ W4A16 8B: single stream TPOT", fmt(tpot("gptq_w4a16"), ".2f", " ms"),
            f"bf16 {fmt(tpot('bf16'), '.2f', ' ms')}", "<= 2.6 ms", judge(tpot("gptq_w4a16"), "<=", 2.6)),
        Row("GPTQ W4A16 8B: 1,000 requests", fmt(w4, ".2f", "x bf16"), f"bf16 {fmt(base, ',.0f', ' tok/s')}",
            ">= 1.0x", judge(w4, ">=", 1.0)),
        Row("FP8 checkpoint 8B: 1,000 requests", fmt(fp8, ".2f", "x load-time FP8"),
            f"load-time FP8 {fmt(tput('fp8_load_time'), ',.0f', ' tok/s')}", "", "n/a"),
        Row("bf16 8B checkpoint (16 GB): load, pages evicted first", fmt(load, ".1f", " s"), "", "<= 10 s",
            judge(load, "<=", 10.0)),
    ]  # fmt: skip


# Each stage's rows, in the scoreboard's order; peers measured by another stage are named.
SECTIONS: tuple[tuple[str, Callable[[dict[str, Any]], list[Row]], str | None], ...] = (
    ("throughput", throughput_rows, "peers"),
    ("latency", latency_rows, "peers"),
    ("attention", attention_rows, None),
    ("variants", variant_rows, None),
    ("gemm", gemm_rows, None),
    ("fp8", fp8_rows, None),
    ("moe", moe_rows, None),
    ("quantized", quantized_rows, None),
    ("serve", serve_rows, None),
    ("multigpu", multigpu_rows, None),
    ("conformance", conformance_rows, None),
    ("engine", engine_rows, None),
    ("tests", tests_rows, None),
)


def scoreboard_sections(stages: dict[str, Any]) -> list[Section]:
    """The scoreboard's rows by the stage whose file holds their numbers. Pure."""
    return [Section(stage, tuple(rows(stages)), peers) for stage, rows, peers in SECTIONS]


def scoreboard(stages: dict[str, Any]) -> list[Row]:
    return [row for section in scoreboard_sections(stages) for row in section.rows]


def markdown(stages: dict[str, Any]) -> str:
    env = stages.get("env") or {}
    head = (
        f"{env.get('gpu', 'GPU not recorded')}, {env.get('date', '')}: torch {env.get('torch')}, "
        f"triton {env.get('triton')}, transformers {env.get('transformers')}, "
        f"pagedserve {env.get('pagedserve_revision')}"
    )
    lines = [
        head,
        "",
        "| benchmark | pagedserve | peer (same run) | target | verdict |",
        "|---|---|---|---|---|",
    ]
    for row in scoreboard(stages):
        verdict = f"**{row.verdict}**" if row.verdict == "missed" else row.verdict
        lines.append(f"| {row.benchmark} | {row.ours} | {row.peer} | {row.target} | {verdict} |")
    return "\n".join(lines) + "\n"


def write_docs(doc: Path, out: Path, stages: dict[str, Any]) -> None:
    """Replace the Today tables of `doc` (docs/benchmarks.md) with the rows measured in `out`, each
    linked to its stage file there (`suite/today.py`)."""
    block = today_block(scoreboard_sections(stages), sorted(stages), out, doc)
    doc.write_text(replace_today(doc.read_text(), block))


def write_report(out: Path) -> dict[str, Any]:
    """suite.json and suite.md from every stage_*.json in `out`."""
    stages = {p.stem.removeprefix("stage_"): read_json(p) for p in sorted(out.glob("stage_*.json"))}
    (out / "suite.json").write_text(json.dumps(stages, indent=2) + "\n")
    (out / "suite.md").write_text(markdown(stages))
    return stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for the results (created)")
    parser.add_argument(
        "--peers", type=Path, help="directory holding hf_throughput.py and peer_compiled_latency.py"
    )
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    parser.add_argument("--workloads", default="256,1000", help="of 256, 1000, or paths to workload files")
    parser.add_argument("--report", action="store_true", help="only rewrite suite.json and suite.md")
    parser.add_argument(
        "--docs",
        type=Path,
        nargs="?",
        const=ROOT / "docs" / "benchmarks.md",
        help="also replace the Today tables of this file (default docs/benchmarks.md) with the rows "
        "measured in --out, which must be inside its folder (docs/results/...)",
    )
    parser.add_argument(
        "--revision", help="the pagedserve revision to record (default: `git rev-parse` of the checkout)"
    )
    args = parser.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    workloads = {w: WORKLOADS[w] if w in WORKLOADS else Path(w) for w in args.workloads.split(",") if w}
    missing = [str(p) for p in workloads.values() if not p.is_file()]
    if missing:
        parser.error(f"workload files not found: {missing}")
    if args.peers is not None and not (args.peers / "hf_throughput.py").is_file():
        parser.error(f"--peers {args.peers} has no hf_throughput.py")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        suite = Suite(out=args.out.resolve(), peers=None if args.peers is None else args.peers.resolve())
        runners: dict[str, Callable[[], dict[str, Any]]] = {
            "env": lambda: stage_env(suite, args.revision),
            "tests": lambda: stage_tests(suite),
            "conformance": lambda: stage_conformance(suite),
            "engine": lambda: stage_engine(suite),
            "attention": lambda: stage_attention(suite),
            "variants": lambda: stage_variants(suite),
            "latency": lambda: stage_latency(suite),
            "throughput": lambda: stage_throughput(suite, workloads),
            "peers": lambda: stage_peers(suite),
            "gemm": lambda: stage_gemm(suite),
            "fp8": lambda: stage_fp8(suite),
            "moe": lambda: stage_moe(suite),
            "quantized": lambda: stage_quantized(suite),
            "serve": lambda: stage_serve(suite),
            "multigpu": lambda: stage_multigpu(suite),
        }
        # The environment is recorded with every run: stages run apart may meet different hosts,
        # so each stage's machine and revision are kept beside its results.
        here = None
        for name in ["env", *(s for s in stages if s != "env")]:
            result = runners[name]()
            (args.out / f"stage_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
            here = measured_from_env(result) if name == "env" else here
            if here is not None:
                record_measured(args.out, name, here)
    stages_found = write_report(args.out)
    if args.docs is not None:
        write_docs(args.docs, args.out, stages_found)
    print((args.out / "suite.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
