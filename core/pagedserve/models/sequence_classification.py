"""`*ForSequenceClassification` of the native decoders (Llama, Mistral, Qwen2, Qwen3): the
decoder with transformers' `score` head in place of the LM head, for `LLM.classify` and
`LLM.score` (as a cross-encoder).

transformers runs `score` (hidden_size -> num_labels, no bias) over the final hidden states (after
the final norm) and keeps the last token's row, which is the engine's LAST pooling: the runner
hands a classification request's pooled row to `classify`, so the logits are transformers'. The
checkpoint has no LM head; generation is refused before it could reach one (`config.runner`), and
the engine's start-up warm-up, which samples two tokens, reads the tied embedding instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.models.decoder import DecoderForCausalLM
from pagedserve.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedserve.models.qwen2 import Qwen2ForCausalLM
from pagedserve.models.qwen3 import Qwen3ForCausalLM


class SequenceClassifier(DecoderForCausalLM):
    """A native decoder with a `score` head (`config.num_labels` outputs) and no LM head."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        # No lm_head module: the checkpoint holds none, and compute_logits then reads the embedding.
        self.tie_word_embeddings = True
        self.lm_head = None
        self.score = nn.Linear(config.hidden_size, int(config.num_labels), bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] pooled final hidden states -> [n, num_labels] float32 logits, computed
        in the head's dtype as transformers does. Does not mutate."""
        return self.score(pooled.to(self.score.weight.dtype)).float()


class LlamaForSequenceClassification(SequenceClassifier, LlamaForCausalLM):
    architecture = "LlamaForSequenceClassification"


class MistralForSequenceClassification(SequenceClassifier, MistralForCausalLM):
    architecture = "MistralForSequenceClassification"


class Qwen2ForSequenceClassification(SequenceClassifier, Qwen2ForCausalLM):
    architecture = "Qwen2ForSequenceClassification"


class Qwen3ForSequenceClassification(SequenceClassifier, Qwen3ForCausalLM):
    architecture = "Qwen3ForSequenceClassification"
