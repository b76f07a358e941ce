"""Encoded KV rows decoded in numba, one row at a time (what the CPU's decode attention reads inside its loop,
ops/attention/cpu.py: `decode_in_place`) or many in parallel (`decode_rows`: LayerKV.decode, prefill).

Bit for bit what each format's NumPy `decode` gives (tests/ops/test_attention_cpu.py): the same float32
operations in the same order, no FMA (no fastmath here), sixteen values at a time (ops/simd.py: fp16 halves
converted in registers, block codes unpacked, rotated indices looked up by a permute or a gather). `decode_row`
leaves a rotated format's values rotated (`decode_rotated`); `decode_rows` unrotates them with the butterflies
of ops/kv_formats/turbo.py's `unrotate`, 16 lanes at a time (docs/benchmarks.md has the timings against the
one-value-at-a-time decoder it replaced).
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import get_thread_id, njit, prange

from ..simd import (bit_fields_16, bit_lanes_16, borrow, butterflies_16, fadd, fmul, fsub, gather_16, iand, ior, ishr,
                    isub, load_bf16_16, load_f16_16, load_f32_16, load_i8_16, load_u8_16, load_u16, load_u32,
                    load_u64, lookup_16, splat_16, store_f32, to_f32, zeros_16)
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
    padded = np.zeros(max(16, len(table)), np.float32)  # (at least 16 levels: one register's load)
    padded[:len(table)] = table
    return np.array([ROTATED, fmt.block_bytes, fmt.group_values, step, bits]), padded


@njit(inline="always")
def _half(row, at, half_table):
    return half_table[load_u16(row, at)]


@njit(inline="always")
def _word(data, at, n_bytes):
    """The little-endian n_bytes (<= 8) at byte `at` of data (at >= 0), zeros past its end."""
    if at + 8 <= data.shape[0]:
        word = load_u64(data, at)
        return word if n_bytes == 8 else word & ((np.uint64(1) << np.uint64(8 * n_bytes)) - np.uint64(1))
    word = np.uint64(0)
    for b in range(min(n_bytes, data.shape[0] - at)):
        word |= np.uint64(data[at + b]) << np.uint64(8 * b)
    return word


@njit(cache=True, nogil=True)
def decode_row(row, codec, table, half_table, bits, bits_f, out):  # pragma: no cover - compiled
    """Decode one encoded row (uint8 [row bytes]) into out [d] float32, as the format's NumPy decode does (the
    rotated formats: decode_rotated, still rotated). bits / bits_f: a uint32 scratch of at least max(d, (row bytes +
    7) // 4) words and its float32 view."""
    decode_row_at(row, 0, codec, table, half_table, bits, bits_f, out)


@njit(cache=True, nogil=True)
def decode_row_at(data, at, codec, table, half_table, bits, bits_f, out):  # pragma: no cover - compiled
    """decode_row of the row at byte `at` of data (uint8, 1-D: a whole cache, flat)."""
    decode_in_place(data, at, codec, table, half_table, bits, bits_f, out, 0, out.shape[0])


@njit(inline="always")
def decode_in_place(data, at, codec, table, half_table, bits, bits_f, out, out_at, d):  # pragma: no cover - compiled
    """decode_row_at into out[out_at:out_at + d], inlined into the caller's loop (ops/attention/cpu.py): a call
    (or a slice of `out`) would cost a view of the row and an atomic reference count of every array argument, and
    the threads' counts of the shared arrays contend for their cache lines (measured: 43% of a lean decode's
    attention). Sixteen values at a time (ops/simd.py) where the row allows it; bytes past the row are read only
    into index bits the masks drop.
    No float operation here may be contracted or reordered: a caller compiled with fastmath would change them."""
    kind, block_values = codec[0], codec[2]
    if d % 16 or kind == F32 or kind == Q6_0 or (kind == ROTATED and block_values % 16):
        _decode_row_scalar(data, at, codec, table, half_table, bits, bits_f, out[out_at:out_at + d])
    elif kind == F16:
        for c in range(0, d, 16):
            store_f32(out, out_at + c, load_f16_16(data, at + 2 * c))
    elif kind == BF16:
        for c in range(0, d, 16):
            store_f32(out, out_at + c, load_bf16_16(data, at + 2 * c))
    elif kind == ROTATED:
        block_bytes, step, index_bits = codec[1], codec[3], codec[4]
        mask = (1 << index_bits) - 1
        inv_sqrt = np.float32(1.0 / math.sqrt(block_values))
        small = table.shape[0] <= 16  # turbo's levels: one register, looked up by a permute
        small_table = load_f32_16(table, 0) if small else zeros_16()
        for blk in range(d // block_values):
            base = at + blk * block_bytes
            f = splat_16(_half(data, base, half_table) * inv_sqrt)
            # 16 values take 2 * step bytes; their indices all lie in the 64 bits from the first
            for sixteen in range(block_values // 16):
                indices = bit_fields_16(_word(data, base + 2 + 2 * step * sixteen, 8), step, mask)
                levels = lookup_16(small_table, indices) if small else gather_16(table, indices)
                store_f32(out, out_at + blk * block_values + 16 * sixteen, fmul(f, levels))
    else:  # llama.cpp 32-value blocks: value = d * q (+ m); the low 16 values, then the high 16
        block_bytes = codec[1]
        for blk in range(d // 32):
            base = at + blk * block_bytes
            o = blk * 32
            scale = splat_16(_half(data, base, half_table))
            if kind == Q8_0:
                for h in range(2):
                    store_f32(out, out_at + o + 16 * h, fmul(to_f32(load_i8_16(data, base + 2 + 16 * h)), scale))
                continue
            affine = kind == Q4_1 or kind == Q5_1
            low = splat_16(_half(data, base + 2, half_table) if affine else np.float32(0.0))
            five_bits = kind == Q5_0 or kind == Q5_1
            codes_at = base + 2 + (2 if affine else 0) + (4 if five_bits else 0)  # after d, m, qh
            high = load_u32(data, codes_at - 4) if five_bits else np.int64(0)
            packed = load_u8_16(data, codes_at)
            for h in range(2):
                q = iand(ishr(packed, 4 * h), 15)
                if five_bits:
                    q = ior(q, bit_lanes_16(high, 16 * h, 16))
                if affine:
                    value = fadd(fmul(scale, to_f32(q)), low)
                else:
                    value = fmul(to_f32(isub(q, 16 if five_bits else 8)), scale)
                store_f32(out, out_at + o + 16 * h, value)


@njit(cache=True, nogil=True)
def _decode_row_scalar(data, at, codec, table, half_table, bits, bits_f, out):  # pragma: no cover - compiled
    """decode_row_at a value at a time: F32, Q6_0, and rows of fewer than 16 values."""
    kind, block_bytes, block_values = codec[0], codec[1], codec[2]
    d = out.shape[0]
    if kind == F32:
        for c in range(d):
            a = at + 4 * c
            bits[c] = (np.uint32(data[a]) | (np.uint32(data[a + 1]) << 8) | (np.uint32(data[a + 2]) << 16)
                       | (np.uint32(data[a + 3]) << 24))
        for c in range(d):  # (not out[:] = ...: see _attend_task's partials)
            out[c] = bits_f[c]
    elif kind == F16:  # the half's bits moved into a float32, scaled by 2^112
        for c in range(d):
            bits[c] = ((np.uint32(data[at + 2 * c]) | (np.uint32(data[at + 2 * c + 1]) << 8)) & 0x7FFF) << 13
        for c in range(d):
            out[c] = bits_f[c] * HALF_TO_FLOAT  # exact, subnormal halves included; inf and NaN come out >= 2^16
        out_bits = out.view(np.uint32)
        for c in range(d):
            sign = (np.uint32(data[at + 2 * c + 1]) & 0x80) << 24
            out_bits[c] |= sign | (np.uint32(0x7F800000) if out[c] >= 65536.0 else np.uint32(0))
    elif kind == BF16:
        for c in range(d):
            bits[c] = (np.uint32(data[at + 2 * c]) | (np.uint32(data[at + 2 * c + 1]) << 8)) << 16
        for c in range(d):  # (not out[:] = ...: see _attend_task's partials)
            out[c] = bits_f[c]
    elif kind == ROTATED:
        step, index_bits = codec[3], codec[4]
        mask = (1 << index_bits) - 1
        inv_sqrt = np.float32(1.0 / math.sqrt(block_values))
        for blk in range(d // block_values):
            base = at + blk * block_bytes
            f = _half(data, base, half_table) * inv_sqrt
            for t in range(block_values):
                p = t * step
                word = np.int64(_word(data, base + 2 + (p >> 3), 4))
                out[blk * block_values + t] = f * table[(word >> (p & 7)) & mask]
    else:  # llama.cpp 32-value blocks: value = d * q (+ m)
        for blk in range(d // 32):
            base = at + blk * block_bytes
            scale = _half(data, base, half_table)
            o = blk * 32
            if kind == Q8_0:
                for i in range(32):
                    out[o + i] = np.float32(np.int8(data[base + 2 + i])) * scale  # the byte read as int8
            elif kind == Q4_0:
                for i in range(16):
                    byte = np.int64(data[base + 2 + i])
                    out[o + i] = np.float32((byte & 15) - 8) * scale
                    out[o + 16 + i] = np.float32((byte >> 4) - 8) * scale
            elif kind == Q4_1:
                low = _half(data, base + 2, half_table)
                for i in range(16):
                    byte = np.int64(data[base + 4 + i])
                    out[o + i] = scale * np.float32(byte & 15) + low
                    out[o + 16 + i] = scale * np.float32(byte >> 4) + low
            elif kind == Q5_0 or kind == Q5_1:
                affine = kind == Q5_1
                low = _half(data, base + 2, half_table) if affine else np.float32(0.0)
                hb = base + (4 if affine else 2)
                high = load_u32(data, hb)
                for i in range(16):
                    byte = np.int64(data[hb + 4 + i])
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
                    byte = np.int64(data[base + 10 + i])
                    shift = 4 if i >= 8 else 0
                    qh = np.int64(data[base + 2 + (i % 8)])
                    lo_q = (byte & 15) | (((qh >> shift) & 3) << 4)
                    hi_q = (byte >> 4) | (((qh >> (shift + 2)) & 3) << 4)
                    out[o + i] = np.float32(lo_q - 32) * scale
                    out[o + 16 + i] = np.float32(hi_q - 32) * scale


def decode_rows(fmt: KVFormat, data: np.ndarray, d: int) -> np.ndarray:
    """float32 [n, d] of encoded rows data [n, row bytes]: fmt.decode(data, d), bit for bit, on every core."""
    data = fmt._byte_rows(data, d)
    codec, table = row_codec(fmt)
    out = np.empty((data.shape[0], d), np.float32)
    group = fmt.group_values if is_rotated(fmt.name) else 0
    # (a writable copy: sign_vector's cached array is read-only, and a read-only type would compile again)
    signs = np.array(sign_vector(group)) if group else np.ones(1, np.float32)
    scratch = np.empty((numba.config.NUMBA_NUM_THREADS, max(d, (data.shape[1] + 7) // 4)), np.uint32)
    _decode_rows(np.ascontiguousarray(data), codec, table, HALF_TABLE, group,
                 np.float32(inv_sqrt_g(group) if group else 1.0), signs, scratch, out)
    return out


@njit(nogil=True)
def _decode_row_into(data_flat, row, row_bytes, codec, table, half_table, group, inv_sqrt, signs, scratch,
                     out_flat, d):  # pragma: no cover - compiled
    """Row `row` of _decode_rows: decoded in place, then unrotated. Compiled on its own, not inlined into the
    parallel loop, whose passes would copy and analyse the whole inlined decoder (most of the compile time)."""
    bits = borrow(scratch[get_thread_id()])
    decode_in_place(data_flat, row * row_bytes, codec, table, half_table, bits, bits.view(np.float32), out_flat,
                    row * d, d)
    if group:
        values = out_flat[row * d:(row + 1) * d]
        for first in range(0, d, group):
            _unrotate_group(values[first:first + group], inv_sqrt, signs)


@njit(parallel=True, cache=True, nogil=True)
def _decode_rows(data, codec, table, half_table, group, inv_sqrt, signs, scratch, out):  # pragma: no cover - compiled
    n, d = out.shape
    row_bytes = data.shape[1]
    # borrowed (simd.borrow): no reference counting per row; `scratch` [threads, words]: each thread's bits
    data_flat, out_flat = borrow(data.reshape(data.size)), borrow(out.reshape(out.size))
    codec, table, half_table, signs = borrow(codec), borrow(table), borrow(half_table), borrow(signs)
    for row in prange(n):  # (an int64 row: see ops/attention/cpu.py _attend_encoded)
        _decode_row_into(data_flat, np.int64(row), row_bytes, codec, table, half_table, group, inv_sqrt, signs,
                         scratch, out_flat, d)


@njit(cache=True, nogil=True)
def _unrotate_group(y, inv_sqrt, signs):  # pragma: no cover - compiled
    """In place: s * (H y) * INV_SQRT_G as ops/kv_formats/turbo.py's unrotate (butterfly stages h = 1, 2, ..., then the scale,
    then the signs: the same roundings). Sixteen lanes at a time for groups of 16 or more values."""
    g = y.shape[0]
    if g % 16 == 0:
        for c in range(0, g, 16):  # stages h = 1 .. 8 inside each sixteen
            store_f32(y, c, butterflies_16(load_f32_16(y, c)))
        h = 16
        while h < g:  # then between sixteens
            for start in range(0, g, 2 * h):
                for i in range(start, start + h, 16):
                    a, b = load_f32_16(y, i), load_f32_16(y, i + h)
                    store_f32(y, i, fadd(a, b))
                    store_f32(y, i + h, fsub(a, b))
            h *= 2
        scale = splat_16(inv_sqrt)
        for c in range(0, g, 16):
            store_f32(y, c, fmul(fmul(load_f32_16(y, c), scale), load_f32_16(signs, c)))
        return
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
