// Paged decode attention over the NHD cache [2, num_blocks, block_size, num_kv_heads, head_size],
// for batches where every sequence has exactly one query token.
//
// One thread block (CTA) computes HEADS_PER_CTA query heads that share one KV head (a GQA group, or
// a slice of one), for one sequence, over one partition of its context:
//   grid = (num_q_heads / HEADS_PER_CTA, num_seqs, num_partitions)
// v1 launches a single partition that covers the whole context and writes the output directly.
// v2 (PARTITIONED=1) launches partitions of `partition_size` tokens; each writes its normalised
// partial output, its max score and its exp-sum, and `paged_attention_reduce` rescales and sums them.
//
// Work split inside a CTA. A *thread group* of TG lanes reads one key token: each lane loads VPT
// 16-byte vectors of the head row, so a group reads TG*VPT*16 contiguous bytes (coalesced). A warp
// holds 32/TG groups and, per loop step, loads ROWS tokens per group, keys and values together, so
// that many 16-byte loads are in flight before the first score is needed. Scores are reduced across
// the group with xor-shuffles. Each group keeps its own online-softmax state (running max m, running
// exp-sum l, unnormalised accumulator) for the head dims its lanes own; at the end the groups of a
// warp merge with shuffles, the warps merge through shared memory.
//
// FP8 caches (KV_KIND 1 or 2): a lane loads the same PS_VEC elements of a head row as for a cache
// in the query's dtype, now PS_VEC bytes (8 or 4), and widens them exactly to float32. The key
// scale is folded into `scale` by the host; `out_scale` (the value scale, 1 otherwise) multiplies
// the normalised output.
//
// Host-set defines: SCALAR_KIND, KV_KIND, HEAD_SIZE, BLOCK_SIZE, HEADS_PER_CTA, NUM_THREADS, TG,
// ROWS, PARTITIONED (0 or 1), MIN_CTAS (0, or CTAs per SM the register allocation must allow).

