"""Samplers against their definitions written out directly, and seeded reproducibility."""
from __future__ import annotations

import numpy as np
import pytest

from cupyllm.sampling import Sampler, SamplingParams, apply_repeat_penalty, candidates, top_k_ids


def brute_force_candidates(logits, top_k, top_p, min_p):
    """The same filter chain, spelled out with Python lists."""
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    if 0 < top_k < len(order):
        order = order[:top_k]
    if top_p < 1.0:
        exps = [np.exp(float(logits[i]) - float(logits[order[0]])) for i in order]
        total, running, kept = sum(exps), 0.0, []
        for i, e in zip(order, exps):
            kept.append(i)
            running += e / total
            if running >= top_p:
                break
        order = kept
    if min_p > 0:
        order = [i for i in order if np.exp(float(logits[i]) - float(logits[order[0]])) >= min_p]
    return order


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1),
                                               (40, 0.95, 0.05), (3, 0.5, 0.2)])
def test_filters_match_definitions(top_k, top_p, min_p):
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = (rng.standard_normal(200) * 3).astype(np.float32)
        ids, _ = candidates(logits, SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p))
        assert list(ids) == brute_force_candidates(logits, top_k, top_p, min_p)


def _vocabularies():
    """Logit vectors that stress the top-k search: random, sorted either way, all equal, coarse (many ties at
    the k-th value), masked (-inf) and NaN entries, and Gemma's vocabulary size."""
    rng = np.random.default_rng(2)
    n = 20000
    yield (rng.standard_normal(n) * 3).astype(np.float32)
    yield np.arange(n, dtype=np.float32)
    yield np.arange(n, 0, -1).astype(np.float32)
    yield np.zeros(n, np.float32)
    yield np.round(rng.standard_normal(n)).astype(np.float32)  # five or so distinct values
    masked = (rng.standard_normal(n) * 3).astype(np.float32)
    masked[rng.random(n) < 0.999] = -np.inf
    yield masked
    with_nan = (rng.standard_normal(n) * 3).astype(np.float32)
    with_nan[rng.integers(0, n, 300)] = np.nan
    yield with_nan
    yield (rng.standard_normal(262144) * 3).astype(np.float32)


@pytest.mark.parametrize("k", [1, 7, 40, 1000])
def test_top_k_is_the_head_of_a_stable_descending_sort(k):
    for logits in _vocabularies():
        finite_first = np.lexsort((np.arange(len(logits)), -np.nan_to_num(logits, nan=0.0), np.isnan(logits)))
        np.testing.assert_array_equal(top_k_ids(logits, k), finite_first[:k])


@pytest.mark.parametrize("top_k,top_p,min_p", [(40, 0.95, 0.05), (0, 0.9, 0.05), (0, 1.0, 0.1), (1000, 0.5, 0.0)])
def test_filters_on_large_vocabularies(top_k, top_p, min_p):
    """The shortcuts (top-k without sorting, the min-p pool with top-k off) against the definitions."""
    rng = np.random.default_rng(3)
    for scale in (1.0, 3.0, 10.0):
        logits = (rng.standard_normal(5000) * scale).astype(np.float32)
        logits[rng.integers(0, 5000, 50)] = logits.max()  # ties at the top
        ids, vals = candidates(logits, SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p))
        assert list(ids) == brute_force_candidates(logits, top_k, top_p, min_p)
        np.testing.assert_array_equal(vals, logits[ids].astype(np.float64))


def test_repeat_penalty_rule():
    logits = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    out = apply_repeat_penalty(logits, np.array([0, 1, 1]), 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, 0.5])


def test_greedy_is_argmax_and_seed_reproduces():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(1000).astype(np.float32)
    assert Sampler(SamplingParams(temperature=0.0))(logits) == int(np.argmax(logits))
    draws = lambda seed: [Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))(logits)  # noqa: E731
                          for _ in range(1)]
    sampler_a = Sampler(SamplingParams(temperature=1.0, seed=7))
    sampler_b = Sampler(SamplingParams(temperature=1.0, seed=7))
    assert [sampler_a(logits) for _ in range(50)] == [sampler_b(logits) for _ in range(50)]
    assert draws(1) == draws(1)


def test_sampling_follows_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3))
    counts = np.bincount([sampler(logits) for _ in range(6000)], minlength=3) / 6000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


def test_bad_parameters_are_refused():
    from cupyllm.errors import CupyllmError
    with pytest.raises(CupyllmError, match="top-p 0.0"):  # a CupyllmError: the CLI prints it as one line
        SamplingParams(top_p=0.0)


def test_negative_seed_is_a_fresh_random_seed():
    """llama.cpp's --seed -1: a new seed each time, not an error."""
    logits = np.zeros(1000, np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=-1)
    draws = [Sampler(params)(logits) for _ in range(8)]
    assert all(0 <= d < 1000 for d in draws) and len(set(draws)) > 1
