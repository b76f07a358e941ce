"""The elementwise family (cupyllm/ops/elementwise/): RoPE against independent definitions (HF transformers'
rope initialisers for the frequencies, stored by tools/make_hf_tiny_reference.py, a per-pair rotation written out for NEOX / normal ordering and partial
rotary dims), and the CPU kernels (RMSNorm, RoPE rows, the gated activations) against reference.py."""
from __future__ import annotations

import math

import numpy as np
import pytest

import make_hf_tiny_reference as hf_reference
from cupyllm.files.config import RopeConfig
from cupyllm.ops.elementwise.cpu import rms_norm_rows, rope_rows
from cupyllm.ops.elementwise.reference import apply_rope, inverse_frequencies, rope_tables


def rotate_pairs(x, positions, inv_freq, mscale, neox):
    """x [n, heads, d]: rotate pair i of each head by positions * inv_freq[i], the slow obvious way."""
    out = x.astype(np.float64).copy()
    n_pairs = len(inv_freq)
    for t, pos in enumerate(positions):
        for i in range(n_pairs):
            a, b = (i, i + n_pairs) if neox else (2 * i, 2 * i + 1)
            c, s = math.cos(pos * inv_freq[i]) * mscale, math.sin(pos * inv_freq[i]) * mscale
            xa, xb = x[t, :, a].astype(np.float64), x[t, :, b].astype(np.float64)
            out[t, :, a], out[t, :, b] = xa * c - xb * s, xa * s + xb * c
    return out


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("n_rot", [32, 16])
def test_rotation_orderings_and_partial_dims(neox, n_rot):
    rope = RopeConfig(base=10000.0, n_rot=n_rot, neox=neox, freq_factors=tuple(np.linspace(1, 4, n_rot // 2)))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 32)).astype(np.float32)
    positions = np.array([0, 1, 7, 100, 4095])
    cos, sin = rope_tables(rope, positions)
    got = apply_rope(x, cos, sin, neox)
    inv_freq = 10000.0 ** (-2 * np.arange(n_rot // 2) / n_rot) / np.linspace(1, 4, n_rot // 2)
    np.testing.assert_allclose(got, rotate_pairs(x, positions, inv_freq, 1.0, neox), atol=2e-5)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])


def test_linear_scaling_matches_transformers():
    """transformers' inverse frequencies and attention factor, stored by tools/make_hf_tiny_reference.py."""
    stored = np.load(hf_reference.OUT)
    ours, mscale = inverse_frequencies(RopeConfig(base=1e6, n_rot=128, scaling="linear", factor=4.0))
    np.testing.assert_allclose(ours, stored["rope_linear_inv_freq"], rtol=1e-6)
    assert mscale == float(stored["rope_linear_attention_factor"]) == 1.0


def test_yarn_matches_transformers():
    stored = np.load(hf_reference.OUT)
    rope = RopeConfig(base=1e6, n_rot=128, scaling="yarn", factor=4.0, original_ctx=32768)
    ours, mscale = inverse_frequencies(rope)
    np.testing.assert_allclose(ours, stored["rope_yarn_inv_freq"], rtol=1e-5)
    assert mscale == pytest.approx(float(stored["rope_yarn_attention_factor"]), rel=1e-6)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("n_rot", [64, 48])  # full and partial rotary
def test_rope_rows_equals_apply_rope(neox, n_rot):
    cfg = RopeConfig(base=10000.0, n_rot=n_rot, neox=neox)
    positions = np.array([0, 5, 1000])
    cos, sin = rope_tables(cfg, positions)
    x = np.random.default_rng(1).standard_normal((3, 4, 64)).astype(np.float32)
    out = np.empty_like(x)
    rope_rows(x, cos, sin, neox, out)
    np.testing.assert_array_equal(out, apply_rope(x, cos, sin, neox))


@pytest.mark.parametrize("n_rows", [1, 67])
def test_rms_norm_rows(n_rows):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n_rows, 640)).astype(np.float32)
    w = rng.standard_normal(640).astype(np.float32)
    out = np.empty_like(x)
    rms_norm_rows(x, w, np.float32(1e-6), out)
    x64 = x.astype(np.float64)
    reference = x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("n_rows", [1, 100])
def test_gated_act_is_the_activation_times_up(activation, n_rows):
    """The backend's fused act(gate) * up (row blocks on threads, in-place buffers) gives the reference
    activation's values times up, bit for bit."""
    from cupyllm.backend.cpu import CPUBackend
    from cupyllm.ops.elementwise.reference import gelu_tanh, silu
    rng = np.random.default_rng(3)
    gate = (4 * rng.standard_normal((n_rows, 1000))).astype(np.float32)
    up = rng.standard_normal((n_rows, 1000)).astype(np.float32)
    reference = (silu if activation == "silu" else gelu_tanh)(gate) * up
    gate_before, up_before = gate.copy(), up.copy()
    got = CPUBackend().gated_act(gate, up, activation)
    np.testing.assert_array_equal(got, reference)
    np.testing.assert_array_equal(gate, gate_before)  # the inputs are left as they were
    np.testing.assert_array_equal(up, up_before)
