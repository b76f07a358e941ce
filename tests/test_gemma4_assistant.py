"""The Gemma 4 assistant drafter (cupyllm/speculative/gemma4_assistant.py) against transformers' Gemma4Assistant.

A tiny random-weight Gemma 4 target (E2B-like: KV-shared layers, per-layer embeddings) and two assistants (every
token scored; the E-series' masked embedder) are written as GGUF (tests/support/make_tiny_models.py) and built in
transformers from the same values; tools/make_hf_assistant_reference.py stores what transformers computes
(tests/data/hf_reference_gemma4_assistant.npz) and the last test recomputes it where torch is installed.

- the NumPy definition (reference_step) fed transformers' own target K/V and hidden rows gives transformers'
  assistant logits and projected states, over three chained drafts from three positions (one past the window);
- the engine (backend ops over cupyllm's own target cache) gives the definition's numbers on that cache, and
  transformers' within the cache's rounding;
- with turbo3 and with normalised q8_0 K caches the drafts are those of an f16 cache (the query meets K as the
  cache stores it), where reading the normalised rows as if they were K is far off;
- greedy generation with the assistant is plain greedy generation, and transformers' generate(...,
  assistant_model=...) output, token for token;
- with Dual Chunk Attention on the target the steps are the definition's with DCA's query positions, and greedy
  text with the assistant is the target's own;
- an assistant of another model, and the assistant as a spec without one, are clear errors.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest

import cupyllm
from cupyllm.errors import InputError
from cupyllm.files.gguf import read_gguf
from cupyllm.generate import prefill
from cupyllm.speculative import SpecConfig
from cupyllm.speculative.gemma4_assistant import (AssistantDrafter, Gemma4Assistant, assistant_config,
                                                  reference_step)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import make_hf_assistant_reference as hf_reference  # noqa: E402
from stored_reference import assert_recomputed_equal  # noqa: E402

VARIANTS = hf_reference.VARIANTS


@pytest.fixture(scope="module")
def stored():
    return np.load(hf_reference.OUT)


@pytest.fixture(scope="module")
def models(tmp_path_factory, stored):
    """{'target' | 'plain' | 'masked': (path, decoded tensors)}, checked to be the files the reference was made of."""
    made = hf_reference.write_models(tmp_path_factory.mktemp("assistant"))
    for name, (path, _) in made.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == str(stored[f"{name}_sha256"]), (
            f"the tiny {name} model changed since its transformers reference was made: pip install -e "
            "'.[reference]' and run python tools/make_hf_assistant_reference.py")
    return made


def _kv_of(stored, upto: int):
    """transformers' target K/V of positions < upto, per kind (True: sliding)."""
    pos = np.arange(upto)
    return {True: (stored["target_sliding_attention_k"][:upto], stored["target_sliding_attention_v"][:upto], pos),
            False: (stored["target_full_attention_k"][:upto], stored["target_full_attention_v"][:upto], pos)}


def _chain(step, token: int, hidden):
    """STEPS chained drafts from `start`: [(logits, state, argmax)] with step(token, hidden) -> (logits, state)."""
    out = []
    for _ in range(hf_reference.STEPS):
        logits, hidden = step(token, hidden)
        token = int(np.argmax(logits))
        out.append((logits, hidden, token))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_step_is_transformers(variant, models, stored):
    """The NumPy definition, given transformers' own target K/V, hidden rows and embedding, gives transformers'
    assistant logits and projected states (every start, every chained step), and the same drafts."""
    path, decoded = models[variant]
    cfg = assistant_config(read_gguf(path))
    target_embd = models["target"][1]["token_embd.weight"]
    ids = stored["prompt_ids"]
    for i, start in enumerate(hf_reference.STARTS):
        kv = _kv_of(stored, start)
        run = _chain(lambda t, h: reference_step(cfg, decoded, target_embd[t], np.sqrt(64.0), h, start, kv),
                     int(ids[start]), stored["target_hidden"][start - 1])
        for j, (logits, state, token) in enumerate(run):
            np.testing.assert_allclose(logits, stored[f"{variant}_logits"][i, j], atol=2e-4, rtol=0,
                                       err_msg=f"start {start} step {j}")
            np.testing.assert_allclose(state, stored[f"{variant}_states"][i, j], atol=2e-4, rtol=0)
            assert token == stored[f"{variant}_tokens"][i, j]


