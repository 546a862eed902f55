"""The conformance case matrix: which batches, shapes and options every backend is run on.

A case is pure data (no tensors); `attention_check` and `cache_check` build its inputs from its
seed. The matrix is derived from what a backend *declares*, intersected with fixed candidate lists:

* Geometry groups (one flattened V1 batch each, at the backend's base shape): pure prefill,
  chunked prefill with a context much longer than the query, decode, speculative queries of 2 to 8
  tokens, a mixed batch (decodes + prefill + chunked prefill + speculative), and sequence lengths
  around block boundaries. Every case reads keys through a shuffled block table with gaps.
* `no_out`: the mixed batch without `out=`, checking the returned tensor instead, in every
  declared dtype.
* `attention_sinks` (backends declaring `attention_sinks`, API 1.13): one sink logit per query
  head in every softmax (see `SINK_RANGE`): prefill, decode, chunked prefill and the mixed batch in
  every declared dtype, with sliding windows, and (full set) long decodes (split-KV kernels),
  a softcap and an FP8 cache. A backend that does not declare sinks gets no such case: the engine
  never passes them to it, and a plugin of an older API could not take the keyword.
* Sweeps, each varying one property of the mixed batch away from the base shape: GQA ratio (1, 3, 4,
  8 and MQA), head size, block size, dtype, sliding window, logit softcap (the last two in every
  declared dtype). Every declared value in the candidate lists is run; candidates the backend does
  not declare become *unsupported probes*: the suite asserts that calling them raises
  `UnsupportedCase`.
* `engine_smoke` (`EngineCase`): a few greedy tokens of a tiny random model per backend and
  declared engine dtype, run through the model's attention layers as the engine runs them.
* `lora` (`LoRACase`, platforms with a `LoRAKernel`): one call adding several adapters' deltas
  to a mixed batch: a decode-sized step in every dtype, a prefill-sized one, one adapter for
  every token, no adapter at all, and widths that are not powers of two.
* MoE groups (`MoECase`, platforms with an `MoEKernel`): one call of the fused MoE operator each,
  from router logits to the weighted sum: experts without tokens, every token on one expert,
  tied router logits, every declared dtype, FP8 expert weights and biases with the clamped SwiGLU
  (when the kernel declares them), each scoring, junk rows past the step's tokens, and token
  counts from 1 to 300 over varied shapes.
* Integer-weight linear groups (`IntLinearCase`, platforms with an `IntLinearKernel`): in their own
  module, `int_linear_cases`.

`quick=True` keeps every group and every declared dtype but fewer head sizes, block sizes, windows
and softcaps, and no long-sequence cases: small enough for the Triton interpreter in CI.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from pagedserve.conformance.tolerances import TOLERANCES
from pagedserve.platforms.api import AttentionCapabilities, KVCacheScales, MoERouting

HEAD_SIZES = (32, 64, 80, 96, 112, 128, 192, 256)
QUICK_HEAD_SIZES = (64, 80)  # a power of two and one a kernel must pad
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
QUICK_BLOCK_SIZES = (16, 32)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BASE_DTYPE_PREFERENCE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
BASE_HEADS = (4, 2)  # (num_q_heads, num_kv_heads): GQA ratio 2, so every case exercises the mapping
GQA_HEADS = ((2, 2), (6, 2), (8, 2), (8, 1), (16, 2), (4, 1))  # ratios 1, 3, 4, 8 (MQA), 8, 4 (MQA)
QUICK_GQA_HEADS = GQA_HEADS[:4]
SLIDING_WINDOWS = (1, 5, 37, 4096)  # own key only, short, longer than a block, wider than any sequence
QUICK_SLIDING_WINDOWS = (5,)
SOFTCAPS = (2.0, 30.0)
QUICK_SOFTCAPS = (2.0,)
MAX_DECLARED_VALUES = 16  # a declared set at most this large is run in full (e.g. block sizes)
# FP8 caches the suite knows (the OCP encodings and AMD's fnuz ones); a backend runs the declared
# ones and must refuse the others.
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
FP8_GROUPS = ("decode", "mixed", "chunked_prefill")  # geometries run with each declared FP8 cache
QUICK_FP8_GROUPS = ("mixed",)  # decodes, a prefill, a chunked prefill and a speculative query
# Scales of every FP8 case: not powers of two (so quantizing rounds), different for keys and values
# (so a swapped scale shows), and small enough that standard-normal data spans most of the FP8
# range: a backend that forgets, swaps or inverts a scale moves every output far past tolerance.
FP8_KV_SCALES = KVCacheScales(k_scale=0.0117, v_scale=0.0213)
# Sink logits of the `attention_sinks` cases are uniform in this range (one per query head, drawn
# after the case's other tensors), the first head's set to its top: about as large as the largest
# of the standard-normal scores, so a backend that ignores a sink, counts it once per KV split or
# scales it like a score is off by far more than any tolerance.
SINK_RANGE = (-1.0, 4.0)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class Geometry:
    """One flattened batch: request `i` has `query_lens[i]` new tokens out of `seq_lens[i]`."""

    query_lens: tuple[int, ...]  # req index -> new tokens this step
    seq_lens: tuple[int, ...]  # req index -> context + new tokens


def _geometries(block_size: int, quick: bool) -> dict[str, Geometry]:
    """Geometry group -> batch. Lengths avoid block multiples except where the group is about them."""
    b = block_size
    found = {
        "prefill": Geometry((17, 9), (17, 9)),
        # Context 147 (not a block multiple) >> query 12; and a short chunk after 40 cached tokens.
        "chunked_prefill": Geometry((12, 5), (159, 45)),
        "decode": Geometry((1, 1, 1, 1), (1, 17, 33, 70)),
        "spec_decode": Geometry((2, 3, 5, 8), (20, 35, 16, 50)),
        # Decodes, a whole prefill, a chunked prefill and a speculative query in one batch.
        "mixed": Geometry((1, 9, 6, 1, 4), (40, 9, 70, 16, 23)),
        "block_boundaries": Geometry((1, 1, 2, 1, 1), (b, b + 1, 2 * b, max(b - 1, 1), 1)),
    }
    if not quick:
        found["long_decode"] = Geometry((1, 1, 1), (517, 300, 1029))
        found["long_chunked_prefill"] = Geometry((37, 1), (731, 260))
        # Only prompt chunks of 16+ tokens, a whole prompt and one after cached context: the
        # batches a backend may run from the new keys and values (`enable_new_kv_reads`).
        found["prompt_chunks"] = Geometry((40, 17), (40, 167))
    return found


@dataclass(frozen=True, slots=True)
class AttentionCase:
    """One call of `AttentionBackend.forward` to check against the reference."""

    group: str  # what the case is about: "decode", "gqa", "head_size", ...
    variant: str  # what distinguishes it within the group: "ratio3", "80", "float16", ...
    geometry: Geometry
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    sliding_window: int | None  # None: whole context
    logit_softcap: float | None  # None: no softcap
    pass_out: bool  # False: forward gets no `out=` and its return value is checked instead
    seed: int  # every tensor of the case is drawn from a generator seeded with this
    kv_cache_dtype: torch.dtype | None = None  # an FP8 cache (scales FP8_KV_SCALES); None: `dtype`
    # Also run every request of the batch alone and compare with its rows in the batch: a result
    # must not depend on what else the batch holds (set on the mixed geometry).
    check_batch_invariance: bool = False
    attention_sinks: bool = False  # pass `sinks=` (one logit per query head, `SINK_RANGE`); API 1.13

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    @property
    def case_id(self) -> str:
        """A stable, unique, readable id (used as the pytest id)."""
        return f"{self.group}[{self.variant}]"

    @property
    def description(self) -> str:
        g = self.geometry
        options = []
        if self.sliding_window is not None:
            options.append(f"window={self.sliding_window}")
        if self.logit_softcap is not None:
            options.append(f"softcap={self.logit_softcap}")
        if not self.pass_out:
            options.append("out=None")
        if self.kv_cache_dtype is not None:
            options.append(f"kv_cache={dtype_name(self.kv_cache_dtype)}")
        if self.attention_sinks:
            options.append("attention sinks")
        if self.check_batch_invariance:
            options.append("each request also alone")
        return (
            f"query_lens={list(g.query_lens)} seq_lens={list(g.seq_lens)} heads={self.num_q_heads}/"
            f"{self.num_kv_heads} head_size={self.head_size} block_size={self.block_size} "
            f"{dtype_name(self.dtype)}" + "".join(f" {o}" for o in options)
        )

    def unsupported_reason(self, caps: AttentionCapabilities) -> str | None:
        """Which property of this case `caps` does not declare, or None if all are declared."""
        if self.head_size not in caps.head_sizes:
            return f"head_size={self.head_size} is not declared"
        if self.dtype not in caps.dtypes:
            return f"dtype={dtype_name(self.dtype)} is not declared"
        if self.block_size not in caps.block_sizes:
            return f"block_size={self.block_size} is not declared"
        if self.sliding_window is not None and not caps.sliding_window:
            return "sliding window is not declared"
        if self.logit_softcap is not None and not caps.logit_softcap:
            return "logit softcap is not declared"
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in caps.kv_cache_dtypes:
            return f"kv_cache_dtype={dtype_name(self.kv_cache_dtype)} is not declared"
        if self.attention_sinks and not caps.attention_sinks:
            return "attention sinks are not declared"
        longest = max(self.geometry.query_lens)
        if caps.max_query_len is not None and longest > caps.max_query_len:
            return f"query_len={longest} exceeds the declared max_query_len={caps.max_query_len}"
        return None


def _seed(case_id: str, base_seed: int) -> int:
    return (zlib.crc32(case_id.encode()) + base_seed) % (2**31)


def _candidates(
    declared: Iterable[int], candidates: tuple[int, ...], quick_subset: tuple[int, ...] | None, base: int
) -> list[int]:
    """Values a sweep runs: declared candidates (only `quick_subset` ones when given), declared values
    outside the candidates when the declared set is small, and undeclared candidates as probes.
    The base value is left out: the geometry groups already run it."""
    declared_set = set(declared)
    run = {c for c in candidates if c in declared_set and (quick_subset is None or c in quick_subset)}
    if quick_subset is None and len(declared_set) <= MAX_DECLARED_VALUES:
        run |= declared_set
    probes = {c for c in candidates if c not in declared_set}
    return sorted((run | probes) - {base})


def _base(declared: frozenset[int], preferred: tuple[int, ...]) -> int:
    for value in preferred:
        if value in declared:
            return value
    return min(declared) if declared else preferred[0]


def base_shape(caps: AttentionCapabilities) -> tuple[int, int, torch.dtype]:
    """(head_size, block_size, dtype) of the geometry groups: declared values, common ones first."""
    head_size = _base(caps.head_sizes, (64, 128, 80, 96, 32, 256, 112, 192))
    block_size = _base(caps.block_sizes, (16, 32, 8, 64, 128))
    dtype = next((d for d in BASE_DTYPE_PREFERENCE if d in caps.dtypes), torch.float32)
    return head_size, block_size, dtype


def attention_cases(caps: AttentionCapabilities, *, quick: bool, seed: int = 0) -> list[AttentionCase]:
    """The attention case matrix for a backend declaring `caps` (see the module docstring). Pure."""
    head_size, block_size, dtype = base_shape(caps)
    hq, hkv = BASE_HEADS
    base = AttentionCase(
        group="",
        variant="",
        geometry=Geometry((1,), (1,)),
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        sliding_window=None,
        logit_softcap=None,
        pass_out=True,
        seed=0,
    )
    cases: list[AttentionCase] = []

    def add(group: str, variant: str, geometry: Geometry, **changes: Any) -> None:
        seed_ = _seed(f"{group}[{variant}]", seed)
        cases.append(replace(base, group=group, variant=variant, geometry=geometry, seed=seed_, **changes))

    declared_dtypes = declared_compute_dtypes(caps) or [dtype]
    for d in [dtype] if quick else declared_dtypes:
        for group, geometry in _geometries(block_size, quick).items():
            add(group, dtype_name(d), geometry, dtype=d, check_batch_invariance=group == "mixed")

    _shape_attention_cases(add, caps, head_size, block_size, dtype, quick)
    _feature_attention_cases(add, caps, block_size, declared_dtypes, quick)
    if caps.attention_sinks:
        _sink_attention_cases(add, caps, block_size, declared_dtypes, quick)
    return cases


def declared_compute_dtypes(caps: AttentionCapabilities) -> list[torch.dtype]:
    """The dtypes of `DTYPES` the backend declares, in `DTYPES`' order (empty if none)."""
    return [d for d in DTYPES if d in caps.dtypes]


