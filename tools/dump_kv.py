"""Dump the K and V vectors a real model writes into its KV cache, as the rotated formats see them.

Runs a model on the CPU over a text (chunked prefill into an f32 cache, so the trajectory is the exact
float model) and captures every ``LayerKV.write`` call: K after RoPE (what the cache stores) and V. Each
head's row is cut into groups of ``G = min(128, head_dim)`` values, WHT-rotated with
``cupyllm.ops.kv_formats.turbo.rotate`` and normalised with ``turbo.group_norm_and_z`` exactly as the turbo / TCQ
encoders do, and saved as unit vectors (``z / sqrt(G)``) in float32 ``[n, G]``:

    OUT/PREFIX_k.npy, OUT/PREFIX_v.npy   rows ordered layer by layer, then position, then KV head, then group
    OUT/PREFIX_meta.json                 model, text (sha256, tokens), G, rows per layer, raw norm statistics

(Gemma 3 270M: head_dim 256 -> G = 128, two groups per head; Qwen2.5-0.5B: head_dim 64 -> G = 64.)
These are the training data of ``tools/train_tcq_codebook.py --from-npy``.

    python tools/dump_kv.py --model gemma --text tests/data/kv_train_text.txt --out /tmp/kv_dumps
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import cupyllm  # noqa: E402
from cupyllm.generate import prefill  # noqa: E402
from cupyllm.kv import group_values_for
from cupyllm.ops.kv_formats import turbo  # noqa: E402


@dataclass
class KVCapture:
    """Per layer, the rotated unit groups of every K and V row written into the cache."""

    group_values: int
    k: dict[int, list[np.ndarray]] = field(default_factory=dict)
    v: dict[int, list[np.ndarray]] = field(default_factory=dict)
    k_norms: list[np.ndarray] = field(default_factory=list)
    v_norms: list[np.ndarray] = field(default_factory=list)

    def add(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        for store, norms, x in ((self.k, self.k_norms, k), (self.v, self.v_norms, v)):
            groups, r = rotated_unit_groups(x, self.group_values)
            store.setdefault(layer, []).append(groups)
            norms.append(r)

    def stacked(self, which: str) -> tuple[np.ndarray, dict[int, int]]:
        store = self.k if which == "k" else self.v
        rows = {layer: sum(len(a) for a in store[layer]) for layer in sorted(store)}
        return np.concatenate([np.concatenate(store[layer]) for layer in sorted(store)]), rows


def rotated_unit_groups(x: np.ndarray, group_values: int) -> tuple[np.ndarray, np.ndarray]:
    """x [..., d] -> (unit groups [m, G] float32 as the rotated encoders normalise them, raw norms r [m])."""
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    y = turbo.rotate(rows, group_values).reshape(-1, group_values)
    r, z = turbo.group_norm_and_z(y)
    return (z * turbo.inv_sqrt_g(group_values)).astype(np.float32), r


def capture_kv(model, ids: list[int], chunk: int | None = None) -> KVCapture:
    """Run `ids` through `model` (a cupyllm Model on the CPU) and capture every K/V written to its cache."""
    cfg = model.cfg
    capture = KVCapture(group_values_for(cfg.head_dim))
    if cfg.v_head_dim != cfg.head_dim:
        raise SystemExit(f"head_dim {cfg.head_dim} != v_head_dim {cfg.v_head_dim}: dump K and V separately")
    cache = model.new_cache()
    for index, layer_kv in enumerate(cache.layers):
        original = layer_kv.write

        def write(k, v, positions, _layer=index, _write=original, **options):  # (queries=: K normalisation)
            capture.add(_layer, k, v)
            _write(k, v, positions, **options)

        layer_kv.write = write  # this cache object only; the engine code is untouched
    try:
        prefill(model.transformer.forward, ids, cache, chunk or model.kv_spec.max_chunk, progress=True)
    finally:
        for layer_kv in cache.layers:
            del layer_kv.write
    return capture


def model_path(name: str) -> Path:
    from models import gemma_path, qwen_path  # tests/models.py: assembles the models from their packages

    return {"gemma": gemma_path, "qwen": qwen_path}[name]() if name in ("gemma", "qwen") else Path(name)


def norm_stats(norms: list[np.ndarray]) -> dict:
    r = np.concatenate(norms).astype(np.float64)
    return {"min": float(r.min()), "median": float(np.median(r)), "max": float(r.max()),
            "zero_groups": int((r == 0).sum())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="gemma, qwen (tests/models.py) or a GGUF path")
    ap.add_argument("--text", type=Path, required=True, help="UTF-8 text file to run the model over")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--prefix", help="file name prefix (default: the --model value's stem)")
    ap.add_argument("--max-tokens", type=int, default=0, help="use at most this many tokens (0: all)")
    args = ap.parse_args(argv)

    path = model_path(args.model)
    text = args.text.read_text(encoding="utf-8")
    model = cupyllm.load(path, device="cpu", ctx=1 << 16, kv_type_k="f32", kv_type_v="f32", progress=False)
    ids = model.tokenize(text)
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    model.kv_spec = type(model.kv_spec)(ctx=len(ids), kv_type_k="f32", kv_type_v="f32",
                                        max_chunk=model.kv_spec.max_chunk)
    capture = capture_kv(model, ids)

    prefix = args.prefix or Path(args.model).stem
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": path.name, "arch": model.cfg.arch, "text": str(args.text),
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "tokens": len(ids),
            "head_dim": model.cfg.head_dim, "n_kv_head": model.cfg.n_kv_head, "group_values": capture.group_values,
            "layout": "rows: layer, position, kv head, group; unit vectors z/sqrt(G) of turbo.group_norm_and_z"}
    for which in ("k", "v"):
        data, rows = capture.stacked(which)
        np.save(args.out / f"{prefix}_{which}.npy", data)
        meta[which] = {"rows": int(len(data)), "rows_per_layer": rows,
                       "raw_norms": norm_stats(capture.k_norms if which == "k" else capture.v_norms)}
        print(f"{args.out / f'{prefix}_{which}.npy'}: {data.shape}")
    (args.out / f"{prefix}_meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
