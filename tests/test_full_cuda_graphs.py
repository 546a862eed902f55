"""Full decode CUDA graphs, compiled GPU forwards and the start-up warm-up, the parts that run
without a GPU: `cudagraph_mode` resolution and its fallbacks, the per-step routing (decode ->
full, mixed -> piecewise, too large -> no graph), the persistent padded buffers, the model
runner's dispatch with stand-in graphs, the warm-up batch sweep and the compile-cache
directories. Capture and replay on a GPU are in `test_cuda_graphs_gpu.py`; the padding contract
of the Triton kernels is in `test_triton_full_graph_padding.py`."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import torch
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.cli.engine_options import add_engine_options, engine_args_from
from pagedserve.config import EngineArgs
from pagedserve.models.spec import ModelSpec
from pagedserve.worker.cuda_graphs import default_graph_sizes, padded_size
from pagedserve.worker.full_cuda_graphs import PADDING_SLOT, DecodeGraphBuffers, FullDecodeGraphs
from pagedserve.worker.gpu_compile import configure_compile_caches
from pagedserve.worker.graph_modes import GraphPlan, plan_graphs, step_path
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.warmup import attention_warmup_batches, prepare_runner, warm_up_attention
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps

VOCAB = 96
CUDA = torch.device("cuda", 0)


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
    kwargs: dict = dict(
        enforce_eager=False,
        gpu_compile=True,
        device=CUDA,
        spec=_spec(),
        backend_supports_full=True,
        cache_ops_skip_padding=True,
    )
    kwargs.update(overrides)
    plan = plan_graphs(mode, **kwargs)
    return plan.full_decode, plan.piecewise, plan.compile, plan.notes


@pytest.mark.parametrize(
    ("mode", "full", "piecewise"),
    [
        ("full_and_piecewise", True, True),
        ("full_decode_only", True, False),
        ("piecewise", False, True),
        ("none", False, False),
    ],
)
def test_each_mode_builds_its_graph_kinds_and_compiles(mode: str, full: bool, piecewise: bool) -> None:
    got = _plan(mode)
    assert got[:3] == (full, piecewise, True)


def test_the_default_mode_is_full_and_piecewise() -> None:
    assert EngineArgs().cudagraph_mode == "full_and_piecewise"
    assert EngineArgs().gpu_compile is True


def test_enforce_eager_turns_everything_off() -> None:
    plan = plan_graphs(
        "full_and_piecewise",
        enforce_eager=True,
        gpu_compile=True,
        device=CUDA,
        spec=_spec(),
        backend_supports_full=True,
        cache_ops_skip_padding=True,
    )
    assert (plan.full_decode, plan.piecewise, plan.compile, plan.warm_up_kernels) == (False,) * 4
    assert "enforce_eager" in plan.notes[0]
    assert _plan("none", gpu_compile=False)[:3] == (False, False, False)
    assert plan_graphs(  # no graphs and no compile asked for, yet the kernels still warm up
        "none",
        enforce_eager=False,
        gpu_compile=False,
        device=CUDA,
        spec=_spec(),
        backend_supports_full=True,
        cache_ops_skip_padding=True,
    ).warm_up_kernels


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
    with pytest.raises(ValueError, match="'full' is not one of none, piecewise"):
        _plan("full")
    with pytest.raises(pydantic.ValidationError, match="cudagraph_mode"):
        EngineArgs(cudagraph_mode="full")  # type: ignore[arg-type]


def test_cli_flags_reach_engine_args() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = engine_args_from(parser.parse_args(["--cudagraph-mode", "piecewise", "--no-gpu-compile"]), None)
    assert (args.cudagraph_mode, args.gpu_compile) == ("piecewise", False)
    with pytest.raises(SystemExit, match="--cudagraph-mode"):
        engine_args_from(parser.parse_args(["--cudagraph-mode", "sometimes"]), None)


# ----------------------------------------------------------------------------- routing one step
FULL = default_graph_sizes(8)  # 1, 2, 4, 8 requests
PIECEWISE = default_graph_sizes(64)  # up to 64 tokens


@pytest.mark.parametrize(
    ("tokens", "reqs", "max_q", "full", "piecewise", "expected"),
    [
        (3, 3, 1, FULL, PIECEWISE, "full"),  # decode: padded to the 4-request graph
        (8, 8, 1, FULL, PIECEWISE, "full"),
        (9, 9, 1, FULL, PIECEWISE, "piecewise"),  # larger than every full graph
        (9, 9, 1, FULL, (), "eager"),  # full_decode_only: no piecewise fallback
        (7, 3, 5, FULL, PIECEWISE, "piecewise"),  # mixed: a prefill chunk among decodes
        (8, 4, 2, FULL, PIECEWISE, "piecewise"),  # uniform speculative batch
        (65, 1, 65, FULL, PIECEWISE, "eager"),  # beyond the piecewise ladder
        (3, 3, 1, (), PIECEWISE, "piecewise"),  # piecewise mode
        (3, 3, 1, (), (), "eager"),  # none
    ],
)
def test_step_path(
    tokens: int, reqs: int, max_q: int, full: tuple[int, ...], piecewise: tuple[int, ...], expected: str
) -> None:
    assert step_path(tokens, reqs, max_q, full_sizes=full, piecewise_sizes=piecewise) == expected


def test_full_graphs_refuse_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="need a CUDA device"):
        FullDecodeGraphs(lambda i, p: i, torch.device("cpu"), [1], max_blocks_per_req=4, max_seq_len=64)


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
    """Stands in for captured graphs on the CPU: the runner's routing is real, the forward eager."""

    def __init__(self, runner: ModelRunner, sizes: tuple[int, ...]) -> None:
        self.runner, self.sizes = runner, sizes
        self.steps: list[int] = []  # num_tokens of every step served

    def _forward(self, metadata: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        r = self.runner
        self.steps.append(ids.shape[0])
        with forward_context(ForwardContext(metadata, r.kv_caches, r.backend, r.cache_ops)):
            return r.model(ids, pos)


class _FullStandIn(_EagerStandIn):
    def covers(self, metadata: AttentionMetadata) -> bool:
        return FullDecodeGraphs.covers(self, metadata)  # type: ignore[arg-type]

    def run(self, metadata: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        assert metadata.max_query_len == 1
        return self._forward(metadata, ids, pos)


class _PiecewiseStandIn(_EagerStandIn):
    def fits(self, num_tokens: int) -> bool:
        return padded_size(self.sizes, num_tokens) is not None

    def run(self, ctx: ForwardContext, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self._forward(ctx.metadata, ids, pos)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    return save_checkpoint(tiny_hf_model(config, seed=5), tmp_path_factory.mktemp("llama"))


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
    runner.full_graphs, runner.cuda_graphs = full, piecewise  # type: ignore[assignment]
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


def test_prepare_runner_times_each_phase_and_leaves_the_kv_cache_alone(checkpoint: Path) -> None:
    # What the engine does at start on a GPU, here with only the kernel warm-up (CPU: no graphs,
    # no GPU compile): the sweep runs on the runner's own backend and caches, nothing is captured.
    runner = _llm(checkpoint).engine.core.runner
    before = [c.clone() for c in runner.kv_caches]
    limits = dict(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16, cuda_graph_max_tokens=8)
    times = prepare_runner(runner, GraphPlan(False, False, False, ()), **limits)
    sweep = attention_warmup_batches(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16)
    assert times.num_warmup_batches == len(sweep)
    assert times.kernels_s > 0 and times.compile_s == times.capture_s == 0.0
    assert runner.full_graphs is None and runner.cuda_graphs is None and runner.compiled is None
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    skipped = prepare_runner(runner, GraphPlan(False, False, False, (), warm_up_kernels=False), **limits)
    assert skipped.num_warmup_batches == 0 and skipped.kernels_s == 0.0
