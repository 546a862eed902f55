"""The attention-kernel sweep of start-up: run the attention backend over synthetic batches so that
every kernel variant a served step can launch is compiled before the first request.

What. `attention_warmup_batches` lists decode batches of every request count class and context
length that picks a different plan, the exact decode batch of every full graph to be captured (its
padded size at its sequence-length bucket, so every plan a graph records is compiled),
speculative and mixed batches with short queries, and prefills of every power-of-two length up to
the token budget. `warm_up_attention` runs them: nothing is written to the KV cache (padding slots)
and the backend only reads it.

The sweep is a list of batch shapes, not a list of kernels: it is what makes it backend-agnostic.
It covers each axis a backend plans on (request count, longest query, longest context) at the
values where the shipped backends change their plan and at the ones Triton specialises integer
arguments on (1, multiples of 16, others).

One call per compiled variant, not per batch shape. Most of the sweep's ~1,300 batch shapes (an
8B engine of 256 requests and 8,192 tokens) launch a kernel variant an earlier batch already
compiled: they differ only in values no compiler specialises on (request counts the kernels
declare `do_not_specialize`, context lengths within one split count, ...). Running every one cost
an H100 11 s on a warm kernel cache, 31 s on a cold one. So before each call `warm_up_attention`
asks the backend which variants it would launch (`AttentionBackend.compile_key`, plugin API 1.9,
host-only) and runs only the calls that need one no earlier call did: tens of calls. A backend
that names no keys gets every call, as before.

In parallel. Each of those calls compiles its new variants, one after another on one thread: on
an H200, 27 variants of an 8B engine took 22 s, a third of its start-up. Triton and NVRTC compile
in native code that releases Python's lock, so a backend that takes calls of different batches
from several threads at once (`AttentionBackend.concurrent_batches`, plugin API 1.11) gets them on
a pool of threads (`attention_warmup_threads`), and `warmup.build_step_forward` runs the whole
sweep beside the forward's compilation (`SweepInBackground`), which never calls the backend.

The sweep's metadata sits in memory as a served step's does (`warmup_metadata`): block-table rows
of the runner's width (its row stride is a kernel argument Triton specialises on) and
`query_start_loc`/`seq_lens` packed as the runner's upload packs them (their 16-byte alignment is
a specialisation too), all of it in one asynchronous upload instead of blocking copies per batch.
Metadata shaped otherwise compiles variants serving never launches and misses some it does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import AttentionBackend, CacheOps, KVCacheScales
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.graphs.cuda_graphs import default_graph_sizes
from pagedserve.worker.graphs.full_cuda_graphs import PADDING_SLOT

logger = logging.getLogger(__name__)

# Threads of the parallel sweep when the engine does not say: enough for the tens of variants of a
# large model, and half the host's CPUs at most, since the forward compiles beside them.
DEFAULT_MAX_THREADS = 8

# Request counts besides the graph ladder: Triton specialises integer arguments equal to 1 and
# divisible by 16, so counts on either side of multiples of 16 give the other variants.
_EXTRA_REQUEST_COUNTS = (3, 5, 15, 17, 31, 33)
# Short query lengths: speculative steps (drafts + 1) and the small chunks of mixed steps, where
# the Triton backend may still split the KV range (it does up to 16 query tokens).
_SHORT_QUERY_LENS = (2, 3, 4, 5, 8, 9, 16, 17)
# Past this many requests a short-query batch fills the GPU without splitting the KV range, so
# its context length no longer changes the plan: one context is enough there.
_MAX_SPLIT_REQUESTS = 16


@dataclass(frozen=True, slots=True)
class WarmupBatch:
    """One synthetic attention call: per-request query and sequence lengths."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def _powers_of_two(low: int, high: int) -> list[int]:
    """Powers of two in [low, high], plus `high` itself. Pure."""
    out = []
    p = 1
    while p <= high:
        if p >= low:
            out.append(p)
        p *= 2
    if high >= low and (not out or out[-1] != high):
        out.append(high)
    return out


