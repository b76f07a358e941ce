"""Decode attention over a spilled KV cache (newest positions on the device, the rest in pinned host memory,
kv/gpu_spill.py) against the same cache wholly on the device, measured in the same run.

One query token (batch 1), head dim 128 with 32 query / 8 KV heads (a Llama/Qwen-7B-style layer), contexts of
64k and 256k positions, device windows of 100% / 50% / 25% of the context, K and V in f16, q8_0 and turbo3.
Reported per row: time (CUDA events around the call, host copies included, median of the repeats), the host
bytes streamed per step and their rate (host bytes / time: the PCIe traffic a spilled step costs), and the time
as a ratio of the whole-device run's.

    python bench/spill_gpu.py                  # writes bench/results/spill_gpu.json (device named in it)
    python bench/spill_gpu.py --smoke          # tiny shapes: checks the script runs (also on the CUDA emulator)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cupyllm.cuda import gpu_count  # noqa: E402

HEAD_DIM, N_HEAD, N_KV = 128, 32, 8
CONTEXTS = (65536, 262144)
FRACTIONS = (1.0, 0.5, 0.25)
FORMATS = ("f16", "q8_0", "turbo3")
FILL_CHUNK = 8192


def build_layer(ops, fmt: str, ctx: int, window: int, head_dim: int, n_kv: int, rng):
    """A global layer's cache of `ctx` positions with `window` of them on the device (all when window == ctx),
    filled with random keys and values through the engine's own write path."""
    from cupyllm.kv.gpu_cache import device_layer_factory
    from cupyllm.ops.kv_formats.gpu import GpuKVCodec
    from cupyllm.kv.gpu_spill import SpilledLayerKV
    from cupyllm.ops.kv_formats.formats import get_format
    cp = ops.cp
    make = device_layer_factory(lambda f, d, n: GpuKVCodec(f, d, n, registry=ops.registry), ops.inputs)
    kv_format = get_format(fmt, head_dim=head_dim)
    layer = make(kv_format, kv_format, n_kv, head_dim, head_dim, capacity=window, ring=window < ctx, window=0,
                 mirror=False, normalize_k=False)
    if window < ctx:
        layer = SpilledLayerKV(layer, host_capacity=ctx - window)
    for start in range(0, ctx, min(FILL_CHUNK, window)):
        n = min(min(FILL_CHUNK, window), ctx - start)
        k = cp.asarray(rng.standard_normal((n, n_kv, head_dim), dtype=np.float32))
        v = cp.asarray(rng.standard_normal((n, n_kv, head_dim), dtype=np.float32))
        layer.write(k, v, np.arange(start, start + n))
    return layer


def time_call(cp, fn, repeats: int) -> float:
    fn()  # warm-up: compiles, uploads the format tables
    times = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="*", default=list(FORMATS))
    parser.add_argument("--contexts", nargs="*", type=int, default=list(CONTEXTS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop starting rows after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (emulator too)")
    args = parser.parse_args(argv)
    if gpu_count() == 0:
        print("bench/spill_gpu.py needs a CUDA device")
        return 1
    import cupy as cp
    emulated = bool(getattr(cp, "__cupyllm_emulated__", False))
    if emulated and not args.smoke:
        print("bench/spill_gpu.py measures a real device; on the CUDA emulator run it with --smoke")
        return 1
    from cupyllm.backend.gpu import GPUBackend
    ops = GPUBackend(attention="dispatch")
    head_dim, n_head, n_kv = (64, 4, 2) if args.smoke else (HEAD_DIM, N_HEAD, N_KV)
    contexts = [256] if args.smoke else args.contexts
    repeats = 1 if args.smoke else args.repeats
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    device = "CUDA emulator" if emulated else (props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]))
    rng = np.random.default_rng(0)
    rows, began = [], time.perf_counter()
    jobs = [(fmt, ctx, frac) for fmt in args.formats for ctx in contexts for frac in FRACTIONS]
    whole_time: dict[tuple, float] = {}
    for fmt, ctx, frac in tqdm(jobs, desc="spill_gpu", unit="row"):
        if time.perf_counter() - began > args.budget_s:
            break
        window = ctx if frac == 1.0 else int(ctx * frac)
        layer = build_layer(ops, fmt, ctx, window, head_dim, n_kv, rng)
        q = cp.asarray(rng.standard_normal((1, n_head, head_dim), dtype=np.float32))
        q_pos = np.array([ctx - 1])
        seconds = time_call(cp, lambda layer=layer: ops.attention(q, q_pos, layer, scale=head_dim ** -0.5), repeats)
        host_bytes = (layer.host_k.nbytes + layer.host_v.nbytes) if window < ctx else 0
        if window == ctx:
            whole_time[(fmt, ctx)] = seconds
        row = {"format": fmt, "ctx": ctx, "device_window": window, "seconds": seconds,
               "host_bytes_per_step": host_bytes, "host_gb_per_s": host_bytes / seconds / 1e9 if host_bytes else 0.0,
               "vs_whole_device": seconds / whole_time[(fmt, ctx)] if (fmt, ctx) in whole_time else None}
        rows.append(row)
        layer = None  # the next row's cache takes its place
        cp.get_default_memory_pool().free_all_blocks()
    result = {"device": device, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "shape": {"head_dim": head_dim, "n_head": n_head, "n_kv": n_kv}, "smoke": args.smoke, "rows": rows}
    out = REPO / "bench" / "results" / ("spill_gpu_smoke.json" if args.smoke else "spill_gpu.json")
    if not args.smoke:
        out.write_text(json.dumps(result, indent=1) + "\n")
        if os.environ.get("OUT"):
            shutil.copy(out, Path(os.environ["OUT"]) / out.name)
    for row in rows:
        ratio = f"{row['vs_whole_device']:.2f}x" if row["vs_whole_device"] else "-"
        print(f"{row['format']:>7} ctx {row['ctx']:>7} window {row['device_window']:>7}: "
              f"{row['seconds'] * 1e3:8.3f} ms  host {row['host_gb_per_s']:6.1f} GB/s  {ratio} of whole-device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
