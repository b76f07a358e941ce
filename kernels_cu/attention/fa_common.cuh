// Pieces shared by the flash-attention kernels (fa_vec.cuh, fa_mma.cuh, fa_combine.cu): reading 8 values of
// a cached row at a time (Chunk8), the runtime KV-format dispatch (with_format / read_chunk), staging raw
// cache rows in shared memory with cp.async (StagedRows / stage_rows), the attention mask and key ranges.
//
// Semantics (cupyllm/attention/reference.py): for query row (i, h) and cache slot j,
//   s = (q_i . k_j) * scale; s = softcap * tanh(s / softcap) if softcap > 0;
//   s += mask[i, j] if a mask is given (mask_stride > 0: float32 [n_q, mask_stride], indexed by slot);
//   key j is used iff 0 <= pos_j <= pos_i and (window == 0, or pos_i - pos_j < window when window > 0, or
//   pos_i - pos_j >= -window when window < 0: the complement, a mixed-type cache's tail, cupyllm/kv/window.py), with
//   pos_j = slot_pos[j] (int32, -1: an empty slot) and pos_i = q_pos[i] (int32);
//   O = softmax(s) V, LSE = log sum_j exp(s_j) (natural log); a row with no usable key: O = 0, LSE = -inf.
// The kernels see Q already multiplied by `scale` and, for rotated K formats, rotated (fa_prep_q); with a
// rotated V format O comes out rotated and fa_combine unrotates it.
//
// Layouts: cache [n_slots, n_kv, row_bytes] uint8 (cupyllm/kv), Q [n_q, n_head, D], O [n_q, n_head, D],
// LSE [n_q, n_head]. Query head h reads KV head h / (n_head / n_kv). Split results ("partials"):
// O_part [n_split, n_q, n_head, D] (each normalised by its own sum) and LSE_part [n_split, n_q, n_head];
// fa_combine merges them exactly as reference.merge does.
#pragma once

#include "kv_formats/kv_formats.cuh"
#include "common/mma.cuh"

namespace cupyllm {

constexpr int kFaThreads = 128;  // every flash-attention block: 4 warps

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---- 8 consecutive values of a row: Chunk8<Fmt>::read(row, c, table, v) gives values 8c .. 8c+7 ------
// Bit-identical to load_kv_value<Fmt> (kv_formats.cuh) value by value; written per format so that the
// bytes of a chunk are read once (scale/norm once per chunk, codes with a few wide loads).
// Row alignment: f32/f16/bf16 rows must be 16-byte aligned (they are: head_dim >= 64); block formats
// need only their blocks' 2-byte alignment.

template <class Fmt>
struct Chunk8 {  // any format: value by value through kv_formats.cuh
    __device__ static void read(const u8* row, int c, const float* table, float (&v)[8]) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = load_kv_value<Fmt>(row, 8 * c + i, table);
    }
};

template <>
struct Chunk8<FmtF32> {
    __device__ static void read(const u8* row, int c, const float*, float (&v)[8]) {
        const float4 a = reinterpret_cast<const float4*>(row)[2 * c];
        const float4 b = reinterpret_cast<const float4*>(row)[2 * c + 1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
};

template <>
struct Chunk8<FmtF16> {
    __device__ static void read(const u8* row, int c, const float*, float (&v)[8]) {
        const uint4 w = reinterpret_cast<const uint4*>(row)[c];  // one 16-byte load
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = f16_bits_to_float(static_cast<u16>(words[i] & 0xFFFFu));
            v[2 * i + 1] = f16_bits_to_float(static_cast<u16>(words[i] >> 16));
        }
    }
};

template <>
struct Chunk8<FmtBF16> {
    __device__ static void read(const u8* row, int c, const float*, float (&v)[8]) {
        const uint4 w = reinterpret_cast<const uint4*>(row)[c];
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = __uint_as_float(words[i] << 16);
            v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
        }
    }
};

// 8 bytes at a 2-byte aligned address, as two little-endian u32 words.
__device__ __forceinline__ void load_8_bytes_2aligned(const u8* p, u32& lo, u32& hi) {
    lo = load_u32_2aligned(p);
    hi = load_u32_2aligned(p + 4);
}

__device__ __forceinline__ int byte_of(u32 lo, u32 hi, int i) {  // byte i (0..7) of the pair lo, hi
    return static_cast<int>(((i < 4 ? lo : hi) >> (8 * (i & 3))) & 0xFFu);
}

// float(q - kOffset) for 0 <= q < 2^23, exactly, without an int->float conversion instruction (those run
// at a quarter of the FMA rate): 2^23 + q is the float whose mantissa bits are q, then one exact add.
template <int kOffset>
__device__ __forceinline__ float small_int_to_float(int q) {
    return __int_as_float(0x4B000000 | q) - (8388608.0f + static_cast<float>(kOffset));
}

