"""KV encode throughput: K + V rows of new tokens quantized into the cache, per layer.

For every KV format, head_dim 128 and 256, n_kv_heads 8: tokens/s of one layer's K+V append, on the CPU
(the NumPy/numba encoders of cupyllm.kv) and, where a CUDA device is present, on the GPU
(cupyllm.ops.kv_formats.gpu, timed with CUDA events after a warm-up; median of the repeats). On the GPU each
head-dim-128 row also gets its share of one prefill step of a Qwen3-8B layer over the same tokens (the
layer's weight products through the engine's cuBLAS prefill path), the measure of the KV issue's
"TCQ encode <= 10% of a prefill step"; the TCQ encoder is also timed at smaller trellis sizes (TRELLIS_SIZES).
That denominator leaves out attention, norms and rope, so it understates a step. The engine's own prefill step
is timed too (`engine_prefill`): a random-weight Qwen3-8B (tests/support/make_tiny_models.py preset, Q4_K_M types,
--engine-layers of its 36 layers, a small vocabulary) prefills --engine-tokens tokens in the engine's chunks of
512 with K and V in f16, turbo3, turbo3_tcq and turbo2_tcq; each TCQ row gets the encode's share of that step
(the encode timed above over the same tokens / the prefill seconds per layer) and the step's own difference
from turbo3 (the same rotation, norm and attention reads; only the search differs).

    python bench/kv_encode.py                 # CPU, plus GPU when one is present
    python bench/kv_encode.py --device gpu    # only the GPU

Writes bench/results/kv_encode_{cpu,gpu}.json (device named in it) and copies them into $OUT when set.
"""
from __future__ import annotations

import argparse
import dataclasses
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
sys.path.insert(0, str(REPO / "bench"))  # (also when loaded as a module: tests/test_cuda_compile.py)

from cupyllm.cuda import device_name, gpu_count  # noqa: E402
from host_cpu import cpu_description  # noqa: E402
from cupyllm.ops.kv_formats.formats import get_format, list_formats  # noqa: E402

RESULTS = Path(os.environ.get("CUPYLLM_BENCH_RESULTS") or REPO / "bench" / "results")
N_KV_HEADS = 8
HEAD_DIMS = (128, 256)




def kv_rows(rng, n_tokens: int, head_dim: int) -> np.ndarray:
    x = rng.standard_normal((n_tokens, N_KV_HEADS, head_dim)).astype(np.float32)
    return x * (10.0 ** rng.uniform(-1, 1, (n_tokens, N_KV_HEADS, 1))).astype(np.float32)


def bench_cpu(fmt, head_dim: int, n_tokens: int, min_seconds: float, rng) -> dict:
    k, v = kv_rows(rng, n_tokens, head_dim), kv_rows(rng, n_tokens, head_dim)
    fmt.encode(k[:1].reshape(-1, head_dim))  # numba compile / table load outside the timing
    times = []
    start = time.perf_counter()
    while not times or (time.perf_counter() - start < min_seconds and len(times) < 50):
        t0 = time.perf_counter()
        fmt.encode(k.reshape(-1, head_dim))
        fmt.encode(v.reshape(-1, head_dim))
        times.append(time.perf_counter() - t0)
    return _row(fmt, head_dim, n_tokens, times)


def gpu_inputs(cp, rng, n_tokens: int, head_dim: int, cache: dict):
    """Three (K, V) input sets per head dim on the device, made once (several sets, so repeated runs do not
    just re-read the L2)."""
    if head_dim not in cache:
        cache[head_dim] = [(cp.asarray(kv_rows(rng, n_tokens, head_dim)), cp.asarray(kv_rows(rng, n_tokens, head_dim)))
                           for _ in range(3)]
    return cache[head_dim]


def time_gpu(cp, run, repeats: int) -> list[float]:
    """CUDA-event times of run(i) after one warm-up call per input set."""
    for i in range(3):
        run(i)
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for i in range(repeats):
        start.record()
        run(i)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return times


def bench_gpu(fmt, head_dim: int, n_tokens: int, repeats: int, rng, registry, input_cache: dict) -> dict:
    import cupy as cp
    from cupyllm.ops.kv_formats.gpu import GpuKVCodec

    codec = GpuKVCodec(fmt, head_dim, N_KV_HEADS, registry=registry)
    inputs = gpu_inputs(cp, rng, n_tokens, head_dim, input_cache)
    slots = cp.asarray(rng.permutation(2 * n_tokens)[:n_tokens].astype(np.int32))
    k_cache, v_cache = codec.allocate(2 * n_tokens), codec.allocate(2 * n_tokens)

    def run(i):
        k, v = inputs[i % len(inputs)]
        codec.encode(k, slots, k_cache)
        codec.encode(v, slots, v_cache)

    return _row(fmt, head_dim, n_tokens, time_gpu(cp, run, repeats))


