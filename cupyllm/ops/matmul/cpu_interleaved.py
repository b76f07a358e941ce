"""Q8_0 and Q5_0 weights with sixteen rows interleaved, for the CPU GEMV: the layouts (their NumPy definitions),
the numba interleaving, and the kernels `cpu_gemv.gemv_blocks` runs on them.

A GGUF row is its blocks one after another (an fp16 scale d, then 32 codes). The GEMV multiplies a block's codes
with the activation's 16-bit codes in int32 lanes of two products each (vpdpwssd); laid out by rows, a block's 32
codes fill one register, so every block of every row ends in a float conversion, a scale product and an FMA, and
every row in a horizontal sum, each once per token: with four tokens (a batched decode) that is most of the
instructions, and the GEMV runs at its compute pace, not the memory's. Interleaved, lane r of a register holds
row r's pair of codes: one vpdpwssd with the activation's pair broadcast is 32 products for 16 rows, a block's
int32 sums land one row a lane, the float work is once per 16 rows' block per token, and the results are 16 lanes
to store. (llama.cpp's CPU backend repacks Q4_0 / Q8_0 / IQ4_NL rows the same way, 4 or 8 rows at a time.)

Group g is rows 16g .. 16g + 15, its x16 blocks one after another; x16 block b holds block b of the 16 rows, the
same bytes as theirs, reordered (r = 0..15 a row, p a pair of values, j = 0..1 one of the pair):

    Q8_0 (544 bytes): d[r] fp16 | q[p][r][j] int8, value 2p + j (p = 0..15)
    Q5_0 (352 bytes): d[r] fp16 | h[r] uint32, row r's high bits 2i in its low half, 2i + 1 in its high half (bit i
                      of each) | qs[p][r][j], row r's code byte 2p + j (p = 0..7): the low nibble value 2p + j, the
                      high nibble value 2p + 16 + j

so that h viewed as 32 int16 lanes has row r's high bit of value 2i + j at bit i of lane 2r + j. A group's row r
multiplies as the sum over blocks b of float32(sum_k q_k * xq_k) * (d[r] * xd[b]), the int32 sum over a block
exact (|q| <= 128, |xq| <= 32767: below 2**27), one FMA a block in order: the same for any number of tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..simd import (MACHINE_HAS_512_BIT_LANES, fma, fmul, iand, ior, ishl, ishr, isub, izeros_16, load_f16_16,
                    load_i8w_32, load_u16_32, load_u8w_32, madd, prefetch, splat_16, splat_pair_32, store_f32, to_f32,
                    zeros_16)

ROWS = 16  # rows interleaved
C_Q8_0_X16, C_Q5_0_X16 = 100, 101  # the kernels' format codes (the GGUF formats' are below 16)


@dataclass(frozen=True)
class InterleavedLayout:
    """A GGUF block format with 16 rows interleaved: what gemv_blocks needs of it (the code its kernels dispatch
    on) and the sizes of a row's block and of an x16 block."""

    name: str
    code: int
    block_bytes: int  # a GGUF block: 32 values of one row

    @property
    def x16_bytes(self) -> int:
        return ROWS * self.block_bytes


LAYOUTS = {"Q8_0": InterleavedLayout("Q8_0x16", C_Q8_0_X16, 34), "Q5_0": InterleavedLayout("Q5_0x16", C_Q5_0_X16, 22)}
X16_CODES = (C_Q8_0_X16, C_Q5_0_X16)


def interleaved_layout(data: np.ndarray, format_name: str) -> InterleavedLayout | None:
    """The layout a weight's rows interleave to, or None: Q8_0 and Q5_0 of a whole number of groups, on a
    machine with 512-bit lanes (the kernels hold 16 rows a register; LLVM would split each in two elsewhere)."""
    layout = LAYOUTS.get(format_name)
    if (layout is None or not MACHINE_HAS_512_BIT_LANES or data.ndim != 2 or data.shape[0] == 0
            or data.shape[0] % ROWS or data.shape[1] % layout.block_bytes):
        return None
    return layout


# --- the layouts' definitions (NumPy) ---------------------------------------------------------------------

def _spread_high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0's qh words -> h: bits 2i in the low half (at bit i), bits 2i + 1 in the high half."""
    bits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    weights = np.uint32(1) << np.arange(16, dtype=np.uint32)
    return (bits[..., 0::2] * weights).sum(-1, dtype=np.uint32) | ((bits[..., 1::2] * weights).sum(-1, dtype=np.uint32)
                                                                   << np.uint32(16))


def _gather_high_bits(h: np.ndarray) -> np.ndarray:
    """The inverse of _spread_high_bits."""
    bits = np.empty(h.shape + (32,), np.uint32)
    bits[..., 0::2] = (h[..., None] >> np.arange(16, dtype=np.uint32)) & 1
    bits[..., 1::2] = (h[..., None] >> np.arange(16, 32, dtype=np.uint32)) & 1
    return (bits << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)


