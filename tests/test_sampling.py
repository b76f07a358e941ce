"""Samplers against their definitions written out directly, and seeded reproducibility."""
from __future__ import annotations

import numpy as np
import pytest

from cupyllm.sampling import Sampler, SamplingParams, apply_repeat_penalty, candidates


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
