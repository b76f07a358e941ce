"""One-token decode steps replayed as CUDA graphs.

A decode step launches a few hundred small kernels (per layer: norms, GEMVs, RoPE, the cache write,
attention, the MLP); from Python each launch costs microseconds, which at 1-token batches is most of the
step. `DecodeGraphs` captures the whole forward pass of one token once and replays it:

- the token id and position are read from two fixed int32 device buffers, written before each replay
  (DeviceInputs.pin maps the host placeholders the model code sees to them, so no upload is captured);
- attention reads `n_used` slots, a kernel argument fixed at capture: every layer's `n_used` is padded
  up to the step's power-of-two length bucket (empty slots hold position -1 and are masked), so one
  graph serves every position in [bucket / 2, bucket) and a new one is captured per bucket;
- everything the captured kernels allocate comes from a memory pool private to the graph, which nothing
  else allocates from, so the replays own those buffers.

The first step of a bucket runs eagerly (it also warms the private pool), then the graph is captured;
the later steps of the bucket replay it. A capture that fails (an operation that cannot be captured)
turns graphs off for this runner, with the reason kept in `disabled_reason`, and steps run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def length_bucket(n_keys: int, min_bucket: int) -> int:
    """The power of two >= n_keys (at least min_bucket)."""
    bucket = max(1, min_bucket)
    while bucket < n_keys:
        bucket *= 2
    return bucket


@dataclass
class _Captured:
    graph: object
    pool: object  # the private memory pool holding the graph's buffers
    logits: object  # the output buffer the graph writes
    token: object  # int32 [1] device buffers read by the graph
    position: object
    token_host: np.ndarray  # the placeholders the model code saw during capture
    position_host: np.ndarray


class DecodeGraphs:
    """Callable like Transformer.forward(tokens, positions, cache, all_logits=False)."""

    def __init__(self, forward, backend, min_bucket: int = 256):
        self.forward = forward
        self.backend = backend
        self.min_bucket = min_bucket
        self.enabled = True
        self.disabled_reason = ""
        self.captures = 0
        self.replays = 0
        self._graphs: dict[tuple, _Captured] = {}
        self._stream = None

    def __call__(self, tokens, positions, cache, all_logits: bool = False):
        tokens = np.asarray(tokens)
        positions = np.asarray(positions)
        if not self.enabled or len(tokens) != 1:
            return self.forward(tokens, positions, cache, all_logits)
        bucket = length_bucket(int(positions[0]) + 1, self.min_bucket)
        key = (id(cache), bucket, bool(all_logits))
        captured = self._graphs.get(key)
        if captured is None:
            return self._run_and_capture(key, tokens, positions, cache, all_logits, bucket)
        return self._replay(captured, tokens, positions, cache)

    def reset(self) -> None:
        """Drop every captured graph (e.g. when the cache they read is discarded)."""
        for captured in self._graphs.values():
            self.backend.inputs.unpin(captured.token_host)
            self.backend.inputs.unpin(captured.position_host)
        self._graphs.clear()

    # ------------------------------------------------------------------------------------------------
    def _own_stream(self):
        """The capture stream, ordered after the work already queued on the caller's stream (it is
        non-blocking, so it does not wait for the legacy default stream by itself)."""
        cp = self.backend.cp
        if self._stream is None:
            self._stream = cp.cuda.Stream(non_blocking=True)
        self._stream.wait_event(cp.cuda.get_current_stream().record())
        return self._stream

    def _pad(self, cache, bucket: int) -> None:
        for layer in cache.own_layers():
            layer.pad_used(bucket)

    def _run_and_capture(self, key, tokens, positions, cache, all_logits, bucket):
        cp = self.backend.cp
        inputs = self.backend.inputs
        self._pad(cache, bucket)
        token_host = np.array(tokens, copy=True)
        position_host = np.array(positions, copy=True)
        token = cp.asarray(tokens.astype(np.int32))
        position = cp.asarray(positions.astype(np.int32))
        inputs.pin(token_host, token)
        inputs.pin(position_host, position)
        try:
            stream = self._own_stream()
            pool = cp.cuda.MemoryPool()
            with cp.cuda.using_allocator(pool.malloc), stream:
                logits = self.forward(token_host, position_host, cache, all_logits)  # this step, eagerly
                result = logits.copy()
                del logits
                inputs.uploads_forbidden = True
                stream.begin_capture()
                try:
                    graph_logits = self.forward(token_host, position_host, cache, all_logits)
                finally:
                    graph = stream.end_capture()
                    inputs.uploads_forbidden = False
            stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - whatever cannot be captured: run eagerly from now on
            inputs.unpin(token_host)
            inputs.unpin(position_host)
            self.enabled = False
            self.disabled_reason = f"{type(exc).__name__}: {exc}"
            cp.cuda.Device().synchronize()
            # the eager step may have run (partly): running it again rewrites the same cache slots
            return self.forward(tokens, positions, cache, all_logits)
        self._graphs[key] = _Captured(graph, pool, graph_logits, token, position, token_host, position_host)
        self.captures += 1
        return result

    def _replay(self, captured: _Captured, tokens, positions, cache):
        stream = self._own_stream()
        with stream:
            captured.token.set(tokens.astype(np.int32))
            captured.position.set(positions.astype(np.int32))
            captured.graph.launch(stream=stream)
            out = captured.logits.copy()
        stream.synchronize()
        # host-side effects of a forward pass that the replay skipped: slots hold keys up to the position
        position = int(positions[0])
        for layer in cache.own_layers():
            slot = position % layer.capacity if layer.ring else position
            layer.n_used = max(layer.n_used, slot + 1)
        self.replays += 1
        return out
