"""LoRA adapters on integer-weight layers: a GPTQ, AWQ or compressed-tensors W4A16 checkpoint
served with an adapter gives, in one batch with requests of the base model, the greedy tokens of
transformers' model of the dequantized weights with that adapter merged (and without it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_support import merged_model, write_adapter
from models_harness import hf_greedy, random_prompts
from quantization_support import write_gptq_awq_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.lora.request import LoRARequest

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)


@pytest.mark.parametrize(
    ("fmt", "group", "sym"), [("gptq", 32, True), ("awq", 32, False), ("compressed-tensors", None, True)]
)
def test_adapters_on_integer_weight_layers_give_the_merged_tokens(
    tmp_path: Path, fmt: str, group: int | None, sym: bool
) -> None:
    path, hf = write_gptq_awq_checkpoint(tmp_path, fmt, 4, group, sym, act_order=False)
    folder = write_adapter(
        tmp_path / "adapter",
        hf,
        rank=4,
        alpha=8,
        targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        seed=3,
    )
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=64,
        block_size=4,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=4,
    )
    vocab = hf.config.vocab_size
    prompts = random_prompts(vocab, [7, 12, 5], seed=4)
    lora = LoRARequest("a", 1, str(folder))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[lora, None, lora])
    merged = merged_model(hf, folder)
    for prompt, out, model in zip(prompts, outs, [merged, hf, merged], strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(model, [prompt], MAX_TOKENS)[0]
    assert hf_greedy(merged, prompts, MAX_TOKENS) != hf_greedy(hf, prompts, MAX_TOKENS)
