"""Quantized checkpoints under tensor parallelism on cpu_reference with gloo: GPTQ (with and
without desc_act, 4 and 8 bits), AWQ, compressed-tensors W4A16 (symmetric groups; zero points,
with and without activation order), W8A16 per channel, and FP8 per channel with dynamic
activations, per tensor with static activation scales, and in blocks; biased projections
throughout.

* Each rank's layers dequantize to exactly its rows or columns of the single-device layers
  (biases: its rows, or a row-parallel layer's whole bias), for every format.
* Greedy tokens at tensor_parallel_size=2 equal tensor_parallel_size=1 (float32), and so do the
  top log-probabilities of every prompt position and step (within 1e-4), for GPTQ, AWQ and a
  mixed-precision compressed-tensors checkpoint holding every compressed-tensors scheme above:
  one engine for them all, since each tensor-parallel engine starts a process per rank.
* Shards that would cut a packed word, a scale group or an FP8 block are refused with the layer
  and the sizes named, before a tensor is read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quantization_support import (
    VOCAB,
    Fp8Spec,
    IntSpec,
    Spec,
    tiny_llama,
    write_fp8_checkpoint,
    write_gptq_awq_checkpoint,
    write_mixed_checkpoint,
)

from pagedserve import LLM, SamplingParams
from pagedserve.distributed.group import TensorParallelGroup
from pagedserve.models.loader import load_model
from pagedserve.processes.tensor_parallel.base import RankFailedError
from pagedserve.processes.tensor_parallel.multiproc import MultiprocExecutor
from pagedserve.quantization.checkpoint_config import IntWeightScheme
from pagedserve.quantization.fp8_linear import Fp8CheckpointLinear
from pagedserve.quantization.int_linear import IntWeightLinear

MAX_NEW = 8
GREEDY = SamplingParams(
    temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False, logprobs=5, prompt_logprobs=5
)
CT = "compressed-tensors"
# Groups of 64 over down_proj's 96 inputs per rank are refused without activation order
# (`test_a_row_parallel_shard_that_splits_scale_groups_is_refused`); with it they load.
SPECS: dict[str, Spec] = {
    "gptq-int4-g32-sym": IntSpec("gptq", 4, 32, True, False),
    "gptq-int4-g64-desc_act": IntSpec("gptq", 4, 64, False, True),
    "gptq_v2-int8-g32": IntSpec("gptq_v2", 8, 32, False, False),
    "awq-int4-g32": IntSpec("awq", 4, 32, False, False),
    "ct-w4a16-g32": IntSpec(CT, 4, 32, True, False),
    "ct-w4a16-asym-g32": IntSpec(CT, 4, 32, False, False),
    "ct-w4a16-asym-g64-actorder": IntSpec(CT, 4, 64, False, True),
    "ct-w8a16-channel": IntSpec(CT, 8, None, True, False),
    "fp8-channel-dynamic": Fp8Spec("channel", "dynamic_token"),
    "fp8-tensor-static": Fp8Spec("tensor", "static_tensor"),
    "fp8-block": Fp8Spec("block", "dynamic_group", (32, 32)),
}
# The mixed checkpoint: each compressed-tensors scheme on one attention or MLP block, so every
# scheme has a column-parallel (qkv, gate_up) and a row-parallel (o, down) layer.
MIXED: dict[str, str] = {
    "model.layers.0.self_attn": "ct-w4a16-g32",
    "model.layers.0.mlp": "ct-w4a16-asym-g64-actorder",
    "model.layers.1.self_attn": "ct-w8a16-channel",
    "model.layers.1.mlp": "fp8-block",
    "model.layers.2.self_attn": "fp8-tensor-static",
    "model.layers.2.mlp": "fp8-channel-dynamic",
    "model.layers.3.self_attn": "ct-w4a16-asym-g32",
    "model.layers.3.mlp": "fp8-channel-dynamic",
}
ENGINE_CASES = ["gptq-int4-g32-sym", "gptq-int4-g64-desc_act", "awq-int4-g32", "ct-mixed"]
BIASED = dict(attention_bias=True, mlp_bias=True)
# tiny_llama: 4 query heads and 2 KV heads of 32, intermediate 192. At TP=2 rank r holds q rows
# [64r, 64r + 64), k and v rows [32r, 32r + 32), gate and up rows [96r, 96r + 96), and the input
# columns [64r, 64r + 64) of o_proj and [96r, 96r + 96) of down_proj.
Q, KV, INTER = 128, 64, 192


def _write(case: str, tmp: Path) -> Path:
    if case == "ct-mixed":
        specs = {prefix: SPECS[name] for prefix, name in MIXED.items()}
        return write_mixed_checkpoint(tmp, specs, tiny_llama(num_hidden_layers=4, **BIASED))
    spec = SPECS[case]
    if isinstance(spec, IntSpec):
        return write_gptq_awq_checkpoint(
            tmp, spec.fmt, spec.bits, spec.group, spec.sym, spec.act_order, tiny_llama(**BIASED)
        )[0]
    return write_fp8_checkpoint(tmp, spec.strategy, spec.activations, spec.block, tiny_llama(**BIASED))


def _dense(layer: torch.nn.Module) -> torch.Tensor:
    """A quantized layer's weight [N, K] as it computes with it (float32)."""
    if isinstance(layer, IntWeightLinear):
        return layer.dequantized(torch.float32)
    assert isinstance(layer, Fp8CheckpointLinear)
    w = layer.weight.to(torch.float32)
    if layer.block_scale is None:
        return w * layer.weight_scale.reshape(-1, 1)
    assert layer.scheme.block is not None
    rows, cols = layer.scheme.block
    return w * layer.block_scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)


