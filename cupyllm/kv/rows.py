"""Encoded KV rows decoded in numba, one row at a time (what the CPU's decode attention reads inside its loop,
attention/cpu_encoded.py) or many in parallel (`decode_rows`: LayerKV.decode without a float32 mirror).

Bit for bit what each format's NumPy `decode` gives (tests/test_cpu_encoded_attention.py): the same float32
operations in the same order, no FMA (no fastmath here). `decode_row` leaves a rotated format's values rotated
(`decode_rotated`); `decode_rows` unrotates them with the butterflies of kv/turbo.py's `unrotate` (4096 rows of
256 values, 2 cores: turbo3 35 -> 5 ms, turbo3_tcq 36 -> 6, f16 1.7 -> 0.4 against NumPy's decode).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .formats import KVFormat, is_rotated
from .tcq import TCQFormat
from .turbo import inv_sqrt_g, sign_vector

# row kinds of decode_row
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
def decode_row(row, codec, table, half_table, bits, bits_f, out):  # pragma: no cover - compiled
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
                    out[o + i] = np.float32(np.int8(row[base + 2 + i])) * scale  # the byte read as int8
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


def decode_rows(fmt: KVFormat, data: np.ndarray, d: int) -> np.ndarray:
    """float32 [n, d] of encoded rows data [n, row bytes]: fmt.decode(data, d), bit for bit, on every core. The
    32-value block formats take NumPy's decode: as fast there (measured: 4096 rows of 256 values, 2-3 ms both)."""
    if fmt.block_values == 32:
        return fmt.decode(data, d)
    data = fmt._byte_rows(data, d)
    codec, table = row_codec(fmt)
    out = np.empty((data.shape[0], d), np.float32)
    group = fmt.group_values if is_rotated(fmt.name) else 0
    signs = sign_vector(group) if group else np.ones(1, np.float32)
    _decode_rows(data, codec, table, HALF_TABLE, group, np.float32(inv_sqrt_g(group) if group else 1.0), signs,
                 out)
    return out


@njit(parallel=True, cache=True, nogil=True)
def _decode_rows(data, codec, table, half_table, group, inv_sqrt, signs, out):  # pragma: no cover - compiled
    n, d = out.shape
    for row in prange(n):
        bits = np.empty(max(d, (data.shape[1] + 7) // 4), np.uint32)
        decode_row(data[row], codec, table, half_table, bits, bits.view(np.float32), out[row])
        if group:
            for first in range(0, d, group):
                _unrotate_group(out[row, first:first + group], inv_sqrt, signs)


@njit(cache=True, nogil=True)
def _unrotate_group(y, inv_sqrt, signs):  # pragma: no cover - compiled
    """In place: s * (H y) * INV_SQRT_G as kv/turbo.py's unrotate (butterfly stages h = 1, 2, ..., then the scale,
    then the signs: the same roundings)."""
    g = y.shape[0]
    h = 1
    while h < g:
        for start in range(0, g, 2 * h):
            for i in range(start, start + h):
                a = y[i]
                b = y[i + h]
                y[i] = a + b
                y[i + h] = a - b
        h *= 2
    for i in range(g):
        y[i] = (y[i] * inv_sqrt) * signs[i]
