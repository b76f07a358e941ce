// GGUF weight block formats on the device: in-register dequantization of one "part" of a block.
//
// The NumPy references in cupyllm/quant/weights.py (llama.cpp's dequantize_row_*) define every value;
// each format here reproduces them bit for bit: the same float32 operations in the same order, each
// rounded once (__f*_rn: never contracted into an FMA).
//
// A block of kBlockValues values is split into kParts parts of kPartValues values; one thread decodes
// one part. A part's values sit at kRuns runs of kRunLength consecutive positions of the block:
//
//   run_start(part, r)                    block position of the first value of run r
//   codes(block, part, q[kPartValues], scale[kRuns], bias[kRuns])
//                                         the value at run_start(part, r) + i is, in exact arithmetic,
//                                         scale[r] * q[r * kRunLength + i] + bias[r]: q are the block's
//                                         small integers as floats (exact; the float formats' own values
//                                         with scale 1), kBias says whether any bias is nonzero
//   decode_part<W>(block, part, w)        the values, as the reference rounds them: fl(fl(scale q) + bias)
//
// The GEMV sums q * x per run and applies scale and bias once per run; the dequantizers use decode_part.
//
// The parts are numbered so that parts [c * kPartsPer128, (c + 1) * kPartsPer128) of a row (counted
// block by block) hold exactly its values [128 c, 128 c + 128): the prefill GEMM dequantizes 128-wide
// tiles part by part. Runs are 4 or 8 values starting at multiples of 4, so activations load as float4.
//
// Alignment: a weight matrix is uploaded as uint8 [n_out, row_bytes] into an allocation aligned to 256
// bytes, so block b of any row starts at a multiple of kAlign = gcd(kBlockBytes, 16) bytes; every load
// below relies on that alignment only. F32/F16/BF16 rows are cut into pseudo-blocks of 32 values (the
// matrix kernels need n_in % 32 == 0 for them).
#pragma once

#include "common/common.cuh"

namespace cupyllm {

// ---- aligned loads ---------------------------------------------------------------------------------

__device__ __forceinline__ u32 load_u32_4aligned(const u8* p) { return *reinterpret_cast<const u32*>(p); }

// 4 bytes at a 2-byte aligned address, little-endian.
template <int kAlign>
__device__ __forceinline__ u32 load_u32(const u8* p) {
    if constexpr (kAlign >= 4) {
        return load_u32_4aligned(p);
    } else {
        static_assert(kAlign == 2, "blocks are at least 2-byte aligned");
        return load_u32_2aligned(p);
    }
}

// Small integers to float, exactly (|q| < 2^22), with two full-rate ALU operations instead of the
// quarter-rate I2F conversion: the bits of 1.5 * 2^23 + q, minus 1.5 * 2^23.
__device__ __forceinline__ float small_int_to_float(int q) {
    return __fsub_rn(__uint_as_float(0x4B400000u + static_cast<u32>(q)), 12582912.0f);
}

// Nibble k (0..7) of a little-endian word: byte k / 2, low nibble for even k.
__device__ __forceinline__ int nibble(u32 word, int k) { return static_cast<int>((word >> (4 * k)) & 0xFu); }
__device__ __forceinline__ int byte_of(u32 word, int k) { return static_cast<int>((word >> (8 * k)) & 0xFFu); }

// ---- float pseudo-blocks: 32 values, 4 parts of 8 consecutive values -------------------------------

struct WF32 {
    static constexpr int kBlockValues = 32, kBlockBytes = 128, kAlign = 16;
    static constexpr int kParts = 4, kPartValues = 8, kRuns = 1, kRunLength = 8;
    static constexpr bool kBias = false, kPlain = true;  // the values themselves, scale 1
    __device__ static int run_start(int part, int) { return 8 * part; }
    __device__ static void codes(const u8* block, int part, float (&w)[8], float (&scale)[1], float (&bias)[1]) {
        const float4* p = reinterpret_cast<const float4*>(block + 32 * part);
        const float4 a = p[0], b = p[1];
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
        scale[0] = 1.0f;
        bias[0] = 0.0f;
    }
};

struct WF16 {
    static constexpr int kBlockValues = 32, kBlockBytes = 64, kAlign = 16;
    static constexpr int kParts = 4, kPartValues = 8, kRuns = 1, kRunLength = 8;
    static constexpr bool kBias = false, kPlain = true;  // the values themselves, scale 1
    __device__ static int run_start(int part, int) { return 8 * part; }
    __device__ static void codes(const u8* block, int part, float (&w)[8], float (&scale)[1], float (&bias)[1]) {
        const uint4 v = *reinterpret_cast<const uint4*>(block + 16 * part);
        const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[2 * i] = f16_bits_to_float(static_cast<u16>(words[i] & 0xFFFFu));
            w[2 * i + 1] = f16_bits_to_float(static_cast<u16>(words[i] >> 16));
        }
        scale[0] = 1.0f;
        bias[0] = 0.0f;
    }
};

