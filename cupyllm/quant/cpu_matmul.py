"""CPU matmul straight from GGUF blocks (numba, multithreaded, f32 accumulation, f32 activations).

`y = x @ W.T` with W kept in its quantized blocks:
- few tokens (decode): `gemv_blocks` walks each weight row once, dequantizing block by block in registers and
  dotting it with every token, so a decode step reads the quantized bytes only;
- many tokens (prefill): `dequantize_rows` expands a tile of rows to f32 and BLAS multiplies the tile, which is
  compute-bound, so the tile's dequantization is amortised over all tokens.
The block decoders mirror `quant/weights.py` (the NumPy definitions) operation for operation.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

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
def _scale_min_k4(j, row, off):
    if j < 4:
        return np.int32(row[off + j]) & 63, np.int32(row[off + j + 4]) & 63
    sc = (np.int32(row[off + j + 4]) & 0x0F) | ((np.int32(row[off + j - 4]) >> 6) << 4)
    mn = (np.int32(row[off + j + 4]) >> 4) | ((np.int32(row[off + j]) >> 6) << 4)
    return sc, mn


@njit(inline="always")
def _dequant_block(code, row, b, out, f16):
    """Decode block `b` of one weight row into out[0:block_values]."""
    if code == C_Q8_0:
        o = b * 34
        d = _half(row, o, f16)
        for j in range(32):
            q = np.int32(row[o + 2 + j])
            out[j] = d * np.float32(q - ((q >> 7) << 8))  # uint8 -> int8
    elif code == C_Q5_0 or code == C_Q5_1:
        o = b * (22 if code == C_Q5_0 else 24)
        d = _half(row, o, f16)
        qh_off = o + 2 if code == C_Q5_0 else o + 4
        qh = (np.uint32(row[qh_off]) | (np.uint32(row[qh_off + 1]) << 8)
              | (np.uint32(row[qh_off + 2]) << 16) | (np.uint32(row[qh_off + 3]) << 24))
        qs = qh_off + 4
        if code == C_Q5_0:
            for j in range(16):
                x0 = (np.int32(row[qs + j]) & 0x0F) | np.int32(((qh >> j) << 4) & 0x10)
                x1 = (np.int32(row[qs + j]) >> 4) | np.int32((qh >> (j + 12)) & 0x10)
                out[j] = np.float32(x0 - 16) * d
                out[j + 16] = np.float32(x1 - 16) * d
        else:
            m = _half(row, o + 2, f16)
            for j in range(16):
                x0 = (np.int32(row[qs + j]) & 0x0F) | np.int32(((qh >> j) << 4) & 0x10)
                x1 = (np.int32(row[qs + j]) >> 4) | np.int32((qh >> (j + 12)) & 0x10)
                out[j] = np.float32(x0) * d + m
                out[j + 16] = np.float32(x1) * d + m
    elif code == C_Q4_0:
        o = b * 18
        d = _half(row, o, f16)
        for j in range(16):
            out[j] = np.float32((np.int32(row[o + 2 + j]) & 0x0F) - 8) * d
            out[j + 16] = np.float32((np.int32(row[o + 2 + j]) >> 4) - 8) * d
    elif code == C_Q4_1:
        o = b * 20
        d = _half(row, o, f16)
        m = _half(row, o + 2, f16)
        for j in range(16):
            out[j] = np.float32(np.int32(row[o + 4 + j]) & 0x0F) * d + m
            out[j + 16] = np.float32(np.int32(row[o + 4 + j]) >> 4) * d + m
    elif code == C_Q4_K or code == C_Q5_K:
        o = b * (144 if code == C_Q4_K else 176)
        d = _half(row, o, f16)
        dmin = _half(row, o + 2, f16)
        qs = o + (16 if code == C_Q4_K else 48)
        for pair in range(4):
            sc0, m0 = _scale_min_k4(2 * pair, row, o + 4)
            sc1, m1 = _scale_min_k4(2 * pair + 1, row, o + 4)
            d0 = d * np.float32(sc0)
            mm0 = dmin * np.float32(m0)
            d1 = d * np.float32(sc1)
            mm1 = dmin * np.float32(m1)
            base = pair * 64
            for l in range(32):
                q = np.int32(row[qs + pair * 32 + l])
                lo = q & 0x0F
                hi = q >> 4
                if code == C_Q5_K:
                    h = np.int32(row[o + 16 + l])
                    lo += ((h >> (2 * pair)) & 1) << 4
                    hi += ((h >> (2 * pair + 1)) & 1) << 4
                out[base + l] = d0 * np.float32(lo) - mm0
                out[base + 32 + l] = d1 * np.float32(hi) - mm1
    elif code == C_Q6_K:
        o = b * 210
        d = _half(row, o + 208, f16)
        for half in range(2):
            ql = o + half * 64
            qh = o + 128 + half * 32
            sc = o + 192 + half * 8
            for l in range(32):
                s = l // 16
                hbits = np.int32(row[qh + l])
                q1 = ((np.int32(row[ql + l]) & 0x0F) | (((hbits >> 0) & 3) << 4)) - 32
                q2 = ((np.int32(row[ql + l + 32]) & 0x0F) | (((hbits >> 2) & 3) << 4)) - 32
                q3 = ((np.int32(row[ql + l]) >> 4) | (((hbits >> 4) & 3) << 4)) - 32
                q4 = ((np.int32(row[ql + l + 32]) >> 4) | (((hbits >> 6) & 3) << 4)) - 32
                base = half * 128
                out[base + l] = (d * _i8(row[sc + s + 0])) * np.float32(q1)
                out[base + l + 32] = (d * _i8(row[sc + s + 2])) * np.float32(q2)
                out[base + l + 64] = (d * _i8(row[sc + s + 4])) * np.float32(q3)
                out[base + l + 96] = (d * _i8(row[sc + s + 6])) * np.float32(q4)
    elif code == C_F16:
        out[0] = _half(row, b * 2, f16)
    elif code == C_BF16:
        bits = (np.uint32(row[b * 2]) | (np.uint32(row[b * 2 + 1]) << 8)) << 16
        out[0] = _bits_to_f32(bits)
    else:  # F32
        bits = (np.uint32(row[b * 4]) | (np.uint32(row[b * 4 + 1]) << 8)
                | (np.uint32(row[b * 4 + 2]) << 16) | (np.uint32(row[b * 4 + 3]) << 24))
        out[0] = _bits_to_f32(bits)


@njit(inline="always")
def _i8(byte):
    v = np.int32(byte)
    return np.float32(v - ((v >> 7) << 8))


@njit(inline="always")
def _bits_to_f32(bits):
    one = np.empty(1, np.uint32)
    one[0] = bits
    return one.view(np.float32)[0]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def dequantize_rows(code, block_values, data, row_start, row_end, out, f16):
    """out[r - row_start, :] = row r of the weight, for r in [row_start, row_end)."""
    n_blocks = out.shape[1] // block_values
    for r in prange(row_end - row_start):
        row = data[row_start + r]
        dst = out[r]
        if block_values == 1 and code == C_F32:
            dst[:] = row.view(np.float32)
            continue
        for b in range(n_blocks):
            _dequant_block(code, row, b, dst[b * block_values:(b + 1) * block_values], f16)


# --- fused dequant-dot of one weight row with one activation vector -------------------------------
# Each adds into 32 lane accumulators `acc` (horizontal sum once per row), which LLVM turns into AVX FMAs.
# Bit fiddling stays in uint32 (numba would widen mixed signed/unsigned ints to int64 and halve the lanes),
# and each type has its own loop, free of per-value branches.

U = np.uint32


@njit(inline="always")
def _u32_at(row, off):
    return U(row[off]) | (U(row[off + 1]) << U(8)) | (U(row[off + 2]) << U(16)) | (U(row[off + 3]) << U(24))


@njit(inline="always")
def _row_q8_0(row, x, acc, f16):
    ri8 = row.view(np.int8)
    for b in range(x.shape[0] // 32):
        o = b * 34
        d = _half(row, o, f16)
        xb = b * 32
        for j in range(32):
            acc[j] += d * (np.float32(ri8[o + 2 + j]) * x[xb + j])


@njit(inline="always")
def _row_q4_0(row, x, acc, f16):
    for b in range(x.shape[0] // 32):
        o = b * 18
        d = _half(row, o, f16)
        xb = b * 32
        for j in range(16):
            q = U(row[o + 2 + j])
            acc[j] += (d * np.float32(np.int32(q & U(15)) - 8)) * x[xb + j]
            acc[j + 16] += (d * np.float32(np.int32(q >> U(4)) - 8)) * x[xb + 16 + j]


@njit(inline="always")
def _row_q4_1(row, x, acc, f16):
    for b in range(x.shape[0] // 32):
        o = b * 20
        d = _half(row, o, f16)
        m = _half(row, o + 2, f16)
        xb = b * 32
        for j in range(16):
            q = U(row[o + 4 + j])
            acc[j] += (np.float32(q & U(15)) * d + m) * x[xb + j]
            acc[j + 16] += (np.float32(q >> U(4)) * d + m) * x[xb + 16 + j]


@njit(inline="always")
def _row_q5_0(row, x, acc, f16):
    for b in range(x.shape[0] // 32):
        o = b * 22
        d = _half(row, o, f16)
        qh = _u32_at(row, o + 2)
        xb = b * 32
        for j in range(16):
            q = U(row[o + 6 + j])
            x0 = (q & U(15)) | (((qh >> U(j)) & U(1)) << U(4))
            x1 = (q >> U(4)) | (((qh >> U(j + 16)) & U(1)) << U(4))
            acc[j] += (d * np.float32(np.int32(x0) - 16)) * x[xb + j]
            acc[j + 16] += (d * np.float32(np.int32(x1) - 16)) * x[xb + 16 + j]


@njit(inline="always")
def _row_q5_1(row, x, acc, f16):
    for b in range(x.shape[0] // 32):
        o = b * 24
        d = _half(row, o, f16)
        m = _half(row, o + 2, f16)
        qh = _u32_at(row, o + 4)
        xb = b * 32
        for j in range(16):
            q = U(row[o + 8 + j])
            x0 = (q & U(15)) | (((qh >> U(j)) & U(1)) << U(4))
            x1 = (q >> U(4)) | (((qh >> U(j + 16)) & U(1)) << U(4))
            acc[j] += (np.float32(x0) * d + m) * x[xb + j]
            acc[j + 16] += (np.float32(x1) * d + m) * x[xb + 16 + j]


@njit(inline="always")
def _row_q4_k(row, x, acc, f16):
    for b in range(x.shape[0] // 256):
        o = b * 144
        d = _half(row, o, f16)
        dmin = _half(row, o + 2, f16)
        for pair in range(4):
            sc0, m0 = _scale_min_k4(2 * pair, row, o + 4)
            sc1, m1 = _scale_min_k4(2 * pair + 1, row, o + 4)
            d0 = d * np.float32(sc0)
            mm0 = dmin * np.float32(m0)
            d1 = d * np.float32(sc1)
            mm1 = dmin * np.float32(m1)
            xb = b * 256 + pair * 64
            qs = o + 16 + pair * 32
            for l in range(32):
                q = U(row[qs + l])
                acc[l] += (d0 * np.float32(q & U(15)) - mm0) * x[xb + l] + (d1 * np.float32(q >> U(4)) - mm1) * x[xb + 32 + l]


@njit(inline="always")
def _row_q5_k(row, x, acc, f16):
    for b in range(x.shape[0] // 256):
        o = b * 176
        d = _half(row, o, f16)
        dmin = _half(row, o + 2, f16)
        for pair in range(4):
            sc0, m0 = _scale_min_k4(2 * pair, row, o + 4)
            sc1, m1 = _scale_min_k4(2 * pair + 1, row, o + 4)
            d0 = d * np.float32(sc0)
            mm0 = dmin * np.float32(m0)
            d1 = d * np.float32(sc1)
            mm1 = dmin * np.float32(m1)
            xb = b * 256 + pair * 64
            qs = o + 48 + pair * 32
            lo_shift = U(2 * pair)
            for l in range(32):
                q = U(row[qs + l])
                h = U(row[o + 16 + l])
                lo = (q & U(15)) | (((h >> lo_shift) & U(1)) << U(4))
                hi = (q >> U(4)) | (((h >> (lo_shift + U(1))) & U(1)) << U(4))
                acc[l] += (d0 * np.float32(lo) - mm0) * x[xb + l] + (d1 * np.float32(hi) - mm1) * x[xb + 32 + l]


@njit(inline="always")
def _row_q6_k(row, x, acc, f16):
    for b in range(x.shape[0] // 256):
        o = b * 210
        d = _half(row, o + 208, f16)
        for half in range(2):
            ql = o + half * 64
            qh = o + 128 + half * 32
            sc = o + 192 + half * 8
            xb = b * 256 + half * 128
            for s in range(2):
                d1 = d * _i8(row[sc + s + 0])
                d2 = d * _i8(row[sc + s + 2])
                d3 = d * _i8(row[sc + s + 4])
                d4 = d * _i8(row[sc + s + 6])
                for i in range(16):
                    l = s * 16 + i
                    hb = U(row[qh + l])
                    lo = U(row[ql + l])
                    hi = U(row[ql + l + 32])
                    q1 = np.int32((lo & U(15)) | ((hb & U(3)) << U(4))) - 32
                    q2 = np.int32((hi & U(15)) | (((hb >> U(2)) & U(3)) << U(4))) - 32
                    q3 = np.int32((lo >> U(4)) | (((hb >> U(4)) & U(3)) << U(4))) - 32
                    q4 = np.int32((hi >> U(4)) | ((hb >> U(6)) << U(4))) - 32
                    acc[l] += ((d1 * np.float32(q1)) * x[xb + l] + (d2 * np.float32(q2)) * x[xb + l + 32]
                               + (d3 * np.float32(q3)) * x[xb + l + 64] + (d4 * np.float32(q4)) * x[xb + l + 96])


@njit(inline="always")
def _row_generic(code, row, x, acc, f16, buf):
    """Types without a fused loop (F16, BF16): decode value by value."""
    for k in range(x.shape[0]):
        _dequant_block(code, row, k, buf, f16)
        acc[k % 32] += buf[0] * x[k]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def gemv_blocks(code, data, x, out, f16):
    """out[n] = sum_k x[k] * W[n, k]: one activation vector against quantized rows, read once."""
    n_rows = data.shape[0]
    n_chunks = min(n_rows, 256)
    for c in prange(n_chunks):
        acc = np.empty(32, np.float32)
        buf = np.empty(256, np.float32)
        for n in range(c * n_rows // n_chunks, (c + 1) * n_rows // n_chunks):
            row = data[n]
            acc[:] = 0.0
            if code == C_Q8_0:
                _row_q8_0(row, x, acc, f16)
            elif code == C_Q5_0:
                _row_q5_0(row, x, acc, f16)
            elif code == C_Q5_1:
                _row_q5_1(row, x, acc, f16)
            elif code == C_Q4_K:
                _row_q4_k(row, x, acc, f16)
            elif code == C_Q5_K:
                _row_q5_k(row, x, acc, f16)
            elif code == C_Q6_K:
                _row_q6_k(row, x, acc, f16)
            elif code == C_Q4_0:
                _row_q4_0(row, x, acc, f16)
            elif code == C_Q4_1:
                _row_q4_1(row, x, acc, f16)
            else:
                _row_generic(code, row, x, acc, f16, buf)
            out[n] = acc.sum()


def matmul(x: np.ndarray, data: np.ndarray, fmt: WeightFormat, n_in: int) -> np.ndarray:
    """x f32 [n_tok, n_in] @ W.T where W is `data` (uint8 blocks [n_out, row_bytes]) -> f32 [n_tok, n_out]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_tok, n_out = x.shape[0], data.shape[0]
    out = np.empty((n_tok, n_out), np.float32)
    if fmt.qtype == T.F32:
        return x @ data.view(np.float32).T
    if n_tok <= TOKENS_PER_GEMV:  # re-reading the rows per token beats expanding them to f32
        for t in range(n_tok):
            gemv_blocks(fmt.code, data, x[t], out[t], F16_TABLE)
        return out
    tile = np.empty((min(ROW_TILE, n_out), n_in), np.float32)
    for start in range(0, n_out, ROW_TILE):
        stop = min(start + ROW_TILE, n_out)
        rows = tile[:stop - start]
        dequantize_rows(fmt.code, fmt.block_values, data, start, stop, rows, F16_TABLE)
        out[:, start:stop] = x @ rows.T  # (matmul into a strided `out=` would skip BLAS)
    return out


def dequantize_numba(data: np.ndarray, fmt: WeightFormat, n_in: int, rows: slice | None = None) -> np.ndarray:
    start, stop = (0, data.shape[0]) if rows is None else (rows.start or 0, rows.stop)
    out = np.empty((stop - start, n_in), np.float32)
    dequantize_rows(fmt.code, fmt.block_values, data, start, stop, out, F16_TABLE)
    return out
