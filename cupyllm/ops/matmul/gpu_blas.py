"""y = x @ w.T with f16 inputs and float32 output and accumulation, through cuBLAS GemmEx.

cupy.matmul on f16 arrays would round the result to f16; GemmEx writes the float32 sums directly. On the CPU
emulator's stand-in for CuPy (tests/support/cuda_emu) the same product is a float32 matmul of the f16 values
(f16 x f16 products are exact in float32).
"""
from __future__ import annotations

import numpy as np

# cudaDataType / cublasComputeType_t / cublasGemmAlgo_t / cublasOperation_t / cublasPointerMode_t values
# (library_types.h, cublas_api.h)
CUDA_R_32F = 0
CUDA_R_16F = 2
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST = 0


def _cublas(cp):
    """CuPy's cuBLAS binding and handle; (None, None) on the CPU emulator's stand-in for CuPy."""
    if getattr(cp, "__cupyllm_emulated__", False):
        return None, None
    from cupy_backends.cuda.libs import cublas
    return cublas, cp.cuda.device.get_cublas_handle()


def matmul_f16_f32(cp, x16, w16, out=None):
    """float32 [n, n_out] = x16 [n, n_in] @ w16 [n_out, n_in].T, both float16 C-contiguous."""
    n, n_in = x16.shape
    n_out = w16.shape[0]
    if out is None:
        out = cp.empty((n, n_out), dtype=cp.float32)
    cublas, handle = _cublas(cp)
    if cublas is None:
        out[...] = cp.matmul(x16.astype(cp.float32), w16.astype(cp.float32).T)
        return out
    alpha = np.ones(1, np.float32)
    beta = np.zeros(1, np.float32)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
    try:
        # column-major view: out^T [n_out, n] = (w^T)^T [n_out, n_in] @ x^T [n_in, n]
        cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n_out, n, n_in,
                      alpha.ctypes.data, w16.data.ptr, CUDA_R_16F, n_in, x16.data.ptr, CUDA_R_16F, n_in,
                      beta.ctypes.data, out.data.ptr, CUDA_R_32F, n_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)
    return out


def _capturing(cp) -> bool:
    if getattr(cp, "__cupyllm_emulated__", False):
        return False
    return bool(cp.cuda.runtime.streamIsCapturing(cp.cuda.get_current_stream().ptr))


def batched_matmul(cp, a, b, few_rows: int = 16):
    """a [..., m, k] @ b [..., k, n] in float32; also inside a CUDA-graph capture.

    CuPy refuses every cuBLAS call while its stream is capturing (cupy_backends' cublas.setStream), so with
    at most `few_rows` rows (a decode step) the products are a broadcast multiply and a CuPy reduction, whose
    [..., m, k, n] temporary stays small. The eager steps take the same path, so a capture finds its kernels
    compiled and loaded."""
    if a.shape[-2] > few_rows and not _capturing(cp):
        return cp.matmul(a, b)
    return (a[..., :, :, None] * b[..., None, :, :]).sum(axis=-2)
