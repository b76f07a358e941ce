"""Small fused CPU kernels (numba) for ops whose NumPy spelling costs more in calls than in arithmetic."""
from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def rms_norm_rows(x, weight, eps, out):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for rows of length len(weight)."""
    n, d = x.shape
    for r in prange(n):
        ss = np.float32(0.0)
        for c in range(d):
            ss += x[r, c] * x[r, c]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
        for c in range(d):
            out[r, c] = (x[r, c] * inv) * weight[c]
