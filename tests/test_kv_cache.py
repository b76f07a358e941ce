"""The KV cache's K channel normalisation (KVSpec.normalize_k): a storage transform. Each layer stores
(K - offset) / scale, per channel offset = the mean key and scale = sqrt(RMS of K / RMS of Q) of the first
write past position 0, and undoes it on decode, so every consumer sees K, with the format's error taken on the
normalised keys: far smaller on the attention logits when some channels of K are large and the queries barely
read them, as in Qwen2.5's first layer (bench/results/kv_quality.md)."""
from __future__ import annotations

import numpy as np
import pytest

import cupyllm
from cupyllm.generate import prefill
from cupyllm.kv.cache import KVCache, KVSpec, LayerKV
from cupyllm.ops.kv_formats.formats import get_format
from cupyllm.ops.matmul import cpu as cpu_linear

N_KV, D = 2, 64
LOUD = np.arange(0, D, 16)  # a few channels with large offsets and spreads


def _skewed_keys(rng, n: int) -> np.ndarray:
    offset = rng.standard_normal((N_KV, D)).astype(np.float32) * 20.0  # per-channel offsets dwarf the spread
    k = rng.standard_normal((n, N_KV, D)).astype(np.float32)
    k[..., LOUD] *= 30.0
    return k + offset


def _layer(fmt: str, normalize_k: bool, mirror: bool = False) -> LayerKV:
    return LayerKV(get_format(fmt, head_dim=D), get_format("f16", head_dim=D), N_KV, D, D, capacity=64, ring=False,
                   mirror=mirror, normalize_k=normalize_k)


