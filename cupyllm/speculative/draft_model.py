"""Draft-model drafting: a smaller model of the same vocabulary proposes tokens greedily from its own cache, which
follows the target's accepted tokens (llama.cpp's -md; vLLM's draft models; transformers' assistant_model)."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..errors import InputError
from ..kv.cache import KVCache
from ..kv.prompt_cache import shared_prefix


class ModelDrafter:
    """Greedy drafts of a model: at most n_max tokens, stopping early where the draft model's own probability of
    its next token falls under p_min (llama.cpp's --draft-p-min): a draft it doubts is rarely kept and costs a
    verify position. `forward(tokens, positions, cache, all_logits)` and `cache`: the draft model's own (any
    KV types; the target's `self` when it drafts for itself, with a cache of its own)."""

    def __init__(self, forward: Callable, cache: KVCache, chunk: int, p_min: float = 0.75,
                 n_vocab: int | None = None):
        self.forward, self.cache, self.chunk, self.p_min = forward, cache, chunk, p_min
        self.n_vocab = n_vocab  # the target's vocabulary: a draft model's padding ids past it end a draft
        self.ids: list[int] = []  # the tokens the draft cache holds, in order
        self._mark = None  # the cache's mark before the last draft's own tokens ran (rewinds a hybrid drafter)

    def draft(self, history: Sequence[int], n_max: int) -> list[int]:
        if n_max <= 0:
            return []
        logits = self._follow(history)
        if logits is None:  # the history does not fit the draft model's context
            return []
        drafts: list[int] = []
        self._mark = self.cache.mark()
        for i in range(n_max):
            token = int(np.argmax(logits))
            if 1.0 / np.exp(logits - logits[token]).sum() < self.p_min or \
                    (self.n_vocab is not None and token >= self.n_vocab):
                break
            drafts.append(token)
            if i + 1 == n_max or self.cache.n_past + 1 >= self.cache.spec.ctx:
                break
            logits = self._run([token])
        return drafts

    def _follow(self, history: Sequence[int]) -> np.ndarray | None:
        """Bring the draft cache to hold `history`; the logits after it."""
        if len(history) + 1 > self.cache.spec.ctx:
            return None
        shared = shared_prefix(self.ids, history)
        keep = min(shared, len(history) - 1)  # at least the last token runs: its logits are the draft's start
        if keep < self.cache.n_past:
            self._cut(keep)
        return self._run(history[self.cache.n_past:])

    def _cut(self, keep: int) -> None:
        """Forget the draft cache past `keep`: rewound to the mark (the draft's own tokens), cut (K/V rows), or
        cleared and run again (a hybrid drafter before its mark)."""
        mark = self._mark
        if mark is not None and mark.n_past <= keep <= self.cache.n_past:
            held = self.cache.rewind(mark, keep)
        elif self.cache.truncate(keep):
            held = keep
        else:
            self.cache.clear()
            held = 0
        del self.ids[held:]
        self._mark = None

    def _run(self, tokens: Sequence[int]) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        for start in range(0, len(tokens), self.chunk):
            part = tokens[start:start + self.chunk]
            positions = np.arange(self.cache.n_past, self.cache.n_past + len(part))
            logits = self.forward(part, positions, self.cache)
            self.cache.n_past += len(part)
            self.ids.extend(int(t) for t in part)
        return np.asarray(logits, dtype=np.float32).reshape(-1)


def check_same_vocabulary(target_tokens: Sequence[str], draft_tokens: Sequence[str], draft_name: str) -> None:
    """InputError unless the draft model's tokens are the target's (ids mean the same text): equal over the
    shorter vocabulary, the sizes at most 128 apart (padding rows, as llama.cpp allows)."""
    n = min(len(target_tokens), len(draft_tokens))
    if abs(len(target_tokens) - len(draft_tokens)) > 128:
        raise InputError(f"the draft model {draft_name} has {len(draft_tokens)} tokens, the model "
                         f"{len(target_tokens)}: a draft model must share the model's vocabulary (the same tokenizer)")
    for i in range(n):
        if target_tokens[i] != draft_tokens[i]:
            raise InputError(f"the draft model {draft_name} has another vocabulary: token {i} is "
                             f"{draft_tokens[i]!r} there, {target_tokens[i]!r} in the model; use a draft model "
                             "of the same family (the same tokenizer)")
