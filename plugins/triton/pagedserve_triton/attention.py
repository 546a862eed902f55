"""`TritonUnifiedAttentionBackend`: the thin host wrapper around `unified_attention`'s kernels.

It checks the layout contract of `pagedserve.platforms.api` (shapes, dtypes, devices, unit stride of
the last dimension), picks the 2D or 3D kernel with `choose_split`, reads launch parameters from
the tuned configs (once per shape class) and launches. It never syncs with the device: every
decision uses host-side metadata (`num_reqs`, `max_query_len`, `max_seq_len`, `num_actual_tokens`).
All of that is done once per step (per metadata object and layout) and reused by the step's other
layers, which only check their tensors' layout and launch (`launch_params.CachedLaunch`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
import triton

from pagedserve.platforms.api import (
    IDENTITY_GRID_ORDER,
    AttentionCapabilities,
    AttentionLayerShape,
    GridOrder,
    KVCacheScales,
)
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.tuned_configs import TunedConfigs
from pagedserve_triton.capabilities import UNIFIED_ATTENTION_CAPABILITIES
from pagedserve_triton.cascade_backend import TritonCascadeBackend
from pagedserve_triton.compile_keys import StandIn
from pagedserve_triton.fp8_widen import bit_widening
from pagedserve_triton.interpreter import INTERPRETED
from pagedserve_triton.launch_params import (
    AttentionLaunchConfig,
    CachedLaunch,
    LaunchParams,
    RaggedPrefillLaunchConfig,
    device_name_of,
    warp_specialize_supported,
)
from pagedserve_triton.programmatic_launch import launch_options, programmatic_launch_supported
from pagedserve_triton.ragged_prefill import MIN_QUERY_LEN as RAGGED_MIN_QUERY_LEN
from pagedserve_triton.ragged_prefill import (
    RaggedPrefillLaunch,
    layout_key,
    ragged_prefill_variant,
    unsupported_reason,
)
from pagedserve_triton.unified_attention import (
    LOG2E,
    reduce_segments_kernel,
    unified_attention_2d_kernel,
    unified_attention_3d_kernel,
)

# 3D-vs-2D heuristic constants (see `choose_split`).
MAX_QUERY_LEN_3D = 16  # longer queries have query-block parallelism, and partials grow with tokens
# Below ~64 keys a split costs more in partial writes + reduction than it saves. Measured on H100
# (bf16, 32/8 heads, head 128): one decode of 512 keys takes 21 us in 2D, 6.5 us with 8 splits,
# 5.7 us with 16; 2048 keys: 78 us in 2D, 8.1 us with 32 splits (benchmarks/kernel_benchmarks/attention.py).
# The split count rounds the context's 64-key chunks up to a power of two (a trailing split may
# get part of a chunk or nothing): one decode of 576 keys, in 32 layers' CUDA graph, took 8.6 us
# per layer with 16 splits against 10.1 with 8 (H100, bf16; 8.0 against 9.8 over an FP8 cache).
MIN_KEYS_PER_SPLIT = 64
MAX_SPLITS = 64
TARGET_PROGRAMS_PER_SM = 2  # enough resident programs per SM to hide memory latency


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """Which kernel runs and over how many KV splits (1 for the 2D kernel, a power of two >= 2 for
    the 3D kernel)."""

    kind: Literal["2d", "3d"]
    num_splits: int


PLAN_2D = SplitPlan("2d", 1)


def choose_split(
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_kv_heads: int,
    num_sms: int,
    *,
    block_q: int = 1,
    tile_size: int = 16,
    max_query_len_3d: int = MAX_QUERY_LEN_3D,
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
    max_splits: int = MAX_SPLITS,
    target_programs_per_sm: int = TARGET_PROGRAMS_PER_SM,
) -> SplitPlan:
    """Pick the 2D or the split-KV 3D kernel from batch geometry. Pure.

    The 2D grid has about `tiles = num_reqs * ceil(max_query_len / block_q) * num_kv_heads` busy
    programs. When that already gives every SM a tile, splitting only adds partial writes and a
    reduction, so the 2D kernel runs. Otherwise (small batches of decodes or short speculative
    queries) the 3D kernel splits each tile's KV range into a power-of-two number of splits, enough
    for `TARGET_PROGRAMS_PER_SM` programs per SM but no more than the context has chunks of
    `MIN_KEYS_PER_SPLIT` keys (or of one `tile_size` KV tile of the 3D kernel, if longer), rounded
    up to a power of two, and at most `MAX_SPLITS`. Queries
    longer than `MAX_QUERY_LEN_3D` always use 2D: their query blocks are parallel already and the
    float32 partials would grow with them. The keyword thresholds default to these constants; a
    platform with thresholds of its own (the rocm plugin's tables) passes them."""
    if num_reqs <= 0 or max_query_len > max_query_len_3d:
        return PLAN_2D
    tiles = num_reqs * triton.cdiv(max_query_len, block_q) * num_kv_heads
    if tiles >= num_sms:
        return PLAN_2D
    chunk = max(min_keys_per_split, tile_size)
    if max_seq_len < 2 * chunk:  # not two whole chunks: too short to split
        return PLAN_2D
    chunks = triton.cdiv(max_seq_len, chunk)
    wanted = triton.next_power_of_2(triton.cdiv(target_programs_per_sm * num_sms, tiles))
    num_splits = min(wanted, triton.next_power_of_2(chunks), max_splits)
    if num_splits < 2:
        return PLAN_2D
    return SplitPlan("3d", num_splits)


@dataclass(frozen=True, slots=True)
class _LayerLaunch:
    """The launches of one layout within one step (`attention` is None when the step has no
    tokens or runs on the ragged prefill kernel; `reduce` is the 3D plan's reduction, None for the
    2D kernel). `ragged` is the ragged prefill kernel's launch, `ragged_config` its config and
    whether some request has cached context (set alone when only planned: `compile_key`)."""

    plan: SplitPlan
    attention: CachedLaunch | None
    reduce: CachedLaunch | None
    ragged: RaggedPrefillLaunch | None = None
    ragged_config: tuple[RaggedPrefillLaunchConfig, bool] | None = None


@dataclass(frozen=True, slots=True)
class _StepCache:
    """What `forward` built for the layers of the step described by `metadata`. Holding the
    metadata keeps its identity from being reused by a later step's object."""

    metadata: AttentionMetadata
    layers: dict[tuple[object, ...], _LayerLaunch]  # layout key -> launches


# Layers of one step with different layouts (e.g. alternating sliding windows) each get an entry;
# a step with more distinct layouts than this starts over rather than grow.
MAX_LAYOUTS_PER_STEP = 8


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"TritonUnifiedAttentionBackend: {message}")


