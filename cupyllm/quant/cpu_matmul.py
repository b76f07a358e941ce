"""CPU matmul straight from GGUF blocks (numba, multithreaded, f32 accumulation, f32 activations).

`y = x @ W.T` with W kept in its quantized blocks:
- few tokens (decode): `gemv_blocks` walks each weight row once, unpacking block by block in registers and
  dotting it with the token, so a decode step reads the quantized bytes only (memory-bound, as in llama.cpp);
- many tokens (prefill): `dequantize_rows` expands a tile of rows to f32 and BLAS multiplies the tile, which is
  compute-bound, so the tile's dequantization is amortised over all tokens.
Both are written with the explicit 8-lane vectors of `quant/simd.py`. The row decoders reproduce the NumPy
definitions of `quant/weights.py` bit for bit; the fused dot products sum the same values in another order.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import (bit_lanes, f32_from_bits, fadd, fma, fmul, fsub, hsum, iand, ior, ishl, ishr, isub, load_f32, load_i8,
                   load_u8, splat, store_f32, to_f32, zeros)
from .weights import WEIGHT_FORMATS, WeightFormat
from gguf import GGMLQuantizationType as T

# fp16 -> f32 by table: a 256 KiB array that stays in L2, cheaper than bit twiddling per scale
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_C = {qtype: fmt.code for qtype, fmt in WEIGHT_FORMATS.items()}
C_F32, C_F16, C_BF16, C_Q8_0 = _C[T.F32], _C[T.F16], _C[T.BF16], _C[T.Q8_0]
C_Q4_0, C_Q4_1, C_Q5_0, C_Q5_1 = _C[T.Q4_0], _C[T.Q4_1], _C[T.Q5_0], _C[T.Q5_1]
C_Q4_K, C_Q5_K, C_Q6_K = _C[T.Q4_K], _C[T.Q5_K], _C[T.Q6_K]

TOKENS_PER_GEMV = 2  # up to this many tokens stream the quantized rows; more go through BLAS tiles
ROW_TILE = 2048


@njit(inline="always")
def _half(row, off, f16):
    return f16[np.int32(row[off]) | (np.int32(row[off + 1]) << 8)]


@njit(inline="always")
def _u32_at(row, off):
    return (np.uint32(row[off]) | (np.uint32(row[off + 1]) << 8) | (np.uint32(row[off + 2]) << 16)
            | (np.uint32(row[off + 3]) << 24))


@njit(inline="always")
def _i8(byte):
    v = np.int32(byte)
    return np.float32(v - ((v >> 7) << 8))


@njit(inline="always")
def _scale_min_k4(j, row, off):
    if j < 4:
        return np.int32(row[off + j]) & 63, np.int32(row[off + j + 4]) & 63
    sc = (np.int32(row[off + j + 4]) & 0x0F) | ((np.int32(row[off + j - 4]) >> 6) << 4)
    mn = (np.int32(row[off + j + 4]) >> 4) | ((np.int32(row[off + j]) >> 6) << 4)
    return sc, mn


# --- dequantization of whole rows (prefill tiles, embedding lookups) ---------------------------------
# Same float32 operations, in the same order, as the NumPy definitions: bit-identical values.

@njit(inline="always")
def _store_scaled(dst, i, q, d):
    """dst[i:i+8] = float(q) * d"""
    store_f32(dst, i, fmul(to_f32(q), splat(d)))


@njit(inline="always")
def _store_affine(dst, i, q, d, m):
    """dst[i:i+8] = float(q) * d + m"""
    store_f32(dst, i, fadd(fmul(to_f32(q), splat(d)), splat(m)))


@njit(inline="always")
def _store_k(dst, i, q, d_sub, m_sub):
    """dst[i:i+8] = d_sub * float(q) - m_sub (K-quant sub-block)"""
    store_f32(dst, i, fsub(fmul(splat(d_sub), to_f32(q)), splat(m_sub)))


@njit(inline="always")
def _deq_row(code, row, dst, f16):
    n = dst.shape[0]
    if code == C_Q8_0:
        for b in range(n // 32):
            o = b * 34
            d = _half(row, o, f16)
            for g in range(4):
                _store_scaled(dst, b * 32 + 8 * g, load_i8(row, o + 2 + 8 * g), d)
    elif code == C_Q4_0 or code == C_Q4_1:
        size, qs = (18, 2) if code == C_Q4_0 else (20, 4)
        for b in range(n // 32):
            o = b * size
            d = _half(row, o, f16)
            for g in range(2):
                q = load_u8(row, o + qs + 8 * g)
                if code == C_Q4_0:
                    _store_scaled(dst, b * 32 + 8 * g, isub(iand(q, 15), 8), d)
                    _store_scaled(dst, b * 32 + 16 + 8 * g, isub(ishr(q, 4), 8), d)
                else:
                    m = _half(row, o + 2, f16)
                    _store_affine(dst, b * 32 + 8 * g, iand(q, 15), d, m)
                    _store_affine(dst, b * 32 + 16 + 8 * g, ishr(q, 4), d, m)
    elif code == C_Q5_0 or code == C_Q5_1:
        size, qh_at = (22, 2) if code == C_Q5_0 else (24, 4)
        for b in range(n // 32):
            o = b * size
            d = _half(row, o, f16)
            h = _u32_at(row, o + qh_at)
            for g in range(2):
                q = load_u8(row, o + qh_at + 4 + 8 * g)
                lo = ior(iand(q, 15), bit_lanes(h, 8 * g, 16))
                hi = ior(ishr(q, 4), bit_lanes(h, 16 + 8 * g, 16))
                if code == C_Q5_0:
                    _store_scaled(dst, b * 32 + 8 * g, isub(lo, 16), d)
                    _store_scaled(dst, b * 32 + 16 + 8 * g, isub(hi, 16), d)
                else:
                    m = _half(row, o + 2, f16)
                    _store_affine(dst, b * 32 + 8 * g, lo, d, m)
                    _store_affine(dst, b * 32 + 16 + 8 * g, hi, d, m)
    elif code == C_Q4_K or code == C_Q5_K:
        size, qs0 = (144, 16) if code == C_Q4_K else (176, 48)
        for b in range(n // 256):
            o = b * size
            d = _half(row, o, f16)
            dmin = _half(row, o + 2, f16)
            for pair in range(4):
                sc0, m0 = _scale_min_k4(2 * pair, row, o + 4)
                sc1, m1 = _scale_min_k4(2 * pair + 1, row, o + 4)
                base = b * 256 + pair * 64
                for g in range(4):
                    q = load_u8(row, o + qs0 + pair * 32 + 8 * g)
                    lo = iand(q, 15)
                    hi = ishr(q, 4)
                    if code == C_Q5_K:
                        h = load_u8(row, o + 16 + 8 * g)
                        lo = ior(lo, ishl(iand(ishr(h, 2 * pair), 1), 4))
                        hi = ior(hi, ishl(iand(ishr(h, 2 * pair + 1), 1), 4))
                    _store_k(dst, base + 8 * g, lo, d * np.float32(sc0), dmin * np.float32(m0))
                    _store_k(dst, base + 32 + 8 * g, hi, d * np.float32(sc1), dmin * np.float32(m1))
    elif code == C_Q6_K:
        for b in range(n // 256):
            o = b * 210
            d = _half(row, o + 208, f16)
            for half in range(2):
                ql = o + half * 64
                qh = o + 128 + half * 32
                sc = o + 192 + half * 8
                base = b * 256 + half * 128
                for g in range(4):  # lanes l = 8g..8g+7 of the four 32-value groups; scale per 16 lanes
                    l = 8 * g
                    s = g // 2
                    h = load_u8(row, qh + l)
                    a = load_u8(row, ql + l)
                    c = load_u8(row, ql + 32 + l)
                    _store_scaled(dst, base + l, isub(ior(iand(a, 15), ishl(iand(h, 3), 4)), 32),
                                  d * _i8(row[sc + s]))
                    _store_scaled(dst, base + 32 + l, isub(ior(iand(c, 15), ishl(iand(h, 12), 2)), 32),
                                  d * _i8(row[sc + s + 2]))
                    _store_scaled(dst, base + 64 + l, isub(ior(ishr(a, 4), iand(h, 48)), 32),
                                  d * _i8(row[sc + s + 4]))
                    _store_scaled(dst, base + 96 + l, isub(ior(ishr(c, 4), iand(ishr(h, 2), 48)), 32),
                                  d * _i8(row[sc + s + 6]))
    else:
        for k in range(n):
            dst[k] = _plain_value(code, row, k, f16)


@njit(inline="always")
def _plain_value(code, row, k, f16):
    """Value k of an F16 / BF16 / F32 row."""
    if code == C_F16:
        return _half(row, 2 * k, f16)
    if code == C_BF16:
        return f32_from_bits((np.uint32(row[2 * k]) | (np.uint32(row[2 * k + 1]) << 8)) << 16)
    return f32_from_bits(_u32_at(row, 4 * k))


@njit(cache=True, nogil=True)  # serial: the prefill tiles it fills go to BLAS, whose threads need the cores
def dequantize_rows(code, data, row_start, row_end, out, f16):
    """out[r - row_start, :] = row r of the weight, for r in [row_start, row_end)."""
    for r in range(row_end - row_start):
        _deq_row(code, data[row_start + r], out[r], f16)


@njit(cache=True, nogil=True)
def gather_rows(code, data, ids, out, f16):
    """out[i, :] = row ids[i] of the weight (embedding lookup), on the calling thread."""
    for i in range(ids.shape[0]):
        _deq_row(code, data[ids[i]], out[i], f16)


# --- fused dequant-dot of one weight row with one activation vector -------------------------------
# Written with the explicit 8-lane vectors of `simd` (numba's integer promotion defeats auto-vectorisation
# here). Every decoder multiplies the block's integer codes with x in float32 lanes first and applies the
# block scale once per 8-32 values; constant offsets (Q4_0's -8, Q5_0's -16, Q6_K's -32, the K-quant
# mins and Q4_1/Q5_1's m) are folded through `xs`, the sums of x over each 16 values, so the lane loop
# is just unpack, convert, FMA.

XS_GROUP = 16  # values per entry of the activation partial sums `xs`


@njit(inline="always")
def _xs32(xs, k):
    """Sum of x over the 32 values starting at k (a multiple of 32)."""
    return xs[k // 16] + xs[k // 16 + 1]


@njit(inline="always")
def _dot4(v0, v1, v2, v3, x, xb):
    """v0 * x[xb:xb+8] + v1 * x[xb+8:xb+16] + ... over 32 consecutive values of x."""
    s = fmul(v0, load_f32(x, xb))
    s = fma(v1, load_f32(x, xb + 8), s)
    s = fma(v2, load_f32(x, xb + 16), s)
    return fma(v3, load_f32(x, xb + 24), s)


@njit(inline="always")
def _dot_q8_0(row, x, xs, f16):
    acc = zeros()
    for b in range(x.shape[0] // 32):
        o = b * 34
        s = _dot4(to_f32(load_i8(row, o + 2)), to_f32(load_i8(row, o + 10)), to_f32(load_i8(row, o + 18)),
                  to_f32(load_i8(row, o + 26)), x, b * 32)
        acc = fma(splat(_half(row, o, f16)), s, acc)
    return hsum(acc)


@njit(inline="always")
def _nibbles(row, qs, x, xb):
    """Sum over the 32 values of a 16-byte nibble field at row[qs]: low nibbles hold values 0..15, high 16..31."""
    q0 = load_u8(row, qs)
    q1 = load_u8(row, qs + 8)
    return _dot4(to_f32(iand(q0, 15)), to_f32(iand(q1, 15)), to_f32(ishr(q0, 4)), to_f32(ishr(q1, 4)), x, xb)


@njit(inline="always")
def _dot_q4_0(row, x, xs, f16):
    acc = zeros()
    offset = np.float32(0.0)
    for b in range(x.shape[0] // 32):
        o = b * 18
        d = _half(row, o, f16)
        acc = fma(splat(d), _nibbles(row, o + 2, x, b * 32), acc)
        offset += d * _xs32(xs, b * 32)
    return hsum(acc) - np.float32(8.0) * offset


@njit(inline="always")
def _dot_q4_1(row, x, xs, f16):
    acc = zeros()
    offset = np.float32(0.0)
    for b in range(x.shape[0] // 32):
        o = b * 20
        acc = fma(splat(_half(row, o, f16)), _nibbles(row, o + 4, x, b * 32), acc)
        offset += _half(row, o + 2, f16) * _xs32(xs, b * 32)
    return hsum(acc) + offset


@njit(inline="always")
def _fives(row, qh, qs, x, xb):
    """Sum over the 32 5-bit values of Q5_0/Q5_1: nibbles at row[qs], 5th bits in the u32 at row[qh]."""
    h = _u32_at(row, qh)
    q0 = load_u8(row, qs)
    q1 = load_u8(row, qs + 8)
    return _dot4(to_f32(ior(iand(q0, 15), bit_lanes(h, 0, 16))), to_f32(ior(iand(q1, 15), bit_lanes(h, 8, 16))),
                 to_f32(ior(ishr(q0, 4), bit_lanes(h, 16, 16))), to_f32(ior(ishr(q1, 4), bit_lanes(h, 24, 16))),
                 x, xb)


@njit(inline="always")
def _dot_q5_0(row, x, xs, f16):
    acc = zeros()
    offset = np.float32(0.0)
    for b in range(x.shape[0] // 32):
        o = b * 22
        d = _half(row, o, f16)
        acc = fma(splat(d), _fives(row, o + 2, o + 6, x, b * 32), acc)
        offset += d * _xs32(xs, b * 32)
    return hsum(acc) - np.float32(16.0) * offset


@njit(inline="always")
def _dot_q5_1(row, x, xs, f16):
    acc = zeros()
    offset = np.float32(0.0)
    for b in range(x.shape[0] // 32):
        o = b * 24
        acc = fma(splat(_half(row, o, f16)), _fives(row, o + 4, o + 8, x, b * 32), acc)
        offset += _half(row, o + 2, f16) * _xs32(xs, b * 32)
    return hsum(acc) + offset


@njit(inline="always")
def _dot_q4_k(row, x, xs, f16):
    acc = zeros()
    mins = np.float32(0.0)
    for b in range(x.shape[0] // 256):
        o = b * 144
        d = _half(row, o, f16)
        dmin = _half(row, o + 2, f16)
        for pair in range(4):  # 32 bytes: low nibbles are sub-block 2*pair, high nibbles 2*pair + 1
            sc0, m0 = _scale_min_k4(2 * pair, row, o + 4)
            sc1, m1 = _scale_min_k4(2 * pair + 1, row, o + 4)
            qs = o + 16 + pair * 32
            xb = b * 256 + pair * 64
            q0 = load_u8(row, qs)
            q1 = load_u8(row, qs + 8)
            q2 = load_u8(row, qs + 16)
            q3 = load_u8(row, qs + 24)
            lo = _dot4(to_f32(iand(q0, 15)), to_f32(iand(q1, 15)), to_f32(iand(q2, 15)), to_f32(iand(q3, 15)), x, xb)
            hi = _dot4(to_f32(ishr(q0, 4)), to_f32(ishr(q1, 4)), to_f32(ishr(q2, 4)), to_f32(ishr(q3, 4)), x, xb + 32)
            acc = fma(splat(d * np.float32(sc0)), lo, acc)
            acc = fma(splat(d * np.float32(sc1)), hi, acc)
            mins += (dmin * np.float32(m0)) * _xs32(xs, xb) + (dmin * np.float32(m1)) * _xs32(xs, xb + 32)
    return hsum(acc) - mins


@njit(inline="always")
def _dot_q5_k(row, x, xs, f16):
    acc = zeros()
    mins = np.float32(0.0)
    for b in range(x.shape[0] // 256):
        o = b * 176
        d = _half(row, o, f16)
        dmin = _half(row, o + 2, f16)
        for pair in range(4):  # bit 2*pair / 2*pair + 1 of qh[l] is the 5th bit of sub-block 2*pair / 2*pair + 1
            sc0, m0 = _scale_min_k4(2 * pair, row, o + 4)
            sc1, m1 = _scale_min_k4(2 * pair + 1, row, o + 4)
            qs = o + 48 + pair * 32
            xb = b * 256 + pair * 64
            lo = zeros()
            hi = zeros()
            for g in range(4):
                q = load_u8(row, qs + 8 * g)
                h = load_u8(row, o + 16 + 8 * g)
                v_lo = ior(iand(q, 15), ishl(iand(ishr(h, 2 * pair), 1), 4))
                v_hi = ior(ishr(q, 4), ishl(iand(ishr(h, 2 * pair + 1), 1), 4))
                lo = fma(to_f32(v_lo), load_f32(x, xb + 8 * g), lo)
                hi = fma(to_f32(v_hi), load_f32(x, xb + 32 + 8 * g), hi)
            acc = fma(splat(d * np.float32(sc0)), lo, acc)
            acc = fma(splat(d * np.float32(sc1)), hi, acc)
            mins += (dmin * np.float32(m0)) * _xs32(xs, xb) + (dmin * np.float32(m1)) * _xs32(xs, xb + 32)
    return hsum(acc) - mins


@njit(inline="always")
def _dot_q6_k(row, x, xs, f16):
    acc = zeros()
    offset = np.float32(0.0)
    for b in range(x.shape[0] // 256):
        o = b * 210
        d = _half(row, o + 208, f16)
        for half in range(2):
            ql = o + half * 64
            qh = o + 128 + half * 32
            sc = o + 192 + half * 8
            xb = b * 256 + half * 128
            for sub in range(2):  # lanes l = 16*sub .. 16*sub+15 of each of the four 32-value groups share a scale
                l = 16 * sub
                h0 = load_u8(row, qh + l)
                h1 = load_u8(row, qh + l + 8)
                a0 = load_u8(row, ql + l)
                a1 = load_u8(row, ql + l + 8)
                c0 = load_u8(row, ql + 32 + l)
                c1 = load_u8(row, ql + 32 + l + 8)
                s1 = fma(to_f32(ior(iand(a1, 15), ishl(iand(h1, 3), 4))), load_f32(x, xb + l + 8),
                         fmul(to_f32(ior(iand(a0, 15), ishl(iand(h0, 3), 4))), load_f32(x, xb + l)))
                s2 = fma(to_f32(ior(iand(c1, 15), ishl(iand(h1, 12), 2))), load_f32(x, xb + 32 + l + 8),
                         fmul(to_f32(ior(iand(c0, 15), ishl(iand(h0, 12), 2))), load_f32(x, xb + 32 + l)))
                s3 = fma(to_f32(ior(ishr(a1, 4), iand(h1, 48))), load_f32(x, xb + 64 + l + 8),
                         fmul(to_f32(ior(ishr(a0, 4), iand(h0, 48))), load_f32(x, xb + 64 + l)))
                s4 = fma(to_f32(ior(ishr(c1, 4), iand(ishr(h1, 2), 48))), load_f32(x, xb + 96 + l + 8),
                         fmul(to_f32(ior(ishr(c0, 4), iand(ishr(h0, 2), 48))), load_f32(x, xb + 96 + l)))
                d1 = d * _i8(row[sc + sub])
                d2 = d * _i8(row[sc + sub + 2])
                d3 = d * _i8(row[sc + sub + 4])
                d4 = d * _i8(row[sc + sub + 6])
                acc = fma(splat(d1), s1, acc)
                acc = fma(splat(d2), s2, acc)
                acc = fma(splat(d3), s3, acc)
                acc = fma(splat(d4), s4, acc)
                g = (xb + l) // XS_GROUP
                offset += d1 * xs[g] + d2 * xs[g + 2] + d3 * xs[g + 4] + d4 * xs[g + 6]
    return hsum(acc) - np.float32(32.0) * offset


@njit(inline="always")
def _dot_plain(code, row, x, f16):
    """F16 / BF16 / F32 rows, value by value (`matmul` sends F32 to BLAS; no model we run has the others)."""
    acc = np.float32(0.0)
    for k in range(x.shape[0]):
        acc += _plain_value(code, row, k, f16) * x[k]
    return acc


@njit(inline="always")
def _dot_row(code, row, x, xs, f16):
    if code == C_Q8_0:
        return _dot_q8_0(row, x, xs, f16)
    if code == C_Q5_0:
        return _dot_q5_0(row, x, xs, f16)
    if code == C_Q4_K:
        return _dot_q4_k(row, x, xs, f16)
    if code == C_Q6_K:
        return _dot_q6_k(row, x, xs, f16)
    if code == C_Q5_K:
        return _dot_q5_k(row, x, xs, f16)
    if code == C_Q5_1:
        return _dot_q5_1(row, x, xs, f16)
    if code == C_Q4_0:
        return _dot_q4_0(row, x, xs, f16)
    if code == C_Q4_1:
        return _dot_q4_1(row, x, xs, f16)
    return _dot_plain(code, row, x, f16)


@njit(inline="always")
def _partial_sums(x, xs):
    """xs[g] = sum of x[16g:16g+16] (float32, pairwise in lanes)."""
    for g in range(x.shape[0] // XS_GROUP):
        xs[g] = hsum(fadd(load_f32(x, XS_GROUP * g), load_f32(x, XS_GROUP * g + 8)))


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def gemv_blocks(codes, datas, x, outs, f16):
    """outs[i][n] = sum_k x[k] * W_i[n, k] for every weight W_i (quantized rows datas[i], format codes[i]) that
    reads the one activation vector x: each row read once, all weights in ONE parallel region, so q/k/v and
    gate/up cost a decode step one thread wake-up per group, not one per weight."""
    xs = np.empty(max(x.shape[0] // XS_GROUP, 1), np.float32)
    if x.shape[0] % XS_GROUP == 0:
        _partial_sums(x, xs)
    n_weights = len(datas)
    chunk_start = np.zeros(n_weights + 1, np.int64)  # row chunks of weight i: [chunk_start[i], chunk_start[i+1])
    for i in range(n_weights):
        chunk_start[i + 1] = chunk_start[i] + min(datas[i].shape[0], 256)
    for c in prange(chunk_start[n_weights]):
        i = 0
        while c >= chunk_start[i + 1]:
            i += 1
        data, out, code = datas[i], outs[i], codes[i]
        n_rows, n_chunks, k = data.shape[0], chunk_start[i + 1] - chunk_start[i], c - chunk_start[i]
        for n in range(k * n_rows // n_chunks, (k + 1) * n_rows // n_chunks):
            out[n] = _dot_row(code, data[n], x, xs, f16)


def _gemv(x: np.ndarray, weights: list[tuple[np.ndarray, WeightFormat]]) -> list[np.ndarray]:
    """[x @ W.T for W in weights] through gemv_blocks, token by token (x: a few tokens, f32 contiguous)."""
    datas = tuple(data for data, _ in weights)
    codes = np.array([fmt.code for _, fmt in weights], np.int64)
    outs = [np.empty((x.shape[0], data.shape[0]), np.float32) for data in datas]
    for t in range(x.shape[0]):
        gemv_blocks(codes, datas, x[t], tuple(out[t] for out in outs), F16_TABLE)
    return outs


def matmul_many(x: np.ndarray, weights: list[tuple[np.ndarray, WeightFormat]], n_in: int) -> list[np.ndarray]:
    """[x @ W.T for W in weights]; decode-sized x with quantized weights of one array type goes through one
    parallel GEMV, anything else weight by weight."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    one_call = (x.shape[0] <= TOKENS_PER_GEMV and all(fmt.qtype != T.F32 for _, fmt in weights)
                and len({(d.dtype, d.ndim, d.flags.c_contiguous, d.flags.writeable) for d, _ in weights}) == 1)
    if one_call:  # (one numba tuple type: the same array type for every weight)
        return _gemv(x, weights)
    return [matmul(x, data, fmt, n_in) for data, fmt in weights]


