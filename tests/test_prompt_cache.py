"""Prompt caching (cupyllm/kv/prompt_cache.py): a prompt that begins like a cached one prefills only the rest, and
gives what a fresh run gives; the cache survives a file round trip; stale or broken caches are clear errors (API)
or are made again (CLI --prompt-cache)."""
from __future__ import annotations

import numpy as np
import pytest

import cupyllm
from cupyllm.errors import CupyllmError
from cupyllm.kv.prompt_cache import PromptCache
from test_generate import run_cli

PREFIX = list(range(5, 90))  # past the tiny Gemma's 6-token window and several 16-token chunks
TAIL = [7, 8, 9]


def _model(tiny_model, arch, **options):
    path = tiny_model(arch)[0]
    return cupyllm.load(path, device="cpu", ctx=256, max_chunk=16, progress=False, **options)


def _fresh_logits(model, ids):
    return model.logits(ids)[-1]


def _scribble(model):
    """Fill the model's working cache with another prompt, so that a restore that left anything out shows."""
    model.generate(list(range(120, 230)), max_tokens=2, temperature=0)


def _assert_close(got, want):
    """A tail of a few tokens runs through the decode GEMV where a fresh prefill has it in a GEMM chunk: the same
    products summed in another order, through 16-bit activation codes (measured up to 1.2e-4 of logits ~2)."""
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_a_cached_prefix_gives_what_a_fresh_run_gives(tiny_model, arch, kv_type):
    """q8_0 K is normalised from the first chunk's statistics, which the cache keeps."""
    model = _model(tiny_model, arch, kv_type_k=kv_type, kv_type_v=kv_type)
    cached = model.cache_prompt(PREFIX)
    assert cached.ids == tuple(PREFIX) and cached.reused == 0
    # only the used slots are kept, not the whole ctx-sized arrays
    assert max(state["k_data"].shape[0] for state in cached.layer_states) <= len(PREFIX) < model.kv_spec.ctx
    _assert_close(cached.logits, _fresh_logits(model, PREFIX))

    fresh = model.generate(PREFIX + TAIL, max_tokens=6, temperature=0)
    _scribble(model)
    again = model.generate(PREFIX + TAIL, max_tokens=6, temperature=0, prompt_cache=cached)
    assert again == fresh
    assert model.last_stats.cached_tokens == len(PREFIX) and model.last_stats.prompt_tokens == len(TAIL)

    extended = model.cache_prompt(PREFIX + TAIL, reuse=cached)
    assert extended.reused == len(PREFIX)
    _assert_close(extended.logits, _fresh_logits(model, PREFIX + TAIL))
    # the whole prompt cached: nothing is prefilled, the saved logits start the generation
    assert model.generate(PREFIX, max_tokens=6, temperature=0, prompt_cache=cached) == \
        model.generate(PREFIX, max_tokens=6, temperature=0)
    assert model.cache_prompt(PREFIX, reuse=cached).reused == len(PREFIX)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_generate_keeps_the_cache_of_prompt_and_reply(tiny_model, arch):
    """keep_cache=True: last_prompt_cache holds the prompt and every reply token that ran (not the last sampled
    one), with the logits after them; a next prompt that continues the reply prefills only what follows it."""
    model = _model(tiny_model, arch)
    reply = model.generate(PREFIX, max_tokens=7, temperature=0, keep_cache=True)
    kept = model.last_prompt_cache
    generated = model.last_stats.generated_tokens
    assert kept.ids[:len(PREFIX)] == tuple(PREFIX) and len(kept.ids) == len(PREFIX) + generated - 1
    assert model.detokenize(kept.ids[len(PREFIX):]) == reply[:len(model.detokenize(kept.ids[len(PREFIX):]))]
    _assert_close(kept.logits, _fresh_logits(model, list(kept.ids)))
    follow_up = list(kept.ids) + TAIL
    fresh = model.generate(follow_up, max_tokens=6, temperature=0)
    _scribble(model)
    assert model.generate(follow_up, max_tokens=6, temperature=0, prompt_cache=kept) == fresh
    assert model.last_stats.cached_tokens == len(kept.ids) and model.last_stats.prompt_tokens == len(TAIL)
    model.generate(PREFIX, max_tokens=2, temperature=0)
    assert model.last_prompt_cache is None  # only when asked for


