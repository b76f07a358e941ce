"""Prompt caching: the KV cache after a prompt, kept so that a later prompt sharing its beginning prefills only
what follows (llama.cpp's --prompt-cache; vLLM's prefix caching, by hand).

A `PromptCache` holds the prompt's token ids, host copies of every layer's cache (KVCache.state) and the logits
after its last token, under a `key` naming what it is valid for: the model file, the KV spec and the DCA
configuration. To reuse it for ids that share its first n tokens, the cache is restored and truncated to n
(KVCache.truncate: a sliding-window ring must still hold the window before n, so a saved prompt may run past
the shared part by at most max_chunk tokens); otherwise the prompt is prefilled from scratch. Saved to disk as
one uncompressed .npz of plain arrays (no pickles), with the key in JSON; the CPU cache's float32 copies of the
rows are left out (restore decodes them again), which makes a file 3-5x smaller.
"""
from __future__ import annotations

import contextlib
import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import InputError

FILE_VERSION = 1
MIRRORS = ("k_f32", "v_f32")  # the CPU cache's float copies: left out of files (decoded again on restore)


@dataclass(frozen=True)
class PromptCache:
    ids: tuple[int, ...]
    layer_states: list[dict]  # KVCache.state(): host arrays per own layer
    logits: np.ndarray  # float32 [n_vocab] after the last id
    key: dict  # what the cache is valid for (api.Model.prompt_cache_key)
    reused: int = field(default=0, compare=False)  # tokens cache_prompt took from the cache it was given (not saved)

    def shared_prefix(self, ids: Sequence[int]) -> int:
        """How many leading tokens `ids` shares with this cache's prompt."""
        return shared_prefix(self.ids, ids)

    def save(self, path: str | Path) -> None:
        """Write to `path` (.npz), through a temporary file so that an interrupted save leaves no half file; a
        folder that cannot be written is an InputError naming the file."""
        path = Path(path)
        arrays = {"ids": np.asarray(self.ids, dtype=np.int64), "logits": np.asarray(self.logits, np.float32),
                  "key": np.frombuffer(json.dumps({"version": FILE_VERSION, **self.key}).encode(), np.uint8)}
        for i, state in enumerate(self.layer_states):
            for name, value in state.items():
                if name not in MIRRORS:
                    arrays[f"layer{i}.{name}"] = np.asarray(value)
        partial = path.with_name(path.name + ".part")
        try:
            with open(partial, "wb") as f:
                np.savez(f, **arrays)
            partial.replace(path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            raise InputError(f"cannot write the prompt cache {path}: {exc.strerror}; choose a file in a folder you "
                             "can write") from None

    @classmethod
    def load(cls, path: str | Path) -> "PromptCache":
        """Read a file save() wrote; a missing, truncated or foreign file, or one whose arrays are not those save()
        writes, is one InputError. Whether its layers fit a model is the model's to check
        (api.Model.check_prompt_cache), with layer_state_problem."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
            key = json.loads(arrays.pop("key").tobytes().decode())
        except FileNotFoundError:
            raise InputError(f"{path}: no such prompt cache file") from None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, json.JSONDecodeError) as exc:
            raise InputError(f"{path} is not a readable cupyllm prompt cache ({exc.__class__.__name__}); delete "
                             "it and it is rebuilt") from None
        if not isinstance(key, dict) or key.pop("version", None) != FILE_VERSION:
            raise InputError(f"{path} is a prompt cache of another cupyllm version; delete it and it is rebuilt")
        problem = _file_problem(arrays)
        if problem is not None:
            raise InputError(f"{path} is not a whole cupyllm prompt cache ({problem}); delete it and it is rebuilt")
        layers: dict[int, dict] = {}
        for name, value in arrays.items():
            if name.startswith("layer"):
                index, field = name[len("layer"):].split(".", 1)
                layers.setdefault(int(index), {})[field] = value
        return cls(ids=tuple(int(t) for t in arrays["ids"]), layer_states=[layers[i] for i in sorted(layers)],
                   logits=arrays["logits"], key=key)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens the id sequences a and b share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(list(a[:n]), dtype=np.int64) != np.asarray(list(b[:n]), dtype=np.int64))
    return int(differ[0]) if len(differ) else n


_LAYER_NAME = re.compile(r"layer(0|[1-9][0-9]*)\.[a-z_0-9]+")


def _file_problem(arrays: dict) -> str | None:
    """What keeps the arrays of a file from being a PromptCache at all (the model checks the rest), or None."""
    ids, logits = arrays.get("ids"), arrays.get("logits")
    if ids is None or logits is None:
        return "no " + ("ids" if ids is None else "logits") + " array"
    if ids.ndim != 1 or len(ids) == 0 or not np.issubdtype(ids.dtype, np.integer):
        return f"ids is {ids.dtype} {ids.shape}, expected a non-empty list of integers"
    if logits.ndim != 1 or not np.issubdtype(logits.dtype, np.floating):
        return f"logits is {logits.dtype} {logits.shape}, expected one float row"
    others = [name for name in arrays if name not in ("ids", "logits")]
    if any(_LAYER_NAME.fullmatch(name) is None for name in others):
        return "unknown arrays " + ", ".join(sorted(n for n in others if _LAYER_NAME.fullmatch(n) is None))
    indices = {int(name[len("layer"):].split(".", 1)[0]) for name in others}
    if indices != set(range(len(indices))):
        return "layers missing"
    return None


def _count(value) -> int | None:
    """A 0-d integer array or int as an int, else None."""
    value = np.asarray(value) if value is not None else None
    if value is None or value.ndim != 0 or not np.issubdtype(value.dtype, np.integer):
        return None
    return int(value)


def _rows_problem(name: str, value, n_rows: int, like) -> str | None:
    """Whether `value` has `n_rows` rows shaped and typed like those of `like` (the working cache's array)."""
    want = (n_rows, *like.shape[1:])
    if value is None:
        return f"no {name}"
    if value.dtype != like.dtype or tuple(value.shape) != want:
        return f"{name} is {value.dtype} {tuple(value.shape)}, expected {like.dtype} {want}"
    return None


def layer_state_problem(layer, state: dict, n_past: int) -> str | None:
    """What keeps `state` (one layer of a prompt cache of `n_past` tokens) from restoring into `layer` of a working
    cache (LayerKV, DeviceLayerKV or SpilledLayerKV), or None: every array the layer would copy in, with the
    shape and type it has there, slot positions below n_past, and the K normalisation where the layer uses it.
    A file that passes restores without a shape error or a broadcast, and reads back what was saved."""
    if hasattr(layer, "host_k"):  # a spilled layer (kv/gpu_spill.py): rows [0, n_host) on the host, then the ring
        n_host = _count(state.get("n_host"))
        if n_host is None or not 0 <= n_host <= layer.host_capacity:
            return f"n_host {state.get('n_host')!r} is not a count up to {layer.host_capacity}"
        problem = _rows_problem("host_k", state.get("host_k"), n_host, layer.host_k) or \
            _rows_problem("host_v", state.get("host_v"), n_host, layer.host_v)
        rest = {name: value for name, value in state.items() if name not in ("n_host", "host_k", "host_v")}
        return problem or layer_state_problem(layer.device, rest, n_past)
    if getattr(layer, "windowed", False):  # mixed types (kv/window.py): the main ring, then the "tail_" arrays
        from .window import TAIL
        tail = {name[len(TAIL):]: value for name, value in state.items() if name.startswith(TAIL)}
        main = {name: value for name, value in state.items() if not name.startswith(TAIL)}
        return layer_state_problem(layer.main, main, n_past) or layer_state_problem(layer.tail, tail, n_past)
    n_used = _count(state.get("n_used"))
    if n_used is None or not 0 <= n_used <= layer.capacity:
        return f"n_used {state.get('n_used')!r} is not a count up to {layer.capacity}"
    rows = ["k_data", "v_data", "slot_pos"] + (list(MIRRORS) if layer.mirror else [])
    for name in rows:
        if name in MIRRORS and name not in state:
            continue  # files leave the float copies out: restore decodes them again
        problem = _rows_problem(name, state.get(name), n_used, getattr(layer, name))
        if problem:
            return problem
    slot_pos = np.asarray(state["slot_pos"])
    if len(slot_pos) and not ((slot_pos >= -1) & (slot_pos < n_past)).all():
        return f"slot positions outside -1 .. {n_past - 1}"
    # (an empty layer has no normalisation yet: its first write sets it)
    norms = [n for n in ("k_offset", "k_scale") if n in state or n_used > 0] if layer.normalize_k else []
    for name in norms:
        value, want = state.get(name), (layer.n_kv, layer.head_dim)
        if value is None or value.dtype != np.float32 or tuple(value.shape) != want:
            got = "none" if value is None else f"{value.dtype} {tuple(value.shape)}"
            return f"{name} is {got}, expected float32 {want}"
    unknown = set(state) - {"n_used", *rows, *norms}
    if unknown:
        return "unexpected arrays " + ", ".join(sorted(unknown))
    return None
