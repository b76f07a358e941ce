"""CPU prefill matmul on integer codes (numba): `y = x_hat @ W.T` for many tokens, W in its GGUF blocks.

The decode GEMV (`cpu_matmul.gemv_blocks`) multiplies a weight row's integer codes with the activation's 16-bit
codes (`ops/matmul/activation_codes.py`). This is the same product for a tile of tokens, arranged so that each `madd`
instruction (vpdpwssd: 16 int16 products summed in pairs into 8 int32 lanes) serves eight tokens at once:

- the activations are packed once per matmul pair-major, `xp[p, t] = (code[t, 2p], code[t, 2p+1])`, so one
  vector load holds one pair of positions for eight consecutive tokens;
- each thread unpacks a tile of weight rows to int16 codes (the GEMV's block-code helpers `_codes32`,
  `_k_codes`, `_q6_codes`, stored instead of multiplied) plus one float scale per 32 values (16 for Q6_K) and, for the affine formats, one min term per 32;
- the micro-kernel keeps 4 rows x 32 tokens of int32 sums in registers (16 independent vpdpwssd chains),
  broadcasts a row's code pair against the tokens' pairs, and at the end of every scale group converts the sums
  and adds them times weight scale x activation scale to float32 accumulators (and the min term times the
  block's activation sum); rows are walked K_CHUNK values at a time over all token tiles, so a pass's codes and
  activations stay in L2;
- where the machine has AVX-512 (simd.MACHINE_HAS_512_BIT_LANES), the wide micro-kernel does the same for
  8 rows x 32 tokens in 512-bit registers (16 chains of sixteen lanes): each lane's operations are the narrow
  kernel's in the same order, so the results are bit for bit the same, at twice the products an instruction
  (per weight against the narrow kernel: bench/cpu_matmul.py).

Integer sums are exact (|code| <= 32767 times |weight code| <= 128 over 32 values stays below 2**31), so each
result is sum_k W[n, k] * x_hat[k] up to float32 summation order: the GEMV's value, reached in another order.
Against BLAS on dequantized f32 tiles it does twice the multiply-adds per instruction and never writes the f32
weights. Each weight is one numba parallel region over row tiles; the prefill's attention runs beside it in
Python threads with BLAS held to one thread (backend/cpu_threads.py), since a numba region next to OpenBLAS's
spinning workers makes both fight for the cores.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .activation_codes import ACTIVATION_BLOCK
from .cpu_gemv import (C_Q4_0, C_Q4_1, C_Q4_K, C_Q5_0, C_Q5_1, C_Q5_K, C_Q6_K, C_Q8_0, F16_TABLE, _codes32, _half,
                       _i8, _k_codes, _k_scale_mins, _q6_codes, _u32_at, quantize_activation_row, weight_rows)
from .cpu_interleaved import C_Q8_0_X16, _group_end_16, interleaved_gemm_group
from ..simd import (MACHINE_HAS_512_BIT_LANES, borrow, fma, fmul, fsub, izeros, izeros_16, load_f32, load_f32_16,
                    load_i16, load_i16_32, load_i8w, madd, splat, splat_at, splat_at_16, splat_pair, splat_pair_32,
                    store_f32, store_i16, to_f32, zeros, zeros_16)
from .reference import WeightFormat

TOKEN_TILE = 32  # tokens per micro-kernel: four vectors of eight (two of sixteen, wide)
ROW_QUAD = 4  # weight rows per micro-kernel
WIDE_ROWS = 8  # weight rows per wide micro-kernel
ROWS_PER_TASK = 32  # weight rows a thread unpacks and multiplies at a time
K_CHUNK = 1024  # values of a row per pass over the token tiles: the pass's codes and activations stay in cache
GEMM_CODES = (C_Q8_0, C_Q4_0, C_Q4_1, C_Q5_0, C_Q5_1, C_Q4_K, C_Q5_K, C_Q6_K)


# --- weight rows -> int16 codes, scales per group, min terms per 32 values ------------------------------
# Every value of the row is scale[k // group] * code[k] + min[k // 32], as in the NumPy definitions.

@njit(inline="always")
def _unpack_row(code, row, n_in, q, qo, scales, so, mins, mo, f16):
    """Row `row` into q[qo:qo+n_in] (codes), scales[so:] (per group) and mins[mo:] (per 32 values; affine
    formats only)."""
    if code == C_Q8_0:
        for b in range(n_in // 32):
            o = b * 34
            scales[so + b] = _half(row, o, f16)
            store_i16(q, qo + 32 * b, load_i8w(row, o + 2))
            store_i16(q, qo + 32 * b + 16, load_i8w(row, o + 18))
    elif code == C_Q4_0 or code == C_Q4_1 or code == C_Q5_0 or code == C_Q5_1:
        five_bit = code == C_Q5_0 or code == C_Q5_1  # (their 5th bits: the u32 before the nibbles)
        affine = code == C_Q4_1 or code == C_Q5_1  # (their m: the half after d)
        size = 18 + 2 * affine + 4 * five_bit
        qs, offset = size - 16, (16 if five_bit else 8) * (1 - affine)
        for b in range(n_in // 32):
            o = b * size
            scales[so + b] = _half(row, o, f16)
            if affine:
                mins[mo + b] = _half(row, o + 2, f16)
            lo, hi = _codes32(row, o + qs, _u32_at(row, o + qs - 4) if five_bit else np.uint32(0), offset)
            store_i16(q, qo + 32 * b, lo)
            store_i16(q, qo + 32 * b + 16, hi)
    elif code == C_Q4_K or code == C_Q5_K:
        size = 144 if code == C_Q4_K else 176
        for b in range(n_in // 256):
            o = b * size
            sc, m = _k_scale_mins(row, o)
            store_f32(scales, so + 8 * b, fmul(splat(_half(row, o, f16)), to_f32(sc)))  # d * sc_j
            store_f32(mins, mo + 8 * b, fsub(zeros(), fmul(splat(_half(row, o + 2, f16)), to_f32(m))))  # -dmin*m_j
            base = qo + 256 * b
            for pair in range(4):
                lo0, lo1, hi0, hi1 = _k_codes(row, o, pair, code == C_Q5_K)
                store_i16(q, base + 64 * pair, lo0)
                store_i16(q, base + 64 * pair + 16, lo1)
                store_i16(q, base + 64 * pair + 32, hi0)
                store_i16(q, base + 64 * pair + 48, hi1)
    else:  # Q6_K: its 16 int8 scales are in the order of its 16-value groups
        for b in range(n_in // 256):
            o = b * 210
            d = _half(row, o + 208, f16)
            for i in range(16):
                scales[so + 16 * b + i] = d * _i8(row[o + 192 + i])
            for half in range(2):
                ql = o + half * 64
                qh = o + 128 + half * 32
                base = qo + 256 * b + 128 * half
                for sub in range(2):
                    l = 16 * sub
                    v0, v1, v2, v3 = _q6_codes(row, ql, qh, l)
                    store_i16(q, base + l, v0)
                    store_i16(q, base + 32 + l, v1)
                    store_i16(q, base + 64 + l, v2)
                    store_i16(q, base + 96 + l, v3)


# --- the micro-kernel: 4 rows x 32 tokens ------------------------------------------------------------
# 16 independent int32 sums (4 rows x 4 vectors of 8 tokens) keep two vpdpwssd a cycle busy past their latency;
# the float accumulators live in `acc` (a group's end touches them once per 16 code pairs).

@njit(inline="always")
def _group_end(acc, i, s, xd, w, affine, xs, m):
    """acc[i:i+8] += float(s) * (xd * w) (+ xs * m for the affine formats): a group's integer sums times weight
    scale x activation scale into the float accumulators, plus the block's min term."""
    f = fma(to_f32(s), fmul(xd, w), load_f32(acc, i))
    store_f32(acc, i, fma(xs, m, f) if affine else f)


