"""Context shift: when a generation fills the cache, forget positions [keep, keep + discard), move every later
position down by `discard` and rotate its stored K by the shift, then go on (llama.cpp's --context-shift,
n_keep / n_discard; the first tokens stay because attention leans on them: StreamingLLM's attention sinks).

K is stored after RoPE, so moving a key from position p to p - d is a rotation of each stored rotary pair by
-d times its frequency (RoPE's angles add). It is a pure rotation: YaRN's magnitude factor (mscale) is already
in the stored key and is not applied again, so nothing compounds over many shifts. Each format goes through its
own codec: decode (block formats dequantize; rotated formats, turbo and TCQ, unrotate), rotate by the shift,
encode again (quantize; rotate back). Normalised K (LayerKV.k_offset / k_scale) is denormalised before the
rotation and normalised again after it with the same offset and scale. V does not depend on the position: its
rows move as stored bytes.

Layouts: a global layer's slot is its position; a sliding-window ring's slot is position % capacity, so every
row it holds moves to the slot of its new position (what a ring evicted before the shift stays gone); Dual
Chunk Attention stores keys roped at `p mod L` (ops/attention/dca.py key_positions), so each moved key turns
by (new mod L) - (old mod L); a spilled cache (kv/gpu_spill.py) holds positions [0, n_host) on the host and
the rest in its device ring, and is laid out that way again for the new positions.

Device caches (DeviceLayerKV, SpilledLayerKV) go through the host: their rows are copied out, shifted with
the NumPy codecs (whose bytes the device kernels read and write identically) and written back into the same
arrays in place, so captured CUDA graphs that read those arrays stay valid. A shift costs one decode and
encode of every moved K row; it happens once per `discard` generated tokens.

A hybrid model's linear-attention layers (Qwen3.5's Gated DeltaNet, cache.RecurrentState) fold every position
into one state that cannot forget a span of them: context shift is refused for those models.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..files.config import ModelConfig, RopeConfig
from ..ops.elementwise.reference import apply_rope, inverse_frequencies
from ..ops.kv_formats.cpu import decode_rows
from .cache import EMPTY, KVCache, RecurrentState
from .window import retype_kv


def context_shift_problem(cfg: ModelConfig) -> str | None:
    """Why a cache of `cfg` cannot be shifted, or None."""
    if cfg.ssm is not None or any(cfg.is_recurrent(il) for il in range(cfg.n_layer)):
        return (f"context shift cannot be used with {cfg.arch}: its linear-attention layers keep one recurrent "
                "state of every position so far, which cannot forget a span of them; drop --context-shift "
                "(context_shift=) or raise -c/--ctx")
    return None


def check_context_shift(cfg: ModelConfig) -> None:
    problem = context_shift_problem(cfg)
    if problem is not None:
        raise InputError(problem)


@dataclass(frozen=True)
class ContextShift:
    """A generation's context-shift policy: keep the first `keep` positions, forget the next `discard` (0: half
    of the positions not kept, as llama.cpp) each time the cache is full. `dca`: the model's Dual Chunk Attention
    config (its global layers store keys at in-chunk positions)."""

    cfg: ModelConfig
    keep: int = 0
    discard: int = 0
    dca: object = None

    def __post_init__(self):
        if self.keep < 0 or self.discard < 0:
            raise InputError(f"context shift needs keep >= 0 and discard >= 0, got keep={self.keep}, "
                             f"discard={self.discard}")
        check_context_shift(self.cfg)

    def make_room(self, cache: KVCache) -> tuple[int, int] | None:
        """Shift `cache` once; (keep, discard): it dropped positions [keep, keep + discard). None, with nothing
        changed, when none can be dropped (the kept positions fill the cache)."""
        keep = min(self.keep, cache.n_past)
        left = cache.n_past - keep
        discard = min(self.discard or left // 2, left)
        if discard < 1:
            return None
        shift_cache(cache, self.cfg, keep, discard, self.dca)
        return keep, discard


def shift_cache(cache: KVCache, cfg: ModelConfig, keep: int, discard: int, dca=None) -> None:
    """Forget positions [keep, keep + discard) of every layer, move the later ones down by `discard` with their
    keys rotated to the new positions; cache.n_past falls by `discard`."""
    if any(isinstance(layer, RecurrentState) for layer in cache.layers):
        check_context_shift(cfg)
        raise InputError("context shift cannot move a recurrent state")  # (a config without ssm: not expected)
    if not (keep >= 0 and discard >= 1 and keep + discard <= cache.n_past):
        raise ValueError(f"cannot drop positions [{keep}, {keep + discard}) of a cache of {cache.n_past}")
    done = set()
    for il, layer in enumerate(cache.layers):
        if id(layer) in done:  # a KV-shared layer aliases its source's cache (shifted with the source's rope)
            continue
        done.add(id(layer))
        shift_layer(layer, keep, discard, cfg.rope_for(il), None if cfg.is_sliding(il) else dca)
    cache.n_past -= discard


def shift_layer(layer, keep: int, discard: int, rope: RopeConfig, dca=None) -> None:
    """shift_cache for one layer cache (LayerKV, DeviceLayerKV or SpilledLayerKV) whose keys `rope` rotated
    (at DCA's in-chunk positions when `dca` is given)."""
    if getattr(layer, "windowed", False):  # mixed types by position (kv/window.py)
        shift_windowed(layer, keep, discard, rope, dca)
        return
    if getattr(layer, "retyped", False):  # a spilled layer whose host part is the tail: each part in its codec
        layer.shift(keep, discard, rope, dca)
        return
    positions, k_rows, v_rows = layer_rows(layer)
    moved = positions >= keep + discard
    held = (positions < keep) | moved
    positions, k_rows, v_rows, moved = positions[held], k_rows[held], v_rows[held], moved[held]
    new_positions = np.where(moved, positions - discard, positions)
    turn = _key_positions(new_positions, dca) - _key_positions(positions, dca)
    rows = np.flatnonzero(turn)
    if len(rows):
        k_rows[rows] = rerope_rows(layer, k_rows[rows], turn[rows], rope)
    put_rows(layer, new_positions, k_rows, v_rows)


def shift_windowed(layer, keep: int, discard: int, rope: RopeConfig, dca=None) -> None:
    """shift_layer for a kv/window.py WindowedLayerKV: each part shifted in its own format, then the window
    refilled: a kept position that the shift brings within the newest kv_window, which the ring dropped long ago,
    comes back from its tail row."""
    shift_layer(layer.main, keep, discard, rope, dca)
    shift_layer(layer.tail, keep, discard, rope, dca)
    tail_pos, tail_k, tail_v = layer_rows(layer.tail)
    n_past = int(tail_pos.max()) + 1 if len(tail_pos) else 0
    main_pos, main_k, main_v = layer_rows(layer.main)
    wanted = np.arange(max(0, n_past - layer.kv_window), n_past)
    missing = np.setdiff1d(np.intersect1d(wanted, tail_pos), main_pos)
    if len(missing):
        rows = np.searchsorted(tail_pos, missing)  # (layer_rows of the tail: positions in order)
        k, v = retype_kv(tail_k[rows], tail_v[rows], layer.tail, layer.main)
        put_rows(layer.main, np.concatenate([main_pos, missing]), np.concatenate([main_k, k]),
                 np.concatenate([main_v, v]))


def _key_positions(positions: np.ndarray, dca) -> np.ndarray:
    return positions % dca.chunk_len if dca is not None else positions


def rotate_keys(k: np.ndarray, turn: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Keys k [n, n_kv, head_dim] roped at some positions, roped at those positions + turn [n] instead: each
    rotary pair turned by turn * its frequency, no magnitude factor (the keys carry theirs already)."""
    inv_freq, _ = inverse_frequencies(rope)
    angles = np.asarray(turn, np.float64)[:, None] * inv_freq[None, :]
    return apply_rope(np.asarray(k, np.float32), np.cos(angles).astype(np.float32),
                      np.sin(angles).astype(np.float32), rope.neox)


def rerope_rows(layer, k_rows: np.ndarray, turn: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Encoded K rows [n, n_kv, row bytes] of `layer`'s format, decoded (and denormalised), rotated by `turn`
    positions and encoded again (normalised with the layer's same offset and scale)."""
    n, n_kv, row_bytes = k_rows.shape
    d = layer.head_dim
    k = decode_rows(layer.k_format, np.ascontiguousarray(k_rows).reshape(n * n_kv, row_bytes), d)
    k = k.reshape(n, n_kv, d)
    offset, scale = layer.k_offset, layer.k_scale
    if offset is not None:
        offset, scale = _host(offset).astype(np.float32), _host(scale).astype(np.float32)
        k = k * scale + offset
    k = rotate_keys(k, turn, rope)
    if offset is not None:
        k = (k - offset) / scale
    return layer.k_format.encode(np.ascontiguousarray(k, np.float32).reshape(n * n_kv, d)).reshape(n, n_kv, -1)


def layer_rows(layer):
    """(positions int64 [m], K rows, V rows uint8 [m, n_kv, row bytes]) of every position `layer` holds, on the
    host (a spilled layer: its host rows and its device ring's)."""
    if getattr(layer, "spilled", False):
        positions, k_rows, v_rows = layer_rows(layer.device)
        n_host = layer.n_host
        return (np.concatenate([np.arange(n_host, dtype=np.int64), positions]),
                np.concatenate([layer.host_k[:n_host], k_rows]), np.concatenate([layer.host_v[:n_host], v_rows]))
    n = layer.n_used
    positions = _host(layer.slot_pos[:n]).astype(np.int64)
    held = np.flatnonzero(positions >= 0)
    return positions[held], _host(layer.k_data[:n])[held], _host(layer.v_data[:n])[held]


def put_rows(layer, positions: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray) -> None:
    """Make `layer` hold exactly these rows at these positions, in its arrays as they are (in place)."""
    if getattr(layer, "spilled", False):
        # the host keeps [0, n_host) and the device ring the newest `window` positions, as writes leave them
        n_past = int(positions.max()) + 1 if len(positions) else 0
        n_host = max(0, n_past - layer.window)
        on_host = positions < n_host
        rows = positions[on_host]
        layer.host_k[rows] = k_rows[on_host]
        layer.host_v[rows] = v_rows[on_host]
        layer.n_host = n_host
        put_rows(layer.device, positions[~on_host], k_rows[~on_host], v_rows[~on_host])
        return
    xp = layer.xp
    slots = positions % layer.capacity if layer.ring else positions
    layer.slot_pos[...] = EMPTY
    if len(slots):
        at = xp.asarray(slots)
        layer.k_data[at] = xp.asarray(k_rows)
        layer.v_data[at] = xp.asarray(v_rows)
        layer.slot_pos[at] = xp.asarray(positions.astype(layer.slot_pos.dtype))
        if layer.mirror:  # the float copy of what the rows now hold
            layer._mirror(slots, k_rows.reshape(len(slots) * layer.n_kv, -1),
                          v_rows.reshape(len(slots) * layer.n_kv, -1))
    layer.n_used = int(slots.max()) + 1 if len(slots) else 0


def _host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)