#if KV_KIND == 0
typedef scalar_t kv_t;
typedef uint4 kv_vec_t;  // PS_VEC elements of scalar_t: 16 bytes
__device__ __forceinline__ kv_vec_t ps_load_kv(const kv_t* p) { return ps_load16(p); }
__device__ __forceinline__ kv_vec_t ps_zero_kv() { return make_uint4(0u, 0u, 0u, 0u); }
__device__ __forceinline__ void ps_unpack_kv(const kv_vec_t& raw, float* out) { ps_unpack(raw, out); }
#else
typedef unsigned char kv_t;
__device__ __forceinline__ void ps_unpack_fp8_word(unsigned int w, float* out) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = ps_fp8_to_float((w >> (8 * i)) & 0xffu);
}
#if PS_VEC == 8
typedef uint2 kv_vec_t;  // 8 FP8 elements: 8 bytes
__device__ __forceinline__ kv_vec_t ps_load_kv(const kv_t* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ kv_vec_t ps_zero_kv() { return make_uint2(0u, 0u); }
__device__ __forceinline__ void ps_unpack_kv(const kv_vec_t& raw, float* out) {
    ps_unpack_fp8_word(raw.x, out);
    ps_unpack_fp8_word(raw.y, out + 4);
}
#else
typedef unsigned int kv_vec_t;  // 4 FP8 elements: 4 bytes
__device__ __forceinline__ kv_vec_t ps_load_kv(const kv_t* p) { return *reinterpret_cast<const unsigned int*>(p); }
__device__ __forceinline__ kv_vec_t ps_zero_kv() { return 0u; }
__device__ __forceinline__ void ps_unpack_kv(const kv_vec_t& raw, float* out) { ps_unpack_fp8_word(raw, out); }
#endif
#endif

constexpr int NUM_VECS = HEAD_SIZE / PS_VEC;      // 16-byte vectors per head row
constexpr int VPT = NUM_VECS / TG;                // vectors per lane per head row
constexpr int DIMS = VPT * PS_VEC;                // head dims a lane owns
constexpr int GROUPS_PER_WARP = 32 / TG;
constexpr int WARP_TOKENS = GROUPS_PER_WARP * ROWS;  // tokens a warp reads per loop step
constexpr int NUM_WARPS = NUM_THREADS / 32;
constexpr int H = HEADS_PER_CTA;

static_assert(HEAD_SIZE % PS_VEC == 0, "head_size must be a multiple of the 16-byte vector");
static_assert(NUM_VECS % TG == 0 && TG <= 32 && (TG & (TG - 1)) == 0, "TG must be a power of two dividing NUM_VECS");
static_assert(NUM_THREADS % 32 == 0, "whole warps only");

#if MIN_CTAS > 0
#define PS_DECODE_BOUNDS __launch_bounds__(NUM_THREADS, MIN_CTAS)
#else
#define PS_DECODE_BOUNDS __launch_bounds__(NUM_THREADS)
#endif

extern "C" __global__ void PS_DECODE_BOUNDS paged_attention_decode(
    scalar_t* __restrict__ out,          // [num_tokens, num_q_heads, HEAD_SIZE] (v1)
    float* __restrict__ part_acc,        // [num_seqs, num_q_heads, max_parts, HEAD_SIZE] (v2)
    float* __restrict__ part_max,        // [num_seqs, num_q_heads, max_parts] (v2)
    float* __restrict__ part_sum,        // [num_seqs, num_q_heads, max_parts] (v2)
    const scalar_t* __restrict__ query,  // [num_tokens, num_q_heads, HEAD_SIZE]
    const kv_t* __restrict__ kv_cache,
    const int* __restrict__ block_table,      // [num_seqs, >= max blocks] (row stride stride_bt)
    const int* __restrict__ seq_lens,         // [num_seqs]
    const int* __restrict__ query_start_loc,  // [num_seqs + 1]
    long long stride_q_tok, long long stride_q_head,
    long long stride_o_tok, long long stride_o_head,
    long long stride_kv_kind, long long stride_kv_block, long long stride_kv_slot, long long stride_kv_head,
    long long stride_bt,
    int num_q_heads, int queries_per_kv, int max_parts, int partition_size,
    float scale, float out_scale, float softcap, int window) {
    const int head0 = blockIdx.x * H;
    const int seq = blockIdx.y;
    const int part = blockIdx.z;
    const int kv_head = head0 / queries_per_kv;
    const int seq_len = seq_lens[seq];
    // With a sliding window W the query (position seq_len - 1) sees keys [seq_len - W, seq_len).
    const int start = (window > 0 && seq_len > window) ? seq_len - window : 0;
    const int p_start = start + part * partition_size;
    if (p_start >= seq_len) return;  // a shorter sequence has fewer partitions (uniform per CTA)
    const int p_end = min(seq_len, p_start + partition_size);

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int group = lane / TG;
    const int j = lane % TG;  // lane within the group: owns vectors j, j + TG, ... of a head row

    // The query rows of the CTA's heads, pre-scaled, in registers.
    const long long q_row = query_start_loc[seq];
    float q[H][DIMS];
#pragma unroll
    for (int h = 0; h < H; ++h) {
        const scalar_t* qp = query + q_row * stride_q_tok + (long long)(head0 + h) * stride_q_head;
#pragma unroll
        for (int v = 0; v < VPT; ++v) {
            ps_unpack(ps_load16(qp + (j + v * TG) * PS_VEC), &q[h][v * PS_VEC]);
#pragma unroll
            for (int e = 0; e < PS_VEC; ++e) q[h][v * PS_VEC + e] *= scale;
        }
    }

    float m[H], l[H], acc[H][DIMS];
#pragma unroll
    for (int h = 0; h < H; ++h) {
        m[h] = PS_NEG_INF;
        l[h] = 0.f;
#pragma unroll
        for (int i = 0; i < DIMS; ++i) acc[h][i] = 0.f;
    }

    const int* bt = block_table + (long long)seq * stride_bt;
    const kv_t* k_base = kv_cache + (long long)kv_head * stride_kv_head;
    const kv_t* v_base = k_base + stride_kv_kind;

    // The loop bound depends only on the warp, so every lane reaches every shuffle below.
    for (int t0 = p_start + warp * WARP_TOKENS; t0 < p_end; t0 += NUM_WARPS * WARP_TOKENS) {
        kv_vec_t kr[ROWS][VPT], vr[ROWS][VPT];
        bool valid[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int t = t0 + r * GROUPS_PER_WARP + group;
            valid[r] = t < p_end;
            if (valid[r]) {
                const long long off =
                    (long long)bt[t / BLOCK_SIZE] * stride_kv_block + (long long)(t % BLOCK_SIZE) * stride_kv_slot;
#pragma unroll
                for (int v = 0; v < VPT; ++v) {
                    kr[r][v] = ps_load_kv(k_base + off + (j + v * TG) * PS_VEC);
                    vr[r][v] = ps_load_kv(v_base + off + (j + v * TG) * PS_VEC);
                }
            } else {
                // Never read past the sequence: its slots may hold anything (NaN in the tests).
#pragma unroll
                for (int v = 0; v < VPT; ++v) {
                    kr[r][v] = ps_zero_kv();
                    vr[r][v] = ps_zero_kv();
                }
            }
        }

        float s[ROWS][H];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float dot[H];
#pragma unroll
            for (int h = 0; h < H; ++h) dot[h] = 0.f;
#pragma unroll
            for (int v = 0; v < VPT; ++v) {
                float k[PS_VEC];
                ps_unpack_kv(kr[r][v], k);
#pragma unroll
                for (int h = 0; h < H; ++h)
#pragma unroll
                    for (int e = 0; e < PS_VEC; ++e) dot[h] = fmaf(q[h][v * PS_VEC + e], k[e], dot[h]);
            }
#pragma unroll
            for (int h = 0; h < H; ++h) {
#pragma unroll
                for (int mask = TG / 2; mask > 0; mask >>= 1) dot[h] += __shfl_xor_sync(PS_FULL_MASK, dot[h], mask);
                if (softcap > 0.f) dot[h] = softcap * tanhf(dot[h] / softcap);
                s[r][h] = valid[r] ? dot[h] : PS_NEG_INF;
            }
        }

        // Online softmax: rescale the running state to the new max, then add this step's tokens.
#pragma unroll
        for (int h = 0; h < H; ++h) {
            float step_max = s[0][h];
#pragma unroll
            for (int r = 1; r < ROWS; ++r) step_max = fmaxf(step_max, s[r][h]);
            const float m_new = fmaxf(m[h], step_max);
            if (m_new == PS_NEG_INF) continue;  // this group has seen no token yet
            const float corr = __expf(m[h] - m_new);  // 0 when m[h] is still -inf
            l[h] *= corr;
#pragma unroll
            for (int i = 0; i < DIMS; ++i) acc[h][i] *= corr;
            m[h] = m_new;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                s[r][h] = __expf(s[r][h] - m_new);  // 0 for invalid rows
                l[h] += s[r][h];
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
            for (int v = 0; v < VPT; ++v) {
                float val[PS_VEC];
                ps_unpack_kv(vr[r][v], val);
#pragma unroll
                for (int h = 0; h < H; ++h) {
                    const float p = (m[h] == PS_NEG_INF) ? 0.f : s[r][h];
#pragma unroll
                    for (int e = 0; e < PS_VEC; ++e) acc[h][v * PS_VEC + e] = fmaf(p, val[e], acc[h][v * PS_VEC + e]);
                }
            }
        }
    }

    // Merge the groups of a warp: lanes j, j + TG, j + 2*TG, ... own the same dims.
#pragma unroll
    for (int mask = TG; mask < 32; mask <<= 1) {
#pragma unroll
        for (int h = 0; h < H; ++h) {
            const float m_o = __shfl_xor_sync(PS_FULL_MASK, m[h], mask);
            const float l_o = __shfl_xor_sync(PS_FULL_MASK, l[h], mask);
            const float m_n = fmaxf(m[h], m_o);
            const float a = (m_n == PS_NEG_INF) ? 0.f : __expf(m[h] - m_n);
            const float b = (m_n == PS_NEG_INF) ? 0.f : __expf(m_o - m_n);
            l[h] = l[h] * a + l_o * b;
#pragma unroll
            for (int i = 0; i < DIMS; ++i) {
                const float other = __shfl_xor_sync(PS_FULL_MASK, acc[h][i], mask);
                acc[h][i] = acc[h][i] * a + other * b;
            }
            m[h] = m_n;
        }
    }

    // Merge the warps through shared memory (group 0 of each warp holds the warp's state).
    __shared__ float sm_acc[NUM_WARPS][H][HEAD_SIZE];
    __shared__ float sm_m[NUM_WARPS][H];
    __shared__ float sm_l[NUM_WARPS][H];
    if (group == 0) {
#pragma unroll
        for (int h = 0; h < H; ++h) {
#pragma unroll
            for (int v = 0; v < VPT; ++v)
#pragma unroll
                for (int e = 0; e < PS_VEC; ++e) sm_acc[warp][h][(j + v * TG) * PS_VEC + e] = acc[h][v * PS_VEC + e];
            if (j == 0) {
                sm_m[warp][h] = m[h];
                sm_l[warp][h] = l[h];
            }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < H * HEAD_SIZE; idx += NUM_THREADS) {
        const int h = idx / HEAD_SIZE;
        const int d = idx % HEAD_SIZE;
        float big = PS_NEG_INF;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) big = fmaxf(big, sm_m[w][h]);
        float total = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float wt = (sm_m[w][h] == PS_NEG_INF) ? 0.f : __expf(sm_m[w][h] - big);
            total += sm_l[w][h] * wt;
            o += sm_acc[w][h][d] * wt;
        }
        const float res = (total > 0.f ? o / total : 0.f) * out_scale;
#if PARTITIONED
        const long long pi = ((long long)seq * num_q_heads + head0 + h) * max_parts + part;
        part_acc[pi * HEAD_SIZE + d] = res;
        if (d == 0) {
            part_max[pi] = big;
            part_sum[pi] = total;
        }
#else
        out[q_row * stride_o_tok + (long long)(head0 + h) * stride_o_head + d] = ps_from_float(res);
#endif
    }
}

