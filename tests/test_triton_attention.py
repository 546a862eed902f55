"""The Triton unified attention kernels (2D and split-KV 3D) against a float64 torch reference,
run on CPU tensors by Triton's interpreter. Shapes are tiny because the interpreter is slow.

Every case uses shuffled block tables, a garbage tail in the block table, NaN in every cache slot
no request owns (so a read outside a request's blocks or past its length poisons the output), and
sequence lengths that are mostly not multiples of the block size.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# The interpreter must be chosen before triton (and the kernels) are imported.
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

from pagedserve.platforms.api import GridOrder, UnsupportedCase
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.tuned_configs import TunedConfigFile, TunedConfigs
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_triton.attention import TritonUnifiedAttentionBackend
from pagedserve_triton.unified_attention import unified_attention_2d_kernel

if not isinstance(unified_attention_2d_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
GARBAGE_BLOCK = 1 << 30  # the block table's unused tail: any read of it would fault or poison


def reference_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    query_lens: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Naive float64 attention, one request at a time, straight from the API contract."""
    _, num_q_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(sum(query_lens), num_q_heads, head_size, dtype=torch.float64)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks = block_table[i, : -(-seq_len // block_size)].long()
        keys = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].double()
        values = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].double()
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query[start : start + q_len].double(), keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = (seq_len - q_len) + torch.arange(q_len)
        k_pos = torch.arange(seq_len)
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        start += q_len
    return out


@dataclass(frozen=True, slots=True)
class Case:
    query_lens: list[int]
    seq_lens: list[int]
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None
    softcap: float | None = None
    num_splits: int | None = None  # None: the backend's heuristic (2D on CPU)


@dataclass(frozen=True, slots=True)
class Batch:
    query: torch.Tensor  # [num_tokens (+ padding), num_q_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor  # [num_reqs, max_blocks + 1] int32
    metadata: AttentionMetadata