struct WBF16 {
    static constexpr int kBlockValues = 32, kBlockBytes = 64, kAlign = 16;
    static constexpr int kParts = 4, kPartValues = 8, kRuns = 1, kRunLength = 8;
    static constexpr bool kBias = false, kPlain = true;  // the values themselves, scale 1
    __device__ static int run_start(int part, int) { return 8 * part; }
    __device__ static void codes(const u8* block, int part, float (&w)[8], float (&scale)[1], float (&bias)[1]) {
        const uint4 v = *reinterpret_cast<const uint4*>(block + 16 * part);
        const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[2 * i] = __uint_as_float(words[i] << 16);
            w[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
        }
        scale[0] = 1.0f;
        bias[0] = 0.0f;
    }
};

// ---- llama.cpp 32-value blocks: 4 parts ----------------------------------------------------------------

// block_q8_0 {f16 d; i8 qs[32]}: part p = values 8p .. 8p+7; w = q * d.
struct WQ8_0 {
    static constexpr int kBlockValues = 32, kBlockBytes = 34, kAlign = 2;
    static constexpr int kParts = 4, kPartValues = 8, kRuns = 1, kRunLength = 8;
    __device__ static int run_start(int part, int) { return 8 * part; }
    static constexpr bool kBias = false, kPlain = false;
    __device__ static void codes(const u8* block, int part, float (&q)[8], float (&scale)[1], float (&bias)[1]) {
        float lo[4], hi[4];  // the int8 as (q + 128) - 128: the byte with its sign bit flipped
        bytes_as_floats<128>(load_u32<kAlign>(block + 2 + 8 * part) ^ 0x80808080u, lo);
        bytes_as_floats<128>(load_u32<kAlign>(block + 6 + 8 * part) ^ 0x80808080u, hi);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = lo[i];
            q[4 + i] = hi[i];
        }
        scale[0] = f16_bits_to_float(load_u16(block));
        bias[0] = 0.0f;
    }
};

// The 4-bit 32-value blocks share the layout of qs: value j < 16 is the low nibble of qs[j], value
// j + 16 the high nibble. Part p takes qs[4p .. 4p+3]: runs at 4p (low nibbles) and 16 + 4p (high).
struct NibblePairParts {
    static constexpr int kBlockValues = 32;
    static constexpr int kParts = 4, kPartValues = 8, kRuns = 2, kRunLength = 4;
    __device__ static int run_start(int part, int run) { return 16 * run + 4 * part; }
    // q[r * 4 + i]: the 4-bit codes of the part (run r = 0 low nibbles, 1 high nibbles)
    __device__ static void nibble_codes(u32 qs, int (&q)[8]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = nibble(qs, 2 * i);
            q[4 + i] = nibble(qs, 2 * i + 1);
        }
    }
    // the same codes minus kOffset as floats (nibbles_as_floats: no per-value extraction and conversion)
    template <int kOffset>
    __device__ static void nibble_floats(u32 qs, float (&q)[8]) {
        float f[8];
        nibbles_as_floats<kOffset>(qs, f);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = f[2 * i];
            q[4 + i] = f[2 * i + 1];
        }
    }
    // 5th bits: bit j of the little-endian u32 qh is bit 4 of value j.
    __device__ static void add_fifth_bits(u32 qh, int part, int (&q)[8]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] |= static_cast<int>((qh >> (4 * part + i)) & 1u) << 4;
            q[4 + i] |= static_cast<int>((qh >> (16 + 4 * part + i)) & 1u) << 4;
        }
    }
};

