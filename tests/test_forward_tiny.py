"""Tiny random-weight Qwen2, Qwen3 (dense, MoE), Gemma 3 and Gemma 4 GGUFs (our writer) against transformers models
built from the very same tensors: float32 logits within 1.5e-3 through chunked prefill and sliding-window rings
and through one-token decode (the quantized matmuls multiply the activations rounded to 16-bit codes), within
1e-4 through prefill with float32 activations; all-F32 twins against llama.cpp's stored logits."""
from __future__ import annotations

import numpy as np
import pytest

import cupyllm
import make_tiny_models
from cupyllm.generate import prefill
from cupyllm.ops.matmul import cpu as cpu_linear

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "qwen3-moe", "gemma3", "gemma4", "gemma4-moe"])
def pair(request, tiny_model):
    path, spec, decoded = tiny_model(request.param)
    hf = make_tiny_models.hf_model(spec, decoded)
    return request.param, path, hf, decoded["token_embd.weight"].shape[0]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("max_chunk", [512, 5])  # 5: several chunks, and (gemma) rings smaller than the sequence
def test_logits_match_transformers(pair, max_chunk, monkeypatch):
    """Prefill logits against transformers: as the engine runs (the quantized matmuls multiply the activations'
    16-bit codes: measured up to 2.3e-4 here), and with the matmuls on float32 activations (ACTIVATION_CODES
    off), where only float32 summation order separates the two."""
    arch, path, hf, vocab = pair
    ids = np.random.default_rng(7).integers(0, vocab, 29).tolist()
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="f32", kv_type_v="f32", max_chunk=max_chunk,
                         progress=False)
    want = hf_logits(hf, ids)
    np.testing.assert_allclose(model.logits(ids), want, atol=1.5e-3, rtol=0)
    monkeypatch.setattr(cpu_linear, "ACTIVATION_CODES", False)
    np.testing.assert_allclose(model.logits(ids), want, atol=1e-4, rtol=0)


def test_decode_steps_match_transformers(pair):
    arch, path, hf, vocab = pair
    ids = np.random.default_rng(8).integers(0, vocab, 20).tolist()
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="f32", kv_type_v="f32", max_chunk=4, progress=False)
    cache = model.new_cache()
    steps = [prefill(model.transformer.forward, ids[:9], cache, 4)]
    for token in ids[9:]:
        steps.append(model.transformer.forward(np.array([token]), np.array([cache.n_past]), cache))
        cache.n_past += 1
    # (decode steps multiply the weights by their activations rounded to 16-bit codes: measured up to 6e-4 here)
    np.testing.assert_allclose(np.concatenate(steps), hf_logits(hf, ids)[8:], atol=1.5e-3, rtol=0)


def test_gemma4_shared_layers_store_no_cache(tiny_model):
    """The last 2 layers of the tiny Gemma 4 read the caches of layers 3 (sliding) and 4 (global): the cache holds
    5 layers' K/V, of each layer's own shape (sliding: 2 heads x 32, global: 2 heads x 64)."""
    path, spec, _ = tiny_model("gemma4")
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="q8_0", kv_type_v="f16", max_chunk=8, progress=False)
    cache = model.new_cache()
    assert [model.cfg.kv_source(il) for il in range(7)] == [0, 1, 2, 3, 4, 3, 4]
    assert cache.layers[5] is cache.layers[3] and cache.layers[6] is cache.layers[4]
    slots = {True: spec.sliding_window + 8, False: 64}
    own = ((True, 32), (True, 32), (False, 64), (True, 32), (False, 64))
    assert cache.nbytes == sum(slots[sliding] * 2 * (hd // 32 * 34 + hd * 2) for sliding, hd in own)


def test_gemma4_moe_without_expert_used_count_is_a_clear_error(tiny_dir):
    import gguf as gguf_pkg

    spec = make_tiny_models.tiny_spec("gemma4-moe")
    path = tiny_dir / "gemma4-moe-no-used-count.gguf"
    original = gguf_pkg.GGUFWriter.add_expert_used_count
    gguf_pkg.GGUFWriter.add_expert_used_count = lambda self, n: None
    try:
        make_tiny_models.write_gguf(spec, path)
    finally:
        gguf_pkg.GGUFWriter.add_expert_used_count = original
    with pytest.raises(cupyllm.errors.ModelFileError, match="expert_used_count"):
        cupyllm.load(path, device="cpu", progress=False)


@pytest.mark.parametrize("arch", ["gemma3", "gemma4", "gemma4-moe", "qwen3-moe"])
def test_tiny_f32_models_match_llama_cpp(arch, tmp_path):
    """The same tiny models with every tensor F32, against llama.cpp's logits stored by
    tools/make_llama_cpp_reference.py (llama-cpp-python, F32 K/V): llama.cpp reads our Gemma 4 files as we do."""
    import make_llama_cpp_reference as reference
    stored = np.load(reference.OUT)
    key = arch.replace("-", "_")
    path, digest = reference.write_model(arch, tmp_path)
    assert digest == str(stored[f"{key}_sha256"]), \
        "the tiny model changed since the reference was made: run python tools/make_llama_cpp_reference.py"
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="f32", kv_type_v="f32", max_chunk=8, progress=False)
    ours = model.logits(stored[f"{key}_ids"].tolist())
    # llama.cpp keeps some intermediates in f16 on the CPU: ~1e-3 apart on logits of magnitude ~4
    np.testing.assert_allclose(ours, stored[f"{key}_logits"], atol=5e-3, rtol=0)