template <>
struct Chunk8<FmtQ8_0> {  // {f16 d; i8 qs[32]}: chunk k of a block is qs[8k .. 8k+7]
    __device__ static void read(const u8* row, int c, const float*, float (&v)[8]) {
        const u8* block = row + (c >> 2) * FmtQ8_0::kBlockBytes;
        const float d = block_f16(block, 0);
        u32 lo, hi;
        load_8_bytes_2aligned(block + 2 + 8 * (c & 3), lo, hi);
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // the int8 q as (q + 128) - 128: the byte with its sign bit flipped
            v[i] = __fmul_rn(small_int_to_float<128>(byte_of(lo, hi, i) ^ 0x80), d);
        }
    }
};

// The 4-bit parts of a 32-value llama.cpp block: value j is the low nibble of qs[j] (j < 16) or the
// high nibble of qs[j - 16]. Chunk k (values 8k .. 8k+7) uses bytes qs[8 (k & 1) ..] and nibble k >> 1.
__device__ __forceinline__ void nibbles_of_chunk(const u8* qs, int k, int (&q)[8]) {
    u32 lo, hi;
    load_8_bytes_2aligned(qs + 8 * (k & 1), lo, hi);
    const int shift = (k >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = (byte_of(lo, hi, i) >> shift) & 0xF;
}

template <>
struct Chunk8<FmtQ4_0> {  // {f16 d; u8 qs[16]}: (q - 8) * d
    __device__ static void read(const u8* row, int c, const float*, float (&v)[8]) {
        const u8* block = row + (c >> 2) * FmtQ4_0::kBlockBytes;
        const float d = block_f16(block, 0);
        int q[8];
        nibbles_of_chunk(block + 2, c & 3, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(small_int_to_float<8>(q[i]), d);
    }
};

template <>
struct Chunk8<FmtQ4_1> {  // {f16 d; f16 m; u8 qs[16]}: d * q + m (two roundings)
    __device__ static void read(const u8* row, int c, const float*, float (&v)[8]) {
        const u8* block = row + (c >> 2) * FmtQ4_1::kBlockBytes;
        const float d = block_f16(block, 0), m = block_f16(block, 2);
        int q[8];
        nibbles_of_chunk(block + 4, c & 3, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fadd_rn(__fmul_rn(d, small_int_to_float<0>(q[i])), m);
    }
};

template <>
struct Chunk8<FmtQ5_0> {  // {f16 d; u32 qh; u8 qs[16]}: bit j of qh is bit 4 of q_j; (q - 16) * d
    __device__ static void read(const u8* row, int c, const float*, float (&v)[8]) {
        const u8* block = row + (c >> 2) * FmtQ5_0::kBlockBytes;
        const float d = block_f16(block, 0);
        const u32 high = load_u32_2aligned(block + 2) >> (8 * (c & 3));
        int q[8];
        nibbles_of_chunk(block + 6, c & 3, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int qi = q[i] | static_cast<int>(((high >> i) & 1u) << 4);
            v[i] = __fmul_rn(small_int_to_float<16>(qi), d);
        }
    }
};

template <>
struct Chunk8<FmtQ5_1> {  // {f16 d; f16 m; u32 qh; u8 qs[16]}: d * q + m
    __device__ static void read(const u8* row, int c, const float*, float (&v)[8]) {
        const u8* block = row + (c >> 2) * FmtQ5_1::kBlockBytes;
        const float d = block_f16(block, 0), m = block_f16(block, 2);
        const u32 high = load_u32_2aligned(block + 4) >> (8 * (c & 3));
        int q[8];
        nibbles_of_chunk(block + 8, c & 3, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int qi = q[i] | static_cast<int>(((high >> i) & 1u) << 4);
            v[i] = __fadd_rn(__fmul_rn(d, small_int_to_float<0>(qi)), m);
        }
    }
};

template <>
struct Chunk8<FmtQ6_0> {  // {f16 d; u8 qh[8]; u8 qs[16]}: high bits of e in qh[e % 8] (FmtQ6_0::high_shift)
    __device__ static void read(const u8* row, int c, const float*, float (&v)[8]) {
        const u8* block = row + (c >> 2) * FmtQ6_0::kBlockBytes;
        const float d = block_f16(block, 0);
        const int k = c & 3;
        const int shift = 2 * (2 * (k & 1) + (k >> 1));  // high_shift(8k + i), the same for all i
        u32 qh_lo, qh_hi;
        load_8_bytes_2aligned(block + 2, qh_lo, qh_hi);
        int q[8];
        nibbles_of_chunk(block + 10, k, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int qi = q[i] | (((byte_of(qh_lo, qh_hi, i) >> shift) & 3) << 4);
            v[i] = __fmul_rn(small_int_to_float<32>(qi), d);
        }
    }
};

// kBytes (<= 4) bytes from p as a little-endian word, read byte by byte (no alignment needed).
template <int kBytes>
__device__ __forceinline__ u32 load_bytes_le(const u8* p) {
    u32 w = 0;
#pragma unroll
    for (int i = 0; i < kBytes; ++i) w |= static_cast<u32>(p[i]) << (8 * i);
    return w;
}

// The flash-attention kernels' turbo table (gpu_kernels.kernel_table) is LEVELS followed by the pair table
// PAIRS[c1 * 2^b + c0] = (LEVELS[c0], LEVELS[c1]): two codes of a chunk index one 8-byte entry, so a chunk takes
// 4 lookups, not 8 (load_kv_value and kv_decode read LEVELS alone).
template <int kBits, int G>
struct Chunk8<FmtTurbo<kBits, G>> {  // {f16 norm; codes LSB first}: factor * LEVELS[code]
    using F = FmtTurbo<kBits, G>;
    __device__ static void read(const u8* row, int c, const float* table, float (&v)[8]) {
        constexpr int kChunksPerGroup = G / 8;
        const u8* block = row + (c / kChunksPerGroup) * F::kBlockBytes;
        const int k = c % kChunksPerGroup;
        const float factor = rotated_group_factor<G>(block);
        const u32 codes = load_bytes_le<kBits>(block + 2 + k * kBits);  // 8 codes = kBits whole bytes
        const float2* pairs = reinterpret_cast<const float2*>(table + F::kLevels);
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
            const float2 level = pairs[(codes >> (i * kBits)) & ((1u << (2 * kBits)) - 1u)];
            v[i] = __fmul_rn(factor, level.x);
            v[i + 1] = __fmul_rn(factor, level.y);
        }
    }
};

template <int kK, int kL, int G>
struct Chunk8<FmtTcq<kK, kL, G>> {  // state_t = kL-bit window at stream bit t * kK: factor * CODEBOOK[state]
    using F = FmtTcq<kK, kL, G>;
    static_assert(7 * kK + kL <= 32, "the 8 windows of a chunk fit one 32-bit word");
    __device__ static void read(const u8* row, int c, const float* table, float (&v)[8]) {
        constexpr int kChunksPerGroup = G / 8;
        const u8* block = row + (c / kChunksPerGroup) * F::kBlockBytes;
        const int k = c % kChunksPerGroup;
        const float factor = rotated_group_factor<G>(block);
        // windows 8k .. 8k+7 span stream bits [8k kK, 8k kK + 7 kK + kL): 4 bytes from byte k kK (the last
        // chunk may read a byte of the block's zero padding, never past the block)
        const u32 bits = load_bytes_le<4>(block + 2 + k * kK);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(factor, table[(bits >> (i * kK)) & ((1u << kL) - 1u)]);
    }
};

// ---- 8 consecutive values of a row as f16: Half8<Fmt>::read(row, c, table) -> uint4 -----------------------
// Four half2 words, value 8c + i in half i: what fa_mma's f16 tiles hold. Bit-identical to Chunk8's floats
// rounded to f16 (nearest even) for every format. The symmetric block formats (q8_0, q6_0, q5_0, q4_0)
// compute (u - offset) * d in f16 arithmetic, two values an instruction and no float conversion: for
// 0 <= u < 1024 the f16 with bits 0x6400 | u is 1024 + u, so u - offset comes out exact, and the product of
// the 11-bit d with an integer of at most 8 bits is exact in f32, so the f16 product rounded once (HMUL2) is
// Chunk8's f32 product rounded to f16. The affine formats (d * q + m, whose f32 sum may round before the f16
// rounding) take their integers the same way and sum in f32 (affine_f16_pair); the rotated ones (an f32 factor
// times an f32 table entry) round Chunk8's floats.
template <class Fmt>
struct Half8FromFloats {  // Chunk8's floats rounded: the definition, and the reader of the other formats
    __device__ static uint4 read(const u8* row, int c, const float* table) {
        float v[8];
        Chunk8<Fmt>::read(row, c, table, v);
        return make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]), pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
    }
};

