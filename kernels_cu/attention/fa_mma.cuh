// FA-MMA: tensor-core flash attention (mma.sync m16n8k16, f16 inputs, f32 accumulation) for prefill
// and many query rows.
//
// fa_mma<D>: one block = kRows query rows sharing one KV head (query heads of a GQA group times queries,
// row r = (query r / group, head r % group)), over one split of the keys. Tiles of kTile keys move in two
// steps: the raw cache rows of tile t + 1 are copied into a staging buffer with cp.async while tile t is
// computed (no thread waits on global memory), then dequantized (any K / V format: runtime ids; Half8 of
// fa_common.cuh, which scales the symmetric block formats in f16 arithmetic) from shared memory into f16
// tiles: K row-major [key][dim], V transposed [dim][key]. Every mma operand comes from an ldmatrix (four 8x8
// fragments an instruction) over rows padded by 16 bytes (row strides of 4 words mod 32 banks: the 8 rows of a
// matrix fall in distinct banks).
//
// fa_mma<D, kDecode>: warps split the rows (prefill, kDecode = false: kRowWarps warps own 16 rows each,
// 64 rows per block) or the keys (decode, kDecode = true: one 16-row tile, each warp takes a quarter of
// every key tile with its own running max/sum/O, merged at the end). Decode on tensor cores: the
// products cost nothing next to dequantizing, which matters for the quantized formats at a few rows.
// For D = 512 the 256 f32 accumulators of a full output row would not fit in registers, so two warps
// share each row/key range (kColSplit = 2): both compute the scores, each keeps half of the output dims.
//
// Per tile: S = Q K^T (f32 accumulators), mask + softcap + online softmax on the accumulator fragments
// (a row's values live in the 4 threads of a quad: max/sum by 2 xor shuffles), P rounded to f16 is
// re-used in registers as the A operand of O += P V (the accumulator layout of two n8 tiles is the A
// layout of one k16 step).
//
// fa_mma<D, kDecode, true>: Dual Chunk Attention (fa_common.cuh). q holds the three rotations; the Q tile
// in shared memory holds one of them, reloaded while a tile is dequantized when the tile holds one regime
// only and it is another (a few times per block: the keys are walked in slot order). A tile with several
// regimes (across a chunk boundary of a regime change: at most about two per row block) keeps the tensor-core
// scores of the regime in shared memory and recomputes the other visible pairs one by one.
//
// fa_mma<D, true, kDca, true>: K and V f16, decode (plain or DCA). The cache rows are already the tiles' f16
// rows, so cp.async copies them straight into K and V tiles (row major; P V takes V's fragments with
// ldmatrix .trans instead of a transposed copy) and the staging buffer and dequantizing pass go away; two
// stages for D <= 128 overlap the copies of tile t + 1 with all the work on tile t (MmaF16Layout). On an H200
// (Nsight Compute, head dim 128, 64k keys, 64 splits) this halved the instructions of a launch (70M -> 33M) and
// took its memory throughput from 1.7 to 2.5 TB/s (before the fragments came by ldmatrix).
//
// Grid: (ceil(n_q * group / kRows), n_split, n_kv); block 128 threads; dynamic shared memory
// MmaLayout::bytes / MmaF16Layout::kBytes (mirrored in cupyllm/attention/gpu_kernels.py; the kernel traps if
// given less).
// Outputs as fa_vec (fa_common.cuh).
#pragma once
#include "attention/fa_common.cuh"