def _holds(layer: torch.nn.Module, spec: Spec) -> bool:
    """Whether `layer` is the quantized layer `spec` describes."""
    if isinstance(spec, Fp8Spec):
        return isinstance(layer, Fp8CheckpointLinear) and layer.scheme.strategy == spec.strategy
    if not isinstance(layer, IntWeightLinear):
        return False
    got = layer.scheme
    want = IntWeightScheme(spec.fmt, spec.bits, spec.group, spec.sym, spec.act_order)  # type: ignore[arg-type]
    return got == want


def _parts(model: torch.nn.Module, prefix: str) -> dict[str, torch.nn.Module]:
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    return {name: model.get_submodule(f"{prefix}.{name}") for name in names}


@pytest.mark.parametrize("case", [*SPECS, "ct-mixed"])
def test_each_rank_holds_its_rows_and_columns_of_the_single_device_layers(tmp_path: Path, case: str) -> None:
    path = _write(case, tmp_path)
    whole = load_model(path, dtype=torch.float32).model
    ranks = [load_model(path, dtype=torch.float32, tp=TensorParallelGroup(r, 2)).model for r in range(2)]
    for layer in range(len(whole.model.layers)):
        one = _parts(whole, f"model.layers.{layer}")
        for name, module in one.items():  # each block quantized as its case (its group) says
            block = f"model.layers.{layer}.{name.partition('.')[0]}"
            assert _holds(module, SPECS[MIXED[block] if case == "ct-mixed" else case])
        q, k, v = _dense(one["self_attn.qkv_proj"]).split([Q, KV, KV])
        q_bias, k_bias, v_bias = one["self_attn.qkv_proj"].bias.split([Q, KV, KV])
        gate, up = _dense(one["mlp.gate_up_proj"]).split([INTER, INTER])
        gate_bias, up_bias = one["mlp.gate_up_proj"].bias.split([INTER, INTER])
        for r, model in enumerate(ranks):
            mine = _parts(model, f"model.layers.{layer}")
            heads, kv, mlp = (
                slice(64 * r, 64 * r + 64),
                slice(32 * r, 32 * r + 32),
                slice(96 * r, 96 * r + 96),
            )
            qkv, gate_up = mine["self_attn.qkv_proj"], mine["mlp.gate_up_proj"]
            assert torch.equal(_dense(qkv), torch.cat([q[heads], k[kv], v[kv]]))
            assert torch.equal(qkv.bias, torch.cat([q_bias[heads], k_bias[kv], v_bias[kv]]))
            assert torch.equal(_dense(gate_up), torch.cat([gate[mlp], up[mlp]]))
            assert torch.equal(gate_up.bias, torch.cat([gate_bias[mlp], up_bias[mlp]]))
            for name, inputs in (("self_attn.o_proj", heads), ("mlp.down_proj", mlp)):
                row = mine[name]
                assert row.reduce is not None  # sums the ranks' partial products, then adds the bias
                assert torch.equal(_dense(row), _dense(one[name])[:, inputs])
                assert torch.equal(row.bias, one[name].bias)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 33, 17)]


