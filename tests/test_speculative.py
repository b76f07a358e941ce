"""Speculative decoding (cupyllm/speculative): the verify loop keeps the target's output (greedy: the same tokens;
sampling: the same distribution), rewinds every kind of cache to what was kept, and each drafter plugs into it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cupyllm
import make_tiny_models
from cupyllm.errors import InputError
from cupyllm.generate import generate_stream
from cupyllm.sampling import Sampler, SamplingParams
from cupyllm.speculative import DraftLength, NgramDrafter, SpecConfig
from cupyllm.speculative.decoder import DraftContext
from cupyllm.speculative.ngram import text_fold

PROMPT = [3, 17, 5, 9, 3, 17, 5, 11, 2, 8, 13, 21, 3, 17]
GREEDY = SamplingParams(temperature=0.0)


class ScriptedDrafter:
    """Proposes the plain run's continuation with tokens changed at random (rate `wrong`): acceptance and
    rejection at every draft position, and so every rewind length."""

    def __init__(self, reference: list[int], n_vocab: int, wrong: float, seed: int = 0):
        self.reference, self.n_vocab, self.wrong = reference, n_vocab, wrong
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def draft(self, history, n_max):
        self.calls += 1
        at = len(history)
        out = list(self.reference[at:at + n_max])
        for i in range(len(out)):
            if self.rng.random() < self.wrong:
                out[i] = (out[i] + 1 + int(self.rng.integers(self.n_vocab - 1))) % self.n_vocab
        return out


def _load(tiny_model, arch, **options):
    path, _, _ = tiny_model(arch)
    options.setdefault("ctx", 96)
    options.setdefault("max_chunk", 8)  # (a sliding window's ring keeps max_chunk spare slots: drafts fit in them)
    return cupyllm.load(path, device="cpu", progress=False, **options)


def _run(model, prompt, max_tokens, sampler, drafter=None, length=None, stop=()):
    """(text, the ids the cache holds at the end, the logits after them, the cache) of one generation in a fresh
    cache of the model's spec."""
    cache = model.transformer.ops.new_cache(model.cfg, model.kv_spec)
    held = {}

    def done(ids, logits):
        held["ids"], held["logits"] = list(ids), np.asarray(logits).reshape(-1)

    text = "".join(generate_stream(model._forward_numpy, model.tokenizer, prompt, cache, sampler,
                                   max_tokens=max_tokens, stop=stop, chunk=model.kv_spec.max_chunk, on_done=done,
                                   drafter=drafter, draft_length=length))
    return text, held["ids"], held["logits"], cache


def _next_logits(model, cache, ids, token):
    """Logits after running `token` at the end of a cache that holds `ids`."""
    assert cache.n_past == len(ids)
    out = model._forward_numpy(np.array([token]), np.array([cache.n_past]), cache)
    cache.n_past += 1
    return np.asarray(out).reshape(-1)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "turbo3_tcq"])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "gemma4", "qwen35", "qwen3next"])
