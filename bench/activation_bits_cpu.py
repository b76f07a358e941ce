"""What 8-bit activation codes would buy the CPU's Q4_K GEMV, and what they would cost in accuracy: a design
measurement, not an engine path.

The engine's GEMV multiplies each weight row by the activation rounded to 16-bit codes per 32 values
(ops/matmul/activation_codes.py), which keeps its matmuls 1e-3-exact against transformers; llama.cpp rounds to
8-bit codes (q8_0 / q8_K). With VNNI, a Q4_K pair of sub-blocks then takes one `vpdpbusd` where 16-bit codes take
two and a shift (the high and low bytes of each code). This script writes the 8-bit kernel beside the engine's
(same super-block loop, scales, prefetch; only the activation codes and their products differ) and times both on
a Q4_K weight larger than the caches, all cores, alternating rounds, the fastest call of each; and it gives
each one's largest error on the first rows against the dequantized weight times x in float32, over the largest
output (Gaussian x).

    python bench/activation_bits_cpu.py [--rounds 12] [--out bench/results/activation_bits_cpu.json]

Needs AVX-512 VNNI (the prototype is written for it only).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "ops"))  # test_matmul.random_rows

from gguf import GGMLQuantizationType as T  # noqa: E402

from cupyllm.ops.matmul import cpu_gemv as G  # noqa: E402
from cupyllm.ops.matmul.reference import WEIGHT_FORMATS  # noqa: E402
from cupyllm.ops.simd import (MACHINE_HAS_VNNI, dpbusd, fadd, fma, hsum, izeros_16, lane_pair_splat_16,  # noqa: E402
                              load_bytes_64, to_f32, zeros, zeros_16)
from host_cpu import cpu_description  # noqa: E402
from test_matmul import random_rows  # noqa: E402

SHAPE = (131072, 2048)  # 151 MB of Q4_K: every row from DRAM


@njit(inline="always")
def _dot_q4_k_8bit(row, xb8, xd, xsum, f16, ahead):
    """The engine's _dot_k_wide (VNNI, Q4_K) with one vpdpbusd a pair of sub-blocks: x's 8-bit codes (int8)."""
    al, ah = zeros_16(), zeros_16()
    mins = zeros()
    for b in range(xb8.shape[0] // 256):
        o = b * 144
        G._prefetch_ahead(row, o + ahead, 144)
        sc, m = G._k_scale_mins(row, o)
        scales, block_mins = G._k_scales(sc, m, G._half(row, o, f16), G._half(row, o + 2, f16), xd, xsum, b * 8)
        mins = fadd(mins, block_mins)
        for pair in range(4):
            sums = dpbusd(izeros_16(), G._k_codes_bytes(row, o, pair, False), load_bytes_64(xb8, b * 256 + pair * 64))
            al, ah = ah, fma(to_f32(sums), lane_pair_splat_16(scales, 2 * pair), al)
    return hsum(fadd(al, ah)) - hsum(mins)


@njit(parallel=True, nogil=True)
def gemv_8bit(data, xb8, xd, xsum, out, f16, ahead, shares):
    n = data.shape[0]
    for s in prange(shares):
        for r in range(s * n // shares, (s + 1) * n // shares):
            out[r] = _dot_q4_k_8bit(data[r], xb8, xd, xsum, f16, ahead)


def codes_8bit(x: np.ndarray):
    """x rounded to int8 codes per 32 values (q8_0's rule): (codes as bytes, scales, sums of x_hat per block),
    the scale arrays padded as the engine's are."""
    blocks = x.reshape(-1, 32)
    scale = (np.abs(blocks).max(axis=1) / 127).astype(np.float32)
    q = np.clip(np.rint(blocks / np.where(scale > 0, scale, 1)[:, None]), -127, 127).astype(np.int8)
    xd = np.zeros(len(scale) + 8, np.float32)
    xsum = np.zeros_like(xd)
    xd[:len(scale)] = scale
    xsum[:len(scale)] = q.sum(axis=1) * scale
    return q.reshape(-1).view(np.uint8).copy(), xd, xsum


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "activation_bits_cpu.json")
    args = parser.parse_args(argv)
    if not MACHINE_HAS_VNNI:
        print("activation_bits_cpu: the prototype needs AVX-512 VNNI; nothing measured")
        return 0
    n_out, n_in = SHAPE
    fmt = WEIGHT_FORMATS[T.Q4_K]
    data = random_rows(T.Q4_K, n_out, n_in, seed=3)
    data.flags.writeable = False
    x = np.random.default_rng(0).standard_normal(n_in).astype(np.float32)
    xb8, xd, xsum = codes_8bit(x)
    codes = np.array([fmt.code], np.int64)
    out8, out16 = np.empty(n_out, np.float32), np.empty((1, n_out), np.float32)
    threads = numba.get_num_threads()
    kernels = {"8-bit": lambda: gemv_8bit(data, xb8, xd, xsum, out8, G.F16_TABLE, G.PREFETCH_BYTES, threads),
               "16-bit (engine)": lambda: G.gemv_blocks(codes, (data,), x[None], (out16,), G.F16_TABLE, None,
                                                        G.PREFETCH_BYTES, threads)}
    for kernel in kernels.values():
        kernel()
    exact = G.dequantize_numba(data[:256], fmt, n_in).astype(np.float64) @ x.astype(np.float64)
    errors = {"8-bit": np.abs(out8[:256] - exact).max() / np.abs(exact).max(),
              "16-bit (engine)": np.abs(out16[0, :256] - exact).max() / np.abs(exact).max()}
    best = {name: float("inf") for name in kernels}
    for round_ in range(args.rounds):
        for name in (list(kernels) if round_ % 2 == 0 else list(kernels)[::-1]):
            t0 = time.perf_counter()
            kernels[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    rows = {name: {"gb_per_s": data.nbytes / best[name] / 1e9, "max_error_over_max_output": float(errors[name])}
            for name in kernels}
    report = {"bench": "activation_bits_cpu", "device": cpu_description(), "threads": threads,
              "weight": {"type": "Q4_K", "shape": list(SHAPE), "bytes": int(data.nbytes)}, "rounds": args.rounds,
              "results": rows, "command": " ".join(["python", *sys.argv]), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, row in rows.items():
        print(f"{name:16s} {row['gb_per_s']:5.1f} GB/s   max error / max output {row['max_error_over_max_output']:.1e}")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