def _engine(path_target, path_assistant, kv_type_k="f16", kv_type_v="f16", **load):
    model = cupyllm.load(path_target, device="cpu", ctx=64, kv_type_k=kv_type_k, kv_type_v=kv_type_v,
                         progress=False, **load)
    assistant = Gemma4Assistant.from_gguf(read_gguf(path_assistant), model.transformer.ops)
    return model, AssistantDrafter(assistant, model.transformer)


def _engine_chain(model, drafter, ids, start: int):
    """Prefill ids[:start] through the drafter's forward, then STEPS chained engine steps from ids[start]."""
    cache = model.new_cache()
    prefill(drafter.target_forward, ids[:start], cache, model.kv_spec.max_chunk)
    hidden = drafter._rows[2][-1:]
    ops = model.transformer.ops

    def step(token, h):
        logits, state = drafter.assistant.step(model.transformer, cache, token, h, start, drafter.dca)
        return np.asarray(ops.to_numpy(logits)).reshape(-1), state

    run = _chain(step, int(ids[start]), hidden)
    return [(logits, np.asarray(ops.to_numpy(state)).reshape(-1), token) for logits, state, token in run], cache


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_matches_reference_and_transformers(variant, models, stored):
    """The engine's steps over cupyllm's own f16 target cache: the NumPy definition's on that cache's decoded
    K/V and cupyllm's hidden rows (to float32 rounding), and transformers' (to the cache's f16 rounding)."""
    model, drafter = _engine(models["target"][0], models[variant][0])
    cfg, decoded = drafter.assistant.cfg, models[variant][1]
    target_embd = models["target"][1]["token_embd.weight"]
    ids = stored["prompt_ids"].tolist()
    for i, start in enumerate(hf_reference.STARTS):
        run, cache = _engine_chain(model, drafter, ids, start)
        kv = _cache_kv(cache, drafter.assistant.sources)
        hidden = np.asarray(model.transformer.ops.to_numpy(drafter._rows[2][-1]))
        want = _chain(lambda t, h: reference_step(cfg, decoded, target_embd[t], np.sqrt(64.0), h, start, kv),
                      ids[start], hidden)
        for j, ((logits, state, token), (ref_logits, ref_state, ref_token)) in enumerate(zip(run, want)):
            np.testing.assert_allclose(logits, ref_logits, atol=2e-3, rtol=0, err_msg=f"start {start} step {j}")
            np.testing.assert_allclose(state, ref_state, atol=2e-3, rtol=0)
            assert token == ref_token
            np.testing.assert_allclose(logits, stored[f"{variant}_logits"][i, j], atol=3e-2, rtol=0)
            assert token == stored[f"{variant}_tokens"][i, j]


def _cache_kv(cache, sources, ops=None):
    """The K/V a cache holds for the assistant's first (sliding) and last (global) layer, decoded as attention
    reads them (rotation undone, normalisation undone), per kind, as NumPy."""
    kv = {}
    for sliding, layer in ((True, sources[0]), (False, sources[-1])):
        layer_kv = cache.layers[layer]
        k, v, pos = (np.asarray(ops.to_numpy(a) if ops is not None else a) for a in layer_kv.decode(0, layer_kv.n_used))
        keep = pos >= 0
        kv[sliding] = (k[keep], v[keep], pos[keep])
    return kv


# relative L2 error of the first draft's logits against the f16 cache's (the same h): measured 0.22 (turbo3: 3-bit
# K and V of a tiny random model) and 0.006 (q8_0)
QUANTIZED_REL = {"turbo3": 0.35, "q8_0": 0.02}


