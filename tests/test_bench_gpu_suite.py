"""`benchmarks/gpu_suite.py` without a GPU: the scoreboard judges every target from the stage
results, stage files written apart make one report, and a stage's failure or time-out is a result,
not a crash."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from bench_support import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


suite = load_benchmark("gpu_suite")
today = importlib.import_module(
    "benchmarks.suite.today"
)  # importable once gpu_suite put the root on the path


def _throughput(tok_s: float, req_s: float) -> dict[str, Any]:
    startup = {"total_s": 40.0, "compile_s": 20.0, "attention_kernels_s": 5.0, "capture_s": 9.0}
    result = {"output_tokens_per_s": tok_s, "requests_per_s": req_s}
    return {"rc": 0, "result": {"result": result, "startup": startup}}


def _stages() -> dict[str, Any]:
    return {
        "env": {"gpu": "Test GPU", "date": "2026-01-01", "torch": "2.11", "triton": "3.6"},
        "throughput": {
            "256_cold": _throughput(6500.0, 30.0),
            "256_warm": _throughput(7100.0, 33.0),
            "1000_cold": _throughput(5000.0, 25.0),
            "1000_warm": _throughput(8100.0, 39.0),
        },
        "latency": {
            "result": {
                "async": {
                    "single_stream": {"tpot_median_ms": 5.9, "ttft_ms": 16.0},
                    "decode_b1": {"idle_fraction": 0.04},
                    "decode_batch": {"idle_fraction": 0.2, "step_mean_ms": 11.0},
                }
            }
        },
        "peers": {
            "compiled_latency": {"result": {"tpot_ms": [7.9, 7.86], "ttft_ms": [24.0, 23.0]}},
            "hf_throughput_256": {"result": {"results": {"cb": {"output_tok_per_s": 450.3}}}},
        },
        "engine": {"cuda": {"rc": 0}, "triton": {"rc": 1}},
        "tests": {"rc": 0, "summary": "20 passed, 2 skipped in 30.0s"},
        "attention": {
            "table": {
                "results": [
                    {
                        "case": "prefill 4x2048",
                        "kind": "prefill",
                        "q_heads": 32,
                        "ours": {"us": 300.0, "tflops": 458.0},
                        "baselines": {"cudnn": {"us": 270.0}},
                        "target": ">= 450 TFLOP/s and <= flex",
                        "target_met": True,
                    },
                    {"case": "decode b1 ctx8192", "kind": "decode", "q_heads": 64, "target": None},
                ]
            }
        },
        "gemm": {  # JSON keys: row counts as strings
            "result": {"per_step_us": {"1": {"torch_us": 5600.0, "skinny_us": 5300.0, "torch_fp8_us": 6300.0,
                                             "skinny_fp8_us": 3300.0}}}
        },
        "variants": {
            "result": {
                "winner": {
                    "variant": "prefetch",
                    "us": {"prefill 4x2048": 300.0, "chunked q1024 ctx7168": 400.0},
                },
                "flops": {"prefill 4x2048": 137_438_953_472, "chunked q1024 ctx7168": 128_849_018_880},
            }
        },
        "fp8": {
            "result": {
                "bf16": {"kv_tokens": 430000, "throughput": {"output_tokens_per_s": 5400.0}},
                "w_fp8+kv_fp8": {
                    "kv_tokens": 970000,
                    "single_stream": {"tpot_median_ms": 4.2},
                    "throughput": {"output_tokens_per_s": 7300.0},
                },
            }
        },
    }  # fmt: skip


def _verdicts() -> dict[str, str]:
    return {row.benchmark: row.verdict for row in suite.scoreboard(_stages())}


def test_throughput_targets_warm_cold_and_requests_per_second() -> None:
    verdicts = _verdicts()
    assert verdicts["offline throughput, 256 requests, warm"] == "met"
    # 6500 / 7100 = 91.5% of warm and >= 6300: both halves of the cold target hold.
    assert verdicts["offline throughput, 256 requests, empty kernel caches"] == "met"
    # 8100 tok/s but 39 req/s: the request rate, a row of its own, misses.
    assert verdicts["offline throughput, 1000 requests, warm"] == "met"
    assert verdicts["offline throughput, 1000 requests, warm, requests/s"] == "missed"
    assert verdicts["offline throughput, 1000 requests, empty kernel caches"] == "missed"  # 62% of warm


def test_latency_idle_and_step_targets() -> None:
    verdicts = _verdicts()
    assert verdicts["single stream 512 -> 128, TPOT"] == "met"
    assert verdicts["single stream 512 -> 128, TTFT"] == "missed"
    assert verdicts["GPU idle, 1 running request"] == "met"
    assert verdicts["GPU idle, 256 running requests"] == "missed"
    assert verdicts["decode step, 256 running requests"] == "met"


def test_checks_and_attention_rows() -> None:
    verdicts = _verdicts()
    assert verdicts["greedy tokens on cuda equal cpu_reference's"] == "met"
    assert verdicts["greedy tokens on triton equal cpu_reference's"] == "missed"
    assert verdicts["GPU tests (pytest -m gpu)"] == "met"
    assert verdicts["attention prefill 4x2048 (32q/8kv)"] == "met"
    assert not any("64q" in name or "decode b1" in name for name in verdicts)  # no goal, no row


def test_gemm_and_fp8_rows() -> None:
    rows = {row.benchmark: row for row in suite.scoreboard(_stages())}
    gemm = rows["GEMMs of a one-row decode step, bf16 weights (32 layers + LM head)"]
    assert (gemm.ours, gemm.verdict) == ("5,300 us", "met") and "5,600" in gemm.peer
    assert rows["FP8 weights + KV: single stream TPOT"].verdict == "missed"  # 4.2 > 3.6 ms
    tput = rows["FP8 weights + KV: throughput, 256 requests"]
    assert (tput.ours, tput.verdict) == ("1.35x bf16", "met")  # 7300 / 5400
    assert rows["FP8 weights + KV: KV tokens at 0.9 of GPU memory"].ours == "970,000"


def test_variant_rows_turn_the_sweep_winner_into_tflops() -> None:
    rows = {row.benchmark: row for row in suite.scoreboard(_stages())}
    prefill = rows["attention prefill 4x2048, best kernel variant (prefetch)"]
    assert (prefill.ours, prefill.verdict) == ("458 TFLOP/s", "met")  # 137.4 GFLOP in 300 us
    assert rows["attention chunked q1024 ctx7168, best kernel variant (prefetch)"].verdict == "missed"  # 322


def test_peers_appear_beside_ours() -> None:
    rows = {row.benchmark: row for row in suite.scoreboard(_stages())}
    assert "7.86 ms" in rows["single stream 512 -> 128, TPOT"].peer
    assert "450 tok/s" in rows["offline throughput, 256 requests, warm"].peer


def test_missing_stages_are_not_run_never_met() -> None:
    rows = suite.scoreboard({})
    assert rows, "every row is shown even when nothing ran"
    assert {row.verdict for row in rows} <= {"not run", "n/a"}


def test_report_joins_stage_files_written_apart(tmp_path: Path) -> None:
    for name, data in _stages().items():
        (tmp_path / f"stage_{name}.json").write_text(json.dumps(data))
    assert suite.main(["--out", str(tmp_path), "--report"]) == 0
    md = (tmp_path / "suite.md").read_text()
    assert md.startswith("Test GPU, 2026-01-01")
    assert "| offline throughput, 256 requests, warm | 7,100 tok/s |" in md
    assert "**missed**" in md
    assert set(json.loads((tmp_path / "suite.json").read_text())) == set(_stages())


def test_bad_arguments_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        suite.main(["--out", str(tmp_path), "--stages", "latency,speed"])
    assert "unknown stages ['speed']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        suite.main(["--out", str(tmp_path), "--peers", str(tmp_path)])
    assert "has no hf_throughput.py" in capsys.readouterr().err


def test_a_stage_that_fails_or_hangs_is_a_result(tmp_path: Path) -> None:
    runner = suite.Suite(out=tmp_path, peers=None)
    failed = runner.run("fails", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], timeout_s=60)
    assert failed["rc"] == 3 and failed["tail"] == ["boom"]
    hung = runner.run("hangs", [sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    assert hung["rc"] == 124
    assert (tmp_path / "logs" / "hangs.log").is_file()


def test_cold_runs_get_their_own_empty_caches(tmp_path: Path) -> None:
    env = suite.cache_env(tmp_path / "cold")
    assert set(env) == set(suite.CACHE_ENV)
    assert all(Path(p).is_dir() and not any(Path(p).iterdir()) for p in env.values())


def test_pytest_summary() -> None:
    assert (
        suite.pytest_summary(["x", "==== 3 passed, 1 skipped in 2.0s ===="]) == "3 passed, 1 skipped in 2.0s"
    )
    assert suite.pytest_summary(["no summary here"]) is None


def test_startup_rows_show_the_phases() -> None:
    rows = {row.benchmark: row.ours for row in suite.scoreboard(_stages())}
    assert rows["engine start-up, cold caches (8B shapes)"] == "40.0 s"
    assert rows["engine start-up, cold caches: compile"] == "20.0 s"
    assert rows["engine start-up, cold caches: graph capture"] == "9.0 s"


def _tp_run(tpot_ms: float, tok_s: float | None, all_reduce_ms: float | None = None) -> dict[str, Any]:
    run: dict[str, Any] = {"single_stream": {"tpot_median_ms": tpot_ms}}
    if tok_s is not None:
        run["throughput"] = {"output_tokens_per_s": tok_s}
    if all_reduce_ms is not None:
        run["collectives"] = {"all_reduce_ms_per_step": all_reduce_ms}
    return {"rc": 0, "result": {"runs": [run]}}


def test_multigpu_rows_judge_each_size_against_tp1_of_the_same_run() -> None:
    stages = {
        "multigpu": {
            "gpus": 2,
            "tp_8b_1": _tp_run(4.7, 12000.0),
            "tp_8b_2": _tp_run(3.0, 20000.0),
            "tp_70b_2": _tp_run(21.0, None, all_reduce_ms=1.5),
            "dp": {"rc": 0, "size": 2, "result": {"result": {"output_tokens_per_s": 23500.0}}},
            # DP is judged against one engine by the same command, not against tp_8b_1
            "dp_one_engine": {"rc": 0, "size": 1, "result": {"result": {"output_tokens_per_s": 12000.0}}},
        }
    }
    rows = {r.benchmark: r for r in suite.scoreboard(stages)}
    assert rows["8B TP=2 single-stream TPOT"].verdict == "met"  # 3.0 / 4.7 = 0.64 <= 0.68
    assert rows["8B TP=2 output tok/s, 1,000 requests"].verdict == "met"  # 1.67x >= 1.5x
    assert rows["70B TP=2 all-reduce per decode step, 64 requests"].verdict == "missed"  # 1.5 > 1.2
    assert rows["8B DP=2 output tok/s, 1,000 requests"].verdict == "met"  # 1.96x >= 1.9x
    assert rows["8B DP=2 output tok/s, 1,000 requests"].peer == "one engine 12,000"
    stages["multigpu"]["dp"]["result"]["result"]["output_tokens_per_s"] = 21000.0  # 1.75x
    rows = {r.benchmark: r for r in suite.scoreboard(stages)}
    assert rows["8B DP=2 output tok/s, 1,000 requests"].verdict == "missed"
    assert not any("through `serve`" in name for name in rows)  # no data-parallel server run: no row


def test_multigpu_rows_judge_data_parallel_serving_against_a_one_engine_server() -> None:
    def served(tok_s: float, size: int) -> dict[str, object]:
        return {"rc": 0, "size": size, "result": {"bench": {"output_throughput": tok_s}}}

    stages = {
        "multigpu": {"gpus": 2, "dp_serve": served(22000.0, 2), "dp_serve_one_engine": served(11000.0, 1)}
    }
    row = {r.benchmark: r for r in suite.scoreboard(stages)}[
        "8B DP=2 through `serve`, output tok/s, 1,000 requests"
    ]
    assert row.verdict == "met" and row.peer == "one-engine server 11,000"  # 2.0x >= 1.9x
    stages["multigpu"]["dp_serve"] = served(18000.0, 2)  # 1.64x
    row = {r.benchmark: r for r in suite.scoreboard(stages)}[
        "8B DP=2 through `serve`, output tok/s, 1,000 requests"
    ]
    assert row.verdict == "missed"


def _load_summary(tok_s: float, itl_p99: float, tpot_p99: float, ttft: tuple[float, float]) -> dict[str, Any]:
    return {
        "summary": {
            "output_throughput": tok_s,
            "itl_ms": {"p99": itl_p99},
            "tpot_ms": {"p99": tpot_p99},
            "ttft_ms": {"p50": ttft[0], "p99": ttft[1]},
        }
    }


def test_serve_rows_judge_the_server_against_the_offline_engine_of_the_same_run() -> None:
    loads = {
        "first_48": _load_summary(0, 0, 0, (12.0, 20.0)),
        "at_once": _load_summary(9800.0, 80.0, 25.0, (5000.0, 9000.0)),
        "rate_20": _load_summary(0, 0, 0, (27.0, 70.0)),
    }
    stages = {
        "serve": {
            "cold": {"rc": 0, "result": {"ready_s": 58.0, "loads": loads}},
            "warm": {"rc": 0, "result": {"ready_s": 21.0, "loads": {}}},
            "offline_fcfs": {"rc": 0, "result": {"result": {"output_tokens_per_s": 10000.0}}},
        }
    }
    rows = {r.benchmark: r for r in suite.scoreboard(stages)}
    assert rows["serve ready, cold caches"].verdict == "met"
    assert rows["serve ready, warm caches"].verdict == "missed"  # 21 > 20 s
    at_once = rows["serve, 1,000 requests at once, output tok/s"]
    assert at_once.verdict == "met" and at_once.ours == "9,800 tok/s"  # 9,800 / 10,000 >= 97%
    assert "10,000" in at_once.peer
    assert rows["serve, 1,000 at once, ITL p99"].verdict == "met"
    assert rows["serve, 1,000 at once, TPOT p99"].verdict == "met"
    first = rows["serve, first 48 requests one at a time, TTFT p99"]
    assert first.verdict == "met" and first.peer == "p50 of the same requests 12.0 ms"  # 20 <= 2 x 12
    assert rows["serve, 20 requests/s, TTFT p99"].verdict == "missed"  # 70 > 60 ms
    stages["serve"]["offline_fcfs"]["result"]["result"]["output_tokens_per_s"] = 10200.0  # 96%
    rows = {r.benchmark: r for r in suite.scoreboard(stages)}
    assert rows["serve, 1,000 requests at once, output tok/s"].verdict == "missed"


def test_serve_rows_say_not_run_without_the_stage() -> None:
    rows = [r for r in suite.scoreboard({}) if "serve" in r.benchmark and "through" not in r.benchmark]
    assert [r.verdict for r in rows] == ["not run"]


def test_multigpu_rows_say_not_run_on_one_gpu() -> None:
    rows = [r for r in suite.scoreboard({"multigpu": {"skipped": "1 GPU"}}) if "parallelism" in r.benchmark]
    assert [r.verdict for r in rows] == ["not run"]


def _today_doc(tmp_path: Path, recorded: str) -> tuple[Path, Path]:
    """A docs folder in tmp_path with a benchmarks.md holding the Today markers, and a copy of a
    results folder the suite wrote under its results/."""
    docs = tmp_path / "docs"
    out = docs / "results" / "run"
    shutil.copytree(ROOT / "docs" / "results" / recorded, out)
    doc = docs / "benchmarks.md"
    doc.write_text("# B\n\n<!-- scoreboard:present -->\nold table\n<!-- /scoreboard:present -->\n\nhistory\n")
    return doc, out


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every table row of `text` that is not a header or rule line."""
    lines = [
        line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| benchmark")
    ]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])] for line in lines]


