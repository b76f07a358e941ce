"""The Gated DeltaNet layer core on the GPU: CuPy launchers of kernels_cu/deltanet/deltanet.cu (the causal conv +
SiLU, the gated delta rule token by token, the gated RMSNorm). Their definitions are reference.py's; the conv state
[K - 1, C] and the recurrent state [Hv, Dk, Dv] are float32 device arrays the kernels update in place.
``kernel_sets()`` declares every instantiation (cupyllm/cuda/registry.py KERNEL_SET_PROVIDERS). CuPy is imported
only when a ``DeltaNetKernels`` is built.
"""
from __future__ import annotations

import numpy as np

from ...cuda.launch import KernelLauncher
from ...cuda.registry import KernelSet
from ...errors import DeviceError

DELTANET_FILE = "deltanet/deltanet.cu"
CONV_WIDTHS = (4,)  # Qwen3.5 / Qwen3-Next's linear_conv_kernel_dim
KEY_HEAD_DIMS = (32, 64, 128, 256)  # Dk = 32 * kRows: one warp's lanes hold a state column
THREADS = 256
DELTA_COLUMNS_PER_BLOCK = 8 * 4  # deltanet.cu kDeltaWarps * kDeltaCols
NORM_ROWS_PER_CTA = 8
GATED_NORM_KERNEL = "gated_rms_norm"


def conv_kernel_name(width: int) -> str:
    return f"conv1d_silu<{width}>"


def delta_rule_kernel_name(key_head_dim: int) -> str:
    return f"gated_delta_rule<{key_head_dim // 32}>"


def kernel_sets() -> list[KernelSet]:
    """The DeltaNet kernels: one compilation unit."""
    names = [*(conv_kernel_name(w) for w in CONV_WIDTHS), *(delta_rule_kernel_name(d) for d in KEY_HEAD_DIMS),
             GATED_NORM_KERNEL]
    return [KernelSet(DELTANET_FILE, tuple(names))]


def _unsupported(what: str) -> DeviceError:
    return DeviceError(f"the GPU Gated DeltaNet kernels do not support {what}; run this model on the CPU backend "
                       "(--device cpu)")


class DeltaNetKernels(KernelLauncher):
    """Launches the DeltaNet kernels on the current CUDA stream (inputs are CuPy arrays)."""

    def _f32(self, a):
        return self.cp.ascontiguousarray(a, dtype=self.cp.float32)

    def _state(self, state, shape: tuple[int, ...], name: str):
        """The caller's float32 C-contiguous state, which the kernel updates in place (a copy would lose it)."""
        if (tuple(state.shape) != shape or state.dtype != self.cp.float32
                or not state.flags.c_contiguous):
            raise DeviceError(f"the DeltaNet {name} must be a C-contiguous float32 array of shape {shape}, "
                              f"got {state.dtype} {tuple(state.shape)}")
        return state

    def conv1d_silu(self, x, weight, conv_state):
        """silu(causal depthwise conv) of x [n, C] with weight [C, K] after the inputs in conv_state [K - 1, C]
        (updated in place to the last K - 1 inputs). Returns y [n, C]."""
        x, weight = self._f32(x), self._f32(weight)
        if x.ndim != 2 or weight.ndim != 2 or weight.shape[0] != x.shape[1]:
            raise DeviceError(f"conv1d_silu takes x [n, C] and weight [C, K], got {tuple(x.shape)} and "
                              f"{tuple(weight.shape)}")
        n, channels = x.shape
        width = int(weight.shape[1])
        if width not in CONV_WIDTHS:
            raise _unsupported(f"a conv kernel of width {width} (only {CONV_WIDTHS})")
        conv_state = self._state(conv_state, (width - 1, channels), "conv state")
        y = self.cp.empty((n, channels), dtype=self.cp.float32)
        if n and channels:
            self._fn(conv_kernel_name(width))(((channels + THREADS - 1) // THREADS,), (THREADS,),
                                              (x, weight, conv_state, y, np.int32(n), np.int32(channels)))
        return y

    def gated_delta_rule(self, q, k, v, g, beta, state):
        """The recurrence over n tokens (q, k [n, Hk, Dk] raw, L2-normalised and scaled in the kernel; v [n, Hv,
        Dv]; g, beta [n, Hv]) from state [Hv, Dk, Dv], which is updated in place. Returns o [n, Hv, Dv]."""
        q, k, v, g, beta = (self._f32(a) for a in (q, k, v, g, beta))
        if q.ndim != 3 or q.shape != k.shape or v.ndim != 3 or v.shape[0] != q.shape[0]:
            raise DeviceError(f"gated_delta_rule takes q, k [n, Hk, Dk] and v [n, Hv, Dv], got {tuple(q.shape)}, "
                              f"{tuple(k.shape)}, {tuple(v.shape)}")
        n, n_k_heads, dk = q.shape
        n_v_heads, dv = v.shape[1], v.shape[2]
        if g.shape != (n, n_v_heads) or beta.shape != (n, n_v_heads):
            raise DeviceError(f"gated_delta_rule's g and beta must be [n, Hv] = {(n, n_v_heads)}, got "
                              f"{tuple(g.shape)} and {tuple(beta.shape)}")
        if dk not in KEY_HEAD_DIMS:
            raise _unsupported(f"key head dim {dk} (only {KEY_HEAD_DIMS})")
        if n_k_heads == 0 or n_v_heads % n_k_heads:
            raise _unsupported(f"{n_v_heads} value heads over {n_k_heads} key heads (need a multiple)")
        state = self._state(state, (n_v_heads, dk, dv), "recurrent state")
        o = self.cp.empty((n, n_v_heads, dv), dtype=self.cp.float32)
        if n and n_v_heads and dv:
            grid = (n_v_heads, (dv + DELTA_COLUMNS_PER_BLOCK - 1) // DELTA_COLUMNS_PER_BLOCK)
            self._fn(delta_rule_kernel_name(dk))(
                grid, (THREADS,),
                (q, k, v, g, beta, state, o, np.int32(n), np.int32(n_k_heads), np.int32(n_v_heads), np.int32(dv)))
        return o

    def gated_rms_norm(self, x, z, weight, eps: float = 1e-6):
        """RMSNorm of x over its last axis (len(weight)) times weight times silu(z), z of x's shape."""
        x, z, weight = self._f32(x), self._f32(z), self._f32(weight)
        d = int(weight.shape[-1])
        if x.shape != z.shape or x.shape[-1] != d:
            raise DeviceError(f"gated_rms_norm takes x and z of one shape [..., {d}], got {tuple(x.shape)} and "
                              f"{tuple(z.shape)}")
        out = self.cp.empty(x.shape, dtype=self.cp.float32)
        n_rows = x.size // d if d else 0
        if n_rows:
            self._fn(GATED_NORM_KERNEL)(((n_rows + NORM_ROWS_PER_CTA - 1) // NORM_ROWS_PER_CTA,), (THREADS,),
                                        (x, z, weight, out, np.int32(n_rows), np.int32(d), np.float32(eps)))
        return out
