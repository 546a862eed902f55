"""Attention sinks (plugin API 1.13, gpt-oss): one learned logit per query head added to every
softmax denominator. The oracle against the formula written out and against transformers' gpt-oss
attention; the fast CPU backend and the Triton kernels (interpreted: 2D, and split-KV 3D whose
reduction must add the sink exactly once) against the oracle; the contract's refusals; the core's
plumbing (layer, operator, hooks, warm-up sweep, layer shapes, backend choice); and the sink
kernels compiled for an H100 and an MI300 without spills.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Hashable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

# The interpreter must be chosen before triton (and the kernels) are imported.
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))

import pytest
import torch
from compile_child import SM90_COMPILE, run_without_interpreter

import pagedserve_cpu_reference.plugin as cpu_reference_plugin
from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.attention.layer import PagedAttention
from pagedserve.conformance.cases import attention_cases
from pagedserve.conformance.report import pattern_hints
from pagedserve.conformance.results import Status
from pagedserve.conformance.suite import ConformanceSuite
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import (
    PLUGIN_API_VERSION,
    AttentionBackend,
    AttentionCapabilities,
    Availability,
    CacheOps,
    KVCacheScales,
    PlatformInfo,
    UnsupportedCase,
)
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve.platforms.registry import PlatformRegistry
from pagedserve.worker.compile.cpu_compile import zero_attention
from pagedserve.worker.graphs.cuda_graphs import _SplitAtAttention
from pagedserve.worker.graphs.full_cuda_graphs import attention_layer_shapes
from pagedserve.worker.startup.attention_sweep import WarmupBatch, warm_up_attention
from pagedserve.worker.startup.device_model import choose_backend
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps
from pagedserve_cpu_reference.fast_attention import FastCpuAttentionBackend

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# Decodes (one alone, short and long), a whole prompt, a chunked prefill, a speculative query.
MIXED = ([1, 7, 4, 1, 3], [1, 7, 19, 26, 12])


@dataclasses.dataclass(frozen=True)
class Batch:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata
    sinks: torch.Tensor  # [num_q_heads] float32
    query_lens: list[int]
    seq_lens: list[int]


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int = 6,
    num_kv_heads: int = 2,
    head_size: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """Shuffled blocks with NaN in every slot no token owns (a read past a sequence poisons the
    output), keys, values and queries ~N(0, 1), and sinks spread from negligible to dominant."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: sum(needed)]
    table = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = order[start : start + n].to(torch.int32)
        start += n
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    for i, s in enumerate(seq_lens):
        for t in range(s):
            block, offset = int(table[i, t // block_size]), t % block_size
            cache[:, block, offset] = torch.randn(2, num_kv_heads, head_size, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), num_q_heads, head_size, generator=gen).to(dtype)
    # Head 0's sink is far below every score (it changes nothing), head 1's far above (it takes
    # nearly all the mass), the others comparable to the scores.
    sinks = torch.empty(num_q_heads).uniform_(-1.0, 3.0, generator=gen)
    sinks[0] = -30.0
    sinks[1] = 6.0
    metadata = AttentionMetadata.build(query_lens, seq_lens, table, block_size)
    return Batch(query, cache, metadata, sinks, list(query_lens), list(seq_lens))


def direct_formula(
    batch: Batch, scale: float, window: int | None, sinks: torch.Tensor | None
) -> torch.Tensor:
    """The module docstring of `pagedserve.platforms.api`, one row at a time, in float64:
    m = max(max_j s_j, sink); out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m))."""
    q_all = batch.query.double()
    _, num_q_heads, _head_size = q_all.shape
    _, _, block_size, num_kv_heads, _ = batch.kv_cache.shape
    group = num_q_heads // num_kv_heads
    table = batch.metadata.block_table
    out = torch.zeros_like(q_all)
    row = 0
    for i, (q_len, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens, strict=True)):
        slots = [(int(table[i, t // block_size]), t % block_size) for t in range(seq_len)]
        keys = torch.stack([batch.kv_cache[0, b, o] for b, o in slots]).double()  # [S, Hkv, D]
        values = torch.stack([batch.kv_cache[1, b, o] for b, o in slots]).double()
        for j in range(q_len):
            pos = seq_len - q_len + j
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(num_q_heads):
                s = keys[lo : pos + 1, h // group] @ q_all[row, h] * scale
                v = values[lo : pos + 1, h // group]
                if sinks is None:
                    e = (s - s.max()).exp()
                    out[row, h] = e @ v / e.sum()
                else:
                    sink = float(sinks[h])
                    m = max(float(s.max()), sink)
                    e = (s - m).exp()
                    out[row, h] = e @ v / (e.sum() + math.exp(sink - m))
            row += 1
    return out


def _forward(backend: AttentionBackend, batch: Batch, scale: float, window: int | None, **kwargs: Any) -> Any:
    return backend.forward(
        batch.query, batch.kv_cache, batch.metadata, scale=scale, sliding_window=window, **kwargs
    )


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------ the oracle


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
def test_reference_is_the_formula(window: int | None) -> None:
    batch = make_batch(*MIXED, dtype=torch.float64)
    reference = ReferenceAttentionBackend()
    got = _forward(reference, batch, 0.3, window, sinks=batch.sinks)
    _assert_close(got, direct_formula(batch, 0.3, window, batch.sinks), torch.float64)
    # The sinks matter (head 0's is negligible, head 1's takes nearly everything) ...
    without = _forward(reference, batch, 0.3, window)
    torch.testing.assert_close(got[:, 0], without[:, 0], atol=1e-12, rtol=1e-12)
    assert float(got[:, 1].abs().amax() / without[:, 1].abs().amax()) < 0.2
    # ... and without them the formula is plain softmax attention.
    _assert_close(without, direct_formula(batch, 0.3, window, None), torch.float64)


@pytest.mark.parametrize("window", [None, 4], ids=["full", "window4"])
def test_reference_matches_transformers_gpt_oss_attention(window: int | None) -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    seq_len, hq, hkv, d = 9, 4, 2, 8
    batch = make_batch(
        [seq_len], [seq_len], num_q_heads=hq, num_kv_heads=hkv, head_size=d, dtype=torch.float64
    )
    blocks = batch.metadata.block_table[0, : -(-seq_len // 4)].long()
    keys, values = (batch.kv_cache[i, blocks].reshape(-1, hkv, d)[:seq_len] for i in (0, 1))
    pos = torch.arange(seq_len)
    visible = pos[None] <= pos[:, None]
    if window is not None:
        visible &= pos[None] > pos[:, None] - window
    mask = torch.zeros(seq_len, seq_len, dtype=torch.float64).masked_fill(~visible, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=hq // hkv, sinks=batch.sinks.double(), training=False)
    expected, _ = eager_attention_forward(
        module,  # type: ignore[arg-type]  # the function reads only these attributes
        batch.query.transpose(0, 1)[None],  # [1, Hq, S, D]
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        mask[None, None],
        scaling=d**-0.5,
    )
    got = _forward(ReferenceAttentionBackend(), batch, d**-0.5, window, sinks=batch.sinks)
    _assert_close(got, expected[0], torch.float64)


# --------------------------------------------------------------------- the fast CPU backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize(
    "geometry",
    [MIXED, ([1, 1, 1], [5, 17, 30]), ([1], [21])],
    ids=["mixed", "decodes", "one_stream"],  # the last two are the fused paths without sinks
)
def test_fast_backend_matches_the_oracle(
    dtype: torch.dtype, window: int | None, geometry: tuple[list[int], list[int]]
) -> None:
    batch = make_batch(*geometry, dtype=dtype, seed=1)
    fast = FastCpuAttentionBackend()
    got = _forward(fast, batch, 0.25, window, sinks=batch.sinks)
    double = dataclasses.replace(batch, query=batch.query.double(), kv_cache=batch.kv_cache.double())
    expected = _forward(ReferenceAttentionBackend(), double, 0.25, window, sinks=batch.sinks)
    _assert_close(got, expected, dtype)
    # The next layer of the step (same metadata, the plan reused) without sinks is plain again.
    plain = _forward(fast, batch, 0.25, window)
    _assert_close(plain, _forward(ReferenceAttentionBackend(), double, 0.25, window), dtype)


# ---------------------------------------------------------------------------- the Triton kernels


def _triton_backend(num_splits: int) -> AttentionBackend:
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from pagedserve_triton.attention import TritonUnifiedAttentionBackend
    from pagedserve_triton.unified_attention import unified_attention_2d_kernel

    if not isinstance(unified_attention_2d_kernel, InterpretedFunction):
        pytest.skip("pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set")
    return TritonUnifiedAttentionBackend(num_splits=num_splits)


TRITON_CASES = {
    # 2D: every row's softmax starts from its sink.
    "2d_mixed": (MIXED, 1, None, torch.float32),
    "2d_mixed_window5": (MIXED, 1, 5, torch.float32),
    "2d_mixed_fp16": (MIXED, 1, None, torch.float16),
    # 3D: splits know nothing of the sink, the reduction adds it once; trailing splits are empty
    # for the short sequences, and one-token sequences leave all splits but one empty.
    "3d_decodes": (([1, 1, 2, 1], [1, 23, 30, 9]), 4, None, torch.float32),
    "3d_decodes_window6": (([1, 1, 2, 1], [1, 23, 30, 9]), 8, 6, torch.float32),
}


@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_matches_the_oracle(name: str) -> None:
    geometry, num_splits, window, dtype = TRITON_CASES[name]
    backend = _triton_backend(num_splits)
    batch = make_batch(*geometry, block_size=16, head_size=32, dtype=dtype, seed=2)
    got = _forward(backend, batch, 0.2, window, sinks=batch.sinks)
    double = dataclasses.replace(batch, query=batch.query.double(), kv_cache=batch.kv_cache.double())
    _assert_close(got, _forward(ReferenceAttentionBackend(), double, 0.2, window, sinks=batch.sinks), dtype)


def test_triton_layers_of_one_step_each_get_their_own_sinks() -> None:
    """The step's launches are built once and reused by its layers: the sinks must be a per-call
    argument (of the 2D kernel, and of the 3D plan's reduction), not frozen at the first layer."""
    for num_splits in (1, 4):
        backend = _triton_backend(num_splits)
        batch = make_batch([1, 3], [20, 11], block_size=16, head_size=32, seed=3)
        reference = ReferenceAttentionBackend()
        for sinks in (batch.sinks, batch.sinks.flip(0), torch.zeros_like(batch.sinks)):
            got = _forward(backend, batch, 0.2, None, sinks=sinks)
            _assert_close(got, _forward(reference, batch, 0.2, None, sinks=sinks), torch.float32)
        _assert_close(
            _forward(backend, batch, 0.2, None), _forward(reference, batch, 0.2, None), torch.float32
        )


def test_triton_compile_keys_tell_sink_variants_apart() -> None:
    def keys(backend: AttentionBackend, batch: Batch, **kwargs: Any) -> frozenset[Hashable]:
        found = backend.compile_key(batch.query, batch.kv_cache, batch.metadata, scale=0.2, **kwargs)
        assert found is not None
        return found

    batch = make_batch([1, 1], [20, 11], block_size=16, head_size=32)
    two_d = _triton_backend(1)
    assert keys(two_d, batch, sinks=batch.sinks) != keys(two_d, batch)
    three_d = _triton_backend(4)
    with_sinks, without = keys(three_d, batch, sinks=batch.sinks), keys(three_d, batch)
    # The split kernel is shared; only its reduction has a sink variant.
    assert len(with_sinks & without) == 1 and len(with_sinks) == len(without) == 2


# --------------------------------------------------------------------------- the contract


class _NoSinks(ReferenceAttentionBackend):
    """The oracle, declaring no attention sinks."""

    name: ClassVar[str] = "no_sinks"
    capabilities: ClassVar[AttentionCapabilities] = dataclasses.replace(
        ReferenceAttentionBackend.capabilities, attention_sinks=False
    )


def test_a_backend_that_does_not_declare_sinks_refuses_them() -> None:
    batch = make_batch([1], [5])
    backend = _NoSinks()
    with pytest.raises(UnsupportedCase, match="attention sinks are not supported"):
        _forward(backend, batch, 0.3, None, sinks=batch.sinks)
    with pytest.raises(UnsupportedCase, match="attention sinks"):
        backend.check_supported(
            head_size=16, dtype=torch.float32, block_size=4, sliding_window=None, logit_softcap=None,
            attention_sinks=True,
        )  # fmt: skip
    _forward(backend, batch, 0.3, None)  # without sinks it serves as before


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(6, dtype=torch.bfloat16), torch.zeros(5), torch.zeros(12)[::2]],
    ids=["bfloat16", "wrong_length", "strided"],
)
def test_sinks_of_the_wrong_layout_are_refused(bad: torch.Tensor) -> None:
    batch = make_batch([1], [5])
    with pytest.raises(ValueError, match="sinks must be a contiguous float32 tensor"):
        _forward(ReferenceAttentionBackend(), batch, 0.3, None, sinks=bad)


def _spec(attention_sinks: bool, num_layers: int = 2) -> ModelSpec:
    return ModelSpec(
        architecture="GptOssForCausalLM",
        implementation="native",
        num_layers=num_layers,
        num_q_heads=6,
        num_kv_heads=2,
        head_size=16,
        hidden_size=96,
        vocab_size=32,
        dtype=torch.float32,
        sliding_windows=(128, None),
        logit_softcap=None,
        max_position_embeddings=None,
        attention_sinks=attention_sinks,
    )


def _registry_of(backend: type[AttentionBackend]) -> PlatformRegistry:
    """Installed-plugin checks for a platform `under_test` whose only attention backend is `backend`."""

    @hookimpl
    def pagedserve_platforms() -> list[PlatformInfo]:
        return [PlatformInfo("under_test", 0, "cpu", (torch.float32,), lambda: Availability(True, "test"))]

    @hookimpl
    def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
        return [backend] if platform == "under_test" else None

    @hookimpl
    def pagedserve_cache_ops(platform: str) -> CacheOps | None:
        return ReferenceCacheOps() if platform == "under_test" else None

    plugin = SimpleNamespace(
        PAGEDSERVE_PLUGIN_API=PLUGIN_API_VERSION,
        pagedserve_platforms=pagedserve_platforms,
        pagedserve_attention_backends=pagedserve_attention_backends,
        pagedserve_cache_ops=pagedserve_cache_ops,
    )
    # With the oracle's plugin beside it, as the conformance kit needs.
    return PlatformRegistry.from_plugins(
        [("cpu_reference", cpu_reference_plugin), ("under_test", plugin)], strict=True
    )


def _platform_of(backend: type[AttentionBackend]) -> Any:
    """A platform `under_test` with `backend` as its only attention backend."""
    return _registry_of(backend).get("under_test")


def test_a_model_with_sinks_needs_a_declaring_backend_and_is_told_where_one_is() -> None:
    platform = _platform_of(_NoSinks)
    with pytest.raises(ValueError, match="attention sinks") as raised:
        choose_backend(platform, _spec(True), 4)
    message = str(raised.value)
    assert "no_sinks: attention sinks are not supported" in message
    assert "cpu_reference (cpu_fast, cpu_reference)" in message  # an installed platform that has them
    backend, _ = choose_backend(platform, _spec(False), 4)  # a model without sinks: as before
    assert backend.name == "no_sinks"
    declared, _ = choose_backend(_platform_of(ReferenceAttentionBackend), _spec(True), 4)
    assert declared.name == "cpu_reference"


class _Recording(ReferenceAttentionBackend):
    """The oracle, recording the sinks of every call (the object itself, or None)."""

    name: ClassVar[str] = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.sinks_seen: list[torch.Tensor | None] = []

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.sinks_seen.append(kwargs.get("sinks"))
        return super().forward(*args, **kwargs)


class _OldSignature(ReferenceAttentionBackend):
    """A backend written before API 1.13: its forward has no `sinks` keyword."""

    name: ClassVar[str] = "old_signature"
    capabilities: ClassVar[AttentionCapabilities] = _NoSinks.capabilities

    def forward(  # type: ignore[override]  # deliberately the pre-1.13 signature
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,
        kv_scales: KVCacheScales | None = None,
    ) -> torch.Tensor:
        return super().forward(
            query, kv_cache, metadata, scale=scale, sliding_window=sliding_window,
            logit_softcap=logit_softcap, out=out, kv_scales=kv_scales,
        )  # fmt: skip


def _layer_inputs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """q, k, v of a step whose new tokens are `batch`'s, and an empty cache to write them into."""
    n, hq, d = batch.query.shape
    hkv = batch.kv_cache.shape[3]
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(n, hkv * d, generator=gen), torch.randn(n, hkv * d, generator=gen)
    return batch.query.reshape(n, hq * d), k, v, [torch.zeros_like(batch.kv_cache)]


def test_the_layer_and_the_operator_pass_sinks_to_the_backend_only_when_there_are_some() -> None:
    batch = make_batch([3, 1], [3, 6])
    q, k, v, caches = _layer_inputs(batch)
    layer = PagedAttention(0, 6, 2, 16, scale=0.25, sliding_window=4)
    recording = _Recording()
    # Sinks as a model keeps them (a bfloat16 parameter, say): the layer hands float32 on.
    sinks = batch.sinks.to(torch.bfloat16)
    with (
        torch.no_grad(),
        forward_context(ForwardContext(batch.metadata, caches, recording, ReferenceCacheOps())),
    ):
        with_sinks = layer(q, k, v, sinks=sinks)
        without = layer(q, k, v)
        query, key, value = q.view(-1, 6, 16), k.view(-1, 2, 16), v.view(-1, 2, 16)
        operator = torch.ops.pagedserve.paged_attention(query, key, value, 0, 0.25, 4, None, sinks.float())
    seen = recording.sinks_seen
    assert seen[0] is not None and seen[0].dtype == torch.float32 and seen[1] is None
    torch.testing.assert_close(operator.reshape(q.shape), with_sinks)
    assert not torch.allclose(with_sinks, without)
    with pytest.raises(ValueError, match="one logit per query head"):
        layer(q, k, v, sinks=torch.zeros(2))
    # A backend of an older API serves layers without sinks as before.
    old = ForwardContext(
        batch.metadata, [torch.zeros_like(batch.kv_cache)], _OldSignature(), ReferenceCacheOps()
    )
    with torch.no_grad(), forward_context(old):
        torch.testing.assert_close(layer(q, k, v), without)


def test_hooks_get_sinks_only_from_layers_that_have_them() -> None:
    batch = make_batch([2], [2])
    q, k, v, caches = _layer_inputs(batch)
    layer = PagedAttention(0, 6, 2, 16, scale=0.25)
    attn_out = torch.zeros(1, 2, 6, 16)
    split = _SplitAtAttention(attn_out, 2, new_graph=None)  # the warm-up of a piecewise capture
    ctx = ForwardContext(batch.metadata, caches, ReferenceAttentionBackend(), ReferenceCacheOps())
    with torch.no_grad(), forward_context(dataclasses.replace(ctx, attention_hook=split)):
        layer(q, k, v, sinks=batch.sinks)
    assert split.sites[0].sinks is not None and torch.equal(split.sites[0].sinks, batch.sinks)
    with torch.no_grad(), forward_context(dataclasses.replace(ctx, attention_hook=zero_attention)):
        assert not layer(q, k, v, sinks=batch.sinks).any()

    def old_hook(layer_idx: int, query: torch.Tensor, *_: torch.Tensor, **options: Any) -> torch.Tensor:
        assert "sinks" not in options  # a hook written before sinks never sees the keyword
        return torch.zeros_like(query)

    with torch.no_grad(), forward_context(dataclasses.replace(ctx, attention_hook=old_hook)):
        layer(q, k, v)


def test_layer_shapes_and_the_warm_up_sweep_carry_sinks() -> None:
    spec = _spec(True)
    shapes = attention_layer_shapes(
        spec, block_size=4, kv_cache_dtype=torch.float32, device=torch.device("cpu")
    )
    assert len(shapes) == 2 and all(s.attention_sinks for s in shapes)
    assert not any(
        s.attention_sinks
        for s in attention_layer_shapes(
            _spec(False), block_size=4, kv_cache_dtype=torch.float32, device=torch.device("cpu")
        )
    )
    cache = torch.zeros(spec.kv_cache_shape(8, 4))
    batches = [WarmupBatch((1,), (5,)), WarmupBatch((3, 1), (3, 9))]
    for with_sinks in (True, False):
        recording = _Recording()
        warm_up_attention(recording, ReferenceCacheOps(), cache, _spec(with_sinks), batches)
        assert len(recording.sinks_seen) == 4  # two batches x two layer layouts
        assert all((s is not None) == with_sinks for s in recording.sinks_seen)


# ------------------------------------------------------------------- compiled for real GPUs

_COMPILE_CHILD = (
    SM90_COMPILE
    + """
import dataclasses, json, sys
from pathlib import Path
from pagedserve_rocm.amdgcn import compile_attention, compile_reduction, table_variants
from pagedserve_triton.unified_attention import reduce_segments_kernel, unified_attention_2d_kernel

out_dir = Path(sys.argv[1])
POINTERS = {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
            "sinks_ptr": "*fp32", "segm_acc_ptr": "*fp32", "segm_max_ptr": "*fp32", "segm_sum_ptr": "*fp32"}
FLOATS = {"scale_log2", "out_scale", "softcap"}
# gpt-oss's layers: 64 query / 8 KV heads, head 64, bfloat16, sliding window (the larger variant).
GPT_OSS = dict(QUERIES_PER_KV=8, HEAD_SIZE=64, HEAD_SIZE_PADDED=64, BLOCK_SIZE=16, USE_SOFTCAP=False,
               USE_WINDOW=True, DOT_IN_FP32=False, NUM_GRID_GROUPS=1, KV_CACHE_MODIFIER="",
               PREFETCH_BLOCK_IDS=False, LAZY_RESCALE=False, LOOP_STAGES=0, WARP_SPECIALIZE=False,
               LONGEST_FIRST=False, WIDEN_BITS=False, DEPENDENT=False, USE_SINKS=True)
results = {}
# The H100 tables' decode and prefill configs at head 64.
for name, block_m, tile in (("decode", 16, 32), ("prefill", 64, 64)):
    constexprs = {**GPT_OSS, "BLOCK_M": block_m, "BLOCK_Q": block_m // 8, "TILE_SIZE": tile}
    compiled = sm90_compile(unified_attention_2d_kernel, constexprs, POINTERS, 4, 2, floats=FLOATS)
    (out_dir / f"{name}.cubin").write_bytes(compiled.asm["cubin"])
    results[f"sm90/{name}"] = {"cubin": str(out_dir / f"{name}.cubin"), "shared": compiled.metadata.shared}
reduce = dict(HEAD_SIZE=64, HEAD_SIZE_PADDED=64, NUM_SPLITS=64, DEPENDENT=False, USE_SINKS=True)
compiled = sm90_compile(reduce_segments_kernel, reduce, POINTERS, 4, 1, floats=FLOATS)
(out_dir / "reduce.cubin").write_bytes(compiled.asm["cubin"])
results["sm90/reduce"] = {"cubin": str(out_dir / "reduce.cubin"), "shared": compiled.metadata.shared}
# The MI300 tables' 2D decode and prefill entries: at gpt-oss's shape, and the prefill entry at
# its most demanding one (head 256, float32, softcap and window).
entries = table_variants("gfx942")
gpt_oss = dict(head_size=64, dtype="bfloat16", num_queries_per_kv=8, attention_sinks=True)
for name, variant in (
    ("decode", dataclasses.replace(entries[0].variant, **gpt_oss)),
    ("prefill", dataclasses.replace(entries[4].variant, **gpt_oss)),
    ("prefill_h256", dataclasses.replace(entries[5].variant, attention_sinks=True)),
):
    results[f"gfx942/{name}"] = dataclasses.asdict(compile_attention(variant))
results["gfx942/reduce"] = dataclasses.asdict(
    compile_reduction("gfx942", head_size=64, num_splits=128, num_warps=4, attention_sinks=True)
)
print(json.dumps(results, default=sorted))
"""
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    pytest.importorskip("triton.backends.nvidia.compiler")
    pytest.importorskip("triton.backends.amd.compiler")
    results: dict[str, dict[str, Any]] = run_without_interpreter(
        _COMPILE_CHILD, str(tmp_path_factory.mktemp("sinks"))
    )
    return results


def test_sink_kernels_compile_for_h100_without_spills(compiled: dict[str, dict[str, Any]]) -> None:
    import re
    import subprocess

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip(f"no cuobjdump at {tool}")
    for name in ("sm90/decode", "sm90/prefill", "sm90/reduce"):
        result = compiled[name]
        assert 0 <= result["shared"] <= 227 * 1024, (name, result)
        text = subprocess.run(
            [str(tool), "-res-usage", result["cubin"]], capture_output=True, text=True, check=True
        ).stdout
        usage = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", text)}
        assert usage["STACK"] == 0 and usage["LOCAL"] == 0, (name, usage)


def test_sink_kernels_compile_for_mi300_without_spills(compiled: dict[str, dict[str, Any]]) -> None:
    from pagedserve_rocm.arch import KNOWN_ARCHES

    for name in ("gfx942/decode", "gfx942/prefill", "gfx942/prefill_h256", "gfx942/reduce"):
        stats = compiled[name]
        assert (stats["vgpr_spills"], stats["sgpr_spills"]) == (0, 0), (name, stats)
        assert stats["lds_bytes"] <= KNOWN_ARCHES["gfx942"].lds_bytes, (name, stats)


# ------------------------------------------------------------- the conformance kit catches bugs


class IgnoresSinks(ReferenceAttentionBackend):
    """Declares sinks, takes the keyword, and computes as if there were none."""

    name: ClassVar[str] = "ignores_sinks"

    def forward(self, *args: Any, sinks: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        return super().forward(*args, **kwargs)


class SinkInEverySplit(ReferenceAttentionBackend):
    """A split-KV kernel whose two splits each add the sink, and whose reduction sums them: the
    sink weighs exp(sink) twice, i.e. the sink logit is off by log(2)."""

    name: ClassVar[str] = "sink_in_every_split"

    def forward(self, *args: Any, sinks: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        doubled = None if sinks is None else sinks + math.log(2.0)
        return super().forward(*args, sinks=doubled, **kwargs)


def _sink_results(backend: type[AttentionBackend], groups: set[str]) -> list[Any]:
    suite = ConformanceSuite.for_platform("under_test", registry=_registry_of(backend), quick=False)
    return [
        suite.run_item(i) for i in suite.items() if i.component == backend.name and i.case.group in groups
    ]


def test_the_matrix_has_sink_cases_exactly_for_declaring_backends() -> None:
    full = [
        c for c in attention_cases(ReferenceAttentionBackend.capabilities, quick=False) if c.attention_sinks
    ]
    assert {c.group for c in full} == {"attention_sinks"}
    variants = {c.variant for c in full}
    assert {"prefill", "decode", "chunked_prefill", "long_decode", "window5_mixed"} <= variants
    assert {"mixed_float16", "mixed_bfloat16", "mixed_float32", "mixed_float64"} <= variants
    assert any(c.kv_cache_dtype is not None for c in full) and any(c.logit_softcap for c in full)
    quick = [
        c for c in attention_cases(ReferenceAttentionBackend.capabilities, quick=True) if c.attention_sinks
    ]
    assert [c.variant for c in quick] == ["window37_mixed"]
    assert not any(c.attention_sinks for c in attention_cases(_NoSinks.capabilities, quick=False))


def test_conformance_passes_the_oracle_and_catches_planted_sink_bugs() -> None:
    groups = {"attention_sinks", "mixed"}
    correct = _sink_results(ReferenceAttentionBackend, groups)
    assert correct and all(r.status is Status.PASSED for r in correct), [r.summary() for r in correct]
    for bug, hint in ((IgnoresSinks, "attention sink ignored"), (SinkInEverySplit, "counted twice")):
        results = _sink_results(bug, groups)
        failed = [r for r in results if r.status is Status.FAILED]
        # Every sink case fails (the mixed batches without sinks pass), and the diagnosis names it.
        assert {r.case.case_id for r in failed} == {
            r.case.case_id for r in results if r.group == "attention_sinks"
        }
        assert all(any(hint in p for p in r.problems) for r in failed), failed[0].summary()
        assert any("only attention-sink cases fail" in h for h in pattern_hints(results))
