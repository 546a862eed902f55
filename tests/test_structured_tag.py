"""Structural tags (vLLM's `structural_tag`): free text in which, once a trigger appears, the tag's
begin, a JSON value matching its schema and its end are enforced. Both of vLLM's forms: the legacy
{"structures", "triggers"} and xgrammar's {"type": "structural_tag", "format"}. Checked on the
compiled matcher token by token, and in generation by a tiny random Llama with SmolLM2's tokenizer,
pushed towards the trigger by logit_bias (a random model never writes it on its own)."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from server_support import build_tiny_model
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedserve import LLM, SamplingParams
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.structured.xgrammar_backend import XGrammarBackend, check_spec

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
BEGIN, END, TRIGGER = "<function=get_weather>", "</function>", "<function="
LEGACY: dict[str, Any] = {
    "type": "structural_tag",
    "structures": [{"begin": BEGIN, "schema": SCHEMA, "end": END}],
    "triggers": [TRIGGER],
}


def _format(*, at_least_one: bool) -> dict[str, Any]:
    # Whitespace is bounded as pagedserve bounds it for `json`: a random model otherwise stalls in it.
    content = {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 20}
    tag = {"type": "tag", "begin": BEGIN, "content": content, "end": END}
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [TRIGGER],
            "tags": [tag],
            "at_least_one": at_least_one,  # True: the output starts with a tag
            "stop_after_first": at_least_one,
        },
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
    return tok


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    yield LLM(str(model_dir), dtype="float32", max_model_len=512, num_kv_blocks=256, block_size=16)


def _accepts(
    backend: XGrammarBackend, compiled: object, text: str, tokenizer: PreTrainedTokenizerBase
) -> bool:
    """Whether the matcher takes every token of `text` and then the stop token."""
    matcher = backend.new_matcher(compiled, 0)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(tokenizer.eos_token_id)


@pytest.mark.parametrize("form", ["legacy", "format"])
def test_matcher_enforces_the_tag_after_its_trigger(form: str, tokenizer: PreTrainedTokenizerBase) -> None:
    tag = LEGACY if form == "legacy" else _format(at_least_one=False)
    backend = XGrammarBackend(tokenizer, 49152, [tokenizer.eos_token_id])
    compiled = backend.compile(StructuredOutputsParams(structural_tag=json.dumps(tag)))
    good = f'{BEGIN}{{"city": "Paris", "days": 3}}{END}'
    assert _accepts(backend, compiled, "Free text, no tag at all.", tokenizer)
    assert _accepts(backend, compiled, f"Let me look. {good} And again: {good} done", tokenizer)
    assert not _accepts(backend, compiled, f'{BEGIN}{{"city": "Rome", "days": 3}}{END}', tokenizer)
    assert not _accepts(backend, compiled, f'{BEGIN}{{"city": "Paris"}}{END}', tokenizer)  # days missing
    assert not _accepts(backend, compiled, '<function=get_time>{"city": "Paris", "days": 3}' + END, tokenizer)
    assert not _accepts(backend, compiled, f'{BEGIN}{{"city": "Paris", "days": 3}} and more', tokenizer)
    assert not _accepts(backend, compiled, f"text {BEGIN}", tokenizer)  # a tag left open cannot stop


def _tagged_json(text: str) -> Any:
    """The JSON value inside the first tag of `text`."""
    match = re.search(re.escape(BEGIN) + "(.*?)" + re.escape(END), text, re.DOTALL)
    assert match is not None, text
    return json.loads(match.group(1))


def test_legacy_tag_generated_after_a_forced_trigger(llm: LLM, tokenizer: PreTrainedTokenizerBase) -> None:
    # logit_bias makes the trigger's tokens nearly all the model samples in free text, so it
    # writes the trigger within a few dozen tokens; the tag's rest is the grammar's doing.
    trigger_ids = tokenizer.encode(TRIGGER, add_special_tokens=False)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            logit_bias={t: 30.0 for t in trigger_ids},
            stop=[END],
            include_stop_str_in_output=True,
            structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(LEGACY)),
        )
        for seed in range(6)
    ]
    outs = llm.generate(["Weather in Paris?"] * len(params), params, use_tqdm=False)
    for out in outs:
        sample = out.outputs[0]
        assert sample.finish_reason == "stop" and sample.text.endswith(END), sample.text
        jsonschema.validate(_tagged_json(sample.text), SCHEMA)


def test_format_tag_generated(llm: LLM) -> None:
    # at_least_one: the output opens with a tag; with stop_after_first it ends after it.
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            structured_outputs=StructuredOutputsParams(structural_tag=_format(at_least_one=True)),
        )
        for seed in range(6)
    ]
    for out in llm.generate(["x"] * len(params), params, use_tqdm=False):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        assert text.startswith(BEGIN) and text.endswith(END), text
        jsonschema.validate(_tagged_json(text), SCHEMA)


def test_deprecated_guided_decoding_params_take_a_structural_tag(llm: LLM) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from pagedserve.sampling_params import GuidedDecodingParams

        guided = GuidedDecodingParams(structural_tag=json.dumps(_format(at_least_one=True)))
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=120, guided_decoding=guided)
    text = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0].text
    jsonschema.validate(_tagged_json(text), SCHEMA)


def test_params_store_text_and_share_a_compile_key() -> None:
    from_dict = StructuredOutputsParams(structural_tag=LEGACY)
    from_text = StructuredOutputsParams(structural_tag=json.dumps(LEGACY))
    assert from_dict.kind == "structural_tag" and isinstance(from_dict.structural_tag, str)
    assert from_dict.key == from_text.key
    assert StructuredOutputsParams.from_wire(from_dict.to_wire()) == from_dict
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(structural_tag=LEGACY, regex="a")
    with pytest.raises(ValueError, match="structural_tag must be a JSON object"):
        StructuredOutputsParams(structural_tag=["not", "a", "tag"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "a JSON object is needed"),
        ({**LEGACY, "triggers": []}, "triggers must be a non-empty list"),
        ({**LEGACY, "structures": []}, "structures must be a non-empty list"),
        ({**LEGACY, "structures": [{"begin": BEGIN, "end": END}]}, r"structures\[0\]\.schema is missing"),
        ({**LEGACY, "structures": [{"begin": 3, "schema": {}, "end": END}]}, r"structures\[0\]\.begin"),
        (
            {**LEGACY, "structures": [{"begin": BEGIN, "schema": {"type": "nope"}, "end": END}]},
            r"structures\[0\]\.schema: invalid JSON schema at type",
        ),
        ({**LEGACY, "triggers": ["<tool="]}, "does not match any trigger"),
        ({**LEGACY, "format": {"type": "any_text"}}, "either format or structures"),
        ({"type": "structural_tag"}, "must have a format"),
        ({"type": "structural_tag", "format": {"type": "nope"}}, "Format type not recognized: nope"),
    ],
)
def test_malformed_tags_are_refused(llm: LLM, tag: Any, message: str) -> None:
    spec = tag if isinstance(tag, str) else json.dumps(tag)
    params = StructuredOutputsParams(structural_tag=spec)
    with pytest.raises(ValueError, match="invalid structural tag: .*" + message):
        check_spec(params)
    with pytest.raises(ValueError, match="structured_outputs: invalid structural tag"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=params), use_tqdm=False)
