"""Which attention kernel a batch gets on the cuda platform, and why: the single source of truth
shared by `CudaPagedAttentionBackend.forward` and `pagedserve platforms --explain`.

Pure: `explain` looks only at host-side batch geometry, the device's SM count and capability, and
the tuned thresholds, so the backend can call it once per step without touching the GPU.

The rules, in order:

1. Prefill, chunked-prefill, speculative and mixed batches (`max_query_len > 1`) go to the Triton
   unified kernel: the CUDA kernels read exactly one query token per sequence.
2. Shapes the CUDA kernels do not compile for (dtype, head size) go to Triton as well, and so does
   every batch on a device whose tuned configs say `"decode_kernels": "triton"`.
3. A decode batch runs v1 (one pass, one CTA per GQA head group and sequence) when that already
   gives the GPU enough CTAs (`ctas_per_sm` per SM) and the context is not longer than
   `v1_max_seq_len`, or when the context fits in one partition anyway.
4. Otherwise v2 splits each context into partitions: `partition_size` tokens, halved (down to
   `min_partition_size`) while the grid still has fewer than `ctas_per_sm` CTAs per SM. If that
   leaves a single partition, v1 runs instead (the same work without the reduction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_CAPABILITY = (8, 0)  # bf16 conversions (cvt.rn.bf16.f32) need sm_80
MAX_HEADS_PER_CTA = 8  # query heads sharing one CTA's K/V reads; more would spill registers
MAX_HEAD_SIZE = 256
STATIC_SHARED_BYTES = 48 * 1024  # the static shared-memory limit of a CTA


@dataclass(frozen=True, slots=True)
class DeviceProps:
    """What the heuristic needs to know about the GPU."""

    name: str  # "NVIDIA H100 80GB HBM3"
    num_sms: int  # streaming multiprocessors
    capability: tuple[int, int]  # (9, 0) for sm_90

    @staticmethod
    def of(device: torch.device) -> DeviceProps:
        """Read from torch (needs a CUDA device). Does not mutate."""
        props = torch.cuda.get_device_properties(device)
        return DeviceProps(props.name, props.multi_processor_count, (props.major, props.minor))


@dataclass(frozen=True, slots=True)
class DecodeTuning:
    """Tuned thresholds of the decode heuristic (tuned-config kernel "cuda_paged_attention")."""

    num_threads: int  # threads per CTA of the decode kernels (a multiple of 32)
    partition_size: int  # v2's largest partition, in tokens
    min_partition_size: int  # v2 halves partitions down to this to fill the GPU
    ctas_per_sm: int  # CTAs per SM the grid should reach before v1 is good enough
    v1_max_seq_len: int  # longer contexts use v2 even with many CTAs (load balance)
    loads_per_lane: int = 8  # 16-byte key loads a lane issues per loop step (values as many again)
    min_ctas_per_sm: int = 0  # __launch_bounds__ occupancy hint: caps registers; 0 leaves it to ptxas
    decode_kernels: Literal["cuda", "triton"] = "cuda"  # "triton": route decode to Triton as well


@dataclass(frozen=True, slots=True)
class BatchShape:
    """The host-side geometry of one attention call."""

    num_seqs: int
    max_query_len: int
    max_seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    sliding_window: int | None = None  # None: the whole context
    logit_softcap: float | None = None  # None: no softcap


@dataclass(frozen=True, slots=True)
class LaunchShape:
    """How a CUDA decode kernel is launched for one batch."""

    heads_per_cta: int  # query heads per CTA (they share one KV head)
    num_threads: int  # threads per CTA
    threads_per_token: int  # TG: lanes reading one key row
    rows: int  # tokens each thread group loads per loop step
    partition_size: int | None  # v2: tokens per partition; None for v1
    num_partitions: int  # v2: partitions of the longest context; 1 for v1
    min_ctas: int = 0  # CTAs per SM the compiler must fit (register cap); 0: no constraint


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The answer of `explain`: which kernel, why, and (CUDA kernels) how it is launched."""

    kernel: Literal["cuda_v1", "cuda_v2", "triton"]
    reason: str
    launch: LaunchShape | None  # None when Triton runs

    def describe(self) -> str:
        """One line for people. Pure."""
        if self.launch is None:
            return f"{self.kernel}: {self.reason}"
        shape = self.launch
        grid = f"{shape.heads_per_cta} heads/CTA, {shape.num_threads} threads"
        if shape.partition_size is not None:
            grid += f", {shape.num_partitions} partitions of {shape.partition_size} tokens"
        return f"{self.kernel} ({grid}): {self.reason}"


def heads_per_cta(queries_per_kv: int) -> int:
    """The GQA group size a CTA covers: the whole group up to 8 heads, else its largest divisor
    <= 8 (so a CTA never spans two KV heads). Pure."""
    return max(h for h in range(1, MAX_HEADS_PER_CTA + 1) if queries_per_kv % h == 0)


