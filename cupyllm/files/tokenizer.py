"""Text <-> token ids from a GGUF's tokenizer metadata, id for id what llama.cpp's llama-vocab produces.

Two vocabulary kinds are supported:
- "llama": SentencePiece BPE (Gemma 3). Spaces become U+2581, the text is split into code points, and
  adjacent symbols are merged best-score-first (ties: leftmost) while the merged text is a vocab entry;
  symbols that are no token fall back to `<0xXX>` byte tokens.
- "gpt2": byte-level BPE (Qwen2, Llama 3). A regex pre-tokenizer (chosen by `tokenizer.ggml.pre`) cuts
  the text into words, each word's UTF-8 bytes are mapped to printable characters, and adjacent symbols
  are merged lowest-merge-rank-first (ties: leftmost).
Before either, special tokens (CONTROL / USER_DEFINED / UNKNOWN) are cut out of the raw text, longest
token first, the way llama.cpp's tokenizer_st_partition does.

Known divergence: letter/number classes come from the `regex` package's Unicode tables; llama.cpp's
tables stop at Unicode 15.1, so characters first assigned in Unicode 16 or later ("undefined" to
llama.cpp) can be pre-tokenized differently. Everything assigned up to 15.1 agrees. The per-model
LSTRIP/RSTRIP special-token attributes llama.cpp sets by model name (phi-3, jina, modern-bert) are
not applied; neither Gemma nor Qwen has them.
"""
from __future__ import annotations

import codecs
import heapq
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import regex

from ..errors import CupyllmError, ModelFileError

# llama.h token attributes (bit flags); GGUF stores a token *type*, mapped below.
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
_TOKEN_TYPE_TO_ATTR = {0: ATTR_UNDEFINED, 1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL,
                       4: ATTR_USER_DEFINED, 5: ATTR_UNUSED, 6: ATTR_BYTE}
_SPECIAL_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN  # cut out of the text before merging
_HIDDEN_ATTRS = ATTR_CONTROL | ATTR_UNKNOWN  # not rendered when decoding with skip_special

SPM_SPACE = "\u2581"
SUPPORTED_MODELS = ("llama", "gpt2", "gemma4")

# llama.cpp's whitespace set (the Unicode White_Space property); spelled out because `\s` differs
# between regex engines (e.g. on U+001C..U+001F).
_WS = r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_CONTRACTIONS_CI = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2_PATTERN = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^WS\p{L}\p{N}]+|[WS]+(?![^WS])|[WS]+"
                 .replace("WS", _WS))


def _llama3_like(number: str) -> str:
    return (_CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|" + number
            + r"| ?[^WS\p{L}\p{N}]+[\r\n]*|[WS]*[\r\n]+|[WS]+(?![^WS])|[WS]+").replace("WS", _WS)


# Pre-tokenizer regex chains, applied like llama.cpp's unicode_regex_split: each regex cuts every
# piece left by the previous one into its matches and the text between them.
_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "qwen2": (_llama3_like(r"\p{N}"),),
    "llama3": (_llama3_like(r"\p{N}{1,3}"),),
    "gpt2": (_GPT2_PATTERN,),
    "default": (r"[\p{P}$+<=>^~|]+", _GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]"),
    # Gemma 4: BPE over characters of the whole line (spaces already U+2581); only newline runs are cut off
    "gemma4": (r"[^\n]+|[\n]+",),
}
# tokenizer.ggml.pre names llama.cpp maps onto the chains above
_PRE_ALIASES = {
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "megrez": "qwen2",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3", "pixtral": "llama3",
    "gpt-2": "gpt2", "phi-2": "gpt2", "gpt2": "gpt2",  # "gpt2" is our spelling; llama.cpp knows "gpt-2"
    "default": "default", "": "default",
}
_IGNORE_MERGES_PRE = {"llama3"}  # llama.cpp: a word that is itself a token skips merging

# Tokens llama.cpp recognises by their text (llama-vocab.cpp, "auto-detect special tokens by text").
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")
_ALWAYS_RENDERED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss

