"""Weights with sixteen rows interleaved for the CPU GEMV (Q8_0, Q5_0, Q4_K, Q6_K): the layouts (their NumPy
definitions), the numba interleaving, and the kernels `cpu_gemv.gemv_blocks` runs on them.

A GGUF row is its blocks one after another. The GEMV multiplies a block's integer codes with the activation's
16-bit codes in int32 lanes of two products each (vpdpwssd); laid out by rows, a register holds one row's codes,
so every block (or sub-block) of every row ends in a float conversion, a scale product and an FMA, and every row
in a horizontal sum, each once per token, beside the unpacking of the codes' bits: the GEMV runs at its
instructions' pace, not the memory's, and four tokens (a batched decode) cost twice one. Interleaved, lane r of a
register holds row r's pair of codes: one vpdpwssd with the activation's pair broadcast is 32 products for 16
rows, a block's int32 sums land one row a lane, the unpacking and the float work are once per 16 rows' block,
and the results are 16 lanes to store. (llama.cpp's CPU backend repacks Q4_0 / Q4_K / IQ4_NL / Q8_0 rows the
same way, 4 or 8 rows at a time.)

Group g is rows 16g .. 16g + 15, its x16 blocks one after another; x16 block b holds block b of the 16 rows, the
same bytes as theirs, reordered: each field of the GGUF block (`LAYOUTS`' fields, in x16 order) for the 16
rows, r = 0..15 a row, j = 0..1 one byte of a pair:

    Q8_0 (544 bytes):  d[r][2] | q[p][r][j]            value 2p + j                                  (p < 16)
    Q5_0 (352 bytes):  d[r][2] | h[r][4] | qs[p][r][j]  low nibble value 2p + j, high 2p + 16 + j     (p < 8)
    Q4_K (2304 bytes): d[r][2] | dmin[r][2] | scales[s][r] (s < 12) | qs[i][p][r][j]: byte 32i + 2p + j,
                       low nibble value 64i + 2p + j, high nibble value 64i + 32 + 2p + j     (i < 4, p < 16)
    Q6_K (3360 bytes): d[r][2] | scales[s][r] (s < 16) | codes[h][p][c][r][j]: c = 0, 1: ql byte 64h + 32c + 2p
                       + j, c = 2: qh byte 32h + 2p + j (the bytes of one kernel step side by side)  (h < 2, p < 16)

Q5_0's h is its qh word with the high bits of values 2i in its low half (at bit i) and of 2i + 1 in its high half,
so that h viewed as 32 int16 lanes has the high bit of row r's value 2i + j at bit i of lane 2r + j. Each row
multiplies as the sum over its (sub-)blocks of float32(int32 sum of codes * xq) * (scale * xd) (minus the
K-quant min times the activation's block sum), one FMA at a time in order: the same for any number of tokens.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..simd import (MACHINE_HAS_512_BIT_LANES, borrow, fma, fmul, fsub, iand, ior, ishl, ishr, isub, izeros_16,
                    load_f16_16, load_f32_16, load_i16_32, load_i8_16, load_i8w_32, load_u16_32, load_u8_16,
                    load_u8w_32, madd, prefetch, splat_16, splat_pair_32, store_f32, store_i16, to_f32, zeros_16)

ROWS = 16  # rows interleaved
C_Q8_0_X16, C_Q5_0_X16, C_Q4_K_X16, C_Q6_K_X16 = 100, 101, 102, 103  # (the GGUF formats' codes are below 16)
X16_CODES = (C_Q8_0_X16, C_Q5_0_X16, C_Q4_K_X16, C_Q6_K_X16)


@dataclass(frozen=True, eq=False)
class InterleavedLayout:
    """A GGUF block format with 16 rows interleaved: the code the kernels dispatch on, the GGUF block's size and
    values, and its fields in x16 order, each (the GGUF block's bytes it holds, an array of their offsets; how
    many of its last dimensions follow the row index)."""

    name: str
    code: int
    block_bytes: int
    block_values: int
    fields: tuple

    @property
    def x16_bytes(self) -> int:
        return ROWS * self.block_bytes


def _bytes(start: int, *dims: int) -> np.ndarray:
    """The offsets start, start + 1, ... in an array of shape dims."""
    return np.arange(start, start + int(np.prod(dims))).reshape(dims)


def _q6_k_codes() -> np.ndarray:
    """Q6_K's code bytes by half h, pair p, then ql byte 64h + 2p + j, ql byte 64h + 32 + 2p + j and qh byte
    128 + 32h + 2p + j: the three bytes a kernel step reads, side by side."""
    h, p, j = np.arange(2)[:, None, None], np.arange(16)[None, :, None], np.arange(2)[None, None, :]
    return np.stack([64 * h + 2 * p + j, 64 * h + 32 + 2 * p + j, 128 + 32 * h + 2 * p + j], axis=2)


Q5_0_HIGH_BITS = _bytes(2, 4)  # Q5_0's qh: the one field that is more than reordered
LAYOUTS = {
    "Q8_0": InterleavedLayout("Q8_0x16", C_Q8_0_X16, 34, 32, ((_bytes(0, 2), 1), (_bytes(2, 16, 2), 1))),
    "Q5_0": InterleavedLayout("Q5_0x16", C_Q5_0_X16, 22, 32,
                              ((_bytes(0, 2), 1), (Q5_0_HIGH_BITS, 1), (_bytes(6, 8, 2), 1))),
    "Q4_K": InterleavedLayout("Q4_Kx16", C_Q4_K_X16, 144, 256,
                              ((_bytes(0, 2), 1), (_bytes(2, 2), 1), (_bytes(4, 12), 0), (_bytes(16, 4, 16, 2), 1))),
    "Q6_K": InterleavedLayout("Q6_Kx16", C_Q6_K_X16, 210, 256,
                              ((_bytes(208, 2), 1), (_bytes(192, 16), 0), (_q6_k_codes(), 1))),
}


def interleaved_layout(data: np.ndarray, format_name: str) -> InterleavedLayout | None:
    """The layout a weight's rows interleave to, or None: a whole number of groups of a format in LAYOUTS, on a
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
    return ((bits[..., 0::2] * weights).sum(-1, dtype=np.uint32)
            | ((bits[..., 1::2] * weights).sum(-1, dtype=np.uint32) << np.uint32(16)))


