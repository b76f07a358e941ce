"""The CPU cache with and without its float32 mirror (--kv-mirror / --no-kv-mirror): memory and decode speed.

With the mirror (--kv-mirror) a decode step reads float32 copies of K and V; without it (the default), it
reads the encoded rows (ops/attention/cpu.py: each row decoded in registers, rotated formats in their
rotated domain). For each KV type: the cache's host bytes both ways, the prefill time (cache_prompt of a --prompt-tokens prompt of English
text), the decode time per step (--steps greedy tokens from that cache; the median of --rounds runs, the two
caches' runs alternating) and its ratio to the mirror's in the same run, and whether the
greedy tokens are the same (both read the same stored rows; the decode steps differ in float rounding only, K's
normalisation and rotation being folded into the query, which can flip a near-tie of greedy decoding).

    python bench/kv_mirror_cpu.py [--model PATH] [--ctx 8192] [--prompt-tokens 5000] [--steps 16] [--rounds 5]
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

KV_TYPES = ("f16", "q8_0", "q4_0", "turbo3", "turbo3_tcq", "turbo2_tcq")


def main(argv=None) -> int:
    import numpy as np

    import cupyllm
    from cupyllm.kv.cache import kv_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: the default model)")
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--prompt-tokens", type=int, default=5000)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="decode runs of each cache, alternating (median)")
    parser.add_argument("--kv-types", default=",".join(KV_TYPES))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_mirror_cpu.json"))
    args = parser.parse_args(argv)

    text = (ROOT / "tests" / "data" / "kv_eval_text.txt").read_text()
    rows = []
    for kv_type in tqdm(args.kv_types.split(","), desc="kv types"):
        runs = {}
        for mirror in (True, False):
            model = cupyllm.load(args.model, device="cpu", ctx=args.ctx, kv_type_k=kv_type, kv_type_v=kv_type,
                                 kv_mirror=mirror, progress=False)
            ids = model.tokenize(text)
            prompt = (ids * (args.prompt_tokens // len(ids) + 1))[:args.prompt_tokens]
            model.generate(prompt[:64], max_tokens=2, temperature=0)  # warm-up: numba kernels loaded
            t0 = time.perf_counter()
            cached = model.cache_prompt(prompt, progress=False)
            runs[mirror] = {"model": model, "cached": cached, "prefill_seconds": time.perf_counter() - t0,
                            "step_ms": [], "prompt": prompt}
        for _ in range(args.rounds):  # the two caches' decode steps alternate: the host's drift hits both alike
            for mirror, run in runs.items():
                text_out = run["model"].generate(run["prompt"], max_tokens=args.steps, temperature=0,
                                                 prompt_cache=run["cached"])
                stats = run["model"].last_stats
                run["step_ms"].append(1e3 * stats.decode_seconds / max(stats.generated_tokens, 1))
                run.setdefault("tokens", run["model"].tokenize(text_out))
        for mirror, run in runs.items():
            model = run["model"]
            rows.append({"kv_type": kv_type, "mirror": mirror,
                         "cache_mib": kv_bytes(model.cfg, model.kv_spec, mirror=mirror) / 2**20,
                         "prefill_seconds": run["prefill_seconds"],
                         "decode_ms_per_step": float(np.median(run["step_ms"])), "decode_ms_rounds": run["step_ms"],
                         "tokens": run["tokens"]})
    for row in rows:
        peer = next(r for r in rows if r["kv_type"] == row["kv_type"] and r["mirror"])
        row["decode_over_mirror"] = row["decode_ms_per_step"] / peer["decode_ms_per_step"]
        row["cache_over_mirror"] = row["cache_mib"] / peer["cache_mib"]
        row["same_tokens_as_mirror"] = row["tokens"] == peer["tokens"]
        # greedy decoding of a real model: a near-tie between two tokens may flip on float rounding alone
        row["first_token_differing"] = next((i for i, (a, b) in enumerate(zip(row["tokens"], peer["tokens"]))
                                             if a != b), None)
    result = {"host": cpu_description(), "model": args.model or "default (Gemma 3 270M Q4_K_M)", "ctx": args.ctx,
              "prompt_tokens": args.prompt_tokens, "steps": args.steps, "rounds": args.rounds,
              "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'kv type':12} {'mirror':>6} {'cache MiB':>10} {'prefill s':>10} {'ms/step':>8} {'x mirror':>9} same (first differing)")
    for r in result["rows"]:
        print(f"{r['kv_type']:12} {str(r['mirror']):>6} {r['cache_mib']:10.1f} {r['prefill_seconds']:10.1f} "
              f"{r['decode_ms_per_step']:8.1f} {r['decode_over_mirror']:9.2f} {r['same_tokens_as_mirror']} ({r['first_token_differing']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
