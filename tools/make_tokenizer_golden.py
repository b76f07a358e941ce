"""Write tests/data/tokenizer_golden.json: llama.cpp's tokenization of a fixed corpus, for both models.

Run with the llama-cpp-python environment (not the project venv), e.g.
    /work/llvenv/bin/python tools/make_tokenizer_golden.py --gemma G.gguf --qwen Q.gguf

Per corpus string and model it records llama_tokenize with (add_special, parse_special) =
(True, True), (False, True) and (False, False), and llama_detokenize of the first with
(remove_special, unparse_special) = (False, True) and (True, False); a value equal to the obvious
one (the ids less the added BOS, the parse_special ids, the text itself, after the BOS text when a
BOS is added) is stored as null. Per model it records the vocab
facts (BOS/EOS/EOT ids, add_bos/add_eos, every end-of-generation id) and token_to_piece bytes of a
sample of ids. The corpus lives here, so the golden file can be regenerated from scratch.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import random
from pathlib import Path

import llama_cpp
from llama_cpp import Llama

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "tokenizer_golden.json"


def _random_text(seed: int, n: int) -> str:
    """Characters from every class the pre-tokenizers distinguish, in random runs."""
    rng = random.Random(seed)
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789", "٠١٢٣٤٥", "½Ⅻ²",
        " ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000",
        ".,;:!?'\"-_()[]{}<>/\\|@#$%^&*+=~`",
        "'s", "'t", "'re", "'LL", "'D",
        "éèêëàâäôöûüçñÅØß", "e\u0301", "ك\u064e",
        "中文字符测试日本語ひらがなカタカナ한국어",
        "😀🎉👍🏽🇫🇷❤️\u200d",
        "\x00\x07\x1b\x7f\x1c\u200b\ufeff",
        "▁", "<start_of_turn>", "<|im_end|>", "<b>", "</s>",
    ]
    out = []
    while sum(map(len, out)) < n:
        pool = rng.choice(pools)
        if len(pool) > 6 and pool.isprintable() and not pool.startswith("<"):
            out.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
        else:
            out.append(pool)
    return "".join(out)


def _long_document(seed: int, n: int) -> str:
    """A long mixed document (prose, code, lists, CJK, chat markers) for whole-document checks."""
    rng = random.Random(seed)
    words = ("the of and a to in is was that for it with as on be at by this had not are but from "
             "tokenizer model context window attention cache layer kernel GPU memory token "
             "naïve café 東京 数据 😀 3.14 2024 x_1 foo() bar[i] it's don't").split()
    parts = []
    while sum(map(len, parts)) < n:
        kind = rng.random()
        if kind < 0.6:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 18)))
            parts.append(sentence[0].upper() + sentence[1:] + rng.choice([". ", "? ", "! ", ", ", ".\n\n"]))
        elif kind < 0.8:
            indent = " " * rng.choice([0, 2, 4, 8])
            name, factor = rng.randint(0, 99), rng.randint(0, 9)
            parts.append(f"\n{indent}def f{name}(x):\n{indent}    return x * {factor}\n")
        elif kind < 0.9:
            parts.append("\n- " + " ".join(rng.choice(words) for _ in range(5)) + "\n")
        else:
            parts.append(rng.choice(["<start_of_turn>model\n", "<end_of_turn>\n", "<|im_start|>user\n",
                                     "<|im_end|>\n", "\t\t", "\n\n\n"]))
    return "".join(parts)


CODE = '''import os


class Cache:
    """A tiny LRU cache."""

    def __init__(self, size: int = 128) -> None:
        self.size = size
        self._data: dict[str, bytes] = {}

    def get(self, key):
        if key not in self._data:
            return None
        value = self._data.pop(key)
        self._data[key] = value  # move to the end
        return value
'''

CORPUS = [
    "",
    "Hello world",
    " Hello world",
    "   leading spaces and trailing   ",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!",
    "It's, we're, they'll, I'd, you've, she's, I'M, DON'T, 'tis, rock'n'roll, O'Neil's.",
    ("Language models read text as tokens. A tokenizer splits each sentence into pieces that "
     "appear in its vocabulary; rare words fall apart into several pieces, and characters that no "
     "piece covers are spelled byte by byte."),
    CODE,
    "int main(void) {\n\tfor (int i = 0; i < 10; ++i) {\n\t\tprintf(\"%d\\n\", i);\n\t}\n\treturn 0;\n}\n",
    "line1\nline2\n\nline4\n\n\n\nline8",
    "\r\n windows line \r\n\r\nend\r",
    "a  b   c    d     e      f\t\t\tg" + " " * 40 + "h\n   \n",
    "中文分词测试，今天天气很好。日本語のテキストです。한국어 문장입니다.",
    "😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇺🇸 ❤️ 🫠🪿",
    "Café naïve résumé Ångström façade Zürich São Paulo Ελληνικά русский текст",
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया สวัสดีชาวโลก",
    "\x00\x01\x07\x1b[31mred\x1b[0m\x7f\x1c\x1d\x1e\x1f end",
    "\u200b\u200d\ufeff\u2028\u2029\xa0\x85\u3000 \U0001D400 \U00010000 \U0010FFFD \U00031350\U00011F04",
    "1 12 123 1234 12345 3.14159 -42 1e-10 0x1F 1,000,000 ٣٤٥ ½ Ⅻ",
    "3141592653589793238462643383279502884197169399375105820974944592",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<bos>text<eos> <|endoftext|> </s> <s> <unused0><unused99> <pad><mask>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "<start_of_turn <|im_start| <end_of_turn>> <<start_of_turn>> <|im_end|><|im_end|>",
    "<table><tr><td>1</td></tr></table> <h1>Title</h1> <b>bold</b> <code>x</code>",
    "a" * 300,
    "Supercalifragilisticexpialidocious" * 6,
    "pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
    "https://example.com/path/to/page?query=1&x=y#frag user.name+tag@example.org",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b", "emoji": "😀"}}',
    "# Title\n\n- item 1\n- item 2\n\n```python\nprint('hi')\n```\n",
    "'s 'S 'll 'LL 're 'Re '' ''' 'abc x's Y'S",
    "abc中文def123ghi😀jkl",
    "     ",
    "\n",
    "\n\n\n\n\n",
    " \n \n ",
    "\t \t  \t   x",
    "!!! ??? ... --- *** ;;; ::: ((( ))) [[[ ]]] {{{ }}} <<< >>>",
    "a▁b ▁▁c ▁",
    "<0x41> <0xFF> <0x0A>",
    "Hello , world ! How are you ? Fine .",
    "∀x∈ℝ: x² ≥ 0 ⇒ √(x²) = |x|, ∑_{i=1}^{n} i = n(n+1)/2",
    "$100 €50 £30 ¥1000 ₹500 ₿0.1",
    "The year 2024 had 366 days; 12:30:45 PM; 2024-02-29T12:00:00Z",
    "e\u0301 a\u0308 n\u0303 ក្ម ☺\ufe0f ☺\ufe0e",
    "\u00a0nbsp\u00a0\u00a0 text\u00a0",
    "<start_of_image>[multimodal]<end_of_image>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "hello \n",
    "end with spaces   ",
    "  \tmixed\u3000　indent",
    _random_text(1, 400),
    _random_text(2, 400),
    _random_text(3, 400),
    _random_text(4, 1200),
    _long_document(5, 8000),
]


def _detokenize(vocab, ids: list[int], remove_special: bool, unparse_special: bool) -> str:
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse_special)
    assert 0 <= n <= size, n
    return buf.raw[:n].decode("utf-8", errors="replace")


def _piece(vocab, tid: int, special: bool) -> str:
    buf = ctypes.create_string_buffer(1024)
    n = llama_cpp.llama_token_to_piece(vocab, tid, buf, 1024, 0, special)
    assert 0 <= n <= 1024, n
    return buf.raw[:n].hex()


def _model_golden(path: Path) -> dict:
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def opt(tid: int):
        return None if tid < 0 else tid

    rng = random.Random(0)
    sample = sorted(set(range(300)) | set(rng.sample(range(n_vocab), 500)) | {n_vocab - 1})
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    add_eos = bool(llama_cpp.llama_vocab_get_add_eos(vocab))
    assert not add_eos, "the compact encoding below assumes no EOS is added"
    bos_text = ""
    if add_bos:
        bos_text = bytes.fromhex(_piece(vocab, llama_cpp.llama_vocab_bos(vocab), True)).decode()
    cases = []
    for text in CORPUS:
        raw = text.encode("utf-8")
        ids = llm.tokenize(raw, add_bos=True, special=True)
        no_bos = llm.tokenize(raw, add_bos=False, special=True)
        no_parse = llm.tokenize(raw, add_bos=False, special=False)
        detok_special = _detokenize(vocab, ids, False, True)
        detok_plain = _detokenize(vocab, ids, True, False)
        # null = "the obvious value", to keep the file small: ids without the added BOS, the
        # parse_special ids, and the corpus text itself
        cases.append({
            "ids": ids,
            "ids_no_bos": None if no_bos == (ids[1:] if add_bos else ids) else no_bos,
            "ids_no_parse": None if no_parse == no_bos else no_parse,
            "detok_special": None if detok_special == bos_text + text else detok_special,
            "detok_plain": None if detok_plain == text else detok_plain,
        })
    return {
        "file": path.name,
        "n_vocab": n_vocab,
        "bos": opt(llama_cpp.llama_vocab_bos(vocab)),
        "eos": opt(llama_cpp.llama_vocab_eos(vocab)),
        "eot": opt(llama_cpp.llama_vocab_eot(vocab)),
        "add_bos": add_bos,
        "add_eos": add_eos,
        "eog": [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)],
        "pieces": {str(t): [_piece(vocab, t, True), _piece(vocab, t, False)] for t in sample},
        "cases": cases,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemma", type=Path, required=True)
    ap.add_argument("--qwen", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    golden = {
        "llama_cpp_python": llama_cpp.__version__,
        "corpus": CORPUS,
        "models": {"gemma": _model_golden(args.gemma), "qwen": _model_golden(args.qwen)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(golden, ensure_ascii=False, separators=(",", ":"))
    args.out.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, {len(CORPUS)} strings)")


if __name__ == "__main__":
    main()
