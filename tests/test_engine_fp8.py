"""FP8 on the CPU engine (cpu_reference): an FP8 KV cache and FP8 weights end to end.

What must hold: the cache really is FP8 and half the bytes (twice the blocks in one budget);
scheduling (chunked prefill, prefix caching, swap and recompute preemption) does not change an
FP8 run's tokens; FP8 runs stay close to the float32/bfloat16 run (logprobs of the same tokens);
`Fp8Linear` computes what its dequantized weights say; and requests a platform cannot serve are
refused at engine start naming the platform and what to use instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import LlamaConfig, Qwen2Config

from pagedserve import LLM, SamplingParams
from pagedserve.models.fp8 import Fp8Linear, quantize_rows
from pagedserve.platforms.kv_cache_dtype import resolve_kv_cache_dtype

VOCAB = 96
MAX_NEW = 10
PROMPTS = random_prompts(VOCAB, [5, 17, 30, 3], seed=11)
PROMPTS.append([*PROMPTS[2][:12], 5, 6, 7])  # shares 12 tokens (3 blocks of 4) with PROMPTS[2]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)


def _config(cls: type) -> object:
    return cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tiny_hf_model(_config(LlamaConfig), seed=3), tmp_path_factory.mktemp("llama"))


def _llm(path: Path, dtype: str = "float32", **engine: object) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, dtype=dtype, block_size=4, max_model_len=64, **engine)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_fp8_cache_is_fp8_and_holds_twice_the_blocks(checkpoint: Path) -> None:
    budget = {"cpu_kv_cache_gib": 2**-12, "max_num_seqs": 64}  # 256 KiB: below the useful cap
    plain = _llm(checkpoint, dtype="bfloat16", **budget)
    fp8 = _llm(checkpoint, dtype="bfloat16", kv_cache_dtype="fp8", **budget)
    runner = fp8.engine.core.runner
    assert {c.dtype for c in runner.kv_caches} == {torch.float8_e4m3fn}
    assert runner.kv_scales is not None and len(runner.kv_scales) == len(runner.kv_caches)
    assert fp8.engine.setup.backend.name == "cpu_reference"  # cpu_fast declares no FP8 cache
    assert fp8.engine.setup.num_kv_blocks == 2 * plain.engine.setup.num_kv_blocks
    e5m2 = _llm(checkpoint, kv_cache_dtype="fp8_e5m2", num_kv_blocks=32)
    assert {c.dtype for c in e5m2.engine.core.runner.kv_caches} == {torch.float8_e5m2}


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param({"max_num_batched_tokens": 8, "max_num_seqs": 4, "num_kv_blocks": 128}, id="chunked-8"),
        pytest.param({"num_kv_blocks": 14, "max_num_seqs": 6}, id="recompute-preemption"),
        pytest.param(
            {"num_kv_blocks": 14, "max_num_seqs": 6, "preemption_mode": "swap", "swap_space_gib": 0.01},
            id="swap-preemption",
        ),
    ],
)
def test_scheduling_does_not_change_fp8_tokens(checkpoint: Path, engine: dict) -> None:
    """Quantization is per element, so an FP8 run's tokens do not depend on how steps are cut,
    on blocks reused from the prefix cache, or on blocks swapped out and back (moved bit for bit)."""
    expected = _tokens(_llm(checkpoint, kv_cache_dtype="fp8", num_kv_blocks=128), PROMPTS)
    llm = _llm(checkpoint, kv_cache_dtype="fp8", **engine)
    assert _tokens(llm, PROMPTS) == expected
    if engine["num_kv_blocks"] == 14:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_fp8_prefix_cache_hits(checkpoint: Path) -> None:
    llm = _llm(checkpoint, kv_cache_dtype="fp8", num_kv_blocks=128)
    first = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0]
    again = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 28)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def _prompt_logprobs(llm: LLM, sequences: list[list[int]]) -> torch.Tensor:
    """log p(token | prefix) of every token after the first, all sequences concatenated."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    values = []
    for out, seq in zip(llm.generate(sequences, params, use_tqdm=False), sequences, strict=True):
        assert out.prompt_logprobs is not None
        values += [out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(seq) if i > 0]
    return torch.tensor(values)


