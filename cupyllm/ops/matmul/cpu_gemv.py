"""CPU block kernels for GGUF weights (numba, multithreaded, f32 accumulation): the decode GEMV and the row
dequantization (`ops/matmul/cpu.py` picks between them and the prefill GEMM of `ops/matmul/cpu_gemm.py`).

- `gemv_blocks` (few tokens, decode) walks each weight row once, unpacking block by block in registers and
  multiplying the weight's integer codes with x rounded to 16-bit codes per 32 values (x_hat,
  `ops/matmul/activation_codes.py`; 16 products an instruction), so a decode step reads the quantized bytes with few
  instructions per value (llama.cpp does the same with 8-bit codes, 256 times coarser); several tokens (a batched
  decode, a verify run of drafts) go four at a time, each block unpacked once for them; where the
  machine has AVX-512 VNNI the K-quants multiply the codes' two bytes with vpdpbusd (64 products an instruction
  pair, `_k_step_bytes`): a pair of sub-blocks then costs one float conversion and one FMA, not two;
- `dequantize_rows` / `gather_rows` expand rows to f32 (embedding lookups; float-weight tiles for BLAS).
Both are written with the explicit vectors of `ops/simd.py`. The row decoders reproduce the NumPy
definitions of `ops/matmul/reference.py` bit for bit, the activation codes those of `ops/matmul/activation_codes.py`; the
products are summed in another order than a float64 reference would.
"""
from __future__ import annotations

import numpy as np
import numba
from numba import njit, prange

from .activation_codes import ACTIVATION_BLOCK, ACTIVATION_LEVELS, SMALLEST_SCALE
from ..simd import (MACHINE_HAS_512_BIT_LANES, MACHINE_HAS_VNNI, bit_lanes, bit_words, bit_words_32, dpbusd,
                    f32_from_bits, fabs, fadd, fifth_bits_64, fma, fmax, fmin, fmul, fround, fsub, halves, hmax, hsum,
                    iand, ior, ishl, ishr, isub, izeros, izeros_16, join_32, lane_pair_splat_16, lane_splat,
                    lane_splat_16, load_bytes_64, load_f32, load_i8, load_i8w, load_i8w_32, load_i16, load_i16_32,
                    load_nibbles_64, load_u8, load_u8w, load_u8w_32, madd, pair_lanes, prefetch, splat, splat_16,
                    store_f32, store_i16, to_f32, zeros, zeros_16)
from .cpu_interleaved import ROWS as X16_ROWS, X16_CODES, interleaved_gemv
from .reference import WEIGHT_FORMATS, WeightFormat
from gguf import GGMLQuantizationType as T

# fp16 -> f32 by table: a 256 KiB array that stays in L2, cheaper than bit twiddling per scale
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_C = {qtype: fmt.code for qtype, fmt in WEIGHT_FORMATS.items()}
C_F32, C_F16, C_BF16, C_Q8_0 = _C[T.F32], _C[T.F16], _C[T.BF16], _C[T.Q8_0]
C_Q4_0, C_Q4_1, C_Q5_0, C_Q5_1 = _C[T.Q4_0], _C[T.Q4_1], _C[T.Q5_0], _C[T.Q5_1]
C_Q4_K, C_Q5_K, C_Q6_K = _C[T.Q4_K], _C[T.Q5_K], _C[T.Q6_K]

# The GEMV asks for the bytes this far ahead of the block it multiplies (its row's later blocks, then the next
# row's): a row streams from DRAM with its compute between the loads, and the hardware prefetcher alone keeps too
# few lines in flight. bench/cpu_matmul.py (gemv_from_dram) measures it against none; in a sweep
# 2 KiB gained about half of what 4 KiB did, 1 KiB and less nothing (docs/benchmarks.md).
PREFETCH_BYTES = 4096
# The GEMV cuts a call's rows (all its weights' together) into this many equal shares unless told how many:
# gemv_many and gemv_each pass the thread count, so that numba's parallel loop, which gives each thread an equal
# run of iterations, gives each one share (an equal number of rows) and one call of the row loop per weight.
ROW_SHARES = 64


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
def _k_scale_mins(row, o):
    """The 6-bit (sc, m) pairs of the 8 sub-blocks of the Q4_K / Q5_K super-block at row[o], as int32 lanes
    j = 0..7, from its 12 scale bytes at row[o + 4] (llama.cpp's get_scale_min_k4, eight at once): j < 4: the
    low 6 bits of bytes j and j + 4; j >= 4: the nibbles of byte j + 4 under the top bits of bytes j - 4 and j."""
    a = load_u8(row, o + 4)  # lane j: scale byte j
    b = load_u8(row, o + 8)  # lane j: scale byte j + 4
    c = load_u8(row, o)  # lane j >= 4: scale byte j - 4
    sc = halves(iand(a, 63), ior(iand(b, 15), ishl(ishr(c, 6), 4)))
    m = halves(iand(b, 63), ior(ishr(b, 4), ishl(ishr(a, 6), 4)))
    return sc, m


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
    """dst[i:i+8] = d_sub * float(q) - m_sub (K-quant sub-block; d_sub, m_sub: the value in every lane)"""
    store_f32(dst, i, fsub(fmul(d_sub, to_f32(q)), m_sub))


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
            sc, m = _k_scale_mins(row, o)
            scales = fmul(splat(_half(row, o, f16)), to_f32(sc))  # d * sc_j, dmin * m_j as in the reference
            mins = fmul(splat(_half(row, o + 2, f16)), to_f32(m))
            for pair in range(4):
                base = b * 256 + pair * 64
                for g in range(4):
                    q = load_u8(row, o + qs0 + pair * 32 + 8 * g)
                    lo = iand(q, 15)
                    hi = ishr(q, 4)
                    if code == C_Q5_K:
                        h = load_u8(row, o + 16 + 8 * g)
                        lo = ior(lo, ishl(iand(ishr(h, 2 * pair), 1), 4))
                        hi = ior(hi, ishl(iand(ishr(h, 2 * pair + 1), 1), 4))
                    _store_k(dst, base + 8 * g, lo, lane_splat(scales, 2 * pair), lane_splat(mins, 2 * pair))
                    _store_k(dst, base + 32 + 8 * g, hi, lane_splat(scales, 2 * pair + 1),
                             lane_splat(mins, 2 * pair + 1))
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


# --- fused dequant-dot of one weight row with one activation row of 16-bit codes ---------------------
# The activation arrives as int16 codes `xq` with a float32 scale `xd` per 32 values and `xsum`, the sum of
# x_hat over those 32 (ops/matmul/activation_codes.py). A weight block's integer codes are unpacked into int16 lanes and
# multiplied with the codes by `madd` (16 products, pairs summed into int32 lanes, exact); the weight's block
# scale times the activation's is applied once per 32 values (16 for Q6_K) to the lanes converted to float32.
# Constant offsets (Q4_0's -8, Q5_0's -16, Q6_K's -32) are taken off the codes in the lanes; the K-quant mins
# and Q4_1 / Q5_1's m multiply `xsum`. So every result is sum_k W[n, k] * x_hat[k] up to float32 summation
# order: exactly the dequantized weight times the rounded activation.


@njit(inline="always")
def _prefetch_ahead(row, o, block_bytes):
    """Prefetch the cache lines of row[o:o + block_bytes], o = a block's offset + `ahead` (one line for blocks
    shorter than a line: consecutive blocks then name every line). ahead = 0 names the block itself, already
    read: no prefetch, in effect (bench/cpu_matmul.py compares the two)."""
    for line in range(0, block_bytes, 64):
        prefetch(row, o + line)


@njit(inline="always")
def _codes16(xq, k):
    """The activation codes k .. k+15."""
    return load_i16(xq, k)


@njit(inline="always")
def _block_step(lo, hi, d, xq, xd, b, acc):
    """acc + (the 32-value block b's codes lo | hi . the activation codes) * (d * xd[b]): one token's share of
    a block of a 32-value format, the codes unpacked once for every token (_dot_*_4)."""
    s = madd(madd(izeros(), lo, _codes16(xq, 32 * b)), hi, _codes16(xq, 32 * b + 16))
    return fma(to_f32(s), splat(d * xd[b]), acc)


