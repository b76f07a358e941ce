"""fa_mma's dequantizing pass alone: the Half8 readers against the definition they replace, in one run.

fa_mma (prefill, and decode of every quantized KV format) stages raw cache rows in shared memory and reads them
into f16 tiles (fa_common.cuh). `fa_dequant_bench<D, Reader>` (fa_combine.cu) runs that pass, the very loops
of fa_mma (DequantRows into a K tile, DequantColumns into a V^T tile), over a large cache of one format and folds
the tiles into a checksum: through Half8 (f16 arithmetic for the block formats) and through Half8FromFloats
(Chunk8's floats rounded), the reader the kernels used before. Both must give the same checksums (checked
here). Reported per format and head dim: time per pass (CUDA events, median),
values per second, and the speed-up of Half8. tools/sass_count.py gives the same comparison as static
instruction counts (no GPU).

    python bench/dequant_gpu.py [--rows 1048576] [--repeats 20]
    python bench/dequant_gpu.py --smoke     # 64 rows at head dim 128: checks the script (emulator too)

Writes bench/results/dequant_gpu.json (device named in it) and copies it into $OUT when set. Needs a CUDA
device (exits with a message otherwise, and refuses the CPU emulator).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cupyllm.cuda import device_name, gpu_count  # noqa: E402
from cupyllm.ops.kv_formats.formats import get_format, list_formats  # noqa: E402

RESULTS = Path(os.environ.get("CUPYLLM_BENCH_RESULTS") or REPO / "bench" / "results")
HEAD_DIMS = (128, 64)


def dequant_pass(cp, registry, fmt, rows, head_dim: int, from_floats: bool, n_blocks: int):
    """A launcher of one pass over `rows` (uint8 [n_rows, row_bytes]) and the checksum array it writes."""
    from cupyllm.ops.attention import gpu as fk
    kernel = registry.function(fk.dequant_bench_kernel_name(head_dim, from_floats))
    table = cp.asarray(fk.kernel_table(fmt))
    n_table = fk.table_len(fmt)
    smem = fk.dequant_bench_smem_bytes(head_dim, rows.shape[1], n_table)
    kernel.max_dynamic_shared_size_bytes = max(smem, fk.DEFAULT_SMEM_LIMIT)
    checksum = cp.zeros(n_blocks, cp.uint32)
    args = (rows, table, checksum, np.int32(rows.shape[0]), np.int32(fk.FORMAT_IDS[fmt.name]),
            np.int32(rows.shape[1]), np.int32(n_table))

    def launch():
        kernel((n_blocks,), (fk.THREADS,), args, shared_mem=smem)
    return launch, checksum


def time_pass(cp, launch, repeats: int) -> float:
    start, end = cp.cuda.Event(), cp.cuda.Event()
    launch()  # compile, warm the caches' tags
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e-3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1 << 20, help="cache rows per format (one KV head each)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "dequant_gpu.json")
    parser.add_argument("--smoke", action="store_true", help="a few rows at head dim 128, to check the script "
                        "(emulator too)")
    args = parser.parse_args()
    if gpu_count() == 0:
        print("bench/dequant_gpu.py: no CUDA device (CuPy finds none); nothing to measure")
        return 0
    import cupy as cp
    if getattr(cp, "__cupyllm_emulated__", False) and not args.smoke:
        print("bench/dequant_gpu.py: CuPy is the CPU emulator (CUPYLLM_EMULATE); timings would be meaningless")
        return 0
    if args.smoke:
        args.rows, args.repeats = 64, 1
    from cupyllm.ops.kv_formats.gpu import GpuKVCodec
    from cupyllm.cuda.registry import KernelRegistry
    registry = KernelRegistry()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = device_name()
    n_blocks = 2 if args.smoke else 4 * int(props["multiProcessorCount"])
    rng = np.random.default_rng(0)
    results = []
    cases = [(d, f) for d in ((128,) if args.smoke else HEAD_DIMS) for f in list_formats() if f not in ("f32", "bf16")]
    for head_dim, fmt_name in tqdm(cases, desc="dequant passes", unit="format"):
        fmt = get_format(fmt_name, head_dim=head_dim)
        codec = GpuKVCodec(fmt, head_dim, 1)
        block_rows = min(1 << 14, args.rows)  # encoded once, tiled: realistic bytes, quick to build
        src = cp.asarray(rng.standard_normal((block_rows, 1, head_dim)).astype(np.float32))
        block = codec.allocate(block_rows)
        codec.encode(src, cp.arange(block_rows, dtype=cp.int32), block)
        rows = cp.ascontiguousarray(cp.tile(block.reshape(block_rows, -1), (-(-args.rows // block_rows), 1))[:args.rows])
        row = {"head_dim": head_dim, "format": fmt_name, "rows": args.rows, "row_bytes": int(rows.shape[1])}
        sums = {}
        for from_floats in (False, True):
            launch, checksum = dequant_pass(cp, registry, fmt, rows, head_dim, from_floats, n_blocks)
            seconds = time_pass(cp, launch, args.repeats)
            sums[from_floats] = cp.asnumpy(checksum)
            key = "from_floats" if from_floats else "half8"
            row[f"{key}_us"] = round(seconds * 1e6, 2)
            row[f"{key}_values_per_s"] = args.rows * head_dim / seconds
        row["checksums_equal"] = bool(np.array_equal(sums[False], sums[True]))
        row["half8_speedup"] = round(row["from_floats_us"] / row["half8_us"], 3)
        results.append(row)
        print(f"hd{head_dim} {fmt_name:<11} Half8 {row['half8_us']:9.1f} us  from floats {row['from_floats_us']:9.1f} us"
              f"  x{row['half8_speedup']:.2f}{'' if row['checksums_equal'] else '  CHECKSUMS DIFFER'}")
        del rows, block
    report = {"device": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "what": "fa_mma's dequantizing pass alone (fa_dequant_bench): Half8 vs Chunk8's floats rounded",
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if os.environ.get("OUT"):
        shutil.copy(args.out, Path(os.environ["OUT"]) / args.out.name)
    bad = [r for r in results if not r["checksums_equal"]]
    print(f"wrote {args.out}" + (f"; {len(bad)} formats with differing checksums" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