def attention_warmup_batches(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    decode_graphs: Sequence[tuple[int, int]] = (),
) -> list[WarmupBatch]:
    """The sweep of batch shapes `warm_up_attention` runs (module docstring), every one within the
    engine's limits: at most `max_num_seqs` requests, `max_num_batched_tokens` tokens and
    `max_model_len` tokens per sequence. `decode_graphs` are the (padded size, bucket) of the full
    decode graphs to be captured (`FullDecodeGraphs.graphs`): each adds the decode batch its
    capture plans for (`size` requests, the longest `bucket` tokens), within `max_model_len`
    whatever the other limits, since the capture runs it. Pure; deterministic order, no
    duplicates."""
    if min(max_num_seqs, max_num_batched_tokens, max_model_len) < 1:
        raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
    for size, bucket in decode_graphs:
        if size < 1 or not 1 <= bucket <= max_model_len:
            raise ValueError(
                f"decode graph ({size} requests, max_seq_len {bucket}): needs >= 1 request and "
                f"1 <= max_seq_len <= max_model_len={max_model_len}"
            )
    max_reqs = min(max_num_seqs, max_num_batched_tokens)
    counts = sorted({*default_graph_sizes(max_reqs), *_EXTRA_REQUEST_COUNTS} & set(range(1, max_reqs + 1)))
    contexts = _powers_of_two(16, max_model_len) or [max_model_len]
    batches: dict[WarmupBatch, None] = {}  # insertion-ordered set

    def add(query_lens: tuple[int, ...], seq_lens: tuple[int, ...]) -> None:
        if sum(query_lens) <= max_num_batched_tokens and len(query_lens) <= max_num_seqs:
            batches[WarmupBatch(query_lens, seq_lens)] = None

    for r in counts:
        for s in contexts:  # decode: the longest context decides split counts and partitions
            add((1,) * r, (s,) + (1,) * (r - 1))
        for q in _SHORT_QUERY_LENS:
            if q > max_model_len:
                continue
            short_contexts = contexts if r <= _MAX_SPLIT_REQUESTS else [max(q, contexts[0])]
            for s in short_contexts:  # one short query among decodes (mixed and speculative steps)
                if q <= s <= max_model_len:
                    add((q,) + (1,) * (r - 1), (s,) + (1,) * (r - 1))
            add((q,) * r, (q,) * r)  # uniform speculative batches
    longest = min(max_num_batched_tokens, max_model_len)
    for q in sorted({*_powers_of_two(32, longest), longest}):
        add((q,), (q,))  # a whole prompt
        if 2 * q <= max_model_len:
            # Chunks after cached context, one and three: the runner uploads seq_lens right after
            # query_start_loc, 16-byte aligned for three requests and not for one, and the ragged
            # prefill kernel is specialised on that alignment.
            for r in (1, 3):
                add((q,) * r, (2 * q,) * r)
        for r in (2, 3, 16):
            add((q,) * r, (q,) * r)
    for size, bucket in decode_graphs:  # what each full-graph capture plans for
        batches[WarmupBatch((1,) * size, (bucket,) + (1,) * (size - 1))] = None
    return list(batches)


@dataclass(frozen=True, slots=True)
class AttentionWarmup:
    """What `warm_up_attention` ran."""

    num_calls: int  # backend calls of the sweep: batch shapes x layer layouts
    num_launched: int  # of those, the ones it ran
    # Distinct compiled variants the calls need (`AttentionBackend.compile_key`); None where the
    # backend names none, and every call ran.
    num_variants: int | None