// block_q4_0 {f16 d; u8 qs[16]}: w = (q - 8) * d.
struct WQ4_0 : NibblePairParts {
    static constexpr int kBlockBytes = 18, kAlign = 2;
    static constexpr bool kBias = false, kPlain = false;
    __device__ static void codes(const u8* block, int part, float (&q)[8], float (&scale)[2], float (&bias)[2]) {
        nibble_floats<8>(load_u32<kAlign>(block + 2 + 4 * part), q);
        scale[0] = scale[1] = f16_bits_to_float(load_u16(block));
        bias[0] = bias[1] = 0.0f;
    }
};

// block_q4_1 {f16 d; f16 m; u8 qs[16]}: w = q * d + m (two roundings, as NumPy).
struct WQ4_1 : NibblePairParts {
    static constexpr int kBlockBytes = 20, kAlign = 4;
    static constexpr bool kBias = true, kPlain = false;
    __device__ static void codes(const u8* block, int part, float (&q)[8], float (&scale)[2], float (&bias)[2]) {
        nibble_floats<0>(load_u32<kAlign>(block + 4 + 4 * part), q);
        scale[0] = scale[1] = f16_bits_to_float(load_u16(block));
        bias[0] = bias[1] = f16_bits_to_float(load_u16(block + 2));
    }
};

// block_q5_0 {f16 d; u8 qh[4]; u8 qs[16]}: w = (q - 16) * d.
struct WQ5_0 : NibblePairParts {
    static constexpr int kBlockBytes = 22, kAlign = 2;
    static constexpr bool kBias = false, kPlain = false;
    __device__ static void codes(const u8* block, int part, float (&q)[8], float (&scale)[2], float (&bias)[2]) {
        int n[8];
        nibble_codes(load_u32<kAlign>(block + 6 + 4 * part), n);
        add_fifth_bits(load_u32<kAlign>(block + 2), part, n);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = small_int_to_float(n[i] - 16);
        scale[0] = scale[1] = f16_bits_to_float(load_u16(block));
        bias[0] = bias[1] = 0.0f;
    }
};

// block_q5_1 {f16 d; f16 m; u8 qh[4]; u8 qs[16]}: w = q * d + m.
struct WQ5_1 : NibblePairParts {
    static constexpr int kBlockBytes = 24, kAlign = 8;
    static constexpr bool kBias = true, kPlain = false;
    __device__ static void codes(const u8* block, int part, float (&q)[8], float (&scale)[2], float (&bias)[2]) {
        int n[8];
        nibble_codes(load_u32<kAlign>(block + 8 + 4 * part), n);
        add_fifth_bits(load_u32<kAlign>(block + 4), part, n);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = small_int_to_float(n[i]);
        scale[0] = scale[1] = f16_bits_to_float(load_u16(block));
        bias[0] = bias[1] = f16_bits_to_float(load_u16(block + 2));
    }
};

// ---- k-quants: 256-value super-blocks, 16 parts ---------------------------------------------------------

