"""Tensor-parallel sharding without processes: which rows and columns each rank holds, the errors
for shapes that do not split, and reading a checkpoint shard by shard."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from pagedserve.distributed.group import TensorParallelGroup
from pagedserve.distributed.sharding import ShardLayout, TensorSlice, shard_weights
from pagedserve.models.decoder import head_size_of
from pagedserve.models.tensor_parallel import iter_safetensors_shard


def _config(**overrides: object) -> LlamaConfig:
    values: dict[str, object] = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def _layout(rank: int, world: int, **overrides: object) -> ShardLayout:
    config = _config(**overrides)
    return ShardLayout.for_config(config, TensorParallelGroup(rank, world), head_size_of(config))


def test_heads_and_intermediate_split_evenly() -> None:
    layouts = [_layout(r, 2) for r in range(2)]
    assert [lay.local_q_heads for lay in layouts] == [2, 2]
    assert [lay.local_kv_heads for lay in layouts] == [1, 1]
    assert [lay.first_kv_head for lay in layouts] == [0, 1]
    assert [lay.local_intermediate for lay in layouts] == [48, 48]


def test_kv_heads_are_replicated_when_ranks_outnumber_them() -> None:
    # 4 query heads, 2 KV heads, 4 ranks: ranks 0,1 attend with KV head 0, ranks 2,3 with KV head 1,
    # exactly the KV head their one query head belongs to (query head h uses KV head h // 2).
    layouts = [_layout(r, 4) for r in range(4)]
    assert [lay.local_kv_heads for lay in layouts] == [1, 1, 1, 1]
    assert [lay.first_kv_head for lay in layouts] == [0, 0, 1, 1]
    assert [lay.rank * lay.local_q_heads // 2 for lay in layouts] == [0, 0, 1, 1]


def test_vocabulary_ranges_cover_every_id_once_with_padding() -> None:
    for world in (2, 4):
        layouts = [_layout(r, world) for r in range(world)]
        ranges = [lay.vocab_range for lay in layouts]
        assert ranges[0][0] == 0 and ranges[-1][1] == 101
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert all(lay.vocab_per_rank * world >= 101 for lay in layouts)


@pytest.mark.parametrize(
    ("world", "overrides", "problem"),
    [
        (3, {}, "num_attention_heads=4 is not a multiple"),
        (2, {"intermediate_size": 95}, "intermediate_size=95"),
        (
            4,
            {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 6},
            "num_key_value_heads=6",
        ),
    ],
)
def test_shapes_that_do_not_split_are_refused_by_name(world: int, overrides: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=f"tensor_parallel_size={world} cannot shard") as info:
        _layout(0, world, **overrides)
    assert problem in str(info.value)


def test_slices_select_heads_columns_and_vocab_rows() -> None:
    lay = _layout(1, 2)
    assert lay.slice_of("model.layers.0.self_attn.q_proj.weight") == TensorSlice(0, 32, 32)
    assert lay.slice_of("model.layers.0.self_attn.k_proj.bias") == TensorSlice(0, 16, 16)
    assert lay.slice_of("model.layers.0.self_attn.o_proj.weight") == TensorSlice(1, 32, 32)
    assert lay.slice_of("model.layers.0.self_attn.o_proj.bias") is None  # added once, after the sum
    assert lay.slice_of("model.layers.0.mlp.up_proj.weight") == TensorSlice(0, 48, 48)
    assert lay.slice_of("model.layers.0.mlp.down_proj.weight") == TensorSlice(1, 48, 48)
    assert lay.slice_of("lm_head.weight") == TensorSlice(0, 51, 50, padded=51)
    assert lay.slice_of("model.norm.weight") is None


def test_sharded_read_equals_slicing_the_whole_tensor(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(101, 64, generator=gen),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64, generator=gen),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(96, 64, generator=gen),
        "model.norm.weight": torch.randn(64, generator=gen),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for rank in range(2):
        lay = _layout(rank, 2)
        read = dict(iter_safetensors_shard(tmp_path, lay))
        cut = dict(shard_weights(tensors.items(), lay))
        assert read.keys() == cut.keys() == tensors.keys()
        for name in tensors:
            assert torch.equal(read[name], cut[name]), name
    last = dict(iter_safetensors_shard(tmp_path, _layout(1, 2)))["model.embed_tokens.weight"]
    assert last.shape == (51, 64)
    assert torch.equal(last[:50], tensors["model.embed_tokens.weight"][51:])
    assert not last[50].any()  # the padding row


def test_engine_refuses_an_unshardable_model_before_starting_ranks(tmp_path: Path) -> None:
    from models_harness import save_checkpoint, tiny_hf_model

    from pagedserve import LLM

    path = save_checkpoint(tiny_hf_model(_config(), seed=0), tmp_path / "llama")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 cannot shard this model"):
        LLM(str(path), skip_tokenizer_init=True, tensor_parallel_size=3, num_kv_blocks=8)