def matmul(x: np.ndarray, data: np.ndarray, fmt: WeightFormat, n_in: int) -> np.ndarray:
    """x f32 [n_tok, n_in] @ W.T where W is `data` (uint8 blocks [n_out, row_bytes]) -> f32 [n_tok, n_out]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_tok, n_out = x.shape[0], data.shape[0]
    if fmt.qtype == T.F32:
        return x @ data.view(np.float32).T
    if n_tok <= TOKENS_PER_GEMV:  # re-reading the rows per token beats expanding them to f32
        return _gemv(x, [(data, fmt)])[0]
    out = np.empty((n_tok, n_out), np.float32)
    tile = np.empty((min(ROW_TILE, n_out), n_in), np.float32)
    for start in range(0, n_out, ROW_TILE):
        stop = min(start + ROW_TILE, n_out)
        rows = tile[:stop - start]
        dequantize_rows(fmt.code, data, start, stop, rows, F16_TABLE)
        out[:, start:stop] = x @ rows.T  # (matmul into a strided `out=` would skip BLAS)
    return out


def dequantize_numba(data: np.ndarray, fmt: WeightFormat, n_in: int, rows: slice | None = None) -> np.ndarray:
    start, stop = (0, data.shape[0]) if rows is None else (rows.start or 0, rows.stop)
    out = np.empty((stop - start, n_in), np.float32)
    dequantize_rows(fmt.code, data, start, stop, out, F16_TABLE)
    return out


def dequantize_ids(data: np.ndarray, fmt: WeightFormat, n_in: int, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of the weight as f32 [len(ids), n_in] (embedding lookup); ids must be in range."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.empty((len(ids), n_in), np.float32)
    gather_rows(fmt.code, data, ids, out, F16_TABLE)
    return out
