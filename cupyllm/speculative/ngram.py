"""n-gram (prompt lookup) drafting: propose what followed the latest earlier occurrence of the text's last n
tokens (Saxena's prompt lookup decoding; transformers' prompt_lookup_num_tokens, vLLM's and llama.cpp's ngram).
No second model: it pays where the output repeats its input (editing code, answering from a document)."""
from __future__ import annotations

from typing import Sequence


class NgramDrafter:
    """Drafts from the history itself: the longest n-gram (n from `size` down to `min_size`) that ends the history
    and occurred before, continued as it continued then (the latest such occurrence). An index from each n-gram
    to the position after its latest occurrence grows with the history, so a draft costs O(size), not a scan."""

    def __init__(self, size: int = 3, min_size: int = 2):
        if not 1 <= min_size <= size:
            raise ValueError(f"n-gram sizes need 1 <= min_size <= size; got min_size {min_size}, size {size}")
        self.size, self.min_size = size, min_size
        self._history: Sequence[int] | None = None  # the sequence indexed (one generation's growing list)
        self._indexed = 0  # history[:_indexed] is in the index
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> position right after its latest occurrence

    def draft(self, history: Sequence[int], n_max: int) -> list[int]:
        if n_max <= 0:
            return []
        self._index(history)
        for n in range(min(self.size, len(history) - 1), self.min_size - 1, -1):
            after = self._next.get(tuple(history[-n:]))
            if after is not None:
                return [int(t) for t in history[after:after + n_max]]
        return []

    def _index(self, history: Sequence[int]) -> None:
        """Index the n-grams that end before the history's last token (an n-gram ending at the last token is the
        one being looked up: it has no continuation yet)."""
        if history is not self._history or len(history) < self._indexed:  # another sequence: start over
            self._history, self._indexed, self._next = history, 0, {}
        for after in range(max(self._indexed, 1), len(history)):
            for n in range(self.min_size, min(self.size, after) + 1):
                self._next[tuple(history[after - n:after])] = after
        self._indexed = len(history)
