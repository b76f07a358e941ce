// Encode on append: quantize n new tokens' K and V rows and scatter them into their caches, in one launch.
//
//   k_src, v_src      [n_new, n_heads, k_head_dim | v_head_dim]  float or __half
//   positions [n_new] int32  each token's position; its cache row (slot) is the position, or with `ring`
//                      (a sliding-window layer) the position mod n_slots; distinct slots within one launch
//                      (rows outside [0, n_slots) and negative positions are skipped: padding passes -1)
//   k_cache, v_cache  [n_slots, n_heads, row_bytes] uint8, row_bytes = head_dim / kBlockValues * kBlockBytes
//   slot_pos  [n_slots] int32  with record_positions, slot_pos[slot] = position (the cache's position table)
//   table  the format's float table (kv_formats.cuh); scalar formats ignore it
// gridDim.y = 2 encodes K (y = 0) and V (y = 1) of one format; gridDim.y = 1 only K (v_* are not read).
// Folding the slot rule, the position table and V into the launch saves a decode step three launches a
// layer (the remainder, the scatter and the second encode: tools/count_decode_launches.py).
//
// One kernel template, kv_encode<Fmt, Src, kNormMode>; the work of one "unit" (a value, a block or a
// group) is done by Encoder<Fmt>, one specialization per format family. Every encoder reproduces the
// NumPy reference (cupyllm/kv/) bit for bit: same float operations in the same order, each rounded
// once (__f*_rn intrinsics, never contracted into FMAs), same tie-breaks.
//
// Launch geometry (mirrored in cupyllm/backend/gpu_kv.py): blockDim = Encoder::kCtaThreads,
// gridDim.x = ceil(max(K, V units) / Encoder::kUnitsPerCta), units = n_new * n_heads * head_dim / kBlockValues.
#include "kv_formats/kv_formats.cuh"

namespace cupyllm {

// turbo.stored_norm modes: what the fp16 norm of a rotated group holds.
enum NormMode : int { kNormRaw = 0, kNormLsq = 1, kNormCorrected = 2 };

template <class Fmt>
struct Encoder;

// ---- f32 / f16 / bf16: one thread per value ---------------------------------------------------

__device__ __forceinline__ void store_float_value(FmtF32, u8* out, float v) { *reinterpret_cast<float*>(out) = v; }
__device__ __forceinline__ void store_float_value(FmtF16, u8* out, float v) { store_u16(out, float_to_f16_bits(v)); }
__device__ __forceinline__ void store_float_value(FmtBF16, u8* out, float v) {
    // scalar.f32_to_bf16_bits: integer round-to-nearest-even; a NaN keeps its top bits, quieted.
    const u32 u = __float_as_uint(v);
    const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    const u32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    store_u16(out, static_cast<u16>(is_nan ? ((u >> 16) | 0x40u) : rounded));
}

template <class Fmt>
struct FloatEncoder {
    static constexpr int kUnitThreads = 1, kUnitsPerCta = 256, kCtaThreads = 256;
    template <class Src, int kNormMode>
    __device__ static void encode(const Src* x, u8* out, const float*, int) {
        store_float_value(Fmt{}, out, to_float(x[0]));
    }
};
template <> struct Encoder<FmtF32> : FloatEncoder<FmtF32> {};
template <> struct Encoder<FmtF16> : FloatEncoder<FmtF16> {};
template <> struct Encoder<FmtBF16> : FloatEncoder<FmtBF16> {};

// ---- llama.cpp 32-value blocks: one warp per block, lane j holds x[j] ----------------------------

struct WarpBlockGeometry {
    static constexpr int kUnitThreads = 32, kUnitsPerCta = 8, kCtaThreads = 256;
};

// d ? 1.0f/d : 0.0f
__device__ __forceinline__ float inverse_or_zero(float d) { return d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f; }

// C's float -> int conversion (toward zero), as scalar._trunc_int.
__device__ __forceinline__ int trunc_to_int(float v) { return __float2int_rz(v); }

// Lane j < 16 writes qs[j] = low nibble of q[j] | low nibble of q[j + 16] << 4.
__device__ __forceinline__ void store_nibbles(u8* qs, int q, int lane) {
    const int upper = __shfl_down_sync(kFullMask, q, 16);
    if (lane < 16) qs[lane] = static_cast<u8>((q & 0x0F) | ((upper & 0x0F) << 4));
}

// Lanes 0/1 write the little-endian uint32 whose bit j is bit 4 of q[j] (qh of q5_0 / q5_1),
// as two 16-bit halves since the field is only 2-byte aligned.
__device__ __forceinline__ void store_bit4(u8* qh, int q, int lane) {
    const u32 bits = __ballot_sync(kFullMask, (q >> 4) & 1);
    if (lane < 2) store_u16(qh + 2 * lane, static_cast<u16>(bits >> (16 * lane)));
}

// d = m / -nmax (m: the largest-magnitude value, first on ties), q = min(2*nmax-1, trunc(x*id + nmax + 0.5)).
template <int kNmax>
__device__ __forceinline__ int symmetric_code(float x, int lane, float& d) {
    const float m = warp_signed_absmax_first(x, lane);
    d = __fdiv_rn(m, static_cast<float>(-kNmax));
    const float id = inverse_or_zero(d);
    const int q = trunc_to_int(__fadd_rn(__fmul_rn(x, id), static_cast<float>(kNmax) + 0.5f));
    return min(q, 2 * kNmax - 1);
}

// d = (max - min) / qmax, q = min(qmax, trunc((x - min)*id + 0.5)).
template <int kQmax>
__device__ __forceinline__ int affine_code(float x, float& d, float& lo) {
    lo = warp_min(x);
    const float hi = warp_max(x);
    d = __fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(kQmax));
    const float id = inverse_or_zero(d);
    const int q = trunc_to_int(__fadd_rn(__fmul_rn(__fsub_rn(x, lo), id), 0.5f));
    return min(q, kQmax);
}