def interleave_rows_reference(data: np.ndarray, layout: InterleavedLayout) -> np.ndarray:
    """Rows uint8 [n_rows, row_bytes] (n_rows a multiple of 16) -> groups uint8 [n_rows / 16, 16 * row_bytes]."""
    n_rows, row_bytes = data.shape
    nb, n_groups = row_bytes // layout.block_bytes, n_rows // ROWS
    blocks = np.asarray(data).reshape(n_groups, ROWS, nb, layout.block_bytes).transpose(0, 2, 1, 3)  # g, b, r, byte
    scales = blocks[..., :2].reshape(n_groups, nb, 2 * ROWS)
    if layout.code == C_Q8_0_X16:
        codes = blocks[..., 2:].reshape(n_groups, nb, ROWS, 16, 2).transpose(0, 1, 3, 2, 4)  # g, b, p, r, j
        parts = [scales, codes.reshape(n_groups, nb, -1)]
    else:
        qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)[..., 0]
        h = _spread_high_bits(qh).view(np.uint8).reshape(n_groups, nb, 4 * ROWS)
        codes = blocks[..., 6:].reshape(n_groups, nb, ROWS, 8, 2).transpose(0, 1, 3, 2, 4)
        parts = [scales, h, codes.reshape(n_groups, nb, -1)]
    return np.concatenate(parts, axis=-1).reshape(n_groups, -1)


def deinterleave_rows_reference(groups: np.ndarray, layout: InterleavedLayout) -> np.ndarray:
    """The inverse of interleave_rows_reference: the GGUF's rows again."""
    n_groups = groups.shape[0]
    nb = groups.shape[1] // layout.x16_bytes
    x16 = np.asarray(groups).reshape(n_groups, nb, layout.x16_bytes)
    blocks = np.empty((n_groups, nb, ROWS, layout.block_bytes), np.uint8)
    blocks[..., :2] = x16[..., :2 * ROWS].reshape(n_groups, nb, ROWS, 2)
    if layout.code == C_Q8_0_X16:
        codes = x16[..., 2 * ROWS:].reshape(n_groups, nb, 16, ROWS, 2).transpose(0, 1, 3, 2, 4)
        blocks[..., 2:] = codes.reshape(n_groups, nb, ROWS, 32)
    else:
        h = np.ascontiguousarray(x16[..., 2 * ROWS:6 * ROWS]).view(np.uint32)
        blocks[..., 2:6] = _gather_high_bits(h).view(np.uint8).reshape(n_groups, nb, ROWS, 4)
        codes = x16[..., 6 * ROWS:].reshape(n_groups, nb, 8, ROWS, 2).transpose(0, 1, 3, 2, 4)
        blocks[..., 6:] = codes.reshape(n_groups, nb, ROWS, 16)
    return blocks.transpose(0, 2, 1, 3).reshape(n_groups * ROWS, -1)


# --- the interleaving (numba: a model's output head is hundreds of MB) -------------------------------------

@njit(inline="always")
def _even_bits(v):
    """Bits 0, 2, .., 30 of v (int64 below 2**32) as bits 0..15."""
    v &= 0x55555555
    v = (v | (v >> 1)) & 0x33333333
    v = (v | (v >> 2)) & 0x0F0F0F0F
    v = (v | (v >> 4)) & 0x00FF00FF
    return (v | (v >> 8)) & 0xFFFF


@njit(parallel=True, cache=True, nogil=True)
def _interleave(code, data, out):
    """interleave_rows_reference in 16-bit words (a block's fields all start at even bytes)."""
    words = 17 if code == C_Q8_0_X16 else 11  # a block's 16-bit words
    x16_words, nb = ROWS * words, data.shape[1] // (2 * words)
    for g in prange(out.shape[0]):
        group = out[g].view(np.uint16)
        for r in range(ROWS):
            row = data[ROWS * g + r].view(np.uint16)
            for b in range(nb):
                o, src = b * x16_words, b * words
                group[o + r] = row[src]  # d
                if code == C_Q8_0_X16:
                    for p in range(16):
                        group[o + 16 + 16 * p + r] = row[src + 1 + p]
                else:
                    qh = np.int64(row[src + 1]) | (np.int64(row[src + 2]) << 16)
                    group[o + 16 + 2 * r] = np.uint16(_even_bits(qh))
                    group[o + 17 + 2 * r] = np.uint16(_even_bits(qh >> 1))
                    for p in range(8):
                        group[o + 48 + 16 * p + r] = row[src + 3 + p]