_CACHE_LIMIT = 1 << 18  # words memoised per tokenizer before the memo is dropped


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes map to themselves, the rest
    to code points from 256 up, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = [""] * 256, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
_LATIN1_TO_MAPPED = str.maketrans({chr(b): c for b, c in enumerate(_BYTE_TO_CHAR)})
_SURROGATE = re.compile("[\ud800-\udfff]")


def _sanitize(text: str) -> str:
    """Lone surrogates (possible in str, impossible in UTF-8) become U+FFFD, as llama.cpp turns
    undecodable input into U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


class _Memo(dict):
    """Word -> ids memo that empties itself instead of growing without bound."""

    def put(self, key: str, value: list[int]) -> None:
        if len(self) >= _CACHE_LIMIT:
            self.clear()
        self[key] = value


# ---------------------------------------------------------------------------------------------------
# special-token partition


def _trie_regex(strings: Iterable[str]) -> str:
    """One regex alternation shaped like a trie, greedy so it finds the longest string at a position.
    (A flat alternation of thousands of literals is ~20x slower to scan.)"""
    trie: dict = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return "(?:" + body + ")?" if "" in node else body

    return build(trie)


class _SpecialSplitter:
    """Cuts special tokens out of raw text with llama.cpp's semantics: tokens are taken longest first,
    each at its leftmost non-overlapping occurrences that lie wholly in text no longer token has taken."""

    def __init__(self, texts: list[str], ids: list[int]):
        # Stable order: length descending, then id (llama.cpp's std::sort leaves equal lengths unordered).
        order = sorted(range(len(ids)), key=lambda k: (-len(texts[k]), ids[k]))
        self._rank = {texts[k]: r for r, k in enumerate(order)}
        self._id = {texts[k]: ids[k] for k in order}
        self._finder = re.compile("(?=(" + _trie_regex(self._id) + "))") if ids else None

    def split(self, text: str) -> list[str | int]:
        """Fragments in order: str for raw text, int for a special token id."""
        if self._finder is None or not text:
            return [text] if text else []
        present = self._present(text)
        if not present:
            return [text]
        taken = bytearray(len(text))  # 1 where a special token already sits
        spans: list[tuple[int, int, int]] = []
        for tok in sorted(present, key=self._rank.__getitem__):
            n, tid = len(tok), self._id[tok]
            pos = text.find(tok)
            while pos >= 0:
                blocked = taken.find(1, pos, pos + n)
                if blocked < 0:
                    taken[pos:pos + n] = b"\x01" * n
                    spans.append((pos, n, tid))
                    pos = text.find(tok, pos + n)
                else:
                    # no occurrence starting before the end of this taken run can be free
                    free = taken.find(0, blocked)
                    pos = text.find(tok, free) if free >= 0 else -1
        spans.sort()
        out: list[str | int] = []
        cursor = 0
        for pos, n, tid in spans:
            if pos > cursor:
                out.append(text[cursor:pos])
            out.append(tid)
            cursor = pos + n
        if cursor < len(text):
            out.append(text[cursor:])
        return out

    def _present(self, text: str) -> set[str]:
        """Special tokens occurring anywhere in text: the longest at each position, plus every special
        token that is a prefix of one of those (it occurs at the same position)."""
        longest = set(self._finder.findall(text))
        longest.discard("")
        present = set(longest)
        for s in longest:
            for k in range(1, len(s)):
                if s[:k] in self._id:
                    present.add(s[:k])
        return present


# ---------------------------------------------------------------------------------------------------
# SentencePiece BPE


def merge_pairs(word: str, priority) -> list[str]:
    """The pieces of `word` after merging adjacent symbols pair by pair, starting from its code points:
    always the queued pair of the smallest priority(left, right) (None: the pair never merges), leftmost on
    ties, as llama.cpp's llm_bigram_spm / llm_bigram_bpe queues do."""
    n = len(word)
    if n == 0:
        return []
    length = [1] * n  # symbol i starts at code point i; 0 once merged into its left neighbour
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap = []
    for i in range(n - 1):
        key = priority(word[i], word[i + 1])
        if key is not None:
            heap.append((key, i, i + 1, 2))
    heapq.heapify(heap)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
            continue  # stale: one side has changed since this pair was queued
        length[left] += length[right]
        length[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        for a, b in ((prv[left], left), (left, nxt[left])):
            if a >= 0 and b >= 0:
                key = priority(word[a:b], word[b:b + length[b]])
                if key is not None:
                    heapq.heappush(heap, (key, a, b, length[a] + length[b]))
    pieces, i = [], 0
    while i != -1:
        pieces.append(word[i:i + length[i]])
        i = nxt[i]
    return pieces


class _SentencePieceMerger:
    """llama.cpp's llm_tokenizer_spm_session over text whose spaces are already U+2581."""

    def __init__(self, token_to_id: dict[str, int], scores: list[float], byte_ids: list[int | None]):
        self._token_to_id = token_to_id
        self._scores = scores
        self._byte_ids = byte_ids
        # A merge can only cross a "non-U+2581 then U+2581" boundary if some token contains that
        # pair; such tokens are rare (Gemma 3 has one), so text is cut into words at those boundaries
        # except where one of these tokens occurs, and words are memoised.
        self._boundary_tokens = [t for t in token_to_id if SPM_SPACE in t.lstrip(SPM_SPACE)]
        self._memo = _Memo()

    _WORD = re.compile(SPM_SPACE + "*[^" + SPM_SPACE + "]+|" + SPM_SPACE + "+")

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        memo = self._memo
        for word in self._words(text):
            ids = memo.get(word)
            if ids is None:
                ids = self._merge(word)
                memo.put(word, ids)
            out.extend(ids)
        return out

    def _words(self, text: str) -> list[str]:
        words = self._WORD.findall(text)
        glued = [t for t in self._boundary_tokens if t in text]
        if not glued or len(words) < 2:
            return words
        # Boundaries inside an occurrence of a boundary-crossing token must not be cut.
        keep_together: set[int] = set()
        for tok in glued:
            pos = text.find(tok)
            while pos >= 0:
                keep_together.update(range(pos + 1, pos + len(tok)))
                pos = text.find(tok, pos + 1)
        merged, start, pos = [], 0, 0
        for w in words:
            if pos > 0 and pos not in keep_together:
                merged.append(text[start:pos])
                start = pos
            pos += len(w)
        merged.append(text[start:])
        return merged

    def _merge(self, word: str) -> list[int]:
        lookup, scores = self._token_to_id, self._scores

        def priority(left: str, right: str):  # best score first: llama.cpp's llm_bigram_spm order
            tid = lookup.get(left + right)
            return None if tid is None else -scores[tid]

        out: list[int] = []
        for piece in merge_pairs(word, priority):
            tid = lookup.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_token(b) for b in piece.encode("utf-8"))
        return out

    def _byte_token(self, b: int) -> int:
        tid = self._byte_ids[b]
        if tid is None:
            raise ModelFileError(f"the vocabulary has no byte token <0x{b:02X}> to spell a character "
                                 "that no token covers; the GGUF tokenizer is incomplete")
        return tid


