"""The CPU quantized matmuls per weight, wide (512-bit lanes) against narrow (256-bit) in the same run:

- the prefill GEMM (8 rows x 32 tokens against 4 x 32 per micro-kernel) and BLAS (NumPy's sgemm on the weight
  dequantized to float32 once, outside the timing), 128 tokens, on the shapes of Qwen2.5-0.5B and Gemma 4 E2B;
  the wide and narrow results must be bit-equal. Figures: G multiply-adds/s (n_out x n_in x tokens / s).
- the decode GEMV of every block format (one token; 32 products a madd against 16), on Qwen2.5-0.5B's gate/up,
  Gemma 4 E2B's shapes and a 16384 x 4096 weight. Figures: G weight values/s. Each weight is multiplied again
  and again, so its rows come from the cache where they fit.
- the GEMV of several tokens (a batched decode, a verify run of drafts: 2, 3, 4, 8 tokens in one call, each
  block unpacked once for four) against the same tokens one call each, on Qwen2.5-0.5B's gate/up and down, the
  engine's kernels (the machine's width); the values must be bit-equal. Figures: the call's time over one
  token's.
- the GEMV as a decode step meets its weights: 40 distinct weights of Gemma 4 E2B's down shape (Q6_K, Q4_K;
  295 / 202 MiB, far past L3) multiplied in turn, so every row streams from DRAM; the engine's kernel (wide,
  prefetching PREFETCH_BYTES ahead) against itself without the prefetch and against the narrow kernel.
  Figures: GB/s of weight bytes.
- (`--interleaved-only`) the decode GEMV, one token and four, on the GGUF's rows against rows interleaved 16 at
  a time (cpu_interleaved.py), Q8_0 / Q5_0 / Q4_K / Q6_K on Qwen2.5-0.5B's, Qwen3.5-0.8B's and Gemma 3 270M's
  shapes, copies of each weight multiplied in turn (rows from DRAM). Figures: GB/s of weight bytes. Then the
  prefill GEMM on the same rows both ways (12, 40, 128 and 512 tokens; not the output head), bit-equal.
  Figures: G multiply-adds/s.

Random GGUF blocks of each format; the kernels alternate in `--rounds` rounds and each figure is the fastest of
its calls (the machine is shared), all cores.

    python bench/cpu_matmul.py [--tokens 128] [--rounds 5] [--gemv-only] [--several-only] [--interleaved-only]
                               [--out bench/results/cpu_matmul.json]
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
sys.path.insert(0, str(ROOT / "tests" / "ops"))  # test_matmul.random_rows

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from cupyllm.ops.matmul import cpu_gemm  # noqa: E402
from cupyllm.ops.matmul.cpu_gemv import F16_TABLE, PREFETCH_BYTES, gemv_blocks  # noqa: E402
from cupyllm.ops.simd import MACHINE_HAS_512_BIT_LANES  # noqa: E402
from cupyllm.ops.matmul.reference import WEIGHT_FORMATS, dequantize  # noqa: E402
from host_cpu import cpu_description  # noqa: E402
from test_matmul import random_rows  # noqa: E402

SHAPES = {  # (n_out, n_in) of a model's weights
    "qwen2.5-0.5b q/o": (896, 896),
    "qwen2.5-0.5b gate/up": (4864, 896),
    "qwen2.5-0.5b down": (896, 4864),
    "gemma4-e2b q": (2048, 1536),
    "gemma4-e2b gate/up": (6144, 1536),
    "gemma4-e2b down": (1536, 6144),
}
TYPES = (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0)
GEMV_SHAPES = {"qwen2.5-0.5b gate/up": (4864, 896), "gemma4-e2b q": (2048, 1536), "gemma4-e2b gate/up": (6144, 1536),
               "gemma4-e2b down": (1536, 6144), "16384 x 4096": (16384, 4096)}
GEMV_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)


def fastest(fn, calls: int = 3) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def alternating(kernels: dict, rounds: int, calls: int = 3) -> dict[str, float]:
    """The fastest seconds of each kernel over `rounds` rounds in alternating order."""
    times = {name: [] for name in kernels}
    for round_ in range(rounds):
        for name in (list(kernels) if round_ % 2 == 0 else list(kernels)[::-1]):
            times[name].append(fastest(kernels[name], calls))
    return {name: min(t) for name, t in times.items()}


def gemv_cases(rounds: int) -> list[dict]:
    rng = np.random.default_rng(1)
    rows = []
    cases = [(s, t) for s in GEMV_SHAPES.items() for t in GEMV_TYPES if s[1][1] % gguf.GGML_QUANT_SIZES[t][0] == 0]
    for (shape_name, (n_out, n_in)), qtype in tqdm(cases, desc="cpu gemv"):
        data = random_rows(qtype, n_out, n_in, seed=len(rows))
        x = rng.standard_normal(n_in).astype(np.float32)
        codes = np.array([WEIGHT_FORMATS[qtype].code], np.int64)
        outs = {name: np.empty((1, n_out), np.float32) for name in ("narrow", "wide")}
        kernels = {name: (lambda name=name: gemv_blocks(codes, (data,), x[None], (outs[name],), F16_TABLE,
                                                        name == "wide"))
                   for name in outs}
        for kernel in kernels.values():
            kernel()
        scale = np.abs(outs["narrow"]).max()
        assert np.abs(outs["wide"] - outs["narrow"]).max() <= 1e-5 * scale, (shape_name, qtype.name)
        seconds = alternating(kernels, rounds, calls=10)
        gvalues = {name: n_out * n_in / t / 1e9 for name, t in seconds.items()}
        rows.append({"shape": shape_name, "n_out": n_out, "n_in": n_in, "type": qtype.name,
                     "gvalues_per_s": {k: round(v, 1) for k, v in gvalues.items()},
                     "wide_vs_narrow": round(gvalues["wide"] / gvalues["narrow"], 2)})
        print(f"gemv {shape_name:24s} {qtype.name:5s} narrow {gvalues['narrow']:6.1f}  wide {gvalues['wide']:6.1f} "
              f"G values/s   wide/narrow x{rows[-1]['wide_vs_narrow']:.2f}")
    return rows


def several_token_cases(rounds: int) -> list[dict]:
    rng = np.random.default_rng(4)
    rows = []
    shapes = {"qwen2.5-0.5b gate/up": (4864, 896), "qwen2.5-0.5b down": (896, 4864)}
    cases = [(s, t) for s in shapes.items() for t in GEMV_TYPES if s[1][1] % gguf.GGML_QUANT_SIZES[t][0] == 0]
    for (shape_name, (n_out, n_in)), qtype in tqdm(cases, desc="cpu gemv, several tokens"):
        data = random_rows(qtype, n_out, n_in, seed=len(rows))
        codes = np.array([WEIGHT_FORMATS[qtype].code], np.int64)
        x = rng.standard_normal((8, n_in)).astype(np.float32)
        one = np.empty((1, n_out), np.float32)
        kernels, outs = {"1": lambda: gemv_blocks(codes, (data,), x[:1], (one,), F16_TABLE)}, {}
        for n in (2, 3, 4, 8):
            outs[n] = together, apart = np.empty((n, n_out), np.float32), np.empty((n, n_out), np.float32)
            kernels[f"{n} together"] = lambda n=n: gemv_blocks(codes, (data,), x[:n], (outs[n][0],), F16_TABLE)
            kernels[f"{n} apart"] = lambda n=n: [gemv_blocks(codes, (data,), x[t:t + 1], (outs[n][1][t:t + 1],),
                                                             F16_TABLE) for t in range(n)]
        for kernel in kernels.values():
            kernel()
        for n, (together, apart) in outs.items():
            assert np.array_equal(together, apart), (shape_name, qtype.name, n)
        seconds = alternating(kernels, rounds, calls=10)
        ratios = {name: round(t / seconds["1"], 2) for name, t in seconds.items() if name != "1"}
        rows.append({"shape": shape_name, "n_out": n_out, "n_in": n_in, "type": qtype.name,
                     "one_token_us": round(seconds["1"] * 1e6, 1), "time_over_one_token": ratios})
        print(f"gemv {shape_name:22s} {qtype.name:5s} " + "  ".join(f"{k} x{v:.2f}" for k, v in ratios.items()))
    return rows


def stream_cases(rounds: int, n_weights: int = 40, shape: tuple[int, int] = (1536, 6144)) -> list[dict]:
    rows = []
    n_out, n_in = shape
    x = np.random.default_rng(2).standard_normal(n_in).astype(np.float32)
    for qtype in tqdm((T.Q6_K, T.Q4_K), desc="cpu gemv from DRAM"):
        one = random_rows(qtype, n_out, n_in, seed=3)
        weights = [one.copy() for _ in range(n_weights)]  # (distinct memory: each is read from DRAM in turn)
        outs = [np.empty((1, n_out), np.float32) for _ in weights]
        code = np.array([WEIGHT_FORMATS[qtype].code], np.int64)
        variants = {"wide, prefetch": (True, PREFETCH_BYTES), "wide, no prefetch": (True, 0),
                    "narrow, prefetch": (False, PREFETCH_BYTES)}

        def step(wide, ahead):
            for data, out in zip(weights, outs):
                gemv_blocks(code, (data,), x[None], (out,), F16_TABLE, wide, ahead)
        kernels = {name: (lambda w=w, a=a: step(w, a)) for name, (w, a) in variants.items()}
        seconds = alternating(kernels, rounds, calls=3)
        total = sum(w.nbytes for w in weights)
        gbs = {name: round(total / t / 1e9, 1) for name, t in seconds.items()}
        rows.append({"type": qtype.name, "weights": n_weights, "n_out": n_out, "n_in": n_in,
                     "mib": round(total / 2**20), "gb_per_s": gbs, "prefetch_bytes": PREFETCH_BYTES,
                     "prefetch_gain": round(gbs["wide, prefetch"] / gbs["wide, no prefetch"], 2),
                     "wide_vs_narrow": round(gbs["wide, prefetch"] / gbs["narrow, prefetch"], 2)})
        print(f"gemv from DRAM {qtype.name}: " + "  ".join(f"{k} {v:5.1f}" for k, v in gbs.items()) + " GB/s")
    return rows


INTERLEAVED_SHAPES = {  # (n_out, n_in): Qwen2.5-0.5B's and Qwen3.5-0.8B's, Gemma 3 270M's output head
    "qwen2.5-0.5b gate/up": (4864, 896), "qwen2.5-0.5b down": (896, 4864), "qwen3.5-0.8b gate/up": (3584, 1024),
    "qwen3.5-0.8b down": (1024, 3584), "gemma3-270m output": (262144, 640)}
INTERLEAVED_TYPES = (T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K)
DRAM_BYTES = 256 * 2**20  # copies of a weight up to this many bytes, multiplied in turn: rows from DRAM


def interleaved_cases(rounds: int) -> list[dict]:
    """The decode GEMV on rows as the GGUF stores them against rows interleaved 16 at a time
    (cpu_interleaved.py), one token and four, each weight one of copies enough to stream from DRAM."""
    from cupyllm.ops.matmul.cpu_gemv import gemv_many
    from cupyllm.ops.matmul.cpu_interleaved import LAYOUTS, interleave_rows
    rows = []
    x = np.random.default_rng(6).standard_normal((4, 262144)).astype(np.float32)
    cases = [(s, t) for s in INTERLEAVED_SHAPES.items() for t in INTERLEAVED_TYPES
             if s[1][1] % gguf.GGML_QUANT_SIZES[t][0] == 0]
    for (shape_name, (n_out, n_in)), qtype in tqdm(cases, desc="cpu gemv, interleaved rows"):
        one = random_rows(qtype, n_out, n_in, seed=len(rows))
        copies = max(1, DRAM_BYTES // one.nbytes)
        weights = [one.copy() for _ in range(copies)]
        for w in weights:
            w.flags.writeable = False
        layout = LAYOUTS[qtype.name]
        operands = {"rows": [(w, WEIGHT_FORMATS[qtype]) for w in weights],
                    "x16": [(interleave_rows(w, layout), layout) for w in weights]}
        xs = {n: np.ascontiguousarray(x[:n, :n_in]) for n in (1, 4)}
        kernels = {f"{name}, {n} token{'s' * (n > 1)}": (lambda ops=ops, n=n: [gemv_many(xs[n], [w]) for w in ops])
                   for name, ops in operands.items() for n in (1, 4)}
        got = {name: gemv_many(xs[4], [ops[0]])[0] for name, ops in operands.items()}
        scale = np.abs(got["rows"]).max()
        assert np.abs(got["x16"] - got["rows"]).max() <= 1e-4 * scale, (shape_name, qtype.name)
        seconds = alternating(kernels, rounds, calls=2)
        total = one.nbytes * copies
        gbs = {name: round(total / t / 1e9, 1) for name, t in seconds.items()}
        rows.append({"shape": shape_name, "n_out": n_out, "n_in": n_in, "type": qtype.name, "copies": copies,
                     "gb_per_s": gbs})
        print(f"gemv {shape_name:22s} {qtype.name:5s} " + "  ".join(f"{k} {v:5.1f}" for k, v in gbs.items())
              + " GB/s")
    return rows


def interleaved_gemm_cases(rounds: int, token_counts=(12, 40, 128, 512)) -> list[dict]:
    """The prefill GEMM on the GGUF's rows (the wide kernel) against rows interleaved 16 at a time, the weights'
    shapes of interleaved_cases but the output head; the values must be bit-equal."""
    from cupyllm.ops.matmul.cpu_interleaved import LAYOUTS, interleave_rows
    rows = []
    cases = [(s, t) for s in INTERLEAVED_SHAPES.items() for t in INTERLEAVED_TYPES
             if s[1][1] % gguf.GGML_QUANT_SIZES[t][0] == 0 and s[1][0] < 65536]
    for (shape_name, (n_out, n_in)), qtype in tqdm(cases, desc="cpu gemm, interleaved rows"):
        data = random_rows(qtype, n_out, n_in, seed=len(rows))
        layout = LAYOUTS[qtype.name]
        groups = interleave_rows(data, layout)
        for n_tok in token_counts:
            x = np.random.default_rng(n_tok).standard_normal((n_tok, n_in)).astype(np.float32)
            xp, xd, xs = cpu_gemm.pack_activations(x)
            outs = {name: np.empty((n_tok, n_out), np.float32) for name in ("rows", "x16")}
            kernels = {
                "rows": lambda: cpu_gemm.gemm_blocks_wide(WEIGHT_FORMATS[qtype].code, data, xp, xd, xs, n_tok,
                                                          outs["rows"], F16_TABLE),
                "x16": lambda: cpu_gemm.gemm_blocks_wide(layout.code, groups, xp, xd, xs, n_tok, outs["x16"],
                                                         F16_TABLE)}
            for kernel in kernels.values():
                kernel()  # (compiled, warm)
            assert np.array_equal(outs["rows"], outs["x16"]), (shape_name, qtype.name, n_tok)
            gmacs = {name: n_out * n_in * n_tok / t / 1e9 for name, t in alternating(kernels, rounds).items()}
            rows.append({"shape": shape_name, "n_out": n_out, "n_in": n_in, "type": qtype.name, "tokens": n_tok,
                         "gmac_per_s": {k: round(v, 1) for k, v in gmacs.items()},
                         "x16_vs_rows": round(gmacs["x16"] / gmacs["rows"], 2)})
            print(f"gemm {shape_name:22s} {qtype.name:5s} {n_tok:4d} tokens  rows {gmacs['rows']:6.1f}  "
                  f"x16 {gmacs['x16']:6.1f} G MAC/s  x{rows[-1]['x16_vs_rows']:.2f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gemv-only", action="store_true", help="skip the GEMM (it takes most of the time)")
    parser.add_argument("--several-only", action="store_true", help="only the GEMV of several tokens")
    parser.add_argument("--interleaved-only", action="store_true",
                        help="only the GEMV and GEMM on rows interleaved 16 at a time against the GGUF's rows")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu_matmul.json")
    args = parser.parse_args()
    if args.interleaved_only:
        result = {"cpu": cpu_description(), "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds,
                  "command": "python bench/cpu_matmul.py " + " ".join(sys.argv[1:]),
                  "gemv_interleaved": interleaved_cases(args.rounds),
                  "gemm_interleaved": interleaved_gemm_cases(args.rounds)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print("wrote", args.out)
        return
    if args.several_only:
        result = {"cpu": cpu_description(), "wide_in_engine": MACHINE_HAS_512_BIT_LANES,
                  "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "gemv_several": several_token_cases(args.rounds)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print("wrote", args.out)
        return
    rng = np.random.default_rng(0)
    rows = []
    cases = [] if args.gemv_only else [(s, t) for s in SHAPES.items() for t in TYPES
                                       if s[1][1] % gguf.GGML_QUANT_SIZES[t][0] == 0]
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
        macs = n_out * n_in * args.tokens
        gmacs = {name: macs / t / 1e9 for name, t in alternating(kernels, args.rounds).items()}
        rows.append({"shape": shape_name, "n_out": n_out, "n_in": n_in, "type": qtype.name, "tokens": args.tokens,
                     "gmac_per_s": {k: round(v, 1) for k, v in gmacs.items()},
                     "wide_vs_narrow": round(gmacs["wide"] / gmacs["narrow"], 2),
                     "wide_vs_blas": round(gmacs["wide"] / gmacs["blas"], 2)})
        print(f"gemm {shape_name:22s} {qtype.name:5s} narrow {gmacs['narrow']:6.1f}  wide {gmacs['wide']:6.1f}  "
              f"blas {gmacs['blas']:6.1f} G MAC/s   wide/narrow x{rows[-1]['wide_vs_narrow']:.2f}  "
              f"wide/blas x{rows[-1]['wide_vs_blas']:.2f}")
    result = {"cpu": cpu_description(), "wide_in_engine": MACHINE_HAS_512_BIT_LANES, "date": time.strftime("%Y-%m-%d"),
              "rounds": args.rounds, **({} if args.gemv_only else {"gemm": rows}), "gemv": gemv_cases(args.rounds),
              "gemv_several": several_token_cases(args.rounds), "gemv_from_dram": stream_cases(args.rounds)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
