// Shared device helpers: fixed-width types, f16/bf16 conversions, little-endian byte access,
// warp reductions.
//
// Numerics: every kernel that must reproduce a NumPy reference bit for bit uses the explicitly
// rounded intrinsics (__fmul_rn, __fadd_rn, __fdiv_rn, ...). The compiler never contracts those
// into FMAs, so the result does not depend on -fmad. CuPy compiles with -ftz=true; that only
// changes results whose f32 intermediates are subnormal (|x| < 1.2e-38), which KV values are not.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cupyllm {

// NVRTC has no <cstdint>; these are the widths we rely on.
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

constexpr u32 kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;

// ---- f16 / bf16 ---------------------------------------------------------------------------

__device__ __forceinline__ float f16_bits_to_float(u16 bits) {
    return __half2float(__ushort_as_half(bits));
}

// Round to nearest even, like NumPy's float32 -> float16 cast (subnormals and inf included).
__device__ __forceinline__ u16 float_to_f16_bits(float x) {
    return __half_as_ushort(__float2half_rn(x));
}

__device__ __forceinline__ float bf16_bits_to_float(u16 bits) {
    return __uint_as_float(static_cast<u32>(bits) << 16);
}

// Round to nearest even; NaN stays a quiet NaN of the same sign (what __float2bfloat16_rn does).
__device__ __forceinline__ u16 float_to_bf16_bits(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// Uniform loads of the source element types an encoder accepts.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// ---- little-endian byte access --------------------------------------------------------------
// Cache blocks are packed back to back (18, 22, 26, ... bytes), so only 2-byte alignment holds
// for the 16-bit fields and none for wider reads: wider values are assembled from bytes/halves.

__device__ __forceinline__ u16 load_u16(const u8* p) {  // p must be 2-byte aligned
    return *reinterpret_cast<const u16*>(p);
}

__device__ __forceinline__ void store_u16(u8* p, u16 v) {  // p must be 2-byte aligned
    *reinterpret_cast<u16*>(p) = v;
}

__device__ __forceinline__ u32 load_u32_2aligned(const u8* p) {
    return static_cast<u32>(load_u16(p)) | (static_cast<u32>(load_u16(p + 2)) << 16);
}

__device__ __forceinline__ u32 load_u32_bytes(const u8* p) {
    return static_cast<u32>(p[0]) | (static_cast<u32>(p[1]) << 8) | (static_cast<u32>(p[2]) << 16) |
           (static_cast<u32>(p[3]) << 24);
}

// ---- warp reductions ------------------------------------------------------------------------
// xor butterflies: every lane ends with the same value, and the combination order is fixed, so
// a sum is reproducible run to run (it is not the sequential left-to-right sum, though).

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}

__device__ __forceinline__ float warp_min(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fminf(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}

__device__ __forceinline__ u32 warp_or(u32 v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v |= __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

// The value of largest magnitude, first one wins on equal magnitudes: llama.cpp's
// `if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` scanned in index order.
// Each lane passes its value and its index in the block; all lanes get the winner's value.
__device__ __forceinline__ float warp_signed_absmax_first(float v, int index) {
    float a = fabsf(v);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other_v = __shfl_xor_sync(kFullMask, v, offset);
        const float other_a = fabsf(other_v);
        const int other_i = __shfl_xor_sync(kFullMask, index, offset);
        const bool take = other_a > a || (other_a == a && other_i < index);
        v = take ? other_v : v;
        a = take ? other_a : a;
        index = take ? other_i : index;
    }
    return v;
}

}  // namespace cupyllm
