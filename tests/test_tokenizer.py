"""Tokenizer and chat prompts against llama.cpp.

The golden file (tools/make_tokenizer_golden.py) holds llama.cpp's ids, detokenized text, token
pieces and end-of-generation ids for a varied corpus on both real models; every check here compares
our tokenizer with those. Chat templates are compared with the documented turn formats.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cupyllm.files.chat import encode_chat, needs_bos, render_chat
from cupyllm.errors import CupyllmError, ModelFileError
from cupyllm.files.gguf import read_gguf
from cupyllm.files.tokenizer import Tokenizer

try:  # tests/ may or may not be a package
    from .models import gemma_path, qwen_path
except ImportError:
    from models import gemma_path, qwen_path

pytestmark = pytest.mark.slow  # loads the real models

GOLDEN = json.loads((Path(__file__).parent / "data" / "tokenizer_golden.json").read_text(encoding="utf-8"))
CORPUS = GOLDEN["corpus"]
MODEL_PATHS = {"gemma": gemma_path, "qwen": qwen_path}


def _expand(gold: dict) -> list[dict]:
    """The golden cases with their nulls ("the obvious value", see the generator) filled in."""
    bos_text = bytes.fromhex(gold["pieces"][str(gold["bos"])][0]).decode() if gold["add_bos"] else ""
    cases = []
    for text, case in zip(CORPUS, gold["cases"]):
        ids = case["ids"]
        no_bos = case["ids_no_bos"]
        if no_bos is None:
            no_bos = ids[1:] if gold["add_bos"] else ids
        cases.append({
            "text": text, "ids": ids, "ids_no_bos": no_bos,
            "ids_no_parse": case["ids_no_parse"] if case["ids_no_parse"] is not None else no_bos,
            "detok_special": case["detok_special"] if case["detok_special"] is not None else bos_text + text,
            "detok_plain": case["detok_plain"] if case["detok_plain"] is not None else text,
        })
    return cases


@pytest.fixture(scope="module", params=["gemma", "qwen"])
def model(request):
    """(name, metadata, tokenizer, golden) for one real model."""
    name = request.param
    metadata = read_gguf(MODEL_PATHS[name]()).metadata
    gold = dict(GOLDEN["models"][name], cases=_expand(GOLDEN["models"][name]))
    return name, metadata, Tokenizer.from_metadata(metadata), gold


@pytest.fixture(scope="module")
def gemma():
    metadata = read_gguf(gemma_path()).metadata
    return metadata, Tokenizer.from_metadata(metadata)


@pytest.fixture(scope="module")
def qwen():
    metadata = read_gguf(qwen_path()).metadata
    return metadata, Tokenizer.from_metadata(metadata)


def _show(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.tokens[i] for i in ids]


# -- ids ---------------------------------------------------------------------------------------------


def test_vocab_facts_match_llama_cpp(model):
    _, _, tok, gold = model
    assert tok.n_vocab == gold["n_vocab"]
    assert (tok.bos_id, tok.eos_id, tok.eot_id) == (gold["bos"], gold["eos"], gold["eot"])
    assert (tok.add_bos, tok.add_eos) == (gold["add_bos"], gold["add_eos"])
    assert sorted(tok.eog_ids) == gold["eog"]


@pytest.mark.parametrize("kind", ["ids", "ids_no_bos", "ids_no_parse"])
def test_ids_match_llama_cpp(model, kind):
    _, _, tok, gold = model
    kwargs = {"ids": {}, "ids_no_bos": {"add_bos": False, "add_eos": False},
              "ids_no_parse": {"add_bos": False, "add_eos": False, "parse_special": False}}[kind]
    mismatches = []
    for i, case in enumerate(gold["cases"]):
        text = case["text"]
        ours = tok.encode(text, **kwargs)
        if ours != case[kind]:
            mismatches.append(f"#{i} {text[:60]!r}:\n  ours  {_show(tok, ours)[:40]}\n"
                              f"  llama {_show(tok, case[kind])[:40]}")
    assert not mismatches, "\n".join(mismatches)


def test_fresh_tokenizer_gives_same_ids_in_any_order(model):
    # word memos must not leak state between strings: encode the corpus backwards on a new tokenizer
    _, metadata, _, gold = model
    tok = Tokenizer.from_metadata(metadata)
    for case in reversed(gold["cases"]):
        assert tok.encode(case["text"]) == case["ids"], case["text"][:60]


# -- decoding ----------------------------------------------------------------------------------------


def test_decode_matches_llama_cpp_detokenize(model):
    _, _, tok, gold = model
    for case in gold["cases"]:
        assert tok.decode(case["ids"]) == case["detok_special"], case["text"][:60]
        assert tok.decode(case["ids"], skip_special=True) == case["detok_plain"], case["text"][:60]


def test_token_bytes_match_llama_cpp_pieces(model):
    _, _, tok, gold = model
    for tid, (with_special, plain) in gold["pieces"].items():
        assert tok.token_bytes(int(tid)).hex() == with_special, (tid, tok.tokens[int(tid)])
        assert tok.token_bytes(int(tid), special=False).hex() == plain, (tid, tok.tokens[int(tid)])


def test_roundtrip_of_special_free_text(model):
    _, _, tok, _ = model
    for text in CORPUS:
        if "<" in text or (tok.model == "llama" and "\u2581" in text):  # SPM reads U+2581 as a space
            continue
        assert tok.decode(tok.encode(text), skip_special=True) == text


def _byte_token_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One token per byte: SPM's <0xXX> tokens, or byte-level BPE's single mapped characters."""
    if tok.model == "llama":
        return [tok.token_to_id(f"<0x{b:02X}>") for b in data]
    from cupyllm.files.tokenizer import _BYTE_TO_CHAR
    return [tok.token_to_id(_BYTE_TO_CHAR[b]) for b in data]


