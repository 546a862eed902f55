"""The cuda platform's kernels on a real NVIDIA GPU, against the cpu_reference oracle.

Every attention case of the conformance matrix (GQA ratios, head sizes, block sizes, dtypes, sliding
windows, softcaps) is re-run with decode-only geometries, so the CUDA kernels (not the Triton
fallback) compute it: with v1 (tuned, and 2 loads per lane), v2 over 64-token partitions (many
partitions per sequence), and v2 at 256 threads with 4 loads per lane. The cache-op cases run on
`CudaCacheOps`. Skipped without an NVIDIA GPU of sm_80+ with cuda-python.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest
import torch

from pagedserve.conformance.attention_check import check_attention_case
from pagedserve.conformance.cache_check import check_cache_case
from pagedserve.conformance.cases import AttentionCase, Geometry, attention_cases, cache_op_cases
from pagedserve.conformance.oracle import Oracle
from pagedserve.conformance.results import Status
from pagedserve_cuda.plugin import availability

AVAILABLE = availability()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not AVAILABLE.available, reason=f"cuda platform unavailable: {AVAILABLE.reason}"),
]

DECODE_GEOMETRIES = {
    "short": Geometry((1, 1, 1, 1), (1, 17, 33, 70)),
    "long": Geometry((1, 1, 1), (517, 300, 1029)),
}


def _decode_cases() -> list[AttentionCase]:
    from pagedserve_cuda.attention import CudaPagedAttentionBackend

    cases = []
    for case in attention_cases(CudaPagedAttentionBackend.capabilities, quick=False):
        if case.unsupported_reason(CudaPagedAttentionBackend.capabilities) is not None:
            continue
        for name, geometry in DECODE_GEOMETRIES.items():
            cases.append(dataclasses.replace(case, variant=f"{case.variant}-{name}", geometry=geometry))
    # dedupe: the geometry groups collapse onto the same decode batches
    return list({c.case_id: c for c in cases}.values())


CASES = _decode_cases() if AVAILABLE.available else []
# variant -> (forced kernel, (threads, partition size, loads per lane) or None for the tuned values)
KERNELS: dict[str, tuple[Literal["cuda_v1", "cuda_v2"], tuple[int, int, int] | None]] = {
    "v1": ("cuda_v1", None),
    "v1_loads2": ("cuda_v1", (128, 512, 2)),
    "v2_p64": ("cuda_v2", (128, 64, 8)),
    "v2_t256_loads4": ("cuda_v2", (256, 128, 4)),
}


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    return Oracle.find()


@pytest.mark.parametrize("variant", list(KERNELS))
def test_decode_kernels_match_the_oracle(variant: str, oracle: Oracle) -> None:
    from pagedserve_cuda.attention import CudaPagedAttentionBackend
    from pagedserve_cuda.selection import BatchShape, DecodeTuning

    kernel, launch = KERNELS[variant]
    tuning = None if launch is None else DecodeTuning(launch[0], launch[1], launch[1], 2, 4096, launch[2])
    backend = CudaPagedAttentionBackend(kernel=kernel, tuning=tuning)
    device = torch.device("cuda")
    failures = []
    for case in CASES:
        shape = BatchShape(
            len(case.geometry.seq_lens), 1, max(case.geometry.seq_lens), case.num_q_heads, case.num_kv_heads,
            case.head_size, case.dtype, case.block_size, case.sliding_window, case.logit_softcap,
        )  # fmt: skip
        chosen = backend.choose(shape, device).kernel
        assert chosen == kernel, f"{case.case_id}: the backend chose {chosen}, not the CUDA kernel"
        result = check_attention_case(backend, case, device, oracle)
        if result.status is not Status.PASSED:
            failures.append(f"{case.case_id} ({case.description}): {'; '.join(result.problems)}")
    assert not failures, f"{len(failures)}/{len(CASES)} cases failed:\n" + "\n".join(failures[:30])


def test_cache_ops_match_the_oracle(oracle: Oracle) -> None:
    from pagedserve_cuda.cache_ops import CudaCacheOps

    ops = CudaCacheOps()
    cases = cache_op_cases((torch.float16, torch.bfloat16, torch.float32), (16, 32, 64), quick=False)
    failures = []
    for case in cases:
        result = check_cache_case(ops, case, torch.device("cuda"), oracle)
        if result.status is not Status.PASSED:
            failures.append(f"{case.case_id}: {'; '.join(result.problems)}")
    assert not failures, "\n".join(failures)


def test_swap_blocks_scattered_and_pinned() -> None:
    """More runs than the direct path takes: the gather / one transfer / scatter path, both ways."""
    from pagedserve_cuda.cache_ops import MAX_DIRECT_RUNS, CudaCacheOps

    ops = CudaCacheOps()
    gpu = torch.randn(2, 40, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    host = torch.zeros(2, 30, 16, 2, 64, dtype=torch.bfloat16).pin_memory()
    pairs = torch.tensor([[3 * i + 1, 29 - 2 * i] for i in range(MAX_DIRECT_RUNS + 3)], dtype=torch.int64)
    ops.swap_blocks(gpu, host, pairs)
    assert torch.equal(host[:, pairs[:, 1]], gpu[:, pairs[:, 0]].cpu())
    back = torch.zeros_like(gpu)
    ops.swap_blocks(host, back, pairs[:, [1, 0]].contiguous())
    torch.cuda.synchronize()
    assert torch.equal(back[:, pairs[:, 0]], gpu[:, pairs[:, 0]])


def test_copy_blocks_is_one_launch_for_all_layers() -> None:
    from pagedserve_cuda.cache_ops import CudaCacheOps

    ops = CudaCacheOps()
    caches = [torch.randn(2, 12, 16, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3)]
    before = [c.clone() for c in caches]
    mapping = torch.tensor([[1, 7], [2, 8], [5, 11]], dtype=torch.int64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.copy_blocks(caches, mapping)
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if e.name == "copy_blocks" and e.device_type.name == "CUDA"]
    assert len(launches) == 1, [e.name for e in prof.events()]
    for c, b in zip(caches, before, strict=True):
        expected = b.clone()
        expected[:, mapping[:, 1]] = b[:, mapping[:, 0]]
        assert torch.equal(c, expected)


def test_backend_picks_v2_for_a_small_long_batch_and_v1_for_a_big_one() -> None:
    from pagedserve_cuda.attention import CudaPagedAttentionBackend
    from pagedserve_cuda.selection import BatchShape

    device = torch.device("cuda")
    small = BatchShape(1, 1, 8192, 32, 8, 128, torch.bfloat16, 16)
    big = BatchShape(512, 1, 512, 32, 8, 128, torch.bfloat16, 16)
    prefill = BatchShape(4, 37, 512, 32, 8, 128, torch.bfloat16, 16)
    tuned = CudaPagedAttentionBackend()
    props = tuned.device_props(device)
    table = tuned.decode_tuning(props.name, 128, torch.bfloat16)
    if table.decode_kernels == "triton":  # the measured H100/H200 tables: Triton decodes faster there
        assert tuned.choose(small, device).kernel == "triton"
    # The CUDA kernels' own thresholds, as on a GPU whose table keeps decode on them.
    backend = CudaPagedAttentionBackend(tuning=dataclasses.replace(table, decode_kernels="cuda"))
    assert backend.choose(small, device).kernel == "cuda_v2"
    assert backend.choose(big, device).kernel == "cuda_v1"
    assert backend.choose(prefill, device).kernel == "triton"


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_programmatic_cache_writes_match_plain_ones_in_a_cuda_graph(kv_dtype: torch.dtype) -> None:
    """`reshape_and_cache` launched as a programmatic dependent launch (`cuLaunchKernelEx`, sm_90+)
    after a torch kernel that makes its keys, eagerly and replayed from a CUDA graph: the bits a
    plain launch writes."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launches need sm_90+")
    from pagedserve.platforms.api import KVCacheScales
    from pagedserve_cuda.cache_ops import CudaCacheOps

    scales = {"kv_scales": KVCacheScales(0.05, 0.02)} if kv_dtype != torch.bfloat16 else {}
    plain, dependent = CudaCacheOps(), CudaCacheOps()
    assert dependent.enable_programmatic_launch(16)
    gen = torch.Generator(device="cuda").manual_seed(4)
    kv_in = torch.randn(3, 2, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    slots = torch.tensor([5, 70, 33], device="cuda")
    caches = [torch.zeros(2, 8, 16, 8, 128, device="cuda", dtype=kv_dtype) for _ in range(2)]

    def write(ops: CudaCacheOps, cache: torch.Tensor) -> None:
        kv = kv_in * 2.0  # a plain kernel right before the write
        ops.reshape_and_cache(kv[:, 0], kv[:, 1], cache, slots, **scales)

    write(dependent, caches[1])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write(dependent, caches[1])
    for _ in range(2):
        kv_in.copy_(torch.randn(3, 2, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen))
        graph.replay()
        write(plain, caches[0])
        torch.cuda.synchronize()
        assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