def test_docs_today_table_from_a_recorded_h100_run(tmp_path: Path) -> None:
    """`--report --docs` on a results folder of a real suite run (the 1,000-request workload)."""
    doc, out = _today_doc(tmp_path, "2026-11-26_h100_offline_batch_profile/suite_1000")
    assert suite.main(["--out", str(out), "--report", "--docs", str(doc)]) == 0
    text = doc.read_text()
    assert "old table" not in text and text.endswith("<!-- /scoreboard:present -->\n\nhistory\n")
    assert "**1 x NVIDIA H100 80GB HBM3, revision 73b8585, 2026-11-26**" in text
    link = "[stage_throughput.json](results/run/stage_throughput.json)"
    assert "| offline throughput, 1000 requests, warm | 11,449 tok/s | vLLM publishes" in text
    rps = "| offline throughput, 1000 requests, warm, requests/s | 57.2 req/s |  | >= 40 req/s | met"
    assert f"{rps} | {link} |" in text
    cold = "| offline throughput, 1000 requests, empty kernel caches | 10,761 tok/s | warm caches,"
    assert cold in text
    assert "| engine start-up, cold caches (8B shapes) | 228.0 s |" in text
    assert "--stages throughput`" in text  # the command under the table
    # Only what was measured: the 256-request rows and every other stage are named, not shown.
    rows = _table_rows(text)
    assert rows and all(cells[1] != "not run" and cells[5] == link for cells in rows)
    assert "Not measured in this run: the stages latency, attention" in text
    # One number in each of our cells, and the form the shipped doc keeps.
    assert all(len(re.findall(r"\d[\d,.]*", cells[1])) == 1 for cells in rows)
    _check_today_form(doc)


