"""A native decoder over a tensor-parallel group: the module swap that gives a meta-built model its
rank's shapes (`shard_model`), and reading only the rank's part of a safetensors checkpoint
(`iter_safetensors_shard`). Which part each rank holds is `distributed.sharding.ShardLayout`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.distributed.group import TensorParallelGroup
from pagedserve.distributed.layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelLogits
from pagedserve.distributed.sharding import PartOf, ShardLayout
from pagedserve.models.decoder import DecoderForCausalLM, DecoderLayer
from pagedserve.models.layers import GatedMLP, MergedLinear
from pagedserve.models.weights import safetensors_files
from pagedserve.moe.layer import SparseMoE


def shard_model(model: DecoderForCausalLM, layout: ShardLayout, group: TensorParallelGroup) -> None:
    """Give a freshly built (meta-device) native model this rank's shapes: swap its projections,
    embedding and head for their sharded forms and its spec for the local head counts. Call under
    the device the model was built on, before materializing and loading it. Mutates `model`."""
    config = model.config
    hidden = int(config.hidden_size)
    hs = layout.head_size
    q_size, kv_size = layout.local_q_heads * hs, layout.local_kv_heads * hs
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        attn.qkv_proj = MergedLinear(
            hidden,
            {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
            bias=attn.qkv_proj.bias is not None,
        )
        attn.o_proj = RowParallelLinear(q_size, hidden, attn.o_proj.bias is not None, group)
        attn.num_heads, attn.num_kv_heads = layout.local_q_heads, layout.local_kv_heads
        attn.q_size, attn.kv_size = q_size, kv_size
        attn.attn.num_heads, attn.attn.num_kv_heads = layout.local_q_heads, layout.local_kv_heads
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            mlp.shard(layout.rank, layout.world_size, group)
            continue
        assert isinstance(mlp, GatedMLP)
        inter = layout.local_intermediate
        mlp_bias = mlp.down_proj.bias is not None
        mlp.gate_up_proj = MergedLinear(hidden, {"gate_proj": inter, "up_proj": inter}, bias=mlp_bias)
        mlp.down_proj = RowParallelLinear(inter, hidden, mlp_bias, group)
        mlp.intermediate_size = inter
    start, end = layout.vocab_range
    model.model.embed_tokens = VocabParallelEmbedding(layout.vocab_per_rank, hidden, start, end, group)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(hidden, layout.vocab_per_rank, bias=False)
    model.vocab_parallel = VocabParallelLogits(layout.vocab_size, group)
    model.spec = dataclasses.replace(
        model.spec, num_q_heads=layout.local_q_heads, num_kv_heads=layout.local_kv_heads
    )


def iter_safetensors_shard(
    directory: Path, layout: ShardLayout, part_of: PartOf | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield this rank's part of every tensor of a safetensors checkpoint, reading only that part
    from disk: a rank never holds the whole checkpoint. `part_of` says what the part of a tensor
    is (a quantized checkpoint's, `quantization.tensor_parallel`); by default `layout.slice_of`."""
    part_of = part_of or layout.slice_of
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                part = part_of(name)
                yield name, f.get_tensor(name) if part is None else part.read(f.get_slice(name))