template <>
struct Encoder<FmtQ8_0> : WarpBlockGeometry {
    template <class Src, int kNormMode>
    __device__ static void encode(const Src* x, u8* out, const float*, int lane) {
        const float v = to_float(x[lane]);
        const float d = __fdiv_rn(warp_max(fabsf(v)), 127.0f);
        const float a = __fmul_rn(v, inverse_or_zero(d));
        // roundf: halves away from zero, like scalar._roundf (exact in float32)
        out[2 + lane] = static_cast<u8>(static_cast<i8>(static_cast<int>(roundf(a))));
        if (lane == 0) store_u16(out, float_to_f16_bits(d));
    }
};

template <>
struct Encoder<FmtQ4_0> : WarpBlockGeometry {
    template <class Src, int kNormMode>
    __device__ static void encode(const Src* x, u8* out, const float*, int lane) {
        float d;
        const int q = symmetric_code<8>(to_float(x[lane]), lane, d);
        store_nibbles(out + 2, q, lane);
        if (lane == 0) store_u16(out, float_to_f16_bits(d));
    }
};

template <>
struct Encoder<FmtQ5_0> : WarpBlockGeometry {
    template <class Src, int kNormMode>
    __device__ static void encode(const Src* x, u8* out, const float*, int lane) {
        float d;
        const int q = symmetric_code<16>(to_float(x[lane]), lane, d);
        store_bit4(out + 2, q, lane);
        store_nibbles(out + 6, q, lane);
        if (lane == 0) store_u16(out, float_to_f16_bits(d));
    }
};

template <>
struct Encoder<FmtQ6_0> : WarpBlockGeometry {
    template <class Src, int kNormMode>
    __device__ static void encode(const Src* x, u8* out, const float*, int lane) {
        float d;
        const int q = symmetric_code<32>(to_float(x[lane]), lane, d);
        // qh[k] = hi(q[k]) | hi(q[k+16]) << 2 | hi(q[k+8]) << 4 | hi(q[k+24]) << 6, hi(q) = q >> 4
        const int hi = q >> 4;
        const int hi8 = __shfl_down_sync(kFullMask, hi, 8);
        const int hi16 = __shfl_down_sync(kFullMask, hi, 16);
        const int hi24 = __shfl_down_sync(kFullMask, hi, 24);
        if (lane < 8) out[2 + lane] = static_cast<u8>(hi | (hi16 << 2) | (hi8 << 4) | (hi24 << 6));
        store_nibbles(out + 10, q, lane);
        if (lane == 0) store_u16(out, float_to_f16_bits(d));
    }
};

