"""Samplers, applied in llama.cpp's default order: repeat penalty -> top-k -> top-p -> min-p -> temperature
-> draw. A temperature <= 0 is greedy. A seed makes the draws reproducible."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import SamplingError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64
    seed: int | None = None  # None or negative (llama.cpp's -1): a fresh random seed

    def __post_init__(self):
        wrong = [f"{name} {value} (need {rule})" for name, value, ok, rule in (
            ("temperature", self.temperature, math.isfinite(self.temperature),
             "a finite number; 0 or below is greedy"),
            ("top-k", self.top_k, self.top_k >= 0, ">= 0; 0 turns it off"),
            ("top-p", self.top_p, 0.0 < self.top_p <= 1.0, "0 < top-p <= 1; 1 turns it off"),
            ("min-p", self.min_p, 0.0 <= self.min_p <= 1.0, "0 <= min-p <= 1; 0 turns it off"),
            ("repeat penalty", self.repeat_penalty, 0 < self.repeat_penalty < math.inf,
             "> 0 and finite; 1 turns it off"),
            ("repeat-last-n", self.repeat_last_n, self.repeat_last_n >= 0, ">= 0; 0 turns the penalty off"))
            if not ok]
        if wrong:
            raise SamplingError("sampling parameter out of range: " + "; ".join(wrong))


def apply_repeat_penalty(logits: np.ndarray, recent: np.ndarray, penalty: float) -> np.ndarray:
    """llama.cpp's rule: divide positive logits of recent tokens by the penalty, multiply negative ones."""
    if penalty == 1.0 or len(recent) == 0:
        return logits
    ids = np.unique(recent)
    vals = logits[ids]
    logits = logits.copy()
    logits[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def by_logit(logits: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """`ids` (default: every token) ordered by logit descending, equal logits by smaller id (NaN last)."""
    ids = np.arange(len(logits)) if ids is None else ids
    return ids[np.lexsort((ids, -logits[ids]))]


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits (0 < k < len), largest first, equal logits by smaller id: the first k of a
    stable descending sort, found without sorting the vocabulary. The k-th largest logit of a strided sample
    that holds at least k values bounds the k-th largest of all from below, so only the logits at or above it
    (about k * stride of them) are looked at again. NaN is never a candidate."""
    n = len(logits)
    stride = max(1, int(np.sqrt(n / k)))  # the sample (>= sqrt(n k) >= k values) and the pool about equal
    sample = logits[::stride]
    sample = sample[sample == sample]
    if len(sample) < k:  # mostly NaN: the sort itself
        return by_logit(logits)[:k]
    bound = np.partition(sample, len(sample) - k)[len(sample) - k]
    pool = np.flatnonzero(logits >= bound)  # ascending ids; >= k of them
    vals = logits[pool]
    if len(pool) > k:
        kth = np.partition(vals, len(vals) - k)[len(vals) - k]
        above = np.flatnonzero(vals > kth)
        ties = np.flatnonzero(vals == kth)[:k - len(above)]  # the smallest ids of the k-th value
        keep = np.concatenate([above, ties])
        pool = pool[keep]
    return by_logit(logits, pool)


def candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Surviving token ids and their logits after top-k, top-p and min-p, sorted by logit descending (equal
    logits by id). Only the tokens that can survive are sorted: the top k, or with top-k off and min-p on those
    within min-p of the largest (top-p then divides by the sum over the whole vocabulary, as it would).
    bench/sampling.py times it against the filter over sorted logits."""
    n = len(logits)
    total = None  # the top-p normaliser, when it is not the survivors' own sum
    if 0 < p.top_k < n:
        ids = top_k_ids(logits, p.top_k)
    elif p.min_p > 0.0:
        largest = np.float64(np.nanmax(logits))
        floor = np.nextafter(np.float32(largest + np.log(p.min_p)), np.float32(-np.inf))  # a superset
        ids = by_logit(logits, np.flatnonzero(logits >= floor))
        if p.top_p < 1.0:  # float32 exps summed in float64 (~1e-8 relative; float64 exps cost 10x)
            shifted = np.exp(logits - np.float32(largest))
            total = float(np.sum(shifted, dtype=np.float64, where=shifted == shifted))
    else:
        ids = by_logit(logits)
    vals = logits[ids].astype(np.float64)
    if p.top_p < 1.0:
        probs = np.exp(vals - vals[0])
        probs /= probs.sum() if total is None else total
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)  # smallest prefix reaching top_p
        ids, vals = ids[:keep], vals[:keep]
    if p.min_p > 0.0:
        keep = vals >= vals[0] + np.log(p.min_p)  # p_i >= min_p * p_max
        ids, vals = ids[keep], vals[keep]
    return ids, vals


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(None if params.seed is None or params.seed < 0 else params.seed)

    def _penalized(self, logits: np.ndarray, history) -> np.ndarray:
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        recent = np.asarray(history[-p.repeat_last_n:] if p.repeat_last_n > 0 else [], dtype=np.int64)
        return apply_repeat_penalty(logits, recent, p.repeat_penalty)

    def distribution(self, logits: np.ndarray, history: list[int] | np.ndarray = ()) -> tuple[np.ndarray, np.ndarray]:
        """The tokens a draw can give after `history` and their probabilities (float64, summing to 1): after the
        repeat penalty, top-k, top-p, min-p and temperature; greedy: the argmax with probability 1."""
        logits = self._penalized(logits, history)
        if self.params.temperature <= 0.0:
            return np.array([int(np.argmax(logits))]), np.ones(1)
        ids, vals = candidates(logits, self.params)
        weights = np.exp((vals - vals[0]) / self.params.temperature)
        return ids, weights / weights.sum()

    def __call__(self, logits: np.ndarray, history: list[int] | np.ndarray = ()) -> int:
        ids, probs = self.distribution(logits, history)
        if self.params.temperature <= 0.0:  # greedy: no draw, the random stream is not advanced
            return int(ids[0])
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def verify(self, logits: np.ndarray, history: list[int] | np.ndarray, draft: int,
               draft_probs: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[int, bool]:
        """Speculative sampling's acceptance test (Leviathan et al. 2023, Chen et al. 2023) for a token `draft`
        proposed after `history`: (the token to emit, whether it is the draft). The draft is kept with
        probability min(1, p(draft) / q(draft)), p this sampler's distribution after `history` and q the
        drafter's (`draft_probs` = (ids, probs); None: the drafter chose `draft` deterministically, q = 1 there);
        otherwise the token is drawn from the residual max(0, p - q), renormalised. The emitted token is then
        distributed exactly as a plain draw from p, whatever the drafter does. Greedy: the argmax, kept when it
        is the draft."""
        ids, probs = self.distribution(logits, history)
        if self.params.temperature <= 0.0:
            return int(ids[0]), int(ids[0]) == draft
        p_draft = float(probs[ids == draft].sum())
        q = np.zeros(len(ids))
        if draft_probs is None:
            q_draft = 1.0
            q[ids == draft] = 1.0
        else:
            q_ids, q_probs = draft_probs
            q_draft = float(q_probs[q_ids == draft].sum())
            lookup = dict(zip(q_ids.tolist(), q_probs.tolist()))
            q = np.array([lookup.get(t, 0.0) for t in ids.tolist()])
        if q_draft > 0.0 and self.rng.random() * q_draft < p_draft:
            return draft, True
        residual = np.maximum(probs - q, 0.0)
        total = residual.sum()
        if total <= 0.0:  # p <= q everywhere p lives: only rounding can get here; p itself is then the residual
            residual, total = probs, 1.0
        return int(ids[self.rng.choice(len(ids), p=residual / total)]), False
