// Row and element operations of the decoder blocks, float32: RMSNorm (optionally fused with the residual
// add before or after it), rotary embedding (optionally after a per-head RMSNorm), SiLU / tanh-GELU (plain
// or gated: act(gate) * up), soft-capping.
//
// NumPy twins: cupyllm/backend/cpu.py (CPUBackend.rms_norm, silu, gelu_tanh), cupyllm/backend/cpu_kernels.py
// (rms_norm_rows), cupyllm/rope.py (rope_tables, apply_rope) and models/build.py (final soft-cap). Each
// operation is written with the reference's float32 operations in its order (__f*_rn: no FMA
// contraction); sums (RMSNorm) and the library functions exp/tanh/sincos may differ in the last bits.
#include "elementwise/activations.cuh"
#include "common/common.cuh"

// ---- RMSNorm: one warp per row -------------------------------------------------------------------------
//   x, residual, sum_out, out: [n_rows, d]; weight, next_weight [d]; norm(v, w) = (v / sqrt(mean(v^2) + eps)) * w
//   kResidual = kNoResidual:     out = norm(x, weight)
//               kResidualBefore: sum_out = x + residual, out = norm(sum_out, weight)  (a pre-norm block's add
//                                and the next norm)
//               kResidualAfter:  out = residual + norm(x, weight)   (a sandwich block's post-norm and add)
//               kResidualAfterThenNorm: sum_out = residual + norm(x, weight), out = norm(sum_out, next_weight)
//                                (the post-norm, the add and the norm of the next sublayer's input)
//   scaled (modes kResidualAfter, kResidualAfterThenNorm): the sum times out_scale[0] (Gemma 4's layer output
//   scale), before the next norm.
//   residual, sum_out, next_weight and out_scale are read / written only where the mode uses them (any float
//   array otherwise: the emulator takes no nullptr). Each norm sums v^2 in the same lane order, so a fused mode
//   gives what the modes one after another give, bit for bit.
// Launch: blockDim = 256 (8 rows), gridDim = ceil(n_rows / 8).
namespace cupyllm {
enum ResidualMode : int { kNoResidual = 0, kResidualBefore = 1, kResidualAfter = 2, kResidualAfterThenNorm = 3 };

// 1 / sqrt(mean(v^2) + eps) from this lane's partial sum of squares
__device__ __forceinline__ float inverse_rms(float lane_squares, int d, float eps) {
    const float ss = warp_sum(lane_squares);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(d)), eps)));
}
}  // namespace cupyllm

template <int kResidual>
__global__ void __launch_bounds__(256)
rms_norm(const float* __restrict__ x, const float* __restrict__ residual, const float* __restrict__ weight,
         const float* __restrict__ next_weight, const float* __restrict__ out_scale, int scaled, int n_rows, int d,
         float eps, float* __restrict__ sum_out, float* __restrict__ out) {
    using namespace cupyllm;
    const float scale = scaled ? out_scale[0] : 1.0f;
    const int row = static_cast<int>(blockIdx.x) * 8 + static_cast<int>(threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= n_rows) return;
    const size_t base = static_cast<size_t>(row) * d;
    float ss = 0.0f;
    for (int c = lane; c < d; c += 32) {
        float v = x[base + c];
        if constexpr (kResidual == kResidualBefore) {
            v = __fadd_rn(v, residual[base + c]);
            sum_out[base + c] = v;
        }
        ss = fmaf(v, v, ss);
    }
    const float inv = inverse_rms(ss, d, eps);
    float next_ss = 0.0f;
    for (int c = lane; c < d; c += 32) {
        const float v = kResidual == kResidualBefore ? sum_out[base + c] : x[base + c];
        const float normed = __fmul_rn(__fmul_rn(v, inv), weight[c]);
        if constexpr (kResidual == kResidualAfterThenNorm) {
            float h = __fadd_rn(residual[base + c], normed);
            if (scaled) h = __fmul_rn(h, scale);
            sum_out[base + c] = h;
            next_ss = fmaf(h, h, next_ss);
        } else if constexpr (kResidual == kResidualAfter) {
            const float h = __fadd_rn(residual[base + c], normed);
            out[base + c] = scaled ? __fmul_rn(h, scale) : h;
        } else {
            out[base + c] = normed;
        }
    }
    if constexpr (kResidual == kResidualAfterThenNorm) {
        const float next_inv = inverse_rms(next_ss, d, eps);
        for (int c = lane; c < d; c += 32) out[base + c] = __fmul_rn(__fmul_rn(sum_out[base + c], next_inv), next_weight[c]);
    }
}

