"""Compile keys (plugin API 1.9) and the start-up warm-up that runs one call per compiled variant.

`launch_variant` must follow Triton's specialisation rules; the Triton backend's `compile_key`
must name exactly the variants its `forward` launches (checked against the launches themselves,
under the interpreter); the warm-up must compile every variant of its sweep while running one
call per new variant (an 8B engine's sweep, with the Triton backend planning as on an H100); and
its metadata must sit in memory the way a served step's does, since Triton specialises on that."""

from __future__ import annotations

import os
import sys
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any, ClassVar

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and the kernels) are imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

import pagedserve_triton.attention as triton_attention
import pagedserve_triton.ragged_prefill_sm90 as ragged_sm90
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import AttentionBackend, AttentionCapabilities, AttentionLayerShape
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.buffers import PackedUpload
from pagedserve.worker.graphs.cuda_graphs import default_graph_sizes
from pagedserve.worker.graphs.full_cuda_graphs import (
    DecodeGraphBuffers,
    DecodeGraphIndex,
    attention_layer_shapes,
    forward_graph_key,
    seq_len_buckets,
)
from pagedserve.worker.startup.attention_sweep import (
    WarmupBatch,
    attention_warmup_batches,
    warm_up_attention,
    warmup_metadata,
)
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps
from pagedserve_triton.attention import SplitPlan, TritonUnifiedAttentionBackend, choose_split
from pagedserve_triton.compile_keys import launch_variant
from pagedserve_triton.unified_attention import unified_attention_2d_kernel

