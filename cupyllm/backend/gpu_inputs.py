"""The index arrays of one forward step (token ids, positions) as int32 device arrays.

The model code passes the same host `positions` array to every layer (RoPE, the cache write, attention);
`DeviceInputs` uploads it once and hands every layer the same device copy. For a CUDA-graph replay the
graph runner pins a host placeholder to a fixed device buffer (`pin`): lookups of that placeholder return
the buffer without any host-to-device copy, which a stream capture would not allow.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import DeviceError


@dataclass
class _Entry:
    host: np.ndarray  # kept alive so its id() is not reused while the entry exists
    snapshot: np.ndarray | None  # the values uploaded (None: pinned, the caller keeps the device side current)
    device: object


class DeviceInputs:
    """Host int arrays -> int32 device arrays, uploaded once per distinct array and content."""

    def __init__(self, cp, keep: int = 8):
        self.cp = cp
        self.keep = keep
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self.uploads_forbidden = False  # set while a CUDA graph is being captured

    def int32(self, values):
        """The int32 device array holding `values` (a host array, or a device array passed through)."""
        cp = self.cp
        if not isinstance(values, np.ndarray) and isinstance(values, cp.ndarray):
            return values if values.dtype == np.int32 else values.astype(np.int32)
        entry = self._entries.get(id(values))
        if entry is not None and entry.host is values:
            if entry.snapshot is None or np.array_equal(entry.snapshot, values):
                self._entries.move_to_end(id(values))
                return entry.device
        if self.uploads_forbidden:
            raise DeviceError("a host index array reached the GPU during CUDA-graph capture; pin it first "
                              "(cupyllm/backend/gpu_graph.py)")
        host = np.ascontiguousarray(values, dtype=np.int32)
        device = cp.asarray(host)
        self._entries[id(values)] = _Entry(values, host.copy(), device)
        self._entries.move_to_end(id(values))
        pinned = sum(1 for e in self._entries.values() if e.snapshot is None)
        while len(self._entries) > self.keep + pinned:
            oldest = next(k for k, e in self._entries.items() if e.snapshot is not None)
            del self._entries[oldest]
        return device

    def host_values(self, values) -> np.ndarray | None:
        """The host array behind `values` (itself when it is one), or None for a device-only array."""
        return values if isinstance(values, np.ndarray) else None

    def pin(self, host: np.ndarray, device) -> None:
        """Make `host` resolve to `device` (int32) until unpinned, whatever values `host` holds."""
        self._entries[id(host)] = _Entry(host, None, device)

    def unpin(self, host: np.ndarray) -> None:
        entry = self._entries.get(id(host))
        if entry is not None and entry.host is host:
            del self._entries[id(host)]
