// The small kernels around fa_vec / fa_mma (fa_common.cuh describes the shapes):
//   fa_prep_q<kRotG, QT, OT>    Q * scale, rotated per group when the K format is rotated, as f32 (VEC) or f16 (MMA);
//                               up to three Q arrays into one (Dual Chunk Attention's rotations, one launch)
//   fa_combine<kRotG, OT>       merge the split results by their LSE; unrotate O when the V format is rotated
//   fa_chunk_check<G>           test aid: read_chunk (Chunk8) next to load_kv_value for every value of some rows
#include "fa_common.cuh"

// ---- Q preparation: out = scale * q, rotated per group of kRotG values when the K format is rotated -------
// One warp per (row, group); G = kRotG, or 32 (no rotation). q, q_b, q_c: [n_rows, d] contiguous, of which the
// first n_parts (1 to 3) are read; out: [n_parts, n_rows, d] (DCA: the intra, successive, inter rotations).
template <int kRotG, class QT, class OT>
__global__ void __launch_bounds__(cupyllm::kFaThreads)
fa_prep_q(const QT* __restrict__ q, const QT* __restrict__ q_b, const QT* __restrict__ q_c, OT* __restrict__ out,
          int n_rows, int n_parts, int d, float scale) {
    using namespace cupyllm;
    constexpr int G = kRotG > 0 ? kRotG : 32;
    const int lane = threadIdx.x % 32;
    const long long item = static_cast<long long>(blockIdx.x) * (kFaThreads / 32) + threadIdx.x / 32;
    const int groups_per_row = d / G;
    const long long items_per_part = static_cast<long long>(n_rows) * groups_per_row;
    if (item >= n_parts * items_per_part) return;  // uniform per warp
    const long long part = item / items_per_part;
    const QT* src = part == 0 ? q : part == 1 ? q_b : q_c;
    const long long base = item * G;  // rows are contiguous, so (part, row, group) -> offset item * G
    const long long src_base = base - part * items_per_part * G;
    float v[G / 32];
#pragma unroll
    for (int s = 0; s < G / 32; ++s) v[s] = __fmul_rn(to_float(src[src_base + s * 32 + lane]), scale);
    if constexpr (kRotG > 0) warp_rotate<G>(v, lane);
#pragma unroll
    for (int s = 0; s < G / 32; ++s) store_out(&out[base + s * 32 + lane], v[s]);
}

// ---- combination of split results: O = sum_s w_s O_s, w_s = exp(LSE_s - LSE), LSE = log sum_s exp(LSE_s) ----
// One warp per (row, group of G values); unrotates O when the V format is rotated (kRotG > 0).
// o_part [n_split, n_rows, d], lse_part [n_split, n_rows]; out [n_rows, d]; lse_out [n_rows].
template <int kRotG, class OT>
__global__ void __launch_bounds__(cupyllm::kFaThreads)
fa_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part, OT* __restrict__ out,
           float* __restrict__ lse_out, int n_split, int n_rows, int d) {
    using namespace cupyllm;
    constexpr int G = kRotG > 0 ? kRotG : 32;
    const int lane = threadIdx.x % 32;
    const long long item = static_cast<long long>(blockIdx.x) * (kFaThreads / 32) + threadIdx.x / 32;
    const int groups_per_row = d / G;
    if (item >= static_cast<long long>(n_rows) * groups_per_row) return;  // uniform per warp
    const long long row = item / groups_per_row;
    const long long base = item * G;
    float lse_max = neg_inf();
    for (int s = 0; s < n_split; ++s) lse_max = fmaxf(lse_max, lse_part[s * static_cast<long long>(n_rows) + row]);
    float v[G / 32] = {};
    float total = 0.0f;
    if (lse_max != neg_inf()) {
        for (int s = 0; s < n_split; ++s) {
            const float w = __expf(lse_part[s * static_cast<long long>(n_rows) + row] - lse_max);
            if (w == 0.0f) continue;  // an empty split (O = 0, LSE = -inf) or a negligible one
            total += w;
            const float* o = o_part + s * static_cast<long long>(n_rows) * d + base;
#pragma unroll
            for (int i = 0; i < G / 32; ++i) v[i] += w * o[i * 32 + lane];
        }
#pragma unroll
        for (int i = 0; i < G / 32; ++i) v[i] /= total;
    }
    if constexpr (kRotG > 0) warp_unrotate<G>(v, lane);
#pragma unroll
    for (int i = 0; i < G / 32; ++i) store_out(&out[base + i * 32 + lane], v[i]);
    if (lane == 0 && base % d == 0) lse_out[row] = lse_max == neg_inf() ? neg_inf() : lse_max + logf(total);
}

namespace cupyllm {
struct ReadValues {  // values 8c .. 8c+7 one by one through kv_formats.cuh
    const u8* row;
    int c;
    const float* table;
    float (&v)[8];
    template <class Fmt>
    __device__ void operator()(Fmt) const {
        for (int i = 0; i < 8; ++i) v[i] = load_kv_value<Fmt>(row, 8 * c + i, table);
    }
};
}  // namespace cupyllm

// Test aid (tests/test_gpu_attention.py): for rows [n_rows, d] of format `fmt` (runtime id),
// out_chunk[i] = value i as read_chunk reads it and out_ref[i] = load_kv_value of the same format; the two
// must be bit-identical (and equal the NumPy decode). One thread per chunk of 8 values.
template <int G>
__global__ void __launch_bounds__(cupyllm::kFaThreads)
fa_chunk_check(const cupyllm::u8* __restrict__ rows, const float* __restrict__ table, float* __restrict__ out_chunk,
               float* __restrict__ out_ref, int n_rows, int d, int fmt, int row_bytes) {
    using namespace cupyllm;
    const long long task = static_cast<long long>(blockIdx.x) * kFaThreads + threadIdx.x;
    const int chunks = d / 8;
    if (task >= static_cast<long long>(n_rows) * chunks) return;
    const long long r = task / chunks;
    const int c = static_cast<int>(task % chunks);
    const u8* row = rows + r * row_bytes;
    float v[8], ref[8];
    read_chunk<G>(fmt, row, c, table, v);
    with_format<G>(fmt, ReadValues{row, c, table, ref});
    for (int i = 0; i < 8; ++i) {
        out_chunk[r * d + 8 * c + i] = v[i];
        out_ref[r * d + 8 * c + i] = ref[i];
    }
}