// v2's second pass: grid (num_q_heads, num_seqs), REDUCE_THREADS threads, dynamic shared memory of
// max_parts floats. Partition p's output is weighted by exp_sum_p * exp(max_p - global max).
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS) paged_attention_reduce(
    scalar_t* __restrict__ out,             // [num_tokens, num_q_heads, HEAD_SIZE]
    const float* __restrict__ part_acc,     // [num_seqs, num_q_heads, max_parts, HEAD_SIZE]
    const float* __restrict__ part_max,     // [num_seqs, num_q_heads, max_parts]
    const float* __restrict__ part_sum,     // [num_seqs, num_q_heads, max_parts]
    const int* __restrict__ seq_lens,
    const int* __restrict__ query_start_loc,
    long long stride_o_tok, long long stride_o_head,
    int num_q_heads, int max_parts, int partition_size, int window) {
    extern __shared__ float sm_w[];
    const int head = blockIdx.x;
    const int seq = blockIdx.y;
    const int seq_len = seq_lens[seq];
    const int span = (window > 0 && seq_len > window) ? window : seq_len;
    const int num_parts = (span + partition_size - 1) / partition_size;
    const long long base = ((long long)seq * num_q_heads + head) * max_parts;

    for (int p = threadIdx.x; p < num_parts; p += REDUCE_THREADS) sm_w[p] = part_max[base + p];
    __syncthreads();
    float big = PS_NEG_INF;
    for (int p = 0; p < num_parts; ++p) big = fmaxf(big, sm_w[p]);
    __syncthreads();
    for (int p = threadIdx.x; p < num_parts; p += REDUCE_THREADS) sm_w[p] = part_sum[base + p] * __expf(sm_w[p] - big);
    __syncthreads();
    float total = 0.f;
    for (int p = 0; p < num_parts; ++p) total += sm_w[p];
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const long long row = query_start_loc[seq];
    for (int d = threadIdx.x; d < HEAD_SIZE; d += REDUCE_THREADS) {
        float o = 0.f;
        for (int p = 0; p < num_parts; ++p) o = fmaf(part_acc[(base + p) * HEAD_SIZE + d], sm_w[p], o);
        out[row * stride_o_tok + (long long)head * stride_o_head + d] = ps_from_float(o * inv);
    }
}