def test_greedy_drafts_give_the_plain_tokens_and_cache(tiny_model, arch, kv_type):
    """Drafts with wrong tokens at random places: the text, the ids the cache holds at the end and the logits
    after them are plain decoding's, and the cache reads the same afterwards (gemma3: a 6-token sliding window,
    crossed many times; gemma4: KV-shared layers; qwen35 / qwen3next: recurrent states rewound and re-run)."""
    model = _load(tiny_model, arch, kv_type_k=kv_type, kv_type_v=kv_type)
    text, ids, logits, cache = _run(model, PROMPT, 40, Sampler(GREEDY))
    drafter = ScriptedDrafter(ids + [0] * 8, model.cfg.n_vocab, wrong=0.25)
    drafter.reference[len(ids)] = int(np.argmax(logits))  # (the last token is not in the cache)
    spec_text, spec_ids, spec_logits, spec_cache = _run(model, PROMPT, 40, Sampler(GREEDY), drafter,
                                                        DraftLength(6, adaptive=False))
    assert spec_text == text
    assert spec_ids == ids
    np.testing.assert_allclose(spec_logits, logits, rtol=0, atol=2e-3 * np.abs(logits).max())  # (quantized K/V: rounding of other sums)
    after = _next_logits(model, spec_cache, spec_ids, 7)
    np.testing.assert_allclose(after, _next_logits(model, cache, ids, 7), rtol=0, atol=2e-3 * np.abs(after).max())
    assert drafter.calls > 3


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "qwen35"])
def test_rewind_leaves_what_a_cache_that_never_saw_the_drafts_holds(tiny_model, arch):
    """KVCache.mark / rewind after a run of rejected tokens, against a cache that only ran the kept ones in the
    same chunks: the same slot positions, rows and recurrent states (bit for bit), the same next logits."""
    model = _load(tiny_model, arch, kv_type_k="q8_0", kv_type_v="q4_0")
    ops, fwd = model.transformer.ops, model._forward_numpy
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, model.cfg.n_vocab, 20)
    run = rng.integers(0, model.cfg.n_vocab, 7)
    for n_keep in (0, 1, 4, 7):
        seen, clean = ops.new_cache(model.cfg, model.kv_spec), ops.new_cache(model.cfg, model.kv_spec)
        for cache in (seen, clean):
            fwd(prompt, np.arange(20), cache)
            cache.n_past = 20
        mark = seen.mark()
        fwd(run, np.arange(20, 27), seen)
        seen.n_past = 27
        held = seen.rewind(mark, 20 + n_keep)
        if held < 20 + n_keep:  # recurrent states went back to the mark: the kept tokens run again
            assert model.cfg.ssm is not None and held == 20
            fwd(run[:n_keep], np.arange(20, 20 + n_keep), seen)
            seen.n_past = 20 + n_keep
        if n_keep:
            fwd(run[:n_keep], np.arange(20, 20 + n_keep), clean)
            clean.n_past = 20 + n_keep
        for a, b in zip(seen.own_layers(), clean.own_layers()):
            if hasattr(a, "recurrent"):
                np.testing.assert_array_equal(a.recurrent, b.recurrent)
                np.testing.assert_array_equal(a.conv, b.conv)
                assert a.n_seen == b.n_seen
                continue
            assert (a.slot_pos < 20 + n_keep).all()
            if a.ring:  # the keys the next queries read (a ring also keeps older ones the drafts overwrote)
                needed = np.arange(max(0, 20 + n_keep - a.window), 20 + n_keep) % a.capacity
                np.testing.assert_array_equal(a.slot_pos[needed], b.slot_pos[needed])
                live = np.zeros(a.capacity, bool)
                live[needed] = True
            else:
                np.testing.assert_array_equal(a.slot_pos, b.slot_pos)
                live = a.slot_pos != -1
            np.testing.assert_array_equal(a.k_data[live], b.k_data[live])
            np.testing.assert_array_equal(a.v_data[live], b.v_data[live])
        np.testing.assert_array_equal(_next_logits(model, seen, [0] * (20 + n_keep), 5),
                                      _next_logits(model, clean, [0] * (20 + n_keep), 5))


def test_rewind_refuses_what_it_cannot_do(tiny_model):
    model = _load(tiny_model, "gemma3")
    cache = model.transformer.ops.new_cache(model.cfg, model.kv_spec)
    model._forward_numpy(np.arange(8), np.arange(8), cache)
    cache.n_past = 8
    mark = cache.mark()
    with pytest.raises(ValueError, match="cannot rewind"):
        cache.rewind(mark, 9)
    for start in range(8, 40, 8):  # far more than the ring's spare slots after the mark
        model._forward_numpy(np.arange(8), np.arange(start, start + 8), cache)
        cache.n_past += 8
    with pytest.raises(ValueError, match="ring"):
        cache.rewind(mark, 9)


# --- sampling: the emitted tokens are distributed as plain draws ---------------------------------------------------
# A chi-square test at p < 1e-4 per case: with the cases below (fixed seeds) a false alarm has probability ~1e-3 if
# the draws were fresh; the seeds make the outcome reproducible.

def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    from math import erf, sqrt
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the distribution was emitted"
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / sqrt(2 / (9 * dof))  # Wilson-Hilferty
    return 0.5 * (1 - erf(z / sqrt(2)))