template <>
struct Encoder<FmtQ4_1> : WarpBlockGeometry {
    template <class Src, int kNormMode>
    __device__ static void encode(const Src* x, u8* out, const float*, int lane) {
        float d, lo;
        const int q = affine_code<15>(to_float(x[lane]), d, lo);
        store_nibbles(out + 4, q, lane);
        if (lane == 0) {
            store_u16(out, float_to_f16_bits(d));
            store_u16(out + 2, float_to_f16_bits(lo));
        }
    }
};

template <>
struct Encoder<FmtQ5_1> : WarpBlockGeometry {
    template <class Src, int kNormMode>
    __device__ static void encode(const Src* x, u8* out, const float*, int lane) {
        float d, lo;
        const int q = affine_code<31>(to_float(x[lane]), d, lo);
        store_bit4(out + 4, q, lane);
        store_nibbles(out + 8, q, lane);
        if (lane == 0) {
            store_u16(out, float_to_f16_bits(d));
            store_u16(out + 2, float_to_f16_bits(lo));
        }
    }
};

// ---- rotated groups: shared pieces ---------------------------------------------------------------

// Load a group in the warp layout (value i in lane i % 32, slot i / 32) and rotate it.
template <int G, class Src>
__device__ __forceinline__ void load_rotated_group(const Src* x, float (&y)[G / 32], int lane) {
#pragma unroll
    for (int s = 0; s < G / 32; ++s) y[s] = to_float(x[s * 32 + lane]);
    warp_rotate<G>(y, lane);
}

// turbo.group_norm_and_z: r = sqrt(tree_sum(y*y)), z = y * (r > 0 ? sqrt(G)/r : 0). Returns r.
template <int G>
__device__ __forceinline__ float group_norm_and_z(const float (&y)[G / 32], float (&z)[G / 32]) {
    float sq[G / 32];
#pragma unroll
    for (int s = 0; s < G / 32; ++s) sq[s] = __fmul_rn(y[s], y[s]);
    const float r = __fsqrt_rn(warp_group_tree_sum<G>(sq));
    const float scale = r > 0.0f ? __fdiv_rn(sqrt_group<G>(), r) : 0.0f;
#pragma unroll
    for (int s = 0; s < G / 32; ++s) z[s] = __fmul_rn(y[s], scale);
    return r;
}

// turbo.stored_norm for raw norm r, unit coordinates z and their reconstructions c (warp layout).
template <int G, int kNormMode>
__device__ __forceinline__ u16 stored_norm_bits(float r, const float (&z)[G / 32], const float (&c)[G / 32]) {
    if constexpr (kNormMode == kNormRaw) {
        return float_to_f16_bits(r);
    } else {
        float cc[G / 32];
#pragma unroll
        for (int s = 0; s < G / 32; ++s) cc[s] = __fmul_rn(c[s], c[s]);
        const float ll = warp_group_tree_sum<G>(cc);
        if constexpr (kNormMode == kNormLsq) {
            float zc[G / 32];
#pragma unroll
            for (int s = 0; s < G / 32; ++s) zc[s] = __fmul_rn(z[s], c[s]);
            const float num = warp_group_tree_sum<G>(zc);
            const float ratio = ll > 0.0f ? __fdiv_rn(num, ll) : 0.0f;
            return float_to_f16_bits(__fmul_rn(r, ratio));
        } else {
            static_assert(kNormMode == kNormCorrected, "unknown norm mode");
            const float factor = ll > 0.0f ? __fdiv_rn(sqrt_group<G>(), __fsqrt_rn(ll)) : 1.0f;
            return float_to_f16_bits(__fmul_rn(r, factor));
        }
    }
}

// Byte `byte_index` of the LSB-first stream holding `count` codes of kWidth bits (codes in smem).
template <int kWidth, class Code>
__device__ __forceinline__ u8 packed_stream_byte(const Code* codes, int count, int byte_index) {
    u32 byte = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) {
        const int p = byte_index * 8 + b;
        const int i = p / kWidth;
        if (i < count) byte |= ((static_cast<u32>(codes[i]) >> (p - i * kWidth)) & 1u) << b;
    }
    return static_cast<u8>(byte);
}

