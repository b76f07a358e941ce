"""Few-query attention on the CPU (decode): one numba call per layer instead of a dozen NumPy ones.

Same semantics as `reference.attend` (causal / sliding-window mask from slot positions, optional softcap,
(O, LSE) outputs); tested against it. One (query, head) pair per task: masked scores, then softmax-weighted values.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

MAX_QUERIES = 4  # above this the BLAS path of the reference is faster


@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True, nogil=True)  # keeps inf semantics
def _attend_few(q, k, v, q_pos, k_pos, window, scale, softcap, out, lse):
    n_q, n_head, d = q.shape
    n_k, n_kv, dv = v.shape
    group = n_head // n_kv
    for task in prange(n_q * n_head):
        i = task // n_head
        h = task % n_head
        kh = h // group
        # pass 1: masked scores and their maximum (two passes instead of an online softmax: no rescaling
        # branch per key, and both loops below are plain vector loops)
        scores = np.empty(n_k, np.float32)
        m = np.float32(-np.inf)
        for j in range(n_k):
            kp = k_pos[j]
            if kp < 0 or kp > q_pos[i] or (window > 0 and q_pos[i] - kp >= window):
                scores[j] = -np.inf
                continue
            s = np.float32(0.0)
            for c in range(d):
                s += q[i, h, c] * k[j, kh, c]
            s *= scale
            if softcap > 0.0:
                s = softcap * np.float32(math.tanh(s / softcap))
            scores[j] = s
            m = max(m, s)
        if m == -np.inf:  # no visible key
            out[i, h, :] = 0.0
            lse[i, h] = -np.inf
            continue
        # pass 2: probabilities and the weighted sum of values
        total = np.float32(0.0)
        acc = np.zeros(dv, np.float32)
        for j in range(n_k):
            if scores[j] == -np.inf:
                continue
            p = np.float32(math.exp(scores[j] - m))
            total += p
            for c in range(dv):
                acc[c] += p * v[j, kh, c]
        inv = np.float32(1.0) / total
        for c in range(dv):
            out[i, h, c] = acc[c] * inv
        lse[i, h] = m + np.float32(math.log(total))


def attend_few(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, *, scale: float,
               window: int = 0, softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(O, LSE) of a few queries [n_q, n_head, d] over keys [n_k, n_kv, d] at slot positions k_pos."""
    n_q, n_head, _ = q.shape
    out = np.empty((n_q, n_head, v.shape[-1]), np.float32)
    lse = np.empty((n_q, n_head), np.float32)
    _attend_few(np.ascontiguousarray(q, np.float32), k, v, np.asarray(q_pos, np.int64),
                np.asarray(k_pos, np.int64), int(window), np.float32(scale), np.float32(softcap), out, lse)
    return out, lse
