"""The host logic of `benchmarks/kernel_benchmarks/moe_op.py`: its arguments, the memory bound and the
report it prints and writes (the timing itself needs a GPU)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch
from bench_support import ROOT, load_benchmark

moe_op = load_benchmark("moe_op", "kernel_benchmarks")


def test_help_works_without_a_gpu() -> None:
    done = subprocess.run(
        [sys.executable, "moe_op.py", "--help"],
        cwd=ROOT / "benchmarks" / "kernel_benchmarks",
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "torch._grouped_mm" in done.stdout and "--bound-tokens" in done.stdout


def test_arguments_default_to_every_model_and_powers_of_two_to_4096() -> None:
    args = moe_op.build_parser().parse_args([])
    assert args.models == ("qwen3_30b_a3b", "gpt_oss_20b", "mixtral_8x7b")
    assert args.tokens == tuple(2**i for i in range(13))
    args = moe_op.build_parser().parse_args(["--models", "mixtral_8x7b", "--tokens", "1,3,64", "--check"])
    assert args.models == ("mixtral_8x7b",) and args.tokens == (1, 3, 64) and args.check


@pytest.mark.parametrize("bad", ["0", "1,x", ""])
def test_bad_token_counts_are_refused(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        moe_op.parse_tokens(bad)


def test_unknown_models_are_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="known: qwen3_30b_a3b"):
        moe_op.parse_models("llama")


def test_expert_bytes_and_the_memory_bound() -> None:
    qwen = moe_op.MODELS["qwen3_30b_a3b"]
    assert qwen.expert_bytes() == 3 * 2048 * 768 * 2
    gpt_oss = moe_op.MODELS["gpt_oss_20b"]
    assert gpt_oss.expert_bytes() == 3 * 2880 * 2880 * 2 + (2 * 2880 + 2880) * 2  # with its biases
    # 8 experts of 9.4 MB at 3 TB/s: 25.2 us.
    assert moe_op.bound_us(8, qwen.expert_bytes(), 3e12) == pytest.approx(8 * 9437184 / 3e12 * 1e6)
    assert moe_op.distinct_experts(torch.tensor([[3, 1], [1, 7], [3, 1]])) == 3


def test_report_table_and_json() -> None:
    points = [
        moe_op.Point("qwen3_30b_a3b", 1, 30.0, 60.0, 8.0, 25.0, 3e-3, True),
        moe_op.Point("mixtral_8x7b", 4096, 4000.0, 3000.0, 8.0, None),
        moe_op.Point("gpt_oss_20b", 2, None, 80.0, 7.5, 60.0, error="OutOfResources: shared memory"),
    ]
    assert points[0].speedup == 2.0 and points[0].vs_bound == 1.2
    assert points[1].vs_bound is None and points[2].speedup is None
    table = moe_op.markdown_table(points, 3.0e12).splitlines()
    assert table[0] == "copy bandwidth: 3.00 TB/s (read + written)"
    assert table[2].startswith("| model | tokens | triton us | grouped_mm us")
    assert table[4] == "| qwen3_30b_a3b | 1 | 30.0 | 60.0 | 2.00 | 8.0 | 25.0 | 1.20 | 3.0e-03 | yes |"
    assert table[5] == "| mixtral_8x7b | 4096 | 4000.0 | 3000.0 | 0.75 | 8.0 | - | - | - | - |"
    assert "error: OutOfResources" in table[6]
    document = json.loads(json.dumps(moe_op.report(points, 3.0e12, "NVIDIA H100 80GB HBM3")))
    assert document["device"] == "NVIDIA H100 80GB HBM3" and document["copy_bytes_per_s"] == 3.0e12
    assert document["points"][0]["speedup"] == 2.0 and document["points"][0]["vs_bound"] == 1.2
    assert document["points"][2]["error"].startswith("OutOfResources")


def test_main_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: main would run the benchmark")
    assert moe_op.main(["--models", "qwen3_30b_a3b"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
