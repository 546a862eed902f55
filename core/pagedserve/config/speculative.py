"""`SpeculativeConfig`: which proposer drafts tokens, how many per step, and from which checkpoint.

Users give vLLM's `speculative_config` dict (`LLM(speculative_config={...})`,
`pagedserve serve --speculative-config JSON`), or the older `num_speculative_tokens=k` alone, which
keeps meaning n-gram prompt lookup. `parse_speculative_config` checks the dict's keys and values when
`EngineArgs` is built (an unknown method or key is refused naming it); `resolve_speculative_config`
turns it, once, into the frozen config below, checking the draft's vocabulary against the target's
(a draft that scores other token ids would propose nonsense the target rejects at every step).
Imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

SpeculativeMethod = Literal["ngram", "draft_model", "eagle", "eagle3"]
"""ngram: prompt lookup; draft_model: a smaller causal LM; eagle / eagle3: a head over the target's
hidden states (one layer, published EAGLE and EAGLE-3 checkpoint layouts)."""

METHODS: tuple[str, ...] = get_args(SpeculativeMethod)

# key -> what it means; the keys of vLLM's speculative_config that this engine reads
KEYS: dict[str, str] = {
    "method": "ngram, draft_model, eagle or eagle3 (default: draft_model with a model, else refused)",
    "model": "the draft checkpoint (draft_model, eagle, eagle3)",
    "num_speculative_tokens": "tokens drafted per step (1-16)",
    "prompt_lookup_min": "ngram: shortest suffix matched (default 1)",
    "prompt_lookup_max": "ngram: longest suffix matched (default 3)",
    "draft_tensor_parallel_size": "ranks the draft runs on (1: the only one built)",
    "dtype": "the draft's dtype: auto (the target's) or float32, float16, bfloat16",
}

MAX_SPECULATIVE_TOKENS = 16
"""The most drafts a step scores (the scheduler and the structured-output rollback size for it)."""

_DRAFT_DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding as resolved before any worker starts (`resolve_speculative_config`)."""

    method: SpeculativeMethod
    num_speculative_tokens: int  # drafts per step, 1..MAX_SPECULATIVE_TOKENS
    prompt_lookup_min: int  # ngram: shortest suffix n-gram matched, >= 1
    prompt_lookup_max: int  # ngram: longest suffix n-gram matched, >= prompt_lookup_min
    model: str | None  # the draft checkpoint; None exactly for ngram
    dtype: str  # the draft's dtype name ("auto": the target's); unused by ngram
    draft_tensor_parallel_size: int  # 1: the draft runs beside the target on its device

    @property
    def uses_draft_model(self) -> bool:
        """Whether a second network (a draft model or an EAGLE head) runs beside the target."""
        return self.method != "ngram"


def parse_speculative_config(raw: Mapping[str, Any], num_speculative_tokens: int) -> SpeculativeConfig:
    """The config `raw` (vLLM's dict) asks for; `num_speculative_tokens`: `EngineArgs`' own field
    (0: not given). Raises ValueError naming the key when a key or value cannot hold. Pure."""
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
            + ", ".join(KEYS)
        )
    model = raw.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"speculative_config.model must be a checkpoint path or name, got {model!r}")
    method = raw.get("method", "draft_model" if model is not None else None)
    if method is None:
        raise ValueError(
            "speculative_config.method is missing: give one of " + ", ".join(METHODS) + " (or a model)"
        )
    if method not in METHODS:
        raise ValueError(
            f"speculative_config.method {method!r} is not built; the methods are {', '.join(METHODS)}"
        )
    k = _int(raw, "num_speculative_tokens", num_speculative_tokens or None)
    if num_speculative_tokens and k != num_speculative_tokens:
        raise ValueError(
            f"num_speculative_tokens={num_speculative_tokens} and speculative_config.num_speculative_tokens"
            f"={k} disagree: give it once"
        )
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config.num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
        )
    low = _int(raw, "prompt_lookup_min", 1)
    high = _int(raw, "prompt_lookup_max", max(3, low))
    if not 1 <= low <= high:
        raise ValueError(
            f"speculative_config needs 1 <= prompt_lookup_min ({low}) <= prompt_lookup_max ({high})"
        )
    if method == "ngram" and model is not None:
        raise ValueError("speculative_config.model: method 'ngram' drafts from the prompt and takes no model")
    if method != "ngram" and model is None:
        raise ValueError(f"speculative_config.model is missing: method {method!r} needs a draft checkpoint")
    if method != "ngram" and ("prompt_lookup_min" in raw or "prompt_lookup_max" in raw):
        raise ValueError(f"speculative_config.prompt_lookup_min/max are ngram's; method is {method!r}")
    draft_tp = _int(raw, "draft_tensor_parallel_size", 1)
    if draft_tp != 1:
        raise ValueError(
            f"speculative_config.draft_tensor_parallel_size={draft_tp}: only 1 is built (the draft runs "
            "on the target's device, beside it)"
        )
    dtype = raw.get("dtype", "auto")
    if dtype not in _DRAFT_DTYPES:
        raise ValueError(f"speculative_config.dtype must be one of {', '.join(_DRAFT_DTYPES)}, got {dtype!r}")
    return SpeculativeConfig(
        method=cast(SpeculativeMethod, method),
        num_speculative_tokens=k,
        prompt_lookup_min=low,
        prompt_lookup_max=high,
        model=model,
        dtype=dtype,
        draft_tensor_parallel_size=draft_tp,
    )


def resolve_speculative_config(
    raw: Mapping[str, Any] | None,
    num_speculative_tokens: int,
    *,
    target_vocab_size: int | None,  # the target's config `vocab_size`; None: not known (not checked)
    draft_vocab_size: int | None,  # the draft config's target-side vocabulary; None: no draft read
    tensor_parallel_size: int,
) -> SpeculativeConfig | None:
    """None when nothing is drafted; else the config, with the draft's vocabulary checked against
    the target's. `num_speculative_tokens` alone means n-gram drafting. Raises ValueError naming
    the field. Pure."""
    if raw is None:
        if not num_speculative_tokens:
            return None
        raw = {"method": "ngram"}
    config = parse_speculative_config(raw, num_speculative_tokens)
    if not config.uses_draft_model:
        return config
    if tensor_parallel_size > 1:
        raise ValueError(
            f"speculative_config.method {config.method!r} with tensor_parallel_size={tensor_parallel_size}: "
            "a draft network runs on one device beside an unsharded target only; use method 'ngram'"
        )
    known = target_vocab_size is not None and draft_vocab_size is not None
    if known and draft_vocab_size != target_vocab_size:
        raise ValueError(
            f"speculative_config.model {config.model!r} has a vocabulary of {draft_vocab_size} tokens and "
            f"the target one of {target_vocab_size}: a draft must score the target's token ids"
        )
    return config


def _int(raw: Mapping[str, Any], key: str, default: int | None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"speculative_config.{key} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{key} must be an integer, got {value!r}")
    return value
