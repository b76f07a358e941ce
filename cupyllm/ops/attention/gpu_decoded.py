"""Attention over a DeviceLayerKV by decoding the cache (kv_decode.cu, f16) and CuPy matmuls, key chunk by
key chunk with an online softmax: the same (O, LSE) semantics as cupyllm/ops/attention/reference.py (causal /
sliding-window mask from the slot positions, optional soft-cap, empty slots masked).

This is the GPU engine's fallback and check: the production path reads the quantized cache in-register
(cupyllm.ops.attention.gpu_dispatch.gpu_attention, FA-VEC / FA-MMA). It launches a fixed sequence of kernels for
a given `layer_kv.n_used`, with no device-to-host copy, so it can be captured in a CUDA graph (its products then avoid cuBLAS, which
CuPy does not let a capture call: gpu_blas.batched_matmul).
"""
from __future__ import annotations

import numpy as np

from ..matmul.gpu_blas import batched_matmul

KEY_CHUNK = 4096  # cache slots decoded at a time


def attend_decoded(q, q_pos, layer_kv, *, scale: float, window: int = 0, softcap: float = 0.0,
                   key_chunk: int = KEY_CHUNK, dca=None, dca_queries=(), with_lse: bool = False):
    """out [n_q, n_head, dv] float32 for q [n_q, n_head, d] at int32 device positions q_pos [n_q] (with_lse:
    (out, LSE [n_q, n_head])). window < 0: keys at least -window positions behind the query (reference.causal_mask).

    Dual Chunk Attention with `dca` (DCAConfig): q is the intra rotation, `dca_queries` the successive and
    inter ones; each (query, key) pair is scored with the rotation of its regime, under one softmax."""
    cp = layer_kv.xp
    n_q, n_head, d = q.shape
    n_kv, dv = layer_kv.n_kv, layer_kv.v_head_dim
    group = n_head // n_kv
    rows = group * n_q
    # [n_kv, group * n_q, d] per rotation: the query heads sharing a KV head as one batch of rows (GQA)
    qgs = [cp.ascontiguousarray(cp.asarray(x).reshape(n_q, n_kv, group, d).transpose(1, 2, 0, 3))
           .reshape(n_kv, rows, d).astype(cp.float32, copy=False) for x in (q, *dca_queries)]
    q_pos = q_pos.reshape(n_q, 1)
    scale = np.float32(scale * (dca.logit_scale if dca else 1.0))

    def by_rows(pairs):  # [n_q, nk] -> [1, group * n_q, nk], the row order of qgs
        return cp.broadcast_to(pairs[None], (group, n_q, pairs.shape[-1])).reshape(1, rows, -1)

    row_max = cp.full((n_kv, rows), -np.inf, dtype=cp.float32)
    row_sum = cp.zeros((n_kv, rows), dtype=cp.float32)
    acc = cp.zeros((n_kv, rows, dv), dtype=cp.float32)
    for start in range(0, layer_kv.n_used, key_chunk):
        k, v, k_pos = layer_kv.decode(start, min(start + key_chunk, layer_kv.n_used))
        k_t = cp.ascontiguousarray(k.transpose(1, 2, 0))
        k_pos = k_pos.reshape(1, -1)
        scores = batched_matmul(cp, qgs[-1], k_t)  # [n_kv, rows, nk]; DCA: the inter rotation, then the nearer regimes
        if dca is not None:
            regime = by_rows(cp.minimum(q_pos // np.int32(dca.chunk_len) - k_pos // np.int32(dca.chunk_len), 2))
            scores = cp.where(regime == 1, batched_matmul(cp, qgs[1], k_t), scores)
            scores = cp.where(regime == 0, batched_matmul(cp, qgs[0], k_t), scores)
        scores = scores * scale
        if softcap > 0.0:
            scores = np.float32(softcap) * cp.tanh(scores / np.float32(softcap))
        allowed = (k_pos <= q_pos) & (k_pos >= 0)
        if window > 0:
            allowed &= (q_pos - k_pos) < window
        elif window < 0:
            allowed &= (q_pos - k_pos) >= -window
        scores = cp.where(by_rows(allowed), scores, np.float32(-np.inf))
        new_max = cp.maximum(row_max, scores.max(axis=-1))
        safe_max = cp.where(cp.isfinite(new_max), new_max, np.float32(0.0))
        probs = cp.exp(scores - safe_max[..., None])  # masked keys: exp(-inf) = 0
        correction = cp.exp(row_max - safe_max)  # nothing accumulated yet: exp(-inf) = 0
        row_sum = row_sum * correction + probs.sum(axis=-1)
        acc = acc * correction[..., None] + batched_matmul(cp, probs, cp.ascontiguousarray(v.transpose(1, 0, 2)))
        row_max = new_max
    out = cp.where(row_sum[..., None] > 0, acc / cp.maximum(row_sum, np.float32(1e-30))[..., None], np.float32(0.0))
    out = cp.ascontiguousarray(out.reshape(n_kv, group, n_q, dv).transpose(2, 0, 1, 3)).reshape(n_q, n_head, dv)
    if not with_lse:
        return out
    lse = cp.where(row_sum > 0, row_max + cp.log(cp.maximum(row_sum, np.float32(1e-30))), np.float32(-np.inf))
    return out, cp.ascontiguousarray(lse.reshape(n_kv, group, n_q).transpose(2, 0, 1)).reshape(n_q, n_head)
