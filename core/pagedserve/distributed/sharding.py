"""Sharding a decoder over a tensor-parallel group: which rows and columns of every checkpoint
tensor each rank holds (`ShardLayout`), and cutting whole tensors down to them. The module swap
that gives a native model its rank's shapes, and reading only a rank's part of a checkpoint, are
the model's (`models.tensor_parallel`).

Layout (Megatron): q/k/v and gate/up are split by output rows (whole heads; whole intermediate
columns), o_proj and down_proj by input columns, the embedding and the LM head by vocabulary rows.
With more ranks than KV heads, each KV head is replicated on `world_size / num_kv_heads` ranks
(rank r holds KV head `r * num_kv_heads // world_size`, the one its query heads attend with).
Mixture-of-experts blocks (`SparseMoE.shard`) split every expert's (and the shared expert's)
intermediate dimension the same way, the router replicated: one all-reduce per layer.
Quantized checkpoints cut their codes, scales, zero points and `g_idx` along the same split
(`quantization.tensor_parallel`, which hands `models.tensor_parallel.iter_safetensors_shard` the
part of each tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedserve.distributed.group import TensorParallelGroup

# Checkpoint projection names split by output rows (gate and up; Mixtral's experts: w1, w3) or by
# input columns (down; Mixtral's experts: w2).
_COLUMN_PARALLEL = frozenset({"gate_proj", "up_proj", "w1", "w3"})
_ROW_PARALLEL = frozenset({"down_proj", "w2"})


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Which part of every sharded tensor one rank holds. Built by `for_config`, which validates."""

    rank: int
    world_size: int
    num_q_heads: int  # of the whole model
    num_kv_heads: int  # of the whole model
    head_size: int
    intermediate_size: int  # of the whole model's dense MLPs
    vocab_size: int  # of the whole model
    expert_intermediate_size: int | None = None  # of one expert (MoE models)
    shared_expert_intermediate_size: int | None = None  # of the shared expert (Qwen2-MoE)

    @classmethod
    def for_config(cls, config: Any, group: TensorParallelGroup, head_size: int) -> ShardLayout:
        """The layout of `group.rank` for a model of `config` whose heads have `head_size`
        (`models.decoder.head_size_of`); raises `ValueError` naming the dimension that does not
        split."""
        tp = group.world_size
        hq, hkv = int(config.num_attention_heads), int(config.num_key_value_heads)
        inter = int(config.intermediate_size)
        problems = []
        if hq % tp:
            problems.append(f"num_attention_heads={hq} is not a multiple of it")
        if hkv % tp and tp % hkv:
            problems.append(f"num_key_value_heads={hkv} neither divides it nor is a multiple of it")
        if inter % tp:
            problems.append(f"intermediate_size={inter} is not a multiple of it")
        expert_inter, shared_inter = _moe_intermediate_sizes(config)
        for name, size in (
            ("the experts' intermediate size", expert_inter),
            ("shared_expert_intermediate_size", shared_inter),
        ):
            if size is not None and size % tp:
                problems.append(f"{name}={size} is not a multiple of it")
        if problems:
            raise ValueError(
                f"tensor_parallel_size={tp} cannot shard this model: "
                + "; ".join(problems)
                + ". Choose a tensor_parallel_size that divides the attention heads and intermediate size"
            )
        return cls(
            group.rank,
            tp,
            hq,
            hkv,
            head_size,
            inter,
            int(config.vocab_size),
            expert_inter,
            shared_inter,
        )

    @property
    def local_q_heads(self) -> int:
        return self.num_q_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def first_kv_head(self) -> int:
        return self.rank * self.num_kv_heads // self.world_size

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        """Rows of every rank's embedding / head (the last rank's real ones may be fewer)."""
        return -(-self.vocab_size // self.world_size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, end) of the vocabulary ids this rank holds."""
        start = min(self.rank * self.vocab_per_rank, self.vocab_size)
        return start, min(start + self.vocab_per_rank, self.vocab_size)

    def slice_of(self, name: str) -> TensorSlice | None:
        """The part of checkpoint tensor `name` this rank holds; None: the whole (replicated) tensor."""
        module_path, _, param = name.rpartition(".")
        proj = module_path.rpartition(".")[2]
        hs = self.head_size
        moe_part = self._moe_intermediate_of(module_path)
        if moe_part is not None:
            local = moe_part // self.world_size
            if proj in _COLUMN_PARALLEL:
                return TensorSlice(0, self.rank * local, local)
            if proj in _ROW_PARALLEL and param == "weight":
                return TensorSlice(1, self.rank * local, local)
            # Stacked experts (every expert in one tensor, gpt-oss's and transformers' layouts)
            # are read whole, one layer at a time; `SparseMoE` keeps its rank's slice.
            return None
        if proj == "q_proj":
            return TensorSlice(0, self.rank * self.local_q_heads * hs, self.local_q_heads * hs)
        if proj in ("k_proj", "v_proj"):
            return TensorSlice(0, self.first_kv_head * hs, self.local_kv_heads * hs)
        if proj in ("gate_proj", "up_proj"):
            return TensorSlice(0, self.rank * self.local_intermediate, self.local_intermediate)
        if proj == "o_proj" and param == "weight":
            return TensorSlice(1, self.rank * self.local_q_heads * hs, self.local_q_heads * hs)
        if proj == "down_proj" and param == "weight":
            return TensorSlice(1, self.rank * self.local_intermediate, self.local_intermediate)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, end = self.vocab_range
            return TensorSlice(0, start, end - start, padded=self.vocab_per_rank)
        return None

    def _moe_intermediate_of(self, module_path: str) -> int | None:
        """The intermediate size of the expert or shared expert `module_path` lies in; None
        for the attention and dense MLPs. Pure."""
        parts = module_path.split(".")
        if "shared_expert" in parts:
            return self.shared_expert_intermediate_size
        if "experts" in parts:
            return self.expert_intermediate_size
        return None


def _moe_intermediate_sizes(config: Any) -> tuple[int | None, int | None]:
    """(one expert's, the shared expert's) intermediate sizes of an MoE config; None where the
    config has no such part. Mixtral's experts use `intermediate_size`."""
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not num_experts:
        return None, None
    expert = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", None) or None
    return int(expert), None if shared is None else int(shared)


class TensorPart(Protocol):
    """What a rank holds of one checkpoint tensor, cut from the whole or read from disk."""

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole tensor (a copy). Does not mutate `tensor`."""
        ...

    def read(self, lazy: Any) -> torch.Tensor:
        """This rank's part read from a safetensors slice handle, reading no more than needed."""
        ...


# checkpoint tensor name -> this rank's part of it; None: the whole (replicated) tensor
PartOf = Callable[[str], TensorPart | None]


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """`length` rows (dim 0) or columns (dim 1) from `start`, zero-padded to `padded` along `dim`."""

    dim: int
    start: int
    length: int
    padded: int | None = None  # None: no padding

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This slice of a whole tensor (a copy). Does not mutate `tensor`."""
        return self._pad(tensor.narrow(self.dim, self.start, self.length).clone())

    def read(self, lazy: Any) -> torch.Tensor:
        """This slice read from a safetensors slice handle, without reading the rest of the tensor."""
        end = self.start + self.length
        part = lazy[self.start : end] if self.dim == 0 else lazy[:, self.start : end]
        return self._pad(part)

    def _pad(self, part: torch.Tensor) -> torch.Tensor:
        if self.padded is None or self.padded == self.length:
            return part
        shape = list(part.shape)
        shape[self.dim] = self.padded - self.length
        return torch.cat([part, part.new_zeros(shape)], dim=self.dim)


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], layout: ShardLayout, part_of: PartOf | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Cut whole checkpoint tensors down to this rank's part (for formats read whole, e.g. GGUF);
    `part_of` as for `iter_safetensors_shard`."""
    part_of = part_of or layout.slice_of
    for name, tensor in weights:
        part = part_of(name)
        yield name, tensor if part is None else part.take(tensor)
