"""The CPU backend: NumPy for the elementwise ops, numba block kernels for the quantized matmuls, and the
reference attention streamed over the cache in chunks (memory stays O(chunk), never O(n^2))."""
from __future__ import annotations

import numpy as np

from ..attention.cpu_decode import MAX_QUERIES, attend_few
from ..attention.reference import attend_chunks, causal_mask
from ..kv.cache import LayerKV
from .cpu_kernels import rms_norm_rows
from ..quant.cpu_matmul import dequantize_numba, matmul
from ..rope import apply_rope, rope_tables
from ..weights import Weight

KEY_CHUNK = 4096  # cache slots decoded and scored at a time


class CPUBackend:
    name = "cpu"
    xp = np
    kv_mirror = True  # attention reads a float32 copy of the decoded cache instead of decoding every step

    def __init__(self):
        self._rope_key, self._rope_table = None, None

    def asarray(self, x, dtype=None):
        return np.asarray(x, dtype=dtype)

    def to_numpy(self, x) -> np.ndarray:
        return np.asarray(x)

    def upload(self, weight: Weight) -> Weight:
        return weight  # weights stay memory-mapped in their GGUF blocks

    # --- linear algebra ---------------------------------------------------------------------------
    def linear(self, x: np.ndarray, weight: Weight, bias: np.ndarray | None = None) -> np.ndarray:
        y = matmul(x, weight.data, weight.fmt, weight.shape[-1])
        if bias is not None:
            y += bias
        return y

    def embed(self, weight: Weight, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty((len(ids), weight.shape[-1]), np.float32)
        for i, token in enumerate(ids):  # one row per token: dequantize just the rows asked for
            out[i] = dequantize_numba(weight.data, weight.fmt, weight.shape[-1], slice(int(token), int(token) + 1))[0]
        return out

    # --- elementwise ------------------------------------------------------------------------------
    @staticmethod
    def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, weight.shape[-1])
        out = np.empty_like(rows)
        rms_norm_rows(rows, weight, np.float32(eps), out)
        return out.reshape(x.shape)

    @staticmethod
    def silu(x: np.ndarray) -> np.ndarray:
        return x / (np.float32(1.0) + np.exp(-x))

    @staticmethod
    def gelu_tanh(x: np.ndarray) -> np.ndarray:
        c = np.float32(np.sqrt(2.0 / np.pi))
        return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))

    def rope(self, x: np.ndarray, rope_cfg, positions: np.ndarray) -> np.ndarray:
        key = (rope_cfg, positions.tobytes())
        if self._rope_key != key:  # every layer of a step shares the positions: build the table once
            self._rope_key, self._rope_table = key, rope_tables(rope_cfg, positions)
        cos, sin = self._rope_table
        return apply_rope(x, cos, sin, rope_cfg.neox)

    # --- attention --------------------------------------------------------------------------------
    @staticmethod
    def attention(q: np.ndarray, q_pos: np.ndarray, layer_kv: LayerKV, *, scale: float, window: int = 0,
                  softcap: float = 0.0) -> np.ndarray:
        """Causal (optionally sliding-window) attention of q [n, n_head, d] over everything the layer caches."""
        if q.shape[0] <= MAX_QUERIES and layer_kv.mirror:  # decode: one numba pass over the float32 mirror
            k, v, k_pos = layer_kv.decode(0, layer_kv.n_used)
            return attend_few(q, k, v, q_pos, k_pos, scale=scale, window=window, softcap=softcap)[0]

        def chunks():
            for k, v, k_pos in layer_kv.chunks(KEY_CHUNK):
                yield k, v, causal_mask(q_pos, k_pos, window)

        out, _ = attend_chunks(q, chunks(), scale=scale, softcap=softcap, dv=layer_kv.v_head_dim)
        return out