template <class Fmt>
struct Half8 : Half8FromFloats<Fmt> {};

template <>
struct Half8<FmtF16> {
    __device__ static uint4 read(const u8* row, int c, const float*) { return reinterpret_cast<const uint4*>(row)[c]; }
};

// (u0 - kOffset, u1 - kOffset) * d in f16 for the pair 1024 + (u0, u1) (byte_pair_as_f16_mantissas).
template <int kOffset>
__device__ __forceinline__ u32 scale_f16_pair(u32 mantissas, __half2 d2) {
    return same_bits<u32>(__hmul2(mantissa_pair_minus<kOffset>(mantissas), d2));
}

// Four values u_i (bytes of lo: values 0-3, of hi: 4-7, each < 256) of a symmetric format as f16 (u_i - kOffset) * d.
template <int kOffset>
__device__ __forceinline__ uint4 scale_f16_bytes(u32 lo, u32 hi, u16 d_bits) {
    const __half2 d2 = __half2half2(__ushort_as_half(d_bits));
    return make_uint4(scale_f16_pair<kOffset>(byte_pair_as_f16_mantissas<false>(lo), d2),
                      scale_f16_pair<kOffset>(byte_pair_as_f16_mantissas<true>(lo), d2),
                      scale_f16_pair<kOffset>(byte_pair_as_f16_mantissas<false>(hi), d2),
                      scale_f16_pair<kOffset>(byte_pair_as_f16_mantissas<true>(hi), d2));
}

