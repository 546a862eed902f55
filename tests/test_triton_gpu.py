"""The Triton platform's compiled kernels on a real GPU, at sizes the interpreter cannot reach:
every declared head size, both 16-bit dtypes and float32, block sizes 16 and 32, long contexts,
the 3D path and the heuristic, and the cache ops (including host <-> GPU swaps).

Skipped without a CUDA/ROCm device, and when the kernels were imported in interpreter mode in this
process (the interpreter test files set TRITON_INTERPRET=1): on a GPU machine run this file in its
own pytest process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))
pytest.importorskip("triton")

# Import the kernels only with a GPU: importing them here first would fix them in compiled mode and
# make the interpreter test files of the same process skip.
if torch.cuda.is_available():
    from pagedserve_triton.interpreter import INTERPRETED
else:
    INTERPRETED = False

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
    pytest.mark.skipif(
        INTERPRETED,
        reason="the kernels were imported under TRITON_INTERPRET=1 in this process (the interpreter "
        "test files set it); run this file alone to test the compiled kernels",
    ),
]

TOLERANCE = {torch.float32: 1e-3, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Float32 attention on the GPU, one request at a time, straight from the API contract."""
    _, hq, d = query.shape
    _, _, bs, hkv, _ = kv_cache.shape
    out = torch.zeros(sum(query_lens), hq, d, dtype=torch.float32, device=query.device)
    start = 0
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks = block_table[i, : -(-sl // bs)].long()
        k = kv_cache[0, blocks].reshape(-1, hkv, d)[:sl].float().repeat_interleave(hq // hkv, 1)
        v = kv_cache[1, blocks].reshape(-1, hkv, d)[:sl].float().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", query[start : start + ql].float(), k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        qp = (sl - ql) + torch.arange(ql, device=query.device)
        kp = torch.arange(sl, device=query.device)
        vis = kp[None, :] <= qp[:, None]
        if window is not None:
            vis &= kp[None, :] > qp[:, None] - window
        out[start : start + ql] = torch.einsum(
            "hqk,khd->qhd", s.masked_fill(~vis, float("-inf")).softmax(-1), v
        )
        start += ql
    return out


def _run(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    grid_groups: int = 1,
    new_kv: bool = False,
) -> None:
    from pagedserve.platforms.api import GridOrder
    from pagedserve.platforms.attention_metadata import AttentionMetadata
    from pagedserve_triton.attention import TritonUnifiedAttentionBackend

    gen = torch.Generator(device="cuda").manual_seed(0)
    need = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(need) + 7
    kv = torch.randn(2, num_blocks, bs, hkv, d, device="cuda", dtype=dtype, generator=gen)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).int()
    bt = torch.zeros(len(need), max(need), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn(sum(query_lens), hq, d, device="cuda", dtype=dtype, generator=gen)
    md = AttentionMetadata.build(query_lens, seq_lens, bt, bs, device="cuda")
    backend = TritonUnifiedAttentionBackend(
        num_splits=num_splits, grid_order=GridOrder(name="test", num_groups=grid_groups)
    )
    extra: dict[str, torch.Tensor] = {}
    if new_kv:  # as the engine calls it: the new tokens' cache rows beside the cache
        from pagedserve_triton.ragged_prefill import unsupported_reason

        assert backend.enable_new_kv_reads()
        rows = [kv[i].flatten(0, 1)[md.slot_mapping] for i in (0, 1)]
        extra = {"new_key": rows[0], "new_value": rows[1]}
        reason = unsupported_reason(q, kv, md, *extra.values(), sliding_window=window, logit_softcap=softcap)
        assert reason is None or torch.cuda.get_device_capability() < (9, 0), reason
    out = backend.forward(q, kv, md, scale=d**-0.5, sliding_window=window, logit_softcap=softcap, **extra)
    ref = _reference(q, kv, query_lens, seq_lens, bt, d**-0.5, window, softcap)
    err = (out.float() - ref).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3g}"


MIXED = ([300, 1, 1, 4, 37, 1], [300, 2049, 77, 516, 1000, 16])


# Whole prompts and chunks after cached context, all of 16+ tokens: on NVIDIA sm_90+ the ragged
# prefill kernel, reading the new tokens' keys and values from the tensors passed beside the cache.
PROMPT_CHUNKS = ([512, 300, 77, 1030, 16], [512, 300, 977, 1030, 2000])


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prompt_chunks_from_new_keys_and_values(d: int, dtype: torch.dtype) -> None:
    _run(*PROMPT_CHUNKS, hq=32, hkv=8, d=d, bs=16, dtype=dtype, new_kv=True)


# Whole prompts only (no cached context), with lengths on and beside the 64-row tile edges: on
# sm_90 the Gluon kernel (head sizes 64 and 128), elsewhere and for other head sizes the Triton one.
WHOLE_PROMPTS = ([512, 300, 77, 1030, 16, 64, 65, 129], [512, 300, 77, 1030, 16, 64, 65, 129])


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (8, 8), (16, 1)])
def test_whole_prompts_from_new_keys_and_values(d: int, dtype: torch.dtype, hq: int, hkv: int) -> None:
    _run(*WHOLE_PROMPTS, hq=hq, hkv=hkv, d=d, bs=16, dtype=dtype, new_kv=True)


