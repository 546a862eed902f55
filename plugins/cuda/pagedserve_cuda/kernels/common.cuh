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
