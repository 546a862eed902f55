"""`benchmarks/gpu_quantized.py` without a GPU: every checkpoint it writes, of a tiny Llama, loads
in pagedserve (cpu_reference) through the benchmark's own engine arguments, holds the layers its
format names and generates finite greedy tokens; the GPTQ and compressed-tensors W4A16 checkpoints
(the same codes packed two ways) give the same tokens, and so do the FP8 checkpoint and the bf16
one quantized at load time; the writer shards with an index, reuses a complete checkpoint and
replaces one cut short; the report computes its ratios; an unknown variant is refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_support import load_benchmark
from transformers import LlamaConfig

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.models.fp8 import Fp8Linear
from pagedserve.quantization.int_formats import unpack_codes
from pagedserve.quantization.int_linear import IntWeightLinear
from pagedserve.sampling.sampling_params import SamplingParams

bench = load_benchmark("gpu_quantized")

VOCAB = 256
SHARD_BYTES = 64_000  # a few shards even for the tiny model
CPU_ENGINE = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 64, "max_num_seqs": 8}
# Projections of a layer as the engine stacks them: qkv, o, gate_up, down.
LINEAR_LAYERS = 4 * 2


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        fmt: bench.write_checkpoint(fmt, tiny_config(), root / fmt, "cpu", shard_bytes=SHARD_BYTES)
        for fmt in bench.FORMATS
    }


def _greedy(engine: LLMEngine) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens of three prompts, and each request's summed logprob."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=0)
    gen = torch.Generator().manual_seed(1)
    for i, length in enumerate((5, 33, 17)):
        engine.add_request(str(i), torch.randint(1, VOCAB, (length,), generator=gen).tolist(), params)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert isinstance(out.outputs, list)  # a generation, not a pooling output
                done[out.request_id] = out.outputs[0]
    outs = [done[str(i)] for i in range(3)]
    return [list(o.token_ids) for o in outs], [o.cumulative_logprob for o in outs]


@pytest.fixture(scope="module")
def runs(checkpoints: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every variant's CPU engine, built by the benchmark: its start-up record, tokens, logprobs and
    a decoder layer of it."""
    out = {}
    for variant in bench.VARIANTS:
        path = checkpoints[bench.checkpoint_format(variant)].path
        engine, record = bench.build_engine(variant, path, "cpu_reference", **CPU_ENGINE)
        tokens, logprobs = _greedy(engine)
        assert engine.setup.loaded is not None
        model = engine.setup.loaded.model
        quantized = [m for m in model.modules() if isinstance(m, IntWeightLinear | Fp8Linear)]
        out[variant] = {"record": record, "tokens": tokens, "logprobs": logprobs, "quantized": quantized}
    return out


@pytest.mark.parametrize("variant", list(bench.VARIANTS))
def test_every_variant_loads_and_generates_finite_greedy_tokens(
    runs: dict[str, dict[str, Any]], variant: str
) -> None:
    run = runs[variant]
    assert [len(t) for t in run["tokens"]] == [8, 8, 8]
    assert all(0 <= tok < VOCAB for t in run["tokens"] for tok in t)
    assert all(math.isfinite(lp) for lp in run["logprobs"])
    record = run["record"]
    assert record["load_s"] is not None and record["load_s"] >= 0  # the start-up's log record
    assert record["build_s"] >= record["load_s"]
    assert record["kv_tokens"] == 64 * 16 and record["model_bytes"] > 0
    kinds = {type(m) for m in run["quantized"]}
    if variant == "bf16":
        assert not kinds and record["linear_layers"] == {}
    elif variant.endswith("w4a16"):
        assert kinds == {IntWeightLinear} and len(run["quantized"]) == LINEAR_LAYERS
        assert all(m.scheme.bits == 4 and m.scheme.group_size == 128 for m in run["quantized"])
        assert sum(record["linear_layers"].values()) == LINEAR_LAYERS
    else:
        assert (
            all(isinstance(m, Fp8Linear) for m in run["quantized"]) and len(run["quantized"]) == LINEAR_LAYERS
        )