# Trellis sizes the GPU encoder is timed at beside the formats' (3, 9) and (2, 8): what a smaller search would
# cost, for the decision on the TCQ encode budget (held-out MSE of each size: bench/results/tcq_trellis_sizes.json).
# Below 32 predecessor sets, several groups share a warp's CTA.
TRELLIS_SIZES = ((3, 9), (3, 8), (3, 7), (3, 6), (2, 8), (2, 7), (2, 6), (2, 5))


def bench_gpu_trellis(k: int, L: int, n_tokens: int, repeats: int, rng, input_cache: dict) -> dict:
    """bench_gpu at head dim 128 with the TCQ encoder at step k, window L (a codebook of Gaussian quantiles: the
    search does the same work whatever the values)."""
    from cupyllm.ops.kv_formats.gpu import trellis_encode_kernel, trellis_registry
    from cupyllm.ops.kv_formats import tcq

    fmt = tcq.trellis_format(k, L, 128, tcq.initial_codebook(L))
    row = bench_gpu(fmt, 128, n_tokens, repeats, rng, trellis_registry([trellis_encode_kernel(fmt)]), input_cache)
    return {**row, "k": k, "L": L, "states": 1 << L, "bits_per_value": fmt.bits_per_value}


def trellis_gain_db(k: int, L: int) -> float | None:
    """Held-out gain over scalar Lloyd-Max of trellis (k, L), from tools/tcq_trellis_sizes.py's results."""
    path = RESULTS / "tcq_trellis_sizes.json"
    if not path.exists():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"] if (r["k"], r["L"]) == (k, L)]
    return rows[0]["gain_db"] if rows else None


# The layer whose prefill step the encode is compared with: Qwen3-8B (head dim 128, 8 KV heads like the
# encode rows above): hidden 4096, 32 query heads, FFN 12288.
PREFILL_LAYER = {"model": "Qwen3-8B layer", "hidden": 4096, "n_head": 32, "n_kv": 8, "head_dim": 128, "ffn": 12288}


def bench_gpu_prefill_layer(n_tokens: int, repeats: int) -> dict:
    """Seconds of one transformer layer's weight products for n_tokens (the engine's prefill path: f16
    weights, cuBLAS GemmEx with float32 output; attention and norms left out, so the step is
    underestimated and the encode share overestimated)."""
    import cupy as cp
    from cupyllm.ops.matmul.gpu_blas import matmul_f16_f32

    L = PREFILL_LAYER
    q_out = L["n_head"] * L["head_dim"]
    kv_out = L["n_kv"] * L["head_dim"]
    shapes = [(q_out + 2 * kv_out, L["hidden"]), (L["hidden"], q_out), (2 * L["ffn"], L["hidden"]),
              (L["hidden"], L["ffn"])]
    weights = [(cp.random.standard_normal(shape, dtype=cp.float32) * 0.02).astype(cp.float16) for shape in shapes]
    x = {n_in: cp.random.standard_normal((n_tokens, n_in), dtype=cp.float32).astype(cp.float16)
         for n_in in {s[1] for s in shapes}}
    outs = [cp.empty((n_tokens, s[0]), dtype=cp.float32) for s in shapes]

    def run(_):
        for w, out in zip(weights, outs):
            matmul_f16_f32(cp, x[w.shape[1]], w, out=out)

    seconds = statistics.median(time_gpu(cp, run, repeats))
    flops = 2 * n_tokens * sum(a * b for a, b in shapes)
    return {**L, "tokens": n_tokens, "seconds_per_layer": seconds, "tflop_per_s": flops / seconds / 1e12}


ENGINE_FORMATS = ("f16", "turbo3", "turbo3_tcq", "turbo2_tcq")
ENGINE_CHUNK = 512  # the engine's default prefill chunk (cupyllm.load's max_chunk)