def make_batch(case: Case, seed: int = 0, padding_rows: int = 0) -> Batch:
    """Random queries and a cache whose blocks are handed to requests in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    bs = case.block_size
    need = [-(-s // bs) for s in case.seq_lens]
    num_blocks = sum(need) + 3  # three blocks nobody owns
    shape = (2, num_blocks, bs, case.num_kv_heads, case.head_size)
    kv_cache = torch.full(shape, float("nan"), dtype=case.dtype)
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((len(need), max(need) + 1), GARBAGE_BLOCK, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        block_table[i, :n] = order[used : used + n].int()
        used += n
        data = torch.randn(2, n * bs, case.num_kv_heads, case.head_size, generator=gen)
        data[:, case.seq_lens[i] :] = float("nan")  # slots past the sequence end
        kv_cache[:, block_table[i, :n].long()] = data.reshape(2, n, bs, case.num_kv_heads, case.head_size).to(
            case.dtype
        )
    num_tokens = sum(case.query_lens)
    query = torch.randn(num_tokens + padding_rows, case.num_q_heads, case.head_size, generator=gen)
    query[num_tokens:] = float("nan")
    metadata = AttentionMetadata.build(case.query_lens, case.seq_lens, block_table, bs)
    return Batch(query.to(case.dtype), kv_cache, block_table, metadata)


def run_case(case: Case, backend: TritonUnifiedAttentionBackend | None = None) -> None:
    batch = make_batch(case)
    backend = backend or TritonUnifiedAttentionBackend(num_splits=case.num_splits)
    scale = case.head_size**-0.5
    out = backend.forward(
        batch.query,
        batch.kv_cache,
        batch.metadata,
        scale=scale,
        sliding_window=case.sliding_window,
        logit_softcap=case.softcap,
    )
    expected = reference_attention(
        batch.query,
        batch.kv_cache,
        case.query_lens,
        case.seq_lens,
        batch.block_table,
        scale,
        case.sliding_window,
        case.softcap,
    )
    assert out.dtype == case.dtype and out.shape == batch.query.shape
    got = out[: batch.metadata.num_actual_tokens].double()
    err = (got - expected).abs().max().item()
    assert err <= TOLERANCE[case.dtype], f"max abs error {err:.3g} for {case}"


CASES = {
    "prefill": Case([7, 12], [7, 12]),
    "chunked_prefill": Case([5, 9], [21, 40]),
    "decode": Case([1, 1, 1], [1, 17, 40]),
    "spec_decode": Case([2, 3, 4], [18, 33, 40]),
    "mixed": Case([6, 1, 3, 1], [6, 25, 40, 16]),
    "long_prefill_multi_tile": Case([37, 1], [37, 29]),
    "gqa1_mha": Case([6, 1, 3], [6, 25, 40], num_q_heads=2, num_kv_heads=2),
    "gqa3_head80": Case([6, 1, 3], [6, 25, 40], num_q_heads=6, num_kv_heads=2, head_size=80),
    "mqa_3heads": Case([6, 1, 11], [6, 25, 40], num_q_heads=3, num_kv_heads=1),
    "sliding_window": Case([6, 1, 9], [6, 25, 40], sliding_window=8),
    "softcap": Case([6, 1, 3], [6, 25, 40], softcap=5.0),
    "block32": Case([6, 1, 3], [6, 35, 40], block_size=32),
    "fp16": Case([6, 1, 3], [6, 25, 40], dtype=torch.float16),
    "bf16_window_softcap_gqa3_head80": Case(
        [6, 1, 3],
        [6, 25, 40],
        num_q_heads=6,
        num_kv_heads=2,
        head_size=80,
        block_size=32,
        dtype=torch.bfloat16,
        sliding_window=11,
        softcap=4.0,
    ),
    "split3d_decode_spec": Case([1, 3, 1], [40, 37, 9], num_splits=4),
    "split3d_window_fp16": Case([1, 2], [40, 33], num_splits=2, sliding_window=10, dtype=torch.float16),
    "split3d_more_splits_than_tiles": Case([1, 4], [12, 40], num_splits=8, num_q_heads=3, num_kv_heads=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name: str) -> None:
    run_case(CASES[name])


def _configs(block_m: int, tile_size: int, extra: dict[str, int | bool] | None = None) -> TunedConfigs:
    """Tuned configs forcing one BLOCK_M / TILE_SIZE (and the `extra` params) for every attention
    shape."""
    files = []
    for kernel in ("unified_attention_2d", "unified_attention_3d"):
        params = {"num_warps": 4, "num_stages": 1, "TILE_SIZE": tile_size, "BLOCK_M": block_m}
        params.update(extra or {})
        content = {
            "schema_version": 1,
            "kernel": kernel,
            "device": "default",
            "configs": [{"params": params}],
        }
        files.append((Path(f"<test {kernel}>"), TunedConfigFile.model_validate(content)))
    reduce = {
        "schema_version": 1,
        "kernel": "reduce_segments",
        "device": "default",
        "configs": [{"params": {"num_warps": 1}}],
    }
    files.append((Path("<test reduce>"), TunedConfigFile.model_validate(reduce)))
    return TunedConfigs(files)


@pytest.mark.parametrize(
    ("block_m", "tile_size", "num_splits"),
    [(16, 16, 1), (32, 64, 1), (16, 16, 2)],
    ids=["tile_eq_block", "tile_spans_blocks", "split3d_tile16"],
)
def test_tile_geometry(block_m: int, tile_size: int, num_splits: int) -> None:
    """Query blocks of 8 tokens straddling request starts, and KV tiles smaller than, equal to or
    spanning several cache blocks (block size 16 and 32)."""
    backend = TritonUnifiedAttentionBackend(tuned_configs=_configs(block_m, tile_size), num_splits=num_splits)
    run_case(Case([13, 1, 20], [13, 30, 40], block_size=32, sliding_window=21), backend)
    run_case(Case([9, 2], [9, 40], block_size=16), backend)


def test_grid_order_remap_gives_same_result() -> None:
    """An XCD-style remap only changes which program computes which tile."""
    backend = TritonUnifiedAttentionBackend(grid_order=GridOrder(name="test", num_groups=3))
    run_case(CASES["mixed"], backend)
    run_case(
        CASES["split3d_decode_spec"],
        TritonUnifiedAttentionBackend(grid_order=GridOrder(name="test", num_groups=8), num_splits=4),
    )


def test_padding_rows_and_out_buffer() -> None:
    """Rows past num_actual_tokens (CUDA-graph padding, NaN here) do not disturb the real rows, and
    the result is written into the given `out`."""
    case = CASES["mixed"]
    batch = make_batch(case, padding_rows=5)
    out = torch.zeros_like(batch.query)
    backend = TritonUnifiedAttentionBackend()
    result = backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=0.125, out=out)
    assert result is out
    expected = reference_attention(
        batch.query, batch.kv_cache, case.query_lens, case.seq_lens, batch.block_table, 0.125, None, None
    )
    n = batch.metadata.num_actual_tokens
    assert (out[:n].double() - expected).abs().max().item() <= TOLERANCE[torch.float32]


def test_strided_query_view() -> None:
    """A query that is a view into a fused QKV buffer (token stride != heads * head_size)."""
    case = CASES["spec_decode"]
    batch = make_batch(case)
    fused = torch.randn(batch.query.shape[0], 3 * case.num_q_heads, case.head_size)
    fused[:, : case.num_q_heads] = batch.query
    query = fused[:, : case.num_q_heads]
    assert not query.is_contiguous()
    out = TritonUnifiedAttentionBackend().forward(query, batch.kv_cache, batch.metadata, scale=0.1)
    expected = reference_attention(
        batch.query, batch.kv_cache, case.query_lens, case.seq_lens, batch.block_table, 0.1, None, None
    )
    assert (out.double() - expected).abs().max().item() <= TOLERANCE[torch.float32]


def test_unsupported_cases_raise() -> None:
    backend = TritonUnifiedAttentionBackend()
    batch = make_batch(Case([2], [5], head_size=48))
    with pytest.raises(UnsupportedCase, match="head_size=48"):
        backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=1.0)
    batch = make_batch(Case([2], [5], block_size=8))
    with pytest.raises(UnsupportedCase, match="block_size=8"):
        backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=1.0)
    batch = make_batch(Case([2], [5], dtype=torch.float64))
    with pytest.raises(UnsupportedCase, match="dtype"):
        backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=1.0)


def test_layout_violations_name_the_problem() -> None:
    backend = TritonUnifiedAttentionBackend()
    batch = make_batch(Case([2, 1], [5, 9]))
    hnd = batch.kv_cache.permute(0, 1, 3, 2, 4)  # an HND cache is not the contract
    with pytest.raises(ValueError, match="num_q_heads=4 is not a multiple of num_kv_heads=16"):
        backend.forward(batch.query, hnd, batch.metadata, scale=1.0)
    with pytest.raises(ValueError, match="unit-stride last dim"):
        backend.forward(
            batch.query.transpose(1, 2).contiguous().transpose(1, 2),
            batch.kv_cache,
            batch.metadata,
            scale=1.0,
        )
    with pytest.raises(ValueError, match="kv_cache dtype"):
        backend.forward(batch.query.half(), batch.kv_cache, batch.metadata, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window=0"):
        backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match=r"out must match query"):
        backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=1.0, out=batch.query[:1])
    with pytest.raises(ValueError, match="num_splits=3"):
        TritonUnifiedAttentionBackend(num_splits=3)


def _counting_plans(backend: TritonUnifiedAttentionBackend) -> list[int]:
    """Count the backend's `plan` calls (one per full check and build). Mutates `backend`."""
    calls: list[int] = []
    real_plan = backend.plan

    def plan(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real_plan(*args, **kwargs)  # type: ignore[arg-type]

    backend.plan = plan  # type: ignore[method-assign, assignment]
    return calls


def _expected(
    batch: Batch, case: Case, query: torch.Tensor, kv_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    return reference_attention(
        query, kv_cache, case.query_lens, case.seq_lens, batch.block_table, scale, None, None
    )


@pytest.mark.parametrize("num_splits", [1, 4], ids=["2d", "split3d"])
def test_step_cache_reused_across_layers_and_rebuilt_for_new_metadata(num_splits: int) -> None:
    """Layers of one step (same metadata object, different query and cache tensors) plan once and
    each gets its own correct result; a new metadata object with the same content plans again."""
    case = Case([1, 3, 1], [40, 37, 9], num_splits=num_splits)
    layer_a = make_batch(case)
    # Another layer: its own queries and cache contents, the step's block table (NaN stays NaN).
    gen = torch.Generator().manual_seed(7)
    kv_b = torch.randn(layer_a.kv_cache.shape, generator=gen)
    layer_b = (
        torch.randn(layer_a.query.shape, generator=gen),
        kv_b.where(~layer_a.kv_cache.isnan(), torch.nan),
    )
    metadata = layer_a.metadata
    backend = TritonUnifiedAttentionBackend(num_splits=num_splits)
    plans = _counting_plans(backend)
    for query, kv_cache in ((layer_a.query, layer_a.kv_cache), layer_b, (layer_a.query, layer_a.kv_cache)):
        out = torch.zeros_like(query)
        backend.forward(query, kv_cache, metadata, scale=0.125, out=out)
        expected = _expected(layer_a, case, query, kv_cache, 0.125)
        assert (out.double() - expected).abs().max().item() <= TOLERANCE[torch.float32]
    assert len(plans) == 1
    # Same tensors, new object: the step cache is keyed on identity, so this is a new step.
    next_step = dataclasses.replace(metadata)
    backend.forward(*layer_b, next_step, scale=0.125)
    assert len(plans) == 2


def test_step_cache_keys_on_options_and_out_layout() -> None:
    """Within one step, a changed scale or window and a missing `out` are new layouts: each result
    follows its own call's options."""
    case = Case([6, 1, 3], [6, 25, 40])
    batch = make_batch(case)
    backend = TritonUnifiedAttentionBackend()
    plans = _counting_plans(backend)
    for scale, window in ((0.1, None), (0.3, None), (0.1, 8), (0.1, None)):
        out = backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=scale, sliding_window=window)
        expected = reference_attention(
            batch.query,
            batch.kv_cache,
            case.query_lens,
            case.seq_lens,
            batch.block_table,
            scale,
            window,
            None,
        )
        assert (out.double() - expected).abs().max().item() <= TOLERANCE[torch.float32]
    assert len(plans) == 3  # the last call repeats the first layout
    given = torch.zeros_like(batch.query)
    backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=0.1, out=given)
    assert len(plans) == 4
    expected = _expected(batch, case, batch.query, batch.kv_cache, 0.1)
    assert (given.double() - expected).abs().max().item() <= TOLERANCE[torch.float32]


