"""The elementwise operations on the CPU: numba kernels for the ones whose NumPy spelling costs more in calls than
in arithmetic (RMSNorm, RoPE), and the activations written to reuse their buffers.

They run on the calling thread: a decode step calls each ~20-100 times on a single row, where a thread launch
costs more than the work, and during prefill the cores belong to BLAS (numba's OpenMP workers, woken for a
parallel loop, spin afterwards and measurably slow the BLAS threads down).
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def rms_norm_rows(x, weight, eps, out):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for rows of length len(weight)."""
    n, d = x.shape
    for r in range(n):
        ss = np.float32(0.0)
        for c in range(d):
            ss += x[r, c] * x[r, c]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
        for c in range(d):
            out[r, c] = (x[r, c] * inv) * weight[c]


@njit(cache=True, nogil=True)  # no fastmath: NumPy's float32 operation order, the same values as apply_rope
def rope_rows(x, cos, sin, neox, out):
    """Rotate x [n_pos, n_heads, head_dim] by tables [n_pos, n_rot // 2] into out; dims past n_rot copied.
    NEOX pairs (i, i + n_rot/2), otherwise adjacent (2i, 2i+1): `rope.apply_rope` is the definition."""
    n_pos, n_heads, head_dim = x.shape
    half = cos.shape[1]
    for p in range(n_pos):
        for h in range(n_heads):
            for i in range(half):
                c = cos[p, i]
                s = sin[p, i]
                ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a = x[p, h, ia]
                b = x[p, h, ib]
                out[p, h, ia] = a * c - b * s
                out[p, h, ib] = a * s + b * c
            for i in range(2 * half, head_dim):
                out[p, h, i] = x[p, h, i]


def silu_times(x: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(x) * up with silu's operations in its order (the same values), in one buffer: a prefill's
    temporaries are megabytes, past L2, so each fresh one is another trip through memory."""
    t = np.negative(x)
    np.exp(t, out=t)
    t += np.float32(1.0)
    np.divide(x, t, out=t)
    t *= up
    return t


def gelu_tanh_times(x: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gelu_tanh(x) * up, its operations in gelu_tanh's order (the same values), in two buffers."""
    t = np.float32(0.044715) * x
    t *= x
    t *= x
    t += x
    t *= np.float32(np.sqrt(2.0 / np.pi))
    np.tanh(t, out=t)
    t += np.float32(1.0)
    out = np.float32(0.5) * x
    out *= t
    out *= up
    return out
