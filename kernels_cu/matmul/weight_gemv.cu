// Decode matmul straight from GGUF blocks: y[t, o] = sum_k W[o, k] x[t, k] (+ bias[o]) for a few tokens.
//
//   weights [n_out, row_bytes] uint8 GGUF blocks (weight_formats.cuh), allocation padded by >= 16 bytes
//   x       [n_tokens, n_in] float32, n_tokens <= kTokens, n_in % W::kBlockValues == 0, 16-byte aligned
//   bias    [n_out] float32, read when has_bias (a dummy array otherwise: the emulator takes no nullptr)
//   y       [n_tokens, n_out] float32
// Up to three matrices of one format and width share x and one launch (a layer's q / k / v projections,
// its gate and up): blockIdx.y = m picks weights_m, n_out_m, bias_m (bit m of has_bias) and y_m; the
// others' arguments are not read. Each matrix's sums are those of a launch of its own, bit for bit.
// weight_gemv_gated (below) is a gated MLP's gate and up in one launch, storing act(gate) * up.
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
#include "elementwise/activations.cuh"
#include "matmul/weight_formats.cuh"

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

// The sums of one warp's kRows rows, acc[r][t] = row r . x[t] over n_in values, every lane holding them.
// `stage` is the warp's own shared-memory stage.
template <class W, int kTokens, int kRows>
__device__ __forceinline__ void gemv_warp_rows(const u8* const (&rows)[kRows], int n_in, const float* __restrict__ x,
                                               int n_tokens, uint4 (&stage)[kRows][GemvSpan<W>::kLoadsPerLane * 32],
                                               int lane, float (&acc)[kRows][kTokens]) {
    using Span = GemvSpan<W>;
    const int n_blocks = n_in / W::kBlockValues;
    const int n_spans = (n_blocks + Span::kBlocks - 1) / Span::kBlocks;
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
            for (int j = 0; j < Span::kLoadsPerLane; ++j) stage[r][lane + 32 * j] = next[r][j];
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
                const u8* staged = reinterpret_cast<const u8*>(stage[r]) + lead[r] + block_in_span * W::kBlockBytes;
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
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int t = 0; t < kTokens; ++t) acc[r][t] = warp_sum(acc[r][t]);
}

// Row `row` of a matrix; rows past the end repeat the last row (their sums are computed, never stored).
__device__ __forceinline__ const u8* weight_row(const u8* weights, int row, int n_out, long long row_bytes) {
    return weights + static_cast<size_t>(min(row, n_out - 1)) * static_cast<size_t>(row_bytes);
}

// store(r, t, at) for the outputs of a warp's rows row0 + r < n_out and tokens t < n_tokens, on lane 0; at is
// the output's index in y [n_tokens, n_out].
template <int kRows, int kTokens, class Store>
__device__ __forceinline__ void store_warp_rows(int row0, int n_out, int n_tokens, int lane, Store store) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int t = 0; t < kTokens; ++t)
            if (lane == 0 && row0 + r < n_out && t < n_tokens) store(r, t, static_cast<size_t>(t) * n_out + row0 + r);
}

}  // namespace cupyllm

template <class W, int kTokens, int kRows>
__global__ void __launch_bounds__(cupyllm::kGemvWarps * 32)
weight_gemv(const cupyllm::u8* __restrict__ weights0, const cupyllm::u8* __restrict__ weights1,
            const cupyllm::u8* __restrict__ weights2, long long row_bytes, int n_out0, int n_out1, int n_out2,
            int n_in, const float* __restrict__ x, int n_tokens, const float* __restrict__ bias0,
            const float* __restrict__ bias1, const float* __restrict__ bias2, int has_bias,
            float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2) {
    using namespace cupyllm;
    const int m = blockIdx.y;  // the matrix
    const u8* const weights = m == 0 ? weights0 : m == 1 ? weights1 : weights2;
    const int n_out = m == 0 ? n_out0 : m == 1 ? n_out1 : n_out2;
    const float* const bias = m == 0 ? bias0 : m == 1 ? bias1 : bias2;
    float* const y = m == 0 ? y0 : m == 1 ? y1 : y2;
    const bool biased = (has_bias >> m) & 1;
    __shared__ uint4 stage[kGemvWarps][kRows][GemvSpan<W>::kLoadsPerLane * 32];

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (static_cast<int>(blockIdx.x) * kGemvWarps + warp) * kRows;
    if (row0 >= n_out) return;  // the whole warp leaves together
    const u8* rows[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) rows[r] = weight_row(weights, row0 + r, n_out, row_bytes);
    float acc[kRows][kTokens];
    gemv_warp_rows<W, kTokens, kRows>(rows, n_in, x, n_tokens, stage[warp], lane, acc);
    store_warp_rows<kRows, kTokens>(row0, n_out, n_tokens, lane, [&](int r, int t, size_t at) {
        y[at] = biased ? __fadd_rn(acc[r][t], bias[row0 + r]) : acc[r][t];
    });
}

// y[t, o] = act(gate[o] . x[t]) * up[t, o]: a gated MLP's input to its down projection in one launch (no gate
// and up arrays, no gated_act pass). kUpMatrix: up[t, o] = up_weights[o] . x[t], the same warp computing row o
// of both matrices (rows [0, kRows) of its span are gate rows, [kRows, 2 kRows) up rows); otherwise up is the
// given array up_given [n_tokens, n_out] (Gemma 4's per-layer input). Each sum is a plain GEMV's, bit for bit,
// and the product elementwise.cu's gated_act of them. No bias (the gated MLPs have none).
// Launch: blockDim = 32 * kGemvWarps, gridDim = ceil(n_out / (kGemvWarps * kRows)).
template <class W, int kTokens, int kRows, int kAct, bool kUpMatrix>
__global__ void __launch_bounds__(cupyllm::kGemvWarps * 32)
weight_gemv_gated(const cupyllm::u8* __restrict__ gate_weights, const cupyllm::u8* __restrict__ up_weights,
                  long long row_bytes, int n_out, int n_in, const float* __restrict__ x, int n_tokens,
                  const float* __restrict__ up_given, float* __restrict__ y) {
    using namespace cupyllm;
    constexpr int kSpanRows = kUpMatrix ? 2 * kRows : kRows;
    __shared__ uint4 stage[kGemvWarps][kSpanRows][GemvSpan<W>::kLoadsPerLane * 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (static_cast<int>(blockIdx.x) * kGemvWarps + warp) * kRows;
    if (row0 >= n_out) return;  // the whole warp leaves together
    const u8* rows[kSpanRows];
#pragma unroll
    for (int r = 0; r < kSpanRows; ++r)
        rows[r] = weight_row(r < kRows ? gate_weights : up_weights, row0 + r % kRows, n_out, row_bytes);
    float acc[kSpanRows][kTokens];
    gemv_warp_rows<W, kTokens, kSpanRows>(rows, n_in, x, n_tokens, stage[warp], lane, acc);
    store_warp_rows<kRows, kTokens>(row0, n_out, n_tokens, lane, [&](int r, int t, size_t at) {
        const float up = kUpMatrix ? acc[(r + kRows) % kSpanRows][t] : up_given[at];  // (up row r: span row r + kRows)
        y[at] = __fmul_rn(activate<kAct>(acc[r][t]), up);
    });
}
