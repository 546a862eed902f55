"""`SamplingParams`: how one request is decoded, validated when it is built.

Field names and defaults follow vLLM's `SamplingParams`, so a user switches engines by changing one
import. Every out-of-range value raises `ValueError` naming the field and the allowed range; an
unknown keyword raises the usual `TypeError` naming it. The object is frozen: an engine that must
change a field (e.g. cap `max_tokens` at the model length) uses `dataclasses.replace`, which
validates again. The one exception is `record_bad_words_token_ids`: the token sequences of
`bad_words`, which only the front end's tokenizer can compute, are filled in once there.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from numbers import Real
from typing import cast

from pagedserve.structured.params import StructuredOutputsParams

GREEDY_TEMPERATURE_EPS = 1e-5
"""Temperatures below this decode greedily: dividing logits by a tiny temperature overflows and
means argmax anyway."""


class SamplingType(enum.Enum):
    GREEDY = "greedy"  # exact argmax of the processed logits
    RANDOM = "random"  # noise from the batch's shared generator
    RANDOM_SEED = "random_seed"  # noise from a per-request generator seeded from (seed, sample, step)


class RequestOutputKind(enum.Enum):
    """Which `RequestOutput`s a running request produces (vLLM's names)."""

    CUMULATIVE = "cumulative"  # one after every step that advanced it, holding everything so far
    # One, when it finishes. Offline generation needs nothing else, and skipping the per-step
    # snapshots saves the engine host time on every step of a large batch.
    FINAL_ONLY = "final_only"


def _is_real(value: object) -> bool:
    # bool is an int subclass; `temperature=True` is a bug, not a temperature.
    return isinstance(value, Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_sequences(value: object) -> tuple[tuple[int, ...], ...]:
    """`value` as a tuple of non-empty token-id tuples; raises ValueError naming bad_words."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"bad_words token ids must be a list of token-id lists, got {value!r}")
    out = []
    for seq in value:
        if (
            isinstance(seq, str | bytes)
            or not isinstance(seq, Sequence)
            or not seq
            or not all(_is_int(t) and t >= 0 for t in seq)
        ):
            raise ValueError(f"bad_words token ids must be non-empty lists of ids >= 0, got {seq!r}")
        out.append(tuple(seq))
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Decoding options of one request (all of its `n` samples share them)."""

    n: int = 1  # independent samples of the same prompt; they share the prompt's KV blocks
    presence_penalty: float = 0.0  # in [-2, 2]; subtracted once from every token already generated
    frequency_penalty: float = 0.0  # in [-2, 2]; subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # > 0; HF/CTRL style over prompt + generated tokens; 1 disables
    temperature: float = 1.0  # >= 0; 0 (below GREEDY_TEMPERATURE_EPS) is greedy
    top_p: float = 1.0  # in (0, 1]; 1 disables
    top_k: int = 0  # 0 or -1 disables (-1 is stored as 0); else keep the k most likely tokens
    min_p: float = 0.0  # in [0, 1]; drop tokens with prob < min_p * max prob; 0 disables
    seed: int | None = None  # reproducible noise whatever the batch composition; None: shared RNG
    stop: str | Sequence[str] | None = None  # stored as tuple[str, ...]; ends generation, excluded from text
    stop_token_ids: Sequence[int] | None = None  # stored as tuple[int, ...]; end generation (token kept)
    ignore_eos: bool = False  # keep generating past the EOS token
    max_tokens: int | None = 16  # >= 1; None: until the model's context length
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are generated
    logprobs: int | None = None  # >= 0: return the sampled token's logprob plus the top-`logprobs`
    prompt_logprobs: int | None = None  # >= 0: same for every prompt token after the first
    detokenize: bool = True  # False: return token ids only (stop strings then cannot be used)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit; stored as a dict copy
    # Only these token ids may be sampled (every other logit is -inf); stored as a sorted tuple.
    allowed_token_ids: Sequence[int] | None = None
    # Words never generated: each is banned as the token sequences it encodes to at the start of a
    # text and after a space (see `bad_words_token_ids`); stored as a tuple, None when empty.
    bad_words: Sequence[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # the enum or its value (a str)
    # The output must match a JSON schema, regex, choice or grammar (constrained decoding).
    structured_outputs: StructuredOutputsParams | None = None
    # Keep only the prompt's last k tokens (k >= 1; -1: max_model_len); None: a prompt that does
    # not fit is refused.
    truncate_prompt_tokens: int | None = None
    # vLLM's older name for structured_outputs: accepted with a DeprecationWarning, not stored.
    guided_decoding: InitVar[StructuredOutputsParams | None] = None
    # The token sequences bad_words ban, one tuple per sequence, recorded by the engine's input
    # processor (`record_bad_words_token_ids`): the tokenizer lives there, not in the engine core.
    # Follows from bad_words and the tokenizer, so equality ignores it. Read `bad_words_token_ids`.
    _bad_words_token_ids: Sequence[Sequence[int]] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self, guided_decoding: StructuredOutputsParams | None) -> None:
        if guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or its older name guided_decoding, not both")
            warnings.warn(
                "SamplingParams(guided_decoding=...) is deprecated: use structured_outputs=",
                DeprecationWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "structured_outputs", guided_decoding)
        self._check_counts()
        self._check_probabilities()
        self._normalize_stops()
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias must be a dict of token id -> float, got {self.logit_bias!r}")
            bias: dict[int, float] = {}
            for token, value in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
                if not _is_real(value) or not math.isfinite(value):
                    raise ValueError(f"logit_bias[{token}] must be a finite float, got {value!r}")
                bias[token] = float(value)
            object.__setattr__(self, "logit_bias", bias)
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if isinstance(allowed, str | bytes) or not isinstance(allowed, Sequence) or not allowed:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}")
            if not all(_is_int(t) and t >= 0 for t in allowed):
                raise ValueError(f"allowed_token_ids must hold token ids (ints >= 0), got {allowed!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))
        self._normalize_bad_words()
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._normalize_output_kind()
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _normalize_output_kind(self) -> None:
        kind: object = self.output_kind
        if isinstance(kind, str):  # the value, as it travels between processes
            kind = next((k for k in RequestOutputKind if k.value == kind), kind)
        if not isinstance(kind, RequestOutputKind):
            names = ", ".join(repr(k.value) for k in RequestOutputKind)
            raise ValueError(
                f"output_kind must be a RequestOutputKind or one of {names}, got {self.output_kind!r}"
            )
        object.__setattr__(self, "output_kind", kind)

    def _check_counts(self) -> None:
        def integer(name: str, low: int, allow_none: bool) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not _is_int(value) or value < low:
                none = " or None" if allow_none else ""
                raise ValueError(f"{name} must be an int >= {low}{none}, got {value!r}")

        integer("n", 1, allow_none=False)
        integer("max_tokens", 1, allow_none=True)
        integer("min_tokens", 0, allow_none=False)
        integer("logprobs", 0, allow_none=True)
        integer("prompt_logprobs", 0, allow_none=True)
        keep = self.truncate_prompt_tokens
        if keep is not None and (not _is_int(keep) or (keep < 1 and keep != -1)):
            raise ValueError(
                f"truncate_prompt_tokens must be an int >= 1, -1 (the model's context length) or None, "
                f"got {keep!r}"
            )
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")

    def _check_probabilities(self) -> None:
        def real(name: str, ok: bool, allowed: str) -> None:
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or not ok:
                raise ValueError(f"{name} must be a float in {allowed}, got {value!r}")

        t = self.temperature
        real("temperature", _is_real(t) and t >= 0, "[0, inf) (0 means greedy)")
        real("top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "(0, 1]")
        real("min_p", _is_real(self.min_p) and 0 <= self.min_p <= 1, "[0, 1]")
        real(
            "presence_penalty",
            _is_real(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "[-2, 2]",
        )
        real(
            "frequency_penalty",
            _is_real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "[-2, 2]",
        )
        real(
            "repetition_penalty",
            _is_real(self.repetition_penalty) and self.repetition_penalty > 0,
            "(0, inf) (1 disables it)",
        )

    def _normalize_stops(self) -> None:
        stop: tuple[str, ...]
        if self.stop is None:
            stop = ()
        elif isinstance(self.stop, str):
            stop = (self.stop,)
        elif isinstance(self.stop, Sequence) and all(isinstance(s, str) for s in self.stop):
            stop = tuple(self.stop)
        else:
            raise ValueError(f"stop must be a str, a list of str or None, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop must not contain the empty string (it would match before any text)")
        if stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched against the text)")
        object.__setattr__(self, "stop", stop)
        ids: tuple[int, ...] = ()
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, str | bytes) or not isinstance(self.stop_token_ids, Sequence):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
                raise ValueError(
                    f"stop_token_ids must hold token ids (ints >= 0), got {self.stop_token_ids!r}"
                )
            ids = tuple(self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", ids)

    def _normalize_bad_words(self) -> None:
        words = self.bad_words
        if words is not None:
            if isinstance(words, str | bytes) or not isinstance(words, Sequence):
                raise ValueError(f"bad_words must be a list of str, got {words!r}")
            for i, word in enumerate(words):
                # Leading whitespace is dropped before encoding (see bad_words_token_ids): a word
                # of whitespace alone would ban nothing, which is surely not what was meant.
                if not isinstance(word, str) or not word.strip():
                    raise ValueError(f"bad_words[{i}] must be a non-blank str, got {word!r}")
            object.__setattr__(self, "bad_words", tuple(words) or None)
        ids = self._bad_words_token_ids
        if ids is not None:
            # Without bad_words there is nothing they could be the tokens of (e.g. a copy made by
            # dataclasses.replace(params, bad_words=None)).
            sequences = _token_sequences(ids) if self.bad_words is not None else None
            object.__setattr__(self, "_bad_words_token_ids", sequences)

    def record_bad_words_token_ids(self, token_ids: Sequence[Sequence[int]]) -> None:
        """Record the token sequences that bad_words encode to (`bad_words_token_ids`).

        Called by the engine's input processor, the one place with a tokenizer, before the request
        leaves for the engine core; every front end (offline engines, server) hands this same
        object on, so the sequences travel with it, across processes too. The only change ever
        made to a built SamplingParams: it fills in what bad_words and the tokenizer determine, so
        it gives the same value each time for one tokenizer (and equality ignores it). Raises
        ValueError for malformed sequences or without bad_words."""
        if self.bad_words is None:
            raise ValueError("bad_words token ids need bad_words")
        object.__setattr__(self, "_bad_words_token_ids", _token_sequences(token_ids))

    def clone(self) -> SamplingParams:
        """A copy (vLLM's method). The object is frozen, so a copy is only needed by code that
        compares identities; `dataclasses.replace(params, field=value)` makes a changed one."""
        return dataclasses.replace(self)

    # ---- derived, read-only views -----------------------------------------------------------------

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple (possibly empty)."""
        return cast("tuple[str, ...]", self.stop)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The stop token ids as a tuple (possibly empty)."""
        return cast("tuple[int, ...]", self.stop_token_ids)

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        """The token sequences bad_words ban (possibly empty: none, or not recorded yet). The
        sampler sets a sequence's last token to -inf wherever the tokens generated so far end with
        the rest of it; a one-token sequence is banned everywhere."""
        return cast("tuple[tuple[int, ...], ...]", self._bad_words_token_ids or ())

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def bias(self) -> Mapping[int, float]:
        """logit_bias as a (possibly empty) mapping."""
        return self.logit_bias if self.logit_bias is not None else {}
