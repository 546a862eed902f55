"""`LLM.classify` and `LLM.score`: pooling requests turned into class probabilities and pair
scores, with vLLM's meanings.

* classify: a `*ForSequenceClassification` checkpoint's head over the last token's final hidden
  state (`models.sequence_classification`), softmax over its labels (sigmoid for one label).
* score, cross-encoder: with such a checkpoint of one label, each pair is encoded as the
  tokenizer encodes a text pair (`tokenizer(text, text_pair=...)`) and scored by the sigmoid of
  the head's logit.
* score, embeddings: with any other model, both texts are embedded (the last token's, normalized)
  and scored by their cosine similarity.

`data_1` / `data_2` pair up one to one, or one `data_1` text with every `data_2` text, as vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from pagedserve.engine.input_processor import ParamError
from pagedserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedserve.pooling_params import PoolingParams

# prompts (text or token ids), one PoolingParams each -> one output each, in order (`LLM.encode`)
PoolingRun = Callable[[list[str | Sequence[int]], list[PoolingParams]], list[PoolingRequestOutput]]

SCORE_TEXTS = "a string or a list of strings"


def is_classifier(architecture: str) -> bool:
    """Whether a checkpoint of this architecture has a sequence-classification head."""
    return architecture.endswith("ForSequenceClassification")


def require_classifier(architecture: str, method: str) -> None:
    """Raise ValueError unless the architecture has a classification head."""
    if not is_classifier(architecture):
        raise ValueError(
            f"{method} needs a *ForSequenceClassification checkpoint (a classification head); this "
            f"model is {architecture}: use embed() for its vectors"
        )


def class_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """[num_labels] logits -> probabilities: softmax, or the sigmoid of a lone logit (vLLM's
    activation for classification heads). Does not mutate."""
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)


def classify(
    run: PoolingRun, prompts: list[str | Sequence[int]], params: list[PoolingParams]
) -> list[ClassificationRequestOutput]:
    """One `ClassificationRequestOutput` per prompt, in order."""
    asked = [classify_params(p) for p in params]
    return [
        ClassificationRequestOutput(
            o.request_id,
            ClassificationOutput(class_probabilities(o.outputs.data).tolist()),
            o.prompt_token_ids,
            o.finished,
        )
        for o in run(prompts, asked)
    ]


def score(
    run: PoolingRun,
    tokenizer: PreTrainedTokenizerBase,
    architecture: str,
    data_1: str | Sequence[str],
    data_2: str | Sequence[str],
    params: PoolingParams | None,
) -> list[ScoringRequestOutput]:
    """One `ScoringRequestOutput` per pair, in order: a cross-encoder's sigmoid probability for a
    classification checkpoint, the cosine similarity of the two embeddings otherwise. Raises
    ValueError for mismatched lists, or a classification head of more than one label."""
    pairs = score_pairs(data_1, data_2)
    if is_classifier(architecture):
        return _cross_encoder(run, tokenizer, pairs, params)
    return _embedding_similarity(run, pairs, params)


def score_pairs(
    data_1: str | Sequence[str], data_2: str | Sequence[str], names: tuple[str, str] = ("data_1", "data_2")
) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score: one to one, or one text_1 against every text_2.
    Raises ParamError naming the argument that is wrong, as `names` calls the two (the server's
    fields are text_1 and text_2)."""
    first, second = _texts(data_1, names[0]), _texts(data_2, names[1])
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ParamError(
            f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one {names[0]} text "
            f"for all of {names[1]}, or as many as {names[1]} (pairs one to one)",
            names[1],
        )
    return list(zip(first, second, strict=True))


def pair_token_ids(
    tokenizer: PreTrainedTokenizerBase, text_1: str, text_2: str, max_length: int | None = None
) -> list[int]:
    """A cross-encoder's prompt for one pair: the tokenizer's own text-pair template. With
    `max_length`, the tokenizer's pair truncation cuts the longer text first and keeps the special
    tokens. Does not mutate the tokenizer."""
    if max_length is None:
        return list(tokenizer(text=text_1, text_pair=text_2)["input_ids"])
    return list(tokenizer(text=text_1, text_pair=text_2, truncation=True, max_length=max_length)["input_ids"])


def classify_params(params: PoolingParams | None) -> PoolingParams:
    """The pooling of a classification request: the caller's pooling type, raw logits."""
    return PoolingParams(
        pooling_type=(params or PoolingParams()).pooling_type, normalize=False, task="classify"
    )


def cross_encoder_score(logits: torch.Tensor) -> float:
    """A one-label head's [1] logit -> the pair's score (its sigmoid). Raises ValueError for a
    head of more labels, which scores no pair."""
    if logits.numel() != 1:
        raise ValueError(
            f"score as a cross-encoder needs a classification head of one label; this one has "
            f"{logits.numel()}: use classify() for its class probabilities"
        )
    return float(class_probabilities(logits).item())


def _texts(data: str | Sequence[str], name: str) -> list[str]:
    texts = [data] if isinstance(data, str) else list(data) if isinstance(data, Sequence) else None
    if texts is None or not texts or not all(isinstance(t, str) for t in texts):
        raise ParamError(f"{name} must be {SCORE_TEXTS} (not empty), got {data!r}", name)
    return texts


def _cross_encoder(
    run: PoolingRun,
    tokenizer: PreTrainedTokenizerBase,
    pairs: list[tuple[str, str]],
    params: PoolingParams | None,
) -> list[ScoringRequestOutput]:
    prompts: list[str | Sequence[int]] = [pair_token_ids(tokenizer, a, b) for a, b in pairs]
    asked = classify_params(params)
    outputs = run(prompts, [asked] * len(prompts))
    return [
        ScoringRequestOutput(
            o.request_id, ScoringOutput(cross_encoder_score(o.outputs.data)), o.prompt_token_ids
        )
        for o in outputs
    ]


def _embedding_similarity(
    run: PoolingRun, pairs: list[tuple[str, str]], params: PoolingParams | None
) -> list[ScoringRequestOutput]:
    texts = sorted({t for pair in pairs for t in pair})  # each distinct text embedded once
    asked = params or PoolingParams()
    prompts: list[str | Sequence[int]] = list(texts)
    vectors = dict(zip(texts, run(prompts, [asked] * len(texts)), strict=True))
    scored = []
    for a, b in pairs:
        first, second = vectors[a], vectors[b]
        value = float(torch.nn.functional.cosine_similarity(first.outputs.data, second.outputs.data, dim=0))
        scored.append(
            ScoringRequestOutput(
                f"{first.request_id}-{second.request_id}",
                ScoringOutput(value),
                first.prompt_token_ids + second.prompt_token_ids,
            )
        )
    return scored
