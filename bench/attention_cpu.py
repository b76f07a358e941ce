"""CPU decode attention over a long cache: one query step of the numba kernel (ops/attention/cpu.py) reading
each KV format in place, beside the NumPy reference (`reference.attend`: BLAS matmuls over float32 K and V that
were decoded beforehand, so its time holds no decode) in the same run, at the shapes of the two real models.

    python bench/attention_cpu.py [--keys 32768] [--rounds 7] [--calls 20] [--kv-types f16,q8_0,q4_0,turbo3]
                                  [--out bench/results/attention_cpu.json]

Each figure is the best of `--rounds` rounds of `--calls` runs, the engines alternating by round (not by run: the
reference's BLAS threads spin on after a call and would take a core from the kernel's next run); ratio =
reference time / kernel time (above 1: the kernel faster). Random rows: attention's cost does not depend on the
values.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm
from host_cpu import cpu_description

from cupyllm.ops.attention.cpu import attend_rows
from cupyllm.ops.attention.reference import attend, causal_mask
from cupyllm.ops.kv_formats.formats import get_format, is_rotated

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"gemma3-270m": (1, 4, 256), "qwen2.5-0.5b": (2, 14, 64)}  # (KV heads, query heads, head dim)


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20, help="runs of one engine in a row, each round")
    parser.add_argument("--kv-types", default="f16,q8_0,q4_0,turbo3")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "attention_cpu.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    cases = [(shape, name) for shape in SHAPES for name in args.kv_types.split(",")]
    for shape, name in tqdm(cases, desc="attention cases"):
        n_kv, n_head, head_dim = SHAPES[shape]
        fmt = get_format(name)
        if is_rotated(name) and head_dim < fmt.block_values:
            continue  # (turbo groups of 64 values: not these shapes' format)
        keys = rng.standard_normal((args.keys * n_kv, head_dim)).astype(np.float32)
        values = rng.standard_normal((args.keys * n_kv, head_dim)).astype(np.float32)
        k_data, v_data = (fmt.encode(x).reshape(args.keys, n_kv, -1) for x in (keys, values))
        k, v = (fmt.decode(x.reshape(args.keys * n_kv, -1), head_dim).reshape(args.keys, n_kv, head_dim)
                for x in (k_data, v_data))
        q = rng.standard_normal((1, 1, n_head, head_dim)).astype(np.float32)
        q_stored = fmt.rotate(q.reshape(n_head, head_dim)).reshape(q.shape) if is_rotated(name) else q  # K's domain
        k_pos, q_pos = np.arange(args.keys), np.array([args.keys])
        allowed = causal_mask(q_pos, k_pos)
        scale = 1.0 / np.sqrt(head_dim)

        def kernel():
            return attend_rows(q_stored, np.zeros((1, 1, n_head), np.float32), q_pos, k_data, v_data, k_pos, fmt, fmt,
                               head_dim, scale=scale, window=0, softcap=0.0, chunk_len=0)

        def reference():
            return attend(q[0], k, v, allowed, scale=scale)
        got, want = kernel()[0], reference()[0]
        if is_rotated(name):  # the kernel's output is still rotated
            got = fmt.unrotate(got.reshape(n_head, head_dim)).reshape(got.shape)
        error = float(np.abs(got - want).max())
        times = {"kernel": [], "reference": []}
        for _ in range(args.rounds):
            for engine, run in (("kernel", kernel), ("reference", reference)):
                times[engine].extend(_seconds(run) for _ in range(args.calls))
        kernel_ms, reference_ms = 1e3 * min(times["kernel"]), 1e3 * min(times["reference"])
        rows.append({"shape": shape, "kv_type": name, "keys": args.keys, "kv_heads": n_kv, "query_heads": n_head,
                     "head_dim": head_dim, "kernel_ms": round(kernel_ms, 3), "reference_ms": round(reference_ms, 3),
                     "ratio_reference_over_kernel": round(reference_ms / kernel_ms, 2),
                     "cache_mib": round((k_data.nbytes + v_data.nbytes) / 2**20, 1), "max_abs_error": error})
        tqdm.write(f"{shape} {name}: kernel {kernel_ms:.2f} ms, reference {reference_ms:.2f} ms "
                   f"(x{reference_ms / kernel_ms:.2f}), max error {error:.1e}")
    report = {"device": cpu_description(), "what": "one decode query over a cache of `keys` slots, best of rounds",
              "rounds": args.rounds, "calls": args.calls, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
