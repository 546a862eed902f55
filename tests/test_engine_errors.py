"""Bad input to the offline API gets a clear ValueError naming the problem, and leaves the engine
usable for the next call."""

from __future__ import annotations

from pathlib import Path

import pytest
from models_harness import save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    path: Path = save_checkpoint(tiny_hf_model(config, seed=0), tmp_path_factory.mktemp("tiny"))
    return LLM(
        str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=32, num_kv_blocks=16, block_size=4
    )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"block_size": 0}, "block_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"load_format": "pickle"}, "load_format"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_engine_arguments_name_the_field(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        LLM("/nonexistent", **kwargs)


def test_missing_model_path_says_so() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model/dir")


def test_prompt_longer_than_context_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 30], SamplingParams(max_tokens=8, detokenize=False), use_tqdm=False)
    # The engine is still usable and nothing leaked.
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert llm.engine.core.scheduler.kv.stats().num_blocks_in_use == 0


def test_token_ids_outside_vocab_are_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt 1: .*\[0, 64\)"):
        llm.generate([[1, 2], [5, 64]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_string_prompt_without_tokenizer_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", GREEDY, use_tqdm=False)


def test_detokenize_needs_a_tokenizer(llm: LLM) -> None:
    with pytest.raises(ValueError, match="detokenize=False"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_params_list_must_match_prompts(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[1], [2], [3]], [GREEDY, GREEDY], use_tqdm=False)


def test_empty_prompt_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="no tokens"):
        llm.generate([[]], GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": 5}, "stop"),
    ],
)
def test_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