def warmup_metadata(
    batches: Sequence[WarmupBatch], block_size: int, block_table_width: int, device: torch.device
) -> list[AttentionMetadata]:
    """Every batch's metadata, laid out the way the model runner lays out a step's
    (`ModelRunner._build_inputs`): block-table rows of the runner's width (the leading rows of one
    table, every entry block 0), and `query_start_loc` then `seq_lens` back to back in one int32
    upload, so that each batch's arrays have the addresses modulo 16 that a served step of the
    same shape has (Triton specialises some kernels on a pointer's 16-byte alignment and on the
    block table's row stride). One host -> device copy for the whole sweep, asynchronous out of
    pinned memory, where building each batch's metadata apart cost four blocking copies per batch.
    Allocates on `device`; the host buffer lives as long as the metadata (its `*_cpu` views)."""
    segments = []
    size = 0
    for batch in batches:
        segments.append(size)
        n = len(batch.query_lens)
        # Each batch starts where a fresh allocation of the runner's upload buffer would (512 B).
        size += -(-(2 * n + 1) // 128) * 128
    pinned = device.type == "cuda" and torch.cuda.is_available()
    host = torch.zeros(max(size, 1), dtype=torch.int32, pin_memory=pinned)
    host_np = host.numpy()
    for batch, start in zip(batches, segments, strict=True):
        q = np.asarray(batch.query_lens, dtype=np.int32)
        s = np.asarray(batch.seq_lens, dtype=np.int32)
        if q.shape != s.shape or not q.size or (q < 1).any() or (q > s).any():
            raise ValueError(f"{batch}: every request needs 1 <= query_len <= seq_len")
        if (-(-s // block_size) > block_table_width).any():
            raise ValueError(f"{batch}: longer than a block table of {block_table_width} blocks holds")
        n = q.size
        np.cumsum(q, out=host_np[start + 1 : start + n + 1])
        host_np[start + n + 1 : start + 2 * n + 1] = s
    dev = host.to(device, non_blocking=True) if device.type != "cpu" else host
    max_reqs = max(len(b.query_lens) for b in batches)
    table = torch.zeros((max_reqs, block_table_width), dtype=torch.int32, device=device)
    slots = torch.full((max(b.num_tokens for b in batches),), PADDING_SLOT, dtype=torch.int64, device=device)
    out = []
    for batch, start in zip(batches, segments, strict=True):
        n, tokens = len(batch.query_lens), batch.num_tokens
        qsl, seq = slice(start, start + n + 1), slice(start + n + 1, start + 2 * n + 1)
        out.append(
            AttentionMetadata(
                num_reqs=n,
                num_actual_tokens=tokens,
                max_query_len=max(batch.query_lens),
                max_seq_len=max(batch.seq_lens),
                query_start_loc=dev[qsl],
                seq_lens=dev[seq],
                block_table=table[:n],
                slot_mapping=slots[:tokens],
                query_start_loc_cpu=host[qsl],
                seq_lens_cpu=host[seq],
            )
        )
    return out


def attention_warmup_threads(requested: int | None, backend: AttentionBackend, cpu_count: int | None) -> int:
    """Threads the sweep runs its calls on: `requested` (`EngineArgs.attention_warmup_threads`)
    when the backend takes concurrent batches, else 1; None picks min(`DEFAULT_MAX_THREADS`, half
    the CPUs). A request the backend cannot honour is logged. Pure but for the log."""
    if requested is not None and requested < 1:
        raise ValueError(
            f"attention_warmup_threads={requested} must be >= 1 (1 compiles one variant at a time)"
        )
    if not backend.concurrent_batches:
        if requested is not None and requested > 1:
            logger.warning(
                "attention_warmup_threads=%d has no effect: the %s attention backend does not declare "
                "concurrent_batches (plugin API 1.11), so its kernels compile one at a time",
                requested,
                backend.name,
            )
        return 1
    if requested is not None:
        return requested
    return max(1, min(DEFAULT_MAX_THREADS, (cpu_count or 2) // 2))


def thread_on(device: torch.device) -> Callable[[], None]:
    """A thread initializer that makes `device` the new thread's current device: a new thread
    starts on device 0 whatever its parent's. An index-less "cuda" is the caller's current device,
    read now, on the caller's thread."""
    if device.type != "cuda":
        return lambda: None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return lambda: torch.cuda.set_device(index)


@dataclass(frozen=True, slots=True)
class _BatchCalls:
    """The sweep's calls for one batch, in layer-layout order: they share its metadata, so one
    thread runs them."""

    query: torch.Tensor  # [num_tokens, num_q_heads, head_size]
    metadata: AttentionMetadata
    options: tuple[dict[str, Any], ...]  # `forward`'s keyword arguments, one call each


def _run_calls(
    run: Callable[[_BatchCalls], None], work: Sequence[_BatchCalls], threads: int, device: torch.device
) -> None:
    """`run` on every item: in order on this thread, or the first here (it builds what a backend
    makes once: kernel binders, loaders) and the rest on `threads` threads, each on `device`."""
    progress = tqdm(total=len(work), desc="attention kernels", disable=None)
    try:
        if threads <= 1 or len(work) <= 2:
            for item in work:
                run(item)
                progress.update()
            return
        run(work[0])
        progress.update()

        def one(item: _BatchCalls) -> None:
            run(item)
            progress.update()

        on_device = thread_on(device)
        with ThreadPoolExecutor(threads, thread_name_prefix="attention-sweep", initializer=on_device) as pool:
            for _ in pool.map(one, work[1:]):  # re-raises the first failure
                pass
    finally:
        progress.close()


def warm_up_attention(
    backend: AttentionBackend,
    cache_ops: CacheOps,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size], one layer's
    spec: ModelSpec,
    batches: Sequence[WarmupBatch],
    kv_scales: KVCacheScales | None = None,  # the layer's, exactly when the cache is FP8
    *,
    new_kv_reads: bool = False,  # the backend takes the step's new keys and values (API 1.7)
    block_table_width: int | None = None,  # the runner's (max_blocks_per_req); None: the sweep's longest
    threads: int = 1,  # > 1 only for a backend that declares `concurrent_batches`
) -> AttentionWarmup:
    """Run `backend.forward` on every batch and distinct (window, softcap) of the model's layers
    whose compiled variants (`backend.compile_key`, asked first for every call, host-only) are not
    all among those of the calls before it; on every one when the backend names no keys. With
    keys and `threads` > 1 the batches' calls run on that many threads (one batch's calls on one).
    Every request's block table points at block 0, and the cache write runs once per token count
    class with padding slots when the cache ops skip them. With `new_kv_reads` (and an
    unquantized cache, as in `attention.layer.attend`) every call gets new keys and values too, so
    the kernels that read them compile here. A model with attention sinks (`spec.attention_sinks`)
    gets `sinks=` on every call, as its layers pass them, so the sink variants compile here. Reads
    the KV cache, writes nothing in it. Slow on a cold kernel cache (each new variant compiles)."""
    if threads > 1 and not backend.concurrent_batches:
        raise ValueError(
            f"threads={threads}: the {backend.name} attention backend does not declare concurrent_batches"
        )
    device = kv_cache.device
    block_size = kv_cache.shape[2]
    max_tokens = max(b.num_tokens for b in batches)
    width = block_table_width or max(-(-max(b.seq_lens) // block_size) for b in batches)
    # Queries, keys and values have the model's dtype; an FP8 cache only stores them narrower.
    query = torch.zeros((max_tokens, spec.num_q_heads, spec.head_size), dtype=spec.dtype, device=device)
    # Plugins of API 1.0 never see `kv_scales`: they declare no FP8 cache (`attention.layer`).
    scales = {} if kv_scales is None else {"kv_scales": kv_scales}
    # Nor `sinks` (API 1.13) unless the model has them: only a declaring backend serves such a model.
    sinks = (
        torch.zeros(spec.num_q_heads, dtype=torch.float32, device=device) if spec.attention_sinks else None
    )
    # As in `attention.layer.attend`: new keys and values go with an unquantized cache only.
    new_kv_shape = (2, max_tokens, spec.num_kv_heads, spec.head_size)
    new_kv = (
        torch.zeros(new_kv_shape, dtype=spec.dtype, device=device)
        if new_kv_reads and kv_scales is None
        else None
    )
    out = torch.empty_like(query)
    layouts = sorted({(w, spec.logit_softcap) for w in spec.sliding_windows}, key=str)
    scale = spec.head_size**-0.5
    seen: set[Hashable] = set()
    keyed = True  # until the backend names no key: then every later call runs
    work: list[_BatchCalls] = []
    metadata = warmup_metadata(batches, block_size, width, device)
    for batch, md in zip(batches, metadata, strict=True):
        n = batch.num_tokens
        extra: dict[str, Any] = dict(scales)
        if new_kv is not None:
            extra.update(new_key=new_kv[0, :n], new_value=new_kv[1, :n])
        if sinks is not None:
            extra["sinks"] = sinks
        calls = []
        for window, softcap in layouts:
            options = dict(scale=scale, sliding_window=window, logit_softcap=softcap, out=out[:n], **extra)
            variants = backend.compile_key(query[:n], kv_cache, md, **options) if keyed else None
            if variants is None:
                keyed = False
            elif variants <= seen:
                continue  # everything it would launch is compiled by an earlier call
            else:
                seen |= variants
            calls.append(options)
        if calls:
            work.append(_BatchCalls(query[:n], md, tuple(calls)))

    def run(item: _BatchCalls) -> None:
        for options in item.options:
            backend.forward(item.query, kv_cache, item.metadata, **options)

    # Without keys two threads could compile one variant twice; it stays on one thread.
    _run_calls(run, work, threads if keyed else 1, device)
    if cache_ops.skips_negative_slots:
        kv = torch.zeros((max_tokens, 2, spec.num_kv_heads, spec.head_size), dtype=spec.dtype, device=device)
        for n in sorted({1, 2, 16, 17, max_tokens} & set(range(1, max_tokens + 1))):
            slots = torch.full((n,), PADDING_SLOT, dtype=torch.int64, device=device)
            cache_ops.reshape_and_cache(kv[:n, 0], kv[:n, 1], kv_cache, slots, **scales)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    launched = sum(len(item.options) for item in work)
    return AttentionWarmup(len(batches) * len(layouts), launched, len(seen) if keyed else None)


class SweepInBackground:
    """A sweep (`sweep`, a call of `warm_up_attention`) run on a thread of its own from `start` on,
    so the forward compiles meanwhile on the caller's thread; `finish` waits for it. Without
    `start`, `finish` runs it on the caller's thread, after whatever came before. Either way
    `finish` returns its result and the seconds the caller spent in it (`waited_s`) beside those
    it ran while the caller did something else (`beside_s`)."""

    def __init__(self, sweep: Callable[[], AttentionWarmup], device: torch.device) -> None:
        self._sweep = sweep
        self._device = device
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[tuple[AttentionWarmup, float, float]] | None = None

    def _timed(self) -> tuple[AttentionWarmup, float, float]:
        start = time.perf_counter()
        result = self._sweep()
        return result, start, time.perf_counter()

    def start(self) -> None:
        """Start the sweep on its own thread. Call at most once."""
        if self._future is not None:
            raise RuntimeError("the attention sweep has started already")
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="attention-sweep-main", initializer=thread_on(self._device)
        )
        self._future = self._pool.submit(self._timed)

    def finish(self) -> tuple[AttentionWarmup, float, float]:
        """(result, waited_s, beside_s): run or wait for the sweep; re-raises its failure. Also
        right after a failure on the caller's thread: a sweep must not launch kernels while the
        engine tears down."""
        if self._future is None:
            result, start, end = self._timed()
            return result, end - start, 0.0
        waiting = time.perf_counter()
        try:
            result, start, end = self._future.result()
        finally:
            assert self._pool is not None
            self._pool.shutdown()
        waited = max(0.0, end - max(waiting, start))
        return result, waited, (end - start) - waited
