"""`SamplingParams`: how one request is decoded, validated when it is built and again when used.

Field names and defaults follow vLLM's `SamplingParams`, so a user switches engines by changing one
import. Every out-of-range value raises `ValueError` naming the field and the allowed range; an
unknown keyword raises the usual `TypeError` naming it. As vLLM's, the object is mutable
(`params.max_tokens = 3`) and `clone()` copies it: a field set after construction is checked when
the request is added (`checked_copy`, which the engines' input processors call), and the engine
keeps that checked copy, so changing the caller's object later changes no running request. Nothing
may hash it or use it as a key. `record_bad_words_token_ids` fills in the token sequences of
`bad_words`, which only the front end's tokenizer can compute.

Each field is the one declaration of its parameter (`declaration.param`): its default, its rule,
its column in the batch, its server field and its doc line. `SAMPLING_PARAMS` lists them; the
batch's rows, the sampling metadata, the server's request models and the docs' parameter table
follow from it.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, cast

import numpy as np

import pagedserve.sampling.param_checks as checks
from pagedserve.sampling.declaration import ApiField, Declaration, RowColumn, declarations, param
from pagedserve.sampling.param_checks import FloatIn, IntAtLeast, is_bool
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
    # One after every step that advanced it, holding only what that step added (new token ids,
    # text, logprobs): what a streaming client needs, without copying the sequence each step.
    DELTA = "delta"
    # One, when it finishes. Offline generation needs nothing else, and skipping the per-step
    # snapshots saves the engine host time on every step of a large batch.
    FINAL_ONLY = "final_only"


def _output_kind(name: str, value: Any) -> RequestOutputKind:
    kind: object = value
    if isinstance(kind, str):  # the value, as it travels between processes
        kind = next((k for k in RequestOutputKind if k.value == kind), kind)
    if not isinstance(kind, RequestOutputKind):
        names = ", ".join(repr(k.value) for k in RequestOutputKind)
        raise ValueError(f"{name} must be a RequestOutputKind or one of {names}, got {value!r}")
    return kind


_PENALTY = FloatIn("[-2, 2]")
_NULLABLE_FLOAT = ApiField(float, nullable=True)


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """Decoding options of one request (all of its `n` samples share them)."""

    n: int = param(
        1,
        "independent samples of the same prompt; they share the prompt's KV blocks",
        check=IntAtLeast(1),
        api=ApiField(int, with_beam_search=True, note="with use_beam_search: the beams returned"),
    )
    presence_penalty: float = param(
        0.0,
        "in [-2, 2]; subtracted once from every token already generated",
        check=_PENALTY,
        row=RowColumn(np.float32, neutral=0.0),
        api=_NULLABLE_FLOAT,
    )
    frequency_penalty: float = param(
        0.0,
        "in [-2, 2]; subtracted per occurrence in the generated tokens",
        check=_PENALTY,
        row=RowColumn(np.float32, neutral=0.0),
        api=_NULLABLE_FLOAT,
    )
    repetition_penalty: float = param(
        1.0,
        "> 0; HF/CTRL style over prompt + generated tokens; 1 disables",
        check=FloatIn("(0, inf)", note="1 disables it"),
        row=RowColumn(np.float32, neutral=1.0),
        api=_NULLABLE_FLOAT,
        generation_config="repetition_penalty",
    )
    temperature: float = param(
        1.0,
        f">= 0; below {GREEDY_TEMPERATURE_EPS} decodes greedily (argmax)",
        check=FloatIn("[0, inf)", note="0 means greedy"),
        row=RowColumn(np.float32, neutral=1.0, random_only=True, metadata=True),
        api=ApiField(float, nullable=True, with_beam_search=True),
        generation_config="temperature",
    )
    top_p: float = param(
        1.0,
        "in (0, 1]; sample from the most likely tokens holding this much probability; 1 disables",
        check=FloatIn("(0, 1]"),
        row=RowColumn(np.float32, neutral=1.0, random_only=True, metadata=True),
        api=_NULLABLE_FLOAT,
        generation_config="top_p",
    )
    top_k: int = param(
        0,
        "0 or -1 disables (-1 is stored as 0); else sample from the k most likely tokens",
        check=checks.top_k,
        # In the metadata as the vocabulary's size where disabled (SamplingRows builds it).
        row=RowColumn(np.int64, neutral=0, random_only=True),
        api=ApiField(int, nullable=True),
        generation_config="top_k",
    )
    min_p: float = param(
        0.0,
        "in [0, 1]; drop tokens whose probability is below min_p times the top one's; 0 disables",
        check=FloatIn("[0, 1]"),
        row=RowColumn(np.float32, neutral=0.0, random_only=True, metadata=True),
        api=_NULLABLE_FLOAT,
        generation_config="min_p",
    )
    seed: int | None = param(
        None,
        "reproducible noise whatever the batch composition; None: the shared generator",
        check=checks.seed,
        api=ApiField(int, nullable=True),
    )
    stop: str | Sequence[str] | None = param(
        None,
        "strings that end generation, excluded from the text; stored as a tuple",
        check=checks.stop,
        api=ApiField(str | list[str], nullable=True),
    )
    stop_token_ids: Sequence[int] | None = param(
        None,
        "token ids that end generation (the token is kept); stored as a tuple",
        check=checks.stop_token_ids,
        api=ApiField(list[int], nullable=True),
    )
    ignore_eos: bool = param(
        False,
        "keep generating past the EOS token",
        check=is_bool,
        api=ApiField(bool, with_beam_search=True),
    )
    max_tokens: int | None = param(
        16,
        ">= 1; None: until the model's context length",
        check=IntAtLeast(1, optional=True),
        generation_config="max_new_tokens",
    )
    min_tokens: int = param(
        0,
        "EOS and stop token ids are banned until this many tokens are generated",
        check=IntAtLeast(0),
        row=RowColumn(np.int64, neutral=0),
        api=ApiField(int),
    )
    logprobs: int | None = param(
        None,
        ">= 0: return the sampled token's logprob and the top-`logprobs` others",
        check=IntAtLeast(0, optional=True),
    )
    prompt_logprobs: int | None = param(
        None,
        ">= 0: the same for every prompt token after the first",
        check=IntAtLeast(0, optional=True),
    )
    detokenize: bool = param(
        True,
        "False: return token ids only (stop strings then cannot be used)",
        check=is_bool,
    )
    skip_special_tokens: bool = param(
        True,
        "leave special tokens out of the text",
        check=is_bool,
        api=ApiField(bool, with_beam_search=True),
    )
    spaces_between_special_tokens: bool = param(
        True,
        "with skip_special_tokens=False: a space between adjacent special tokens (slow tokenizers; "
        "fast ones ignore it, as in transformers)",
        check=is_bool,
        api=ApiField(bool, with_beam_search=True),
    )
    include_stop_str_in_output: bool = param(
        False,
        "keep the matched stop string at the end of the text",
        check=is_bool,
        api=ApiField(bool, with_beam_search=True),
    )
    logit_bias: Mapping[int, float] | None = param(
        None,
        "token id -> added to its logit; stored as a dict copy",
        check=checks.logit_bias,
        api=ApiField(
            dict[str, float],
            nullable=True,
            note="token id (a string, as JSON keys are) -> added to its logit",
        ),
    )
    allowed_token_ids: Sequence[int] | None = param(
        None,
        "only these token ids may be sampled (every other logit is -inf); stored sorted",
        check=checks.allowed_token_ids,
        api=ApiField(list[int], nullable=True),
    )
    bad_words: Sequence[str] | None = param(
        None,
        "words never generated, banned as the token sequences they encode to; None when empty",
        check=checks.bad_words,
        api=ApiField(list[str], nullable=True),
    )
    output_kind: RequestOutputKind = param(
        RequestOutputKind.CUMULATIVE,
        "which RequestOutputs the request produces: the enum or its value (a str)",
        check=_output_kind,
    )
    structured_outputs: StructuredOutputsParams | None = param(
        None,
        "the output must match a JSON schema, regex, choice or grammar (constrained decoding)",
        check=checks.structured_outputs,
    )
    truncate_prompt_tokens: int | None = param(
        None,
        "keep only the prompt's last k tokens (k >= 1; -1: max_model_len); None: refuse a prompt too long",
        check=checks.truncate_prompt_tokens,
        api=ApiField(int, nullable=True),
    )
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
        for name, check in _CHECKS:
            value = getattr(self, name)
            checked = check(name, value)
            if checked is not value:
                object.__setattr__(self, name, checked)
        # The rules that read two fields.
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched against the text)")
        ids = self._bad_words_token_ids
        if ids is not None:
            # Without bad_words there is nothing they could be the tokens of (e.g. a copy made by
            # dataclasses.replace(params, bad_words=None)).
            sequences = checks.token_sequences(ids) if self.bad_words is not None else None
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
        object.__setattr__(self, "_bad_words_token_ids", checks.token_sequences(token_ids))

    def clone(self) -> SamplingParams:
        """A copy that can be changed without touching this one (vLLM's method); every field is
        checked again, so a bad value set since construction raises ValueError naming it. Does
        not mutate `self`."""
        return dataclasses.replace(self)

    def checked_copy(self) -> SamplingParams:
        """What an engine keeps of a request's parameters: a copy with every field checked and
        normalised again (a field may have been set since construction, `params.stop = ["x"]`).
        Raises ValueError starting with the field's name. Does not mutate `self`."""
        return self.clone()

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


SAMPLING_PARAMS: tuple[Declaration, ...] = declarations(SamplingParams)
"""Every sampling parameter, one declaration each, in field order."""

_CHECKS = tuple((d.name, d.check) for d in SAMPLING_PARAMS)  # what __post_init__ runs