def vector_elems(dtype: torch.dtype) -> int:
    """Elements per 16-byte load: 8 for 16-bit dtypes, 4 for float32. Pure."""
    return 16 // dtype.itemsize


def thread_layout(head_size: int, dtype: torch.dtype, heads: int, loads_per_lane: int = 8) -> tuple[int, int]:
    """(TG, ROWS): lanes per key row (largest power of two <= 32 dividing the row's 16-byte
    vectors) and tokens per thread group per loop step (about `loads_per_lane` vector loads per
    lane, fewer for large head groups to bound registers). Pure."""
    vecs = head_size // vector_elems(dtype)
    tg = 1
    while tg < 32 and vecs % (tg * 2) == 0:
        tg *= 2
    per_lane = vecs // tg
    rows = max(1, min(loads_per_lane // per_lane, 32 // heads))
    return tg, rows


def shared_bytes(num_threads: int, heads: int, head_size: int) -> int:
    """Static shared memory of the decode kernel: per warp, an accumulator row per head plus the
    max and the exp-sum. Pure."""
    return (num_threads // 32) * heads * (head_size + 2) * 4


def _unsupported(shape: BatchShape, device: DeviceProps) -> str | None:
    if device.capability < MIN_CAPABILITY:
        major, minor = device.capability
        return f"sm_{major}{minor} is below sm_80, which the CUDA kernels need"
    if shape.dtype not in CUDA_DTYPES:
        return f"dtype {shape.dtype} has no CUDA kernel"
    vec = vector_elems(shape.dtype)
    if shape.head_size % vec or shape.head_size > MAX_HEAD_SIZE:
        return f"head_size={shape.head_size} is not a multiple of {vec} up to {MAX_HEAD_SIZE}"
    if shape.num_kv_heads < 1 or shape.num_q_heads % shape.num_kv_heads:
        return f"{shape.num_q_heads} query heads do not split into {shape.num_kv_heads} KV-head groups"
    return None


def explain(shape: BatchShape, device: DeviceProps, tuning: DecodeTuning) -> KernelChoice:
    """The kernel for `shape` on `device` and the reason (rules in the module docstring). Pure."""
    if shape.max_query_len != 1:
        return KernelChoice(
            "triton",
            f"max_query_len={shape.max_query_len}: prefill/mixed batches use the Triton unified kernel "
            "(the CUDA kernels are decode-only: one query token per sequence)",
            None,
        )
    problem = _unsupported(shape, device)
    if problem is not None:
        return KernelChoice("triton", f"{problem}; the Triton unified kernel runs instead", None)
    if tuning.decode_kernels == "triton":
        return KernelChoice(
            "triton", f"the tuned configs for {device.name} route decode batches to the Triton kernel", None
        )

    heads = heads_per_cta(shape.num_q_heads // shape.num_kv_heads)
    threads = tuning.num_threads
    while threads > 32 and shared_bytes(threads, heads, shape.head_size) > STATIC_SHARED_BYTES:
        threads //= 2
    tg, rows = thread_layout(shape.head_size, shape.dtype, heads, tuning.loads_per_lane)
    min_ctas = tuning.min_ctas_per_sm
    span = shape.max_seq_len
    if shape.sliding_window is not None:
        span = min(span, shape.sliding_window)
    ctas = shape.num_seqs * (shape.num_q_heads // heads)
    target = tuning.ctas_per_sm * device.num_sms

    def v1(reason: str) -> KernelChoice:
        return KernelChoice("cuda_v1", reason, LaunchShape(heads, threads, tg, rows, None, 1, min_ctas))

    if span <= tuning.min_partition_size:
        return v1(f"the context ({span} tokens) fits in one partition of {tuning.min_partition_size}")
    if ctas >= target and span <= tuning.v1_max_seq_len:
        return v1(
            f"{ctas} CTAs (sequences x head groups) already give {device.num_sms} SMs "
            f">= {tuning.ctas_per_sm} each, and the context ({span}) is <= {tuning.v1_max_seq_len}"
        )
    size = tuning.partition_size
    while size > tuning.min_partition_size and ctas * -(-span // size) < target:
        size //= 2
    parts = -(-span // size)
    if parts == 1:
        return v1(f"the context ({span} tokens) fits in one partition of {size}")
    why = (
        f"only {ctas} CTAs for {device.num_sms} SMs"
        if ctas < target
        else f"the context ({span}) is longer than {tuning.v1_max_seq_len}"
    )
    return KernelChoice(
        "cuda_v2",
        f"{why}: {parts} partitions of {size} tokens give {ctas * parts} CTAs",
        LaunchShape(heads, threads, tg, rows, size, parts, min_ctas),
    )
