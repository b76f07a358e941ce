// Row and element operations of the decoder blocks, float32: RMSNorm (optionally fused with the residual
// add before or after it), rotary embedding, SiLU / tanh-GELU (plain or gated: act(gate) * up), soft-capping.
//
// NumPy twins: cupyllm/backend/cpu.py (CPUBackend.rms_norm, silu, gelu_tanh), cupyllm/backend/cpu_kernels.py
// (rms_norm_rows), cupyllm/rope.py (rope_tables, apply_rope) and models/build.py (final soft-cap). Each
// operation is written with the reference's float32 operations in its order (__f*_rn: no FMA
// contraction); sums (RMSNorm) and the library functions exp/tanh/sincos may differ in the last bits.
#include "common.cuh"

namespace cupyllm {

enum Activation : int { kSilu = 0, kGeluTanh = 1 };

// x / (1 + exp(-x))
__device__ __forceinline__ float silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }

// 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x * x * x))), NumPy's left-to-right order
__device__ __forceinline__ float gelu_tanh(float x) {
    const float c = 0.7978845834732056f;  // float32(sqrt(2 / pi))
    const float cube = __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, x), x), x);
    const float inner = __fmul_rn(c, __fadd_rn(x, cube));
    return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(inner)));
}

template <int kAct>
__device__ __forceinline__ float activate(float x) {
    if constexpr (kAct == kSilu) {
        return silu(x);
    } else {
        static_assert(kAct == kGeluTanh, "unknown activation");
        return gelu_tanh(x);
    }
}

}  // namespace cupyllm

// ---- RMSNorm: one warp per row -------------------------------------------------------------------------
//   x, residual, sum_out, out: [n_rows, d]; weight [d]; norm(v) = (v / sqrt(mean(v^2) + eps)) * weight
//   kResidual = kNoResidual:     out = norm(x)
//               kResidualBefore: sum_out = x + residual, out = norm(sum_out)  (a pre-norm block's add, next norm)
//               kResidualAfter:  out = residual + norm(x)                     (a sandwich block's post-norm, add)
//   residual and sum_out are read / written only where the mode uses them (any float array otherwise: the
//   emulator takes no nullptr)
// Launch: blockDim = 256 (8 rows), gridDim = ceil(n_rows / 8).
namespace cupyllm {
enum ResidualMode : int { kNoResidual = 0, kResidualBefore = 1, kResidualAfter = 2 };
}

template <int kResidual>
__global__ void __launch_bounds__(256)
rms_norm(const float* __restrict__ x, const float* __restrict__ residual, const float* __restrict__ weight,
         int n_rows, int d, float eps, float* __restrict__ sum_out, float* __restrict__ out) {
    using namespace cupyllm;
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
    ss = warp_sum(ss);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(d)), eps)));
    for (int c = lane; c < d; c += 32) {
        const float v = kResidual == kResidualBefore ? sum_out[base + c] : x[base + c];
        const float normed = __fmul_rn(__fmul_rn(v, inv), weight[c]);
        out[base + c] = kResidual == kResidualAfter ? __fadd_rn(residual[base + c], normed) : normed;
    }
}

// ---- rotary embedding ---------------------------------------------------------------------------------
//   x, out     [n_tokens, n_heads, head_dim] (out may be x)
//   positions  [n_tokens] int32
//   inv_freq   [n_rot / 2] float64: rope.inverse_frequencies (base, freq factors, linear / YaRN scaling)
//   mscale     the YaRN magnitude scale (1.0 otherwise)
// cos, sin = float32(cos(pos * inv_freq) * mscale), float32(sin(...) * mscale), computed in float64 like
// rope.rope_tables; NEOX rotates (i, i + n_rot/2), normal (2i, 2i + 1); dims >= n_rot pass through.
// One thread per pair slot i < head_dim / 2 of a (token, head) row: slot i < n_rot / 2 rotates pair i,
// the others copy dims n_rot + 2 (i - n_rot / 2) and the one after it.
// Launch: blockDim = 256, gridDim = ceil(n_tokens * n_heads * head_dim / 2 / 256).
template <bool kNeox>
__global__ void __launch_bounds__(256)
rope(const float* __restrict__ x, float* __restrict__ out, const int* __restrict__ positions,
     const double* __restrict__ inv_freq, double mscale, int n_tokens, int n_heads, int head_dim, int n_rot) {
    const int half_dim = head_dim / 2, half_rot = n_rot / 2;
    const long long slot = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (slot >= static_cast<long long>(n_tokens) * n_heads * half_dim) return;
    const long long row = slot / half_dim;
    const int i = static_cast<int>(slot % half_dim);
    const float* src = x + row * head_dim;
    float* dst = out + row * head_dim;
    if (i >= half_rot) {
        const int c = n_rot + 2 * (i - half_rot);
        const float a = src[c], b = src[c + 1];
        dst[c] = a;
        dst[c + 1] = b;
        return;
    }
    const int token = static_cast<int>(row / n_heads);
    double s64, c64;
    sincos(static_cast<double>(positions[token]) * inv_freq[i], &s64, &c64);
    const float cs = static_cast<float>(c64 * mscale), sn = static_cast<float>(s64 * mscale);
    const int ia = kNeox ? i : 2 * i, ib = kNeox ? i + half_rot : 2 * i + 1;
    const float a = src[ia], b = src[ib];
    dst[ia] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
    dst[ib] = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
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
