"""The GPU backend's elementwise kernels (cupyllm/ops/elementwise/gpu.py, kernels_cu/elementwise/) against the
reference: RMSNorm and its fused residual adds -> the CPU backend; RoPE -> ops/elementwise/reference.py
`rope_tables` + `apply_rope` (1e-6: device float64 sincos vs the host's); SiLU, softcap 1e-6 relative; tanh-GELU
4e-6 absolute (1 + tanh cancels for negative inputs).

Marked `gpu`; skipped without a CUDA device. CUPYLLM_EMULATE=1 runs them on the CPU emulator (tests/support/cuda_emu).
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import GPU_TEST_MARKS, backend, cp  # noqa: F401 (fixtures)

pytestmark = GPU_TEST_MARKS


def test_rms_norm_and_fused_residuals(backend, cp):
    from cupyllm.backend.cpu import CPUBackend
    rng = np.random.default_rng(8)
    for shape in ((5, 896), (3, 4, 128), (2, 3584)):
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        r = rng.standard_normal(shape).astype(np.float32)
        w = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)
        want = CPUBackend.rms_norm(x, w, 1e-6)
        got = cp.asnumpy(backend.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
        total, normed = backend.rms_norm_residual(cp.asarray(x), cp.asarray(r), cp.asarray(w), 1e-6)
        np.testing.assert_array_equal(cp.asnumpy(total), x + r)
        np.testing.assert_allclose(cp.asnumpy(normed), CPUBackend.rms_norm(x + r, w, 1e-6), rtol=2e-6, atol=1e-6)
        added = backend.add_rms_norm(cp.asarray(r), cp.asarray(x), cp.asarray(w), 1e-6)  # r + norm(x)
        np.testing.assert_allclose(cp.asnumpy(added), r + want, rtol=2e-6, atol=2e-6)
        w2 = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)
        h, h_normed = backend.add_rms_norm_and_norm(cp.asarray(r), cp.asarray(x), cp.asarray(w), 1e-6, cp.asarray(w2))
        np.testing.assert_array_equal(cp.asnumpy(h), cp.asnumpy(added))  # the fused pass: the two kernels' bits
        np.testing.assert_array_equal(cp.asnumpy(h_normed), cp.asnumpy(backend.rms_norm(h, cp.asarray(w2), 1e-6)))
        np.testing.assert_allclose(cp.asnumpy(h_normed), CPUBackend.rms_norm(cp.asnumpy(h), w2, 1e-6),
                                   rtol=2e-6, atol=1e-6)
        scale = cp.asarray(np.array([0.3125 + shape[-1] * 1e-4], np.float32))  # Gemma 4's layer output scale
        scaled = backend.add_rms_norm(cp.asarray(r), cp.asarray(x), cp.asarray(w), 1e-6, out_scale=scale)
        np.testing.assert_array_equal(cp.asnumpy(scaled), cp.asnumpy(added * scale))  # the sum, then the scale
        hs, hs_normed = backend.add_rms_norm_and_norm(cp.asarray(r), cp.asarray(x), cp.asarray(w), 1e-6,
                                                      cp.asarray(w2), out_scale=scale)
        np.testing.assert_array_equal(cp.asnumpy(hs), cp.asnumpy(scaled))
        np.testing.assert_array_equal(cp.asnumpy(hs_normed), cp.asnumpy(backend.rms_norm(hs, cp.asarray(w2), 1e-6)))


ROPE_CASES = {
    "neox": dict(base=1_000_000.0, n_rot=64),
    "normal": dict(base=10_000.0, n_rot=64, neox=False),
    "partial": dict(base=10_000.0, n_rot=32),
    "freq_factors": dict(base=500_000.0, n_rot=64, freq_factors=tuple(1.0 + 0.25 * i for i in range(32))),
    "linear": dict(base=10_000.0, n_rot=64, scaling="linear", factor=4.0),
    "yarn": dict(base=1_000_000.0, n_rot=64, scaling="yarn", factor=4.0, original_ctx=32768),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_variants(backend, cp, case):
    from cupyllm.files.config import RopeConfig
    from cupyllm.ops.elementwise.reference import apply_rope, rope_tables
    rope = RopeConfig(**ROPE_CASES[case])
    rng = np.random.default_rng(9)
    positions = np.array([0, 1, 7, 4095, 32768, 131071, 999_999])
    x = rng.standard_normal((len(positions), 3, 64)).astype(np.float32)
    cos, sin = rope_tables(rope, positions)
    want = apply_rope(x, cos, sin, rope.neox)
    got = cp.asnumpy(backend.rope(cp.asarray(x), rope, positions))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    if rope.n_rot < 64:
        np.testing.assert_array_equal(got[..., rope.n_rot:], x[..., rope.n_rot:])


@pytest.mark.parametrize("case", ["neox", "normal", "partial"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_rope_of_normed_q_and_k_in_one_launch(backend, cp, case, head_dim):
    """rope_qk: q and k (their own heads and positions, as DCA has them) each RMS-normed per head, then
    rotated, against the CPU backend's rms_norm and rope one after the other."""
    from cupyllm.backend.cpu import CPUBackend
    from cupyllm.files.config import RopeConfig
    rope = RopeConfig(**{**ROPE_CASES[case], "n_rot": min(head_dim, ROPE_CASES[case]["n_rot"] * head_dim // 64)})
    rng = np.random.default_rng(10)
    q_pos, k_pos = np.array([0, 5, 4095, 70000]), np.array([0, 5, 3000, 3001])
    q = (rng.standard_normal((4, 6, head_dim)) * 4).astype(np.float32)
    k = (rng.standard_normal((4, 2, head_dim)) * 4).astype(np.float32)
    q_norm, k_norm = (1 + 0.2 * rng.standard_normal((2, head_dim))).astype(np.float32)
    cpu = CPUBackend()
    for norms in ((None, None), (q_norm, k_norm)):
        want_q, want_k = cpu.rope_qk(q, k, rope, q_pos, k_pos, *norms, eps=1e-6)
        got_q, got_k = backend.rope_qk(cp.asarray(q), cp.asarray(k), rope, q_pos, k_pos,
                                       *(None if w is None else cp.asarray(w) for w in norms), eps=1e-6)
        np.testing.assert_allclose(cp.asnumpy(got_q), want_q, rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(cp.asnumpy(got_k), want_k, rtol=2e-6, atol=2e-6)
        alone, none = backend.rope_qk(cp.asarray(q), None, rope, q_pos, None,
                                      None if norms[0] is None else cp.asarray(norms[0]), None, eps=1e-6)
        assert none is None
        np.testing.assert_array_equal(cp.asnumpy(alone), cp.asnumpy(got_q))


def test_activations_and_softcap(backend, cp):
    from cupyllm.ops.elementwise.reference import gelu_tanh, silu
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((7, 300)) * 4).astype(np.float32)
    up = rng.standard_normal((7, 300)).astype(np.float32)
    # GELU's 1 + tanh(.) cancels for negative x: a 2-ulp tanh (CUDA's tanhf) moves it by ~2.4e-7 * |x| / 2
    for name, ref, atol in (("silu", silu, 1e-7), ("gelu_tanh", gelu_tanh, 4e-6)):
        got = cp.asnumpy(getattr(backend, name)(cp.asarray(x)))
        np.testing.assert_allclose(got, ref(x), rtol=1e-6, atol=atol)
        gated = cp.asnumpy(backend.gated_act(cp.asarray(x), cp.asarray(up), name))
        np.testing.assert_allclose(gated, ref(x) * up, rtol=1e-6, atol=atol * np.abs(up).max())
    capped = cp.asnumpy(backend.softcap(cp.asarray(x * 10), 30.0))
    np.testing.assert_allclose(capped, np.float32(30.0) * np.tanh(x * 10 / np.float32(30.0)), rtol=1e-6, atol=1e-6)