def test_a_stream_closed_early_keeps_what_ran(tiny_model):
    """A stream closed between pieces (Ctrl-C in `cupyllm chat`) keeps the cache of what ran, logits included."""
    model = _model(tiny_model, "qwen2")
    pieces = model.generate(PREFIX, max_tokens=20, temperature=0, stream=True, keep_cache=True)
    next(pieces)
    next(pieces)
    pieces.close()
    kept = model.last_prompt_cache
    assert len(PREFIX) < len(kept.ids) < len(PREFIX) + 20
    _assert_close(kept.logits, _fresh_logits(model, list(kept.ids)))


def test_a_cache_the_model_still_holds_is_not_copied_back(tiny_model, monkeypatch):
    """generate(prompt_cache=) right after the cache_prompt or keep_cache that made it uses the working cache as
    it is (no restore, same tokens); once anything else ran, it restores."""
    from cupyllm.kv.cache import KVCache
    model = _model(tiny_model, "gemma3")
    fresh = model.generate(PREFIX + TAIL, max_tokens=6, temperature=0)
    restores = []
    original = KVCache.restore
    monkeypatch.setattr(KVCache, "restore", lambda self, *a: (restores.append(1), original(self, *a)))
    cached = model.cache_prompt(PREFIX)
    assert model.generate(PREFIX + TAIL, max_tokens=6, temperature=0, prompt_cache=cached, keep_cache=True) == fresh
    assert restores == [] and model.last_stats.cached_tokens == len(PREFIX)
    kept = model.last_prompt_cache
    follow_up = list(kept.ids) + TAIL
    assert model.generate(follow_up, max_tokens=4, temperature=0, prompt_cache=kept) == \
        (want := model.generate(follow_up, max_tokens=4, temperature=0))
    assert restores == []  # the second, fresh run did not use it
    assert model.generate(PREFIX + TAIL, max_tokens=6, temperature=0, prompt_cache=cached) == fresh
    assert restores == [1]  # the working cache held another prompt by then
    assert model.generate(follow_up, max_tokens=4, temperature=0, prompt_cache=kept) == want and restores == [1, 1]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_a_cached_prefix_with_dual_chunk_attention(tiny_model, arch):
    """DCA (keys cached at their in-chunk positions, 32-token chunks: the prefix spans three): the same text."""
    model = _model(tiny_model, arch, dca={"chunk_size": 32, "local_size": 4})
    fresh = model.generate(PREFIX + TAIL, max_tokens=6, temperature=0)
    cached = model.cache_prompt(PREFIX)
    _scribble(model)
    assert model.generate(PREFIX + TAIL, max_tokens=6, temperature=0, prompt_cache=cached) == fresh
    assert model.last_stats.cached_tokens == len(PREFIX)
    assert cached.key["dca"] == {"chunk_size": 32, "local_size": 4, "yarn_factor": 1.0}
    with pytest.raises(CupyllmError, match="other settings"):  # a cache of the plain model does not fit
        _model(tiny_model, arch).generate(PREFIX, max_tokens=1, prompt_cache=cached)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_a_cache_that_ran_past_the_shared_part_is_cut_back(tiny_model, arch):
    """Truncation: a cache of PREFIX + other tokens serves PREFIX + TAIL from PREFIX on; the tiny Gemma's sliding
    ring (window 6 + chunk 16 slots) still holds the window before PREFIX's end after 10 more tokens, not after 40,
    when the prompt is prefilled afresh (and still right)."""
    model = _model(tiny_model, arch)
    fresh = model.generate(PREFIX + TAIL, max_tokens=6, temperature=0)
    for extra, reusable in ((10, True), (40, arch == "qwen2")):
        other = model.cache_prompt(PREFIX + list(range(100, 100 + extra)))
        _scribble(model)
        assert model.generate(PREFIX + TAIL, max_tokens=6, temperature=0, prompt_cache=other) == fresh
        assert model.last_stats.cached_tokens == (len(PREFIX) if reusable else 0), (extra, arch)
        cut = model.cache_prompt(PREFIX + TAIL, reuse=other)
        _assert_close(cut.logits, _fresh_logits(model, PREFIX + TAIL))