# add(group, variant, geometry, **changes): appends a variant of the base case to the matrix.
_AddAttentionCase = Callable[..., None]


def _shape_attention_cases(
    add: _AddAttentionCase,
    caps: AttentionCapabilities,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    quick: bool,
) -> None:
    """Add the cases varying one shape parameter of the base case (head counts, head size,
    block size, dtype), each on the mixed geometry."""
    mixed = _geometries(block_size, quick)["mixed"]
    for q_heads, kv_heads in QUICK_GQA_HEADS if quick else GQA_HEADS:
        mqa = "_mqa" if kv_heads == 1 else ""
        add(
            "gqa",
            f"ratio{q_heads // kv_heads}{mqa}_h{q_heads}/{kv_heads}",
            mixed,
            num_q_heads=q_heads,
            num_kv_heads=kv_heads,
        )
    for h in _candidates(caps.head_sizes, HEAD_SIZES, QUICK_HEAD_SIZES if quick else None, head_size):
        add("head_size", str(h), mixed, head_size=h)
    for b in _candidates(caps.block_sizes, BLOCK_SIZES, QUICK_BLOCK_SIZES if quick else None, block_size):
        # Each block size gets its own mixed geometry: block boundaries must fall inside sequences.
        add("block_size", str(b), _geometries(b, quick)["mixed"], block_size=b)
    for d in sorted(DTYPES, key=dtype_name):
        if d != dtype:
            add("dtype", dtype_name(d), mixed, dtype=d)


