"""Development probe for the decode-attention kernels on a GPU: time FA-VEC and FA-MMA over split counts
around the planner's choice, or run one call for a profiler (`--once`, e.g. under `ncu`).

    python tools/attention_probe.py --sweep                           # table + JSON (bench/results/attention_probe.json)
    ncu --clock-control none -k regex:fa_ python tools/attention_probe.py --once hd128_32q8kv f16 vec 65536

Shapes, cache layers and timing are bench/attention_gpu.py's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import attention_gpu as bench  # noqa: E402

SWEEP = [("hd128_32q8kv", "f16", 65536), ("hd256_8q4kv", "f16", 65536), ("hd256_4q1kv_gemma3_270m", "f16", 65536),
         ("hd512_16q2kv", "f16", 65536), ("hd64_14q2kv_qwen2.5_0.5b", "f16", 65536), ("hd128_32q8kv", "q8_0", 65536),
         ("hd128_32q8kv", "f16", 4096), ("hd256_4q1kv_gemma3_270m", "f16", 4096)]
SPLIT_FACTORS = (0.5, 1, 2)


def layers_for(cp, device, shape, fmt, n_keys, rng, min_layers=1):
    head_dim, n_head, n_kv = bench.SHAPES[shape]
    f = bench.get_format(fmt, head_dim=head_dim)
    layer_bytes = 2 * n_keys * n_kv * f.row_bytes(head_dim)
    n_layers = max(min_layers, math.ceil(bench.L2_MULTIPLE * device["l2_bytes"] / layer_bytes))
    return bench.make_layers(cp, fmt, fmt, head_dim, n_kv, n_keys, n_layers, rng), n_head, head_dim


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--once", nargs=4, metavar=("SHAPE", "FORMAT", "KERNEL", "N_KEYS"))
    args = parser.parse_args(argv)
    cp = bench.real_cupy("attention_probe")
    if cp is None:
        return 0
    from cupyllm.ops.attention import gpu_dispatch as dispatch
    runner = dispatch.GpuAttention()
    device = bench.device_info(cp)
    rng = np.random.default_rng(0)
    if args.once:
        shape, fmt, kernel, n_keys = args.once
        layers, n_head, head_dim = layers_for(cp, device, shape, fmt, int(n_keys), rng)
        q = cp.asarray(rng.standard_normal((1, n_head, head_dim)).astype(np.float32))
        q_pos = cp.asarray(np.array([int(n_keys) - 1], np.int32))
        for i in range(3):
            runner.attention(q, q_pos, layers[i % len(layers)], scale=head_dim ** -0.5, kernel=kernel)
        cp.cuda.Device().synchronize()
        return 0
    rows = []
    for shape, fmt, n_keys in SWEEP:
        layers, n_head, head_dim = layers_for(cp, device, shape, fmt, n_keys, rng)
        q = cp.asarray(rng.standard_normal((1, n_head, head_dim)).astype(np.float32))
        q_pos = cp.asarray(np.array([n_keys - 1], np.int32))
        n_kv = layers[0].n_kv
        for kernel in ("vec", "mma"):
            auto = dispatch.plan_attention(1, n_head, n_kv, head_dim, n_keys, runner.n_sm, kernel).n_split
            for factor in SPLIT_FACTORS:
                n_split = max(1, int(auto * factor))
                seconds, how = bench.time_calls(
                    cp, lambda i: runner.attention(q, q_pos, layers[i % len(layers)], scale=head_dim ** -0.5,
                                                   kernel=kernel, n_split=n_split), len(layers), 10)
                row = {"shape": shape, "format": fmt, "n_keys": n_keys, "kernel": kernel, "n_split": n_split,
                       "auto_n_split": auto, "us": seconds * 1e6, "timing": how,
                       "pct_of_peak": 100 * layers[0].bytes / seconds / device["peak_bandwidth_bytes_per_s"]}
                rows.append(row)
                print(f"{shape:26s} {fmt:6s} {n_keys:6d} {kernel} split {n_split:4d} (auto {auto:4d}): "
                      f"{row['us']:7.1f} us {row['pct_of_peak']:5.1f}% of peak", flush=True)
        layers = None  # free before the next shape
        cp.get_default_memory_pool().free_all_blocks()
    path = REPO / "bench" / "results" / "attention_probe.json"
    path.write_text(json.dumps({"device": device["name"], "rows": rows}, indent=1))
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