@pytest.mark.parametrize("kv_type", ["turbo3", "q8_0"])
def test_drafts_read_quantized_caches_as_stored(kv_type, models, stored):
    """With K rotated (turbo3) or channel-normalised (q8_0: normalize_k on) the assistant's queries meet K as the
    cache stores it: the engine's step is the definition's on the K/V the cache decodes to, its logits are the f16
    cache's within the format's error (the same draft), and the normalised rows read as if they were K (a drafter
    that skips the query's transform) are off by far more than the format's error."""
    ids = stored["prompt_ids"].tolist()
    start = hf_reference.STARTS[-1]
    base_model, base_drafter = _engine(models["target"][0], models["plain"][0])
    base, _ = _engine_chain(base_model, base_drafter, ids, start)
    hidden = base_drafter._rows[2][-1:]  # the f16 run's h: the cache is the only difference
    model, drafter = _engine(models["target"][0], models["plain"][0], kv_type_k=kv_type, kv_type_v=kv_type)
    _engine_chain(model, drafter, ids, start)
    cache, assistant = drafter.cache, drafter.assistant

    def step():
        logits, _ = assistant.step(model.transformer, cache, ids[start], hidden, start)
        return np.asarray(model.transformer.ops.to_numpy(logits)).reshape(-1)

    logits, want = step(), base[0][0]
    embedding = models["target"][1]["token_embd.weight"][ids[start]]
    definition, _ = reference_step(assistant.cfg, models["plain"][1], embedding, np.sqrt(64.0),
                                   np.asarray(hidden).reshape(-1), start, _cache_kv(cache, assistant.sources))
    np.testing.assert_allclose(logits, definition, atol=1e-3, rtol=0)
    error = np.linalg.norm(logits - want) / np.linalg.norm(want)
    assert error < QUANTIZED_REL[kv_type]
    assert np.argmax(logits) == np.argmax(want)
    if kv_type == "q8_0":
        layer_kv = cache.layers[assistant.sources[0]]
        assert layer_kv.normalize_k and layer_kv.k_scale is not None
        offset, scale = layer_kv.k_offset, layer_kv.k_scale
        layer_kv.k_offset, layer_kv.k_scale = None, None  # K read as stored, untransformed
        try:
            raw = step()
        finally:
            layer_kv.k_offset, layer_kv.k_scale = offset, scale
        assert np.linalg.norm(raw - want) / np.linalg.norm(want) > 10 * error


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_with_the_assistant_is_plain_greedy_and_transformers(variant, models, stored):
    """load(..., draft_model=ASSISTANT.gguf) picks the assistant drafter by the file's architecture; greedy text
    with it is plain greedy text, and transformers' generate(..., assistant_model=...) ids; drafts were made."""
    ids = stored["prompt_ids"][:hf_reference.GENERATE_PROMPT].tolist()
    n = hf_reference.NEW_TOKENS

    def reply_ids(model) -> list[int]:  # (keep_cache: the cache holds the prompt and every reply id but the last)
        text = model.generate(ids, max_tokens=n, temperature=0.0, keep_cache=True)
        held = list(model.last_prompt_cache.ids)[len(ids):]
        assert model.detokenize(held) == text[:len(model.detokenize(held))]
        return held, text

    plain = cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False)
    want, want_text = reply_ids(plain)
    model = cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False, draft_model=models[variant][0],
                         spec=SpecConfig(type="draft", draft_max=3, draft_p_min=0.0, adaptive=False))
    assert model.spec.type == "assistant"
    got, text = reply_ids(model)
    assert got == want and text == want_text
    np.testing.assert_array_equal(stored["greedy_ids"], stored[f"{variant}_generate_ids"])
    np.testing.assert_array_equal(got, stored[f"{variant}_generate_ids"][:n - 1])
    assert text == model.detokenize(stored[f"{variant}_generate_ids"].tolist())
    assert model.last_stats.draft.drafted > 0


def test_drafts_during_generation_are_those_of_a_fresh_state(models, stored):
    """Every draft run a generation makes (after verify steps that rejected drafts and rewound the cache) is the
    one a fresh target gives after prefilling the same history: the h row at P - 1 and the cache are the
    right ones."""
    ids = stored["prompt_ids"][:hf_reference.GENERATE_PROMPT].tolist()
    spec = {"type": "assistant", "draft_max": 3, "draft_p_min": 0.0, "adaptive": False}
    model = cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False, draft_model=models["masked"][0],
                         spec=spec)
    drafter = model._drafter(model.spec)
    calls, drafting = [], drafter.draft

    def recorded(history, n_max):
        out = drafting(history, n_max)
        calls.append((list(history), n_max, out))
        return out

    drafter.draft = recorded
    model.generate(ids, max_tokens=10, temperature=0.0)
    assert len(calls) >= 3 and all(out for _, _, out in calls)
    fresh_model = cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False)
    assistant = Gemma4Assistant.from_gguf(read_gguf(models["masked"][0]), fresh_model.transformer.ops)
    for history, n_max, out in calls:
        fresh = AssistantDrafter(assistant, fresh_model.transformer)
        prefill(fresh.target_forward, history[:-1], fresh_model.new_cache(), fresh_model.kv_spec.max_chunk)
        assert fresh.draft(history, n_max) == out


def test_greedy_ids_with_the_assistant_on_quantized_caches(models, stored):
    """The loop stays lossless on turbo3 and q8_0 caches: the same ids as without drafts."""
    ids = stored["prompt_ids"][:hf_reference.GENERATE_PROMPT].tolist()
    for kv in ("turbo3", "q8_0"):
        plain = cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False, kv_type_k=kv, kv_type_v=kv)
        model = cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False, kv_type_k=kv, kv_type_v=kv,
                             draft_model=models["plain"][0], spec={"type": "assistant", "draft_max": 4,
                                                                   "draft_p_min": 0.0, "adaptive": False})
        assert model.generate(ids, max_tokens=10, temperature=0.0) == plain.generate(ids, max_tokens=10,
                                                                                      temperature=0.0)


