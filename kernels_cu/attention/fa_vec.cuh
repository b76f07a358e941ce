// FA-VEC: flash attention for a few query rows per KV head (decode, small batches), split over the keys.
//
// fa_vec<D, kRows>: one block = up to kRows (4 or 8) query rows that share one KV head (the query heads of
// a GQA group, times the queries), over one split of the keys. The K and V rows are read from the cache
// once per block and dequantized in registers (Chunk8 of the K / V format: runtime ids, fa_common.cuh),
// so GQA reads the KV once for the whole group.
//
// Grid: (ceil(n_q * group / kRows), n_split, n_kv); block: 128 threads; dynamic shared memory
// VecLayout::bytes (mirrored in cupyllm/attention/gpu_kernels.py; the kernel traps if given less).
// Writes O_part / LSE_part of its split (fa_common.cuh); with one split and no V rotation these are the
// final O / LSE.
//
// Thread layout: thread t owns the 8 dims [8c, 8c + 8) with c = t % (D / 8) for the whole kernel, and key
// slot t / (D / 8) of each tile (kKeySlots keys side by side, kKeysPerThread keys each). So its slice of
// every Q row stays in registers (no shared-memory traffic per key), and the same mapping serves both
// products. Per tile of kTile keys (32 for D <= 128, 16 for D = 256, 8 for D = 512):
//   1. the raw K and V rows (and slot positions) of tile t + 1 are copied to shared memory with cp.async
//      while tile t is computed (double buffering: HBM traffic overlaps the arithmetic);
//   2. scores: each thread dots its 8 dims of its keys with its 8 dims of every row; the D / 8 threads of a
//      key sum their partial dots with a butterfly reduce-scatter (about kRows shuffles per key for kRows
//      sums, instead of kRows * log2(lanes));
//   3. mask + softcap + online softmax, one warp per row and one lane per key;
//   4. O += P V: each thread adds its keys' V dims times P into kRows x 8 accumulators; the key slots are
//      summed once at the end.
//
// fa_vec<D, kRows, true>: Dual Chunk Attention (fa_common.cuh): q holds the three rotations, and step 2
// runs once per regime the tile can hold, with that regime's Q slice reloaded into the registers only
// when it changes (a few times per block: the keys are walked in slot order); a tile with several
// regimes keeps each (row, key) score from the pass of its own regime.
#pragma once
#include "attention/fa_common.cuh"

namespace cupyllm {

template <int D, int kRows_>
struct VecConfig {
    static_assert(D == 64 || D == 128 || D == 256 || D == 512, "head dims 64, 128, 256, 512");
    static_assert(kRows_ == 4 || kRows_ == 8, "4 or 8 query rows per block");
    static constexpr int kRows = kRows_;
    static constexpr int kTile = D <= 128 ? 32 : 4096 / D;                // keys per tile: ~16 KB of f16 K + V
    static constexpr int kChunkThreads = D / 8;                           // threads covering one row
    static constexpr int kKeySlots = kFaThreads / kChunkThreads;          // keys side by side: 16, 8, 4, 2
    static constexpr int kKeysPerThread = kTile / kKeySlots;              // 2, 4, 4, 4
    static constexpr int kReduceLanes = kChunkThreads < 32 ? kChunkThreads : 32;  // one warp at most
    static constexpr int kScoreParts = kChunkThreads / kReduceLanes;      // 2 for D = 512: a key spans 2 warps
    // after the reduce-scatter of a key's kRows dots: kSums sums per lane, each held by kSharers lanes
    static constexpr int kSums = kRows >= kReduceLanes ? kRows / kReduceLanes : 1;
    static constexpr int kSharers = kRows >= kReduceLanes ? 1 : kReduceLanes / kRows;
    static_assert(kTile <= 32, "one lane per key in the softmax");
};

// Dynamic shared memory layout (byte offsets from the 16-byte aligned base).
template <class C>
struct VecLayout {
    int k_raw, v_raw, pos, scores, k_table, v_table, bytes;