namespace cupyllm {

template <int D, bool kDecode>
struct MmaConfig {
    static_assert(D == 64 || D == 128 || D == 256 || D == 512, "head dims 64, 128, 256, 512");
    static constexpr int kColSplit = D == 512 ? 2 : 1;
    static constexpr int kKeyParts = kDecode ? (kFaThreads / 32) / kColSplit : 1;   // warps splitting the keys
    static constexpr int kRowWarps = (kFaThreads / 32) / kColSplit / kKeyParts;
    static constexpr int kRows = 16 * kRowWarps;  // prefill 64 (32 for D = 512), decode 16
    // keys per tile: prefill 64, 32 (D = 256), 16 (D = 512); decode 16 per key part
    static constexpr int kTile = kDecode ? 16 * kKeyParts : D <= 128 ? 64 : 8192 / D;
    static constexpr int kWarpKeys = kTile / kKeyParts;  // keys of a tile one warp multiplies
    static_assert(kWarpKeys % 16 == 0, "P V takes keys 16 at a time");
    static constexpr int kDv = D / kColSplit;           // output dims per warp
    static constexpr int kQStride = D + 8;              // halves per row of Q and K in shared memory
    static constexpr int kVStride = kTile + 8;          // halves per row of V^T
};

// Dynamic shared memory layout (byte offsets).
template <int D, bool kDecode>
struct MmaLayout {
    using C = MmaConfig<D, kDecode>;
    static constexpr int kQ = 0;                                    // half [kRows][kQStride]
    static constexpr int kK = kQ + C::kRows * C::kQStride * 2;       // half [kTile][kQStride]
    static constexpr int kV = kK + C::kTile * C::kQStride * 2;       // half [D][kVStride]  (V^T)
    static constexpr int kPos = kV + D * C::kVStride * 2;            // int [kTile]: positions of the tile
    static constexpr int kRawPos = kPos + C::kTile * 4;              // int [kTile]: staged positions
    static constexpr int kKRaw = kRawPos + C::kTile * 4;             // u8 [kTile][LK.slot_bytes]: staged K rows
    int v_raw, k_table, v_table, bytes;                              // then V rows, the tables

    __device__ static MmaLayout of(const StagedRows& LK, const StagedRows& LV, int k_table_len, int v_table_len) {
        MmaLayout s;
        s.v_raw = kKRaw + C::kTile * LK.slot_bytes;
        s.k_table = s.v_raw + C::kTile * LV.slot_bytes;
        s.v_table = s.k_table + (k_table_len + 3) / 4 * 16;
        s.bytes = max(s.v_table + (v_table_len + 3) / 4 * 16, kMergeBytes);
        return s;
    }
    // decode: the key parts' O (f32 [kKeyParts][16][D]) over the start of the buffer after the last tile
    static constexpr int kMergeBytes = C::kKeyParts > 1 ? C::kKeyParts * 16 * D * 4 : 0;
};

// fa_mma<D, true, false, true> (K and V f16, decode): Q, then kStages stages of K [kTile][kQStride],
// V [kTile][kQStride] (row major) and the tile's positions, all copied by cp.async (byte offsets).
template <int D>
struct MmaF16Layout {
    using C = MmaConfig<D, true>;
    static constexpr int kStages = D <= 128 ? 2 : 1;  // two stages of D = 256 / 512 would leave 1 block per SM
    static constexpr int kTileHalves = C::kTile * C::kQStride;
    static constexpr int kStage = C::kRows * C::kQStride * 2;   // the first stage, after Q
    static constexpr int kStageBytes = 2 * kTileHalves * 2 + C::kTile * 4;
    static constexpr int kEnd = kStage + kStages * kStageBytes;
    static constexpr int kBytes = kEnd > MmaLayout<D, true>::kMergeBytes ? kEnd : MmaLayout<D, true>::kMergeBytes;
};

// Issue the cp.async copies of the raw K / V rows and positions of the tile at key `first` (one group).
template <int kTile>
__device__ __forceinline__ void stage_mma_tile(const StagedRows& LK, const StagedRows& LV, u8* k_raw, u8* v_raw,
                                               int* raw_pos, const u8* k_cache, const u8* v_cache,
                                               const int* slot_pos, KeyRange keys, int first, int n_kv, int kh,
                                               long long n_cache_rows, int tid) {
    const int n_valid = min(kTile, keys.end - first);
    stage_rows(LK, k_raw, k_cache, first, kTile, n_valid, n_kv, kh, n_cache_rows, tid);
    stage_rows(LV, v_raw, v_cache, first, kTile, n_valid, n_kv, kh, n_cache_rows, tid);
    if (tid < kTile) cp_async<4>(raw_pos + tid, tid < n_valid ? slot_pos + first + tid : slot_pos, tid < n_valid);
    cp_async_commit();
}

// The f16 Q tile: rows r < rows_here of q [n_q][n_head][D] (row r = (query r / group, head r % group) of
// KV head kh), zero past the end; row stride kQStride halves. Every thread of the block takes part.
template <int D, int kRows, int kQStride>
__device__ __forceinline__ void load_q_tile(__half* q_s, const __half* q, int rows_here, int row0, int group, int kh,
                                            int n_head, int tid) {
    constexpr int kChunks = D / 8;
    for (int task = tid; task < kRows * kChunks; task += kFaThreads) {
        const int r = task / kChunks, c = task % kChunks;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (r < rows_here) {
            const RowIndex ri = row_index(row0 + r, group, kh);
            w = reinterpret_cast<const uint4*>(q + (static_cast<long long>(ri.query) * n_head + ri.head) * D)[c];
        }
        *reinterpret_cast<uint4*>(q_s + r * kQStride + 8 * c) = w;
    }
}

// DCA: q . k of one f16 Q row (global memory) and one f16 K row (shared memory), f32 sums. Out of line:
// the rare tiles that need it do not cost the main loop registers.
template <int D>
__device__ __noinline__ float dca_pair_score(const __half* q_row, const __half* k_row) {
    float sum = 0.0f;
#pragma unroll 4
    for (int c = 0; c < D; c += 2) {
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(q_row + c));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(k_row + c));
        sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
    }
    return sum;
}

