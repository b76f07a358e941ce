"""A global layer's cache larger than the GPU can hold: the newest positions on the device, the older ones in
pinned host memory, attention over both merged by log-sum-exp (kv/plan.py plan_spill sizes the window).

    device  a DeviceLayerKV ring of `window` slots (slot = position % window), holding positions
            [n_past - window, n_past)
    host    pinned uint8 [host_capacity, n_kv, row_bytes] K and V rows, row p = position p, holding [0, n_host)

A write first moves the rows its slots still hold (positions p - window) to the host, then encodes the new
rows on the device, so the two parts always partition the positions written. With tail types (KVSpec
kv_type_k_tail / kv_type_v_tail, kv/window.py) the host part is the tail: each row is retyped on its way there,
encode_tail(decode_main(row)) with the NumPy codecs (kv/window.py retype_rows, the bytes the CPU's tail holds),
and attention reads the host rows in the tail formats. Attention runs the flash kernels
(ops/attention/gpu_dispatch.py gpu_attention_lse) on the device ring, then streams the host rows through a device
staging buffer `stage_tokens` at a time, each chunk one more partial (O, LSE), merged exactly as
ops/attention/reference.py's merge defines. The rows move as stored bytes (already encoded, already normalised),
so the result is the attention over the whole cache up to the order of the merges. Each step copies the host
part over PCIe: decode speed falls to that bandwidth once the host part dominates; the window keeps the
newest keys, which short-range attention reads most, on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..ops.attention.reference import merge
from ..errors import CupyllmError
from .window import retype_kv

STAGE_TOKENS = 8192  # host rows copied to the device per attention chunk


@dataclass
class _RowsView:
    """The LayerKV-like view gpu_attention_lse reads: staged host rows at consecutive positions."""

    k_format: object
    v_format: object
    n_kv: int
    head_dim: int
    v_head_dim: int
    k_data: object
    v_data: object
    slot_pos: object
    n_used: int
    inputs: object
    ring: bool = False


def _pinned(shape) -> np.ndarray:
    """A host array in page-locked memory where CuPy provides it (fast, asynchronous copies)."""
    try:
        import cupyx
        return cupyx.empty_pinned(shape, dtype=np.uint8)
    except (ImportError, AttributeError):
        return np.empty(shape, np.uint8)


@dataclass
class SpilledLayerKV:
    device: object  # DeviceLayerKV, ring of `window` slots
    host_capacity: int
    stage_tokens: int = STAGE_TOKENS
    tail_formats: tuple | None = None  # (K, V) KVFormat of the host rows; None: the device's
    spilled = True
    n_host: int = field(init=False, default=0)  # positions [0, n_host) are on the host

    def __post_init__(self):
        dev = self.device
        xp = dev.xp
        self.host_k_format, self.host_v_format = self.tail_formats or (dev.k_format, dev.v_format)
        k_row, v_row = self.host_k_format.row_bytes(dev.head_dim), self.host_v_format.row_bytes(dev.v_head_dim)
        self.host_k = _pinned((self.host_capacity, dev.n_kv, k_row))
        self.host_v = _pinned((self.host_capacity, dev.n_kv, v_row))
        stage = min(self.stage_tokens, max(self.host_capacity, 1))
        self._stage_k = xp.empty((stage, dev.n_kv, k_row), xp.uint8)
        self._stage_v = xp.empty((stage, dev.n_kv, v_row), xp.uint8)

    @property
    def retyped(self) -> bool:
        """Whether the host rows are in other formats than the device's (tail types)."""
        return (self.host_k_format.name, self.host_v_format.name) != (self.device.k_format.name,
                                                                      self.device.v_format.name)

    # what the model code and the backend read of a layer cache
    def __getattr__(self, name):
        if name in ("k_format", "v_format", "n_kv", "head_dim", "v_head_dim", "capacity", "normalize_k", "k_scale",
                    "k_offset", "xp", "inputs", "query_scale", "mirror"):
            return getattr(self.device, name)
        raise AttributeError(name)

    @property
    def window(self) -> int:
        return self.device.capacity

    @property
    def nbytes(self) -> int:
        return self.device.nbytes  # device bytes; the host part is host_bytes

    @property
    def host_bytes(self) -> int:
        return self.host_k.nbytes + self.host_v.nbytes

    def write(self, k, v, positions, queries=None) -> None:
        """Move the rows the new positions' ring slots hold to the host, then encode the new rows there."""
        dev, xp = self.device, self.device.xp
        host = dev.inputs.host_values(positions)
        if host is None:
            raise CupyllmError("a spilled cache needs host positions (decode steps are not captured as graphs)")
        host = np.asarray(host, np.int64)
        if len(host) > self.window:
            raise CupyllmError(f"a chunk of {len(host)} tokens exceeds the device window of {self.window}")
        if len(host):
            evict = np.arange(max(int(host.min()) - self.window, self.n_host), int(host.max()) + 1 - self.window)
            if len(evict):
                if int(evict[-1]) >= self.host_capacity:
                    raise CupyllmError(f"position {int(evict[-1])} is past the host part of the cache "
                                       f"({self.host_capacity} positions)")
                slots = xp.asarray(evict % self.window)
                k_rows, v_rows = xp.asnumpy(dev.k_data[slots]), xp.asnumpy(dev.v_data[slots])
                if self.retyped:  # the host part is the tail: rows retyped as they leave the window
                    k_rows, v_rows = retype_kv(k_rows, v_rows, dev, _HostFormats(self))
                self.host_k[evict[0]:evict[-1] + 1] = k_rows
                self.host_v[evict[0]:evict[-1] + 1] = v_rows
                self.n_host = int(evict[-1]) + 1
        dev.write(k, v, positions, queries=queries)

    def attention_lse(self, attend_lse, q, q_pos, **options):
        """(O, LSE) of q over the device ring and the host rows; attend_lse is gpu_attention_lse's signature."""
        xp, dev = self.device.xp, self.device
        out, lse = attend_lse(q, q_pos, dev, **options)
        out = out.astype(xp.float32)
        for start in range(0, self.n_host, len(self._stage_k)):
            stop = min(start + len(self._stage_k), self.n_host)
            n = stop - start
            self._stage_k[:n] = xp.asarray(self.host_k[start:stop])
            self._stage_v[:n] = xp.asarray(self.host_v[start:stop])
            rows = _RowsView(self.host_k_format, self.host_v_format, dev.n_kv, dev.head_dim, dev.v_head_dim,
                             self._stage_k[:n], self._stage_v[:n], xp.arange(start, stop, dtype=xp.int32), n,
                             dev.inputs)
            part, part_lse = attend_lse(q, q_pos, rows, **options)
            out, lse = merge(out, lse, part.astype(xp.float32), part_lse)
        return out.astype(q.dtype), lse

    def decode(self, start: int, stop: int):
        raise CupyllmError("a spilled cache is read by attention only")

    def clear(self) -> None:
        self.device.clear()
        self.n_host = 0

    # prompt caching (KVCache.state / restore / truncate)
    def state(self) -> dict:
        """The device ring's state, and the host rows [0, n_host) (already host arrays: copied as they are)."""
        return {**self.device.state(), "n_host": np.int64(self.n_host),
                "host_k": self.host_k[:self.n_host].copy(), "host_v": self.host_v[:self.n_host].copy()}

    def restore(self, state: dict) -> None:
        n_host = int(state["n_host"])
        if n_host > self.host_capacity:
            raise CupyllmError(f"a prompt cache with {n_host} host positions does not fit this cache's "
                               f"{self.host_capacity}")
        self.device.restore({name: value for name, value in state.items()
                             if name not in ("n_host", "host_k", "host_v")})
        self.host_k[:n_host] = state["host_k"]
        self.host_v[:n_host] = state["host_v"]
        self.n_host = n_host

    def can_truncate(self, n_keep: int) -> bool:
        """Always: the ring holds [n_host, n_past) and the host [0, n_host), so a cut anywhere leaves every
        position before it, and later writes move to the host only what the ring still holds."""
        return True

    def truncate(self, n_keep: int) -> None:
        self.device.truncate(n_keep)
        self.n_host = min(self.n_host, n_keep)

    def pad_used(self, n_slots: int) -> None:
        self.device.pad_used(n_slots)

    # context shift (kv/shift.py) of a retyped host part: each part in its own codec
    def shift(self, keep: int, discard: int, rope, dca=None) -> None:
        """The host rows and the device ring shifted each in its formats; host rows whose new positions fall in
        the device window (a kept prefix, when keep reaches past it) move to the device, retyped back."""
        from .shift import layer_rows, put_rows, shift_layer
        host = _HostRows(self)
        shift_layer(host, keep, discard, rope, dca)
        shift_layer(self.device, keep, discard, rope, dca)
        host_pos, host_k, host_v = layer_rows(host)
        dev_pos, dev_k, dev_v = layer_rows(self.device)
        n_past = int(max(host_pos.max(initial=-1), dev_pos.max(initial=-1))) + 1
        n_host = max(0, n_past - self.window)
        up = host_pos >= n_host
        if up.any():
            dev = self.device
            k, v = retype_kv(host_k[up], host_v[up], _HostFormats(self), dev)
            put_rows(dev, np.concatenate([dev_pos, host_pos[up]]), np.concatenate([dev_k, k]),
                     np.concatenate([dev_v, v]))
        self.n_host = n_host