def test_the_cache_survives_a_file_and_bad_files_are_one_error(tiny_model, tmp_path):
    model = _model(tiny_model, "gemma3", kv_mirror=True)  # (a file leaves the float32 copies out)
    cached = model.cache_prompt(PREFIX)
    path = tmp_path / "prompt.cache"
    cached.save(path)
    loaded = PromptCache.load(path)
    assert loaded.ids == cached.ids and loaded.key == cached.key
    assert "k_f32" in cached.layer_states[0] and "k_f32" not in loaded.layer_states[0]  # float copies left out
    later = _model(tiny_model, "gemma3", kv_mirror=True)  # another process, in effect: a cache that never held it
    assert later.generate(PREFIX + TAIL, max_tokens=6, temperature=0, prompt_cache=loaded) == \
        model.generate(PREFIX + TAIL, max_tokens=6, temperature=0)

    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CupyllmError, match="not a readable cupyllm prompt cache"):
        PromptCache.load(path)
    with pytest.raises(CupyllmError, match="no such prompt cache"):
        PromptCache.load(tmp_path / "missing.cache")
    other_ctx = _model(tiny_model, "gemma3", kv_type_k="q8_0")
    with pytest.raises(CupyllmError, match="other settings"):
        other_ctx.generate(PREFIX, max_tokens=2, prompt_cache=cached)


def test_cli_prompt_cache(tiny_model, tmp_path):
    path = tiny_model("qwen2")[0]
    cache_file = tmp_path / "doc.cache"
    document = "the sea and the sky and the sand " * 6
    base = ["generate", "-m", str(path), "-n", "6", "--temp", "0", "--device", "cpu", "-c", "256"]
    plain = run_cli(*base, document + "what is blue?")
    first = run_cli(*base, document + "what is green?", "--prompt-cache", str(cache_file))
    assert first.returncode == 0 and cache_file.exists(), first.stderr
    assert "0 of them from the saved cache" in first.stderr
    second = run_cli(*base, document + "what is blue?", "--prompt-cache", str(cache_file))
    assert second.returncode == 0, second.stderr
    assert second.stdout == plain.stdout
    reused = int(second.stderr.split(" of them from the saved cache")[0].rsplit(" ", 1)[1])
    assert reused > 0 and "cached)" in second.stderr

    cache_file.write_bytes(b"not a cache")
    broken = run_cli(*base, document + "what is blue?", "--prompt-cache", str(cache_file))
    assert broken.returncode == 0 and broken.stdout == plain.stdout
    assert "cupyllm: note:" in broken.stderr and "Traceback" not in broken.stderr
    settings = run_cli(*base, document + "what is blue?", "--prompt-cache", str(cache_file), "-ctk", "q8_0")
    assert settings.returncode == 0 and "other settings" in settings.stderr


@pytest.mark.slow
def test_real_gemma_document_questions(tmp_path):
    """Gemma 3 270M (sliding window 512 in rings of 512 + 512 slots): a 700-token document's cache answers
    questions as a fresh prefill does, also cut back from a cache that ran 100 tokens further."""
    from models import gemma_path
    model = cupyllm.load(gemma_path(), device="cpu", ctx=1024, progress=False)
    document = ("The keepers of the northern lighthouses wrote down the weather, the tides and the ships they saw "
                "each morning, and the survey printed their notes every spring. ") * 22
    doc_ids = model.tokenize(document)
    assert 600 < len(doc_ids) < 800
    cached = model.cache_prompt(document)
    longer = model.cache_prompt(doc_ids + model.tokenize(" The survey also counted" * 25, add_bos=False)[:100])
    for question in ("\nQuestion: What did the keepers write down?\nAnswer:", "\nQ: When was it printed?\nA:"):
        fresh = model.generate(document + question, max_tokens=8, temperature=0)
        for cache in (cached, longer):
            _scribble(model)
            assert model.generate(document + question, max_tokens=8, temperature=0, prompt_cache=cache) == fresh
            assert model.last_stats.cached_tokens >= len(doc_ids) - 1
