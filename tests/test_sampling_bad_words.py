"""`SamplingParams.bad_words` (vLLM's field): words the model never generates.

Each word is encoded by the front end's tokenizer (at the start of a text and, when the space
merges into it, after a space); the sampler bans a sequence's last token wherever the generated
tokens end with the rest of it. Checked here: the parameter's validation, the encoding rule, the
per-step bans (drafts included), and whole generations on a tiny random model with a real
byte-level BPE tokenizer, with asynchronous scheduling on: the banned words never appear, the
tokens equal transformers' `generate(bad_words_ids=...)`, and a request without bad words in the
same batch generates what it generates alone. The server's request bodies carry the field too.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from models_harness import TINY_DECODER, save_checkpoint, tiny_hf_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast

from pagedserve import LLM
from pagedserve.config import EngineArgs
from pagedserve.engine.input_processor import InputProcessor, ParamError, bad_words_token_ids
from pagedserve.engine.protocol import EngineCoreRequest
from pagedserve.processes.engine_core import serialization as wire
from pagedserve.sampling.rows import SamplingRequest, SamplingRows, TokenHistories, build_sampling_metadata
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.async_engine import AsyncLLMEngine
from pagedserve.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    field_of_error,
    to_sampling_params,
)

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
CORPUS = [
    "the cat sat on the mat and the dog ran after the cat",
    "hello world, hello there",
    "a quick brown fox jumps over the lazy dog",
]


def _tokenizer() -> PreTrainedTokenizerFast:
    """A 300-token byte-level BPE (GPT-2 style: a leading space merges into the word), trained in
    milliseconds on a few sentences."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return _tokenizer()


@pytest.fixture(scope="module")
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast
) -> tuple[Path, PreTrainedModel]:
    """A tiny random Llama over the tokenizer's vocabulary, saved with the tokenizer."""
    hf = tiny_hf_model(LlamaConfig(**{**TINY_DECODER, "vocab_size": len(tokenizer)}), seed=5)
    folder = save_checkpoint(hf, tmp_path_factory.mktemp("bad-words"))
    tokenizer.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module")
def llm(checkpoint: tuple[Path, PreTrainedModel]) -> LLM:
    # Asynchronous scheduling (off by default on CPU platforms): step N+1 is built before step N's
    # tokens reach the host, so the bans of several-token words must wait for them.
    return LLM(str(checkpoint[0]), max_model_len=128, block_size=4, dtype="float32", async_scheduling=True)


def _recorded(words: list[str], sequences: list[list[int]]) -> SamplingParams:
    params = SamplingParams(temperature=0, bad_words=words)
    params.record_bad_words_token_ids(sequences)
    return params


# ---- the parameter ------------------------------------------------------------------------------