def _feature_attention_cases(
    add: _AddAttentionCase,
    caps: AttentionCapabilities,
    block_size: int,
    dtypes: list[torch.dtype],
    quick: bool,
) -> None:
    """Add the cases turning on one optional attention feature of the base case (sliding
    window, logit softcap, no preallocated output, FP8 KV cache). Windows, softcaps and the
    returned output run on the mixed batch in every dtype of `dtypes` (the declared ones): masks
    and output conversions are often written once per dtype."""
    geometries = _geometries(block_size, quick)
    mixed = geometries["mixed"]
    for w in QUICK_SLIDING_WINDOWS if quick else SLIDING_WINDOWS:
        for d in dtypes:
            add("sliding_window", f"{w}_{dtype_name(d)}", mixed, sliding_window=w, dtype=d)
        if not quick:
            add(
                "sliding_window",
                f"{w}_chunked",
                _geometries(block_size, quick)["long_chunked_prefill"],
                sliding_window=w,
            )
    for c in QUICK_SOFTCAPS if quick else SOFTCAPS:
        for d in dtypes:
            add("softcap", f"{c}_{dtype_name(d)}", mixed, logit_softcap=c, dtype=d)
    if not quick:
        add("softcap", "2.0_window5", mixed, logit_softcap=2.0, sliding_window=5)
    for d in dtypes:
        add("no_out", dtype_name(d), mixed, pass_out=False, dtype=d)
    for kv in FP8_KV_DTYPES:
        # Declared encodings run on several geometries; undeclared ones are one probe each.
        groups = (QUICK_FP8_GROUPS if quick else FP8_GROUPS) if kv in caps.kv_cache_dtypes else FP8_GROUPS[:1]
        for group in groups:
            add("fp8_kv_cache", f"{dtype_name(kv)}_{group}", geometries[group], kv_cache_dtype=kv)


