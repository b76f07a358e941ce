"""Dual Chunk Attention on the GPU: the fused DCA kernels against plain attention over the same KV cache.

Decode (one query, batch 1) over caches of n_keys positions, per shape and KV format: the time of plain flash
attention (cupyllm.ops.attention.gpu_dispatch, the kernel it picks) and of the fused DCA call
(cupyllm.ops.attention.gpu_dca.gpu_dca_attention: Q in three rotations, one pass over the KV with the same kernel
family), and their ratio; the target is dca / plain <= 1.3. A few prefill rows (--prefill: 512 queries) give
the same ratio for the MMA kernels. Timing as bench/attention_gpu.py (CUDA events around a captured CUDA graph
of calls cycling through enough layers to exceed 2x the L2, median of the repeats).

DCA configuration: chunk_size S (--chunk-size, default 8192: many chunk boundaries, the kernels' worst case
per key), local_size W = S / 32; the query sits at the last position, so every regime is present.

    python bench/dca_gpu.py                 # hd128 28q/4kv (Qwen2.5-7B-1M), f16 / q8_0 / q4_0 / turbo3, 16k and 128k
    python bench/dca_gpu.py --all           # every shape, more lengths, prefill rows
    python bench/dca_gpu.py --smoke         # tiny rows: checks the script (the CUDA emulator too)

Writes bench/results/dca_gpu.json (device named in it, rewritten after every row so a timeout keeps what ran)
and copies it into $OUT when set. Needs a CUDA device (exits with a message otherwise, and refuses the CPU
emulator). Kernels are compiled up front in parallel threads (NVRTC takes ~5-10 s per kernel).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

RESULTS = Path(os.environ.get("CUPYLLM_BENCH_RESULTS") or REPO / "bench" / "results")
SHAPES = {  # name: (head_dim, n_head, n_kv)
    "hd128_28q4kv_qwen2.5_7b": (128, 28, 4),
    "hd128_40q8kv_qwen2.5_14b": (128, 40, 8),
    "hd256_4q1kv_gemma3_270m": (256, 4, 1),
    "hd64_14q2kv_qwen2.5_0.5b": (64, 14, 2),
}
DEFAULT_SHAPES = ("hd128_28q4kv_qwen2.5_7b",)
FORMATS = ("f16", "q8_0", "q4_0", "turbo3")
DEFAULT_LENGTHS = (16384, 131072)
ALL_LENGTHS = (16384, 65536, 262144)
PREFILL_QUERIES = 512
TARGET_RATIO = 1.3
L2_MULTIPLE = 2.0
MEMORY_FRACTION = 0.6


def kernel_names(head_dim: int, rows: int, kernel: str, decode: bool, f16: bool) -> list[str]:
    """The instantiations one plain and one DCA call of this shape launch (compiled up front); f16: K and V
    f16 (fa_mma's f16 path)."""
    from cupyllm.ops.attention import gpu as fk
    names = []
    for dca in (False, True):
        if kernel == "vec":
            names.append(fk.vec_kernel_name(head_dim, fk.vec_rows_for(rows, dca), dca))
        else:
            names.append(fk.mma_kernel_name(head_dim, decode, dca, f16=f16 and decode))
    return names


def precompile(runner, names: set[str]) -> float:
    """Compile the kernels' sets concurrently (NVRTC releases the GIL); returns the seconds it took."""
    from cupyllm.ops.attention import gpu as fk
    from cupyllm.ops.kv_formats.gpu import GROUP_SIZES
    names = set(names)
    for g in (0, *GROUP_SIZES):
        names |= {fk.prep_kernel_name(g, "float32", o) for o in ("float32", "float16")}
        names.add(fk.combine_kernel_name(g, "float32"))
    start = time.perf_counter()
    by_set = {}
    for name in names:
        by_set.setdefault(runner.registry.kernel_set_for(name), name)
    with ThreadPoolExecutor(max_workers=min(16, len(by_set))) as pool:
        list(pool.map(runner.registry.function, by_set.values()))
    for name in names:  # the rest of each set is compiled now
        runner.registry.function(name)
    return time.perf_counter() - start


def bench_pair(cp, runner, layers, n_head, head_dim, n_q, dca, kernel, repeats) -> dict:
    """Plain and DCA attention of n_q queries at the last positions, timed back to back."""
    from attention_gpu import time_calls
    from cupyllm.ops.attention.gpu_dca import gpu_dca_attention
    rng = np.random.default_rng(1)
    q3 = [cp.asarray(rng.standard_normal((n_q, n_head, head_dim)).astype(np.float32)) for _ in range(3)]
    n_keys = layers[0].n_used
    q_pos = cp.asarray(np.arange(n_keys - n_q, n_keys, dtype=np.int32))
    scale = head_dim ** -0.5
    out = {}
    try:
        plain, how = time_calls(cp, lambda i: runner.attention(q3[0], q_pos, layers[i % len(layers)], scale=scale,
                                                               kernel=kernel), len(layers), repeats)
        fused, _ = time_calls(cp, lambda i: gpu_dca_attention(*q3, q_pos, layers[i % len(layers)], dca, scale=scale,
                                                              kernel=kernel, runner=runner), len(layers), repeats)
        plain2, _ = time_calls(cp, lambda i: runner.attention(q3[0], q_pos, layers[i % len(layers)], scale=scale,
                                                              kernel=kernel), len(layers), repeats)
    except Exception as exc:  # noqa: BLE001 - e.g. shared memory limits: recorded, not fatal
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    plain = min(plain, plain2)  # the faster of the runs around the DCA one (clock/thermal drift)
    out.update(kernel=kernel, timing=how, plain_seconds=plain, dca_seconds=fused, dca_over_plain=fused / plain,
               meets_target=fused / plain <= TARGET_RATIO, kv_bandwidth_bytes_per_s_dca=layers[0].bytes / fused)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=None, choices=list(SHAPES))
    parser.add_argument("--formats", nargs="*", default=list(FORMATS))
    parser.add_argument("--lengths", nargs="*", type=int, default=None)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--prefill", action="store_true", help=f"also {PREFILL_QUERIES}-query prefill rows")
    parser.add_argument("--all", action="store_true", help="every shape, more lengths, prefill rows")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=45.0, help="start no new row after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny decode and prefill rows, to check the script "
                        "(emulator too)")
    args = parser.parse_args(argv)
    from attention_gpu import device_info, make_layers, real_cupy
    cp = real_cupy("dca_gpu", smoke=args.smoke)
    if cp is None:
        return 0
    if args.smoke:
        args.shapes, args.formats, args.lengths = ["hd64_14q2kv_qwen2.5_0.5b"], ["q8_0"], [512]
        args.chunk_size, args.repeats, args.prefill, args.budget_s = 256, 1, True, 1e9
    from cupyllm.ops.attention import gpu_dispatch as dispatch
    from cupyllm.ops.attention.dca import DCAConfig
    from cupyllm.ops.attention.gpu_dispatch import GpuAttention
    from cupyllm.ops.kv_formats.formats import get_format
    started = time.perf_counter()
    shapes = args.shapes or (list(SHAPES) if args.all else list(DEFAULT_SHAPES))
    lengths = args.lengths or (ALL_LENGTHS if args.all else DEFAULT_LENGTHS)
    dca = DCAConfig.for_model(args.chunk_size)
    device = device_info(cp)
    runner = GpuAttention()
    modes = [("decode", 1)] + ([("prefill", PREFILL_QUERIES)] if args.prefill or args.all else [])
    jobs = [(s, f, n, mode, n_q) for mode, n_q in modes for s in shapes for f in args.formats for n in lengths]
    names = set()
    for shape, fmt, _, mode, n_q in jobs:
        head_dim, n_head, n_kv = SHAPES[shape]
        kernel = dispatch.choose_kernel(n_q, n_head, n_kv, head_dim, fmt, fmt)
        rows = n_q * (n_head // n_kv)
        names.update(kernel_names(head_dim, rows, kernel, rows <= 16, fmt == "f16"))
    compile_s = precompile(runner, names)
    report = {
        "benchmark": "dca_gpu",
        "what": "fused Dual Chunk Attention vs plain flash attention over the same KV cache (batch 1, queries at "
                "the last positions); dca_over_plain = time ratio, target <= 1.3",
        "device": device["name"], "device_info": device,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dca": {"chunk_size": dca.chunk_size, "local_size": dca.local_size, "chunk_len": dca.chunk_len},
        "implementation": "cupyllm.ops.attention.gpu_dca (fa_vec / fa_mma DCA instantiations) vs "
                          "cupyllm.ops.attention.gpu_dispatch (same kernel family)",
        "compile_seconds": compile_s, "results": [],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "dca_gpu.json"
    rng = np.random.default_rng(0)
    for shape, fmt, n_keys, mode, n_q in jobs:
        head_dim, n_head, n_kv = SHAPES[shape]
        row = {"shape": shape, "mode": mode, "n_q": n_q, "head_dim": head_dim, "n_head": n_head, "n_kv": n_kv,
               "n_keys": n_keys, "k_format": fmt, "v_format": fmt}
        if time.perf_counter() - started > args.budget_s:
            row["skipped"] = f"time budget of {args.budget_s} s spent"
            report["results"].append(row)
            continue
        kf = get_format(fmt, head_dim=head_dim)
        layer_bytes = n_keys * n_kv * 2 * kf.row_bytes(head_dim)
        n_layers = 1 if args.smoke else max(1, math.ceil(L2_MULTIPLE * device["l2_bytes"] / layer_bytes))
        free, _ = cp.cuda.runtime.memGetInfo()
        if layer_bytes * (n_layers + 1) > MEMORY_FRACTION * free:
            row["skipped"] = "does not fit in device memory"
        else:
            layers = make_layers(cp, fmt, fmt, head_dim, n_kv, n_keys, n_layers, rng)
            kernel = dispatch.choose_kernel(n_q, n_head, n_kv, head_dim, fmt, fmt)
            row.update(layers_cycled=n_layers, kv_bytes_read=layer_bytes)
            row.update(bench_pair(cp, runner, layers, n_head, head_dim, n_q, dca, kernel, args.repeats))
            del layers
            cp.get_default_memory_pool().free_all_blocks()
        report["results"].append(row)
        print(json.dumps(row))
        path.write_text(json.dumps(report, indent=1))
    measured = [r for r in report["results"] if "dca_over_plain" in r and r["mode"] == "decode"]
    report["decode_worst_ratio"] = max((r["dca_over_plain"] for r in measured), default=None)
    report["decode_meets_target"] = bool(measured) and all(r["meets_target"] for r in measured)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}; decode worst dca/plain = {report['decode_worst_ratio']}")
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