def test_changed_layout_within_a_step_is_checked_in_full() -> None:
    """After a good call, later calls with the same metadata but a bad query, cache or out raise
    the full checks' errors instead of launching with the cached arguments."""
    case = Case([2, 1], [5, 9])
    batch = make_batch(case)
    backend = TritonUnifiedAttentionBackend()
    backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=1.0)
    with pytest.raises(ValueError, match="kv_cache dtype"):
        backend.forward(batch.query.half(), batch.kv_cache, batch.metadata, scale=1.0)
    hnd = batch.kv_cache.permute(0, 1, 3, 2, 4)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        backend.forward(batch.query, hnd, batch.metadata, scale=1.0)
    with pytest.raises(ValueError, match="has 3 tokens but query only 2 rows"):
        backend.forward(batch.query[:2], batch.kv_cache, batch.metadata, scale=1.0)
    with pytest.raises(ValueError, match="out must match query"):
        backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=1.0, out=batch.query[:, :2])
    with pytest.raises(ValueError, match=r"logit_softcap=-1\.0"):
        backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=1.0, logit_softcap=-1.0)
    # The good layout still works after the failures.
    out = backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=1.0)
    expected = _expected(batch, case, batch.query, batch.kv_cache, 1.0)
    assert (out.double() - expected).abs().max().item() <= TOLERANCE[torch.float32]


