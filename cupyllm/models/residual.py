"""The residual stream of a decoder stack, and where its adds and norms meet.

A block reads the stream through a norm and adds its sublayer's output back:

    x.add(Attn(x.norm(w.attn_norm)))                                   x = x + Attn(RMSNorm(x))
    x.add(MLP(x.norm(w.ffn_norm)), post_norm=w.post_ffn_norm)          x = x + RMSNorm(MLP(RMSNorm(x)))

An add waits until the stream is next read: read through a norm (the next sublayer's, or the next block's, or
the output norm after the last block), the add and that norm are one backend operation (`rms_norm_residual`,
`add_rms_norm_and_norm`; one pass over the row on the GPU); read as it is (`value`), the add runs alone. So
the fusion across a block's boundary is decided here, once, and no block passes norms to its neighbour.
"""
from __future__ import annotations

from ..backend.base import Array, Backend


class ResidualStream:
    def __init__(self, ops: Backend, x: Array, eps: float):
        self._ops, self._eps = ops, eps
        self._x = x
        self._pending: tuple | None = None  # (out, post_norm weight or None, scale or None): x + post(out), scaled

    def add(self, out: Array, post_norm: Array | None = None, scale: Array | None = None) -> None:
        """x <- (x + RMSNorm(out; post_norm)) * scale: RMSNorm only where a post_norm weight is given (Gemma's
        sandwich norms), the scale only where given (Gemma 4's layer output scale)."""
        if scale is not None and post_norm is None:
            raise ValueError("a scaled residual add needs its post-norm (Gemma 4's layer output scale)")
        self._flush()
        self._pending = (out, post_norm, scale)

    def norm(self, weight: Array) -> Array:
        """RMSNorm(x) with `weight`, after any waiting add (with it, in one operation)."""
        ops, eps = self._ops, self._eps
        if self._pending is None:
            return ops.rms_norm(self._x, weight, eps)
        out, post_norm, scale = self._pending
        self._pending = None
        if post_norm is None:
            self._x, normed = ops.rms_norm_residual(self._x, out, weight, eps)
        else:
            self._x, normed = ops.add_rms_norm_and_norm(self._x, out, post_norm, eps, weight, scale)
        return normed

    @property
    def value(self) -> Array:
        """x itself, after any waiting add."""
        self._flush()
        return self._x

    def _flush(self) -> None:
        if self._pending is None:
            return
        out, post_norm, scale = self._pending
        self._pending = None
        if post_norm is None:
            self._x = self._x + out
        else:
            self._x = self._ops.add_rms_norm(self._x, out, post_norm, self._eps, scale)