def test_docs_today_table_puts_the_peer_of_the_same_run_beside_ours(tmp_path: Path) -> None:
    doc, out = _today_doc(tmp_path, "2026-11-24_h100")
    assert suite.main(["--out", str(out), "--report", "--docs", str(doc)]) == 0
    text = doc.read_text()
    assert "| single stream 512 -> 128, TPOT | 6.49 ms | HF + static cache + torch.compile 7.83 ms |" in text
    assert text.count("**1 x NVIDIA H100 80GB HBM3, revision ") == 1  # one run, one table


def test_docs_today_tables_split_by_where_each_stage_ran(tmp_path: Path) -> None:
    doc, out = _today_doc(tmp_path, "2026-11-24_h100")
    today.record_measured(out, "latency", today.Measured("1 x GPU A", "aaaaaaa", "2026-01-02"))
    today.record_measured(out, "peers", today.Measured("1 x GPU B", "bbbbbbb", "2026-01-03"))
    assert suite.main(["--out", str(out), "--report", "--docs", str(doc)]) == 0
    text = doc.read_text()
    # Throughput has no record, so it keeps the env stage's machine; latency gets a table of its own.
    assert "**1 x GPU A, revision aaaaaaa, 2026-01-02**" in text
    assert "**1 x NVIDIA H100 80GB HBM3, revision f2ab5c3" in text
    tpot = next(cells for cells in _table_rows(text) if cells[0] == "single stream 512 -> 128, TPOT")
    assert tpot[2].endswith("(1 x GPU B, bbbbbbb, 2026-01-03: not this run)")