# Kernel variants of the tuned configs (`AttentionLaunchConfig`): each must give the same
# attention. WARP_SPECIALIZE is dropped off NVIDIA sm_90+ (here: the interpreter), so its row
# checks that a config asking for it still runs, with the tl.range loop it implies.
LOOP_VARIANTS = {
    "prefetch": {"PREFETCH_BLOCK_IDS": True},
    "lazy_rescale": {"LAZY_RESCALE": True},
    "loop_stages": {"LOOP_STAGES": 3},
    "prefetch_lazy_loop_stages": {"PREFETCH_BLOCK_IDS": True, "LAZY_RESCALE": True, "LOOP_STAGES": 3},
    "warp_specialize_prefetch": {"WARP_SPECIALIZE": True, "PREFETCH_BLOCK_IDS": True},
    "longest_first": {"LONGEST_FIRST": True},
    "all_but_warp_specialize": {
        "PREFETCH_BLOCK_IDS": True,
        "LAZY_RESCALE": True,
        "LOOP_STAGES": 3,
        "LONGEST_FIRST": True,
    },
}


@pytest.mark.parametrize("num_splits", [1, 2], ids=["2d", "split3d"])
@pytest.mark.parametrize("variant", list(LOOP_VARIANTS))
def test_loop_variants_match_reference(variant: str, num_splits: int) -> None:
    """Prefill, chunked prefill and decode rows in one batch, with several interior (unmasked)
    KV tiles per query block (16-key tiles, 40-key sequences), under each loop variant; then a
    sliding window with softcap (the interior run starts past the window's masked edge) in
    bfloat16, and query blocks whose interior run is empty."""
    backend = TritonUnifiedAttentionBackend(
        tuned_configs=_configs(16, 16, LOOP_VARIANTS[variant]), num_splits=num_splits
    )
    case = Case([37, 9, 1, 1], [37, 40, 40, 3])
    run_case(case, backend)
    # ... and the cpu_reference platform's attention on the same batch.
    batch = make_batch(case)
    got = backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=0.125)
    expected = ReferenceAttentionBackend().forward(batch.query, batch.kv_cache, batch.metadata, scale=0.125)
    n = batch.metadata.num_actual_tokens
    assert (got[:n] - expected[:n]).abs().max().item() <= TOLERANCE[case.dtype]
    run_case(
        Case(
            [6, 1, 9],
            [6, 40, 38],
            num_q_heads=6,
            num_kv_heads=2,
            dtype=torch.bfloat16,
            sliding_window=19,
            softcap=4.0,
        ),
        backend,
    )


def test_lazy_rescale_survives_growing_scores() -> None:
    """Keys whose scores grow by far more than the rescale threshold from tile to tile (the
    running maximum must move) and then shrink (it must not): same result as the plain loop's."""
    case = Case([1, 33], [48, 48], num_q_heads=2, num_kv_heads=1, head_size=32)
    batch = make_batch(case)
    positions = torch.arange(batch.kv_cache.shape[1] * case.block_size, dtype=torch.float32)
    ramp = (positions % 48 - 24).abs().reshape(batch.kv_cache.shape[1], case.block_size, 1, 1)
    keys = batch.kv_cache[0]
    batch.kv_cache[0] = torch.where(keys.isnan(), keys, keys.abs() * ramp)
    batch.query.abs_()
    backend = TritonUnifiedAttentionBackend(
        tuned_configs=_configs(16, 16, {"LAZY_RESCALE": True}), num_splits=1
    )
    out = backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=1.0)
    expected = reference_attention(
        batch.query, batch.kv_cache, case.query_lens, case.seq_lens, batch.block_table, 1.0, None, None
    )
    err = (out[: batch.metadata.num_actual_tokens].double() - expected).abs().max().item()
    assert err <= TOLERANCE[torch.float32]
