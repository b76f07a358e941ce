// KV-cache storage formats on the device: layout constants and in-register dequantization.
//
// The NumPy references in cupyllm/kv/ (scalar.py, turbo.py, tcq.py) define every byte and every
// float operation; this header mirrors them. Each format is one struct with
//
//   kBlockValues, kBlockBytes          block geometry (a head row is head_dim / kBlockValues blocks)
//   kRotated                           stores WHT-rotated groups (turbo*, *_tcq)
//   dequant(block, j, table) -> float  value j of the block, with the reference's exact rounding
//
// `table` is the format's float table in global or shared memory (unused by the scalar formats):
//   turbo:  LEVELS[2^b] followed by BOUNDS[2^b - 1]   (cupyllm.kv.lloyd_max.float32_tables)
//   tcq:    CODEBOOK[2^L]                            (cupyllm.kv.tcq.load_codebook)
// Rotated formats dequantize into the rotated domain; attention uses them as they are (Q is rotated
// once, the output unrotated once) and kv_decode.cu unrotates for checks and prefill.
//
// Flash-attention kernels include this header and read K/V straight from the cache with
// `load_kv_value<Fmt>(row, i, table)`.
#pragma once

#include "common/common.cuh"

namespace cupyllm {

// ---- helpers shared by the block formats -----------------------------------------------------

__device__ __forceinline__ float block_f16(const u8* block, int byte_offset) {
    return f16_bits_to_float(load_u16(block + byte_offset));
}

// Bits [bit, bit + width) of a little-endian byte stream (stream bit p = bit p % 8 of byte p / 8).
// Reads only the bytes that hold those bits, so the last field of a block never reads past it.
template <int kWidth>
__device__ __forceinline__ u32 stream_bits_at(const u8* stream, int bit) {
    static_assert(kWidth >= 1 && kWidth <= 24, "at most 24 bits (4 bytes) per read");
    const u8* p = stream + (bit >> 3);
    const int shift = bit & 7;
    const int n_bytes = (shift + kWidth + 7) >> 3;
    u32 word = p[0];
    if (n_bytes > 1) word |= static_cast<u32>(p[1]) << 8;
    if (n_bytes > 2) word |= static_cast<u32>(p[2]) << 16;
    if (n_bytes > 3) word |= static_cast<u32>(p[3]) << 24;
    return (word >> shift) & ((1u << kWidth) - 1u);
}

// Code j of a 32-value llama.cpp block: low nibble of qs[j] for j < 16, high nibble of qs[j - 16].
__device__ __forceinline__ int q_low_nibble(const u8* qs, int j) {
    return j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
}

// ---- float formats ---------------------------------------------------------------------------

struct FmtF32 {
    static constexpr int kBlockValues = 1, kBlockBytes = 4;
    static constexpr bool kRotated = false;
    __device__ static float dequant(const u8* block, int, const float*) {
        return *reinterpret_cast<const float*>(block);  // rows are 4-byte aligned
    }
};

struct FmtF16 {
    static constexpr int kBlockValues = 1, kBlockBytes = 2;
    static constexpr bool kRotated = false;
    __device__ static float dequant(const u8* block, int, const float*) { return block_f16(block, 0); }
};

struct FmtBF16 {
    static constexpr int kBlockValues = 1, kBlockBytes = 2;
    static constexpr bool kRotated = false;
    __device__ static float dequant(const u8* block, int, const float*) {
        return bf16_bits_to_float(load_u16(block));
    }
};

// ---- llama.cpp 32-value block formats ----------------------------------------------------------
// Symmetric types (q8_0, q6_0, q5_0, q4_0): value = (q - offset) * f32(d), one rounding.
// Affine types (q5_1, q4_1): value = f32(d) * q + f32(m), two roundings (no FMA, as NumPy).

struct FmtQ8_0 {  // {fp16 d; int8 qs[32]}
    static constexpr int kBlockValues = 32, kBlockBytes = 34;
    static constexpr bool kRotated = false;
    __device__ static float dequant(const u8* block, int j, const float*) {
        const int q = static_cast<i8>(block[2 + j]);
        return __fmul_rn(static_cast<float>(q), block_f16(block, 0));
    }
};

struct FmtQ6_0 {  // {fp16 d; u8 qh[8]; u8 qs[16]}  (ik_llama.cpp)
    static constexpr int kBlockValues = 32, kBlockBytes = 26;
    static constexpr bool kRotated = false;
    // Element e keeps its two high bits in qh[e % 8] at bit 2 * (2*((e % 16) >= 8) + (e >= 16)).
    __device__ static int high_shift(int e) { return 2 * (2 * ((e & 15) >= 8) + (e >= 16)); }
    __device__ static float dequant(const u8* block, int j, const float*) {
        const int high = (block[2 + (j & 7)] >> high_shift(j)) & 3;
        const int q = q_low_nibble(block + 10, j) | (high << 4);
        return __fmul_rn(static_cast<float>(q - 32), block_f16(block, 0));
    }
};

struct FmtQ5_1 {  // {fp16 d; fp16 m; u8 qh[4]; u8 qs[16]}
    static constexpr int kBlockValues = 32, kBlockBytes = 24;
    static constexpr bool kRotated = false;
    __device__ static float dequant(const u8* block, int j, const float*) {
        const u32 qh = load_u32_2aligned(block + 4);  // bit j = bit 4 of q[j]
        const int q = q_low_nibble(block + 8, j) | static_cast<int>(((qh >> j) & 1u) << 4);
        return __fadd_rn(__fmul_rn(block_f16(block, 0), static_cast<float>(q)), block_f16(block, 2));
    }
};

struct FmtQ5_0 {  // {fp16 d; u8 qh[4]; u8 qs[16]}
    static constexpr int kBlockValues = 32, kBlockBytes = 22;
    static constexpr bool kRotated = false;
    __device__ static float dequant(const u8* block, int j, const float*) {
        const u32 qh = load_u32_2aligned(block + 2);
        const int q = q_low_nibble(block + 6, j) | static_cast<int>(((qh >> j) & 1u) << 4);
        return __fmul_rn(static_cast<float>(q - 16), block_f16(block, 0));
    }
};

struct FmtQ4_1 {  // {fp16 d; fp16 m; u8 qs[16]}
    static constexpr int kBlockValues = 32, kBlockBytes = 20;
    static constexpr bool kRotated = false;
    __device__ static float dequant(const u8* block, int j, const float*) {
        const int q = q_low_nibble(block + 4, j);
        return __fadd_rn(__fmul_rn(block_f16(block, 0), static_cast<float>(q)), block_f16(block, 2));
    }
};

struct FmtQ4_0 {  // {fp16 d; u8 qs[16]}
    static constexpr int kBlockValues = 32, kBlockBytes = 18;
    static constexpr bool kRotated = false;
    __device__ static float dequant(const u8* block, int j, const float*) {
        const int q = q_low_nibble(block + 2, j);
        return __fmul_rn(static_cast<float>(q - 8), block_f16(block, 0));
    }
};

// ---- rotated formats (turbo*, *_tcq) -------------------------------------------------------------
// A group of G values (G = min(128, head_dim), a power of two) is rotated by y = H (s * x) / sqrt(G):
// sign flips from kSignWords, an unnormalised Walsh-Hadamard transform, a multiply by fl32(1/sqrt(G)).

// The first 128 bits of the golden ratio's fractional part; value i is negated iff bit i % 32 of
// word i / 32 is set (turbo.SIGN_WORDS).
__device__ __forceinline__ bool group_sign_flipped(int i) {
    constexpr u32 kSignWords[4] = {0x9E3779B9u, 0x7F4A7C15u, 0xF39CC060u, 0x5CEDC834u};
    return (kSignWords[i >> 5] >> (i & 31)) & 1u;
}

__host__ __device__ constexpr bool is_power_of_4(int g) { return g == 1 || (g % 4 == 0 && is_power_of_4(g / 4)); }
__host__ __device__ constexpr int isqrt_pow4(int g) { return g == 1 ? 1 : 2 * isqrt_pow4(g / 4); }

// fl32(1/sqrt(G)) and fl32(sqrt(G)) exactly as NumPy computes them from doubles: for G = 4^j both are
// powers of two; for G = 2 * 4^j they are fl32(1/sqrt 2) / 2^j and fl32(sqrt 2) * 2^j (exact scalings).
template <int G>
__host__ __device__ constexpr float inv_sqrt_group() {
    return is_power_of_4(G) ? 1.0f / static_cast<float>(isqrt_pow4(G))
                            : 0x1.6a09e6p-1f / static_cast<float>(isqrt_pow4(G / 2));
}
template <int G>
__host__ __device__ constexpr float sqrt_group() {
    return is_power_of_4(G) ? static_cast<float>(isqrt_pow4(G))
                            : 0x1.6a09e6p+0f * static_cast<float>(isqrt_pow4(G / 2));
}

// Stored norm -> per-value factor fl32(f32(n) * INV_SQRT_G); value = fl32(factor * table entry).
template <int G>
__device__ __forceinline__ float rotated_group_factor(const u8* block) {
    return __fmul_rn(block_f16(block, 0), inv_sqrt_group<G>());
}

// turbo{2,3,4}: {fp16 norm; G b-bit Lloyd-Max codes, LSB-first bitstream}; table = LEVELS, BOUNDS.
template <int kBits, int G>
struct FmtTurbo {
    static_assert(kBits >= 2 && kBits <= 4, "turbo stores 2, 3 or 4 bits per value");
    static_assert(G >= 32 && G <= 128 && (G & (G - 1)) == 0, "groups of 32, 64 or 128 values");
    static constexpr int kBlockValues = G;
    static constexpr int kBlockBytes = 2 + (G * kBits + 7) / 8;
    static constexpr bool kRotated = true;
    static constexpr int kLevels = 1 << kBits;
    static constexpr int kTableSize = 2 * kLevels - 1;  // LEVELS then BOUNDS
    __device__ static int code(const u8* block, int j) {
        return static_cast<int>(stream_bits_at<kBits>(block + 2, j * kBits));
    }
    __device__ static float dequant(const u8* block, int j, const float* table) {
        return __fmul_rn(rotated_group_factor<G>(block), table[code(block, j)]);
    }
};

// *_tcq: {fp16 norm; bitstream of G*k + L - k bits; zero padding to a multiple of 4 bytes}.
// state_t = the L-bit window at stream bit t*k; value = factor * CODEBOOK[state_t]; table = CODEBOOK.
template <int kK, int kL, int G>
struct FmtTcq {
    static_assert(kL > kK && kL <= 16, "state window wider than the step");
    static_assert(G >= 32 && G <= 128 && (G & (G - 1)) == 0, "groups of 32, 64 or 128 values");
    static constexpr int kStreamBits = G * kK + kL - kK;
    static constexpr int kStreamBytes = (kStreamBits + 7) / 8;
    static constexpr int kBlockValues = G;
    static constexpr int kBlockBytes = (2 + kStreamBytes + 3) / 4 * 4;
    static constexpr bool kRotated = true;
    static constexpr int kStates = 1 << kL;
    static constexpr int kTableSize = kStates;
    __device__ static int state(const u8* block, int t) {
        return static_cast<int>(stream_bits_at<kL>(block + 2, t * kK));
    }
    __device__ static float dequant(const u8* block, int j, const float* table) {
        return __fmul_rn(rotated_group_factor<G>(block), table[state(block, j)]);
    }
};

// The formats the engine names (cupyllm.kv.formats), for G = 64 or 128.
template <int G> using FmtTurbo4 = FmtTurbo<4, G>;
template <int G> using FmtTurbo3 = FmtTurbo<3, G>;
template <int G> using FmtTurbo2 = FmtTurbo<2, G>;
template <int G> using FmtTurbo3Tcq = FmtTcq<3, 9, G>;
template <int G> using FmtTurbo2Tcq = FmtTcq<2, 8, G>;

// ---- row access ----------------------------------------------------------------------------------

// Value i (0 <= i < head_dim) of one cached head row (rotated domain for rotated formats).
template <class Fmt>
__device__ __forceinline__ float load_kv_value(const u8* row, int i, const float* table) {
    const u8* block = row + (i / Fmt::kBlockValues) * Fmt::kBlockBytes;
    return Fmt::dequant(block, i % Fmt::kBlockValues, table);
}

// ---- warp-level Walsh-Hadamard rotation of one group -----------------------------------------------
// Layout: value i of the group lives in lane i % 32, register slot i / 32 (G/32 slots per lane).
// A butterfly (v[i], v[i+h]) <- (v[i] + v[i+h], v[i] - v[i+h]) is exact-order independent, so the
// result equals the NumPy stage-by-stage transform bit for bit.

template <int G>
__device__ __forceinline__ void warp_fwht(float (&v)[G / 32], int lane) {
    constexpr int kSlots = G / 32;
#pragma unroll
    for (int h = 1; h < 32 && h < G; h <<= 1) {  // partners in other lanes
        const bool upper = lane & h;
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
            const float other = __shfl_xor_sync(kFullMask, v[s], h);
            v[s] = upper ? __fsub_rn(other, v[s]) : __fadd_rn(v[s], other);
        }
    }
#pragma unroll
    for (int hs = 1; hs < kSlots; hs <<= 1) {  // partners in other slots of the same lane (h >= 32)
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
            if ((s & hs) == 0) {
                const float a = v[s], b = v[s + hs];
                v[s] = __fadd_rn(a, b);
                v[s + hs] = __fsub_rn(a, b);
            }
        }
    }
}

