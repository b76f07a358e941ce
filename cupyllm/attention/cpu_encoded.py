"""Few-query attention on the CPU straight from the encoded cache (decode steps; the default, no float32 mirror).

What the GPU's FA-VEC kernel does, in numba: each K/V row is decoded into a small scratch inside the loop
(kv/rows.py decode_in_place, 16 values at a time), never the whole cache; every array the loops read is
borrowed (simd.borrow), so that numba counts no references per row. The rotated formats (turbo*, *_tcq) are read in their rotated domain: Q is rotated
once for K (dot products are rotation-invariant) and the output is unrotated once for V (it is linear in V).
K channel normalisation (kv/cache.py key_normalization) folds into the query: with K stored as
(K - offset) / scale, q . K = (q * scale) . K_stored + q . offset.

Work is split over (KV head, block of `BLOCK_KEYS` slots), each task decoding its rows once for every query
head of its group (GQA) and returning a partial (sum, max, weighted values); the partials merge by
log-sum-exp (split-K flash decoding); a block's softmax weights are computed 16 at a time (`simd.fexp`), its
dot products and value sums 16 lanes at a time. The same kernel reads float32 rows in place (`attend_floats`:
the CPU cache's float32 mirror, cpu_decode.attend_few, dca_cpu.dca_few). Semantics: `reference.attend` over
`LayerKV.decode` (causal and sliding-window masks from slot positions, softcap, (O, LSE)); for DCA the query
rotation of each key's regime, as `dca.attend_dca`. Tested against the reference and the dense DCA reference
(tests/test_cpu_encoded_attention.py, tests/test_attention_reference.py, tests/test_dca.py).
"""
from __future__ import annotations

import math

import numpy as np
import numba
from numba import get_thread_id, njit, prange

from ..kv.formats import get_format, is_rotated
from ..kv.rows import F32, HALF_TABLE, decode_in_place, row_codec
from ..quant.simd import borrow, fadd, fexp, fma, fsub, hsum, load_f32_16, splat_16, store_f32, zeros_16

BLOCK_KEYS = 256  # slots per task (a multiple of 16): enough work per task, and the task's scores stay in L1


@njit(inline="always")
def _dot(a, ao, b, bo, n):
    """sum_c a[ao + c] * b[bo + c] over c < n (1-D float32 arrays): 16 lanes at a time into four sums (one sum
    would chain every multiply-add on the one before: 4 cycles each), then the tail."""
    s0, s1, s2, s3 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    c = 0
    while c + 64 <= n:
        s0 = fma(load_f32_16(a, ao + c), load_f32_16(b, bo + c), s0)
        s1 = fma(load_f32_16(a, ao + c + 16), load_f32_16(b, bo + c + 16), s1)
        s2 = fma(load_f32_16(a, ao + c + 32), load_f32_16(b, bo + c + 32), s2)
        s3 = fma(load_f32_16(a, ao + c + 48), load_f32_16(b, bo + c + 48), s3)
        c += 64
    while c + 16 <= n:
        s0 = fma(load_f32_16(a, ao + c), load_f32_16(b, bo + c), s0)
        c += 16
    total = hsum(fadd(fadd(s0, s1), fadd(s2, s3)))
    for t in range(c, n):
        total += a[ao + t] * b[bo + t]
    return total


@njit(inline="always")
def _add_scaled(acc, ao, p, v, vo, n):
    """acc[ao + c] += p * v[vo + c] over c < n (1-D float32 arrays), 16 lanes at a time."""
    weight = splat_16(p)
    whole = n - n % 16
    for c in range(0, whole, 16):
        store_f32(acc, ao + c, fma(weight, load_f32_16(v, vo + c), load_f32_16(acc, ao + c)))
    for c in range(whole, n):
        acc[ao + c] += p * v[vo + c]


@njit(inline="always")
def _take(work, at, n):
    """(work[at:at + n], at + n): the next n words of a scratch."""
    return work[at:at + n], at + n