// s += Q K^T for one warp's 16 Q rows (q_rows, row stride kQStride) and kWarpKeys keys from k_keys (row major,
// the same stride), every fragment loaded by ldmatrix: one for Q's k16 step, one for two key tiles' B.
template <int D, int kWarpKeys, int kQStride>
__device__ __forceinline__ void qk_tile(float (&s)[kWarpKeys / 8][4], const __half* q_rows, const __half* k_keys,
                                        int lane) {
    static_assert(kWarpKeys % 16 == 0, "key tiles in pairs");
    const int m = lane / 8, row = lane % 8;  // this lane gives the address of row `row` of ldmatrix's matrix m
    const __half* a_row = q_rows + ((m & 1) * 8 + row) * kQStride + (m >> 1) * 8;  // a[m]: rows +0 / +8, dims +0 / +8
    const __half* b_row = k_keys + ((m >> 1) * 8 + row) * kQStride + (m & 1) * 8;  // key tile n, n + 1; dims +0 / +8
#pragma unroll 4
    for (int k0 = 0; k0 < D; k0 += 16) {
        u32 a[4];
        ldmatrix_x4<false>(a, a_row + k0);
#pragma unroll
        for (int n = 0; n < kWarpKeys / 8; n += 2) {
            u32 b[4];
            ldmatrix_x4<false>(b, b_row + n * 8 * kQStride + k0);
            const u32 b_lo[2] = {b[0], b[1]}, b_hi[2] = {b[2], b[3]};
            mma_m16n8k16_f16_f32(s[n], a, b_lo, s[n]);
            mma_m16n8k16_f16_f32(s[n + 1], a, b_hi, s[n + 1]);
        }
    }
}

}  // namespace cupyllm