class TritonUnifiedAttentionBackend(TritonCascadeBackend):
    """Unified paged attention for V1 batches on any GPU Triton targets (one launch per layer for
    the 2D kernel, two for the 3D kernel plus its reduction).

    An instance keeps the current step's launches and split buffers, so the layers of one step must
    run from one thread, on one stream. Calls of different steps (distinct metadata objects) may run
    on different threads at once (`concurrent_batches`): each holds its own step's plan and buffers
    in a local, and the instance's caches only lose an entry when two threads fill them."""

    name: ClassVar[str] = "triton_unified"
    # API 1.16: cascade steps on `cascade_kernels` (the cuda platform's CUDA kernels lack them,
    # so it declares the unified kernel's capabilities without this).
    capabilities: ClassVar[AttentionCapabilities] = replace(
        UNIFIED_ATTENTION_CAPABILITIES, cascade_attention=True
    )
    # Grids and scalars come from host metadata only; padding requests (query length 0) end in
    # their first program, a split past a sequence's end writes an empty partial, and the
    # reduction of a padding token writes only that token's row.
    supports_full_cuda_graph: ClassVar[bool] = True
    # The 2D and 3D grids count `num_actual_tokens // BLOCK_Q + num_reqs` query blocks and each
    # program finds its request in `query_start_loc`, so a grid sized for more tokens and requests
    # only adds programs that end at once; `max_query_len` picks the tile config and the split plan,
    # both correct for shorter queries. Only the ragged prefill kernel plans from host query
    # lengths, and it runs only when the call passes new keys and values (never in a full graph).
    supports_full_cuda_graph_mixed: ClassVar[bool] = True
    # `forward` reads `self._step` once into a local and plans a new step object for new metadata,
    # so two threads with different batches never share a plan or a split buffer; Triton's own
    # kernel cache takes concurrent compiles of different variants.
    concurrent_batches: ClassVar[bool] = True

    def __init__(
        self,
        *,
        tuned_configs: TunedConfigs | None = None,
        grid_order: GridOrder = IDENTITY_GRID_ORDER,
        num_splits: int | None = None,
    ) -> None:
        """`tuned_configs` is the platform's (`LoadedPlatform.tuned_configs()`); None reads this
        plugin's own files. `grid_order` comes from the `pagedserve_grid_order` hook. `num_splits`
        overrides the heuristic: 1 forces the 2D kernel, a power of two >= 2 the 3D kernel
        (tests, benchmarks)."""
        if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
            raise ValueError(f"num_splits={num_splits} must be None (heuristic) or a power of two >= 1")
        if grid_order.num_groups < 1:
            raise ValueError(
                f"grid order {grid_order.name!r} has num_groups={grid_order.num_groups}; need >= 1"
            )
        self._launch_params = LaunchParams(tuned_configs)
        self._grid_order = grid_order
        self._num_splits = num_splits
        self._num_sms: dict[torch.device, int] = {}
        self._step: _StepCache | None = None
        self._dependent_max_tokens = 0  # `enable_programmatic_launch`
        self._new_kv_reads = False  # `enable_new_kv_reads`

    def _cascade_launch_params(self) -> LaunchParams:
        """The cascade kernels read the same tuned configs (and cache) as the unified kernels."""
        return self._launch_params

    def enable_programmatic_launch(self, max_tokens: int) -> bool:
        """Launch the kernels of steps of at most `max_tokens` tokens (the 2D or 3D kernel and the
        reduction) as programmatic dependent launches on devices that have them
        (`programmatic_launch`): each waits on the device for the previous kernel before its first
        memory access, so its grid is set up while that kernel drains. Returns True (devices
        without them launch plainly). Mutates the instance."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens} must be >= 0 (0 turns programmatic launches off)")
        self._dependent_max_tokens = max_tokens
        self._step = None  # launches built before were planned without
        return True

    def enable_new_kv_reads(self) -> bool:
        """Take the step's new keys and values beside the cache: batches of prompt chunks (every
        query at least `ragged_prefill.MIN_QUERY_LEN` tokens, 16-bit cache, no window or softcap)
        then run on NVIDIA sm_90+ on `ragged_prefill_kernel`, which streams them with TMA. Returns
        True. Mutates the instance."""
        self._new_kv_reads = True
        self._step = None
        return True

    def _sm_count(self, device: torch.device) -> int:
        count = self._num_sms.get(device)
        if count is None:
            # Interpreter runs on CPU tensors: a single "SM" makes the heuristic choose 2D.
            count = (
                torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            )
            self._num_sms[device] = count
        return count

    def _check_layout(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None,
    ) -> None:
        _require(
            query.dim() == 3, f"query must be [num_tokens, num_q_heads, head_size], got {tuple(query.shape)}"
        )
        _require(
            kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size] (NHD), "
            f"got {tuple(kv_cache.shape)}",
        )
        _require(
            kv_cache.shape[4] == query.shape[2],
            f"head_size differs: query {query.shape[2]}, kv_cache {kv_cache.shape[4]}",
        )
        _require(
            query.shape[1] % kv_cache.shape[3] == 0,
            f"num_q_heads={query.shape[1]} is not a multiple of num_kv_heads={kv_cache.shape[3]}",
        )
        # The cache's dtype (the query's, or a declared FP8 one) is a capability: `check_call`.
        _require(
            query.stride(-1) == 1 and kv_cache.stride(-1) == 1,
            "query and kv_cache need a unit-stride last dim",
        )
        _require(kv_cache.device == query.device, f"kv_cache on {kv_cache.device}, query on {query.device}")
        if out is not None:
            _require(
                out.shape == query.shape and out.dtype == query.dtype and out.device == query.device,
                f"out must match query ({tuple(query.shape)}, {query.dtype}, {query.device}), "
                f"got ({tuple(out.shape)}, {out.dtype}, {out.device})",
            )
            _require(out.stride(-1) == 1, "out needs a unit-stride last dim")
        for field in ("query_start_loc", "seq_lens", "block_table"):
            t: torch.Tensor = getattr(metadata, field)
            _require(
                t.dtype == torch.int32 and t.device == query.device,
                f"metadata.{field} must be int32 on {query.device}, got {t.dtype} on {t.device}",
            )
        _require(
            metadata.block_table.dim() == 2, "metadata.block_table must be [num_reqs, max_blocks_per_req]"
        )
        _require(metadata.block_table.stride(-1) == 1, "metadata.block_table needs a unit-stride last dim")
        _require(
            metadata.num_actual_tokens <= query.shape[0],
            f"metadata has {metadata.num_actual_tokens} tokens but query only {query.shape[0]} rows",
        )
        _require(
            query.device.type != "cpu" or INTERPRETED,
            "CPU tensors run only under TRITON_INTERPRET=1 (set before importing triton); use GPU tensors",
        )

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_size]
        kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
        new_key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]
        new_value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]
        sinks: torch.Tensor | None = None,  # [num_q_heads] float32: attention sinks (API 1.13)
    ) -> torch.Tensor:
        """Attention output [num_tokens, num_q_heads, head_size]; rows past num_actual_tokens are
        left as they were in `out` (uninitialised when `out` is None). Writes only `out` (and the
        instance's step cache). With `new_key` and `new_value` (after `enable_new_kv_reads`), a
        batch of prompt chunks reads its new tokens' keys and values from them. With `sinks`, each
        head's sink logit joins its rows' softmax (`unified_attention`); such a layer never runs
        on the ragged prefill kernel, which has no sink.

        Every layer of a step passes the same metadata object, so the first call for a metadata
        object and layout checks everything and builds the launches (plan, tuned configs, grid,
        fixed arguments, split buffers); the step's other layers with that layout reuse them and
        pass only their own query, cache, output and sinks. A layout is every shape, stride, dtype
        and device of `query`, `kv_cache`, `out` and `sinks`, plus the three options: anything else
        is new and checked in full."""
        new_kv = self._new_kv(metadata, new_key, new_value)
        key = (
            query.shape,
            query.stride(),
            query.dtype,
            query.device,
            kv_cache.shape,
            kv_cache.stride(),
            kv_cache.dtype,
            kv_cache.device,
            None if out is None else (out.shape, out.stride(), out.dtype, out.device),
            scale,
            sliding_window,
            logit_softcap,
            kv_scales,
            None if new_kv is None else tuple(layout_key(t) for t in (query, *new_kv)),
            None if sinks is None else (sinks.shape, sinks.stride(), sinks.dtype, sinks.device),
        )
        step = self._step
        if step is None or step.metadata is not metadata:
            # Dropping the previous step frees its split buffers: only the current step is held.
            step = self._step = _StepCache(metadata, {})
        layer = step.layers.get(key)
        if layer is None:
            layer = self._build_layer(
                query, kv_cache, metadata, out, scale, sliding_window, logit_softcap, kv_scales, new_kv,
                sinks=sinks,
            )  # fmt: skip
            if len(step.layers) >= MAX_LAYOUTS_PER_STEP:
                step.layers.clear()
            step.layers[key] = layer
        if out is None:
            # Contiguous, as `_build_layer` assumed for the output strides.
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if layer.ragged is not None and new_kv is not None:
            layer.ragged(out, query, new_kv[0], new_kv[1], kv_cache)
            return out
        if layer.attention is None:
            return out
        # Each layer has sinks of its own: a per-call argument, of the 2D kernel or the reduction.
        per_layer = () if sinks is None else (sinks,)
        if layer.reduce is None:
            layer.attention(out, query, kv_cache, *per_layer)
        else:
            layer.attention(query, kv_cache)
            layer.reduce(out, *per_layer)
        return out

    def _new_kv(
        self, metadata: AttentionMetadata, new_key: torch.Tensor | None, new_value: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's new keys and values where the ragged prefill kernel may read them. Pure."""
        # Decode and mixed steps (some query shorter than the ragged kernel takes; on average
        # shorter, then surely) skip the ragged path's checks altogether.
        prompt_chunks = metadata.num_actual_tokens >= RAGGED_MIN_QUERY_LEN * metadata.num_reqs
        if self._new_kv_reads and prompt_chunks and new_key is not None and new_value is not None:
            return new_key, new_value
        return None

    def compile_key(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_size]
        kv_scales: KVCacheScales | None = None,
        new_key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]
        new_value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]
        sinks: torch.Tensor | None = None,  # [num_q_heads] float32
    ) -> frozenset[Hashable] | None:
        """API 1.9: the compiled Triton variants `forward` would launch for this call
        (`compile_keys.launch_variant` of each launch: the 2D kernel, the 3D kernel and its
        reduction, or the ragged prefill kernel). Checks the call and plans it as `forward` does,
        from the same code, but allocates nothing on the device and launches nothing; the split
        and tile buffers `forward` would allocate count as fresh, aligned tensors. None where this
        Triton cannot say, and for a subclass that launches differently (overrides `forward`
        without overriding this). Mutates only the launch-parameter cache."""
        if type(self).forward is not TritonUnifiedAttentionBackend.forward:
            return None
        new_kv = self._new_kv(metadata, new_key, new_value)
        layer = self._build_layer(
            query, kv_cache, metadata, out, scale, sliding_window, logit_softcap, kv_scales, new_kv,
            plan_only=True, sinks=sinks,
        )  # fmt: skip
        # `forward` allocates a missing `out` contiguous.
        out_arg: torch.Tensor | StandIn = out if out is not None else StandIn(query.dtype, query.shape)
        per_layer = () if sinks is None else (sinks,)
        variants: list[Hashable | None] = []
        if layer.ragged_config is not None and new_kv is not None:
            config, has_context = layer.ragged_config
            variants.append(
                ragged_prefill_variant(
                    out_arg, query, *new_kv, kv_cache, metadata, config, scale=scale, has_context=has_context
                )
            )
        elif layer.attention is not None and layer.reduce is None:
            variants.append(layer.attention.variant(out_arg, query, kv_cache, *per_layer))
        elif layer.attention is not None and layer.reduce is not None:
            variants.append(layer.attention.variant(query, kv_cache))
            variants.append(layer.reduce.variant(out_arg, *per_layer))
        if any(v is None for v in variants):
            return None
        return frozenset(v for v in variants if v is not None)

    def full_graph_key(self, metadata: AttentionMetadata, layer: AttentionLayerShape) -> SplitPlan:
        """The plan `forward` makes for `metadata` on a layer of shape `layer`: the split count is
        the only launch choice that depends on `max_seq_len` (grids, tile configs and scalar
        arguments follow from the request and token counts, `max_query_len` and the layout).
        Host-only; mutates only the launch-parameter cache."""
        if metadata.num_actual_tokens == 0 or metadata.num_reqs == 0:
            return PLAN_2D  # `forward` launches nothing
        return self.plan(
            metadata,
            num_q_heads=layer.num_q_heads,
            num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size,
            block_size=layer.block_size,
            dtype=layer.dtype,
            device=layer.device,
        )

    def reset_step_cache(self) -> None:
        """Forget the cached step, so the next call checks and plans from scratch (benchmarks of
        the uncached path). Mutates the instance."""
        self._step = None

    def _build_layer(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        out: torch.Tensor | None,  # [num_tokens, num_q_heads, head_size]
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        kv_scales: KVCacheScales | None,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None,  # this step's keys and values
        *,
        plan_only: bool = False,
        sinks: torch.Tensor | None = None,  # [num_q_heads] float32: only its layout is read here
    ) -> _LayerLaunch:
        """Check the whole call and build its launches. Allocates the 3D plan's split buffers and
        uploads the ragged kernel's tile plan, unless `plan_only` (`compile_key`: `StandIn`s take
        the buffers' place, the ragged launch is left at its config; such launches must never
        run). With `sinks` the 2D kernel (or the 3D plan's reduction) takes them per call.
        Mutates only the launch-parameter cache."""
        # The layout first: a wrong layout (an HND cache, say) reads as wrong capabilities otherwise.
        self._check_layout(query, kv_cache, metadata, out)
        self.check_call(
            query,
            kv_cache,
            scale=scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            kv_scales=kv_scales,
            sinks=sinks,
        )
        # An FP8 cache's scales: k_scale folds into the softmax scale, v_scale scales the output.
        k_scale, v_scale = (kv_scales.k_scale, kv_scales.v_scale) if kv_scales is not None else (1.0, 1.0)
        _, num_q_heads, head_size = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        num_tokens = metadata.num_actual_tokens
        if num_tokens == 0 or metadata.num_reqs == 0:
            return _LayerLaunch(PLAN_2D, None, None)
        ragged_config = (
            self._ragged_config(query, kv_cache, metadata, new_kv, sliding_window, logit_softcap)
            if new_kv is not None and sinks is None  # the ragged prefill kernel has no sink
            else None
        )
        if ragged_config is not None and plan_only:
            return _LayerLaunch(PLAN_2D, None, None, ragged_config=ragged_config)
        if ragged_config is not None:
            config, has_context = ragged_config
            ragged = RaggedPrefillLaunch.build(query, metadata, config, scale=scale, has_context=has_context)
            return _LayerLaunch(PLAN_2D, None, None, ragged, ragged_config)

        queries_per_kv = num_q_heads // num_kv_heads
        device_name = device_name_of(query.device)
        plan = self.plan(
            metadata,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            block_size=block_size,
            dtype=query.dtype,
            device=query.device,
        )
        kernel = "unified_attention_2d" if plan.kind == "2d" else "unified_attention_3d"
        cfg = self.attention_config(
            kernel,
            query.device,
            head_size=head_size,
            block_size=block_size,
            num_queries_per_kv=queries_per_kv,
            dtype=query.dtype,
            max_query_len=metadata.max_query_len,
            kv_cache_dtype=kv_cache.dtype,
        )
        block_m = max(cfg.block_m, triton.next_power_of_2(queries_per_kv))
        block_q = block_m // queries_per_kv
        num_q_blocks = num_tokens // block_q + metadata.num_reqs
        num_programs = num_q_blocks * num_kv_heads * plan.num_splits
        head_padded = max(triton.next_power_of_2(head_size), 16)
        dependent = num_tokens <= self._dependent_max_tokens and programmatic_launch_supported(query.device)
        # `forward` allocates a missing `out` contiguous.
        out_strides = out.stride() if out is not None else (num_q_heads * head_size, head_size, 1)
        common: dict[str, object] = dict(
            q_ptr=None,  # per call
            kv_ptr=None,  # per call
            block_table_ptr=metadata.block_table,
            seq_lens_ptr=metadata.seq_lens,
            query_start_loc_ptr=metadata.query_start_loc,
            scale_log2=scale * k_scale * LOG2E,
            softcap=float(logit_softcap) if logit_softcap is not None else 1.0,
            window=int(sliding_window) if sliding_window is not None else 0,
            num_reqs=metadata.num_reqs,
            num_q_blocks=num_q_blocks,
            num_programs=num_programs,
            stride_q_tok=query.stride(0),
            stride_q_head=query.stride(1),
            stride_kv_kind=kv_cache.stride(0),
            stride_kv_block=kv_cache.stride(1),
            stride_kv_slot=kv_cache.stride(2),
            stride_kv_head=kv_cache.stride(3),
            stride_bt_req=metadata.block_table.stride(0),
            QUERIES_PER_KV=queries_per_kv,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=head_padded,
            BLOCK_SIZE=block_size,
            TILE_SIZE=cfg.tile_size,
            USE_SOFTCAP=logit_softcap is not None,
            USE_WINDOW=sliding_window is not None,
            # Triton's interpreter (3.9) multiplies bfloat16 dot operands as raw uint16 bits.
            DOT_IN_FP32=query.dtype == torch.bfloat16 and INTERPRETED,
            NUM_GRID_GROUPS=self.grid_groups(query.device),
            KV_CACHE_MODIFIER=cfg.kv_cache_modifier,
            WIDEN_BITS=bit_widening(query.device, kv_cache.dtype, query.dtype),
            DEPENDENT=dependent,
            **cfg.variant_constexprs(warp_specialize_supported=warp_specialize_supported(query.device)),
        )
        launch = launch_options(dependent, query.device)
        options = {
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
            **dict(cfg.backend_options),
            **launch,
        }
        # Sinks are per layer, so per call; without them the pointer is None, which Triton compiles
        # as a constant: the kernels are exactly those of a backend without sinks.
        use_sinks = sinks is not None
        sink_args: dict[str, object] = {"sinks_ptr": None, "USE_SINKS": use_sinks}
        sinks_per_call = ("sinks_ptr",) if use_sinks else ()
        if plan.kind == "2d":
            attention = CachedLaunch(
                unified_attention_2d_kernel,
                (num_programs,),
                {
                    **common,
                    **sink_args,
                    "out_ptr": None,
                    "out_scale": v_scale,
                    "stride_o_tok": out_strides[0],
                    "stride_o_head": out_strides[1],
                },
                ("out_ptr", "q_ptr", "kv_ptr", *sinks_per_call),
                options,
            )
            return _LayerLaunch(plan, attention, None)
        # Float32 partials, one per (token, query head, split); every split writes its slot. One
        # set serves every layer of the step: the stream runs each layer's reduction before the
        # next layer's 3D kernel overwrites them.
        partial_shape = (num_tokens, num_q_heads, plan.num_splits)
        buffers: tuple[torch.Tensor | StandIn, ...]
        if plan_only:
            partial = StandIn(torch.float32, partial_shape)
            buffers = (StandIn(torch.float32, (*partial_shape, head_padded)), partial, partial)
        else:
            maxima = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
            acc = torch.empty((*partial_shape, head_padded), dtype=torch.float32, device=query.device)
            buffers = (acc, maxima, torch.empty_like(maxima))
        segm_acc, segm_max, segm_sum = buffers
        attention = CachedLaunch(
            unified_attention_3d_kernel,
            (num_programs,),
            {
                **common,
                "segm_acc_ptr": segm_acc,
                "segm_max_ptr": segm_max,
                "segm_sum_ptr": segm_sum,
                "num_q_heads": num_q_heads,
                "NUM_SPLITS": plan.num_splits,
            },
            ("q_ptr", "kv_ptr"),
            options,
        )
        reduce_cfg = self._launch_params.simple("reduce_segments", device_name, head_size=head_size)
        reduce = CachedLaunch(
            reduce_segments_kernel,
            (num_tokens, num_q_heads),
            {
                "out_ptr": None,  # per call
                "segm_acc_ptr": segm_acc,
                "segm_max_ptr": segm_max,
                "segm_sum_ptr": segm_sum,
                "out_scale": v_scale,
                "num_q_heads": num_q_heads,
                "stride_o_tok": out_strides[0],
                "stride_o_head": out_strides[1],
                "HEAD_SIZE": head_size,
                "HEAD_SIZE_PADDED": head_padded,
                "NUM_SPLITS": plan.num_splits,
                "DEPENDENT": dependent,
                **sink_args,
            },
            ("out_ptr", *sinks_per_call),
            {"num_warps": reduce_cfg.num_warps, **launch},
        )
        return _LayerLaunch(plan, attention, reduce)

    def _ragged_config(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        new_kv: tuple[torch.Tensor, torch.Tensor],
        sliding_window: int | None,
        logit_softcap: float | None,
    ) -> tuple[RaggedPrefillLaunchConfig, bool] | None:
        """The ragged prefill kernel's config for this batch and whether some request has cached
        context, or None when it must run on the unified kernels
        (`ragged_prefill.unsupported_reason`). Host-only; mutates only the launch-parameter cache."""
        if unsupported_reason(
            query, kv_cache, metadata, *new_kv, sliding_window=sliding_window, logit_softcap=logit_softcap
        ):
            return None
        query_lens = metadata.query_start_loc_cpu[1:] - metadata.query_start_loc_cpu[:-1]
        has_context = bool((metadata.seq_lens_cpu > query_lens).any())
        config = self._launch_params.ragged_prefill(
            device_name_of(query.device),
            head_size=query.shape[2],
            dtype=query.dtype,
            has_context=has_context,
            max_query_len=metadata.max_query_len,
        )
        return config, has_context

    def plan(
        self,
        metadata: AttentionMetadata,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> SplitPlan:
        """The kernel `forward` runs for this batch: the constructor's `num_splits` if given, else
        `choose_split`. Host-only (no device sync); mutates only the launch-parameter cache."""
        queries_per_kv = num_q_heads // num_kv_heads
        if self._num_splits is not None:
            return PLAN_2D if self._num_splits == 1 else SplitPlan("3d", self._num_splits)
        # The heuristic needs the 2D kernel's tokens per query block, which its config sets.
        cfg_2d = self.attention_config(
            "unified_attention_2d",
            device,
            head_size=head_size,
            block_size=block_size,
            num_queries_per_kv=queries_per_kv,
            dtype=dtype,
            max_query_len=metadata.max_query_len,
        )
        # ... and the 3D kernel's KV tile: a split shorter than one tile would get no work.
        cfg_3d = self.attention_config(
            "unified_attention_3d",
            device,
            head_size=head_size,
            block_size=block_size,
            num_queries_per_kv=queries_per_kv,
            dtype=dtype,
            max_query_len=metadata.max_query_len,
        )
        block_q = max(cfg_2d.block_m, triton.next_power_of_2(queries_per_kv)) // queries_per_kv
        return self.split_plan(
            metadata.num_reqs,
            metadata.max_query_len,
            metadata.max_seq_len,
            num_kv_heads,
            device,
            block_q=block_q,
            tile_size=cfg_3d.tile_size,
        )

    # What a platform that reuses this backend with tables of its own (the rocm plugin) overrides.

    def attention_config(
        self,
        kernel: str,
        device: torch.device,
        *,
        head_size: int,
        block_size: int,
        num_queries_per_kv: int,
        dtype: torch.dtype,
        max_query_len: int,
        kv_cache_dtype: torch.dtype | None = None,  # None: the cache holds `dtype`
    ) -> AttentionLaunchConfig:
        """Launch parameters of "unified_attention_2d" or "unified_attention_3d" for this shape class
        on `device`, from the tuned configs. Mutates only the launch-parameter cache."""
        return self._launch_params.attention(
            kernel,
            device_name_of(device),
            head_size=head_size,
            block_size=block_size,
            num_queries_per_kv=num_queries_per_kv,
            dtype=dtype,
            max_query_len=max_query_len,
            kv_cache_dtype=kv_cache_dtype,
        )

    def grid_groups(self, device: torch.device) -> int:
        """`NUM_GRID_GROUPS` of the launches on `device`: the constructor's grid order. Pure."""
        return self._grid_order.num_groups

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
        """`choose_split` with this module's thresholds and the device's SM count."""
        return choose_split(
            num_reqs,
            max_query_len,
            max_seq_len,
            num_kv_heads,
            self._sm_count(device),
            block_q=block_q,
            tile_size=tile_size,
        )
