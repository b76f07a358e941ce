"""Decode attention on the GPU: cupyllm FA-VEC over every KV format vs PyTorch SDPA (flash, f16).

One query token (batch 1) over a KV cache of 4k .. 1M positions (as memory allows), for the shapes

    hd128 32q/8kv (Llama-style), hd256 8q/4kv, hd256 4q/1kv (Gemma 3 270M), hd512 16q/2kv, hd64 14q/2kv (Qwen2.5-0.5B)

and every KV format (K and V in the same format; --pairs adds asymmetric ones). Reported per run, for both
decode kernels (FA-VEC and MMA's decode tiles; "auto" marks the one cupyllm.ops.attention.gpu_dispatch picks): time
(CUDA events, median of the repeats), effective bandwidth = bytes of K and V actually read / time, as a
percentage of the device's peak HBM bandwidth, the split count used, and PyTorch
`scaled_dot_product_attention` with the flash backend on the same shape in f16 (GQA via enable_gqa) with the
speed-up over it. Each timed call reads a different layer's cache (enough layers for > 2x the L2), as a
model's decode step does, so small contexts are not served from L2.

    python bench/attention_gpu.py                       # everything that fits
    python bench/attention_gpu.py --quick               # 4k and 64k, f16 / q8_0 / q4_0 / turbo3

    python bench/attention_gpu.py --smoke               # one tiny row: checks the script (the CUDA emulator too)

Writes bench/results/attention_gpu.json (device named in it; $CUPYLLM_BENCH_RESULTS moves the folder) and copies
it into $OUT when set. Needs a CUDA device (exits with a message otherwise; refuses the CPU emulator but with --smoke).
"""
from __future__ import annotations

import argparse
import json
import math
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

from cupyllm.cuda import device_name, gpu_count  # noqa: E402
from cupyllm.ops.kv_formats.formats import get_format, list_formats  # noqa: E402

# where the GPU benchmarks write their JSON (tests/test_gpu_bench_smoke.py points it at a temporary folder)
RESULTS = Path(os.environ.get("CUPYLLM_BENCH_RESULTS") or REPO / "bench" / "results")
SHAPES = {  # name: (head_dim, n_head, n_kv)
    "hd128_32q8kv": (128, 32, 8),
    "hd256_8q4kv": (256, 8, 4),
    "hd256_4q1kv_gemma3_270m": (256, 4, 1),
    "hd512_16q2kv": (512, 16, 2),
    "hd64_14q2kv_qwen2.5_0.5b": (64, 14, 2),
}
LENGTHS = (4096, 16384, 65536, 262144, 1048576)
PAIRS = (("q8_0", "q4_0"), ("q8_0", "turbo3"), ("f16", "turbo3_tcq"), ("turbo4", "turbo2"))
# Peak HBM bandwidth by device name (bytes/s); other devices: clock x bus width from the properties.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
                  "A100 80GB PCIe": 1.935e12, "A100-SXM4-40GB": 1.555e12, "A100": 1.555e12, "L40S": 0.864e12}
L2_MULTIPLE = 2.0      # cycle through layers totalling this many times the L2 size
MEMORY_FRACTION = 0.6  # of the free device memory, for the caches of one run


def real_cupy(bench: str, smoke: bool = False):
    """CuPy on a CUDA device, or None (saying why) without one or under the CPU emulator (allowed for a smoke
    run: it checks the script, its timings mean nothing)."""
    if gpu_count() == 0:
        print(f"{bench}: no CUDA device (CuPy finds none); nothing to measure")
        return None
    import cupy as cp
    if getattr(cp, "__cupyllm_emulated__", False) and not smoke:
        print(f"{bench}: CuPy is the CPU emulator (CUPYLLM_EMULATE); timings would be meaningless")
        return None
    return cp


def device_info(cp) -> dict:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = device_name()
    peak = next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)
    if peak is None and props.get("memoryClockRate") and props.get("memoryBusWidth"):
        peak = 2.0 * props["memoryClockRate"] * 1e3 * props["memoryBusWidth"] / 8
    return {"name": name, "sm_count": int(props["multiProcessorCount"]), "peak_bandwidth_bytes_per_s": peak,
            "l2_bytes": int(props.get("l2CacheSize", 50 << 20)), "compute_capability": cp.cuda.Device().compute_capability}


class Layer:
    """A LayerKV-like cache of n_keys positions on the device (slot = position)."""

    def __init__(self, k_format, v_format, n_kv, head_dim, k_data, v_data, slot_pos, n_used):
        self.k_format, self.v_format, self.n_kv = k_format, v_format, n_kv
        self.head_dim = self.v_head_dim = head_dim
        self.k_data, self.v_data, self.slot_pos, self.n_used, self.ring = k_data, v_data, slot_pos, n_used, False
        self.bytes = int(k_data.nbytes + v_data.nbytes)


