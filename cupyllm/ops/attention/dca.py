"""Dual Chunk Attention (ChunkLlama; Qwen2.5-1M, vLLM's dual-chunk rotary embedding): training-free context
extension. Position remaps and regime masks are computed here on the host, in NumPy.

With chunk_size S (default: the model's trained context) and local_size W (default S/32), chunk_len L = S - W and
chunk(p) = p // L:
- keys are roped once at  p_k = j mod L  (the same in every regime, so K is cached with it);
- intra      (chunk(j) == chunk(i)):      query position  i mod L                 (true distances);
- successive (chunk(j) == chunk(i) - 1):  query position  min(i mod L + L, S);
- inter      (chunk(j) <  chunk(i) - 1):  query position  min(2L - 1, S).
Every query-key distance stays within S. Each regime is causal softmax attention over its own keys; the three
key sets partition the causal triangle, so merging the three partial results by log-sum-exp is exactly
attention over the remapped scores. When the whole sequence fits in one chunk, DCA is plain attention.
`yarn_factor` f > 1 adds YaRN's attention temperature: logits scaled by (0.1 ln f + 1)^2 (YaRN scales both
q and k by 0.1 ln f + 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...errors import CupyllmError
from .reference import attend, causal_mask, merge, nothing_seen

INTRA, SUCCESSIVE, INTER = 0, 1, 2


@dataclass(frozen=True)
class DCAConfig:
    chunk_size: int  # S
    local_size: int  # W
    yarn_factor: float = 1.0

    def __post_init__(self):
        if not 0 < self.local_size < self.chunk_size:
            raise CupyllmError(f"DCA needs 0 < local_size < chunk_size, got local_size={self.local_size}, "
                               f"chunk_size={self.chunk_size}")
        if self.yarn_factor < 1.0:
            raise CupyllmError(f"DCA yarn factor must be >= 1 (1 = off), got {self.yarn_factor}")

    @classmethod
    def for_model(cls, ctx_train: int, chunk_size: int | None = None, local_size: int | None = None,
                  yarn_factor: float = 1.0) -> "DCAConfig":
        chunk = int(chunk_size or ctx_train)
        return cls(chunk, int(local_size or chunk // 32), float(yarn_factor))

    @property
    def chunk_len(self) -> int:  # L
        return self.chunk_size - self.local_size

    @property
    def logit_scale(self) -> float:
        mscale = 0.1 * math.log(self.yarn_factor) + 1.0
        return mscale * mscale


def key_positions(positions: np.ndarray, dca: DCAConfig) -> np.ndarray:
    return np.asarray(positions) % dca.chunk_len


def query_positions(positions: np.ndarray, dca: DCAConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(intra, successive, inter) rope positions of queries at true positions `positions`."""
    L, S = dca.chunk_len, dca.chunk_size
    in_chunk = np.asarray(positions) % L
    successive = np.minimum(in_chunk + L, S)
    inter = np.full_like(in_chunk, min(2 * L - 1, S))
    return in_chunk, successive, inter


def regimes(q_pos: np.ndarray, k_pos: np.ndarray, dca: DCAConfig, window: int = 0) -> np.ndarray:
    """int8 [n_q, n_k]: INTRA / SUCCESSIVE / INTER for causal pairs, -1 where the key is masked
    (in the future of the query, or an empty cache slot with position < 0, or outside `window` as
    reference.causal_mask reads it: a mixed cache's parts, kv/window.py)."""
    q = np.asarray(q_pos)[:, None]
    k = np.asarray(k_pos)[None, :]
    gap = q // dca.chunk_len - k // dca.chunk_len
    regime = np.where(gap == 0, INTRA, np.where(gap == 1, SUCCESSIVE, INTER)).astype(np.int8)
    return np.where(causal_mask(q_pos, k_pos, window), regime, np.int8(-1))


def attend_dca(q_intra, q_successive, q_inter, k, v, q_pos, k_pos, dca: DCAConfig, *, scale: float,
               softcap: float = 0.0, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """DCA over one block of keys (k roped at key_positions): three masked attentions merged by LSE."""
    regime = regimes(q_pos, k_pos, dca, window)
    scale = scale * dca.logit_scale
    out = lse = None
    for which, q in ((INTRA, q_intra), (SUCCESSIVE, q_successive), (INTER, q_inter)):
        allowed = regime == which
        if not allowed.any():
            continue
        part = attend(q, k, v, allowed, scale=scale, softcap=softcap)
        out, lse = part if out is None else merge(out, lse, *part)
    if out is None:  # no query sees any key of this block
        return nothing_seen(*q_intra.shape[:2], v.shape[-1])
    return out, lse
