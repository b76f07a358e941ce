"""Qwen NextN (MTP) heads as a drafter (cupyllm/speculative/mtp.py): the engine's head against its NumPy
definition, the target's hidden rows handed over without changing its logits, greedy text unchanged with MTP
drafts on the three tiny hybrids under f16 and q8_0 caches, counters that count what the target kept, and one
clear error for a file without a head."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import cupyllm
import make_tiny_models
from gpu_helpers import GPU_TEST_MARKS
from cupyllm.errors import InputError
from cupyllm.speculative.mtp import MTPDrafter, mtp_config, mtp_forward, mtp_reference

ARCHES = ("qwen35", "qwen35-moe", "qwen3next")
PROMPT = [3, 17, 5, 9, 3, 17, 5, 11, 2, 8, 13, 21, 3, 17]
DRAFT_ALWAYS = {"type": "mtp", "draft_p_min": 0.0, "adaptive": False, "draft_max": 4}


def _mtp_models(folder, ssm_dim: int | None = None):
    """make(arch) -> (path, decoded float32 tensors), each written once into `folder`: the tiny hybrid with one
    NextN block (its eh_proj in Q8_0, so a quantized projection runs too); ssm_dim: its DeltaNet key and value
    head dims (None: the tiny models' own)."""
    made = {}

    def make(arch: str):
        if arch not in made:
            spec = make_tiny_models.tiny_spec(arch)
            if ssm_dim is not None:
                spec.ssm_k_dim = spec.ssm_v_dim = ssm_dim
            spec.n_nextn = 1
            spec.types = {**spec.types, "nextn.eh_proj.weight": T.Q8_0}
            path = folder / f"tiny-{arch}-mtp{'' if ssm_dim is None else f'-{ssm_dim}'}.gguf"
            made[arch] = (path, make_tiny_models.write_gguf(spec, path))
        return made[arch]

    return make


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """mtp_model(arch) -> (path, decoded float32 tensors): the tiny hybrid with one NextN block."""
    return _mtp_models(tmp_path_factory.mktemp("tiny_mtp"))


def _load(path, **options):
    options.setdefault("ctx", 96)
    options.setdefault("max_chunk", 8)
    return cupyllm.load(path, device="cpu", progress=False, **options)


def test_the_tiny_writer_adds_the_head_only_when_asked(tmp_path):
    """n_nextn=0 (the default: the files the stored references were made from) writes no head and no key; with
    it, block_count counts the head, nextn_predict_layers says so, and only the head's block is added."""
    plain, with_head = tmp_path / "plain.gguf", tmp_path / "head.gguf"
    make_tiny_models.write_gguf(make_tiny_models.tiny_spec("qwen35"), plain)
    spec = make_tiny_models.tiny_spec("qwen35")
    spec.n_nextn = 1
    make_tiny_models.write_gguf(spec, with_head)
    from cupyllm.files.gguf import read_gguf

    a, b = read_gguf(plain), read_gguf(with_head)
    assert a.get("qwen35.block_count") == 4 and "qwen35.nextn_predict_layers" not in a.metadata
    assert b.get("qwen35.block_count") == 5 and b.get("qwen35.nextn_predict_layers") == 1
    assert set(b.tensors) - set(a.tensors) == {n for n in b.tensors if n.startswith("blk.4.")}
    assert "blk.4.nextn.eh_proj.weight" in b.tensors and b.tensors["blk.4.nextn.eh_proj.weight"].shape == (64, 128)


@pytest.mark.parametrize("arch", ARCHES)
def test_the_engine_head_is_the_reference(mtp_model, arch):
    """mtp_forward (the backend's ops, the cache of its one layer, in chunks and then one chained row at a time)
    against mtp_reference over the same rows: the target's hidden rows of the prompt with the tokens after them,
    then rows chained on the head's own output."""
    path, decoded = mtp_model(arch)
    model = _load(path)
    target, cfg = model.transformer, model.transformer.cfg
    drafter = MTPDrafter.for_model(model)
    rows = []
    cache = model.new_cache()
    target.forward(np.array(PROMPT), np.arange(len(PROMPT)), cache, on_hidden=rows.append)
    hidden = np.asarray(rows[0], np.float32)
    next_tokens = PROMPT[1:] + [7]
    outs = []
    for start in range(0, len(next_tokens), 5):  # (chunks of 5 rows, as a prefill of the head's cache)
        stop = min(start + 5, len(next_tokens))
        outs.append(mtp_forward(target.ops, cfg, drafter.w, target.token_embd, np.array(next_tokens[start:stop]),
                                hidden[start:stop], np.arange(start, stop), drafter.cache))
        drafter.cache.n_past = stop
    chained_tokens = [11, 2, 40]
    for i, token in enumerate(chained_tokens):  # (one row at a time on the head's own last output)
        position = len(next_tokens) + i
        outs.append(mtp_forward(target.ops, cfg, drafter.w, target.token_embd, np.array([token]), outs[-1][-1:],
                                np.array([position]), drafter.cache))
        drafter.cache.n_past = position + 1
    got = np.concatenate([np.asarray(o, np.float32) for o in outs])
    got_logits = np.asarray(target.ops.linear(got, target.output), np.float32)
    inputs = np.concatenate([hidden, got[len(next_tokens) - 1:-1]])  # the chained rows read the head's output
    want, want_logits = mtp_reference(decoded, cfg, cfg.n_layer, next_tokens + chained_tokens, inputs)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=2e-3 * np.abs(want_logits).max())


