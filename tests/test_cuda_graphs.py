"""Piecewise CUDA graphs, the parts that run without a GPU: the size ladder and padding choice,
that graphs refuse a CPU device (`test_full_cuda_graphs.py` has the mode rules), the attention
hook of the forward context (what capture cuts the forward at), the eager `attend` that replay
runs between graphs, and that an engine off CUDA stays eager and unchanged. The capture and
replay themselves are in `test_cuda_graphs_gpu.py`."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.attention.layer import attend, paged_attention
from pagedserve.config import EngineArgs
from pagedserve.models.loader import load_model
from pagedserve.platforms.api import CacheOps
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.graphs.cuda_graphs import (
    PiecewiseCudaGraphs,
    _SplitAtAttention,
    default_graph_sizes,
    padded_size,
)
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps

VOCAB = 96


def _config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tiny_hf_model(_config(), seed=3), tmp_path_factory.mktemp("llama"))


# ----------------------------------------------------------------------------- ladder and padding
def test_default_ladder_is_fine_then_coarse_and_capped_at_2048() -> None:
    sizes = default_graph_sizes(8192)
    assert sizes[:8] == (1, 2, 4, 8, 16, 24, 32, 40)
    assert list(sizes) == sorted(set(sizes))
    assert sizes[-1] == 2048 == EngineArgs.model_fields["cuda_graph_max_tokens"].default
    steps = [b - a for a, b in itertools.pairwise(sizes)]
    assert max(steps[:10]) <= 8  # padding is at most 8 tokens below 64
    assert max(b - a for a, b in itertools.pairwise(default_graph_sizes(8192, 512))) == 32


def test_ladder_ends_exactly_at_a_small_token_budget() -> None:
    # Every step of an engine with a 100-token budget fits a graph: 100 itself is a size.
    assert default_graph_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100)
    assert default_graph_sizes(64)[-2:] == (56, 64)
    assert default_graph_sizes(1) == (1,)
    assert default_graph_sizes(8192, max_graph_tokens=20) == (1, 2, 4, 8, 16, 20)


def test_a_cap_above_512_continues_the_ladder_an_eighth_at_a_time() -> None:
    sizes = default_graph_sizes(8192, max_graph_tokens=2048)
    assert sizes[:31] == default_graph_sizes(8192, max_graph_tokens=512)  # below 512, unchanged
    assert sizes[31:] == (576, 640, 704, 768, 832, 896, 960, 1024, *range(1152, 2049, 128))
    # A step past 512 tokens pads by less than an eighth of its size, so large steps lose little.
    assert all(padded_size(sizes, n) - n < n / 8 for n in range(513, 2049))  # type: ignore[operator]
    assert default_graph_sizes(1000, max_graph_tokens=4096)[-3:] == (896, 960, 1000)


def test_ladder_rejects_a_nonpositive_budget() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        default_graph_sizes(0)


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [(1, 1), (2, 2), (3, 4), (8, 8), (9, 16), (33, 40), (100, 100), (101, None), (5000, None)],
)
def test_padded_size_is_the_smallest_size_that_holds_the_step(num_tokens: int, expected: int | None) -> None:
    assert padded_size(default_graph_sizes(100), num_tokens) == expected


# ----------------------------------------------------------------------------- when graphs are off
def test_graphs_refuse_a_cpu_device(checkpoint: Path) -> None:
    model = load_model(checkpoint).model
    with pytest.raises(ValueError, match="need a CUDA device"):
        PiecewiseCudaGraphs(model, torch.device("cpu"), [1, 2])


# ----------------------------------------------------------------------------- the attention hook
class _NoCacheWrites(CacheOps):
    """Cache ops that fail the test if anything reaches the KV cache."""

    def reshape_and_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        raise AssertionError("the KV cache was written while an attention hook was set")

    def copy_blocks(self, kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
        raise AssertionError("copy_blocks called")

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
        raise AssertionError("swap_blocks called")


def _metadata(query_lens: list[int], seq_lens: list[int], block_size: int = 4) -> AttentionMetadata:
    blocks = -(-max(seq_lens) // block_size)
    table = torch.arange(len(seq_lens) * blocks, dtype=torch.int32).view(len(seq_lens), blocks)
    return AttentionMetadata.build(query_lens, seq_lens, table, block_size)


def test_hook_answers_attention_and_the_cache_is_left_alone() -> None:
    calls: list[tuple[int, tuple[int, ...], float, int | None]] = []
    answer = torch.full((3, 4, 16), 7.0)

    def hook(
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
    ) -> torch.Tensor:
        calls.append((layer_idx, tuple(key.shape), scale, sliding_window))
        return answer

    cache = torch.zeros(2, 4, 4, 2, 16)
    ctx = ForwardContext(_metadata([3], [3]), [cache], ReferenceAttentionBackend(), _NoCacheWrites(), hook)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    with forward_context(ctx):
        out = paged_attention(0, q, k, k, scale=0.5, sliding_window=8, logit_softcap=None)
    assert out is answer
    assert calls == [(0, (3, 2, 16), 0.5, 8)]
    assert not cache.any()


def test_native_model_calls_the_hook_once_per_layer_in_order(checkpoint: Path) -> None:
    # The eager warm-up hook of a capture: it returns rows of the shared output buffer.
    model = load_model(checkpoint).model
    spec = model.spec
    attn_out = torch.zeros(spec.num_layers, 8, spec.num_q_heads, spec.head_size)
    warmup = _SplitAtAttention(attn_out, 5, new_graph=None)
    caches = [torch.zeros(spec.kv_cache_shape(4, 4)) for _ in range(spec.num_layers)]
    ctx = ForwardContext(_metadata([5], [5]), caches, ReferenceAttentionBackend(), _NoCacheWrites(), warmup)
    with torch.no_grad(), forward_context(ctx):
        hidden = model(torch.arange(5), torch.arange(5))
    assert hidden.shape == (5, spec.hidden_size)
    assert [s.layer_idx for s in warmup.sites] == list(range(spec.num_layers))
    assert all(s.query.shape == (5, spec.num_q_heads, spec.head_size) for s in warmup.sites)
    assert all(s.out.data_ptr() == attn_out[i].data_ptr() for i, s in enumerate(warmup.sites))
    with pytest.raises(RuntimeError, match="only warms up"):
        warmup.begin_graph()


def test_hook_refuses_a_query_the_output_buffer_cannot_hold() -> None:
    hook = _SplitAtAttention(torch.zeros(1, 8, 4, 16), 5, new_graph=None)
    bad = torch.zeros(5, 2, 16)
    with pytest.raises(RuntimeError, match="enforce_eager=True"):
        hook(0, bad, bad, bad, scale=1.0, sliding_window=None, logit_softcap=None)
    hook(0, torch.zeros(5, 4, 16), bad, bad, scale=1.0, sliding_window=None, logit_softcap=None)
    with pytest.raises(RuntimeError, match="more than 1 times"):
        hook(1, torch.zeros(5, 4, 16), bad, bad, scale=1.0, sliding_window=None, logit_softcap=None)


# ----------------------------------------------------------------------------- eager attention of replay
def test_attend_on_the_real_rows_writes_only_them_and_matches_paged_attention() -> None:
    # Replay runs attention on the first num_actual_tokens rows of padded q/k/v, into the static
    # output rows; the padded rows of `out` must stay as they were and the result equal the
    # plain path's.
    torch.manual_seed(0)
    metadata = _metadata([3, 1], [5, 6])  # 4 real tokens; the buffers below hold 8 (padded)
    q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    backend, ops = ReferenceAttentionBackend(), ReferenceCacheOps()
    cache_a = torch.randn(2, 4, 4, 2, 16)
    cache_b = cache_a.clone()
    with forward_context(ForwardContext(metadata, [cache_a], backend, ops)):
        expected = paged_attention(
            0, q[:4], k[:4], v[:4], scale=0.25, sliding_window=None, logit_softcap=None
        )
    out = torch.full((8, 4, 16), 3.0)
    ctx = ForwardContext(metadata, [cache_b], backend, ops)
    attend(ctx, 0, q[:4], k[:4], v[:4], scale=0.25, sliding_window=None, logit_softcap=None, out=out[:4])
    torch.testing.assert_close(out[:4], expected)
    assert bool((out[4:] == 3.0).all())
    assert torch.equal(cache_a, cache_b)


# ----------------------------------------------------------------------------- engine off CUDA
def test_cpu_engine_stays_eager_and_gives_the_same_tokens(checkpoint: Path) -> None:
    prompts = random_prompts(VOCAB, [5, 17, 9], seed=1)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False)
    outs = {}
    for enforce_eager in (False, True):
        llm = LLM(
            str(checkpoint),
            platform="cpu_reference",  # a GPU host would pick an accelerator platform
            skip_tokenizer_init=True,
            dtype="float32",
            block_size=4,
            max_model_len=64,
            num_kv_blocks=64,
            enforce_eager=enforce_eager,
        )
        assert llm.engine.core.runner.cuda_graphs is None
        outs[enforce_eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[False] == outs[True]
    assert all(len(t) == 6 for t in outs[False])
