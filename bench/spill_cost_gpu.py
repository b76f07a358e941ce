"""The spill cost model (cupyllm/kv/spill_cost.py) against the device: predicted and measured decode slowdown of a
spilled KV cache, for two tiers (f16 and q8_0) at each host fraction, its host part in the tier's types
(uniform) and in q4_0 (the tail auto types give it: kv/plan.py floor_tail).

A random-weight model with a real model's shapes (tests/support/make_tiny_models.py PRESETS, default
Qwen2.5-0.5B: 24 global layers, written here) is loaded once; `measure_spill_rates` times the cost terms as
`cupyllm.load` does for -ctk auto -ctv auto --kv-spill. Per tier, caches of --ctx positions filled with random
rows through the engine's write path: wholly on the device, its decode steps replayed as CUDA graphs (as
Model.generate runs them; eager steps timed too), and per host fraction and --tails spilled with a device window
of (1 - fraction) x ctx (kv/plan.py plan_spill at the budget that leaves it), its steps eager (as generate runs a
spilled cache). Each step is one token at the end of the cache; the median of --steps steps is reported beside
what predict_step gives for the same specs: whole_s, spilled_s, and slowdown = spilled_s / whole_s - 1.

    python bench/spill_cost_gpu.py                       # writes bench/results/spill_cost_gpu.json
    python bench/spill_cost_gpu.py --smoke               # tiny model and context: checks the script (emulator too)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))  # make_tiny_models
RESULTS = Path(os.environ.get("CUPYLLM_BENCH_RESULTS") or REPO / "bench" / "results")

from cupyllm.cuda import gpu_count  # noqa: E402

TIERS = ("f16", "q8_0")
FILL_CHUNK = 4096


def fill(cache, cfg, n_positions: int, chunk: int, rng) -> None:
    """Random K and V rows at positions [0, n_positions) of every layer cache, `chunk` at a time (one random
    chunk per layer shape, written again at every offset: the values do not change the time)."""
    cp = cache.layers[0].xp
    rows: dict[tuple, tuple] = {}
    for layer in cache.own_layers():
        shape = (layer.n_kv, layer.head_dim, layer.v_head_dim)
        if shape not in rows:
            rows[shape] = (cp.asarray(rng.standard_normal((chunk, layer.n_kv, layer.head_dim), dtype=np.float32)),
                           cp.asarray(rng.standard_normal((chunk, layer.n_kv, layer.v_head_dim), dtype=np.float32)))
        k, v = rows[shape]
        for start in range(0, n_positions, chunk):
            n = min(chunk, n_positions - start)
            layer.write(k[:n], v[:n], np.arange(start, start + n))
    cache.n_past = n_positions


def step_seconds(cp, forward, cache, first: int, n_steps: int) -> float:
    """Median wall seconds of one-token steps at positions first, first + 1, ... (the first untimed: warm-up,
    and the capture of a graph runner)."""
    token = np.array([1])
    times = []
    for i in range(n_steps + 1):
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        forward(token, np.array([first + i]), cache)
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="tests/support/make_tiny_models.py PRESETS name")
    parser.add_argument("--ctx", type=int, default=65536)
    parser.add_argument("--host-fractions", type=float, nargs="*", default=[0.02, 0.25])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--tails", nargs="*", default=["uniform", "q4_0"], choices=["uniform", "q4_0"],
                        help="the host part in the tier's types and/or in q4_0")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no new row after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny model and context, to check the script")
    args = parser.parse_args(argv)
    if gpu_count() == 0:
        print("bench/spill_cost_gpu.py needs a CUDA device")
        return 1
    import cupy as cp
    emulated = bool(getattr(cp, "__cupyllm_emulated__", False))
    if emulated and not args.smoke:
        print("bench/spill_cost_gpu.py measures a real device; on the CUDA emulator run it with --smoke")
        return 1
    import cupyllm
    from cupyllm.cuda import device_name
    from cupyllm.kv.cache import KVSpec, kv_bytes
    from cupyllm.kv.plan import floor_tail, plan_spill
    from cupyllm.kv.spill_cost import measure_spill_rates, predict_step
    from make_tiny_models import PRESETS, tiny_spec, write_gguf

    began = time.perf_counter()
    spec = dataclasses.replace(tiny_spec("qwen2"), n_layer=2, head_dim=64) if args.smoke else PRESETS[args.preset]
    ctx, steps, max_chunk = (64, 2, 4) if args.smoke else (args.ctx, args.steps, 512)
    fractions = [0.25] if args.smoke else args.host_fractions
    work = Path(tempfile.mkdtemp(prefix="cupyllm-spill-cost-"))
    path = work / f"random-{'tiny' if args.smoke else args.preset}.gguf"
    write_gguf(spec, path)
    model = cupyllm.load(path, device="gpu", ctx=ctx, max_chunk=max_chunk, progress=False)
    transformer, cfg = model.transformer, model.cfg
    ops = transformer.ops
    rates = measure_spill_rates(transformer)
    print(f"measured: {rates.describe()}")
    rng = np.random.default_rng(0)
    first = ctx - steps - 1  # the steps write the last positions
    rows = []
    result = {"benchmark": "spill_cost_gpu", "device": "CUDA emulator" if emulated else device_name(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": f"{'tiny qwen2' if args.smoke else args.preset} (random weights, real shapes)",
              "what": "decode step (1 token, full cache) wholly on the device vs spilled, measured and as "
                      "kv/spill_cost.py predicts it from the rates measured in the same run",
              "command": "python bench/spill_cost_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "smoke": args.smoke, "rates": dataclasses.asdict(rates), "results": rows}
    whole = {}  # kv_type -> (graph, eager seconds, graphs used) of the whole-device step
    for kv_type in TIERS:
        whole_spec = KVSpec(ctx=ctx, kv_type_k=kv_type, kv_type_v=kv_type, max_chunk=max_chunk)
        cache = ops.new_cache(cfg, whole_spec)
        fill(cache, cfg, first, min(FILL_CHUNK, ctx), rng)
        graphs = ops.decode_forward(transformer.forward)
        graph_s = step_seconds(cp, graphs, cache, first, steps)
        graphed = graphs.enabled
        graphs.reset()
        whole[kv_type] = (graph_s, step_seconds(cp, transformer.forward, cache, first, steps), graphed)
        del cache, graphs
        cp.get_default_memory_pool().free_all_blocks()
    # both tiers at each case before the next case: a run cut short by --budget-s still compares two tiers
    for fraction, tail, kv_type in [(f, t, k) for f in fractions for t in args.tails for k in TIERS]:
        if time.perf_counter() - began > args.budget_s:
            break
        whole_graph, whole_eager, graphed = whole[kv_type]
        whole_spec = KVSpec(ctx=ctx, kv_type_k=kv_type, kv_type_v=kv_type, max_chunk=max_chunk)
        window = max(max_chunk, int(ctx * (1 - fraction)))
        spilled_spec = floor_tail(cfg, whole_spec) if tail == "q4_0" else whole_spec
        budget = kv_bytes(cfg, dataclasses.replace(spilled_spec, device_window=window))
        plan = plan_spill(cfg, spilled_spec, budget)
        cache = ops.new_cache(cfg, plan.spec)
        fill(cache, cfg, first, min(FILL_CHUNK, plan.spec.device_window), rng)
        spilled = step_seconds(cp, transformer.forward, cache, first, steps)
        del cache
        cp.get_default_memory_pool().free_all_blocks()
        whole_s, spilled_s, streamed, chunks = predict_step(cfg, plan.spec, rates)
        row = {"kv_type": kv_type, "host_types": plan.spec.tail_type_k if tail == "q4_0" else "uniform", "ctx": ctx,
               "host_fraction": fraction, "device_window": plan.spec.device_window,
               "host_bytes": plan.host_bytes, "streamed_bytes_per_step": streamed, "stream_chunks_per_step": chunks,
               "measured": {"whole_graph_s": whole_graph, "whole_eager_s": whole_eager, "graphs": graphed,
                            "spilled_s": spilled, "slowdown": spilled / whole_graph - 1,
                            "slowdown_vs_eager": spilled / whole_eager - 1},
               "predicted": {"whole_s": whole_s, "spilled_s": spilled_s, "slowdown": spilled_s / whole_s - 1}}
        rows.append(row)
        print(f"{kv_type:>5} host {fraction:5.0%} in {row['host_types']:>7} (window {plan.spec.device_window}): "
              f"whole {whole_graph * 1e3:.2f} ms (eager {whole_eager * 1e3:.2f}), spilled {spilled * 1e3:.2f} ms: "
              f"slowdown measured {row['measured']['slowdown']:+.0%}, predicted {row['predicted']['slowdown']:+.0%} "
              f"(predicted whole {whole_s * 1e3:.2f} ms, spilled {spilled_s * 1e3:.2f} ms)")
        write(result)  # after every row: a run cut short keeps what it measured
    write(result)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def write(result: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "spill_cost_gpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    if os.environ.get("OUT"):
        shutil.copy(out, Path(os.environ["OUT"]) / out.name)


if __name__ == "__main__":
    sys.exit(main())
