"""CUDA graphs on a real GPU: greedy tokens with full decode graphs, piecewise graphs and the
compiled forward (per layer and whole) equal those of `enforce_eager=True`, for tiny float32
Llama, Mistral (sliding window) and Qwen3 models, through a whole-batch prefill that replays a
piecewise graph, chunked prefill mixed with decodes, preemption, and a step too large for any
graph; every `cudagraph_mode` on the triton and cuda platforms; the graphs captured are the ones
the ladders name; a short context replays a full graph planned for its sequence-length bucket;
and once the engine is built, serving compiles no kernel.

Skipped without a CUDA GPU. On a GPU machine run this file in its own pytest process (the
interpreter test files set TRITON_INTERPRET=1, which would put the Triton kernels on the CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_support import load_benchmark
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.worker.graphs.cuda_graphs import borrow, default_graph_sizes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "triton"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


_engine_check = load_benchmark("gpu_engine_check")  # its tiny model configs
VOCAB: int = _engine_check.VOCAB
CONFIGS = {arch: _engine_check.CONFIGS[arch] for arch in ("llama", "mistral", "qwen3")}
MAX_NEW = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for i, (arch, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(i)
        hf: Any = AutoModelForCausalLM.from_config(make(), dtype=torch.float32)
        path = tmp_path_factory.mktemp(arch)
        hf.save_pretrained(path)
        out[arch] = path
    return out


def _prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


# Whole-batch first step: 479 tokens, padded to the 480-token graph.
PROMPTS = _prompts([5, 33, 100, 260, 17, 64])
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)


def _run(
    path: Path, prompts: list[list[int]], platform: str = "triton", **engine: Any
) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        str(path),
        platform=platform,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=1024,
        **engine,
    )
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_borrowed_view_aliases_without_owning() -> None:
    base = torch.randn(6, 10, dtype=torch.float32, device="cuda").to(torch.bfloat16)
    view = base[:, 2:8].view(6, 3, 2)
    alias = borrow(view)
    assert alias.dtype == torch.bfloat16 and alias.shape == view.shape and alias.stride() == view.stride()
    assert alias.data_ptr() == view.data_ptr()
    base.fill_(3.0)
    assert bool((alias == 3.0).all())


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize(
    ("label", "engine"),
    [
        ("whole-batch", {"num_kv_blocks": 256, "max_num_seqs": 8}),
        ("chunked+preempt", {"num_kv_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 4}),
    ],
)
def test_graphs_give_the_eager_tokens(
    checkpoints: dict[str, Path], arch: str, label: str, engine: dict
) -> None:
    # The default mode: full graphs for decode batches and mixed steps, piecewise graphs for the
    # rest, compiled.
    path = checkpoints[arch]
    eager, _ = _run(path, PROMPTS, enforce_eager=True, **engine)
    graphed, llm = _run(path, PROMPTS, **engine)
    assert graphed == eager
    runner = llm.engine.core.runner
    graphs, full, mixed = runner.cuda_graphs, runner.full_graphs, runner.mixed_graphs
    assert graphs is not None and full is not None and mixed is not None and runner.compiled is not None
    budget = engine.get("max_num_batched_tokens", 8192)
    num_layers = runner.spec.num_layers
    # One graph before each attention layer and one after the last: L + 1 per size.
    assert graphs.graphs_per_size() == {s: num_layers + 1 for s in default_graph_sizes(budget)}
    assert full.sizes == default_graph_sizes(engine["max_num_seqs"])
    if label == "whole-batch":
        # The 479-token prefill (prompts only: the backend's own prefill path) replays piecewise
        # graphs (padded to 480), the MAX_NEW - 1 decode steps of 6 requests the full graph of 8.
        assert (graphs.num_replays, full.num_replays, mixed.num_replays) == (1, MAX_NEW - 1, 0)
    else:
        # Chunks beside decodes replay the mixed-step graphs, then decodes the decode graphs.
        assert mixed.num_replays > 0 and full.num_replays > 0
        assert llm.engine.core.scheduler.num_preemptions > 0


_EAGER: dict[str, list[list[int]]] = {}  # platform -> eager tokens of the mode test's engine


@pytest.mark.parametrize(
    ("platform", "mode", "compiled"),
    [
        ("triton", "full_and_piecewise", False),
        ("triton", "full", True),
        ("cuda", "full", True),
        ("triton", "full_decode_only", True),
        ("triton", "piecewise", True),
        ("triton", "none", True),
        ("cuda", "full_and_piecewise", True),
        ("cuda", "full_decode_only", True),
    ],
)
def test_every_mode_gives_the_eager_tokens(
    checkpoints: dict[str, Path], platform: str, mode: str, compiled: bool
) -> None:
    path = checkpoints["mistral"]  # the sliding window exercises the windowed kernels too
    engine = {"num_kv_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 4, "platform": platform}
    if platform not in _EAGER:
        _EAGER[platform] = _run(path, PROMPTS, enforce_eager=True, **engine)[0]
    eager = _EAGER[platform]
    graphed, llm = _run(path, PROMPTS, cudagraph_mode=mode, gpu_compile=compiled, **engine)
    assert graphed == eager
    runner = llm.engine.core.runner
    assert (runner.full_graphs is not None) == mode.startswith("full")
    assert (runner.cuda_graphs is not None) == (mode in ("piecewise", "full_and_piecewise", "full"))
    assert (runner.mixed_graphs is not None) == (mode == "full")
    assert (runner.compiled is not None) == compiled
    if runner.full_graphs is not None:
        assert runner.full_graphs.num_replays > 0
    if runner.mixed_graphs is not None:
        # The 64-token budget splits the prompts into chunks that run beside decodes.
        assert runner.mixed_graphs.num_replays > 0


@pytest.mark.parametrize("mode", ["none", "full"])
@pytest.mark.parametrize("scope", ["layer", "model"])
def test_both_compile_scopes_give_the_eager_tokens(
    checkpoints: dict[str, Path], mode: str, scope: str
) -> None:
    # "none": every step runs the compiled forward itself; "full": the graphs replay it.
    path = checkpoints["qwen3"]  # per-head q/k norms inside the first stretch of each layer
    engine = {"num_kv_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 4}
    eager, _ = _run(path, PROMPTS, enforce_eager=True, **engine)
    compiled, llm = _run(path, PROMPTS, cudagraph_mode=mode, gpu_compile_scope=scope, **engine)
    assert compiled == eager
    runner = llm.engine.core.runner
    assert runner.compiled is not None and runner.compiled.scope == scope


def test_a_step_beyond_the_ladder_runs_eagerly(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["mistral"]
    prompts = _prompts([600])
    eager, _ = _run(path, prompts, enforce_eager=True, num_kv_blocks=64)
    graphed, llm = _run(path, prompts, num_kv_blocks=64, cuda_graph_max_tokens=512)
    assert graphed == eager
    runner = llm.engine.core.runner
    assert runner.cuda_graphs is not None and runner.full_graphs is not None
    # The 600-token prefill runs the compiled forward; each of the MAX_NEW - 1 decodes after it
    # replays the one-request full graph.
    assert runner.cuda_graphs.num_replays == 0
    assert runner.full_graphs.num_replays == MAX_NEW - 1


@pytest.mark.parametrize("platform", ["triton", "cuda"])
def test_short_contexts_replay_graphs_planned_for_their_bucket(
    checkpoints: dict[str, Path], platform: str
) -> None:
    # max_model_len 1024 gives the buckets 256, 512, 1024. One request (2 KV heads: a split-KV
    # plan, or v2 partitions, that follow the bound) of 250 prompt tokens decodes at sequence
    # lengths 251..273: six steps replay the one-request graph planned for 256 tokens, the other
    # seventeen the one planned for 512, and the tokens are the eager ones.
    path = checkpoints["llama"]
    prompts = _prompts([250])
    engine = {"num_kv_blocks": 64, "max_num_seqs": 4, "platform": platform}
    eager, _ = _run(path, prompts, enforce_eager=True, **engine)
    graphed, llm = _run(path, prompts, **engine)
    assert graphed == eager
    full = llm.engine.core.runner.full_graphs
    assert full is not None and full.buckets == (256, 512, 1024)
    assert (1, 256) in full.graphs and (1, 512) in full.graphs and full.num_graphs > len(full.sizes)
    assert full.index.graph_for(1, 256) == (1, 256) and full.index.graph_for(1, 257) == (1, 512)
    assert dict(full.replays) == {(1, 256): 6, (1, 512): MAX_NEW - 1 - 6}


def test_enforce_eager_captures_and_compiles_nothing(checkpoints: dict[str, Path]) -> None:
    _, llm = _run(checkpoints["llama"], PROMPTS[:1], enforce_eager=True, num_kv_blocks=32)
    runner = llm.engine.core.runner
    assert runner.cuda_graphs is None and runner.full_graphs is None and runner.compiled is None


def _compiled_variants() -> dict[str, int]:
    """Kernel name -> variants Triton has compiled in this process, for the triton platform's
    kernels (attention and cache writes)."""
    from pagedserve_triton import cache_kernels, unified_attention

    kernels = {
        "unified_attention_2d": unified_attention.unified_attention_2d_kernel,
        "unified_attention_3d": unified_attention.unified_attention_3d_kernel,
        "reduce_segments": unified_attention.reduce_segments_kernel,
        "reshape_and_cache": cache_kernels.reshape_and_cache_kernel,
    }
    counts = {}
    for name, kernel in kernels.items():
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton version keeps no per-device kernel caches to count")
        counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts


def test_no_kernel_compiles_after_start(checkpoints: dict[str, Path]) -> None:
    # No cold start: once the engine is built, a workload of prefills, chunks, mixed steps,
    # preemption and decodes of every batch size compiles nothing more.
    from torch._dynamo.utils import counters

    llm = LLM(
        str(checkpoints["qwen3"]),
        platform="triton",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=1024,
        num_kv_blocks=64,  # the 705-token request needs 45; the others still preempt
        max_num_batched_tokens=96,
        max_num_seqs=8,
        cuda_graph_max_tokens=32,  # steps of 33..96 tokens call the compiled forward directly
    )
    before, graphs_before = _compiled_variants(), counters["stats"]["unique_graphs"]
    prompts = _prompts([3, 700, 40, 9, 130, 64, 1, 250, 17, 90])
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in (40, 5, 90, 12, 60, 3, 30, 8, 70, 20)
    ]
    llm.generate(prompts, params, use_tqdm=False)
    after = _compiled_variants()
    grew = {k: (before[k], after[k]) for k in after if after[k] != before[k]}
    assert not grew, f"kernel variants compiled while serving (before, after): {grew}"
    assert counters["stats"]["unique_graphs"] == graphs_before, "torch.compile compiled while serving"
