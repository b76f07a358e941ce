"""A global layer's cache larger than the GPU can hold: the newest positions on the device, the older ones in
pinned host memory, attention over both merged by log-sum-exp (kv/plan.py plan_spill sizes the window).

    device  a DeviceLayerKV ring of `window` slots (slot = position % window), holding positions
            [n_past - window, n_past)
    host    pinned uint8 [host_capacity, n_kv, row_bytes] K and V rows, row p = position p, holding [0, n_host)

A write first moves the rows its slots still hold (positions p - window) to the host, then encodes the new
rows on the device, so the two parts always partition the positions written. Attention runs the flash kernels
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
    spilled = True
    n_host: int = field(init=False, default=0)  # positions [0, n_host) are on the host

    def __post_init__(self):
        dev = self.device
        xp = dev.xp
        self.host_k = _pinned((self.host_capacity, dev.n_kv, dev.k_data.shape[2]))
        self.host_v = _pinned((self.host_capacity, dev.n_kv, dev.v_data.shape[2]))
        stage = min(self.stage_tokens, max(self.host_capacity, 1))
        self._stage_k = xp.empty((stage, dev.n_kv, dev.k_data.shape[2]), xp.uint8)
        self._stage_v = xp.empty((stage, dev.n_kv, dev.v_data.shape[2]), xp.uint8)

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
                self.host_k[evict[0]:evict[-1] + 1] = xp.asnumpy(dev.k_data[slots])
                self.host_v[evict[0]:evict[-1] + 1] = xp.asnumpy(dev.v_data[slots])
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
            rows = _RowsView(dev.k_format, dev.v_format, dev.n_kv, dev.head_dim, dev.v_head_dim,
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
