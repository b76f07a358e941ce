"""Few-query attention on the CPU (decode) over float32 K / V: one numba call per layer instead of a dozen NumPy
ones.

Same semantics as `reference.attend` (causal / sliding-window mask from slot positions, optional softcap,
(O, LSE) outputs); tested against it. The kernel is the encoded cache's (`cpu_encoded.py`) reading float32 rows:
tasks of (KV head, 256 keys), each key's row read once for all query heads of its group, the softmax weights
of a block 16 at a time (`simd.fexp`), the blocks merged by LSE.
"""
from __future__ import annotations

import numpy as np

from .cpu_encoded import attend_floats

MAX_QUERIES = 4  # above this the BLAS path of the reference is faster


def attend_few(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, *, scale: float,
               window: int = 0, softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(O, LSE) of a few queries [n_q, n_head, d] over keys [n_k, n_kv, d] at slot positions k_pos."""
    return attend_floats(q, k, v, q_pos, k_pos, scale=scale, window=window, softcap=softcap)