def bench_gpu_engine_prefill(n_tokens: int, n_layer: int, repeats: int, smoke: bool = False) -> dict:
    """Seconds of the engine's prefill of n_tokens on a random-weight Qwen3-8B of n_layer layers (smoke: the
    tiny test Qwen3 at head dim 128), per KV format of ENGINE_FORMATS (K and V alike); best of `repeats` after a warm-up."""
    import tempfile
    import cupy as cp
    sys.path.insert(0, str(REPO / "tests" / "support"))  # make_tiny_models
    from make_tiny_models import PRESETS, tiny_spec, write_gguf
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.generate import prefill
    from cupyllm.files.gguf import read_gguf
    from cupyllm.kv.cache import KVSpec
    from cupyllm.models.build import Transformer

    spec = (dataclasses.replace(tiny_spec("qwen3"), head_dim=128) if smoke  # (the turbo kernels' group size)
            else dataclasses.replace(PRESETS["qwen3-8b"], n_layer=n_layer, n_vocab=None))
    with tempfile.TemporaryDirectory(prefix="cupyllm-kv-encode-") as work:
        path = Path(work) / "qwen3-8b-layers.gguf"
        write_gguf(spec, path)
        ops = GPUBackend()
        transformer = Transformer.from_gguf(read_gguf(path), ops, progress=False)
    ids = np.random.default_rng(0).integers(0, transformer.cfg.n_vocab, n_tokens)

    def forward(tokens, positions, kv, all_logits=False):
        return ops.to_numpy(transformer.forward(tokens, positions, kv, all_logits))

    rows = []
    for name in tqdm(ENGINE_FORMATS, desc="GPU engine prefill by KV format"):
        cache = ops.new_cache(transformer.cfg, KVSpec(ctx=n_tokens, kv_type_k=name, kv_type_v=name,
                                                      max_chunk=ENGINE_CHUNK))
        times = []
        for _ in range(repeats + 1):  # the first compiles and warms up
            cache.clear()
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            prefill(forward, ids, cache, ENGINE_CHUNK, progress=False)
            cp.cuda.Device().synchronize()
            times.append(time.perf_counter() - t0)
        seconds = min(times[1:])
        rows.append({"format": name, "prefill_seconds": seconds, "seconds_per_layer": seconds / spec.n_layer,
                     "prefill_tokens_per_s": n_tokens / seconds})
        del cache
        cp.get_default_memory_pool().free_all_blocks()
    by_name = {r["format"]: r for r in rows}
    for row in rows:
        row["over_turbo3"] = row["prefill_seconds"] / by_name["turbo3"]["prefill_seconds"] - 1
    return {"model": "Qwen3-8B shapes (random weights, Q4_K_M types)" if not smoke else "tiny Qwen3 (smoke)",
            "n_layer": spec.n_layer, "hidden": spec.d_model, "n_head": spec.n_head, "n_kv": spec.n_kv_head,
            "head_dim": spec.head_dim, "ffn": spec.ffn_dim, "tokens": n_tokens, "chunk": ENGINE_CHUNK,
            "timing": "wall time of the whole prefill with the device synchronized around it, best of repeats",
            "repeats": repeats, "rows": rows}


def _row(fmt, head_dim: int, n_tokens: int, times: list[float]) -> dict:
    seconds = statistics.median(times)
    src_bytes = 2 * n_tokens * N_KV_HEADS * head_dim * 4  # K and V, float32
    cache_bytes = 2 * n_tokens * N_KV_HEADS * fmt.row_bytes(head_dim)
    return {
        "format": fmt.name,
        "head_dim": head_dim,
        "n_kv_heads": N_KV_HEADS,
        "tokens": n_tokens,
        "repeats": len(times),
        "seconds_per_layer_kv": seconds,
        "tokens_per_s": n_tokens / seconds,
        "bytes_moved_per_s": (src_bytes + cache_bytes) / seconds,
    }


