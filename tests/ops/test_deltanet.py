"""The Gated DeltaNet family (cupyllm/ops/deltanet/): the float64 reference against independent definitions, the
CPU kernels (float32) against the reference, and both against HF transformers' outputs stored by
tools/make_hf_deltanet_reference.py.

- The recurrence against the paper's form written out with explicit matrices (M_t = M_{t-1} exp(g_t)
  (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = M_t q_t): 1e-12. The chunked reference against the recurrence
  (lengths around the chunk of 64, with and without an initial state, one and two value heads per key head):
  1e-12 (measured 6e-16). The conv against np.convolve per channel: 1e-12.
- CPU kernels against the reference, outputs ~0.3 and states ~1 in magnitude: the token loop and the one-token
  step within 5e-7 (measured up to 1.7e-7), the float32 chunked form within 1e-5 (measured up to 2.3e-6 on the
  state; HF's own float32 chunked function is off the reference by up to 7.9e-6 on the same inputs); conv 1e-5
  (measured 2e-6, silu of sums up to ~10), gated norm 1e-5 (measured 1e-6; a prompt's rows, normed on the threads,
  equal the same rows normed a few at a time bit for bit).
  A prompt run as prefill, decode steps and a second prefill, carrying both states, equals one prefill over the
  whole prompt bit for bit for the conv and the token loop (their sums keep their order), within 1e-5 by the
  chunked form.
- Against transformers (float32, stored): the reference within 2e-6 (measured 4.3e-7) on outputs, states, conv and
  norm; the gates g within 1e-6 relative (measured 2.6e-7), beta 1e-6; the CPU token loop within 2e-6 (measured
  1.9e-7).
"""
from __future__ import annotations

import numpy as np
import pytest

import make_hf_deltanet_reference as hf_reference
from cupyllm.ops.deltanet import cpu
from cupyllm.ops.deltanet.reference import (causal_conv1d_silu, decay_and_beta, gated_delta_rule,
                                            gated_delta_rule_chunked, gated_rms_norm, l2_normalize, silu)

F32 = np.float32


def random_inputs(rng, n, n_k, n_v, dk, dv, with_state=True):
    """float32 q, k, v, gates from the model's formulas (|g| from ~0.01 to ~20), and an initial state or None."""
    q = rng.standard_normal((n, n_k, dk)).astype(F32)
    k = rng.standard_normal((n, n_k, dk)).astype(F32)
    v = rng.standard_normal((n, n_v, dv)).astype(F32)
    g, beta = decay_and_beta(rng.standard_normal((n, n_v)) * 2, rng.standard_normal((n, n_v)) * 2,
                             np.log(rng.uniform(0.1, 8, n_v)), rng.standard_normal(n_v))
    state = rng.standard_normal((n_v, dk, dv)).astype(F32) * F32(0.5) if with_state else None
    return q, k, v, g.astype(F32), beta.astype(F32), state


def paper_form(q, k, v, g, beta, state):
    """The recurrence as Yang et al. write it, M [Dv, Dk] per head, explicit (I - beta k k^T); M = S^T."""
    n, n_k, dk = q.shape
    n_v, dv = v.shape[1:]
    g, beta = np.asarray(g, np.float64), np.asarray(beta, np.float64)
    m = np.zeros((n_v, dv, dk)) if state is None else np.swapaxes(np.asarray(state, np.float64), 1, 2).copy()
    out = np.zeros((n, n_v, dv))
    for t in range(n):
        for h in range(n_v):
            hk = h // (n_v // n_k)
            kt = l2_normalize(k[t, hk])
            qt = l2_normalize(q[t, hk]) / np.sqrt(dk)
            forget = np.exp(g[t, h]) * (np.eye(dk) - beta[t, h] * np.outer(kt, kt))
            m[h] = m[h] @ forget + beta[t, h] * np.outer(v[t, h], kt)
            out[t, h] = m[h] @ qt
    return out, np.swapaxes(m, 1, 2)


@pytest.mark.parametrize("heads", [(2, 4), (3, 3)])
def test_recurrence_is_the_papers(heads):
    q, k, v, g, beta, state = random_inputs(np.random.default_rng(1), 23, *heads, 8, 6)
    for initial in (state, None):
        out, final = gated_delta_rule(q, k, v, g, beta, initial)
        want_out, want_final = paper_form(q, k, v, g, beta, initial)
        np.testing.assert_allclose(out, want_out, atol=1e-12)
        np.testing.assert_allclose(final, want_final, atol=1e-12)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 130, 200])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("heads", [(2, 4), (2, 2)])
