"""SamplingParams: vLLM-compatible defaults, normalization and validation errors that name the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pagedserve.sampling import SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert p.stop_strings == () and p.stop_ids == () and p.bias == {}
    assert p.skip_special_tokens and p.detokenize and not p.ignore_eos and not p.include_stop_str_in_output


def test_normalization() -> None:
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=[7, 9], logit_bias={3: 1})
    assert p.top_k == 0
    assert p.stop == ("###",) and p.stop_strings == ("###",)
    assert p.stop_token_ids == (7, 9) and p.stop_ids == (7, 9)
    assert p.logit_bias == {3: 1.0} and isinstance(p.bias[3], float)
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ("a", "bc")


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0, seed=3).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type is SamplingType.RANDOM_SEED


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"temperature": -0.1}, "temperature", "[0, inf)"),
        ({"temperature": float("nan")}, "temperature", "[0, inf)"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", ">= -1"),
        ({"top_k": 2.5}, "top_k", ">= -1"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"min_p": 1.1}, "min_p", "[0, 1]"),
        ({"n": 0}, "n", ">= 1"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"logprobs": -1}, "logprobs", ">= 0"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", ">= 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "(0, inf)"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "(0, inf)"),
        ({"stop": 5}, "stop", "a str, a list of str"),
        ({"stop": ["ok", 3]}, "stop", "a str, a list of str"),
        ({"stop": [""]}, "stop", "empty string"),
        ({"stop_token_ids": "12"}, "stop_token_ids", "list of token ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "ints >= 0"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias", "ints >= 0"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias", "finite"),
        ({"seed": 1.5}, "seed", "int"),
        ({"seed": 2**64}, "seed", "[-2**63, 2**64)"),
        ({"temperature": True}, "temperature", "[0, inf)"),
        ({"n": True}, "n", ">= 1"),
        ({"ignore_eos": 1}, "ignore_eos", "bool"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", "<= max_tokens"),
        ({"stop": "x", "detokenize": False}, "stop", "detokenize=True"),
    ],
)
def test_out_of_range_values_raise_naming_field(kwargs: dict[str, Any], field: str, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert field in str(info.value) and allowed in str(info.value)


def test_boundary_values_are_accepted() -> None:
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(min_tokens=5, max_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=1000, seed=-(2**63), logprobs=0, prompt_logprobs=0)


def test_unknown_keyword_names_it() -> None:
    with pytest.raises(TypeError, match="best_of_typo"):
        SamplingParams(best_of_typo=2)  # type: ignore[call-arg]


def test_mutable_as_vllm_and_checked_again_when_copied() -> None:
    p = SamplingParams(max_tokens=8)
    p.max_tokens = 9  # vLLM's SamplingParams is mutable too
    assert p.max_tokens == 9
    assert dataclasses.replace(p, max_tokens=3).max_tokens == 3
    with pytest.raises(ValueError, match="max_tokens"):
        dataclasses.replace(p, max_tokens=0)
    p.stop = ["x"]  # a list set later is normalised in the copy an engine keeps
    copy = p.clone()
    assert copy.stop == ("x",) and copy is not p
    copy.max_tokens = 1
    assert p.max_tokens == 9  # the clone is independent
    p.max_tokens = 0
    with pytest.raises(ValueError, match=r"^max_tokens"):
        p.checked_copy()


def test_logit_bias_is_copied() -> None:
    bias = {1: 2.0}
    p = SamplingParams(logit_bias=bias)
    bias[1] = 5.0
    assert p.bias == {1: 2.0}
