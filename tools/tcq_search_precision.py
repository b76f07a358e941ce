"""What the integer Viterbi search (cupyllm.ops.kv_formats.tcq, TrellisMetric) costs against a float32 one.

The encoders search in exact int32 arithmetic (z and the centroids rounded to the metric's fixed point), which
makes the NumPy, numba and CUDA encoders agree bit for bit. This tool measures the price: the squared error per
coordinate of the integer search's paths against that of the float32 search the encoders ran before (below:
``float_viterbi``, the same trellis and tie rules, costs in float32 with one rounding per operation), on
N(0, 1) groups rotated and normalised as the encoder does, and on real K/V dumped by tools/dump_kv.py (rotated
unit groups), with the shipped codebooks.

    python tools/tcq_search_precision.py [--groups 4096] [--npy DUMP_k.npy ...] [--out bench/results/tcq_search_precision.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cupyllm.ops.kv_formats import tcq, turbo  # noqa: E402


def float_viterbi(z: np.ndarray, codebook: np.ndarray, k: int, L: int) -> np.ndarray:
    """float32 Viterbi over the bitshift trellis (cost_t[s'] = min_r cost_{t-1}[(m << k) | r] + (z_t - c_s')^2,
    smallest predecessor and smallest final state on ties): z [m, G] -> states [m, G]."""
    m, g = z.shape
    n_low, n_pred = 1 << (L - k), 1 << k
    low_of_state = np.arange(1 << L) & (n_low - 1)
    cost = (z[:, :1] - codebook[None, :]) ** 2
    choice = np.zeros((g, m, n_low), dtype=np.int32)
    for t in range(1, g):
        grouped = cost.reshape(m, n_low, n_pred)
        r = np.argmin(grouped, axis=2)
        choice[t] = r
        best = np.take_along_axis(grouped, r[:, :, None], axis=2)[:, :, 0]
        cost = best[:, low_of_state] + (z[:, t:t + 1] - codebook[None, :]) ** 2
    states = np.empty((m, g), dtype=np.int32)
    s = np.argmin(cost, axis=1)
    for t in range(g - 1, 0, -1):
        states[:, t] = s
        low = s & (n_low - 1)
        s = (low << k) | choice[t, np.arange(m), low]
    states[:, 0] = s
    return states


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tcq_search_precision.json")
    parser.add_argument("--npy", type=Path, nargs="*", default=[],
                        help="tools/dump_kv.py dumps (float32 [n, G] rotated unit groups) to measure on as well")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    sets = [(f"N(0,1) G={g}", g, turbo.group_norm_and_z(turbo.rotate(
        rng.standard_normal((args.groups, g)).astype(np.float32), g))[1]) for g in (128, 64)]
    for path in args.npy:
        unit = np.load(path)
        unit = unit[np.isfinite(unit).all(axis=1) & (np.abs(unit).sum(axis=1) > 0)]
        pick = np.random.default_rng(args.seed).choice(len(unit), min(args.groups, len(unit)), replace=False)
        g = unit.shape[1]
        sets.append((path.name, g, (unit[np.sort(pick)] * np.float32(np.sqrt(g))).astype(np.float32)))
    rows = []
    for name, (k, L) in tcq.TCQ_PARAMS.items():
        codebook = tcq.load_codebook(name)
        for data, g, z in sets:
            float_states = float_viterbi(z, codebook, k, L)
            int_states, _ = tcq.viterbi_states(z, codebook, k, L)
            mse_float, mse_int = (float(np.mean((z - codebook[s]).astype(np.float64) ** 2))
                                  for s in (float_states, int_states))
            metric = tcq.metric_for(codebook, g, k)
            rows.append({"format": name, "data": data, "group_values": g, "frac_bits": metric.frac_bits, "z_bits": metric.z_bits,
                         "mse_float_search": mse_float, "mse_integer_search": mse_int,
                         "relative_increase": mse_int / mse_float - 1,
                         "groups_on_another_path": float(np.mean((float_states != int_states).any(axis=1)))})
            r = rows[-1]
            print(f"{name} on {data} (F={r['frac_bits']}): MSE float {mse_float:.6f}, integer {mse_int:.6f} "
                  f"({r['relative_increase']:+.4%}); {r['groups_on_another_path']:.1%} of groups on another path")
    args.out.write_text(json.dumps({
        "what": "squared error per coordinate (N(0,1) units) of the integer Viterbi search's paths against a "
                "float32 search's, same trellis and codebook (tools/tcq_search_precision.py); N(0,1) groups and "
                "K/V dumps of real models (tools/dump_kv.py over tests/data/kv_eval_text.txt, raw K)",
        "groups": args.groups, "seed": args.seed, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
