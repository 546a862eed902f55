// Shared by every kernel of pagedserve_cuda; the host prepends it to each .cu source before NVRTC
// compiles it. No CUDA toolkit header is included: NVRTC wheels ship without cuda_fp16.h and
// cuda_bf16.h, so 16-bit floats are carried as raw `unsigned short` and converted with PTX `cvt`.
//
// SCALAR_KIND (set by the host with -D): 0 float32, 1 float16, 2 bfloat16.

#define PS_FULL_MASK 0xffffffffu
#define PS_NEG_INF __int_as_float(0xff800000)

#if SCALAR_KIND == 0
typedef float scalar_t;
#define PS_ELEM_BYTES 4
#else
typedef unsigned short scalar_t;
#define PS_ELEM_BYTES 2
#endif

// Elements in one 16-byte vector load: 8 for the 16-bit dtypes, 4 for float32.
#define PS_VEC (16 / PS_ELEM_BYTES)

#if SCALAR_KIND == 0
__device__ __forceinline__ float ps_to_float(float x) { return x; }
__device__ __forceinline__ float ps_from_float(float x) { return x; }
__device__ __forceinline__ void ps_unpack(const uint4& raw, float* out) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
}
#elif SCALAR_KIND == 1
__device__ __forceinline__ float ps_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short ps_from_float(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ void ps_unpack_word(unsigned int w, float* out) {
    out[0] = ps_to_float((unsigned short)(w & 0xffffu));
    out[1] = ps_to_float((unsigned short)(w >> 16));
}
#else
// bfloat16 is the upper half of a float32: widening is a shift, narrowing rounds to nearest even.
__device__ __forceinline__ float ps_to_float(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ unsigned short ps_from_float(float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ void ps_unpack_word(unsigned int w, float* out) {
    out[0] = __uint_as_float(w << 16);
    out[1] = __uint_as_float(w & 0xffff0000u);
}
#endif

#if SCALAR_KIND != 0
__device__ __forceinline__ void ps_unpack(const uint4& raw, float* out) {
    ps_unpack_word(raw.x, out);
    ps_unpack_word(raw.y, out + 2);
    ps_unpack_word(raw.z, out + 4);
    ps_unpack_word(raw.w, out + 6);
}
#endif

__device__ __forceinline__ uint4 ps_load16(const scalar_t* p) { return *reinterpret_cast<const uint4*>(p); }

// FP8 KV caches. KV_KIND (set by the host with -D; 0 when absent): 0 the cache holds scalar_t,
// 1 float8_e4m3fn, 2 float8_e5m2. The conversions are integer arithmetic, exact, and the same on
// every architecture the platform supports (sm_80 has no FP8 conversion instructions).
#ifndef KV_KIND
#define KV_KIND 0
#endif

// e4m3fn -> float: the byte's exponent and mantissa placed at float32's mantissa top, scaled by
// 2^(127 - 7) (subnormals come out right because the product is computed on a float32 denormal).
// 0x7f / 0xff are the format's NaNs.
__device__ __forceinline__ float ps_e4m3_to_float(unsigned int b) {
    const float mag = __uint_as_float((b & 0x7fu) << 20) * 1.329227995784916e36f;  // 2^120
    const float v = (b & 0x80u) ? -mag : mag;
    return ((b & 0x7fu) == 0x7fu) ? __int_as_float(0x7fc00000) : v;
}

// e5m2 is the upper byte of a float16.
__device__ __forceinline__ float ps_e5m2_to_float(unsigned int b) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(b << 8)));
    return f;
}

// float -> FP8, round to nearest even. `x` must already lie within the format's finite range (the
// caller clamps); NaN stays NaN. Matches torch's conversion bit for bit.
__device__ __forceinline__ unsigned char ps_float_to_e4m3(float x) {
    const unsigned int u = __float_as_uint(x);
    const unsigned int sign = (u >> 24) & 0x80u;
    const float a = fabsf(x);
    if (a != a) return (unsigned char)(sign | 0x7fu);
    if (a < 0.015625f) return (unsigned char)(sign | (unsigned int)rintf(a * 512.f));  // subnormal: 2^-9 steps
    unsigned int ua = __float_as_uint(a);
    ua += 0x7ffffu + ((ua >> 20) & 1u);  // round the 20 dropped mantissa bits to nearest even
    return (unsigned char)(sign | ((((ua >> 23) - 120u) << 3) | ((ua >> 20) & 7u)));
}

__device__ __forceinline__ unsigned char ps_float_to_e5m2(float x) {
    const unsigned int u = __float_as_uint(x);
    const unsigned int sign = (u >> 24) & 0x80u;
    const float a = fabsf(x);
    if (a != a) return (unsigned char)(sign | 0x7fu);
    if (a < 6.103515625e-05f) return (unsigned char)(sign | (unsigned int)rintf(a * 65536.f));  // 2^-16 steps
    unsigned int ua = __float_as_uint(a);
    ua += 0xfffffu + ((ua >> 21) & 1u);  // round the 21 dropped mantissa bits to nearest even
    return (unsigned char)(sign | ((((ua >> 23) - 112u) << 2) | ((ua >> 21) & 3u)));
}

#if KV_KIND == 1
__device__ __forceinline__ float ps_fp8_to_float(unsigned int b) { return ps_e4m3_to_float(b); }
__device__ __forceinline__ unsigned char ps_float_to_fp8(float x) { return ps_float_to_e4m3(x); }
#define PS_FP8_MAX 448.f
#elif KV_KIND == 2
__device__ __forceinline__ float ps_fp8_to_float(unsigned int b) { return ps_e5m2_to_float(b); }
__device__ __forceinline__ unsigned char ps_float_to_fp8(float x) { return ps_float_to_e5m2(x); }
#define PS_FP8_MAX 57344.f
#endif