# ---------------------------------------------------------------------------------------------------
# byte-level BPE


class _PreTokenizer:
    def __init__(self, patterns: tuple[str, ...]):
        self._patterns = [regex.compile(p) for p in patterns]

    def split(self, text: str) -> list[str]:
        pieces = [text]
        for pat in self._patterns:
            nxt: list[str] = []
            for piece in pieces:
                cursor = 0
                for m in pat.finditer(piece):
                    s, e = m.span()
                    if s > cursor:
                        nxt.append(piece[cursor:s])
                    if e > s:
                        nxt.append(piece[s:e])
                    cursor = e
                if cursor < len(piece):
                    nxt.append(piece[cursor:])
            pieces = nxt
        return pieces


class _ByteLevelBpe:
    """llama.cpp's llm_tokenizer_bpe_session: regex words, GPT-2 byte mapping, merges by rank.

    Gemma 4 (`byte_encode` False) runs the same merges over the characters themselves: spaces become U+2581
    first, a word made only of newlines is one token when the vocabulary has it, and a piece no token spells
    falls back to its UTF-8 bytes as <0xXX> tokens."""

    def __init__(self, token_to_id: dict[str, int], merges: list[str], pre: str, byte_encode: bool = True):
        self._token_to_id = token_to_id
        # Merge "a b" has rank = its line; the first line wins for duplicates (C++ emplace).
        self._ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
        self._pre = _PreTokenizer(_PRE_TOKENIZERS[pre])
        self._ignore_merges = pre in _IGNORE_MERGES_PRE
        self._byte_encode = byte_encode
        self._byte_ids = None if byte_encode else _byte_fallback_ids(token_to_id)
        self._memo = _Memo()

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        memo = self._memo
        if not self._byte_encode:
            text = text.replace(" ", SPM_SPACE)
        for word in self._pre.split(text):
            ids = memo.get(word)
            if ids is None:
                ids = self._merge(word.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_MAPPED)
                                  if self._byte_encode else word)
                memo.put(word, ids)
            out.extend(ids)
        return out

    def _merge(self, word: str) -> list[int]:
        lookup, ranks = self._token_to_id, self._ranks
        if (self._ignore_merges or (not self._byte_encode and not word.strip("\n"))) and word in lookup:
            return [lookup[word]]

        def priority(left: str, right: str):  # lowest rank first: llama.cpp's llm_bigram_bpe order
            return ranks.get(left + " " + right)

        out: list[int] = []
        for piece in merge_pairs(word, priority):
            tid = lookup.get(piece)
            if tid is not None:
                out.append(tid)
            elif not self._byte_encode:
                out.extend(self._byte_ids[b] for b in piece.encode("utf-8") if self._byte_ids[b] is not None)
            else:
                # llama.cpp looks each UTF-8 byte of the mapped text up as a one-byte token and drops
                # the misses; only ASCII bytes can hit.
                for b in piece.encode("utf-8"):
                    tid = lookup.get(chr(b)) if b < 0x80 else None
                    if tid is not None:
                        out.append(tid)
        return out