// ---- turbo{2,3,4}: one warp per group ---------------------------------------------------------------

template <int kBits, int G>
struct Encoder<FmtTurbo<kBits, G>> {
    using Fmt = FmtTurbo<kBits, G>;
    static constexpr int kUnitThreads = 32, kUnitsPerCta = 4, kCtaThreads = 128;
    static constexpr int kCodeBytes = Fmt::kBlockBytes - 2;

    template <class Src, int kNormMode>
    __device__ static void encode(const Src* x, u8* out, const float* table, int lane) {
        __shared__ u8 codes_smem[kUnitsPerCta][G];
        u8* codes = codes_smem[threadIdx.x / 32];
        const float* levels = table;
        const float* bounds = table + Fmt::kLevels;

        float y[G / 32], z[G / 32], c[G / 32];
        load_rotated_group<G>(x, y, lane);
        const float r = group_norm_and_z<G>(y, z);
#pragma unroll
        for (int s = 0; s < G / 32; ++s) {
            // code = #{j : z > BOUNDS[j]}: the nearest level, the lower one exactly on a boundary
            int code = 0;
#pragma unroll
            for (int j = 0; j < Fmt::kLevels - 1; ++j) code += z[s] > bounds[j];
            codes[s * 32 + lane] = static_cast<u8>(code);
            c[s] = levels[code];
        }
        const u16 norm = stored_norm_bits<G, kNormMode>(r, z, c);
        __syncwarp();
        for (int byte = lane; byte < kCodeBytes; byte += 32)
            out[2 + byte] = packed_stream_byte<kBits>(codes, G, byte);
        if (lane == 0) store_u16(out, norm);
    }
};

// ---- *_tcq: Viterbi over the bitshift trellis, one thread per predecessor set ----
//
// state_{t+1} = (state_t >> k) | new_bits << (L - k); the predecessors of s' are (m << k) | r with
// m = s' & (2^(L-k) - 1), r = 0 .. 2^k - 1. Thread `me` holds the 2^k states (me << k) | r: exactly the
// predecessor set of m = me, so its minimum is taken in registers,
//   best_t[me] = min_r cost_{t-1}[(me << k) | r].
// The search is tcq.py's integer one (TrellisMetric): a state's cost is kept packed as cost << k | r, so one
// signed minimum gives the smallest cost and, on ties, the smallest r; its step cost X_t * centroid + square
// is one IMAD, and adding the set's best and taking the minimum is one __viaddmin_s32 (a single DPX
// instruction on sm_90, IADD + IMNMX before). The next costs of its states need the minima of the sets
// ((me << k) | r) & (2^(L-k) - 1): 2^k consecutive entries of best_t, read as one or two 16-byte words that
// a warp's lanes share. So a step moves one int per predecessor set through shared memory instead of one
// per state: the previous layout (a thread per set writing its 2^k successors' costs for their sets'
// threads to read: 18 accesses a step, not 5) was bound by shared-memory traffic (75% of a prefill layer step).
// Every kRenormSteps-th step subtracts best_{t-1}[0] from every best_t (tcq.RENORM_STEPS): the costs stay
// within int32 for any group. The final state is the smallest argmin; each group's thread 0 backtracks.
//
// A group of 2^(L-k) >= 32 threads has its own CTA. Smaller trellises (timed by bench/kv_encode.py for the
// encode-budget decision; no format uses one) put 32 / 2^(L-k) groups in one warp's CTA, each group on its
// own lanes: warp 0 rotates and normalises them one after another, the search runs them side by side. Their
// threads meet at __syncthreads, so none may leave early: the kernel gives a group past the end or with a
// skipped slot out = nullptr (kSyncsCta) and it computes without storing.

// X_t of tcq.TrellisMetric.steps: rint(z * scale), scale = -2^(Fx+1) (exact), clamped to +-limit, 0 for NaN.
__device__ __forceinline__ int trellis_step(float z, float scale, float limit) {
    const float v = __fmul_rn(z, scale);
    if (v != v) return 0;
    return __float2int_rn(fminf(fmaxf(v, -limit), limit));
}

