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

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import CupyllmError

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
        n = min(len(ids), len(self.ids))
        mine = np.asarray(self.ids[:n], dtype=np.int64)
        theirs = np.asarray(list(ids[:n]), dtype=np.int64)
        differ = np.flatnonzero(mine != theirs)
        return int(differ[0]) if len(differ) else n

    def save(self, path: str | Path) -> None:
        """Write to `path` (.npz), through a temporary file so that an interrupted save leaves no half file."""
        path = Path(path)
        arrays = {"ids": np.asarray(self.ids, dtype=np.int64), "logits": np.asarray(self.logits, np.float32),
                  "key": np.frombuffer(json.dumps({"version": FILE_VERSION, **self.key}).encode(), np.uint8)}
        for i, state in enumerate(self.layer_states):
            for name, value in state.items():
                if name not in MIRRORS:
                    arrays[f"layer{i}.{name}"] = np.asarray(value)
        partial = path.with_name(path.name + ".part")
        with open(partial, "wb") as f:
            np.savez(f, **arrays)
        partial.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "PromptCache":
        """Read a file save() wrote; a missing, truncated or foreign file is one CupyllmError."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
            key = json.loads(arrays.pop("key").tobytes().decode())
        except FileNotFoundError:
            raise CupyllmError(f"{path}: no such prompt cache file") from None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, json.JSONDecodeError) as exc:
            raise CupyllmError(f"{path} is not a readable cupyllm prompt cache ({exc.__class__.__name__}); delete "
                               "it and it is rebuilt") from None
        if key.pop("version", None) != FILE_VERSION:
            raise CupyllmError(f"{path} is a prompt cache of another cupyllm version; delete it and it is rebuilt")
        layers: dict[int, dict] = {}
        for name, value in arrays.items():
            if name.startswith("layer"):
                index, field = name[len("layer"):].split(".", 1)
                layers.setdefault(int(index), {})[field] = value
        return cls(ids=tuple(int(t) for t in arrays["ids"]), layer_states=[layers[i] for i in sorted(layers)],
                   logits=arrays["logits"], key=key)