def _sink_attention_cases(
    add: _AddAttentionCase,
    caps: AttentionCapabilities,
    block_size: int,
    dtypes: list[torch.dtype],
    quick: bool,
) -> None:
    """Add the `attention_sinks` cases of a backend declaring them (module docstring). The quick
    set keeps one: the mixed batch with a window of 37 keys, which the shorter sequences fit whole
    (full attention plus sink) and the longer ones do not (windowed attention plus sink)."""
    geometries = _geometries(block_size, quick)
    sinks: dict[str, Any] = {"attention_sinks": True}
    if caps.sliding_window:
        add("attention_sinks", "window37_mixed", geometries["mixed"], sliding_window=37, **sinks)
    elif quick:
        add("attention_sinks", "mixed", geometries["mixed"], **sinks)
    if quick:
        return
    for group in ("prefill", "decode", "chunked_prefill", "long_decode"):
        add("attention_sinks", group, geometries[group], **sinks)
    for d in dtypes:
        add("attention_sinks", f"mixed_{dtype_name(d)}", geometries["mixed"], dtype=d, **sinks)
    if caps.sliding_window:
        add("attention_sinks", "window5_mixed", geometries["mixed"], sliding_window=5, **sinks)
        chunked = geometries["long_chunked_prefill"]
        add("attention_sinks", "window37_long_chunked", chunked, sliding_window=37, **sinks)
    if caps.logit_softcap:  # the softcap applies to the scores, never to the sink
        add("attention_sinks", "softcap2.0_mixed", geometries["mixed"], logit_softcap=2.0, **sinks)
    fp8 = [kv for kv in FP8_KV_DTYPES if kv in caps.kv_cache_dtypes]
    if fp8:  # k_scale multiplies the scores, never the sink
        add(
            "attention_sinks",
            f"{dtype_name(fp8[0])}_mixed",
            geometries["mixed"],
            kv_cache_dtype=fp8[0],
            **sinks,
        )


ENGINE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes the engine serves models in
ENGINE_PREFILL_CHUNK = 8  # prompt tokens per step in the engine smoke check (chunked prefill)


@dataclass(frozen=True, slots=True)
class EngineCase:
    """A few greedy steps of a tiny random model whose attention runs on one backend, compared
    with the same model on cpu_reference (see `engine_check`)."""

    backend: str  # the attention backend's name
    dtype: torch.dtype  # the model's parameters, activations and KV cache
    head_size: int
    block_size: int
    prefill_chunk: int  # prompt tokens per step, within the backend's max_query_len
    seed: int

    @property
    def group(self) -> str:
        return "engine_smoke"

    @property
    def variant(self) -> str:
        return dtype_name(self.dtype)

    @property
    def case_id(self) -> str:
        return f"{self.group}[{self.variant}]"

    @property
    def description(self) -> str:
        return (
            f"greedy tokens of a tiny random Llama (heads {BASE_HEADS[0]}/{BASE_HEADS[1]}, head_size="
            f"{self.head_size}, block_size={self.block_size}, prompt chunks of {self.prefill_chunk}) in "
            f"{dtype_name(self.dtype)}, against cpu_reference"
        )


