"""The decode-kernel choice that a bench/attention_gpu.py run measured: dispatch.VEC_DECODE_FORMATS.

A block or rotated KV format (K and V alike) decodes on FA-VEC at a head dim when FA-VEC's time was below
FA-MMA's at every context length measured for every shape of that head dim; everything else decodes on FA-MMA
(f16 on its f16 path; f32 and bf16 stay on FA-VEC for their range, by dispatch.VEC_FORMATS, not by timing).
tests/ops/test_attention_gpu_dispatch.py checks that dispatch.py holds what the committed JSON measured, so after a new
GPU run:

    python tools/dispatch_from_bench.py [bench/results/attention_gpu.json]   # the dict, and whether it changed
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH_JSON = REPO / "bench" / "results" / "attention_gpu.json"
NOT_BY_TIMING = ("f32", "bf16", "f16")


def measured_vec_formats(results: list[dict]) -> dict[int, tuple[str, ...]]:
    """{head_dim: formats FA-VEC decoded faster at every length and shape}, formats sorted by name."""
    faster: dict[tuple[int, str], bool] = {}
    order: dict[int, set[str]] = defaultdict(set)
    for row in results:
        fmt, vec, mma = row["k_format"], row.get("vec"), row.get("mma")
        if fmt != row["v_format"] or fmt in NOT_BY_TIMING or not vec or not mma:
            continue
        key = (row["head_dim"], fmt)
        faster[key] = faster.get(key, True) and vec["seconds"] < mma["seconds"]
        order[row["head_dim"]].add(fmt)
    chosen = {d: tuple(f for f in sorted(fmts) if faster[(d, f)]) for d, fmts in sorted(order.items())}
    return {d: fmts for d, fmts in chosen.items() if fmts}


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else BENCH_JSON
    sys.path.insert(0, str(REPO))
    from cupyllm.ops.attention.gpu_dispatch import VEC_DECODE_FORMATS
    report = json.loads(path.read_text())
    measured = measured_vec_formats(report["results"])
    print(f"{path} ({report.get('device', '?')}, {report.get('created', '?')}):")
    print(f"VEC_DECODE_FORMATS = {measured}")
    same = measured == VEC_DECODE_FORMATS
    print("cupyllm/ops/attention/gpu_dispatch.py has it" if same else f"dispatch.py has {VEC_DECODE_FORMATS}: update it")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
