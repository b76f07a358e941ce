"""The KV cache: per layer, K and V rows encoded in their formats, and the position held by every slot.

Global-attention layers hold one slot per position up to `ctx`. Sliding-window layers hold a ring of
`window + max_chunk` slots: a prefill chunk of up to `max_chunk` tokens is written before it attends, and
the ring is just large enough that this never evicts a key an earlier query of the same chunk still needs.
Attention masks by the slot positions (empty slots hold -1), so both layouts read the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import numpy as np

from ..files.config import ModelConfig
from ..errors import BudgetError, ContextOverflowError
from ..ops.kv_formats.formats import KVFormat, get_format, is_float
from ..ops.kv_formats.cpu import decode_rows

EMPTY = -1


@dataclass(frozen=True)
class KVSpec:
    """What a cache stores: K and V formats and how many positions it holds."""

    ctx: int
    kv_type_k: str = "f16"
    kv_type_v: str = "f16"
    max_chunk: int = 512  # largest prefill chunk written at once (sizes the sliding-window rings)
    normalize_k: bool | None = None  # K channel normalisation (LayerKV); None: on for quantized K formats
    # Spilled (GPU backend, kv/plan.py plan_spill): global layers keep only the newest `device_window` positions
    # on the device, in a ring; older ones move to pinned host memory (kv/gpu_spill.py). 0: all on the device.
    device_window: int = 0
    # CPU backend: keep a float32 copy of the decoded cache beside the encoded rows, so decode attention reads
    # floats instead of decoding every step (4 more bytes per value whatever the format). None / False: none
    # (the default; the GPU reads the encoded rows in its kernels and never keeps one).
    float_mirror: bool | None = None
    # Mixed types by position (kv/window.py): global layers keep their newest `kv_window` positions in
    # kv_type_k / kv_type_v and older ones in the tail types (None: the main type). No tail type: one type for
    # every position, exactly the cache above. Spilled, the host part is the tail (kv_window unused).
    kv_window: int = 0
    kv_type_k_tail: str | None = None
    kv_type_v_tail: str | None = None

    @property
    def k_normalized(self) -> bool:
        """K normalised: by default when K is quantized in the window or the tail (one offset and scale for both,
        so a row moves between them in the normalised domain)."""
        if self.normalize_k is not None:
            return bool(self.normalize_k)
        return not (is_float(self.kv_type_k) and is_float(self.tail_type_k if self.has_tail else self.kv_type_k))

    @property
    def tail_type_k(self) -> str:
        return self.kv_type_k_tail or self.kv_type_k

    @property
    def tail_type_v(self) -> str:
        return self.kv_type_v_tail or self.kv_type_v

    @property
    def has_tail(self) -> bool:
        """Whether some positions are stored in tail types: a tail type is set, and a window shorter than the
        context holds the rest (spilled: the host part)."""
        if self.kv_type_k_tail is None and self.kv_type_v_tail is None:
            return False
        return self.spilled or 0 < self.kv_window < self.ctx

    @property
    def windowed(self) -> bool:
        """Global layers are kv/window.py WindowedLayerKV (a tail without a spill)."""
        return self.has_tail and not self.spilled

    @property
    def spilled(self) -> bool:
        return 0 < self.device_window < self.ctx


@dataclass
class LayerKV:
    k_format: KVFormat
    v_format: KVFormat
    n_kv: int
    head_dim: int
    v_head_dim: int
    capacity: int
    ring: bool  # slot = position % capacity (sliding window) instead of slot = position
    spilled: ClassVar[bool] = False  # a SpilledLayerKV (kv/gpu_spill.py) keeps older rows on the host
    window: int = 0
    mirror: bool = False  # also keep decode(encode(k, v)) as float32, so attention on the CPU skips decoding
    # K channel normalisation: the first write sets k_offset and k_scale [n_kv, head_dim] from its keys and
    # queries (key_normalization); every write encodes (K - k_offset) / k_scale and decode undoes it. Some
    # models' K has channels with large offsets and spreads that the queries barely read (Qwen2.5's layer 0):
    # they eat a block format's range or a rotated group's norm, and the error of the channels the queries do
    # read swamps the attention logits. Normalised, each channel's share of the error follows its weight in
    # q . k (bench/results/kv_quality.md).
    normalize_k: bool = False
    k_offset: np.ndarray | None = field(init=False, default=None, repr=False)
    k_scale: np.ndarray | None = field(init=False, default=None, repr=False)
    k_data: np.ndarray = field(init=False, repr=False)
    v_data: np.ndarray = field(init=False, repr=False)
    slot_pos: np.ndarray = field(init=False, repr=False)
    n_used: int = field(init=False, default=0)  # slots [0, n_used) may hold keys

    def __post_init__(self):
        k_row = self.k_format.row_bytes(self.head_dim)
        v_row = self.v_format.row_bytes(self.v_head_dim)
        self.k_data = np.zeros((self.capacity, self.n_kv, k_row), np.uint8)
        self.v_data = np.zeros((self.capacity, self.n_kv, v_row), np.uint8)
        self.slot_pos = np.full(self.capacity, EMPTY, np.int64)
        if self.mirror:
            self.k_f32 = np.zeros((self.capacity, self.n_kv, self.head_dim), np.float32)
            self.v_f32 = np.zeros((self.capacity, self.n_kv, self.v_head_dim), np.float32)

    @property
    def nbytes(self) -> int:
        return self.k_data.nbytes + self.v_data.nbytes

    def slots_for(self, positions: np.ndarray) -> np.ndarray:
        return positions % self.capacity if self.ring else positions

    def write(self, k: np.ndarray, v: np.ndarray, positions: np.ndarray, queries: np.ndarray | None = None) -> None:
        """Encode k [n, n_kv, head_dim] and v [n, n_kv, v_head_dim] into the slots of `positions`. `queries`
        [n, n_head, head_dim] (the same positions' queries, as attention will read them): what K's
        normalisation balances against on the first write (key_normalization)."""
        n = len(positions)
        slots = self.slots_for(np.asarray(positions))
        if self.normalize_k:
            k = self._normalized(k, positions, queries)
        k_bytes = self.k_format.encode(k.reshape(n * self.n_kv, self.head_dim))
        v_bytes = self.v_format.encode(v.reshape(n * self.n_kv, self.v_head_dim))
        self.k_data[slots] = k_bytes.reshape(n, self.n_kv, -1)
        self.v_data[slots] = v_bytes.reshape(n, self.n_kv, -1)
        if self.mirror:  # exactly what decoding the stored bytes gives, computed once per token
            self._mirror(slots, k_bytes, v_bytes)
        self.slot_pos[slots] = positions
        self.n_used = max(self.n_used, int(slots.max()) + 1)

    def _mirror(self, slots, k_bytes: np.ndarray, v_bytes: np.ndarray) -> None:
        """k_f32 / v_f32 of `slots` from their stored bytes ([n * n_kv, row bytes] each)."""
        n = len(k_bytes) // self.n_kv
        k = decode_rows(self.k_format, k_bytes, self.head_dim).reshape(n, self.n_kv, self.head_dim)
        self.k_f32[slots] = self._denormalized(k)
        self.v_f32[slots] = decode_rows(self.v_format, v_bytes, self.v_head_dim).reshape(n, self.n_kv, self.v_head_dim)

    def decode(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Slots [start, stop) as float32 k, v and their positions."""
        if self.mirror:
            return self.k_f32[start:stop], self.v_f32[start:stop], self.slot_pos[start:stop]
        n = stop - start
        k = decode_rows(self.k_format, self.k_data[start:stop].reshape(n * self.n_kv, -1), self.head_dim)
        v = decode_rows(self.v_format, self.v_data[start:stop].reshape(n * self.n_kv, -1), self.v_head_dim)
        return (self._denormalized(k.reshape(n, self.n_kv, self.head_dim)), v.reshape(n, self.n_kv, self.v_head_dim),
                self.slot_pos[start:stop])

    def _normalized(self, k, positions, queries, xp=np):
        """K as stored, (K - k_offset) / k_scale; the first write sets both (key_normalization)."""
        if self.k_offset is None:
            self.k_offset, self.k_scale = key_normalization(k, positions, xp=xp, queries=queries)
        return (k - self.k_offset) / self.k_scale

    def _denormalized(self, k: np.ndarray) -> np.ndarray:
        return k * self.k_scale + self.k_offset if self.k_offset is not None else k

    def chunks(self, chunk_slots: int):
        """Yield (k, v, positions) over the used slots, `chunk_slots` at a time, decoded."""
        for start in range(0, self.n_used, chunk_slots):
            yield self.decode(start, min(start + chunk_slots, self.n_used))

    def clear(self) -> None:
        self.slot_pos[:] = EMPTY
        self.n_used = 0
        self.k_offset = None
        self.k_scale = None

    # --- prompt caching (cupyllm/kv/prompt_cache.py): the state after a prompt, kept on the host, put back ---------
    @property
    def xp(self):
        return np

    def state(self) -> dict:
        """Host copies of all this layer holds in its used slots (every slot past n_used is empty): the encoded
        rows, slot positions, float mirrors, and the K normalisation."""
        out = {"n_used": np.int64(self.n_used)}
        for name in _STATE_ARRAYS:
            value = getattr(self, name, None)
            if value is not None:
                value = value[:self.n_used] if name in _SLOT_ARRAYS else value
                out[name] = _host_copy(value)
        return out

    def restore(self, state: dict) -> None:
        """Put back what state() took, in place: the arrays keep their addresses (a captured CUDA graph that reads
        them stays valid)."""
        xp = self.xp
        n_used = int(state["n_used"])
        for name in _SLOT_ARRAYS:
            if getattr(self, name, None) is not None and name in state:
                getattr(self, name)[:n_used] = xp.asarray(state[name])
        self.slot_pos[n_used:] = EMPTY
        self.k_offset = xp.asarray(state["k_offset"]) if "k_offset" in state else None
        self.k_scale = xp.asarray(state["k_scale"]) if "k_scale" in state else None
        self.n_used = n_used
        if self.mirror and "k_f32" not in state:  # a saved state leaves the float copies out: decode them again
            rows = slice(0, n_used)
            self._mirror(rows, self.k_data[rows].reshape(n_used * self.n_kv, -1),
                         self.v_data[rows].reshape(n_used * self.n_kv, -1))

    def can_truncate(self, n_keep: int) -> bool:
        """Whether truncate(n_keep) leaves what positions n_keep and later need: always for a global layer; for a
        ring, only while it still holds the window before n_keep (a later write may have evicted it)."""
        if not self.ring:
            return True
        held = _host_copy(self.slot_pos)
        needed = np.arange(max(0, n_keep - self.window), n_keep)
        return bool((held[needed % self.capacity] == needed).all())

    def truncate(self, n_keep: int) -> None:
        """Forget positions n_keep and later (their slots become empty)."""
        self.slot_pos[self.slot_pos >= n_keep] = EMPTY
        if not self.ring:
            self.n_used = min(self.n_used, n_keep)


MAX_CHECKPOINTS = 8  # recurrent-state copies a hybrid's cache keeps at prefill chunk boundaries (the latest ones)


@dataclass
class RecurrentState:
    """A Gated DeltaNet layer's memory of everything before `n_seen` (Qwen3.5's linear-attention layers): the
    conv's last K - 1 inputs [K - 1, C] and the recurrent state [Hv, Dk, Dv], float32 (ops/deltanet's layouts).
    Fixed in size, whatever the context. It cannot be rewound to an arbitrary position: it truncates to where it
    stands, or to one of its `checkpoints` (host copies of it at earlier positions: prefill chunk boundaries, so
    that a prompt cache cut to a shared prefix runs again only from the boundary before the cut)."""

    conv: np.ndarray
    recurrent: np.ndarray
    n_seen: int = 0  # positions [0, n_seen) are folded into the state
    checkpoints: list = field(default_factory=list, repr=False)  # [(position, conv, recurrent)], host copies

    @classmethod
    def for_model(cls, cfg: ModelConfig) -> "RecurrentState":
        s = cfg.ssm
        return cls(np.zeros((s.conv_kernel - 1, s.conv_channels), np.float32),
                   np.zeros((s.n_v_heads, s.k_head_dim, s.v_head_dim), np.float32))

    @property
    def nbytes(self) -> int:
        return int(self.conv.nbytes + self.recurrent.nbytes)

    def clear(self) -> None:
        self.conv[...] = 0.0
        self.recurrent[...] = 0.0
        self.n_seen = 0
        self.checkpoints = []

    def checkpoint(self) -> None:
        """Keep a host copy of the state where it stands (the latest MAX_CHECKPOINTS are kept)."""
        if self.checkpoints and self.checkpoints[-1][0] == self.n_seen:
            return
        self.checkpoints.append((self.n_seen, _host_copy(self.conv), _host_copy(self.recurrent)))
        del self.checkpoints[:-MAX_CHECKPOINTS]

    def state(self) -> dict:
        out = {"conv": _host_copy(self.conv), "recurrent": _host_copy(self.recurrent), "n_seen": np.int64(self.n_seen)}
        if self.checkpoints:
            out["checkpoint_pos"] = np.array([c[0] for c in self.checkpoints], np.int64)
            out["checkpoint_conv"] = np.stack([c[1] for c in self.checkpoints])
            out["checkpoint_recurrent"] = np.stack([c[2] for c in self.checkpoints])
        return out

    def restore(self, state: dict) -> None:
        self._put(state["conv"], state["recurrent"])
        self.n_seen = int(state["n_seen"])
        self.checkpoints = [(int(p), np.asarray(c), np.asarray(r)) for p, c, r in
                            zip(state.get("checkpoint_pos", ()), state.get("checkpoint_conv", ()),
                                state.get("checkpoint_recurrent", ()))]

    def _put(self, conv, recurrent) -> None:
        self.conv[...] = conv
        self.recurrent[...] = recurrent

    def state_problem(self, state: dict, n_past: int) -> str | None:
        """What keeps `state` (of a prompt cache of n_past tokens) from restoring into this layer, or None."""
        known = {"conv", "recurrent", "n_seen", "checkpoint_pos", "checkpoint_conv", "checkpoint_recurrent"}
        if not {"conv", "recurrent", "n_seen"} <= set(state) <= known:
            return f"arrays {sorted(state)}, expected conv, n_seen, recurrent (a linear-attention layer)"
        for name in ("conv", "recurrent"):
            value, like = np.asarray(state[name]), getattr(self, name)
            if value.dtype != like.dtype or value.shape != like.shape:
                return f"{name} is {value.dtype} {value.shape}, expected {like.dtype} {like.shape}"
        seen = np.asarray(state["n_seen"])
        if seen.shape != () or seen.dtype.kind not in "iu" or int(seen) != n_past:
            return f"n_seen {seen!r} is not the prompt's {n_past} tokens"
        if "checkpoint_pos" not in state:
            return None if not set(state) - {"conv", "recurrent", "n_seen"} else "checkpoint arrays without positions"
        pos = np.asarray(state["checkpoint_pos"])
        if pos.ndim != 1 or pos.dtype.kind not in "iu" or not 0 < len(pos) <= MAX_CHECKPOINTS or \
                not ((pos >= 0) & (pos <= n_past)).all() or (np.diff(pos) <= 0).any():
            return f"checkpoint_pos {pos!r} is not up to {MAX_CHECKPOINTS} rising positions up to {n_past}"
        for name in ("conv", "recurrent"):
            value, like = np.asarray(state.get("checkpoint_" + name)), getattr(self, name)
            if value.dtype != like.dtype or value.shape != (len(pos), *like.shape):
                return f"checkpoint_{name} is {value.dtype} {value.shape}, expected {like.dtype} {(len(pos), *like.shape)}"
        return None

    def can_truncate(self, n_keep: int) -> bool:
        return n_keep == self.n_seen

    def checkpoint_positions(self) -> list[int]:
        return [c[0] for c in self.checkpoints]

    def back_to_checkpoint(self, position: int) -> None:
        """Put the state back to its checkpoint at `position` (later checkpoints are dropped)."""
        index = self.checkpoint_positions().index(position)
        _, conv, recurrent = self.checkpoints[index]
        self._put(conv, recurrent)
        self.n_seen = position
        del self.checkpoints[index + 1:]

    def snapshot(self) -> tuple:
        """Copies of the states where they live (host or device), for rewinding to here (KVCache.mark)."""
        return self.conv.copy(), self.recurrent.copy(), self.n_seen

    def put_back(self, snapshot: tuple) -> None:
        conv, recurrent, self.n_seen = snapshot
        self.conv[...] = conv
        self.recurrent[...] = recurrent

    def truncate(self, n_keep: int) -> None:
        if n_keep != self.n_seen:
            raise ValueError(f"a recurrent state after {self.n_seen} positions cannot be rewound to {n_keep}")


@dataclass(frozen=True)
class CacheMark:
    """Where a cache stood (KVCache.mark): its n_past, and copies of the recurrent states, which cannot be cut
    back to an earlier position as K/V rows can."""

    n_past: int
    recurrent: tuple  # (layer, RecurrentState.snapshot()) for each own recurrent layer


def recurrent_bytes(cfg: ModelConfig) -> int:
    """Bytes of the recurrent states of a hybrid model's linear-attention layers (0 for other models)."""
    if cfg.ssm is None:
        return 0
    s = cfg.ssm
    per_layer = 4 * ((s.conv_kernel - 1) * s.conv_channels + s.n_v_heads * s.k_head_dim * s.v_head_dim)
    return per_layer * sum(cfg.is_recurrent(il) for il in range(cfg.n_layer))


def _host_copy(array) -> np.ndarray:
    """A NumPy copy of a host or device (CuPy, DeviceLayerKV) array."""
    return array.get() if hasattr(array, "get") else array.copy()


_SLOT_ARRAYS = ("k_data", "v_data", "slot_pos", "k_f32", "v_f32")  # one row per slot
_STATE_ARRAYS = _SLOT_ARRAYS + ("k_offset", "k_scale")


def key_normalization(k, positions, xp=np, queries=None):
    """(offset, scale), float32 [n_kv, head_dim] each, from the keys k [n, n_kv, head_dim] (an `xp` array: NumPy,
    or CuPy for the device cache) and their queries [n, n_head, head_dim] (None: unknown, taken as alike in
    every channel), leaving out position 0 (the attention sink's key is an outlier) unless it is the only one.
    `positions`: the host positions of the rows, or None (unknown: every row counts).

    offset: per channel, the mean key. scale: per channel sqrt(rms_k / rms_q), rms_k the keys' RMS about the
    offset and rms_q the RMS of the queries of that KV head's group. The cache stores (K - offset) / scale and
    attention reads it with q * scale, so both sides of every channel have the spread sqrt(rms_k * rms_q):
    the format spends its range on channels by what they add to q . k, not by how loud K alone is (a channel
    loud in K but quiet in Q shrinks, a quiet one that Q reads grows). Each RMS is at least 10% of its head's
    mean RMS, so no channel that was (nearly) constant here is magnified without bound later; from one key
    alone the scale is 1.
    """
    later = np.flatnonzero(np.asarray(positions) > 0) if positions is not None else np.arange(0)
    take = (lambda a: a[xp.asarray(later)]) if len(later) else (lambda a: a)  # CuPy indexes with device arrays only
    rows = take(k).astype(xp.float64)
    offset = rows.mean(axis=0)
    if len(rows) < 2:
        return offset.astype(xp.float32), xp.ones_like(offset, dtype=xp.float32)

    def floored_rms(x, axes):
        rms = xp.sqrt((x ** 2).mean(axis=axes))
        floor = 0.1 * rms.mean(axis=-1, keepdims=True)
        return xp.where(floor > 0, xp.maximum(rms, floor), xp.ones_like(rms))  # an all-constant head: 1

    k_rms = floored_rms(rows - offset, 0)
    if queries is None:
        q_rms = xp.ones_like(k_rms)
    else:
        q = take(queries).astype(xp.float64)
        q_rms = floored_rms(q.reshape(q.shape[0], k.shape[1], -1, k.shape[2]), (0, 2))
    return offset.astype(xp.float32), xp.sqrt(k_rms / q_rms).astype(xp.float32)


@dataclass
class KVCache:
    spec: KVSpec
    layers: list[LayerKV]  # a RecurrentState at a hybrid model's linear-attention layers
    n_past: int = 0  # positions [0, n_past) are cached

    @classmethod
    def for_model(cls, cfg: ModelConfig, spec: KVSpec, mirror: bool = False,
                  make_layer: Callable[..., LayerKV] = LayerKV) -> "KVCache":
        """The cache of `cfg` for `spec`. `make_layer` builds each layer from LayerKV's arguments; a backend
        whose cache lives on its device passes its own (kv/gpu_cache.py: arrays in GPU memory)."""
        formats = {d: (get_format(spec.kv_type_k, head_dim=d), get_format(spec.kv_type_v, head_dim=d))
                   for d in cfg.head_dims()}
        tail_formats = {d: (get_format(spec.tail_type_k, head_dim=d), get_format(spec.tail_type_v, head_dim=d))
                        for d in cfg.head_dims()}
        if spec.windowed and mirror:
            raise BudgetError("--kv-mirror keeps a float32 copy of every position, which outweighs what a tail type "
                              "saves: drop --kv-mirror (kv_mirror=) or --kv-window and the tail types")
        need = kv_bytes(cfg, spec, mirror=mirror)
        available = host_bytes_available() if mirror else float("inf")  # host arrays: check before allocating
        if need > available:
            raise BudgetError(_no_room(spec, need, f"the host has {_gib(available)} available", mirror))
        layers = []
        try:
            for layer in range(cfg.n_layer):
                if cfg.is_recurrent(layer):  # a linear-attention layer keeps a fixed-size state instead of K/V
                    layers.append(RecurrentState.for_model(cfg))
                    continue
                if cfg.kv_source(layer) != layer:  # a KV-shared layer (Gemma 4) reads an earlier layer's cache
                    layers.append(layers[cfg.kv_source(layer)])
                    continue
                sliding = cfg.is_sliding(layer)
                head_dim, v_head_dim = cfg.head_dim_of(layer), cfg.v_head_dim_of(layer)
                windowed = spec.windowed and not sliding  # (kv/window.py: main ring + tail)
                main = make_layer(formats[head_dim][0], formats[v_head_dim][1], cfg.n_kv_head_of(layer),
                                  head_dim, v_head_dim, capacity=_slots(cfg, spec, layer),
                                  ring=sliding or spec.spilled or windowed,
                                  window=cfg.sliding_window if sliding else spec.kv_window if windowed else 0,
                                  mirror=mirror, normalize_k=spec.k_normalized)
                if windowed:
                    from .window import WindowedLayerKV
                    main = WindowedLayerKV(main, make_layer(
                        tail_formats[head_dim][0], tail_formats[v_head_dim][1], cfg.n_kv_head_of(layer), head_dim,
                        v_head_dim, capacity=spec.ctx, ring=False, window=0, mirror=False,
                        normalize_k=spec.k_normalized))
                layers.append(main)
        except MemoryError:  # host arrays, and CuPy's OutOfMemoryError on the device
            raise BudgetError(_no_room(spec, need, "the allocation failed", mirror)) from None
        return cls(spec, layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.own_layers())

    def own_layers(self) -> list[LayerKV]:
        """Each layer cache once (KV-shared layers alias an earlier layer's)."""
        return list({id(layer): layer for layer in self.layers}.values())

    def recurrent_parts(self, layer: int) -> list[tuple[slice, "RecurrentState"]]:
        """The rows of a forward and the recurrent state each advances at a hybrid's linear-attention layer: all
        rows, this cache's state (a batched forward's stand-in gives each sequence's rows its own)."""
        return [(slice(None), self.layers[layer])]

    def check_room(self, n_new: int) -> None:
        if self.n_past + n_new > self.spec.ctx:
            raise ContextOverflowError(
                f"{self.n_past} cached + {n_new} new tokens exceed the context of {self.spec.ctx} tokens; "
                f"raise -c/--ctx (ctx=...) or shorten the prompt / max_tokens")

    def clear(self) -> None:
        for layer in self.own_layers():
            layer.clear()
        self.n_past = 0

    def state(self) -> list[dict]:
        """LayerKV.state() of each own layer (host copies): with n_past, what PromptCache keeps."""
        return [layer.state() for layer in self.own_layers()]

    def restore(self, layer_states: list[dict], n_past: int) -> None:
        for layer, state in zip(self.own_layers(), layer_states, strict=True):
            layer.restore(state)
        self.n_past = n_past

    def mark(self) -> CacheMark:
        """Remember where the cache stands, so that rewind() can forget what is written after it (speculative
        decoding's rejected drafts). Copies only the recurrent states (nothing for a cache of K/V rows alone)."""
        return CacheMark(self.n_past, tuple((layer, layer.snapshot()) for layer in self.own_layers()
                                            if isinstance(layer, RecurrentState)))

    def rewind(self, mark: CacheMark, n_keep: int) -> int:
        """Forget every position from n_keep on, n_keep between mark.n_past and n_past. K/V rows are cut at
        n_keep; recurrent states cannot be, so with any (a hybrid model) the whole cache goes back to the mark
        and the caller runs positions [mark.n_past, n_keep) again. Returns the position the cache now holds
        up to (n_keep, or mark.n_past after a hybrid's rewind)."""
        if not mark.n_past <= n_keep <= self.n_past:
            raise ValueError(f"cannot rewind a cache of {self.n_past} positions marked at {mark.n_past} to {n_keep}")
        if n_keep == self.n_past:
            return n_keep
        cut = n_keep if not mark.recurrent else mark.n_past
        kv_layers = [layer for layer in self.own_layers() if not isinstance(layer, RecurrentState)]
        if not all(layer.can_truncate(cut) for layer in kv_layers):
            raise ValueError(f"a sliding-window ring no longer holds the keys before position {cut}: more was written "
                             "after the mark than the ring's spare slots (max_chunk)")
        for layer in kv_layers:
            layer.truncate(cut)
        for layer, snapshot in mark.recurrent:
            layer.put_back(snapshot)
        self.n_past = cut
        return cut

    def truncate(self, n_keep: int) -> bool:
        """Keep positions [0, n_keep) only; False, with nothing changed, when a sliding layer's ring has lost
        keys that positions from n_keep on would read, or a recurrent state is past n_keep (cut_to goes back to
        a checkpoint instead)."""
        if not all(layer.can_truncate(n_keep) for layer in self.own_layers()):
            return False
        for layer in self.own_layers():
            layer.truncate(n_keep)
        self.n_past = min(self.n_past, n_keep)
        return True

    def checkpoint(self) -> None:
        """Copy the recurrent states where they stand (a hybrid model's prefill calls it at each chunk boundary),
        so that cut_to can later go back to here; nothing for a cache of K/V rows alone."""
        for layer in self.own_layers():
            if isinstance(layer, RecurrentState):
                layer.checkpoint()

    def cut_to(self, n_keep: int) -> int:
        """Keep at most positions [0, n_keep) and return how many are kept: n_keep (K/V rows cut, or recurrent
        states already there), else the latest recurrent checkpoint before it (the caller runs the rest again),
        else 0 with the cache cleared."""
        if self.truncate(n_keep):
            return self.n_past
        recurrent = [layer for layer in self.own_layers() if isinstance(layer, RecurrentState)]
        kv_layers = [layer for layer in self.own_layers() if not isinstance(layer, RecurrentState)]
        if recurrent:
            common = set.intersection(*(set(layer.checkpoint_positions()) for layer in recurrent))
            for position in sorted((p for p in common if p <= n_keep), reverse=True):
                if all(layer.can_truncate(position) for layer in kv_layers):
                    for layer in kv_layers:
                        layer.truncate(position)
                    for layer in recurrent:
                        layer.back_to_checkpoint(position)
                    self.n_past = position
                    return position
        self.clear()
        return 0


def kv_bytes(cfg: ModelConfig, spec: KVSpec, mirror: bool = False) -> int:
    """Bytes a cache for `spec` takes, without allocating it (mirror: plus the CPU's float32 copy; spilled: on
    the device only, host_kv_bytes counts the host part; windowed: the window's ring and the tail)."""
    total = recurrent_bytes(cfg)
    for layer in range(cfg.n_layer):
        if cfg.kv_source(layer) != layer or cfg.is_recurrent(layer):
            continue  # reads an earlier layer's cache, or keeps a recurrent state (counted above)
        k_row, v_row = _row_bytes(cfg, layer, spec.kv_type_k, spec.kv_type_v)
        if mirror:
            k_dim, v_dim = cfg.head_dim_of(layer), cfg.v_head_dim_of(layer)
            k_row, v_row = k_row + 4 * k_dim, v_row + 4 * v_dim
        total += _slots(cfg, spec, layer) * cfg.n_kv_head_of(layer) * (k_row + v_row)
        if spec.windowed and not cfg.is_sliding(layer):  # the tail: every position, in the tail types
            total += spec.ctx * cfg.n_kv_head_of(layer) * sum(_row_bytes(cfg, layer, spec.tail_type_k,
                                                                          spec.tail_type_v))
    return total


def host_kv_bytes(cfg: ModelConfig, spec: KVSpec) -> int:
    """Bytes of a spilled cache's host part (kv/gpu_spill.py): the global layers' positions past the device
    window, in the tail types (the main types when none is set); 0 unspilled."""
    if not spec.spilled:
        return 0
    total = 0
    for layer in range(cfg.n_layer):
        if cfg.kv_source(layer) != layer or cfg.is_recurrent(layer) or cfg.is_sliding(layer):
            continue
        rows = sum(_row_bytes(cfg, layer, spec.tail_type_k, spec.tail_type_v))
        total += (spec.ctx - spec.device_window) * cfg.n_kv_head_of(layer) * rows
    return total


def _row_bytes(cfg: ModelConfig, layer: int, kv_type_k: str, kv_type_v: str) -> tuple[int, int]:
    k_dim, v_dim = cfg.head_dim_of(layer), cfg.v_head_dim_of(layer)
    return (get_format(kv_type_k, head_dim=k_dim).row_bytes(k_dim),
            get_format(kv_type_v, head_dim=v_dim).row_bytes(v_dim))


def _slots(cfg: ModelConfig, spec: KVSpec, layer: int) -> int:
    """Cache slots of `layer`: every position for global attention (the device window when spilled, a ring of
    window + chunk in the main types when windowed), a ring of window + chunk for sliding."""
    if cfg.is_sliding(layer):
        return min(spec.ctx, cfg.sliding_window + spec.max_chunk)
    if spec.windowed:
        return min(spec.ctx, spec.kv_window + spec.max_chunk)
    return spec.device_window if spec.spilled else spec.ctx


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.1f} GiB"


def host_bytes_available() -> float:
    """MemAvailable of /proc/meminfo (Linux); elsewhere unknown (infinite: the allocation itself decides)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def _no_room(spec: KVSpec, need: int, why: str, mirror: bool) -> str:
    what = f"a KV cache of {spec.ctx} tokens (K {spec.kv_type_k}, V {spec.kv_type_v}) needs {_gib(need)}"
    if mirror:  # the float32 copy dominates: fewer KV bits barely help on the CPU
        return (f"{what} on the CPU (with the float32 copy --kv-mirror asks for) and {why}; drop --kv-mirror "
                f"/ kv_mirror=True to store only the cache's own format, with -ctk/-ctv q8_0, turbo3, ... to make "
                f"that smaller, or lower -c/--ctx (ctx=...)")
    return (f"{what} and {why}; lower -c/--ctx (ctx=...) or store K/V in fewer bits (-ctk/-ctv q8_0, q4_0, "
            f"turbo3, turbo2_tcq; kv_type_k=/kv_type_v=)")