def engine_cases(
    backend: str, caps: AttentionCapabilities, platform_dtypes: Iterable[torch.dtype], *, seed: int = 0
) -> list[EngineCase]:
    """One engine smoke case per dtype the engine serves in that both the backend and its
    platform declare, at the backend's base head and block size. Pure."""
    head_size, block_size, _ = base_shape(caps)
    if head_size not in caps.head_sizes or block_size not in caps.block_sizes:
        return []  # nothing declared to build a model from; the attention cases report that
    chunk = min(ENGINE_PREFILL_CHUNK, caps.max_query_len or ENGINE_PREFILL_CHUNK)
    platform = set(platform_dtypes)
    return [
        EngineCase(backend, d, head_size, block_size, chunk, _seed(f"engine_smoke[{dtype_name(d)}]", seed))
        for d in ENGINE_DTYPES
        if d in caps.dtypes and d in platform
    ]


class CacheOp(enum.Enum):
    """The cache operation a `CacheOpCase` checks; swaps are split by direction."""

    RESHAPE_AND_CACHE = "reshape_and_cache"
    COPY_BLOCKS = "copy_blocks"
    SWAP_SAME_DEVICE = "swap_blocks_same_device"
    SWAP_TO_HOST = "swap_blocks_to_host"  # device -> CPU (swap out)
    SWAP_FROM_HOST = "swap_blocks_from_host"  # CPU -> device (swap in)


@dataclass(frozen=True, slots=True)
class CacheOpCase:
    """One call of a `CacheOps` method to compare bit for bit with the reference."""

    op: CacheOp
    variant: str
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    num_items: int  # tokens written (reshape_and_cache) or block pairs moved (copies, swaps)
    num_layers: int  # caches passed to copy_blocks; 1 otherwise
    strided_inputs: bool  # reshape_and_cache: key/value are slices of a fused qkv tensor
    seed: int
    kv_cache_dtype: torch.dtype | None = None  # an FP8 cache (scales FP8_KV_SCALES); None: `dtype`

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    @property
    def group(self) -> str:
        return self.op.value

    @property
    def case_id(self) -> str:
        return f"{self.group}[{self.variant}]"

    @property
    def description(self) -> str:
        return (
            f"{self.op.value}: items={self.num_items} layers={self.num_layers} kv_heads={self.num_kv_heads} "
            f"head_size={self.head_size} block_size={self.block_size} {dtype_name(self.dtype)}"
            + (" strided key/value" if self.strided_inputs else "")
            + (f" kv_cache={dtype_name(self.kv_cache_dtype)}" if self.kv_cache_dtype is not None else "")
        )


def cache_op_cases(
    dtypes: Iterable[torch.dtype],
    block_sizes: Iterable[int],
    *,
    quick: bool,
    seed: int = 0,
    kv_cache_dtypes: Iterable[torch.dtype] = (),  # FP8 caches the platform's backends declare
) -> list[CacheOpCase]:
    """Cache-op cases for a platform computing in `dtypes` whose backends use `block_sizes` and
    read `kv_cache_dtypes`. Cache ops declare no capabilities, so every case must pass. Pure."""
    dtype_list = sorted({d for d in dtypes if d in TOLERANCES}, key=dtype_name)
    sizes = sorted({b for b in block_sizes if b in BLOCK_SIZES}) or [16]
    base_block = 16 if 16 in sizes else sizes[0]
    base = CacheOpCase(
        op=CacheOp.RESHAPE_AND_CACHE,
        variant="",
        num_kv_heads=2,
        head_size=64,
        block_size=base_block,
        dtype=torch.float32,
        num_items=13,
        num_layers=1,
        strided_inputs=False,
        seed=0,
    )
    cases: list[CacheOpCase] = []

    def add(op: CacheOp, variant: str, **changes: Any) -> None:
        seed_ = _seed(f"{op.value}[{variant}]", seed)
        cases.append(replace(base, op=op, variant=variant, seed=seed_, **changes))

    for d in dtype_list:
        name = dtype_name(d)
        add(CacheOp.RESHAPE_AND_CACHE, name, dtype=d)
        add(CacheOp.COPY_BLOCKS, name, dtype=d, num_items=5, num_layers=2)
        for op in (CacheOp.SWAP_SAME_DEVICE, CacheOp.SWAP_TO_HOST, CacheOp.SWAP_FROM_HOST):
            add(op, name, dtype=d, num_items=4)
    d0 = dtype_list[0] if dtype_list else torch.float32
    _shape_cache_op_cases(add, d0, quick, [base_block] if quick else sizes)
    _fp8_cache_op_cases(add, dtype_list, kv_cache_dtypes, quick)
    return cases


# add(op, variant, **changes): appends a variant of the base case to the list.
_AddCacheOpCase = Callable[..., None]


