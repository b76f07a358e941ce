// Decode matmul straight from GGUF blocks: y[t, o] = sum_k W[o, k] x[t, k] (+ bias[o]) for a few tokens.
//
//   weights [n_out, row_bytes] uint8 GGUF blocks (weight_formats.cuh), allocation padded by >= 16 bytes
//   x       [n_tokens, n_in] float32, n_tokens <= kTokens, n_in % W::kBlockValues == 0, 16-byte aligned
//   bias    [n_out] float32, read when has_bias (a dummy array otherwise: the emulator takes no nullptr)
//   y       [n_tokens, n_out] float32
// Up to three matrices of one format and width share x and one launch (a layer's q / k / v projections,
// its gate and up): blockIdx.y = m picks weights_m, n_out_m, bias_m (bit m of has_bias) and y_m; the
// others' arguments are not read. Each matrix's sums are those of a launch of its own, bit for bit.
//
// NumPy twin: cupyllm/quant/weights.py dequantize (the values) then x @ W.T (the sums; float32
// accumulation, so the order of the additions differs and results agree to rounding, not bit for bit).
//
// One warp owns kRows consecutive output rows. It walks the rows in spans of kSpanBlocks blocks: the
// span's bytes are copied with coalesced 16-byte loads into a per-warp shared-memory stage (rows of
// 2-aligned formats such as Q8_0 or Q6_K cannot be read as 16-byte vectors where they lie), then each
// lane dequantizes kPartsPerLane parts from the stage in registers and multiplies them with the matching
// activations (float4 loads, reused across the kRows rows); the formats hand over their small integers and
// each run's scale and bias (W::codes), so a run costs one FMA per value and two per run instead of forming
// every weight first. The next span's loads are issued before the current span is computed, so a warp
// keeps one span of every row in flight. Lane sums are reduced with warp shuffles at the end.
//
// Launch (cupyllm/backend/gpu_kernels.py): blockDim = 32 * kGemvWarps,
// gridDim = (ceil(max n_out_m / (kGemvWarps * kRows)), matrices).
#include "weight_formats.cuh"

namespace cupyllm {

constexpr int kGemvWarps = 4;
constexpr int kGemvSpanTargetBytes = 512;  // bytes of one row a warp stages per step, at least

template <class W>
struct GemvSpan {
    static constexpr int kPartBytes = (W::kBlockBytes + W::kParts - 1) / W::kParts;
    static constexpr int kWanted = (kGemvSpanTargetBytes + 32 * kPartBytes - 1) / (32 * kPartBytes);
    static constexpr int kPartsPerLane = kWanted < 1 ? 1 : (kWanted > 4 ? 4 : kWanted);
    static constexpr int kBlocks = 32 * kPartsPerLane / W::kParts;
    static constexpr int kBytes = kBlocks * W::kBlockBytes;
    static constexpr int kMaxLead = W::kAlign >= 16 ? 0 : 16 - W::kAlign;  // span start below a 16-byte line
    static constexpr int kVectors = (kMaxLead + kBytes + 15) / 16;
    static constexpr int kLoadsPerLane = (kVectors + 31) / 32;
    static_assert((32 * kPartsPerLane) % W::kParts == 0, "a span is whole blocks");
};

}  // namespace cupyllm