@pytest.mark.parametrize("draft,with_q", [(0, False), (3, False), (5, False), (None, True)])
def test_verify_emits_the_target_distribution(draft, with_q):
    """Sampler.verify against Sampler.distribution: a likely draft, an unlikely one, one the top-k filter removes
    (never kept), deterministic (q = 1) and with a drafter's distribution q."""
    params = SamplingParams(temperature=0.9, top_k=5, top_p=1.0, min_p=0.0, seed=123)
    logits = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -3.0, 0.1], np.float32)
    sampler = Sampler(params)
    ids, probs = sampler.distribution(logits)
    target = np.zeros(len(logits))
    target[ids] = probs
    q = (np.array([3, 5, 1]), np.array([0.5, 0.3, 0.2])) if with_q else None
    drafts = np.random.default_rng(7).choice(q[0], size=20000, p=q[1]) if with_q else np.full(20000, draft)
    counts = np.zeros(len(logits))
    kept = 0
    for draft in drafts:  # (a drafter with a distribution q draws its drafts from q)
        token, accepted = sampler.verify(logits, [], int(draft), q)
        counts[token] += 1
        kept += accepted
        assert accepted == (token == draft) or not accepted
    assert _chi2_pvalue(counts, target) > 1e-4
    if draft == 5 and not with_q:
        assert kept == 0  # outside top-k: p(draft) = 0


def test_greedy_verify_keeps_the_argmax_only():
    sampler = Sampler(GREEDY)
    logits = np.array([0.0, 3.0, 1.0], np.float32)
    assert sampler.verify(logits, [], 1) == (1, True)
    assert sampler.verify(logits, [], 2) == (1, False)


def test_sampled_generation_keeps_the_plain_distribution(tiny_model):
    """The second token of many seeded generations (the first a verify step emits), plain and with drafts (the plain greedy run's tokens, often
    kept, often not), against each other: a two-sample chi-square test (p < 1e-4: false alarm ~1e-4)."""
    model = _load(tiny_model, "qwen2")
    params = dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
    _, reference, last, _ = _run(model, PROMPT, 8, Sampler(GREEDY))
    reference = reference + [int(np.argmax(last))] + [0] * 8
    plain, drafted = np.zeros(model.cfg.n_vocab), np.zeros(model.cfg.n_vocab)
    kept = 0
    n = 400
    for seed in range(n):
        for counts, drafter in ((plain, None), (drafted, ScriptedDrafter(reference, model.cfg.n_vocab, 0.0))):
            cache = model.transformer.ops.new_cache(model.cfg, model.kv_spec)
            held = {}
            list(generate_stream(model._forward_numpy, model.tokenizer, PROMPT, cache,
                                 Sampler(SamplingParams(seed=seed, **params)), max_tokens=3,
                                 on_done=lambda ids, logits: held.update(ids=ids),
                                 drafter=drafter, draft_length=DraftLength(3, adaptive=False) if drafter else None))
            counts[held["ids"][-1]] += 1  # the second token (the cache holds all but the last of three)
    both = plain + drafted
    keep = both > 0
    stat = (((plain - drafted) ** 2)[keep] / both[keep]).sum()
    dof = int(keep.sum()) - 1
    from math import erf, sqrt
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / sqrt(2 / (9 * dof))
    assert 0.5 * (1 - erf(z / sqrt(2))) > 1e-4
    assert plain.sum() == drafted.sum() == n


# --- the API, the stop rules and the drafters ------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "qwen35"])
def test_self_drafting_keeps_every_draft_and_the_stop_rules(tiny_model, arch):
    """spec="self" (the model drafts for itself, greedily): every draft kept; EOG, max_tokens and stop strings
    end the text where plain decoding ends it, and keep_cache holds the same tokens."""
    model = _load(tiny_model, arch)
    text = model.generate(PROMPT, max_tokens=30, temperature=0, keep_cache=True)
    plain_cache = model.last_prompt_cache
    assert model.generate(PROMPT, max_tokens=30, temperature=0, keep_cache=True, spec="self") == text
    stats = model.last_stats.draft
    assert stats.drafted > 0 and stats.accepted == stats.drafted
    assert model.last_prompt_cache.ids == plain_cache.ids
    np.testing.assert_allclose(model.last_prompt_cache.logits, plain_cache.logits, rtol=0, atol=1e-3)
    if len(text) > 6:
        stop = text[4:6]
        assert model.generate(PROMPT, max_tokens=30, temperature=0, stop=[stop], spec="self") == \
            model.generate(PROMPT, max_tokens=30, temperature=0, stop=[stop])
    for n in (1, 2, 5):
        assert model.generate(PROMPT, max_tokens=n, temperature=0, spec="self") == \
            model.generate(PROMPT, max_tokens=n, temperature=0)