def _llm(path: Path, **engine: object) -> LLM:
    return LLM(str(path), platform="cpu_reference", skip_tokenizer_init=True, dtype="float32",
               max_model_len=256, num_kv_blocks=64, **engine)  # fmt: skip


def _run(llm: LLM) -> tuple[list[list[int]], list[dict[int, float]]]:
    """Greedy tokens, and the top log-probabilities of every prompt position and generated step."""
    outputs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    tables = []
    for out in outputs:
        assert out.prompt_logprobs is not None and out.outputs[0].logprobs is not None
        steps = [entry for entry in out.prompt_logprobs if entry is not None] + out.outputs[0].logprobs
        tables += [{token: lp.logprob for token, lp in entry.items()} for entry in steps]
    return [list(o.outputs[0].token_ids) for o in outputs], tables


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_tp2_greedy_tokens_and_logprobs_equal_tp1(tmp_path: Path, case: str) -> None:
    path = _write(case, tmp_path)
    tokens, logprobs = _run(_llm(path))
    llm = _llm(path, tensor_parallel_size=2)
    try:
        got_tokens, got_logprobs = _run(llm)
    finally:
        runner = llm.engine.core.runner
        assert isinstance(runner, MultiprocExecutor)
        runner.shutdown()
    assert got_tokens == tokens
    # Only the order of the ranks' partial sums differs (1e-6 here); a bias added on every rank,
    # or a scale read from the wrong rows, moves log-probabilities by a tenth or more.
    for want, got in zip(logprobs, got_logprobs, strict=True):
        common = set(want) & set(got)
        assert len(common) >= 4  # the top 5 of each, give or take a near tie at the end
        assert all(abs(want[t] - got[t]) < 1e-4 for t in common), (want, got)


def _load_rank0(path: Path) -> None:
    load_model(path, dtype=torch.float32, tp=TensorParallelGroup(0, 2))


def test_a_row_parallel_shard_that_splits_scale_groups_is_refused(tmp_path: Path) -> None:
    # down_proj's 192 inputs over 2 ranks: 96 each, not a multiple of the 64-input groups.
    path, _ = write_gptq_awq_checkpoint(tmp_path, "gptq", 4, 64, True, False)
    load_model(path, dtype=torch.float32)  # one device reads it
    with pytest.raises(
        ValueError,
        match=r"cannot shard the quantized layer model\.layers\.0\.mlp\.down_proj: a rank holds 96 of "
        r"its input columns \(from 0\), not a multiple of 64 \(its scales and zero points are per group",
    ):
        _load_rank0(path)


def test_a_column_shard_that_splits_packed_words_is_refused(tmp_path: Path) -> None:
    # AWQ packs 8 outputs per word; gate_proj's 200 outputs give each rank 100.
    config = tiny_llama()
    config.intermediate_size = 200
    path, _ = write_gptq_awq_checkpoint(tmp_path, "awq", 4, 8, False, False, config=config)
    load_model(path, dtype=torch.float32)
    with pytest.raises(
        ValueError,
        match=r"quantized layer model\.layers\.0\.mlp\.gate_proj: a rank holds 100 of its output rows "
        r"\(from 0\), not a multiple of 8 \(qweight and qzeros pack 8 outputs per int32 word\)",
    ):
        _load_rank0(path)


def test_a_shard_that_splits_fp8_blocks_is_refused(tmp_path: Path) -> None:
    # Blocks of 64 rows: k_proj's 64 rows are one block, and each rank would hold half of it.
    path = write_fp8_checkpoint(tmp_path, "block", "dynamic_group", (64, 64))
    load_model(path, dtype=torch.float32)
    with pytest.raises(
        ValueError,
        match=r"quantized layer model\.layers\.0\.self_attn\.k_proj: a rank holds 32 of its output rows "
        r"\(from 0\), not a multiple of 64 \(its FP8 scales are per block of 64 x 64\)",
    ):
        _load_rank0(path)


def test_the_engine_reports_the_refusal_of_its_ranks(tmp_path: Path) -> None:
    path, _ = write_gptq_awq_checkpoint(tmp_path, "compressed-tensors", 4, 64, True, False)
    with pytest.raises(
        RankFailedError, match=r"cannot shard the quantized layer model\.layers\.0\.mlp\.down_proj"
    ):
        _llm(path, tensor_parallel_size=2)
