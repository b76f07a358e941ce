"""Decode speed and cache size at a long context on the CPU: uniform f16, uniform q4_0, and an f16 window over a
q4_0 tail (--kv-window N -ctkt q4_0 -ctvt q4_0; kv/window.py).

A decode step's attention reads every cached row of the global layers: at a long context that is most of the
step's memory traffic, and a q4_0 row is 3.6x smaller than an f16 one. The window keeps the newest positions,
which take most of the attention, in f16. For each cache: its bytes (kv_bytes), the prefill of a --ctx-token
prompt of English text (cache_prompt, timed once), then --steps greedy tokens from that prompt cache, the
median of --rounds runs, the caches' runs alternating so that the host's drift hits all alike.

    python bench/kv_window_cpu.py [--models qwen gemma] [--ctx 16384] [--window 512] [--steps 16] [--rounds 3]
    python bench/kv_window_cpu.py --models qwen --ctx 1024 --steps 8 --rounds 1   # a smoke run

Writes bench/results/kv_window_cpu.json (--out), with the host named. Timings need an otherwise idle machine.
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
sys.path.insert(0, str(ROOT / "tests"))


def caches(window: int) -> list[dict]:
    """The three caches compared: label and load() options."""
    return [{"label": "f16", "kv_type_k": "f16", "kv_type_v": "f16"},
            {"label": "q4_0", "kv_type_k": "q4_0", "kv_type_v": "q4_0"},
            {"label": f"f16 window {window} + q4_0 tail", "kv_type_k": "f16", "kv_type_v": "f16",
             "kv_window": window, "kv_type_k_tail": "q4_0", "kv_type_v_tail": "q4_0"}]


def model_path(name: str) -> Path | None:
    if name == "gemma":
        return None  # the default model
    if name == "qwen":
        from models import qwen_path  # tests/models.py assembles it from its packages
        return qwen_path()
    return Path(name)


def main(argv=None) -> int:
    import numpy as np

    import cupyllm
    from cupyllm.kv.cache import kv_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen", "gemma"], help="qwen, gemma or GGUF paths")
    parser.add_argument("--ctx", type=int, default=16384, help="prompt tokens before the decode steps")
    parser.add_argument("--window", type=int, default=512, help="--kv-window of the mixed cache")
    parser.add_argument("--steps", type=int, default=16, help="greedy tokens decoded per run")
    parser.add_argument("--rounds", type=int, default=3, help="decode runs of each cache, alternating (median)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_window_cpu.json"))
    args = parser.parse_args(argv)

    text = (ROOT / "tests" / "data" / "kv_eval_text.txt").read_text()
    result = {"host": cpu_description(), "ctx": args.ctx, "window": args.window, "steps": args.steps,
              "rounds": args.rounds, "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "models": {}}
    for name in args.models:
        path = model_path(name)
        runs = []
        for options in tqdm(caches(args.window), desc=f"{name}: prefill"):
            label = options.pop("label")
            model = cupyllm.load(path, device="cpu", ctx=args.ctx + args.steps + 1, threads=args.threads,
                                 progress=False, **options)
            ids = model.tokenize(text)
            prompt = (ids * (args.ctx // len(ids) + 1))[:args.ctx]
            model.generate(prompt[:64], max_tokens=2, temperature=0)  # warm-up: numba kernels loaded
            t0 = time.perf_counter()
            cached = model.cache_prompt(prompt, progress=False)
            runs.append({"label": label, "options": options, "model": model, "cached": cached, "prompt": prompt,
                         "prefill_seconds": time.perf_counter() - t0, "step_ms": []})
        for _ in tqdm(range(args.rounds), desc=f"{name}: decode rounds"):
            for run in runs:
                out = run["model"].generate(run["prompt"], max_tokens=args.steps, temperature=0,
                                            prompt_cache=run["cached"])
                stats = run["model"].last_stats
                run["step_ms"].append(1e3 * stats.decode_seconds / max(stats.generated_tokens, 1))
                run.setdefault("text", out)
        rows = []
        for run in runs:
            model = run["model"]
            step = float(np.median(run["step_ms"]))
            rows.append({"cache": run["label"], **run["options"],
                         "cache_mib": kv_bytes(model.cfg, model.kv_spec) / 2**20,
                         "prefill_seconds": round(run["prefill_seconds"], 2), "decode_ms_per_step": step,
                         "decode_tokens_per_s": 1e3 / step, "decode_ms_rounds": run["step_ms"],
                         "text": run["text"]})
        for row in rows:
            row["decode_speed_over_f16"] = rows[0]["decode_ms_per_step"] / row["decode_ms_per_step"]
        result["models"][name] = {"model": runs[0]["model"].path.name, "arch": runs[0]["model"].cfg.arch,
                                  "rows": rows}
        print(f"{name} ({result['models'][name]['model']}), {args.ctx} tokens, {result['host']}")
        print(f"  {'cache':32} {'MiB':>8} {'prefill s':>10} {'ms/step':>8} {'tok/s':>7} {'x f16':>6}")
        for r in rows:
            print(f"  {r['cache']:32} {r['cache_mib']:8.1f} {r['prefill_seconds']:10.1f} "
                  f"{r['decode_ms_per_step']:8.1f} {r['decode_tokens_per_s']:7.2f} {r['decode_speed_over_f16']:6.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