template <int D, bool kDecode, bool kDca = false, bool kF16 = false>
__global__ void __launch_bounds__(cupyllm::kFaThreads)
fa_mma(const __half* __restrict__ q, const cupyllm::u8* __restrict__ k_cache, const cupyllm::u8* __restrict__ v_cache,
       const int* __restrict__ slot_pos, const int* __restrict__ q_pos, const float* __restrict__ mask,
       long long mask_stride, const float* __restrict__ k_table, const float* __restrict__ v_table,
       float* __restrict__ o_part, float* __restrict__ lse_part, int n_q, int n_head, int n_kv, int n_slots,
       int n_keys, int keys_per_split, int window, float softcap, int slots_are_positions, int k_fmt, int v_fmt,
       int k_row_bytes, int v_row_bytes, int k_table_len, int v_table_len, int dca_chunk_len) {
    using namespace cupyllm;
    using C = MmaConfig<D, kDecode>;
    using S = MmaLayout<D, kDecode>;
    constexpr int kRows = C::kRows, kTile = C::kTile, kQStride = C::kQStride, kVStride = C::kVStride;
    constexpr int kWarpKeys = C::kWarpKeys;
    constexpr int kChunks = D / 8, G = GroupOf<D>::value;

    extern __shared__ __align__(16) u8 fa_smem[];
    const StagedRows LK = StagedRows::of(k_row_bytes), LV = StagedRows::of(v_row_bytes);
    const S layout = S::of(LK, LV, k_table_len, v_table_len);
    static_assert(!kF16 || kDecode, "the f16 path is a decode layout");
    const int smem_needed = kF16 ? MmaF16Layout<D>::kBytes : layout.bytes;
    if (dynamic_smem_bytes() < static_cast<u32>(smem_needed)) __trap();  // gpu_kernels.py sized it too small
    __half* q_s = reinterpret_cast<__half*>(fa_smem + S::kQ);
    __half* k_s = reinterpret_cast<__half*>(fa_smem + S::kK);
    __half* vt_s = reinterpret_cast<__half*>(fa_smem + S::kV);
    int* pos_s = reinterpret_cast<int*>(fa_smem + S::kPos);
    int* raw_pos_s = reinterpret_cast<int*>(fa_smem + S::kRawPos);
    u8* k_raw = fa_smem + S::kKRaw;
    u8* v_raw = fa_smem + layout.v_raw;
    float* ktab_s = reinterpret_cast<float*>(fa_smem + layout.k_table);
    float* vtab_s = reinterpret_cast<float*>(fa_smem + layout.v_table);
    __shared__ long long row_qpos[kRows];
    __shared__ int row_query[kRows];
    __shared__ long long qpos_range[2];
    __shared__ float part_m[C::kKeyParts][kRows], part_l[C::kKeyParts][kRows];
    __shared__ DcaRows dca_rows_s;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4;                          // mma fragment coordinates
    const int col_part = warp % C::kColSplit;
    const int key_part = (warp / C::kColSplit) % C::kKeyParts;     // decode: this warp's quarter of each tile
    const int row_warp = warp / (C::kColSplit * C::kKeyParts);
    const int key0 = key_part * kWarpKeys;                         // its first key within a tile
    const int kh = blockIdx.z, split = blockIdx.y;
    const int group = n_head / n_kv;
    const int row0 = blockIdx.x * kRows;
    const int rows_here = min(kRows, n_q * group - row0);
    const long long n_cache_rows = static_cast<long long>(n_slots) * n_kv;

    // ---- setup: tables, Q tile (f16, zero rows past the end), row positions ----
    for (int i = tid; i < k_table_len; i += kFaThreads) ktab_s[i] = k_table[i];
    for (int i = tid; i < v_table_len; i += kFaThreads) vtab_s[i] = v_table[i];
    // DCA loads the rotation its first tile needs there (dca_tile): most splits of a long context hold inter
    // keys only, so loading the intra rotation first would only be replaced at once
    if constexpr (!kDca) load_q_tile<D, kRows, kQStride>(q_s, q, rows_here, row0, group, kh, n_head, tid);
    int q_loaded = kDca ? -1 : 0;  // DCA: the rotation in q_s (-1: none yet)
    const long long q_regime_stride = static_cast<long long>(n_q) * n_head * D;  // DCA: Q [3][n_q][n_head][D]
    for (int r = tid; r < kRows; r += kFaThreads) {
        const int query = r < rows_here ? row_index(row0 + r, group, kh).query : 0;
        row_query[r] = query;
        row_qpos[r] = r < rows_here ? q_pos[query] : -1;  // -1: no key is visible to a padding row
    }
    __syncthreads();
    if (tid == 0) summarize_rows<kDca>(row_qpos, rows_here, dca_chunk_len, qpos_range, &dca_rows_s);
    __syncthreads();
    const KeyRange keys = split_key_range(split, keys_per_split, n_keys, slots_are_positions != 0, qpos_range[0],
                                          qpos_range[1], window);

    const long long qpos_lo = qpos_range[0], qpos_hi = qpos_range[1];  // over the block's rows
    // this thread's two rows (g and g + 8 of its warp's 16)
    const int my_row[2] = {row_warp * 16 + g, row_warp * 16 + g + 8};
    const long long my_qpos[2] = {row_qpos[my_row[0]], row_qpos[my_row[1]]};
    const int my_query[2] = {row_query[my_row[0]], row_query[my_row[1]]};
    int my_chunk[2] = {0, 0};
    if constexpr (kDca) {
        my_chunk[0] = dca_chunk(static_cast<int>(my_qpos[0]), dca_chunk_len);
        my_chunk[1] = dca_chunk(static_cast<int>(my_qpos[1]), dca_chunk_len);
    }

    float o_acc[C::kDv / 8][4];
#pragma unroll
    for (int n = 0; n < C::kDv / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) o_acc[n][i] = 0.0f;
    float m_run[2] = {neg_inf(), neg_inf()};
    float l_part[2] = {0.0f, 0.0f};  // this thread's share of the row sums (the quad is summed at the end)

    // ldmatrix of the V fragments of P V for output dim tiles n, n + 1 and the 16 keys from `key`: from V^T
    // [dim][kVStride] as it is, or, on the f16 path, transposed from row-major V [key][kQStride]; b[0], b[1]
    // are tile n's, b[2], b[3] tile n + 1's.
    const int ld_m = lane / 8, ld_row = lane % 8;  // this lane's row address: row ld_row of matrix ld_m
    auto load_v_pairs = [&](u32 (&b)[4], const __half* v_base, int n, int key) {
        if constexpr (kF16) {
            ldmatrix_x4<true>(b, v_base + (key + (ld_m & 1) * 8 + ld_row) * kQStride + (n + (ld_m >> 1)) * 8);
        } else {
            ldmatrix_x4<false>(b, v_base + ((n + (ld_m >> 1)) * 8 + ld_row) * kVStride + key + (ld_m & 1) * 8);
        }
    };
    // Mask, softcap and online softmax on this warp's score fragments of the tile at key `first` (positions
    // `pos`, n_valid keys), then O += P V with V from v_base (load_v_pairs).
    auto softmax_and_pv = [&](float (&s_acc)[kWarpKeys / 8][4], const int* pos, int n_valid, int first,
                              const __half* v_base) {
        // ---- mask, softcap, online softmax on the fragments ----
        // Most tiles (every decode tile but the last, prefill tiles below the diagonal) hold keys that every
        // row of the block sees, with no additive mask: those skip the tests per score. (Padding rows past
        // rows_here then score finite values too; they are never written out.)
        bool lane_sees_all = true;
#pragma unroll
        for (int q = lane; q < kWarpKeys; q += 32) {
            const int j = key0 + q;
            lane_sees_all = lane_sees_all && j < n_valid && key_visible(pos[j], qpos_lo, window) &&
                            key_visible(pos[j], qpos_hi, window);  // (every window's rule holds on [lo, hi])
        }
        const bool all_visible = mask_stride <= 0 && __all_sync(kFullMask, lane_sees_all);
        float m_tile[2] = {neg_inf(), neg_inf()};
        if (all_visible) {
#pragma unroll
            for (int n = 0; n < kWarpKeys / 8; ++n) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    s_acc[n][i] = apply_softcap(s_acc[n][i], softcap);
                    m_tile[i >> 1] = fmaxf(m_tile[i >> 1], s_acc[n][i]);
                }
            }
        } else {
#pragma unroll
            for (int n = 0; n < kWarpKeys / 8; ++n) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int j = key0 + n * 8 + 2 * t + (i & 1), h = i >> 1;
                    float s = apply_softcap(s_acc[n][i], softcap);
                    const bool visible = j < n_valid && key_visible(pos[j], my_qpos[h], window);
                    if (mask_stride > 0 && visible) s += mask[my_query[h] * mask_stride + first + j];
                    s = visible ? s : neg_inf();
                    s_acc[n][i] = s;
                    m_tile[h] = fmaxf(m_tile[h], s);
                }
            }
        }
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            m_tile[h] = fmaxf(m_tile[h], __shfl_xor_sync(kFullMask, m_tile[h], 1));
            m_tile[h] = fmaxf(m_tile[h], __shfl_xor_sync(kFullMask, m_tile[h], 2));
            const float m_new = fmaxf(m_run[h], m_tile[h]);
            const float m_use = m_new == neg_inf() ? 0.0f : m_new;  // no visible key yet: exp(-inf) = 0
            alpha[h] = __expf(m_run[h] - m_use);
            m_run[h] = m_new;
            l_part[h] *= alpha[h];