@pytest.mark.parametrize("text", ["é😀中 👨‍👩‍👧 🇺🇸", "abc\U0010FFFD\u0301x"])
def test_stream_decoder_holds_back_split_characters(model, text):
    _, _, tok, _ = model
    ids = _byte_token_ids(tok, text.encode("utf-8"))
    assert None not in ids
    dec = tok.stream_decoder()
    chunks = [dec.feed(t) for t in ids] + [dec.flush()]
    assert "".join(chunks) == tok.decode(ids) == text
    assert all("\ufffd" not in c for c in chunks)
    # a 4-byte emoji emits nothing until its last byte arrives
    start = text.encode("utf-8").find("😀".encode("utf-8"))
    if start >= 0:
        assert chunks[start:start + 3] == ["", "", ""] and chunks[start + 3] == "😀"


def test_stream_decoder_matches_decode_on_corpus(model):
    _, _, tok, gold = model
    for case in gold["cases"]:
        dec = tok.stream_decoder(skip_special=True)
        streamed = "".join(dec.feed(t) for t in case["ids"]) + dec.flush()
        assert streamed == case["detok_plain"]


def test_stream_decoder_flushes_incomplete_tail(gemma):
    _, tok = gemma
    ids = _byte_token_ids(tok, "😀".encode("utf-8")[:2])
    dec = tok.stream_decoder()
    assert [dec.feed(t) for t in ids] == ["", ""]
    assert dec.flush() == tok.decode(ids) == "\ufffd"


# -- errors ------------------------------------------------------------------------------------------


def test_unknown_tokenizer_model_is_a_clear_error(qwen):
    metadata, _ = qwen
    with pytest.raises(ModelFileError, match="'llama'.*'gpt2'"):
        Tokenizer.from_metadata({**metadata, "tokenizer.ggml.model": "t5"})


def test_unknown_pre_tokenizer_is_a_clear_error(qwen):
    metadata, _ = qwen
    with pytest.raises(ModelFileError, match="qwen2.*supported.*llama3"):
        Tokenizer.from_metadata({**metadata, "tokenizer.ggml.pre": "qwen2-but-not-really"})


def test_out_of_range_id_is_a_clear_error(gemma):
    _, tok = gemma
    with pytest.raises(CupyllmError, match="outside the vocabulary"):
        tok.decode([tok.n_vocab])


# -- chat templates ----------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Capital of France?"},
]


def test_qwen_template_renders_chatml(qwen):
    metadata, tok = qwen
    text = render_chat(metadata, CONVERSATION)
    assert text == ("<|im_start|>system\nYou answer in one word.<|im_end|>\n"
                    "<|im_start|>user\nCapital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_system = render_chat(metadata, CONVERSATION[1:], add_generation_prompt=False)
    assert no_system == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                         "assistant.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n")
    ids = encode_chat(tok, metadata, CONVERSATION)
    assert ids == tok.encode(text)  # Qwen adds no BOS
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(tok.token_to_id("<|im_end|>")) == 2