def interleave_rows(data: np.ndarray, layout: InterleavedLayout) -> np.ndarray:
    """interleave_rows_reference's bytes, in parallel; read-only, as the GEMV takes its weights."""
    out = np.empty((data.shape[0] // ROWS, data.shape[1] * ROWS), np.uint8)
    rows = np.ascontiguousarray(data).view()
    rows.flags.writeable = False  # (one numba type, the memory-mapped GGUF's, whatever the caller's array)
    _interleave(layout.code, rows, out)
    out.flags.writeable = False
    return out


# --- the kernels: one, two or four tokens at a time (gemv_blocks passes x1..x3 None for fewer) -------------

@njit(inline="always")
def _q8_0_sum(group, o, xq, b):
    """x16 block b of a Q8_0 group (at byte o) times one token's codes: 16 vpdpwssd, the 16 rows' int32 sums."""
    s = izeros_16()
    for p in range(16):
        s = madd(s, load_i8w_32(group, o + 32 + 32 * p), splat_pair_32(xq, 32 * b + 2 * p))
    return s


@njit(inline="always")
def _q5_0_codes(group, o, h, h4, p):
    """Pairs p and p + 8 of a Q5_0 x16 block's values, 16 rows as int16 lanes (code - 16); h4: h << 4 (its high
    bits 0..7 at bits 4..11: bit p of h is bit 4 of h4 >> p; bit p + 8 is bit 4 of h >> p + 4)."""
    v = load_u8w_32(group, o + 96 + 32 * p)
    low = ior(iand(v, 15), iand(ishr(h4, p), 16))
    high = ior(ishr(v, 4), iand(ishr(h, p + 4), 16))
    return isub(low, 16), isub(high, 16)


@njit(inline="always")
def _step(acc, s, d, xd, b):
    return fma(to_f32(s), fmul(d, splat_16(xd[b])), acc)


@njit(inline="always")
def _q8_0_block(group, o, b, d, x0, x1, x2, x3, a0, a1, a2, a3):
    a0 = _step(a0, _q8_0_sum(group, o, x0[0], b), d, x0[1], b)
    if x1 is not None:
        a1 = _step(a1, _q8_0_sum(group, o, x1[0], b), d, x1[1], b)
    if x2 is not None:
        a2 = _step(a2, _q8_0_sum(group, o, x2[0], b), d, x2[1], b)
        a3 = _step(a3, _q8_0_sum(group, o, x3[0], b), d, x3[1], b)
    return a0, a1, a2, a3


@njit(inline="always")
def _q5_0_block(group, o, b, d, x0, x1, x2, x3, a0, a1, a2, a3):
    """The Q5_0 block's codes unpacked once for the tokens, each token's sum in its own int32 lanes."""
    h = load_u16_32(group, o + 32)
    h4 = ishl(h, 4)
    s0, s1, s2, s3 = izeros_16(), izeros_16(), izeros_16(), izeros_16()
    for p in range(8):
        low, high = _q5_0_codes(group, o, h, h4, p)
        k = 32 * b + 2 * p
        s0 = madd(madd(s0, low, splat_pair_32(x0[0], k)), high, splat_pair_32(x0[0], k + 16))
        if x1 is not None:
            s1 = madd(madd(s1, low, splat_pair_32(x1[0], k)), high, splat_pair_32(x1[0], k + 16))
        if x2 is not None:
            s2 = madd(madd(s2, low, splat_pair_32(x2[0], k)), high, splat_pair_32(x2[0], k + 16))
            s3 = madd(madd(s3, low, splat_pair_32(x3[0], k)), high, splat_pair_32(x3[0], k + 16))
    a0 = _step(a0, s0, d, x0[1], b)
    if x1 is not None:
        a1 = _step(a1, s1, d, x1[1], b)
    if x2 is not None:
        a2 = _step(a2, s2, d, x2[1], b)
        a3 = _step(a3, s3, d, x3[1], b)
    return a0, a1, a2, a3


def _x16_rows(block, x16_bytes):
    """The loop of `block` (_q8_0_block or _q5_0_block) over a thread's groups, compiled on its own."""
    @njit(nogil=True)  # (no fastmath: see ops/simd.py)
    def rows(groups, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, ahead):
        nb = x0[0].shape[0] // 32
        for g in range(first, end):
            group = groups[g]
            a0, a1, a2, a3 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
            for b in range(nb):
                o = b * x16_bytes
                for line in range(0, x16_bytes, 64):
                    prefetch(group, o + ahead + line)
                a0, a1, a2, a3 = block(group, o, b, load_f16_16(group, o), x0, x1, x2, x3, a0, a1, a2, a3)
            store_f32(out[t0], ROWS * g, a0)
            if x1 is not None:
                store_f32(out[t1], ROWS * g, a1)
            if x2 is not None:
                store_f32(out[t2], ROWS * g, a2)
                store_f32(out[t3], ROWS * g, a3)
    return rows


_ROWS_Q8_0_X16 = _x16_rows(_q8_0_block, LAYOUTS["Q8_0"].x16_bytes)
_ROWS_Q5_0_X16 = _x16_rows(_q5_0_block, LAYOUTS["Q5_0"].x16_bytes)


@njit(nogil=True)
def interleaved_gemv(code, groups, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, ahead):
    """out[t, 16g + r] = row 16g + r's dot product with x_hat of token t for the groups g in [first, end) and the
    tokens t0 (x0), t1 (x1), t2, t3 (x: (xq, xd) of gemv_blocks' activation rows; x1 None: one token, x2 None:
    two). Each token's chain of FMAs is the same whatever the others: its values are the one-token run's."""
    if code == C_Q8_0_X16:
        _ROWS_Q8_0_X16(groups, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, ahead)
    else:
        _ROWS_Q5_0_X16(groups, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, ahead)
