"""The engine front end's input side: prompts to token ids, and the request checks that need the
tokenizer. Shared by the in-process `LLMEngine` and the server's `AsyncLLMEngine`, which runs it in
the API process while the model lives in the engine-core process.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.structured.checks import check_constraint


class ParamError(ValueError):
    """A ValueError about one SamplingParams field, named in `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """The UTF-8 length of the vocabulary's longest token string. Scans the whole vocabulary:
    ~60 ms for a 49,152-token one on a 2-CPU host, longer for larger ones."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(t.encode()) for t in tokens if isinstance(t, str))


class InputProcessor:
    """Tokenizes prompts and checks them against the vocabulary. Mutates nothing but the bad-word
    token ids it records on a request's SamplingParams (`check_params`)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        vocab_size: int,
        max_logprobs: int = 20,
        max_model_len: int | None = None,
        token_bytes: int | None = None,  # `longest_token_bytes(tokenizer)`; None: on first need
    ) -> None:
        self.tokenizer = tokenizer  # None with skip_tokenizer_init
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        # With it, a text too long to fit is refused before it is tokenized (`max_text_bytes`).
        self.max_model_len = max_model_len
        # The server computes it before it reports ready: the scan would otherwise land in the
        # first text request's latency.
        self._longest_token_bytes = token_bytes

    def max_text_bytes(self) -> int | None:
        """The longest text (in UTF-8 bytes) that may still fit max_model_len tokens: no token
        stands for more bytes than the vocabulary's longest token, so a longer text needs more
        tokens than fit. Twice that, for normalizers that shorten a text before it is split.
        None without a tokenizer or max_model_len. Scans the vocabulary on the first call unless
        the scan was given (`token_bytes`), and caches it."""
        if self.tokenizer is None or self.max_model_len is None:
            return None
        if self._longest_token_bytes is None:
            self._longest_token_bytes = longest_token_bytes(self.tokenizer)
        return 2 * self.max_model_len * self._longest_token_bytes

    def prompt_ids(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """The token ids a request with `params` runs on: `tokenize`'s, cut to their last
        `params.truncate_prompt_tokens` (-1: max_model_len) when that is set. Raises ValueError."""
        if params.truncate_prompt_tokens is None:
            return self.tokenize(prompt)
        if params.truncate_prompt_tokens == -1 and self.max_model_len is None:
            raise ParamError(
                "truncate_prompt_tokens=-1 needs the engine's max_model_len", "truncate_prompt_tokens"
            )
        return last_tokens(self.tokenize(prompt, bounded=False), params, self.max_model_len or 0)

    def tokenize(
        self, prompt: str | Sequence[int], *, add_special_tokens: bool = True, bounded: bool = True
    ) -> list[int]:
        """Token ids of a prompt: a string is encoded (with the model's special tokens unless
        `add_special_tokens` is False, for text a chat template rendered); a list of ids is
        checked against the vocabulary. Raises ValueError for an empty or bad prompt, or (unless
        `bounded` is False: the caller truncates) a text too long to fit max_model_len whatever
        its tokens."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True): pass token ids")
            if not prompt:
                raise ValueError("prompt is an empty string: give at least one character or token")
            limit = self.max_text_bytes() if bounded else None
            size = len(prompt.encode("utf-8", "surrogatepass"))
            if limit is not None and size > limit:
                raise ValueError(
                    f"the prompt has {size} bytes of text, more than max_model_len={self.max_model_len} "
                    "tokens can hold with this tokenizer: shorten it"
                )
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        else:
            ids = list(prompt)
            bad = [
                t
                for t in ids
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
            ]
            if bad:
                raise ValueError(
                    f"prompt token ids must be ints in [0, {self.vocab_size}); got {bad[:5]!r}"
                    + (" ..." if len(bad) > 5 else "")
                )
        if not ids:
            raise ValueError("prompt has no tokens")
        return ids

    def checked_params(self, params: SamplingParams) -> SamplingParams:
        """The parameters a request of the caller's runs with: a copy of `params` with every
        field checked again (SamplingParams is mutable: a field may have been set since it was
        built, and a later change must not reach the running request), then `check_params`.
        Raises ValueError naming the field. Does not mutate `params`."""
        try:
            copy = params.checked_copy()
        except ValueError as exc:  # the rule's message starts with the field's name
            raise ParamError(str(exc), str(exc).split(" ", 1)[0].strip(":=,")) from None
        self.check_params(copy)
        return copy

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError when `params` needs something this front end lacks (a tokenizer), asks
        for more logprobs than the engine's max_logprobs, or has a malformed constraint. Records
        the token sequences of `params.bad_words` on `params` (`bad_words_token_ids`), which the
        engine core, having no tokenizer, could not compute."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ParamError(
                    f"{name}={value} exceeds this engine's max_logprobs={self.max_logprobs}: ask for at "
                    "most that many, or start the engine with a larger --max-logprobs",
                    name,
                )
        if params.structured_outputs is not None:
            try:
                check_constraint(params.structured_outputs, has_tokenizer=self.tokenizer is not None)
            except ValueError as exc:
                raise ParamError(str(exc), "structured_outputs") from None
        allowed = params.allowed_token_ids
        if allowed is not None and allowed[-1] >= self.vocab_size:  # sorted: the last is the largest
            raise ParamError(
                f"allowed_token_ids must be token ids in [0, {self.vocab_size}), got {allowed[-1]}",
                "allowed_token_ids",
            )
        if params.bad_words is not None:
            self._record_bad_words(params)
        if params.stop_strings and not params.detokenize:
            why = " (this engine has no tokenizer)" if self.tokenizer is None else ""
            raise ParamError(
                f"stop strings need detokenize=True (they are matched in the text){why}: "
                "use stop_token_ids instead",
                "stop",
            )
        if self.tokenizer is None and params.detokenize:
            raise ValueError(
                "this engine has no tokenizer (skip_tokenizer_init=True): "
                "use SamplingParams(detokenize=False)"
            )

    def _record_bad_words(self, params: SamplingParams) -> None:
        assert params.bad_words is not None
        if self.tokenizer is None:
            raise ParamError(
                "bad_words are encoded with the tokenizer, and this engine has none "
                "(skip_tokenizer_init=True)",
                "bad_words",
            )
        sequences = bad_words_token_ids(self.tokenizer, params.bad_words)
        largest = max(t for seq in sequences for t in seq)
        if largest >= self.vocab_size:
            raise ParamError(
                f"bad_words encode to token id {largest}, outside the model's vocabulary "
                f"[0, {self.vocab_size})",
                "bad_words",
            )
        params.record_bad_words_token_ids(sequences)


def bad_words_token_ids(
    tokenizer: PreTrainedTokenizerBase, words: Sequence[str]
) -> tuple[tuple[int, ...], ...]:
    """The token sequences that ban `words`, by vLLM's rule: each word, its leading whitespace
    dropped, as the tokenizer encodes it at the start of a text, and also as it encodes it after a
    space when that gives a different first token and as many tokens (the tokenizer merged the
    space into the word, as byte-level BPE does; where the space stays apart, the word's own
    tokens follow it and are banned already). Duplicates are dropped, order kept. Raises
    ParamError (bad_words) for a word that encodes to no tokens. Does not mutate."""
    out: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        text = word.lstrip()
        bare = tuple(tokenizer.encode(text, add_special_tokens=False))
        if not bare:
            raise ParamError(f"bad_words[{i}] ({word!r}) encodes to no tokens", "bad_words")
        spaced = tuple(tokenizer.encode(" " + text, add_special_tokens=False))
        variants = [bare]
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            variants.append(spaced)
        for seq in variants:
            if seq not in out:
                out.append(seq)
    return tuple(out)


def detokenizer_eos_token_id(
    tokenizer: PreTrainedTokenizerBase | None, eos_token_ids: frozenset[int]
) -> int | None:
    """The EOS id the detokenizer checks. It mirrors the core's check, where any id of
    `eos_token_ids` ends a sequence; the tokenizer's own EOS (or the lowest id) stands for the set."""
    if tokenizer is not None:
        eos = tokenizer.eos_token_id
        return int(eos) if isinstance(eos, int) else None
    return min(eos_token_ids, default=None)


def last_tokens(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """`ids` cut to their last `params.truncate_prompt_tokens` (-1: `max_model_len`), or as they
    are when that is None. Pure."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return ids
    return ids[-(max_model_len if keep == -1 else keep) :]