@njit(nogil=True)  # (no fastmath: see ops/simd.py)
def _rows4_tiles(q, n_in, scales, n_groups, mins, affine, group_pairs, g_start, g_end, xp, xd, xs, t_start, t_stop,
                 tokens, padded, acc, half):
    """For each token tile [t0, t0 + 32) in [t_start, t_stop) and each ROW_QUAD rows j0.. of the task's `padded`:
    acc[ao + 8 * (4 * j + v) + l] += the sum over groups [g_start, g_end) of the codes of row j0 + j (rows at
    q[qo + j * n_in:], scales at scales[so + j * n_groups:], mins at mins[mo + j * n_in // 32:]; qo = j0 * n_in,
    ...) times token t0 + 8 * v + l's x_hat, ao = (t0 // 32 * padded + j0) * 32. `half` None: v < 4; True: only
    v < 2, for a last tile of at most 16 tokens."""
    n_blocks = n_in // ACTIVATION_BLOCK
    m0 = m1 = m2 = m3 = zeros()
    e0 = e1 = e2 = e3 = zeros()
    row_tiles = padded // ROW_QUAD
    for tile in range((t_stop - t_start) // TOKEN_TILE * row_tiles):  # token tiles, then row tiles
        t0, j0 = t_start + tile // row_tiles * TOKEN_TILE, tile % row_tiles * ROW_QUAD
        qo, so, mo = j0 * n_in, j0 * n_groups, j0 * n_blocks
        ao = (t0 // TOKEN_TILE * padded + j0) * TOKEN_TILE
        for g in range(g_start, g_end):
            s00, s01, s02, s03 = izeros(), izeros(), izeros(), izeros()
            s10, s11, s12, s13 = izeros(), izeros(), izeros(), izeros()
            s20, s21, s22, s23 = izeros(), izeros(), izeros(), izeros()
            s30, s31, s32, s33 = izeros(), izeros(), izeros(), izeros()
            for p in range(g * group_pairs, (g + 1) * group_pairs):
                xo = 2 * (p * tokens + t0)
                x0, x1 = load_i16(xp, xo), load_i16(xp, xo + 16)
                k = qo + 2 * p
                w0, w1, w2, w3 = splat_pair(q, k), splat_pair(q, k + n_in), splat_pair(q, k + 2 * n_in), splat_pair(
                    q, k + 3 * n_in)
                s00, s01, s10, s11 = madd(s00, w0, x0), madd(s01, w0, x1), madd(s10, w1, x0), madd(s11, w1, x1)
                s20, s21, s30, s31 = madd(s20, w2, x0), madd(s21, w2, x1), madd(s30, w3, x0), madd(s31, w3, x1)
                if half is None:
                    x2, x3 = load_i16(xp, xo + 32), load_i16(xp, xo + 48)
                    s02, s03, s12, s13 = madd(s02, w0, x2), madd(s03, w0, x3), madd(s12, w1, x2), madd(s13, w1, x3)
                    s22, s23, s32, s33 = madd(s22, w2, x2), madd(s23, w2, x3), madd(s32, w3, x2), madd(s33, w3, x3)
            b = (g * group_pairs * 2) // ACTIVATION_BLOCK
            xo = b * tokens + t0
            d0, d1, d2, d3 = load_f32(xd, xo), load_f32(xd, xo + 8), load_f32(xd, xo + 16), load_f32(xd, xo + 24)
            if affine:  # (affine formats have 32-value groups: group g is block b)
                e0, e1, e2, e3 = load_f32(xs, xo), load_f32(xs, xo + 8), load_f32(xs, xo + 16), load_f32(xs, xo + 24)
                m0, m1 = splat_at(mins, mo + b), splat_at(mins, mo + n_blocks + b)
                m2, m3 = splat_at(mins, mo + 2 * n_blocks + b), splat_at(mins, mo + 3 * n_blocks + b)
            c0, c1 = splat_at(scales, so + g), splat_at(scales, so + n_groups + g)
            c2, c3 = splat_at(scales, so + 2 * n_groups + g), splat_at(scales, so + 3 * n_groups + g)
            _group_end(acc, ao + 0, s00, d0, c0, affine, e0, m0)
            _group_end(acc, ao + 8, s01, d1, c0, affine, e1, m0)
            _group_end(acc, ao + 32, s10, d0, c1, affine, e0, m1)
            _group_end(acc, ao + 40, s11, d1, c1, affine, e1, m1)
            _group_end(acc, ao + 64, s20, d0, c2, affine, e0, m2)
            _group_end(acc, ao + 72, s21, d1, c2, affine, e1, m2)
            _group_end(acc, ao + 96, s30, d0, c3, affine, e0, m3)
            _group_end(acc, ao + 104, s31, d1, c3, affine, e1, m3)
            if half is None:
                _group_end(acc, ao + 16, s02, d2, c0, affine, e2, m0)
                _group_end(acc, ao + 24, s03, d3, c0, affine, e3, m0)
                _group_end(acc, ao + 48, s12, d2, c1, affine, e2, m1)
                _group_end(acc, ao + 56, s13, d3, c1, affine, e3, m1)
                _group_end(acc, ao + 80, s22, d2, c2, affine, e2, m2)
                _group_end(acc, ao + 88, s23, d3, c2, affine, e3, m2)
                _group_end(acc, ao + 112, s32, d2, c3, affine, e2, m3)
                _group_end(acc, ao + 120, s33, d3, c3, affine, e3, m3)


# --- the wide micro-kernel: 8 rows x 32 tokens in 512-bit registers (AVX-512) ------------------------------
# The same sums as _rows4_tokens32, each lane's operations in the same order (so bit for bit the same results):
# 16 int32 chains of sixteen lanes (8 rows x 2 vectors of 16 tokens), twice the products an instruction.

@njit(inline="always")
def _group_ends_16(acc, ao, s0, s1, d0, d1, c, affine, e0, e1, m, half):
    """One row's two token vectors through _group_end_16 (the second not for a half tile)."""
    _group_end_16(acc, ao, s0, d0, c, affine, e0, m)
    if half is None:
        _group_end_16(acc, ao + 16, s1, d1, c, affine, e1, m)


@njit(nogil=True)  # (no fastmath: see ops/simd.py)
def _rows8_tiles(q, n_in, scales, n_groups, mins, affine, group_pairs, g_start, g_end, xp, xd, xs, t_start, t_stop,
                 tokens, padded, acc, half):
    """_rows4_tiles through 512-bit lanes, eight rows at a time: acc[ao + 16 * (2 * j + v) + l] += the sum over
    groups of the codes of row j0 + j (j < 8) times token t0 + 16 * v + l's x_hat; `half` True: v = 0 only."""
    n_blocks = n_in // ACTIVATION_BLOCK
    row_tiles = padded // WIDE_ROWS
    for tile in range((t_stop - t_start) // TOKEN_TILE * row_tiles):  # token tiles, then row tiles
        e0 = e1 = m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = zeros_16()  # (read only for the affine formats)
        t0, j0 = t_start + tile // row_tiles * TOKEN_TILE, tile % row_tiles * WIDE_ROWS
        qo, so, mo = j0 * n_in, j0 * n_groups, j0 * n_blocks
        ao = (t0 // TOKEN_TILE * padded + j0) * TOKEN_TILE
        for g in range(g_start, g_end):
            s00, s01, s10, s11 = izeros_16(), izeros_16(), izeros_16(), izeros_16()
            s20, s21, s30, s31 = izeros_16(), izeros_16(), izeros_16(), izeros_16()
            s40, s41, s50, s51 = izeros_16(), izeros_16(), izeros_16(), izeros_16()
            s60, s61, s70, s71 = izeros_16(), izeros_16(), izeros_16(), izeros_16()
            for p in range(g * group_pairs, (g + 1) * group_pairs):
                xo = 2 * (p * tokens + t0)
                x0 = load_i16_32(xp, xo)
                k = qo + 2 * p
                w0, w1, w2, w3 = splat_pair_32(q, k), splat_pair_32(q, k + n_in), splat_pair_32(q, k + 2 * n_in), \
                    splat_pair_32(q, k + 3 * n_in)
                w4, w5, w6, w7 = splat_pair_32(q, k + 4 * n_in), splat_pair_32(q, k + 5 * n_in), \
                    splat_pair_32(q, k + 6 * n_in), splat_pair_32(q, k + 7 * n_in)
                s00, s10, s20, s30 = madd(s00, w0, x0), madd(s10, w1, x0), madd(s20, w2, x0), madd(s30, w3, x0)
                s40, s50, s60, s70 = madd(s40, w4, x0), madd(s50, w5, x0), madd(s60, w6, x0), madd(s70, w7, x0)
                if half is None:
                    x1 = load_i16_32(xp, xo + 32)
                    s01, s11, s21, s31 = madd(s01, w0, x1), madd(s11, w1, x1), madd(s21, w2, x1), madd(s31, w3, x1)
                    s41, s51, s61, s71 = madd(s41, w4, x1), madd(s51, w5, x1), madd(s61, w6, x1), madd(s71, w7, x1)
            b = (g * group_pairs * 2) // ACTIVATION_BLOCK
            xo = b * tokens + t0
            d0, d1 = load_f32_16(xd, xo), load_f32_16(xd, xo + 16)
            if affine:
                e0, e1 = load_f32_16(xs, xo), load_f32_16(xs, xo + 16)
                m0, m1 = splat_at_16(mins, mo + b), splat_at_16(mins, mo + n_blocks + b)
                m2, m3 = splat_at_16(mins, mo + 2 * n_blocks + b), splat_at_16(mins, mo + 3 * n_blocks + b)
                m4, m5 = splat_at_16(mins, mo + 4 * n_blocks + b), splat_at_16(mins, mo + 5 * n_blocks + b)
                m6, m7 = splat_at_16(mins, mo + 6 * n_blocks + b), splat_at_16(mins, mo + 7 * n_blocks + b)
            sg = so + g  # (row j's scale: scales[sg + j * n_groups])
            _group_ends_16(acc, ao, s00, s01, d0, d1, splat_at_16(scales, sg), affine, e0, e1, m0,
                           half)
            _group_ends_16(acc, ao + 32, s10, s11, d0, d1, splat_at_16(scales, sg + n_groups), affine, e0, e1, m1,
                           half)
            _group_ends_16(acc, ao + 64, s20, s21, d0, d1, splat_at_16(scales, sg + 2 * n_groups), affine, e0, e1, m2,
                           half)
            _group_ends_16(acc, ao + 96, s30, s31, d0, d1, splat_at_16(scales, sg + 3 * n_groups), affine, e0, e1, m3,
                           half)
            _group_ends_16(acc, ao + 128, s40, s41, d0, d1, splat_at_16(scales, sg + 4 * n_groups), affine, e0, e1, m4,
                           half)
            _group_ends_16(acc, ao + 160, s50, s51, d0, d1, splat_at_16(scales, sg + 5 * n_groups), affine, e0, e1, m5,
                           half)
            _group_ends_16(acc, ao + 192, s60, s61, d0, d1, splat_at_16(scales, sg + 6 * n_groups), affine, e0, e1, m6,
                           half)
            _group_ends_16(acc, ao + 224, s70, s71, d0, d1, splat_at_16(scales, sg + 7 * n_groups), affine, e0, e1, m7,
                           half)


# A task's tiles through one micro-kernel, compiled on their own for a whole tile (`half` None) and for a last
# tile of at most 16 tokens (`half` True). The micro-kernels test `half is None`, a branch numba prunes by the
# argument's type before it inlines anything, so each form is compiled without the other's code; and the tile of
# rows that calls them (and unpacks the rows) names only one kernel, so numba never copies the other.

@njit(inline="always")
def _task_tiles(kernel_rows, q, n_in, scales, n_groups, mins, affine, group_pairs, g_start, g_end, xp, xd, xs, n_tok,
                tokens, padded, acc):
    """Groups [g_start, g_end) of all of a task's tiles: the whole token tiles, then a last one of at most 16
    tokens in the kernel's half form."""
    whole = tokens if n_tok - (tokens - TOKEN_TILE) > TOKEN_TILE // 2 else tokens - TOKEN_TILE
    if kernel_rows == WIDE_ROWS:
        _rows8_tiles(q, n_in, scales, n_groups, mins, affine, group_pairs, g_start, g_end, xp, xd, xs, 0, whole,
                    tokens, padded, acc, None)
        if whole < tokens:
            _rows8_tiles(q, n_in, scales, n_groups, mins, affine, group_pairs, g_start, g_end, xp, xd, xs, whole,
                        tokens, tokens, padded, acc, True)
    else:
        _rows4_tiles(q, n_in, scales, n_groups, mins, affine, group_pairs, g_start, g_end, xp, xd, xs, 0, whole,
                    tokens, padded, acc, None)
        if whole < tokens:
            _rows4_tiles(q, n_in, scales, n_groups, mins, affine, group_pairs, g_start, g_end, xp, xd, xs, whole,
                        tokens, tokens, padded, acc, True)


@njit(inline="always")
def _gemm_row_tile(task, code, data, xp, xd, xs, n_tok, out, f16, kernel_rows):
    """out[:, r] for the ROWS_PER_TASK rows r of tile `task`, through the micro-kernel of `kernel_rows` rows (a
    constant at each call site: the other kernel folds away)."""
    tokens = xd.shape[1]
    n_in = xp.shape[0] // (2 * tokens) * 2
    n_blocks = n_in // ACTIVATION_BLOCK
    group_pairs = 8 if code == C_Q6_K else 16
    n_groups = n_in // (2 * group_pairs)
    affine = code == C_Q4_1 or code == C_Q5_1 or code == C_Q4_K or code == C_Q5_K
    r0 = task * ROWS_PER_TASK
    n_rows = min(ROWS_PER_TASK, data.shape[0] - r0)
    padded = (n_rows + kernel_rows - 1) // kernel_rows * kernel_rows
    q = np.empty(padded * n_in, np.int16)
    scales = np.empty(padded * n_groups, np.float32)  # (K-quant rows store 8 lanes a super-block: in range)
    mins = np.empty(padded * n_blocks, np.float32)
    for r in range(n_rows):
        _unpack_row(code, data[r0 + r], n_in, q, r * n_in, scales, r * n_groups, mins, r * n_blocks, f16)
    for r in range(n_rows, padded):  # rows past the weight's end: zero codes, results dropped
        q[r * n_in:(r + 1) * n_in] = 0
        scales[r * n_groups:(r + 1) * n_groups] = 0
        mins[r * n_blocks:(r + 1) * n_blocks] = 0
    acc = np.zeros(tokens // TOKEN_TILE * padded * TOKEN_TILE, np.float32)
    chunk_groups = K_CHUNK // (2 * group_pairs)
    for g0 in range(0, n_groups, chunk_groups):  # K_CHUNK values of the rows and tokens at a time: in cache
        g1 = min(g0 + chunk_groups, n_groups)
        _task_tiles(kernel_rows, q, n_in, scales, n_groups, mins, affine, group_pairs, g0, g1, xp, xd, xs, n_tok,
                    tokens, padded, acc)
    for t in range(n_tok):  # a token's row of results at a time: out's rows are far apart (n_out floats)
        a = t // TOKEN_TILE * padded * TOKEN_TILE + t % TOKEN_TILE
        for r in range(n_rows):
            out[t, r0 + r] = acc[a + TOKEN_TILE * r]


# Each tile of rows is compiled on its own, not inlined into the parallel loop: numba's parallel passes copied
# and analysed the whole inlined tile (unpacking of every format, the micro-kernels), most of the compile time.
# (The tile's index as an int64: see ops/attention/cpu.py _attend_encoded.)

@njit(nogil=True)  # (no fastmath: see ops/simd.py)
def _gemm_tile(task, code, data, xp, xd, xs, n_tok, out, f16):
    """_gemm_row_tile through the micro-kernel of ROW_QUAD rows."""
    _gemm_row_tile(task, code, data, xp, xd, xs, n_tok, out, f16, ROW_QUAD)


@njit(nogil=True)
def _gemm_tile_wide(task, code, data, xp, xd, xs, n_tok, out, f16):
    """_gemm_row_tile through the wide micro-kernel (WIDE_ROWS rows); for the interleaved formats (`data`: groups
    of 16 rows, cpu_interleaved.py) group `task` through theirs."""
    if code >= C_Q8_0_X16:
        interleaved_gemm_group(code, data, task, xp, xd, xs, n_tok, out)
    else:
        _gemm_row_tile(task, code, data, xp, xd, xs, n_tok, out, f16, WIDE_ROWS)


@njit(inline="always")
def _gemm_tasks(code, data):
    """The tasks of a weight: its tiles of ROWS_PER_TASK rows, or (interleaved) its groups of 16."""
    return data.shape[0] if code >= C_Q8_0_X16 else (data.shape[0] + ROWS_PER_TASK - 1) // ROWS_PER_TASK


@njit(parallel=True, cache=True, nogil=True)  # (no fastmath: see ops/simd.py)
def gemm_blocks(code, data, xp, xd, xs, n_tok, out, f16):
    """out[t, n] = sum_k x_hat[t, k] * W[n, k] for the weight W (quantized rows `data`, format `code`) and the
    packed activations (xp, xd, xs: `pack_activations`); one parallel region over tiles of ROWS_PER_TASK rows.
    (One weight a call, unlike the GEMV: every prefill weight fills the cores alone, and a tuple of weights
    would compile the kernel again for each tuple length.)"""
    xp, xd, xs, f16 = borrow(xp), borrow(xd), borrow(xs), borrow(f16)
    data, out = borrow(data), borrow(out)
    for task in prange((data.shape[0] + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        _gemm_tile(np.int64(task), code, data, xp, xd, xs, n_tok, out, f16)


@njit(parallel=True, cache=True, nogil=True)
def gemm_blocks_wide(code, data, xp, xd, xs, n_tok, out, f16):
    """gemm_blocks through the wide micro-kernel (8 rows x 32 tokens in 512-bit lanes): the same values bit for
    bit, twice the products an instruction where the machine has AVX-512 (MACHINE_HAS_512_BIT_LANES). Also the
    interleaved formats' GEMM (`code` one of cpu_interleaved.X16_CODES, `data` the groups of rows): one parallel
    loop for both, compiled once."""
    xp, xd, xs, f16 = borrow(xp), borrow(xd), borrow(xs), borrow(f16)
    data, out = borrow(data), borrow(out)
    for task in prange(_gemm_tasks(code, data)):
        _gemm_tile_wide(np.int64(task), code, data, xp, xd, xs, n_tok, out, f16)


@njit(nogil=True)
def _pack_tokens(x, xp, xd, xs, group):
    """Tokens 8 * group .. + 7 of _pack_activations (each pair's eight tokens are one 32-byte write)."""
    n_tok, n_in = x.shape
    tokens = xd.shape[1]
    n_blocks = n_in // ACTIVATION_BLOCK
    pairs = xp.view(np.int32)
    codes = np.zeros((8, n_in), np.int16)
    scales = np.zeros((8, n_blocks), np.float32)
    sums = np.zeros((8, n_blocks), np.float32)
    t0 = 8 * group
    for l in range(min(8, n_tok - t0)):
        quantize_activation_row(x[t0 + l], codes[l], scales[l], sums[l])
    code_pairs = codes.reshape(-1).view(np.int32)
    for p in range(n_in // 2):
        for l in range(8):
            pairs[p * tokens + t0 + l] = code_pairs[l * (n_in // 2) + p]
    for b in range(n_blocks):
        for l in range(8):
            xd[b, t0 + l] = scales[l, b]
            xs[b, t0 + l] = sums[l, b]


@njit(parallel=True, cache=True, nogil=True)
def _pack_activations(x, xp, xd, xs):
    """Token t's codes into xp as int32 pairs xp[p * tokens + t], its block scales and sums into xd[b, t],
    xs[b, t]; the padding tokens past x's rows are zero. Eight tokens a task (the task compiled on its own,
    not copied into the parallel loop)."""
    for group in prange(xd.shape[1] // 8):
        _pack_tokens(x, xp, xd, xs, np.int64(group))


def pack_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x f32 [n_tok, n_in] -> (xp int16 [n_in // 2 * tokens * 2]: code pairs, pair-major; xd, xs f32
    [n_in // 32, tokens]: block scales and block sums of x_hat), tokens = n_tok padded to TOKEN_TILE with
    zero codes."""
    n_tok, n_in = x.shape
    tokens = (n_tok + TOKEN_TILE - 1) // TOKEN_TILE * TOKEN_TILE
    xp = np.empty(n_in * tokens, np.int16)
    xd = np.empty((n_in // ACTIVATION_BLOCK, tokens), np.float32)
    xs = np.empty_like(xd)
    _pack_activations(np.ascontiguousarray(x, dtype=np.float32), xp, xd, xs)
    return xp, xd, xs


def gemm_many(x: np.ndarray, weights: list[tuple[np.ndarray, WeightFormat]], interleaved: list | None = None
              ) -> list[np.ndarray]:
    """[x_hat @ W.T for W in weights] (block-quantized W of GEMM_CODES), x packed once for all of them.
    `interleaved`: for each weight its rows interleaved ((array, layout): cpu_interleaved.py) or None; those
    multiply there (the same values)."""
    xp, xd, xs = pack_activations(x)
    gemm = gemm_blocks_wide if MACHINE_HAS_512_BIT_LANES else gemm_blocks
    outs = []
    for (data, fmt), x16 in zip(weights, interleaved or [None] * len(weights)):
        out = np.empty((x.shape[0], data.shape[0]), np.float32)
        if x16 is not None:
            groups, layout = x16
            gemm_blocks_wide(layout.code, groups, xp, xd, xs, x.shape[0], out, F16_TABLE)
        else:
            gemm(fmt.code, weight_rows(data), xp, xd, xs, x.shape[0], out, F16_TABLE)
        outs.append(out)
    return outs
