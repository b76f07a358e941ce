"""The cost of one context shift (kv/shift.py) on the CPU, for each KV type, beside a decode step.

A shift forgets positions [keep, keep + discard) of a full cache, moves the later rows down and re-ropes their
keys: block formats decode, rope and encode; rotated (turbo, TCQ) formats unrotate and rotate around that; K
normalisation undoes and redoes its offset and scale; a windowed cache shifts both its parts. For each model and
KV type: a --ctx-token prompt of English text fills the cache (cache_prompt), then one shift with llama.cpp's
defaults (keep the first token, discard half of the rest) is timed --rounds times from that same state (restored
between rounds, untimed; one round more first, to warm the kernels up), median; beside it the median of one decode step's forward at that context, so the
shift reads as "so many decode steps".

    python bench/context_shift_cpu.py [--models gemma qwen] [--ctx 4096] [--rounds 3]

Writes bench/results/context_shift_cpu.json (--out), with the host named. Timings need an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from host_cpu import cpu_description

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

KV_TYPES = [("f16", "f16", {}), ("q8_0", "q8_0", {}), ("q4_0", "q4_0", {}), ("q6_0", "q6_0", {}),
            ("turbo3", "turbo3", {}), ("turbo3_tcq", "turbo3_tcq", {}), ("turbo2_tcq", "turbo2_tcq", {}),
            ("f16", "f16", {"kv_window": 512, "kv_type_k_tail": "q4_0", "kv_type_v_tail": "q4_0"})]


def text_ids(model, n: int) -> list[int]:
    text = (ROOT / "tests" / "data" / "kv_eval_text.txt").read_text(encoding="utf-8")
    ids = model.tokenize(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def main() -> int:
    import numpy as np

    import cupyllm
    from cupyllm.kv.shift import ContextShift
    from models import gemma_path, qwen_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma", "qwen"], choices=["gemma", "qwen"])
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "context_shift_cpu.json")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        path = {"gemma": gemma_path, "qwen": qwen_path}[name]()
        for kv_k, kv_v, extra in KV_TYPES:
            model = cupyllm.load(path, device="cpu", ctx=args.ctx, kv_type_k=kv_k, kv_type_v=kv_v, progress=False,
                                 **extra)
            label = f"{kv_k}/{kv_v}" + (f" window {extra['kv_window']} + {extra['kv_type_k_tail']} tail"
                                        if extra else "")
            full = model.cache_prompt(text_ids(model, args.ctx))  # every position held
            cache = model._working_cache()
            shift = ContextShift(model.cfg, keep=1, discard=0)
            shift_s, step_s = [], []
            for round_ in range(args.rounds + 1):  # (round 0 warms the kernels up: not counted)
                cache.restore(full.layer_states, len(full.ids))
                start = time.perf_counter()
                kept, dropped = shift.make_room(cache)
                shift_s.append(time.perf_counter() - start)
                token = np.asarray(full.ids[-1:], np.int64)
                start = time.perf_counter()
                model._forward_numpy(token, np.arange(cache.n_past, cache.n_past + 1), cache)
                step_s.append(time.perf_counter() - start)
                cache.n_past += 1
                if round_ == 0:
                    shift_s.clear(), step_s.clear()
            shift_ms, step_ms = 1e3 * statistics.median(shift_s), 1e3 * statistics.median(step_s)
            rows.append({"model": path.name, "kv": label, "ctx": args.ctx, "keep": kept, "discard": dropped,
                         "shift_ms": shift_ms, "decode_step_ms": step_ms, "shift_in_decode_steps": shift_ms / step_ms,
                         "rounds_shift_ms": [1e3 * s for s in shift_s]})
            print(f"{path.name:<42} {label:<32} shift {shift_ms:8.1f} ms  decode step {step_ms:6.1f} ms  "
                  f"= {shift_ms / step_ms:5.1f} steps", flush=True)
    args.out.write_text(json.dumps({"machine": cpu_description(), "command": "python bench/context_shift_cpu.py "
                                    + " ".join(sys.argv[1:]), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
