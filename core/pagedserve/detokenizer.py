"""Incremental detokenization and stop checking for one sample of one request.

Text. Decoding each new token alone is wrong twice over: a byte-level BPE token may carry only part
of a multi-byte UTF-8 character (an emoji is often split over 3 or 4 tokens), and SentencePiece
tokenizers drop a token's leading space unless a token precedes it. So each step decodes a short
window `ids[prefix_offset:]` and subtracts the decoded `ids[prefix_offset:read_offset]`; while the
window ends in U+FFFD (an incomplete character) nothing is emitted and the offsets stay put, so a
replacement character is never emitted for a character that later tokens complete. The window
starts inside the prompt's last tokens, so the first generated token decodes in context.

Stops, checked token by token (a multi-token step stops at the first token that finishes):
  * token level, once `min_tokens` are generated: EOS (unless ignore_eos) and `stop_token_ids`.
    The token stays in `token_ids`; its text is dropped unless include_stop_str_in_output.
  * stop strings, in text produced after the first `min_tokens` tokens: the text is cut before the
    earliest match (after it with include_stop_str_in_output). While streaming, a tail of the text
    that could be the start of a stop string is held back, so no partial stop string is shown.
  * length: `max_tokens` generated, or prompt + output reaching `max_model_len`. A token that
    both stops and reaches the length reports "stop".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import tokenizers
from transformers import PreTrainedTokenizerFast

from pagedserve.outputs import FinishReason
from pagedserve.sampling.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded in front of the first generated one (enough for any leading-space rule)."""

_REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    # HF types the result as str | list[str] (a batch decodes to a list); a flat id list gives a str.
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


def decode_text(
    tokenizer: TokenDecoder,
    token_ids: list[int],
    *,
    skip_special_tokens: bool = False,
    spaces_between_special_tokens: bool = True,
) -> str:
    """`tokenizer.decode(token_ids)` checked to be a str (e.g. one token's text for a `Logprob`).
    `spaces_between_special_tokens=False` is handed to the tokenizer (HF's option; the default
    is not passed, so a tokenizer without the option decodes as before). Does not mutate."""
    if spaces_between_special_tokens:
        text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    else:
        decode = cast(Any, tokenizer).decode  # an HF option the protocol does not require
        text = decode(token_ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False)
    if not isinstance(text, str):
        raise TypeError(f"tokenizer.decode returned {type(text).__name__}, expected str")
    return text


def token_decoder(
    tokenizer: TokenDecoder, *, skip_special_tokens: bool, spaces_between_special_tokens: bool = True
) -> Callable[[list[int]], str]:
    """A function ids -> text equal to `decode_text(tokenizer, ids, skip_special_tokens=...,
    spaces_between_special_tokens=...)`, as fast as it can be had. Does not mutate.

    A Hugging Face fast tokenizer's `decode` is its Rust backend's `decode` wrapped in Python
    argument conversion and an optional clean-up pass; the wrapping costs twice the decoding
    itself, and the detokenizer decodes twice per generated token. When the tokenizer's class
    keeps the stock `decode` and `_decode` (HF's two steps; several model tokenizers override
    them) and clean-up is off, the backend is called directly: the same text, by construction.
    Any other tokenizer is decoded through its own `decode`."""
    cls = type(tokenizer)
    stock = (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and getattr(cls, "_decode", None) is getattr(PreTrainedTokenizerFast, "_decode", None)
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    )
    backend = getattr(tokenizer, "backend_tokenizer", None) if stock else None
    if isinstance(backend, tokenizers.Tokenizer):
        # HF's fast decode ignores spaces_between_special_tokens too: the backend joins the tokens.
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(
        decode_text,
        tokenizer,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )


