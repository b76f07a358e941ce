"""How many device launches one decode step makes, counted on the CUDA emulator (no GPU needed).

A random-weight model with a preset's layer structure (tools/make_tiny_models.py PRESETS: its layers, heads,
head dims, sliding pattern and weight types) but narrow (d_model, MLP width and vocabulary cut down, which
changes no launch), a prompt of --prompt-tokens, then one eager decode step, the one the GPU backend captures
as a CUDA graph, counted by the emulated CuPy's `launches` (tools/cuda_emu/fakecupy: our kernels by name,
CuPy's elementwise, reduction, copy and fill kernels). The H200 profile of the same step
(tools/profile_decode_gpu.py) counted 473 kernels for gemma3-270m at 512 prompt tokens.

    python tools/count_decode_launches.py [--models gemma3-270m qwen2.5-0.5b] [--prompt-tokens 512]
                                          [--out bench/results/decode_launches.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
if "cupy" in sys.modules:
    raise SystemExit("count_decode_launches: run it in a fresh process (the emulated cupy must load first)")
sys.path.insert(0, str(ROOT / "tools" / "cuda_emu" / "fakecupy"))

NARROW = dict(d_model=256, ffn_dim=512, n_vocab=4096)  # multiples of the K-quant super-block (256)


def count_step(name: str, prompt_tokens: int) -> dict:
    import cupy

    from make_tiny_models import PRESETS, write_gguf
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.generate import prefill
    from cupyllm.gguf_io import read_gguf
    from cupyllm.kv.cache import KVSpec
    from cupyllm.models.build import Transformer

    spec = dataclasses.replace(PRESETS[name], **NARROW)
    path = Path(tempfile.mkdtemp(prefix="cupyllm-launches-")) / f"narrow-{name}.gguf"
    write_gguf(spec, path)
    ops = GPUBackend()
    transformer = Transformer.from_gguf(read_gguf(path), ops, progress=False)
    cache = ops.new_cache(transformer.cfg, KVSpec(ctx=prompt_tokens + 64, max_chunk=512))
    ids = np.random.default_rng(0).integers(0, spec.n_vocab, prompt_tokens)
    logits = prefill(lambda t, p, kv, all_logits=False: ops.to_numpy(transformer.forward(t, p, kv, all_logits)),
                     ids, cache, 512, progress=False)
    cupy.launches.clear()
    transformer.forward(np.array([int(np.argmax(logits))]), np.array([cache.n_past]), cache)
    counted = dict(cupy.launches)
    path.unlink()
    return {"model": name, "n_layer": spec.n_layer, "prompt_tokens": prompt_tokens,
            "launches_per_step": sum(counted.values()),
            "launches": dict(sorted(counted.items(), key=lambda item: -item[1]))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gemma3-270m", "qwen2.5-0.5b"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "decode_launches.json")
    args = parser.parse_args(argv)
    rows = []
    for name in tqdm(args.models, desc="decode launches (emulated)", unit="model"):
        rows.append(count_step(name, args.prompt_tokens))
        row = rows[-1]
        print(f"{name}: {row['launches_per_step']} launches per decode step "
              f"({row['launches_per_step'] / row['n_layer']:.1f} per layer)")
        for kernel, calls in row["launches"].items():
            print(f"  {calls:5d}  {kernel}")
    report = {"tool": "count_decode_launches", "device": "CUDA emulator (tools/cuda_emu), sm_90 limits",
              "narrowed": NARROW, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