@pytest.mark.parametrize(("block_n", "stages"), [(64, 2), (64, 3), (32, 2)])
def test_whole_prompts_sm90_kernel_reads_and_writes_only_real_tokens(block_n: int, stages: int) -> None:
    """The Gluon kernel, launched directly over a batch whose tensors have NaN padding rows past
    the real tokens: the real rows match the reference and the padding rows of `out` are untouched."""
    from pagedserve_triton import ragged_prefill_sm90
    from pagedserve_triton.ragged_prefill import plan_tiles

    if not ragged_prefill_sm90.device_supported(torch.device("cuda")):
        pytest.skip("the Gluon prefill kernel runs on sm_90 GPUs only")
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens, hq, hkv, d, pad = [200, 1, 64, 63, 513], 16, 4, 128, 40
    tokens = sum(lens)
    q, k, v = (
        torch.randn(tokens + pad, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for h in (hq, hkv, hkv)
    )
    for t in (q, k, v):
        t[tokens:] = float("nan")
    out = torch.full_like(q, float("nan"))
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    request, index = plan_tiles(qsl, torch.tensor(lens, dtype=torch.int32), ragged_prefill_sm90.BLOCK_M)
    ragged_prefill_sm90.launch_ragged_prefill_sm90(
        q, k, v, qsl.cuda(), tokens, (request.cuda(), index.cuda()), out,
        scale=d**-0.5, block_n=block_n, num_stages=stages,
    )  # fmt: skip
    start = 0
    for n in lens:
        rows = slice(start, start + n)
        kk, vv = (t[rows].float().transpose(0, 1).repeat_interleave(hq // hkv, 0) for t in (k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[rows].float().transpose(0, 1), kk, vv, is_causal=True, scale=d**-0.5
        ).transpose(0, 1)
        err = (out[rows].float() - ref).abs().max().item()
        assert err <= TOLERANCE[torch.bfloat16], f"request of {n} tokens: max abs error {err:.3g}"
        start += n
    assert out[tokens:].isnan().all()


@pytest.mark.parametrize("d", [32, 64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_mixed_batch_all_head_sizes(d: int, dtype: torch.dtype) -> None:
    _run(*MIXED, hq=8, hkv=2, d=d, bs=16, dtype=dtype)


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize(("hq", "hkv"), [(8, 8), (12, 4), (32, 8), (16, 1)])
def test_gqa_and_block_sizes(bs: int, hq: int, hkv: int) -> None:
    _run(*MIXED, hq=hq, hkv=hkv, d=128, bs=bs, dtype=torch.bfloat16)


@pytest.mark.parametrize("num_splits", [None, 2, 8, 32])
def test_split_kv_decode(num_splits: int | None) -> None:
    _run([1, 1, 3], [8192, 777, 3000], hq=32, hkv=8, d=128, bs=16, dtype=torch.float16, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_xcd_style_grid_remap(num_splits: int) -> None:
    _run(*MIXED, hq=8, hkv=2, d=128, bs=16, dtype=torch.float16, grid_groups=8)
    _run(
        [1, 2],
        [3000, 900],
        hq=8,
        hkv=2,
        d=128,
        bs=16,
        dtype=torch.float16,
        num_splits=num_splits,
        grid_groups=8,
    )


def test_window_and_softcap() -> None:
    _run(*MIXED, hq=16, hkv=8, d=256, bs=16, dtype=torch.bfloat16, window=128, softcap=30.0)
    _run([1, 2], [4000, 3001], hq=16, hkv=8, d=256, bs=32, dtype=torch.bfloat16, window=512, num_splits=4)


def test_cache_ops_on_gpu() -> None:
    from pagedserve_triton.cache_ops import TritonCacheOps

    ops = TritonCacheOps()
    caches = [torch.randn(2, 64, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    before = [c.clone() for c in caches]
    mapping = torch.tensor([[1, 5], [7, 2], [1, 63]], dtype=torch.int64)
    ops.copy_blocks(caches, mapping.cuda())
    for c, b in zip(caches, before, strict=True):
        expected = b.clone()
        expected[:, mapping[:, 1]] = b[:, mapping[:, 0]]
        assert torch.equal(c, expected)

    key = torch.randn(40, 8, 128, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(40, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device="cuda")[:40]
    ops.reshape_and_cache(key, value, caches[0], slots)
    flat = caches[0].reshape(2, 64 * 16, 8, 128)
    assert torch.equal(flat[0, slots], key) and torch.equal(flat[1, slots], value)

    host = torch.zeros(2, 16, 16, 8, 128, dtype=torch.bfloat16)
    out_map = torch.tensor([[3, 0], [9, 15]], dtype=torch.int64)
    ops.swap_blocks(caches[1], host, out_map)
    assert torch.equal(host[:, [0, 15]], caches[1][:, [3, 9]].cpu())
    back = torch.tensor([[0, 40], [15, 41]], dtype=torch.int64)
    ops.swap_blocks(host, caches[2], back)
    torch.cuda.synchronize()
    assert torch.equal(caches[2][:, [40, 41]].cpu(), host[:, [0, 15]])
    ops.swap_blocks(caches[0], caches[1], torch.tensor([[2, 3]], dtype=torch.int64))
    assert torch.equal(caches[1][:, 3], caches[0][:, 2])


@pytest.mark.parametrize("batch", ["decode_3d", "mixed_2d"])
def test_step_cache_across_layers(batch: str) -> None:
    """Layers of one step (one metadata object; each layer its own query, cache and output) reuse
    the first layer's launches, launched directly after the first; a query 2 bytes past a 16-byte
    boundary (another Triton specialization) is still right, as are the layers after it."""
    from pagedserve.platforms.attention_metadata import AttentionMetadata
    from pagedserve_triton.attention import TritonUnifiedAttentionBackend

    query_lens, seq_lens = ([1, 1, 1], [3000, 100, 517]) if batch == "decode_3d" else MIXED
    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(1)
    need = [-(-s // bs) for s in seq_lens]
    table = torch.randperm(sum(need), device="cuda", generator=gen).int()
    bt = torch.zeros(len(need), max(need), dtype=torch.int32, device="cuda")
    for i, start in enumerate([0, *torch.tensor(need).cumsum(0).tolist()[:-1]]):
        bt[i, : need[i]] = table[start : start + need[i]]
    md = AttentionMetadata.build(query_lens, seq_lens, bt, bs, device="cuda")
    backend = TritonUnifiedAttentionBackend()
    num_tokens = sum(query_lens)
    for layer in range(5):
        kv = torch.randn(2, sum(need), bs, hkv, d, device="cuda", dtype=dtype, generator=gen)
        flat = torch.randn(num_tokens * hq * d + 1, device="cuda", dtype=dtype, generator=gen)
        offset = 1 if layer == 2 else 0
        q = flat[offset : offset + num_tokens * hq * d].view(num_tokens, hq, d)
        out = torch.full_like(q, float("nan"))
        backend.forward(q, kv, md, scale=d**-0.5, out=out)
        ref = _reference(q, kv, query_lens, seq_lens, bt, d**-0.5, None, None)
        err = (out.float() - ref).abs().max().item()
        assert err <= TOLERANCE[dtype], f"layer {layer}: max abs error {err:.3g}"


def test_cached_launch_goes_direct_on_gpu() -> None:
    """After its first launch a `CachedLaunch` of a real kernel launches the compiled kernel
    directly, with each call's own tensors."""
    from pagedserve_triton.cache_kernels import reshape_and_cache_kernel
    from pagedserve_triton.launch_params import CachedLaunch

    slots = torch.randperm(64 * 16, device="cuda")[:40]
    caches = [torch.zeros(2, 64, 16, 8, 128, device="cuda", dtype=torch.float16) for _ in range(3)]
    args: dict[str, object] = {
        "key_ptr": None,
        "value_ptr": None,
        "kv_ptr": None,
        "slot_mapping_ptr": slots,
        "stride_k_tok": 8 * 128,
        "stride_k_head": 128,
        "stride_v_tok": 8 * 128,
        "stride_v_head": 128,
        "stride_kv_kind": caches[0].stride(0),
        "stride_kv_block": caches[0].stride(1),
        "stride_kv_slot": caches[0].stride(2),
        "stride_kv_head": caches[0].stride(3),
        # A 16-bit cache: the FP8 arguments are passed and not read (QUANTIZE is off).
        "k_inv_scale": 1.0,
        "v_inv_scale": 1.0,
        "fp8_max": 448.0,
        "fp8_min_subnormal": 2.0**-9,
        "BLOCK_SIZE": 16,
        "HEAD_SIZE": 128,
        "HEAD_SIZE_PADDED": 128,
        "QUANTIZE": False,
        "MANT_BITS": 3,
        "MIN_NORMAL_EXP": -6,
    }
    launch = CachedLaunch(reshape_and_cache_kernel, (40, 8), args, ("key_ptr", "value_ptr", "kv_ptr"), {})
    for i, cache in enumerate(caches):
        key = torch.randn(40, 8, 128, device="cuda", dtype=torch.float16)
        value = torch.randn(40, 8, 128, device="cuda", dtype=torch.float16)
        launch(key, value, cache)
        assert launch.fast, f"call {i} did not leave a compiled kernel to launch directly"
        flat = cache.view(2, 64 * 16, 8, 128)
        assert torch.equal(flat[0, slots], key) and torch.equal(flat[1, slots], value)


@pytest.mark.parametrize("num_splits", [1, 16], ids=["2d", "split3d"])
def test_programmatic_decode_chain_in_a_cuda_graph(num_splits: int) -> None:
    """Eight layers of decode attention launched as programmatic dependent launches, each layer's
    query made from the previous layer's output by a plain torch kernel, captured in one CUDA
    graph and replayed for new inputs: the same bits as the plain backend run eagerly."""
    if not torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("programmatic dependent launches need sm_90+")
    from pagedserve.platforms.attention_metadata import AttentionMetadata
    from pagedserve_triton.attention import TritonUnifiedAttentionBackend

    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    seq_lens = [600, 37, 1200]
    gen = torch.Generator(device="cuda").manual_seed(2)
    need = [-(-s // bs) for s in seq_lens]
    bt = torch.randperm(sum(need), device="cuda", generator=gen).int()
    table = torch.zeros(len(need), max(need), dtype=torch.int32, device="cuda")
    for i, start in enumerate([0, *torch.tensor(need).cumsum(0).tolist()[:-1]]):
        table[i, : need[i]] = bt[start : start + need[i]]
    md = AttentionMetadata.build([1, 1, 1], seq_lens, table, bs, device="cuda")
    caches = [
        torch.randn(2, sum(need), bs, hkv, d, device="cuda", dtype=dtype, generator=gen) for _ in range(8)
    ]

    def chain(backend: TritonUnifiedAttentionBackend, q0: torch.Tensor) -> torch.Tensor:
        q = q0
        for cache in caches:
            q = backend.forward(q * 1.5, cache, md, scale=d**-0.5) + q0
        return q

    plain = TritonUnifiedAttentionBackend(num_splits=num_splits)
    dependent = TritonUnifiedAttentionBackend(num_splits=num_splits)
    dependent.enable_programmatic_launch(16)
    q_in = torch.randn(3, hq, d, device="cuda", dtype=dtype, generator=gen)
    chain(dependent, q_in)  # compile and build the launches before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = chain(dependent, q_in)
    for seed in range(3):
        q_in.copy_(torch.randn(3, hq, d, device="cuda", dtype=dtype, generator=gen))
        graph.replay()
        expected = chain(plain, q_in)
        torch.cuda.synchronize()
        assert torch.equal(q_out, expected), f"replay {seed}"
