"""vLLM's everyday Python idioms with only the import changed: every prompt form of `generate`
alone and in lists (and a clear refusal of anything else: never a silently wrong prompt), vLLM's
module paths, `SamplingParams.clone` and the older `guided_decoding` spelling, `llm.llm_engine`,
`get_default_sampling_params` from the model's generation config, `RequestOutput.metrics`, and
`chat`'s
`continue_final_message`, `chat_template_kwargs` and `tools`."""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from pathlib import Path

import pytest
from server_support import build_tiny_model

from pagedserve import LLM
from pagedserve.inputs import TextPrompt, TokensPrompt
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "do_sample": True})
    )
    return LLM(str(folder), max_model_len=128, num_kv_blocks=64, block_size=16)


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_every_prompt_form_alone_and_in_lists(llm: LLM) -> None:
    text = "Hello there"
    ids = llm.get_tokenizer().encode(text)
    expected = _tokens(llm.generate(ids, GREEDY, use_tqdm=False))
    forms: list[object] = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    forms += [TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids)]
    for form in forms:
        assert _tokens(llm.generate(form, GREEDY, use_tqdm=False)) == expected, form  # type: ignore[arg-type]
    mixed = llm.generate(forms, GREEDY, use_tqdm=False)  # type: ignore[arg-type]
    assert _tokens(mixed) == expected * len(forms)
    assert _tokens(llm.generate([ids, tuple(ids)], GREEDY, use_tqdm=False)) == expected * 2


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ({"prompt_ids": [1, 2]}, r"unknown prompt key\(s\) \['prompt_ids'\]"),
        ({"prompt": "x", "multi_modal_data": {}}, "multi-modal inputs are not supported"),
        ({}, "needs 'prompt'"),
        ({"prompt": 5}, r"\['prompt'\] must be a string, got int"),
        ({"prompt_token_ids": "abc"}, "must be a list of token ids, got str"),
        (["ok", {"prompt_token_ids": [1.5]}], r"prompt 1\['prompt_token_ids'\] must hold int token ids"),
        (["ok", 7], "prompt 1 must be a string, a list of token ids, a TextPrompt"),
        (["ok", b"bytes"], "got bytes"),
        (42, "prompts must be a string, a list of token ids, a TextPrompt .* got int"),
        ({"a", "b"}, "got set"),
        ([], "prompts is empty"),
    ],
)
def test_anything_else_is_refused_naming_it(llm: LLM, prompts: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)  # type: ignore[arg-type]


def test_vllm_module_paths_and_sampling_params_idioms() -> None:
    assert RequestOutput.__name__ == "RequestOutput" and CompletionOutput.__name__ == "CompletionOutput"
    assert RequestOutputKind.FINAL_ONLY.value == "final_only"
    params = SamplingParams(temperature=0.5, stop=["x"])
    copy = params.clone()
    assert copy == params and copy is not params
    regex = StructuredOutputsParams(regex="a+")
    with pytest.warns(DeprecationWarning, match="structured_outputs"):
        old = SamplingParams(guided_decoding=regex)
    assert old.structured_outputs == regex
    with pytest.raises(ValueError, match="not both"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SamplingParams(guided_decoding=regex, structured_outputs=regex)
    with pytest.warns(DeprecationWarning, match="StructuredOutputsParams"):
        from pagedserve.sampling_params import GuidedDecodingParams
    assert GuidedDecodingParams is StructuredOutputsParams
    with pytest.raises(TypeError, match="best_of"):
        SamplingParams(best_of=2)  # type: ignore[call-arg]  # unknown fields still fail naming them


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("one two three four five six seven eight nine ten")
    (cut,) = llm.generate(
        ids, SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=3), use_tqdm=False
    )
    (tail,) = llm.generate(ids[-3:], GREEDY, use_tqdm=False)
    assert cut.prompt_token_ids == ids[-3:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)  # type: ignore[arg-type]


def test_allowed_token_ids_restrict_sampling(llm: LLM) -> None:
    allowed = [1000, 2000, 3000]
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed
    )
    (out,) = llm.generate("Hello", params, use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= set(allowed)
    (greedy,) = llm.generate("Hello", dataclasses.replace(params, temperature=0), use_tqdm=False)
    assert set(greedy.outputs[0].token_ids) <= set(allowed)
    with pytest.raises(ValueError, match=r"allowed_token_ids must be token ids in \[0, 49152\)"):
        llm.generate("Hello", SamplingParams(allowed_token_ids=[49152]), use_tqdm=False)
    for bad in ([], [-1], "12"):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)  # type: ignore[arg-type]


def test_request_output_metrics(llm: LLM) -> None:
    before = time.time()
    (out,) = llm.generate("Hello", GREEDY, use_tqdm=False)
    m = out.metrics
    assert m is not None and m.first_token_time is not None and m.finished_time is not None
    assert before <= m.arrival_time <= m.first_token_time <= m.finished_time <= time.time()
    assert m.time_to_first_token == m.first_token_time - m.arrival_time


def test_engine_and_default_sampling_params(llm: LLM) -> None:
    assert llm.llm_engine is llm.engine
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.6, 0.9, 20, 7)
    out = llm.generate("Hi", use_tqdm=False)  # no params: the model's defaults
    assert len(out[0].outputs[0].token_ids) <= 7


def test_chat_options_reach_the_template(llm: LLM) -> None:
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if tools %}[tools:{{ tools | length }}]{% endif %}{{ greeting | default('') }}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    tokenizer = llm.get_tokenizer()

    def tokens_of(text: str) -> list[list[int]]:
        return _tokens(
            llm.generate([tokenizer.encode(text, add_special_tokens=False)], GREEDY, use_tqdm=False)
        )

    options = {"chat_template": template, "chat_template_kwargs": {"greeting": "hey"}, "tools": [tool]}
    got = llm.chat(conversation, GREEDY, use_tqdm=False, **options)  # type: ignore[arg-type]
    assert _tokens(got) == tokens_of("<user>hi<assistant>Hel[tools:1]hey<assistant>")
    # The last message is continued: the text stops right after it.
    got = llm.chat(
        conversation,
        GREEDY,
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
        **options,  # type: ignore[arg-type]
    )
    assert _tokens(got) == tokens_of("<user>hi<assistant>Hel")
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(conversation, GREEDY, use_tqdm=False, continue_final_message=True)


def test_generation_defaults_without_a_config(tmp_path: Path) -> None:
    from pagedserve.entrypoints.llm import generation_defaults

    assert generation_defaults(str(tmp_path)) == SamplingParams()
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"generation_config\.json: temperature"):
        generation_defaults(str(tmp_path))
