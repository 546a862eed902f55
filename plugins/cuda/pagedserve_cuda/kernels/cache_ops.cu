// KV-cache data movement over the NHD cache [2, num_blocks, block_size, num_kv_heads, head_size].
// Both kernels move raw bytes in units of UNIT_BYTES (16 when every address and stride allows
// 16-byte vectors, else the element size), so one compiled variant serves every dtype.
//
// Host-set defines: UNIT_BYTES (16, 8, 4 or 2); DEPENDENT (programmatic.cuh, reshape_and_cache only).

#if UNIT_BYTES == 16
typedef uint4 unit_t;
#elif UNIT_BYTES == 8
typedef uint2 unit_t;
#elif UNIT_BYTES == 4
typedef unsigned int unit_t;
#else
typedef unsigned short unit_t;
#endif

// One CTA per token: writes the token's key and value rows of every KV head into its slot.
// All strides are in bytes.
extern "C" __global__ void reshape_and_cache(
    const char* __restrict__ key,            // [num_tokens, num_kv_heads, head_size], strided
    const char* __restrict__ value,          // [num_tokens, num_kv_heads, head_size], strided
    char* __restrict__ kv_cache,
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    long long stride_k_tok, long long stride_k_head,
    long long stride_v_tok, long long stride_v_head,
    long long stride_kv_kind, long long stride_kv_block, long long stride_kv_slot, long long stride_kv_head,
    int block_size, int num_kv_heads, int head_bytes) {
    PS_AWAIT_PREVIOUS_KERNEL();
    const long long token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;  // a padding token of a full CUDA graph: nothing to write
    const long long block = slot / block_size;
    const long long offset = slot % block_size;
    char* dst = kv_cache + block * stride_kv_block + offset * stride_kv_slot;
    const char* k_src = key + token * stride_k_tok;
    const char* v_src = value + token * stride_v_tok;
    const int units_per_head = head_bytes / UNIT_BYTES;
    for (int i = threadIdx.x; i < num_kv_heads * units_per_head; i += blockDim.x) {
        const int h = i / units_per_head;
        const int u = i % units_per_head;
        const long long d = h * stride_kv_head + (long long)u * UNIT_BYTES;
        *reinterpret_cast<unit_t*>(dst + d) =
            *reinterpret_cast<const unit_t*>(k_src + h * stride_k_head + (long long)u * UNIT_BYTES);
        *reinterpret_cast<unit_t*>(dst + stride_kv_kind + d) =
            *reinterpret_cast<const unit_t*>(v_src + h * stride_v_head + (long long)u * UNIT_BYTES);
    }
}

// grid = (num_pairs, num_layers, 2): CTA (pair, layer, kind) copies one block of one layer's keys
// (kind 0) or values (kind 1). `src_bases`/`dst_bases` hold each layer's cache address, so all
// copy-on-write pairs of all layers take a single launch. A block is `block_bytes` contiguous bytes.
extern "C" __global__ void copy_blocks(
    const long long* __restrict__ src_bases,      // [num_layers] addresses
    const long long* __restrict__ dst_bases,      // [num_layers] addresses
    const long long* __restrict__ block_mapping,  // [num_pairs, 2] (src_block, dst_block), contiguous
    long long src_stride_kind, long long dst_stride_kind, long long block_bytes) {
    const long long pair = blockIdx.x;
    const int layer = blockIdx.y;
    const int kind = blockIdx.z;
    const long long src_block = block_mapping[2 * pair];
    const long long dst_block = block_mapping[2 * pair + 1];
    const unit_t* src = reinterpret_cast<const unit_t*>(
        reinterpret_cast<const char*>(src_bases[layer]) + kind * src_stride_kind + src_block * block_bytes);
    unit_t* dst = reinterpret_cast<unit_t*>(
        reinterpret_cast<char*>(dst_bases[layer]) + kind * dst_stride_kind + dst_block * block_bytes);
    const long long units = block_bytes / UNIT_BYTES;
    for (long long i = threadIdx.x; i < units; i += blockDim.x) dst[i] = src[i];
}
