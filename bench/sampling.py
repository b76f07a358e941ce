"""The host sampler's candidate filter on a real vocabulary size, against the filter by sorting.

`sampling.candidates` (top-k found without sorting the vocabulary; with top-k off, only the min-p pool
sorted) and its peer in the same run: the same chain over a full stable sort of the logits, after an
`argpartition` of the top k when top-k is on (what cupyllm did before). Both must give the same ids.
Logits: N(0, 3^2) over Gemma 3's 262,144 tokens; the repeat penalty over the last 64 of 100 history tokens.

    python bench/sampling.py [--vocab 262144] [--rounds 50] [--out bench/results/sampling_cpu.json]
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

from cupyllm.sampling import SamplingParams, apply_repeat_penalty, candidates  # noqa: E402
from host_cpu import cpu_description  # noqa: E402

CASES = {  # llama.cpp's defaults, with the repeat penalty, top-k off, top-k off and top-p off
    "top-k 40, top-p 0.95, min-p 0.05": SamplingParams(),
    "the same, repeat penalty 1.1": SamplingParams(repeat_penalty=1.1),
    "top-k off, top-p 0.95, min-p 0.05": SamplingParams(top_k=0),
    "top-k off, top-p off, min-p 0.05": SamplingParams(top_k=0, top_p=1.0),
}


def sorted_candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The filter chain over sorted logits (equal logits by id)."""
    n = len(logits)
    if 0 < p.top_k < n:
        ids = np.argpartition(-logits, p.top_k - 1)[:p.top_k]
        ids = ids[np.lexsort((ids, -logits[ids]))]
    else:
        ids = np.lexsort((np.arange(n), -logits))
    vals = logits[ids].astype(np.float64)
    if p.top_p < 1.0:
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
        ids, vals = ids[:keep], vals[:keep]
    if p.min_p > 0.0:
        keep = vals >= vals[0] + np.log(p.min_p)
        ids, vals = ids[keep], vals[keep]
    return ids, vals


def _seconds(fn, logits, params, recent, rounds: int) -> float:
    """Median over `rounds` of the repeat penalty and the filter, as the sampler runs them."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(apply_repeat_penalty(logits, recent, params.repeat_penalty), params)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sampling_cpu.json")
    args = parser.parse_args(argv)

    logits = (np.random.default_rng(0).standard_normal(args.vocab) * 3).astype(np.float32)
    recent = np.arange(36, 100)
    rows = []
    for name, params in tqdm(CASES.items(), desc="sampling bench", unit="case"):
        penalised = apply_repeat_penalty(logits, recent, params.repeat_penalty)
        ours, peer = candidates(penalised, params), sorted_candidates(penalised, params)
        if not np.array_equal(ours[0], peer[0]):
            raise SystemExit(f"{name}: the two filters disagree")
        ours_s = _seconds(candidates, logits, params, recent, args.rounds)
        peer_s = _seconds(sorted_candidates, logits, params, recent, args.rounds)
        rows.append({"case": name, "candidates": int(len(ours[0])), "ms": ours_s * 1e3, "sorted_ms": peer_s * 1e3,
                     "speedup": peer_s / ours_s})
        print(f"{name}: {ours_s * 1e3:.3f} ms against {peer_s * 1e3:.3f} ms sorted ({peer_s / ours_s:.1f}x), "
              f"{len(ours[0])} candidates")
    report = {"bench": "sampling", "device": cpu_description(),
              "vocab": args.vocab, "rounds": args.rounds, "figures": "median per call, penalty included",
              "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
