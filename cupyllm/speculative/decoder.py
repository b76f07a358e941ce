"""The decode loop's token source: one target forward per token, or, with a drafter, a verified run of drafts.

Without a drafter each token is drawn from the logits after everything before it, and the token is run through
the model only when the next one is asked for (so the last token of a generation is never run). With one, the
step that runs the pending token also runs up to k drafted tokens after it, in one forward (the prefill path):

    logits L_0 .. L_k = Target(pending, d_1 .. d_k)        (L_j: after pending, d_1 .. d_j)
    for j = 1 .. k:  t_j = Sampler.verify(L_{j-1}, d_j)     (kept, or the residual draw that ends the run)
    all k kept:      t_{k+1} = Sampler(L_k)                 (one more token for free)

Every emitted token is distributed exactly as plain decoding's (greedy: the same tokens), and the cache is
rewound to what was emitted (KVCache.rewind; a hybrid model's recurrent states go back to their mark and the
kept tokens run again). The caller sees one token at a time and applies its stop rules to each, as without a
drafter; settle() puts the cache where plain decoding would have it when the caller stops.

With a context shift (kv/shift.py ContextShift), a step that would not fit the cache first shifts it: only
between steps, never inside a verify run's mark, so rewinds stay within one layout. The cache then holds
the tokens of history less the spans dropped (`held`), which drafters see in place of the whole history.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from ..kv.cache import KVCache
from ..sampling import Sampler


# the most tokens a verify forward runs: the CPU's few-query attention and multi-token GEMV take this many with
# the values of one-token steps (longer runs take the prefill paths, whose sums differ in the last bits)
MAX_RUN_TOKENS = 16


@dataclass(frozen=True)
class DraftContext:
    """The kind of draft a drafter is about to make (NgramDrafter: how long its match runs), and the acceptance
    rate to expect of a kind not seen yet."""

    kind: object
    prior: float


class Drafter(Protocol):
    """Proposes tokens to follow `history`: at most n_max of them (fewer, or none, when it has no good guess).
    A drafter may also have `context(history) -> DraftContext`, cheap; DraftLength then keeps the acceptance
    rates of each kind of draft apart."""

    def draft(self, history: Sequence[int], n_max: int) -> list[int]: ...


@dataclass
class DraftStats:
    drafted: int = 0  # draft tokens the target checked
    accepted: int = 0  # of them, kept
    forwards: int = 0  # target forwards of the decode (verify steps and plain steps)
    emitted: int = 0  # tokens those forwards produced
    by_position: list[list[int]] = field(default_factory=list)  # [drafted, accepted] per draft position

    def count(self, n_drafted: int, n_accepted: int) -> None:
        self.drafted += n_drafted
        self.accepted += n_accepted
        while len(self.by_position) < n_drafted:
            self.by_position.append([0, 0])
        for j in range(n_drafted):
            self.by_position[j][0] += 1
            self.by_position[j][1] += j < n_accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.forwards if self.forwards else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [accepted / drafted for drafted, accepted in self.by_position]


class DraftLength:
    """How many tokens to draft: as many as pay for themselves. Keeps the acceptance rate of each draft
    position (given the one before was kept) and what a target forward of n tokens costs beside a one-token
    forward, each n's measured as the generation goes (the CPU's costs are not a line: a few tokens take the
    GEMV token by token, more the GEMM's tiles), plus the drafter's own time, and drafts the k that maximises

        expected tokens per step / cost(k + 1),   expected tokens = 1 + sum_{i<=k} prod_{j<=i} a_j

    (0, plain decoding, when no k beats 1). A length not measured yet is costed 1 + prior_slope (n - 1), which
    is optimistic, so each length gets tried once. A drafter that keeps missing stops being asked, and is
    asked for one token again every `probe_every` plain steps in case the text turned predictable.
    adaptive=False: always n_max (where it fits)."""

    def __init__(self, n_max: int, n_min: int = 0, adaptive: bool = True, prior: float = 0.5,
                 prior_slope: float = 0.2, probe_every: int = 16):
        self.n_max, self.n_min, self.adaptive = n_max, n_min, adaptive
        self.prior = prior
        # the drafter's context -> (acceptance of position j given j - 1 kept, decayed mean; verdicts seen there)
        self.rates: dict = {}
        self.seconds: dict[int, float] = {}  # tokens in a forward -> decayed mean seconds
        self.prior_slope = prior_slope
        self.draft_seconds = None  # decayed mean seconds the drafter takes per drafted token
        self.plain_steps = 0
        self.probe_every = probe_every

    def cost(self, n_tokens: int) -> float:
        """A forward of n_tokens in one-token forwards (measured, else the prior)."""
        one = self.seconds.get(1)
        if one and n_tokens in self.seconds:
            return max(self.seconds[n_tokens] / one, 1.0)
        return 1.0 + self.prior_slope * (n_tokens - 1)

    def rate(self, context: DraftContext | None = None) -> np.ndarray:
        """The acceptance rates by position of drafts made in `context` (Drafter.context; None: one table). A
        position no verdict has reached yet takes the rate of the one before it (a draft kept so far is as
        likely to go on), the first one the context's prior."""
        if context not in self.rates:
            prior = self.prior if context is None else context.prior
            self.rates[context] = (np.full(self.n_max, prior), np.zeros(self.n_max, np.int64))
        rate, seen = self.rates[context]
        carried = rate.copy()
        for j in range(1, self.n_max):
            if not seen[j]:
                carried[j] = carried[j - 1]
        return carried

    def choose(self, room: int, context=None) -> int:
        """Draft length for the next step (at most `room`), the drafter's next draft made in `context`."""
        limit = min(self.n_max, room)
        if limit <= 0 or not self.adaptive:
            return max(limit, 0)
        one = self.seconds.get(1)
        drafting = self.draft_seconds / one if one and self.draft_seconds else 0.0
        best_k, best = 0, 1.0
        expected, kept = 1.0, 1.0
        rate = self.rate(context)
        for k in range(1, limit + 1):
            kept *= rate[k - 1]
            expected += kept
            gain = expected / (self.cost(k + 1) + k * drafting)
            if gain > best:
                best_k, best = k, gain
        if best_k == 0 and self.plain_steps >= self.probe_every:
            best_k = 1  # a probe: the rates only learn from drafts
        if best_k and best_k < self.n_min:
            best_k = min(limit, self.n_min)
        return best_k

    def observe(self, n_tokens: int, seconds: float, n_drafted: int, n_accepted: int,
                draft_seconds: float = 0.0, context=None) -> None:
        """One step's outcome: a target forward of n_tokens took `seconds`, n_accepted of its n_drafted drafts
        (made in `context`) were kept, and drafting them took draft_seconds."""
        old = self.seconds.get(n_tokens)
        self.seconds[n_tokens] = seconds if old is None else 0.8 * old + 0.2 * seconds
        if n_drafted:
            self.plain_steps = 0
            per_token = draft_seconds / n_drafted
            self.draft_seconds = per_token if self.draft_seconds is None else 0.8 * self.draft_seconds + 0.2 * per_token
        else:
            self.plain_steps += 1
        carried = self.rate(context)
        rate, seen = self.rates[context]
        for j in range(min(n_drafted, n_accepted + 1)):  # positions the verdict reached
            rate[j] = 0.7 * carried[j] + 0.3 * (j < n_accepted)
            seen[j] += 1


