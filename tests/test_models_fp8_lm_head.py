"""The LM head in FP8 (`quantize_lm_head=True` with `quantization="fp8"`), on the CPU.

What must hold: the head becomes FP8 per vocabulary row in exactly the decoder layers' format
(tied models keep their embedding for the lookup and get an FP8 copy for the head); its logits
stay within the error FP8 rounding allows of the dense head's; a platform kernel gets the head
only when it declares FP8 weights; the engine generates with it; and the option is refused,
naming what to change, wherever it cannot run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pydantic
import pytest
import torch
from models_harness import TINY_DECODER, paged_greedy, random_prompts, save_checkpoint, tiny_hf_model
from torch import nn
from transformers import GPTNeoXConfig, LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.models.decoder import DecoderForCausalLM
from pagedserve.models.fp8 import FP8_MAX, Fp8Linear, quantize_rows, scaled_linear
from pagedserve.models.loader import load_model
from pagedserve.models.platform_linear import route_lm_head
from pagedserve.platforms.api import LinearKernel
from pagedserve.worker.startup.device_model import _route_linear_layers

VOCAB = TINY_DECODER["vocab_size"]
HIDDEN = TINY_DECODER["hidden_size"]
PROMPTS = random_prompts(VOCAB, [5, 17, 9], seed=21)
FP8 = torch.float8_e4m3fn
HEAD_CALLS: list[tuple[int, torch.dtype]] = []  # (rows, weight dtype) of every test-kernel call


@torch.library.custom_op("pagedserve_tests::fp8_head_linear", mutates_args=())
def _recording_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """The `LinearKernel.op` contract computed plainly: `x @ (weight * scale[:, None]).T + bias`."""
    HEAD_CALLS.append((x.shape[0], weight.dtype))
    w = weight.to(x.dtype) * (scale[:, None].to(x.dtype) if scale is not None else 1)
    return torch.nn.functional.linear(x, w, bias)


@_recording_linear.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


FP8_KERNEL = LinearKernel(
    name="recording FP8 test GEMM", op=_recording_linear, weight_dtypes=frozenset({FP8})
)
DENSE_KERNEL = LinearKernel(
    name="recording 16-bit test GEMM", op=_recording_linear, weight_dtypes=frozenset()
)


class _Platform:
    """What `_route_linear_layers` asks of a platform: its linear kernel."""

    def __init__(self, kernel: LinearKernel) -> None:
        self.kernel = kernel

    def linear_kernel(self) -> LinearKernel:
        return self.kernel


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(**TINY_DECODER, tie_word_embeddings=request.param)
    return save_checkpoint(tiny_hf_model(config, seed=4), tmp_path_factory.mktemp("tiny"))


def _native(path: Path, **options: object) -> DecoderForCausalLM:
    model = load_model(path, dtype=torch.bfloat16, quantization="fp8", **options).model  # type: ignore[arg-type]
    assert isinstance(model, DecoderForCausalLM)
    return model


def _dense_head(model: DecoderForCausalLM) -> torch.Tensor:  # [vocab, hidden] in the model's dtype
    return (model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach()


def _hidden_states(rows: int) -> torch.Tensor:  # [rows, hidden] bfloat16, like a final RMSNorm's
    gen = torch.Generator().manual_seed(5)
    channel_gain = torch.logspace(-1, 1, HIDDEN)[torch.randperm(HIDDEN, generator=gen)]  # outlier columns
    return (torch.randn(rows, HIDDEN, generator=gen) * channel_gain).to(torch.bfloat16)


def test_the_option_makes_the_head_fp8_per_vocabulary_row(checkpoint: Path) -> None:
    dense = _native(checkpoint)
    fp8 = _native(checkpoint, quantize_lm_head=True)
    assert isinstance(dense.lm_head, nn.Linear | None)  # without the option the head stays dense
    head = fp8.lm_head
    assert isinstance(head, Fp8Linear)
    assert head.weight.dtype == FP8 and head.weight.shape == (VOCAB, HIDDEN)
    assert head.weight_scale.dtype == torch.float32 and head.weight_scale.shape == (1, VOCAB)
    # Exactly the decoder layers' format: `quantize_rows` of the dense head, amax(row) / 448.
    codes, scales = quantize_rows(_dense_head(dense))
    assert torch.equal(head.weight.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(head.weight_scale, scales.reshape(1, -1))
    amax = _dense_head(dense).float().abs().amax(dim=1)
    torch.testing.assert_close(head.weight_scale.reshape(-1), amax / FP8_MAX, rtol=1e-6, atol=0)
    # The embedding is looked up, not multiplied: it stays in the model's dtype, bit for bit (for
    # a tied model the FP8 head is a copy beside it).
    assert fp8.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(fp8.model.embed_tokens.weight, dense.model.embed_tokens.weight)
    assert sum(isinstance(m, Fp8Linear) for m in fp8.modules()) == 4 * TINY_DECODER["num_hidden_layers"] + 1


def test_fp8_head_logits_stay_within_the_fp8_rounding_bound(checkpoint: Path) -> None:
    """The same hidden states through the dense head (float64, the reference) and the FP8 head.

    The bound, derived from the formats: e4m3 keeps 3 mantissa bits, so rounding a value of a
    row with scale s to the FP8 grid moves it by at most max(2^-4 |v|, 2^-10 s) (relative half
    ulp in the normal range; half the subnormal spacing 2^-9, in units of s, below 2^-6 s). Both
    the head's rows (per row) and the hidden states (per token, `scaled_linear`) are rounded so,
    hence |dz_v| <= sum_k (|h_k| e_w[v, k] + e_h[k] |W_vk| + e_h[k] e_w[v, k]); the float32
    accumulation adds at most hidden * 2^-24 of sum_k |h_k W_vk|, and the product is rounded to
    bfloat16 (2^-8 of |z|) before the float32 logits."""
    dense, fp8 = _native(checkpoint), _native(checkpoint, quantize_lm_head=True)
    hidden = _hidden_states(12)
    w = _dense_head(dense).double()
    h = hidden.double()
    reference = h @ w.t()
    got = fp8.compute_logits(hidden)
    assert got.dtype == torch.float32 and got.shape == (12, VOCAB)

    def rounding(x: torch.Tensor) -> torch.Tensor:  # the per-element FP8 error bound, rows scaled
        scale = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
        return torch.maximum(x.abs() * 2**-4, scale * 2**-10)

    e_h, e_w = rounding(h), rounding(w)
    products = h.abs() @ w.abs().t()
    bound = (
        h.abs() @ e_w.t()
        + e_h @ w.abs().t()
        + e_h @ e_w.t()
        + products * HIDDEN * 2**-24
        + got.double().abs() * 2**-8
    )
    error = (got.double() - reference).abs()
    assert bool((error <= bound).all()), float((error - bound).max())
    assert float(error.max()) > 0  # FP8 really ran: the dense head's logits would be exact here
    # The dense head of the same model stays the default: its logits are the plain product.
    torch.testing.assert_close(dense.compute_logits(hidden), (hidden @ _dense_head(dense).t()).float())


def test_a_kernel_gets_the_fp8_head_only_when_it_takes_fp8(checkpoint: Path) -> None:
    model = _native(checkpoint, quantize_lm_head=True)
    hidden = _hidden_states(3)
    head = model.lm_head
    assert isinstance(head, Fp8Linear)
    fallback = scaled_linear(hidden, head.weight, head.weight_scale, None).float()
    torch.testing.assert_close(model.compute_logits(hidden), fallback, rtol=0, atol=0)

    assert not route_lm_head(model, DENSE_KERNEL, torch.bfloat16)  # declares no FP8 weights
    assert model.head_kernel is None
    HEAD_CALLS.clear()
    torch.testing.assert_close(model.compute_logits(hidden), fallback, rtol=0, atol=0)
    assert HEAD_CALLS == []

    _route_linear_layers(model, _Platform(FP8_KERNEL), torch.bfloat16, programmatic=False)  # type: ignore[arg-type]
    assert model.head_kernel is FP8_KERNEL
    HEAD_CALLS.clear()
    logits = model.compute_logits(hidden)
    assert HEAD_CALLS == [(3, FP8)]  # the codes and their scales, not a widened copy
    expected = _recording_linear(hidden, head.weight, head.weight_scale.reshape(-1), None).float()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_a_dense_head_still_takes_any_kernel(checkpoint: Path) -> None:
    model = _native(checkpoint)
    assert route_lm_head(model, DENSE_KERNEL, torch.bfloat16)
    assert model.head_kernel is DENSE_KERNEL
    assert not route_lm_head(model, DENSE_KERNEL, torch.float32)  # a head in another dtype keeps torch's
    assert model.head_kernel is None


def test_greedy_generation_through_the_engine(checkpoint: Path) -> None:
    """cpu_reference generates with the FP8 head, and its greedy tokens are those of the same
    loaded model driven step by step by the test harness (the head's logits, not the engine's
    scheduling, decide them)."""
    llm = LLM(
        str(checkpoint),
        platform="cpu_reference",
        quantization="fp8",
        quantize_lm_head=True,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=4,
        max_model_len=64,
        num_kv_blocks=32,
    )
    loaded = llm.engine.setup.loaded
    assert loaded is not None  # an in-process engine holds its model
    model = loaded.model
    assert isinstance(model, DecoderForCausalLM) and isinstance(model.lm_head, Fp8Linear)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert [len(t) for t in tokens] == [8] * len(PROMPTS)
    assert tokens == paged_greedy(model, PROMPTS, 8)


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_the_option_needs_fp8_weights(quantization: str | None) -> None:
    with pytest.raises(pydantic.ValidationError, match=r"quantize_lm_head=True .* add quantization='fp8'"):
        EngineArgs(quantize_lm_head=True, quantization=quantization)
    with pytest.raises(ValueError, match=r"quantize_lm_head=True needs quantization='fp8'"):
        load_model("unused", quantize_lm_head=True, quantization=quantization)  # type: ignore[arg-type]
    assert EngineArgs(quantization="fp8", quantize_lm_head=True).quantize_lm_head
    assert EngineArgs().quantize_lm_head is False  # off by default


def test_tensor_parallelism_is_refused_by_name() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"tensor_parallel_size=2.*use tensor_parallel_size=1"):
        EngineArgs(quantization="fp8", quantize_lm_head=True, tensor_parallel_size=2)


def test_heads_it_cannot_quantize_are_refused(checkpoint: Path, tmp_path: Path) -> None:
    model = _native(checkpoint)
    model.packed_head = object()  # type: ignore[assignment]  # only its presence is read
    with pytest.raises(ValueError, match=r"packed 4-bit codes \(quantization='gguf'\)"):
        model.quantize_head_fp8()
    model.packed_head = None
    model.vocab_parallel = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"sharded over tensor-parallel ranks; use tensor_parallel_size=1"):
        model.quantize_head_fp8()
    # The transformers fallback keeps its own dense head: refused at load, naming both options.
    GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"transformers fallback.*drop quantization= and quantize_lm_head"):
        load_model(
            tmp_path, dtype=torch.bfloat16, load_format="dummy", quantization="fp8", quantize_lm_head=True
        )


def test_the_command_line_flag() -> None:
    from pagedserve.cli.engine_options import add_engine_options, engine_args_from
    from pagedserve.cli.main import build_parser

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_args_from(parser.parse_args([]), None).quantize_lm_head is False
    on = engine_args_from(parser.parse_args(["--quantization", "fp8", "--quantize-lm-head"]), None)
    assert on.quantization == "fp8" and on.quantize_lm_head is True
    with pytest.raises(
        SystemExit, match=r"invalid engine options: quantize_lm_head=True .*--quantization fp8"
    ):
        engine_args_from(parser.parse_args(["--quantize-lm-head"]), None)
    for command in (["generate", "hi"], ["serve"], ["bench", "throughput", "--workload", "w.json"]):
        parsed = build_parser().parse_args([*command, "--quantization", "fp8", "--quantize-lm-head"])
        assert parsed.engine_quantize_lm_head is True, command
