"""The elementwise operations on the GPU: CuPy launchers of kernels_cu/elementwise/elementwise.cu (RMSNorm and its
fused residual adds, RoPE with the q / k norms, the activations, the soft cap). Their definitions are
reference.py's; ``kernel_sets()`` declares every instantiation (cupyllm/cuda/registry.py KERNEL_SET_PROVIDERS).
CuPy is imported only when an ``ElementwiseKernels`` is built.
"""
from __future__ import annotations

import numpy as np

from ...cuda.launch import KernelLauncher, grid_stride_blocks
from ...cuda.registry import KernelSet
from ...errors import DeviceError

ELEMENTWISE_FILE = "elementwise/elementwise.cu"
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # activations.cuh Activation (the gated GEMV applies them too)
ELEMENT_THREADS = 256
NORM_ROWS_PER_CTA = 8


RESIDUAL_MODES = {None: 0, "before": 1, "after": 2, "after_then_norm": 3}  # elementwise.cu ResidualMode


def rms_norm_kernel_name(residual: str | None) -> str:
    """residual: None, "before" (norm of x + residual), "after" (residual + norm of x) or "after_then_norm"
    (that sum and its own norm)."""
    return f"rms_norm<{RESIDUAL_MODES[residual]}>"


def rope_kernel_name(neox: bool, norm: bool = False) -> str:
    """norm: RMSNorm each head row first (q / k norms)."""
    return f"rope<{'true' if neox else 'false'}, {'true' if norm else 'false'}>"


def act_kernel_name(activation: str, gated: bool) -> str:
    return f"{'gated_act' if gated else 'act'}<{ACTIVATIONS[activation]}>"


SOFTCAP_KERNEL = "softcap<float>"


def kernel_sets() -> list[KernelSet]:
    """The elementwise kernels: one compilation unit."""
    names = [*(rms_norm_kernel_name(mode) for mode in RESIDUAL_MODES), SOFTCAP_KERNEL,
             *(rope_kernel_name(neox, norm) for neox in (True, False) for norm in (False, True))]
    names += [act_kernel_name(a, g) for a in ACTIVATIONS for g in (False, True)]
    return [KernelSet(ELEMENTWISE_FILE, tuple(names))]