def _shape_cache_op_cases(add: _AddCacheOpCase, d0: torch.dtype, quick: bool, block_list: list[int]) -> None:
    """Add the cases varying head size and block size in dtype `d0`: strided writes (and, in
    the full matrix, many-layer block copies) for each pair."""
    head_list = (64, 80) if quick else (64, 80, 128, 256)
    for h in head_list:
        for b in block_list:
            variant = f"{dtype_name(d0)}_h{h}_b{b}_strided"
            add(
                CacheOp.RESHAPE_AND_CACHE,
                variant,
                dtype=d0,
                head_size=h,
                block_size=b,
                strided_inputs=True,
                num_kv_heads=1 if h > 128 else 2,
            )
            if not quick:
                add(
                    CacheOp.COPY_BLOCKS,
                    f"{dtype_name(d0)}_h{h}_b{b}",
                    dtype=d0,
                    head_size=h,
                    block_size=b,
                    num_items=7,
                    num_layers=3,
                )


def _fp8_cache_op_cases(
    add: _AddCacheOpCase, dtype_list: list[torch.dtype], kv_cache_dtypes: Iterable[torch.dtype], quick: bool
) -> None:
    """Add the cases for each declared FP8 cache encoding: quantizing writes (from each model
    dtype in `dtype_list`, plain and strided), block copies and swaps."""
    fp8_sources = [d for d in (torch.bfloat16, torch.float16, torch.float32) if d in dtype_list]
    for kv in sorted(set(kv_cache_dtypes), key=dtype_name):
        kv_name = dtype_name(kv)
        d = fp8_sources[0] if fp8_sources else torch.float32
        for source in [d] if quick else fp8_sources:  # quantizing writes from each model dtype
            add(
                CacheOp.RESHAPE_AND_CACHE,
                f"{kv_name}_from_{dtype_name(source)}",
                dtype=source,
                kv_cache_dtype=kv,
            )
        add(
            CacheOp.RESHAPE_AND_CACHE,
            f"{kv_name}_from_{dtype_name(d)}_h80_strided",
            dtype=d,
            kv_cache_dtype=kv,
            head_size=80,
            strided_inputs=True,
        )
        add(CacheOp.COPY_BLOCKS, kv_name, dtype=d, kv_cache_dtype=kv, num_items=5, num_layers=2)
        swaps = (CacheOp.SWAP_SAME_DEVICE, CacheOp.SWAP_TO_HOST, CacheOp.SWAP_FROM_HOST)
        for op in swaps[2:] if quick else swaps:
            add(op, kv_name, dtype=d, kv_cache_dtype=kv, num_items=4)


@dataclass(frozen=True, slots=True)
class LoRACase:
    """One call of a platform's `LoRAKernel.op`, compared with the float64 torch formulation."""

    variant: str
    num_tokens: int  # rows of x and y
    num_slots: int  # adapter slots: lora_a / lora_b's first dimension
    rank: int  # R: the width of a slot's stacked A rows
    in_features: int  # K
    out_features: int  # N
    dtype: torch.dtype
    used_slots: int  # distinct slots the tokens use (the first ones of a shuffled order)
    base_tokens: bool  # some tokens have no adapter
    seed: int

    @property
    def group(self) -> str:
        return "lora"

    @property
    def case_id(self) -> str:
        return f"{self.group}[{self.variant}]"

    @property
    def description(self) -> str:
        return (
            f"lora: tokens={self.num_tokens} slots={self.used_slots}/{self.num_slots} rank={self.rank} "
            f"{self.in_features}->{self.out_features} {dtype_name(self.dtype)}"
            + (" with base-model tokens" if self.base_tokens else "")
        )


def lora_cases(dtypes: Iterable[torch.dtype], *, quick: bool, seed: int = 0) -> list[LoRACase]:
    """LoRA-kernel cases for a platform computing in `dtypes`. A `LoRAKernel` declares no
    capabilities: every case must pass. Pure."""
    dtype_list = sorted({d for d in dtypes if d in TOLERANCES and d != torch.float64}, key=dtype_name)
    d0 = dtype_list[0] if dtype_list else torch.float32
    base = LoRACase("", 12, 4, 48, 96, 80, d0, 3, True, 0)
    cases: list[LoRACase] = []

    def add(variant: str, **changes: Any) -> None:
        cases.append(replace(base, variant=variant, seed=_seed(f"lora[{variant}]", seed), **changes))

    for d in dtype_list:
        add(f"decode_{dtype_name(d)}", dtype=d)
    # Past 128 rows, where kernels tend to switch to larger row blocks.
    add("prefill", num_tokens=200, num_slots=2, rank=16, in_features=64, out_features=72, used_slots=2)
    add("one_adapter", num_tokens=20, num_slots=3, rank=8, used_slots=1, base_tokens=False)
    add("no_adapter", num_tokens=9, used_slots=0)
    if not quick:
        add("odd_widths", num_tokens=33, num_slots=3, rank=12, in_features=100, out_features=33, used_slots=3)
        add("one_token", num_tokens=1, num_slots=2, used_slots=1, base_tokens=False)
    return cases


