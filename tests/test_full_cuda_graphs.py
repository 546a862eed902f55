"""Full decode CUDA graphs, compiled GPU forwards and the start-up warm-up, the parts that run
without a GPU: `cudagraph_mode` resolution and its fallbacks, the per-step routing (decode ->
full, mixed -> piecewise, too large -> no graph), the persistent padded buffers, the model
runner's dispatch with stand-in graphs, the sequence-length buckets and the choice of graph by
(size, longest sequence), the warm-up batch sweep and the compile-cache directories. Capture and
replay on a GPU are in `test_cuda_graphs_gpu.py`; the padding contract of the Triton kernels is
in `test_triton_full_graph_padding.py`; the backends' plan keys are in the plugins' tests."""

from __future__ import annotations

from pathlib import Path

import graph_support
import pydantic
import pytest
import torch
from models_harness import random_prompts, save_tiny_llama

from pagedserve import LLM, SamplingParams
from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.cli.engine_options import add_engine_options, engine_args_from
from pagedserve.config import EngineArgs
from pagedserve.models.loader import load_model
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import AttentionBackend, AttentionLayerShape
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.compile.gpu_compile import (
    PROGRAMMATIC_MAX_TOKENS,
    GpuCompiledForward,
    configure_compile_caches,
    programmatic_options,
)
from pagedserve.worker.graphs.cuda_graphs import padded_size
from pagedserve.worker.graphs.full_cuda_graphs import (
    PADDING_SLOT,
    DecodeGraphBuffers,
    DecodeGraphIndex,
    FullDecodeGraphs,
    attention_layer_shapes,
    forward_graph_key,
    seq_len_buckets,
)
from pagedserve.worker.graphs.graph_modes import GraphPlan, StepLimits, no_programmatic_launch
from pagedserve.worker.graphs.step_path import DecodeGraphCover, PathPlan
from pagedserve.worker.kv_caches import KVCaches
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.startup.attention_sweep import WarmupBatch, attention_warmup_batches, warm_up_attention
from pagedserve.worker.startup.device_model import DeviceModel
from pagedserve.worker.startup.warmup import build_step_forward
from pagedserve.worker.step_forward import StepForward
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps

VOCAB = 96


def _spec(implementation: str = "native", windows: tuple[int | None, ...] = (None, None)) -> ModelSpec:
    return ModelSpec(
        architecture="LlamaForCausalLM",
        implementation=implementation,  # type: ignore[arg-type]
        num_layers=len(windows),
        num_q_heads=4,
        num_kv_heads=2,
        head_size=16,
        hidden_size=64,
        vocab_size=VOCAB,
        dtype=torch.float32,
        sliding_windows=windows,
        logit_softcap=None,
        max_position_embeddings=256,
    )


# ----------------------------------------------------------------------------- cudagraph_mode
def _plan(mode: str, **overrides: object) -> tuple[bool, bool, bool, tuple[str, ...]]:
    spec = overrides.pop("spec", _spec())
    assert isinstance(spec, ModelSpec)
    plan = graph_support.plan(mode, spec, **overrides)
    return plan.full_decode, plan.piecewise, plan.compile, plan.notes


@pytest.mark.parametrize(
    ("mode", "full", "piecewise"),
    [
        ("full_and_piecewise", True, True),
        ("full", True, True),
        ("full_decode_only", True, False),
        ("piecewise", False, True),
        ("none", False, False),
    ],
)
def test_each_mode_builds_its_graph_kinds_and_compiles(mode: str, full: bool, piecewise: bool) -> None:
    got = _plan(mode)
    assert got[:3] == (full, piecewise, True)


def test_the_default_mode_is_full() -> None:
    assert EngineArgs().cudagraph_mode == "full"
    assert EngineArgs().gpu_compile is True


def test_enforce_eager_turns_everything_off() -> None:
    plan = graph_support.plan("full_and_piecewise", _spec(), enforce_eager=True)
    assert (plan.full_decode, plan.piecewise, plan.compile, plan.warm_up_kernels) == (False,) * 4
    assert "enforce_eager" in plan.notes[0]
    assert _plan("none", gpu_compile=False)[:3] == (False, False, False)
    # no graphs and no compile asked for, yet the kernels still warm up
    assert graph_support.plan("none", _spec(), gpu_compile=False).warm_up_kernels


