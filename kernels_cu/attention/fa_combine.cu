// The small kernels around fa_vec / fa_mma (fa_common.cuh describes the shapes):
//   fa_prep_q<kRotG, QT, OT>    Q * scale, rotated per group when the K format is rotated, as f32 (VEC) or f16 (MMA);
//                               up to three Q arrays into one (Dual Chunk Attention's rotations, one launch)
//   fa_combine<kRotG, OT>       merge the split results by their LSE; unrotate O when the V format is rotated
//   fa_chunk_check<G>           test aid: read_chunk (Chunk8) next to load_kv_value for every value of some rows
//   fa_dequant_bench<D, Reader>  benchmark aid: fa_mma's dequantizing pass alone, with Half8 or its definition
#include "attention/fa_common.cuh"

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
// One block per row. The threads first share the splits' LSEs (max, then the sum of the weights); then each
// thread owns one float4 column of the row and one of `streams` interleaved walks over the splits, so a
// thread has few splits to visit and their loads in flight together (a walk over every split per thread was
// latency-bound: ~60 us at 128 splits on an H200); the walks meet in shared memory, and a warp per group of
// G values unrotates O (kRotG > 0: the V format is rotated) and stores it.
// o_part [n_split, n_rows, d], lse_part [n_split, n_rows]; out [n_rows, d]; lse_out [n_rows]; d in 64..512.
template <int kRotG, class OT>
__global__ void __launch_bounds__(cupyllm::kFaThreads)
fa_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part, OT* __restrict__ out,
           float* __restrict__ lse_out, int n_split, int n_rows, int d) {
    using namespace cupyllm;
    constexpr int G = kRotG > 0 ? kRotG : 32;
    constexpr int kWarps = kFaThreads / 32;
    __shared__ float4 partial[kFaThreads];  // [stream][column]: streams * columns = kFaThreads
    __shared__ float warp_part[kWarps];
    __shared__ float row_stat[2];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const long long row = blockIdx.x;
    const float* lse = lse_part + row;  // split s at lse[s * n_rows]

    float m = neg_inf();
    for (int s = tid; s < n_split; s += kFaThreads) m = fmaxf(m, lse[s * static_cast<long long>(n_rows)]);
    m = warp_max(m);
    if (lane == 0) warp_part[warp] = m;
    __syncthreads();
    if (tid == 0) {
        float x = warp_part[0];
        for (int w = 1; w < kWarps; ++w) x = fmaxf(x, warp_part[w]);
        row_stat[0] = x;
    }
    __syncthreads();
    const float lse_max = row_stat[0];
    const bool seen = lse_max != neg_inf();  // some split saw a key
    float total = 0.0f;
    if (seen)
        for (int s = tid; s < n_split; s += kFaThreads) total += __expf(lse[s * static_cast<long long>(n_rows)] - lse_max);
    total = warp_sum(total);
    if (lane == 0) warp_part[warp] = total;  // every thread read row_stat[0] / warp_part before the last barrier
    __syncthreads();
    if (tid == 0) {
        float x = 0.0f;
        for (int w = 0; w < kWarps; ++w) x += warp_part[w];
        row_stat[1] = x;
    }

    const int columns = d / 4, streams = kFaThreads / columns;
    const int column = tid % columns, stream = tid / columns;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (seen) {
#pragma unroll 4
        for (int s = stream; s < n_split; s += streams) {
            const float w = __expf(lse[s * static_cast<long long>(n_rows)] - lse_max);
            const float4 o = reinterpret_cast<const float4*>(o_part + (s * static_cast<long long>(n_rows) + row) * d)[column];
            if (w != 0.0f) {  // an empty split (O = 0, LSE = -inf) or a negligible one adds nothing
                acc.x += w * o.x;
                acc.y += w * o.y;
                acc.z += w * o.z;
                acc.w += w * o.w;
            }
        }
    }
    partial[stream * columns + column] = acc;
    __syncthreads();
    if (tid < columns) {
        float4 sum = partial[tid];
        for (int p = 1; p < streams; ++p) {
            const float4 x = partial[p * columns + tid];
            sum.x += x.x;
            sum.y += x.y;
            sum.z += x.z;
            sum.w += x.w;
        }
        const float t = row_stat[1];
        partial[tid] = seen ? make_float4(sum.x / t, sum.y / t, sum.z / t, sum.w / t) : sum;
    }
    __syncthreads();
    const float* o_row = reinterpret_cast<const float*>(partial);
    for (int g = warp; g < d / G; g += kWarps) {
        float v[G / 32];
#pragma unroll
        for (int i = 0; i < G / 32; ++i) v[i] = o_row[g * G + i * 32 + lane];
        if constexpr (kRotG > 0) warp_unrotate<G>(v, lane);
#pragma unroll
        for (int i = 0; i < G / 32; ++i) store_out(&out[row * d + g * G + i * 32 + lane], v[i]);
    }
    if (tid == 0) lse_out[row] = seen ? lse_max + logf(row_stat[1]) : neg_inf();
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
// must be bit-identical (and equal the NumPy decode). out_f16[i] = value i as read_chunk_f16 reads it (fa_mma's
// tiles), which must be out_ref[i] rounded to f16. One thread per chunk of 8 values.
template <int G>
__global__ void __launch_bounds__(cupyllm::kFaThreads)
fa_chunk_check(const cupyllm::u8* __restrict__ rows, const float* __restrict__ table, float* __restrict__ out_chunk,
               float* __restrict__ out_ref, cupyllm::u16* __restrict__ out_f16, int n_rows, int d, int fmt,
               int row_bytes) {
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
    const uint4 h = read_chunk_f16<G>(fmt, row, c, table);
    const u32 words[4] = {h.x, h.y, h.z, h.w};
    for (int i = 0; i < 8; ++i) {
        out_chunk[r * d + 8 * c + i] = v[i];
        out_ref[r * d + 8 * c + i] = ref[i];
        out_f16[r * d + 8 * c + i] = static_cast<u16>(words[i / 2] >> (16 * (i % 2)));
    }
}

// Benchmark aid (bench/dequant_gpu.py): fa_mma's dequantizing pass alone, so that one run times the Half8
// readers (Reader = Half8) against the definition they replace, Chunk8's floats rounded (Half8FromFloats). Each block
// walks tiles of 64 rows [n_rows, row_bytes] of format `fmt` (runtime id): stages a tile in shared memory with
// cp.async and dequantizes it into a K tile and a V^T tile exactly as fa_mma does (DequantRows,
// DequantColumns), then folds the words of both tiles into one xor per block (checksum[block]): both variants
// must give the same checksums.
template <int D, template <class> class Reader>
__global__ void __launch_bounds__(cupyllm::kFaThreads)
fa_dequant_bench(const cupyllm::u8* __restrict__ rows, const float* __restrict__ table, cupyllm::u32* __restrict__ checksum,
                 int n_rows, int fmt, int row_bytes, int table_len) {
    using namespace cupyllm;
    constexpr int kTile = 64, kKStride = D + 8, kVStride = kTile + 8, G = GroupOf<D>::value;
    extern __shared__ __align__(16) u8 fa_smem[];
    const StagedRows L = StagedRows::of(row_bytes);
    __half* k_s = reinterpret_cast<__half*>(fa_smem);                  // [kTile][kKStride]
    __half* vt_s = k_s + kTile * kKStride;                             // [D][kVStride]
    u8* raw = reinterpret_cast<u8*>(vt_s + D * kVStride);              // [kTile][L.slot_bytes]
    float* table_s = reinterpret_cast<float*>(raw + kTile * L.slot_bytes);
    const int tid = threadIdx.x;
    for (int i = tid; i < table_len; i += kFaThreads) table_s[i] = table[i];
    u32 fold = 0u;
    for (long long first = static_cast<long long>(blockIdx.x) * kTile; first < n_rows;
         first += static_cast<long long>(gridDim.x) * kTile) {
        const int n_valid = static_cast<int>(min(static_cast<long long>(kTile), n_rows - first));
        stage_rows(L, raw, rows, first, kTile, n_valid, 1, 0, n_rows, tid);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        with_format<G>(fmt, DequantRows<D, kTile, kKStride, Reader>{{L, raw, k_s, first, 1, 0, table_s, tid}});
        with_format<G>(fmt, DequantColumns<D, kTile, kVStride, Reader>{{L, raw, vt_s, first, 1, 0, table_s, tid}});
        __syncthreads();
        const u32* k_words = reinterpret_cast<const u32*>(k_s);
        const u32* v_words = reinterpret_cast<const u32*>(vt_s);
        for (int w = tid; w < kTile * (D / 2); w += kFaThreads) fold ^= k_words[(w / (D / 2)) * (kKStride / 2) + w % (D / 2)];
        for (int w = tid; w < D * (kTile / 2); w += kFaThreads)
            fold ^= v_words[(w / (kTile / 2)) * (kVStride / 2) + w % (kTile / 2)];
        __syncthreads();  // the next tile overwrites the staged rows and the tiles
    }
    for (int offset = 16; offset >= 1; offset >>= 1) fold ^= __shfl_xor_sync(kFullMask, fold, offset);
    __shared__ u32 warp_fold[kFaThreads / 32];
    if (tid % 32 == 0) warp_fold[tid / 32] = fold;
    __syncthreads();
    if (tid == 0) {
        u32 all = 0u;
        for (int w = 0; w < kFaThreads / 32; ++w) all ^= warp_fold[w];
        checksum[blockIdx.x] = all;
    }
}
