"""The host logic of `benchmarks/kernel_benchmarks/attention.py --variants` (`attention_variants.py`,
`attention_configs.py`): scores, the decode verdict, the config overrides it times and the files it
writes; then one tiny end-to-end run in Triton's interpreter (two variants, one launch point)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
H100 = "NVIDIA H100 80GB HBM3"

# As in test_bench_attention_formulas.py: the interpreter is chosen before the kernels exist, and
# the kernel scripts import their neighbours by file name.
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(ROOT / "plugins" / "triton"))
sys.path.insert(0, str(ROOT / "benchmarks" / "kernel_benchmarks"))
import attention_cases as case_table  # noqa: E402
import attention_configs as configs  # noqa: E402
import attention_variants as variants  # noqa: E402
from attention_batches import Shape  # noqa: E402

from pagedserve.platforms.tuned_configs import TunedConfigs  # noqa: E402
from pagedserve_triton.launch_params import CONFIG_DIR, LaunchParams  # noqa: E402

SHAPE = Shape(q_heads=32, kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)
LAUNCH = {"BLOCK_M": 128, "TILE_SIZE": 64, "num_warps": 8, "num_stages": 3}


def _h100(params: LaunchParams, kernel: str, max_query_len: int) -> object:
    return params.attention(
        kernel,
        H100,
        head_size=128,
        block_size=16,
        num_queries_per_kv=4,
        dtype=torch.bfloat16,
        max_query_len=max_query_len,
    )


def _result(name: str, us: dict[str, float], max_diff: float = 0.0, error: str | None = None) -> object:
    return variants.VariantResult(name, {}, us, max_diff, error)


def test_prefill_score_is_the_geometric_mean_tflops_of_complete_results() -> None:
    flops = {"a": 4 * 10**8, "b": 10**8}  # 400 and 100 TFLOP/s at 1 us: geomean 200
    assert variants.prefill_score(_result("x", {"a": 1.0, "b": 1.0}), flops) == pytest.approx(200.0)
    assert variants.prefill_score(_result("x", {"a": 1.0}), flops) == 0.0
    assert variants.prefill_score(_result("x", {"a": 1.0, "b": 1.0}, error="OutOfResources"), flops) == 0.0


def test_decode_verdict_needs_a_gain_and_no_case_much_slower() -> None:
    assert variants.decode_verdict([0.95, 0.97, 1.0])
    assert not variants.decode_verdict([0.99, 1.0, 0.995])  # no real gain
    assert not variants.decode_verdict([0.80, 0.85, 1.05])  # one case 5 % slower
    assert not variants.decode_verdict([])


def test_choose_decode_flags_takes_the_fastest_correct_candidate() -> None:
    plain = _result("plain", {"a": 10.0, "b": 10.0})
    fast = _result("fast", {"a": 9.0, "b": 9.0})
    faster_but_wrong = _result("wrong", {"a": 5.0, "b": 5.0}, max_diff=1.0)
    failed = _result("failed", {}, error="CompilationError")
    faster = _result("faster", {"a": 8.5, "b": 9.5})
    candidates = {"plain": {}, "fast": {"F": True}, "wrong": {"W": True}, "failed": {}, "faster": {"G": 1}}
    results = [plain, fast, faster_but_wrong, failed, faster]
    assert variants.choose_decode_flags(results, candidates, 3e-2) == ("faster", {"G": 1})
    assert variants.choose_decode_flags([plain, faster_but_wrong], candidates, 3e-2) is None


def test_decode_candidates_add_the_winners_flags_once() -> None:
    winner = variants.VariantResult(
        "prefetch+lazy", {**LAUNCH, "PREFETCH_BLOCK_IDS": True, "LAZY_RESCALE": True}
    )
    assert variants.decode_candidates(winner) == {
        "plain": {},
        "prefetch+3stages": {"PREFETCH_BLOCK_IDS": True, "num_stages": 3},
        "prefetch+lazy (winner)": {"PREFETCH_BLOCK_IDS": True, "LAZY_RESCALE": True},
    }
    # Prefetching alone (at the decode entries' own 2 stages) is a set of its own.
    same = variants.VariantResult("prefetch", {**LAUNCH, "PREFETCH_BLOCK_IDS": True, "num_stages": 3})
    assert list(variants.decode_candidates(same)) == ["plain", "prefetch+3stages", "prefetch (winner)"]
    assert list(variants.decode_candidates(variants.VariantResult("plain", LAUNCH))) == [
        "plain",
        "prefetch+3stages",
    ]


def test_overrides_win_for_their_classes_only() -> None:
    entry = {"match": {"head_size": 128, "max_query_len_ge": 17}, "params": {**LAUNCH, "LAZY_RESCALE": True}}
    params = LaunchParams(configs.configs_with(H100, {"unified_attention_2d": [entry]}))
    prefill = _h100(params, "unified_attention_2d", 2048)
    assert (prefill.block_m, prefill.num_stages, prefill.lazy_rescale) == (128, 3, True)
    shipped = LaunchParams(TunedConfigs.from_files(sorted(CONFIG_DIR.glob("*.json"))))
    assert _h100(params, "unified_attention_2d", 1) == _h100(shipped, "unified_attention_2d", 1)


def test_written_files_change_the_prefill_entry_and_decode_only_when_adopted(tmp_path: Path) -> None:
    winner = {**LAUNCH, "PREFETCH_BLOCK_IDS": True}
    written = configs.write_variant_configs(tmp_path, "h100", H100, SHAPE, (winner, [1024, 2048]), None)
    assert [p.name for p in written] == ["unified_attention_2d-h100.json"]
    shipped_content = json.loads((CONFIG_DIR / "unified_attention_2d-h100.json").read_text())
    content = json.loads(written[0].read_text())
    changed = [
        i
        for i, (a, b) in enumerate(zip(shipped_content["configs"], content["configs"], strict=True))
        if a != b
    ]
    assert len(changed) == 1 and content["configs"][changed[0]]["params"] == winner
    others = sorted(p for p in CONFIG_DIR.glob("*.json") if p.name != written[0].name)
    params = LaunchParams(TunedConfigs.from_files([written[0], *others]))
    for max_query_len in (1024, 2048):
        cfg = _h100(params, "unified_attention_2d", max_query_len)
        assert (cfg.block_m, cfg.tile_size, cfg.num_warps, cfg.num_stages) == (128, 64, 8, 3)
        assert cfg.prefetch_block_ids
    assert not _h100(params, "unified_attention_2d", 1).prefetch_block_ids

    written = configs.write_variant_configs(
        tmp_path / "both", "h100", H100, SHAPE, (winner, [2048]), {"PREFETCH_BLOCK_IDS": True}
    )
    assert sorted(p.name for p in written) == [
        "unified_attention_2d-h100.json",
        "unified_attention_3d-h100.json",
    ]
    others = sorted(p for p in CONFIG_DIR.glob("*.json") if p.name not in {w.name for w in written})
    params = LaunchParams(TunedConfigs.from_files([*written, *others]))
    for kernel in ("unified_attention_2d", "unified_attention_3d"):
        decode = _h100(params, kernel, 1)
        assert decode.prefetch_block_ids and not decode.lazy_rescale
        shipped = _h100(LaunchParams(), kernel, 1)
        assert (decode.block_m, decode.tile_size) == (shipped.block_m, shipped.tile_size)


def test_smoke_run_prints_the_tables_and_writes_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two variants at one launch point, tiny shapes, interpreter: the plumbing end to end."""
    monkeypatch.setattr(
        variants, "LOOP_VARIANTS", {"plain": {}, "pf+lazy+longest": variants.LOOP_VARIANTS["pf+lazy+longest"]}
    )
    monkeypatch.setattr(variants, "SMOKE_POINTS", ((16, 16, 4, 2),))
    monkeypatch.setattr(
        variants,
        "SMOKE_SIZES",
        case_table.TableSizes(
            decode_batches=(2,),
            decode_contexts=(40,),
            prefill=(1, 24),
            chunked=(9, 30),
            mixed=(1, 20, 1, 9),
            spec=(1, 2, 20),
        ),
    )
    args = argparse.Namespace(
        smoke=True,
        dtype="fp32",
        q_heads=4,
        kv_heads=2,
        head_size=32,
        block_size=16,
        budget_s=600.0,
        json=tmp_path / "v.json",
        skip_variant=[],
        write_configs=tmp_path / "out",
    )
    variants.run_variants(args)
    out = capsys.readouterr().out
    assert "prefill sweep" in out and "decode check" in out and "mixed batch" in out
    payload = json.loads((tmp_path / "v.json").read_text())
    assert {r["variant"] for r in payload["prefill"]} == {"plain", "pf+lazy+longest"}
    assert all(r["error"] is None and r["max_diff"] <= 1e-3 for r in payload["prefill"] + payload["decode"])
    assert payload["winner"]["params"]["BLOCK_M"] == 16
    written = json.loads((tmp_path / "out" / "unified_attention_2d-default.json").read_text())
    assert payload["winner"]["params"] in [e["params"] for e in written["configs"]]


def test_sweep_order_keeps_warp_specialisation_last() -> None:
    points = ((64, 64, 4, 2), (128, 64, 8, 2))
    pairs = variants.sweep_order(["plain", "ws", "prefetch", "prefetch+loop3"], points)
    assert pairs == [
        ("plain", points[0]),
        ("prefetch", points[0]),
        ("plain", points[1]),
        ("prefetch", points[1]),
        ("ws", points[0]),
        ("prefetch+loop3", points[0]),
        ("ws", points[1]),
        ("prefetch+loop3", points[1]),
    ]
    every = variants.sweep_order(list(variants.LOOP_VARIANTS), variants.PREFILL_POINTS)
    assert len(every) == len(set(every)) == len(variants.LOOP_VARIANTS) * len(variants.PREFILL_POINTS)