class _HostFormats:
    """A spilled layer's host formats and widths, as retype_kv reads a layer cache."""

    def __init__(self, layer: SpilledLayerKV):
        self.k_format, self.v_format = layer.host_k_format, layer.host_v_format
        self.head_dim, self.v_head_dim = layer.device.head_dim, layer.device.v_head_dim


@dataclass
class _HostRows:
    """A spilled layer's host rows as kv/shift.py reads and writes a layer (slot = position, [0, n_host))."""

    layer: SpilledLayerKV
    ring: bool = False
    mirror: bool = False
    xp: object = np

    def __post_init__(self):
        layer = self.layer
        self.k_data, self.v_data = layer.host_k, layer.host_v
        self.k_format, self.v_format = layer.host_k_format, layer.host_v_format
        self.head_dim, self.n_kv = layer.device.head_dim, layer.device.n_kv
        k_offset, k_scale = layer.device.k_offset, layer.device.k_scale
        self.k_offset = None if k_offset is None else _host(k_offset)
        self.k_scale = None if k_scale is None else _host(k_scale)
        self.capacity = layer.host_capacity
        self.slot_pos = np.full(self.capacity, -1, np.int64)
        self.slot_pos[:layer.n_host] = np.arange(layer.n_host)
        self.n_used = layer.n_host


def _host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)