def test_the_drafter_factory_keeps_and_hooks_what_it_makes(tiny_model):
    """speculative/factory.py, as generate() and the server's slots use it: a model drafter whose forwards an
    execute hook runs (the server's batcher) drafts what one without it drafts, every forward through the hook;
    a kept drafter comes back with its spec's p_min; n-gram lookup is new each time."""
    from cupyllm.speculative.factory import drafter_for

    model = _load(tiny_model, "qwen2")
    spec = SpecConfig(type="self", draft_p_min=0.5)
    through_hook, direct = [], []

    def execute(work):
        through_hook.append(1)
        return work()

    hooked, plain = drafter_for(spec, model, execute=execute), drafter_for(spec, model)
    forward = plain.forward
    plain.forward = lambda *args, **kwargs: direct.append(1) or forward(*args, **kwargs)
    drafts = hooked.draft(PROMPT, 4)
    assert drafts == plain.draft(PROMPT, 4) and len(drafts) == 4  # (self: p_min 0, every draft made)
    assert len(through_hook) == len(direct) > 0
    hooked.p_min = 0.3
    assert drafter_for(spec, model, kept=hooked) is hooked and hooked.p_min == 0.0  # (self: its drafts are kept)
    ngram = SpecConfig(type="ngram")
    assert drafter_for(ngram, model, kept=hooked) is not hooked and isinstance(drafter_for(ngram, model), NgramDrafter)
    assert drafter_for(None, model, kept=hooked) is None


def test_ngram_drafter_looks_up_the_longest_latest_match():
    """Before any draft (fresh drafters), the longest n-gram's latest occurrence."""
    history = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert NgramDrafter(size=3, min_size=1).draft(history, 2) == [4, 9]  # "1 2 3" occurred at the start
    history += [7]
    assert NgramDrafter(size=3, min_size=1).draft(history, 3) == []  # "7" never occurred before
    history += [2, 3]
    assert NgramDrafter(size=3, min_size=1).draft(history, 3) == [7, 2, 3]  # "2 3" was last followed by 7
    assert NgramDrafter(size=2, min_size=2).draft([5, 6, 7, 5], 4) == []  # no 2-gram "7 5" before
    assert NgramDrafter(size=2, min_size=1).draft([5, 6, 7, 5], 4) == [6, 7, 5]


def test_ngram_drafter_keeps_reading_where_it_drafted_from():
    """A phrase the source holds twice: once the text has followed a draft from the first, its next lookup
    continues there (the occurrence it reads), not at the phrase's latest occurrence; a text that left the
    source takes the first occurrence after where it was reading."""
    source = [1, 10, 11, 12, 2, 3, 4, 10, 11, 12, 5, 6, 7, 10, 11, 12, 8]
    history = source + [9, 1, 10]
    drafter = NgramDrafter(size=2, min_size=2)
    assert drafter.draft(history, 3) == [11, 12, 2]  # "1 10": once, at the source's start
    history += [11, 12]  # followed
    assert drafter.draft(history, 3) == [2, 3, 4]  # "11 12" three times: the one being read
    assert NgramDrafter(size=2, min_size=2).draft(list(history), 3) == [8, 9, 1]  # (no reading: the latest)
    history += [2, 3, 4, 99, 10, 11]  # read on to 4, then left the source: "10 11" after where it stood
    assert drafter.draft(history, 2) == [12, 5]


def test_ngram_context_says_how_long_the_match_runs():
    """The kind of an n-gram draft: how many of the history's last tokens equal those before the occurrence it
    continues, as a class of MATCH_CLASSES, with the prior m / (m + 2)."""
    drafter = NgramDrafter(size=3, min_size=2)
    quote = [11, 12, 13, 14, 15, 16, 17, 18]
    history = [1, 2] + quote + [3, 4] + quote[:5]  # the quote's first five tokens again: a match of 5
    assert drafter.draft(history, 3) == [16, 17, 18]
    context = drafter.context(history)
    assert context.kind == 4 and context.prior == pytest.approx(4 / 6)  # 5 falls in the class from 4
    history += quote[5:7]  # seven quoted: the class from 6
    assert drafter.context(history).kind == 6
    assert drafter.context([5, 6, 7]) == DraftContext(0, 0.0)  # nothing to continue