@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "turbo3", "turbo3_tcq"])
def test_normalized_keys_decode_back_with_less_logit_error(fmt, mirror):
    rng = np.random.default_rng(0)
    k = _skewed_keys(rng, 40)
    v = rng.standard_normal((40, N_KV, D)).astype(np.float32)
    q = rng.standard_normal((40, N_KV, D)).astype(np.float32)
    q[..., LOUD] *= 0.01  # queries that read the quiet channels: the loud ones only eat the format's range
    positions = np.arange(40)
    errors = {}
    for normalize_k in (False, True):
        layer = _layer(fmt, normalize_k, mirror)
        layer.write(k[:16], v[:16], positions[:16], queries=q[:16])  # the first write sets offset and scale
        layer.write(k[16:], v[16:], positions[16:])
        got_k, got_v, got_pos = layer.decode(0, 40)
        np.testing.assert_array_equal(got_pos, positions)
        np.testing.assert_allclose(got_v, v, atol=2e-3)  # V is not touched
        errors[normalize_k] = float(np.abs(np.einsum("qhd,khd->qhk", q[-8:], got_k - k)).max())
        if normalize_k:  # against the definition, computed here in float64 (no floor binds for these keys)
            first = k[1:16].astype(np.float64)
            q_rms = np.sqrt((q[1:16].astype(np.float64) ** 2).mean(axis=0))
            q_rms = np.maximum(q_rms, 0.1 * q_rms.mean(axis=-1, keepdims=True))
            np.testing.assert_allclose(layer.k_offset, first.mean(axis=0), rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(layer.k_scale, np.sqrt(first.std(axis=0) / q_rms), rtol=1e-5)
    assert errors[True] < 0.3 * errors[False], errors


def test_clear_forgets_the_normalization_and_a_lone_first_key_sets_it():
    rng = np.random.default_rng(1)
    k = _skewed_keys(rng, 3)
    layer = _layer("q8_0", normalize_k=True)
    layer.write(k[:1], k[:1], np.arange(1))  # only position 0: its own key is the offset, nothing to scale by
    np.testing.assert_allclose(layer.k_offset, k[0], rtol=1e-6)
    np.testing.assert_array_equal(layer.k_scale, np.ones((N_KV, D), np.float32))
    layer.clear()
    assert layer.k_offset is None and layer.k_scale is None
    layer.write(k[1:], k[1:], np.arange(1, 3))
    np.testing.assert_allclose(layer.k_offset, k[1:].mean(axis=0), rtol=1e-5, atol=1e-5)


def test_a_channel_constant_in_the_first_write_gets_a_floor_not_a_blowup():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((20, N_KV, D)).astype(np.float32)
    k[:10, :, 5] = 0.0  # constant while the statistics are taken, varies later
    layer = _layer("q8_0", normalize_k=True)
    layer.write(k[:10], k[:10], np.arange(10))
    floor = 0.1 * k[1:10].astype(np.float64).std(axis=0).mean(axis=-1)  # no queries: their RMS counts as 1
    np.testing.assert_allclose(layer.k_scale[:, 5], np.sqrt(floor), rtol=1e-4)
    layer.write(k[10:], k[10:], np.arange(10, 20))
    got_k, _, _ = layer.decode(0, 20)
    assert np.isfinite(got_k).all()
    # q8_0 still holds the keys: the channel's later values are stored magnified about threefold against the
    # others (sqrt of the 10% floor; not without bound), which coarsens the steps of their blocks
    np.testing.assert_allclose(got_k, k, atol=0.25)


def test_the_default_normalizes_quantized_keys_only():
    assert KVSpec(ctx=8, kv_type_k="q8_0").k_normalized
    assert KVSpec(ctx=8, kv_type_k="turbo3_tcq", kv_type_v="f16").k_normalized
    assert not KVSpec(ctx=8, kv_type_k="f16", kv_type_v="q4_0").k_normalized
    assert not KVSpec(ctx=8, kv_type_k="q8_0", normalize_k=False).k_normalized
    assert KVSpec(ctx=8, kv_type_k="f32", normalize_k=True).k_normalized


def test_engine_with_normalized_keys(tiny_model, monkeypatch):
    """The whole CPU engine: normalising an f32 cache changes nothing beyond rounding; a normalised q8_0 cache
    stays close to the exact logits. The f32 comparison runs the matmuls on float32 activations
    (ACTIVATION_CODES off): their 16-bit codes would turn a last-bit difference into a whole code step
    (1/32767 of a block's largest value) wherever a value sits at a rounding boundary, measured 1.3e-5 of the
    logit scale on an x86_64 host, beyond what this bound is about."""
    path, _, _ = tiny_model("qwen2")
    model = cupyllm.load(path, device="cpu", ctx=32, kv_type_k="f32", kv_type_v="f32", progress=False)
    ids = np.arange(4, 24)

    def logits(kv_type: str, normalize_k: bool) -> np.ndarray:
        spec = KVSpec(ctx=32, kv_type_k=kv_type, kv_type_v="f32", max_chunk=8, normalize_k=normalize_k)
        cache = KVCache.for_model(model.cfg, spec, mirror=False)
        forward = lambda t, p, kv, all_logits=False: np.asarray(model.transformer.forward(t, p, kv, all_logits))  # noqa: E731
        return prefill(forward, ids, cache, 8, all_logits=True, progress=False)

    exact = logits("f32", False)
    scale = np.abs(exact).max()
    assert np.abs(logits("q8_0", True) - exact).max() <= 5e-2 * scale
    with monkeypatch.context() as patch:
        patch.setattr(cpu_linear, "ACTIVATION_CODES", False)
        exact = logits("f32", False)
        assert np.abs(logits("f32", True) - exact).max() <= 1e-5 * scale


def test_api_and_cli_take_the_normalization_switch(tiny_model):
    import subprocess
    import sys
    path, _, _ = tiny_model("qwen2")
    ids = list(range(4, 24))
    exact = cupyllm.load(path, device="cpu", ctx=32, kv_type_k="f32", kv_type_v="f32", progress=False).logits(ids)
    default = cupyllm.load(path, device="cpu", ctx=32, kv_type_k="q8_0", kv_type_v="f32", progress=False)
    raw = cupyllm.load(path, device="cpu", ctx=32, kv_type_k="q8_0", kv_type_v="f32", kv_normalize_k=False,
                       progress=False)
    assert default.kv_spec.k_normalized and not raw.kv_spec.k_normalized
    got = default.logits(ids)
    assert np.abs(got - exact).max() <= 5e-2 * np.abs(exact).max()
    assert np.abs(raw.logits(ids) - got).max() > 0  # the switch reaches the cache
    for flag in ("--cache-normalize-k", "--no-cache-normalize-k"):
        out = subprocess.run([sys.executable, "-m", "cupyllm.cli", "generate", "hello", "-m", str(path), "--device",
                              "cpu", "-n", "4", "--temp", "0", "-ctk", "q4_0", flag],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("dca", [False, True])
def test_the_model_hands_its_queries_to_the_cache(tiny_model, dca):
    """Every attention path (plain, DCA) writes K with the same positions' queries, which the first write's
    normalisation balances against."""
    path, _, _ = tiny_model("qwen2")
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="q8_0", progress=False,
                         dca={"chunk_size": 16, "local_size": 4} if dca else None)
    seen = []

    class Spy(LayerKV):
        def write(self, k, v, positions, queries=None):
            seen.append((len(positions), None if queries is None else tuple(queries.shape)))
            super().write(k, v, positions, queries=queries)

    spec = KVSpec(ctx=64, kv_type_k="q8_0", max_chunk=8)
    cache = KVCache.for_model(model.cfg, spec, make_layer=Spy)
    forward = lambda t, p, kv, all_logits=False: np.asarray(model.transformer.forward(t, p, kv, all_logits))  # noqa: E731
    prefill(forward, np.arange(4, 44), cache, 8, all_logits=False, progress=False)
    assert seen and all(shape == (n, model.cfg.n_head, model.cfg.head_dim) for n, shape in seen), seen
