"""The KV cache on the GPU: `DeviceLayerKV` is a `LayerKV` whose arrays are CuPy arrays.

    k_data, v_data  uint8 [capacity, n_kv, row_bytes]  the encoded rows, byte for byte what the format's
                    NumPy `encode` gives (written by kernels_cu/kv_formats/kv_encode.cu through GpuKVCodec)
    slot_pos        int32 [capacity]                    the position each slot holds, -1 when empty

Same layout and semantics as the CPU cache (cupyllm/kv/cache.py): global layers hold slot = position,
sliding-window layers a ring of slot = position % capacity; attention masks by slot_pos. Normalised K
(normalize_k): the rows hold (K - k_offset) / k_scale (device arrays); decode undoes it, and the flash kernels
read the normalised rows with Q scaled by k_scale (GPUBackend), which leaves softmax attention unchanged
(q . k_offset is one constant per query row; only their LSE is shifted by it) but not a soft-capped or DCA
score, so GPUBackend sends those to the decoding path. `n_used` is
kept on the host (every slot at or past it is empty), so attention kernels know how far to read
without a device-to-host copy. Positions may arrive as host arrays (the model code) or as device arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from .cache import EMPTY, LayerKV, RecurrentState
from ..ops.kv_formats.formats import KVFormat
from ..ops.kv_formats.gpu import encode_kv


@dataclass
class DeviceLayerKV(LayerKV):
    codecs: tuple = field(default=(), repr=False)  # (k GpuKVCodec, v GpuKVCodec)
    inputs: object = field(default=None, repr=False)  # DeviceInputs: host positions -> int32 device arrays
    _query_scale: object = field(init=False, default=None, repr=False)  # query_scale(), until clear()

    def __post_init__(self):
        k_codec, v_codec = self.codecs
        self.mirror = False  # attention reads the encoded rows in-register; no float copy
        self.k_data = k_codec.allocate(self.capacity)
        self.v_data = v_codec.allocate(self.capacity)
        cp = k_codec._cp
        self.slot_pos = cp.full(self.capacity, EMPTY, dtype=cp.int32)

    @property
    def xp(self):
        return self.codecs[0]._cp

    def write(self, k, v, positions, queries=None) -> None:
        """Encode k [n, n_kv, head_dim] and v [n, n_kv, v_head_dim] (device, f32/f16) into the slots of
        `positions` (host or device ints); `queries` as for LayerKV.write."""
        cp = self.xp
        n = int(k.shape[0])
        pos = self.inputs.int32(positions)
        k_codec, v_codec = self.codecs
        k = k.reshape(n, self.n_kv, self.head_dim)
        host = self.inputs.host_values(positions)
        if self.normalize_k:  # device positions (host None): every key counts for the first write's statistics
            k = self._normalized(k.astype(cp.float32), host, queries, xp=cp)
        # one launch: the ring's slot = position % capacity, both encodes and slot_pos[slot] = position
        encode_kv(k_codec, k, self.k_data, pos, v_codec, v.reshape(n, self.n_kv, self.v_head_dim), self.v_data,
                  slot_pos=self.slot_pos, ring=self.ring)
        if host is None:  # device positions: their largest slot is unknown without a copy, so read every slot
            self.n_used = self.capacity  # (empty ones hold -1 and are masked)
        elif len(host):
            host_slots = np.asarray(host) % self.capacity if self.ring else np.asarray(host)
            self.n_used = max(self.n_used, int(host_slots.max()) + 1)

    def decode(self, start: int, stop: int):
        """Slots [start, stop) as float32 device k, v (f16-rounded by the decode kernel) and positions."""
        n = stop - start
        k_codec, v_codec = self.codecs
        k = k_codec.decode(self.k_data, start, n).astype(np.float32)
        v = v_codec.decode(self.v_data, start, n).astype(np.float32)
        return self._denormalized(k), v, self.slot_pos[start:stop]

    def query_scale(self, n_head: int):
        """k_scale per query head, float32 [n_head, head_dim] (each head takes its KV head's row): the flash
        kernels read the normalised rows with Q times this. Built once per normalisation."""
        if self._query_scale is None or self._query_scale.shape[0] != n_head:
            cp = self.xp
            self._query_scale = cp.repeat(self.k_scale, n_head // self.n_kv, axis=0).astype(cp.float32)
        return self._query_scale

    def clear(self) -> None:
        super().clear()
        self._query_scale = None  # the next write normalises afresh

    def restore(self, state: dict) -> None:
        super().restore(state)
        self._query_scale = None  # built again from the restored k_scale

    def pad_used(self, n_slots: int) -> None:
        """Read at least `n_slots` slots from now on (empty ones are masked): fixes the kernel arguments
        of a captured decode step for a whole range of lengths."""
        self.n_used = max(self.n_used, min(int(n_slots), self.capacity))


def device_layer_factory(codec_factory, inputs):
    """A `make_layer` for KVCache.for_model that builds DeviceLayerKV layers.

    codec_factory(fmt, head_dim, n_kv) -> GpuKVCodec; codecs are shared by layers of one shape."""
    codecs: dict[tuple, object] = {}

    def codec(fmt: KVFormat, head_dim: int, n_kv: int):
        key = (fmt.name, id(fmt), head_dim, n_kv)
        if key not in codecs:
            codecs[key] = codec_factory(fmt, head_dim, n_kv)
        return codecs[key]

    def make_layer(k_format, v_format, n_kv, head_dim, v_head_dim, **options):
        return DeviceLayerKV(k_format, v_format, n_kv, head_dim, v_head_dim,
                             codecs=(codec(k_format, head_dim, n_kv), codec(v_format, v_head_dim, n_kv)),
                             inputs=inputs, **options)

    return make_layer



@dataclass
class DeviceRecurrentState(RecurrentState):
    """A linear-attention layer's RecurrentState with its float32 conv [K - 1, C] and recurrent [Hv, Dk, Dv]
    states as device (CuPy) arrays, which the DeltaNet kernels advance in place. state() gives host copies and
    restore() takes them, as a prompt cache stores them (checkpoints are host copies too)."""

    @classmethod
    def from_host(cls, host: RecurrentState, cp) -> "DeviceRecurrentState":
        return cls(cp.asarray(host.conv, dtype=cp.float32), cp.asarray(host.recurrent, dtype=cp.float32),
                   host.n_seen)

    def _put(self, conv, recurrent) -> None:
        self.conv.set(np.ascontiguousarray(conv, dtype=np.float32))
        self.recurrent.set(np.ascontiguousarray(recurrent, dtype=np.float32))