def _scratch_words(rows: int, block_keys: int, d: int, dv: int, k_row_bytes: int, v_row_bytes: int) -> int:
    """float32 words of one thread's scratch in _attend_encoded: scores and weights [rows, block_keys], the rows'
    maxima and sums, their value sums [rows, dv], a decoded K and V row, the row decoder's uint32 scratch."""
    bits_words = max(d, dv, (max(k_row_bytes, v_row_bytes) + 7) // 4)
    return 2 * rows * block_keys + 2 * rows + rows * dv + d + dv + bits_words


@njit(parallel=True, cache=True, nogil=True)  # no fastmath: the inlined row decode stays exact
def _attend_encoded(q, q_offset, q_pos, k_data, v_data, k_pos, window, chunk_len, scale, softcap,
                    k_codec, k_table, v_codec, v_table, half_table, block_keys, scratch,
                    part_acc, part_max, part_sum):  # pragma: no cover - compiled
    n_regime, n_q, n_head, d = q.shape
    n_k, n_kv, _ = k_data.shape
    dv = part_acc.shape[-1]
    group = n_head // n_kv
    n_blocks = part_max.shape[1]
    rows = n_q * group  # row i * group + g: query i, head kh * group + g
    k_row_bytes, v_row_bytes = k_data.shape[2], v_data.shape[2]
    # Every array the loops read is borrowed (simd.borrow: no reference counts, which numba would otherwise take
    # per row for the inlined helpers): the arguments' views here, each thread's slice of `scratch` below.
    q_flat, q_offset, q_pos, k_pos = borrow(q.reshape(q.size)), borrow(q_offset), borrow(q_pos), borrow(k_pos)
    k_codec, k_table, v_codec, v_table = borrow(k_codec), borrow(k_table), borrow(v_codec), borrow(v_table)
    half_table = borrow(half_table)
    # float32 rows (the mirror) are read in place, flat; encoded rows are decoded in place
    no_floats = np.empty(0, np.float32)
    k_all = borrow(k_data.view(np.float32).reshape(k_data.size // 4) if k_codec[0] == F32 else no_floats)
    v_all = borrow(v_data.view(np.float32).reshape(v_data.size // 4) if v_codec[0] == F32 else no_floats)
    k_bytes, v_bytes = borrow(k_data.reshape(k_data.size)), borrow(v_data.reshape(v_data.size))
    for task in prange(n_kv * n_blocks):
        kh = task // n_blocks
        first = (task % n_blocks) * block_keys
        stop = min(first + block_keys, n_k)
        work = borrow(scratch[get_thread_id()])  # (one task at a time per thread)
        # row r's scores at scores[r * block_keys + j - first] (-inf: not seen), so that its softmax weights
        # are one vector loop; block_keys is a multiple of 16, the slots past `stop` stay -inf
        scores, at = _take(work, 0, rows * block_keys)
        weights, at = _take(work, at, rows * block_keys)
        row_max, at = _take(work, at, rows)
        total, at = _take(work, at, rows)
        acc, at = _take(work, at, rows * dv)
        k_row, at = _take(work, at, d)
        v_row, at = _take(work, at, dv)
        bits_f = work[at:]  # the row decoder's scratch
        bits = bits_f.view(np.uint32)
        scores[:] = -np.inf
        row_max[:] = -np.inf
        total[:] = 0.0
        acc[:] = 0.0
        k_floats = k_all if k_codec[0] == F32 else k_row  # where key j's values are, from k_at
        v_floats = v_all if v_codec[0] == F32 else v_row
        # pass 1: decode each visible key once, score it for every query head of the group
        for j in range(first, stop):
            kp = k_pos[j]
            if kp < 0:
                continue
            decoded = False
            for i in range(n_q):
                if kp > q_pos[i] or (window > 0 and q_pos[i] - kp >= window):
                    continue
                if not decoded and k_codec[0] != F32:
                    decode_in_place(k_bytes, (j * n_kv + kh) * k_row_bytes, k_codec, k_table, half_table, bits,
                                    bits_f, k_row)
                    decoded = True
                k_at = (j * n_kv + kh) * d if k_codec[0] == F32 else 0
                regime = 0 if chunk_len == 0 else min(q_pos[i] // chunk_len - kp // chunk_len, 2)
                for g in range(group):
                    h = kh * group + g
                    s = q_offset[regime, i, h] + _dot(q_flat, ((regime * n_q + i) * n_head + h) * d, k_floats, k_at, d)
                    s *= scale
                    if softcap > 0.0:
                        s = softcap * np.float32(math.tanh(s / softcap))
                    r = i * group + g
                    scores[r * block_keys + j - first] = s
                    row_max[r] = max(row_max[r], s)
        # pass 2: each row's softmax weights exp(s - max), 16 at a time (fexp of -inf: 0), and their sum
        for r in range(rows):
            if row_max[r] == -np.inf:
                continue  # no key of the block seen: its weights are never read
            m = splat_16(row_max[r])
            sums = zeros_16()
            for o in range(r * block_keys, (r + 1) * block_keys, 16):
                e = fexp(fsub(load_f32_16(scores, o), m))
                store_f32(weights, o, e)
                sums = fadd(sums, e)
            total[r] = hsum(sums)
        # pass 3: decode each value row some query sees once, accumulate it with its weights
        for j in range(first, stop):
            seen = False
            for r in range(rows):
                if scores[r * block_keys + j - first] != -np.inf:
                    seen = True
                    break
            if not seen:
                continue
            if v_codec[0] != F32:
                decode_in_place(v_bytes, (j * n_kv + kh) * v_row_bytes, v_codec, v_table, half_table, bits,
                                bits_f, v_row)
            v_at = (j * n_kv + kh) * dv if v_codec[0] == F32 else 0
            for r in range(rows):
                o = r * block_keys + j - first
                if scores[o] != -np.inf:
                    _add_scaled(acc, r * dv, weights[o], v_floats, v_at, dv)
        part_acc[kh, task % n_blocks] = acc.reshape(rows, dv)
        part_max[kh, task % n_blocks] = row_max
        part_sum[kh, task % n_blocks] = total


def attend_encoded(q: np.ndarray, q_pos: np.ndarray, layer_kv, *, scale: float, window: int = 0,
                   softcap: float = 0.0, chunk_len: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(O [n_q, n_head, dv], LSE [n_q, n_head]) of a few queries over a LayerKV's encoded slots.

    q: [n_q, n_head, d], or [3, n_q, n_head, d] for DCA (intra, successive, inter rotations; chunk_len > 0
    picks each key's regime by its position, as dca_cpu.dca_few; scale then includes DCA's logit scale)."""
    q = np.asarray(q, np.float32)
    q = q[None] if q.ndim == 3 else q
    n_k = layer_kv.n_used
    q, q_offset = _query_for_stored_keys(q, layer_kv, q.shape[2] // layer_kv.n_kv)
    out, lse = attend_rows(q, q_offset, q_pos, layer_kv.k_data[:n_k], layer_kv.v_data[:n_k],
                           layer_kv.slot_pos[:n_k], layer_kv.k_format, layer_kv.v_format, layer_kv.v_head_dim,
                           scale=scale, window=window, softcap=softcap, chunk_len=chunk_len)
    if is_rotated(layer_kv.v_format.name):  # sum_j p_j rotate(v_j) = rotate(sum_j p_j v_j): unrotate once
        n_q, n_head, dv = out.shape
        out = layer_kv.v_format.unrotate(out.reshape(n_q * n_head, dv)).reshape(n_q, n_head, dv)
    return np.ascontiguousarray(out, np.float32), lse


def attend_floats(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, *,
                  scale: float, window: int = 0, softcap: float = 0.0,
                  chunk_len: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """attend_encoded's (O, LSE) over float32 K [n_k, n_kv, d] and V [n_k, n_kv, dv] (the CPU cache's float32
    mirror: its rows read as the f32 format's), keys at slot positions k_pos; q as attend_encoded's."""
    q = np.ascontiguousarray(q, np.float32)
    q = q[None] if q.ndim == 3 else q
    f32 = get_format("f32")
    return attend_rows(q, np.zeros(q.shape[:3], np.float32), q_pos,
                       np.ascontiguousarray(k, np.float32).view(np.uint8),
                       np.ascontiguousarray(v, np.float32).view(np.uint8), k_pos, f32, f32, v.shape[-1],
                       scale=scale, window=window, softcap=softcap, chunk_len=chunk_len)


def attend_rows(q, q_offset, q_pos, k_data, v_data, k_pos, k_format, v_format, dv: int, *, scale: float,
                window: int, softcap: float, chunk_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(O [n_q, n_head, dv] in V's stored domain, LSE) of q [n_regime, n_q, n_head, d] (as it dots the stored
    K rows; q_offset [n_regime, n_q, n_head] added to each score) over encoded rows k_data / v_data
    [n_k, n_kv, row bytes] at slot positions k_pos: _attend_encoded's split-K partials merged by LSE."""
    n_regime, n_q, n_head, d = q.shape
    n_k, n_kv = k_data.shape[:2]
    group = n_head // n_kv
    n_blocks = max(1, -(-n_k // BLOCK_KEYS))
    part_acc = np.zeros((n_kv, n_blocks, n_q * group, dv), np.float32)
    part_max = np.full((n_kv, n_blocks, n_q * group), -np.inf, np.float32)
    part_sum = np.zeros((n_kv, n_blocks, n_q * group), np.float32)
    k_codec, k_table = row_codec(k_format)
    v_codec, v_table = row_codec(v_format)
    words = _scratch_words(n_q * group, BLOCK_KEYS, d, dv, k_data.shape[2], v_data.shape[2])
    scratch = np.empty((numba.config.NUMBA_NUM_THREADS, words), np.float32)  # a slice per thread
    _attend_encoded(q, np.ascontiguousarray(q_offset, np.float32), np.ascontiguousarray(q_pos, np.int64), k_data,
                    v_data, np.ascontiguousarray(k_pos, np.int64), int(window), int(chunk_len), np.float32(scale),
                    np.float32(softcap), k_codec, k_table, v_codec, v_table, HALF_TABLE, BLOCK_KEYS, scratch,
                    part_acc, part_max, part_sum)
    out, lse = _merge_blocks(part_acc, part_max, part_sum)  # [n_kv, n_q * group, ...]
    out = out.reshape(n_kv, n_q, group, dv).transpose(1, 0, 2, 3).reshape(n_q, n_head, dv)
    lse = lse.reshape(n_kv, n_q, group).transpose(1, 0, 2).reshape(n_q, n_head)
    return out, np.ascontiguousarray(lse)


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
