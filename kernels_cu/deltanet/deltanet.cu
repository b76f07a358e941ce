// The Gated DeltaNet layer core (Qwen3.5 / Qwen3.6 / Qwen3-Next linear attention), float32: the causal
// depthwise conv + SiLU over a carried conv state, the gated delta rule token by token over a carried recurrent
// state (decode is n = 1, a prompt is the same loop inside one launch), and the gated RMSNorm.
//
// Definitions: cupyllm/ops/deltanet/reference.py (float64); CPU twin cupyllm/ops/deltanet/cpu.py. Sums are float32
// (fmaf, warp butterflies), so results differ from the float64 reference in the last bits, not bit for bit.
// A chunked tensor-core prompt path (reference.py gated_delta_rule_chunked) is not here yet.
#include "elementwise/activations.cuh"
#include "common/common.cuh"

// ---- causal depthwise conv1d + SiLU ------------------------------------------------------------------------
//   x [n, C], weight [C, kWidth], conv_state [kWidth - 1, C] (oldest row first; read, then overwritten with the
//   last kWidth - 1 rows of state-then-x), y [n, C]:
//   y[t, c] = silu(sum_j weight[c, j] * xx[t + j, c]), xx = conv_state followed by x.
// One thread per channel carries its kWidth - 1 inputs in registers through the n tokens; channels never mix,
// so updating the state in place races with nothing.
// Launch: blockDim = 256, gridDim = ceil(C / 256).
template <int kWidth>
__global__ void __launch_bounds__(256)
conv1d_silu(const float* __restrict__ x, const float* __restrict__ weight, float* __restrict__ conv_state,
            float* __restrict__ y, int n, int channels) {
    static_assert(kWidth >= 2 && kWidth <= 8, "conv width");
    const int c = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float w[kWidth], window[kWidth - 1];
#pragma unroll
    for (int j = 0; j < kWidth; ++j) w[j] = weight[static_cast<size_t>(c) * kWidth + j];
#pragma unroll
    for (int j = 0; j < kWidth - 1; ++j) window[j] = conv_state[static_cast<size_t>(j) * channels + c];
    for (int t = 0; t < n; ++t) {
        const float xt = x[static_cast<size_t>(t) * channels + c];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < kWidth - 1; ++j) acc = fmaf(w[j], window[j], acc);
        acc = fmaf(w[kWidth - 1], xt, acc);
        y[static_cast<size_t>(t) * channels + c] = cupyllm::silu(acc);
#pragma unroll
        for (int j = 0; j + 1 < kWidth - 1; ++j) window[j] = window[j + 1];
        window[kWidth - 2] = xt;
    }
#pragma unroll
    for (int j = 0; j < kWidth - 1; ++j) conv_state[static_cast<size_t>(j) * channels + c] = window[j];
}

// ---- gated delta rule, token by token ----------------------------------------------------------------------
//   q, k [n, n_k_heads, kRows * 32] (raw: L2-normalised here, x / sqrt(sum x^2 + 1e-6), q then times
//   1 / sqrt(Dk)), v [n, n_v_heads, dv], g, beta [n, n_v_heads] (log decay <= 0, write strength),
//   state [n_v_heads, Dk, dv] (read, then overwritten with the state after the n tokens), o [n, n_v_heads, dv].
//   Value head h reads key head h / (n_v_heads / n_k_heads). Per token, per value head:
//     S' = exp(g) S;  d = beta (v - S'^T k);  S = S' + k d^T;  o = S^T q
// The value columns of S never mix: a warp owns kCols columns of one head, lane l rows l, l + 32, ... (kRows
// of them), so its tile of S lives in registers for all n tokens; the dots over Dk are warp butterflies. Each
// warp normalises q and k itself (kRows values a lane, two butterflies): no shared memory, no block barrier.
// Launch: blockDim = 256 (8 warps), gridDim = (n_v_heads, ceil(dv / (8 * kCols))).
namespace cupyllm {
constexpr int kDeltaCols = 4;  // value columns per warp
constexpr int kDeltaWarps = 8;
constexpr float kL2Eps = 1e-6f;  // reference.py L2_EPS (inside the square root)
}  // namespace cupyllm

