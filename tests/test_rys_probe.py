"""`cupyllm rys-probe` (cupyllm/rys_probe.py): its scores and ranking on a tiny model equal a brute-force
recomputation that loads every plan afresh and scores it with NumPy; its flags fail cleanly."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import cupyllm
from cupyllm.errors import InputError
from cupyllm.rys_probe import Battery, Task, band_and_widths, candidate_plans, default_battery, probe

import make_tiny_models

# answers a tiny random model sometimes gives: single characters of its vocabulary
BATTERY = Battery(tuple(Task(kind, prompt, answer) for kind, prompt, answer in (
    ("arithmetic", "1 + 1 =", "2"), ("arithmetic", "3 + 4 =", "7"), ("facts", "The sky is", "e"),
    ("facts", "Grass is", "a"), ("code", "def f(x):\n    return", "x"), ("code", "import", "o"))), max_tokens=6)
CORPUS = "The quick brown fox jumps over the lazy dog. " * 3 + "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    path = tmp_path_factory.mktemp("rys") / "tiny-qwen3-6.gguf"
    make_tiny_models.write_gguf(make_tiny_models.TinySpec("qwen3", n_layer=6), path)
    return path


def _numpy_nll(model, ids) -> float:
    """Mean -log p(next token) from the full logits of one prefill, in float64."""
    logits = model.logits(ids).astype(np.float64)[:-1]
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return float(np.mean(log_z - logits[np.arange(len(ids) - 1), ids[1:]]))


def test_probe_matches_a_brute_force_recomputation(six_layers):
    model = cupyllm.load(six_layers, device="cpu", ctx=512, progress=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="repeat_layers")
        result = probe(model, band=(1, 4), widths=(1, 2), corpus=CORPUS, battery=BATTERY, progress=False)
        ids = model.tokenize(CORPUS)
        brute = {}
        for plan in ["", *("%d,%d" % blocks[0] for blocks in candidate_plans((1, 4), (1, 2)))]:
            fresh = cupyllm.load(six_layers, device="cpu", ctx=512, progress=False, repeat_layers=plan)
            passed = sum(task.answer in fresh.generate(task.prompt, max_tokens=6, temperature=0, stop=["\n"])
                         for task in BATTERY.tasks)
            brute[plan] = (_numpy_nll(fresh, ids), passed)
    assert result.corpus_tokens == len(ids) and len(result.candidates) == 3 + 2
    for score in [result.base, *result.candidates]:
        nll, passed = brute[score.plan]
        assert score.nll == pytest.approx(nll, rel=1e-5), score.plan
        assert score.passed == passed, score.plan
    base_nll, base_passed = brute[""]
    kept = sorted((p for p in brute if p and brute[p][1] >= base_passed), key=lambda p: (brute[p][0], p))
    assert [c.plan for c in result.ranked()] == kept
    gains = {p: np.exp(base_nll) - np.exp(brute[p][0]) for p in kept}
    added = {p: int(p.split(",")[1]) - int(p.split(",")[0]) for p in kept}
    gaining = [p for p in kept if gains[p] > 0]
    best = result.largest_gain()
    assert (best.plan if best else None) == (max(gaining, key=gains.get) if gaining else None)
    efficient = result.most_efficient()
    assert (efficient.plan if efficient else None) == \
        (max(gaining, key=lambda p: gains[p] / added[p]) if gaining else None)


def test_token_nll_is_the_log_softmax_of_the_logits(six_layers):
    model = cupyllm.load(six_layers, device="cpu", ctx=512, progress=False)
    ids = model.tokenize(CORPUS)
    for chunk in (3, 64):
        assert model.token_nll(ids, chunk=chunk).mean() == pytest.approx(_numpy_nll(model, ids), rel=1e-5)
    with pytest.raises(InputError, match="two token ids"):
        model.token_nll(ids[:1])


def test_cli_writes_the_table_and_json(six_layers, tmp_path, capsys):
    from cupyllm.cli import main

    out, corpus = tmp_path / "probe.json", tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    assert main(["rys-probe", str(six_layers), "-c", "512", "--band", "2,4", "--widths", "1", "--corpus",
                 str(corpus), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [c["plan"] for c in data["ranked"] + data["dropped"]] and data["n_tasks"] == len(default_battery().tasks)
    assert {c["plan"] for c in data["ranked"] + data["dropped"]} == {"2,3", "3,4"}
    assert "most efficient:" in capsys.readouterr().out


@pytest.mark.parametrize("flags, words", [
    (["--band", "4,2"], "--band"), (["--band", "0,7"], "--band"), (["--band", "x"], "--band"),
    (["--widths", "0"], "--widths"), (["--widths", "5", "--band", "2,4"], "--widths"), (["--top-k", "0"], "--top-k"),
    (["--corpus", "/nonexistent/corpus.txt"], "cannot read the corpus"), (["-c", "16"], "corpus has"),
])
def test_bad_flags_are_one_clear_error(flags, words, six_layers, capsys):
    from cupyllm.cli import main

    assert main(["rys-probe", str(six_layers), *flags]) == 1
    assert words in capsys.readouterr().err


def test_auto_band_and_widths():
    assert band_and_widths(18) == ((3, 15), (1, 2, 4))
    assert band_and_widths(24) == ((3, 21), (1, 2, 4, 8))
    assert band_and_widths(80) == ((10, 70), (1, 2, 4, 8, 16))
    assert band_and_widths(4) == ((0, 4), (1, 2))