class RouterPattern(enum.Enum):
    """How an `MoECase`'s router logits are drawn (see `moe_check`). Every pattern keeps distinct
    logits at least `moe_check.LOGIT_GAP / 2` apart, so that float32 and float64 routing agree;
    only `TIES` has equal logits, and those exactly equal."""

    SPREAD = "spread"  # each row a shuffled ladder: every expert about equally loaded
    IDLE = "idle"  # half the experts (the first and the last among them) never chosen
    ONE_EXPERT = "one_expert"  # one expert is every token's first choice
    TIES = "ties"  # equal logits straddling the top-k boundary (and whole rows of them)


MoEScoring = Literal["softmax_topk", "topk_softmax"]
MOE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the engine serves MoE models in
MOE_FP8_WEIGHT_DTYPE = torch.float8_e4m3fn  # the expert weight format `MoEKernel.weight_dtypes` may list
GPT_OSS_SWIGLU_LIMIT = 7.0


@dataclass(frozen=True, slots=True)
class MoECase:
    """One call of a platform's `MoEKernel.op`, compared with the float64 torch formulation."""

    group: str  # "idle_experts", "one_expert", "ties", "dtype", "fp8_weights", "scoring", ...
    variant: str
    num_tokens: int  # M: the step's tokens (rows of x and router_logits before any junk rows)
    num_experts: int  # E
    hidden_size: int  # H
    intermediate_size: int  # I: of one expert
    top_k: int
    scoring: MoEScoring
    renormalize: bool
    dtype: torch.dtype  # x, the output, and the expert weights unless `fp8_weights`
    pattern: RouterPattern
    seed: int
    activation: Literal["silu", "swiglu_limit"] = "silu"
    swiglu_limit: float | None = None  # "swiglu_limit" only
    biases: bool = False  # w13_bias and w2_bias
    fp8_weights: bool = False  # float8_e4m3fn experts with per-output-channel float32 scales
    junk_rows: int = 0  # rows of x and router_logits past the step's tokens, holding NaN and huge values

    @property
    def case_id(self) -> str:
        return f"{self.group}[{self.variant}]"

    @property
    def routing(self) -> MoERouting:
        return MoERouting(self.top_k, self.scoring, self.renormalize, self.activation, self.swiglu_limit)

    @property
    def weight_dtype(self) -> torch.dtype:
        return MOE_FP8_WEIGHT_DTYPE if self.fp8_weights else self.dtype

    @property
    def description(self) -> str:
        options = [f"{self.scoring}" + (" renormalized" if self.renormalize else "")]
        if self.activation == "swiglu_limit":
            options.append(f"swiglu_limit={self.swiglu_limit}")
        if self.biases:
            options.append("biases")
        if self.fp8_weights:
            options.append("float8_e4m3fn experts")
        if self.pattern is not RouterPattern.SPREAD:
            options.append(f"router: {self.pattern.value}")
        if self.junk_rows:
            options.append(f"+{self.junk_rows} junk rows")
        return (
            f"moe: tokens={self.num_tokens} experts={self.num_experts} top_k={self.top_k} "
            f"H={self.hidden_size} I={self.intermediate_size} {dtype_name(self.dtype)} " + " ".join(options)
        )


