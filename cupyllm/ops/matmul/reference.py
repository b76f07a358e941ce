"""GGUF weight block formats: NumPy dequantization references (the definitions) and their numba twins.

Layouts and arithmetic follow llama.cpp's `ggml-common.h` / `dequantize_row_*` in `ggml-quants.c`, including
the float32 evaluation order (e.g. Q4_K computes `d1 = d * sc` first, then `d1 * q - m1`), so the numba
kernels in `ops/matmul/cpu_gemv.py` reproduce these values exactly before they are summed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

QK_K = 256


@dataclass(frozen=True)
class WeightFormat:
    qtype: T
    block_values: int
    block_bytes: int
    dequantize_blocks: Callable[[np.ndarray], np.ndarray]  # uint8 [n_blocks, block_bytes] -> f32 [n_blocks, block_values]
    code: int  # small integer id the numba kernels dispatch on

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.block_bytes / self.block_values


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """fp16 field at byte `start` of each block, as f32 [n_blocks, 1]."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _deq_f32(b):
    return b.copy().view(np.float32)


def _deq_f16(b):
    return b.copy().view(np.float16).astype(np.float32)


def _deq_bf16(b):
    return (b.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _deq_q8_0(b):
    return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """32 4-bit values of a 16-byte field: low nibbles are values 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)


def _fifth_bits(qh_bytes: np.ndarray) -> np.ndarray:
    """Bit j of the little-endian u32 `qh` is the 5th bit of value j."""
    return np.unpackbits(qh_bytes, axis=1, bitorder="little").astype(np.int32)


def _deq_q4_0(b):
    return (_low_high_nibbles(b[:, 2:18]) - 8).astype(np.float32) * _f16(b, 0)


def _deq_q4_1(b):
    return _low_high_nibbles(b[:, 4:20]).astype(np.float32) * _f16(b, 0) + _f16(b, 2)


def _deq_q5_0(b):
    q = _low_high_nibbles(b[:, 6:22]) | (_fifth_bits(b[:, 2:6]) << 4)
    return (q - 16).astype(np.float32) * _f16(b, 0)


def _deq_q5_1(b):
    q = _low_high_nibbles(b[:, 8:24]) | (_fifth_bits(b[:, 4:8]) << 4)
    return q.astype(np.float32) * _f16(b, 0) + _f16(b, 2)


def k_quant_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """6-bit (scale, min) pairs of the 8 sub-blocks of a Q4_K/Q5_K block (llama.cpp get_scale_min_k4)."""
    s = scales.astype(np.int32)
    sc = np.empty((len(s), 8), np.int32)
    mn = np.empty((len(s), 8), np.int32)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _deq_q4_k(b):
    n = len(b)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = k_quant_scales(b[:, 4:16])
    d_sub = (d * sc.astype(np.float32))[:, :, None]  # [n, 8, 1]
    m_sub = (dmin * mn.astype(np.float32))[:, :, None]
    qs = b[:, 16:144].reshape(n, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    return (d_sub * q - m_sub).reshape(n, QK_K)


def _deq_q5_k(b):
    n = len(b)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = k_quant_scales(b[:, 4:16])
    d_sub = (d * sc.astype(np.float32))[:, :, None]
    m_sub = (dmin * mn.astype(np.float32))[:, :, None]
    qh = b[:, 16:48].astype(np.int32)  # [n, 32]: bit 2j / 2j+1 is the 5th bit of sub-block 2j / 2j+1
    qs = b[:, 48:176].reshape(n, 4, 32).astype(np.int32)
    sub = np.arange(8)
    high = ((qh[:, None, :] >> sub[None, :, None]) & 1) << 4  # [n, 8, 32]
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    return (d_sub * (low + high).astype(np.float32) - m_sub).reshape(n, QK_K)


def _deq_q6_k(b):
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 64).astype(np.int32)
    qh = b[:, 128:192].reshape(n, 2, 32).astype(np.int32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32).reshape(n, 2, 8)
    d = _f16(b, 208)[:, :, None]
    # Within each 128-value half: four groups of 32 take ql low/high nibbles and 2 bits of qh each.
    q = np.stack([
        (ql[:, :, 0:32] & 0x0F) | (((qh >> 0) & 3) << 4),
        (ql[:, :, 32:64] & 0x0F) | (((qh >> 2) & 3) << 4),
        (ql[:, :, 0:32] >> 4) | (((qh >> 4) & 3) << 4),
        (ql[:, :, 32:64] >> 4) | (((qh >> 6) & 3) << 4),
    ], axis=2) - 32  # [n, 2, 4, 32]
    # 16-value sub-blocks: group g of half h, lanes 0..15 use scale 2g, lanes 16..31 scale 2g+1.
    sc = scales.reshape(n, 2, 4, 2)[:, :, :, :, None]  # [n, 2, 4, 2, 1]
    y = (d[:, :, :, None, None] * sc) * q.reshape(n, 2, 4, 2, 16).astype(np.float32)
    return y.reshape(n, QK_K)


_DEQUANT = {
    T.F32: _deq_f32, T.F16: _deq_f16, T.BF16: _deq_bf16, T.Q8_0: _deq_q8_0,
    T.Q4_0: _deq_q4_0, T.Q4_1: _deq_q4_1, T.Q5_0: _deq_q5_0, T.Q5_1: _deq_q5_1,
    T.Q4_K: _deq_q4_k, T.Q5_K: _deq_q5_k, T.Q6_K: _deq_q6_k,
}

FLOAT_TYPES = (T.F32, T.F16, T.BF16)  # weights that hold their values (the GEMV multiplies x itself by them)

WEIGHT_FORMATS: dict[T, WeightFormat] = {
    qtype: WeightFormat(qtype, *GGML_QUANT_SIZES[qtype], fn, code)
    for code, (qtype, fn) in enumerate(_DEQUANT.items())
}
SUPPORTED_WEIGHT_TYPES = tuple(t.name for t in WEIGHT_FORMATS)


def weight_format(qtype: T) -> WeightFormat | None:
    return WEIGHT_FORMATS.get(qtype)


def dequantize(data: np.ndarray, qtype: T, n_per_row: int) -> np.ndarray:
    """Reference dequantization of uint8 rows [n_rows, row_bytes] -> f32 [n_rows, n_per_row]."""
    fmt = WEIGHT_FORMATS[qtype]
    rows = np.ascontiguousarray(data).reshape(-1, fmt.block_bytes)
    return fmt.dequantize_blocks(rows).reshape(-1, n_per_row)