    __device__ static VecLayout of(const StagedRows& LK, const StagedRows& LV, int k_table_len, int v_table_len) {
        VecLayout s;
        s.k_raw = 0;                                                   // u8 [2][kTile][LK.slot_bytes]
        s.v_raw = s.k_raw + 2 * C::kTile * LK.slot_bytes;              // u8 [2][kTile][LV.slot_bytes]
        const int raw_end = s.v_raw + 2 * C::kTile * LV.slot_bytes;
        const int reduce = C::kKeySlots * C::kRows * C::kChunkThreads * 8 * 4;  // float [slots][kRows][D], at the end
        s.pos = max(raw_end, reduce);                                  // int [2][kTile]
        s.scores = s.pos + 2 * C::kTile * 4;                           // float [kScoreParts][kRows][kTile]
        s.k_table = s.scores + C::kScoreParts * C::kRows * C::kTile * 4;  // float [k_table_len]
        s.v_table = s.k_table + (k_table_len + 3) / 4 * 16;           // float [v_table_len]
        s.bytes = s.v_table + (v_table_len + 3) / 4 * 16;
        return s;
    }
};

// Sums each of the kValues values over the kLanes lanes of a group (aligned, power of two) and spreads
// the sums: at each xor step a lane keeps one half of its values and adds its partner's copy of that
// half, so kValues - 1 shuffles in all. Afterwards lane holds the sums of values [first, first + kOut),
// kOut = max(1, kValues / kLanes); with fewer values than lanes the last steps are plain reductions and
// every lane whose bits below kLanes / kValues are zero holds a (shared) sum.
template <int kN, int kOffset, int kValues>
struct ReduceScatter {
    __device__ static void run(float (&v)[kValues], int lane, int& first) {
        if constexpr (kOffset > 0) {
            if constexpr (kN >= 2) {
                constexpr int kHalf = kN / 2;
                const bool upper = (lane & kOffset) != 0;
#pragma unroll
                for (int i = 0; i < kHalf; ++i) {
                    const float send = upper ? v[i] : v[i + kHalf];
                    const float keep = upper ? v[i + kHalf] : v[i];
                    v[i] = keep + __shfl_xor_sync(kFullMask, send, kOffset);
                }
                if (upper) first += kHalf;
                ReduceScatter<kHalf, kOffset / 2, kValues>::run(v, lane, first);
            } else {
                v[0] += __shfl_xor_sync(kFullMask, v[0], kOffset);
                ReduceScatter<1, kOffset / 2, kValues>::run(v, lane, first);
            }
        }
    }
};

// This thread's 8 dims (chunk c) of the Q row of every block row r < rows_here; zero for rows past the end
// (finite scores). q: [n_q][n_head][D].
template <int D, int kRows>
__device__ __forceinline__ void load_q_slice(float (&q_reg)[kRows][8], const float* q, int rows_here, int row0,
                                             int group, int kh, int n_head, int c) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
        if (r < rows_here) {
            const RowIndex ri = row_index(row0 + r, group, kh);
            const float4* src = reinterpret_cast<const float4*>(q + (static_cast<long long>(ri.query) * n_head + ri.head) * D);
            a = src[2 * c];
            b = src[2 * c + 1];
        }
        q_reg[r][0] = a.x; q_reg[r][1] = a.y; q_reg[r][2] = a.z; q_reg[r][3] = a.w;
        q_reg[r][4] = b.x; q_reg[r][5] = b.y; q_reg[r][6] = b.z; q_reg[r][7] = b.w;
    }
}

template <class C>
struct StageTile {  // copies the raw K, V rows and slot positions of tile t into buffer t % 2
    const StagedRows& LK;
    const StagedRows& LV;
    u8* k_raw;
    u8* v_raw;
    int* pos;
    const u8* k_cache;
    const u8* v_cache;
    const int* slot_pos;
    KeyRange keys;
    int n_kv, kh;
    long long n_cache_rows;
    int tid;