def encoded_block(cp, fmt, head_dim: int, n_kv: int, rows: int, rng):
    """`rows` positions of K-like data encoded by the GPU codec: uint8 [rows, n_kv, row_bytes]."""
    from cupyllm.ops.kv_formats.gpu import GpuKVCodec
    codec = GpuKVCodec(fmt, head_dim, n_kv)
    src = cp.asarray(rng.standard_normal((rows, n_kv, head_dim)).astype(np.float32))
    block = codec.allocate(rows)
    codec.encode(src, cp.arange(rows, dtype=cp.int32), block)
    return block


def make_layers(cp, k_name, v_name, head_dim, n_kv, n_keys, n_layers, rng) -> list[Layer]:
    kf, vf = get_format(k_name, head_dim=head_dim), get_format(v_name, head_dim=head_dim)
    block_rows = min(n_keys, 4096)
    k_block = encoded_block(cp, kf, head_dim, n_kv, block_rows, rng)
    v_block = encoded_block(cp, vf, head_dim, n_kv, block_rows, rng)
    reps = -(-n_keys // block_rows)
    slot_pos = cp.arange(n_keys, dtype=cp.int32)
    layers = []
    for _ in range(n_layers):  # tiled copies of the encoded block: realistic bytes, quick to build
        k = cp.ascontiguousarray(cp.tile(k_block, (reps, 1, 1))[:n_keys])
        v = cp.ascontiguousarray(cp.tile(v_block, (reps, 1, 1))[:n_keys])
        layers.append(Layer(kf, vf, n_kv, head_dim, k, v, slot_pos, n_keys))
    return layers


def time_calls(cp, fn, n_calls: int, repeats: int) -> tuple[float, str]:
    """(median seconds per call of fn(i), i = 0 .. n_calls-1, how it was timed). The calls are captured in a
    CUDA graph when possible, so the host's launch overhead between the kernels of a call is not timed
    (the engine replays decode steps as graphs too); otherwise they are timed as launched."""
    stream = cp.cuda.Stream(non_blocking=True)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    with stream:
        for i in range(min(n_calls, 3)):  # compile, upload tables, fill the memory pool
            fn(i)
        stream.synchronize()
        graph, how = None, "eager"
        try:
            stream.begin_capture()
            try:
                for i in range(n_calls):
                    fn(i)
            finally:
                graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            how = "cuda_graph"
        except Exception:  # noqa: BLE001 - capture unsupported here: time the launches instead
            graph = None
        times = []
        for _ in range(repeats):
            start.record(stream)
            if graph is not None:
                graph.launch(stream)
            else:
                for i in range(n_calls):
                    fn(i)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / n_calls)
    return statistics.median(times), how


def bench_cupyllm(cp, runner, layers, n_head, head_dim, repeats, kernel: str) -> dict:
    from cupyllm.ops.attention import gpu_dispatch as dispatch
    rng = np.random.default_rng(1)
    q = cp.asarray(rng.standard_normal((1, n_head, head_dim)).astype(np.float32))
    n_keys = layers[0].n_used
    q_pos = cp.asarray(np.array([n_keys - 1], np.int32))
    scale = head_dim ** -0.5
    try:
        seconds, how = time_calls(cp, lambda i: runner.attention(q, q_pos, layers[i % len(layers)], scale=scale,
                                                                kernel=kernel), len(layers), repeats)
    except dispatch.AttentionArgumentError as exc:  # e.g. MMA decode tiles of f32 rows beyond shared memory
        return {"error": str(exc)}
    plan = dispatch.plan_attention(1, n_head, layers[0].n_kv, head_dim, n_keys, runner.n_sm, kernel)
    return {"seconds": seconds, "timing": how, "n_split": plan.n_split,
            "bandwidth_bytes_per_s": layers[0].bytes / seconds}