def test_compile_switches_off_separately() -> None:
    full, piecewise, compiled, notes = _plan("full_and_piecewise", gpu_compile=False)
    assert (full, piecewise, compiled) == (True, True, False)
    assert notes == ("gpu_compile=False",)


def test_no_graphs_off_cuda_or_for_the_transformers_fallback() -> None:
    assert _plan("full_and_piecewise", device=torch.device("cpu"))[:3] == (False, False, False)
    full, piecewise, compiled, notes = _plan("piecewise", spec=_spec("transformers"))
    assert (full, piecewise, compiled) == (False, False, False)
    assert "transformers fallback" in notes[0]


def test_a_backend_without_full_graph_support_falls_back() -> None:
    full, piecewise, _, notes = _plan("full_and_piecewise", backend_supports_full=False)
    assert (full, piecewise) == (False, True)
    assert "supports_full_cuda_graph" in notes[0] and "piecewise graphs only" in notes[0]
    full, piecewise, _, notes = _plan("full_decode_only", cache_ops_skip_padding=False)
    assert (full, piecewise) == (False, False)
    assert "skips_negative_slots" in notes[0] and "no graphs" in notes[0]


def test_an_unknown_mode_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'sometimes' is not one of none, piecewise"):
        _plan("sometimes")
    with pytest.raises(pydantic.ValidationError, match="cudagraph_mode"):
        EngineArgs(cudagraph_mode="sometimes")  # type: ignore[arg-type]


def test_cli_flags_reach_engine_args() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = engine_args_from(parser.parse_args(["--cudagraph-mode", "piecewise", "--no-gpu-compile"]), None)
    assert (args.cudagraph_mode, args.gpu_compile) == ("piecewise", False)
    with pytest.raises(SystemExit, match="--cudagraph-mode"):
        engine_args_from(parser.parse_args(["--cudagraph-mode", "sometimes"]), None)


def test_full_graphs_refuse_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="need a CUDA device"):
        FullDecodeGraphs(lambda i, p: i, torch.device("cpu"), [1], max_blocks_per_req=4, max_seq_len=64)


# ----------------------------------------------------------------------------- sequence-length buckets
@pytest.mark.parametrize(
    ("max_model_len", "block_size", "expected"),
    [
        (4096, 16, (256, 512, 1024, 2048, 4096)),
        (3000, 16, (256, 512, 1024, 2048, 3000)),  # the last bucket is max_model_len, not a power
        (257, 32, (256, 257)),
        (256, 16, (256,)),
        (64, 16, (64,)),  # shorter than the first bucket: one bucket
        (1000, 48, (288, 576, 1000)),  # the first multiple of the block size >= 256
    ],
)
def test_bucket_ladder(max_model_len: int, block_size: int, expected: tuple[int, ...]) -> None:
    assert seq_len_buckets(max_model_len, block_size) == expected


def test_bucket_ladder_refuses_bad_limits() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        seq_len_buckets(0, 16)
    with pytest.raises(ValueError, match="must be >= 1"):
        seq_len_buckets(4096, 0)


BUCKETS = (256, 512, 1024, 2048, 4096)


