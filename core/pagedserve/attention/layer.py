"""The attention layer models call: write the new K/V into the paged cache, then attend.

Native models own one `PagedAttention` per decoder layer. The transformers fallback calls
`paged_attention` directly, because there the window and softcap arrive per call from the
transformers attention module instead of being fixed at construction.

Attention sinks (gpt-oss, plugin API 1.13) are a per-head tensor the model owns (a parameter), so
they arrive per call too (`PagedAttention.forward(q, k, v, sinks=...)`), and every path that
intercepts attention (CUDA-graph capture, warm-up hooks) carries them to the backend.

Under `torch.compile` (`pagedserve.worker.compile.cpu_compile`) the call is one opaque operator,
`torch.ops.pagedserve.paged_attention`, whose kernel is the eager code below: the forward context,
the per-step plan and the platform's backend (a plugin) are host-side state that no graph should
freeze or look into, so the compiled graph stops at attention and calls it as it is.
"""

from __future__ import annotations

from typing import TypedDict

import torch
from torch import nn

from pagedserve.attention.cascade import cascade_attention
from pagedserve.attention.forward_context import ForwardContext, get_forward_context
from pagedserve.platforms.api import KVCacheScales


class NewKV(TypedDict, total=False):
    """`AttentionBackend.forward`'s API 1.7 keywords, passed only to a backend whose
    `enable_new_kv_reads` answered True (empty otherwise)."""

    new_key: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    new_value: torch.Tensor  # [num_tokens, num_kv_heads, head_size]


class Sinks(TypedDict, total=False):
    """`AttentionBackend.forward`'s API 1.13 keyword, passed only for a layer with sinks (empty
    otherwise), so a backend written for an older API never sees it."""

    sinks: torch.Tensor  # [num_q_heads] float32


def sinks_keyword(sinks: torch.Tensor | None) -> Sinks:
    """`sinks=` when the layer has sinks, else nothing. Pure."""
    return Sinks(sinks=sinks) if sinks is not None else Sinks()


def paged_attention(
    layer_idx: int,
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    *,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    sinks: torch.Tensor | None = None,  # [num_q_heads] float32: the layer's sink logits (API 1.13)
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_size]
    """Cache this step's keys/values for layer `layer_idx` and return the attention output.

    Mutates the layer's KV cache in the open forward context (and nothing else). When the context
    carries an `attention_hook` (CUDA-graph capture), the hook answers instead and the KV cache is
    left alone."""
    if torch.compiler.is_compiling():
        return torch.ops.pagedserve.paged_attention(
            query, key, value, layer_idx, scale, sliding_window, logit_softcap, sinks
        )
    return _paged_attention_eager(
        query,
        key,
        value,
        layer_idx,
        scale=scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        sinks=sinks,
    )


def _paged_attention_eager(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    layer_idx: int,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    sinks: torch.Tensor | None = None,  # [num_q_heads] float32
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_size]
    """`paged_attention` outside compilation, and the kernel of its operator. Mutates the layer's
    KV cache (see `paged_attention`)."""
    ctx = get_forward_context()
    if layer_idx >= len(ctx.kv_caches):
        raise RuntimeError(
            f"attention layer {layer_idx} has no KV cache: the forward context holds "
            f"{len(ctx.kv_caches)} layer caches; allocate one per attention layer (ModelSpec.num_layers)"
        )
    if ctx.attention_hook is not None:
        # `sinks=` only for a layer that has them, as to backends: hooks of models without sinks
        # keep the signature they had.
        return ctx.attention_hook(
            layer_idx,
            query,
            key,
            value,
            scale=scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            **sinks_keyword(sinks),
        )
    return attend(
        ctx,
        layer_idx,
        query,
        key,
        value,
        scale=scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        sinks=sinks,
    )


