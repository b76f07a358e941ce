"""The token loop: prefill the prompt in chunks, then decode one token at a time until a stop condition,
streaming UTF-8-safe text pieces and holding back any text that could still become a stop string."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from .errors import InputError
from .kv.cache import KVCache
from .sampling import Sampler
from .speculative.decoder import ContextFull, DraftLength, DraftStats, Drafter, TokenSource

PROGRESS_MIN_TOKENS = 1024  # prompts at least this long show a prefill progress bar


def check_max_tokens(max_tokens) -> int:
    """max_tokens as an int: a count >= 0, or -1 for no limit (llama.cpp's -n -1; other negatives are mistakes,
    not "unlimited")."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < -1:
        raise InputError(f"max_tokens (-n/--max-tokens) must be a count >= 0, or -1 for no limit; got {max_tokens!r}")
    return int(max_tokens)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a prompt cache held (not prefilled)
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    stop_reason: str = ""
    draft: DraftStats | None = None  # speculative decoding's counts, when a drafter ran
    context_shifts: int = 0  # times a full cache was shifted to go on (kv/shift.py)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def summary(self) -> str:
        cached = f" (+{self.cached_tokens} cached)" if self.cached_tokens else ""
        draft = ""
        if self.draft is not None:
            d = self.draft
            draft = (f", drafts: {d.accepted}/{d.drafted} kept ({100 * d.acceptance:.0f}%), "
                     f"{d.tokens_per_forward:.2f} tok/forward")
        shifts = f", context shifts: {self.context_shifts}" if self.context_shifts else ""
        return (f"prefill {self.prompt_tokens} tok{cached} in {self.prefill_seconds:.2f} s ({self.prefill_tps:.1f} tok/s), "
                f"decode {self.generated_tokens} tok in {self.decode_seconds:.2f} s ({self.decode_tps:.1f} tok/s)"
                f"{draft}{shifts}, stop: {self.stop_reason}")


def prefill(forward: Callable, ids: Sequence[int], cache: KVCache, chunk: int, *, all_logits: bool = False,
            progress: bool | None = None, checkpoint_at: Sequence[int] = ()) -> np.ndarray:
    """Run `ids` through the model from position cache.n_past in chunks; logits of the last token (or all).
    Each chunk's end is a checkpoint of a hybrid model's recurrent states (KVCache.checkpoint); `checkpoint_at`:
    positions where a chunk ends too (the start of a chat's generation prompt: where the next turn's prompt,
    which renders this reply back without its thought, leaves this one)."""
    ids = np.asarray(ids, dtype=np.int64)
    cache.check_room(len(ids))
    show = progress if progress is not None else len(ids) >= PROGRESS_MIN_TOKENS
    outputs = []
    cuts = sorted({*range(0, len(ids), chunk), *(p - cache.n_past for p in checkpoint_at
                                                 if 0 < p - cache.n_past < len(ids))})
    with tqdm(total=len(ids), desc="prefill", unit="tok", disable=not show, leave=False) as bar:
        for start, stop in zip(cuts, cuts[1:] + [len(ids)]):
            part = ids[start:stop]
            positions = np.arange(cache.n_past, cache.n_past + len(part))
            logits = forward(part, positions, cache, all_logits=all_logits)
            cache.n_past += len(part)
            cache.checkpoint()  # (recurrent states: a later prompt cut inside this prompt restarts from here)
            outputs.append(logits)
            bar.update(len(part))
    return np.concatenate(outputs) if all_logits else outputs[-1]


class StopMatcher:
    """Feeds text pieces; emits what can no longer be the start of a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[:min(hits)], ""
            return out
        hold = 0  # longest suffix of pending that is a proper prefix of some stop string
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(stop[:n]):
                    hold = n
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def generate_stream(forward: Callable, tokenizer, prompt_ids: Sequence[int], cache: KVCache, sampler: Sampler, *,
                    max_tokens: int, stop: Sequence[str] = (), chunk: int = 512,
                    stats: GenerationStats | None = None, progress: bool | None = None,
                    history: Sequence[int] = (), logits: np.ndarray | None = None,
                    on_done: Callable[[list[int], np.ndarray], None] | None = None,
                    drafter: Drafter | None = None, draft_length: DraftLength | None = None,
                    checkpoint_at: Sequence[int] = (), context_shift=None) -> Iterator[str]:
    """Yield text pieces of the continuation of `prompt_ids` (the cache must be empty or hold a prefix: the
    tokens `history`, which the repeat penalty sees too). `logits`: those after the last cached token, when
    prompt_ids is empty (the whole prompt is cached). max_tokens=-1 (llama.cpp's -n -1) generates until an
    end-of-generation token, a stop string or a full context. `on_done(ids, logits)`: called when the
    stream ends or is closed between tokens, with the tokens the cache then holds (the last sampled token is
    never run) and the logits after them; not after an error inside the model (the cache may be half written).
    `drafter`: speculative decoding (cupyllm/speculative), `draft_length` choosing how much it drafts; the text
    is the same as without, token for token where sampling is greedy. `checkpoint_at`: as prefill's.
    `context_shift`: a kv/shift.py ContextShift: a full cache is shifted and generation goes on (max_tokens
    alone ends it; on_done then gets the tokens the shifted cache holds); None: a full context ends it."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    room = cache.spec.ctx - cache.n_past - len(prompt_ids)
    if context_shift is not None:  # (ContextFull still ends it where the kept tokens fill the cache)
        room = max_tokens if max_tokens >= 0 else float("inf")
    budget = room if max_tokens < 0 else min(max_tokens, room)
    cache.check_room(len(prompt_ids) + (1 if max_tokens != 0 else 0))
    t0 = time.perf_counter()
    if len(prompt_ids) or logits is None:
        logits = prefill(forward, prompt_ids, cache, chunk, progress=progress, checkpoint_at=checkpoint_at)
    stats.prefill_seconds = time.perf_counter() - t0

    history = list(history) + list(prompt_ids)
    if drafter is not None:
        stats.draft = DraftStats()
    tokens = TokenSource(forward, cache, sampler, history, logits, drafter, draft_length, stats.draft,
                         shift=context_shift)
    decoder = tokenizer.stream_decoder()
    matcher = StopMatcher(stop)
    stats.stop_reason = "max_tokens" if 0 <= max_tokens <= budget else "context full"
    t0 = time.perf_counter()
    try:
        for step in (itertools.count() if budget == float("inf") else range(budget)):
            try:
                token = tokens.next(budget - step)
            except ContextFull:
                stats.stop_reason = "context full"
                break
            stats.generated_tokens += 1
            if tokenizer.is_eog(token):
                stats.stop_reason = "end of generation token"
                break
            text = matcher.feed(decoder.feed(token))
            if text:
                yield text
            if matcher.stopped:
                stats.stop_reason = "stop string"
                break
        if not matcher.stopped:
            tail = matcher.feed(decoder.flush()) + matcher.flush()
            if tail:
                yield tail
    except GeneratorExit:  # closed at a yield: the cache is whole
        if on_done is not None:
            on_done(tokens.held_ids(), tokens.settle())
        raise
    else:
        logits = tokens.settle()
        if on_done is not None:
            on_done(tokens.held_ids(), logits)
    finally:
        stats.decode_seconds = time.perf_counter() - t0
        stats.context_shifts = tokens.shifts