def test_the_suite_records_where_each_stage_ran(tmp_path: Path) -> None:
    env = {"gpu": "NVIDIA H200", "nvidia_smi": "NVIDIA H200, 1, 2\nNVIDIA H200, 1, 2\n", "date": "2026-02-03",
           "pagedserve_revision": "abc1234"}  # fmt: skip
    here = today.measured_from_env(env)
    assert here == today.Measured("2 x NVIDIA H200", "abc1234", "2026-02-03")
    today.record_measured(tmp_path, "latency", here)
    today.record_measured(tmp_path, "serve", today.Measured("1 x X", "r", "d"))
    measured = today.read_measured(tmp_path)
    assert measured["latency"] == here and measured["serve"].machine == "1 x X"
    assert measured["*"].machine == "machine not recorded"  # no stage_env.json in this folder


def test_docs_refuses_results_outside_the_docs_folder(tmp_path: Path) -> None:
    doc, _ = _today_doc(tmp_path, "2026-11-24_h100")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "docs" / "results" / "2026-11-24_h100", elsewhere)
    with pytest.raises(ValueError, match="docs/results"):
        suite.main(["--out", str(elsewhere), "--report", "--docs", str(doc)])
    with pytest.raises(ValueError, match="scoreboard:present"):
        today.replace_today("no markers", "table")