def test_chunked_reference_equals_recurrence(n, with_state, heads):
    q, k, v, g, beta, state = random_inputs(np.random.default_rng(n), n, *heads, 16, 12, with_state)
    out, final = gated_delta_rule(q, k, v, g, beta, state)
    chunk_out, chunk_final = gated_delta_rule_chunked(q, k, v, g, beta, state)
    np.testing.assert_allclose(chunk_out, out, atol=1e-12)
    np.testing.assert_allclose(chunk_final, final, atol=1e-12)


def test_conv_reference_is_a_causal_convolution():
    rng = np.random.default_rng(2)
    x, weight = rng.standard_normal((11, 5)), rng.standard_normal((5, 4))
    state = rng.standard_normal((3, 5))
    y, new_state = causal_conv1d_silu(x, weight, state)
    xx = np.concatenate([state, x])
    for c in range(5):  # np.convolve flips its kernel: weight[c, j] multiplies xx[t + j]
        np.testing.assert_allclose(y[:, c], silu(np.convolve(xx[:, c], weight[c, ::-1], "valid")), atol=1e-12)
    np.testing.assert_array_equal(new_state, xx[-3:])
    y0, _ = causal_conv1d_silu(x, weight)  # from an empty state: zeros before the first token
    np.testing.assert_allclose(y0, causal_conv1d_silu(x, weight, np.zeros((3, 5)))[0], atol=0)


@pytest.mark.parametrize("n", [1, 2, 3, 17])
def test_conv_kernel_equals_reference(n):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 70)).astype(F32)
    weight = rng.standard_normal((70, 4)).astype(F32)
    state = rng.standard_normal((3, 70)).astype(F32)
    want, want_state = causal_conv1d_silu(x, weight, state)
    got, got_state = np.empty_like(x), state.copy()
    cpu.conv1d_silu_rows(x, weight, got_state, got)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_array_equal(got_state, want_state.astype(F32))


@pytest.mark.parametrize("n", [1, 40, 64, 150])
@pytest.mark.parametrize("heads", [(2, 4), (4, 4)])
def test_delta_kernels_equal_reference(n, heads):
    q, k, v, g, beta, state = random_inputs(np.random.default_rng(10 + n), n, *heads, 32, 48)
    want, want_state = gated_delta_rule(q, k, v, g, beta, state)
    got, got_state = np.empty(v.shape, F32), state.copy()
    cpu.gated_delta_tokens(q, k, v, g, beta, got_state, got)
    np.testing.assert_allclose(got, want, atol=5e-7)
    np.testing.assert_allclose(got_state, want_state, atol=5e-7)
    step_state = state.copy()  # the first token alone, as a decode step
    first, first_state = gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], state)
    np.testing.assert_allclose(cpu.decode(q[0], k[0], v[0], g[0], beta[0], step_state), first[0], atol=5e-7)
    np.testing.assert_allclose(step_state, first_state, atol=5e-7)
    chunk_state = state.copy()
    np.testing.assert_allclose(cpu.gated_delta_chunked(q, k, v, g, beta, chunk_state), want, atol=1e-5)
    np.testing.assert_allclose(chunk_state, want_state, atol=1e-5)


def test_value_head_dim_off_the_tile_width_is_a_clear_error():
    q, k, v, g, beta, state = random_inputs(np.random.default_rng(4), 3, 2, 2, 16, 24)
    with pytest.raises(ValueError, match="value head dim .24. must be a multiple of 16"):
        cpu.gated_delta_tokens(q, k, v, g, beta, state, np.empty(v.shape, F32))


def test_prefill_then_decode_carries_the_states():
    """conv + delta rule over 100 tokens as prefill 70, three decode steps, prefill 27 = one prefill of 100."""
    rng = np.random.default_rng(5)
    n, n_k, n_v, dk, dv = 100, 2, 4, 32, 32
    q, k, v, g, beta, _ = random_inputs(rng, n, n_k, n_v, dk, dv)
    x = rng.standard_normal((n, 2 * n_k * dk + n_v * dv)).astype(F32)
    weight = rng.standard_normal((x.shape[1], 4)).astype(F32)

    def conv(pieces):
        state, out = np.zeros((3, x.shape[1]), F32), []
        for sl in pieces:
            y = np.empty_like(x[sl])
            cpu.conv1d_silu_rows(x[sl], weight, state, y)
            out.append(y)
        return np.concatenate(out), state
    pieces = [slice(0, 70), slice(70, 71), slice(71, 72), slice(72, 73), slice(73, 100)]
    whole, whole_state = conv([slice(0, n)])
    split, split_state = conv(pieces)
    np.testing.assert_array_equal(split, whole)
    np.testing.assert_array_equal(split_state, whole_state)

    def delta(pieces, chunked):
        state, out = np.zeros((n_v, dk, dv), F32), []
        for sl in pieces:
            if sl.stop - sl.start == 1:
                out.append(cpu.decode(q[sl][0], k[sl][0], v[sl][0], g[sl][0], beta[sl][0], state)[None])
            elif chunked:
                out.append(cpu.gated_delta_chunked(q[sl], k[sl], v[sl], g[sl], beta[sl], state))
            else:
                o = np.empty(v[sl].shape, F32)
                cpu.gated_delta_tokens(q[sl], k[sl], v[sl], g[sl], beta[sl], state, o)
                out.append(o)
        return np.concatenate(out), state
    whole, whole_state = delta([slice(0, n)], chunked=False)
    split, split_state = delta(pieces, chunked=False)
    np.testing.assert_array_equal(split, whole)
    np.testing.assert_array_equal(split_state, whole_state)
    split, split_state = delta(pieces, chunked=True)
    np.testing.assert_allclose(split, whole, atol=1e-5)
    np.testing.assert_allclose(split_state, whole_state, atol=1e-5)
    want, want_state = gated_delta_rule(q, k, v, g, beta)
    np.testing.assert_allclose(whole, want, atol=5e-7)
    np.testing.assert_allclose(whole_state, want_state, atol=5e-7)


