"""n-gram (prompt lookup) drafting: propose what followed an earlier occurrence of the text's last n tokens
(Saxena's prompt lookup decoding; transformers' prompt_lookup_num_tokens, vLLM's and llama.cpp's ngram).
No second model: it pays where the output repeats its input (editing code, answering from a document)."""
from __future__ import annotations

import bisect
from typing import Callable, Hashable, Sequence

from .decoder import DraftContext

# match lengths past this count as this long (a verbatim quote is a quote)
LONGEST_MATCH = 16
# DraftLength's rate tables by match length: these lengths and up share a table
MATCH_CLASSES = (0, 1, 2, 3, 4, 6, 9, LONGEST_MATCH)


class NgramDrafter:
    """Drafts from the history itself: the longest n-gram (n from `size` down to `min_size`) that ends the history
    and occurred before, continued as it continued then (of several occurrences, the one the text is reading:
    _match). An index from each n-gram to the positions after its occurrences grows with the history, so a draft
    costs O(size + log occurrences), not a scan.

    fold: a token's key for a second lookup where no n-gram matches as it is (e.g. its text lowercased,
    `text_fold`): an answer that quotes its input mid-sentence with a capital ("2. Insert two" for
    "Second, insert two") finds the quote a token or two sooner. A folded match's drafts are the history's own
    tokens after it, and its context a kind of its own."""

    def __init__(self, size: int = 3, min_size: int = 2, fold: Callable[[int], Hashable] | None = None):
        if not 1 <= min_size <= size:
            raise ValueError(f"n-gram sizes need 1 <= min_size <= size; got min_size {min_size}, size {size}")
        self.size, self.min_size, self.fold = size, min_size, fold
        self._history: Sequence[int] | None = None  # the sequence indexed (one generation's growing list)
        self._indexed = 0  # history[:_indexed] is in the index
        self._next: dict[tuple, list[int]] = {}  # n-gram -> the positions right after its occurrences, in order
        self._keys: list = []  # fold(token) of each token of the history (with fold)
        self._next_folded: dict[tuple, list[int]] = {}  # the same by folded n-grams
        self._followed: tuple[int, int] | None = None  # (the last draft's source position, the history's length)

    def draft(self, history: Sequence[int], n_max: int) -> list[int]:
        after, _, _ = self._match(history) if n_max > 0 else (None, 0, False)
        if after is None:
            return []
        self._followed = (after, len(history))
        return [int(t) for t in history[after:after + n_max]]

    def context(self, history: Sequence[int]) -> DraftContext:
        """How far the history's end runs verbatim beside the occurrence a draft would continue (up to
        LONGEST_MATCH tokens; 0: no draft), as one of MATCH_CLASSES: text that has been quoting its input
        for a dozen tokens keeps quoting more often than text whose last two tokens happen to recur, so
        DraftLength keeps the acceptance rates of each class apart (and of folded matches apart from exact
        ones). Prior m / (m + 2) for a class from m: 1/2 for the shortest lookups (every draft's prior without
        classes), 8/9 for a quote (Laplace's (m + 1) / (m + 2) drafted more on free text, and lost there:
        bench/spec_cpu.py)."""
        _, length, folded = self._match(history)
        kind = max(c for c in MATCH_CLASSES if c <= length)
        return DraftContext(("folded", kind) if folded else kind, kind / (kind + 2))

    def _match(self, history: Sequence[int]) -> tuple[int | None, int, bool]:
        """(the position after an earlier occurrence of the longest indexed n-gram that ends the history, or None;
        how many tokens before that position equal the history's last ones; whether the match is by folded keys,
        tried where no n-gram matches as it is). Of several occurrences: the one the text is reading (where the
        last draft's source has led, as far as the text followed it), else the first after it, else the latest:
        an answer quotes its input in order, and a phrase that recurs in the input ("the base unit") must not
        send the draft to its last occurrence."""
        self._index(history)
        reading = self._reading(history)
        for folded, (seq, index) in enumerate([(history, self._next)]
                                              + ([(self._keys, self._next_folded)] if self.fold else [])):
            for n in range(min(self.size, len(seq) - 1), self.min_size - 1, -1):
                occurrences = index.get(tuple(seq[-n:]))
                if occurrences:
                    after = _pick(occurrences, reading)
                    length = n
                    while (length < LONGEST_MATCH and after - 1 - length >= 0
                           and seq[after - 1 - length] == seq[-1 - length]):
                        length += 1
                    return after, length, bool(folded)
        return None, 0, False

    def _reading(self, history: Sequence[int]) -> int | None:
        """Where in the history the text now reads: the last draft's source position, moved on by as many of the
        tokens since as equal the source's (None before any draft)."""
        if self._followed is None:
            return None
        source, start = self._followed
        followed = 0
        while start + followed < len(history) and history[start + followed] == history[source + followed]:
            followed += 1
        return source + followed

    def _index(self, history: Sequence[int]) -> None:
        """Index the n-grams that end before the history's last token (an n-gram ending at the last token is the
        one being looked up: it has no continuation yet)."""
        if history is not self._history or len(history) < self._indexed:  # another sequence: start over
            self._history, self._indexed, self._next, self._keys, self._next_folded = history, 0, {}, [], {}
            self._followed = None
        if self.fold is not None:
            self._keys += [self.fold(t) for t in history[len(self._keys):]]
        for after in range(max(self._indexed, 1), len(history)):
            for n in range(self.min_size, min(self.size, after) + 1):
                self._next.setdefault(tuple(history[after - n:after]), []).append(after)
                if self.fold is not None:
                    self._next_folded.setdefault(tuple(self._keys[after - n:after]), []).append(after)
        self._indexed = len(history)


def _pick(occurrences: list[int], reading: int | None) -> int:
    """Of an n-gram's occurrences (ascending), the one at the reading position, else the first after it, else
    the latest."""
    if reading is not None:
        at = bisect.bisect_left(occurrences, reading)
        if at < len(occurrences):
            return occurrences[at]
    return occurrences[-1]


def text_fold(token_bytes: Callable[[int], bytes]) -> Callable[[int], str]:
    """A token's text lowercased, its spaces kept (token_bytes: the tokenizer's), as NgramDrafter's fold;
    remembered per token. (Stripping the spaces too let folded matches run on across sentence ends:
    docs/speculative.md.)"""
    keys: dict[int, str] = {}

    def fold(token: int) -> str:
        key = keys.get(token)
        if key is None:
            key = keys[token] = token_bytes(int(token)).decode("utf-8", errors="replace").lower()
        return key
    return fold
