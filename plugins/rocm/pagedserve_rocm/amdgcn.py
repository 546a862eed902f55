"""Compiling the unified attention kernels for AMD targets without a GPU, and reading their AMDGCN.

The assembly says the VGPRs, spills, LDS, occupancy and the cache-policy bits of the K/V loads.

Triton's AMD backend compiles to AMDGCN without a GPU (`triton.compile(ASTSource(...),
target=GPUTarget("hip", "gfx942", 64))`). The arguments are specialised as a real launch would
specialise them (16-byte divisibility of pointers and strides; 32-bit pointer ranges, which
enable buffer loads, for every tensor but the KV cache, which is larger than 2 GiB in a real
engine), so the registers counted are those of the kernel that would run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedserve_rocm.arch import waves_per_eu
from pagedserve_rocm.tuning import RocmAttentionConfig

_POINTER_TYPES = {
    "block_table_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "sinks_ptr": "*fp32",
}
_FLOAT_ARGS = frozenset({"scale_log2", "softcap"})
_TRITON_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
# The memory instructions that read the KV cache: it is the only tensor without a 32-bit pointer
# range, so its vector loads stay `global_load` while every other tensor's become `buffer_load`.
# gfx950 loads K/V straight into LDS (`global_load_lds_dwordx4`), gfx942 into registers.
_KV_LOAD = re.compile(r"^\s*global_load(?:_lds)?_dwordx(?:2|4)\b(.*)$", re.M)
_POLICY_BITS = ("sc0", "sc1", "nt")

CACHE_POLICY_BITS: dict[str, frozenset[str]] = {"": frozenset(), ".cg": frozenset({"nt"})}
"""The cache-policy bits every K/V load must carry for each cache modifier the tables use: none
for the default policy; for `.cg`, `nt` (non-temporal: streamed through the caches, not kept),
which Triton's AMD backend sets on gfx942 and gfx950 (on gfx950 some load forms add `sc0`)."""


def carries_policy(bits: frozenset[str], modifier: str) -> bool:
    """Whether one load's cache-policy `bits` are what `modifier` asks for: exactly none for the
    default policy, at least `CACHE_POLICY_BITS[modifier]` otherwise. Pure."""
    wanted = CACHE_POLICY_BITS[modifier]
    return not bits if not wanted else wanted <= bits


@dataclass(frozen=True, slots=True)
class AttentionVariant:
    """One compiled form of a unified attention kernel: kernel, target and every constexpr."""

    kernel: str  # "unified_attention_2d" or "unified_attention_3d"
    arch: str  # "gfx942"
    config: RocmAttentionConfig
    head_size: int
    dtype: str  # "float16", "bfloat16" or "float32"
    num_queries_per_kv: int
    block_size: int
    softcap_and_window: bool  # both features compiled in (the most registers)
    num_grid_groups: int  # XCDs of the grid order
    num_splits: int = 1  # 3D kernel only
    # Attention sinks compiled in (2D kernel only: the 3D kernel leaves them to its reduction).
    attention_sinks: bool = False


@dataclass(frozen=True, slots=True)
class AmdgcnStats:
    """What the AMDGCN of one compiled kernel says."""

    vgprs: int  # VGPRs per lane (arch + accumulation registers)
    vgpr_spills: int
    sgpr_spills: int
    lds_bytes: int  # shared memory per workgroup
    waves_per_eu: int  # occupancy the VGPR count allows (waves per SIMD)
    kv_load_bits: tuple[frozenset[str], ...]  # cache-policy bits of each K/V vector load


def _metadata_int(asm: str, key: str) -> int:
    found = re.search(rf"^\s*\.{key}:\s+(\d+)", asm, re.M)
    if found is None:
        raise ValueError(f"the AMDGCN metadata has no .{key}; a Triton version with another format?")
    return int(found.group(1))


def kv_load_bits(asm: str) -> tuple[frozenset[str], ...]:
    """The cache-policy bits (sc0, sc1, nt) of every K/V vector load in `asm`. Pure."""
    return tuple(
        frozenset(bit for bit in _POLICY_BITS if re.search(rf"\b{bit}\b", rest))
        for rest in _KV_LOAD.findall(asm)
    )


def stats_of(asm: str, arch: str, lds_bytes: int) -> AmdgcnStats:
    """Read `AmdgcnStats` from AMDGCN assembly text. Pure."""
    vgprs = _metadata_int(asm, "vgpr_count")
    return AmdgcnStats(
        vgprs=vgprs,
        vgpr_spills=_metadata_int(asm, "vgpr_spill_count"),
        sgpr_spills=_metadata_int(asm, "sgpr_spill_count"),
        lds_bytes=lds_bytes,
        waves_per_eu=waves_per_eu(arch, vgprs),
        kv_load_bits=kv_load_bits(asm),
    )