@pytest.mark.parametrize("n_rows", [9, 200])
def test_gated_norm_kernel_equals_reference(n_rows):
    """A decode step's few rows (on the calling thread) and a prompt's (on the threads): the reference's values,
    and a prompt's rows the same bit for bit as those rows normed a few at a time."""
    rng = np.random.default_rng(6)
    x, z = (rng.standard_normal((n_rows, 128)).astype(F32) for _ in range(2))
    weight = (1 + 0.1 * rng.standard_normal(128)).astype(F32)
    out = np.empty_like(x)
    cpu.gated_rms_norm_rows(x, z, weight, F32(1e-6), out)
    np.testing.assert_allclose(out, gated_rms_norm(x, z, weight, 1e-6), atol=1e-5)
    pieces = np.empty_like(x)
    for start in range(0, n_rows, 4):
        cpu.gated_rms_norm_rows(x[start:start + 4], z[start:start + 4], weight, F32(1e-6), pieces[start:start + 4])
    np.testing.assert_array_equal(pieces, out)


@pytest.fixture(scope="module")
def stored():
    return dict(np.load(hf_reference.OUT))


@pytest.mark.parametrize("name", ["chunk", "recurrent"])
def test_delta_rule_against_transformers(stored, name):
    d = {key[len(name) + 1:]: value for key, value in stored.items() if key.startswith(name + "_")}
    g, beta = decay_and_beta(d["a"], d["b"], stored["a_log"], stored["dt_bias"])
    np.testing.assert_allclose(g, d["g"], rtol=1e-6)
    np.testing.assert_allclose(beta, d["beta"], atol=1e-6)
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"])
    for rule in (gated_delta_rule, gated_delta_rule_chunked):
        out, final = rule(*args, d["state"])
        np.testing.assert_allclose(out, d["out"], atol=2e-6)
        np.testing.assert_allclose(final, d["final_state"], atol=2e-6)
    got, state = np.empty(d["v"].shape, F32), d["state"].copy()
    cpu.gated_delta_tokens(*args, state, got)
    np.testing.assert_allclose(got, d["out"], atol=2e-6)
    np.testing.assert_allclose(state, d["final_state"], atol=2e-6)


def test_conv_and_norm_against_transformers(stored):
    weight = stored["conv_weight"]
    y, _ = causal_conv1d_silu(stored["conv_x"], weight)
    np.testing.assert_allclose(y, stored["conv_prefill_out"], atol=2e-6)
    ours_state = stored["conv_hf_state"][:, 1:].T.copy()  # HF's K columns, the oldest unread -> [K - 1, C]
    y, new_state = causal_conv1d_silu(stored["conv_token"], weight, ours_state)
    np.testing.assert_allclose(y, stored["conv_update_out"], atol=2e-6)
    np.testing.assert_array_equal(new_state, stored["conv_update_hf_state"][:, 1:].T)
    got = np.empty_like(stored["conv_token"])
    cpu.conv1d_silu_rows(stored["conv_token"], weight, ours_state, got)
    np.testing.assert_allclose(got, stored["conv_update_out"], atol=2e-6)
    x, z = stored["norm_x"], stored["norm_z"]
    np.testing.assert_allclose(gated_rms_norm(x, z, stored["norm_weight"]), stored["norm_out"], atol=2e-6)


def test_stored_reference_is_what_transformers_computes(stored):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    inputs = hf_reference.make_inputs()
    for name, value in inputs.items():
        np.testing.assert_array_equal(stored[name], value, err_msg=f"{name}: run tools/make_hf_deltanet_reference.py")
    for name, value in hf_reference.hf_outputs(inputs).items():
        np.testing.assert_allclose(stored[name], value, rtol=1e-6, atol=1e-6, err_msg=name)
