"""Dual Chunk Attention on the CPU: the fused few-query kernel (the CPU twin of kernels_cu/dca_fused.cu: one pass
over the keys, the query rotation picked per key by its regime, one online softmax). Prefill streams key blocks
through `dca.attend_dca` (three masked attentions per block, merged by LSE; backend/cpu.py)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .dca import DCAConfig


@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _dca_few(q3, k, v, q_pos, k_pos, chunk_len, scale, softcap, out, lse):
    _, n_q, n_head, d = q3.shape
    n_k, n_kv, dv = v.shape
    group = n_head // n_kv
    for task in prange(n_q * n_head):
        i = task // n_head
        h = task % n_head
        kh = h // group
        q_chunk = q_pos[i] // chunk_len
        m = -np.inf
        total = 0.0
        acc = np.zeros(dv, np.float32)
        for j in range(n_k):
            kp = k_pos[j]
            if kp < 0 or kp > q_pos[i]:
                continue
            regime = min(q_chunk - kp // chunk_len, 2)  # 0 intra, 1 successive, 2 inter
            s = np.float32(0.0)
            for c in range(d):
                s += q3[regime, i, h, c] * k[j, kh, c]
            s *= scale
            if softcap > 0.0:
                s = softcap * math.tanh(s / softcap)
            if s > m:
                factor = math.exp(m - s) if total > 0.0 else 0.0
                total *= factor
                for c in range(dv):
                    acc[c] *= factor
                m = s
            p = math.exp(s - m)
            total += p
            for c in range(dv):
                acc[c] += p * v[j, kh, c]
        if total > 0.0:
            for c in range(dv):
                out[i, h, c] = acc[c] / total
            lse[i, h] = m + math.log(total)
        else:
            for c in range(dv):
                out[i, h, c] = 0.0
            lse[i, h] = -np.inf


def dca_few(q_intra, q_successive, q_inter, k, v, q_pos, k_pos, dca: DCAConfig, *, scale: float,
            softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    n_q, n_head, _ = q_intra.shape
    q3 = np.ascontiguousarray(np.stack([q_intra, q_successive, q_inter]), dtype=np.float32)
    out = np.empty((n_q, n_head, v.shape[-1]), np.float32)
    lse = np.empty((n_q, n_head), np.float32)
    _dca_few(q3, k, v, np.asarray(q_pos, np.int64), np.asarray(k_pos, np.int64), dca.chunk_len,
             np.float32(scale * dca.logit_scale), np.float32(softcap), out, lse)
    return out, lse

