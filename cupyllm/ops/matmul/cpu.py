"""y = x @ W.T on the CPU, W a GGUF weight kept in its blocks: which kernel multiplies.

- up to TOKENS_PER_GEMV tokens (decode): the GEMV (`cpu_matmul.gemv_blocks`) streams each quantized row once
  per token against x's 16-bit codes; up to TOKENS_PER_X16_GEMV where every weight has its rows interleaved
  (cpu_interleaved.py: each group of rows read once for all tokens, unpacked once for every four);
- more tokens (prefill) with a block-quantized weight: the integer GEMM (`cpu_gemm.gemm_blocks`), the same
  products for 32 tokens at a time;
- F32 weights: the GEMV for a few tokens (it multiplies x itself for float weights), BLAS on the mapped array
  for more; F16 / BF16 weights: BLAS on f32 tiles of them (or the GEMV).
Both integer kernels multiply x_hat (`ops/matmul/activation_codes.py`), so prefill and decode compute the same
products; `ACTIVATION_CODES = False` sends every quantized weight through f32 tiles and BLAS instead
(x itself: the GPU-parity test compares against that).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .cpu_gemm import GEMM_CODES, gemm_many
from .cpu_gemv import F16_TABLE, dequantize_rows, gemv_each, gemv_many, weight_rows
from .reference import WeightFormat

# up to this many tokens go through the GEMV (four at a time); more go through the GEMM, which pads them to 32
# (measured, a forward of n tokens with all their logits on Qwen2.5-0.5B / Gemma 3 270M: the GEMV is faster up to
# 8 tokens, two fours; the GEMM from 10 on Qwen, from 12 on Gemma; docs/benchmarks.md)
TOKENS_PER_GEMV = 8
# the same on rows interleaved 16 at a time: there the GEMV beats the GEMM up to 28 tokens (a forward of n
# tokens, Gemma 3 270M and Qwen2.5-Coder-0.5B, its last logits or all; docs/benchmarks.md)
TOKENS_PER_X16_GEMV = 28
ACTIVATION_CODES = True  # quantized weights multiply x's 16-bit codes (False: x itself, through BLAS tiles)
ROW_TILE = 2048  # weight rows per f32 tile of the BLAS path


def _kernel(n_tok: int, fmts: list[WeightFormat], interleaved: list | None = None) -> str:
    if not ACTIVATION_CODES:
        return "blas" if all(fmt.qtype == T.F32 for fmt in fmts) else "tiles"
    if n_tok <= TOKENS_PER_GEMV:  # (float32 weights too: a BLAS call per narrow weight costs more than its rows)
        return "gemv"
    if n_tok <= TOKENS_PER_X16_GEMV and interleaved is not None and all(x16 is not None for x16 in interleaved):
        return "gemv"
    if all(fmt.qtype == T.F32 for fmt in fmts):
        return "blas"
    if all(fmt.code in GEMM_CODES for fmt in fmts):
        return "gemm"
    return "tiles"


def matmul_many(x: np.ndarray, weights: list[tuple[np.ndarray, WeightFormat]], n_in: int,
                interleaved: list | None = None) -> list[np.ndarray]:
    """[x @ W.T for W in weights]: a decode step's weights that read the same x go through one parallel GEMV
    (one thread wake-up for q/k/v or gate/up) when their arrays share a numba type; a prefill's GEMMs share the
    packing of x; else weight by weight. `interleaved`: for each weight, its rows interleaved (cpu_interleaved.py:
    (array, layout)) or None; the GEMV and the GEMM read those (the f32 tiles, the GGUF's rows)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    kernel = _kernel(x.shape[0], [fmt for _, fmt in weights], interleaved)
    if kernel == "gemv":
        if interleaved is not None:
            weights = [w if x16 is None else x16 for w, x16 in zip(weights, interleaved)]
        if len({(d.dtype, d.ndim, d.flags.c_contiguous, d.flags.writeable) for d, _ in weights}) == 1:
            return gemv_many(x, weights)
        return [gemv_many(x, [weight])[0] for weight in weights]
    if kernel == "gemm":
        return gemm_many(x, weights, interleaved)
    quantized = [i for i, (_, fmt) in enumerate(weights) if fmt.qtype != T.F32]
    x16 = None if interleaved is None else [interleaved[i] for i in quantized]
    if 1 < len(quantized) < len(weights) and _kernel(x.shape[0], [weights[i][1] for i in quantized], x16) in (
            "gemm", "gemv"):
        # a prefill's float32 weights beside quantized ones (DeltaNet's alpha / beta beside qkv / z): BLAS for
        # those, one GEMM (or, interleaved, one GEMV) for the rest
        ys = dict(zip(quantized, matmul_many(x, [weights[i] for i in quantized], n_in, x16)))
        return [ys[i] if i in ys else matmul(x, data, fmt, n_in) for i, (data, fmt) in enumerate(weights)]
    return [matmul(x, data, fmt, n_in) for data, fmt in weights]


def matmul_each(xs: np.ndarray, weights: list[tuple[np.ndarray, WeightFormat]], x_of, n_in: int) -> list[np.ndarray]:
    """[xs[x_of[i]] @ W_i.T for each weight W_i] (one row each): a decode step's chosen experts through one
    parallel GEMV when the GEMV takes them all and their arrays share a numba type; else weight by weight."""
    xs = np.ascontiguousarray(xs, dtype=np.float32)
    kernel = _kernel(1, [fmt for _, fmt in weights])
    one_type = len({(d.dtype, d.ndim, d.flags.c_contiguous, d.flags.writeable) for d, _ in weights}) == 1
    if kernel == "gemv" and one_type:
        return gemv_each(xs, weights, x_of)
    return [matmul(xs[r:r + 1], data, fmt, n_in)[0] for (data, fmt), r in zip(weights, x_of)]


def matmul_grouped(xs: np.ndarray, groups: list[list[tuple[np.ndarray, WeightFormat]]], bounds,
                   n_in: int) -> list[np.ndarray]:
    """[ys_j] with ys_j[bounds[i]:bounds[i + 1]] = xs[bounds[i]:bounds[i + 1]] @ W_ij.T for each group i and
    its weights W_ij (as many in every group): each group's rows through matmul_many, so each row's values are
    what its group's rows alone give."""
    xs = np.ascontiguousarray(xs, dtype=np.float32)
    outs = [np.empty((xs.shape[0], data.shape[0]), np.float32) for data, _ in groups[0]]
    for i, weights in enumerate(groups):
        a, b = int(bounds[i]), int(bounds[i + 1])
        for out, y in zip(outs, matmul_many(xs[a:b], weights, n_in)):
            out[a:b] = y
    return outs


def matmul(x: np.ndarray, data: np.ndarray, fmt: WeightFormat, n_in: int, interleaved: tuple | None = None
           ) -> np.ndarray:
    """x f32 [n_tok, n_in] @ W.T where W is `data` (uint8 blocks [n_out, row_bytes]) -> f32 [n_tok, n_out]
    (`interleaved`: matmul_many's, for this weight)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    kernel = _kernel(x.shape[0], [fmt], [interleaved])
    if kernel == "blas":
        return x @ data.view(np.float32).T
    if kernel == "gemv":
        return gemv_many(x, [interleaved or (data, fmt)])[0]
    if kernel == "gemm":
        return gemm_many(x, [(data, fmt)], [interleaved])[0]
    n_out = data.shape[0]
    data = weight_rows(data)
    out = np.empty((x.shape[0], n_out), np.float32)
    tile = np.empty((min(ROW_TILE, n_out), n_in), np.float32)
    for start in range(0, n_out, ROW_TILE):
        stop = min(start + ROW_TILE, n_out)
        rows = tile[:stop - start]
        dequantize_rows(fmt.code, data, start, stop, rows, F16_TABLE)  # (serial: BLAS's threads need the cores)
        out[:, start:stop] = x @ rows.T  # (matmul into a strided `out=` would skip BLAS)
    return out
