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

// The bits of `from` as a To of the same size (a u32 as the half2 of its low and high 16 bits, and back): a
// reinterpretation, no instruction (the emulator copies the bytes; its __half2 is a plain struct).
template <class To, class From>
__device__ __forceinline__ To same_bits(From from) {
    static_assert(sizeof(To) == sizeof(From), "a reinterpretation keeps the size");
#if defined(CUPYLLM_EMULATOR)
    To to;
    std::memcpy(&to, &from, sizeof(To));
    return to;
#else
    return *reinterpret_cast<const To*>(&from);
#endif
}

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

// ---- small integers from packed nibbles and bytes ----------------------------------------------------
// For 0 <= u < 1024 the f16 with bits 0x6400 | u is 1024 + u: two codes placed as mantissas (one LOP3 or
// byte_perm), one HSUB2 taking 1024 + kOffset off both (exact), two f16 -> f32 conversions (full rate,
// unlike I2F) give the integers minus kOffset as floats: 2.5 instructions a value where extracting and
// converting one by one took 4.

// The pair (u0 - kOffset, u1 - kOffset) as f16, exactly, from the mantissa pair 0x6400 | u0, 0x6400 | u1.
template <int kOffset>
__device__ __forceinline__ __half2 mantissa_pair_minus(u32 mantissas) {
    const __half2 bias = __half2half2(__ushort_as_half(static_cast<u16>(0x6400 + kOffset)));  // 1024 + kOffset
    return __hsub2(same_bits<__half2>(mantissas), bias);
}

// The f16 pair 1024 + (byte 0, byte 1) of w (kHigh: bytes 2, 3).
template <bool kHigh>
__device__ __forceinline__ u32 byte_pair_as_f16_mantissas(u32 w) {
    return __byte_perm(w, 0x64646464u, kHigh ? 0x4342 : 0x4140);
}

// The four bytes of w minus kOffset, out[k] for byte k.
template <int kOffset>
__device__ __forceinline__ void bytes_as_floats(u32 w, float (&out)[4]) {
    const float2 lo = __half22float2(mantissa_pair_minus<kOffset>(byte_pair_as_f16_mantissas<false>(w)));
    const float2 hi = __half22float2(mantissa_pair_minus<kOffset>(byte_pair_as_f16_mantissas<true>(w)));
    out[0] = lo.x;
    out[1] = lo.y;
    out[2] = hi.x;
    out[3] = hi.y;
}

// The eight nibbles of w minus kOffset, out[k] for nibble k (bits 4k .. 4k + 3).
template <int kOffset>
__device__ __forceinline__ void nibbles_as_floats(u32 w, float (&out)[8]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {  // nibbles s and s + 4: the low nibbles of bytes 0 and 2 of w >> 4s
        const u32 mantissas = ((w >> (4 * s)) & 0x000F000Fu) | 0x64006400u;
        const float2 v = __half22float2(mantissa_pair_minus<kOffset>(mantissas));
        out[s] = v.x;
        out[s + 4] = v.y;
    }
}

}  // namespace cupyllm
