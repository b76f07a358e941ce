"""How many device launches one decode step makes, counted on the CUDA emulator (no GPU needed).

A random-weight model with a preset's layer structure (tests/support/make_tiny_models.py PRESETS: its layers, heads,
head dims, sliding pattern and weight types) but narrow (d_model, MLP width and vocabulary cut down, which
changes no launch), a prompt of --prompt-tokens, then one eager decode step, the one the GPU backend captures
as a CUDA graph, counted by the emulated CuPy's `launches` (tests/support/cuda_emu/fakecupy: our kernels by name,
CuPy's elementwise, reduction, copy and fill kernels). The H200 profile of the same step
(tools/profile_decode_gpu.py) counted 473 kernels for gemma3-270m at 512 prompt tokens.

    python tools/count_decode_launches.py [--models gemma3-270m qwen2.5-0.5b] [--prompt-tokens 512]
                                          [--baseline REV] [--out bench/results/decode_launches.json]

--baseline REV counts the same steps at an earlier commit too (a git worktree of REV, given this tool and the
emulated CuPy's counter), in the same run, and reports both.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # make_tiny_models in a --baseline tree from before it moved
sys.path.insert(0, str(ROOT / "tests" / "support"))  # make_tiny_models
if "cupy" in sys.modules:
    raise SystemExit("count_decode_launches: run it in a fresh process (the emulated cupy must load first)")
sys.path.insert(0, str(ROOT / "tests" / "support" / "cuda_emu" / "fakecupy"))

NARROW = dict(d_model=256, ffn_dim=512, n_vocab=4096)  # multiples of the K-quant super-block (256)


def count_step(name: str, prompt_tokens: int) -> dict:
    import cupy

    from make_tiny_models import PRESETS, write_gguf
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.generate import prefill
    from cupyllm.files.gguf import read_gguf
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


def count_at(rev: str, models: list[str], prompt_tokens: int) -> dict:
    """The same count at commit `rev`: a worktree of it with this tool and the counting fakecupy copied in."""
    work = Path(tempfile.mkdtemp(prefix="cupyllm-launches-base-"))
    tree = work / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    try:
        emulator = Path("tests/support/cuda_emu")  # the counting emulator, also into trees from before it moved there
        shutil.copytree(ROOT / emulator, tree / emulator, dirs_exist_ok=True)
        shutil.copy(Path(__file__), tree / "tools" / Path(__file__).name)
        out = work / "baseline.json"
        subprocess.run([sys.executable, str(tree / "tools" / Path(__file__).name), "--models", *models,
                        "--prompt-tokens", str(prompt_tokens), "--out", str(out)], check=True, cwd=tree,
                       env={**__import__("os").environ, "PYTHONPATH": str(tree)})
        rows = json.loads(out.read_text())["rows"]
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True,
                                text=True).stdout.strip()
        return {"commit": commit, "rows": rows}
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gemma3-270m", "qwen2.5-0.5b"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--baseline", help="also count at this earlier commit, in the same run")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "decode_launches.json")
    args = parser.parse_args(argv)
    baseline = count_at(args.baseline, args.models, args.prompt_tokens) if args.baseline else None
    rows = []
    for name in tqdm(args.models, desc="decode launches (emulated)", unit="model"):
        rows.append(count_step(name, args.prompt_tokens))
        row = rows[-1]
        print(f"{name}: {row['launches_per_step']} launches per decode step "
              f"({row['launches_per_step'] / row['n_layer']:.1f} per layer)")
        for kernel, calls in row["launches"].items():
            print(f"  {calls:5d}  {kernel}")
    report = {"tool": "count_decode_launches", "device": "CUDA emulator (tests/support/cuda_emu), sm_90 limits",
              "narrowed": NARROW, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    if baseline is not None:
        report["baseline"] = baseline
        before = {row["model"]: row["launches_per_step"] for row in baseline["rows"]}
        for row in rows:
            print(f"{row['model']}: {before[row['model']]} -> {row['launches_per_step']} launches per step "
                  f"(at {baseline['commit'][:7]} -> now)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