@pytest.mark.parametrize(
    "fp8",
    [
        pytest.param({"kv_cache_dtype": "fp8"}, id="kv-e4m3"),
        pytest.param({"kv_cache_dtype": "fp8_e5m2"}, id="kv-e5m2"),
        pytest.param({"quantization": "fp8"}, id="weights"),
        pytest.param({"quantization": "fp8", "kv_cache_dtype": "fp8"}, id="weights-and-kv"),
    ],
)
def test_fp8_logprobs_stay_close_to_bfloat16(checkpoint: Path, fp8: dict) -> None:
    """Teacher-forced on the bfloat16 run's own greedy output: FP8 moves each token's logprob by
    little (the tiny model's logits span a few nats; e4m3 keeps 3 mantissa bits, e5m2 2)."""
    # No prefix caching: a cached prompt block has no prompt logprobs to report.
    engine = {"dtype": "bfloat16", "num_kv_blocks": 128, "enable_prefix_caching": False}
    base = _llm(checkpoint, **engine)
    sequences = [p + t for p, t in zip(PROMPTS, _tokens(base, PROMPTS), strict=True)]
    reference = _prompt_logprobs(base, sequences)
    got = _prompt_logprobs(_llm(checkpoint, **engine, **fp8), sequences)
    error = (got - reference).abs()
    assert float(error.mean()) < 0.05 and float(error.max()) < 0.3, (float(error.mean()), float(error.max()))
    assert float(error.max()) > 0  # FP8 really ran: bit-identical logprobs would mean it did not


def test_fp8_linear_computes_its_dequantized_product() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen) * torch.logspace(-2, 1, 48)[:, None]  # rows of all sizes
    bias = torch.randn(48, generator=gen)
    x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    layer = Fp8Linear(weight, bias.to(torch.bfloat16))
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (1, 48)
    x_codes, x_scales = quantize_rows(x)
    w = layer.weight.float() * layer.weight_scale.t()  # per-output-channel dequantization
    expected = (x_codes.float() * x_scales) @ w.t() + bias.to(torch.bfloat16).float()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 48)
    assert torch.allclose(got.float(), expected, rtol=1e-2, atol=1e-2)  # bfloat16 output rounding
    # Per-channel scales: every row keeps ~3 significant bits, small rows included.
    assert torch.allclose(w, weight, rtol=0.07, atol=0)


def test_fp8_weights_replace_the_decoder_linears_only(checkpoint: Path) -> None:
    llm = _llm(checkpoint, dtype="bfloat16", quantization="fp8", num_kv_blocks=32)
    model = llm.engine.setup.loaded.model
    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8_layers) == 2 * 4  # qkv, o, gate_up, down per layer
    assert not any(isinstance(m, torch.nn.Linear) for m in model.model.modules())
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_fp8_weights_with_qkv_bias(tmp_path: Path) -> None:
    path = save_checkpoint(tiny_hf_model(_config(Qwen2Config), seed=5), tmp_path)
    base = _tokens(_llm(path, dtype="bfloat16", num_kv_blocks=64), PROMPTS[:2])
    got = _tokens(_llm(path, dtype="bfloat16", quantization="fp8", num_kv_blocks=64), PROMPTS[:2])
    agree = sum(a == b for x, y in zip(base, got, strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 0.5 * sum(map(len, base))


def test_unsupported_kv_cache_dtype_names_platform_and_alternative() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is not supported on platform 'rocm'.*'auto'"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, frozenset(), where="platform 'rocm'")
    fnuz = frozenset({torch.float8_e4m3fnuz})
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, fnuz, where="x") == torch.float8_e4m3fnuz
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, frozenset(), where="x") == torch.bfloat16
    with pytest.raises(ValueError, match=r"'fp8_e5m2' is not supported.*use kv_cache_dtype='auto' or 'fp8'"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, fnuz, where="x")


def test_fp8_weights_refuse_float64(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="quantization='fp8' computes with bfloat16"):
        _llm(checkpoint, dtype="float64", quantization="fp8", num_kv_blocks=32)
