"""One forward pass over several sequences, each with its own KV cache (the server's continuous batching).

The sequences' tokens are concatenated into one stream of rows, so every matmul reads each weight once for
all of them (the GEMV / GEMM over n rows, the batched kernels on the GPU); attention is the only place a block
looks at a cache, and it goes through Transformer.attention's hook (models/layers.py default_attention, or
Dual Chunk Attention's): `SequenceAttention` splits q / k / v by sequence and calls that attention on each
sequence's rows with that sequence's cache and positions, then concatenates the outputs. Everything else a
block does (norms, RoPE inside attention, MLPs, Gemma 4's per-layer inputs, MoE routing) is per row.

Gemma 4's KV-shared layers (k None) read the source layer of the sequence's own cache, as the cache aliases
it; sliding-window layers mask by the sequence's own positions. The hybrid Qwen3.5 families' DeltaNet layers ask
the cache for their recurrent states (`recurrent_parts`): the batched forward's stand-in gives each sequence's
rows its own state, and the conv and the delta rule run sequence by sequence between batched projections.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..kv.cache import KVCache
from ..ops.matmul.reference import FLOAT_TYPES
from .build import Transformer
from .layers import attend_rotated, default_attention, rotate


@dataclass(frozen=True)
class Segment:
    """One sequence's part of a batched forward: its tokens, run from cache.n_past on, and whether it wants the
    logits of every token (a drafted run being verified) or of its last one."""

    tokens: np.ndarray
    cache: KVCache
    all_logits: bool = False


class SegmentwiseFloatOps:
    """The backend, except that a float weight multiplies each sequence's rows by themselves, as that sequence's
    own forward does. The CPU sends a prefill's float weights to BLAS (float32 as they are, F16 / BF16 through
    float32 tiles), whose kernel for more rows can round differently (other formats go through the GEMV, row by
    row, up to TOKENS_PER_GEMV rows and the GEMM, whose rows are independent, past them); the few float
    matrices of the GGUFs (small ones, or the tiny test models' K / V) cost little this way, and a batched decode
    or a batch of prompts then gives each sequence the very logits it gets alone."""

    def __init__(self, ops, bounds: Sequence[int]):
        self._ops, self._bounds = ops, list(bounds)

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def _rowwise(self, x, weight) -> bool:
        return x.shape[0] > 1 and weight.fmt.qtype in FLOAT_TYPES

    def linear(self, x, weight, bias=None):
        if not self._rowwise(x, weight):
            return self._ops.linear(x, weight, bias)
        # all rows: each sequence's together; a subset (a mixture of experts' routed rows): row by row, as a
        # one-token step multiplies its chosen experts
        bounds = self._bounds if x.shape[0] == self._bounds[-1] else range(x.shape[0] + 1)
        return self._ops.xp.concatenate([self._ops.linear(x[a:b], weight, bias)
                                         for a, b in zip(bounds[:-1], bounds[1:])])

    def linear_many(self, x, weights, biases=None):
        if not any(self._rowwise(x, w) for w in weights):
            return self._ops.linear_many(x, weights, biases)
        biases = list(biases or ()) + [None] * (len(weights) - len(biases or ()))
        return [self.linear(x, w, b) for w, b in zip(weights, biases)]

    def linear_grouped(self, xs, groups, bounds):
        if not any(self._rowwise(xs, w) for w in groups[0]):
            return self._ops.linear_grouped(xs, groups, bounds)
        # an expert's routed rows, row by row (as linear's subset)
        by_row = [weights for weights, a, b in zip(groups, bounds, bounds[1:]) for _ in range(a, b)]
        return self._ops.linear_grouped(xs, by_row, np.arange(xs.shape[0] + 1))

    def gated_linear(self, x, w_gate, activation, w_up=None, up=None):
        gate, up = self.linear_many(x, (w_gate, w_up)) if w_up is not None else (self.linear(x, w_gate), up)
        return self._ops.gated_act(gate, up, activation)


class _SequenceCaches:
    """What the blocks get as `cache` in a batched forward: there is no one cache. A DeltaNet layer's states come
    per sequence (recurrent_parts); anything else a block reads outside the attention hook is a block this module
    does not know how to batch."""

    def __init__(self, bounds: Sequence[int], caches: Sequence[KVCache]):
        self.bounds, self.caches = list(bounds), list(caches)

    def recurrent_parts(self, layer: int):
        return [(slice(self.bounds[i], self.bounds[i + 1]), cache.layers[layer])
                for i, cache in enumerate(self.caches)]

    def __getattr__(self, name):
        raise TypeError(f"a block read cache.{name} outside attention: this architecture cannot be batched "
                        "(models/batch.py)")


class SequenceAttention:
    """The attention hook of a batched forward: rows [bounds[i], bounds[i + 1]) belong to caches[i]. The plain
    attention's RoPE and q / k norms work row by row, so they run once for all rows (one rope table per step,
    not one per sequence); the cache writes and the attention, per sequence."""

    def __init__(self, inner: Callable | None, bounds: Sequence[int], caches: Sequence[KVCache]):
        self.inner = inner or default_attention
        self.bounds, self.caches = list(bounds), list(caches)

    def __call__(self, ops, cfg, w, layer, q, k, v, positions, cache):
        if self.inner is default_attention:  # RoPE (and the q / k norms) row by row: all sequences' rows at once
            q, k = rotate(ops, cfg, w, layer, q, k, positions)
        outs = []
        for i, seq_cache in enumerate(self.caches):
            rows = slice(self.bounds[i], self.bounds[i + 1])
            q_rows, k_rows, v_rows = q[rows], None if k is None else k[rows], None if v is None else v[rows]
            if self.inner is default_attention:
                outs.append(attend_rotated(ops, cfg, layer, q_rows, k_rows, v_rows, positions[rows], seq_cache))
            else:
                outs.append(self.inner(ops, cfg, w, layer, q_rows, k_rows, v_rows, positions[rows], seq_cache))
        return outs[0] if len(outs) == 1 else ops.xp.concatenate(outs, axis=0)


def forward_batch(transformer: Transformer, segments: Sequence[Segment]) -> list[np.ndarray]:
    """Run every segment's tokens at its cache's next positions (from cache.n_past) in one forward, writing
    their K / V; as with Transformer.forward, the caller advances each cache's n_past. Returns per segment its
    logits on the host, float32 [n_tokens or 1, n_vocab]. The same computation as Transformer.forward on each
    segment alone (build.py), row for row."""
    ops, cfg = transformer.ops, transformer.cfg
    if len({id(s.cache) for s in segments}) != len(segments):
        raise ValueError("each segment of a batched forward needs its own cache")
    lengths = [len(s.tokens) for s in segments]
    for s, n in zip(segments, lengths):
        s.cache.check_room(n)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate([np.asarray(s.tokens, np.int64) for s in segments])
    positions = np.concatenate([np.arange(s.cache.n_past, s.cache.n_past + n) for s, n in zip(segments, lengths)])
    if len(segments) == 1:
        attention, cache = transformer.attention, segments[0].cache
    else:
        caches = [s.cache for s in segments]
        attention, cache = SequenceAttention(transformer.attention, bounds, caches), _SequenceCaches(bounds, caches)
        if transformer.ops.name == "cpu":
            ops = SegmentwiseFloatOps(ops, bounds)

    normed = transformer.hidden(tokens, positions, cache, attention, ops)
    rows = np.concatenate([np.arange(bounds[i], bounds[i + 1]) if s.all_logits else [bounds[i + 1] - 1]
                           for i, s in enumerate(segments)]).astype(np.int64)
    picked = normed if len(rows) == len(tokens) else normed[ops.asarray(rows)]
    counts = [n if s.all_logits else 1 for s, n in zip(segments, lengths)]
    if isinstance(ops, SegmentwiseFloatOps):  # the output rows: each segment's picked ones
        ops = SegmentwiseFloatOps(transformer.ops, np.concatenate([[0], np.cumsum(counts)]))
    logits = np.asarray(ops.to_numpy(transformer.logits(picked, ops)), dtype=np.float32)
    return np.split(logits, np.cumsum(counts)[:-1])
