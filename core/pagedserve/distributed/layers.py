"""Megatron-style parallel layers whose outputs need communication.

Column-parallel projections (q/k/v, gate/up) need none: each rank simply holds a `MergedLinear`
with its own output rows, and its output stays sharded into attention / the activation. What
follows them must put the pieces back together:

* `RowParallelLinear` (o_proj, down_proj): each rank multiplies its input columns, one all-reduce
  sums the partial products, the (replicated) bias is added once, after the sum.
* `VocabParallelEmbedding`: each rank holds a contiguous range of vocabulary rows and looks up
  only the ids in its range (zeros elsewhere); one all-reduce assembles the embeddings.
* `VocabParallelLogits`: the LM head's rows are split the same way; each rank computes its slice
  of the logits and one all-gather concatenates them (padding rows of the last rank trimmed).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.distributed.group import TensorParallelGroup
from pagedserve.platforms.api import LinearKernel


class RowParallelLinear(nn.Linear):
    """`y = all_reduce(x_local @ W_local^T) + b`: the input's last dimension is this rank's slice."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup
    ) -> None:  # in_features: this rank's share
        super().__init__(in_features, out_features, bias=bias)
        self.group = group
        # The local product on a platform's GEMM (`models.platform_linear` routes it); None: torch's.
        self.kernel: LinearKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, in_features] -> [num_tokens, out_features]. Does not mutate `x`."""
        if self.kernel is None:
            partial = F.linear(x, self.weight)
        else:
            rows = x.reshape(-1, self.in_features)
            partial = self.kernel.op(rows, self.weight, None, None).reshape(*x.shape[:-1], self.out_features)
        # The bias joins after the sum: added on every rank before it, it would count world_size times.
        out = self.group.all_reduce(partial)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """The rows `[vocab_start, vocab_start + num_embeddings)` of the embedding matrix (the last rank's
    range may end in padding rows, which no id reaches)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        vocab_start: int,
        vocab_end: int,
        group: TensorParallelGroup,
    ) -> None:  # num_embeddings: this rank's padded share; [vocab_start, vocab_end): its real ids
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_start = vocab_start
        self.vocab_end = vocab_end
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids -> [num_tokens, embedding_dim]. Does not mutate `input_ids`."""
        inside = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(inside, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        # Adding exact zeros from the other ranks: the result equals the unsharded lookup bit for bit.
        return self.group.all_reduce(out)


class VocabParallelLogits:
    """Assembles full-vocabulary logits from each rank's slice of the LM head's output."""

    def __init__(self, vocab_size: int, group: TensorParallelGroup) -> None:
        self.vocab_size = vocab_size
        self.group = group

    def gather(
        self,
        local_logits: torch.Tensor,  # [num_selected, padded vocab share]
    ) -> torch.Tensor:  # [num_selected, vocab_size]
        """Concatenate every rank's slice in rank order and drop the padding. Does not mutate."""
        return self.group.all_gather_last(local_logits)[:, : self.vocab_size]
