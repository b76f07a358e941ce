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

from ..kv.formats import KVFormat, is_rotated
from ..kv.tcq import TCQFormat

BLOCK_KEYS = 256  # slots per task: enough work per task, and the task's scores stay in L1

# row kinds of _decode_row
F32, F16, BF16, Q8_0, Q6_0, Q5_1, Q5_0, Q4_1, Q4_0, ROTATED = range(10)
_SCALAR_KINDS = {"f32": F32, "f16": F16, "bf16": BF16, "q8_0": Q8_0, "q6_0": Q6_0, "q5_1": Q5_1, "q5_0": Q5_0,
                 "q4_1": Q4_1, "q4_0": Q4_0}
# every fp16 bit pattern as float32: exact, and a table read is cheaper than rebuilding the float from bits
HALF_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
HALF_TO_FLOAT = np.float32(2.0 ** 112)  # a half's exponent bias 15 -> float32's 127


def row_codec(fmt: KVFormat) -> tuple[np.ndarray, np.ndarray]:
    """(codec [kind, block_bytes, group_values, index_step, index_bits] int64, level table float32) of a format.

    A rotated group is a fp16 norm n and a bitstream; value t is fl32(n / sqrt(G)) * table[index_t], index_t the
    `index_bits` bits from stream bit t * index_step: turbo's codes (step = bits = b, the Lloyd-Max levels) and
    TCQ's trellis states (step k, L bits, the codebook) read the same way."""
    if fmt.name in _SCALAR_KINDS:
        return np.array([_SCALAR_KINDS[fmt.name], fmt.block_bytes, fmt.block_values, 0, 0]), np.zeros(1, np.float32)
    if isinstance(fmt, TCQFormat):
        step, bits, table = fmt.k, fmt.L, fmt.codebook
    else:
        step = bits = fmt.bits
        table = fmt.levels
    return (np.array([ROTATED, fmt.block_bytes, fmt.group_values, step, bits]),
            np.ascontiguousarray(table, dtype=np.float32))


@njit(cache=True, nogil=True)
def _half(row, at, half_table):
    return half_table[np.int64(row[at]) | (np.int64(row[at + 1]) << 8)]


