"""What `LLM.generate` returns: one `RequestOutput` per prompt, in input order, each holding one
`CompletionOutput` per sample (`SamplingParams.n`); and what `LLM.encode` / `LLM.embed` return:
one `PoolingRequestOutput` / `EmbeddingRequestOutput` per prompt; `LLM.classify` and `LLM.score`
one `ClassificationRequestOutput` per prompt and one `ScoringRequestOutput` per pair. Shapes and
names follow vLLM's.

Logprobs are lists with one entry per token. Each entry maps token id -> `Logprob` and holds the
chosen token (the sampled one, or the prompt's actual next token) plus the top-N requested tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

FinishReason = Literal["stop", "length", "abort"]
"""Why a sample ended: "stop" (EOS, a stop token id or a stop string), "length" (max_tokens or the
model's context length) or "abort" (the request was cancelled)."""


@dataclass(frozen=True, slots=True)
class Logprob:
    """The log-probability of one token at one position."""

    logprob: float  # log_softmax of the model's raw logits, float32
    rank: int | None  # 1-based rank in the vocabulary (1 = most likely); None if not computed
    decoded_token: str | None = None  # the token's own text; None when detokenize=False


SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token
PromptLogprobs = list[dict[int, Logprob] | None]  # one per prompt token; the first is None (no context)


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One sample of a request."""

    index: int  # which of the request's n samples, in [0, n)
    text: str  # generated text; "" when detokenize=False; stop string excluded unless asked for
    token_ids: list[int]  # generated token ids (a stop token id is included, a stop string's tokens too)
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None unless logprobs was set
    logprobs: SampleLogprobs | None  # None unless SamplingParams.logprobs was set
    finish_reason: FinishReason | None = None  # None while still generating
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for
    # EOS, for "length" and while generating

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """When a request's milestones happened, as seen by the engine front end (wall-clock seconds,
    `time.time()`, vLLM's field names). A field is None until its milestone is reached."""

    arrival_time: float  # when the request was added
    first_token_time: float | None = None  # when its first generated token arrived
    finished_time: float | None = None  # when its last sample finished (or it was aborted)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first token, once there is one."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The state of one request after a step (streaming) or at the end (`LLM.generate`)."""

    request_id: str
    prompt: str | None  # None when the request was given as token ids
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None  # None unless SamplingParams.prompt_logprobs was set
    outputs: list[CompletionOutput]  # index i -> sample i
    finished: bool  # every sample has finished
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    metrics: RequestMetrics | None = None  # arrival, first-token and finish times


@dataclass(frozen=True, slots=True)
class PoolingOutput:
    """The pooled vector of one prompt (vLLM's name)."""

    data: torch.Tensor  # [hidden_size] float32 on the CPU


@dataclass(frozen=True, slots=True)
class PoolingRequestOutput:
    """What `LLM.encode` returns per prompt: its pooled vector. A pooling request generates no
    tokens and is finished once its prompt has been computed."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    """One prompt's embedding as a list (vLLM's name)."""

    embedding: list[float]  # [hidden_size]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True, slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(
            output.request_id,
            EmbeddingOutput(output.outputs.data.tolist()),
            output.prompt_token_ids,
            output.finished,
        )


@dataclass(frozen=True, slots=True)
class ClassificationOutput:
    """One prompt's class probabilities (vLLM's name): the softmax of a classification head's
    logits, or the sigmoid of its one logit for a one-label head."""

    probs: list[float]  # [num_labels]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True, slots=True)
class ClassificationRequestOutput:
    """What `LLM.classify` returns per prompt."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(frozen=True, slots=True)
class ScoringOutput:
    """How well one pair of texts matches (vLLM's name): a cross-encoder's sigmoid probability,
    or the cosine similarity of two embeddings."""

    score: float


@dataclass(frozen=True, slots=True)
class ScoringRequestOutput:
    """What `LLM.score` returns per pair."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the pair's tokens (a cross-encoder's one prompt, or both prompts)
    finished: bool = True
