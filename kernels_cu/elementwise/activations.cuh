// SiLU and tanh-GELU, shared by elementwise.cu (act, gated_act) and weight_gemv.cu (weight_gemv_gated): the
// NumPy twins' float32 operations in their order (cupyllm/backend/cpu.py silu, gelu_tanh); expf / tanhf may
// differ from NumPy's in the last bits.
#pragma once
#include "common/common.cuh"

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