def _paged_attention_shape(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the operator returns, as the compiler sees it while tracing: the query's shape and dtype."""
    return torch.empty_like(query)


def _register_operator() -> None:
    """Define `torch.ops.pagedserve.paged_attention` once per process (its kernel runs on any device).

    The schema declares no mutated argument: the KV cache it writes is not an argument but lives in
    the forward context, and the output does not alias an input. The compiler keeps every call,
    in order, because each layer's call consumes the previous layer's output."""
    if hasattr(torch.ops.pagedserve, "paged_attention"):
        return
    library = torch.library.Library("pagedserve", "FRAGMENT")
    library.define(
        "paged_attention(Tensor query, Tensor key, Tensor value, int layer_idx, float scale, "
        "int? sliding_window, float? logit_softcap, Tensor? sinks=None) -> Tensor"
    )
    library.impl("paged_attention", _paged_attention_eager, "CompositeExplicitAutograd")
    torch.library.register_fake("pagedserve::paged_attention", _paged_attention_shape, lib=library)
    _LIBRARIES.append(library)


# A `Library` unregisters its operators when garbage-collected: keep it for the process lifetime.
_LIBRARIES: list[torch.library.Library] = []
_register_operator()


def attend(
    ctx: ForwardContext,
    layer_idx: int,
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    *,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_size]
    sinks: torch.Tensor | None = None,  # [num_q_heads] float32: the layer's sink logits (API 1.13)
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_size]
    """Write the new keys/values of layer `layer_idx` into its cache, then attend, into `out` when
    given. The same work as `paged_attention`, for callers holding the context themselves (CUDA-graph
    replay runs attention between graphs, outside any model code). Mutates the layer's KV cache and
    `out`."""
    kv_cache = ctx.kv_caches[layer_idx]
    if ctx.kv_scales is not None:
        return _attend_quantized(
            ctx,
            ctx.kv_scales[layer_idx],
            query,
            key,
            value,
            kv_cache,
            scale=scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            out=out,
            sinks=sinks,
        )
    ctx.cache_ops.reshape_and_cache(key, value, kv_cache, ctx.metadata.slot_mapping)
    if ctx.metadata.cascade is not None:
        # API 1.16: the step shares a prefix (set only for models without windows or sinks).
        return cascade_attention(
            ctx.backend, query, kv_cache, ctx.metadata, scale=scale, logit_softcap=logit_softcap, out=out
        )
    # API 1.7: a backend that asked for them gets the step's own keys and values beside the cache.
    new_kv = NewKV(new_key=key, new_value=value) if ctx.new_kv_reads else NewKV()
    return ctx.backend.forward(
        query,
        kv_cache,
        ctx.metadata,
        scale=scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        out=out,
        **new_kv,
        **sinks_keyword(sinks),
    )


def _attend_quantized(
    ctx: ForwardContext,
    kv_scales: KVCacheScales,
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size], FP8
    *,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    out: torch.Tensor | None,  # [num_tokens, num_q_heads, head_size]
    sinks: torch.Tensor | None,  # [num_q_heads] float32
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_size]
    """`attend` into an FP8 cache. Apart, so that plugins written for API 1.0 (which never declare
    an FP8 cache) are never passed the `kv_scales` keyword. Mutates the cache and `out`."""
    ctx.cache_ops.reshape_and_cache(key, value, kv_cache, ctx.metadata.slot_mapping, kv_scales=kv_scales)
    return ctx.backend.forward(
        query,
        kv_cache,
        ctx.metadata,
        scale=scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        out=out,
        kv_scales=kv_scales,
        **sinks_keyword(sinks),
    )


class PagedAttention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache of one layer.

    Holds no parameters: projections and rotary embedding belong to the model. Keys and values
    enter already rotated; the output keeps the query's flat head layout."""

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} "
                "(grouped-query attention shares each KV head among a whole group of query heads)"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        sinks: torch.Tensor | None = None,  # [num_heads] float32: sink logits (gpt-oss), None: none
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        """Mutates this layer's KV cache (writes the new tokens' keys and values). `sinks` is the
        model's per-head tensor (a parameter, this rank's heads under tensor parallelism): taken
        per call, not at construction, so that it stays the model's to load and move. Any float
        dtype: backends take float32, converted here (a no-op for a float32 parameter)."""
        num_tokens = q.shape[0]
        if sinks is not None:
            if tuple(sinks.shape) != (self.num_heads,):
                raise ValueError(
                    f"attention layer {self.layer_idx}: sinks must have one logit per query head "
                    f"[{self.num_heads}], got {tuple(sinks.shape)}"
                )
            sinks = sinks.float().contiguous()
        out = paged_attention(
            self.layer_idx,
            q.view(num_tokens, self.num_heads, self.head_size),
            k.view(num_tokens, self.num_kv_heads, self.head_size),
            v.view(num_tokens, self.num_kv_heads, self.head_size),
            scale=self.scale,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
            sinks=sinks,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, sliding_window={self.sliding_window}, "
            f"logit_softcap={self.logit_softcap}"
        )
