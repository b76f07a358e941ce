"""Mixed KV types by position: a global layer keeps its newest `kv_window` positions in the main types and older
ones in cheaper tail types (--kv-window N, -ctkt / -ctvt; KVSpec.kv_window, kv_type_k_tail, kv_type_v_tail).

Recent keys take most of the attention, so they keep the better type; the long tail, read with small weights,
takes fewer bits. A `WindowedLayerKV` is two ordinary layer caches:

    main  a ring of kv_window + max_chunk slots in the main types (slot = position % capacity), as a
          sliding-window layer's: attention reads it with the sliding mask q - p < kv_window
    tail  one slot per position in the tail types (slot = position): attention reads it with the complement,
          q - p >= kv_window (reference.causal_mask's negative window)

Each row's tail copy is made when the row is written: its main bytes decoded and encoded in the tail types,
`retype_rows` (the NumPy codecs, so the CPU and the GPU store the same bytes), encode_tail(decode_main(row)).
A query at position q thus reads row p in the main types while p is among its newest kv_window positions and
in the tail types once p has left that window: every query reads the same rows whichever chunk or speculative
draft wrote them, and rewinding (KVCache.rewind, cut_to) needs nothing beyond the ring's own rule (it keeps the
window before the cut while at most max_chunk positions were written after it). Both parts share the K
normalisation (one offset and scale, set by the first write): a row is retyped in the normalised domain.

Bytes: the ring's (kv_window + max_chunk) rows in the main types plus ctx rows in the tail types (kv_bytes).
Context shift (kv/shift.py) shifts each part in its own codec, then fills any window position the ring no
longer holds (a kept prefix now within the window) from its tail row. A spilled GPU cache (kv/gpu_spill.py)
does not use this class: its host part is the tail, rows retyped as they move there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import CupyllmError
from ..ops.kv_formats.cpu import decode_rows
from ..ops.kv_formats.formats import KVFormat


def retype_rows(rows: np.ndarray, from_format: KVFormat, to_format: KVFormat, d: int) -> np.ndarray:
    """Encoded rows [n, n_kv, row bytes] of `from_format` as `to_format` rows: decoded, then encoded (the
    same bytes when the formats are one)."""
    rows = np.ascontiguousarray(rows)
    if from_format.name == to_format.name:
        return rows.copy()
    n, n_kv, row_bytes = rows.shape
    flat = rows.reshape(n * n_kv, row_bytes)
    # (the same values either way: decode_rows is the format's decode bit for bit, on every core, which costs
    # a thread-pool wake-up that a decode step's few rows do not repay)
    values = from_format.decode(flat, d) if len(flat) <= FEW_ROWS else decode_rows(from_format, flat, d)
    return to_format.encode(values).reshape(n, n_kv, -1)


FEW_ROWS = 64  # rows retype_rows decodes with the format's NumPy decode rather than the parallel decode_rows


def retype_kv(k_rows: np.ndarray, v_rows: np.ndarray, main, tail) -> tuple[np.ndarray, np.ndarray]:
    """(K rows, V rows) of layer cache `main`'s formats as `tail`'s (retype_rows of each; one call for both
    where K and V share their formats and widths: a decode step's few rows cost the call, not the values)."""
    k_rows, v_rows = np.ascontiguousarray(k_rows), np.ascontiguousarray(v_rows)
    same = (main.k_format.name == main.v_format.name and tail.k_format.name == tail.v_format.name
            and main.head_dim == main.v_head_dim and k_rows.shape == v_rows.shape)
    if not same:
        return (retype_rows(k_rows, main.k_format, tail.k_format, main.head_dim),
                retype_rows(v_rows, main.v_format, tail.v_format, main.v_head_dim))
    both = retype_rows(np.concatenate([k_rows, v_rows]), main.k_format, tail.k_format, main.head_dim)
    return both[:len(k_rows)], both[len(k_rows):]


@dataclass
class WindowedLayerKV:
    main: object  # LayerKV or DeviceLayerKV: ring of kv_window + max_chunk slots, window=kv_window, main types
    tail: object  # LayerKV or DeviceLayerKV: slot = position, capacity ctx, tail types
    spilled: ClassVar[bool] = False
    windowed: ClassVar[bool] = True
    mirror: ClassVar[bool] = False  # (a float32 copy of every row would outweigh what the tail saves)

    def __post_init__(self):
        if not self.main.ring or self.main.window <= 0 or self.tail.ring:
            raise ValueError("a windowed layer takes a main ring with its window and a tail of one slot a position")

    # what the model code and the backends read of a layer cache: the main part's shape and normalisation
    def __getattr__(self, name):
        if name in ("n_kv", "head_dim", "v_head_dim", "normalize_k", "k_offset", "k_scale", "xp", "inputs",
                    "query_scale", "k_format", "v_format"):
            return getattr(self.main, name)
        raise AttributeError(name)

    @property
    def kv_window(self) -> int:
        return self.main.window

    @property
    def ring(self) -> bool:
        return False  # (a layer's positions, not its slots: the tail holds position p at slot p)

    @property
    def nbytes(self) -> int:
        return self.main.nbytes + self.tail.nbytes

    def parts(self):
        """(part, window) pairs attention reads and merges by LSE: the main ring with the sliding mask, the tail
        with its complement (a negative window: keys at least kv_window positions behind the query)."""
        return ((self.main, self.kv_window), (self.tail, -self.kv_window))

    def write(self, k, v, positions, queries=None) -> None:
        """Encode k / v into the main ring (LayerKV.write), then their rows retyped into the tail."""
        main, tail = self.main, self.tail
        main.write(k, v, positions, queries=queries)
        self._share_normalization()
        host = main.inputs.host_values(positions) if hasattr(main, "inputs") else positions
        if host is None:
            raise CupyllmError("a windowed KV cache needs host positions (decode steps are not captured as graphs)")
        host = np.asarray(host, np.int64)
        if len(host) == 0:
            return
        slots = host % main.capacity
        k_rows, v_rows = _host(main.k_data[_index(main, slots)]), _host(main.v_data[_index(main, slots)])
        self._put_tail(host, *retype_kv(k_rows, v_rows, main, tail))

    def _put_tail(self, positions: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray) -> None:
        tail = self.tail
        at = _index(tail, positions)
        tail.k_data[at] = tail.xp.asarray(k_rows)
        tail.v_data[at] = tail.xp.asarray(v_rows)
        tail.slot_pos[at] = tail.xp.asarray(positions.astype(np.int64)).astype(tail.slot_pos.dtype)
        tail.n_used = max(tail.n_used, int(positions.max()) + 1)

    def _share_normalization(self) -> None:
        """The tail reads its rows with the main part's K offset and scale (set by the first write)."""
        if self.tail.k_offset is not self.main.k_offset or self.tail.k_scale is not self.main.k_scale:
            self.tail.k_offset, self.tail.k_scale = self.main.k_offset, self.main.k_scale
            if hasattr(self.tail, "_query_scale"):
                self.tail._query_scale = None

    def decode(self, start: int, stop: int):
        raise CupyllmError("a windowed KV cache is read part by part (parts())")

    def clear(self) -> None:
        self.main.clear()
        self.tail.clear()

    # prompt caching (KVCache.state / restore), rewinding (mark / rewind / cut_to)
    def state(self) -> dict:
        """The main ring's LayerKV.state(), and the tail's with its names prefixed "tail_"."""
        return {**self.main.state(), **{TAIL + name: value for name, value in self.tail.state().items()}}

    def restore(self, state: dict) -> None:
        self.main.restore({name: value for name, value in state.items() if not name.startswith(TAIL)})
        self.tail.restore({name[len(TAIL):]: value for name, value in state.items() if name.startswith(TAIL)})
        self._share_normalization()

    def can_truncate(self, n_keep: int) -> bool:
        """As a sliding-window ring: while the ring still holds the window before n_keep (the tail holds every
        position)."""
        return self.main.can_truncate(n_keep)

    def truncate(self, n_keep: int) -> None:
        self.main.truncate(n_keep)
        self.tail.truncate(n_keep)

    def pad_used(self, n_slots: int) -> None:
        raise CupyllmError("a windowed KV cache is not captured as a CUDA graph")


TAIL = "tail_"  # prefix of the tail part's arrays in a windowed layer's state


def _index(layer, positions: np.ndarray):
    """Host indices as the layer's arrays take them (CuPy indexes with device arrays)."""
    return layer.xp.asarray(positions) if layer.xp is not np else positions


def _host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)
