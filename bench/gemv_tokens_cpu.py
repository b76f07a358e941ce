"""How many tokens the CPU GEMV should take on rows interleaved 16 at a time, before the GEMM: a forward of n
tokens with `ops/matmul/cpu.py`'s TOKENS_PER_X16_GEMV as it is (the GEMV up to it) against 8, TOKENS_PER_GEMV
(the GEMM past 8 tokens, as for rows that are not interleaved), in the same process.

    python bench/gemv_tokens_cpu.py [--models gemma qwen qwen3.5-0.8b] [--tokens 9 12 16 20 24 28 32]
                                    [--rounds 5] [--out bench/results/gemv_tokens_cpu.json]

Each n is a fresh sequence of n tokens, with the logits of its last token (a prompt) and of all of them (a
verify run of drafts), the two settings alternating; each figure is the fastest of `--rounds` forwards, ms;
ratio = the GEMM's time over the GEMV's (above 1: the GEMV is faster). 2 threads.
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
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from host_cpu import cpu_description  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma", "qwen", "qwen3.5-0.8b"],
                        choices=["gemma", "qwen", "qwen3.5-0.8b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[9, 12, 16, 20, 24, 28, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gemv_tokens_cpu.json")
    args = parser.parse_args(argv)

    import cupyllm
    from cupyllm.ops.matmul import cpu as matmul_cpu
    from e2e_cpu import preset_path
    from models import gemma_path, qwen_path
    paths = {"gemma": gemma_path, "qwen": qwen_path, "qwen3.5-0.8b": lambda: preset_path("qwen3.5-0.8b")}
    settings = {"gemv": matmul_cpu.TOKENS_PER_X16_GEMV, "gemm": matmul_cpu.TOKENS_PER_GEMV}
    results = {}
    for name in tqdm(args.models, desc="models"):
        model = cupyllm.load(paths[name](), device="cpu", threads=2, progress=False)
        t = model.transformer
        ids = np.random.default_rng(0).integers(3, min(model.cfg.n_vocab, 270), size=max(args.tokens))

        def forward(n: int, all_logits: bool) -> float:
            cache = model.new_cache()
            start = time.perf_counter()
            with t.ops.running_on(2):
                t.forward(ids[:n], np.arange(n), cache, all_logits)
            return time.perf_counter() - start

        forward(max(args.tokens), True)  # (the weights interleaved, the kernels warm)
        rows = []
        for n in args.tokens:
            best = {(kernel, logits): np.inf for kernel in settings for logits in ("last", "all")}
            for _ in range(args.rounds):
                for kernel, tokens in settings.items():
                    matmul_cpu.TOKENS_PER_X16_GEMV = tokens
                    for logits in ("last", "all"):
                        best[kernel, logits] = min(best[kernel, logits], forward(n, logits == "all"))
            matmul_cpu.TOKENS_PER_X16_GEMV = settings["gemv"]
            row = {"tokens": n}
            for logits in ("last", "all"):
                row[logits] = {"gemv_ms": round(best["gemv", logits] * 1e3, 1),
                               "gemm_ms": round(best["gemm", logits] * 1e3, 1),
                               "gemm_over_gemv": round(best["gemm", logits] / best["gemv", logits], 2)}
            rows.append(row)
            print(f"{name} {n:3d} tokens  " + "   ".join(
                f"{k}: GEMV {row[k]['gemv_ms']:6.1f} ms, GEMM {row[k]['gemm_ms']:6.1f} ms (x{row[k]['gemm_over_gemv']})"
                for k in ("last", "all")), flush=True)
        results[name] = rows
    out = {"bench": "gemv_tokens_cpu", "device": cpu_description(), "threads": 2, "rounds": args.rounds,
           "tokens_per_x16_gemv": settings["gemv"], "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python bench/gemv_tokens_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