DCA = {"chunk_size": 8, "local_size": 2}  # chunks of 6 positions: the starts 9 and 13 lie one and two chunks on


@pytest.mark.parametrize("variant", VARIANTS)
def test_steps_with_dual_chunk_attention_are_the_definition_and_lossless(variant, models, stored):
    """With Dual Chunk Attention on the target, its global layers cache K roped at in-chunk positions: the
    engine's steps are the definition's with the query roped at P's intra / successive / inter positions (over
    the K/V the cache decodes to), far from reading that cache as plain attention would past the first chunk;
    and greedy text with the assistant is the target's own greedy text with DCA."""
    from cupyllm.ops.attention.dca import DCAConfig
    model, drafter = _engine(models["target"][0], models[variant][0], dca=DCA)
    assert drafter.dca == DCAConfig(**DCA)
    cfg, decoded = drafter.assistant.cfg, models[variant][1]
    target_embd = models["target"][1]["token_embd.weight"]
    ids = stored["prompt_ids"].tolist()
    for start in hf_reference.STARTS:
        run, cache = _engine_chain(model, drafter, ids, start)
        kv = _cache_kv(cache, drafter.assistant.sources)
        hidden = np.asarray(model.transformer.ops.to_numpy(drafter._rows[2][-1]))
        want = _chain(lambda t, h: reference_step(cfg, decoded, target_embd[t], np.sqrt(64.0), h, start, kv,
                                                  dca=drafter.dca), ids[start], hidden)
        plain_reading = reference_step(cfg, decoded, target_embd[ids[start]], np.sqrt(64.0), hidden, start, kv)[0]
        for j, ((logits, state, token), (ref_logits, ref_state, ref_token)) in enumerate(zip(run, want)):
            np.testing.assert_allclose(logits, ref_logits, atol=2e-3, rtol=0, err_msg=f"start {start} step {j}")
            np.testing.assert_allclose(state, ref_state, atol=2e-3, rtol=0)
            assert token == ref_token
        if start > DCA["chunk_size"] - DCA["local_size"]:
            assert np.abs(run[0][0] - plain_reading).max() > 50 * 2e-3, f"start {start}"
    prompt = ids[:hf_reference.GENERATE_PROMPT]
    plain = cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False, dca=DCA)
    drafting = cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False, dca=DCA,
                            draft_model=models[variant][0], spec={"type": "assistant", "draft_max": 3,
                                                                  "draft_p_min": 0.0, "adaptive": False})
    want_text = plain.generate(prompt, max_tokens=hf_reference.NEW_TOKENS, temperature=0.0)
    assert drafting.generate(prompt, max_tokens=hf_reference.NEW_TOKENS, temperature=0.0) == want_text
    assert drafting.last_stats.draft.drafted > 0


def _on_gpu(test):
    from gpu_helpers import GPU_TEST_MARKS  # (marked gpu; skipped without a device; CUPYLLM_EMULATE=1: the emulator)
    for mark in GPU_TEST_MARKS:
        test = mark(test)
    return test


@_on_gpu
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])  # (the GPU's turbo kernels take groups of 64 / 128 values)
def test_gpu_step_is_the_definition_and_greedy_text_is_plain(kv_type, models, stored):
    """On the GPU backend (its own cache, its attention kernels): each of the chained steps is the definition's
    on the K/V the device cache decodes to and the device's h, and greedy text with the assistant is the
    device's plain greedy text."""
    ids = stored["prompt_ids"].tolist()
    start = hf_reference.STARTS[-1]
    model = cupyllm.load(models["target"][0], device="gpu", ctx=64, kv_type_k=kv_type, kv_type_v=kv_type,
                         progress=False)
    ops = model.transformer.ops
    drafter = AssistantDrafter(Gemma4Assistant.from_gguf(read_gguf(models["masked"][0]), ops), model.transformer)
    cache = model.new_cache()
    prefill(drafter.target_forward, ids[:start], cache, model.kv_spec.max_chunk)
    kv = _cache_kv(cache, drafter.assistant.sources, ops)
    token, hidden = ids[start], drafter._rows[2][-1:]
    for _ in range(hf_reference.STEPS):
        logits, state = drafter.assistant.step(model.transformer, cache, token, hidden, start)
        logits = np.asarray(ops.to_numpy(logits)).reshape(-1)
        want, want_state = reference_step(drafter.assistant.cfg, models["masked"][1],
                                          models["target"][1]["token_embd.weight"][token], np.sqrt(64.0),
                                          np.asarray(ops.to_numpy(hidden)).reshape(-1), start, kv)
        np.testing.assert_allclose(logits, want, atol=5e-3, rtol=0)
        np.testing.assert_allclose(np.asarray(ops.to_numpy(state)).reshape(-1), want_state, atol=5e-3, rtol=0)
        token, hidden = int(np.argmax(logits)), state
    prompt = ids[:hf_reference.GENERATE_PROMPT]
    plain = model.generate(prompt, max_tokens=8, temperature=0.0)
    assisted = cupyllm.load(models["target"][0], device="gpu", ctx=64, kv_type_k=kv_type, kv_type_v=kv_type,
                            progress=False, draft_model=models["masked"][0],
                            spec={"type": "assistant", "draft_max": 3, "draft_p_min": 0.0, "adaptive": False})
    assert assisted.generate(prompt, max_tokens=8, temperature=0.0) == plain
    assert assisted.last_stats.draft.drafted > 0


