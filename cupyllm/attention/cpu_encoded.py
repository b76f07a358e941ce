"""Few-query attention on the CPU straight from the encoded cache (decode steps without the float32 mirror).

What the GPU's FA-VEC kernel does, in numba: each K/V row is decoded into a small scratch inside the loop,
never the whole cache. The rotated formats (turbo*, *_tcq) are read in their rotated domain: Q is rotated
once for K (dot products are rotation-invariant) and the output is unrotated once for V (it is linear in V).
K channel normalisation (kv/cache.py key_normalization) folds into the query: with K stored as
(K - offset) / scale, q . K = (q * scale) . K_stored + q . offset.

Work is split over (KV head, block of `BLOCK_KEYS` slots), each task decoding its rows once for every query
head of its group (GQA) and returning a partial (sum, max, weighted values); the partials merge by
log-sum-exp (split-K flash decoding). Semantics: `reference.attend` over `LayerKV.decode` (causal and
sliding-window masks from slot positions, softcap, (O, LSE)); for DCA the query rotation of each key's regime,
as `dca_cpu.dca_few`. Tested against both (tests/test_cpu_encoded_attention.py).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..kv.formats import is_rotated
from ..kv.rows import HALF_TABLE, decode_row, row_codec

BLOCK_KEYS = 256  # slots per task: enough work per task, and the task's scores stay in L1


@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True, nogil=True)  # keeps inf semantics
def _attend_encoded(q, q_offset, q_pos, k_data, v_data, k_pos, window, chunk_len, scale, softcap,
                    k_codec, k_table, v_codec, v_table, half_table, block_keys,
                    part_acc, part_max, part_sum):  # pragma: no cover - compiled
    n_regime, n_q, n_head, d = q.shape
    n_k, n_kv, _ = k_data.shape
    dv = part_acc.shape[-1]
    group = n_head // n_kv
    n_blocks = part_max.shape[1]
    rows = n_q * group  # row i * group + g: query i, head kh * group + g
    width = max(d, dv)
    for task in prange(n_kv * n_blocks):
        kh = task // n_blocks
        first = (task % n_blocks) * block_keys
        stop = min(first + block_keys, n_k)
        scores = np.full((stop - first, rows), -np.inf, np.float32)
        row_max = np.full(rows, -np.inf, np.float32)
        k_row = np.empty(d, np.float32)
        v_row = np.empty(dv, np.float32)
        bits = np.empty(max(width, (max(k_data.shape[2], v_data.shape[2]) + 7) // 4), np.uint32)
        bits_f = bits.view(np.float32)
        # pass 1: decode each visible key once, score it for every query head of the group
        for j in range(first, stop):
            kp = k_pos[j]
            if kp < 0:
                continue
            decoded = False
            for i in range(n_q):
                if kp > q_pos[i] or (window > 0 and q_pos[i] - kp >= window):
                    continue
                if not decoded:
                    decode_row(k_data[j, kh], k_codec, k_table, half_table, bits, bits_f, k_row)
                    decoded = True
                regime = 0 if chunk_len == 0 else min(q_pos[i] // chunk_len - kp // chunk_len, 2)
                for g in range(group):
                    h = kh * group + g
                    s = q_offset[regime, i, h]
                    for c in range(d):
                        s += q[regime, i, h, c] * k_row[c]
                    s *= scale
                    if softcap > 0.0:
                        s = softcap * np.float32(math.tanh(s / softcap))
                    r = i * group + g
                    scores[j - first, r] = s
                    row_max[r] = max(row_max[r], s)
        # pass 2: decode each value row some query sees once, accumulate it with its probabilities
        acc = np.zeros((rows, dv), np.float32)
        total = np.zeros(rows, np.float32)
        for j in range(first, stop):
            seen = False
            for r in range(rows):
                if scores[j - first, r] != -np.inf:
                    seen = True
                    break
            if not seen:
                continue
            decode_row(v_data[j, kh], v_codec, v_table, half_table, bits, bits_f, v_row)
            for r in range(rows):
                s = scores[j - first, r]
                if s == -np.inf:
                    continue
                p = np.float32(math.exp(s - row_max[r]))
                total[r] += p
                for c in range(dv):
                    acc[r, c] += p * v_row[c]
        part_acc[kh, task % n_blocks] = acc
        part_max[kh, task % n_blocks] = row_max
        part_sum[kh, task % n_blocks] = total


def attend_encoded(q: np.ndarray, q_pos: np.ndarray, layer_kv, *, scale: float, window: int = 0,
                   softcap: float = 0.0, chunk_len: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(O [n_q, n_head, dv], LSE [n_q, n_head]) of a few queries over a LayerKV's encoded slots.

    q: [n_q, n_head, d], or [3, n_q, n_head, d] for DCA (intra, successive, inter rotations; chunk_len > 0
    picks each key's regime by its position, as dca_cpu.dca_few; scale then includes DCA's logit scale)."""
    q = np.asarray(q, np.float32)
    q = q[None] if q.ndim == 3 else q
    n_regime, n_q, n_head, d = q.shape
    n_k, n_kv, dv = layer_kv.n_used, layer_kv.n_kv, layer_kv.v_head_dim
    group = n_head // n_kv
    q, q_offset = _query_for_stored_keys(q, layer_kv, group)
    n_blocks = max(1, -(-n_k // BLOCK_KEYS))
    part_acc = np.zeros((n_kv, n_blocks, n_q * group, dv), np.float32)
    part_max = np.full((n_kv, n_blocks, n_q * group), -np.inf, np.float32)
    part_sum = np.zeros((n_kv, n_blocks, n_q * group), np.float32)
    k_codec, k_table = row_codec(layer_kv.k_format)
    v_codec, v_table = row_codec(layer_kv.v_format)
    _attend_encoded(q, q_offset, np.asarray(q_pos, np.int64), layer_kv.k_data[:n_k], layer_kv.v_data[:n_k],
                    layer_kv.slot_pos[:n_k], int(window), int(chunk_len), np.float32(scale), np.float32(softcap),
                    k_codec, k_table, v_codec, v_table, HALF_TABLE, BLOCK_KEYS, part_acc, part_max, part_sum)
    out, lse = _merge_blocks(part_acc, part_max, part_sum)  # [n_kv, n_q * group, ...]
    out = out.reshape(n_kv, n_q, group, dv).transpose(1, 0, 2, 3).reshape(n_q, n_head, dv)
    lse = lse.reshape(n_kv, n_q, group).transpose(1, 0, 2).reshape(n_q, n_head)
    if is_rotated(layer_kv.v_format.name):  # sum_j p_j rotate(v_j) = rotate(sum_j p_j v_j): unrotate once
        out = layer_kv.v_format.unrotate(out.reshape(n_q * n_head, dv)).reshape(n_q, n_head, dv)
    return np.ascontiguousarray(out, np.float32), lse


def _query_for_stored_keys(q: np.ndarray, layer_kv, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(q as it dots the stored K rows, q . offset [n_regime, n_q, n_head]): scaled by K's normalisation, rotated
    into a rotated K format's domain."""
    n_regime, n_q, n_head, d = q.shape
    offset = np.zeros((n_regime, n_q, n_head), np.float32)
    if layer_kv.k_offset is not None:
        k_scale = np.repeat(layer_kv.k_scale, group, axis=0)  # [n_head, d]: each query head's KV head
        offset = np.einsum("rqhd,hd->rqh", q, np.repeat(layer_kv.k_offset, group, axis=0)).astype(np.float32)
        q = q * k_scale
    if is_rotated(layer_kv.k_format.name):
        q = layer_kv.k_format.rotate(q.reshape(-1, d)).reshape(q.shape)
    return np.ascontiguousarray(q, np.float32), offset


def _merge_blocks(part_acc, part_max, part_sum):
    """Split-K partials [n_kv, n_blocks, rows, ...] -> (O, LSE) [n_kv, rows, ...] by log-sum-exp."""
    best = part_max.max(axis=1)  # [n_kv, rows]
    safe = np.where(np.isfinite(best), best, 0.0)
    weight = np.where(np.isfinite(part_max), np.exp(part_max - safe[:, None]), 0.0)  # [n_kv, n_blocks, rows]
    total = (weight * part_sum).sum(axis=1)
    acc = (weight[..., None] * part_acc).sum(axis=1)
    seen = total > 0
    out = np.where(seen[..., None], acc / np.where(seen, total, 1.0)[..., None], 0.0)
    lse = np.where(seen, safe + np.log(np.where(seen, total, 1.0)), -np.inf)
    return out.astype(np.float32), lse.astype(np.float32)
