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


class InputProcessor:
    """Tokenizes prompts and checks them against the vocabulary. Does not mutate anything."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, *, vocab_size: int, max_logprobs: int = 20
    ) -> None:
        self.tokenizer = tokenizer  # None with skip_tokenizer_init
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: a string is encoded (with the model's special tokens); a list
        of ids is checked against the vocabulary. Raises ValueError for an empty or bad prompt."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True): pass token ids")
            if not prompt:
                raise ValueError("prompt is an empty string: give at least one character or token")
            ids = list(self.tokenizer.encode(prompt))
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

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError when `params` needs something this front end lacks (a tokenizer), asks
        for more logprobs than the engine's max_logprobs, or has a malformed constraint."""
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
        if params.stop_strings and not params.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        if self.tokenizer is None and params.detokenize:
            raise ValueError(
                "this engine has no tokenizer (skip_tokenizer_init=True): "
                "use SamplingParams(detokenize=False)"
            )


def detokenizer_eos_token_id(
    tokenizer: PreTrainedTokenizerBase | None, eos_token_ids: frozenset[int]
) -> int | None:
    """The EOS id the detokenizer checks. It mirrors the core's check, where any id of
    `eos_token_ids` ends a sequence; the tokenizer's own EOS (or the lowest id) stands for the set."""
    if tokenizer is not None:
        eos = tokenizer.eos_token_id
        return int(eos) if isinstance(eos, int) else None
    return min(eos_token_ids, default=None)
