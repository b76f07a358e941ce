"""What a smaller trellis costs in quality: TCQ codebooks trained per (k, L) on rotated N(0, 1) groups.

The GPU Viterbi encode's work grows with the number of trellis states 2^L (every state's cost is computed
each step), so the KV issue's "encode <= 10% of a prefill step" asks how far L can fall. This trains a
codebook for each (k, L) with tools/train_tcq_codebook.py's own Lloyd loop (same data, iterations and
seed for all, so the sizes compare with one another; the shipped codebooks were trained longer) and reports
the held-out MSE per value beside the scalar Lloyd-Max quantizer of the same bits.

    python tools/tcq_trellis_sizes.py            # ~2 minutes on one core
    -> bench/results/tcq_trellis_sizes.{json,md}
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from cupyllm.ops.kv_formats import lloyd_max, tcq  # noqa: E402
import train_tcq_codebook as trainer  # noqa: E402

SIZES = [(3, 9), (3, 8), (3, 7), (3, 6), (2, 8), (2, 7), (2, 6), (2, 5)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-train", type=int, default=8192)
    ap.add_argument("--n-val", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tcq_trellis_sizes.json")
    args = ap.parse_args(argv)

    z_train = [trainer.to_unit_z(trainer.gaussian_groups(args.n_train, 128, 1))]
    z_val = [trainer.to_unit_z(trainer.gaussian_groups(args.n_val, 128, 2))]
    shipped = {params: name for name, params in tcq.TCQ_PARAMS.items()}
    rows = []
    for k, L in SIZES:
        name = shipped.get((k, L), f"k{k}_L{L}")
        t0 = time.time()
        _, val_mse = trainer.train(name, z_train, z_val, args.iters, [0], 2.5, 5, trellis=(k, L))
        scalar = lloyd_max.gaussian_lloyd_max(k).mse
        rows.append({"k": k, "L": L, "states": 1 << L, "format": shipped.get((k, L)),
                     "val_mse": val_mse, "scalar_lloyd_max_mse": scalar, "gain_db": 10 * math.log10(scalar / val_mse),
                     "train_seconds": time.time() - t0})
    report = {
        "what": "held-out MSE per value of TCQ codebooks trained per trellis size (k bits per value, 2^L states) "
                "on rotated N(0,1) groups of 128; gain_db = scalar Lloyd-Max MSE / TCQ MSE in dB",
        "training": f"tools/train_tcq_codebook.py Lloyd loop, {args.n_train} train / {args.n_val} held-out groups, "
                    f"{args.iters} iterations, relax 2.5, seed 0",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# TCQ trellis size vs MSE (rotated N(0,1) groups of 128)", "", report["training"], "",
             "| k (bits) | L | states | format | MSE | scalar Lloyd-Max MSE | gain over scalar |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['k']} | {r['L']} | {r['states']} | {r['format'] or '-'} | {r['val_mse']:.4f} | "
                     f"{r['scalar_lloyd_max_mse']:.4f} | {r['gain_db']:.2f} dB |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