    __device__ void operator()(int t) const {
        constexpr int kTile = C::kTile;
        const int buf = t & 1;
        const long long first = keys.begin + static_cast<long long>(t) * kTile;
        const int n_valid = min(kTile, keys.end - static_cast<int>(first));
        stage_rows(LK, k_raw + buf * kTile * LK.slot_bytes, k_cache, first, kTile, n_valid, n_kv, kh, n_cache_rows, tid);
        stage_rows(LV, v_raw + buf * kTile * LV.slot_bytes, v_cache, first, kTile, n_valid, n_kv, kh, n_cache_rows, tid);
        if (tid < kTile)
            cp_async<4>(pos + buf * kTile + tid, tid < n_valid ? slot_pos + first + tid : slot_pos, tid < n_valid);
        cp_async_commit();
    }
};

}  // namespace cupyllm

// Register budget: kRows = 4 fits ~160 registers (3 blocks per SM), kRows = 8 ~200 (2 blocks); with two
// tiles in flight per block that is 4-6 x 16 KB of loads in flight per SM, more than HBM latency needs.
template <int D, int kRows, bool kDca = false>
__global__ void __launch_bounds__(cupyllm::kFaThreads, kRows == 4 ? 3 : 2)
fa_vec(const float* __restrict__ q, const cupyllm::u8* __restrict__ k_cache, const cupyllm::u8* __restrict__ v_cache,
       const int* __restrict__ slot_pos, const int* __restrict__ q_pos, const float* __restrict__ mask,
       long long mask_stride, const float* __restrict__ k_table, const float* __restrict__ v_table,
       float* __restrict__ o_part, float* __restrict__ lse_part, int n_q, int n_head, int n_kv, int n_slots,
       int n_keys, int keys_per_split, int window, float softcap, int slots_are_positions, int k_fmt, int v_fmt,
       int k_row_bytes, int v_row_bytes, int k_table_len, int v_table_len, int dca_chunk_len) {
    using namespace cupyllm;
    using C = VecConfig<D, kRows>;
    constexpr int kTile = C::kTile, G = GroupOf<D>::value;
    const StagedRows LK = StagedRows::of(k_row_bytes), LV = StagedRows::of(v_row_bytes);
    const VecLayout<C> S = VecLayout<C>::of(LK, LV, k_table_len, v_table_len);

    extern __shared__ __align__(16) u8 fa_smem[];
    if (dynamic_smem_bytes() < static_cast<u32>(S.bytes)) __trap();  // gpu_kernels.py sized it too small
    int* pos_s = reinterpret_cast<int*>(fa_smem + S.pos);
    float* sp_s = reinterpret_cast<float*>(fa_smem + S.scores);
    float* ktab_s = reinterpret_cast<float*>(fa_smem + S.k_table);
    float* vtab_s = reinterpret_cast<float*>(fa_smem + S.v_table);
    __shared__ float row_m[kRows], row_l[kRows], row_alpha[kRows];
    __shared__ long long row_qpos[kRows];
    __shared__ int row_query[kRows];
    __shared__ long long qpos_range[2];
    __shared__ int row_chunk[kDca ? kRows : 1];  // DCA: chunk of each row's position
    __shared__ DcaRows dca_rows_s;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int chunk = tid % C::kChunkThreads, slot = tid / C::kChunkThreads;  // this thread's dims and key slot
    const int kh = blockIdx.z, split = blockIdx.y;
    const int group = n_head / n_kv;
    const int row0 = blockIdx.x * kRows;
    const int rows_here = min(kRows, n_q * group - row0);  // block-uniform: loops over rows test it
    const long long n_cache_rows = static_cast<long long>(n_slots) * n_kv;

    // ---- setup: tables, this thread's slice of Q, row positions ----
    for (int i = tid; i < k_table_len; i += kFaThreads) ktab_s[i] = k_table[i];
    for (int i = tid; i < v_table_len; i += kFaThreads) vtab_s[i] = v_table[i];
    float q_reg[kRows][8];
    int q_loaded = -1;  // the rotation held in q_reg (DCA: loaded by the first pass)
    if constexpr (!kDca) {
        load_q_slice<D, kRows>(q_reg, q, rows_here, row0, group, kh, n_head, chunk);
        q_loaded = 0;
    }
    const long long q_regime_stride = static_cast<long long>(n_q) * n_head * D;  // DCA: Q [3][n_q][n_head][D]
    if (tid < kRows) {
        const int r = tid;
        const int query = r < rows_here ? row_index(row0 + r, group, kh).query : 0;
        row_query[r] = query;
        row_qpos[r] = r < rows_here ? q_pos[query] : -1;
        if constexpr (kDca) row_chunk[r] = dca_chunk(static_cast<int>(row_qpos[r]), dca_chunk_len);
        row_m[r] = neg_inf();
        row_l[r] = 0.0f;
        row_alpha[r] = 1.0f;
    }
    __syncthreads();
    if (tid == 0) summarize_rows<kDca>(row_qpos, rows_here, dca_chunk_len, qpos_range, &dca_rows_s);
    __syncthreads();
    const KeyRange keys = split_key_range(split, keys_per_split, n_keys, slots_are_positions != 0, qpos_range[0],
                                          qpos_range[1], window);
    const int n_tiles = (keys.end - keys.begin + kTile - 1) / kTile;
    DcaChunkWalk dca_walk = DcaChunkWalk::at(keys.begin, kDca ? dca_chunk_len : 1);  // DCA: tile regimes

    float acc[kRows][8];  // this thread's 8 output dims of every row, summed over its key slot
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] = 0.0f;

    const StageTile<C> stage_tile{LK, LV, fa_smem + S.k_raw, fa_smem + S.v_raw, pos_s, k_cache, v_cache, slot_pos,
                                  keys, n_kv, kh, n_cache_rows, tid};
    if (n_tiles > 0) stage_tile(0);
    for (int t = 0; t < n_tiles; ++t) {
        const int buf = t & 1;
        if (t + 1 < n_tiles) {
            stage_tile(t + 1);
            cp_async_wait<1>();  // tile t has landed (tile t + 1 may still be in flight)
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const long long first = keys.begin + static_cast<long long>(t) * kTile;
        const int n_valid = min(kTile, keys.end - static_cast<int>(first));
        const u8* k_raw = fa_smem + S.k_raw + buf * kTile * LK.slot_bytes;
        const u8* v_raw = fa_smem + S.v_raw + buf * kTile * LV.slot_bytes;
        const int* pos = pos_s + buf * kTile;

        // ---- partial dots of this thread's keys and dims, summed over the key's threads ----
        // Key by key (one copy of the format switch, kRows dots live at a time): the reduce-scatter of kRows
        // values costs about as many shuffles per key as one over all keys at once.
        // One pass; DCA: one per regime the tile can hold, each keeping the scores of its own regime.
        u32 todo = 1u;
        if constexpr (kDca)
            todo = dca_walk.tile(slots_are_positions != 0, pos, static_cast<int>(first), n_valid, dca_rows_s, lane);
        const bool select = kDca && (todo & (todo - 1u)) != 0u;  // several regimes: keep scores per (row, key)
        while (todo != 0u) {
            const int regime = kDca ? dca_next_regime(todo, q_loaded) : 0;
            todo &= ~(1u << regime);
            if (kDca && regime != q_loaded) {
                load_q_slice<D, kRows>(q_reg, q + regime * q_regime_stride, rows_here, row0, group, kh, n_head, chunk);
                q_loaded = regime;
            }
#pragma unroll 1
            for (int m = 0; m < C::kKeysPerThread; ++m) {
                const int j = slot + m * C::kKeySlots;
                const long long row = (first + j) * n_kv + kh;
                float kv[8];
                read_chunk<G>(k_fmt, k_raw + j * LK.slot_bytes + LK.offset(row), chunk, ktab_s, kv);
                float dot[kRows];
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    float s = 0.0f;
                    if (r < rows_here) {
#pragma unroll
                        for (int e = 0; e < 8; ++e) s += q_reg[r][e] * kv[e];
                    }
                    dot[r] = s;
                }
                int first_row = 0;
                ReduceScatter<kRows, C::kReduceLanes / 2, kRows>::run(dot, lane, first_row);
                if ((lane & (C::kSharers - 1)) == 0) {
                    const int part = chunk / C::kReduceLanes;  // D = 512: the two warps of a key write apart
                    const int key_chunk = select ? dca_chunk(pos[j], dca_chunk_len) : 0;
#pragma unroll
                    for (int p = 0; p < C::kSums; ++p) {
                        if (!select || dca_regime(row_chunk[first_row + p], key_chunk) == regime)
                            sp_s[(part * kRows + first_row + p) * kTile + j] = dot[p];
                    }
                }
            }
        }
        __syncthreads();

        // ---- mask, softcap, online softmax: one warp per row, one lane per key ----
        for (int r = warp; r < rows_here; r += kFaThreads / 32) {
            float s = neg_inf();
            if (lane < n_valid) {
                float dot = 0.0f;
#pragma unroll
                for (int part = 0; part < C::kScoreParts; ++part) dot += sp_s[(part * kRows + r) * kTile + lane];
                if (key_visible(pos[lane], row_qpos[r], window)) {
                    s = apply_softcap(dot, softcap);
                    if (mask_stride > 0) s += mask[row_query[r] * mask_stride + first + lane];
                }
            }
            const float m_old = row_m[r];
            const float m_new = fmaxf(m_old, warp_max(s));
            const float m_use = m_new == neg_inf() ? 0.0f : m_new;  // no visible key yet: exp(-inf) = 0
            const float p = __expf(s - m_use);
            const float p_sum = warp_sum(p);
            if (lane < kTile) sp_s[r * kTile + lane] = p;
            if (lane == 0) {
                const float alpha = __expf(m_old - m_use);
                row_alpha[r] = alpha;
                row_l[r] = row_l[r] * alpha + p_sum;
                row_m[r] = m_new;
            }
        }
        __syncthreads();

        // ---- O += P V ----
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            if (r < rows_here) {
                const float alpha = row_alpha[r];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
            }
        }