// The affine formats' f32 * u + m of the same four-and-four values u_i: u_i comes out of f16 exact (1024 + u
// less 1024) and one FMA rounds d * u_i + m once, which is Chunk8's sum of the product (exact in f32: 11 + 5
// bits) and m; then rounded to f16.
__device__ __forceinline__ u32 affine_f16_pair(u32 mantissas, float d, float m) {
    const float2 u = __half22float2(mantissa_pair_minus<0>(mantissas));
    return pack_half2(__fmaf_rn(d, u.x, m), __fmaf_rn(d, u.y, m));
}

__device__ __forceinline__ uint4 affine_f16_bytes(u32 lo, u32 hi, const u8* block) {
    const float d = block_f16(block, 0), m = block_f16(block, 2);
    return make_uint4(affine_f16_pair(byte_pair_as_f16_mantissas<false>(lo), d, m),
                      affine_f16_pair(byte_pair_as_f16_mantissas<true>(lo), d, m),
                      affine_f16_pair(byte_pair_as_f16_mantissas<false>(hi), d, m),
                      affine_f16_pair(byte_pair_as_f16_mantissas<true>(hi), d, m));
}

// The nibbles of chunk k of a 32-value block's qs (nibbles_of_chunk), one per byte: values 0-3 in lo, 4-7 in hi.
__device__ __forceinline__ void nibble_bytes_of_chunk(const u8* qs, int k, u32& lo, u32& hi) {
    load_8_bytes_2aligned(qs + 8 * (k & 1), lo, hi);
    const int shift = (k >> 1) * 4;
    lo = (lo >> shift) & 0x0F0F0F0Fu;
    hi = (hi >> shift) & 0x0F0F0F0Fu;
}

// Bits 0-3 of `bits` as bit 4 of bytes 0-3 (q5 blocks: the fifth bit of four values). The multiply places
// bit i at bit 8i + 4; the partial products do not overlap, so nothing carries.
__device__ __forceinline__ u32 spread_bits_to_bit4(u32 bits) {
    return ((bits & 0xFu) * 0x02040810u) & 0x10101010u;
}

template <>
struct Half8<FmtQ8_0> {  // (q + 128) - 128: the int8 with its sign bit flipped
    __device__ static uint4 read(const u8* row, int c, const float*) {
        const u8* block = row + (c >> 2) * FmtQ8_0::kBlockBytes;
        u32 lo, hi;
        load_8_bytes_2aligned(block + 2 + 8 * (c & 3), lo, hi);
        return scale_f16_bytes<128>(lo ^ 0x80808080u, hi ^ 0x80808080u, load_u16(block));
    }
};

template <>
struct Half8<FmtQ4_0> {
    __device__ static uint4 read(const u8* row, int c, const float*) {
        const u8* block = row + (c >> 2) * FmtQ4_0::kBlockBytes;
        u32 lo, hi;
        nibble_bytes_of_chunk(block + 2, c & 3, lo, hi);
        return scale_f16_bytes<8>(lo, hi, load_u16(block));
    }
};

// The 5-bit values of chunk k of a q5 block (nibbles at qs, fifth bits in the u32 at qh), one per byte.
__device__ __forceinline__ void five_bit_bytes_of_chunk(const u8* qh, const u8* qs, int k, u32& lo, u32& hi) {
    const u32 high = load_u32_2aligned(qh) >> (8 * k);
    nibble_bytes_of_chunk(qs, k, lo, hi);
    lo |= spread_bits_to_bit4(high);
    hi |= spread_bits_to_bit4(high >> 4);
}

template <>
struct Half8<FmtQ5_0> {
    __device__ static uint4 read(const u8* row, int c, const float*) {
        const u8* block = row + (c >> 2) * FmtQ5_0::kBlockBytes;
        u32 lo, hi;
        five_bit_bytes_of_chunk(block + 2, block + 6, c & 3, lo, hi);
        return scale_f16_bytes<16>(lo, hi, load_u16(block));
    }
};

template <>
struct Half8<FmtQ4_1> {
    __device__ static uint4 read(const u8* row, int c, const float*) {
        const u8* block = row + (c >> 2) * FmtQ4_1::kBlockBytes;
        u32 lo, hi;
        nibble_bytes_of_chunk(block + 4, c & 3, lo, hi);
        return affine_f16_bytes(lo, hi, block);
    }
};

template <>
struct Half8<FmtQ5_1> {
    __device__ static uint4 read(const u8* row, int c, const float*) {
        const u8* block = row + (c >> 2) * FmtQ5_1::kBlockBytes;
        u32 lo, hi;
        five_bit_bytes_of_chunk(block + 4, block + 8, c & 3, lo, hi);
        return affine_f16_bytes(lo, hi, block);
    }
};

