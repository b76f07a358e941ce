"""Scalar KV formats: plain floats and the llama.cpp 32-value block types, byte for byte.

All multi-byte fields are little-endian. ``fp16(v)`` is IEEE binary16 rounded to nearest-even (overflow to
inf), ``f32(h)`` its exact widening. Arithmetic is IEEE float32 with one rounding per operation and NO fused
multiply-add (a CUDA port must use ``__fmul_rn``/``__fadd_rn`` where the compiler could contract, or it will
differ by an ulp from these references).

Float formats (block_values 1):

* ``f32``:  4 bytes, the value itself (exact).
* ``f16``:  2 bytes, ``fp16(x)``.
* ``bf16``: 2 bytes, the high half of the float32 bits rounded to nearest-even:
  ``(u + 0x7fff + ((u >> 16) & 1)) >> 16``; a NaN keeps its top bits with the quiet bit forced
  (``(u >> 16) | 0x40``), as ggml_compute_fp32_to_bf16. Decoding shifts the 16 bits back up (exact).

Block formats, 32 values ``x[0..31]`` per block. Quantizers follow llama.cpp's ``quantize_row_*_ref`` in
ggml-quants.c (same scale choice, same rounding); decoders follow ``dequantize_row_*``:

* ``q8_0`` (34 B): ``{fp16 d; int8 qs[32]}``. ``amax = max|x|``, ``d = amax / 127``,
  ``id = d != 0 ? 1/d : 0``, ``qs[j] = roundf(x[j]*id)`` (halves away from zero). Value ``= qs[j] * f32(d)``.
* ``q4_0`` (18 B): ``{fp16 d; u8 qs[16]}``. ``m`` = the x with the largest |x| (the first one on ties),
  ``d = m / -8``, ``q[j] = min(15, trunc(x[j]*id + 8.5))``; ``qs[j] = q[j] | q[j+16] << 4`` (j < 16).
  Value ``= (q - 8) * f32(d)``.
* ``q4_1`` (20 B): ``{fp16 d; fp16 m; u8 qs[16]}``. ``d = (max - min) / 15``, ``m = min`` (the float32 min is
  used for quantizing, fp16(min) is stored), ``q[j] = min(15, trunc((x[j] - min)*id + 0.5))``, nibbles as
  q4_0. Value ``= f32(d) * q + f32(m)`` (multiply, round, add, round).
* ``q5_0`` (22 B): ``{fp16 d; u8 qh[4]; u8 qs[16]}``. ``d = m / -16``, ``q[j] = min(31, trunc(x[j]*id + 16.5))``;
  ``qs`` holds the low nibbles as q4_0; ``qh`` read as a little-endian uint32 has bit j = bit 4 of q[j].
  Value ``= (q - 16) * f32(d)``.
* ``q5_1`` (24 B): ``{fp16 d; fp16 m; u8 qh[4]; u8 qs[16]}``. ``d = (max - min) / 31``,
  ``q[j] = trunc((x[j] - min)*id + 0.5)`` (at most 31), bits as q5_0. Value ``= f32(d) * q + f32(m)``.
* ``q6_0`` (26 B): ``{fp16 d; u8 qh[8]; u8 qs[16]}``, the layout of ik_llama.cpp (ikawrakow/ik_llama.cpp,
  ``ggml/src/ggml-common.h`` block_q6_0; the same struct is in the turboquant llama.cpp forks).
  ``d = m / -32``, ``q[j] = min(63, trunc(x[j]*id + 32.5))`` in 0..63 (value ``x ~ (q - 32) * d``).
  ``qs[j] = (q[j] & 15) | (q[j+16] & 15) << 4`` (j < 16) exactly as q5_0; the two high bits (``q >> 4``) of
  element e go to ``qh[e % 8]`` at bit offset ``2 * (2*((e % 16) >= 8) + (e >= 16))``, i.e. for k < 8:
  ``qh[k] = hi(q[k]) | hi(q[k+16]) << 2 | hi(q[k+8]) << 4 | hi(q[k+24]) << 6``.
  Value ``= (q - 32) * f32(d)``. This matches ik_llama.cpp's ``dequantize_row_q6_0`` and its CUDA KV-cache
  writer ``quantize_f32_q6_0_block`` (ggml/src/ggml-cuda/cpy-utils.cuh), which uses the plain
  ``d = m / -32`` scale as here. (ik_llama.cpp's CPU ``quantize_row_q6_0_ref`` additionally refits d by a
  weighted least-squares step; we do not, so that the scale is a function of the block max alone, as in
  every other ``*_0`` type.)

Out of the bit-exact contract: NaN/inf inputs, and blocks whose largest |x| is below ~1e-37 (where ``1/d``
overflows) other than all-zero blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .base import KVFormat

QK = 32  # values per block of every q* type
_F32 = np.float32


# -- float formats ---------------------------------------------------------------------------------


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) of float32 values, round-to-nearest-even, NaN kept quiet."""
    u = np.ascontiguousarray(x, dtype=_F32).view(np.uint32)
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = (u.astype(np.uint64) + (np.uint64(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint64(16)
    nan_bits = (u >> np.uint32(16)) | np.uint32(0x40)
    return np.where(is_nan, nan_bits, rounded).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(_F32)


@dataclass(frozen=True)
class FloatFormat(KVFormat):
    """f32 / f16 / bf16: one value per block."""

    def encode(self, x: np.ndarray) -> np.ndarray:
        x = self._float_rows(x)
        n, d = x.shape
        if self.name == "f32":
            out = x.astype("<f4")
        elif self.name == "f16":
            out = x.astype("<f2")
        else:
            out = f32_to_bf16_bits(x).astype("<u2")
        return out.view(np.uint8).reshape(n, self.row_bytes(d))

    def decode(self, data: np.ndarray, d: int) -> np.ndarray:
        data = self._byte_rows(data, d)
        if self.name == "f32":
            return data.view("<f4").astype(_F32)
        if self.name == "f16":
            return data.view("<f2").astype(_F32)
        return bf16_bits_to_f32(data.view("<u2"))


# -- llama.cpp block formats -------------------------------------------------------------------------


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    """[nb] float32 -> [nb, 2] uint8 (fp16, round-to-nearest-even)."""
    return v.astype("<f2").view(np.uint8).reshape(-1, 2)


def _fp16_from(raw: np.ndarray) -> np.ndarray:
    """[nb, 2] uint8 -> [nb, 1] float32."""
    return np.ascontiguousarray(raw).view("<f2").astype(_F32).reshape(-1, 1)


def _inverse_or_zero(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f`` in float32."""
    out = np.zeros_like(d)
    np.divide(_F32(1.0), d, out=out, where=d != 0)
    return out


def _trunc_int(v: np.ndarray) -> np.ndarray:
    """C's float -> integer conversion (toward zero)."""
    with np.errstate(invalid="ignore"):
        return np.trunc(v).astype(np.int32)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf: nearest integer, halves away from zero (exact in float32: a - floor(a) is exact)."""
    a = np.abs(v)
    fl = np.floor(a)
    r = fl + (a - fl >= _F32(0.5)).astype(_F32)
    return np.copysign(r, v).astype(np.int32)


def _signed_absmax(b: np.ndarray) -> np.ndarray:
    """[nb, 32] -> [nb, 1]: the element with the largest |x|, the first one on ties (as ``if (amax < |v|)``)."""
    idx = np.argmax(np.abs(b), axis=1)
    return b[np.arange(b.shape[0]), idx].reshape(-1, 1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[nb, 32] codes -> [nb, 16]: low nibble of q[j] | low nibble of q[j+16] << 4."""
    q = q.astype(np.uint8)
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """[nb, 16] -> [nb, 32] low nibbles (int32)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)


def _pack_bit4(q: np.ndarray) -> np.ndarray:
    """[nb, 32] 5-bit codes -> [nb, 4]: little-endian uint32 whose bit j is bit 4 of q[j]."""
    return np.packbits(((q >> 4) & 1).astype(np.uint8), axis=1, bitorder="little")


def _unpack_bit4(qh: np.ndarray) -> np.ndarray:
    """[nb, 4] -> [nb, 32] values 0/16."""
    return np.unpackbits(qh, axis=1, bitorder="little").astype(np.int32) << 4


def _q8_0_quantize(b: np.ndarray) -> np.ndarray:
    d = np.max(np.abs(b), axis=1, keepdims=True) / _F32(127)
    q = _roundf(b * _inverse_or_zero(d))
    return np.concatenate([_fp16_bytes(d), q.astype(np.int8).view(np.uint8)], axis=1)


def _q8_0_dequantize(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw[:, 2:]).view(np.int8).astype(_F32) * _fp16_from(raw[:, :2])


def _symmetric_codes(b: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """q4_0 / q5_0 / q6_0 scale and codes: d = m / -nmax, q = min(2*nmax - 1, trunc(x*id + nmax + 0.5))."""
    d = _signed_absmax(b) / _F32(-nmax)
    q = _trunc_int(b * _inverse_or_zero(d) + _F32(nmax + 0.5))
    return d, np.minimum(q, 2 * nmax - 1)


def _affine_codes(b: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q4_1 / q5_1 scale, min and codes: d = (max - min) / qmax, q = trunc((x - min)*id + 0.5) (<= qmax)."""
    lo = np.min(b, axis=1, keepdims=True)
    hi = np.max(b, axis=1, keepdims=True)
    d = (hi - lo) / _F32(qmax)
    q = _trunc_int((b - lo) * _inverse_or_zero(d) + _F32(0.5))
    return d, lo, np.minimum(q, qmax)


def _q4_0_quantize(b: np.ndarray) -> np.ndarray:
    d, q = _symmetric_codes(b, 8)
    return np.concatenate([_fp16_bytes(d), _pack_nibbles(q)], axis=1)


def _q4_0_dequantize(raw: np.ndarray) -> np.ndarray:
    return (_unpack_nibbles(raw[:, 2:]) - 8).astype(_F32) * _fp16_from(raw[:, :2])


def _q4_1_quantize(b: np.ndarray) -> np.ndarray:
    d, lo, q = _affine_codes(b, 15)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(q)], axis=1)


def _q4_1_dequantize(raw: np.ndarray) -> np.ndarray:
    q = _unpack_nibbles(raw[:, 4:]).astype(_F32)
    return _fp16_from(raw[:, :2]) * q + _fp16_from(raw[:, 2:4])


def _q5_0_quantize(b: np.ndarray) -> np.ndarray:
    d, q = _symmetric_codes(b, 16)
    return np.concatenate([_fp16_bytes(d), _pack_bit4(q), _pack_nibbles(q)], axis=1)


def _q5_0_dequantize(raw: np.ndarray) -> np.ndarray:
    q = _unpack_nibbles(raw[:, 6:]) | _unpack_bit4(raw[:, 2:6])
    return (q - 16).astype(_F32) * _fp16_from(raw[:, :2])


def _q5_1_quantize(b: np.ndarray) -> np.ndarray:
    d, lo, q = _affine_codes(b, 31)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_bit4(q), _pack_nibbles(q)], axis=1)