template <class W, int kTokens, int kRows>
__global__ void __launch_bounds__(cupyllm::kGemvWarps * 32)
weight_gemv(const cupyllm::u8* __restrict__ weights0, const cupyllm::u8* __restrict__ weights1,
            const cupyllm::u8* __restrict__ weights2, long long row_bytes, int n_out0, int n_out1, int n_out2,
            int n_in, const float* __restrict__ x, int n_tokens, const float* __restrict__ bias0,
            const float* __restrict__ bias1, const float* __restrict__ bias2, int has_bias,
            float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2) {
    using namespace cupyllm;
    using Span = GemvSpan<W>;
    const int m = blockIdx.y;  // the matrix
    const u8* const weights = m == 0 ? weights0 : m == 1 ? weights1 : weights2;
    const int n_out = m == 0 ? n_out0 : m == 1 ? n_out1 : n_out2;
    const float* const bias = m == 0 ? bias0 : m == 1 ? bias1 : bias2;
    float* const y = m == 0 ? y0 : m == 1 ? y1 : y2;
    const bool biased = (has_bias >> m) & 1;
    __shared__ uint4 stage[kGemvWarps][kRows][Span::kLoadsPerLane * 32];

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (static_cast<int>(blockIdx.x) * kGemvWarps + warp) * kRows;
    if (row0 >= n_out) return;  // the whole warp leaves together
    const int n_blocks = n_in / W::kBlockValues;
    const int n_spans = (n_blocks + Span::kBlocks - 1) / Span::kBlocks;

    const u8* rows[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r)  // rows past the end repeat the last row; their sums are dropped
        rows[r] = weights + static_cast<size_t>(min(row0 + r, n_out - 1)) * static_cast<size_t>(row_bytes);

    float acc[kRows][kTokens];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int t = 0; t < kTokens; ++t) acc[r][t] = 0.0f;

    // bytes [start, start + n) of a row as 16-byte vectors from the line holding `start`
    uint4 next[kRows][Span::kLoadsPerLane];
    auto load_span = [&](int span) {
        const int first_block = span * Span::kBlocks;
        const int n_bytes = min(Span::kBlocks, n_blocks - first_block) * W::kBlockBytes;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const u8* start = rows[r] + static_cast<size_t>(first_block) * W::kBlockBytes;
            const int lead = static_cast<int>(reinterpret_cast<size_t>(start) & 15);
            const uint4* line = reinterpret_cast<const uint4*>(start - lead);
            const int n_vectors = (lead + n_bytes + 15) / 16;  // may read <= 15 bytes past the row
#pragma unroll
            for (int j = 0; j < Span::kLoadsPerLane; ++j) {
                const int v = lane + 32 * j;
                if (v < n_vectors) next[r][j] = line[v];
            }
        }
    };

    load_span(0);
    for (int span = 0; span < n_spans; ++span) {
        __syncwarp();  // every lane is done reading the previous span from the stage
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int j = 0; j < Span::kLoadsPerLane; ++j) stage[warp][r][lane + 32 * j] = next[r][j];
        __syncwarp();
        const int first_block = span * Span::kBlocks;
        int lead[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
            lead[r] = static_cast<int>(
                reinterpret_cast<size_t>(rows[r] + static_cast<size_t>(first_block) * W::kBlockBytes) & 15);
        if (span + 1 < n_spans) load_span(span + 1);

#pragma unroll
        for (int j = 0; j < Span::kPartsPerLane; ++j) {
            const int slot = lane + 32 * j;  // part slot within the span
            const int block_in_span = slot / W::kParts, part = slot % W::kParts;
            const int block = first_block + block_in_span;
            if (block >= n_blocks) continue;
            const float* x_block = x + static_cast<size_t>(block) * W::kBlockValues;
            // w = scale * q + bias per run (W::codes: q the block's small integers, exact as floats, or the
            // float formats' values): sum q * x over the run, then scale it and add bias * sum(x) once
            float q[kRows][W::kPartValues], scale[kRows][W::kRuns], bias[kRows][W::kRuns];
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const u8* staged = reinterpret_cast<const u8*>(stage[warp][r]) + lead[r] +
                                   block_in_span * W::kBlockBytes;
                W::codes(staged, part, q[r], scale[r], bias[r]);
            }
#pragma unroll
            for (int t = 0; t < kTokens; ++t) {
                if (t >= n_tokens) break;
                const float* x_token = x_block + static_cast<size_t>(t) * n_in;
#pragma unroll
                for (int run = 0; run < W::kRuns; ++run) {
                    const float4* xr = reinterpret_cast<const float4*>(x_token + W::run_start(part, run));
                    float qx[kRows], x_sum = 0.0f;
#pragma unroll
                    for (int r = 0; r < kRows; ++r) qx[r] = 0.0f;
#pragma unroll
                    for (int v = 0; v < W::kRunLength / 4; ++v) {
                        const float4 xv = xr[v];
                        const int k = run * W::kRunLength + 4 * v;
                        if constexpr (W::kBias) x_sum += (xv.x + xv.y) + (xv.z + xv.w);
#pragma unroll
                        for (int r = 0; r < kRows; ++r) {
                            qx[r] = fmaf(q[r][k], xv.x, qx[r]);
                            qx[r] = fmaf(q[r][k + 1], xv.y, qx[r]);
                            qx[r] = fmaf(q[r][k + 2], xv.z, qx[r]);
                            qx[r] = fmaf(q[r][k + 3], xv.w, qx[r]);
                        }
                    }
#pragma unroll
                    for (int r = 0; r < kRows; ++r) {
                        if constexpr (W::kBias) acc[r][t] = fmaf(bias[r][run], x_sum, acc[r][t]);
                        acc[r][t] = W::kPlain ? acc[r][t] + qx[r] : fmaf(scale[r][run], qx[r], acc[r][t]);
                    }
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int t = 0; t < kTokens; ++t) {
            const float sum = warp_sum(acc[r][t]);
            const int row = row0 + r;
            if (lane == 0 && row < n_out && t < n_tokens)
                y[static_cast<size_t>(t) * n_out + row] = biased ? __fadd_rn(sum, bias[row]) : sum;
        }
    }
}
