"""Full CUDA graphs of mixed steps, the parts that run without a GPU: the `full` mode and its
fallback, the padded buffers of a mixed step, which steps a mixed-step graph replays, and the
model runner's dispatch with stand-in graphs (the tokens are the plain engine's). Capture and
replay on a GPU are in `test_cuda_graphs_gpu.py` and, under tensor parallelism,
`test_distributed_gpu.py`."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import graph_support
import pytest
import torch
from models_harness import random_prompts, save_tiny_llama

from pagedserve import LLM, SamplingParams
from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.graphs.cuda_graphs import default_graph_sizes
from pagedserve.worker.graphs.full_cuda_graphs import PADDING_SLOT, GraphBuffers
from pagedserve.worker.graphs.full_mixed_graphs import mixed_graph_sizes
from pagedserve.worker.graphs.step_path import MixedGraphCover, PathPlan, step_path
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.step_forward import StepForward

CPU = torch.device("cpu")
VOCAB = 96


def _spec() -> ModelSpec:
    return ModelSpec(
        architecture="LlamaForCausalLM",
        implementation="native",
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_size=16,
        hidden_size=64,
        vocab_size=VOCAB,
        dtype=torch.float32,
        sliding_windows=(None, None),
        logit_softcap=None,
        max_position_embeddings=256,
    )


# ----------------------------------------------------------------------------- the mode
def test_full_mode_adds_mixed_graphs_when_the_backend_promises_them() -> None:
    plan = graph_support.plan("full", _spec(), backend_supports_full_mixed=True)
    assert (plan.full_decode, plan.full_mixed, plan.piecewise, plan.notes) == (True, True, True, ())
    assert plan.describe().startswith("full decode + full mixed + piecewise CUDA graphs")
    # A backend of API 1.9 or older never declares it: decode graphs and piecewise graphs only.
    plan = graph_support.plan("full", _spec())
    assert (plan.full_decode, plan.full_mixed, plan.piecewise) == (True, False, True)
    assert "supports_full_cuda_graph_mixed" in plan.notes[0] and "piecewise" in plan.notes[0]
    # Without full graphs at all, the mode falls back to piecewise graphs, as full_and_piecewise does.
    plan = graph_support.plan("full", _spec(), backend_supports_full=False, backend_supports_full_mixed=True)
    assert (plan.full_decode, plan.full_mixed, plan.piecewise) == (False, False, True)
    assert not graph_support.plan("full_and_piecewise", _spec(), backend_supports_full_mixed=True).full_mixed


def test_mixed_sizes_start_at_two_tokens() -> None:
    assert mixed_graph_sizes(default_graph_sizes(16)) == (2, 4, 8, 16)
    assert mixed_graph_sizes((1,)) == ()


# ----------------------------------------------------------------------------- buffers
def _metadata(query_lens: list[int], seq_lens: list[int], width: int = 4) -> AttentionMetadata:
    n = len(query_lens)
    table = (torch.arange(n * width, dtype=torch.int32).view(n, width) + 1) % 50
    return AttentionMetadata.build(query_lens, seq_lens, table, 4)


def test_fill_step_pads_tokens_and_requests_apart() -> None:
    buffers = GraphBuffers(max_tokens=16, max_reqs=4, max_blocks_per_req=6, device=CPU)
    buffers.input_ids.fill_(5)  # an earlier step's ids: padding keeps valid ids
    md = _metadata([5, 1], [9, 3])  # a 5-token chunk beside a decode: 6 tokens, 2 requests
    ids, pos = torch.arange(10, 16), torch.tensor([4, 5, 6, 7, 8, 2])
    buffers.fill_step(8, 4, ids, pos, md)
    assert buffers.input_ids.tolist() == [10, 11, 12, 13, 14, 15] + [5] * 10
    # Requests 2 and 3 are padding: query length 0 (they start at the step's 6 tokens), seq_len 0.
    assert buffers.query_start_loc.tolist() == [0, 5, 6, 6, 6]
    assert buffers.seq_lens.tolist() == [9, 3, 0, 0]
    assert buffers.slot_mapping[:6].tolist() == md.slot_mapping.tolist()
    assert buffers.slot_mapping[6:].tolist() == [PADDING_SLOT] * 10
    capture = buffers.graph_metadata(8, 4, max_query_len=8, max_seq_len=64)
    assert (capture.num_actual_tokens, capture.num_reqs, capture.max_query_len) == (8, 4, 8)
    assert capture.query_start_loc.data_ptr() == buffers.query_start_loc.data_ptr()
    assert capture.slot_mapping.shape == (8,) and capture.block_table.shape == (4, 6)


def test_fill_step_and_graph_metadata_refuse_what_does_not_fit() -> None:
    buffers = GraphBuffers(max_tokens=8, max_reqs=2, max_blocks_per_req=4, device=CPU)
    md = _metadata([5, 1, 1], [9, 3, 3])
    seven = torch.arange(7)
    with pytest.raises(ValueError, match="7 tokens for 3 requests does not fit a graph of 8 tokens and 2"):
        buffers.fill_step(8, 2, seven, seven, md)
    with pytest.raises(ValueError, match="6 ids"):
        buffers.fill_step(8, 2, seven[:6], seven, _metadata([6, 1], [6, 2]))
    with pytest.raises(ValueError, match="block table has 6 columns"):
        buffers.fill_step(8, 2, seven, seven, _metadata([6, 1], [6, 2], width=6))
    with pytest.raises(ValueError, match="1 <= requests <= min"):
        buffers.graph_metadata(8, 3, max_query_len=8, max_seq_len=64)


# ----------------------------------------------------------------------------- which steps replay
def _cover(sizes: tuple[int, ...], *, max_num_seqs: int, prompt_steps_elsewhere: bool) -> MixedGraphCover:
    """The cover `FullMixedGraphs` makes, without a GPU: the capture keys from the real buffers'
    capture metadata."""

    # The plan: short queries among few requests plan apart (like a split-KV choice).
    def graph_key(md: AttentionMetadata) -> Hashable:
        return "short" if md.max_query_len <= 4 and md.num_reqs <= 2 else "wide"

    keys = {s: graph_key(_capture(s, max_num_seqs)) for s in sizes}
    return MixedGraphCover(sizes, max_num_seqs, 64, prompt_steps_elsewhere, graph_key, keys)


def _capture(size: int, max_num_seqs: int) -> AttentionMetadata:
    buffers = GraphBuffers(size, min(size, max_num_seqs), 4, CPU)
    return buffers.graph_metadata(size, min(size, max_num_seqs), max_query_len=size, max_seq_len=64)


@pytest.mark.parametrize(
    ("query_lens", "elsewhere", "expected"),
    [
        ([5, 1, 1], False, True),  # a chunk beside decodes: padded to 8 tokens, 3 of 4 requests
        ([5, 1, 1], True, True),  # it has decodes, so it is no prompt-only step
        ([1, 1, 1], False, False),  # a decode batch: the decode graphs' step
        ([3, 5], False, True),  # prompt chunks only, where the backend has no prefill path of its own
        ([3, 5], True, False),  # ... and where it has (it reads the step's new keys and values)
        ([9, 1], False, False),  # 10 tokens: past the ladder (2, 4, 8)
        ([1, 1, 1, 1, 2], False, False),  # 6 tokens fit 8, but 5 requests are more than its 4
        ([2, 1], False, False),  # the step plans apart from the capture (the key differs)
    ],
)
def test_which_steps_replay_a_mixed_graph(query_lens: list[int], elsewhere: bool, expected: bool) -> None:
    plan = PathPlan(full_mixed=_cover((2, 4, 8), max_num_seqs=4, prompt_steps_elsewhere=elsewhere))
    md = _metadata(query_lens, [q + 3 for q in query_lens])
    assert (step_path(md, plan) == "full_mixed") is expected


# ----------------------------------------------------------------------------- runner dispatch
class _MixedStandIn:
    """Stands in for captured mixed graphs on the CPU: the runner's routing and the cover are
    real, the forward eager."""

    def __init__(self, runner: ModelRunner, sizes: tuple[int, ...]) -> None:
        self.cover = MixedGraphCover(sizes, 4, 64, True, lambda md: None, dict.fromkeys(sizes))
        self.runner = runner
        self.steps: list[tuple[int, int]] = []  # (tokens, requests) of every step served

    def run(self, md: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        assert step_path(md, PathPlan(full_mixed=self.cover)) == "full_mixed"
        r = self.runner
        self.steps.append((md.num_actual_tokens, md.num_reqs))
        with forward_context(ForwardContext(md, r.kv_caches, r.backend, r.cache_ops)):
            return r.model(ids, pos)


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
        max_num_batched_tokens=8,  # chunks of a prompt run beside the other requests' decodes
        max_num_seqs=4,
    )


def test_runner_sends_mixed_steps_to_the_mixed_graphs(checkpoint: Path) -> None:
    prompts = random_prompts(VOCAB, [3, 20], seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False)
    plain = [o.outputs[0].token_ids for o in _llm(checkpoint).generate(prompts, params, use_tqdm=False)]
    llm = _llm(checkpoint)
    runner = llm.engine.core.runner
    mixed = _MixedStandIn(runner, (2, 4, 8))
    graph_support.runner_with(llm, StepForward(runner.model, full_mixed=mixed))  # type: ignore[arg-type]
    routed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert routed == plain
    # Step 1 holds the 3-token prompt and 5 tokens of the other: prompt chunks only, which stay
    # on the backend's own path here. Then the 20-token prompt's chunks run beside the first
    # request's decodes: 8 tokens of 2 requests, twice (7 + 1). Its last prompt token beside a
    # decode is one token per request: a decode batch, not a mixed step.
    assert mixed.steps == [(8, 2), (8, 2)]