def _gather_high_bits(h: np.ndarray) -> np.ndarray:
    """The inverse of _spread_high_bits."""
    bits = np.empty(h.shape + (32,), np.uint32)
    bits[..., 0::2] = (h[..., None] >> np.arange(16, dtype=np.uint32)) & 1
    bits[..., 1::2] = (h[..., None] >> np.arange(16, 32, dtype=np.uint32)) & 1
    return (bits << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)


def _high_bits(field: np.ndarray, convert) -> np.ndarray:
    """A Q5_0 field of 4 bytes a row, its words converted (_spread_high_bits / _gather_high_bits)."""
    return convert(np.ascontiguousarray(field).view(np.uint32)).view(np.uint8)


def interleave_rows_reference(data: np.ndarray, layout: InterleavedLayout, spread: bool = True) -> np.ndarray:
    """Rows [n_rows, row_bytes] (n_rows a multiple of 16) -> groups [n_rows / 16, 16 * row_bytes]. (spread
    False: Q5_0's high bits as they are, for an array of byte indices.)"""
    n_rows, row_bytes = data.shape
    nb, n_groups = row_bytes // layout.block_bytes, n_rows // ROWS
    blocks = np.asarray(data).reshape(n_groups, ROWS, nb, layout.block_bytes).transpose(0, 2, 1, 3)  # g, b, r, byte
    parts = []
    for offsets, inner in layout.fields:
        field = blocks[..., offsets]  # g, b, r, *dims
        if spread and offsets is Q5_0_HIGH_BITS:
            field = _high_bits(field, _spread_high_bits)
        field = np.moveaxis(field, 2, 2 + offsets.ndim - inner)
        parts.append(field.reshape(n_groups, nb, -1))
    return np.concatenate(parts, axis=-1).reshape(n_groups, -1)


def deinterleave_rows_reference(groups: np.ndarray, layout: InterleavedLayout) -> np.ndarray:
    """The inverse of interleave_rows_reference: the GGUF's rows again."""
    n_groups = groups.shape[0]
    nb = groups.shape[1] // layout.x16_bytes
    x16 = np.asarray(groups).reshape(n_groups, nb, layout.x16_bytes)
    blocks = np.empty((n_groups, nb, ROWS, layout.block_bytes), groups.dtype)
    at = 0
    for offsets, inner in layout.fields:
        dims = offsets.shape
        order = dims[:len(dims) - inner] + (ROWS,) + dims[len(dims) - inner:]
        field = x16[..., at:at + ROWS * offsets.size].reshape(n_groups, nb, *order)
        field = np.moveaxis(field, 2 + len(dims) - inner, 2)  # g, b, r, *dims
        if offsets is Q5_0_HIGH_BITS:
            field = _high_bits(field, _gather_high_bits)
        blocks[..., offsets] = field
        at += ROWS * offsets.size
    return blocks.transpose(0, 2, 1, 3).reshape(n_groups * ROWS, -1)


def x16_byte_order(layout: InterleavedLayout) -> np.ndarray:
    """For each byte of an x16 block, the byte of the 16 rows' blocks (row r's byte s: r * block_bytes + s) that
    it holds (Q5_0's h: qh's bytes, before the spreading)."""
    source = np.arange(ROWS * layout.block_bytes, dtype=np.int32).reshape(ROWS, layout.block_bytes)
    return interleave_rows_reference(source, layout, spread=False).reshape(-1)


# --- the interleaving (numba: a model's output head is hundreds of MB) -------------------------------------