if not isinstance(unified_attention_2d_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

CPU = torch.device("cpu")
H100_NAME, H100_SMS = "NVIDIA H100 80GB HBM3", 132


class H100Plans(TritonUnifiedAttentionBackend):
    """The Triton backend planning split counts for an H100's 132 SMs (on CPU tensors it would
    plan for one SM, and never split)."""

    def split_plan(
        self,
        num_reqs: int,
        max_query_len: int,
        max_seq_len: int,
        num_kv_heads: int,
        device: torch.device,
        *,
        block_q: int,
        tile_size: int,
    ) -> SplitPlan:
        return choose_split(
            num_reqs, max_query_len, max_seq_len, num_kv_heads, H100_SMS, block_q=block_q, tile_size=tile_size
        )


@pytest.fixture
def h100_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuned configs of an H100 (the launch parameters are looked up by device name)."""
    monkeypatch.setattr(triton_attention, "device_name_of", lambda device: H100_NAME)


@pytest.fixture
def h100_launches(monkeypatch: pytest.MonkeyPatch, h100_configs: None) -> None:
    """Also what an H100 launches besides: programmatic launches, warp specialisation and the
    Gluon prefill kernel. Keys only: the interpreter cannot run these launches."""
    monkeypatch.setattr(triton_attention, "programmatic_launch_supported", lambda device: True)
    monkeypatch.setattr(
        triton_attention,
        "launch_options",
        lambda dependent, device: {"launch_pdl": True} if dependent else {},
    )
    monkeypatch.setattr(triton_attention, "warp_specialize_supported", lambda device: True)
    monkeypatch.setattr(ragged_sm90, "device_supported", lambda device: True)


# ----------------------------------------------------------------------------- Triton's rules
@triton.jit(do_not_specialize=["m"])
def _toy_kernel(x_ptr, n, m, scale, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * scale + n + m)


def test_launch_variant_follows_tritons_specialisation_rules() -> None:
    x = torch.zeros(64)

    def variant(
        x: torch.Tensor = x, n: int = 16, m: int = 16, scale: float = 1.0, **options: Any
    ) -> Hashable:
        options.setdefault("BLOCK", 16)
        found = launch_variant(_toy_kernel, (x, n, m, scale), options)
        assert found is not None
        return found

    base = variant()
    assert variant(n=32) == variant(n=0) == base  # multiples of 16: one class
    assert variant(n=17) != base and variant(n=1) != base and variant(n=1) != variant(n=17)
    assert variant(n=17) == variant(n=33)  # neither 1 nor a multiple of 16: one class
    assert variant(m=17) == variant(m=1) == base  # do_not_specialize
    assert variant(scale=3.5) == base  # floats are never specialised
    assert variant(x=x[1:]) != base and variant(x=x[4:]) == base  # 16-byte alignment of a pointer
    assert variant(x=x.half()) != base  # the pointee's dtype
    assert variant(BLOCK=32) != base  # constexpr values
    assert variant(num_warps=8) != variant(num_warps=4)  # launch options


# ----------------------------------------------------------------------------- what forward launches
HQ, HKV, D, BLOCK_SIZE = 4, 2, 32, 16
WIDTH = 16  # the block table's row: a runner's max_blocks_per_req


def _metadata(batch: WarmupBatch, width: int = WIDTH) -> AttentionMetadata:
    [md] = warmup_metadata([batch], BLOCK_SIZE, width, CPU)
    return md


class _Calls:
    """Tensors of one call shape: query, output, new keys and values, a KV cache."""

    def __init__(self, num_tokens: int, dtype: torch.dtype = torch.float16) -> None:
        gen = torch.Generator().manual_seed(0)
        self.query = torch.randn(num_tokens, HQ, D, generator=gen).to(dtype)
        self.out = torch.empty_like(self.query)
        self.new_kv = torch.randn(2, num_tokens, HKV, D, generator=gen).to(dtype)
        self.cache = torch.randn(2, 8, BLOCK_SIZE, HKV, D, generator=gen).to(dtype)

    def kwargs(self, with_out: bool = True) -> dict[str, Any]:
        return dict(
            scale=D**-0.5,
            out=self.out if with_out else None,
            new_key=self.new_kv[0],
            new_value=self.new_kv[1],
        )


@pytest.fixture
def recorded_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Hashable | None]]:
    """The variant of every kernel the interpreter runs, from the launch's own arguments."""
    launched: list[Hashable | None] = []
    run = InterpretedFunction.run

    def recording(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        launched.append(launch_variant(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    yield launched


FAITHFUL_CASES = [
    WarmupBatch((1,), (40,)),  # a decode too short to split: the 2D kernel
    WarmupBatch((1,), (200,)),  # the 3D kernel over 4 splits and its reduction
    WarmupBatch((1, 1, 1), (200, 1, 1)),
    WarmupBatch((3,), (130,)),  # a speculative step: another query-length class of the configs
    WarmupBatch((17, 1), (40, 5)),  # a mixed step: queries too long to split
    WarmupBatch((16,), (16,)),  # a whole prompt: the ragged prefill kernel
    WarmupBatch((16,), (32,)),  # a chunk after context: seq_lens not 16-byte aligned
    WarmupBatch((16, 16, 16), (32, 32, 32)),  # three: seq_lens aligned
]


@pytest.mark.usefixtures("h100_configs")
@pytest.mark.parametrize("batch", FAITHFUL_CASES, ids=str)
@pytest.mark.parametrize("with_out", [True, False])
def test_compile_key_is_exactly_what_forward_launches(
    batch: WarmupBatch, with_out: bool, recorded_launches: list[Hashable | None]
) -> None:
    backend = H100Plans()
    backend.enable_new_kv_reads()
    calls, md = _Calls(batch.num_tokens), _metadata(batch)
    key = backend.compile_key(calls.query, calls.cache, md, **calls.kwargs(with_out))
    assert key is not None and not recorded_launches  # asked without launching
    backend.forward(calls.query, calls.cache, md, **calls.kwargs(with_out))
    assert None not in recorded_launches and len(recorded_launches) in (1, 2)
    assert key == frozenset(recorded_launches)


def test_compile_key_covers_both_kernel_families_of_the_cases() -> None:
    """The cases above reach the 2D, 3D, reduction and ragged kernels (else the test proves less)."""
    backend = H100Plans()
    backend.enable_new_kv_reads()
    names = set()
    for batch in FAITHFUL_CASES:
        calls = _Calls(batch.num_tokens)
        key = backend.compile_key(calls.query, calls.cache, _metadata(batch), **calls.kwargs())
        assert key is not None
        names |= {variant[0].rsplit(".", 1)[1] for variant in key}  # type: ignore[index]
    assert names == {
        "unified_attention_2d_kernel",
        "unified_attention_3d_kernel",
        "reduce_segments_kernel",
        "ragged_prefill_kernel",
    }


# ----------------------------------------------------------------------------- what changes a key
@pytest.mark.usefixtures("h100_launches")
def test_compile_key_changes_exactly_with_what_triton_specialises() -> None:
    backend = H100Plans()
    backend.enable_programmatic_launch(16)
    backend.enable_new_kv_reads()

    def key(batch: WarmupBatch, width: int = WIDTH, query_offset: int = 0) -> frozenset[Hashable]:
        calls = _Calls(batch.num_tokens + query_offset)
        query = calls.query[query_offset:]
        kwargs = calls.kwargs()
        kwargs.update(out=calls.out[: batch.num_tokens], new_key=calls.new_kv[0, : batch.num_tokens])
        kwargs.update(new_value=calls.new_kv[1, : batch.num_tokens])
        found = backend.compile_key(query, calls.cache, _metadata(batch, width), **kwargs)
        assert found is not None
        return found

    def decodes(count: int, longest: int) -> WarmupBatch:
        return WarmupBatch((1,) * count, (longest,) + (1,) * (count - 1))

    # The split count: 2 splits at 128 keys, 4 at 256; 300 and 400 keys both take 8.
    assert key(decodes(1, 128)) != key(decodes(1, 256))
    assert key(decodes(1, 300), 32) == key(decodes(1, 400), 32)
    # The block table's row stride (a kernel argument): 1, a multiple of 16 and neither differ.
    assert len({key(decodes(2, 16), width) for width in (1, 16, 17)}) == 3
    assert key(decodes(2, 16), 16) == key(decodes(2, 16), 32)
    # Request counts are not specialised (the kernels opt out, `do_not_specialize`) but the
    # programmatic launch is decided by the token count: 16 decodes are one, 17 are not.
    assert key(decodes(17, 16)) == key(decodes(33, 16)) != key(decodes(16, 16)) == key(decodes(15, 16))
    # A whole prompt (the Gluon kernel on an H100) against a chunk after context (Triton's), and
    # such chunks with seq_lens 16-byte aligned in the upload (three requests) or not (one).
    prompt, chunk, chunks = (
        WarmupBatch((32,), (32,)),
        WarmupBatch((32,), (64,)),
        WarmupBatch((32,) * 3, (64,) * 3),
    )
    assert len({key(prompt), key(chunk), key(chunks)}) == 3
    assert key(chunks) == key(WarmupBatch((32,) * 7, (64,) * 7))
    # A query not 16-byte aligned (a pointer specialisation) compiles another variant.
    assert key(decodes(2, 16), query_offset=1) == key(decodes(2, 16))  # 256-byte rows stay aligned
    misaligned = _Calls(3).query.flatten()[1:].as_strided((2, HQ, D), (HQ * D, D, 1))
    calls = _Calls(2)
    assert backend.compile_key(misaligned, calls.cache, _metadata(decodes(2, 16)), **calls.kwargs()) != key(
        decodes(2, 16)
    )


def test_a_subclass_that_launches_otherwise_names_no_key() -> None:
    class Other(TritonUnifiedAttentionBackend):
        def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
            return super().forward(*args, **kwargs)

    calls, batch = _Calls(1), WarmupBatch((1,), (40,))
    assert TritonUnifiedAttentionBackend().compile_key(calls.query, calls.cache, _metadata(batch), scale=1.0)
    assert Other().compile_key(calls.query, calls.cache, _metadata(batch), scale=1.0) is None


def test_no_tokens_no_variants() -> None:
    calls = _Calls(1)
    md = _metadata(WarmupBatch((1,), (40,)))
    empty = AttentionMetadata(
        0, 0, 0, 0, md.query_start_loc[:1], md.seq_lens[:0], md.block_table[:0], md.slot_mapping[:0],
        md.query_start_loc_cpu[:1], md.seq_lens_cpu[:0],
    )  # fmt: skip
    assert (
        TritonUnifiedAttentionBackend().compile_key(calls.query, calls.cache, empty, scale=1.0) == frozenset()
    )


# ----------------------------------------------------------------------------- the warm-up of an 8B engine
LLAMA_8B = ModelSpec(
    architecture="LlamaForCausalLM",
    implementation="native",
    num_layers=32,
    num_q_heads=32,
    num_kv_heads=8,
    head_size=128,
    hidden_size=4096,
    vocab_size=128256,
    dtype=torch.bfloat16,
    sliding_windows=(None,),
    logit_softcap=None,
    max_position_embeddings=8192,
)
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN, ENGINE_BLOCK_SIZE = 256, 8192, 4096, 16


class _KeysOnly(AttentionBackend):
    """Asks `inner` for keys and records the calls the warm-up runs, launching nothing."""

    name: ClassVar[str] = "keys_only"
    capabilities: ClassVar[AttentionCapabilities] = TritonUnifiedAttentionBackend.capabilities

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.asked: list[frozenset[Hashable] | None] = []
        self.ran: list[frozenset[Hashable] | None] = []
        # (metadata, window) -> the key given for that call: the sweep asks every key first
        self._given: dict[tuple[int, object], frozenset[Hashable] | None] = {}

    def key_for(self, *args: Any, **kwargs: Any) -> frozenset[Hashable] | None:
        return self.inner.compile_key(*args, **kwargs)

    def compile_key(self, *args: Any, **kwargs: Any) -> frozenset[Hashable] | None:  # type: ignore[override]
        self.asked.append(self.key_for(*args, **kwargs))
        self._given[id(args[2]), kwargs.get("sliding_window")] = self.asked[-1]
        return self.asked[-1]

    def forward(self, query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        self.ran.append(self._given.get((id(args[1]), kwargs.get("sliding_window"))))
        return query


@pytest.mark.usefixtures("h100_launches")
def test_the_8b_sweep_runs_one_call_per_variant_and_compiles_them_all() -> None:
    backend = H100Plans()
    backend.enable_programmatic_launch(16)
    backend.enable_new_kv_reads()
    width = MAX_MODEL_LEN // ENGINE_BLOCK_SIZE
    # The full decode graphs an engine of these limits captures, as `warmup.build_step_forward` plans them.
    layers = attention_layer_shapes(
        LLAMA_8B, block_size=ENGINE_BLOCK_SIZE, kv_cache_dtype=torch.bfloat16, device=CPU
    )
    graph_key = forward_graph_key(backend, layers)
    sizes = default_graph_sizes(MAX_NUM_SEQS, 512)
    buffers = DecodeGraphBuffers(sizes[-1], width, CPU)
    graphs = DecodeGraphIndex(
        sizes,
        seq_len_buckets(MAX_MODEL_LEN, ENGINE_BLOCK_SIZE),
        lambda size, bucket: graph_key(buffers.metadata(size, bucket)),
        max_model_len=MAX_MODEL_LEN,
    ).graphs
    batches = attention_warmup_batches(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        decode_graphs=graphs,
    )
    keys_only = _KeysOnly(backend)
    cache = torch.zeros(
        2, 4, ENGINE_BLOCK_SIZE, LLAMA_8B.num_kv_heads, LLAMA_8B.head_size, dtype=torch.bfloat16
    )
    report = warm_up_attention(
        keys_only, ReferenceCacheOps(), cache, LLAMA_8B, batches, new_kv_reads=True, block_table_width=width
    )
    asked = [key for key in keys_only.asked if key is not None]
    assert len(asked) == len(keys_only.asked) == report.num_calls == len(batches)  # one layout
    every = frozenset().union(*asked)
    ran = [key for key in keys_only.ran if key is not None]
    assert frozenset().union(*ran) == every  # the full sweep's variants, every one compiled
    seen: set[Hashable] = set()
    for key in ran:  # and no call ran without a variant new to it
        assert not key <= seen
        seen |= key
    assert report.num_launched == len(ran) and report.num_variants == len(every)
    print(
        f"8B engine (256 seqs, 8192 tokens, 4096 max len), Triton backend planning for an H100: "
        f"{report.num_variants} variants from {len(batches)} batch shapes, {report.num_launched} calls run"
    )
    assert report.num_launched <= len(every) < len(batches) // 20


def test_a_call_runs_when_it_needs_any_variant_not_run_yet() -> None:
    spec = ModelSpec(
        architecture="LlamaForCausalLM", implementation="native", num_layers=1, num_q_heads=HQ,
        num_kv_heads=HKV, head_size=D, hidden_size=HQ * D, vocab_size=32, dtype=torch.float32,
        sliding_windows=(None,), logit_softcap=None, max_position_embeddings=64,
    )  # fmt: skip
    planned = [{"a"}, {"a", "b"}, {"b"}, {"c", "a"}, set(), {"a", "c"}, {"d"}]

    class Planned(_KeysOnly):
        def key_for(self, *args: Any, **kwargs: Any) -> frozenset[Hashable] | None:
            return frozenset(planned[len(self.asked)])

    batches = [WarmupBatch((1,), (n,)) for n in range(1, len(planned) + 1)]
    backend = Planned(TritonUnifiedAttentionBackend())
    report = warm_up_attention(
        backend, ReferenceCacheOps(), torch.zeros(2, 4, BLOCK_SIZE, HKV, D), spec, batches
    )
    assert backend.ran == [frozenset(k) for k in ({"a"}, {"a", "b"}, {"c", "a"}, {"d"})]
    assert (report.num_calls, report.num_launched, report.num_variants) == (7, 4, 4)


def test_without_keys_every_call_runs() -> None:
    spec = ModelSpec(
        architecture="LlamaForCausalLM", implementation="native", num_layers=1, num_q_heads=HQ,
        num_kv_heads=HKV, head_size=D, hidden_size=HQ * D, vocab_size=32, dtype=torch.float32,
        sliding_windows=(None, 4), logit_softcap=None, max_position_embeddings=64,
    )  # fmt: skip

    class Unkeyed(_KeysOnly):
        def key_for(self, *args: Any, **kwargs: Any) -> frozenset[Hashable] | None:
            return None

    batches = attention_warmup_batches(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16)
    backend = Unkeyed(TritonUnifiedAttentionBackend())
    cache = torch.zeros(2, 4, BLOCK_SIZE, HKV, D)
    report = warm_up_attention(backend, ReferenceCacheOps(), cache, spec, batches)
    assert report.num_calls == report.num_launched == len(backend.ran) == 2 * len(batches)
    assert report.num_variants is None
    assert len(backend.asked) == 1  # asked once: a backend without keys is not asked again


# ----------------------------------------------------------------------------- metadata as a step has it
@pytest.mark.parametrize("num_reqs", range(1, 10))
def test_warmup_metadata_sits_in_memory_like_the_runners(num_reqs: int) -> None:
    """Triton specialises on a pointer's 16-byte alignment and on the block table's row stride:
    the warm-up's metadata has the alignment a served step's upload gives it (`PackedUpload`:
    query_start_loc then seq_lens, back to back) and the runner's block-table width."""
    batch = WarmupBatch((2,) * num_reqs, (5,) * num_reqs)
    md = warmup_metadata([WarmupBatch((1,), (3,)), batch], BLOCK_SIZE, WIDTH, CPU)[1]
    upload = PackedUpload(torch.int32, torch.device("meta"))  # packs as on a GPU, copying nothing
    (_, qsl), (_, seq) = upload.upload(np.zeros(num_reqs + 1, np.int32), np.zeros(num_reqs, np.int32))
    assert qsl.data_ptr() % 16 == 0
    assert md.query_start_loc.data_ptr() % 16 == 0
    assert md.seq_lens.data_ptr() % 16 == seq.data_ptr() % 16
    assert md.block_table.shape == (num_reqs, WIDTH) and md.block_table.stride(0) == WIDTH
    assert md.query_start_loc_cpu.tolist() == list(range(0, 2 * num_reqs + 1, 2))
    assert md.seq_lens_cpu.tolist() == [5] * num_reqs
    assert (md.num_reqs, md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (
        num_reqs,
        2 * num_reqs,
        2,
        5,
    )


def test_warmup_metadata_refuses_what_the_runner_could_not_hold() -> None:
    with pytest.raises(ValueError, match="block table of 1 blocks"):
        warmup_metadata([WarmupBatch((1,), (17,))], BLOCK_SIZE, 1, CPU)
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        warmup_metadata([WarmupBatch((3,), (2,))], BLOCK_SIZE, 1, CPU)


def test_layer_shape_keys_and_call_keys_agree_on_the_plan() -> None:
    """`full_graph_key` (a layer shape, no tensors) and `compile_key` (the call) plan alike: two
    decode batches with one plan never differ in their keys for a reason the plan would see."""
    backend = H100Plans()
    layer = AttentionLayerShape(HQ, HKV, D, BLOCK_SIZE, torch.float16, torch.float16, CPU)
    calls = _Calls(1)
    by_plan: dict[Hashable, set[frozenset[Hashable]]] = {}
    for longest in (16, 64, 128, 192, 256, 512, 1024, 2048, 4096):
        md = _metadata(WarmupBatch((1,), (longest,)), width=256)
        key = backend.compile_key(calls.query, calls.cache, md, scale=1.0, out=calls.out)
        assert key is not None
        by_plan.setdefault(backend.full_graph_key(md, layer), set()).add(key)
    assert len(by_plan) > 2 and all(len(keys) == 1 for keys in by_plan.values())
