"""Reference attention with log-sum-exp: the definition every kernel and the CPU engine follow.

`attend` returns (O, LSE) for one block of keys, so results over disjoint key sets merge exactly with
`merge`: O = sum_i O_i exp(LSE_i - LSE), LSE = log sum_i exp(LSE_i). A query row that sees no key returns
O = 0 and LSE = -inf, and contributes nothing to a merge. This is how the CPU engine streams a long cache
in chunks, how a spilled cache (GPU window + host tail) merges, and how Dual Chunk Attention combines its
three regimes.

Shapes: q [n_q, n_head, d], k [n_k, n_kv, d], v [n_k, n_kv, dv]; query head h reads KV head h // (n_head/n_kv).
"""
from __future__ import annotations

import numpy as np


def causal_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int = 0) -> np.ndarray:
    """allowed[i, j]: key j is at or before query i (and within `window` positions of it when window > 0; at
    least -window positions behind it when window < 0: the complement, a mixed cache's tail, kv/window.py).
    Negative key positions mark empty cache slots."""
    q_pos = np.asarray(q_pos)[:, None]
    k_pos = np.asarray(k_pos)[None, :]
    allowed = (k_pos <= q_pos) & (k_pos >= 0)
    if window > 0:
        allowed &= (q_pos - k_pos) < window
    elif window < 0:
        allowed &= (q_pos - k_pos) >= -window
    return allowed


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray | None, *, scale: float,
           softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention of q over (k, v) restricted to `allowed` [n_q, n_k] (None: all keys), float32."""
    n_q, n_head, d = q.shape
    n_k, n_kv, dv = v.shape
    group = n_head // n_kv
    if n_k == 0:
        return nothing_seen(n_q, n_head, dv)
    scores = np.matmul(grouped_queries(q, n_kv), np.ascontiguousarray(k.transpose(1, 2, 0)))  # [n_kv, group * n_q, n_k]
    scores *= np.float32(scale)
    if softcap > 0.0:
        scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
    scores = scores.reshape(n_kv, group, n_q, n_k)
    if allowed is not None and not allowed.all():  # (a block every query sees in full needs no mask)
        scores = np.where(allowed[None, None], scores, np.float32(-np.inf))
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, np.float32(0.0))
    scores -= row_max  # in place: long prefills hold [n_kv, group, n_q, n_k] scores per key block
    probs = np.exp(scores, out=scores)
    row_sum = probs.sum(axis=-1)  # [n_kv, group, n_q]
    out = np.matmul(probs.reshape(n_kv, group * n_q, n_k), np.ascontiguousarray(v.transpose(1, 0, 2)))
    return normalized(out.reshape(n_kv, group, n_q, dv), row_max, row_sum)


def nothing_seen(n_q: int, n_head: int, dv: int) -> tuple[np.ndarray, np.ndarray]:
    """(O, LSE) of queries that see no key: zeros and -inf (they merge as nothing)."""
    return np.zeros((n_q, n_head, dv), np.float32), np.full((n_q, n_head), -np.inf, np.float32)


def grouped_queries(q: np.ndarray, n_kv: int) -> np.ndarray:
    """q [n_q, n_head, d] as [n_kv, group * n_q, d]: every query head that shares a KV head in one batched
    matmul (GQA)."""
    n_q, n_head, d = q.shape
    group = n_head // n_kv
    return np.ascontiguousarray(q.reshape(n_q, n_kv, group, d).transpose(1, 2, 0, 3)).reshape(n_kv, group * n_q, d)


def normalized(out: np.ndarray, row_max: np.ndarray, row_sum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(O [n_q, n_head, dv], LSE [n_q, n_head]) from a block's weighted value sums out [n_kv, group, n_q, dv],
    its rows' maxima [n_kv, group, n_q, 1] (0 for a row that saw nothing) and weight sums [n_kv, group, n_q]."""
    n_kv, group, n_q, dv = out.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(row_sum[..., None] > 0, out / row_sum[..., None], np.float32(0.0))
        lse = np.where(row_sum > 0, row_max[..., 0] + np.log(row_sum), np.float32(-np.inf))
    out = out.transpose(2, 0, 1, 3).reshape(n_q, n_kv * group, dv)
    lse = lse.transpose(2, 0, 1).reshape(n_q, n_kv * group)
    return out.astype(np.float32, copy=False), lse.astype(np.float32, copy=False)


def merge(out_a: np.ndarray, lse_a: np.ndarray, out_b: np.ndarray, lse_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Combine two partial attentions over disjoint key sets into the attention over their union."""
    lse = np.logaddexp(lse_a, lse_b)
    finite = np.isfinite(lse)
    safe = np.where(finite, lse, 0.0)
    w_a = np.where(finite, np.exp(lse_a - safe), 0.0)[..., None]
    w_b = np.where(finite, np.exp(lse_b - safe), 0.0)[..., None]
    return (out_a * w_a + out_b * w_b).astype(np.float32), lse.astype(np.float32)

