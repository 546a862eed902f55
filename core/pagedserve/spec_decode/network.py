"""`DraftNetwork`: what a proposer needs of the network it drafts with (a draft model, an EAGLE
head), so that one proposer (`model_proposer`) drives them all."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from pagedserve.models.spec import ModelSpec, PagedCausalLM


class DraftNetwork(nn.Module, ABC):
    """A network that drafts greedily over the target's vocabulary, on its own paged KV cache.

    Position i of a request is fed, depending on `reads_target_hidden`: False (a draft model)
    token i; True (EAGLE) token i + 1 and the target's hidden state at position i. Either way its
    output at position i scores the token at position i + 1 (draft model) or i + 2 (EAGLE)."""

    spec: ModelSpec  # the KV cache's shape (layers, KV heads, head size) and dtype
    reads_target_hidden: bool

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens] absolute positions
        hidden: torch.Tensor | None,  # [num_tokens, width]: the target's (or its own carried) states
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([n, hidden] for logits, [n, hidden] carried to the next draft)
        """One forward over a flattened batch inside a forward context. Mutates its KV cache."""

    @abstractmethod
    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n] int64 greedy drafts, in the target's token ids. Does not mutate."""


class DraftModelNetwork(DraftNetwork):
    """A causal LM with the target's vocabulary, loaded like any model (`models/loader.py`)."""

    reads_target_hidden = False

    def __init__(self, model: PagedCausalLM) -> None:
        super().__init__()
        self.model = model
        self.spec = model.spec

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids, positions)
        return out, out

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).argmax(dim=-1)