class ContextFull(Exception):
    """The cache has no room for the next step and no context shift can make any."""


class TokenSource:
    """Tokens one at a time after a prefilled cache; see the module docstring. `history`: every token the
    cache holds (the prompt), extended with each token handed out; `logits`: those after the last of them.
    `shift`: a ContextShift (kv/shift.py) that frees room when a step would not fit; None: ContextFull then."""

    def __init__(self, forward: Callable, cache: KVCache, sampler: Sampler, history: list[int], logits,
                 drafter: Drafter | None = None, length: DraftLength | None = None,
                 stats: DraftStats | None = None, shift=None):
        if drafter is not None and length is None:
            raise ValueError("a drafter needs a DraftLength")
        self.forward, self.cache, self.sampler = forward, cache, sampler
        self.history = history
        self.drafter, self.length = drafter, length
        self.stats = stats if stats is not None else DraftStats()
        self._logits = logits  # after the cache's last position (valid when the cache holds all of history)
        self._queue: list[tuple[int, np.ndarray]] = []  # verified tokens not handed out, with their logits
        self._last_logits = None  # the logits the last handed-out token was drawn from
        self._mark, self._run = None, None  # the last step's cache mark (None: no drafts) and the tokens it ran
        self.shift = shift
        self.shifts = 0  # context shifts made
        self.held = history  # the tokens at the cache's positions, and the pending one: history until a shift

    def next(self, room: int) -> int:
        """The next token; `room`: how many more tokens the caller may still take, this one included (drafts
        never run past it, nor past the context)."""
        if not self._queue:
            if self.cache.n_past == len(self.held):  # the first token: drawn from the prefill's logits
                self._queue.append((self.sampler(np.asarray(self._logits).reshape(-1), self.history), self._logits))
            else:
                self._step(room)
                self.stats.forwards += 1
        if self._last_logits is not None:
            self.stats.emitted += 1  # (a token after the first: a decode forward's)
        token, self._last_logits = self._queue.pop(0)
        self.history.append(token)
        if self.held is not self.history:
            self.held.append(token)
        return token

    def _step(self, room: int) -> None:
        """Run the pending token (the last handed out), with drafts after it when they pay, and queue the
        verified tokens."""
        cache = self.cache
        if cache.n_past + 1 > cache.spec.ctx:  # the pending token has no position: shift (between steps only)
            dropped = self.shift.make_room(cache) if self.shift is not None else None
            if dropped is None:
                raise ContextFull(f"the context of {cache.spec.ctx} tokens is full")
            if self.held is self.history:
                self.held = list(self.history)
            del self.held[dropped[0]:dropped[0] + dropped[1]]
            self.shifts += 1
        start = cache.n_past
        k, context = 0, None
        if self.drafter is not None:  # (a sliding window's ring has max_chunk spare slots for a run)
            if hasattr(self.drafter, "context"):
                context = self.drafter.context(self.held)
            k = self.length.choose(min(room - 1, cache.spec.ctx - start - 1, cache.spec.max_chunk - 1,
                                       MAX_RUN_TOKENS - 1), context)
        t0 = time.perf_counter()
        drafts = [int(t) for t in self.drafter.draft(self.held, k)][:k] if k > 0 else []
        draft_seconds = time.perf_counter() - t0
        tokens = np.array([self.history[-1], *drafts], dtype=np.int64)
        mark = cache.mark() if drafts else None
        t0 = time.perf_counter()
        logits = self.forward(tokens, np.arange(start, start + len(tokens)), cache, all_logits=bool(drafts))
        cache.n_past += len(tokens)
        logits = np.asarray(logits).reshape(len(tokens) if drafts else 1, -1)
        seconds = time.perf_counter() - t0
        kept = 0
        # the tokens before each verified one, as far back as the sampler's repeat penalty reads (not a copy of
        # the whole history every step)
        recent = self.sampler.params.repeat_last_n
        verified = self.history[len(self.history) - recent:] if recent > 0 else []
        for j, draft in enumerate(drafts):
            token, accepted = self.sampler.verify(logits[j], verified, draft)
            self._queue.append((token, logits[j]))
            verified.append(token)
            if not accepted:
                break
            kept += 1
        if kept == len(drafts):  # every draft kept (or none made): one more token from the last logits
            self._queue.append((self.sampler(logits[-1], verified), logits[-1]))
        if drafts:
            self.stats.count(len(drafts), kept)
        if self.length is not None:
            self.length.observe(len(tokens), seconds, len(drafts), kept, draft_seconds, context)
        # the cache must hold the tokens before the last queued one: the run's first 1 + kept
        self._mark, self._run = mark, tokens
        self._rewind(start + 1 + kept)

    def held_ids(self, pending: bool = False) -> list[int]:
        """The tokens the cache holds, in order (history itself until a context shift drops some); pending: with
        the last handed-out token, which the next step runs, after them."""
        return self.held[:self.cache.n_past + pending]

    def _rewind(self, n_keep: int) -> None:
        """Cut the cache back to n_keep positions, within the last step's run (self._run, from the mark)."""
        if n_keep == self.cache.n_past:
            return
        mark = self._mark
        held = self.cache.rewind(mark, n_keep)
        if held < n_keep:  # a hybrid's recurrent states went back to the mark: run the kept tokens again
            self.forward(self._run[held - mark.n_past:n_keep - mark.n_past], np.arange(held, n_keep), self.cache)
            self.cache.n_past = n_keep

    def settle(self):
        """Put the cache where plain decoding would have it now (holding every handed-out token but the last)
        and return the logits after its last position."""
        if self._last_logits is None:  # nothing handed out: the cache holds all of history
            return self._logits
        self._rewind(len(self.held) - 1)  # (only a step with drafts can hold more: it has a mark)
        self._queue.clear()
        return self._last_logits
