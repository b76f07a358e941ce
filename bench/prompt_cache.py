"""Prompt caching: questions about one long document, with and without the document's cache.

A document of --doc-tokens tokens (repetitive prose), then --questions short questions; each answered greedily
(--answer-tokens) once with a fresh prefill of document + question and once from `cache_prompt(document)`
(made once, its time reported beside). Same process, alternating; the answers must be identical and the
next-token logits agree (argmax equal, within 1% of their scale; the largest difference is kept).

    python bench/prompt_cache.py [--device cpu] [--doc-tokens 2048] [--out bench/results/prompt_cache_cpu.json]
    python bench/prompt_cache.py --device gpu --preset gemma3-270m --doc-tokens 8192 --out ...   # (gpu_check.sh)

--preset: a random-weight model with a real model's shapes (tests/support/make_tiny_models.py; the device machine has
no real GGUF), whose document and questions are random token ids (the answers mean nothing; they must still
be identical).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm
from host_cpu import cpu_description

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SENTENCE = ("The survey of the northern coast recorded tides, currents and the depth of every harbour, and the "
            "keepers of the lighthouses wrote down the weather each morning. ")
QUESTIONS = ["\n\nQuestion: What did the survey record?\nAnswer:", "\n\nQuestion: Who wrote down the weather?\nAnswer:",
             "\n\nQuestion: Which coast was surveyed?\nAnswer:"]


def _preset_model(name: str) -> Path:
    import tempfile
    sys.path.insert(0, str(ROOT / "tests" / "support"))  # make_tiny_models
    from make_tiny_models import PRESETS, write_gguf
    path = Path(tempfile.mkdtemp(prefix="cupyllm-prompt-cache-")) / f"random-{name}.gguf"
    write_gguf(PRESETS[name], path)
    return path


def main(argv=None) -> int:
    import numpy as np

    import cupyllm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: the default model)")
    parser.add_argument("--preset", help="a random-weight model of these shapes instead (tests/support/make_tiny_models.py)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "prompt_cache_cpu.json"))
    args = parser.parse_args(argv)

    model_path = _preset_model(args.preset) if args.preset else args.model
    model = cupyllm.load(model_path, device=args.device, ctx=args.doc_tokens + 256, progress=False)
    if args.preset:  # random weights: prompts of random ids (lists of ids concatenate like the texts below)
        rng = np.random.default_rng(0)
        document = [int(t) for t in rng.integers(10, model.cfg.n_vocab, args.doc_tokens)]
        questions = [[int(t) for t in rng.integers(10, model.cfg.n_vocab, 12)] for _ in QUESTIONS]
    else:
        document = model.detokenize(model.tokenize(SENTENCE * (args.doc_tokens // 20 + 1))[:args.doc_tokens])
        questions = QUESTIONS
    model.generate(document[:200], max_tokens=2, temperature=0)  # warm-up: kernels compiled, buffers allocated

    t0 = time.perf_counter()
    cached = model.cache_prompt(document)
    cache_seconds = time.perf_counter() - t0
    rows = []
    for question in tqdm(questions, desc="questions"):
        prompt = document + question
        t0 = time.perf_counter()
        fresh = model.generate(prompt, max_tokens=args.answer_tokens, temperature=0)
        fresh_seconds, fresh_stats = time.perf_counter() - t0, model.last_stats
        t0 = time.perf_counter()
        reused = model.generate(prompt, max_tokens=args.answer_tokens, temperature=0, prompt_cache=cached)
        cached_seconds, cached_stats = time.perf_counter() - t0, model.last_stats
        if reused != fresh:
            raise SystemExit(f"answers differ: fresh {fresh!r}, from the cache {reused!r}")
        # the next-token logits both ways (random weights answer with text that may decode to nothing)
        want = model.cache_prompt(prompt).logits
        got = model.cache_prompt(prompt, reuse=cached).logits
        logit_diff = float(np.abs(got - want).max() / np.abs(want).max())
        if int(np.argmax(got)) != int(np.argmax(want)) or logit_diff > 1e-2:
            raise SystemExit(f"next-token logits differ: {logit_diff:.2e} of their scale")
        rows.append({"question": " ".join(question.split()) if isinstance(question, str) else question,
                     "answer": fresh, "fresh_seconds": fresh_seconds,
                     "cached_seconds": cached_seconds, "speedup": fresh_seconds / cached_seconds,
                     "fresh_prefill_tokens": fresh_stats.prompt_tokens,
                     "cached_prefill_tokens": cached_stats.prompt_tokens,
                     "cached_tokens": cached_stats.cached_tokens, "next_token_logit_diff": logit_diff})
    if model.device == "gpu":
        from cupyllm.cuda import device_name
        device = device_name()
    else:
        device = cpu_description()
    result = {"bench": "prompt_cache", "device": device,
              "model": model.path.name + (" (random weights, real shapes)" if args.preset else ""),
              "document_tokens": len(cached.ids),
              "cache_prompt_seconds": cache_seconds, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(f"{str(row['question'])[:40]:<40} fresh {row['fresh_seconds']:.2f} s, cached {row['cached_seconds']:.2f} s "
              f"(x{row['speedup']:.1f}; prefilled {row['fresh_prefill_tokens']} vs {row['cached_prefill_tokens']} "
              f"tokens) -> {row['answer']!r}")
    print(f"cache_prompt of {len(cached.ids)} tokens: {cache_seconds:.2f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