# ---------------------------------------------------------------------------------------------------
# the tokenizer


@dataclass(frozen=True)
class SpecialIds:
    """Special token ids as llama.cpp resolves them (GGUF keys, model-kind defaults, text detection)."""

    bos: int | None
    eos: int | None
    eot: int | None
    eom: int | None
    unk: int | None
    pad: int | None
    fim_pre: int | None
    fim_suf: int | None
    fim_mid: int | None
    fim_pad: int | None
    fim_rep: int | None
    fim_sep: int | None


_SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id",
                 "eom": "eom_token_id", "unk": "unknown_token_id", "pad": "padding_token_id",
                 "fim_pre": "fim_pre_token_id", "fim_suf": "fim_suf_token_id", "fim_mid": "fim_mid_token_id",
                 "fim_pad": "fim_pad_token_id", "fim_rep": "fim_rep_token_id", "fim_sep": "fim_sep_token_id"}
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}, "gemma4": {}}


def _meta_bool(metadata: dict, key: str, default: bool) -> bool:
    value = metadata.get(key)
    return default if value is None else bool(value)


def _token_attrs(metadata: dict, n: int) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        return [ATTR_NORMAL] * n
    types = np.asarray(types)
    if len(types) < n:
        raise ModelFileError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens; "
                             "the GGUF is corrupt")
    lut = np.zeros(max(7, int(types.max()) + 1), dtype=np.int64)  # unknown types: UNDEFINED
    for token_type, attr in _TOKEN_TYPE_TO_ATTR.items():
        lut[token_type] = attr
    return lut[np.clip(types[:n], 0, None)].tolist()


