"""Tiny random-weight Qwen2, Qwen3 and Gemma 3 GGUFs (our writer) against transformers models built from the very
same tensors: float32 logits within 1e-4, through chunked prefill, sliding-window rings and one-token decode."""
from __future__ import annotations

import numpy as np
import pytest

import cupyllm
import make_tiny_models
from cupyllm.generate import prefill

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "gemma3"])
def pair(request, tiny_model):
    path, spec, decoded = tiny_model(request.param)
    hf = make_tiny_models.hf_model(spec, decoded)
    return request.param, path, hf, decoded["token_embd.weight"].shape[0]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("max_chunk", [512, 5])  # 5: several chunks, and (gemma) rings smaller than the sequence
def test_logits_match_transformers(pair, max_chunk):
    arch, path, hf, vocab = pair
    ids = np.random.default_rng(7).integers(0, vocab, 29).tolist()
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="f32", kv_type_v="f32", max_chunk=max_chunk,
                         progress=False)
    ours = model.logits(ids)
    np.testing.assert_allclose(ours, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_decode_steps_match_transformers(pair):
    arch, path, hf, vocab = pair
    ids = np.random.default_rng(8).integers(0, vocab, 20).tolist()
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="f32", kv_type_v="f32", max_chunk=4, progress=False)
    cache = model.new_cache()
    steps = [prefill(model.transformer.forward, ids[:9], cache, 4)]
    for token in ids[9:]:
        steps.append(model.transformer.forward(np.array([token]), np.array([cache.n_past]), cache))
        cache.n_past += 1
    np.testing.assert_allclose(np.concatenate(steps), hf_logits(hf, ids)[8:], atol=1e-4, rtol=0)
