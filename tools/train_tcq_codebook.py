"""Learn the codebooks of the TCQ KV formats (turbo3_tcq, turbo2_tcq).

Lloyd / k-means style alternation on a training set of rotated, unit-normalised groups, scaled by sqrt(G)
so every coordinate is about N(0, 1) (the codebook's units, see cupyllm/kv/tcq.py):

1. Viterbi-encode every training group with the current codebook (the exact encoder of the format);
2. move each codebook entry towards the mean of the coordinates whose trellis state it was:
   ``c <- c + relax * (mean - c)`` (entries no coordinate used keep their value).

With ``relax = 1`` this is plain Lloyd (the training distortion never increases); the default over-relaxation
``relax = 2.5`` reaches the same plateau in about a third of the iterations (measured on the Gaussian set:
turbo2_tcq after 20 iterations 0.0761 at relax 1, 0.0744 at 2, 0.0738 at 3). The start is QTIP's
"random Gaussian codebook" (the 2^L Gaussian quantiles dealt to the states in a seeded pseudo-random order);
the codebook with the lowest held-out MSE over all seeds and checked iterations is written.

Training data:
  --gaussian          groups of i.i.d. N(0, 1) values, rotated and normalised like real K/V (default)
  --from-npy PATH     float32 [n, G] rotated unit-normalised vectors (e.g. dumped K/V of a real model);
                      rows are renormalised, all-zero rows dropped

Example (the shipped codebooks):
  python tools/train_tcq_codebook.py --format all --gaussian
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyllm.kv import lloyd_max, tcq, turbo  # noqa: E402

LLOYD_MAX_BITS_FOR = {"turbo3_tcq": 3, "turbo2_tcq": 2}


def gaussian_groups(n: int, group_values: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, group_values)).astype(np.float32)
    return turbo.rotate(x, group_values)


def npy_groups(path: Path) -> np.ndarray:
    data = np.load(path)
    if data.ndim != 2 or data.shape[1] < 2 or data.shape[1] & (data.shape[1] - 1):
        raise SystemExit(f"{path}: expected float32 [n, G] with G a power of two, got {data.dtype} {data.shape}")
    data = data.astype(np.float32)
    keep = np.isfinite(data).all(axis=1) & (np.abs(data).sum(axis=1) > 0)
    return data[keep]


def to_unit_z(groups: np.ndarray) -> np.ndarray:
    _, z = turbo.group_norm_and_z(groups)
    return z


def distortion(z: np.ndarray, codebook: np.ndarray, k: int, L: int) -> tuple[float, np.ndarray]:
    """Mean squared error per coordinate (N(0,1) units) of the Viterbi path, and the states."""
    states, _ = tcq.viterbi_states(z, codebook, k, L)
    err = z - codebook[states]
    return float(np.mean(err.astype(np.float64) ** 2)), states


def centroid_update(z: np.ndarray, states: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    n = codebook.shape[0]
    counts = np.bincount(states.ravel(), minlength=n)
    sums = np.bincount(states.ravel(), weights=z.ravel().astype(np.float64), minlength=n)
    new = codebook.astype(np.float64).copy()
    used = counts > 0
    new[used] = sums[used] / counts[used]
    return new.astype(np.float32)


def train(
    name: str, z_train: np.ndarray, z_val: np.ndarray, iters: int, seeds: list[int], relax: float, val_every: int
) -> tuple[np.ndarray, float]:
    k, L = tcq.TCQ_PARAMS[name]
    best_cb, best_val = None, np.inf
    for seed in seeds:
        cb = tcq.initial_codebook(L, seed)
        val, _ = distortion(z_val, cb, k, L)
        print(f"[{name}] seed {seed}: start  val MSE {val:.5f}", flush=True)
        for it in range(1, iters + 1):
            t0 = time.time()
            train_mse, states = distortion(z_train, cb, k, L)
            cb = (cb + np.float32(relax) * (centroid_update(z_train, states, cb) - cb)).astype(np.float32)
            line = f"[{name}] seed {seed}: iter {it:2d} train MSE {train_mse:.5f}"
            if it % val_every == 0 or it == iters:
                val, _ = distortion(z_val, cb, k, L)
                line += f" val MSE {val:.5f}"
                if val < best_val:
                    best_cb, best_val = cb.copy(), val
            print(f"{line} ({time.time() - t0:.1f}s)", flush=True)
    return best_cb, best_val


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="all", choices=["all", *tcq.TCQ_PARAMS])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--gaussian", action="store_true", help="train on rotated N(0,1) groups (default)")
    src.add_argument("--from-npy", type=Path, help="float32 [n, G] rotated unit-normalised vectors")
    ap.add_argument("--group", type=int, default=128, help="G for --gaussian (default 128)")
    ap.add_argument("--n-train", type=int, default=16384, help="training groups (default 16384)")
    ap.add_argument("--n-val", type=int, default=4096, help="held-out groups (default 4096)")
    ap.add_argument("--iters", type=int, default=60, help="Lloyd iterations per seed (default 60)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="initial codebook seeds (default 0)")
    ap.add_argument("--relax", type=float, default=2.5, help="over-relaxation of the centroid step (default 2.5)")
    ap.add_argument("--val-every", type=int, default=5, help="check the held-out MSE every N iterations")
    ap.add_argument("--out-dir", type=Path, default=tcq.DATA_DIR, help="where tcq_*.npy go (package data)")
    args = ap.parse_args(argv)

    if args.from_npy is not None:
        groups = npy_groups(args.from_npy)
        order = np.random.default_rng(1234).permutation(len(groups))
        n_val = min(args.n_val, len(groups) // 5)
        val_groups, train_groups = groups[order[:n_val]], groups[order[n_val : n_val + args.n_train]]
        source = f"{args.from_npy} ({len(train_groups)} train / {len(val_groups)} val groups of {groups.shape[1]})"
    else:
        train_groups = gaussian_groups(args.n_train, args.group, seed=1000)
        val_groups = gaussian_groups(args.n_val, args.group, seed=2000)
        source = f"gaussian ({args.n_train} train / {args.n_val} val groups of {args.group})"
    z_train, z_val = to_unit_z(train_groups), to_unit_z(val_groups)
    print(f"training data: {source}")

    names = list(tcq.TCQ_PARAMS) if args.format == "all" else [args.format]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        cb, val = train(name, z_train, z_val, args.iters, args.seeds, args.relax, args.val_every)
        out = args.out_dir / tcq.codebook_path(name).name
        np.save(out, cb)
        lm = lloyd_max.gaussian_lloyd_max(LLOYD_MAX_BITS_FOR[name]).mse
        print(f"[{name}] wrote {out}: held-out MSE {val:.5f} (Lloyd-Max scalar at the same bits: {lm:.5f})")


if __name__ == "__main__":
    main()
