"""The padding contract of full decode CUDA graphs, on the Triton kernels under the interpreter:
a decode batch padded the way `DecodeGraphBuffers.fill` pads it (padding requests of query
length 0 and seq_len 0, padding slots -1) and planned from a `max_seq_len` bound gives the real
rows the outputs of the unpadded batch, in the 2D and the split-KV 3D kernels, and writes no KV
slot for a padding token. Also the start-up warm-up sweep over the Triton backend and cache ops,
which must leave the KV cache as it was."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and the kernels) are imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.graphs.full_cuda_graphs import PADDING_SLOT, DecodeGraphBuffers
from pagedserve.worker.startup.attention_sweep import attention_warmup_batches, warm_up_attention
from pagedserve_triton.attention import TritonUnifiedAttentionBackend
from pagedserve_triton.cache_ops import TritonCacheOps
from pagedserve_triton.unified_attention import unified_attention_2d_kernel

if not isinstance(unified_attention_2d_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

BLOCK_SIZE, HQ, HKV, D = 16, 4, 2, 32
SEQ_LENS = [21, 37, 2]  # three real decodes, padded to a graph of 8 requests
PADDED = 8
MAX_BLOCKS = 4


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 16, BLOCK_SIZE, HKV, D, generator=gen)
    q = torch.randn(PADDED, HQ, D, generator=gen)
    k, v = torch.randn(PADDED, HKV, D, generator=gen), torch.randn(PADDED, HKV, D, generator=gen)
    table = torch.tensor([[3, 7, 0, 0], [1, 9, 12, 0], [14, 0, 0, 0]], dtype=torch.int32)
    return cache, q, k, v, AttentionMetadata.build([1, 1, 1], SEQ_LENS, table, BLOCK_SIZE)


@pytest.mark.parametrize("num_splits", [1, 4])  # the 2D kernel, the split-KV 3D kernel
@pytest.mark.parametrize("window", [None, 3])
def test_padded_decode_batch_equals_the_unpadded_one(num_splits: int, window: int | None) -> None:
    cache, q, k, v, real = _inputs()
    ops = TritonCacheOps()
    backend = TritonUnifiedAttentionBackend(num_splits=num_splits)

    cache_real = cache.clone()
    ops.reshape_and_cache(k[:3], v[:3], cache_real, real.slot_mapping)
    expected = backend.forward(q[:3], cache_real, real, scale=0.25, sliding_window=window)

    buffers = DecodeGraphBuffers(PADDED, MAX_BLOCKS, torch.device("cpu"))
    buffers.fill(PADDED, torch.arange(3), torch.tensor(SEQ_LENS) - 1, real)
    # The graph's plan: host fields of the padded size and the max_model_len bound.
    padded = buffers.metadata(PADDED, max_seq_len=64)
    cache_padded = cache.clone()
    ops.reshape_and_cache(k, v, cache_padded, padded.slot_mapping)
    assert torch.equal(cache_padded, cache_real)  # padding tokens wrote nothing
    out = torch.full((PADDED, HQ, D), 7.0)
    backend.forward(q, cache_padded, padded, scale=0.25, sliding_window=window, out=out)
    torch.testing.assert_close(out[:3], expected, rtol=1e-5, atol=1e-5)


def test_negative_slots_are_skipped_among_real_ones() -> None:
    cache, _, k, v, _ = _inputs()
    before = cache.clone()
    slots = torch.tensor([PADDING_SLOT, 6, PADDING_SLOT, 45], dtype=torch.int64)
    TritonCacheOps().reshape_and_cache(k[:4], v[:4], cache, slots)
    flat = cache.view(2, -1, HKV, D)
    torch.testing.assert_close(flat[0, 6], k[1])
    torch.testing.assert_close(flat[1, 45], v[3])
    changed = (flat != before.view(2, -1, HKV, D)).any(3).any(2).any(0)  # [num_slots]
    assert changed.nonzero().flatten().tolist() == [6, 45]


def test_warm_up_sweep_over_triton_leaves_the_cache_alone() -> None:
    spec = ModelSpec(
        architecture="LlamaForCausalLM",
        implementation="native",
        num_layers=1,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        hidden_size=HQ * D,
        vocab_size=32,
        dtype=torch.float32,
        sliding_windows=(None,),
        logit_softcap=None,
        max_position_embeddings=64,
    )
    cache = torch.randn(2, 4, BLOCK_SIZE, HKV, D)
    before = cache.clone()
    batches = attention_warmup_batches(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=8)
    warm_up_attention(TritonUnifiedAttentionBackend(), TritonCacheOps(), cache, spec, batches)
    assert torch.equal(cache, before)


def test_a_model_forward_on_padded_buffers_gives_the_real_rows_hidden_states(tmp_path: Path) -> None:
    # What a full graph replays: the whole forward over the padded buffers, planned from the
    # max_model_len bound. Garbage in the padding rows (the 3D kernel's reduction of unwritten
    # partials) must not reach a real row through any layer, and the KV cache must end up as
    # the unpadded step leaves it.
    from models_harness import save_checkpoint, tiny_hf_model
    from transformers import LlamaConfig

    from pagedserve.attention.forward_context import ForwardContext, forward_context
    from pagedserve.models.loader import load_model

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=128,
    )
    model = load_model(save_checkpoint(tiny_hf_model(config, seed=4), tmp_path / "llama")).model
    spec = model.spec
    backend, ops = TritonUnifiedAttentionBackend(num_splits=4), TritonCacheOps()
    caches = [torch.zeros(spec.kv_cache_shape(16, BLOCK_SIZE)) for _ in range(spec.num_layers)]
    table = torch.tensor([[3, 7, 0, 0], [1, 9, 12, 0], [14, 0, 0, 0]], dtype=torch.int32)
    prompt_lens = [s - 1 for s in SEQ_LENS]
    ids = torch.randint(1, 64, (sum(prompt_lens),), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in prompt_lens])
    prefill = AttentionMetadata.build(prompt_lens, prompt_lens, table, BLOCK_SIZE)
    with torch.inference_mode():
        with forward_context(ForwardContext(prefill, caches, backend, ops)):
            model(ids, positions)
        decode = AttentionMetadata.build([1, 1, 1], SEQ_LENS, table, BLOCK_SIZE)
        new_ids, new_pos = torch.tensor([5, 6, 7]), torch.tensor(prompt_lens)
        real_caches = [c.clone() for c in caches]
        with forward_context(ForwardContext(decode, real_caches, backend, ops)):
            expected = model(new_ids, new_pos)

        buffers = DecodeGraphBuffers(PADDED, MAX_BLOCKS, torch.device("cpu"))
        buffers.input_ids.fill_(9)  # an earlier step's ids in the padding rows
        buffers.fill(PADDED, new_ids, new_pos, decode)
        padded_caches = [c.clone() for c in caches]
        metadata = buffers.metadata(PADDED, max_seq_len=config.max_position_embeddings)
        with forward_context(ForwardContext(metadata, padded_caches, backend, ops)):
            hidden = model(buffers.input_ids[:PADDED], buffers.positions[:PADDED])
    torch.testing.assert_close(hidden[:3], expected, rtol=1e-5, atol=1e-5)
    new_slots = decode.slot_mapping.tolist()
    for before, real, padded in zip(caches, real_caches, padded_caches, strict=True):
        # Equal up to rounding (a GEMM over 8 rows may round differently from one over 3) ...
        torch.testing.assert_close(padded, real, rtol=1e-5, atol=1e-5)
        # ... and exactly the three new tokens' slots were written, nothing for the padding.
        flat, flat_before = padded.view(2, -1, 1, 32), before.view(2, -1, 1, 32)
        written = (flat != flat_before).any(3).any(2).any(0).nonzero().flatten().tolist()
        assert written == sorted(new_slots)