template <int G>
__device__ __forceinline__ void warp_rotate(float (&v)[G / 32], int lane) {
#pragma unroll
    for (int s = 0; s < G / 32; ++s)
        if (group_sign_flipped(s * 32 + lane)) v[s] = -v[s];
    warp_fwht<G>(v, lane);
#pragma unroll
    for (int s = 0; s < G / 32; ++s) v[s] = __fmul_rn(v[s], inv_sqrt_group<G>());
}

template <int G>
__device__ __forceinline__ void warp_unrotate(float (&v)[G / 32], int lane) {
    warp_fwht<G>(v, lane);
#pragma unroll
    for (int s = 0; s < G / 32; ++s) {
        v[s] = __fmul_rn(v[s], inv_sqrt_group<G>());
        if (group_sign_flipped(s * 32 + lane)) v[s] = -v[s];
    }
}

// turbo.tree_sum over a group in the warp layout: first the slots (h >= 32), then the lanes
// (h = 16 .. 1). After the xor step with offset h, lanes i < h hold s[i] + s[i + h] exactly as the
// reference; lane 0 ends with the tree sum, which is broadcast.
template <int G>
__device__ __forceinline__ float warp_group_tree_sum(const float (&s_in)[G / 32]) {
    float s[G / 32];
#pragma unroll
    for (int i = 0; i < G / 32; ++i) s[i] = s_in[i];
#pragma unroll
    for (int h = G / 64; h >= 1; h >>= 1)
#pragma unroll
        for (int i = 0; i < h; ++i) s[i] = __fadd_rn(s[i], s[i + h]);
    float v = s[0];
#pragma unroll
    for (int h = 16; h >= 1; h >>= 1) v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, h));
    return __shfl_sync(kFullMask, v, 0);
}

}  // namespace cupyllm