#pragma unroll 1
        for (int j = slot; j < n_valid; j += C::kKeySlots) {  // not unrolled: one copy of the format switch
            const long long row = (first + j) * n_kv + kh;
            float vv[8];
            read_chunk<G>(v_fmt, v_raw + j * LV.slot_bytes + LV.offset(row), chunk, vtab_s, vv);
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                if (r < rows_here) {
                    const float p = sp_s[r * kTile + j];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r][e] += p * vv[e];
                }
            }
        }
        __syncthreads();  // the buffers of tile t are refilled by the copies issued in iteration t + 1
    }

    // ---- sum the key slots, normalise, write this split's O and LSE ----
    float* reduce_s = reinterpret_cast<float*>(fa_smem);  // over the raw buffers: every copy has landed
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) reduce_s[(slot * kRows + r) * D + chunk * 8 + e] = acc[r][e];
    __syncthreads();
    for (int idx = tid; idx < rows_here * D; idx += kFaThreads) {
        const int r = idx / D, d = idx % D;
        float o = 0.0f;
        for (int k = 0; k < C::kKeySlots; ++k) o += reduce_s[(k * kRows + r) * D + d];
        const float l = row_l[r];
        const RowIndex ri = row_index(row0 + r, group, kh);
        const long long out_row = (static_cast<long long>(split) * n_q + ri.query) * n_head + ri.head;
        o_part[out_row * D + d] = l > 0.0f ? o / l : 0.0f;
        if (d == 0) lse_part[out_row] = l > 0.0f ? row_m[r] + logf(l) : neg_inf();
    }
}