def _constexprs(variant: AttentionVariant) -> dict[str, Any]:
    config = variant.config
    head_padded = max(1 << (variant.head_size - 1).bit_length(), 16)
    block_m = max(config.block_m, 1 << (variant.num_queries_per_kv - 1).bit_length())
    values: dict[str, Any] = dict(
        QUERIES_PER_KV=variant.num_queries_per_kv,
        BLOCK_M=block_m,
        BLOCK_Q=block_m // variant.num_queries_per_kv,
        HEAD_SIZE=variant.head_size,
        HEAD_SIZE_PADDED=head_padded,
        BLOCK_SIZE=variant.block_size,
        TILE_SIZE=config.tile_size,
        USE_SOFTCAP=variant.softcap_and_window,
        USE_WINDOW=variant.softcap_and_window,
        DOT_IN_FP32=False,
        NUM_GRID_GROUPS=variant.num_grid_groups,
        KV_CACHE_MODIFIER=config.kv_cache_modifier,
        WIDEN_BITS=False,  # the bit-moving FP8 widening is NVIDIA PTX
        DEPENDENT=False,  # programmatic dependent launches are NVIDIA's
        # The rocm tables set no interior-loop variant: the plain loop (and never warp specialisation).
        **config.for_backend("hip")[0].variant_constexprs(warp_specialize_supported=False),
    )
    if variant.kernel == "unified_attention_3d":
        values["NUM_SPLITS"] = variant.num_splits
    else:
        values["USE_SINKS"] = variant.attention_sinks
        if not variant.attention_sinks:
            values["sinks_ptr"] = None  # as a launch without sinks passes it: a constant
    return values


def _signature(kernel: Any, constexprs: dict[str, Any], dtype: str) -> tuple[dict[str, str], dict[Any, Any]]:
    """The argument types of `kernel` and the specialisation attributes of a real launch."""
    signature: dict[str, str] = {}
    attrs: dict[Any, Any] = {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            is_partial = name.startswith("segm")
            signature[name] = _POINTER_TYPES.get(name, "*fp32" if is_partial else f"*{_TRITON_DTYPES[dtype]}")
            attrs[(index,)] = [["tt.divisibility", 16]]
            if name != "kv_ptr":
                attrs[(index,)].append(["tt.pointer_range", 32])
        else:
            signature[name] = "fp32" if name in _FLOAT_ARGS else "i32"
            if name.startswith("stride"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def compile_attention(variant: AttentionVariant) -> AmdgcnStats:
    """Compile `variant` for its AMD target (no GPU needed) and read its statistics. Uses Triton's
    on-disk kernel cache."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedserve_triton.unified_attention import unified_attention_2d_kernel, unified_attention_3d_kernel

    kernel = (
        unified_attention_2d_kernel
        if variant.kernel == "unified_attention_2d"
        else unified_attention_3d_kernel
    )
    constexprs = _constexprs(variant)
    signature, attrs = _signature(kernel, constexprs, variant.dtype)
    options = {"num_warps": variant.config.num_warps, "num_stages": variant.config.num_stages}
    options.update(variant.config.amd_options())
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("hip", variant.arch, 64),
        options=options,
    )
    return stats_of(compiled.asm["amdgcn"], variant.arch, compiled.metadata.shared)


def compile_reduction(
    arch: str, *, head_size: int, num_splits: int, num_warps: int, attention_sinks: bool = False
) -> AmdgcnStats:
    """Compile the 3D kernel's reduction for `arch` (with the sinks' term when `attention_sinks`)
    and read its statistics."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedserve_triton.unified_attention import reduce_segments_kernel

    head_padded = max(1 << (head_size - 1).bit_length(), 16)
    constexprs = {
        "HEAD_SIZE": head_size,
        "HEAD_SIZE_PADDED": head_padded,
        "NUM_SPLITS": num_splits,
        "DEPENDENT": False,
        "USE_SINKS": attention_sinks,
        **({} if attention_sinks else {"sinks_ptr": None}),
    }
    signature, attrs = _signature(reduce_segments_kernel, constexprs, "bfloat16")
    compiled = triton.compile(
        ASTSource(fn=reduce_segments_kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("hip", arch, 64),
        options={"num_warps": num_warps},
    )
    return stats_of(compiled.asm["amdgcn"], arch, compiled.metadata.shared)


@dataclass(frozen=True, slots=True)
class TableVariant:
    """A variant the tables can select, compiled at its entry's most demanding shape."""

    variant: AttentionVariant
    entry: str  # "unified_attention_2d-gfx942.json#0 {match}"


def table_variants(arch: str, configs_dir: Any = None) -> list[TableVariant]:
    """One variant per entry of `arch`'s attention tables, at the entry's most demanding shape: the
    largest head size it covers (256 when unbounded), float32 unless it names a dtype, softcap and
    sliding window compiled in, GQA ratio 4, block size 16, the largest XCD count and (3D) the
    largest split count. Reads the table files. Pure otherwise."""
    import json
    from pathlib import Path

    from pagedserve_rocm.arch import KNOWN_ARCHES
    from pagedserve_rocm.tuning import ATTENTION_KERNELS, CONFIG_DIR, read_attention_config

    directory = Path(configs_dir) if configs_dir is not None else CONFIG_DIR
    found: list[TableVariant] = []
    for kernel in ATTENTION_KERNELS:
        path = directory / f"{kernel}-{arch}.json"
        for index, entry in enumerate(json.loads(path.read_text())["configs"]):
            match = entry["match"]
            config = read_attention_config(entry["params"], f"{path.name}#{index}")
            variant = AttentionVariant(
                kernel=kernel,
                arch=arch,
                config=config,
                head_size=int(match.get("head_size", match.get("head_size_le", 256))),
                dtype=str(match.get("dtype", "float32")),
                num_queries_per_kv=4,
                block_size=16,
                softcap_and_window=True,
                num_grid_groups=KNOWN_ARCHES[arch].max_xcds,
                num_splits=128 if kernel == "unified_attention_3d" else 1,
            )
            found.append(TableVariant(variant, f"{path.name}#{index} {match}"))
    return found