@pytest.mark.parametrize("arch", ARCHES)
def test_the_target_hands_over_its_hidden_rows_unchanged(mtp_model, arch):
    """forward(on_hidden=...) gives the logits forward gives without it, bit for bit, and the rows it hands
    over are Transformer.hidden's (what the logits are taken from)."""
    path, _ = mtp_model(arch)
    model = _load(path)
    target = model.transformer
    ids, positions = np.array(PROMPT), np.arange(len(PROMPT))
    plain = np.asarray(target.forward(ids, positions, model.new_cache(), all_logits=True))
    rows = []
    seen = np.asarray(target.forward(ids, positions, model.new_cache(), all_logits=True, on_hidden=rows.append))
    assert np.array_equal(plain, seen)
    assert np.array_equal(np.asarray(rows[0]), np.asarray(target.hidden(ids, positions, model.new_cache())))
    assert np.array_equal(np.asarray(target.logits(rows[0])), plain)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "turbo3_tcq"])
@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_text_is_unchanged_with_mtp_drafts(mtp_model, arch, kv_type):
    """The same tokens with the head drafting 4 a step (every draft checked: no adaptive length, no p_min) as
    without, the held ids and (to rounding, as tests/test_speculative.py) the logits after them; the counters
    move. The head's cache takes the target's KV types (a rotated, trellis-coded one too)."""
    path, _ = mtp_model(arch)
    model = _load(path, kv_type_k=kv_type, kv_type_v=kv_type)
    plain = model.generate(PROMPT, max_tokens=40, temperature=0, keep_cache=True)
    plain_cache = model.last_prompt_cache
    drafted = model.generate(PROMPT, max_tokens=40, temperature=0, keep_cache=True, spec=DRAFT_ALWAYS)
    stats = model.last_stats.draft
    assert drafted == plain
    assert model.last_prompt_cache.ids == plain_cache.ids
    want = plain_cache.logits  # (a verify forward's sums of quantized K/V and recurrent runs round otherwise)
    np.testing.assert_allclose(model.last_prompt_cache.logits, want, rtol=0, atol=2e-3 * np.abs(want).max())
    assert stats.drafted > 0 and stats.forwards > 0 and stats.by_position[0][0] > 0
    assert stats.emitted + 1 == model.last_stats.generated_tokens