@njit(inline="always")
def _dot_q8_0(row, xq, xd, xsum, f16, ahead):
    acc, acc_next = zeros(), zeros()  # (two chains: the next block's FMA need not wait for this one's)
    for b in range(xq.shape[0] // 32):
        o = b * 34
        _prefetch_ahead(row, o + ahead, 34)
        acc, acc_next = acc_next, _block_step(load_i8w(row, o + 2), load_i8w(row, o + 18), _half(row, o, f16),
                                              xq, xd, b, acc)
    return hsum(fadd(acc, acc_next))


# --- a block's weight codes as int16 lanes: what the GEMV multiplies here and the GEMM (cpu_gemm.py) stores ----

@njit(inline="always")
def _codes32(row, qs, h, offset):
    """The 32 codes of a Q4_0 / Q4_1 / Q5_0 / Q5_1 block as int16 lanes (values 0..15, values 16..31): the nibbles
    at row[qs] (low, then high), the 5th bits from the u32 `h` (0 for the 4-bit formats), less `offset`."""
    v = load_u8w(row, qs)
    return isub(ior(iand(v, 15), bit_words(h, 0, 16)), offset), isub(ior(ishr(v, 4), bit_words(h, 16, 16)), offset)


@njit(inline="always")
def _k_codes(row, o, pair, five_bit):
    """Sub-blocks 2*pair (lanes lo0 | lo1) and 2*pair + 1 (hi0 | hi1) of the Q4_K / Q5_K (five_bit) super-block
    at row[o]: 32 bytes whose low nibbles are the first sub-block, high nibbles the second; Q5_K's 5th bits are
    bits 2*pair and 2*pair + 1 of its qh bytes."""
    if not five_bit:
        q0 = load_u8w(row, o + 16 + pair * 32)
        q1 = load_u8w(row, o + 32 + pair * 32)
        return iand(q0, 15), iand(q1, 15), ishr(q0, 4), ishr(q1, 4)
    h0 = load_u8w(row, o + 16)
    h1 = load_u8w(row, o + 32)
    q0 = load_u8w(row, o + 48 + pair * 32)
    q1 = load_u8w(row, o + 64 + pair * 32)
    return (ior(iand(q0, 15), ishl(iand(ishr(h0, 2 * pair), 1), 4)),
            ior(iand(q1, 15), ishl(iand(ishr(h1, 2 * pair), 1), 4)),
            ior(ishr(q0, 4), ishl(iand(ishr(h0, 2 * pair + 1), 1), 4)),
            ior(ishr(q1, 4), ishl(iand(ishr(h1, 2 * pair + 1), 1), 4)))


@njit(inline="always")
def _q6_codes(row, ql, qh, l):
    """Q6_K codes less 32 at positions l, 32 + l, 64 + l, 96 + l (16 each) of the 128-value half whose low bits
    start at row[ql] and high bits at row[qh]."""
    return _q6_from_bits(load_u8w(row, ql + l), load_u8w(row, ql + 32 + l), load_u8w(row, qh + l))


@njit(inline="always")
def _q6_from_bits(a, c, h):
    """Q6_K's four code vectors (less 32) from its low-bit bytes a = ql[l], c = ql[32 + l] and high-bit bytes
    h = qh[l] (int16 lanes of either width)."""
    return (isub(ior(iand(a, 15), ishl(iand(h, 3), 4)), 32), isub(ior(iand(c, 15), ishl(iand(h, 12), 2)), 32),
            isub(ior(ishr(a, 4), iand(h, 48)), 32), isub(ior(ishr(c, 4), iand(ishr(h, 2), 48)), 32))


@njit(inline="always")
def _q6_scales(row, o, d, xd, half, xb):
    """Lane sub + 2i: (d * sc[sub + 2i]) * xd of the half's 32-value block i (xd is padded for the read)."""
    return fmul(fmul(splat(d), to_f32(load_i8(row, o + 192 + half * 8))), pair_lanes(load_f32(xd, xb // 32)))


@njit(inline="always")
def _small_layout(affine, five_bit):
    """(block bytes, offset of the nibbles, code offset) of Q4_0 / Q4_1 / Q5_0 / Q5_1."""
    if five_bit:
        return (24, 8, 0) if affine else (22, 6, 16)
    return (20, 4, 0) if affine else (18, 2, 8)


@njit(inline="always")
def _dot_small(row, xq, xd, xsum, f16, ahead, affine, five_bit):
    """Q4_0, Q4_1 (affine), Q5_0 (five_bit) or Q5_1 (both): 32 values a block, d first; an affine block's m
    (the half after d) multiplies xsum; a five-bit block's 5th bits are the u32 before its nibbles."""
    block_bytes, qs, offset = _small_layout(affine, five_bit)
    acc, acc_next = zeros(), zeros()  # (two chains: the next block's FMA need not wait for this one's)
    mins, mins_next = np.float32(0.0), np.float32(0.0)
    for b in range(xq.shape[0] // 32):
        o = b * block_bytes
        _prefetch_ahead(row, o + ahead, block_bytes)
        lo, hi = _codes32(row, o + qs, _u32_at(row, o + qs - 4) if five_bit else np.uint32(0), offset)
        acc, acc_next = acc_next, _block_step(lo, hi, _half(row, o, f16), xq, xd, b, acc)
        if affine:
            mins, mins_next = mins_next, mins + _half(row, o + 2, f16) * xsum[b]
    return hsum(fadd(acc, acc_next)) + (mins + mins_next)


@njit(inline="always")
def _k_scales(sc, m, d, dmin, xd, xsum, k):
    """A Q4_K / Q5_K super-block's 8 sub-block scales times their activation scales, (d * sc_j) * xd[k + j], and
    its mins terms (dmin * m_j) * xsum[k + j], as lanes j (sc, m: _k_scale_mins of the block)."""
    scales = fmul(fmul(splat(d), to_f32(sc)), load_f32(xd, k))
    return scales, fmul(fmul(splat(dmin), to_f32(m)), load_f32(xsum, k))


@njit(inline="always")
def _k_step(lo0, lo1, hi0, hi1, xq, k, scales, pair, acc_lo, acc_hi):
    """acc_lo + sub-block k's integer sum (codes lo0 | lo1) times scale lane 2*pair, acc_hi + sub-block k + 1's
    (hi0 | hi1) times lane 2*pair + 1: one token's share of a K-quant pair of sub-blocks."""
    lo = madd(madd(izeros(), lo0, _codes16(xq, 32 * k)), lo1, _codes16(xq, 32 * k + 16))
    hi = madd(madd(izeros(), hi0, _codes16(xq, 32 * k + 32)), hi1, _codes16(xq, 32 * k + 48))
    return (fma(to_f32(lo), lane_splat(scales, 2 * pair), acc_lo),
            fma(to_f32(hi), lane_splat(scales, 2 * pair + 1), acc_hi))


@njit(inline="always")
def _dot_k(row, xq, xd, xsum, f16, ahead, five_bit):
    """Q4_K, or Q5_K (five_bit)."""
    acc_lo, acc_hi, next_lo, next_hi = zeros(), zeros(), zeros(), zeros()  # (four FMA chains, not one)
    mins = zeros()
    size = 176 if five_bit else 144
    for b in range(xq.shape[0] // 256):
        o = b * size
        _prefetch_ahead(row, o + ahead, size)
        sc, m = _k_scale_mins(row, o)
        scales, block_mins = _k_scales(sc, m, _half(row, o, f16), _half(row, o + 2, f16), xd, xsum, b * 8)
        mins = fadd(mins, block_mins)
        for pair in range(4):
            lo0, lo1, hi0, hi1 = _k_codes(row, o, pair, five_bit)
            acc_lo, acc_hi, (next_lo, next_hi) = next_lo, next_hi, _k_step(lo0, lo1, hi0, hi1, xq, b * 8 + 2 * pair,
                                                                           scales, pair, acc_lo, acc_hi)
    return _k_sum(acc_lo, acc_hi, next_lo, next_hi, mins)


@njit(inline="always")
def _k_codes_wide(row, o, pair, five_bit):
    """_k_codes in two registers: sub-block 2*pair's 32 codes, then sub-block 2*pair + 1's (int16 x 32)."""
    q = load_u8w_32(row, o + (48 if five_bit else 16) + pair * 32)
    if not five_bit:
        return iand(q, 15), ishr(q, 4)
    h = load_u8w_32(row, o + 16)
    return (ior(iand(q, 15), ishl(iand(ishr(h, 2 * pair), 1), 4)),
            ior(ishr(q, 4), ishl(iand(ishr(h, 2 * pair + 1), 1), 4)))


@njit(inline="always")
def _k_step_wide(lo_codes, hi_codes, xq, k, scales, pair, acc_lo, acc_hi):
    """_k_step in 512-bit registers: the pair's two sub-blocks from activation code k on."""
    lo = madd(izeros_16(), lo_codes, load_i16_32(xq, k))
    hi = madd(izeros_16(), hi_codes, load_i16_32(xq, k + 32))
    return (fma(to_f32(lo), lane_splat_16(scales, 2 * pair), acc_lo),
            fma(to_f32(hi), lane_splat_16(scales, 2 * pair + 1), acc_hi))


@njit(inline="always")
def _k_codes_bytes(row, o, pair, five_bit):
    """_k_codes as 64 byte lanes: sub-block 2*pair's 32 codes, then sub-block 2*pair + 1's (VNNI)."""
    if not five_bit:
        return load_nibbles_64(row, o + 16 + pair * 32)
    return ior(load_nibbles_64(row, o + 48 + pair * 32), fifth_bits_64(row, o + 16, 2 * pair))


@njit(inline="always")
def _k_step_bytes(codes, xb, k, scales, pair, acc):
    """acc + one token's share of a K-quant pair of sub-blocks (codes: _k_codes_bytes) with vpdpbusd: each
    16-bit activation code is its high byte times 256 plus its low byte (xb: split_activation_bytes), so the
    pair's 64 products land four to an int32 lane, lanes 0-7 the first sub-block's, 8-15 the second's, and
    one conversion and one FMA (scale lanes 2*pair, 2*pair + 1) take both sub-blocks."""
    high = ishl(dpbusd(izeros_16(), codes, load_bytes_64(xb, 2 * k + 64)), 8)  # (codes unsigned, bytes signed)
    sums = dpbusd(high, load_bytes_64(xb, 2 * k), codes)  # (low bytes unsigned, codes < 32 as signed bytes)
    return fma(to_f32(sums), lane_pair_splat_16(scales, 2 * pair), acc)


@njit(inline="always")
def _k_pair_codes_wide(row, o, pair, five_bit):
    """A pair of sub-blocks' codes for the wide kernels: 64 byte lanes for vpdpbusd where the machine has VNNI
    (_k_codes_bytes), else sub-block 2*pair's and 2*pair + 1's int16 registers (_k_codes_wide)."""
    if MACHINE_HAS_VNNI:
        return _k_codes_bytes(row, o, pair, five_bit)
    return _k_codes_wide(row, o, pair, five_bit)


@njit(inline="always")
def _k_token_wide(codes, x, k, scales, pair, al, ah, nl, nh):
    """One token's (x: its (xq, xd, xsum, xb)) update of its four FMA chains by a pair of sub-blocks, activation
    code k on: with VNNI one step of both sub-blocks (ah and nh stay zero), else one a sub-block."""
    if MACHINE_HAS_VNNI:
        return nl, nh, _k_step_bytes(codes, x[3], k, scales, pair, al), ah
    step_lo, step_hi = _k_step_wide(codes[0], codes[1], x[0], k, scales, pair, al, ah)
    return nl, nh, step_lo, step_hi


@njit(inline="always")
def _dot_k_wide(row, xq, xd, xsum, xb, f16, ahead, five_bit):
    """_dot_k in 512-bit registers (MACHINE_HAS_512_BIT_LANES): with VNNI through vpdpbusd, half the float
    conversions and FMAs (two sub-blocks share a register), else a sub-block's 32 products in one madd; the
    same integer products either way, the float sums in another order."""
    al, ah, nl, nh = zeros_16(), zeros_16(), zeros_16(), zeros_16()  # (four FMA chains, or two)
    mins = zeros()
    size = 176 if five_bit else 144
    for b in range(xq.shape[0] // 256):
        o = b * size
        _prefetch_ahead(row, o + ahead, size)
        sc, m = _k_scale_mins(row, o)
        scales, block_mins = _k_scales(sc, m, _half(row, o, f16), _half(row, o + 2, f16), xd, xsum, b * 8)
        mins = fadd(mins, block_mins)
        for pair in range(4):
            al, ah, nl, nh = _k_token_wide(_k_pair_codes_wide(row, o, pair, five_bit), (xq, xd, xsum, xb),
                                           b * 256 + pair * 64, scales, pair, al, ah, nl, nh)
    return _k_sum(al, ah, nl, nh, mins)


@njit(inline="always")
def _q6_part(v, xq, k, scale, acc):
    """acc + v . codes k .. k+15, times the lanes `scale` (one Q6_K scale covers 16 values)."""
    return fma(to_f32(madd(izeros(), v, _codes16(xq, k))), scale, acc)


@njit(inline="always")
def _q6_step(v0, v1, v2, v3, xq, xb, scales, sub, acc0, acc1, acc2, acc3):
    """One token's share of lanes l = 16*sub .. 16*sub+15 of the four 32-value groups of a Q6_K half (codes
    v0..v3 from _q6_codes, activation codes from xb on)."""
    l = 16 * sub
    return (_q6_part(v0, xq, xb + l, lane_splat(scales, sub), acc0),
            _q6_part(v1, xq, xb + 32 + l, lane_splat(scales, sub + 2), acc1),
            _q6_part(v2, xq, xb + 64 + l, lane_splat(scales, sub + 4), acc2),
            _q6_part(v3, xq, xb + 96 + l, lane_splat(scales, sub + 6), acc3))


@njit(inline="always")
def _dot_q6_k(row, xq, xd, xsum, f16, ahead):
    acc0, acc1, acc2, acc3 = zeros(), zeros(), zeros(), zeros()  # (four FMA chains, not one)
    for b in range(xq.shape[0] // 256):
        o = b * 210
        _prefetch_ahead(row, o + ahead, 210)
        d = _half(row, o + 208, f16)
        for half in range(2):
            ql = o + half * 64
            qh = o + 128 + half * 32
            xb = b * 256 + half * 128
            scales = _q6_scales(row, o, d, xd, half, xb)
            for sub in range(2):  # lanes l = 16*sub .. 16*sub+15 of each of the four 32-value groups share a scale
                v0, v1, v2, v3 = _q6_codes(row, ql, qh, 16 * sub)
                acc0, acc1, acc2, acc3 = _q6_step(v0, v1, v2, v3, xq, xb, scales, sub, acc0, acc1, acc2, acc3)
    return hsum(fadd(fadd(acc0, acc1), fadd(acc2, acc3)))


# --- the same dot products in 512-bit registers (MACHINE_HAS_512_BIT_LANES): 32 products a madd, not 16 ----------
# Each lane's integer sum is one of the narrow kernel's (a pair of products, or the narrow lane's two pairs), times
# the same float scale; only the order in which the float lanes are summed differs.

@njit(inline="always")
def _block_step_wide(codes, d, xq, xd, b, acc):
    """_block_step with the block's 32 codes in one register."""
    return fma(to_f32(madd(izeros_16(), codes, load_i16_32(xq, 32 * b))), splat_16(d * xd[b]), acc)


@njit(inline="always")
def _dot_q8_0_wide(row, xq, xd, xsum, f16, ahead):
    acc, acc_next = zeros_16(), zeros_16()  # (two chains: the next block's FMA need not wait for this one's)
    for b in range(xq.shape[0] // 32):
        o = b * 34
        _prefetch_ahead(row, o + ahead, 34)
        acc, acc_next = acc_next, _block_step_wide(load_i8w_32(row, o + 2), _half(row, o, f16), xq, xd, b, acc)
    return hsum(fadd(acc, acc_next))


@njit(inline="always")
def _q5_codes_wide(row, qs, h, offset):
    """_codes32 of a Q5_0 / Q5_1 block in one register: its 32 codes in order (the low nibbles, then the high
    ones, each with its 5th bit from h), less `offset`. (The 5th bits as one 32-bit mask, bit_words_32: the wide
    Q5_0 row measured x1.24-1.39 the narrow one, where testing each lane's bit gave x1.05-1.11.)"""
    v = load_u8w(row, qs)
    return isub(ior(join_32(iand(v, 15), ishr(v, 4)), bit_words_32(h, 16)), offset)


@njit(inline="always")
def _dot_q5_wide(row, xq, xd, xsum, f16, ahead, affine):
    """Q5_0, or Q5_1 (`affine`: its m, the half after d, times xsum). (Q4_0 / Q4_1 stay narrow: measured no
    faster wide, bench/cpu_matmul.py; their blocks cost more in scales than in products.)"""
    block_bytes, qs, offset = _small_layout(affine, True)
    acc, acc_next = zeros_16(), zeros_16()  # (two chains: the next block's FMA need not wait for this one's)
    mins, mins_next = np.float32(0.0), np.float32(0.0)
    for b in range(xq.shape[0] // 32):
        o = b * block_bytes
        _prefetch_ahead(row, o + ahead, block_bytes)
        codes = _q5_codes_wide(row, o + qs, _u32_at(row, o + qs - 4), offset)
        acc, acc_next = acc_next, _block_step_wide(codes, _half(row, o, f16), xq, xd, b, acc)
        if affine:
            mins, mins_next = mins_next, mins + _half(row, o + 2, f16) * xsum[b]
    return hsum(fadd(acc, acc_next)) + (mins + mins_next)


@njit(inline="always")
def _q6_codes_wide(row, ql, qh):
    """_q6_codes for all 32 positions l at once: codes less 32 of values 0-31, 32-63, 64-95, 96-127 of the half."""
    return _q6_from_bits(load_u8w_32(row, ql), load_u8w_32(row, ql + 32), load_u8w_32(row, qh))


@njit(inline="always")
def _q6_part_wide(v, xq, k, scales, group, acc):
    """acc + v . codes k .. k+31, lanes 0-7 times scale lane 2*group, lanes 8-15 times lane 2*group + 1."""
    return fma(to_f32(madd(izeros_16(), v, load_i16_32(xq, k))), lane_pair_splat_16(scales, 2 * group), acc)


@njit(inline="always")
def _q6_step_wide(v0, v1, v2, v3, xq, xb, scales, acc0, acc1, acc2, acc3):
    """_q6_step for all 32 positions of each group at once."""
    return (_q6_part_wide(v0, xq, xb, scales, 0, acc0), _q6_part_wide(v1, xq, xb + 32, scales, 1, acc1),
            _q6_part_wide(v2, xq, xb + 64, scales, 2, acc2), _q6_part_wide(v3, xq, xb + 96, scales, 3, acc3))


@njit(inline="always")
def _dot_q6_k_wide(row, xq, xd, xsum, f16, ahead):
    acc0, acc1, acc2, acc3 = zeros_16(), zeros_16(), zeros_16(), zeros_16()  # (four FMA chains, not one)
    for b in range(xq.shape[0] // 256):
        o = b * 210
        _prefetch_ahead(row, o + ahead, 210)
        d = _half(row, o + 208, f16)
        for half in range(2):
            ql = o + half * 64
            xb = b * 256 + half * 128
            scales = _q6_scales(row, o, d, xd, half, xb)
            v0, v1, v2, v3 = _q6_codes_wide(row, ql, o + 128 + half * 32)
            acc0, acc1, acc2, acc3 = _q6_step_wide(v0, v1, v2, v3, xq, xb, scales, acc0, acc1, acc2, acc3)
    return hsum(fadd(fadd(acc0, acc1), fadd(acc2, acc3)))


# --- four tokens at once: each block's codes and scale bytes unpacked once, then every token's share -----------
# A decode step of several sequences, or a verify run of drafts, multiplies each row by several tokens. On few
# cores that is compute-bound, and the unpacking is much of a block's work: these kernels do it once for four
# tokens, keeping each token's accumulators in registers. Each token's values are the one-token kernel's bit for
# bit: the same step functions, the same FMA chains in the same order. x0..x3: each token's (xq, xd, xsum, xb);
# fewer tokens repeat some (gemv_blocks runs two as four: one kernel compiled, not two).

@njit(inline="always")
def _dot_small_4(row, x0, x1, x2, x3, f16, ahead, code):
    """Q8_0, Q4_0 or Q5_0 (code): 32 values a block, d first, the codes unpacked once for the tokens."""
    q0, d0 = x0[0], x0[1]
    q1, d1 = x1[0], x1[1]
    block_bytes, qs, offset = (34, 2, 0) if code == C_Q8_0 else _small_layout(False, code == C_Q5_0)
    a0, n0, a1, n1, a2, n2, a3, n3 = zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), zeros()
    for b in range(q0.shape[0] // 32):
        o = b * block_bytes
        _prefetch_ahead(row, o + ahead, block_bytes)
        if code == C_Q8_0:
            lo, hi = load_i8w(row, o + 2), load_i8w(row, o + 18)
        else:
            lo, hi = _codes32(row, o + qs, _u32_at(row, o + qs - 4) if code == C_Q5_0 else np.uint32(0), offset)
        d = _half(row, o, f16)
        a0, n0 = n0, _block_step(lo, hi, d, q0, d0, b, a0)
        a1, n1 = n1, _block_step(lo, hi, d, q1, d1, b, a1)
        a2, n2 = n2, _block_step(lo, hi, d, x2[0], x2[1], b, a2)
        a3, n3 = n3, _block_step(lo, hi, d, x3[0], x3[1], b, a3)
    return (hsum(fadd(a0, n0)), hsum(fadd(a1, n1)), hsum(fadd(a2, n2)), hsum(fadd(a3, n3)))


@njit(inline="always")
def _k_sum(acc_lo, acc_hi, next_lo, next_hi, mins):
    """A K-quant row's dot product from its four FMA chains and its mins terms."""
    return hsum(fadd(fadd(acc_lo, acc_hi), fadd(next_lo, next_hi))) - hsum(mins)


@njit(inline="always")
def _k_token_scales_4(row, o, f16, b, x0, x1, x2, x3, mins0, mins1, mins2, mins3):
    """Super-block b's (at row[o]) scales for each token, lanes j: (d * sc_j) * xd[8b + j], and each token's
    mins terms added to its running sum: (sc0..sc3, mins0..mins3)."""
    sc, m = _k_scale_mins(row, o)
    d, dmin, k = _half(row, o, f16), _half(row, o + 2, f16), b * 8
    sc0, bm0 = _k_scales(sc, m, d, dmin, x0[1], x0[2], k)
    sc1, bm1 = _k_scales(sc, m, d, dmin, x1[1], x1[2], k)
    mins0, mins1 = fadd(mins0, bm0), fadd(mins1, bm1)
    sc2, bm2 = _k_scales(sc, m, d, dmin, x2[1], x2[2], k)
    sc3, bm3 = _k_scales(sc, m, d, dmin, x3[1], x3[2], k)
    mins2, mins3 = fadd(mins2, bm2), fadd(mins3, bm3)
    return sc0, sc1, sc2, sc3, mins0, mins1, mins2, mins3


@njit(inline="always")
def _k_token_4(lo0, lo1, hi0, hi1, q, k, scales, pair, al, ah, nl, nh):
    """_dot_k's update of one token's four chains by one pair of sub-blocks."""
    step_lo, step_hi = _k_step(lo0, lo1, hi0, hi1, q, k, scales, pair, al, ah)
    return nl, nh, step_lo, step_hi


@njit(inline="always")
def _dot_k_4(row, x0, x1, x2, x3, f16, ahead, five_bit):
    q0, q1 = x0[0], x1[0]
    al0, ah0, nl0, nh0, al1, ah1, nl1, nh1 = zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), zeros()
    al2, ah2, nl2, nh2, al3, ah3, nl3, nh3 = zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), zeros()
    mins0, mins1, mins2, mins3 = zeros(), zeros(), zeros(), zeros()
    size = 176 if five_bit else 144
    for b in range(q0.shape[0] // 256):
        o = b * size
        _prefetch_ahead(row, o + ahead, size)
        sc0, sc1, sc2, sc3, mins0, mins1, mins2, mins3 = _k_token_scales_4(row, o, f16, b, x0, x1, x2, x3, mins0,
                                                                           mins1, mins2, mins3)
        for pair in range(4):
            lo0, lo1, hi0, hi1 = _k_codes(row, o, pair, five_bit)
            k = b * 8 + 2 * pair
            al0, ah0, nl0, nh0 = _k_token_4(lo0, lo1, hi0, hi1, q0, k, sc0, pair, al0, ah0, nl0, nh0)
            al1, ah1, nl1, nh1 = _k_token_4(lo0, lo1, hi0, hi1, q1, k, sc1, pair, al1, ah1, nl1, nh1)
            al2, ah2, nl2, nh2 = _k_token_4(lo0, lo1, hi0, hi1, x2[0], k, sc2, pair, al2, ah2, nl2, nh2)
            al3, ah3, nl3, nh3 = _k_token_4(lo0, lo1, hi0, hi1, x3[0], k, sc3, pair, al3, ah3, nl3, nh3)
    return (_k_sum(al0, ah0, nl0, nh0, mins0), _k_sum(al1, ah1, nl1, nh1, mins1),
            _k_sum(al2, ah2, nl2, nh2, mins2), _k_sum(al3, ah3, nl3, nh3, mins3))


@njit(inline="always")
def _dot_q6_k_4(row, x0, x1, x2, x3, f16, ahead):
    q0, d0 = x0[0], x0[1]
    q1, d1 = x1[0], x1[1]
    a00, a01, a02, a03, a10, a11, a12, a13 = zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), zeros()
    a20, a21, a22, a23, a30, a31, a32, a33 = zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), zeros()
    for b in range(q0.shape[0] // 256):
        o = b * 210
        _prefetch_ahead(row, o + ahead, 210)
        d = _half(row, o + 208, f16)
        for half in range(2):
            ql = o + half * 64
            qh = o + 128 + half * 32
            xb = b * 256 + half * 128
            sc0, sc1 = _q6_scales(row, o, d, d0, half, xb), _q6_scales(row, o, d, d1, half, xb)
            sc2, sc3 = _q6_scales(row, o, d, x2[1], half, xb), _q6_scales(row, o, d, x3[1], half, xb)
            for sub in range(2):
                v0, v1, v2, v3 = _q6_codes(row, ql, qh, 16 * sub)
                a00, a01, a02, a03 = _q6_step(v0, v1, v2, v3, q0, xb, sc0, sub, a00, a01, a02, a03)
                a10, a11, a12, a13 = _q6_step(v0, v1, v2, v3, q1, xb, sc1, sub, a10, a11, a12, a13)
                a20, a21, a22, a23 = _q6_step(v0, v1, v2, v3, x2[0], xb, sc2, sub, a20, a21, a22, a23)
                a30, a31, a32, a33 = _q6_step(v0, v1, v2, v3, x3[0], xb, sc3, sub, a30, a31, a32, a33)
    return (hsum(fadd(fadd(a00, a01), fadd(a02, a03))), hsum(fadd(fadd(a10, a11), fadd(a12, a13))),
            hsum(fadd(fadd(a20, a21), fadd(a22, a23))), hsum(fadd(fadd(a30, a31), fadd(a32, a33))))


@njit(inline="always")
def _dot_small_wide_4(row, x0, x1, x2, x3, f16, ahead, code):
    """_dot_small_4 in 512-bit registers, for Q8_0 or Q5_0 (code): a block's 32 codes in one register."""
    q0, d0 = x0[0], x0[1]
    q1, d1 = x1[0], x1[1]
    block_bytes, qs, offset = (34, 2, 0) if code == C_Q8_0 else _small_layout(False, True)
    a0, n0, a1, n1 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    a2, n2, a3, n3 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    for b in range(q0.shape[0] // 32):
        o = b * block_bytes
        _prefetch_ahead(row, o + ahead, block_bytes)
        if code == C_Q8_0:
            codes = load_i8w_32(row, o + 2)
        else:
            codes = _q5_codes_wide(row, o + qs, _u32_at(row, o + qs - 4), offset)
        d = _half(row, o, f16)
        a0, n0 = n0, _block_step_wide(codes, d, q0, d0, b, a0)
        a1, n1 = n1, _block_step_wide(codes, d, q1, d1, b, a1)
        a2, n2 = n2, _block_step_wide(codes, d, x2[0], x2[1], b, a2)
        a3, n3 = n3, _block_step_wide(codes, d, x3[0], x3[1], b, a3)
    return (hsum(fadd(a0, n0)), hsum(fadd(a1, n1)), hsum(fadd(a2, n2)), hsum(fadd(a3, n3)))


@njit(inline="always")
def _dot_k_wide_4(row, x0, x1, x2, x3, f16, ahead, five_bit):
    q0, q1 = x0[0], x1[0]
    al0, ah0, nl0, nh0 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    al1, ah1, nl1, nh1 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    al2, ah2, nl2, nh2 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    al3, ah3, nl3, nh3 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    mins0, mins1, mins2, mins3 = zeros(), zeros(), zeros(), zeros()
    size = 176 if five_bit else 144
    for b in range(q0.shape[0] // 256):
        o = b * size
        _prefetch_ahead(row, o + ahead, size)
        sc0, sc1, sc2, sc3, mins0, mins1, mins2, mins3 = _k_token_scales_4(row, o, f16, b, x0, x1, x2, x3, mins0,
                                                                           mins1, mins2, mins3)
        for pair in range(4):
            codes = _k_pair_codes_wide(row, o, pair, five_bit)
            k = b * 256 + pair * 64
            al0, ah0, nl0, nh0 = _k_token_wide(codes, x0, k, sc0, pair, al0, ah0, nl0, nh0)
            al1, ah1, nl1, nh1 = _k_token_wide(codes, x1, k, sc1, pair, al1, ah1, nl1, nh1)
            al2, ah2, nl2, nh2 = _k_token_wide(codes, x2, k, sc2, pair, al2, ah2, nl2, nh2)
            al3, ah3, nl3, nh3 = _k_token_wide(codes, x3, k, sc3, pair, al3, ah3, nl3, nh3)
    return (_k_sum(al0, ah0, nl0, nh0, mins0), _k_sum(al1, ah1, nl1, nh1, mins1),
            _k_sum(al2, ah2, nl2, nh2, mins2), _k_sum(al3, ah3, nl3, nh3, mins3))


@njit(inline="always")
def _dot_q6_k_wide_4(row, x0, x1, x2, x3, f16, ahead):
    q0, d0 = x0[0], x0[1]
    q1, d1 = x1[0], x1[1]
    a00, a01, a02, a03 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    a10, a11, a12, a13 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    a20, a21, a22, a23 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    a30, a31, a32, a33 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
    for b in range(q0.shape[0] // 256):
        o = b * 210
        _prefetch_ahead(row, o + ahead, 210)
        d = _half(row, o + 208, f16)
        for half in range(2):
            ql = o + half * 64
            xb = b * 256 + half * 128
            v0, v1, v2, v3 = _q6_codes_wide(row, ql, o + 128 + half * 32)
            sc = _q6_scales(row, o, d, d0, half, xb)
            a00, a01, a02, a03 = _q6_step_wide(v0, v1, v2, v3, q0, xb, sc, a00, a01, a02, a03)
            sc = _q6_scales(row, o, d, d1, half, xb)
            a10, a11, a12, a13 = _q6_step_wide(v0, v1, v2, v3, q1, xb, sc, a10, a11, a12, a13)
            sc = _q6_scales(row, o, d, x2[1], half, xb)
            a20, a21, a22, a23 = _q6_step_wide(v0, v1, v2, v3, x2[0], xb, sc, a20, a21, a22, a23)
            sc = _q6_scales(row, o, d, x3[1], half, xb)
            a30, a31, a32, a33 = _q6_step_wide(v0, v1, v2, v3, x3[0], xb, sc, a30, a31, a32, a33)
    return (hsum(fadd(fadd(a00, a01), fadd(a02, a03))), hsum(fadd(fadd(a10, a11), fadd(a12, a13))),
            hsum(fadd(fadd(a20, a21), fadd(a22, a23))), hsum(fadd(fadd(a30, a31), fadd(a32, a33))))


@njit(inline="always")
def _dot_plain(code, row, x, f16):
    """F16 / BF16 rows, value by value (no model we run has them as matrices)."""
    acc = np.float32(0.0)
    for k in range(x.shape[0]):
        acc += _plain_value(code, row, k, f16) * x[k]
    return acc


@njit(inline="always")
def _dot_f32(row, x):
    """An F32 row (its bytes) . x, sixteen lanes at a time in two FMA chains: the narrow float32 weights of a
    decode step (DeltaNet's alpha / beta, a router) stream with the quantized ones, in their parallel region."""
    w = row.view(np.float32)
    n = x.shape[0]
    acc, acc_next = zeros(), zeros()
    k = 0
    while k + 16 <= n:
        acc = fma(load_f32(w, k), load_f32(x, k), acc)
        acc_next = fma(load_f32(w, k + 8), load_f32(x, k + 8), acc_next)
        k += 16
    total = hsum(fadd(acc, acc_next))
    for j in range(k, n):
        total += w[j] * x[j]
    return total


# --- activation rounding (ops/matmul/activation_codes.py's definition, the same float32 operations) -------------

@njit(inline="always")
def _block_scale(x, k):
    """scale and 1 / scale of the 32 activation values x[k:k+32] (0 where the scale is not normal)."""
    amax = hmax(fmax(fmax(fabs(load_f32(x, k)), fabs(load_f32(x, k + 8))),
                     fmax(fabs(load_f32(x, k + 16)), fabs(load_f32(x, k + 24)))))
    scale = amax / np.float32(ACTIVATION_LEVELS)
    return scale, (np.float32(1.0) / scale if scale >= SMALLEST_SCALE else np.float32(0.0))


@njit(inline="always")
def _codes8(x, i, inv):
    """The codes of x[i:i+8] as float32 integers in [-32767, 32767]: rint(x * inv), clamped."""
    q = fround(fmul(load_f32(x, i), splat(inv)))
    return fmin(fmax(q, splat(-ACTIVATION_LEVELS)), splat(ACTIVATION_LEVELS))


@njit(cache=True, nogil=True)
def quantize_activation_row(x, xq, xd, xsum):
    """xq, xd: quantize_activations(x); xsum[b]: the sum of x_hat over block b (x: one row, whole blocks)."""
    for b in range(x.shape[0] // ACTIVATION_BLOCK):
        k = b * ACTIVATION_BLOCK
        scale, inv = _block_scale(x, k)
        total = zeros()
        for i in range(k, k + ACTIVATION_BLOCK, 8):
            q = _codes8(x, i, inv)
            total = fadd(total, q)  # (integers below 2**20: exact in any order)
            store_i16(xq, i, q)
        total = hsum(total)
        xd[b] = scale
        xsum[b] = total * scale


@njit(cache=True, nogil=True)
def split_activation_bytes(xq, xb):
    """xb: the codes xq split into bytes for the VNNI kernels, 64 codes at a time: their low bytes (code & 255),
    then their high bytes (code >> 8, -128..127), so that code = 256 * high + low."""
    for c in range(xq.shape[0] // 64):
        for i in range(64):
            v = np.int32(xq[64 * c + i])
            xb[128 * c + i] = np.uint8(v & 255)
            xb[128 * c + 64 + i] = np.uint8((v >> 8) & 255)


@njit(cache=True, nogil=True)
def activation_rows(xs, codes):
    """Each row of xs [rows, n_in] as the GEMV kernels multiply it: (xq, xd, xsum) = quantize_activation_row's,
    and xb = split_activation_bytes' where the machine has VNNI and a weight of `codes` is a K-quant (the only
    kernels that read it; else no columns). Rows of no whole blocks are left unrounded: float rows read x."""
    n_rows, n_in = xs.shape
    n_blocks = n_in // ACTIVATION_BLOCK + 8  # + 8: Q6_K loads 8 lanes to use its last 4
    xq = np.empty((n_rows, n_in), np.int16)  # (np.empty: np.zeros would be a parallel loop of its own)
    xd = np.empty((n_rows, n_blocks), np.float32)
    xsum = np.empty_like(xd)
    split = False
    if MACHINE_HAS_VNNI:
        for code in codes:
            split |= code == C_Q4_K or code == C_Q5_K
    xb = np.empty((n_rows, 2 * n_in if split else 0), np.uint8)
    if n_in % ACTIVATION_BLOCK == 0:
        for r in range(n_rows):
            quantize_activation_row(xs[r], xq[r], xd[r], xsum[r])
            if split:
                split_activation_bytes(xq[r], xb[r])
    return xq, xd, xsum, xb


@njit(inline="always")
def _out_rows(code, data):
    """A weight's output rows: its array's rows, or 16 a row of an interleaved weight's (cpu_interleaved.py)."""
    return data.shape[0] * X16_ROWS if code in X16_CODES else data.shape[0]


@njit(inline="always")
def _share_rows(codes, datas, share, n_shares):
    """[first, stop) of the output rows of share `share` of n_shares, counting all the weights' rows in order."""
    total = 0
    for i in range(len(datas)):
        total += _out_rows(codes[i], datas[i])
    return share * total // n_shares, (share + 1) * total // n_shares


@njit(inline="always")
def _rows_wide(code, data, first, end, x, xq, xd, xsum, xb, out, f16, ahead):
    """out[n] = row n's dot product for n in [first, end), Q8_0, Q5_0 / Q5_1 and the K-quants in 512-bit lanes.
    (Each format's own row loop: with the format's branch inside one loop, numba's reference counts of the
    inlined helpers' arrays stayed in it, a dozen calls a row. Each helper takes its format's flags as
    constants, so that its loop is compiled for that layout alone.)"""
    if code == C_Q8_0:
        for n in range(first, end):
            out[n] = _dot_q8_0_wide(data[n], xq, xd, xsum, f16, ahead)
    elif code == C_Q4_K:
        for n in range(first, end):
            out[n] = _dot_k_wide(data[n], xq, xd, xsum, xb, f16, ahead, False)
    elif code == C_Q6_K:
        for n in range(first, end):
            out[n] = _dot_q6_k_wide(data[n], xq, xd, xsum, f16, ahead)
    elif code == C_Q5_K:
        for n in range(first, end):
            out[n] = _dot_k_wide(data[n], xq, xd, xsum, xb, f16, ahead, True)
    elif code == C_Q5_0:
        for n in range(first, end):
            out[n] = _dot_q5_wide(data[n], xq, xd, xsum, f16, ahead, False)
    elif code == C_Q5_1:
        for n in range(first, end):
            out[n] = _dot_q5_wide(data[n], xq, xd, xsum, f16, ahead, True)
    else:  # (Q4_0 / Q4_1 stay narrow: see _dot_q5_wide)
        _rows_either(code, data, first, end, x, xq, xd, xsum, out, f16, ahead)


@njit(inline="always")
def _rows_narrow(code, data, first, end, x, xq, xd, xsum, out, f16, ahead):
    """_rows_wide in 256-bit lanes."""
    if code == C_Q8_0:
        for n in range(first, end):
            out[n] = _dot_q8_0(data[n], xq, xd, xsum, f16, ahead)
    elif code == C_Q4_K:
        for n in range(first, end):
            out[n] = _dot_k(data[n], xq, xd, xsum, f16, ahead, False)
    elif code == C_Q6_K:
        for n in range(first, end):
            out[n] = _dot_q6_k(data[n], xq, xd, xsum, f16, ahead)
    elif code == C_Q5_K:
        for n in range(first, end):
            out[n] = _dot_k(data[n], xq, xd, xsum, f16, ahead, True)
    elif code == C_Q5_0:
        for n in range(first, end):
            out[n] = _dot_small(data[n], xq, xd, xsum, f16, ahead, False, True)
    elif code == C_Q5_1:
        for n in range(first, end):
            out[n] = _dot_small(data[n], xq, xd, xsum, f16, ahead, True, True)
    else:
        _rows_either(code, data, first, end, x, xq, xd, xsum, out, f16, ahead)


@njit(inline="always")
def _rows_either(code, data, first, end, x, xq, xd, xsum, out, f16, ahead):
    """_rows_wide and _rows_narrow's Q4_0, Q4_1 and float rows."""
    if code == C_Q4_0:
        for n in range(first, end):
            out[n] = _dot_small(data[n], xq, xd, xsum, f16, ahead, False, False)
    elif code == C_Q4_1:
        for n in range(first, end):
            out[n] = _dot_small(data[n], xq, xd, xsum, f16, ahead, True, False)
    elif code == C_F32:
        for n in range(first, end):
            out[n] = _dot_f32(data[n], x)
    else:
        for n in range(first, end):
            out[n] = _dot_plain(code, data[n], x, f16)


@njit(nogil=True)  # (no fastmath: see ops/simd.py)
def _gemv_rows(code, data, first, end, x, xq, xd, xsum, xb, out, f16, ahead, wide):
    """out[n] = row n's dot product with x (x_hat: xq, xd, xsum) for n in [first, end): a thread's share of a
    weight in gemv_blocks and gemv_blocks_each. Compiled on its own, not inlined into their parallel loops:
    numba compiles the dot products once for both kernels, and its parallel passes do not copy and analyse
    them (most of the compile time when they were inlined). `wide` None: the machine's kernels, and only those
    are compiled (numba prunes a branch on `is None` by the argument's type)."""
    if wide is None:
        if MACHINE_HAS_512_BIT_LANES:
            _rows_wide(code, data, first, end, x, xq, xd, xsum, xb, out, f16, ahead)
        else:
            _rows_narrow(code, data, first, end, x, xq, xd, xsum, out, f16, ahead)
    elif wide:
        _rows_wide(code, data, first, end, x, xq, xd, xsum, xb, out, f16, ahead)
    else:
        _rows_narrow(code, data, first, end, x, xq, xd, xsum, out, f16, ahead)


def _four_token_rows(dot, *flag):
    """The loop of `dot` (a _dot_*_4 kernel, with its format's flag if it takes one, a constant) over a thread's
    rows, as a function compiled on its own: one function holding every format's loop took numba several times
    the sum of its parts. (numba calls a closure with no *args: one loop without the flag, one with it.)"""
    if not flag:
        @njit(nogil=True)
        def rows(data, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, f16, ahead):
            for n in range(first, end):
                out[t0, n], out[t1, n], out[t2, n], out[t3, n] = dot(data[n], x0, x1, x2, x3, f16, ahead)
        return rows
    constant, = flag

    @njit(nogil=True)
    def rows_with_flag(data, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, f16, ahead):
        for n in range(first, end):
            out[t0, n], out[t1, n], out[t2, n], out[t3, n] = dot(data[n], x0, x1, x2, x3, f16, ahead, constant)
    return rows_with_flag


_ROWS4_Q8_0, _ROWS4_Q8_0_WIDE = _four_token_rows(_dot_small_4, C_Q8_0), _four_token_rows(_dot_small_wide_4, C_Q8_0)
_ROWS4_Q4_K, _ROWS4_Q4_K_WIDE = _four_token_rows(_dot_k_4, False), _four_token_rows(_dot_k_wide_4, False)
_ROWS4_Q5_K, _ROWS4_Q5_K_WIDE = _four_token_rows(_dot_k_4, True), _four_token_rows(_dot_k_wide_4, True)
_ROWS4_Q6_K, _ROWS4_Q6_K_WIDE = _four_token_rows(_dot_q6_k_4), _four_token_rows(_dot_q6_k_wide_4)
_ROWS4_Q5_0, _ROWS4_Q5_0_WIDE = _four_token_rows(_dot_small_4, C_Q5_0), _four_token_rows(_dot_small_wide_4, C_Q5_0)
_ROWS4_Q4_0 = _four_token_rows(_dot_small_4, C_Q4_0)
# (Q4_1 and Q5_1, rare in GGUF releases, keep the one-token kernels: their several-token kernels cost the first
# run's compile about 5 s of CPU)
SEVERAL_TOKEN_CODES = (C_Q8_0, C_Q4_0, C_Q5_0, C_Q4_K, C_Q5_K, C_Q6_K)


@njit(nogil=True)
def _rows_wide_4(code, *rows):
    """out[t, n] for the four tokens t0..t3 (x0..x3) and n in [first, end) (`rows`: the arguments of
    _four_token_rows' loop): _rows_wide's kernels, four tokens a row."""
    if code == C_Q8_0:
        _ROWS4_Q8_0_WIDE(*rows)
    elif code == C_Q4_K:
        _ROWS4_Q4_K_WIDE(*rows)
    elif code == C_Q6_K:
        _ROWS4_Q6_K_WIDE(*rows)
    elif code == C_Q5_K:
        _ROWS4_Q5_K_WIDE(*rows)
    elif code == C_Q5_0:
        _ROWS4_Q5_0_WIDE(*rows)
    else:  # (Q4_0 stays narrow: see _rows_wide)
        _ROWS4_Q4_0(*rows)


@njit(nogil=True)
def _rows_narrow_4(code, *rows):
    """_rows_wide_4 with _rows_narrow's kernels."""
    if code == C_Q8_0:
        _ROWS4_Q8_0(*rows)
    elif code == C_Q4_K:
        _ROWS4_Q4_K(*rows)
    elif code == C_Q6_K:
        _ROWS4_Q6_K(*rows)
    elif code == C_Q5_K:
        _ROWS4_Q5_K(*rows)
    elif code == C_Q5_0:
        _ROWS4_Q5_0(*rows)
    else:
        _ROWS4_Q4_0(*rows)


@njit(nogil=True)  # (no fastmath: see ops/simd.py)
def _gemv_rows_4(code, data, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, f16, ahead, wide):
    """out[t, n] = row n's dot product with x_hat of token t, for the tokens t0..t3 (x0..x3: their (xq, xd,
    xsum, xb); repeats allowed: three tokens, or two, run as four) and n in [first, end): _gemv_rows for a
    block-quantized weight, four tokens a row."""
    if wide is None:
        if MACHINE_HAS_512_BIT_LANES:
            _rows_wide_4(code, data, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, f16, ahead)
        else:
            _rows_narrow_4(code, data, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, f16, ahead)
    elif wide:
        _rows_wide_4(code, data, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, f16, ahead)
    else:
        _rows_narrow_4(code, data, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, f16, ahead)


@njit(parallel=True, cache=True, nogil=True)  # (no fastmath: it would reach the activation rounding)
def gemv_blocks(codes, datas, xs, outs, f16, wide=None, ahead=PREFETCH_BYTES, shares=ROW_SHARES):
    """outs[i][t, n] = sum_k x_hat_t[k] * W_i[n, k] for every weight W_i (quantized rows datas[i], format codes[i])
    and every token t of xs [T, n_in] (x_hat: x rounded to 16-bit codes per 32 values; float weights take x as
    it is): each row read from memory once for all T tokens and unpacked once for every four, all weights in ONE
    parallel region, so q/k/v and gate/up cost a decode step one thread wake-up per group, not one per weight.
    Each token's dot products are the one-token kernel's, bit for bit, whatever T (a verify run of drafts
    computes what decode steps do, a sequence in a batch what it computes alone).
    `wide`: Q8_0, Q5_0 / Q5_1 and K-quant rows in 512-bit lanes (None, the default: where the machine has them,
    MACHINE_HAS_512_BIT_LANES; the narrow kernels give the same values up to float32 summation order); `ahead`:
    the bytes past each block to prefetch (0: none); `shares`: the equal shares of all the rows that the
    parallel loop hands out (ROW_SHARES; gemv_many passes the thread count: a share a thread). Weights of no rows
    add no work (gemv_many pads the tuples to GEMV_WEIGHTS with them). A weight of a code in X16_CODES has 16
    rows interleaved a row of its array (cpu_interleaved.py), its output rows 16 times its array's."""
    n_tok = xs.shape[0]
    xq, xd, xsum, xb = activation_rows(xs, codes)
    # Tokens go four at a time through a weight of SEVERAL_TOKEN_CODES (three as four, the last one twice), then
    # two at a time, the rest (and every token of the other weights) one at a time. Several passes over the rows:
    # a tile of rows at a time for every pass, so each row is read from memory once and from the cache for the
    # other passes (one pass: the share's rows in one call).
    token_by_token = False
    for i in range(len(datas)):
        token_by_token |= codes[i] not in SEVERAL_TOKEN_CODES and codes[i] not in X16_CODES
    tile = TOKEN_TILE_ROWS if n_tok > 4 or (n_tok > 1 and token_by_token) else 1 << 62
    for share in prange(shares):
        first, stop = _share_rows(codes, datas, share, shares)
        offset = 0
        for i in range(len(datas)):  # the weights' rows that fall in this thread's share
            code = codes[i]
            n_rows = _out_rows(code, datas[i])
            lo, hi = max(first - offset, 0), min(stop - offset, n_rows)
            if code in X16_CODES:  # (the groups whose first row falls in the share: a share's rows, rounded)
                interleaved_gemv(code, datas[i], (lo + X16_ROWS - 1) // X16_ROWS, (hi + X16_ROWS - 1) // X16_ROWS,
                                 xq, xd, xsum, outs[i], ahead)
                lo = hi  # (done: no rows for the loops below)
            blocks = code in SEVERAL_TOKEN_CODES
            n_fours = (n_tok + 1) // 4 if blocks else 0
            for a in range(lo, hi, tile):
                b = min(a + tile, hi)
                for g in range(n_fours):
                    t, last = 4 * g, min(4 * g + 3, n_tok - 1)
                    _gemv_rows_4(code, datas[i], a, b, (xq[t], xd[t], xsum[t], xb[t]),
                                 (xq[t + 1], xd[t + 1], xsum[t + 1], xb[t + 1]),
                                 (xq[t + 2], xd[t + 2], xsum[t + 2], xb[t + 2]),
                                 (xq[last], xd[last], xsum[last], xb[last]), outs[i], t, t + 1, t + 2, last, f16,
                                 ahead, wide)
                u = 4 * n_fours
                if blocks and n_tok - u == 2:  # (as four: the kernels for two tokens are not compiled)
                    x0, x1 = (xq[u], xd[u], xsum[u], xb[u]), (xq[u + 1], xd[u + 1], xsum[u + 1], xb[u + 1])
                    _gemv_rows_4(code, datas[i], a, b, x0, x1, x0, x1, outs[i], u, u + 1, u, u + 1, f16, ahead, wide)
                    u += 2
                for v in range(u, n_tok):
                    _gemv_rows(code, datas[i], a, b, xs[v], xq[v], xd[v], xsum[v], xb[v], outs[i][v], f16, ahead,
                               wide)
            offset += n_rows


TOKEN_TILE_ROWS = 16  # rows a thread takes through all tokens at once: 16 rows of 4096 Q4_K values are 36 KiB


# gemv_many passes this many weights a call, padding with empty ones: numba compiles gemv_blocks once per tuple
# length, and one length (q/k/v, gate/up, a DeltaNet's qkv/z/alpha/beta, a single weight alike) is one compile
# instead of four
GEMV_WEIGHTS = 4


def weight_rows(data: np.ndarray) -> np.ndarray:
    """data as the kernels take it: read-only, C-contiguous (the memory-mapped GGUF's arrays are), so that an
    array built in memory (a test's, a converted weight) does not compile the kernels again for a writable type."""
    flags = data.flags
    if flags.writeable or not flags.c_contiguous:
        data = np.ascontiguousarray(data).view()
        data.flags.writeable = False
    return data


_NO_ROWS = np.empty((0, 1), np.uint8)  # gemv_many's padding: a weight of no rows, and its output
_NO_ROWS.flags.writeable = False
_NO_OUT = np.empty(0, np.float32)


def gemv_many(x: np.ndarray, weights: list[tuple[np.ndarray, WeightFormat]]) -> list[np.ndarray]:
    """[x_hat @ W.T for W in weights] through gemv_blocks (x: a few tokens, f32 contiguous; the weights' arrays
    all of one type; a weight may have its rows interleaved, with its cpu_interleaved.InterleavedLayout as format),
    GEMV_WEIGHTS weights a call."""
    if len(weights) > GEMV_WEIGHTS:
        return [y for i in range(0, len(weights), GEMV_WEIGHTS)
                for y in gemv_many(x, weights[i:i + GEMV_WEIGHTS])]
    n_pad = GEMV_WEIGHTS - len(weights)
    datas = tuple([weight_rows(data) for data, _ in weights] + [_NO_ROWS] * n_pad)
    codes = np.array([fmt.code for _, fmt in weights] + [0] * n_pad, np.int64)
    outs = [np.empty((x.shape[0], data.shape[0] * (X16_ROWS if fmt.code in X16_CODES else 1)), np.float32)
            for data, fmt in weights]
    no_out = np.empty((x.shape[0], 0), np.float32)
    gemv_blocks(codes, datas, x, tuple(outs + [no_out] * n_pad), F16_TABLE, None, PREFETCH_BYTES,
                numba.get_num_threads())
    return outs


@njit(parallel=True, cache=True, nogil=True)
def gemv_blocks_each(codes, datas, x_of, xs, outs, f16, wide=None, ahead=PREFETCH_BYTES, shares=ROW_SHARES):
    """outs[i][n] = sum_k x_hat[k] * W_i[n, k] with x = xs[x_of[i]]: gemv_blocks where each weight reads its own
    activation row (a mixture of experts' chosen experts: gate / up read the token, down its expert's hidden
    row), all in ONE parallel region. Each row of xs is rounded once, as gemv_blocks rounds its x, and each row's
    dot product is gemv_blocks' own, so the values are the same bit for bit."""
    xq, xd, xsum, xb = activation_rows(xs, codes)
    for share in prange(shares):
        first, stop = _share_rows(codes, datas, share, shares)
        offset = 0
        for i in range(len(datas)):
            n_rows, r = datas[i].shape[0], x_of[i]
            if max(first, offset) < min(stop, offset + n_rows):
                _gemv_rows(codes[i], datas[i], max(first - offset, 0), min(stop - offset, n_rows), xs[r],
                           xq[r], xd[r], xsum[r], xb[r], outs[i], f16, ahead, wide)
            offset += n_rows


# gemv_each passes this many weights a call (numba compiles once per tuple length): 8 experts' gate and up
EACH_WEIGHTS = 16


def gemv_each(xs: np.ndarray, weights: list[tuple[np.ndarray, WeightFormat]], x_of: np.ndarray) -> list[np.ndarray]:
    """[x_hat_i @ W_i.T] with x_i = xs[x_of[i]] (xs: f32 [rows, n_in] contiguous; the weights' arrays all of one
    type): gemv_many where each weight reads its own row, EACH_WEIGHTS weights a parallel launch."""
    x_of = np.asarray(x_of, np.int64)
    if len(weights) > EACH_WEIGHTS:
        return [y for i in range(0, len(weights), EACH_WEIGHTS)
                for y in gemv_each(xs, weights[i:i + EACH_WEIGHTS], x_of[i:i + EACH_WEIGHTS])]
    n_pad = EACH_WEIGHTS - len(weights)
    datas = tuple([weight_rows(data) for data, _ in weights] + [_NO_ROWS] * n_pad)
    codes = np.array([fmt.code for _, fmt in weights] + [0] * n_pad, np.int64)
    outs = [np.empty(data.shape[0], np.float32) for data, _ in weights]
    gemv_blocks_each(codes, datas, np.concatenate([x_of, np.zeros(n_pad, np.int64)]), xs,
                     tuple(outs + [_NO_OUT] * n_pad), F16_TABLE, None, PREFETCH_BYTES, numba.get_num_threads())
    return outs


def dequantize_numba(data: np.ndarray, fmt: WeightFormat, n_in: int, rows: slice | None = None) -> np.ndarray:
    start, stop = (0, data.shape[0]) if rows is None else (rows.start or 0, rows.stop)
    out = np.empty((stop - start, n_in), np.float32)
    dequantize_rows(fmt.code, weight_rows(data), start, stop, out, F16_TABLE)
    return out


def dequantize_ids(data: np.ndarray, fmt: WeightFormat, n_in: int, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of the weight as f32 [len(ids), n_in] (embedding lookup); ids must be in range."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.empty((len(ids), n_in), np.float32)
    gather_rows(fmt.code, weight_rows(data), ids, out, F16_TABLE)
    return out
