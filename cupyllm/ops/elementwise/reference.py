"""The elementwise operations, defined in NumPy: RMSNorm, the MLP activations (SiLU, tanh GELU) and the rotary
position embedding (NEOX and normal pair orderings, partial rotary dims, per-pair frequency factors
(`rope_freqs`), linear and YaRN scaling, as llama.cpp's `ggml_rope_ext` defines them).

RoPE angles are computed in float64 from integer positions and cast once, so a table for position p is the same
whether it was built for a prefill or a decode step (and for Dual Chunk Attention's remapped positions).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ...files.config import RopeConfig


def _yarn_corr_dims(n_rot: int, original_ctx: int, base: float, beta_fast: float, beta_slow: float):
    def corr_dim(n_rotations: float) -> float:
        return n_rot * math.log(original_ctx / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))
    return low, high


@functools.lru_cache(maxsize=64)
def inverse_frequencies(rope: RopeConfig) -> tuple[np.ndarray, float]:
    """Per-pair angular frequency (radians per position) and the cos/sin magnitude scale (YaRN mscale)."""
    n_pairs = rope.n_rot // 2
    pair = np.arange(n_pairs, dtype=np.float64)
    extrapolated = rope.base ** (-2.0 * pair / rope.n_rot)
    if rope.freq_factors is not None:
        extrapolated = extrapolated / np.asarray(rope.freq_factors[:n_pairs], dtype=np.float64)
    mscale = 1.0
    if rope.scaling == "linear":
        return extrapolated / rope.factor, mscale
    if rope.scaling == "yarn":
        freq_scale = 1.0 / rope.factor
        interpolated = extrapolated * freq_scale
        ext_factor = 1.0 if rope.yarn_ext_factor is None else rope.yarn_ext_factor
        original_ctx = rope.original_ctx or 4096
        low, high = _yarn_corr_dims(rope.n_rot, original_ctx, rope.base, rope.yarn_beta_fast, rope.yarn_beta_slow)
        ramp = 1.0 - np.clip((pair - low) / max(0.001, high - low), 0.0, 1.0)
        mix = ramp * ext_factor
        mscale = rope.yarn_attn_factor
        if ext_factor != 0.0:
            mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
        return interpolated * (1 - mix) + extrapolated * mix, mscale
    return extrapolated, mscale


def rope_tables(rope: RopeConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, float32 [n_pos, n_rot // 2], for integer positions."""
    inv_freq, mscale = inverse_frequencies(rope)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (np.cos(angles) * mscale).astype(np.float32), (np.sin(angles) * mscale).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool = True) -> np.ndarray:
    """Rotate x [n_pos, n_heads, head_dim] by per-position tables [n_pos, n_rot // 2]; dims past n_rot pass through."""
    n_rot = 2 * cos.shape[-1]
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:
        a, b = x[..., : n_rot // 2], x[..., n_rot // 2 : n_rot]
        out[..., : n_rot // 2] = a * c - b * s
        out[..., n_rot // 2 : n_rot] = a * s + b * c
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * c - b * s
        out[..., 1:n_rot:2] = a * s + b * c
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, in float64 (the definition the float32 kernels
    are held to within rounding)."""
    x64 = np.asarray(x, np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), float32 (the definition the GPU kernels are tested against)."""
    return x / (np.float32(1.0) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation, float32."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap), float32: Gemma's final-logit (and Gemma 2's attention-score) soft cap."""
    cap = np.float32(cap)
    return cap * np.tanh(x / cap)