template <>
struct Half8<FmtQ6_0> {
    __device__ static uint4 read(const u8* row, int c, const float*) {
        const u8* block = row + (c >> 2) * FmtQ6_0::kBlockBytes;
        const int k = c & 3;
        const int shift = 2 * (2 * (k & 1) + (k >> 1));  // FmtQ6_0::high_shift(8k + i), the same for all i
        u32 qh_lo, qh_hi, lo, hi;
        load_8_bytes_2aligned(block + 2, qh_lo, qh_hi);
        nibble_bytes_of_chunk(block + 10, k, lo, hi);
        // bits shift, shift + 1 of each qh byte (shift <= 6: they stay inside their byte) as bits 4, 5
        lo |= ((qh_lo >> shift) & 0x03030303u) << 4;
        hi |= ((qh_hi >> shift) & 0x03030303u) << 4;
        return scale_f16_bytes<32>(lo, hi, load_u16(block));
    }
};

// ---- runtime KV format ids ----------------------------------------------------------------------------
// The kernels are compiled once per head dim and read any K format with any V format: the format is a
// block-uniform runtime id, and only the reading is dispatched on it (FA-VEC: a jump table per chunk of 8
// values; fa_mma: one per staged tile, around its whole dequantizing loop), so the per-format code is the
// small reader while the arithmetic is shared. One instantiation per (head dim, K, V) would cost ~4 s of NVRTC
// time each, for 784 pairs.
// The ids are cupyllm.kv.formats.list_formats() order (cupyllm/attention/gpu_kernels.py FORMAT_IDS).
enum FaFormatId : int {
    kFaF32 = 0, kFaF16, kFaBF16, kFaQ8_0, kFaQ6_0, kFaQ5_1, kFaQ5_0, kFaQ4_1, kFaQ4_0,
    kFaTurbo4, kFaTurbo3, kFaTurbo2, kFaTurbo3Tcq, kFaTurbo2Tcq, kFaFormatCount
};

// Calls fn(Fmt{}) with the kv_formats.cuh type of format `id`; rotated formats use groups of G values.
template <int G, class Fn>
__device__ __forceinline__ void with_format(int id, Fn&& fn) {
    switch (id) {
        case kFaF32: fn(FmtF32{}); break;
        case kFaF16: fn(FmtF16{}); break;
        case kFaBF16: fn(FmtBF16{}); break;
        case kFaQ8_0: fn(FmtQ8_0{}); break;
        case kFaQ6_0: fn(FmtQ6_0{}); break;
        case kFaQ5_1: fn(FmtQ5_1{}); break;
        case kFaQ5_0: fn(FmtQ5_0{}); break;
        case kFaQ4_1: fn(FmtQ4_1{}); break;
        case kFaQ4_0: fn(FmtQ4_0{}); break;
        case kFaTurbo4: fn(FmtTurbo4<G>{}); break;
        case kFaTurbo3: fn(FmtTurbo3<G>{}); break;
        case kFaTurbo2: fn(FmtTurbo2<G>{}); break;
        case kFaTurbo3Tcq: fn(FmtTurbo3Tcq<G>{}); break;
        case kFaTurbo2Tcq: fn(FmtTurbo2Tcq<G>{}); break;
        default: __trap();  // the launcher validates ids; never reached
    }
}

// Values 8c .. 8c+7 of a row of format `id` (Chunk8 of that format). A functor, not a lambda: NVRTC
// treats lambdas in device code as host functions.
struct ReadChunk {
    const u8* row;
    int c;
    const float* table;
    float (&v)[8];
    template <class Fmt>
    __device__ void operator()(Fmt) const { Chunk8<Fmt>::read(row, c, table, v); }
};

template <int G>
__device__ __forceinline__ void read_chunk(int id, const u8* row, int c, const float* table, float (&v)[8]) {
    with_format<G>(id, ReadChunk{row, c, table, v});
}

template <template <class> class Reader>
struct ReadChunkF16 {  // Reader<Fmt> of the format
    const u8* row;
    int c;
    const float* table;
    uint4& out;
    template <class Fmt>
    __device__ void operator()(Fmt) const { out = Reader<Fmt>::read(row, c, table); }
};

// Values 8c .. 8c+7 of a row of format `id` as four half2 words (Half8 of that format; Half8FromFloats for the
// benchmark of the two).
template <int G, template <class> class Reader = Half8>
__device__ __forceinline__ uint4 read_chunk_f16(int id, const u8* row, int c, const float* table) {
    uint4 out;
    with_format<G>(id, ReadChunkF16<Reader>{row, c, table, out});
    return out;
}

// ---- raw rows staged in shared memory (cp.async) -----------------------------------------------------
// Row r of a cache (r = slot * n_kv + head) starts at byte r * row_bytes of a 16-byte aligned buffer,
// so rows are `align`-aligned, align = the largest power of two (<= 16) dividing row_bytes. Rows are
// copied in align-byte words; rows that are only 2-byte aligned (turbo at G = 128: 66, 50, 34 bytes) in
// the 4-byte words that cover them, placed so that row byte 0 lands at offset() in its slot.
// gpu_kernels.py mirrors slot_bytes (it sizes the shared memory).
struct StagedRows {
    int row_bytes, align, word_bytes, words, slot_bytes;