class ElementwiseKernels(KernelLauncher):
    """Launches the elementwise kernels on the current CUDA stream (inputs are CuPy arrays)."""

    def rms_norm(self, x, weight, eps: float, residual=None, add_after: bool = False, next_weight=None,
                 out_scale=None):
        """RMSNorm over the last axis (len(weight)); with `residual`, of x + residual, returning (sum, norm), or
        with add_after, residual + norm(x), and with next_weight too (sum, norm(sum, next_weight)); with
        add_after, out_scale (a device float32 [1]) scales the sum first."""
        cp = self.cp
        d = int(weight.shape[-1])
        weight = cp.ascontiguousarray(weight, dtype=cp.float32)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n_rows = x.size // d
        out = cp.empty(x.shape, dtype=cp.float32)
        grid = max(1, (n_rows + NORM_ROWS_PER_CTA - 1) // NORM_ROWS_PER_CTA)
        mode = (None if residual is None else "before" if not add_after else
                "after" if next_weight is None else "after_then_norm")
        residual = x if residual is None else cp.ascontiguousarray(residual, dtype=cp.float32)
        if residual.shape != x.shape:
            raise DeviceError(f"RMSNorm's residual must have x's shape {x.shape}, got {residual.shape}")
        next_weight = weight if next_weight is None else cp.ascontiguousarray(next_weight, dtype=cp.float32)
        two_outputs = mode in ("before", "after_then_norm")
        total = cp.empty(x.shape, dtype=cp.float32) if two_outputs else out
        if out_scale is not None and not add_after:
            raise DeviceError("RMSNorm scales only a residual sum after the norm (add_after)")
        scale = self._unused_f32 if out_scale is None else cp.ascontiguousarray(out_scale, dtype=cp.float32).reshape(-1)
        if scale.size != 1:
            raise DeviceError(f"RMSNorm's out_scale must hold one value, got {scale.size}")
        self._fn(rms_norm_kernel_name(mode))(
            (grid,), (32 * NORM_ROWS_PER_CTA,),
            (x, residual, weight, next_weight, scale, np.int32(out_scale is not None), np.int32(n_rows), np.int32(d),
             np.float32(eps), total, out))
        return (total, out) if two_outputs else out

    def rope(self, q, k, q_positions, k_positions, inv_freq, mscale: float, neox: bool, n_rot: int,
             q_norm=None, k_norm=None, eps: float = 0.0):
        """Rotate q [n, n_q_heads, head_dim] and k [n, n_k_heads, head_dim] (None: q only) at int32 device
        positions with float64 device `inv_freq`, each head row RMS-normed first with q_norm / k_norm when
        given; one launch. Returns (q_out, k_out or None)."""
        cp = self.cp
        n, n_q_heads, head_dim = q.shape
        q = cp.ascontiguousarray(q, dtype=cp.float32)
        q_out = cp.empty_like(q)
        norm = q_norm is not None
        if k is not None and (k_norm is not None) != norm:
            raise DeviceError("a rope after RMSNorm takes a weight for q and, with a k, one for k")
        if k is None:  # (any arrays stand in for the absent k)
            k, k_out, n_k_heads, k_positions, k_norm = q, q_out, 0, q_positions, q_norm
        else:
            if k.shape[0] != n or k.shape[2] != head_dim:
                raise DeviceError(f"rope of q {tuple(q.shape)} and k {tuple(k.shape)}: tokens and head dims must match")
            k = cp.ascontiguousarray(k, dtype=cp.float32)
            k_out, n_k_heads = cp.empty_like(k), k.shape[1]
        weights = [cp.ascontiguousarray(w, dtype=cp.float32) if norm else self._unused_f32 for w in (q_norm, k_norm)]
        rows = n * (n_q_heads + n_k_heads)
        if rows:
            self._fn(rope_kernel_name(neox, norm))(
                ((rows + NORM_ROWS_PER_CTA - 1) // NORM_ROWS_PER_CTA,), (32 * NORM_ROWS_PER_CTA,),
                (q, k, q_out, k_out, q_positions, k_positions, *weights, inv_freq, np.float64(mscale),
                 np.float32(eps), np.int32(n), np.int32(n_q_heads), np.int32(n_k_heads), np.int32(head_dim),
                 np.int32(n_rot)))
        return q_out, (k_out if n_k_heads else None)

    def act(self, x, activation: str):
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        out = cp.empty_like(x)
        self._fn(act_kernel_name(activation, False))((grid_stride_blocks(x.size, ELEMENT_THREADS),), (ELEMENT_THREADS,),
                                                     (x, out, np.int64(x.size)))
        return out

    def gated_act(self, gate, up, activation: str):
        cp = self.cp
        gate = cp.ascontiguousarray(gate, dtype=cp.float32)
        up = cp.ascontiguousarray(up, dtype=cp.float32)
        if gate.shape != up.shape:
            raise DeviceError(f"gated activation needs gate and up of one shape, got {gate.shape} and {up.shape}")
        out = cp.empty_like(gate)
        self._fn(act_kernel_name(activation, True))((grid_stride_blocks(gate.size, ELEMENT_THREADS),), (ELEMENT_THREADS,),
                                                    (gate, up, out, np.int64(gate.size)))
        return out

    def softcap(self, x, cap: float):
        cp = self.cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        out = cp.empty_like(x)
        self._fn(SOFTCAP_KERNEL)((grid_stride_blocks(x.size, ELEMENT_THREADS),), (ELEMENT_THREADS,), (x, out, np.int64(x.size), np.float32(cap)))
        return out