// 6-bit (scale, min) of sub-block j from the 12 packed bytes (llama.cpp get_scale_min_k4).
__device__ __forceinline__ void k4_scale_min(const u8* scales, int j, int& sc, int& mn) {
    if (j < 4) {
        sc = scales[j] & 63;
        mn = scales[j + 4] & 63;
    } else {
        sc = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
        mn = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
}

// Q4_K / Q5_K parts: part p (g = p / 4, c = p % 4) holds run 0 = values 64g + 8c .. +7 (sub-block 2g,
// low nibbles of qs[32g + 8c ..]) and run 1 = values 64g + 32 + 8c .. +7 (sub-block 2g + 1, high nibbles).
struct KQuantParts {
    static constexpr int kBlockValues = 256;
    static constexpr int kParts = 16, kPartValues = 16, kRuns = 2, kRunLength = 8;
    __device__ static int run_start(int part, int run) { return 64 * (part >> 2) + 32 * run + 8 * (part & 3); }
    static constexpr bool kBias = true, kPlain = false;
    // w = d_sub * q - m_sub with d_sub = d * sc, m_sub = dmin * mn (llama.cpp's order, each rounded): the
    // codes as floats, scale = d_sub and bias = -m_sub per run
    __device__ static void run_scales(const u8* block, int part, float (&scale)[2], float (&bias)[2]) {
        const float d = f16_bits_to_float(load_u16(block));
        const float dmin = f16_bits_to_float(load_u16(block + 2));
#pragma unroll
        for (int run = 0; run < 2; ++run) {
            int sc, mn;
            k4_scale_min(block + 4, 2 * (part >> 2) + run, sc, mn);
            scale[run] = __fmul_rn(d, small_int_to_float(sc));
            bias[run] = -__fmul_rn(dmin, small_int_to_float(mn));
        }
    }
    __device__ static void run_codes(const u8* block, int part, const int (&n)[16], float (&q)[16],
                                     float (&scale)[2], float (&bias)[2]) {
        run_scales(block, part, scale, bias);
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = small_int_to_float(n[i]);
    }
};

// block_q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}
struct WQ4_K : KQuantParts {
    static constexpr int kBlockBytes = 144, kAlign = 16;
    __device__ static void codes(const u8* block, int part, float (&q)[16], float (&scale)[2], float (&bias)[2]) {
        const uint2 qs = *reinterpret_cast<const uint2*>(block + 16 + 32 * (part >> 2) + 8 * (part & 3));
        float fx[8], fy[8];  // nibble k of qs.x / qs.y
        nibbles_as_floats<0>(qs.x, fx);
        nibbles_as_floats<0>(qs.y, fy);
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // low nibbles: run 0, high nibbles: run 1
            q[i] = fx[2 * i];
            q[4 + i] = fy[2 * i];
            q[8 + i] = fx[2 * i + 1];
            q[12 + i] = fy[2 * i + 1];
        }
        run_scales(block, part, scale, bias);
    }
};

// block_q5_K {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: bit s of qh[k] is bit 4 of
// value 32 s + k.
struct WQ5_K : KQuantParts {
    static constexpr int kBlockBytes = 176, kAlign = 16;
    __device__ static void integers(const u8* block, int part, int (&q)[16]) {
        const int g = part >> 2, c = part & 3;
        const uint2 qs = *reinterpret_cast<const uint2*>(block + 48 + 32 * g + 8 * c);
        const uint2 qh = *reinterpret_cast<const uint2*>(block + 16 + 8 * c);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int h_lo = byte_of(qh.x, i), h_hi = byte_of(qh.y, i);  // qh[8c + i], qh[8c + 4 + i]
            q[i] = nibble(qs.x, 2 * i) | (((h_lo >> (2 * g)) & 1) << 4);
            q[4 + i] = nibble(qs.y, 2 * i) | (((h_hi >> (2 * g)) & 1) << 4);
            q[8 + i] = nibble(qs.x, 2 * i + 1) | (((h_lo >> (2 * g + 1)) & 1) << 4);
            q[12 + i] = nibble(qs.y, 2 * i + 1) | (((h_hi >> (2 * g + 1)) & 1) << 4);
        }
    }
    __device__ static void codes(const u8* block, int part, float (&q)[16], float (&scale)[2], float (&bias)[2]) {
        int n[16];
        integers(block, part, n);
        run_codes(block, part, n, q, scale, bias);
    }
};

