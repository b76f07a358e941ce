// Prefill matmul on the tensor cores, dequantizing the weight tiles in the kernel:
// y[t, o] = sum_k f16(W[o, k]) f16(x[t, k]) (+ bias[o]), float32 accumulation.
//
//   weights [n_out, row_bytes] uint8 GGUF blocks (weight_formats.cuh); n_in % 128 == 0
//   x       [n_tokens, n_in] __half (the activations rounded once to f16)
//   bias    [n_out] float32, read when has_bias
//   y       [n_tokens, n_out] float32
//
// NumPy twin: dequantize (cupyllm/quant/weights.py), round W and x to float16, multiply in float32;
// the same product as the cuBLAS path (an f16 copy of W times f16 x), so the two can be compared.
//
// A CTA computes a 64 (weight rows) x 64 (tokens) tile of y^T with 4 warps of 32 x 32. Per 128-wide
// k step it dequantizes the weight tile part by part (weight_formats.cuh: the parts of one 128-value
// chunk are a contiguous range) into shared memory as f16, copies the activation tile with 16-byte
// loads, and runs 8 x 8 mma.sync m16n8k16 per warp, reading fragments with 32-bit shared loads (the
// row pitch of 136 halves puts the 32 lanes of a fragment load in 32 different banks).
//
// Launch (cupyllm/backend/gpu_kernels.py): blockDim = 128,
// gridDim = ceil(n_out / 64) * ceil(n_tokens / 64), weight tiles varying fastest.
#include "matmul/weight_formats.cuh"
#include "common/mma.cuh"  // mma_m16n8k16_f16_f32, pack_half2 (shared with the attention kernels)

namespace cupyllm {

constexpr int kMmaRows = 64, kMmaTokens = 64, kMmaDepth = 128;
constexpr int kMmaPitch = kMmaDepth + 8;  // halves per tile row in shared memory

// Write `kLength` (4 or 8) dequantized values as f16 at a 8- or 16-byte aligned shared address.
template <int kLength>
__device__ __forceinline__ void store_f16_run(u16* dst, const float* v) {
    if constexpr (kLength == 4) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]));
    } else {
        static_assert(kLength == 8, "runs of 4 or 8 values");
        *reinterpret_cast<uint4*>(dst) = make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]),
                                                    pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
    }
}

__device__ __forceinline__ u32 shared_pair(const u16* tile, int row, int col) {
    return *reinterpret_cast<const u32*>(tile + row * kMmaPitch + col);
}

}  // namespace cupyllm

template <class W>
__global__ void __launch_bounds__(128)
weight_mma(const cupyllm::u8* __restrict__ weights, long long row_bytes, int n_out, int n_in,
           const __half* __restrict__ x, int n_tokens, const float* __restrict__ bias, int has_bias,
           float* __restrict__ y) {
    using namespace cupyllm;
    constexpr int kPartsPer128 = PartGeometry<W>::kPartsPer128;
    __shared__ uint4 a_raw[kMmaRows * kMmaPitch / 8];
    __shared__ uint4 b_raw[kMmaTokens * kMmaPitch / 8];
    u16* a_tile = reinterpret_cast<u16*>(a_raw);
    u16* b_tile = reinterpret_cast<u16*>(b_raw);

    const int n_row_tiles = (n_out + kMmaRows - 1) / kMmaRows;
    const int m0 = (static_cast<int>(blockIdx.x) % n_row_tiles) * kMmaRows;
    const int n0 = (static_cast<int>(blockIdx.x) / n_row_tiles) * kMmaTokens;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int warp_m = (warp & 1) * 32, warp_n = (warp >> 1) * 32;

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.0f;

    for (int k0 = 0; k0 < n_in; k0 += kMmaDepth) {
        const int first_part = (k0 / kMmaDepth) * kPartsPer128;
        for (int i = tid; i < kMmaRows * kPartsPer128; i += 128) {  // weight tile, part by part
            const int r = i / kPartsPer128, global_part = first_part + i % kPartsPer128;
            const int row = min(m0 + r, n_out - 1);
            int part;
            const u8* block = part_block<W>(weights + static_cast<size_t>(row) * row_bytes, global_part, part);
            float w[W::kPartValues];
            decode_part<W>(block, part, w);
            const int block_col = (global_part / W::kParts) * W::kBlockValues - k0;
#pragma unroll
            for (int run = 0; run < W::kRuns; ++run)
                store_f16_run<W::kRunLength>(a_tile + r * kMmaPitch + block_col + W::run_start(part, run),
                                             w + run * W::kRunLength);
        }
        for (int i = tid; i < kMmaTokens * (kMmaDepth / 8); i += 128) {  // activation tile, 8 halves at a time
            const int n = i / (kMmaDepth / 8), v = i % (kMmaDepth / 8);
            const int token = n0 + n;
            uint4 value = make_uint4(0u, 0u, 0u, 0u);
            if (token < n_tokens)
                value = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(token) * n_in + k0 + 8 * v);
            *reinterpret_cast<uint4*>(b_tile + n * kMmaPitch + 8 * v) = value;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kMmaDepth; kk += 16) {
            u32 a[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const int row = warp_m + mt * 16 + g;
                a[mt][0] = shared_pair(a_tile, row, kk + 2 * t);
                a[mt][1] = shared_pair(a_tile, row + 8, kk + 2 * t);
                a[mt][2] = shared_pair(a_tile, row, kk + 2 * t + 8);
                a[mt][3] = shared_pair(a_tile, row + 8, kk + 2 * t + 8);
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const int token = warp_n + nt * 8 + g;
                const u32 b[2] = {shared_pair(b_tile, token, kk + 2 * t), shared_pair(b_tile, token, kk + 2 * t + 8)};
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) mma_m16n8k16_f16_f32(acc[mt][nt], a[mt], b, acc[mt][nt]);
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = m0 + warp_m + mt * 16 + g + (e >= 2 ? 8 : 0);
                const int token = n0 + warp_n + nt * 8 + 2 * t + (e & 1);
                if (row < n_out && token < n_tokens) {
                    const float v = acc[mt][nt][e];
                    y[static_cast<size_t>(token) * n_out + row] = has_bias ? __fadd_rn(v, bias[row]) : v;
                }
            }
        }
    }
}