    __device__ static StagedRows of(int row_bytes) {
        StagedRows s;
        s.row_bytes = row_bytes;
        s.align = row_bytes % 16 == 0 ? 16 : row_bytes % 8 == 0 ? 8 : row_bytes % 4 == 0 ? 4 : 2;
        s.word_bytes = s.align >= 4 ? s.align : 4;
        s.words = s.align >= 4 ? row_bytes / s.word_bytes : (row_bytes + 2) / 4;
        // whole 16-byte units, and not a multiple of 128 bytes: threads reading the same offset of
        // consecutive rows then hit different banks
        const int slot = (s.words * s.word_bytes + 15) / 16 * 16;
        s.slot_bytes = slot % 128 == 0 ? slot + 16 : slot;
        return s;
    }
    __device__ int offset(long long row) const {  // where row byte 0 sits in its slot
        return align >= 4 ? 0 : static_cast<int>(row & 1) * 2;  // row_bytes = 2 mod 4, buffer 16-aligned
    }
};

// Rotated formats store groups of G = min(128, head_dim) values.
template <int D>
struct GroupOf { static constexpr int value = D < 128 ? D : 128; };

// ---- fa_mma's dequantizing pass: a staged tile of raw rows into f16 tiles ------------------------------------
// The rows j < kTile of a tile staged by stage_rows (rows (first + j) * n_kv + head of the cache) are read with
// Reader<Fmt> (Half8, or Half8FromFloats for bench/dequant_gpu.py) into
//   DequantRows:    dst[j * kStride + d], row-major (fa_mma's K tile);
//   DequantColumns: dst[d * kStride + j], transposed, stored as key pairs (fa_mma's V^T tile).
// Run through with_format(id, ...), so the format is resolved once per tile, not once per chunk.
struct StagedTile {  // the staged rows of a tile, where they came from and where their f16 values go
    const StagedRows& L;
    const u8* raw;
    __half* dst;
    long long first;
    int n_kv, head;
    const float* table;
    int tid;
};

template <int D, int kTile, int kStride, template <class> class Reader = Half8>
struct DequantRows : StagedTile {
    template <class Fmt>
    __device__ void operator()(Fmt) const {
        constexpr int kChunks = D / 8;
        for (int task = tid; task < kTile * kChunks; task += kFaThreads) {
            const int j = task / kChunks, c = task % kChunks;  // consecutive threads: consecutive chunks of a row
            const long long row = (first + j) * n_kv + head;
            *reinterpret_cast<uint4*>(dst + j * kStride + 8 * c) =
                Reader<Fmt>::read(raw + j * L.slot_bytes + L.offset(row), c, table);
        }
    }
};

template <int D, int kTile, int kStride, template <class> class Reader = Half8>
struct DequantColumns : StagedTile {
    template <class Fmt>
    __device__ void operator()(Fmt) const {
        constexpr int kChunks = D / 8;
        for (int task = tid; task < (kTile / 2) * kChunks; task += kFaThreads) {
            // consecutive threads: consecutive key pairs of one chunk, so the transposed 4-byte stores of a warp
            // fall in distinct banks; rows past the tile's end were zero-filled: they decode to 0
            const int p = task % (kTile / 2), c = task / (kTile / 2);
            const long long row = (first + 2 * p) * n_kv + head;
            const uint4 a = Reader<Fmt>::read(raw + (2 * p) * L.slot_bytes + L.offset(row), c, table);
            const uint4 b = Reader<Fmt>::read(raw + (2 * p + 1) * L.slot_bytes + L.offset(row + n_kv), c, table);
            const u32 wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // dims 8c + 2i, 8c + 2i + 1: the low, then the high halves of both keys
                *reinterpret_cast<u32*>(dst + (8 * c + 2 * i) * kStride + 2 * p) = __byte_perm(wa[i], wb[i], 0x5410);
                *reinterpret_cast<u32*>(dst + (8 * c + 2 * i + 1) * kStride + 2 * p) = __byte_perm(wa[i], wb[i], 0x7632);
            }
        }
    }
};

// The (row j, word w) copies of a staged tile, thread tid taking tasks tid, tid + kFaThreads, ... of the
// row-major task list: one division per tile, then each step carries the word over into the row (a division
// by the runtime word count per copy cost ~20 instructions).
struct TileWalk {
    int j, w, dj, dw, words;
    __device__ TileWalk(int words_per_row, int tid) : words(words_per_row) {
        j = tid / words;
        w = tid - j * words;
        dj = kFaThreads / words;
        dw = kFaThreads - dj * words;
    }
    __device__ void next() {
        j += dj;
        w += dw;
        if (w >= words) {
            w -= words;
            ++j;
        }
    }
};

template <int kWordBytes>
__device__ __forceinline__ void stage_words(const StagedRows& L, u8* smem, const u8* cache, long long first_slot,
                                            int n_rows_tile, int n_valid, int n_kv, int head, int tid) {
    for (TileWalk walk(L.words, tid); walk.j < n_rows_tile; walk.next()) {
        const int j = walk.j, w = walk.w;
        const bool valid = j < n_valid;
        const u8* src = cache + ((first_slot + j) * n_kv + head) * L.row_bytes + w * kWordBytes;
        cp_async<kWordBytes>(smem + j * L.slot_bytes + w * kWordBytes, valid ? src : cache, valid);
    }
}