class IncrementalDetokenizer:
    """Text, token ids and finish state of one sample, updated as tokens arrive."""

    def __init__(
        self,
        tokenizer: TokenDecoder | None,  # None is allowed only with detokenize=False
        params: SamplingParams,
        *,
        prompt_token_ids: Sequence[int] = (),
        eos_token_id: int | None = None,
        max_model_len: int | None = None,  # finish with "length" when prompt + output reaches it
    ) -> None:
        if tokenizer is None and params.detokenize:
            raise ValueError("a tokenizer is needed to detokenize; pass one or set detokenize=False")
        self._params = params
        # The checks of every token, read off `params` once (this runs per token per request).
        self._decode: Callable[[list[int]], str] | None = None
        if params.detokenize:
            assert tokenizer is not None  # checked above
            self._decode = token_decoder(
                tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        self._eos_token_id = None if params.ignore_eos else eos_token_id
        self._stop_ids = frozenset(params.stop_ids)
        self._min_tokens = params.min_tokens
        self._keep_stop_text = params.include_stop_str_in_output
        # Outputs at which the sample ends with "length": max_tokens, or the model's context.
        limits = [math.inf if params.max_tokens is None else params.max_tokens]
        if max_model_len is not None:
            limits.append(max_model_len - len(prompt_token_ids))
        self._length_limit = min(limits)
        self._stop_strings = params.stop_strings
        self._max_stop_len = max((len(s) for s in self._stop_strings), default=0)
        self.token_ids: list[int] = []  # generated ids; read-only for callers
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # stop token id or stop string; None for EOS / length
        # Decoding window over prompt tail + generated ids (see the module docstring).
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._window_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""  # all text decoded so far (cut at a stop string once one matches)
        self._stop_check_floor = 0  # stop strings must end after this text offset (min_tokens)
        self._emitted = 0  # length of the text handed out by take_delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text that may be shown now: everything once finished; while generating, all but a
        tail that could begin a stop string."""
        if self.finished or not self._stop_strings:
            return self._text
        return self._text[: len(self._text) - self._stop_prefix_len()]

    def take_delta(self) -> str:
        """The part of `text` not returned by the previous call (streaming). Mutates the cursor."""
        # Sliced straight out of the whole text: building `text` first would copy all of it, and
        # this runs once per stream per step.
        end = len(self._text)
        if not self.finished and self._stop_strings:
            end -= self._stop_prefix_len()
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta

    def append(self, new_token_ids: Sequence[int]) -> int:
        """Add newly sampled tokens, in order, stopping at the first that finishes the sample.
        Returns how many were accepted (the rest are dropped). Mutates the detokenizer; raises
        ValueError if it has already finished."""
        if self.finished:
            raise ValueError(
                f"cannot append tokens to a finished sample (finish_reason={self.finish_reason!r})"
            )
        for accepted, token in enumerate(new_token_ids, start=1):
            self._append_one(token)
            if self.finished:
                return accepted
        return len(new_token_ids)

    def abort(self) -> None:
        """Mark the sample aborted (no-op if already finished). Mutates."""
        if not self.finished:
            self.finish_reason = "abort"

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End the sample for a reason decided elsewhere (e.g. the engine core's length limit):
        flushes text still waiting for the rest of a character. No-op if already finished, so the
        first reason wins. Mutates."""
        if not self.finished:
            self._finish(reason, stop_reason, decode_last=False)

    # ---- one token ------------------------------------------------------------------------------

    def _append_one(self, token: int) -> None:
        token_ids = self.token_ids
        token_ids.append(token)
        past_min_tokens = len(token_ids) > self._min_tokens
        if past_min_tokens and token == self._eos_token_id:
            self._finish("stop", None, decode_last=self._keep_stop_text)
            return
        if past_min_tokens and token in self._stop_ids:
            self._finish("stop", token, decode_last=self._keep_stop_text)
            return
        if self._decode is not None:
            checked_up_to = len(self._text)
            self._decode_step([token], final=False)
            if not past_min_tokens:
                self._stop_check_floor = len(self._text)
            elif self._stop_strings and self._find_stop_string(checked_up_to):
                return
        if len(token_ids) >= self._length_limit:
            self._finish("length", None, decode_last=False)

    def _finish(self, reason: FinishReason, stop_reason: int | str | None, *, decode_last: bool) -> None:
        if self._decode is not None:
            # Flush bytes still waiting for the rest of a character: the sample ends here, so they
            # show as U+FFFD, exactly as tokenizer.decode(token_ids) would show them.
            self._decode_step([self.token_ids[-1]] if decode_last else [], final=True)
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def _decode_step(self, new_ids: list[int], *, final: bool) -> None:
        decode = self._decode
        assert decode is not None  # only called when detokenizing
        self._window_ids.extend(new_ids)
        prefix_text = decode(self._window_ids[self._prefix_offset : self._read_offset])
        full_text = decode(self._window_ids[self._prefix_offset :])
        complete = len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT_CHAR)
        if complete or (final and len(full_text) > len(prefix_text)):
            self._text += full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._window_ids)

    # ---- stop strings ---------------------------------------------------------------------------

    def _find_stop_string(self, checked_up_to: int) -> bool:
        """Cut the text at the earliest stop string that ends after both `checked_up_to` (earlier
        text was already searched) and the min_tokens floor; finish if one is found."""
        best: tuple[int, int, str] | None = None  # (start, -len, stop): earliest, then longest
        for stop in self._stop_strings:
            start_from = max(0, max(checked_up_to, self._stop_check_floor) - len(stop) + 1)
            index = self._text.find(stop, start_from)
            if index >= 0 and (best is None or (index, -len(stop)) < best[:2]):
                best = (index, -len(stop), stop)
        if best is None:
            return False
        index, _, stop = best
        end = index + len(stop) if self._params.include_stop_str_in_output else index
        self._text = self._text[:end]
        self.finish_reason = "stop"
        self.stop_reason = stop
        return True

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        text = self._text
        for length in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[len(text) - length :]
            if any(stop.startswith(tail) for stop in self._stop_strings):
                return length
        return 0