def test_ngram_drafter_falls_back_to_folded_tokens():
    """With a fold (a token's key: here t % 100, as text_fold maps " Insert" and " insert" together), a history
    whose last n-gram never occurred as it is drafts the continuation of its folded match (the history's own
    tokens), in a context of its own; an exact match still comes first."""
    drafter = NgramDrafter(size=3, min_size=2, fold=lambda t: t % 100)
    history = [1, 2, 3, 4, 5, 6, 7, 9, 9, 103, 4]  # "103 4" folds to "3 4", which was followed by 5 6 7
    assert NgramDrafter(size=3, min_size=2).draft(list(history), 3) == []
    assert drafter.draft(history, 3) == [5, 6, 7]
    assert drafter.context(history) == DraftContext(("folded", 2), 0.5)
    history += [105, 6]  # "105 6" folds to "5 6"; no exact "105 6" before either
    assert drafter.draft(history, 2) == [7, 9]
    assert drafter.context(history).kind == ("folded", 4)  # "3 4 5 6" folded, then 2 before it differs
    history += [7, 9, 6, 7]  # "6 7" occurred as it is, last followed by 9 6: the exact match is taken
    assert drafter.draft(history, 2) == [9, 6] and isinstance(drafter.context(history).kind, int)


def test_text_fold_lowercases_and_keeps_spaces():
    pieces = {1: b" Insert", 2: b" insert", 3: b"insert", 4: b"\n"}
    fold = text_fold(pieces.__getitem__)
    assert fold(1) == fold(2) == " insert" and fold(3) == "insert" != fold(2) and fold(4) == "\n"


def test_draft_length_keeps_each_context_apart():
    """Rates kept per drafter context: a long quote is drafted long at once (its prior carried to the positions
    no verdict has reached), a short match short; and what a context learns stays with it."""
    quote, short = DraftContext(16, 16 / 18), DraftContext(2, 0.5)
    length = DraftLength(15)
    length.observe(1, 0.010, 0, 0)
    length.observe(16, 0.050, 15, 15, context=quote)  # measured: 16 tokens cost 5 one-token forwards
    length.observe(2, 0.013, 1, 1, context=short)
    length.observe(4, 0.021, 3, 3, context=short)
    assert length.choose(15, quote) >= 8  # (lengths not measured yet are costed optimistically: tried once)
    assert length.choose(15, short) < 8
    np.testing.assert_allclose(length.rate(quote)[:3], 0.7 * quote.prior + 0.3)  # reached, kept
    assert length.rate(quote)[14] == length.rate(quote)[13]  # (reached too: the run kept them all)
    rate = length.rate(short)
    assert rate[2] == rate[3] == rate[14]  # positions 4.. not reached: carried from the last reached
    for _ in range(20):
        length.observe(16, 0.050, 15, 0, context=quote)
    assert length.choose(15, quote) == 0 and length.choose(15, short) > 0


def test_draft_length_stops_drafting_what_is_not_kept():
    length = DraftLength(8)
    assert length.choose(8) > 0  # a prior that drafting pays
    for _ in range(30):
        length.observe(1, 0.01, 0, 0)
        length.observe(5, 0.03, 4, 0)
    assert length.choose(8) == 0
    length = DraftLength(8, adaptive=False)
    assert length.choose(3) == 3 and length.choose(20) == 8


def _draft_file(tmp_path):
    """A draft model for the tiny qwen2: its vocabulary, other random weights, fewer layers."""
    spec = make_tiny_models.tiny_spec("qwen2")
    spec.seed, spec.n_layer = 5, 2
    draft_path = tmp_path / "draft.gguf"
    make_tiny_models.write_gguf(spec, draft_path)
    return draft_path


def test_draft_model_gives_the_plain_text(tiny_model, tmp_path):
    """A draft model of the same vocabulary (other random weights): greedy text unchanged; one of another
    vocabulary refused before loading, with the words that say what to do."""
    path, _, _ = tiny_model("qwen2")
    draft_path = _draft_file(tmp_path)
    model = cupyllm.load(path, device="cpu", ctx=96, progress=False, draft_model=draft_path,
                         spec={"type": "draft", "draft_p_min": 0.0, "adaptive": False, "draft_max": 4})
    plain = model.generate(PROMPT, max_tokens=30, temperature=0, spec=False)
    assert model.generate(PROMPT, max_tokens=30, temperature=0) == plain
    assert model.last_stats.draft.drafted > 0
    assert model.generate(PROMPT[:5], max_tokens=30, temperature=0) == \
        model.generate(PROMPT[:5], max_tokens=30, temperature=0, spec=False)  # the draft cache follows a new prompt
    with pytest.raises(InputError, match="another vocabulary"):
        cupyllm.load(path, device="cpu", ctx=96, progress=False, draft_model=tiny_model("gemma3")[0])
    with pytest.raises(InputError, match="needs a draft model"):
        cupyllm.load(path, device="cpu", ctx=96, progress=False, spec="draft")


