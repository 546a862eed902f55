# Triton kernel arguments are IR values (pointers, scalars, constexprs) with no Python types.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels that move KV-cache data, launched by `cache_ops.TritonCacheOps`.

Layout (NHD, see `pagedserve.platforms.api`): a layer's cache is [2, num_blocks, block_size,
num_kv_heads, head_size]; keys at index 0, values at index 1. Inside one block the
[block_size, num_kv_heads, head_size] elements are contiguous (the wrapper asserts it), so a whole
block is copied as one flat run of `block_elems` elements.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_to_fp8_grid(x, min_subnormal, MANT_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """Round float32 `x` (within the FP8 range) to the nearest FP8 value, ties to even, staying in
    float32, so that the cast after it is exact. Why not cast directly: Triton's interpreter rounds
    float32 -> FP8 half-up and loses the carry into the exponent, and doing the rounding here makes
    the written bits the same under the interpreter and on every GPU, for every encoding."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    exp = (mag >> 23).to(tl.int32)
    # float32 mantissa bits below the FP8 grid: 23 - MANT_BITS for normals, more for subnormals.
    drop = (23 - MANT_BITS) + tl.maximum(MIN_NORMAL_EXP + 127 - exp, 0)
    drop = tl.minimum(drop, 23).to(tl.uint32)
    # Ties go to the even multiple of the grid step: the parity is that of the significand with its
    # implicit leading one (the bit at `drop` is that one itself when drop == 23).
    lsb = (((mag & 0x7FFFFF) | 0x800000) >> drop) & 1
    half_minus_one = (tl.full(mag.shape, 1, tl.uint32) << (drop - 1)) - 1
    rounded = ((mag + half_minus_one + lsb) >> drop) << drop
    # Below the smallest subnormal the grid is {0, min_subnormal}: more than half of it rounds up.
    tiny = exp < MIN_NORMAL_EXP + 127 - MANT_BITS
    tiny_bits = tl.where(tl.abs(x) > min_subnormal * 0.5, min_subnormal, 0.0).to(tl.uint32, bitcast=True)
    return tl.where(tiny, tiny_bits | sign, rounded | sign).to(tl.float32, bitcast=True)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    kv_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kv_kind,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    k_inv_scale,  # float32(1 / k_scale); used only with QUANTIZE
    v_inv_scale,  # float32(1 / v_scale); used only with QUANTIZE
    fp8_max,  # the cache dtype's largest finite value; used only with QUANTIZE
    fp8_min_subnormal,  # its smallest positive value; used only with QUANTIZE
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    QUANTIZE: tl.constexpr,  # the cache is FP8 (its encoding is the pointer's element type)
    MANT_BITS: tl.constexpr,  # the FP8 encoding's mantissa bits (3 for e4m3, 2 for e5m2)
    MIN_NORMAL_EXP: tl.constexpr,  # its smallest normal value is 2**MIN_NORMAL_EXP
):
    """One program per (token, KV head): write that head's key and value into the token's slot,
    quantized into an FP8 cache exactly as `pagedserve.platforms.kv_cache_dtype.quantize` does
    (float32 multiply by the reciprocal, clamp, round to nearest even)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return  # a padding token of a full CUDA graph: nothing to write
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    d_mask = offs_d < HEAD_SIZE
    k = tl.load(key_ptr + tok * stride_k_tok + head * stride_k_head + offs_d, mask=d_mask)
    v = tl.load(value_ptr + tok * stride_v_tok + head * stride_v_head + offs_d, mask=d_mask)
    dst = (
        (slot // BLOCK_SIZE) * stride_kv_block + (slot % BLOCK_SIZE) * stride_kv_slot + head * stride_kv_head
    )
    if QUANTIZE:
        cache_ty = kv_ptr.dtype.element_ty
        k = tl.minimum(tl.maximum(k.to(tl.float32) * k_inv_scale, -fp8_max), fp8_max)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * v_inv_scale, -fp8_max), fp8_max)
        k = _round_to_fp8_grid(k, fp8_min_subnormal, MANT_BITS, MIN_NORMAL_EXP).to(cache_ty)
        v = _round_to_fp8_grid(v, fp8_min_subnormal, MANT_BITS, MIN_NORMAL_EXP).to(cache_ty)
    tl.store(kv_ptr + dst + offs_d, k, mask=d_mask)
    tl.store(kv_ptr + stride_kv_kind + dst + offs_d, v, mask=d_mask)


@triton.jit
def copy_blocks_kernel(
    elem_ref_ptr,  # any cache of the element type; only its pointer type is used
    src_bases_ptr,  # [num_layers] int64: data_ptr of each layer's source cache
    dst_bases_ptr,  # [num_layers] int64: data_ptr of each layer's destination cache
    block_mapping_ptr,  # [num_copies, 2] int64: (src_block, dst_block)
    src_stride_kind,  # elements between the key and value halves of a source cache
    dst_stride_kind,
    block_elems,  # elements in one block of one half: block_size * num_kv_heads * head_size
    BLOCK: tl.constexpr,  # elements moved per step
):
    """One program per (copy, layer, key-or-value half): copy one block. Layers are reached
    through their base addresses, so all layers and all copies take a single launch. Copies sit on
    grid axis 0, the only one not limited to 65535."""
    pair = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    half = tl.program_id(2).to(tl.int64)
    src_block = tl.load(block_mapping_ptr + 2 * pair)
    dst_block = tl.load(block_mapping_ptr + 2 * pair + 1)
    src_base = tl.load(src_bases_ptr + layer).to(elem_ref_ptr.dtype)
    dst_base = tl.load(dst_bases_ptr + layer).to(elem_ref_ptr.dtype)
    src = src_base + half * src_stride_kind + src_block * block_elems
    dst = dst_base + half * dst_stride_kind + dst_block * block_elems
    for start in range(0, block_elems, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < block_elems
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
