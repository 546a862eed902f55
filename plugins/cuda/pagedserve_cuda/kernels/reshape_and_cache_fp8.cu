// reshape_and_cache into an FP8 cache: each element of the new keys and values is multiplied by
// the float32 reciprocal of its scale, clamped to the format's finite range and rounded to nearest
// even, exactly as pagedserve.platforms.kv_cache_dtype.quantize does on the CPU.
//
// Host-set defines: SCALAR_KIND (the keys' and values' dtype), KV_KIND (1 e4m3fn, 2 e5m2),
// DEPENDENT (programmatic.cuh).

#if KV_KIND == 0
#error "reshape_and_cache_fp8 needs KV_KIND 1 (e4m3fn) or 2 (e5m2)"
#endif

// Clamp to the finite range; NaN passes through (fminf/fmaxf alone would turn it into a bound).
__device__ __forceinline__ float ps_clamp_fp8(float x) {
    return (x != x) ? x : fminf(fmaxf(x, -PS_FP8_MAX), PS_FP8_MAX);
}

// One CTA per token: every element of the token's key and value rows, all KV heads (the host
// launches one thread per element, up to 1,024: cache_ops.fp8_cache_threads). Key/value
// strides are in elements of scalar_t; cache strides in bytes (= elements).
extern "C" __global__ void reshape_and_cache_fp8(
    const scalar_t* __restrict__ key,        // [num_tokens, num_kv_heads, head_size], strided
    const scalar_t* __restrict__ value,      // [num_tokens, num_kv_heads, head_size], strided
    unsigned char* __restrict__ kv_cache,    // [2, num_blocks, block_size, num_kv_heads, head_size]
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    long long stride_k_tok, long long stride_k_head,
    long long stride_v_tok, long long stride_v_head,
    long long stride_kv_kind, long long stride_kv_block, long long stride_kv_slot, long long stride_kv_head,
    int block_size, int num_kv_heads, int head_size,
    float k_inv_scale, float v_inv_scale) {
    PS_AWAIT_PREVIOUS_KERNEL();
    const long long token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;  // a padding token of a full CUDA graph: nothing to write
    unsigned char* dst = kv_cache + (slot / block_size) * stride_kv_block + (slot % block_size) * stride_kv_slot;
    const scalar_t* k_src = key + token * stride_k_tok;
    const scalar_t* v_src = value + token * stride_v_tok;
    for (int i = threadIdx.x; i < num_kv_heads * head_size; i += blockDim.x) {
        const int h = i / head_size;
        const int d = i % head_size;
        const float k = ps_to_float(k_src[h * stride_k_head + d]) * k_inv_scale;
        const float v = ps_to_float(v_src[h * stride_v_head + d]) * v_inv_scale;
        const long long o = h * stride_kv_head + d;
        dst[o] = ps_float_to_fp8(ps_clamp_fp8(k));
        dst[stride_kv_kind + o] = ps_float_to_fp8(ps_clamp_fp8(v));
    }
}