def _today_of(doc: Path) -> str:
    text = doc.read_text()
    return text[text.index(today.BEGIN) : text.index(today.END)]


def _check_today_form(doc: Path) -> None:
    """The form `--docs` writes: a header naming machine, revision and date over each table, the
    same columns, at most one number in our cell (pass/fail rows have none), and every row linked
    to a raw file that exists under the doc's results/ folder."""
    block = _today_of(doc)
    header = "| " + " | ".join(today.COLUMNS) + " |"
    tables = block.split(header)[1:]
    assert tables, f"{doc} has no Today table"
    heads = re.findall(r"^\*\*(.+?), revision (\w+), (\d{4}-\d{2}-\d{2})\*\*$", block, flags=re.M)
    assert len(heads) == len(tables), "every Today table needs a **machine, revision REV, DATE** line"
    for cells in _table_rows(block):
        assert len(cells) == len(today.COLUMNS), cells
        assert len(re.findall(r"\d[\d,.]*", cells[1])) <= 1, f"one number in our cell: {cells}"
        links = re.findall(r"\]\((results/[^)]+)\)", cells[5])
        assert len(links) == 1, f"one raw output per row: {cells}"
        assert (doc.parent / links[0]).exists(), f"{links[0]} does not exist"


def test_the_shipped_today_tables_have_the_generated_form() -> None:
    """The Today tables of docs/benchmarks.md, kept by hand until a suite run replaces them, have
    the form `--docs` writes."""
    _check_today_form(ROOT / "docs" / "benchmarks.md")