def test_bad_words_are_validated_and_stored_as_a_tuple() -> None:
    assert SamplingParams().bad_words is None and SamplingParams().bad_words_token_ids == ()
    assert SamplingParams(bad_words=["a", " b"]).bad_words == ("a", " b")
    assert SamplingParams(bad_words=[]).bad_words is None  # vLLM's server sends [] for none
    for bad, message in [
        ("word", r"bad_words must be a list of str, got 'word'"),
        ([""], r"bad_words\[0\] must be a non-blank str, got ''"),
        (["ok", "  "], r"bad_words\[1\] must be a non-blank str, got '  '"),
        (["ok", 3], r"bad_words\[1\] must be a non-blank str, got 3"),
        (7, "bad_words must be a list of str"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(bad_words=bad)  # type: ignore[arg-type]


def test_recorded_token_ids_follow_bad_words() -> None:
    params = _recorded(["x"], [[5], [7, 8]])
    assert params.bad_words_token_ids == ((5,), (7, 8))
    assert params == SamplingParams(temperature=0, bad_words=["x"])  # derived: equality ignores them
    assert params.clone().bad_words_token_ids == ((5,), (7, 8))
    # A copy without bad words has nothing they could be the tokens of.
    assert dataclasses.replace(params, bad_words=None).bad_words_token_ids == ()
    with pytest.raises(ValueError, match="bad_words token ids need bad_words"):
        SamplingParams().record_bad_words_token_ids([[1]])
    for bad in ([[]], [[-1]], [["a"]], "ab", [[1.5]]):
        with pytest.raises(ValueError, match="bad_words token ids must be"):
            params.record_bad_words_token_ids(bad)  # type: ignore[arg-type]


# ---- encoding ---------------------------------------------------------------------------------


def test_words_are_encoded_at_the_start_and_after_a_space(tokenizer: PreTrainedTokenizerFast) -> None:
    def enc(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    # "cat" and " cat" are one token each (the space merges into the word): both are banned.
    assert len(enc("cat")) == 1 and len(enc(" cat")) == 1
    assert bad_words_token_ids(tokenizer, ["cat"]) == (enc("cat"), enc(" cat"))
    # Leading whitespace is dropped first, and duplicates once.
    assert bad_words_token_ids(tokenizer, ["  cat", "cat"]) == (enc("cat"), enc(" cat"))
    # Where the space does not merge (the spaced form has another length), only the bare form
    # is banned: its tokens follow the space's anyway (vLLM's rule).
    assert len(enc(" zebra")) != len(enc("zebra"))
    assert bad_words_token_ids(tokenizer, ["zebra"]) == (enc("zebra"),)


def test_the_input_processor_records_the_sequences(tokenizer: PreTrainedTokenizerFast) -> None:
    inputs = InputProcessor(tokenizer, vocab_size=len(tokenizer))
    params = SamplingParams(bad_words=["cat", "zebra"])
    inputs.check_params(params)
    assert params.bad_words_token_ids == bad_words_token_ids(tokenizer, ["cat", "zebra"])
    inputs.check_params(params)  # again (the same params for another prompt): the same value
    assert params.bad_words_token_ids == bad_words_token_ids(tokenizer, ["cat", "zebra"])
    with pytest.raises(ParamError, match="outside the model's vocabulary") as small:
        InputProcessor(tokenizer, vocab_size=200).check_params(SamplingParams(bad_words=["cat"]))
    assert small.value.param == "bad_words"
    with pytest.raises(ParamError, match="this engine has none") as none:
        InputProcessor(None, vocab_size=300).check_params(SamplingParams(bad_words=["cat"], detokenize=False))
    assert none.value.param == "bad_words"


# ---- the per-step bans ---------------------------------------------------------------------------


def _bans(meta: Any) -> set[tuple[int, int]]:
    edits = meta.logit_edits
    if edits is None:
        return set()
    assert bool((edits.values == float("-inf")).all())
    return set(zip(edits.rows.tolist(), edits.token_ids.tolist(), strict=True))


def test_a_sequence_last_token_is_banned_after_the_rest_of_it() -> None:
    words = _recorded(["w"], [[5], [7, 8, 9], [8, 3]])
    plain = SamplingParams(temperature=0)

    def bans(prompt: list[int], output: list[int]) -> set[tuple[int, int]]:
        requests = [SamplingRequest(words, prompt, output), SamplingRequest(plain, prompt, output)]
        return _bans(build_sampling_metadata(requests, vocab_size=16, eos_token_id=None))

    # Row 1 (no bad words) is never touched; a one-token word is banned everywhere.
    assert bans([1, 2], []) == {(0, 5)}
    assert bans([1, 2], [7, 8]) == {(0, 5), (0, 9), (0, 3)}
    assert bans([1, 2], [4, 8]) == {(0, 5), (0, 3)}
    assert bans([1, 2], [7, 8, 1]) == {(0, 5)}
    # Only generated tokens count (vLLM's rule): a prompt ending with 7, 8 bans nothing more.
    assert bans([7, 8], []) == {(0, 5)}
    assert bans([7], [8]) == {(0, 5), (0, 3)}


def test_drafted_positions_see_the_drafts_before_them() -> None:
    rows = SamplingRows(2)
    rows.add(_recorded(["w"], [[7, 8]]), 0)
    # Row 0 has prompt [1] and output [2], then drafts 7, 3 scored at once: three sampled positions.
    token_ids = np.array([[1, 2, 7, 3]], dtype=np.int64)
    histories = TokenHistories(
        token_ids, np.zeros(3, dtype=np.int64), np.ones(3, dtype=np.int64), np.array([2, 3, 4])
    )
    meta = rows.metadata(
        histories, vocab_size=16, eos_token_id=None, device=torch.device("cpu"), generator=None
    )
    assert _bans(meta) == {(1, 8)}  # only the position after draft 7


def test_rows_without_several_token_words_cost_nothing_per_step() -> None:
    rows = SamplingRows(3)
    rows.add(SamplingParams(temperature=0), 0)
    rows.add(_recorded(["w"], [[5], [6]]), 0)
    all_rows = np.arange(2)
    assert not rows.reads_outputs(all_rows)  # the runner never waits for their pending tokens

    def meta(outputs: list[list[int]]) -> Any:
        histories = TokenHistories.from_lists([[1]] * len(outputs), outputs)
        return rows.metadata(
            histories, vocab_size=16, eos_token_id=None, device=torch.device("cpu"), generator=None
        )

    first = meta([[2], [2]])
    assert meta([[2, 3], [2, 4]]) is first  # one-token bans are fixed: one cached metadata
    assert _bans(first) == {(1, 5), (1, 6)}
    rows.add(_recorded(["w"], [[5, 6]]), 0)
    assert rows.reads_outputs(np.arange(3)) and not rows.reads_outputs(all_rows)
    assert _bans(meta([[2], [2], [5]])) == {(1, 5), (1, 6), (2, 6)}


def test_ids_outside_the_vocabulary_are_refused() -> None:
    request = SamplingRequest(_recorded(["w"], [[40]]), [1], [])
    with pytest.raises(ValueError, match=r"bad_words hold token ids outside the vocabulary \[0, 16\)"):
        build_sampling_metadata([request], vocab_size=16, eos_token_id=None)


# ---- whole generations ------------------------------------------------------------------------


def _has_sequence(tokens: list[int], sequence: tuple[int, ...]) -> bool:
    n = len(sequence)
    return any(tuple(tokens[i : i + n]) == sequence for i in range(len(tokens) - n + 1))


def _hf_bad_words(hf: Any, prompt: list[int], sequences: tuple[tuple[int, ...], ...]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            pad_token_id=0,
            bad_words_ids=[list(s) for s in sequences],
        )
    return list(out[0, len(prompt) :].tolist())


def _word_in(tokenizer: PreTrainedTokenizerFast, output: list[int], length: int) -> str | None:
    """A word `output` holds: the text of `length` consecutive tokens of it that is banned as
    exactly those tokens, and only as `length`-token sequences. None if it holds none."""
    for i in range(len(output) - length + 1):
        tokens = tuple(output[i : i + length])
        word = tokenizer.decode(list(tokens))
        if not word.strip() or "\ufffd" in word:  # blank, or part of a character
            continue
        sequences = bad_words_token_ids(tokenizer, [word])
        if tokens in sequences and all(len(s) == length for s in sequences):
            return word
    return None


@pytest.mark.parametrize("length", [1, 2])
def test_greedy_never_generates_a_bad_word_and_matches_transformers(
    llm: LLM,
    checkpoint: tuple[Path, PreTrainedModel],
    tokenizer: PreTrainedTokenizerFast,
    length: int,
) -> None:
    prompts = [tokenizer.encode(text) for text in ("the cat", "hello world", "a quick brown", "the dog")]
    baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    # The first prompt whose greedy output holds such a word gets it banned; the others run
    # beside it without bad words.
    words = [_word_in(tokenizer, out, length) for out in baseline]
    index = next(i for i, w in enumerate(words) if w is not None)
    word, prompt = words[index], prompts[index]
    assert word is not None
    banned = dataclasses.replace(GREEDY, bad_words=[word])
    params = [banned if i == index else GREEDY for i in range(len(prompts))]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    sequences = bad_words_token_ids(tokenizer, [word])
    assert outs[index] != baseline[index]
    assert not any(_has_sequence(outs[index], s) for s in sequences), (word, sequences, outs[index])
    # The unbanned requests of the same batch are untouched.
    assert [o for i, o in enumerate(outs) if i != index] == [o for i, o in enumerate(baseline) if i != index]
    # transformers' processor also searches the prompt: the comparison holds when the prompt does
    # not end with the start of a word (true of the tokens chosen here).
    assert all(prompt[-(len(s) - 1) :] != list(s[:-1]) for s in sequences if len(s) > 1)
    assert outs[index] == _hf_bad_words(checkpoint[1], prompt, sequences)
    # The same with synchronous steps.
    sync = LLM(str(checkpoint[0]), max_model_len=128, block_size=4, dtype="float32", async_scheduling=False)
    assert sync.generate([prompt], banned, use_tqdm=False)[0].outputs[0].token_ids == outs[index]


def test_bad_words_need_the_tokenizer(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    ids_only = LLM(
        str(checkpoint[0]), max_model_len=64, block_size=4, dtype="float32", skip_tokenizer_init=True
    )
    params = SamplingParams(bad_words=["cat"], detokenize=False)
    with pytest.raises(ValueError, match="bad_words are encoded with the tokenizer"):
        ids_only.generate([[1, 2, 3]], params, use_tqdm=False)


# ---- the server's request bodies -----------------------------------------------------------------


@pytest.mark.parametrize("make", [CompletionRequest, ChatCompletionRequest])
def test_request_bodies_carry_bad_words(make: Any) -> None:
    extra = (
        {"prompt": "hi"} if make is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    )

    def params(**body: Any) -> SamplingParams:
        req = make(**extra, **body)
        return to_sampling_params(req, max_tokens=4, logprobs=None, prompt_logprobs=None, vocab_size=300)

    assert params(bad_words=["cat", "dog"]).bad_words == ("cat", "dog")
    assert params().bad_words is None and params(bad_words=[]).bad_words is None
    with pytest.raises(ValueError) as blank:
        params(bad_words=["cat", " "])
    assert field_of_error(str(blank.value)) == "bad_words"


def test_recorded_sequences_cross_the_wire() -> None:
    params = _recorded(["cat"], [[262], [267]])
    request = EngineCoreRequest("r", [1, 2], params, frozenset({0}))
    sent = wire.decode(wire.encode_add(request)).request
    assert sent is not None and sent.sampling_params.bad_words == ("cat",)
    assert sent.sampling_params.bad_words_token_ids == ((262,), (267,))


def test_the_server_engine_bans_them_in_its_core_process(
    llm: LLM, checkpoint: tuple[Path, PreTrainedModel], tokenizer: PreTrainedTokenizerFast
) -> None:
    """The server's engine encodes the words in the API process; the sequences reach the sampler
    in the engine-core process with the request's SamplingParams."""
    prompt = tokenizer.encode("the cat")
    (baseline,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    word = _word_in(tokenizer, baseline.outputs[0].token_ids, 2)
    assert word is not None
    params = dataclasses.replace(GREEDY, bad_words=[word])
    expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert expected != baseline.outputs[0].token_ids
    args = EngineArgs(
        model=str(checkpoint[0]), max_model_len=128, block_size=4, dtype="float32", async_scheduling=True
    )

    async def main() -> None:
        engine = await AsyncLLMEngine.launch(args)
        try:
            # A fresh SamplingParams, as the server's handlers build one per request.
            fresh = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, bad_words=[word])
            outs = [o async for o in engine.generate(prompt, fresh, "a")]
            assert outs[-1].outputs[0].token_ids == expected
        finally:
            await engine.shutdown()

    asyncio.run(main())