@pytest.mark.parametrize("arch", ARCHES)
def test_the_counters_count_what_the_target_kept(mtp_model, arch):
    """Each step's drafts, recorded, checked afterwards against the target's own greedy tokens after the same
    history and drafts (one fresh forward of them): the kept counts and drafted counts are those."""
    path, _ = mtp_model(arch)
    model = _load(path)
    model.generate(PROMPT, max_tokens=1, temperature=0, spec=DRAFT_ALWAYS)  # (makes the model's drafter)
    drafter = model._model_drafters["mtp"]
    calls = []
    draft = drafter.draft

    def recording(history, n_max):
        out = draft(history, n_max)
        calls.append((list(history), list(out)))
        return out

    drafter.draft = recording
    model.generate(PROMPT, max_tokens=40, temperature=0, spec=DRAFT_ALWAYS)
    stats = model.last_stats.draft
    assert calls and stats.drafted == sum(len(out) for _, out in calls)
    kept = []
    for history, out in calls:
        greedy = np.argmax(model.logits(history + out), axis=-1)[len(history) - 1:]
        matches = np.asarray(out) == greedy[:len(out)]
        kept.append(len(out) if matches.all() else int(np.argmin(matches)))
    assert stats.accepted == sum(kept)
    assert [a for _, a in stats.by_position] == [sum(k > j for k in kept) for j in range(len(stats.by_position))]