#pragma unroll
            for (int n = 0; n < kWarpKeys / 8; ++n) {
#pragma unroll
                for (int i = 2 * h; i < 2 * h + 2; ++i) {
                    s_acc[n][i] = __expf(s_acc[n][i] - m_use);
                    l_part[h] += s_acc[n][i];
                }
            }
        }
        // O is rescaled only when some row's max moved: past the first tiles it seldom does, and skipping a
        // multiply by 1 changes nothing (kDv / 2 multiplies per thread and tile otherwise)
        if (__any_sync(kFullMask, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
            for (int n = 0; n < C::kDv / 8; ++n) {
                o_acc[n][0] *= alpha[0];
                o_acc[n][1] *= alpha[0];
                o_acc[n][2] *= alpha[1];
                o_acc[n][3] *= alpha[1];
            }
        }

        // ---- O += P V: P from the score fragments, V by ldmatrix ----
#pragma unroll
        for (int kk = 0; kk < kWarpKeys / 16; ++kk) {
            const u32 a[4] = {pack_half2(s_acc[2 * kk][0], s_acc[2 * kk][1]), pack_half2(s_acc[2 * kk][2], s_acc[2 * kk][3]),
                              pack_half2(s_acc[2 * kk + 1][0], s_acc[2 * kk + 1][1]),
                              pack_half2(s_acc[2 * kk + 1][2], s_acc[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < C::kDv / 8; n += 2) {
                u32 b[4];
                load_v_pairs(b, v_base, n, key0 + kk * 16);
                const u32 b_lo[2] = {b[0], b[1]}, b_hi[2] = {b[2], b[3]};
                mma_m16n8k16_f16_f32(o_acc[n], a, b_lo, o_acc[n]);
                mma_m16n8k16_f16_f32(o_acc[n + 1], a, b_hi, o_acc[n + 1]);
            }
        }
    };

    // DCA: the regimes the tile at positions `pos` can hold (the same set in every warp); when it holds one
    // regime only and q_s holds another, or q_s holds none yet, a regime's Q is loaded into q_s (returns true:
    // the caller makes the new Q visible before multiplying).
    DcaChunkWalk dca_walk = DcaChunkWalk::at(keys.begin, kDca ? dca_chunk_len : 1);
    auto dca_tile = [&](const int* pos, int first, int n_valid, u32& regimes) -> bool {
        regimes = dca_walk.tile(slots_are_positions != 0, pos, first, n_valid, dca_rows_s, lane);
        const int lowest = regimes != 0u ? __ffs(static_cast<int>(regimes)) - 1 : 0;
        const bool single = regimes != 0u && (regimes & (regimes - 1u)) == 0u;
        const int want = single || q_loaded < 0 ? lowest : q_loaded;  // several: keep q_s, the rest pair by pair
        if (want == q_loaded) return false;
        load_q_tile<D, kRows, kQStride>(q_s, q + want * q_regime_stride, rows_here, row0, group, kh, n_head, tid);
        q_loaded = want;
        return true;
    };
    // DCA, a tile with several regimes (across a chunk boundary: at most ~2 per row block): the scores of the
    // visible pairs whose regime is not the one in q_s, one by one from Q in global memory and the f16 K rows.
    auto dca_other_regimes = [&](float (&s_acc)[kWarpKeys / 8][4], const __half* k_rows, const int* pos, int n_valid) {
#pragma unroll
        for (int n = 0; n < kWarpKeys / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int j = key0 + n * 8 + 2 * t + (i & 1), h = i >> 1;
                if (j >= n_valid) continue;
                const int regime = dca_regime(my_chunk[h], dca_chunk(pos[j], dca_chunk_len));
                if (regime != q_loaded && key_visible(pos[j], my_qpos[h], window)) {
                    const RowIndex ri = row_index(row0 + my_row[h], group, kh);
                    const __half* q_row = q + regime * q_regime_stride +
                                          (static_cast<long long>(ri.query) * n_head + ri.head) * D;
                    s_acc[n][i] = dca_pair_score<D>(q_row, k_rows + j * kQStride);
                }
            }
        }
    };

    if constexpr (kF16) {
        // K and V f16 (decode): the cache rows are the tiles' rows already. cp.async copies them straight into
        // K [kTile][kQStride] and V [kTile][kQStride] of a stage (no staging buffer, no dequantizing pass, no
        // transposition: P V loads V's fragments with ldmatrix .trans); two stages for D <= 128, so the copies
        // of tile t + 1 overlap all the work on tile t.
        using L = MmaF16Layout<D>;
        // Consecutive threads copy consecutive 16 bytes: thread tid takes chunk tid % kChunks of the tile's rows
        // tid / kChunks + i * kRowStep (kFaThreads is a multiple of kChunks), so its addresses advance by fixed
        // strides and the copy loop is the copies alone.
        constexpr int kRowStep = kFaThreads / kChunks;
        const int my_chunk = tid % kChunks, my_first_row = tid / kChunks;
        const long long k_step = static_cast<long long>(kRowStep) * n_kv * k_row_bytes;
        const long long v_step = static_cast<long long>(kRowStep) * n_kv * v_row_bytes;
        auto stage_f16 = [&](int first, int stage) {
            __half* k_dst = reinterpret_cast<__half*>(fa_smem + L::kStage + stage * L::kStageBytes);
            __half* v_dst = k_dst + L::kTileHalves;
            int* pos_dst = reinterpret_cast<int*>(v_dst + L::kTileHalves);
            const int n_valid = min(kTile, keys.end - first);
            const long long row0 = (static_cast<long long>(first) + my_first_row) * n_kv + kh;
            const u8* k_src = k_cache + row0 * k_row_bytes + 16 * my_chunk;
            const u8* v_src = v_cache + row0 * v_row_bytes + 16 * my_chunk;
            __half* k_to = k_dst + my_first_row * kQStride + 8 * my_chunk;
            __half* v_to = v_dst + my_first_row * kQStride + 8 * my_chunk;
#pragma unroll
            for (int j = my_first_row; j < kTile; j += kRowStep) {
                const bool valid = j < n_valid;  // rows past the end are zero-filled (their source is not read)
                cp_async<16>(k_to, valid ? k_src : k_cache, valid);
                cp_async<16>(v_to, valid ? v_src : v_cache, valid);
                k_src += k_step;
                v_src += v_step;
                k_to += kRowStep * kQStride;
                v_to += kRowStep * kQStride;
            }
            if (tid < kTile) cp_async<4>(pos_dst + tid, tid < n_valid ? slot_pos + first + tid : slot_pos, tid < n_valid);
            cp_async_commit();
        };
        int stage = 0;
        if (keys.begin < keys.end) stage_f16(keys.begin, 0);
        for (int first = keys.begin; first < keys.end; first += kTile) {
            const bool more = first + kTile < keys.end;
            if (L::kStages == 2 && more) {
                stage_f16(first + kTile, stage ^ 1);  // that stage's last reader passed the barrier below
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();  // this tile has landed for every thread
            const __half* k_tile = reinterpret_cast<const __half*>(fa_smem + L::kStage + stage * L::kStageBytes);
            const __half* v_tile = k_tile + L::kTileHalves + col_part * C::kDv;
            const int* pos = reinterpret_cast<const int*>(k_tile + 2 * L::kTileHalves);
            const int n_valid = min(kTile, keys.end - first);
            u32 regimes = 1u;
            if constexpr (kDca) {
                if (dca_tile(pos, first, n_valid, regimes)) __syncthreads();  // the new Q tile, before any warp multiplies
            }
            float s_acc[kWarpKeys / 8][4] = {};
            qk_tile<D, kWarpKeys, kQStride>(s_acc, q_s + (row_warp * 16) * kQStride, k_tile + key0 * kQStride, lane);
            if (kDca && (regimes & (regimes - 1u)) != 0u) dca_other_regimes(s_acc, k_tile, pos, n_valid);
            softmax_and_pv(s_acc, pos, n_valid, first, v_tile);
            __syncthreads();  // every warp is done with this stage before it is refilled
            if (L::kStages == 1 && more) stage_f16(first + kTile, 0);
            if (L::kStages == 2) stage ^= 1;
        }
    } else {
        if (keys.begin < keys.end)
            stage_mma_tile<kTile>(LK, LV, k_raw, v_raw, raw_pos_s, k_cache, v_cache, slot_pos, keys, keys.begin, n_kv, kh,
                                  n_cache_rows, tid);
        for (int first = keys.begin; first < keys.end; first += kTile) {
            const int n_valid = min(kTile, keys.end - first);
            cp_async_wait<0>();
            __syncthreads();  // the staged tile has landed, and the previous tile's f16 tiles are no longer read
            u32 regimes = 1u;  // DCA: the regimes this tile can hold (the barrier below publishes a new Q tile)
            if constexpr (kDca) dca_tile(raw_pos_s, first, n_valid, regimes);

            // ---- dequantize the staged rows: K as f16 rows, V transposed, positions ----
            with_format<G>(k_fmt, DequantRows<D, kTile, kQStride>{{LK, k_raw, k_s, first, n_kv, kh, ktab_s, tid}});
            with_format<G>(v_fmt, DequantColumns<D, kTile, kVStride>{{LV, v_raw, vt_s, first, n_kv, kh, vtab_s, tid}});
            for (int j = tid; j < kTile; j += kFaThreads) pos_s[j] = raw_pos_s[j];
            __syncthreads();  // f16 tiles ready; the staging buffer is free
            if (first + kTile < keys.end)  // the next tile's copies overlap this tile's arithmetic
                stage_mma_tile<kTile>(LK, LV, k_raw, v_raw, raw_pos_s, k_cache, v_cache, slot_pos, keys, first + kTile,
                                      n_kv, kh, n_cache_rows, tid);

            // ---- S = Q K^T for this warp's 16 rows x kWarpKeys keys ----
            float s_acc[kWarpKeys / 8][4];
#pragma unroll
            for (int n = 0; n < kWarpKeys / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) s_acc[n][i] = 0.0f;
            qk_tile<D, kWarpKeys, kQStride>(s_acc, q_s + (row_warp * 16) * kQStride, k_s + key0 * kQStride, lane);
            if (kDca && (regimes & (regimes - 1u)) != 0u) dca_other_regimes(s_acc, k_s, pos_s, n_valid);

            softmax_and_pv(s_acc, pos_s, n_valid, first, vt_s + (col_part * C::kDv) * kVStride);
            __syncthreads();  // the next tile overwrites K, V^T and the positions
        }
    }

    // ---- normalise and write this split's O and LSE ----
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_part[h] += __shfl_xor_sync(kFullMask, l_part[h], 1);
        l_part[h] += __shfl_xor_sync(kFullMask, l_part[h], 2);
    }
    if constexpr (C::kKeyParts == 1) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = my_row[h];
            if (r >= rows_here) continue;
            const RowIndex ri = row_index(row0 + r, group, kh);
            const long long out_row = (static_cast<long long>(split) * n_q + ri.query) * n_head + ri.head;
            const float l = l_part[h];
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            float* o = o_part + out_row * D + col_part * C::kDv + 2 * t;
#pragma unroll
            for (int n = 0; n < C::kDv / 8; ++n)
                *reinterpret_cast<float2*>(o + n * 8) = make_float2(o_acc[n][2 * h] * inv, o_acc[n][2 * h + 1] * inv);
            if (col_part == 0 && t == 0) lse_part[out_row] = l > 0.0f ? m_run[h] + logf(l) : neg_inf();
        }
    } else {
        // decode: merge the key parts like splits (fa_combine's rule), through shared memory
        float* merge_s = reinterpret_cast<float*>(fa_smem);  // [kKeyParts][16][D], over the tiles: all done
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float* o = merge_s + (key_part * 16 + my_row[h]) * D + col_part * C::kDv + 2 * t;
#pragma unroll
            for (int n = 0; n < C::kDv / 8; ++n)
                *reinterpret_cast<float2*>(o + n * 8) = make_float2(o_acc[n][2 * h], o_acc[n][2 * h + 1]);
            if (col_part == 0 && t == 0) {
                part_m[key_part][my_row[h]] = m_run[h];
                part_l[key_part][my_row[h]] = l_part[h];
            }
        }
        __syncthreads();
        for (int idx = tid; idx < rows_here * D; idx += kFaThreads) {
            const int r = idx / D, d = idx % D;
            float m = neg_inf();
#pragma unroll
            for (int p = 0; p < C::kKeyParts; ++p) m = fmaxf(m, part_m[p][r]);
            float l = 0.0f, o = 0.0f;
            if (m != neg_inf()) {
#pragma unroll
                for (int p = 0; p < C::kKeyParts; ++p) {
                    const float w = __expf(part_m[p][r] - m);  // a part without visible keys: exp(-inf) = 0
                    l += w * part_l[p][r];
                    o += w * merge_s[(p * 16 + r) * D + d];
                }
            }
            const RowIndex ri = row_index(row0 + r, group, kh);
            const long long out_row = (static_cast<long long>(split) * n_q + ri.query) * n_head + ri.head;
            o_part[out_row * D + d] = l > 0.0f ? o / l : 0.0f;
            if (d == 0) lse_part[out_row] = l > 0.0f ? m + logf(l) : neg_inf();
        }
    }
}
