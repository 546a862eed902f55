"""`TritonCascade`: the thin host wrapper around `cascade_kernels` (plugin API 1.16's prefix,
suffix and merge operations on the triton, cuda and rocm platforms).

It checks the layout contract (what `AttentionBackend.check_cascade_call` does not: unit-stride
last dimensions, devices, int32 metadata), reads launch parameters from the tuned configs
(`cascade_prefix`, `cascade_suffix`: the unified kernels' schema and shape keys, `max_query_len`
being the step's; `merge_attention_states`: `num_warps`) and launches. Grids come from host
metadata only (`num_actual_tokens`, `num_reqs`) and the prefix length is read on the device, so
the launches may be recorded in a CUDA graph and replayed for other prefixes and batches of the
same padded size: a full graph's key need only say whether the step cascades.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.attention_states import AttentionState
from pagedserve_triton.cascade_kernels import (
    cascade_prefix_kernel,
    cascade_suffix_kernel,
    merge_states_kernel,
)
from pagedserve_triton.interpreter import INTERPRETED
from pagedserve_triton.launch_params import AttentionLaunchConfig, LaunchParams, device_name_of

PREFIX_KERNEL = "cascade_prefix"
SUFFIX_KERNEL = "cascade_suffix"
MERGE_KERNEL = "merge_attention_states"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"triton cascade attention: {message}")


def _check_layout(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
    """Raise ValueError naming the first broken layout rule. Reads only tensor metadata."""
    _require(
        query.stride(-1) == 1 and kv_cache.stride(-1) == 1, "query and kv_cache need a unit-stride last dim"
    )
    _require(kv_cache.device == query.device, f"kv_cache on {kv_cache.device}, query on {query.device}")
    cascade = metadata.cascade
    assert cascade is not None  # check_cascade_call ran first
    for name, t in (
        ("query_start_loc", metadata.query_start_loc),
        ("seq_lens", metadata.seq_lens),
        ("block_table", metadata.block_table),
        ("cascade.prefix_block_table", cascade.prefix_block_table),
        ("cascade.prefix_len_device", cascade.prefix_len_device),
    ):
        _require(
            t.dtype == torch.int32 and t.device == query.device and t.stride(-1) == 1,
            f"metadata.{name} must be unit-stride int32 on {query.device}, got {t.dtype} on {t.device}",
        )
    _require(
        metadata.num_actual_tokens <= query.shape[0],
        f"metadata has {metadata.num_actual_tokens} tokens but query only {query.shape[0]} rows",
    )
    _require(
        query.device.type != "cpu" or INTERPRETED,
        "CPU tensors run only under TRITON_INTERPRET=1 (set before importing triton); use GPU tensors",
    )


class TritonCascade:
    """The three cascade operations for one backend instance (launch parameters cached per shape
    class). Stateless between calls otherwise; allocates its float32 states per call."""

    def __init__(self, launch_params: LaunchParams) -> None:
        self._launch_params = launch_params

    def _config(
        self, kernel: str, query: torch.Tensor, kv_cache: torch.Tensor, max_query_len: int
    ) -> AttentionLaunchConfig:
        return self._launch_params.attention(
            kernel,
            device_name_of(query.device),
            head_size=query.shape[2],
            block_size=kv_cache.shape[2],
            num_queries_per_kv=query.shape[1] // kv_cache.shape[3],
            dtype=query.dtype,
            max_query_len=max_query_len,
        )

    def _states(self, query: torch.Tensor) -> AttentionState:
        rows, heads, size = query.shape
        out = torch.empty((rows, heads, size), dtype=torch.float32, device=query.device)
        lse = torch.empty((rows, heads), dtype=torch.float32, device=query.device)
        return AttentionState(out, lse)

    def prefix(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,  # with `cascade`
        *,
        scale: float,
        logit_softcap: float | None,
    ) -> AttentionState:
        """Every query row against the shared prefix. Writes only the new states."""
        _check_layout(query, kv_cache, metadata)
        cascade = metadata.cascade
        assert cascade is not None
        state = self._states(query)
        tokens = metadata.num_actual_tokens
        group = query.shape[1] // kv_cache.shape[3]
        config = self._config(PREFIX_KERNEL, query, kv_cache, tokens)
        block_m = max(config.block_m, triton.next_power_of_2(group))
        if tokens == 0:
            return state
        grid = (triton.cdiv(tokens, block_m // group), kv_cache.shape[3])
        cascade_prefix_kernel[grid](
            state.out,
            state.lse,
            query,
            kv_cache,
            cascade.prefix_block_table,
            cascade.prefix_len_device,
            tokens,
            scale,
            logit_softcap or 1.0,
            query.stride(0),
            query.stride(1),
            *kv_cache.stride()[:4],
            state.out.stride(0),
            state.out.stride(1),
            state.lse.stride(0),
            **_launch_options(query, kv_cache, config, block_m, logit_softcap),
        )
        return state

    def suffix(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,  # with `cascade`
        *,
        scale: float,
        logit_softcap: float | None,
    ) -> AttentionState:
        """Each request's rows against its own keys past the prefix. Writes only the new states."""
        _check_layout(query, kv_cache, metadata)
        cascade = metadata.cascade
        assert cascade is not None
        state = self._states(query)
        if metadata.num_reqs == 0:
            return state
        group = query.shape[1] // kv_cache.shape[3]
        config = self._config(SUFFIX_KERNEL, query, kv_cache, metadata.max_query_len)
        block_m = max(config.block_m, triton.next_power_of_2(group))
        grid = (metadata.num_actual_tokens // (block_m // group) + metadata.num_reqs, kv_cache.shape[3])
        cascade_suffix_kernel[grid](
            state.out,
            state.lse,
            query,
            kv_cache,
            metadata.block_table,
            metadata.query_start_loc,
            metadata.seq_lens,
            cascade.prefix_len_device,
            metadata.num_reqs,
            scale,
            logit_softcap or 1.0,
            query.stride(0),
            query.stride(1),
            *kv_cache.stride()[:4],
            state.out.stride(0),
            state.out.stride(1),
            state.lse.stride(0),
            metadata.block_table.stride(0),
            **_launch_options(query, kv_cache, config, block_m, logit_softcap),
        )
        return state

    def merge(self, prefix: AttentionState, suffix: AttentionState, out: torch.Tensor) -> torch.Tensor:
        """Both parts merged into `out` (rounded once to its dtype). Mutates `out` only."""
        rows, heads, size = prefix.out.shape
        _require(
            suffix.out.shape == prefix.out.shape
            and prefix.lse.shape == suffix.lse.shape == (rows, heads)
            and out.shape[0] >= rows
            and tuple(out.shape[1:]) == (heads, size),
            f"states {tuple(prefix.out.shape)} / {tuple(suffix.out.shape)} and out "
            f"{tuple(out.shape)} disagree",
        )
        for name, t in (("prefix", prefix.out), ("suffix", suffix.out), ("out", out)):
            _require(
                t.stride(-1) == 1 and t.device == out.device,
                f"{name} needs a unit-stride last dim on {out.device}",
            )
        for name, state in (("prefix", prefix), ("suffix", suffix)):
            _require(
                state.out.dtype == torch.float32 and state.lse.dtype == torch.float32,
                f"the {name} state must be float32, got {state.out.dtype} / {state.lse.dtype}",
            )
        if rows == 0:
            return out
        config = self._launch_params.simple(MERGE_KERNEL, device_name_of(out.device), head_size=size)
        merge_states_kernel[(rows,)](
            out,
            prefix.out,
            prefix.lse,
            suffix.out,
            suffix.lse,
            heads,
            out.stride(0),
            out.stride(1),
            prefix.out.stride(0),
            prefix.out.stride(1),
            prefix.lse.stride(0),
            suffix.out.stride(0),
            suffix.out.stride(1),
            suffix.lse.stride(0),
            HEAD_SIZE=size,
            HEAD_PAD=max(16, triton.next_power_of_2(size)),
            HEADS_PAD=triton.next_power_of_2(heads),
            num_warps=config.num_warps,
        )
        return out


def _launch_options(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    config: AttentionLaunchConfig,
    block_m: int,
    logit_softcap: float | None,
) -> dict[str, Any]:
    """The compile-time options and launch shape the prefix and suffix kernels share. Pure."""
    return {
        "QUERIES_PER_KV": query.shape[1] // kv_cache.shape[3],
        "HEAD_SIZE": query.shape[2],
        "HEAD_PAD": max(16, triton.next_power_of_2(query.shape[2])),
        "BLOCK_SIZE": kv_cache.shape[2],
        "TILE_SIZE": config.tile_size,
        "BLOCK_M": block_m,
        "USE_SOFTCAP": logit_softcap is not None,
        "DOT_IN_FP32": query.dtype == torch.bfloat16 and INTERPRETED,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }
