"""Constrained decoding in the engine: outputs follow their constraint under random sampling, with
draft tokens, with preemption and chunked prefill, and unconstrained requests sharing the batch are
unchanged. A tiny random Llama with SmolLM2's tokenizer: a random model is the hardest case for a
grammar, since nothing but the mask keeps it on track."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch
from server_support import build_tiny_model

from pagedserve import LLM, SamplingParams
from pagedserve.sampling.grammar_mask import apply_token_bitmask
from pagedserve.structured.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["age"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    yield LLM(str(model_dir), dtype="float32", max_model_len=512, num_kv_blocks=256, block_size=16)


def _params(seed: int, max_tokens: int = 200, **constraint: object) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(disable_any_whitespace=True, **constraint),  # type: ignore[arg-type]
    )


def test_json_schema_20_seeds_validate(llm: LLM) -> None:
    outs = llm.generate(
        ["A pet as JSON:"] * 20, [_params(seed, json=SCHEMA) for seed in range(20)], use_tqdm=False
    )
    for out in outs:
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", sample.text
        value = json.loads(sample.text)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"])  # the schema's property order is kept


def test_regex_choice_and_forced_grammar(llm: LLM) -> None:
    regex = r"[a-c]{2}-[0-9]{3}"
    prompts = ["x"] * 30
    params = (
        [_params(s, regex=regex) for s in range(10)]
        + [_params(s, choice=["red", "green", "blue"]) for s in range(10)]
        + [_params(s, grammar='root ::= "paged" "serve"') for s in range(10)]
    )
    outs = llm.generate(prompts, params)
    texts = [o.outputs[0].text for o in outs]
    assert all(re.fullmatch(regex, t) for t in texts[:10]), texts[:10]
    assert all(t in ("red", "green", "blue") for t in texts[10:20]), texts[10:20]
    assert texts[20:] == ["pagedserve"] * 10


def test_json_object_and_n_samples(llm: LLM) -> None:
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=3,
        max_tokens=120,
        structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    )
    (out,) = llm.generate(["{"], params)
    assert len(out.outputs) == 4
    assert any(s.finish_reason == "stop" for s in out.outputs)
    for sample in out.outputs:
        if sample.finish_reason == "stop":  # a random model may still be mid-object at max_tokens
            assert isinstance(json.loads(sample.text), dict)


def test_unconstrained_greedy_unchanged_beside_constrained(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["The weather today is"], greedy)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["The weather today is", "A pet as JSON:", "x"],
        [greedy, _params(1, json=SCHEMA), _params(2, regex=r"[0-9]{5}")],
    )
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch(r"[0-9]{5}", mixed[2].outputs[0].text)


def test_drafts_preemption_and_chunked_prefill(model_dir: Path) -> None:
    # Few blocks and a small step budget: requests are preempted and long prompts are chunked;
    # n-gram drafts are scored every step and must be rejected where the grammar refuses them.
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=24,
        block_size=16,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_speculative_tokens=3,
    )
    prompt = "ab ab ab ab " * 20  # repetitive: the n-gram proposer drafts from it
    params = [_params(s, json=SCHEMA, max_tokens=120) for s in range(6)]
    outs = llm.generate([prompt] * 6, params)
    for out in outs:
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), SCHEMA)
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_apply_token_bitmask_matches_bits() -> None:
    vocab = 70
    logits = torch.randn(3, vocab)
    allowed = [[0, 5, 69], list(range(vocab)), [33]]
    bitmask = torch.zeros(3, 3, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            word = int(bitmask[row, t // 32]) | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask, fused=False)
    fused = logits.clone()
    apply_token_bitmask(fused, bitmask)  # xgrammar's kernel: the same logits
    assert torch.equal(fused, masked)
    for row, tokens in enumerate(allowed):
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[tokens] = True
        assert torch.equal(masked[row][keep], logits[row][keep])
        assert bool(torch.isinf(masked[row][~keep]).all())
    with pytest.raises(ValueError, match="does not cover"):
        apply_token_bitmask(logits, bitmask[:, :2])


def test_bad_constraints_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate(["x"], _params(0, regex="(ab"))
    with pytest.raises(ValueError, match="invalid JSON schema"):
        llm.generate(["x"], _params(0, json={"type": "nope"}))
    with pytest.raises(ValueError, match="grammar"):
        llm.generate(["x"], _params(0, grammar="root ::= undefined_rule"))


@pytest.mark.slow
def test_smollm2_json_schema_validates() -> None:
    # The embedded SmolLM2-135M, a real model: its own JSON at temperature 1, with any whitespace.
    llm = LLM(max_model_len=512, num_kv_blocks=128)
    schema = {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "sizes": {
                "type": "array",
                "items": {"type": "integer", "minimum": 1, "maximum": 9},
                "maxItems": 3,
            },
            "shape": {"type": "object", "properties": {"round": {"type": "boolean"}}, "required": ["round"]},
        },
        "required": ["colour", "sizes", "shape"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        n=4, temperature=1.0, seed=5, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema)
    )
    (out,) = llm.generate(["Describe a ball as JSON."], params, use_tqdm=False)
    for sample in out.outputs:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), schema)


def test_abort_while_grammar_compiles(llm: LLM) -> None:
    engine = llm.engine
    schema = {"type": "object", "properties": {"never_seen_before": {"type": "integer"}}}
    params = SamplingParams(max_tokens=8, n=2, structured_outputs=StructuredOutputsParams(json=schema))
    engine.add_request("compiling", "x", params)
    assert engine.core._awaiting_grammar  # held outside the scheduler until compiled
    engine.abort_request("compiling")
    assert not engine.core._awaiting_grammar
    for _ in range(3):
        engine.step()
    assert not engine.has_unfinished_requests()
    assert not engine.core.structured or not engine.core.structured.active


def test_asynchronous_scheduling_runs_constrained_steps_synchronously(model_dir: Path) -> None:
    # With asynchronous scheduling a grammar still sees every step's tokens before it masks the
    # next step: steps run synchronously while a request is constrained, and ahead again after.
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=512,
        num_kv_blocks=256,
        block_size=16,
        async_scheduling=True,
    )
    assert llm.engine.core.pipeline is not None
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain_before = llm.generate(["The sky is"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(
        ["A pet as JSON:"] * 4 + ["The sky is"],
        [_params(seed, json=SCHEMA) for seed in range(4)] + [greedy],
        use_tqdm=False,
    )
    for out in outs[:4]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert outs[4].outputs[0].token_ids == plain_before  # the unconstrained request is unchanged
    assert llm.generate(["The sky is"], greedy, use_tqdm=False)[0].outputs[0].token_ids == plain_before
