"""Tiny random-weight Qwen2, Qwen3 (dense, MoE), Qwen3.5 (Gated DeltaNet hybrids), Gemma 3 and Gemma 4 GGUFs (our
writer) against transformers models built from the very same tensors: float32 logits within 1.5e-3 through
chunked prefill and sliding-window rings and through one-token decode (the quantized matmuls multiply the
activations rounded to 16-bit codes), within 1e-4 through prefill with float32 activations; all-F32 twins against
llama.cpp's stored logits.

The hybrids get their own, measured bounds (CODES_TOL, PLAIN_TOL). Over six weight seeds of each tiny hybrid
(TinySpec.seed 0 .. 5), the activation codes moved the
logits by 9e-4 .. 8.5e-3 (the L2-normalised q and k of 16 values, the gates' exp and the recurrence make these
tiny random models sensitive), while float32 activations stayed within 2e-4 of transformers: the bound with codes
is 1e-2, the plain one 3e-4, at seed 0 for every model.

transformers' logits are stored in tests/data/hf_reference_tiny.npz by tools/make_hf_tiny_reference.py, so the
suite needs no torch; where torch and transformers are installed, the stored arrays are recomputed and compared."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

import cupyllm
import make_hf_tiny_reference as hf_reference
import make_tiny_models
from cupyllm.generate import prefill
from cupyllm.ops.matmul import cpu as cpu_linear
from stored_reference import assert_recomputed_equal

CODES_TOL = {arch: 1e-2 for arch in make_tiny_models.HYBRID_ARCHES}  # default 1.5e-3
PLAIN_TOL = {arch: 3e-4 for arch in make_tiny_models.HYBRID_ARCHES}  # default 1e-4


@pytest.fixture(scope="module")
def stored():
    return np.load(hf_reference.OUT)


@pytest.fixture(scope="module", params=list(hf_reference.ARCHES))
def tiny(request, tiny_model, stored):
    """(arch, GGUF path, stored arrays of this arch), after checking the file is the one the reference was made of."""
    path, _, _ = tiny_model(request.param)
    key = hf_reference.key(request.param)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == str(stored[f"{key}_sha256"]), (
        "the tiny model changed since its transformers reference was made: pip install -e '.[reference]' and run "
        "python tools/make_hf_tiny_reference.py")
    return request.param, path, {name[len(key) + 1:]: stored[name] for name in stored.files
                                 if name.startswith(key + "_")}


@pytest.mark.parametrize("max_chunk", [512, 5])  # 5: several chunks, and (gemma) rings smaller than the sequence
def test_logits_match_transformers(tiny, max_chunk, monkeypatch):
    """Prefill logits against transformers: as the engine runs (the quantized matmuls multiply the activations'
    16-bit codes: measured up to 2.3e-4 here), and with the matmuls on float32 activations (ACTIVATION_CODES
    off), where only float32 summation order separates the two."""
    arch, path, ref = tiny
    ids = ref["prefill_ids"].tolist()
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="f32", kv_type_v="f32", max_chunk=max_chunk,
                         progress=False)
    want = ref["prefill_logits"]
    np.testing.assert_allclose(model.logits(ids), want, atol=CODES_TOL.get(arch, 1.5e-3), rtol=0)
    monkeypatch.setattr(cpu_linear, "ACTIVATION_CODES", False)
    np.testing.assert_allclose(model.logits(ids), want, atol=PLAIN_TOL.get(arch, 1e-4), rtol=0)


def test_decode_steps_match_transformers(tiny):
    arch, path, ref = tiny
    ids = ref["decode_ids"].tolist()
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="f32", kv_type_v="f32", max_chunk=4, progress=False)
    cache = model.new_cache()
    steps = [prefill(model.transformer.forward, ids[:9], cache, 4)]
    for token in ids[9:]:
        steps.append(model.transformer.forward(np.array([token]), np.array([cache.n_past]), cache))
        cache.n_past += 1
    # (decode steps multiply the weights by their activations rounded to 16-bit codes: measured up to 6e-4 here)
    np.testing.assert_allclose(np.concatenate(steps), ref["decode_logits"][8:], atol=CODES_TOL.get(arch, 1.5e-3),
                               rtol=0)


def test_stored_reference_is_what_transformers_computes(stored, tmp_path):
    """Where torch and transformers are installed: tools/make_hf_tiny_reference.py's arrays, recomputed now, equal
    the stored ones (float32 logits within 1e-5: BLAS builds sum in other orders; ids and hashes exactly)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    assert_recomputed_equal(hf_reference.compute(tmp_path), stored)


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


@pytest.mark.parametrize("arch", ["gemma3", "gemma4", "gemma4-moe", "qwen3-moe", *make_tiny_models.HYBRID_ARCHES])
def test_tiny_f32_models_match_llama_cpp(arch, tmp_path):
    """The same tiny models with every tensor F32, against llama.cpp's logits stored by
    tools/make_llama_cpp_reference.py (llama-cpp-python, F32 K/V): llama.cpp reads our Gemma 4 and hybrid Qwen3.5 /
    Qwen3-Next files (Gated DeltaNet layers) as we do."""
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
