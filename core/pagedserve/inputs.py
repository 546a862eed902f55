"""The prompt forms `LLM.generate` takes, with vLLM's names (`pagedserve.inputs` for `vllm.inputs`).

A prompt is a string, a sequence of token ids, a `TextPrompt` (`{"prompt": text}`) or a
`TokensPrompt` (`{"prompt_token_ids": ids}`); `generate` takes one or a list of them, mixed.
Anything else is refused with its type named: a dict is never read as a list of its keys. Keys of
vLLM's prompt dicts that this engine does not implement (multi-modal data, prompt embeddings,
cache salts) are refused by name rather than ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt given as text, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids. `prompt` may carry its text, for outputs that show it."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | Sequence[int] | TextPrompt | TokensPrompt
"""One prompt, in any form `LLM.generate` takes."""

EnginePrompt = str | list[int]
"""A prompt as the engine takes it: text to tokenize, or token ids."""

_UNSUPPORTED_KEYS = {
    "multi_modal_data": "multi-modal inputs are not supported",
    "mm_processor_kwargs": "multi-modal inputs are not supported",
    "multi_modal_uuids": "multi-modal inputs are not supported",
    "prompt_embeds": "prompt embeddings are not supported: give text or token ids",
    "token_type_ids": "token type ids are not supported",
    "cache_salt": "cache salts are not supported",
    "encoder_prompt": "encoder-decoder prompts are not supported",
    "decoder_prompt": "encoder-decoder prompts are not supported",
}


def is_single_prompt(value: object) -> bool:
    """Whether `value` is one prompt (not a list of prompts). Pure."""
    if isinstance(value, str | Mapping):
        return True
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        items = list(value)
        return bool(items) and all(_is_token_id(t) for t in items)
    return False


def to_engine_prompt(prompt: object, where: str) -> EnginePrompt:
    """`prompt` in the form the engine takes. Raises ValueError naming `where` (e.g. "prompt 3")
    and what is wrong: an unknown type, a dict with neither or both of `prompt` and
    `prompt_token_ids`, an unsupported key, or token ids that are not ints."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        return _from_dict(prompt, where)
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
        return _token_ids(prompt, where)
    raise ValueError(
        f"{where} must be a string, a list of token ids, a TextPrompt {{'prompt': str}} or a "
        f"TokensPrompt {{'prompt_token_ids': [int, ...]}}, got {type(prompt).__name__}"
    )


def _from_dict(prompt: Mapping[Any, Any], where: str) -> EnginePrompt:
    for key, why in _UNSUPPORTED_KEYS.items():
        if key in prompt:
            raise ValueError(f"{where}: {key!r}: {why}")
    unknown = sorted(str(k) for k in prompt if k not in ("prompt", "prompt_token_ids"))
    if unknown:
        raise ValueError(
            f"{where}: unknown prompt key(s) {unknown}: a prompt dict holds 'prompt' (text) or "
            "'prompt_token_ids' (token ids)"
        )
    if "prompt_token_ids" in prompt:
        return _token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']")
    if "prompt" in prompt:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"{where}['prompt'] must be a string, got {type(text).__name__}")
        return text
    raise ValueError(f"{where}: a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (token ids)")


def _token_ids(ids: object, where: str) -> list[int]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise ValueError(f"{where} must be a list of token ids, got {type(ids).__name__}")
    items = list(ids)
    bad = [t for t in items if not _is_token_id(t)]
    if bad:
        raise ValueError(f"{where} must hold int token ids, got {bad[:3]!r}")
    return [int(t) for t in items]


def _is_token_id(value: object) -> bool:
    # Integral takes numpy's ints too; bool is an int subclass but never a token id.
    return isinstance(value, Integral) and not isinstance(value, bool)