@functools.cache
def _places(layout: InterleavedLayout) -> np.ndarray:
    """Where each byte of the 16 rows' blocks goes in the x16 block: x16_byte_order's inverse (once a layout)."""
    return np.argsort(x16_byte_order(layout)).astype(np.int32)


@njit(inline="always")
def _even_bits(v):
    """Bits 0, 2, .., 30 of v (int64 below 2**32) as bits 0..15."""
    v &= 0x55555555
    v = (v | (v >> 1)) & 0x33333333
    v = (v | (v >> 2)) & 0x0F0F0F0F
    v = (v | (v >> 4)) & 0x00FF00FF
    return (v | (v >> 8)) & 0xFFFF


@njit(cache=True, nogil=True)
def _interleave_group(data, place, block_bytes, spread_at, out, g):
    """Group g's x16 blocks: byte s of row r's block b goes to byte place[r * block_bytes + s] of x16 block b
    (each row read in order, its bytes scattered within the x16 block, which stays in the L1 cache); then
    (spread_at >= 0) Q5_0's 16 qh words at byte spread_at of each x16 block spread (_spread_high_bits)."""
    x16_bytes = place.shape[0]
    group = out[g]
    for b in range(data.shape[1] // block_bytes):
        o, src = b * x16_bytes, b * block_bytes
        for r in range(ROWS):
            row = data[ROWS * g + r]
            for s in range(block_bytes):
                group[o + place[r * block_bytes + s]] = row[src + s]
        if spread_at >= 0:
            for r in range(ROWS):
                at = o + spread_at + 4 * r
                qh = (np.int64(group[at]) | (np.int64(group[at + 1]) << 8) | (np.int64(group[at + 2]) << 16)
                      | (np.int64(group[at + 3]) << 24))
                h = _even_bits(qh) | (_even_bits(qh >> 1) << 16)
                for k in range(4):
                    group[at + k] = np.uint8((h >> (8 * k)) & 255)


@njit(parallel=True, cache=True, nogil=True)
def _interleave(data, place, block_bytes, spread_at, out):
    """_interleave_group for every group, in parallel (the loop alone: numba's parallel passes copy and analyse
    what a prange body holds, so the work sits in a function compiled on its own)."""
    for g in prange(out.shape[0]):
        _interleave_group(data, place, block_bytes, spread_at, out, np.int64(g))


def interleave_rows(data: np.ndarray, layout: InterleavedLayout, chunk_bytes: int | None = None,
                    after_chunk=None) -> np.ndarray:
    """interleave_rows_reference's bytes, in parallel; read-only, as the kernels take their weights. With
    `chunk_bytes`, about that many bytes of rows at a time, each chunk's rows given to `after_chunk` once they are
    copied (the CPU backend releases their pages there, so a big weight is never resident twice)."""
    out = np.empty((data.shape[0] // ROWS, data.shape[1] * ROWS), np.uint8)
    rows = np.ascontiguousarray(data).view()
    rows.flags.writeable = False  # (one numba type, the memory-mapped GGUF's, whatever the caller's array)
    spread_at = 2 * ROWS if layout.code == C_Q5_0_X16 else -1  # (h follows d)
    groups = out.shape[0] if chunk_bytes is None else max(1, chunk_bytes // max(1, ROWS * data.shape[1]))
    for first in range(0, out.shape[0], groups):
        end = min(first + groups, out.shape[0])
        _interleave(rows[ROWS * first:ROWS * end], _places(layout), layout.block_bytes, spread_at, out[first:end])
        if after_chunk is not None:
            after_chunk(data[ROWS * first:ROWS * end])
    out.flags.writeable = False
    return out


# --- the kernels: one or four tokens at a time -------------------------------------------------------------
# A token's activation rows: xq (16-bit codes), xd (their scales), xs (their block sums), one per token; for one
# token the kernels are compiled with n = 1 and the other tokens' arrays are stand-ins (never read). (The
# arrays are unpacked from gemv_blocks' tuples once per call: a tuple's item taken inside the loops cost numba a
# reference count call each time.)

@njit(inline="always")
def _prefetch_lines(group, at, start, stop):
    """Ask for the cache lines of group[at + start:at + stop] (at: an x16 block's offset plus the distance
    ahead); the K-quants' kernels ask for a quarter of their x16 block at a time."""
    for line in range(start, stop, 64):
        prefetch(group, at + line)


@njit(inline="always")
def _step(acc, s, scale, xd, blk):
    """acc + float(s) * (scale * xd[blk]): a (sub-)block's int32 sums into the float sums."""
    return fma(to_f32(s), fmul(scale, splat_16(xd[blk])), acc)


@njit(inline="always")
def _q8_0_sum(group, o, xq, b):
    s = izeros_16()
    for p in range(16):
        s = madd(s, load_i8w_32(group, o + 32 + 32 * p), splat_pair_32(xq, 32 * b + 2 * p))
    return s


@njit(inline="always")
def _q8_0_block(n, group, o, b, q0, q1, q2, q3, d0, d1, d2, d3, s0, s1, s2, s3, a0, a1, a2, a3, ahead):
    _prefetch_lines(group, o + ahead, 0, 544)
    d = load_f16_16(group, o)
    a0 = _step(a0, _q8_0_sum(group, o, q0, b), d, d0, b)
    if n == 4:
        a1 = _step(a1, _q8_0_sum(group, o, q1, b), d, d1, b)
        a2 = _step(a2, _q8_0_sum(group, o, q2, b), d, d2, b)
        a3 = _step(a3, _q8_0_sum(group, o, q3, b), d, d3, b)
    return a0, a1, a2, a3


@njit(inline="always")
def _q5_0_codes(v, h, h4, p):
    """Step p's codes (code - 16, int16 lanes) from its nibble bytes v (the x16 block's bytes 96 + 32p ..):
    values 2p + j (low nibbles) and 2p + 16 + j (high), their 5th bits from h (the block's qh words) and
    h4 = h << 4 (h's bits 0..7 at bits 4..11: bit p is bit 4 of h4 >> p; bit p + 8 is bit 4 of h >> p + 4)."""
    return isub(ior(iand(v, 15), iand(ishr(h4, p), 16)), 16), isub(ior(ishr(v, 4), iand(ishr(h, p + 4), 16)), 16)


@njit(inline="always")
def _q5_0_block(n, group, o, b, q0, q1, q2, q3, d0, d1, d2, d3, s0, s1, s2, s3, a0, a1, a2, a3, ahead):
    """The block's codes unpacked once for the tokens (code - 16, int16 lanes), each token's sums its own."""
    _prefetch_lines(group, o + ahead, 0, 352)
    d, h = load_f16_16(group, o), load_u16_32(group, o + 32)
    h4 = ishl(h, 4)
    i0, i1, i2, i3 = izeros_16(), izeros_16(), izeros_16(), izeros_16()
    for p in range(8):
        low, high = _q5_0_codes(load_u8w_32(group, o + 96 + 32 * p), h, h4, p)
        k = 32 * b + 2 * p
        i0 = madd(madd(i0, low, splat_pair_32(q0, k)), high, splat_pair_32(q0, k + 16))
        if n == 4:
            i1 = madd(madd(i1, low, splat_pair_32(q1, k)), high, splat_pair_32(q1, k + 16))
            i2 = madd(madd(i2, low, splat_pair_32(q2, k)), high, splat_pair_32(q2, k + 16))
            i3 = madd(madd(i3, low, splat_pair_32(q3, k)), high, splat_pair_32(q3, k + 16))
    a0 = _step(a0, i0, d, d0, b)
    if n == 4:
        a1 = _step(a1, i1, d, d1, b)
        a2 = _step(a2, i2, d, d2, b)
        a3 = _step(a3, i3, d, d3, b)
    return a0, a1, a2, a3


@njit(inline="always")
def _q4_k_scales(group, o, j, d, dmin):
    """Sub-block j's scale d * sc and min dmin * m for the 16 rows, sc and m its 6-bit codes (llama.cpp's
    get_scale_min_k4) from the rows' scale bytes j, j + 4 and (j >= 4) j - 4."""
    b_j, b_j4 = load_u8_16(group, o + 64 + 16 * j), load_u8_16(group, o + 64 + 16 * ((j + 4) % 12))
    if j < 4:
        sc, m = iand(b_j, 63), iand(b_j4, 63)
    else:
        b_jm4 = load_u8_16(group, o + 64 + 16 * (j - 4))
        sc, m = ior(iand(b_j4, 15), ishl(ishr(b_jm4, 6), 4)), ior(ishr(b_j4, 4), ishl(ishr(b_j, 6), 4))
    return fmul(d, to_f32(sc)), fmul(dmin, to_f32(m))


@njit(inline="always")
def _k_step(acc, s, scale, mins, xd, xs, blk):
    """_step, then minus mins * the activation's block sum (a K-quant sub-block's min)."""
    return fma(mins, splat_16(-xs[blk]), _step(acc, s, scale, xd, blk))


@njit(inline="always")
def _q4_k_block(n, group, o, sb, q0, q1, q2, q3, d0, d1, d2, d3, s0, s1, s2, s3, a0, a1, a2, a3, ahead):
    """A super-block: each pair of sub-blocks' codes unpacked once for the tokens (the low and high nibbles of
    the same bytes), then each token's two sums scaled."""
    d, dmin = load_f16_16(group, o), load_f16_16(group, o + 32)
    for i in range(4):
        _prefetch_lines(group, o + ahead, 576 * i, 576 * (i + 1))  # (a quarter of the 2304 bytes)
        l0, h0, l1, h1 = izeros_16(), izeros_16(), izeros_16(), izeros_16()
        l2, h2, l3, h3 = izeros_16(), izeros_16(), izeros_16(), izeros_16()
        for p in range(16):
            v = load_u8w_32(group, o + 256 + 512 * i + 32 * p)
            low, high = iand(v, 15), ishr(v, 4)
            k = 256 * sb + 64 * i + 2 * p
            l0, h0 = madd(l0, low, splat_pair_32(q0, k)), madd(h0, high, splat_pair_32(q0, k + 32))
            if n == 4:
                l1, h1 = madd(l1, low, splat_pair_32(q1, k)), madd(h1, high, splat_pair_32(q1, k + 32))
                l2, h2 = madd(l2, low, splat_pair_32(q2, k)), madd(h2, high, splat_pair_32(q2, k + 32))
                l3, h3 = madd(l3, low, splat_pair_32(q3, k)), madd(h3, high, splat_pair_32(q3, k + 32))
        j, blk = 2 * i, 8 * sb + 2 * i
        lo_scale, lo_min = _q4_k_scales(group, o, j, d, dmin)
        hi_scale, hi_min = _q4_k_scales(group, o, j + 1, d, dmin)
        a0 = _k_step(_k_step(a0, l0, lo_scale, lo_min, d0, s0, blk), h0, hi_scale, hi_min, d0, s0, blk + 1)
        if n == 4:
            a1 = _k_step(_k_step(a1, l1, lo_scale, lo_min, d1, s1, blk), h1, hi_scale, hi_min, d1, s1, blk + 1)
            a2 = _k_step(_k_step(a2, l2, lo_scale, lo_min, d2, s2, blk), h2, hi_scale, hi_min, d2, s2, blk + 1)
            a3 = _k_step(_k_step(a3, l3, lo_scale, lo_min, d3, s3, blk), h3, hi_scale, hi_min, d3, s3, blk + 1)
    return a0, a1, a2, a3


@njit(inline="always")
def _q6_k_codes(group, o, h, p):
    """Values 128h + 32q + 2p + j (q = 0..3) of the 16 rows, as int16 lanes (code - 32)."""
    at = o + 288 + 96 * (16 * h + p)
    a = load_u8w_32(group, at)  # ql bytes 64h + 2p + j
    b = load_u8w_32(group, at + 32)  # ql bytes 64h + 32 + 2p + j
    hi = load_u8w_32(group, at + 64)  # qh bytes 32h + 2p + j: 2 high bits each of q = 0..3
    return (isub(ior(iand(a, 15), iand(ishl(hi, 4), 48)), 32), isub(ior(iand(b, 15), iand(ishl(hi, 2), 48)), 32),
            isub(ior(ishr(a, 4), iand(hi, 48)), 32), isub(ior(ishr(b, 4), iand(ishr(hi, 2), 48)), 32))


@njit(inline="always")
def _q6_k_sums(v0, v1, v2, v3, xq, k, i0, i1, i2, i3):
    return (madd(i0, v0, splat_pair_32(xq, k)), madd(i1, v1, splat_pair_32(xq, k + 32)),
            madd(i2, v2, splat_pair_32(xq, k + 64)), madd(i3, v3, splat_pair_32(xq, k + 96)))


@njit(inline="always")
def _q6_k_scaled(scales, d, xd, blk, i0, i1, i2, i3, acc):
    """acc + a token's four sums (values 128h + 32q + 16 half .. + 15, q = 0..3), each by its 16 values' scale
    (scales: the four scales' int8 lanes)."""
    acc = _step(acc, i0, fmul(d, to_f32(scales[0])), xd, blk)
    acc = _step(acc, i1, fmul(d, to_f32(scales[1])), xd, blk + 1)
    acc = _step(acc, i2, fmul(d, to_f32(scales[2])), xd, blk + 2)
    return _step(acc, i3, fmul(d, to_f32(scales[3])), xd, blk + 3)


@njit(inline="always")
def _q6_k_block(n, group, o, sb, q0, q1, q2, q3, d0, d1, d2, d3, s0, s1, s2, s3, a0, a1, a2, a3, ahead):
    """A super-block by halves (h) and by the 16 values of each scale (half): the codes unpacked once for the
    tokens, four sums a token (one per 32-value block of the half)."""
    d = load_f16_16(group, o)
    for h in range(2):
        for half in range(2):
            part = 2 * h + half  # (the codes of a quarter; the first with the scales)
            _prefetch_lines(group, o + ahead, 0 if part == 0 else 288 + 768 * part, 288 + 768 * (part + 1))
            z = izeros_16()
            t00, t01, t02, t03, t10, t11, t12, t13 = z, z, z, z, z, z, z, z
            t20, t21, t22, t23, t30, t31, t32, t33 = z, z, z, z, z, z, z, z
            for p in range(8 * half, 8 * half + 8):
                v0, v1, v2, v3 = _q6_k_codes(group, o, h, p)
                k = 256 * sb + 128 * h + 2 * p
                t00, t01, t02, t03 = _q6_k_sums(v0, v1, v2, v3, q0, k, t00, t01, t02, t03)
                if n == 4:
                    t10, t11, t12, t13 = _q6_k_sums(v0, v1, v2, v3, q1, k, t10, t11, t12, t13)
                    t20, t21, t22, t23 = _q6_k_sums(v0, v1, v2, v3, q2, k, t20, t21, t22, t23)
                    t30, t31, t32, t33 = _q6_k_sums(v0, v1, v2, v3, q3, k, t30, t31, t32, t33)
            at = o + 32 + 16 * (8 * h + half)
            scales = (load_i8_16(group, at), load_i8_16(group, at + 32), load_i8_16(group, at + 64),
                      load_i8_16(group, at + 96))
            blk = 8 * sb + 4 * h
            a0 = _q6_k_scaled(scales, d, d0, blk, t00, t01, t02, t03, a0)
            if n == 4:
                a1 = _q6_k_scaled(scales, d, d1, blk, t10, t11, t12, t13, a1)
                a2 = _q6_k_scaled(scales, d, d2, blk, t20, t21, t22, t23, a2)
                a3 = _q6_k_scaled(scales, d, d3, blk, t30, t31, t32, t33, a3)
    return a0, a1, a2, a3


def _x16_rows(block, layout, n):
    """The loop of `block` (a _*_block above) over a thread's groups for n = 1 or 4 tokens, compiled on its own
    (n a constant: the other tokens' code is pruned)."""
    x16_bytes, block_values = layout.x16_bytes, layout.block_values

    @njit(nogil=True)  # (no fastmath: see ops/simd.py)
    def rows(groups, first, end, x0, x1, x2, x3, out, t0, t1, t2, t3, ahead):
        q0, d0, s0 = x0
        q1, d1, s1 = x1
        q2, d2, s2 = x2
        q3, d3, s3 = x3
        nb = q0.shape[0] // block_values
        for g in range(first, end):
            group = groups[g]
            a0, a1, a2, a3 = zeros_16(), zeros_16(), zeros_16(), zeros_16()
            for b in range(nb):
                a0, a1, a2, a3 = block(n, group, b * x16_bytes, b, q0, q1, q2, q3, d0, d1, d2, d3, s0, s1, s2, s3,
                                       a0, a1, a2, a3, ahead)
            store_f32(out[t0], ROWS * g, a0)
            if n == 4:
                store_f32(out[t1], ROWS * g, a1)
                store_f32(out[t2], ROWS * g, a2)
                store_f32(out[t3], ROWS * g, a3)
    return rows


def _x16_tokens(rows_1, rows_4):
    """The token schedule of gemv_blocks on an interleaved weight, over `rows_1` / `rows_4` (one format's
    kernels): four tokens at a time (three as four, the last one twice), then two (as four), then one; group by
    group past four tokens, so that a group is read from memory once for all of them."""
    @njit(nogil=True)
    def tokens(groups, first, end, xq, xd, xsum, out, ahead):
        n_tok = xq.shape[0]
        step = 1 if n_tok > 4 else max(end - first, 1)
        n_fours = (n_tok + 1) // 4
        for a in range(first, end, step):
            b = min(a + step, end)
            for f in range(n_fours):
                t, last = 4 * f, min(4 * f + 3, n_tok - 1)
                rows_4(groups, a, b, (xq[t], xd[t], xsum[t]), (xq[t + 1], xd[t + 1], xsum[t + 1]),
                       (xq[t + 2], xd[t + 2], xsum[t + 2]), (xq[last], xd[last], xsum[last]), out, t, t + 1, t + 2,
                       last, ahead)
            u = 4 * n_fours
            if n_tok - u == 2:
                x0, x1 = (xq[u], xd[u], xsum[u]), (xq[u + 1], xd[u + 1], xsum[u + 1])
                rows_4(groups, a, b, x0, x1, x0, x1, out, u, u + 1, u, u + 1, ahead)
                u += 2
            for v in range(u, n_tok):
                x0 = (xq[v], xd[v], xsum[v])
                rows_1(groups, a, b, x0, x0, x0, x0, out, v, v, v, v, ahead)
    return tokens


_BLOCKS = {"Q8_0": _q8_0_block, "Q5_0": _q5_0_block, "Q4_K": _q4_k_block, "Q6_K": _q6_k_block}
_TOKENS_Q8_0, _TOKENS_Q5_0, _TOKENS_Q4_K, _TOKENS_Q6_K = (
    _x16_tokens(_x16_rows(_BLOCKS[name], LAYOUTS[name], 1), _x16_rows(_BLOCKS[name], LAYOUTS[name], 4))
    for name in ("Q8_0", "Q5_0", "Q4_K", "Q6_K"))


@njit(nogil=True)
def interleaved_gemv(code, groups, first, end, xq, xd, xsum, out, ahead):
    """out[t, 16g + r] = row 16g + r's dot product with x_hat of token t (xq, xd, xsum: gemv_blocks' activation
    rows) for every token t and the groups g in [first, end) of a weight of interleaved rows (`code`). Each
    token's chain of FMAs is the same whatever the other tokens: its values are the one-token run's."""
    if code == C_Q8_0_X16:
        _TOKENS_Q8_0(groups, first, end, xq, xd, xsum, out, ahead)
    elif code == C_Q5_0_X16:
        _TOKENS_Q5_0(groups, first, end, xq, xd, xsum, out, ahead)
    elif code == C_Q4_K_X16:
        _TOKENS_Q4_K(groups, first, end, xq, xd, xsum, out, ahead)
    else:
        _TOKENS_Q6_K(groups, first, end, xq, xd, xsum, out, ahead)


# --- the prefill GEMM on interleaved rows ---------------------------------------------------------------
# A group's 16 rows are unpacked once to int16 codes in x16 order (codes[32 P + 2 r + j]: row r's value 2P + j; the
# GEMV's unpacking above, stored instead of multiplied), a float scale per 16 rows and scale group and (Q4_K) a
# min term per 32 values; the micro-kernel then holds 16 tokens' int32 sums, one 512-bit register of 16 rows each,
# and multiplies one register of the rows' code pairs with each token's pair broadcast (vpdpwssd with an embedded
# broadcast): 32 products an instruction, as the row GEMM's wide kernel (cpu_gemm.py). Each (row, token) sum is
# the row GEMM's: the same integer sums per scale group, times the same scale products, added by the same FMAs in
# the same order, so the values are its bit for bit.

GEMM_TOKENS = 16  # tokens per micro-kernel: 16 int32 chains of 16 rows
GEMM_K_CHUNK = 1024  # values of the rows per pass over the token tiles (cpu_gemm.K_CHUNK's reason)


@njit(nogil=True)
def _unpack_q8_0(group, n_in, codes, scales, mins):
    for b in range(n_in // 32):
        o = b * 544
        store_f32(scales, ROWS * b, load_f16_16(group, o))
        for p in range(16):
            store_i16(codes, 32 * (16 * b + p), load_i8w_32(group, o + 32 + 32 * p))


@njit(nogil=True)
def _unpack_q5_0(group, n_in, codes, scales, mins):
    for b in range(n_in // 32):
        o = b * 352
        store_f32(scales, ROWS * b, load_f16_16(group, o))
        h = load_u16_32(group, o + 32)
        h4 = ishl(h, 4)
        for p in range(8):
            low, high = _q5_0_codes(load_u8w_32(group, o + 96 + 32 * p), h, h4, p)
            store_i16(codes, 32 * (16 * b + p), low)
            store_i16(codes, 32 * (16 * b + 8 + p), high)


@njit(nogil=True)
def _unpack_q4_k(group, n_in, codes, scales, mins):
    for sb in range(n_in // 256):
        o = sb * 2304
        d, dmin = load_f16_16(group, o), load_f16_16(group, o + 32)
        for j in range(8):  # (the row GEMM's min term: 0 - dmin * m)
            scale, m = _q4_k_scales(group, o, j, d, dmin)
            store_f32(scales, ROWS * (8 * sb + j), scale)
            store_f32(mins, ROWS * (8 * sb + j), fsub(zeros_16(), m))
        for i in range(4):
            for p in range(16):
                v = load_u8w_32(group, o + 256 + 512 * i + 32 * p)
                store_i16(codes, 32 * (128 * sb + 32 * i + p), iand(v, 15))
                store_i16(codes, 32 * (128 * sb + 32 * i + 16 + p), ishr(v, 4))


@njit(nogil=True)
def _unpack_q6_k(group, n_in, codes, scales, mins):
    for sb in range(n_in // 256):
        o = sb * 3360
        d = load_f16_16(group, o)
        for s in range(16):  # (16 values a scale: group s holds values 16s .. 16s + 15)
            store_f32(scales, ROWS * (16 * sb + s), fmul(d, to_f32(load_i8_16(group, o + 32 + 16 * s))))
        for h in range(2):
            for p in range(16):
                v0, v1, v2, v3 = _q6_k_codes(group, o, h, p)
                at = 32 * (128 * sb + 64 * h + p)
                store_i16(codes, at, v0)
                store_i16(codes, at + 32 * 16, v1)
                store_i16(codes, at + 32 * 32, v2)
                store_i16(codes, at + 32 * 48, v3)


@njit(inline="always")
def _group_end_16(acc, i, s, xd, w, affine, xs, m):
    """acc[i:i+16] += float(s) * (xd * w) (+ xs * m for the affine formats): a scale group's integer sums into
    the float sums, sixteen lanes (cpu_gemm._group_end's FMAs; both 512-bit GEMMs end their groups here, so their
    values agree bit for bit)."""
    f = fma(to_f32(s), fmul(xd, w), load_f32_16(acc, i))
    store_f32(acc, i, fma(xs, m, f) if affine else f)


@njit(inline="always")
def _gemm_end(acc, t, s, scale, xd, xs, m, b, affine):
    """Token t's sums of a scale group into acc[16t:16t + 16], the min term from the block b the group lies in."""
    _group_end_16(acc, ROWS * t, s, splat_16(xd[b, t]), scale, affine, splat_16(xs[b, t]), m)


@njit(inline="always")
def _madd4(s0, s1, s2, s3, w, xp, xo):
    """Four tokens' sums + the rows' code pair w times each token's pair (xp[xo], xp[xo + 2], ...)."""
    return (madd(s0, w, splat_pair_32(xp, xo)), madd(s1, w, splat_pair_32(xp, xo + 2)),
            madd(s2, w, splat_pair_32(xp, xo + 4)), madd(s3, w, splat_pair_32(xp, xo + 6)))


@njit(nogil=True)  # (no fastmath: see ops/simd.py)
def _gemm_tokens16(codes, scales, mins, affine, group_pairs, g_start, g_end, xp, xd, xs, t0, tokens, acc):
    """acc[16t:16t + 16] += the 16 rows' products with token t's x_hat over scale groups [g_start, g_end), for
    the tokens t0 .. t0 + 15 (xp: cpu_gemm.pack_activations' pairs, `tokens` of them a pair)."""
    codes, scales, mins, acc = borrow(codes), borrow(scales), borrow(mins), borrow(acc)  # (the caller owns them)
    xp, xd, xs = borrow(xp), borrow(xd), borrow(xs)
    m = zeros_16()
    for g in range(g_start, g_end):
        z = izeros_16()
        s0, s1, s2, s3, s4, s5, s6, s7 = z, z, z, z, z, z, z, z
        s8, s9, s10, s11, s12, s13, s14, s15 = z, z, z, z, z, z, z, z
        for pair in range(g * group_pairs, (g + 1) * group_pairs):
            w = load_i16_32(codes, 32 * pair)
            xo = 2 * (pair * tokens + t0)
            s0, s1, s2, s3 = _madd4(s0, s1, s2, s3, w, xp, xo)
            s4, s5, s6, s7 = _madd4(s4, s5, s6, s7, w, xp, xo + 8)
            s8, s9, s10, s11 = _madd4(s8, s9, s10, s11, w, xp, xo + 16)
            s12, s13, s14, s15 = _madd4(s12, s13, s14, s15, w, xp, xo + 24)
        b = g * group_pairs // 16  # (the 32-value block of the activation's scale)
        scale = load_f32_16(scales, ROWS * g)
        if affine:
            m = load_f32_16(mins, ROWS * g)
        t = t0
        _gemm_end(acc, t, s0, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 1, s1, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 2, s2, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 3, s3, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 4, s4, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 5, s5, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 6, s6, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 7, s7, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 8, s8, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 9, s9, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 10, s10, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 11, s11, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 12, s12, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 13, s13, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 14, s14, scale, xd, xs, m, b, affine)
        _gemm_end(acc, t + 15, s15, scale, xd, xs, m, b, affine)


@njit(nogil=True)  # (no fastmath: see ops/simd.py)
def interleaved_gemm_group(code, groups, g, xp, xd, xs, n_tok, out):
    """out[t, 16g:16g + 16] = the products of rows 16g .. 16g + 15 with token t's x_hat for every token t, for a
    weight of interleaved rows (`code`) and the packed activations (cpu_gemm.pack_activations: tokens padded to a
    multiple of 32, so a last tile of 16 reads zero codes): the group unpacked, then its tiles of 16 tokens,
    GEMM_K_CHUNK values at a time. (One task of cpu_gemm.gemm_blocks_wide's parallel loop; the values are its
    row kernel's bit for bit.)"""
    tokens = xd.shape[1]
    n_in = xp.shape[0] // tokens
    group_pairs = 8 if code == C_Q6_K_X16 else 16  # (Q6_K: a scale per 16 values)
    n_scales = n_in // (2 * group_pairs)
    codes = np.empty(ROWS * n_in, np.int16)
    scales = np.empty(ROWS * n_scales, np.float32)
    mins = np.empty(ROWS * n_scales, np.float32)
    group = groups[g]
    if code == C_Q8_0_X16:
        _unpack_q8_0(group, n_in, codes, scales, mins)
    elif code == C_Q5_0_X16:
        _unpack_q5_0(group, n_in, codes, scales, mins)
    elif code == C_Q4_K_X16:
        _unpack_q4_k(group, n_in, codes, scales, mins)
    else:
        _unpack_q6_k(group, n_in, codes, scales, mins)
    affine = code == C_Q4_K_X16
    n_tiles = (n_tok + GEMM_TOKENS - 1) // GEMM_TOKENS
    acc = np.zeros(ROWS * GEMM_TOKENS * n_tiles, np.float32)
    chunk = GEMM_K_CHUNK // (2 * group_pairs)
    for g0 in range(0, n_scales, chunk):
        for tile in range(n_tiles):
            _gemm_tokens16(codes, scales, mins, affine, group_pairs, g0, min(g0 + chunk, n_scales), xp, xd, xs,
                           GEMM_TOKENS * tile, tokens, acc)
    for t in range(n_tok):
        store_f32(out[t], ROWS * g, load_f32_16(acc, ROWS * t))

