"""Dual Chunk Attention on the GPU: one fused flash-attention pass over a layer's cache.

``gpu_dca_attention_lse(q_intra, q_successive, q_inter, q_pos, layer_kv, dca, scale=, softcap=)`` -> (O, LSE)
computes exactly what ``cupyllm.attention.dca.attend_dca`` defines over everything the layer caches (and
``cupyllm.attention.dca_cpu._dca_few`` on the CPU): key j is scored against query i with the rotation of
its regime ``min(chunk(pos_i) - chunk(pos_j), 2)`` (intra / successive / inter; chunk(p) = p // chunk_len,
true positions from ``layer_kv.slot_pos``), causal mask, logit scale ``scale * dca.logit_scale``, optional
softcap, and ONE softmax over all visible keys. The kernels are the DCA instantiations of FA-VEC / FA-MMA
(``fa_vec<D, 8, true>``, ``fa_mma<D, kDecode, true>``, kernels_cu/fa_common.cuh): the three rotations are
prepared by one fa_prep_q launch (scaled, rotated for rotated K formats), the cache is read once in its
encoded format, split-KV results merge in fa_combine. A query row that sees no key gets O = 0, LSE = -inf.

Arguments as ``cupyllm.attention.dispatch.gpu_attention_lse`` (the three q arrays alike: float32 or float16
[n_q, n_head, d] on the device), plus ``dca`` (DCAConfig). ``kernel`` / ``n_split`` override the automatic
choices (tests, benchmarks). Everything is launched asynchronously (CUDA-graph capturable).

``attend_dca_decoded`` is the fallback for caches the flash kernels have no instantiation for (as
backend/gpu_attention.attend_decoded is for plain attention): the cache decoded chunk by chunk, the three
score matrices by CuPy matmuls, the regime picked per (query, key), one online softmax.
"""
from __future__ import annotations

import numpy as np

from .dca import DCAConfig
from .dispatch import GpuAttention, default_gpu_attention

KEY_CHUNK = 4096  # cache slots the fallback decodes at a time


def gpu_dca_attention_lse(q_intra, q_successive, q_inter, q_pos, layer_kv, dca: DCAConfig, *, scale: float,
                          softcap: float = 0.0, kernel: str | None = None, n_split: int | None = None,
                          runner: GpuAttention | None = None):
    """(O [n_q, n_head, d] in q's dtype, LSE float32 [n_q, n_head]); see the module docstring."""
    runner = runner or default_gpu_attention()
    return runner.attention_lse(q_intra, q_pos, layer_kv, scale=scale, softcap=softcap, kernel=kernel,
                                n_split=n_split, dca=dca, dca_queries=(q_successive, q_inter))


def gpu_dca_attention(q_intra, q_successive, q_inter, q_pos, layer_kv, dca: DCAConfig, *, scale: float,
                      softcap: float = 0.0, kernel: str | None = None, n_split: int | None = None,
                      runner: GpuAttention | None = None):
    """O of the fused DCA (gpu_dca_attention_lse without the LSE)."""
    return gpu_dca_attention_lse(q_intra, q_successive, q_inter, q_pos, layer_kv, dca, scale=scale, softcap=softcap,
                                 kernel=kernel, n_split=n_split, runner=runner)[0]


def attend_dca_decoded(q_intra, q_successive, q_inter, q_pos, layer_kv, dca: DCAConfig, *, scale: float,
                       softcap: float = 0.0, key_chunk: int = KEY_CHUNK):
    """out [n_q, n_head, dv] float32 by decoding the cache (f16) and CuPy matmuls; q_pos int32 on the device."""
    cp = layer_kv.xp
    n_q, n_head, d = q_intra.shape
    n_kv, dv = layer_kv.n_kv, layer_kv.v_head_dim
    group = n_head // n_kv
    rows = group * n_q
    # [n_kv, group * n_q, d] per rotation: the query heads sharing a KV head as one batch of rows (GQA)
    qg = [cp.ascontiguousarray(cp.asarray(q).reshape(n_q, n_kv, group, d).transpose(1, 2, 0, 3))
          .reshape(n_kv, rows, d).astype(cp.float32, copy=False) for q in (q_intra, q_successive, q_inter)]
    q_pos = q_pos.reshape(n_q, 1)
    q_chunk = q_pos // np.int32(dca.chunk_len)
    scale = np.float32(scale * dca.logit_scale)
    row_max = cp.full((n_kv, rows), -np.inf, dtype=cp.float32)
    row_sum = cp.zeros((n_kv, rows), dtype=cp.float32)
    acc = cp.zeros((n_kv, rows, dv), dtype=cp.float32)
    for start in range(0, layer_kv.n_used, key_chunk):
        k, v, k_pos = layer_kv.decode(start, min(start + key_chunk, layer_kv.n_used))
        k_t = cp.ascontiguousarray(k.transpose(1, 2, 0))
        k_pos = k_pos.reshape(1, -1)
        regime = cp.minimum(q_chunk - k_pos // np.int32(dca.chunk_len), 2)  # [n_q, nk]
        regime = cp.broadcast_to(regime[None], (group, n_q, regime.shape[-1])).reshape(1, rows, -1)
        scores = cp.matmul(qg[2], k_t)
        scores = cp.where(regime == 1, cp.matmul(qg[1], k_t), scores)
        scores = cp.where(regime == 0, cp.matmul(qg[0], k_t), scores) * scale
        if softcap > 0.0:
            scores = np.float32(softcap) * cp.tanh(scores / np.float32(softcap))
        allowed = (k_pos <= q_pos) & (k_pos >= 0)
        allowed = cp.broadcast_to(allowed[None], (group, n_q, allowed.shape[-1])).reshape(1, rows, -1)
        scores = cp.where(allowed, scores, np.float32(-np.inf))
        new_max = cp.maximum(row_max, scores.max(axis=-1))
        safe_max = cp.where(cp.isfinite(new_max), new_max, np.float32(0.0))
        probs = cp.exp(scores - safe_max[..., None])  # masked keys: exp(-inf) = 0
        correction = cp.exp(row_max - safe_max)  # nothing accumulated yet: exp(-inf) = 0
        row_sum = row_sum * correction + probs.sum(axis=-1)
        acc = acc * correction[..., None] + cp.matmul(probs, cp.ascontiguousarray(v.transpose(1, 0, 2)))
        row_max = new_max
    out = cp.where(row_sum[..., None] > 0, acc / cp.maximum(row_sum, np.float32(1e-30))[..., None], np.float32(0.0))
    return cp.ascontiguousarray(out.reshape(n_kv, group, n_q, dv).transpose(2, 0, 1, 3)).reshape(n_q, n_head, dv)