def moe_cases(
    dtypes: Iterable[torch.dtype],
    weight_dtypes: Iterable[torch.dtype],
    activations: Iterable[str],
    *,
    quick: bool,
    seed: int = 0,
) -> list[MoECase]:
    """MoE-kernel cases for a platform computing in `dtypes` whose `MoEKernel` declares
    `weight_dtypes` and `activations`. The FP8 and SwiGLU groups exist only when declared; every
    case must pass (an `MoEKernel` has no other capabilities to refuse a case with). float64 is
    left out: no model serves MoE layers in it, and the router logits are float32 anyway. Empty
    when the kernel declares no activation the suite knows. Pure."""
    dtype_list = sorted({d for d in dtypes if d in MOE_DTYPES}, key=dtype_name)
    acts = set(activations)
    if "silu" in acts:
        activation: Literal["silu", "swiglu_limit"] = "silu"
        limit = None
    elif "swiglu_limit" in acts:
        activation, limit = "swiglu_limit", GPT_OSS_SWIGLU_LIMIT
    else:
        return []
    d0 = next((d for d in BASE_DTYPE_PREFERENCE if d in dtype_list), torch.float32)
    base = MoECase(
        group="",
        variant="",
        num_tokens=24,
        num_experts=8,
        hidden_size=64,
        intermediate_size=64,
        top_k=2,
        scoring="softmax_topk",
        renormalize=True,
        dtype=d0,
        pattern=RouterPattern.SPREAD,
        seed=0,
        activation=activation,
        swiglu_limit=limit,
    )
    cases: list[MoECase] = []

    def add(group: str, variant: str, *, full_only: bool = False, **changes: Any) -> None:
        if full_only and quick:
            return
        seed_ = _seed(f"moe/{group}[{variant}]", seed)
        cases.append(replace(base, group=group, variant=variant, seed=seed_, **changes))

    _moe_routing_cases(add)
    for d in dtype_list or [d0]:
        add("dtype", dtype_name(d), dtype=d)
    if MOE_FP8_WEIGHT_DTYPE in set(weight_dtypes):
        # Quick: the dtype FP8 models are served in; full: every declared dtype under FP8 experts.
        fp8_dtypes = [d for d in (torch.bfloat16, torch.float16, torch.float32) if d in dtype_list] or [d0]
        for d in fp8_dtypes:
            add("fp8_weights", dtype_name(d), full_only=d != fp8_dtypes[0], dtype=d, fp8_weights=True)
    add("scoring", "softmax_topk_renormalized", num_experts=16, top_k=4)
    add("scoring", "softmax_topk", num_experts=16, top_k=4, renormalize=False)
    add("scoring", "topk_softmax", num_experts=16, top_k=4, scoring="topk_softmax", renormalize=False)
    # renormalize changes nothing for topk_softmax: a kernel that divides once more must still pass.
    add(
        "scoring",
        "topk_softmax_renormalized",
        full_only=True,
        num_experts=16,
        top_k=4,
        scoring="topk_softmax",
    )
    if "swiglu_limit" in acts:
        swiglu = {"activation": "swiglu_limit", "swiglu_limit": GPT_OSS_SWIGLU_LIMIT, "biases": True}
        for d in dtype_list or [d0]:
            # gpt-oss routes with topk_softmax; its expert matrices carry biases.
            add(
                "swiglu_bias",
                dtype_name(d),
                full_only=d != d0,
                dtype=d,
                scoring="topk_softmax",
                renormalize=False,
                **swiglu,
            )
        add("swiglu_bias", "top4_e16", full_only=True, num_experts=16, top_k=4, num_tokens=64, **swiglu)
    # Padding to a CUDA graph's batch size: 3 tokens in a graph of 16, 45 in one of 64.
    add("junk_rows", "decode", num_tokens=3, junk_rows=13)
    add("junk_rows", "prefill", num_tokens=45, junk_rows=19)
    add(
        "junk_rows",
        "topk_softmax_top4",
        full_only=True,
        num_tokens=10,
        junk_rows=22,
        num_experts=16,
        top_k=4,
        scoring="topk_softmax",
        renormalize=False,
    )
    for m, e, h, i, k, in_quick in MOE_TOKEN_COUNTS:
        add(
            "token_counts",
            f"{m}_e{e}_h{h}_i{i}_top{k}",
            full_only=not in_quick,
            num_tokens=m,
            num_experts=e,
            hidden_size=h,
            intermediate_size=i,
            top_k=k,
        )
    return cases


# (tokens, experts, hidden, intermediate, top_k, in the quick set): one token to a few hundred,
# across the 128 rows where kernels tend to change tiles, with dimensions that are not powers of two.
MOE_TOKEN_COUNTS = (
    (1, 4, 32, 32, 1, True),
    (2, 16, 64, 128, 4, False),
    (17, 6, 96, 48, 2, True),
    (64, 8, 128, 64, 2, False),
    (129, 16, 64, 96, 3, True),
    (300, 16, 128, 128, 4, True),
)


def _moe_routing_cases(add: Callable[..., None]) -> None:
    """Add the cases about which experts the router picks: experts left without tokens, every
    token on one expert, and ties."""
    # 3 tokens x 2 of 16 experts leave at least 10 idle and give the others 1 or 2 tokens.
    add("idle_experts", "few_tokens", num_tokens=3, num_experts=16)
    add("idle_experts", "half_idle", num_tokens=40, num_experts=16, pattern=RouterPattern.IDLE)
    add("idle_experts", "one_token_top4", full_only=True, num_tokens=1, num_experts=16, top_k=4)
    # 100 tokens on one of 8 experts: far past a balanced share, over several row tiles.
    add("one_expert", "top1", full_only=True, num_tokens=100, top_k=1, pattern=RouterPattern.ONE_EXPERT)
    add("one_expert", "top2", num_tokens=100, pattern=RouterPattern.ONE_EXPERT)
    add("ties", "softmax_topk", num_tokens=32, pattern=RouterPattern.TIES)
    add(
        "ties",
        "topk_softmax",
        num_tokens=32,
        pattern=RouterPattern.TIES,
        scoring="topk_softmax",
        renormalize=False,
    )
    add(
        "ties",
        "softmax_topk_top3_e16",
        full_only=True,
        num_tokens=32,
        num_experts=16,
        top_k=3,
        renormalize=False,
        pattern=RouterPattern.TIES,
    )