def write_results(device: str, device_name: str, rows: list[dict], extra: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"kv_encode_{device}.json"
    payload = {
        "benchmark": "kv_encode",
        "what": "K+V encode of new tokens into the cache, one layer; tokens_per_s = tokens / (K time + V time)",
        "device": device_name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
        "results": rows,
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
    out = os.environ.get("OUT")
    if out:
        shutil.copy(path, Path(out) / path.name)
    return path


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'format':<12} {'head_dim':>8} {'tokens':>7} {'ms/layer':>9} {'tokens/s':>12} {'GB/s':>8}")
    for r in rows:
        print(f"{r['format']:<12} {r['head_dim']:>8} {r['tokens']:>7} {r['seconds_per_layer_kv'] * 1e3:>9.3f} "
              f"{r['tokens_per_s']:>12,.0f} {r['bytes_moved_per_s'] / 1e9:>8.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "gpu", "all"), default="all",
                        help="all = CPU, plus GPU when one is present (default)")
    parser.add_argument("--formats", default=",".join(list_formats()), help="comma-separated format names")
    parser.add_argument("--cpu-tokens", type=int, default=256)
    parser.add_argument("--cpu-tcq-tokens", type=int, default=32, help="the numba Viterbi is slow")
    parser.add_argument("--cpu-seconds", type=float, default=0.5, help="minimum timed time per CPU case")
    parser.add_argument("--gpu-tokens", type=int, default=8192)
    parser.add_argument("--gpu-repeats", type=int, default=20)
    parser.add_argument("--engine-tokens", type=int, default=8192, help="prompt of the engine prefill step (0: skip)")
    parser.add_argument("--engine-layers", type=int, default=4, help="Qwen3-8B layers of the engine prefill model")
    parser.add_argument("--engine-repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the engine prefill on the tiny test Qwen3 (the emulator)")
    args = parser.parse_args(argv)
    names = [n for n in args.formats.split(",") if n]
    rng = np.random.default_rng(0)
    cases = [(name, hd) for name in names for hd in HEAD_DIMS]

    if args.device in ("cpu", "all"):
        rows = []
        for name, hd in tqdm(cases, desc="CPU kv encode"):
            tokens = args.cpu_tcq_tokens if name.endswith("_tcq") else args.cpu_tokens
            rows.append(bench_cpu(get_format(name, head_dim=hd), hd, tokens, args.cpu_seconds, rng))
        path = write_results("cpu", cpu_description(), rows, {"implementation": "cupyllm.kv (NumPy / numba)"})
        print_table(f"CPU ({cpu_description()}) -> {path}", rows)

    if args.device in ("gpu", "all"):
        if gpu_count() == 0:
            if args.device == "gpu":
                print("no CUDA device: GPU benchmark not run", file=sys.stderr)
                return 1
            return 0
        import cupy as cp
        from cupyllm.cuda.registry import KernelRegistry

        gpu_name = device_name()
        registry = KernelRegistry()
        extra = {"implementation": "kernels_cu/kv_formats/kv_encode.cu via cupyllm.ops.kv_formats.gpu",
                 "cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
                 "timing": "CUDA events, median of repeats after a warm-up"}
        prefill = bench_gpu_prefill_layer(args.gpu_tokens, args.gpu_repeats)
        extra["prefill_layer"] = prefill
        rows, input_cache = [], {}
        for name, hd in tqdm(cases, desc="GPU kv encode"):
            row = bench_gpu(get_format(name, head_dim=hd), hd, args.gpu_tokens, args.gpu_repeats, rng, registry,
                            input_cache)
            if hd == PREFILL_LAYER["head_dim"]:
                row["share_of_prefill_layer"] = row["seconds_per_layer_kv"] / prefill["seconds_per_layer"]
            rows.append(row)
            path = write_results("gpu", gpu_name, rows, extra)  # after every row: a timeout keeps what ran
        trellis_rows = []
        for k, L in tqdm(TRELLIS_SIZES, desc="GPU TCQ encode by trellis size"):
            row = bench_gpu_trellis(k, L, args.gpu_tokens, args.gpu_repeats, rng, input_cache)
            row["share_of_prefill_layer"] = row["seconds_per_layer_kv"] / prefill["seconds_per_layer"]
            row["gain_db_over_scalar"] = trellis_gain_db(k, L)
            trellis_rows.append(row)
            extra["tcq_trellis_sizes"] = trellis_rows
            path = write_results("gpu", gpu_name, rows, extra)
        if args.engine_tokens:
            engine = bench_gpu_engine_prefill(args.engine_tokens, args.engine_layers, args.engine_repeats, args.smoke)
            extra["engine_prefill"] = engine
            # the encode rows were timed over gpu_tokens tokens of N_KV_HEADS heads: scale them to the engine's
            # prompt and KV heads (the same for Qwen3-8B; the smoke model has fewer heads)
            per_group = args.engine_tokens * engine["n_kv"] / (args.gpu_tokens * N_KV_HEADS)
            encode_seconds = {r["format"]: r["seconds_per_layer_kv"] * per_group
                              for r in rows if r["head_dim"] == engine["head_dim"]}
            for row in engine["rows"]:
                if row["format"] in encode_seconds:
                    row["encode_share_of_step"] = encode_seconds[row["format"]] / row["seconds_per_layer"]
            path = write_results("gpu", gpu_name, rows, extra)
            print(f"engine prefill of {engine['tokens']} tokens ({engine['model']}, {engine['n_layer']} layers, "
                  f"chunks of {engine['chunk']}):")
            for row in engine["rows"]:
                share = row.get("encode_share_of_step")
                print(f"  {row['format']:<12} {row['seconds_per_layer'] * 1e3:8.2f} ms/layer, "
                      f"{100 * row['over_turbo3']:+.1f}% vs turbo3"
                      + (f", encode = {100 * share:.1f}% of the step" if share is not None else ""))
        print(f"prefill step of one {prefill['model']} ({args.gpu_tokens} tokens, weight products only): "
              f"{prefill['seconds_per_layer'] * 1e3:.2f} ms ({prefill['tflop_per_s']:.0f} TFLOP/s)")
        for row in rows:
            if "share_of_prefill_layer" in row:
                print(f"  {row['format']:<12} encode = {100 * row['share_of_prefill_layer']:.1f}% of it")
        for row in trellis_rows:
            print(f"  trellis k={row['k']} L={row['L']} ({row['states']} states): "
                  f"{row['seconds_per_layer_kv'] * 1e3:.3f} ms = {100 * row['share_of_prefill_layer']:.1f}% of it")
        print_table(f"GPU ({gpu_name}) -> {path}", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
