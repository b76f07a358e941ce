"""16-bit activation codes: what the CPU's quantized matmuls (decode GEMV, prefill GEMM) multiply the weight
blocks with (NumPy reference).

A quantized weight times a float activation is a float multiply per value; times a 16-bit integer code it is
an integer multiply-add, sixteen per instruction (vpmaddwd / vpdpwssd), and the block scales are applied once
per 32 values. So before its quantized matmuls the CPU backend rounds each activation row, per 32
values, to `scale * code` with `code` an int16 in [-32767, 32767] and `scale = max|x| / 32767` (float32):

    scale = amax / 32767;  inv = 1 / scale;  code = rint(x * inv);  x_hat = code * scale

with inv = 0 (all codes 0) for a block whose scale is not a normal float32 (amax < 32767 * 2**-126, about
4e-34: values that small are zero to every product they enter; 1 / a subnormal scale would overflow).

The rounding is at most scale / 2 = amax / 65534 per value: 256 times finer than the 8-bit codes llama.cpp's
CPU path uses. Measured on the two real models against transformers (float32, same weights): rounding every
matmul's input this way moves the logits by at most 0.005 and no argmax; 8-bit codes move them by up to 1.4 and
flip 1-7% of the argmaxes. Prefill multiplies the same codes (cpu_gemm.py: twice the products an instruction
of float32 BLAS, and the weights never expanded to float32). Float weights (F32 / F16 / BF16) multiply x itself.
"""
from __future__ import annotations

import numpy as np

ACTIVATION_BLOCK = 32  # values per activation scale
ACTIVATION_LEVELS = 32767  # the largest code: codes are symmetric int16
SMALLEST_SCALE = np.finfo(np.float32).tiny  # below it a block's codes are 0


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x f32 [..., n] (n a multiple of 32) -> (codes int16 [..., n], scales f32 [..., n // 32])."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % ACTIVATION_BLOCK:
        raise ValueError(f"activation rows of {x.shape[-1]} values are not whole blocks of {ACTIVATION_BLOCK}")
    blocks = x.reshape(*x.shape[:-1], -1, ACTIVATION_BLOCK)
    scales = np.abs(blocks).max(axis=-1) / np.float32(ACTIVATION_LEVELS)
    normal = scales >= SMALLEST_SCALE
    inv = np.where(normal, np.float32(1.0) / np.where(normal, scales, np.float32(1.0)), np.float32(0.0))
    codes = np.clip(np.rint(blocks * inv[..., None]), -ACTIVATION_LEVELS, ACTIVATION_LEVELS)
    return codes.astype(np.int16).reshape(x.shape), scales.astype(np.float32)


def dequantize_activations(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The activation the quantized matmuls multiply: codes * scale per 32 values (float32)."""
    blocks = codes.reshape(*codes.shape[:-1], -1, ACTIVATION_BLOCK).astype(np.float32)
    return (blocks * scales[..., None]).reshape(codes.shape)


def round_activations(x: np.ndarray) -> np.ndarray:
    """x_hat = dequantize_activations(*quantize_activations(x)): what a decode step's quantized matmuls multiply."""
    return dequantize_activations(*quantize_activations(x))