// Issue the copies of rows `first_slot + j` (j < n_rows_tile) of KV head `head` into smem slots j;
// slots j >= n_valid are zero-filled (zero bytes decode to 0 in every format). `n_cache_rows` =
// n_slots * n_kv: the covering words of the very last row must not read past the buffer.
__device__ __forceinline__ void stage_rows(const StagedRows& L, u8* smem, const u8* cache, long long first_slot,
                                           int n_rows_tile, int n_valid, int n_kv, int head,
                                           long long n_cache_rows, int tid) {
    switch (L.align) {
        case 16: stage_words<16>(L, smem, cache, first_slot, n_rows_tile, n_valid, n_kv, head, tid); return;
        case 8: stage_words<8>(L, smem, cache, first_slot, n_rows_tile, n_valid, n_kv, head, tid); return;
        case 4: stage_words<4>(L, smem, cache, first_slot, n_rows_tile, n_valid, n_kv, head, tid); return;
        default: break;
    }
    for (TileWalk walk(L.words, tid); walk.j < n_rows_tile; walk.next()) {
        const int j = walk.j, w = walk.w;
        const bool valid = j < n_valid;
        const long long row = (first_slot + j) * n_kv + head;
        const u8* word = cache + row * L.row_bytes - L.offset(row) + 4 * w;
        u8* dst = smem + j * L.slot_bytes + 4 * w;
        if (valid && w == L.words - 1 && L.offset(row) == 0 && row == n_cache_rows - 1) {
            *reinterpret_cast<u16*>(dst) = load_u16(word);  // the last 2 bytes of the buffer
        } else {
            cp_async<4>(dst, valid ? word : cache, valid);
        }
    }
}

// ---- mask ------------------------------------------------------------------------------------------------
__device__ __forceinline__ bool key_visible(long long key_pos, long long query_pos, int window) {
    return key_pos >= 0 && key_pos <= query_pos &&
           (window == 0 || (window > 0 ? query_pos - key_pos < window : query_pos - key_pos >= -window));
}

__device__ __forceinline__ float apply_softcap(float s, float softcap) {
    return softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
}

// Key range [begin, end) of one split. When slot j holds position j (a non-ring cache), keys after the
// last query position or before the window of the first one are all masked: skip them (with a negative
// window, the complement, keys within -window positions of the last query are masked too).
struct KeyRange {
    int begin, end;
};

__device__ __forceinline__ KeyRange split_key_range(int split, int keys_per_split, int n_keys, bool slots_are_positions,
                                                    long long min_qpos, long long max_qpos, int window) {
    long long begin = static_cast<long long>(split) * keys_per_split;
    long long end = min(static_cast<long long>(n_keys), begin + keys_per_split);
    if (slots_are_positions) {
        end = min(end, max_qpos + 1);
        if (window > 0) begin = max(begin, min_qpos - window + 1);
        if (window < 0) end = min(end, max_qpos + window + 1);
    }
    return KeyRange{static_cast<int>(begin), static_cast<int>(max(begin, end))};
}

// ---- Dual Chunk Attention: the query rotation of each (query, key) pair (cupyllm/attention/dca.py) ----------
// The DCA instantiations (kDca = true) read Q in three rotations, Q [3][n_q][n_head][D] (intra, successive,
// inter, each scaled and, for rotated K formats, rotated by fa_prep_q), and score key j for query i with
//   regime = min(chunk(pos_i) - chunk(pos_j), 2),  chunk(p) = p / chunk_len   (true positions, slot_pos),
// everything else (mask, softcap, online softmax, P V, splits, combine) unchanged: one pass over the keys,
// one softmax. Per key tile the kernels make one pass per regime the tile can hold (a bit mask computed
// by every warp alike, so block-uniform): a tile within one chunk, the common case, costs one pass with
// the Q of that regime; a tile across a chunk boundary costs two, each keeping only its regime's scores.
constexpr int kDcaRegimes = 3;

// The query rows of one block as DCA sees them: chunks [chunk_lo, chunk_hi] of the rows that have a
// position, the largest position (chunk_hi = -1: no row sees any key).
struct DcaRows {
    int chunk_len, chunk_lo, chunk_hi, pos_hi;
};

__device__ __forceinline__ int dca_chunk(int pos, int chunk_len) { return pos >= 0 ? pos / chunk_len : -1; }

__device__ __forceinline__ int dca_regime(int query_chunk, int key_chunk) {
    return min(query_chunk - key_chunk, 2);
}

// The regimes of every key in chunks [c_lo, c_hi] with the rows of `rows` (the union over those chunks: the
// regime falls as the key chunk rises, so it is one run of bits).
__device__ __forceinline__ u32 dca_chunk_span_regimes(int c_lo, int c_hi, const DcaRows& rows) {
    if (rows.chunk_hi < 0 || c_lo > rows.chunk_hi) return 0u;  // no row, or keys past every row's chunk
    c_hi = min(c_hi, rows.chunk_hi);
    const int lo = min(max(rows.chunk_lo - c_hi, 0), 2), hi = min(rows.chunk_hi - c_lo, 2);
    return ((2u << hi) - 1u) & ~((1u << lo) - 1u);
}