def _q5_1_dequantize(raw: np.ndarray) -> np.ndarray:
    q = (_unpack_nibbles(raw[:, 8:]) | _unpack_bit4(raw[:, 4:8])).astype(_F32)
    return _fp16_from(raw[:, :2]) * q + _fp16_from(raw[:, 2:4])


# q6_0 high-bit placement: element e's two high bits live in qh[e % 8] at this shift.
_Q6_0_HIGH_SHIFT = np.array([2 * (2 * ((e % 16) >= 8) + (e >= 16)) for e in range(QK)], dtype=np.int32)


def _q6_0_quantize(b: np.ndarray) -> np.ndarray:
    d, q = _symmetric_codes(b, 32)
    high = (q >> 4) << _Q6_0_HIGH_SHIFT  # [nb, 32], disjoint bits per qh byte
    qh = np.zeros((b.shape[0], 8), dtype=np.int32)
    for first in range(0, QK, 8):  # elements e, e+8, e+16, e+24 share qh[e % 8]
        qh |= high[:, first : first + 8]
    return np.concatenate([_fp16_bytes(d), qh.astype(np.uint8), _pack_nibbles(q)], axis=1)


def _q6_0_dequantize(raw: np.ndarray) -> np.ndarray:
    qh = np.tile(raw[:, 2:10].astype(np.int32), 4)  # element e reads qh[e % 8]
    q = _unpack_nibbles(raw[:, 10:]) | (((qh >> _Q6_0_HIGH_SHIFT) & 3) << 4)
    return (q - 32).astype(_F32) * _fp16_from(raw[:, :2])


