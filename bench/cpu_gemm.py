"""The CPU prefill GEMM per weight: the wide micro-kernel (8 rows x 32 tokens in 512-bit lanes) against the narrow
one (4 rows x 32 tokens, 256-bit) and against BLAS (NumPy's sgemm on the weight dequantized to float32 once,
outside the timing), in the same run, on the shapes of the models we run (Qwen2.5-0.5B, Gemma 4 E2B).

Each case: random GGUF blocks of the format, 128 tokens; the kernels alternate in `--rounds` rounds and each
figure is the fastest of its calls (the machine is shared); the wide and narrow results must be bit-equal.
Figures: G multiply-adds/s (n_out x n_in x tokens / s) on all cores, and wide / narrow, wide / BLAS.

    python bench/cpu_gemm.py [--tokens 128] [--rounds 5] [--out bench/results/cpu_gemm.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from cupyllm.quant import cpu_gemm  # noqa: E402
from cupyllm.quant.cpu_matmul import F16_TABLE  # noqa: E402
from cupyllm.quant.weights import WEIGHT_FORMATS, dequantize  # noqa: E402
from host_cpu import cpu_description  # noqa: E402
from test_weights import random_rows  # noqa: E402

SHAPES = {  # (n_out, n_in) of a model's weights
    "qwen2.5-0.5b q/o": (896, 896),
    "qwen2.5-0.5b gate/up": (4864, 896),
    "qwen2.5-0.5b down": (896, 4864),
    "gemma4-e2b q": (2048, 1536),
    "gemma4-e2b gate/up": (6144, 1536),
    "gemma4-e2b down": (1536, 6144),
}
TYPES = (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0)


def fastest(fn, calls: int = 3) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu_gemm.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    cases = [(s, t) for s in SHAPES.items() for t in TYPES if s[1][1] % gguf.GGML_QUANT_SIZES[t][0] == 0]
    for (shape_name, (n_out, n_in)), qtype in tqdm(cases, desc="cpu gemm"):  # (K-quants: rows of 256s only)
        fmt = WEIGHT_FORMATS[qtype]
        data = random_rows(qtype, n_out, n_in, seed=len(rows))
        x = rng.standard_normal((args.tokens, n_in)).astype(np.float32)
        weight_f32 = dequantize(data, qtype, n_in)
        xp, xd, xs = cpu_gemm.pack_activations(x)
        outs = {name: np.empty((args.tokens, n_out), np.float32) for name in ("narrow", "wide")}
        kernels = {
            "narrow": lambda: cpu_gemm.gemm_blocks(fmt.code, data, xp, xd, xs, args.tokens, outs["narrow"], F16_TABLE),
            "wide": lambda: cpu_gemm.gemm_blocks_wide(fmt.code, data, xp, xd, xs, args.tokens, outs["wide"],
                                                      F16_TABLE),
            "blas": lambda: x @ weight_f32.T,
        }
        for kernel in kernels.values():
            kernel()  # (compiled, warm)
        assert np.array_equal(outs["narrow"], outs["wide"]), (shape_name, qtype.name)
        times = {name: [] for name in kernels}
        for round_ in range(args.rounds):
            for name in (list(kernels) if round_ % 2 == 0 else list(kernels)[::-1]):
                times[name].append(fastest(kernels[name]))
        macs = n_out * n_in * args.tokens
        gmacs = {name: macs / min(t) / 1e9 for name, t in times.items()}
        rows.append({"shape": shape_name, "n_out": n_out, "n_in": n_in, "type": qtype.name, "tokens": args.tokens,
                     "gmac_per_s": {k: round(v, 1) for k, v in gmacs.items()},
                     "wide_vs_narrow": round(gmacs["wide"] / gmacs["narrow"], 2),
                     "wide_vs_blas": round(gmacs["wide"] / gmacs["blas"], 2)})
        print(f"{shape_name:22s} {qtype.name:5s} narrow {gmacs['narrow']:6.1f}  wide {gmacs['wide']:6.1f}  "
              f"blas {gmacs['blas']:6.1f} G MAC/s   wide/narrow x{rows[-1]['wide_vs_narrow']:.2f}  "
              f"wide/blas x{rows[-1]['wide_vs_blas']:.2f}")
    result = {"cpu": cpu_description(), "wide_gemm_in_engine": cpu_gemm.WIDE_GEMM, "date": time.strftime("%Y-%m-%d"),
              "rounds": args.rounds, "cases": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