// The regimes (bit r: regime r) key `key_pos` can take with the rows of `rows`: a superset of those of its
// visible (row, key) pairs, exact when the rows share one chunk (decode).
__device__ __forceinline__ u32 dca_key_regimes(int key_pos, const DcaRows& rows) {
    if (key_pos < 0 || key_pos > rows.pos_hi) return 0u;  // no row sees it
    const int key_chunk = key_pos / rows.chunk_len;
    return dca_chunk_span_regimes(key_chunk, key_chunk, rows);
}

// The regimes of the first n_valid keys of a tile (positions `pos`), the same in every warp.
__device__ __forceinline__ u32 dca_tile_regimes(const int* pos, int n_valid, const DcaRows& rows, int lane) {
    u32 bits = 0u;
    for (int j = lane; j < n_valid; j += 32) bits |= dca_key_regimes(pos[j], rows);
    return warp_or(bits);
}

// The regimes of consecutive key tiles when slot j holds position j (or is empty): a tile of slots
// [first, last] can only hold keys of chunks chunk(first) .. chunk(last). Walks the chunk boundaries along
// the split's tiles (first never decreases), so a tile costs a few uniform integer ops instead of a
// division and a warp reduction over its positions (dca_tile_regimes): DCA's per-tile overhead.
struct DcaChunkWalk {
    int chunk_len, chunk, boundary;  // chunk of the current tile's first slot, the first slot of the next chunk

    __device__ __forceinline__ static DcaChunkWalk at(int first, int chunk_len) {
        const int c = max(first, 0) / chunk_len;
        return DcaChunkWalk{chunk_len, c, (c + 1) * chunk_len};
    }
    __device__ __forceinline__ u32 regimes(int first, int last, const DcaRows& rows) {
        while (first >= boundary) {  // one step per chunk boundary passed (more only for chunks under a tile)
            ++chunk;
            boundary += chunk_len;
        }
        const int c_hi = last < boundary ? chunk : (last < boundary + chunk_len ? chunk + 1 : last / chunk_len);
        return dca_chunk_span_regimes(chunk, c_hi, rows);
    }
    // The regimes of the tile at slot `first` (n_valid keys, positions `pos`): from its slot range when slots
    // hold their positions, else from the positions themselves (rings).
    __device__ __forceinline__ u32 tile(bool slots_are_positions, const int* pos, int first, int n_valid,
                                        const DcaRows& rows, int lane) {
        return slots_are_positions ? regimes(first, first + n_valid - 1, rows)
                                   : dca_tile_regimes(pos, n_valid, rows, lane);
    }
};

// The next regime to run of the (nonzero) set `todo`: `loaded` when present (its Q is in place), else the lowest.
__device__ __forceinline__ int dca_next_regime(u32 todo, int loaded) {
    return loaded >= 0 && ((todo >> loaded) & 1u) != 0u ? loaded : __ffs(static_cast<int>(todo)) - 1;
}

// DcaRows of `n_rows` row positions (-1: a row without position); one thread calls it.
__device__ __forceinline__ DcaRows dca_rows_of(const long long* row_qpos, int n_rows, int chunk_len) {
    int lo = -1, hi = -1;
    for (int r = 0; r < n_rows; ++r) {
        const int p = static_cast<int>(row_qpos[r]);
        if (p < 0) continue;
        lo = lo < 0 ? p : min(lo, p);
        hi = max(hi, p);
    }
    return DcaRows{chunk_len, dca_chunk(lo, chunk_len), dca_chunk(hi, chunk_len), hi};
}

// What the split's key range (split_key_range) and, for DCA, a tile's regimes need of the block's rows: the
// range [lo, hi] of their positions into qpos_range and their DcaRows. One thread calls it.
template <bool kDca>
__device__ __forceinline__ void summarize_rows(const long long* row_qpos, int rows_here, int dca_chunk_len,
                                               long long* qpos_range, DcaRows* dca_rows) {
    long long lo = row_qpos[0], hi = row_qpos[0];
    for (int r = 1; r < rows_here; ++r) {
        lo = min(lo, row_qpos[r]);
        hi = max(hi, row_qpos[r]);
    }
    qpos_range[0] = lo;
    qpos_range[1] = hi;
    if constexpr (kDca) *dca_rows = dca_rows_of(row_qpos, rows_here, dca_chunk_len);
}

__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_out(__half* p, float v) { *p = __float2half_rn(v); }

// Row r (0 <= r < n_q * group) of KV head kh: query r / group, head kh * group + r % group.
struct RowIndex {
    int query, head;
};
__device__ __forceinline__ RowIndex row_index(int r, int group, int kh) {
    return RowIndex{r / group, kh * group + r % group};
}

}  // namespace cupyllm