def _special_ids(metadata: dict, model: str, token_to_id: dict[str, int], attrs: list[int]) -> SpecialIds:
    """GGUF key if in range, else the model kind's default if in range, else found by text."""
    n = len(attrs)
    found: dict[str, int | None] = {}
    for name, key in _SPECIAL_KEYS.items():
        tid = _DEFAULT_IDS[model].get(name)
        tid = tid if tid is not None and tid < n else None
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < n:
            tid = int(value)
        found[name] = tid
    for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
        if found[name] is None:
            # llama.cpp takes the first hit of a hash-map walk (unspecified order); we take the first
            # text in list order, which is what llama.cpp picks for Gemma 3 and Qwen2.5 (<|im_end|>).
            tid = next((token_to_id[t] for t in texts if t in token_to_id), None)
            if tid is not None:
                attrs[tid] |= ATTR_CONTROL  # llama.cpp forces control-looking tokens to CONTROL
            found[name] = tid
    return SpecialIds(**found)


def _end_of_generation_ids(specials: SpecialIds, tokens: list[str], token_to_id: dict[str, int],
                           attrs: list[int]) -> frozenset[int]:
    """llama.cpp's special_eog_ids: FIM pad/repo/file-sep, tokens with end-of-turn texts, EOS, EOT, EOM."""
    eog = {tid for tid in (specials.fim_pad, specials.fim_rep, specials.fim_sep) if tid is not None}
    for t in _EOG_TEXTS:
        if t in token_to_id:
            eog.add(token_to_id[t])
            attrs[token_to_id[t]] |= ATTR_CONTROL
    for t in _ALWAYS_RENDERED_TEXTS:
        if t in token_to_id:
            attrs[token_to_id[t]] = ATTR_USER_DEFINED
    eog.update(tid for tid in (specials.eos, specials.eot, specials.eom) if tid is not None)
    by_text = {tokens[t]: t for t in eog}
    # llama.cpp's workarounds: "<|end|>" is no EOG next to "<|return|>"+"<|call|>" (harmony) or
    # "<|calls|>"+"<|flush|>" (solar-open); "</s>" is none next to "<|tool_response>" or "<|plamo:eos|>".
    if "<|end|>" in by_text and (("<|return|>" in by_text and "<|call|>" in by_text)
                                 or ("<|calls|>" in by_text and "<|flush|>" in by_text)):
        eog.discard(by_text["<|end|>"])
        attrs[by_text["<|end|>"]] = ATTR_USER_DEFINED
    if "</s>" in by_text and ("<|tool_response>" in by_text or "<|plamo:eos|>" in by_text):
        eog.discard(by_text["</s>"])
        attrs[by_text["</s>"]] = ATTR_NORMAL
    return frozenset(eog)


def _byte_fallback_ids(token_to_id: dict[str, int]) -> list[int | None]:
    """SPM byte tokens <0x00>..<0xFF>; llama.cpp falls back to a one-character token for ASCII."""
    ids = []
    for b in range(256):
        tid = token_to_id.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = token_to_id.get(chr(b))
        ids.append(tid)
    return ids