template <int kK, int kL, int G>
struct Encoder<FmtTcq<kK, kL, G>> {
    using Fmt = FmtTcq<kK, kL, G>;
    static constexpr int kLowStates = 1 << (kL - kK);  // predecessor sets: one thread each
    static constexpr int kPreds = 1 << kK;
    static constexpr int kTagMask = kPreds - 1;  // the r packed below a cost
    static constexpr int kRenormSteps = 16;  // tcq.RENORM_STEPS
    static constexpr int kUnitThreads = kLowStates;
    static constexpr int kUnitsPerCta = kLowStates >= 32 ? 1 : 32 / kLowStates;
    static constexpr int kCtaThreads = kUnitThreads * kUnitsPerCta;
    static constexpr bool kSyncsCta = kUnitsPerCta > 1;
    static constexpr int kWarps = kLowStates >= 32 ? kLowStates / 32 : 1;  // per group
    static_assert(kLowStates >= 4 && kLowStates <= 1024 && (kLowStates % 32 == 0 || 32 % kLowStates == 0),
                  "whole warps of predecessor sets, or whole groups in one warp");
    static_assert(kL >= 2 * kK && kPreds % 4 == 0, "a thread's sets are whole 16-byte words of best_t");

    // best_t of set m at m + 4 * (m / 32): the 8 distinct 32-byte runs a warp reads at k = 3 then start in
    // distinct banks (unpadded, runs 0 and 4 would collide); a run never crosses the padding.
    __device__ static int best_index(int m) { return m + ((m >> 5) << 2); }
    static constexpr int kBestStride = kLowStates + 4 * (kLowStates / 32);

