"""Weight block formats: our NumPy dequantization against the `gguf` package's independent one, and the numba
matmul kernels (streamed GEMV and BLAS tiles) against the NumPy reference."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cupyllm.quant.cpu_matmul import dequantize_numba, matmul
from cupyllm.quant.weights import WEIGHT_FORMATS, dequantize

QUANTIZABLE = (T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)  # gguf.quants can quantize these
K_QUANTS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # fp16 scale offsets inside each block


def random_rows(qtype: T, n_rows: int, n_in: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype == T.F32:
        return rng.standard_normal((n_rows, n_in)).astype(np.float32).view(np.uint8)
    if qtype in QUANTIZABLE:
        packed = gguf.quants.quantize(rng.standard_normal((n_rows, n_in)).astype(np.float32), qtype)
        return np.ascontiguousarray(packed).view(np.uint8).reshape(n_rows, -1)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * n_in // block_values
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in K_QUANTS[qtype]:  # finite scales: random bytes could spell inf/NaN
        raw[:, off:off + 2] = rng.uniform(-0.05, 0.05, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_rows, -1)


@pytest.mark.parametrize("qtype", list(WEIGHT_FORMATS), ids=lambda t: t.name)
def test_reference_dequant_equals_gguf(qtype):
    rows = random_rows(qtype, 8, 512)
    ours = dequantize(rows, qtype, 512)
    theirs = gguf.quants.dequantize(rows, qtype).reshape(8, 512)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("qtype", list(WEIGHT_FORMATS), ids=lambda t: t.name)
def test_numba_dequant_equals_reference(qtype):
    rows = random_rows(qtype, 8, 512, seed=1)
    fmt = WEIGHT_FORMATS[qtype]
    np.testing.assert_allclose(dequantize_numba(rows, fmt, 512), dequantize(rows, qtype, 512), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n_tok", [1, 2, 7])
@pytest.mark.parametrize("qtype", list(WEIGHT_FORMATS), ids=lambda t: t.name)
def test_matmul_from_blocks(qtype, n_tok):
    n_out, n_in = 300, 512  # n_out not a multiple of the row tile or thread chunk
    rows = random_rows(qtype, n_out, n_in, seed=2)
    x = np.random.default_rng(3).standard_normal((n_tok, n_in)).astype(np.float32)
    reference = x.astype(np.float64) @ dequantize(rows, qtype, n_in).astype(np.float64).T
    got = matmul(x, rows, WEIGHT_FORMATS[qtype], n_in)
    assert got.dtype == np.float32 and got.shape == (n_tok, n_out)
    np.testing.assert_allclose(got, reference, rtol=2e-5, atol=2e-5 * np.abs(reference).max())