def _split_like_key(size: int, bucket: int) -> object:
    """A stand-in plan: small batches split by length up to 1024 keys, larger ones never."""
    return ("3d", min(bucket, 1024) // 64) if size <= 2 else ("2d",)


def test_equal_keys_share_one_graph_captured_at_their_largest_bucket() -> None:
    calls: list[tuple[int, int]] = []

    def key(size: int, bucket: int) -> object:
        calls.append((size, bucket))
        return _split_like_key(size, bucket)

    index = DecodeGraphIndex((4, 1, 2), BUCKETS, key, max_model_len=4096)
    assert sorted(calls) == sorted((s, b) for s in (1, 2, 4) for b in BUCKETS)  # once each
    # Sizes 1 and 2: 256 and 512 plan alone, 1024..4096 alike (captured at 4096); size 4: one plan.
    assert index.graphs == ((4, 4096), (2, 4096), (2, 512), (2, 256), (1, 4096), (1, 512), (1, 256))
    assert index.sizes == (1, 2, 4)


def test_keys_group_even_when_not_adjacent() -> None:
    # 256 and 4096 plan alike, the buckets between them differently: 256 replays the 4096 graph.
    index = DecodeGraphIndex((1,), BUCKETS, lambda s, b: "a" if b in (256, 4096) else b, max_model_len=4096)
    assert index.graphs == ((1, 4096), (1, 2048), (1, 1024), (1, 512))
    assert index.graph_for(1, 200) == (1, 4096)


@pytest.mark.parametrize(
    ("num_reqs", "max_seq_len", "expected"),
    [
        (1, 1, (1, 256)),
        (1, 255, (1, 256)),
        (1, 256, (1, 256)),  # a bucket holds sequences as long as itself
        (1, 257, (1, 512)),
        (1, 600, (1, 4096)),  # bucket 1024 plans like 4096: its group's graph
        (1, 4096, (1, 4096)),
        (2, 512, (2, 512)),
        (3, 100, (4, 4096)),  # padded to 4 requests, whose only plan is captured at 4096
        (4, 4096, (4, 4096)),
    ],
)
def test_a_step_replays_the_graph_of_its_size_and_bucket(
    num_reqs: int, max_seq_len: int, expected: tuple[int, int]
) -> None:
    index = DecodeGraphIndex((1, 2, 4), BUCKETS, _split_like_key, max_model_len=4096)
    assert index.graph_for(num_reqs, max_seq_len) == expected
    assert expected in index.graphs


def test_steps_beyond_the_ladders_have_no_graph() -> None:
    index = DecodeGraphIndex((1, 2, 4), BUCKETS, _split_like_key, max_model_len=4096)
    with pytest.raises(ValueError, match="max_seq_len=4097 is longer than the last"):
        index.graph_for(1, 4097)
    with pytest.raises(ValueError, match="5 requests are more than the largest full graph"):
        index.graph_for(5, 100)


def test_buckets_must_ascend_and_end_at_max_model_len() -> None:
    def key(size: int, bucket: int) -> object:
        return None

    with pytest.raises(ValueError, match="last sequence-length bucket must be max_model_len=4096, got 8192"):
        DecodeGraphIndex((1,), (256, 8192), key, max_model_len=4096)  # a bucket past max_model_len
    with pytest.raises(ValueError, match="last sequence-length bucket must be max_model_len=4096, got 2048"):
        DecodeGraphIndex((1,), (256, 2048), key, max_model_len=4096)  # long steps would have none
    with pytest.raises(ValueError, match="strictly ascending"):
        DecodeGraphIndex((1,), (512, 256, 4096), key, max_model_len=4096)
    with pytest.raises(ValueError, match="strictly ascending"):
        DecodeGraphIndex((1,), (), key, max_model_len=4096)
    with pytest.raises(ValueError, match="non-empty list of positive ints"):
        DecodeGraphIndex((0, 1), (4096,), key, max_model_len=4096)


def _index_of(
    backend: AttentionBackend, spec: ModelSpec, sizes: tuple[int, ...], buckets: tuple[int, ...]
) -> DecodeGraphIndex:
    """The index `FullDecodeGraphs` builds for `backend` and `spec`, from capture metadata on CPU
    buffers."""
    layers = attention_layer_shapes(spec, block_size=4, kv_cache_dtype=spec.dtype, device=torch.device("cpu"))
    key = forward_graph_key(backend, layers)
    buffers = DecodeGraphBuffers(max(sizes), 16, torch.device("cpu"))
    return DecodeGraphIndex(
        sizes, buckets, lambda size, bucket: key(buffers.metadata(size, bucket)), max_model_len=buckets[-1]
    )


def test_a_backend_with_the_default_key_gets_one_graph_per_size() -> None:
    # The reference backend keeps the API's default key (None): today's one graph per size,
    # planned for max_model_len, whatever the buckets.
    assert ReferenceAttentionBackend().full_graph_key(_decode_metadata([3]), _layer()) is None
    index = _index_of(ReferenceAttentionBackend(), _spec(), (1, 2, 4, 8), (16, 32, 64))
    assert index.graphs == ((8, 64), (4, 64), (2, 64), (1, 64))
    assert index.graph_for(1, 5) == (1, 64) and index.graph_for(3, 64) == (4, 64)


def _layer(window: int | None = None) -> AttentionLayerShape:
    return AttentionLayerShape(4, 2, 16, 4, torch.float32, torch.float32, torch.device("cpu"), window, None)


def test_layer_shapes_are_the_distinct_windows_of_the_model() -> None:
    spec = _spec(windows=(4, None, 4, None))
    shapes = attention_layer_shapes(
        spec, block_size=16, kv_cache_dtype=torch.float8_e4m3fn, device=torch.device("cpu")
    )
    assert [s.sliding_window for s in shapes] == [4, None]
    assert shapes[0] == AttentionLayerShape(
        num_q_heads=4, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float32,
        kv_cache_dtype=torch.float8_e4m3fn, device=torch.device("cpu"), sliding_window=4,
    )  # fmt: skip


def test_the_forward_key_asks_every_layer_shape() -> None:
    seen: list[tuple[int, int | None]] = []

    class Windowed(ReferenceAttentionBackend):
        def full_graph_key(self, metadata: AttentionMetadata, layer: AttentionLayerShape) -> object:
            seen.append((metadata.max_seq_len, layer.sliding_window))
            # Like a kernel whose work is bounded by the window: longer bounds plan alike.
            span = metadata.max_seq_len if layer.sliding_window is None else min(metadata.max_seq_len, 32)
            return (metadata.num_reqs, span)

    index = _index_of(Windowed(), _spec(windows=(32, None)), (1, 2), (16, 32, 64))
    assert set(seen) == {(b, w) for b in (16, 32, 64) for w in (32, None)}
    # The full-attention layer plans differently at every bucket, so every bucket has a graph.
    assert index.graphs == ((2, 64), (2, 32), (2, 16), (1, 64), (1, 32), (1, 16))
    windowed_only = _index_of(Windowed(), _spec(windows=(32, 32)), (1,), (16, 32, 64))
    assert windowed_only.graphs == ((1, 64), (1, 16))  # 32 and 64 both plan for the window


# ----------------------------------------------------------------------------- persistent buffers
def _decode_metadata(seq_lens: list[int], width: int = 4, block_size: int = 4) -> AttentionMetadata:
    n = len(seq_lens)
    table = (torch.arange(n * width, dtype=torch.int32).view(n, width) + 1) % 50
    return AttentionMetadata.build([1] * n, seq_lens, table, block_size)


def test_fill_writes_the_real_rows_and_pads_the_rest() -> None:
    buffers = DecodeGraphBuffers(max_reqs=8, max_blocks_per_req=6, device=torch.device("cpu"))
    buffers.input_ids.fill_(5)  # an earlier step's ids: padding keeps valid ids
    metadata = _decode_metadata([3, 9, 1])
    ids, positions = torch.tensor([11, 12, 13]), torch.tensor([2, 8, 0])
    buffers.fill(4, ids, positions, metadata)
    assert buffers.input_ids.tolist() == [11, 12, 13, 5, 5, 5, 5, 5]
    assert buffers.positions[:3].tolist() == [2, 8, 0]
    # Request 3 is padding: query length 0 (start == end == 3) and seq_len 0.
    assert buffers.query_start_loc[:5].tolist() == [0, 1, 2, 3, 3]
    assert buffers.seq_lens[:4].tolist() == [3, 9, 1, 0]
    assert buffers.slot_mapping[:3].tolist() == metadata.slot_mapping.tolist()
    assert buffers.slot_mapping[3:].tolist() == [PADDING_SLOT] * 5
    assert torch.equal(buffers.block_table[:3, :4], metadata.block_table)


def test_a_smaller_step_overwrites_an_earlier_larger_one_as_padding() -> None:
    buffers = DecodeGraphBuffers(max_reqs=8, max_blocks_per_req=4, device=torch.device("cpu"))
    buffers.fill(8, torch.arange(8), torch.arange(8), _decode_metadata([4] * 8))
    buffers.fill(8, torch.tensor([1, 2]), torch.tensor([3, 3]), _decode_metadata([4, 4]))
    assert buffers.query_start_loc.tolist() == [0, 1, 2, 2, 2, 2, 2, 2, 2]
    assert buffers.seq_lens.tolist() == [4, 4, 0, 0, 0, 0, 0, 0]
    assert bool((buffers.slot_mapping[2:] == PADDING_SLOT).all())


def test_capture_metadata_views_the_buffers_with_bounded_host_fields() -> None:
    buffers = DecodeGraphBuffers(max_reqs=8, max_blocks_per_req=4, device=torch.device("cpu"))
    md = buffers.metadata(4, max_seq_len=1024)
    assert (md.num_reqs, md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (4, 4, 1, 1024)
    assert md.seq_lens.data_ptr() == buffers.seq_lens.data_ptr() and md.seq_lens.shape == (4,)
    assert md.query_start_loc.shape == (5,) and md.block_table.shape == (4, 4)
    buffers.fill(4, torch.tensor([1]), torch.tensor([0]), _decode_metadata([1]))
    assert md.seq_lens.tolist() == [1, 0, 0, 0]  # a replay reads what the last fill wrote
    buffers.pad_all()
    assert not buffers.seq_lens.any() and not buffers.query_start_loc.any()
    with pytest.raises(ValueError, match="size=9"):
        buffers.metadata(9, max_seq_len=1024)


def test_fill_refuses_what_a_decode_graph_cannot_hold() -> None:
    buffers = DecodeGraphBuffers(max_reqs=4, max_blocks_per_req=2, device=torch.device("cpu"))
    two = torch.tensor([1, 2])
    mixed = AttentionMetadata.build([2], [5], torch.zeros(1, 2, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="one token per request"):
        buffers.fill(4, two, two, mixed)
    with pytest.raises(ValueError, match="do not fit a graph of 1"):
        buffers.fill(1, two, two, _decode_metadata([1, 1], width=2))
    with pytest.raises(ValueError, match="block table has 4 columns"):
        buffers.fill(2, two, two, _decode_metadata([1, 1], width=4))


# ----------------------------------------------------------------------------- runner dispatch
class _EagerStandIn:
    """Stands in for captured graphs on the CPU: the runner's routing is real, the forward eager
    (over the runner's own KV caches and backend)."""

    def __init__(self, runner: ModelRunner, sizes: tuple[int, ...]) -> None:
        self.runner, self.sizes = runner, sizes
        self.steps: list[int] = []  # num_tokens of every step served

    def _forward(self, metadata: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        r = self.runner
        self.steps.append(ids.shape[0])
        with forward_context(ForwardContext(metadata, r.kv_caches, r.backend, r.cache_ops)):
            return r.model(ids, pos)


class _FullStandIn(_EagerStandIn):
    def __init__(self, runner: ModelRunner, sizes: tuple[int, ...]) -> None:
        super().__init__(runner, sizes)
        self.cover = DecodeGraphCover(sizes, max_seq_len=64)

    def run(self, metadata: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        assert metadata.max_query_len == 1 and metadata.num_reqs <= self.sizes[-1]
        return self._forward(metadata, ids, pos)


class _PiecewiseStandIn(_EagerStandIn):
    def run(self, ctx: ForwardContext, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        assert padded_size(self.sizes, ids.shape[0]) is not None
        return self._forward(ctx.metadata, ids, pos)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), VOCAB, seed=5)


def _llm(checkpoint: Path) -> LLM:
    return LLM(
        str(checkpoint),
        platform="cpu_reference",
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        num_kv_blocks=64,
    )


def test_runner_sends_decodes_to_full_graphs_mixed_to_piecewise_and_large_steps_eagerly(
    checkpoint: Path,
) -> None:
    prompts = random_prompts(VOCAB, [5, 30, 9], seed=2)
    lengths = [3, 8, 5]  # requests finish at different steps: decode batches of 3, then 2, then 1
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
    plain = [o.outputs[0].token_ids for o in _llm(checkpoint).generate(prompts, params, use_tqdm=False)]
    llm = _llm(checkpoint)
    runner = llm.engine.core.runner
    full = _FullStandIn(runner, (1, 2))  # a 3-request decode is larger than every full graph
    piecewise = _PiecewiseStandIn(runner, (1, 2, 4, 8, 16, 24, 32))  # the 44-token prefill is not
    forward = StepForward(runner.model, full_decode=full, piecewise=piecewise)  # type: ignore[arg-type]
    graph_support.runner_with(llm, forward)
    routed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert routed == plain
    # Step 1: the 44-token prefill runs eagerly. Steps 2-3: 3 decodes -> piecewise (3 tokens).
    # Then 2 decodes (until step 5) and 1 decode (until step 8) replay the full graphs.
    assert piecewise.steps == [3, 3]
    assert full.steps == [2, 2, 1, 1, 1]


# ----------------------------------------------------------------------------- warm-up sweep
def test_warmup_sweep_stays_within_the_engine_limits_and_covers_each_axis() -> None:
    batches = attention_warmup_batches(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024)
    assert len(batches) == len(set(batches))
    for b in batches:
        assert len(b.query_lens) <= 64 and b.num_tokens <= 512
        assert all(1 <= q <= s <= 1024 for q, s in zip(b.query_lens, b.seq_lens, strict=True))
    decodes = [b for b in batches if max(b.query_lens) == 1]
    # Every request count of the ladder and both sides of a multiple of 16, each at every context
    # length that can change a split-KV plan.
    assert {len(b.query_lens) for b in decodes} >= {1, 2, 15, 16, 17, 64}
    assert {max(b.seq_lens) for b in decodes if len(b.query_lens) == 1} == {16, 32, 64, 128, 256, 512, 1024}
    assert {max(b.query_lens) for b in batches} >= {2, 16, 17, 32, 512}
    assert any(b.query_lens == (256,) and b.seq_lens == (512,) for b in batches)  # chunk after context


def test_warmup_sweep_of_a_tiny_engine_and_bad_limits() -> None:
    batches = attention_warmup_batches(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=8)
    assert all(b.num_tokens <= 4 and max(b.seq_lens) <= 8 for b in batches)
    assert {(b.query_lens, b.seq_lens) for b in batches} >= WARMUP_TINY
    with pytest.raises(ValueError, match="must be >= 1"):
        attention_warmup_batches(max_num_seqs=0, max_num_batched_tokens=4, max_model_len=8)


WARMUP_TINY = {((1,), (8,)), ((1, 1), (8, 1)), ((2, 2), (2, 2)), ((4,), (8,))}


def test_warmup_sweep_runs_the_batch_of_every_full_graph() -> None:
    graphs = ((256, 4096), (8, 4096), (1, 4096), (1, 1024), (1, 256))
    with pytest.raises(ValueError, match="max_model_len=3000"):  # a graph planned past max_model_len
        attention_warmup_batches(
            max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=3000, decode_graphs=graphs
        )
    graphs = ((256, 3000), (8, 3000), (1, 3000), (1, 1024), (1, 256))
    batches = attention_warmup_batches(
        max_num_seqs=256, max_num_batched_tokens=128, max_model_len=3000, decode_graphs=graphs
    )
    assert len(batches) == len(set(batches))
    for size, bucket in graphs:  # even the 256-request graph, more requests than the token budget
        assert WarmupBatch((1,) * size, (bucket,) + (1,) * (size - 1)) in batches


def test_warm_up_attention_runs_every_batch_and_leaves_the_cache_alone() -> None:
    spec = _spec(windows=(None, 4))
    cache = torch.randn(spec.kv_cache_shape(8, 4))
    before = cache.clone()
    calls: list[tuple[int, int | None]] = []

    class Counting(ReferenceAttentionBackend):
        def forward(
            self,
            query: torch.Tensor,
            kv_cache: torch.Tensor,
            metadata: AttentionMetadata,
            *,
            scale: float,
            sliding_window: int | None = None,
            logit_softcap: float | None = None,
            out: torch.Tensor | None = None,
        ) -> torch.Tensor:
            calls.append((metadata.num_actual_tokens, sliding_window))
            return super().forward(
                query, kv_cache, metadata, scale=scale, sliding_window=sliding_window,
                logit_softcap=logit_softcap, out=out,
            )  # fmt: skip

    batches = attention_warmup_batches(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=8)
    warm_up_attention(Counting(), ReferenceCacheOps(), cache, spec, batches)
    # Once per batch and per layer layout (full attention and the 4-token window).
    assert sorted(calls, key=str) == sorted([(b.num_tokens, w) for b in batches for w in (None, 4)], key=str)
    assert torch.equal(cache, before)


# ----------------------------------------------------------------------------- programmatic launches
def test_programmatic_launch_needs_the_compiled_forward_and_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert _plan_with(programmatic_launch=True).programmatic_launch
    assert "programmatic dependent launches" in _plan_with(programmatic_launch=True).describe()
    assert not _plan_with(programmatic_launch=False).programmatic_launch
    assert not _plan_with(programmatic_launch=True, gpu_compile=False).programmatic_launch
    assert not _plan_with(programmatic_launch=True, enforce_eager=True).programmatic_launch
    capability[0] = (8, 9)
    ada = _plan_with(programmatic_launch=True)
    assert not ada.programmatic_launch
    assert any("sm_89 has no programmatic dependent launch" in note for note in ada.notes)
    assert no_programmatic_launch(torch.device("cpu")) is not None


def _plan_with(**overrides: object) -> GraphPlan:
    return graph_support.plan("full_and_piecewise", _spec(), **overrides)


def test_short_steps_run_the_programmatic_compilation(checkpoint: Path) -> None:
    """With programmatic launches, steps of at most PROGRAMMATIC_MAX_TOKENS tokens run the second
    compilation (inductor's `triton.enable_pdl`), longer ones the plain one; warm-up covers both."""
    model = load_model(checkpoint, dtype=torch.float32).model
    plain = GpuCompiledForward(model)
    assert not plain.programmatic and plain.warm_up_sizes() == (2, 1)
    if programmatic_options() is None:
        pytest.skip("this torch's inductor has no programmatic dependent launches")
    compiled = GpuCompiledForward(model, programmatic_launch=True)
    assert compiled.programmatic
    assert compiled.warm_up_sizes() == (2, 1, PROGRAMMATIC_MAX_TOKENS + 1)
    calls: list[str] = []
    compiled._short = lambda ids, positions: calls.append("short") or ids  # type: ignore[assignment]
    compiled._forward = lambda ids, positions: calls.append("plain") or ids  # type: ignore[assignment]
    for tokens in (1, PROGRAMMATIC_MAX_TOKENS, PROGRAMMATIC_MAX_TOKENS + 1, 300):
        ids = torch.zeros(tokens, dtype=torch.long)
        compiled(ids, ids)
    assert calls == ["short", "short", "plain", "plain"]


# ----------------------------------------------------------------------------- compile caches
def test_compile_caches_go_to_a_persistent_directory_unless_chosen(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "TRITON_CACHE_DIR": "/mine/triton"}
    chosen = configure_compile_caches(env)
    assert chosen["TRITON_CACHE_DIR"] == "/mine/triton"
    assert chosen["TORCHINDUCTOR_CACHE_DIR"] == env["TORCHINDUCTOR_CACHE_DIR"]
    assert chosen["TORCHINDUCTOR_CACHE_DIR"].endswith("pagedserve/inductor")
    env = {"PAGEDSERVE_CACHE_DIR": str(tmp_path / "c"), "XDG_CACHE_HOME": str(tmp_path / "x")}
    assert configure_compile_caches(env)["TRITON_CACHE_DIR"] == str(tmp_path / "c" / "triton")
    env = {"XDG_CACHE_HOME": str(tmp_path / "x")}
    assert configure_compile_caches(env)["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "x/pagedserve/inductor")


def test_build_step_forward_times_each_phase_and_leaves_the_kv_cache_alone(checkpoint: Path) -> None:
    # What the engine does at start on a GPU, here with only the kernel warm-up (CPU: no graphs,
    # no GPU compile): the sweep runs on the engine's own backend and caches, nothing is captured.
    llm = _llm(checkpoint)
    setup, runner = llm.engine.setup, llm.engine.core.runner
    dm = DeviceModel(setup.platform, setup.loaded, setup.backend, runner.cache_ops, runner.kv_caches[0].dtype)
    kv = KVCaches(runner.kv_caches, runner.block_size, runner.kv_scales)
    before = [c.clone() for c in runner.kv_caches]
    limits = StepLimits(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16, cuda_graph_max_tokens=8)
    forward, times = build_step_forward(dm, kv, GraphPlan(False, False, False, ()), limits)
    sweep = attention_warmup_batches(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16)
    assert times.num_warmup_batches == len(sweep)
    assert times.kernels_s > 0 and times.compile_s == times.capture_s == 0.0
    assert forward.full_decode is None and forward.piecewise is None and forward.compiled is None
    assert forward.plan == PathPlan()  # every step runs the model eagerly
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    plan = GraphPlan(False, False, False, (), warm_up_kernels=False)
    _, skipped = build_step_forward(dm, kv, plan, limits)
    assert skipped.num_warmup_batches == 0 and skipped.kernels_s == 0.0
