"""The fused MoE kernels (`pagedserve_triton.moe_kernel`, `moe_routing`) in Triton's interpreter on
CPU, against the torch formulation (`pagedserve.moe.reference.moe_forward_reference`) run in
float64 on the same inputs, and the device routing against `pagedserve.moe.routing.select_experts`."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

from pagedserve.moe.reference import moe_forward_reference
from pagedserve.moe.routing import select_experts
from pagedserve.platforms.api import ExpertWeights, MoERouting
from pagedserve.platforms.tuned_configs import TunedConfigError
from pagedserve_triton.moe_kernel import (
    MAX_SPLIT_K,
    MOE_KERNEL,
    GemmTiles,
    MoEConfig,
    fused_moe_forward,
    moe_config,
    moe_gemm_kernel,
    parse_config,
    plan_launch,
)
from pagedserve_triton.moe_routing import max_blocks, route_and_group

if not isinstance(moe_gemm_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

# Relative error (Frobenius norm) against the float64 formulation: twice the worst seen here (the
# torch formulation in bfloat16 itself is off by 3-4e-3). bfloat16 rounded by truncation (the
# interpreter's cast, before `moe_kernel._rounded`) was off by 9e-3.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 6e-3}
SILU = MoERouting(top_k=2, scoring="softmax_topk", renormalize=True)
GPT_OSS = MoERouting(4, "topk_softmax", False, "swiglu_limit", 7.0)


def _experts(
    e: int, h: int, i: int, dtype: torch.dtype, gen: torch.Generator, *, fp8: bool = False, bias: bool = False
) -> ExpertWeights:
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    s13 = s2 = None
    if fp8:  # per-output-channel scales, as `SparseMoE.quantize_fp8` makes them
        s13, s2 = w13.abs().amax(-1) / 448, w2.abs().amax(-1) / 448
        w13 = (w13 / s13[..., None]).to(torch.float8_e4m3fn)
        w2 = (w2 / s2[..., None]).to(torch.float8_e4m3fn)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    b13 = torch.randn(e, 2 * i, generator=gen).to(dtype) if bias else None
    b2 = torch.randn(e, h, generator=gen).to(dtype) if bias else None
    return ExpertWeights(w13, w2, s13, s2, b13, b2)


def _float64(experts: ExpertWeights) -> ExpertWeights:
    """The same experts for the oracle: FP8 codes stay (the reference dequantizes them)."""

    def up(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None or t.dtype == torch.float8_e4m3fn else t.double()

    return ExpertWeights(
        experts.w13 if experts.w13.dtype == torch.float8_e4m3fn else experts.w13.double(),
        experts.w2 if experts.w2.dtype == torch.float8_e4m3fn else experts.w2.double(),
        up(experts.w13_scale),
        up(experts.w2_scale),
        up(experts.w13_bias),
        up(experts.w2_bias),
    )


def _check(
    x: torch.Tensor, logits: torch.Tensor, experts: ExpertWeights, routing: MoERouting, dtype: torch.dtype
) -> torch.Tensor:
    got = MOE_KERNEL.op(x, logits, experts, routing)
    want = moe_forward_reference(x.double(), logits.double(), _float64(experts), routing)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.isfinite(got).all()
    error = float((got.double() - want).norm() / want.norm())
    assert error <= TOLERANCE[dtype], error
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("m", "e", "k", "h", "i"),
    # one token; a decode batch on many experts; a few hundred pairs over several blocks per
    # expert (even K; I not a multiple of the gate/up tile)
    [(1, 16, 4, 64, 48), (9, 32, 8, 96, 40), (100, 8, 4, 128, 80)],
)
def test_kernel_equals_the_float64_formulation(
    m: int, e: int, k: int, h: int, i: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(m * 31 + e)
    x = torch.randn(m, h, generator=gen).to(dtype)
    logits = torch.randn(m, e, generator=gen)
    _check(x, logits, _experts(e, h, i, dtype, gen), dataclasses.replace(SILU, top_k=k), dtype)


@pytest.mark.parametrize(
    ("scoring", "renormalize"), [("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False)]
)
def test_both_scorings_pick_and_weigh_like_select_experts(scoring: str, renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    routing = MoERouting(3, scoring, renormalize)  # type: ignore[arg-type]
    x = torch.randn(21, 64, generator=gen)
    logits = torch.randn(21, 12, generator=gen) * 3
    _check(x, logits, _experts(12, 64, 32, torch.float32, gen), routing, torch.float32)
    group = route_and_group(logits, 3, scoring, renormalize, 16)
    weights, ids = select_experts(logits, routing)
    assert torch.equal(group.ids.long(), ids)
    torch.testing.assert_close(group.weights, weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("m", "e", "k", "block_m"),
    # one launch (one chunk: 1, 16 and 37 tokens); route, scan and scatter (17 and 700 tokens)
    [(1, 128, 8, 16), (16, 128, 8, 16), (17, 128, 8, 16), (37, 32, 4, 64), (700, 16, 6, 32)],
)
def test_routing_kernel_equals_select_experts_and_groups_every_pair_once(
    m: int, e: int, k: int, block_m: int
) -> None:
    """(700 tokens x 6 pairs take several scatter programs and route chunks.)"""
    logits = torch.randn(m, e, generator=torch.Generator().manual_seed(m))
    routing = MoERouting(k, "softmax_topk", True)
    group = route_and_group(logits, k, routing.scoring, routing.renormalize, block_m)
    weights, ids = select_experts(logits, routing)
    assert torch.equal(group.ids.long(), ids)
    torch.testing.assert_close(group.weights, weights, rtol=1e-6, atol=1e-7)
    blocks = int(group.num_blocks)
    assert 0 < blocks <= max_blocks(m * k, e, block_m) == group.block_rows.numel()
    rows = group.block_rows[:blocks]
    assert bool((rows > 0).all()) and bool((group.block_rows[blocks:] == 0).all())
    grouped: list[int] = []
    for b in range(blocks):
        pairs = group.sorted_pairs[b * block_m : b * block_m + int(rows[b])].long()
        assert bool((ids.reshape(-1)[pairs] == group.block_expert[b]).all())
        grouped += pairs.tolist()
    # Every pair once, grouped by expert in pair order (deterministic).
    assert grouped == torch.argsort(ids.reshape(-1), stable=True).tolist()


def test_ties_go_to_the_lower_expert_index() -> None:
    logits = torch.tensor(
        [
            [0.0] * 8,  # all tied: 0, 1, 2
            [1.0, 0.0, 3.0, 0.0, 0.0, 3.0, 0.0, 1.0],  # 2 before 5, then 0 before 7
            [5.0, 5.0, 5.0, 5.0, -1.0, 9.0, 5.0, 5.0],  # 5, then 0, 1
        ]
    )
    want = [[0, 1, 2], [2, 5, 0], [5, 0, 1]]
    for scoring in ("softmax_topk", "topk_softmax"):
        routing = MoERouting(3, scoring, True)
        group = route_and_group(logits, 3, scoring, True, 16)
        assert group.ids.tolist() == want == select_experts(logits, routing)[1].tolist()
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(3, 64, generator=gen)
        _check(x, logits, _experts(8, 64, 32, torch.float32, gen), routing, torch.float32)


def test_experts_without_tokens_and_all_tokens_on_one_expert() -> None:
    gen = torch.Generator().manual_seed(3)
    e, m = 16, 90
    # Experts 3 and 11 win every token (several blocks each); the other fourteen get none.
    logits = torch.randn(m, e, generator=gen)
    logits[:, 3] += 20
    logits[:, 11] += 10
    group = route_and_group(logits, 2, "softmax_topk", True, 16)
    assert int(group.num_blocks) == 2 * -(-m // 16)
    assert set(group.block_expert[: int(group.num_blocks)].tolist()) == {3, 11}
    x = torch.randn(m, 64, generator=gen).to(torch.bfloat16)
    experts = _experts(e, 64, 48, torch.bfloat16, gen)
    _check(x, logits, experts, SILU, torch.bfloat16)
    # top-1 on a single expert: the output is that expert's dense MLP.
    one = MoERouting(1, "softmax_topk", True)
    out = _check(x, logits, experts, one, torch.bfloat16)
    h = (x.double() @ experts.w13[3].double().T).chunk(2, dim=-1)
    dense = (torch.nn.functional.silu(h[0]) * h[1]) @ experts.w2[3].double().T
    assert float((out.double() - dense).norm() / dense.norm()) < TOLERANCE[torch.bfloat16]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the junk rows
def test_junk_rows_past_the_step_change_no_other_row() -> None:
    """Padding rows of a CUDA graph (NaN, infinities, huge values in x and in the logits) may route
    anywhere: the real rows keep the bits of a call without them."""
    gen = torch.Generator().manual_seed(4)
    m, e, h = 20, 8, 64
    x = torch.randn(m, h, generator=gen).to(torch.bfloat16)
    logits = torch.randn(m, e, generator=gen)
    experts = _experts(e, h, 48, torch.bfloat16, gen)
    clean = MOE_KERNEL.op(x, logits, experts, SILU)
    junk_x = torch.tensor([float("nan"), float("inf"), 3e38]).repeat_interleave(h).view(3, h)
    junk_logits = torch.tensor([float("nan"), float("inf"), -3e38]).repeat_interleave(e).view(3, e)
    junk_logits[2, 5] = 3e38
    padded = MOE_KERNEL.op(
        torch.cat([x, junk_x.to(torch.bfloat16)]), torch.cat([logits, junk_logits]), experts, SILU
    )
    assert torch.equal(padded[:m], clean)
    assert torch.equal(MOE_KERNEL.op(x, logits, experts, SILU), clean)  # and the same bits again


def test_fp8_experts_with_per_channel_scales() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(30, 96, generator=gen).to(torch.bfloat16)
    logits = torch.randn(30, 8, generator=gen)
    experts = _experts(8, 96, 64, torch.bfloat16, gen, fp8=True)
    _check(x, logits, experts, SILU, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_biases_with_the_clamped_swiglu(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(13, 64, generator=gen) * 4).to(dtype)  # large enough that the clamps act
    logits = torch.randn(13, 16, generator=gen)
    experts = _experts(16, 64, 48, dtype, gen, bias=True)
    h = x.double() @ experts.w13[0].double().T
    assert float(h.abs().max()) > GPT_OSS.swiglu_limit  # type: ignore[operator]
    _check(x, logits, experts, GPT_OSS, dtype)


@pytest.mark.parametrize(("split_k", "weight_major"), [(3, False), (1, True)])
def test_split_down_product_and_weight_major_dots(split_k: int, weight_major: bool) -> None:
    """Launch variants the shipped configs may name: the down product's float32 partial sums over
    K splits (summed by the combine), and dots with the weight tile as their M side."""
    gen = torch.Generator().manual_seed(7)
    tiles = GemmTiles(block_n=32, block_k=16, num_warps=4, num_stages=2)
    config = MoEConfig(16, tiles, tiles, split_k, weight_major)
    assert plan_launch(config, 11, 8, 64, 80, 2).split_k == split_k
    x = torch.randn(11, 64, generator=gen).to(torch.bfloat16)
    logits = torch.randn(11, 8, generator=gen)
    experts = _experts(8, 64, 80, torch.bfloat16, gen, bias=True)
    got = fused_moe_forward(x, logits, experts, SILU, config)
    want = moe_forward_reference(x.double(), logits.double(), _float64(experts), SILU)
    assert float((got.double() - want).norm() / want.norm()) <= TOLERANCE[torch.bfloat16]


def test_the_operator_is_opaque_to_compile() -> None:
    gen = torch.Generator().manual_seed(8)
    experts = _experts(8, 64, 32, torch.float32, gen)
    logits = torch.randn(5, 8, generator=gen)

    def block(x: torch.Tensor) -> torch.Tensor:
        return MOE_KERNEL.op(x * 2.0, logits, experts, SILU) + 1.0

    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(torch.compile(block, backend="aot_eager", fullgraph=True)(x), block(x))


H100 = "NVIDIA H100 80GB HBM3"
MODEL_SHAPES = [(128, 8, 2048, 768), (32, 4, 2880, 2880), (8, 2, 4096, 14336)]


@pytest.mark.parametrize("device", [H100, "AMD Instinct MI300X", "cpu"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_shipped_configs_cover_the_models_at_every_size(device: str, weight_dtype: torch.dtype) -> None:
    for e, k, h, i in MODEL_SHAPES:
        for m in (1, 2, 16, 64, 65, 512, 4096, 40000):
            config = moe_config(
                device, num_experts=e, hidden_size=h, intermediate_size=i, top_k=k,
                dtype=torch.bfloat16, weight_dtype=weight_dtype, tokens=m,
            )  # fmt: skip
            plan = plan_launch(config, m, e, h, i, k)
            assert 1 <= plan.split_k <= MAX_SPLIT_K
            assert plan.k_per_split % config.down.block_k == 0
            assert plan.split_k * plan.k_per_split >= i > (plan.split_k - 1) * plan.k_per_split
            assert plan.gate_up_groups * config.gate_up.block_n // 2 >= i
            assert plan.down_groups * config.down.block_n >= h
            if m * k <= 8 * e:  # decode steps: a few rows per expert, small blocks
                assert config.block_m == 16


def test_bad_config_params_are_refused() -> None:
    good = {
        "BLOCK_M": 16, "GATE_UP_BLOCK_N": 64, "GATE_UP_BLOCK_K": 128, "GATE_UP_WARPS": 4, "GATE_UP_STAGES": 4,
        "DOWN_BLOCK_N": 64, "DOWN_BLOCK_K": 128, "DOWN_WARPS": 4, "DOWN_STAGES": 4,
    }  # fmt: skip
    assert parse_config(good, "here").down_split_k == 0
    assert parse_config({**good, "DOWN_SPLIT_K": 2, "WEIGHT_MAJOR": True}, "here").weight_major
    for bad in (
        {"BLOCK_M": 24},
        {"GATE_UP_BLOCK_N": 16},
        {"DOWN_WARPS": 0},
        {"BLOCK_N": 64},
        {"WEIGHT_MAJOR": 1},
    ):
        with pytest.raises(TunedConfigError, match="here"):
            parse_config({**good, **bad}, "here")


def test_logits_in_the_model_dtype_route_as_their_float32_values() -> None:
    """The engine passes the router's bfloat16 output uncast (`logits_in_model_dtype`)."""
    assert MOE_KERNEL.logits_in_model_dtype
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    logits = torch.randn(7, 16, generator=gen).to(torch.bfloat16)
    experts = _experts(16, 64, 32, torch.bfloat16, gen)
    routing = dataclasses.replace(SILU, top_k=4)
    assert torch.equal(
        MOE_KERNEL.op(x, logits, experts, routing), MOE_KERNEL.op(x, logits.float(), experts, routing)
    )