@njit(cache=True, nogil=True)
def _decode_row(row, codec, table, half_table, bits, bits_f, out):  # pragma: no cover - compiled
    """Decode one encoded row (uint8 [row bytes]) into out [d] float32, as the format's NumPy decode does (the
    rotated formats: decode_rotated, still rotated). bits / bits_f: a uint32 scratch of at least max(d, (row bytes +
    7) // 4) words and its float32 view."""
    kind, block_bytes, block_values = codec[0], codec[1], codec[2]
    d = out.shape[0]
    if kind == F32:
        for c in range(d):
            bits[c] = (np.uint32(row[4 * c]) | (np.uint32(row[4 * c + 1]) << 8) | (np.uint32(row[4 * c + 2]) << 16)
                       | (np.uint32(row[4 * c + 3]) << 24))
        out[:] = bits_f[:d]
    elif kind == F16:  # branch-free (it vectorises): the half's bits moved into a float32, scaled by 2^112
        for c in range(d):
            bits[c] = ((np.uint32(row[2 * c]) | (np.uint32(row[2 * c + 1]) << 8)) & 0x7FFF) << 13
        for c in range(d):
            out[c] = bits_f[c] * HALF_TO_FLOAT  # exact, subnormal halves included; inf and NaN come out >= 2^16
        out_bits = out.view(np.uint32)
        for c in range(d):
            sign = (np.uint32(row[2 * c + 1]) & 0x80) << 24
            out_bits[c] |= sign | (np.uint32(0x7F800000) if out[c] >= 65536.0 else np.uint32(0))
    elif kind == BF16:
        for c in range(d):
            bits[c] = (np.uint32(row[2 * c]) | (np.uint32(row[2 * c + 1]) << 8)) << 16
        out[:] = bits_f[:d]
    elif kind == ROTATED:
        step, index_bits = codec[3], codec[4]
        mask = (1 << index_bits) - 1
        inv_sqrt = np.float32(1.0 / math.sqrt(block_values))
        n_bytes = row.shape[0]
        stream = bits.view(np.uint8)  # the row, then zero bytes: the 32-bit reads below need no bounds test
        stream[:n_bytes] = row
        stream[n_bytes:n_bytes + 4] = 0
        for blk in range(d // block_values):
            base = blk * block_bytes
            f = _half(stream, base, half_table) * inv_sqrt
            # 8 values take 8 * step bits = `step` bytes; their indices all lie in the 32 bits from the first
            # (7 * step + index_bits <= 32 for turbo4/3/2 and both trellises)
            if block_values % 8:  # groups of 2 or 4 values (head_dim < 8): one index at a time
                for t in range(block_values):
                    p = t * step
                    at = base + 2 + (p >> 3)
                    word = np.int64(stream[at]) | (np.int64(stream[at + 1]) << 8)
                    out[blk * block_values + t] = f * table[(word >> (p & 7)) & mask]
                continue
            for eight in range(block_values // 8):
                at = base + 2 + eight * step
                word = (np.int64(stream[at]) | (np.int64(stream[at + 1]) << 8) | (np.int64(stream[at + 2]) << 16)
                        | (np.int64(stream[at + 3]) << 24))
                o = blk * block_values + 8 * eight
                for u in range(8):
                    out[o + u] = f * table[(word >> (u * step)) & mask]
    else:  # llama.cpp 32-value blocks: value = d * q (+ m)
        for blk in range(d // 32):
            base = blk * block_bytes
            scale = _half(row, base, half_table)
            o = blk * 32
            if kind == Q8_0:
                for i in range(32):
                    q = np.int64(row[base + 2 + i])
                    out[o + i] = np.float32(q - 256 if q > 127 else q) * scale
            elif kind == Q4_0:
                for i in range(16):
                    byte = np.int64(row[base + 2 + i])
                    out[o + i] = np.float32((byte & 15) - 8) * scale
                    out[o + 16 + i] = np.float32((byte >> 4) - 8) * scale
            elif kind == Q4_1:
                low = _half(row, base + 2, half_table)
                for i in range(16):
                    byte = np.int64(row[base + 4 + i])
                    out[o + i] = scale * np.float32(byte & 15) + low
                    out[o + 16 + i] = scale * np.float32(byte >> 4) + low
            elif kind == Q5_0 or kind == Q5_1:
                affine = kind == Q5_1
                low = _half(row, base + 2, half_table) if affine else np.float32(0.0)
                hb = base + (4 if affine else 2)
                high = (np.int64(row[hb]) | (np.int64(row[hb + 1]) << 8) | (np.int64(row[hb + 2]) << 16)
                        | (np.int64(row[hb + 3]) << 24))
                for i in range(16):
                    byte = np.int64(row[hb + 4 + i])
                    lo_q = (byte & 15) | (((high >> i) & 1) << 4)
                    hi_q = (byte >> 4) | (((high >> (i + 16)) & 1) << 4)
                    if affine:
                        out[o + i] = scale * np.float32(lo_q) + low
                        out[o + 16 + i] = scale * np.float32(hi_q) + low
                    else:
                        out[o + i] = np.float32(lo_q - 16) * scale
                        out[o + 16 + i] = np.float32(hi_q - 16) * scale
            else:  # Q6_0: element e's two high bits sit in qh[e % 8] at 2 * (2 * ((e % 16) >= 8) + (e >= 16))
                for i in range(16):
                    byte = np.int64(row[base + 10 + i])
                    shift = 4 if i >= 8 else 0
                    qh = np.int64(row[base + 2 + (i % 8)])
                    lo_q = (byte & 15) | (((qh >> shift) & 3) << 4)
                    hi_q = (byte >> 4) | (((qh >> (shift + 2)) & 3) << 4)
                    out[o + i] = np.float32(lo_q - 32) * scale
                    out[o + 16 + i] = np.float32(hi_q - 32) * scale


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
                    _decode_row(k_data[j, kh], k_codec, k_table, half_table, bits, bits_f, k_row)
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
            _decode_row(v_data[j, kh], v_codec, v_table, half_table, bits, bits_f, v_row)
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