def bench_torch(cp, n_head, n_kv, head_dim, n_keys, n_layers, repeats) -> dict:
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as exc:
        return {"error": f"torch not importable: {exc}"}
    if not torch.cuda.is_available():
        return {"error": "torch has no CUDA"}
    try:
        q = torch.randn(1, n_head, 1, head_dim, device="cuda", dtype=torch.float16)
        kv = [(torch.randn(1, n_kv, n_keys, head_dim, device="cuda", dtype=torch.float16),
               torch.randn(1, n_kv, n_keys, head_dim, device="cuda", dtype=torch.float16)) for _ in range(n_layers)]

        def call(i):
            k, v = kv[i % n_layers]
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=n_head != n_kv)

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(min(n_layers, 3)):
            call(i)
        torch.cuda.synchronize()
        graph, how = torch.cuda.CUDAGraph(), "cuda_graph"  # timed like ours: no host overhead
        try:
            with torch.cuda.graph(graph):
                for i in range(n_layers):
                    call(i)
            replay = graph.replay
        except Exception:  # noqa: BLE001
            how = "eager"

            def replay():
                for i in range(n_layers):
                    call(i)
        times = []
        for _ in range(repeats):
            start.record()
            replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / n_layers)
        result = {"seconds": statistics.median(times), "timing": how, "version": torch.__version__}
        del kv, graph
        torch.cuda.empty_cache()
        return result
    except Exception as exc:  # noqa: BLE001 - e.g. flash has no kernel for head dim 512: recorded, not fatal
        torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--formats", nargs="*", default=list_formats())
    parser.add_argument("--lengths", nargs="*", type=int, default=list(LENGTHS))
    parser.add_argument("--pairs", action="store_true", help="also asymmetric K/V format pairs")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--quick", action="store_true", help="4k and 64k; f16, q8_0, q4_0, turbo3")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="start no new row after this many seconds (0: no limit); the 64k rows run first")
    parser.add_argument("--smoke", action="store_true", help="one tiny row, to check the script (emulator too)")
    args = parser.parse_args(argv)
    cp = real_cupy("attention_gpu", smoke=args.smoke)
    if cp is None:
        return 0
    if args.smoke:
        args.shapes, args.formats, args.lengths = ["hd64_14q2kv_qwen2.5_0.5b"], ["q8_0", "turbo3"], [256]
        args.repeats, args.no_torch, args.pairs = 1, True, False
    from cupyllm.ops.attention import gpu_dispatch as dispatch
    from cupyllm.ops.attention.gpu_dispatch import GpuAttention
    if args.quick:
        args.lengths, args.formats = [4096, 65536], ["f16", "q8_0", "q4_0", "turbo3"]
    device = device_info(cp)
    runner = GpuAttention()
    pairs = [(f, f) for f in args.formats] + (list(PAIRS) if args.pairs else [])
    # the targets' length (64k) first for every shape and format, then the others: a time budget keeps those
    lengths = sorted(args.lengths, key=lambda n: (n != 65536, n))
    jobs = [(s, kf, vf, n) for n in lengths for s in args.shapes for (kf, vf) in pairs]
    rng = np.random.default_rng(0)
    rows, torch_cache = [], {}
    started = time.perf_counter()
    for shape, k_name, v_name, n_keys in tqdm(jobs, desc="attention", unit="run"):
        if args.budget_s and time.perf_counter() - started > args.budget_s:
            rows.append({"shape": shape, "k_format": k_name, "v_format": v_name, "n_keys": n_keys,
                         "skipped": f"time budget of {args.budget_s} s spent"})
            continue
        head_dim, n_head, n_kv = SHAPES[shape]
        kf, vf = get_format(k_name, head_dim=head_dim), get_format(v_name, head_dim=head_dim)
        layer_bytes = n_keys * n_kv * (kf.row_bytes(head_dim) + vf.row_bytes(head_dim))
        free, _ = cp.cuda.runtime.memGetInfo()
        n_layers = 1 if args.smoke else max(1, math.ceil(L2_MULTIPLE * device["l2_bytes"] / layer_bytes))
        row = {"shape": shape, "head_dim": head_dim, "n_head": n_head, "n_kv": n_kv, "n_keys": n_keys,
               "k_format": k_name, "v_format": v_name, "kv_bytes_read": layer_bytes}
        if layer_bytes * (n_layers + 1) > MEMORY_FRACTION * free:
            row["skipped"] = "does not fit in device memory"
            rows.append(row)
            continue
        layers = make_layers(cp, k_name, v_name, head_dim, n_kv, n_keys, n_layers, rng)
        auto = dispatch.choose_kernel(1, n_head, n_kv, head_dim, k_name, v_name)
        row.update(auto_kernel=auto, layers_cycled=n_layers)
        for kernel in ("vec", "mma"):
            result = bench_cupyllm(cp, runner, layers, n_head, head_dim, args.repeats, kernel)
            if "seconds" in result and device["peak_bandwidth_bytes_per_s"]:
                result["pct_of_peak_bandwidth"] = 100.0 * result["bandwidth_bytes_per_s"] / device["peak_bandwidth_bytes_per_s"]
            row[kernel] = result
        del layers
        cp.get_default_memory_pool().free_all_blocks()
        ours = row[auto]
        row.update({f"auto_{k}": v for k, v in ours.items()})
        if not args.no_torch:
            key = (shape, n_keys)
            if key not in torch_cache:
                torch_layers = max(1, math.ceil(L2_MULTIPLE * device["l2_bytes"] / (n_keys * n_kv * head_dim * 4)))
                torch_cache[key] = bench_torch(cp, n_head, n_kv, head_dim, n_keys, torch_layers, args.repeats)
            row["torch_sdpa_flash_f16"] = torch_cache[key]
            if "seconds" in torch_cache[key] and "seconds" in ours:
                row["speedup_vs_torch"] = torch_cache[key]["seconds"] / ours["seconds"]
        rows.append(row)
        _write_report(device, rows)  # after every row: a timeout keeps what ran
    _write_report(device, rows, final=True)
    return 0


def _write_report(device: dict, rows: list, final: bool = False) -> None:
    report = {
        "benchmark": "attention_gpu",
        "what": "decode attention, batch 1, one query over n_keys cached positions; bandwidth = K+V bytes read / time",
        "device": device["name"],
        "device_info": device,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "implementation": "cupyllm.ops.attention.gpu_dispatch (fa_vec) vs torch SDPA flash backend, f16",
        "results": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "attention_gpu.json"
    path.write_text(json.dumps(report, indent=1))
    if final:
        print(f"wrote {path}")
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)


if __name__ == "__main__":
    sys.exit(main())
