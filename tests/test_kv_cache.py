"""The KV cache's centred K (KVSpec.center_k): a storage transform. Each layer stores K minus a per-head offset
(the first write's mean key past position 0) and adds it back on decode, so every consumer sees K, with the
format's error taken on K - offset: far smaller when K carries large per-channel offsets, as Qwen2.5's does."""
from __future__ import annotations

import numpy as np
import pytest

import cupyllm
from cupyllm.generate import prefill
from cupyllm.kv.cache import KVCache, KVSpec, LayerKV
from cupyllm.kv.formats import get_format

N_KV, D = 2, 64


def _offset_keys(rng, n: int) -> np.ndarray:
    offset = rng.standard_normal((N_KV, D)).astype(np.float32) * 20.0  # per-channel offsets dwarf the spread
    return rng.standard_normal((n, N_KV, D)).astype(np.float32) + offset


def _layer(fmt: str, center_k: bool, mirror: bool = False) -> LayerKV:
    return LayerKV(get_format(fmt, head_dim=D), get_format("f16", head_dim=D), N_KV, D, D, capacity=64, ring=False,
                   mirror=mirror, center_k=center_k)


@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "turbo3"])
def test_centred_keys_decode_back_with_less_error(fmt, mirror):
    rng = np.random.default_rng(0)
    k = _offset_keys(rng, 40)
    v = rng.standard_normal((40, N_KV, D)).astype(np.float32)
    positions = np.arange(40)
    errors = {}
    for center_k in (False, True):
        layer = _layer(fmt, center_k, mirror)
        layer.write(k[:16], v[:16], positions[:16])  # the first write sets the offset
        layer.write(k[16:], v[16:], positions[16:])
        got_k, got_v, got_pos = layer.decode(0, 40)
        np.testing.assert_array_equal(got_pos, positions)
        np.testing.assert_allclose(got_v, v, atol=2e-3)  # V is not touched
        errors[center_k] = float(np.abs(got_k - k).max())
        if center_k:
            np.testing.assert_allclose(layer.k_offset, k[1:16].mean(axis=0), rtol=1e-5, atol=1e-4)
    assert errors[True] < 0.3 * errors[False], errors


def test_clear_forgets_the_offset_and_a_lone_first_key_sets_it():
    rng = np.random.default_rng(1)
    k = _offset_keys(rng, 3)
    layer = _layer("q8_0", center_k=True)
    layer.write(k[:1], k[:1], np.arange(1))  # only position 0: its own key is the offset
    np.testing.assert_allclose(layer.k_offset, k[0], rtol=1e-6)
    layer.clear()
    assert layer.k_offset is None
    layer.write(k[1:], k[1:], np.arange(1, 3))
    np.testing.assert_allclose(layer.k_offset, k[1:].mean(axis=0), rtol=1e-5, atol=1e-5)


def test_engine_with_centred_keys(tiny_model):
    """The whole CPU engine: centring an f32 cache changes nothing beyond rounding; a centred q8_0 cache stays
    close to the exact logits."""
    path, _, _ = tiny_model("qwen2")
    model = cupyllm.load(path, device="cpu", ctx=32, kv_type_k="f32", kv_type_v="f32", progress=False)
    ids = np.arange(4, 24)

    def logits(kv_type: str, center_k: bool) -> np.ndarray:
        spec = KVSpec(ctx=32, kv_type_k=kv_type, kv_type_v="f32", max_chunk=8, center_k=center_k)
        cache = KVCache.for_model(model.cfg, spec, mirror=model.transformer.ops.kv_mirror)
        forward = lambda t, p, kv, all_logits=False: np.asarray(model.transformer.forward(t, p, kv, all_logits))  # noqa: E731
        return prefill(forward, ids, cache, 8, all_logits=True, progress=False)

    exact = logits("f32", False)
    scale = np.abs(exact).max()
    assert np.abs(logits("f32", True) - exact).max() <= 1e-5 * scale
    assert np.abs(logits("q8_0", True) - exact).max() <= 5e-2 * scale


def test_api_and_cli_take_centred_keys(tiny_model):
    import subprocess
    import sys
    path, _, _ = tiny_model("qwen2")
    ids = list(range(4, 24))
    exact = cupyllm.load(path, device="cpu", ctx=32, kv_type_k="f32", kv_type_v="f32", progress=False).logits(ids)
    centred = cupyllm.load(path, device="cpu", ctx=32, kv_type_k="q8_0", kv_type_v="f32", kv_center_k=True,
                           progress=False)
    assert centred.kv_spec.center_k
    assert np.abs(centred.logits(ids) - exact).max() <= 5e-2 * np.abs(exact).max()
    out = subprocess.run([sys.executable, "-m", "cupyllm.cli", "generate", "hello", "-m", str(path), "--device", "cpu",
                          "-n", "4", "--temp", "0", "-ctk", "q4_0", "--cache-center-k"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