    // The encode table (gpu_kv.encode_table): the codebook, int32 centroid[kStates] and square[kStates]
    // (tcq.TrellisMetric), then the float scale and clamp of X_t.
    template <class Src, int kNormMode>
    __device__ static void encode(const Src* x, u8* out, const float* table, int thread) {
        constexpr int U = kUnitsPerCta;
        __shared__ float z_smem[U][G];
        __shared__ __align__(16) int step_smem[U][G];  // X_t
        __shared__ __align__(16) int best_smem[U][2][kBestStride];  // best_t, double-buffered: one barrier a step
        __shared__ u8 choice[U][G][kLowStates];  // best r of step t for each set
        __shared__ short states[U][G];
        __shared__ int best_cost[U][kWarps];
        __shared__ int best_state[U][kWarps];
        __shared__ float group_r[U];
        __shared__ const Src* group_x[U];
        __shared__ u8* group_out[U];

        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        const int unit = U == 1 ? 0 : static_cast<int>(threadIdx.x) / kUnitThreads;  // this thread's group
        if constexpr (U > 1) {  // warp 0 works for every group of the CTA: their sources and destinations
            if (thread == 0) group_x[unit] = x, group_out[unit] = out;
            __syncthreads();
        }
        if (warp == 0) {  // rotate and normalise the groups: z in N(0, 1) units, and the search's X_t
            const float scale = table[3 * Fmt::kStates], limit = table[3 * Fmt::kStates + 1];
            for (int u = 0; u < U; ++u) {
                float y[G / 32], z[G / 32];
                load_rotated_group<G>(U == 1 ? x : group_x[u], y, lane);
                const float r = group_norm_and_z<G>(y, z);
#pragma unroll
                for (int s = 0; s < G / 32; ++s) {
                    z_smem[u][s * 32 + lane] = z[s];
                    step_smem[u][s * 32 + lane] = trellis_step(z[s], scale, limit);
                }
                if (lane == 0) group_r[u] = r;
            }
        }
        __syncthreads();

        const int me = thread;
        const int sets = best_index((me << kK) & (kLowStates - 1));  // the sets of this thread's states: sets + r
        const int* const centroid_table = reinterpret_cast<const int*>(table + Fmt::kStates);
        int centroid[kPreds], square[kPreds];  // of the states (me << k) | r
#pragma unroll
        for (int r = 0; r < kPreds; ++r) {
            centroid[r] = centroid_table[(me << kK) | r];
            square[r] = centroid_table[Fmt::kStates + ((me << kK) | r)];
        }
        // X_t of a run of kRenormSteps steps, read as 16-byte words (one load per four steps)
        int steps[kRenormSteps];
        const auto load_steps = [&](int run) {
#pragma unroll
            for (int w = 0; w < kRenormSteps / 4; ++w) {
                const int4 x4 = *reinterpret_cast<const int4*>(&step_smem[unit][run + 4 * w]);
                steps[4 * w] = x4.x, steps[4 * w + 1] = x4.y, steps[4 * w + 2] = x4.z, steps[4 * w + 3] = x4.w;
            }
        };
        load_steps(0);
        // best: the packed minimum over this thread's states of cost_{t-1}, here t = 1
        int best = steps[0] * centroid[0] + square[0];
#pragma unroll
        for (int r = 1; r < kPreds; ++r) best = min(best, steps[0] * centroid[r] + square[r]);
        // step t: store best_t (renormalised every kRenormSteps-th step) and the choices, then the next best
        const auto search_step = [&](int t, int step, bool renormalise) {
            int* const best_t = best_smem[unit][t & 1];
            int masked = best & ~kTagMask;
            if (renormalise) masked -= best_smem[unit][(t - 1) & 1][best_index(0)];
            best_t[best_index(me)] = masked;
            choice[unit][t][me] = static_cast<u8>(best);  // r in its low bits (masked when backtracking)
            __syncthreads();
            int set_best[kPreds];
#pragma unroll
            for (int w = 0; w < kPreds / 4; ++w) {
                const int4 b4 = *reinterpret_cast<const int4*>(best_t + sets + 4 * w);
                set_best[4 * w] = b4.x, set_best[4 * w + 1] = b4.y, set_best[4 * w + 2] = b4.z, set_best[4 * w + 3] = b4.w;
            }
            best = step * centroid[0] + square[0] + set_best[0];
#pragma unroll
            for (int r = 1; r < kPreds; ++r) best = __viaddmin_s32(step * centroid[r] + square[r], set_best[r], best);
        };
        static_assert(G % kRenormSteps == 0, "whole runs of steps between renormalisations");
#pragma unroll
        for (int t = 1; t < kRenormSteps; ++t) search_step(t, steps[t], false);
        for (int run = kRenormSteps; run < G; run += kRenormSteps) {  // (unrolled inside: no test per step)
            load_steps(run);
#pragma unroll
            for (int i = 0; i < kRenormSteps; ++i) search_step(run + i, steps[i], i == 0);
        }

        // argmin over the final costs, the smallest state on ties: best is this thread's (its states grow with r)
        int c = best & ~kTagMask;
        int s = (me << kK) | (best & kTagMask);
#pragma unroll
        for (int offset = (kUnitThreads < 32 ? kUnitThreads : 32) / 2; offset > 0; offset >>= 1) {  // (within the group)
            const int oc = __shfl_xor_sync(kFullMask, c, offset);
            const int os = __shfl_xor_sync(kFullMask, s, offset);
            if (oc < c || (oc == c && os < s)) { c = oc; s = os; }
        }
        if (thread % 32 == 0) { best_cost[unit][thread / 32] = c; best_state[unit][thread / 32] = s; }
        __syncthreads();
        if (thread == 0) {
            int bc = best_cost[unit][0];
            int bs = best_state[unit][0];
            for (int w = 1; w < kWarps; ++w)
                if (best_cost[unit][w] < bc || (best_cost[unit][w] == bc && best_state[unit][w] < bs)) {
                    bc = best_cost[unit][w];
                    bs = best_state[unit][w];
                }
            for (int t = G - 1; t > 0; --t) {
                states[unit][t] = static_cast<short>(bs);
                const int low = bs & (kLowStates - 1);
                bs = (low << kK) | (choice[unit][t][low] & kTagMask);
            }
            states[unit][0] = static_cast<short>(bs);
        }
        __syncthreads();

        if (warp == 0) {  // norm of the chosen reconstruction
            for (int u = 0; u < U; ++u) {
                u8* const group_dst = U == 1 ? out : group_out[u];
                if (group_dst == nullptr) continue;  // (the same for every lane)
                float z[G / 32], cb[G / 32];
#pragma unroll
                for (int i = 0; i < G / 32; ++i) {
                    z[i] = z_smem[u][i * 32 + lane];
                    cb[i] = table[states[u][i * 32 + lane]];
                }
                const u16 norm = stored_norm_bits<G, kNormMode>(group_r[u], z, cb);
                if (lane == 0) store_u16(group_dst, norm);
            }
        }
        if (out == nullptr) return;
        // stream bit p belongs to state t = min(p / k, G - 1), bit p - t*k of its window (a loop: a smaller
        // trellis has fewer threads than stream bytes, e.g. k = 3, L = 8: 32 predecessor sets, 50 bytes)
        for (int byte = thread; byte < Fmt::kBlockBytes - 2; byte += kUnitThreads) {
            u32 value = 0;
#pragma unroll
            for (int b = 0; b < 8; ++b) {
                const int p = byte * 8 + b;
                if (p < Fmt::kStreamBits) {
                    const int t = min(p / kK, G - 1);
                    value |= ((static_cast<u32>(states[unit][t]) >> (p - t * kK)) & 1u) << b;
                }
            }
            out[2 + byte] = static_cast<u8>(value);
        }
    }
};