def test_a_file_without_a_head_is_one_clear_error(tiny_model, mtp_model):
    path, _, _ = tiny_model("qwen35")
    with pytest.raises(InputError, match="no NextN"):
        _load(path, spec="mtp")
    model = _load(path)
    with pytest.raises(InputError, match="no NextN"):
        model.generate(PROMPT, max_tokens=4, spec="mtp")
    qwen3, _, _ = tiny_model("qwen3")
    with pytest.raises(InputError, match="--spec-type ngram"):
        _load(qwen3, spec={"type": "mtp"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the head's tensors are not reported as unused)
        assert _load(mtp_model("qwen35")[0], spec="mtp").spec.type == "mtp"


def test_mtp_config_is_one_full_attention_layer(mtp_model):
    model = _load(mtp_model("qwen35")[0])
    cfg = mtp_config(model.cfg)
    assert cfg.n_layer == 1 and not cfg.is_recurrent(0) and cfg.head_dim == model.cfg.head_dim


def test_reading_the_config_leaves_the_file_as_it_is(mtp_model):
    """config_from_gguf read twice from one GGUFFile: its tensors (the same objects, in the same order) and the
    ones it set aside are as read_gguf left them, both readings agree, and the NextN block is counted apart from
    the decoder's layers (block_count counts it)."""
    from cupyllm.files.config import config_from_gguf
    from cupyllm.files.gguf import read_gguf

    gguf = read_gguf(mtp_model("qwen35")[0])
    tensors, unused = list(gguf.tensors.items()), list(gguf.unused_tensors.items())
    snapshot = lambda items: [(name, id(info)) for name, info in items]  # noqa: E731
    configs = []
    for _ in range(2):
        configs.append(config_from_gguf(gguf))
        assert snapshot(gguf.tensors.items()) == snapshot(tensors)
        assert snapshot(gguf.unused_tensors.items()) == snapshot(unused)
    assert configs[0] == configs[1]
    block_count = gguf.get("qwen35.block_count")
    assert configs[0].n_layer == block_count - 1 and list(configs[0].nextn_layers) == [block_count - 1]
    head = [name for name in gguf.tensors if name.startswith(f"blk.{block_count - 1}.")]
    assert head and all(configs[0].is_nextn_tensor(name) for name in head)
    assert not any(configs[0].is_nextn_tensor(name) for name in gguf.tensors if name not in head)


def test_the_report_counts_the_decoder_without_the_head(mtp_model, tiny_model):
    """`cupyllm info` of a file with a head gives the parameters and tensor types of the same file without it."""
    from cupyllm.report import model_report

    def counts(path):
        return [line for line in model_report(path, ctx=96).splitlines()
                if line.startswith(("parameters", "tensor types", "layers"))]

    assert counts(mtp_model("qwen35")[0]) == counts(tiny_model("qwen35")[0])


def test_cli_spec_type_mtp(mtp_model, tiny_model):
    """--spec-type mtp: the same text, the summary's draft counts; a file without a head: one error line."""
    import subprocess
    import sys

    path, _ = mtp_model("qwen35")
    base = [sys.executable, "-m", "cupyllm.cli", "generate", "-m", str(path), "the cat sat on the mat and the cat",
            "-n", "16", "--temp", "0", "-c", "96"]
    plain = subprocess.run(base, capture_output=True, text=True, check=True)
    drafted = subprocess.run(base + ["--spec-type", "mtp", "--draft-p-min", "0", "--draft-fixed", "--draft-max", "3"],
                             capture_output=True, text=True, check=True)
    assert drafted.stdout == plain.stdout
    assert "drafts:" in drafted.stderr and "drafts:" not in plain.stderr
    base[5] = str(tiny_model("qwen35")[0])
    bad = subprocess.run(base + ["--spec-type", "mtp"], capture_output=True, text=True)
    assert bad.returncode == 1 and "no NextN (MTP) head" in bad.stderr and "Traceback" not in bad.stderr


# --- the GPU backend (a CUDA device, or the emulator: CUPYLLM_EMULATE=1 python -m pytest -m gpu ...) -------------

@pytest.fixture(scope="module")
def gpu_mtp_model(tmp_path_factory):
    """gpu_mtp_model(arch) -> (path, decoded): the tiny hybrid with its head and DeltaNet head dims of 32 (the
    tiny models' 16 is below what the GPU kernels take: tests/test_gpu_backend.py hybrid_models)."""
    return _mtp_models(tmp_path_factory.mktemp("tiny_mtp_gpu"), ssm_dim=32)


def on_the_gpu(test):
    """gpu_helpers.GPU_TEST_MARKS on one test: selected by -m gpu, skipped without a device."""
    for mark in GPU_TEST_MARKS:
        test = mark(test)
    return test


@on_the_gpu
@pytest.mark.parametrize("arch", ARCHES)
def test_the_gpu_head_is_the_reference(gpu_mtp_model, arch):
    """mtp_forward on the GPU backend's ops against the definition (f16-rounded GEMM inputs: 5e-3 of the
    largest value, as tests/test_gpu_backend.py's prefill tolerance)."""
    path, decoded = gpu_mtp_model(arch)
    model = cupyllm.load(path, device="gpu", ctx=96, max_chunk=8, progress=False)
    target, cfg = model.transformer, model.transformer.cfg
    drafter = MTPDrafter.for_model(model)
    rows = []
    target.forward(np.array(PROMPT), np.arange(len(PROMPT)), model.new_cache(), on_hidden=rows.append)
    hidden = target.ops.to_numpy(rows[0])
    next_tokens = PROMPT[1:] + [7]
    out = mtp_forward(target.ops, cfg, drafter.w, target.token_embd, np.array(next_tokens),
                      target.ops.asarray(hidden), np.arange(len(next_tokens)), drafter.cache)
    got = np.asarray(target.ops.to_numpy(out), np.float32)
    want, _ = mtp_reference(decoded, cfg, cfg.n_layer, next_tokens, hidden)
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-3 * np.abs(want).max())


@on_the_gpu
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_gpu_greedy_text_is_unchanged_with_mtp_drafts(gpu_mtp_model, kv_type):
    """The head drafting on the GPU backend (its cache a device cache): the plain greedy text."""
    path, _ = gpu_mtp_model("qwen35")
    model = cupyllm.load(path, device="gpu", ctx=96, max_chunk=8, progress=False, kv_type_k=kv_type,
                         kv_type_v=kv_type)
    plain = model.generate(PROMPT, max_tokens=24, temperature=0)
    assert model.generate(PROMPT, max_tokens=24, temperature=0, spec=DRAFT_ALWAYS) == plain
    assert model.last_stats.draft.drafted > 0


def test_server_slots_draft_with_the_head(mtp_model):
    """`cupyllm serve` with spec mtp: each slot keeps a head cache of its own and runs its target forwards
    alone (they hand over hidden rows); two concurrent requests get Model.generate's texts, which are the plain
    greedy ones, and the drafting counters move."""
    from concurrent.futures import ThreadPoolExecutor

    server = pytest.importorskip("test_server")  # (its loopback harness; skipped without the serve extra)
    model = _load(mtp_model("qwen35")[0], spec=DRAFT_ALWAYS)
    prompts = ["the cat sat on the mat", "one two one two"]
    want = [model.generate(p, max_tokens=16, temperature=0, spec=False) for p in prompts]
    assert want == [model.generate(p, max_tokens=16, temperature=0) for p in prompts]
    with server.serving(model, parallel=2) as url:
        c = server.client(url)
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: c.completions.create(model="m", prompt=p, max_tokens=16, temperature=0)
                                .choices[0].text, prompts))
        assert got == want
        assert server.metric(url, "draft_tokens_total") > 0


