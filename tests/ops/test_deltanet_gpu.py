"""The GPU Gated DeltaNet kernels (cupyllm/ops/deltanet/gpu.py, kernels_cu/deltanet/deltanet.cu) against the float64
definitions of cupyllm/ops/deltanet/reference.py, with the states carried across calls (a prompt then decode steps
gives what one longer prompt gives).

Tolerances (float32 kernels, float32 sums, against float64): conv + SiLU 1e-6 absolute (|x| ~ 1: a 4-term sum);
the delta rule 1e-6 absolute on outputs (|o| ~ 0.05: q is normalised and scaled by 1 / sqrt(Dk); seen: 1e-8) and
on the state (|S| ~ 1, 40 tokens of rank-one updates with Dk-long float32 dots; seen: 1e-7); a prompt and the same
tokens one decode step at a time are the same float32 operations, so equal bit for bit; the gated RMSNorm 2e-6
relative.

Marked `gpu`; skipped without a CUDA device. CUPYLLM_EMULATE=1 runs them on the CPU emulator (tests/support/cuda_emu).
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import GPU_TEST_MARKS, cp  # noqa: F401 (fixture)

pytestmark = GPU_TEST_MARKS

DELTA_ATOL = 1e-6


@pytest.fixture(scope="module")
def kernels(cp):
    from cupyllm.ops.deltanet.gpu import DeltaNetKernels
    return DeltaNetKernels()


# (key heads, value heads, Dk, Dv): GQA Hk < Hv at head dim 128 (Qwen3.5's), a small 32 case, Dv != Dk with Dv
# not a multiple of a block's 32 columns
SHAPES = {"hk2_hv4_d128": (2, 4, 128, 128), "hk1_hv2_d32": (1, 2, 32, 32), "hk2_hv2_dk64_dv48": (2, 2, 64, 48)}


def _delta_inputs(rng, n, hk, hv, dk, dv):
    from cupyllm.ops.deltanet.reference import decay_and_beta
    q = rng.standard_normal((n, hk, dk)).astype(np.float32)
    k = rng.standard_normal((n, hk, dk)).astype(np.float32)
    v = rng.standard_normal((n, hv, dv)).astype(np.float32)
    g, beta = decay_and_beta(rng.standard_normal((n, hv)), rng.standard_normal((n, hv)),
                             np.log(rng.uniform(0.5, 4.0, hv)), rng.standard_normal(hv))
    return q, k, v, g.astype(np.float32), beta.astype(np.float32)


@pytest.mark.parametrize("channels", [2 * 2 * 128 + 4 * 128, 2 * 32 + 2 * 32 + 7])
def test_conv1d_silu_carries_its_state(kernels, cp, channels):
    from cupyllm.ops.deltanet.reference import causal_conv1d_silu
    rng = np.random.default_rng(31)
    x = rng.standard_normal((37 + 3, channels)).astype(np.float32)
    w = (0.5 * rng.standard_normal((channels, 4))).astype(np.float32)
    start = rng.standard_normal((3, channels)).astype(np.float32)
    want_y, want_state = causal_conv1d_silu(x, w, start)
    state = cp.asarray(start)
    got = [cp.asnumpy(kernels.conv1d_silu(cp.asarray(x[:37]), cp.asarray(w), state))]
    np.testing.assert_allclose(got[0], want_y[:37], rtol=0, atol=1e-6)
    for t in range(37, 40):  # decode steps after the prompt
        got.append(cp.asnumpy(kernels.conv1d_silu(cp.asarray(x[t:t + 1]), cp.asarray(w), state)))
    np.testing.assert_allclose(np.concatenate(got), want_y, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(cp.asnumpy(state), want_state.astype(np.float32))  # the last 3 inputs, exactly
    short = cp.zeros((3, channels), dtype=cp.float32)  # a prompt shorter than the window, from a sequence start
    y2 = cp.asnumpy(kernels.conv1d_silu(cp.asarray(x[:2]), cp.asarray(w), short))
    want2, want2_state = causal_conv1d_silu(x[:2], w)
    np.testing.assert_allclose(y2, want2, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(cp.asnumpy(short), want2_state.astype(np.float32))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gated_delta_rule_prompt_then_decode(kernels, cp, shape):
    from cupyllm.ops.deltanet.reference import gated_delta_rule
    hk, hv, dk, dv = SHAPES[shape]
    rng = np.random.default_rng(32)
    q, k, v, g, beta = _delta_inputs(rng, 40, hk, hv, dk, dv)
    start = (0.1 * rng.standard_normal((hv, dk, dv))).astype(np.float32)
    want_o, want_state = gated_delta_rule(q, k, v, g, beta, start)
    state = cp.asarray(start)
    outs = [cp.asnumpy(kernels.gated_delta_rule(*(cp.asarray(a[:37]) for a in (q, k, v, g, beta)), state))]
    np.testing.assert_allclose(outs[0], want_o[:37], rtol=0, atol=DELTA_ATOL)
    for t in range(37, 40):  # decode: n = 1 from the carried state
        outs.append(cp.asnumpy(kernels.gated_delta_rule(*(cp.asarray(a[t:t + 1]) for a in (q, k, v, g, beta)), state)))
    np.testing.assert_allclose(np.concatenate(outs), want_o, rtol=0, atol=DELTA_ATOL)
    np.testing.assert_allclose(cp.asnumpy(state), want_state, rtol=0, atol=DELTA_ATOL)
    # one prompt of all 40 tokens from the same start: the outputs and state of 37 + 3 steps, bit for bit
    whole_state = cp.asarray(start)
    whole = cp.asnumpy(kernels.gated_delta_rule(*(cp.asarray(a) for a in (q, k, v, g, beta)), whole_state))
    np.testing.assert_array_equal(whole, np.concatenate(outs))
    np.testing.assert_array_equal(cp.asnumpy(whole_state), cp.asnumpy(state))


def test_gated_delta_rule_decode_from_a_sequence_start(kernels, cp):
    """n = 1 from a zero state: o = beta (q.k) v with q, k normalised (q also scaled), the state beta k v^T."""
    from cupyllm.ops.deltanet.reference import gated_delta_rule
    rng = np.random.default_rng(33)
    hk, hv, dk, dv = SHAPES["hk2_hv4_d128"]
    q, k, v, g, beta = _delta_inputs(rng, 1, hk, hv, dk, dv)
    state = cp.zeros((hv, dk, dv), dtype=cp.float32)
    got = cp.asnumpy(kernels.gated_delta_rule(*(cp.asarray(a) for a in (q, k, v, g, beta)), state))
    want_o, want_state = gated_delta_rule(q, k, v, g, beta)
    np.testing.assert_allclose(got, want_o, rtol=0, atol=1e-6)
    np.testing.assert_allclose(cp.asnumpy(state), want_state, rtol=0, atol=1e-6)


def test_gated_rms_norm(kernels, cp):
    from cupyllm.ops.deltanet.reference import gated_rms_norm
    rng = np.random.default_rng(34)
    for shape in ((1, 4, 128), (37, 2, 32), (5, 3, 48)):
        x = (3 * rng.standard_normal(shape)).astype(np.float32)
        z = (2 * rng.standard_normal(shape)).astype(np.float32)
        w = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)
        got = cp.asnumpy(kernels.gated_rms_norm(cp.asarray(x), cp.asarray(z), cp.asarray(w), 1e-6))
        np.testing.assert_allclose(got, gated_rms_norm(x, z, w, 1e-6), rtol=2e-6, atol=1e-7)


def test_unsupported_shapes_raise_one_device_error(kernels, cp):
    from cupyllm.errors import DeviceError
    q = cp.zeros((1, 1, 96), dtype=cp.float32)
    v = cp.zeros((1, 2, 32), dtype=cp.float32)
    gates = cp.zeros((1, 2), dtype=cp.float32)
    with pytest.raises(DeviceError, match="key head dim 96"):
        kernels.gated_delta_rule(q, q, v, gates, gates, cp.zeros((2, 96, 32), dtype=cp.float32))
    q2 = cp.zeros((1, 2, 32), dtype=cp.float32)
    v3 = cp.zeros((1, 3, 32), dtype=cp.float32)
    with pytest.raises(DeviceError, match="3 value heads over 2 key heads"):
        kernels.gated_delta_rule(q2, q2, v3, gates[:, :1].repeat(3, axis=1), gates[:, :1].repeat(3, axis=1),
                                 cp.zeros((3, 32, 32), dtype=cp.float32))
    with pytest.raises(DeviceError, match="recurrent state must be a C-contiguous float32"):
        kernels.gated_delta_rule(q2, q2, v, gates, gates, cp.zeros((2, 32, 32), dtype=cp.float64))
    with pytest.raises(DeviceError, match="width 3"):
        kernels.conv1d_silu(cp.zeros((1, 8), dtype=cp.float32), cp.zeros((8, 3), dtype=cp.float32),
                            cp.zeros((2, 8), dtype=cp.float32))