// Whether an encoder's groups meet at __syncthreads (its CTA must not lose threads to an early return).
template <class E, class = void>
struct SyncsCta { static constexpr bool value = false; };
template <class E>
struct SyncsCta<E, decltype(void(E::kSyncsCta))> { static constexpr bool value = E::kSyncsCta; };

}  // namespace cupyllm

// ---- the kernel --------------------------------------------------------------------------------------

template <class Fmt, class Src, int kNormMode>
__global__ void __launch_bounds__(cupyllm::Encoder<Fmt>::kCtaThreads)
kv_encode(const Src* __restrict__ k_src, const Src* __restrict__ v_src, const int* __restrict__ positions,
          cupyllm::u8* __restrict__ k_cache, cupyllm::u8* __restrict__ v_cache, int* __restrict__ slot_pos,
          int record_positions, int n_new, int n_slots, int ring, int n_heads, int k_head_dim, int v_head_dim,
          const float* __restrict__ table) {
    using E = cupyllm::Encoder<Fmt>;
    const bool is_v = blockIdx.y == 1;
    const Src* const src = is_v ? v_src : k_src;
    cupyllm::u8* const cache = is_v ? v_cache : k_cache;
    const int head_dim = is_v ? v_head_dim : k_head_dim;
    const int units_per_head = head_dim / Fmt::kBlockValues;
    const long long n_units = static_cast<long long>(n_new) * n_heads * units_per_head;
    long long unit = static_cast<long long>(blockIdx.x) * E::kUnitsPerCta + threadIdx.x / E::kUnitThreads;
    constexpr bool kStay = cupyllm::SyncsCta<E>::value;  // a unit that must not store still takes part
    const bool past_end = unit >= n_units;
    if (past_end && !kStay) return;  // uniform per unit: warps / CTAs of one unit leave together
    if (past_end) unit = n_units - 1;  // (computes on a real group, stores nothing)
    const int token = static_cast<int>(unit / (static_cast<long long>(n_heads) * units_per_head));
    const int within = static_cast<int>(unit % (static_cast<long long>(n_heads) * units_per_head));
    const int position = positions[token];
    const int slot = position < 0 ? -1 : ring ? position % n_slots : position;
    const bool skipped = past_end || slot < 0 || slot >= n_slots;
    if (record_positions && !skipped && !is_v && within == 0 && threadIdx.x % E::kUnitThreads == 0)
        slot_pos[slot] = position;
    if (skipped && !kStay) return;
    const size_t row_bytes = static_cast<size_t>(units_per_head) * Fmt::kBlockBytes;
    const int head = within / units_per_head;
    const int block = within % units_per_head;
    const Src* x = src + (static_cast<size_t>(token) * n_heads + head) * head_dim +
                   static_cast<size_t>(block) * Fmt::kBlockValues;
    cupyllm::u8* out = skipped ? nullptr : cache + (static_cast<size_t>(slot) * n_heads + head) * row_bytes +
                                             static_cast<size_t>(block) * Fmt::kBlockBytes;
    E::template encode<Src, kNormMode>(x, out, table, threadIdx.x % E::kUnitThreads);
}