def test_drafting_after_a_prompt_cache(mtp_model):
    """A prompt cache's positions have no hidden rows: the head starts at the first position it sees, and the
    text is still the plain one."""
    model = _load(mtp_model("qwen35")[0])
    prefix, tail = PROMPT, [7, 8, 9]
    plain = model.generate(prefix + tail, max_tokens=12, temperature=0)
    cached = model.cache_prompt(prefix)
    assert model.generate(prefix + tail, max_tokens=12, temperature=0, prompt_cache=cached,
                          spec=DRAFT_ALWAYS) == plain
    assert model.last_stats.cached_tokens == len(prefix) and model.last_stats.draft.drafted > 0
    drafter = model._model_drafters["mtp"]
    assert drafter.base == len(prefix)  # (head position 0 is the first target position with a hidden row)


@pytest.mark.parametrize("arch", ARCHES)
def test_the_head_cache_holds_only_what_the_target_kept(mtp_model, arch):
    """After a generation with drafts (many rejected), the head's cache cut where the next step cuts it holds
    the rows of a head that only ever saw the kept tokens: K and V against a fresh head run over a fresh
    prefill's hidden rows of the same tokens (to the rounding of other batchings), positions alike. (Each step
    ran its chained drafts into the cache; a row of one left behind would sit where a kept token's belongs.)"""
    path, _ = mtp_model(arch)
    model = _load(path)
    model.generate(PROMPT, max_tokens=30, temperature=0, keep_cache=True, spec=DRAFT_ALWAYS)
    held = list(model.last_prompt_cache.ids)
    drafter = model._model_drafters["mtp"]
    assert model.last_stats.draft.drafted > model.last_stats.draft.accepted  # (rejected drafts were run)
    assert drafter.base == 0 and len(PROMPT) < drafter.done <= len(held)
    done = drafter.done
    assert drafter.cache.n_past >= done  # (and the last step's chained rows, when it chained any)
    drafter.cache.truncate(done)
    target, cfg = model.transformer, model.transformer.cfg
    rows = []
    target.forward(np.array(held[:done]), np.arange(done), model.new_cache(), on_hidden=rows.append)
    fresh = target.ops.new_cache(mtp_config(cfg), drafter.cache.spec)
    mtp_forward(target.ops, cfg, drafter.w, target.token_embd, np.array(held[1:done + 1]), rows[0],
                np.arange(done), fresh)
    fresh.n_past = done
    got_k, got_v, got_pos = drafter.cache.layers[0].decode(0, done)
    want_k, want_v, want_pos = fresh.layers[0].decode(0, done)
    np.testing.assert_array_equal(got_pos, want_pos)
    np.testing.assert_allclose(got_k, want_k, rtol=0, atol=2e-3 * np.abs(want_k).max())
    np.testing.assert_allclose(got_v, want_v, rtol=0, atol=2e-3 * np.abs(want_v).max())