def test_the_shipped_benchmarks_doc_reads_in_one_sitting() -> None:
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    assert len(lines) <= 600, f"docs/benchmarks.md has {len(lines)} lines: move history out of it"
    long_rows = [line[:60] for line in lines if line.startswith("|") and len(line) > 400]
    assert not long_rows, f"table rows over 400 characters: {long_rows}"


def test_moe_and_quantized_rows_judge_a_recorded_h100_run() -> None:
    """The rows read the files the stages' scripts write: here those of a real run."""
    results = ROOT / "docs" / "results" / "2026-12-07_h100_moe_engine"
    stages = {
        "moe": {
            "qwen3_30b_a3b": json.loads((results / "qwen3_30b_a3b.json").read_text()),
            "op": json.loads((results / "moe_op.json").read_text()),
        },
        "quantized": {"result": json.loads((results / "quantized_cuda.json").read_text())},
    }
    rows = {row.benchmark: row for row in suite.scoreboard(stages)}
    start = rows["Qwen3-30B-A3B shape: start-up on empty caches"]
    assert (start.ours, start.verdict) == ("45.8 s", "met")
    assert rows["Qwen3-30B-A3B shape: single stream TPOT"].ours == "4.51 ms"
    assert rows["Qwen3-30B-A3B shape: single stream TPOT"].verdict == "missed"
    assert rows["Qwen3-30B-A3B shape: 1,000 requests"].ours == "5,799 tok/s"
    assert rows["gpt-oss-20b shape (triton): single stream TPOT"].verdict == "not run"
    bound = rows["MoE op, Qwen3-30B-A3B experts, 1 token: time over the experts' bytes"]
    assert (bound.ours, bound.verdict) == ("1.47x", "missed")
    assert rows["MoE op, Qwen3-30B-A3B experts, 4,096 tokens"].verdict == "met"
    # That run's W4A16 variant ran out of time before its numbers were written.
    assert rows["GPTQ W4A16 8B: single stream TPOT"].verdict == "not run"
    load = rows["bf16 8B checkpoint (16 GB): load, pages evicted first"]
    assert (load.ours, load.verdict) == ("7.5 s", "met")
