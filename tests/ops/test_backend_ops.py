"""Every elementwise operation of the backend contract (backend/base.py), on every backend, against the NumPy
reference in float64, over one set of shapes: llama.cpp's test-backend-ops in small. The CPU backend always; the
GPU backend where one is (a device, or CUPYLLM_EMULATE=1: the CUDA emulator, which CI runs in
tests/test_gpu_backend_emulated.py)."""
from __future__ import annotations

import numpy as np
import pytest

from cupyllm.backend.cpu import CPUBackend
from cupyllm.cuda import gpu_count
from cupyllm.files.config import RopeConfig
from cupyllm.ops.elementwise.reference import apply_rope, gelu_tanh, rms_norm, rope_tables, silu, softcap

SHAPES = [(1, 64), (5, 896), (3, 4, 128), (2, 2304)]  # a decode row; Qwen2.5-0.5B; per-head rows; Gemma 2B width
EPS = 1e-6
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=["cpu", pytest.param("gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA device or CUPYLLM_EMULATE=1")])])
def backend(request):
    if request.param == "cpu":
        return CPUBackend(threads=1)
    from cupyllm.backend.gpu import GPUBackend
    return GPUBackend(attention="decode")


def inputs(shape, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    r = rng.standard_normal(shape).astype(np.float32)
    w, w2 = (1 + 0.1 * rng.standard_normal((2, shape[-1]))).astype(np.float32)
    return x, r, w, w2


def run(backend, op, *args, **kwargs):
    """backend.op on the backend's arrays, results back as NumPy (a tuple stays a tuple)."""
    moved = [backend.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    out = getattr(backend, op)(*moved, **{k: backend.asarray(v) if isinstance(v, np.ndarray) else v
                                          for k, v in kwargs.items()})
    return tuple(backend.to_numpy(o) for o in out) if isinstance(out, tuple) else backend.to_numpy(out)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_norms_and_their_fused_adds(backend, shape):
    x, r, w, w2 = inputs(shape, 1)
    scale = np.array([0.8125], np.float32)
    np.testing.assert_allclose(run(backend, "rms_norm", x, w, EPS), rms_norm(x, w, EPS), **TOL)
    h, n = run(backend, "rms_norm_residual", x, r, w, EPS)
    np.testing.assert_allclose(h, x.astype(np.float64) + r, **TOL)
    np.testing.assert_allclose(n, rms_norm(x.astype(np.float64) + r, w, EPS), **TOL)
    added = r + rms_norm(x, w, EPS)
    np.testing.assert_allclose(run(backend, "add_rms_norm", r, x, w, EPS), added, **TOL)
    np.testing.assert_allclose(run(backend, "add_rms_norm", r, x, w, EPS, scale), added * scale[0], **TOL)
    h, n = run(backend, "add_rms_norm_and_norm", r, x, w, EPS, w2, scale)
    np.testing.assert_allclose(h, added * scale[0], **TOL)
    np.testing.assert_allclose(n, rms_norm(added * scale[0], w2, EPS), **TOL)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation(backend, shape, activation):
    gate, up, _, _ = inputs(shape, 2)
    act = silu if activation == "silu" else gelu_tanh
    want = act(gate.astype(np.float64)) * up
    np.testing.assert_allclose(run(backend, "gated_act", gate, up, activation), want, **TOL)


@pytest.mark.parametrize("cap", [30.0, 50.0])
def test_softcap(backend, cap):
    x = (np.random.default_rng(3).standard_normal((3, 1000)) * 40).astype(np.float32)
    np.testing.assert_allclose(run(backend, "softcap", x, cap), softcap(x.astype(np.float64), cap), **TOL)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_dim, n_rot", [(64, 64), (128, 64), (256, 256)])
def test_rope_of_normed_q_and_k(backend, neox, head_dim, n_rot):
    rope = RopeConfig(base=10_000.0, n_rot=n_rot, neox=neox)
    rng = np.random.default_rng(4)
    q_pos, k_pos = np.array([0, 3, 4095]), np.array([0, 2, 4000])
    q = (rng.standard_normal((3, 4, head_dim)) * 2).astype(np.float32)
    k = (rng.standard_normal((3, 2, head_dim)) * 2).astype(np.float32)
    q_norm, k_norm = (1 + 0.2 * rng.standard_normal((2, head_dim))).astype(np.float32)
    got_q, got_k = run(backend, "rope_qk", q, k, rope, q_pos, k_pos, q_norm, k_norm, eps=EPS)
    for got, x, norm, pos in ((got_q, q, q_norm, q_pos), (got_k, k, k_norm, k_pos)):
        cos, sin = rope_tables(rope, pos)
        want = apply_rope(rms_norm(x, norm, EPS).astype(np.float32), cos, sin, neox)
        np.testing.assert_allclose(got, want, **TOL)
