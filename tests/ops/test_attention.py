"""The reference attention (O, LSE) against a dense softmax written out directly, and the LSE merge."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from cupyllm.ops.attention.reference import attend, causal_mask, merge


def dense(q, k, v, allowed, scale, softcap=0.0, mask=None):
    """Direct float64 softmax attention, one head at a time; `mask` [n_q, n_k] is added to the scores (-inf drops
    a key)."""
    n_q, n_head, _ = q.shape
    group = n_head // k.shape[1]
    out = np.zeros((n_q, n_head, v.shape[-1]))
    lse = np.full((n_q, n_head), -np.inf)
    for h in range(n_head):
        s = (q[:, h].astype(np.float64) @ k[:, h // group].astype(np.float64).T) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        if mask is not None:
            s = s + mask
        for i in range(n_q):
            keep = allowed[i] & np.isfinite(s[i])
            if not keep.any():
                continue
            m = s[i, keep].max()
            p = np.exp(s[i, keep] - m)
            out[i, h] = p @ v[keep, h // group] / p.sum()
            lse[i, h] = m + np.log(p.sum())
    return out, lse


@pytest.mark.parametrize("n_head,n_kv,d,window,softcap", [(4, 4, 16, 0, 0.0), (8, 2, 32, 0, 0.0),
                                                           (4, 1, 64, 5, 0.0), (6, 3, 16, 0, 30.0)])
def test_attend_matches_dense(n_head, n_kv, d, window, softcap):
    rng = np.random.default_rng(0)
    n_q, n_k = 7, 19
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_k, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n_k, n_kv, d)).astype(np.float32)
    k_pos = rng.permutation(n_k)  # slots need not be in position order (ring buffers)
    k_pos[3] = -1  # an empty slot
    q_pos = np.array([0, 2, 5, 9, 12, 17, 18])
    allowed = causal_mask(q_pos, k_pos, window)
    out, lse = attend(q, k, v, allowed, scale=d ** -0.5, softcap=softcap)
    ref_out, ref_lse = dense(q, k, v, allowed, d ** -0.5, softcap)
    np.testing.assert_allclose(out, ref_out, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)


def test_fully_masked_rows_contribute_nothing():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 2, 8)).astype(np.float32)
    k = rng.standard_normal((4, 1, 8)).astype(np.float32)
    v = rng.standard_normal((4, 1, 8)).astype(np.float32)
    allowed = np.zeros((3, 4), bool)
    allowed[1, :2] = True
    out, lse = attend(q, k, v, allowed, scale=0.3)
    assert np.all(out[[0, 2]] == 0) and np.all(np.isneginf(lse[[0, 2]]))
    assert np.all(np.isfinite(out)) and np.isfinite(lse[1]).all()


def test_chunks_merge_to_the_whole():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((40, 2, 16)).astype(np.float32)
    v = rng.standard_normal((40, 2, 16)).astype(np.float32)
    allowed = causal_mask(np.arange(35, 40), np.arange(40))
    whole, whole_lse = attend(q, k, v, allowed, scale=0.25)
    splits = [0, 7, 8, 30, 40]  # uneven, including a single-key chunk
    parts = [attend(q, k[a:b], v[a:b], allowed[:, a:b], scale=0.25) for a, b in zip(splits, splits[1:])]
    out, lse = functools.reduce(lambda x, y: merge(*x, *y), parts)
    np.testing.assert_allclose(out, whole, atol=1e-5)
    np.testing.assert_allclose(lse, whole_lse, atol=1e-5)
    # merging in the other order gives the same result
    a_out, a_lse = attend(q, k[:20], v[:20], allowed[:, :20], scale=0.25)
    b_out, b_lse = attend(q, k[20:], v[20:], allowed[:, 20:], scale=0.25)
    np.testing.assert_allclose(merge(b_out, b_lse, a_out, a_lse)[0], whole, atol=1e-5)


@pytest.mark.parametrize("n_head,n_kv,window,softcap", [(4, 1, 0, 0.0), (8, 2, 6, 0.0), (4, 4, 0, 20.0)])
def test_cpu_decode_kernel_matches_reference(n_head, n_kv, window, softcap):
    from cupyllm.ops.attention.cpu import attend_few

    rng = np.random.default_rng(3)
    n_k, d = 23, 64
    q = rng.standard_normal((3, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_k, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n_k, n_kv, d)).astype(np.float32)
    k_pos = rng.permutation(n_k)
    k_pos[5] = -1
    q_pos = np.array([0, 11, 22])
    ref_out, ref_lse = attend(q, k, v, causal_mask(q_pos, k_pos, window), scale=0.125, softcap=softcap)
    out, lse = attend_few(q, k, v, q_pos, k_pos, scale=0.125, window=window, softcap=softcap)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
    empty = attend_few(q, k, v, q_pos, np.full(n_k, -1), scale=0.125)
    assert np.all(empty[0] == 0) and np.all(np.isneginf(empty[1]))
