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
    asked = [_classify_params(p) for p in params]
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


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score: one to one, or one text_1 against every text_2.
    Raises ValueError naming the argument that is wrong."""
    first, second = _texts(data_1, "data_1"), _texts(data_2, "data_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"data_1 has {len(first)} texts and data_2 {len(second)}: give one data_1 text for all of "
            "data_2, or as many as data_2 (pairs one to one)"
        )
    return list(zip(first, second, strict=True))


def _texts(data: str | Sequence[str], name: str) -> list[str]:
    texts = [data] if isinstance(data, str) else list(data) if isinstance(data, Sequence) else None
    if texts is None or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{name} must be {SCORE_TEXTS} (not empty), got {data!r}")
    return texts


def _classify_params(params: PoolingParams) -> PoolingParams:
    return PoolingParams(pooling_type=params.pooling_type, normalize=False, task="classify")


def _cross_encoder(
    run: PoolingRun,
    tokenizer: PreTrainedTokenizerBase,
    pairs: list[tuple[str, str]],
    params: PoolingParams | None,
) -> list[ScoringRequestOutput]:
    prompts: list[str | Sequence[int]] = [
        list(tokenizer(text=a, text_pair=b)["input_ids"])  # the tokenizer's own pair template
        for a, b in pairs
    ]
    asked = _classify_params(params or PoolingParams())
    outputs = run(prompts, [asked] * len(prompts))
    scored = []
    for o in outputs:
        if o.outputs.data.numel() != 1:
            raise ValueError(
                f"score as a cross-encoder needs a classification head of one label; this one has "
                f"{o.outputs.data.numel()}: use classify() for its class probabilities"
            )
        value = float(class_probabilities(o.outputs.data).item())
        scored.append(ScoringRequestOutput(o.request_id, ScoringOutput(value), o.prompt_token_ids))
    return scored


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
