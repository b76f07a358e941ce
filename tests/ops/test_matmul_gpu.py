"""The GPU backend's weight kernels (cupyllm/ops/matmul/gpu.py, kernels_cu/matmul/) against the reference.

References: weight blocks -> cupyllm/ops/matmul/reference.py `dequantize` (bit for bit); matmuls -> float64 products
of those values (GEMV, float32 activations) or of their f16 roundings (prefill paths). Tolerances: dequantization and
embedding rows exact; GEMV and MMA sums |y - ref| <= 2e-5 * sum_k |w_k x_k| (summation order differs).

Marked `gpu`; skipped without a CUDA device. CUPYLLM_EMULATE=1 runs them on the CPU emulator (tests/support/cuda_emu).
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import GPU_TEST_MARKS, backend, cp  # noqa: F401 (fixtures)

pytestmark = GPU_TEST_MARKS


def _weight_types():
    from cupyllm.ops.matmul.gpu import WEIGHT_TYPES
    return list(WEIGHT_TYPES)


def make_weight(type_name: str, n_out: int, n_in: int, seed: int = 0):
    """A Weight of random valid blocks (host) and the float32 values it decodes to by the reference."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from cupyllm.ops.matmul.reference import WEIGHT_FORMATS, dequantize
    from cupyllm.models.weights import Weight

    qtype = T[type_name]
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):  # no quantizer in gguf-py: random blocks with moderate scales
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n_out * n_in // block_values, block_bytes), dtype=np.uint8)
        for off in {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]:
            raw[:, off:off + 2] = (rng.uniform(0.2, 1.0, len(raw)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    elif qtype == T.F32:
        raw = values
    else:
        raw = gguf.quants.quantize(values, qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, -1)
    fmt = WEIGHT_FORMATS[qtype]
    return Weight(f"test.{type_name}", fmt, (n_out, n_in), raw), dequantize(raw, qtype, n_in)


def assert_sums_close(got, w, x, bias=None, rel=2e-5):
    """got [n, n_out] vs x @ w.T (+ bias) in float64, within rel * sum_k |w_k x_k| per output."""
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    if bias is not None:
        ref = ref + bias
        scale = scale + np.abs(bias)
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err - rel * scale), err.shape)
    assert np.all(err <= rel * scale + 1e-30), f"at {worst}: got {got[worst]}, want {ref[worst]} (scale {scale[worst]})"


@pytest.mark.parametrize("type_name", _weight_types())
def test_dequantize_rows_bit_exact(backend, cp, type_name):
    weight, ref = make_weight(type_name, 7, 512)
    on_device = backend.upload(weight)
    got = cp.asnumpy(backend.kernels.dequantize(on_device))
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(cp.asnumpy(backend.kernels.dequantize(on_device, dtype="float16")),
                                  ref.astype(np.float16))
    ids = np.array([3, 0, 6, 3], np.int64)
    np.testing.assert_array_equal(cp.asnumpy(backend.embed(on_device, ids)), ref[ids])


@pytest.mark.parametrize("type_name", _weight_types())
def test_gemv_every_instantiation(backend, cp, type_name):
    """Every (tokens, rows per warp) shape; rows not a multiple of a CTA's; several spans, the last partial."""
    from cupyllm.ops.matmul.gpu import GEMV_SHAPES
    weight, w = make_weight(type_name, 45, 1280, seed=1)
    on_device = backend.upload(weight)
    rng = np.random.default_rng(2)
    bias = rng.standard_normal(45).astype(np.float32)
    for tokens, rows in GEMV_SHAPES:
        for n in sorted({1, tokens}):
            x = rng.standard_normal((n, 1280)).astype(np.float32)
            with_bias = (tokens + rows) % 2 == 0
            got = backend.kernels.gemv(on_device, cp.asarray(x), cp.asarray(bias) if with_bias else None,
                                       shape=(tokens, rows))
            assert_sums_close(cp.asnumpy(got), w, x, bias if with_bias else None)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K"])
def test_gemv_of_several_matrices_in_one_launch(backend, cp, type_name):
    """gemv_many: up to three matrices of one type (different row counts, a bias on some) give each the sums
    of a launch of its own, bit for bit; linear_many groups by type (a Q5_0 matrix among them runs apart)."""
    weights = [backend.upload(make_weight(type_name, n_out, 512, seed=5 + i)[0]) for i, n_out in enumerate((70, 9, 33))]
    rng = np.random.default_rng(6)
    biases = [None, cp.asarray(rng.standard_normal(9).astype(np.float32)), None]
    for n in (1, 3):
        x = cp.asarray(rng.standard_normal((n, 512)).astype(np.float32))
        together = backend.kernels.gemv_many(weights, x, biases)
        for weight, bias, got in zip(weights, biases, together):
            np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(backend.kernels.gemv(weight, x, bias)))
        other = backend.upload(make_weight("Q5_0", 17, 512, seed=9)[0])
        mixed = backend.linear_many(x, [weights[0], other, weights[2]], [None, None, None])
        for weight, got in zip((weights[0], other, weights[2]), mixed):
            np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(backend.kernels.gemv(weight, x)))
    from cupyllm.errors import DeviceError
    with pytest.raises(DeviceError, match="one type and width"):
        backend.kernels.gemv_many([weights[0], other], x)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K", "F16"])
