"""tools/kv_quality.py: its statistics against direct NumPy formulas, and a smoke run on a tiny model."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import cupyllm
import kv_quality  # tools/ is on sys.path (tests/conftest.py)


def softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_row_stats_match_direct_formulas(monkeypatch):
    monkeypatch.setattr(kv_quality, "ROW_BLOCK", 2)  # several blocks, and a short last one
    rng = np.random.default_rng(0)
    base = rng.normal(size=(5, 11)).astype(np.float32) * 3
    logits = base + rng.normal(size=(5, 11)).astype(np.float32) * 0.5
    logits[4] = base[4]  # identical rows: KLD 0
    targets = np.array([3, 0, 10, 7, -1])
    stats = kv_quality.row_stats(logits, base, targets)
    p, q = softmax(base.astype(np.float64)), softmax(logits.astype(np.float64))
    np.testing.assert_allclose(stats.kld, (p * np.log(p / q)).sum(axis=1), rtol=1e-10, atol=1e-15)
    assert stats.kld[4] == pytest.approx(0.0, abs=1e-15)
    np.testing.assert_allclose(stats.nll[:4], -np.log(q[np.arange(4), targets[:4]]), rtol=1e-12)
    assert np.isnan(stats.nll[4])
    np.testing.assert_array_equal(stats.top1_same, p.argmax(1) == q.argmax(1))
    alone = kv_quality.row_stats(logits, None, targets)
    np.testing.assert_array_equal(alone.kld, 0.0)
    np.testing.assert_allclose(alone.nll, stats.nll)


def test_perplexity_is_the_geometric_mean_inverse_probability():
    probs = np.array([0.5, 0.25, 0.125, 0.9])
    nll = np.append(-np.log(probs), np.nan)  # the last position has no next token
    assert kv_quality.perplexity(nll) == pytest.approx(np.prod(probs) ** (-1 / len(probs)), rel=1e-12)


def test_bootstrap_interval_and_summary():
    rng = np.random.default_rng(1)
    values = rng.exponential(size=400)
    lo, hi = kv_quality.bootstrap_ci(values, np.mean)
    assert lo < values.mean() < hi
    assert kv_quality.bootstrap_ci(np.full(50, 0.25), np.median) == (0.25, 0.25)
    base_nll = np.append(rng.uniform(1, 3, size=99), np.nan)
    stats = np.stack([values[:100], np.append(base_nll[:99] + 0.1, np.nan), np.ones(100)], axis=1)
    s = kv_quality.summarize(stats, base_nll)
    assert s["ppl_change"] == pytest.approx(math.expm1(0.1), rel=1e-9)  # every NLL up by 0.1
    lo, hi = s["ppl_change_ci95"]
    assert lo == pytest.approx(math.expm1(0.1), rel=1e-9) and hi == pytest.approx(math.expm1(0.1), rel=1e-9)
    assert s["kld_median"] == pytest.approx(np.median(values[:100]))
    assert s["top1_agree"] == 1.0


TEXT = "the cat sat on the mat, and then the other cat sat on the hat. " * 3


def test_harness_matches_model_logits_on_a_tiny_model(tiny_model):
    """evaluate_config's KLD / NLL equal the direct formulas on Model.logits of separately loaded models."""
    path, _, _ = tiny_model("qwen2")
    base_model = cupyllm.load(path, device="cpu", ctx=128, max_chunk=16, progress=False)
    ids = np.asarray(base_model.tokenize(TEXT), dtype=np.int64)[:60]
    assert len(ids) > 32  # several prefill chunks
    base_logits = base_model.logits(ids)
    for k, v in (("q4_0", "q4_0"), ("turbo3_tcq", "turbo2")):
        model = cupyllm.load(path, device="cpu", ctx=128, max_chunk=16, kv_type_k=k, kv_type_v=v, progress=False)
        direct = model.logits(ids)
        stats = kv_quality.evaluate_config(base_model, ids, kv_quality.KVConfig(k, v), base_logits, progress=False)
        p, q = softmax(base_logits.astype(np.float64)), softmax(direct.astype(np.float64))
        np.testing.assert_allclose(stats[:, 0], (p * np.log(p / q)).sum(axis=1), rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(stats[:-1, 1], -np.log(q[np.arange(len(ids) - 1), ids[1:]]), rtol=1e-6)
        assert stats[:, 0].max() > 0  # the quantized cache does change the distributions


def test_harness_end_to_end_on_a_tiny_model(tiny_model, tmp_path):
    path, _, _ = tiny_model("gemma3")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "kv_quality"
    kv_quality.main(["--models", str(path), "--configs", "f32", "q8_0", "turbo2", "q8_0/turbo3_tcq",
                     "--text", str(text), "--work-dir", str(tmp_path / "work"), "--out", str(out),
                     "--gaussian-rows", "16", "--gaussian-formats", "q4_0", "turbo4", "turbo2", "turbo2_tcq"])
    report = json.loads(out.with_suffix(".json").read_text())
    configs = report["models"][str(path)]["configs"]
    assert list(configs) == ["f16", "f32", "q8_0", "turbo2", "q8_0/turbo3_tcq"]
    assert configs["f16"]["kld_mean"] == 0.0 and configs["f16"]["ppl_change"] == 0.0
    assert configs["f32"]["kld_mean"] < configs["turbo2"]["kld_mean"]
    assert configs["q8_0/turbo3_tcq"]["bits_per_value_v"] == pytest.approx(
        cupyllm.kv.get_format("turbo3_tcq", head_dim=32).bits_per_value)
    mse = report["gaussian_mse"]
    assert mse["turbo2"]["head_dim_256"]["mse"] > mse["turbo4"]["head_dim_256"]["mse"]
    noise = report["models"][str(path)]["k_logit_noise"]["per_layer"]
    assert len(noise["q8_0"]) == 3 and np.mean(noise["q8_0"]) < np.mean(noise["turbo2"])
    assert len(noise["turbo3" + kv_quality.NORMALIZED]) == 3  # the diagnostic on normalised K is there too
    text_md = out.with_suffix(".md").read_text()
    assert "turbo2_tcq" in text_md and "K error on the attention logits" in text_md and "(K normalised)" in text_md
    assert "**K normalised** (the engine's default" in text_md
    assert report["targets"][str(path)]["q8_0 within noise of f16"]["f16_ppl_ci95"][0] < configs["f16"]["ppl"]


def test_dump_kv_captures_what_the_cache_stores(tiny_model):
    """tools/dump_kv.py (the TCQ codebooks' training data): every K and V row the cache stores, as rotated unit
    groups, layer by layer; checked against the f32 cache's own rows after the run."""
    import dump_kv

    model = cupyllm.load(tiny_model("qwen2")[0], device="cpu", ctx=64, kv_type_k="f32", kv_type_v="f32",
                         max_chunk=8, progress=False)
    ids = list(range(3, 23))
    capture = dump_kv.capture_kv(model, ids)
    k_rows, per_layer = capture.stacked("k")
    cache = model._cache
    g = capture.group_values
    assert per_layer == {i: len(ids) * cache.layers[i].n_kv * cache.layers[i].head_dim // g
                         for i in range(len(cache.layers))}
    np.testing.assert_allclose(np.linalg.norm(k_rows, axis=1), 1.0, rtol=1e-5)
    stored_k, stored_v, _ = cache.layers[0].decode(0, len(ids))  # (an f32 cache: its stored values)
    for stored, rows in ((stored_k, k_rows), (stored_v, capture.stacked("v")[0])):
        want, _ = dump_kv.rotated_unit_groups(stored, g)
        np.testing.assert_array_equal(rows[:per_layer[0]], want)