def test_the_two_w4a16_checkpoints_hold_the_same_weights(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["gptq_w4a16"]["tokens"] == runs["ct_w4a16"]["tokens"]
    for gptq, ct in zip(runs["gptq_w4a16"]["quantized"], runs["ct_w4a16"]["quantized"], strict=True):
        assert torch.equal(gptq.packed, ct.packed) and torch.equal(gptq.scales, ct.scales)
        assert gptq.zeros is None and ct.zeros is None  # symmetric
    # The dequantized weights have the dense variant's spread: codes over -8..7, scales ~0.0043.
    layer = runs["ct_w4a16"]["quantized"][2]  # layer 0's gate_up: [256, 64]
    codes = unpack_codes(layer.packed, 4, layer.in_features, dim=1).float() - 8
    assert codes.min() == -8 and codes.max() == 7
    weight = codes * layer.scales.repeat_interleave(128, dim=1)[:, : layer.in_features]
    assert weight.std().item() == pytest.approx(bench.WEIGHT_STD, rel=0.1)


def test_the_fp8_checkpoint_is_bf16_quantized_at_load_time(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["ct_fp8"]["tokens"] == runs["fp8_load_time"]["tokens"]
    for stored, quantized in zip(
        runs["ct_fp8"]["quantized"], runs["fp8_load_time"]["quantized"], strict=True
    ):
        assert torch.equal(stored.weight.view(torch.uint8), quantized.weight.view(torch.uint8))
        assert torch.equal(stored.weight_scale, quantized.weight_scale)


def test_the_writer_shards_with_an_index_and_reuses_a_complete_checkpoint(
    checkpoints: dict[str, Any], tmp_path: Path
) -> None:
    config = tiny_config()
    for fmt, checkpoint in checkpoints.items():
        index = json.loads((checkpoint.path / "model.safetensors.index.json").read_text())
        files = sorted(p.name for p in checkpoint.path.glob("*.safetensors"))
        assert len(files) == checkpoint.files > 1 and sorted(set(index["weight_map"].values())) == files
        assert files[0] == f"model-00001-of-{checkpoint.files:05d}.safetensors"
        assert index["metadata"]["total_size"] == checkpoint.bytes == bench.checkpoint_bytes(fmt, config)
        quant = json.loads((checkpoint.path / "config.json").read_text()).get("quantization_config")
        assert quant == bench.quantization_config(fmt)
    again = bench.write_checkpoint("fp8_load_time", config, checkpoints["bf16"].path, "cpu")
    assert again.reused and again.bytes == checkpoints["bf16"].bytes
    cut_short = tmp_path / "cut_short"  # a write that stopped before its marker: written again
    cut_short.mkdir()
    (cut_short / "part-00001.safetensors").write_bytes(b"partial")
    written = bench.write_checkpoint("ct_w4a16", config, cut_short, "cpu")
    assert not written.reused and not (cut_short / "part-00001.safetensors").exists()
    assert written.files == 1 and written.disk_bytes > written.bytes
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a checkpoint of this benchmark"):
        bench.write_checkpoint("bf16", config, tmp_path / "other", "cpu")


def test_an_unknown_variant_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.build_parser().parse_args(["--variants", "bf16,gptq_w3a16"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown variant 'gptq_w3a16'" in err and "ct_w4a16" in err
    assert bench.build_parser().parse_args(["--variants", "ct_fp8,bf16"]).variants == ["ct_fp8", "bf16"]


def test_merged_runs_report_the_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def variant(tpot: float, tput: float, load: float, size: int) -> dict[str, Any]:
        return {
            "single_stream": {"tpot_median_ms": tpot, "ttft_ms": 14.0},
            "throughput": {"output_tokens_per_s": tput},
            "load_s": load,
            "checkpoint_bytes": size,
        }

    first = {
        "device": "GPU",
        "variants": {
            "bf16": variant(6.0, 10000.0, 10.0, 16),
            "fp8_load_time": variant(4.0, 13000.0, 12.0, 16),
            "ct_fp8": variant(4.2, 12350.0, 6.0, 9),
        },
    }
    second = {
        "device": "GPU",
        "variants": {
            "gptq_w4a16": variant(3.0, 8000.0, 20.0, 6),
            "ct_w4a16": {"error": "ValueError: refused"},
        },
    }
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, run in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(run))
    out = tmp_path / "merged.json"
    assert bench.main(["--merge", *map(str, paths), "--json", str(out)]) == 0
    ratios = json.loads(out.read_text())["ratios"]
    assert ratios["tpot_vs_bf16"]["gptq_w4a16"] == pytest.approx(0.5)
    want = {"gptq_w4a16": 0.8, "ct_w4a16": None, "ct_fp8": 1.235, "fp8_load_time": 1.3}
    assert ratios["throughput_vs_bf16"] == pytest.approx(want)
    assert ratios["ct_fp8_vs_fp8_load_time"] == pytest.approx({"tpot": 1.05, "throughput": 0.95})
    assert ratios["checkpoint_bytes_vs_bf16"]["ct_fp8"] == pytest.approx(9 / 16)
    table = capsys.readouterr().out
    assert "| gptq_w4a16 |" in table and "0.500x" in table and "failed: ValueError: refused" in table


def test_the_disk_holds_each_checkpoint_from_its_first_variant_to_its_last() -> None:
    sizes = {"bf16": 16, "ct_fp8": 9, "gptq_w4a16": 6}
    assert bench.disk_peak_bytes(["bf16", "ct_fp8", "fp8_load_time"], sizes, keep=False) == 25
    assert bench.disk_peak_bytes(["bf16", "fp8_load_time", "ct_fp8", "gptq_w4a16"], sizes, keep=False) == 16
    assert bench.disk_peak_bytes(["bf16", "fp8_load_time", "ct_fp8", "gptq_w4a16"], sizes, keep=True) == 31


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_a_run_without_a_gpu_is_refused() -> None:
    with pytest.raises(SystemExit, match="CUDA GPU"):
        bench.main(["--variants", "bf16"])