@dataclass(frozen=True)
class BlockFormat(KVFormat):
    """A llama.cpp-style 32-value block type."""

    quantize_blocks: Callable[[np.ndarray], np.ndarray]
    dequantize_blocks: Callable[[np.ndarray], np.ndarray]

    def encode(self, x: np.ndarray) -> np.ndarray:
        x = self._float_rows(x)
        n, d = x.shape
        raw = self.quantize_blocks(x.reshape(-1, self.block_values))
        return np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, self.row_bytes(d))

    def decode(self, data: np.ndarray, d: int) -> np.ndarray:
        data = self._byte_rows(data, d)
        n = data.shape[0]
        out = self.dequantize_blocks(data.reshape(-1, self.block_bytes))
        return np.ascontiguousarray(out, dtype=_F32).reshape(n, d)


def all_formats() -> list[KVFormat]:
    return [
        FloatFormat("f32", 1, 4),
        FloatFormat("f16", 1, 2),
        FloatFormat("bf16", 1, 2),
        BlockFormat("q8_0", QK, 34, _q8_0_quantize, _q8_0_dequantize),
        BlockFormat("q6_0", QK, 26, _q6_0_quantize, _q6_0_dequantize),
        BlockFormat("q5_1", QK, 24, _q5_1_quantize, _q5_1_dequantize),
        BlockFormat("q5_0", QK, 22, _q5_0_quantize, _q5_0_dequantize),
        BlockFormat("q4_1", QK, 20, _q4_1_quantize, _q4_1_dequantize),
        BlockFormat("q4_0", QK, 18, _q4_0_quantize, _q4_0_dequantize),
    ]