def test_gemma_builtin_template(gemma):
    metadata, tok = gemma
    assert not metadata.get("tokenizer.chat_template")
    turns = CONVERSATION + [{"role": "assistant", "content": "Paris."},
                            {"role": "user", "content": "Germany?"}]
    text = render_chat(metadata, turns)
    assert text == ("<bos><start_of_turn>user\nYou answer in one word.\n\nCapital of France?<end_of_turn>\n"
                    "<start_of_turn>model\nParis.<end_of_turn>\n"
                    "<start_of_turn>user\nGermany?<end_of_turn>\n"
                    "<start_of_turn>model\n")
    assert not needs_bos(tok, text)
    ids = encode_chat(tok, metadata, turns)
    assert ids == tok.encode(text, add_bos=False)
    assert ids[:2] == [tok.bos_id, tok.token_to_id("<start_of_turn>")] and ids.count(tok.bos_id) == 1
    with pytest.raises(CupyllmError, match="alternate"):
        render_chat(metadata, [{"role": "assistant", "content": "hi"}])


def test_needs_bos_when_template_omits_it(gemma):
    _, tok = gemma
    assert needs_bos(tok, "<start_of_turn>user\nhi<end_of_turn>\n")
    assert not needs_bos(tok, "<bos><start_of_turn>user\n")


def test_template_string_with_hf_helpers():
    template = ("{% for m in messages %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
                "{% if loop.last %}{% break %}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ raise_exception('stop: ' + bos_token) }}{% endif %}")
    messages = [{"role": "user", "content": "héllo"}, {"role": "user", "content": "x"}]
    assert render_chat(template, messages, add_generation_prompt=False) == '"héllo""x"'
    with pytest.raises(CupyllmError, match="stop: <s>"):
        render_chat(template, messages, bos_token="<s>")


# ---- Gemma 4: BPE over characters ------------------------------------------------------------------------

def test_gemma4_ids_match_hf_tokenizers(tiny_model):
    """HF `tokenizers`' ids of the texts, with the same vocabulary and the components a Gemma 4 tokenizer.json
    names (tools/make_hf_tiny_reference.py stores them; test_forward_tiny.py recomputes them where installed)."""
    import make_hf_tiny_reference as hf_reference
    import make_tiny_models
    path, _, _ = tiny_model("gemma4")
    ours = Tokenizer.from_gguf(path)
    tokens, _, _ = make_tiny_models.gemma4_vocab()
    stored = np.load(hf_reference.OUT)
    assert ours.add_bos and ours.bos_id == tokens.index("<bos>")
    for i, text in enumerate(hf_reference.GEMMA4_TEXTS):
        want = stored[f"gemma4_tokenizer_ids_{i}"].tolist()
        assert ours.encode(text, add_bos=False) == want, text
        assert ours.decode(want) == text, text  # U+2581 back to spaces, byte tokens back to bytes
    assert ours.encode("the", add_bos=True)[0] == ours.bos_id
    assert ours.is_eog(tokens.index("<turn|>"))


def test_gemma4_ids_match_llama_cpp(tiny_model):
    """llama.cpp's ids for the tiny Gemma 4 vocabulary (stored by tools/make_llama_cpp_reference.py)."""
    import make_llama_cpp_reference as reference
    stored = np.load(reference.OUT)
    ours = Tokenizer.from_gguf(tiny_model("gemma4")[0])
    ids, offsets = stored["gemma4_text_ids"].tolist(), stored["gemma4_text_offsets"]
    texts = reference.TOKENIZER_TEXTS + reference.fuzz_texts()
    assert len(offsets) == len(texts) + 1
    for i, text in enumerate(texts):
        assert ours.encode(text, add_bos=False) == ids[offsets[i]:offsets[i + 1]], text


def test_gemma4_random_strings_match_hf_tokenizers(tiny_model):
    import make_hf_tiny_reference as hf_reference
    stored = np.load(hf_reference.OUT)
    ours = Tokenizer.from_gguf(tiny_model("gemma4")[0])
    ids, offsets = stored["gemma4_fuzz_ids"].tolist(), stored["gemma4_fuzz_offsets"]
    texts = hf_reference.gemma4_fuzz_texts()
    assert len(offsets) == len(texts) + 1
    for i, text in enumerate(texts):
        assert ours.encode(text, add_bos=False) == ids[offsets[i]:offsets[i + 1]], text
