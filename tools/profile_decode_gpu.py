"""Where one GPU decode step's time goes: torch.profiler (CUPTI sees every kernel of the process, CuPy's
included) over CUDA-graph replays of decode steps of a random-weight model with a real shape (bench/e2e_gpu.py's
presets, written here), after a 512-token prefill. Prints the kernels by total device time and writes them
as JSON (bench/results/decode_profile_gpu.json, and into $OUT when set).

    python tools/profile_decode_gpu.py [--model gemma3-270m] [--steps 32]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # make_tiny_models
sys.path.insert(0, str(ROOT / "bench"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "decode_profile_gpu.json")
    args = parser.parse_args(argv)
    from attention_gpu import real_cupy
    cp = real_cupy("profile_decode_gpu")
    if cp is None:
        return 0
    import torch
    from torch.profiler import ProfilerActivity, profile

    from make_tiny_models import PRESETS, write_gguf
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.generate import prefill
    from cupyllm.files.gguf import read_gguf
    from cupyllm.kv.cache import KVSpec
    from cupyllm.models.build import Transformer

    spec = PRESETS[args.model]
    path = Path(tempfile.mkdtemp(prefix="cupyllm-profile-")) / f"random-{args.model}.gguf"
    write_gguf(spec, path)
    ops = GPUBackend()
    transformer = Transformer.from_gguf(read_gguf(path), ops, progress=False)
    cache = ops.new_cache(transformer.cfg, KVSpec(ctx=1024, max_chunk=512))
    ids = np.random.default_rng(0).integers(0, spec.n_vocab, 512)
    logits = prefill(lambda t, p, kv, all_logits=False: ops.to_numpy(transformer.forward(t, p, kv, all_logits)),
                     ids, cache, 512)
    graphs = ops.decode_forward(transformer.forward)

    def steps(n: int) -> float:
        nonlocal logits
        token = int(np.argmax(logits))
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            logits = ops.to_numpy(graphs(np.array([token]), np.array([cache.n_past]), cache))
            cache.n_past += 1
            token = int(np.argmax(logits))
        return (time.perf_counter() - t0) / n

    steps(4)  # capture
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_s = steps(args.steps)
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if device_us > 0:
            rows.append({"name": e.key[:160], "calls": int(e.count), "device_us_total": float(device_us),
                         "device_us_per_step": float(device_us) / args.steps})
    rows.sort(key=lambda r: -r["device_us_total"])
    device_per_step = sum(r["device_us_per_step"] for r in rows)
    kernels_per_step = sum(r["calls"] for r in rows) / args.steps
    report = {"tool": "profile_decode_gpu", "model": args.model, "device": torch.cuda.get_device_name(),
              "steps": args.steps, "wall_ms_per_step": step_s * 1e3, "graph": graphs.enabled,
              "device_ms_per_step": device_per_step / 1e3, "kernels_per_step": kernels_per_step,
              "kernels": rows[:80]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if os.environ.get("OUT"):
        shutil.copy(args.out, Path(os.environ["OUT"]) / args.out.name)
    print(f"{args.model}: {step_s * 1e3:.2f} ms per decode step (wall, graph {graphs.enabled}); kernels "
          f"{device_per_step / 1e3:.2f} ms of device time, {kernels_per_step:.0f} launches per step")
    for r in rows[:args.top]:
        print(f"  {r['device_us_per_step']:8.1f} us/step  {r['calls'] / args.steps:5.1f}x  {r['name']}")
    path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
