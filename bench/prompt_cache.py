"""Prompt caching: questions about one long document, with and without the document's cache.

A document of --doc-tokens tokens (repetitive prose), then --questions short questions; each answered greedily
(--answer-tokens) once with a fresh prefill of document + question and once from `cache_prompt(document)`
(made once, its time reported beside). Same process, alternating; the answers must be identical.

    python bench/prompt_cache.py [--device cpu] [--doc-tokens 2048] [--out bench/results/prompt_cache_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SENTENCE = ("The survey of the northern coast recorded tides, currents and the depth of every harbour, and the "
            "keepers of the lighthouses wrote down the weather each morning. ")
QUESTIONS = ["\n\nQuestion: What did the survey record?\nAnswer:", "\n\nQuestion: Who wrote down the weather?\nAnswer:",
             "\n\nQuestion: Which coast was surveyed?\nAnswer:"]


def main(argv=None) -> int:
    import cupyllm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: the default model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "prompt_cache_cpu.json"))
    args = parser.parse_args(argv)

    model = cupyllm.load(args.model, device=args.device, ctx=args.doc_tokens + 256, progress=False)
    ids = model.tokenize(SENTENCE * (args.doc_tokens // 20 + 1))[:args.doc_tokens]
    document = model.detokenize(ids)
    model.generate(document[:200], max_tokens=2, temperature=0)  # warm-up: kernels compiled, buffers allocated

    t0 = time.perf_counter()
    cached = model.cache_prompt(document)
    cache_seconds = time.perf_counter() - t0
    rows = []
    for question in tqdm(QUESTIONS, desc="questions"):
        prompt = document + question
        t0 = time.perf_counter()
        fresh = model.generate(prompt, max_tokens=args.answer_tokens, temperature=0)
        fresh_seconds, fresh_stats = time.perf_counter() - t0, model.last_stats
        t0 = time.perf_counter()
        reused = model.generate(prompt, max_tokens=args.answer_tokens, temperature=0, prompt_cache=cached)
        cached_seconds, cached_stats = time.perf_counter() - t0, model.last_stats
        if reused != fresh:
            raise SystemExit(f"answers differ: fresh {fresh!r}, from the cache {reused!r}")
        rows.append({"question": " ".join(question.split()), "answer": fresh, "fresh_seconds": fresh_seconds,
                     "cached_seconds": cached_seconds, "speedup": fresh_seconds / cached_seconds,
                     "fresh_prefill_tokens": fresh_stats.prompt_tokens,
                     "cached_prefill_tokens": cached_stats.prompt_tokens,
                     "cached_tokens": cached_stats.cached_tokens})
    result = {"bench": "prompt_cache", "device": f"{args.device}: {platform.machine()}, {platform.processor() or ''}",
              "model": model.path.name, "document_tokens": len(cached.ids),
              "cache_prompt_seconds": cache_seconds, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(f"{row['question'][:40]:<40} fresh {row['fresh_seconds']:.2f} s, cached {row['cached_seconds']:.2f} s "
              f"(x{row['speedup']:.1f}; prefilled {row['fresh_prefill_tokens']} vs {row['cached_prefill_tokens']} "
              f"tokens) -> {row['answer']!r}")
    print(f"cache_prompt of {len(cached.ids)} tokens: {cache_seconds:.2f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