// block_q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}. In half h (values 128h ..), for l < 32:
//   value 128h + l      = ql[64h + l] & 15      | (qh[32h + l] >> 0 & 3) << 4
//   value 128h + 32 + l = ql[64h + 32 + l] & 15 | (qh[32h + l] >> 2 & 3) << 4
//   value 128h + 64 + l = ql[64h + l] >> 4      | (qh[32h + l] >> 4 & 3) << 4
//   value 128h + 96 + l = ql[64h + 32 + l] >> 4 | (qh[32h + l] >> 6 & 3) << 4
// minus 32, times d * scales[value / 16]. Part p (h = p / 8, l0 = 4 (p % 8)) takes l = l0 .. l0 + 3
// of all four rows: runs at 128h + 32r + l0.
struct WQ6_K {
    static constexpr int kBlockValues = 256, kBlockBytes = 210, kAlign = 2;
    static constexpr int kParts = 16, kPartValues = 16, kRuns = 4, kRunLength = 4;
    __device__ static int run_start(int part, int run) { return 128 * (part >> 3) + 32 * run + 4 * (part & 7); }
    static constexpr bool kBias = false, kPlain = false;
    __device__ static void codes(const u8* block, int part, float (&q)[16], float (&scale)[4], float (&bias)[4]) {
        const int h = part >> 3, l0 = 4 * (part & 7);
        const u32 ql_a = load_u32<kAlign>(block + 64 * h + l0);
        const u32 ql_b = load_u32<kAlign>(block + 64 * h + 32 + l0);
        const u32 qh = load_u32<kAlign>(block + 128 + 32 * h + l0);
        const float d = f16_bits_to_float(load_u16(block + 208));
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const u32 ql = (r & 1) ? ql_b : ql_a;
            const int sc = static_cast<i8>(block[192 + 8 * h + 2 * r + (l0 >= 16)]);
            scale[r] = __fmul_rn(d, small_int_to_float(sc));  // d_sub
            bias[r] = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int low = (r < 2) ? nibble(ql, 2 * i) : nibble(ql, 2 * i + 1);
                const int high = (byte_of(qh, i) >> (2 * r)) & 3;
                q[4 * r + i] = small_int_to_float((low | (high << 4)) - 32);
            }
        }
    }
};

// ---- helpers shared by the matrix kernels ------------------------------------------------------------

// The values of a part as the NumPy reference rounds them: fl(fl(scale * q) + bias) per run (the float formats'
// values as they are: no multiply by 1, which -ftz would flush for f32 subnormals).
template <class W>
__device__ __forceinline__ void decode_part(const u8* block, int part, float (&w)[W::kPartValues]) {
    float q[W::kPartValues], scale[W::kRuns], bias[W::kRuns];
    W::codes(block, part, q, scale, bias);
#pragma unroll
    for (int i = 0; i < W::kPartValues; ++i) {
        const int run = i / W::kRunLength;
        if constexpr (W::kPlain) {
            w[i] = q[i];
        } else if constexpr (W::kBias) {
            w[i] = __fadd_rn(__fmul_rn(scale[run], q[i]), bias[run]);
        } else {
            w[i] = __fmul_rn(scale[run], q[i]);
        }
    }
}

template <class W>
struct PartGeometry {
    static constexpr int kPartsPer128 = 128 * W::kParts / W::kBlockValues;
    static_assert(W::kPartValues == W::kRuns * W::kRunLength, "a part is its runs");
    static_assert(W::kRunLength % 4 == 0, "runs load as float4");
};

// Part `global_part` of a row (parts counted block by block): its block and the part within it.
template <class W>
__device__ __forceinline__ const u8* part_block(const u8* row, int global_part, int& part) {
    part = global_part % W::kParts;
    return row + static_cast<size_t>(global_part / W::kParts) * W::kBlockBytes;
}

// Row position of value k of a part.
template <class W>
__device__ __forceinline__ int part_value_column(int global_part, int k) {
    const int block = global_part / W::kParts, part = global_part % W::kParts;
    return block * W::kBlockValues + W::run_start(part, k / W::kRunLength) + k % W::kRunLength;
}

}  // namespace cupyllm