def test_gated_gemv_equals_the_gemvs_then_gated_act(backend, cp, type_name):
    """weight_gemv_gated: act(gate . x) * (up . x), or * given up values, in one launch; bit for bit the two
    GEMVs then gated_act, for every instantiation (rows past the end of a partial last warp included), and
    gated_linear takes it for a few tokens and the separate kernels otherwise."""
    from cupyllm.ops.matmul.gpu import GEMV_GATED_SHAPES, GEMV_MAX_TOKENS
    n_out, n_in = 37, 512
    gate, up = (backend.upload(make_weight(type_name, n_out, n_in, seed=11 + i)[0]) for i in range(2))
    rng = np.random.default_rng(12)
    for tokens, rows in GEMV_GATED_SHAPES:
        for n in sorted({1, tokens}):
            x = cp.asarray(rng.standard_normal((n, n_in)).astype(np.float32))
            given = cp.asarray(rng.standard_normal((n, n_out)).astype(np.float32))
            g, u = backend.kernels.gemv(gate, x), backend.kernels.gemv(up, x)
            for activation in ("silu", "gelu_tanh"):
                fused = backend.kernels.gemv_gated(gate, x, activation, up=up, shape=(tokens, rows))
                np.testing.assert_array_equal(cp.asnumpy(fused), cp.asnumpy(backend.gated_act(g, u, activation)))
                by_given = backend.kernels.gemv_gated(gate, x, activation, up_given=given, shape=(tokens, rows))
                np.testing.assert_array_equal(cp.asnumpy(by_given),
                                              cp.asnumpy(backend.gated_act(g, given, activation)))
    x = cp.asarray(rng.standard_normal((GEMV_MAX_TOKENS + 1, n_in)).astype(np.float32))  # prefill: apart
    for w_up, given in ((up, None), (None, cp.asarray(rng.standard_normal((len(x), n_out)).astype(np.float32)))):
        got = backend.gated_linear(x, gate, "silu", w_up=w_up, up=given)
        want = backend.gated_act(backend.linear(x, gate), backend.linear(x, up) if given is None else given, "silu")
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(want))
    from cupyllm.errors import DeviceError
    other = backend.upload(make_weight("Q5_0", n_out, n_in, seed=13)[0])
    with pytest.raises(DeviceError, match="one type and shape"):
        backend.kernels.gemv_gated(gate, x[:1], "silu", up=other)


@pytest.mark.parametrize("type_name", _weight_types())
def test_mma_matmul(backend, cp, type_name):
    """The tensor-core prefill kernel: two row tiles and two token tiles, both partial, with a bias."""
    weight, w = make_weight(type_name, 70, 512, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((67, 512)).astype(np.float32)
    bias = rng.standard_normal(70).astype(np.float32)
    got = backend.kernels.mma_matmul(backend.upload(weight), cp.asarray(x.astype(np.float16)), cp.asarray(bias))
    assert_sums_close(cp.asnumpy(got), w.astype(np.float16).astype(np.float32),
                      x.astype(np.float16).astype(np.float32), bias)


@pytest.mark.parametrize("path", ["cublas", "mma", "auto"])
def test_linear_dispatch(cp, path):
    """backend.linear: GEMV up to 8 tokens, the chosen prefill path above; rows of 64 floats (not a multiple
    of the MMA depth) take the cuBLAS path either way."""
    from cupyllm.backend.gpu import GPUBackend
    ops = GPUBackend(prefill=path, attention="decode")
    rng = np.random.default_rng(5)
    for type_name, n_in in (("Q4_K", 256), ("Q8_0", 384), ("F32", 64)):
        weight, w = make_weight(type_name, 33, n_in, seed=6)
        on_device = ops.upload(weight)
        for n in (1, 8, 9, 40):
            x = rng.standard_normal((n, n_in)).astype(np.float32)
            got = cp.asnumpy(ops.linear(cp.asarray(x), on_device))
            if n <= 8:
                assert_sums_close(got, w, x)
            else:
                assert_sums_close(got, w.astype(np.float16).astype(np.float32), x.astype(np.float16).astype(np.float32))


def test_float_rows_the_kernels_cannot_read_fall_back_to_dense(backend, cp):
    """F16 rows of 40 values are not whole 32-value pseudo-blocks: stored as dense float32 rows instead."""
    weight, w = make_weight("F16", 9, 40)
    on_device = backend.upload(weight)
    x = np.random.default_rng(7).standard_normal((3, 40)).astype(np.float32)
    assert_sums_close(cp.asnumpy(backend.linear(cp.asarray(x), on_device)), w, x)
    np.testing.assert_array_equal(cp.asnumpy(backend.embed(on_device, np.array([8, 1]))), w[[8, 1]])


def test_embed_rejects_out_of_range_ids(backend):
    from cupyllm.errors import CupyllmError
    weight, _ = make_weight("Q8_0", 5, 64)
    with pytest.raises(CupyllmError, match="token ids"):
        backend.embed(backend.upload(weight), np.array([1, 5]))