template <int kRows>
__global__ void __launch_bounds__(256)
gated_delta_rule(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                 const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
                 float* __restrict__ o, int n, int n_k_heads, int n_v_heads, int dv) {
    using namespace cupyllm;
    constexpr int kCols = kDeltaCols;
    constexpr int dk = kRows * kWarpSize;
    const int head = blockIdx.x;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int col0 = (static_cast<int>(blockIdx.y) * kDeltaWarps + warp) * kCols;
    if (col0 >= dv) return;  // the whole warp: no lane of it takes part in a butterfly
    const int key_head = head / (n_v_heads / n_k_heads);
    const float q_scale = 1.0f / sqrtf(static_cast<float>(dk));
    float s[kRows][kCols];
    float* const head_state = state + static_cast<size_t>(head) * dk * dv;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c)
            s[r][c] = col0 + c < dv ? head_state[static_cast<size_t>(lane + r * kWarpSize) * dv + col0 + c] : 0.0f;
    for (int t = 0; t < n; ++t) {
        const size_t qk_base = (static_cast<size_t>(t) * n_k_heads + key_head) * dk;
        float kr[kRows], qr[kRows];
        float k_ss = 0.0f, q_ss = 0.0f;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            kr[r] = k[qk_base + lane + r * kWarpSize];
            qr[r] = q[qk_base + lane + r * kWarpSize];
            k_ss = fmaf(kr[r], kr[r], k_ss);
            q_ss = fmaf(qr[r], qr[r], q_ss);
        }
        const float k_inv = 1.0f / sqrtf(warp_sum(k_ss) + kL2Eps);
        const float q_inv = q_scale / sqrtf(warp_sum(q_ss) + kL2Eps);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            kr[r] *= k_inv;
            qr[r] *= q_inv;
        }
        const size_t gate = static_cast<size_t>(t) * n_v_heads + head;
        const float decay = expf(g[gate]), write = beta[gate];
        const size_t v_base = (static_cast<size_t>(t) * n_v_heads + head) * dv;
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
            float predicted = 0.0f;
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                s[r][c] *= decay;
                predicted = fmaf(s[r][c], kr[r], predicted);
            }
            predicted = warp_sum(predicted);
            const float value = col0 + c < dv ? v[v_base + col0 + c] : 0.0f;
            const float delta = write * (value - predicted);
            float out = 0.0f;
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                s[r][c] = fmaf(kr[r], delta, s[r][c]);
                out = fmaf(s[r][c], qr[r], out);
            }
            out = warp_sum(out);
            if (lane == 0 && col0 + c < dv) o[v_base + col0 + c] = out;
        }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c)
            if (col0 + c < dv) head_state[static_cast<size_t>(lane + r * kWarpSize) * dv + col0 + c] = s[r][c];
}

// ---- gated RMSNorm: out = (x / sqrt(mean(x^2) + eps)) * weight * silu(z) ------------------------------------
//   x, z, out [n_rows, d]; weight [d] (the plain weight, not 1 + weight). One warp per row.
// Launch: blockDim = 256 (8 rows), gridDim = ceil(n_rows / 8).
__global__ void __launch_bounds__(256)
gated_rms_norm(const float* __restrict__ x, const float* __restrict__ z, const float* __restrict__ weight,
               float* __restrict__ out, int n_rows, int d, float eps) {
    using namespace cupyllm;
    const int row = static_cast<int>(blockIdx.x) * 8 + static_cast<int>(threadIdx.x) / kWarpSize;
    const int lane = threadIdx.x % kWarpSize;
    if (row >= n_rows) return;
    const size_t base = static_cast<size_t>(row) * d;
    float ss = 0.0f;
    for (int c = lane; c < d; c += kWarpSize) ss = fmaf(x[base + c], x[base + c], ss);
    const float inv = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(d) + eps);
    for (int c = lane; c < d; c += kWarpSize)
        out[base + c] = x[base + c] * inv * weight[c] * silu(z[base + c]);
}