// ---- rotary embedding, optionally after a per-head RMSNorm; q and k rows in one launch ----------------------
//   q, q_out   [n_tokens, n_q_heads, head_dim];  k, k_out [n_tokens, n_k_heads, head_dim] (n_k_heads = 0: q only,
//              k / k_out / k_norm / k_positions then any array: the emulator takes no nullptr)
//   q_positions, k_positions  [n_tokens] int32
//   q_norm, k_norm  [head_dim]: with kNorm each row is first x <- (x / sqrt(mean(x^2) + eps)) * weight, in
//              rms_norm's operations and order (Qwen3's and Gemma's q / k norms: the norm and the rotation
//              that follows it are one launch, and q and k share it: four launches a layer become one)
//   inv_freq   [n_rot / 2] float64: rope.inverse_frequencies (base, freq factors, linear / YaRN scaling)
//   mscale     the YaRN magnitude scale (1.0 otherwise)
// cos, sin = float32(cos(pos * inv_freq) * mscale), float32(sin(...) * mscale), computed in float64 like
// rope.rope_tables; NEOX rotates (i, i + n_rot/2), normal (2i, 2i + 1); dims >= n_rot pass through (normed).
// One warp per (token, head) row, q rows first; lane l takes pair slots i = l, l + 32, ... < head_dim / 2:
// slot i < n_rot / 2 rotates pair i, the others copy dims n_rot + 2 (i - n_rot / 2) and the one after it.
// Launch: blockDim = 256 (8 rows), gridDim = ceil(n_tokens * (n_q_heads + n_k_heads) / 8).
template <bool kNeox, bool kNorm>
__global__ void __launch_bounds__(256)
rope(const float* __restrict__ q, const float* __restrict__ k, float* __restrict__ q_out, float* __restrict__ k_out,
     const int* __restrict__ q_positions, const int* __restrict__ k_positions, const float* __restrict__ q_norm,
     const float* __restrict__ k_norm, const double* __restrict__ inv_freq, double mscale, float eps, int n_tokens,
     int n_q_heads, int n_k_heads, int head_dim, int n_rot) {
    using namespace cupyllm;
    const long long row = static_cast<long long>(blockIdx.x) * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const long long q_rows = static_cast<long long>(n_tokens) * n_q_heads;
    if (row >= q_rows + static_cast<long long>(n_tokens) * n_k_heads) return;
    const bool is_q = row < q_rows;
    const long long head_row = is_q ? row : row - q_rows;
    const float* const src = (is_q ? q : k) + head_row * head_dim;
    float* const dst = (is_q ? q_out : k_out) + head_row * head_dim;
    const int token = static_cast<int>(head_row / (is_q ? n_q_heads : n_k_heads));
    const float* const weight = is_q ? q_norm : k_norm;
    float inv = 1.0f;
    if constexpr (kNorm) {
        float ss = 0.0f;
        for (int c = lane; c < head_dim; c += 32) ss = fmaf(src[c], src[c], ss);
        inv = inverse_rms(ss, head_dim, eps);
    }
    const auto value = [&](int c) { return kNorm ? __fmul_rn(__fmul_rn(src[c], inv), weight[c]) : src[c]; };
    const int half_dim = head_dim / 2, half_rot = n_rot / 2;
    const int position = (is_q ? q_positions : k_positions)[token];
    for (int i = lane; i < half_dim; i += 32) {
        if (i >= half_rot) {
            const int c = n_rot + 2 * (i - half_rot);
            dst[c] = value(c);
            dst[c + 1] = value(c + 1);
            continue;
        }
        double s64, c64;
        sincos(static_cast<double>(position) * inv_freq[i], &s64, &c64);
        const float cs = static_cast<float>(c64 * mscale), sn = static_cast<float>(s64 * mscale);
        const int ia = kNeox ? i : 2 * i, ib = kNeox ? i + half_rot : 2 * i + 1;
        const float a = value(ia), b = value(ib);
        dst[ia] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
        dst[ib] = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
    }
}

// ---- activations ------------------------------------------------------------------------------------------
// act: out = act(x); gated_act: out = act(gate) * up. n elements; launch blockDim = 256, grid-stride.
template <int kAct>
__global__ void __launch_bounds__(256)
act(const float* __restrict__ x, float* __restrict__ out, long long n) {
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x)
        out[i] = cupyllm::activate<kAct>(x[i]);
}

template <int kAct>
__global__ void __launch_bounds__(256)
gated_act(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ out, long long n) {
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x)
        out[i] = __fmul_rn(cupyllm::activate<kAct>(gate[i]), up[i]);
}

// out = cap * tanh(x / cap) (final-logit and attention-score soft-capping); instantiated for float
template <class T>
__global__ void __launch_bounds__(256)
softcap(const T* __restrict__ x, T* __restrict__ out, long long n, float cap) {
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x)
        out[i] = __fmul_rn(cap, tanhf(__fdiv_rn(x[i], cap)));
}