def test_a_draft_models_file_is_read_once(tiny_model, tmp_path, monkeypatch):
    """load(draft_model=PATH) parses each file once: the draft's GGUF serves its vocabulary check, its kind and
    its weights. load() of an opened GGUFFile is load() of its path."""
    import cupyllm.api
    from cupyllm.files.gguf import read_gguf

    path, _, _ = tiny_model("qwen2")
    draft_path = _draft_file(tmp_path)
    reads = []
    monkeypatch.setattr(cupyllm.api, "read_gguf", lambda file: reads.append(Path(file)) or read_gguf(file))
    model = cupyllm.load(path, device="cpu", ctx=96, progress=False, draft_model=draft_path)
    assert sorted(reads) == sorted([Path(path), draft_path])
    assert model.draft.path == draft_path and model.draft.cfg.n_layer == 2
    opened = cupyllm.load(read_gguf(draft_path), device="cpu", ctx=96, progress=False)
    assert opened.path == draft_path
    np.testing.assert_array_equal(opened.logits(PROMPT), model.draft.logits(PROMPT))


@pytest.mark.parametrize("spec", [{"draft_max": 0}, {"type": "medusa"}, {"draft_min": 5, "draft_max": 2},
                                  {"ngram_size": 2, "ngram_min": 3}, {"draft_p_min": 1.5}, {"draft_maxx": 3}, 7])
def test_bad_spec_options_are_one_error(tiny_model, spec):
    model = _load(tiny_model, "qwen2")
    with pytest.raises(InputError, match="speculative|spec"):
        model.generate(PROMPT, max_tokens=2, spec=spec)


def test_cli_spec_flags(tiny_model):
    path, _, _ = tiny_model("qwen2")
    base = [sys.executable, "-m", "cupyllm.cli", "generate", "-m", str(path), "the cat sat on the mat and the cat",
            "-n", "24", "--temp", "0", "-c", "96"]
    plain = subprocess.run(base, capture_output=True, text=True, check=True)
    drafted = subprocess.run(base + ["--spec-type", "ngram", "--spec-ngram-min", "1", "--draft-max", "4"],
                             capture_output=True, text=True, check=True)
    assert drafted.stdout == plain.stdout
    assert "drafts:" in drafted.stderr and "drafts:" not in plain.stderr
    bad = subprocess.run(base + ["--spec-type", "draft"], capture_output=True, text=True)
    assert bad.returncode == 1 and "needs a draft model" in bad.stderr and "Traceback" not in bad.stderr


# --- the real models ---------------------------------------------------------------------------------------------

GROUNDED = ("Here is a list of fruits: apple, banana, cherry, damson, elderberry, fig, grape, honeydew. "
            "Repeat the list of fruits exactly: apple, banana,")


@pytest.mark.parametrize("options", [dict(kv_type_k="f16", kv_type_v="f16"), dict(kv_type_k="q8_0", kv_type_v="q8_0"),
                                     dict(kv_type_k="turbo3_tcq", kv_type_v="turbo3_tcq"),
                                     dict(dca={"chunk_size": 32, "local_size": 8})],
                         ids=["f16", "q8_0", "turbo3_tcq", "dca"])
@pytest.mark.parametrize("which", ["gemma", "qwen"])
def test_real_models_greedy_text_is_unchanged_by_drafting(which, options):
    """n-gram drafts on an input-grounded prompt (always drafting 6: many kept, many not), on both real models with
    f16, q8_0 and turbo3_tcq caches and with Dual Chunk Attention (32-token chunks: the prompt spans several)."""
    from models import gemma_path, qwen_path
    path = gemma_path() if which == "gemma" else qwen_path()
    model = cupyllm.load(path, device="cpu", ctx=256, progress=False, **options)
    plain = model.generate(GROUNDED, max_tokens=40, temperature=0)
    spec = SpecConfig(type="ngram", draft_max=6, ngram_min=1, adaptive=False)
    assert model.generate(GROUNDED, max_tokens=40, temperature=0, spec=spec) == plain
    stats = model.last_stats.draft
    assert stats.accepted > 0