def test_assistant_of_another_model_is_a_clear_error(models, tmp_path):
    """An assistant made for another width, and spec 'assistant' without one, are one InputError each."""
    import make_tiny_models

    spec = make_tiny_models.assistant_spec()
    spec.target = make_tiny_models.tiny_spec("gemma4-moe")  # width 64 too, but its global layers cache K=V ...
    spec.target.d_model = 48  # ... and here another width
    path = tmp_path / "other-assistant.gguf"
    make_tiny_models.write_assistant_gguf(spec, path)
    with pytest.raises(InputError, match="not an assistant of this model"):
        cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False, draft_model=path)
    with pytest.raises(InputError, match="assistant"):
        cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False, spec="assistant")
    model = cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False, draft_model=models["plain"][0])
    with pytest.raises(InputError, match="spec type 'draft' needs a draft model"):
        model.generate([2, 40, 50], max_tokens=2, spec="draft")


def test_cli_picks_the_assistant_by_its_file(models):
    """-md ASSISTANT.gguf drafts with the assistant (no --spec-type needed): the plain text, with drafts made;
    --spec-type assistant without -md is one error."""
    import subprocess

    base = [sys.executable, "-m", "cupyllm.cli", "generate", "-m", str(models["target"][0]), "the water",
            "-n", "8", "--temp", "0", "-c", "64", "--device", "cpu"]
    plain = subprocess.run(base, capture_output=True, text=True, check=True)
    drafted = subprocess.run(base + ["-md", str(models["masked"][0]), "--draft-p-min", "0", "--draft-fixed",
                                     "--draft-max", "3"], capture_output=True, text=True, check=True)
    assert drafted.stdout == plain.stdout
    assert "drafts: 0/0" not in drafted.stderr and "drafts:" in drafted.stderr
    bad = subprocess.run(base + ["--spec-type", "assistant"], capture_output=True, text=True)
    assert bad.returncode == 1 and "needs a Gemma 4 assistant" in bad.stderr and "Traceback" not in bad.stderr


def test_server_slots_draft_with_the_assistant(models, stored):
    """Served, each slot drafts with its own assistant drafter (the slot's hidden rows; its steps on the batcher's
    thread): two concurrent greedy completions are plain generation's text, and drafts were checked."""
    from concurrent.futures import ThreadPoolExecutor

    from test_server import client, metric, serving

    model = cupyllm.load(models["target"][0], device="cpu", ctx=64, progress=False, draft_model=models["masked"][0],
                         spec={"type": "assistant", "draft_max": 3, "draft_p_min": 0.0, "adaptive": False})
    prompts = [stored["prompt_ids"][:hf_reference.GENERATE_PROMPT].tolist(), stored["prompt_ids"][3:].tolist()]
    want = [model.generate(p, max_tokens=10, temperature=0.0, spec=False) for p in prompts]
    with serving(model, parallel=2) as url:
        c = client(url)
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: c.completions.create(model="m", prompt=p, max_tokens=10, temperature=0)
                                .choices[0].text, prompts))
        assert got == want
        assert metric(url, "draft_tokens_total") > 0


def test_stored_reference_is_what_transformers_computes(stored, tmp_path):
    """Where torch and transformers are installed: the stored arrays, recomputed now, equal (floats within
    1e-5: BLAS builds sum in other orders; ids and hashes exactly)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    assert_recomputed_equal(hf_reference.compute(tmp_path), stored)
