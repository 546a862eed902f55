"""The host logic of `benchmarks/kernel_benchmarks/moe_tune.py`: the candidates it searches and the
tuned-config entries it writes, which the plugin's config parser accepts (the timing needs a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_support import ROOT, load_benchmark

sys.path.insert(0, str(ROOT / "plugins" / "triton"))
moe_tune = load_benchmark("moe_tune", "kernel_benchmarks")


def test_help_works_without_a_gpu() -> None:
    done = subprocess.run(
        [sys.executable, "moe_tune.py", "--help"],
        cwd=ROOT / "benchmarks" / "kernel_benchmarks",
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "WEIGHT_MAJOR" in done.stdout and "--min-gain" in done.stdout


def test_block_heights_stop_at_twice_the_pairs_per_expert() -> None:
    assert moe_tune.candidate_block_ms(1) == (16,)
    assert moe_tune.candidate_block_ms(16) == (16, 32)
    assert moe_tune.candidate_block_ms(33) == (16, 32, 64, 128)
    assert moe_tune.candidate_block_ms(1000) == (16, 32, 64, 128)


def test_unknown_model_is_refused_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        moe_tune.build_parser().parse_args(["--model", "nope"])
    assert "qwen3_30b_a3b" in capsys.readouterr().err


def test_entries_parse_and_win_the_lookup_for_their_bucket(tmp_path: Path) -> None:
    from pagedserve.platforms.tuned_configs import TunedConfigs
    from pagedserve_triton.moe_kernel import GemmTiles, MoEConfig, parse_config

    shape = moe_tune.MODELS["qwen3_30b_a3b"]
    tuned = MoEConfig(32, GemmTiles(128, 64, 8, 3), GemmTiles(64, 256, 4, 3), 0, True)
    other = MoEConfig(64, GemmTiles(64, 128, 4, 4), GemmTiles(128, 64, 4, 4), 0)
    results = [
        {"tokens": 256, "tokens_per_expert": 16, "best": moe_tune.params_of(tuned)},
        # the same bucket as 256 tokens, and fewer tokens: its entry is kept
        {"tokens": 200, "tokens_per_expert": 13, "best": moe_tune.params_of(other)},
        {"tokens": 1024, "tokens_per_expert": 64, "best": moe_tune.params_of(other)},
    ]
    entries = moe_tune.entries(shape, results)
    assert [e["match"]["tokens_per_expert_le"] for e in entries] == [16, 64]
    assert parse_config(entries[0]["params"], "test") == other
    assert parse_config(moe_tune.params_of(tuned), "test") == tuned
    file = tmp_path / "fused_moe-h100.json"
    file.write_text(
        json.dumps({"schema_version": 1, "kernel": "fused_moe", "device": "h100", "configs": entries})
    )
    configs = TunedConfigs.from_files([file])
    keys = dict(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8, dtype="bfloat16")
    got = configs.lookup(
        "fused_moe", "h100", **keys, weight_dtype="bfloat16", tokens=1024, tokens_per_expert=64
    )
    assert parse_config(got, "test") == other