class Tokenizer:
    """A GGUF vocabulary with llama.cpp's encode and token-to-piece behaviour."""

    def __init__(self, *, model: str, pre: str, tokens: list[str], attrs: list[int],
                 specials: SpecialIds, eog_ids: frozenset[int], add_bos: bool, add_eos: bool,
                 add_space_prefix: bool, engine: _SentencePieceMerger | _ByteLevelBpe,
                 token_to_id: dict[str, int]):
        self.model = model
        self.pre = pre
        self.tokens = tokens
        self._attrs = attrs
        self.specials = specials
        self.eog_ids = eog_ids
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self._engine = engine
        self._token_to_id = token_to_id
        self._splitters: dict[bool, _SpecialSplitter] = {}
        self._pieces: dict[tuple[int, bool], bytes] = {}

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        from .gguf import read_gguf
        return cls.from_metadata(read_gguf(path).metadata)

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> "Tokenizer":
        model = metadata.get("tokenizer.ggml.model")
        if model not in SUPPORTED_MODELS:
            raise ModelFileError(f"tokenizer model {model!r} is not supported; supported are 'llama' "
                                 "(SentencePiece, e.g. Gemma 3), 'gpt2' (byte-level BPE, e.g. Qwen2, "
                                 "Llama 3) and 'gemma4' (BPE over characters)")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFileError("the GGUF has no tokenizer.ggml.tokens; it cannot be used for text")
        # llama.cpp renames empty entries so every text maps to one id
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        token_to_id = {t: i for i, t in enumerate(tokens)}  # later duplicates win, as in llama.cpp
        attrs = _token_attrs(metadata, len(tokens))

        pre_name = ""
        if model == "llama":
            add_bos, add_eos, add_space_prefix = True, False, True
        elif model == "gemma4":  # llama.cpp sets the pre-tokenizer whatever the file says
            pre_name = "gemma4"
            add_bos, add_eos, add_space_prefix = True, False, False
        else:
            pre_name = str(metadata.get("tokenizer.ggml.pre", "") or "")
            if pre_name not in _PRE_ALIASES:
                names = ", ".join(sorted(k for k in _PRE_ALIASES if k))
                raise ModelFileError(f"pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported; "
                                     f"supported are: {names}")
            add_bos = _PRE_ALIASES[pre_name] == "llama3"  # llama.cpp's default for llama3-style vocabs
            add_eos, add_space_prefix = False, False
        add_space_prefix = _meta_bool(metadata, "tokenizer.ggml.add_space_prefix", add_space_prefix)
        add_bos = _meta_bool(metadata, "tokenizer.ggml.add_bos_token", add_bos)
        add_eos = _meta_bool(metadata, "tokenizer.ggml.add_eos_token", add_eos)

        specials = _special_ids(metadata, model, token_to_id, attrs)
        eog = _end_of_generation_ids(specials, tokens, token_to_id, attrs)

        if model == "llama":
            scores = metadata.get("tokenizer.ggml.scores")
            if scores is None:
                scores = [0.0] * len(tokens)
            elif len(scores) < len(tokens):
                raise ModelFileError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} "
                                     "tokens; the GGUF is corrupt")
            else:
                scores = np.asarray(scores, np.float64).tolist()
            engine: _SentencePieceMerger | _ByteLevelBpe = _SentencePieceMerger(
                token_to_id, scores, _byte_fallback_ids(token_to_id))
        else:
            merges = metadata.get("tokenizer.ggml.merges")
            if merges is None:
                raise ModelFileError(f"the GGUF's {model} tokenizer has no tokenizer.ggml.merges; "
                                     "re-convert the model with a current convert_hf_to_gguf.py")
            engine = _ByteLevelBpe(token_to_id, list(merges), _PRE_ALIASES.get(pre_name, pre_name),
                                   byte_encode=model != "gemma4")

        return cls(model=model, pre=pre_name, tokens=tokens, attrs=attrs, specials=specials,
                   eog_ids=eog, add_bos=add_bos, add_eos=add_eos,
                   add_space_prefix=add_space_prefix, engine=engine, token_to_id=token_to_id)

    # -- properties ---------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.specials.bos

    @property
    def eos_id(self) -> int | None:
        return self.specials.eos

    @property
    def eot_id(self) -> int | None:
        return self.specials.eot

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def is_control(self, token_id: int) -> bool:
        """CONTROL or UNKNOWN: tokens that decode to nothing with skip_special."""
        return bool(self._attrs[token_id] & _HIDDEN_ATTRS)

    def token_to_id(self, text: str) -> int | None:
        """The id whose vocab text is exactly `text` (e.g. "<start_of_turn>"), or None."""
        return self._token_to_id.get(text)

    # -- encoding -----------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               add_eos: bool | None = None) -> list[int]:
        """Token ids for `text`. add_bos/add_eos None follow the GGUF's flags. With parse_special, the
        text of CONTROL tokens (e.g. "<start_of_turn>", "<|im_start|>") becomes those tokens; without
        it only USER_DEFINED tokens are recognised, as in llama.cpp."""
        if not isinstance(text, str):
            raise CupyllmError(f"encode() takes a str, got {type(text).__name__}")
        add_bos = self.add_bos if add_bos is None else add_bos
        add_eos = self.add_eos if add_eos is None else add_eos
        out: list[int] = []
        if add_bos:
            out.append(self._required(self.specials.bos, "BOS"))
        is_spm = self.model == "llama"
        prev_special = True  # SPM: a text fragment right after a special token gets the space prefix
        for frag in self._splitter(parse_special).split(_sanitize(text)):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif is_spm:
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._engine.encode(frag.replace(" ", SPM_SPACE)))
                prev_special = False
            else:
                out.extend(self._engine.encode(frag))
        if add_eos:
            out.append(self._required(self.specials.eos, "EOS"))
        return out

    def _required(self, tid: int | None, what: str) -> int:
        if tid is None:
            raise CupyllmError(f"this vocabulary has no {what} token; call encode() with "
                               f"add_{what.lower()}=False")
        return tid

    def _splitter(self, parse_special: bool) -> _SpecialSplitter:
        splitter = self._splitters.get(parse_special)
        if splitter is None:  # built on first use: the trie regex over thousands of tokens takes ~0.2 s
            if parse_special:
                ids = [i for i, a in enumerate(self._attrs) if a & _SPECIAL_ATTRS]
            else:  # USER_DEFINED only; llama.cpp skips any token also marked CONTROL/UNKNOWN
                ids = [i for i, a in enumerate(self._attrs)
                       if a & ATTR_USER_DEFINED and not a & _HIDDEN_ATTRS]
            splitter = _SpecialSplitter([self.tokens[i] for i in ids], ids)
            self._splitters[parse_special] = splitter
        return splitter

    # -- decoding -----------------------------------------------------------------------------------

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The bytes llama.cpp's token_to_piece gives: CONTROL/UNKNOWN tokens are b"" unless `special`;
        U+2581 becomes a space (SPM), byte tokens give their byte, byte-level BPE text is unmapped."""
        key = (token_id, special)
        piece = self._pieces.get(key)
        if piece is None:
            piece = self._piece(token_id, special)
            if len(self._pieces) >= _CACHE_LIMIT:
                self._pieces.clear()
            self._pieces[key] = piece
        return piece

    def _piece(self, token_id: int, special: bool) -> bytes:
        if not 0 <= token_id < len(self.tokens):
            raise CupyllmError(f"token id {token_id} is outside the vocabulary (0..{len(self.tokens) - 1})")
        attr = self._attrs[token_id]
        text = self.tokens[token_id]
        if attr & _HIDDEN_ATTRS and not special:
            return b""
        if attr & (_HIDDEN_ATTRS | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.model in ("llama", "gemma4"):
                return text.replace(SPM_SPACE, " ").encode("utf-8")
            return _unmap_bytes(text)
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # UNUSED / UNDEFINED tokens render as nothing

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Concatenated token pieces as text (invalid UTF-8 becomes U+FFFD)."""
        data = b"".join(self.token_bytes(int(t), not skip_special) for t in ids)
        return data.decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)


def _unmap_bytes(text: str) -> bytes:
    """Byte-level BPE token text -> raw bytes (llama_decode_text, including its marker for characters
    outside the byte map)."""
    out = bytearray()
    for ch in text:
        b = _CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


class StreamDecoder:
    """Turns generated ids into text as they come, holding back a UTF-8 sequence split across tokens
    (e.g. an emoji spelled by byte tokens) until it is complete; the concatenated output equals
    Tokenizer.decode of all ids."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(int(token_id), self._special))

    def flush(self) -> str:
        """Whatever is still held back (an incomplete sequence becomes U+FFFD); resets the decoder."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
