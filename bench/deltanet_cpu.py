"""One Gated DeltaNet layer core on the CPU (cupyllm/ops/deltanet/cpu.py): the prompt's conv, delta rule (by the
numba token loop and by the chunked form, BLAS products) and gated norm, and one decode step (conv + delta rule +
gated norm), at Qwen3.5 / Qwen3-Next shapes. The projections around the core (in_proj, out_proj) are matmuls, not here.

    python bench/deltanet_cpu.py [--tokens 64,512,2048] [--rounds 5] [--out bench/results/deltanet_cpu.json]

Each case runs on one thread and on all of them (numba's and BLAS's; the kernels split the value heads over
threads). Each figure is the best of `--rounds` runs. The load average at the start and end is recorded: a parallel
region waits for its slowest thread, so a core taken by another process costs whole scheduler slices. Random
inputs with realistic gates (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)): the cost does not depend
on the values. max_abs_diff: the chunked form's output against the token loop's (both float32).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numba
import numpy as np
from host_cpu import cpu_description
from threadpoolctl import threadpool_limits

from cupyllm.ops.deltanet import cpu
from cupyllm.ops.deltanet.reference import decay_and_beta

ROOT = Path(__file__).resolve().parents[1]
# (key heads, value heads, key head dim, value head dim, conv kernel). The first: HF Qwen3_5TextConfig's defaults,
# the same linear-attention shape as Qwen3-Next-80B-A3B's config.json. The second: one value head per key head,
# half the state, as the qwen3.5-0.8b preset of tests/support/make_tiny_models.py (bench/e2e_cpu.py's).
SHAPES = {"qwen3.5 defaults / qwen3-next (16k/32v x 128)": (16, 32, 128, 128, 4),
          "16k/16v x 128": (16, 16, 128, 128, 4)}


def best_ms(run, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(1e3 * min(times), 3)


def inputs(rng, n, n_k, n_v, dk, dv):
    f32 = np.float32
    q = rng.standard_normal((n, n_k, dk)).astype(f32)
    k = rng.standard_normal((n, n_k, dk)).astype(f32)
    v = rng.standard_normal((n, n_v, dv)).astype(f32)
    g, beta = decay_and_beta(rng.standard_normal((n, n_v)), rng.standard_normal((n, n_v)),
                             np.log(rng.uniform(1, 16, n_v)), np.ones(n_v))
    return q, k, v, g.astype(f32), beta.astype(f32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="64,512,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "deltanet_cpu.json")
    args = parser.parse_args()
    rows = []
    load_before = os.getloadavg()[0]
    all_threads = numba.config.NUMBA_NUM_THREADS
    for threads, (shape, (n_k, n_v, dk, dv, width)) in ((t, item) for t in sorted({1, all_threads})
                                                         for item in SHAPES.items()):
        numba.set_num_threads(threads)
        threadpool_limits(threads)  # BLAS too (the chunked form's products), until the next case sets it
        rng = np.random.default_rng(0)
        channels = 2 * n_k * dk + n_v * dv
        weight = rng.standard_normal((channels, width)).astype(np.float32)
        state0 = np.zeros((n_v, dk, dv), np.float32)
        for n in (int(t) for t in args.tokens.split(",")):
            q, k, v, g, beta = inputs(rng, n, n_k, n_v, dk, dv)
            x = rng.standard_normal((n, channels)).astype(np.float32)
            y = np.empty_like(x)
            out = np.empty(v.shape, np.float32)
            z = rng.standard_normal((n * n_v, dv)).astype(np.float32)
            norm_w, normed = np.ones(dv, np.float32), np.empty_like(z)
            conv_ms = best_ms(lambda: cpu.conv1d_silu_rows(x, weight, np.zeros((width - 1, channels), np.float32), y),
                              args.rounds)
            loop_ms = best_ms(lambda: cpu.gated_delta_tokens(q, k, v, g, beta, state0.copy(), out), args.rounds)
            chunked_ms = best_ms(lambda: cpu.gated_delta_chunked(q, k, v, g, beta, state0.copy()), args.rounds)
            norm_ms = best_ms(lambda: cpu.gated_rms_norm_rows(out.reshape(-1, dv), z, norm_w, np.float32(1e-6),
                                                              normed), args.rounds)
            cpu.gated_delta_tokens(q, k, v, g, beta, state0.copy(), out)
            diff = float(np.abs(cpu.gated_delta_chunked(q, k, v, g, beta, state0.copy()) - out).max())
            rows.append({"shape": shape, "threads": threads, "what": "prefill", "tokens": n, "conv_ms": conv_ms,
                         "token_loop_ms": loop_ms, "chunked_ms": chunked_ms, "gated_norm_ms": norm_ms,
                         "token_loop_us_per_token": round(1e3 * loop_ms / n, 2),
                         "chunked_us_per_token": round(1e3 * chunked_ms / n, 2), "max_abs_diff": diff})
            print(f"{shape}, {threads} thread(s), prefill {n}: conv {conv_ms} ms, token loop {loop_ms} ms, "
                  f"chunked {chunked_ms} ms, gated norm {norm_ms} ms, diff {diff:.1e}")
        q, k, v, g, beta = inputs(rng, 1, n_k, n_v, dk, dv)
        x = rng.standard_normal((1, channels)).astype(np.float32)
        conv_state = np.zeros((width - 1, channels), np.float32)
        state = rng.standard_normal((n_v, dk, dv)).astype(np.float32)
        z = rng.standard_normal((n_v, dv)).astype(np.float32)
        norm_w = np.ones(dv, np.float32)
        y, o, normed = np.empty_like(x), np.empty((n_v, dv), np.float32), np.empty((n_v, dv), np.float32)

        def step():
            cpu.conv1d_silu_rows(x, weight, conv_state, y)
            cpu.decode(q[0], k[0], v[0], g[0], beta[0], state, o)
            cpu.gated_rms_norm_rows(o, z, norm_w, np.float32(1e-6), normed)
        step_ms = best_ms(step, max(args.rounds, 20))
        delta_ms = best_ms(lambda: cpu.decode(q[0], k[0], v[0], g[0], beta[0], state, o), max(args.rounds, 20))
        rows.append({"shape": shape, "threads": threads, "what": "decode step", "step_ms": step_ms,
                     "delta_rule_ms": delta_ms, "state_mib": round(state.nbytes / 2**20, 2)})
        print(f"{shape}, {threads} thread(s), decode: step {step_ms} ms (delta rule {delta_ms} ms), "
              f"state {state.nbytes / 2**20:.1f} MiB")
    report = {"device": cpu_description(), "what": "one Gated DeltaNet layer core, float32, best of rounds",
              "rounds": args.rounds, "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
