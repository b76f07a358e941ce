"""Where a CPU decode step's time goes: each backend operation's share, and for every weight its time and the
bytes it reads per second (the GEMV of a decode step streams the weight from DRAM: its GB/s against the machine's
says whether the step is memory-bound or compute-bound).

    python bench/decode_profile_cpu.py [MODEL] [--context 200] [--steps 20] [--batch 1] [--prefill] [--out PATH]

MODEL: a GGUF path (default: the default model). The context is prefilled with random tokens, then `--steps`
one-token steps of `--batch` sequences (models/batch.py forward_batch) are timed twice, the second time with
every backend method wrapped in a timer (the wrappers add a few microseconds a call: compare the step time of
both). Each figure is per step; nested operations (gated_linear runs linear_many) count in both. `--prefill`: the
context's prefill itself instead (512-token chunks, as `generate`), timed the same way, figures per prefill.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from host_cpu import cpu_description  # noqa: E402

import cupyllm  # noqa: E402
from cupyllm.models.batch import Segment, forward_batch  # noqa: E402

# backend methods that are plumbing, not operations
NOT_TIMED = {"asarray", "to_numpy", "running_on", "new_cache", "memory_available", "decode_forward", "upload"}


def weight_name(weight) -> str:
    parts = weight.name.split(".")
    return parts[-2] if weight.name.startswith("blk.") else weight.name


class OperationTimer:
    """Wraps the backend class's methods so that each call's time adds to its name (and, for the linear
    algebra, to its weights'), until `restore`."""

    def __init__(self, ops):
        self.cls, self.seconds, self.calls, self.bytes = type(ops), collections.Counter(), collections.Counter(), {}
        self.saved = {}
        for name, raw in inspect.getmembers_static(self.cls):
            if name.startswith("_") or name in NOT_TIMED or not callable(getattr(self.cls, name)):
                continue
            self.saved[name] = raw
            setattr(self.cls, name, self._timed(name, getattr(self.cls, name), isinstance(raw, staticmethod)))

    def _timed(self, name, fn, static):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            seconds = time.perf_counter() - start
            self.seconds[name] += seconds
            self.calls[name] += 1
            if name in ("linear", "linear_many", "linear_each"):
                weights = [args[2]] if name == "linear" else list(args[2])  # (args[0]: the backend)
                key = f"{name} {weight_name(weights[0])} {weights[0].fmt.qtype.name} {tuple(weights[0].shape)}"
                key += f" x{len(weights)}" if len(weights) > 1 else ""
                self.seconds[key] += seconds
                self.calls[key] += 1
                self.bytes[key] = self.bytes.get(key, 0) + sum(int(w.data.nbytes) for w in weights)
            return result
        return staticmethod(timed) if static else timed

    def restore(self):
        for name, raw in self.saved.items():
            setattr(self.cls, name, raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefill", action="store_true", help="time the context's prefill, not decode steps")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = cupyllm.load(args.model, device="cpu", ctx=args.context + 2 * args.steps + 8, progress=False)
    transformer, rng = model.transformer, np.random.default_rng(0)
    caches = [transformer.ops.new_cache(model.cfg, model.kv_spec) for _ in range(args.batch)]
    for cache in caches:
        forward_batch(transformer, [Segment(rng.integers(100, 5000, size=args.context), cache)])
        cache.n_past = args.context

    def decode_steps() -> float:
        start = time.perf_counter()
        for _ in range(args.steps):
            forward_batch(transformer, [Segment(np.array([int(rng.integers(100, 5000))]), c) for c in caches])
            for cache in caches:
                cache.n_past += 1
        return (time.perf_counter() - start) / args.steps

    forward_batch(transformer, [Segment(np.array([int(rng.integers(100, 5000))]), c) for c in caches])
    for cache in caches:  # (a first decode step, untimed: the CPU backend interleaves the weights' rows in it)
        cache.n_past += 1
    prompt = np.random.default_rng(1).integers(100, 5000, size=args.context).tolist()  # (--prefill's)

    def prefill_once() -> float:
        from cupyllm.generate import prefill
        start = time.perf_counter()
        prefill(transformer.forward, prompt, transformer.ops.new_cache(model.cfg, model.kv_spec), 512)
        return time.perf_counter() - start

    steps = prefill_once if args.prefill else decode_steps
    if args.prefill:
        args.steps = 1  # (figures per prefill)
    plain = steps()
    timer = OperationTimer(transformer.ops)
    try:
        timed = steps()
    finally:
        timer.restore()
    rows = []
    for key, seconds in timer.seconds.most_common():
        row = {"operation": key, "ms_per_step": round(seconds / args.steps * 1e3, 3),
               "calls_per_step": timer.calls[key] / args.steps}
        if key in timer.bytes:
            row["gb_per_s"] = round(timer.bytes[key] / seconds / 1e9, 1)
        rows.append(row)
        extra = f"  {row['gb_per_s']:5.1f} GB/s" if "gb_per_s" in row else ""
        print(f"{row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:<5g} {key}{extra}")
    tokens = args.context if args.prefill else args.batch
    print(f"{'prefill' if args.prefill else 'step'} {plain * 1e3:.2f} ms ({tokens / plain:.1f} tok/s); "
          f"with the timers {timed * 1e3:.2f} ms")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "cpu": cpu_description(), "date": time.strftime("%Y-%m-%d"), "model": str(args.model or "default"),
            "context": args.context, "steps": args.steps, "batch": args.batch, "prefill": args.prefill,
            "step_ms": round(plain * 1e3, 2),
            "step_ms_timed": round(timed * 1e3, 2), "operations": rows,
            "command": " ".join(["python", *sys.argv])}, indent=1) + "\n")


if __name__ == "__main__":
    main()
