"""The integer-weight GEMM (`pagedserve_triton.int_linear`) in Triton's interpreter on CPU, against
the core's dequantize-then-multiply formulation (`pagedserve.quantization.int_linear`), and through
the engine on a GPTQ checkpoint: greedy tokens equal transformers' on the dequantized weights."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from models_harness import hf_argmax_tokens
from quantization_support import write_gptq_awq_checkpoint
from triton.runtime.interpreter import InterpretedFunction

from pagedserve import LLM, SamplingParams
from pagedserve.platforms.api import PackedIntWeight
from pagedserve.platforms.tuned_configs import TunedConfigError
from pagedserve.quantization.int_formats import pack_codes
from pagedserve.quantization.int_linear import IntWeightLinear, int_linear_reference, route_int_weight_layers
from pagedserve_triton.int_linear import (
    INT_LINEAR_KERNEL,
    IntGemmTiles,
    choose_tiles,
    int_weight_gemm_kernel,
    int_weight_linear_forward,
    parse_tiles,
    plan_split,
    tuned_entry,
)

if not isinstance(int_weight_gemm_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

# Relative error of the whole output against the formulation: float32 differs by the order of the
# float32 sums only; 16-bit dtypes round the same weights and the same products once.
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _weight(n: int, k: int, bits: int, group: int, zeros: bool, gen: torch.Generator) -> PackedIntWeight:
    groups = -(-k // group)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    zero = torch.randint(-3, 4, (n, groups), generator=gen).to(torch.int8) if zeros else None
    return PackedIntWeight(
        pack_codes(codes, bits), torch.rand(n, groups, generator=gen) / 8, zero, bits, group, k
    )


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert float((got.double() - want.double()).norm() / want.double().norm()) <= TOLERANCE[dtype]


# (rows, outputs, inputs, bits, group, zero points): decode and prefill rows, groups that align
# with the K step (128), that do not (16, 32), one per channel (K), and widths off every tile.
CASES = [
    (1, 64, 256, 4, 128, False),
    (3, 40, 96, 4, 32, True),
    (17, 33, 70, 8, 70, False),
    (70, 48, 128, 4, 16, True),
    (5, 96, 192, 8, 64, True),
]


@pytest.mark.parametrize(("m", "n", "k", "bits", "group", "zeros"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_equals_the_formulation(
    m: int, n: int, k: int, bits: int, group: int, zeros: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    weight = _weight(n, k, bits, group, zeros, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    want = int_linear_reference(x, weight, bias)
    _close(INT_LINEAR_KERNEL.op(x, weight, bias), want, dtype)
    # Small tiles: several K steps and column tiles, the group gathered per input; K split in three
    # ranges (float32 partials, the last range's program sums them and adds the bias); the weight
    # tile as the dot's M side; the dense weight, then a library GEMM.
    for tiles, with_bias in (
        (IntGemmTiles(16, 16, 16, 4, 1), False),
        (IntGemmTiles(16, 16, 16, 4, 1, split_k=3), True),
        (IntGemmTiles(16, 16, 16, 4, 1, split_k=2, weight_major=True), True),
        (IntGemmTiles(16, 32, 32, 4, 1, dequantize_first=True), True),
    ):
        got = int_weight_linear_forward(x, weight, bias if with_bias else None, tiles)
        _close(got, want if with_bias else want - bias, dtype)


def test_rows_past_the_step_change_no_other_row() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = _weight(40, 96, 4, 32, True, gen)
    x = torch.randn(6, 96, generator=gen)
    junk = torch.cat([x, torch.full((10, 96), float("nan"))])
    assert torch.equal(INT_LINEAR_KERNEL.op(junk, weight, None)[:6], INT_LINEAR_KERNEL.op(x, weight, None))


def test_the_kernel_declares_what_it_takes() -> None:
    gen = torch.Generator().manual_seed(5)
    assert INT_LINEAR_KERNEL.takes(_weight(8, 96, 4, 96, False, gen))  # one group per channel
    assert INT_LINEAR_KERNEL.takes(_weight(8, 96, 8, 32, False, gen))
    assert not INT_LINEAR_KERNEL.takes(_weight(8, 96, 4, 24, False, gen))  # not a multiple of 16
    # The default file's rule: 16-row tiles up to 16 rows, 64-row tiles above; K split until
    # ~TARGET_PROGRAMS programs stream (decode tiles only); K steps inside one group.
    assert choose_tiles(1, 128, 64, 4096).block_m == 16 and choose_tiles(300, 128, 64, 4096).block_m == 64
    assert [choose_tiles(1, 128, n, 4096).split_k for n in (1024, 4096, 6144, 28672)] == [8, 2, 1, 1]
    assert choose_tiles(300, 128, 1024, 4096).split_k == 1
    assert [choose_tiles(1, group, 64, 4096).block_k for group in (4096, 128, 32, 16, 48)] == [
        64,
        64,
        32,
        16,
        16,
    ]
    # Whole K steps per split, none empty: 14336 inputs in 64-input steps over 4 splits.
    assert plan_split(IntGemmTiles(16, 32, 64, 8, 3, split_k=4), 14336) == (4, 3584)
    assert plan_split(IntGemmTiles(16, 32, 64, 8, 3, split_k=16), 96) == (2, 64)


def test_tuned_entries_round_trip_and_bad_ones_are_named() -> None:
    tiles = IntGemmTiles(16, 64, 128, 4, 2, split_k=8, weight_major=True)
    entry = tuned_entry(tiles, rows=3, n=6144, k=4096, group_size=128)
    assert entry["match"] == {"n": 6144, "k": 4096, "group_size": 128, "rows_le": 4}
    assert parse_tiles(entry["params"], "here") == (tiles, True)
    with pytest.raises(TunedConfigError, match="here: param 'BLOCK_N' must be a power of two"):
        parse_tiles({**entry["params"], "BLOCK_N": 48}, "here")
    with pytest.raises(TunedConfigError, match=r"unknown params \['TILE'\]"):
        parse_tiles({**entry["params"], "TILE": 1}, "here")
    with pytest.raises(TunedConfigError, match="here: param 'WEIGHT_MAJOR' must be true or false"):
        parse_tiles({**entry["params"], "WEIGHT_MAJOR": 1}, "here")


def test_the_operator_is_opaque_to_compile() -> None:
    gen = torch.Generator().manual_seed(6)
    weight = _weight(24, 64, 4, 32, True, gen)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return INT_LINEAR_KERNEL.op(x * 2.0, weight, None) + 1.0

    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(torch.compile(layer, backend="aot_eager", fullgraph=True)(x), layer(x))


def test_engine_tokens_on_the_kernel_equal_transformers(tmp_path: Path) -> None:
    path, hf = write_gptq_awq_checkpoint(tmp_path, "gptq", 4, 32, sym=False, act_order=False)
    llm = LLM(str(path), platform="cpu_reference", skip_tokenizer_init=True, dtype="float32",
              max_model_len=128, num_kv_blocks=32)  # fmt: skip
    model = llm.engine.setup.loaded.model
    assert route_int_weight_layers(model, INT_LINEAR_KERNEL) == (8, 0)
    assert all(m.kernel is INT_LINEAR_KERNEL for m in model.modules() if isinstance(m, IntWeightLinear))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (5, 20)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == hf_argmax_tokens(hf, prompts, 4)
