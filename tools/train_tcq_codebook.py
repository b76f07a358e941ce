"""Learn the codebooks of the TCQ KV formats (turbo3_tcq, turbo2_tcq).

Lloyd / k-means style alternation on a training set of rotated, unit-normalised groups, scaled by sqrt(G)
so every coordinate is about N(0, 1) (the codebook's units, see cupyllm/ops/kv_formats/tcq.py):

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
  --from-npy PATH...  float32 [n, G] rotated unit-normalised vectors (tools/dump_kv.py: K/V of real
                      models); rows are renormalised, all-zero rows dropped; several files (of any G) are
                      mixed: each is split into --n-val held-out and --n-train training groups, and the
                      MSE is the mean over all their coordinates

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

from cupyllm.ops.kv_formats import lloyd_max, tcq, turbo  # noqa: E402

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


def distortion(zs, codebook: np.ndarray, k: int, L: int):
    """Mean squared error per coordinate (N(0,1) units) of the Viterbi paths, and the states. ``zs`` is one
    [m, G] array (states: one array) or a list of them, possibly of different G (states: a list)."""
    single = isinstance(zs, np.ndarray)
    total, count, all_states = 0.0, 0, []
    for z in [zs] if single else zs:
        states, _ = tcq.viterbi_states(z, codebook, k, L)
        err = z - codebook[states]
        total += float(np.sum(err.astype(np.float64) ** 2))
        count += err.size
        all_states.append(states)
    return total / count, all_states[0] if single else all_states


def centroid_update(zs, states, codebook: np.ndarray) -> np.ndarray:
    """Each entry moved to the mean of the coordinates whose state it was (over every set); unused entries kept."""
    if isinstance(zs, np.ndarray):
        zs, states = [zs], [states]
    n = codebook.shape[0]
    counts = np.zeros(n)
    sums = np.zeros(n)
    for z, s in zip(zs, states):
        counts += np.bincount(s.ravel(), minlength=n)
        sums += np.bincount(s.ravel(), weights=z.ravel().astype(np.float64), minlength=n)
    new = codebook.astype(np.float64).copy()
    used = counts > 0
    new[used] = sums[used] / counts[used]
    return new.astype(np.float32)


def train(
    name: str, z_train: list[np.ndarray], z_val: list[np.ndarray], iters: int, seeds: list[int], relax: float,
    val_every: int, init: np.ndarray | None = None, trellis: tuple[int, int] | None = None,
) -> tuple[np.ndarray, float]:
    """Lloyd iterations from each seed's random Gaussian codebook (or from ``init``); the codebook with the
    lowest held-out MSE (checked every ``val_every`` iterations, the start included) and that MSE.
    ``trellis`` = (k, L) for a trellis no format has (tools/tcq_trellis_sizes.py); else the format's own."""
    k, L = trellis or tcq.TCQ_PARAMS[name]
    best_cb, best_val = None, np.inf
    for seed in seeds if init is None else ["init"]:
        cb = tcq.initial_codebook(L, seed) if init is None else init.astype(np.float32).copy()
        val, _ = distortion(z_val, cb, k, L)
        print(f"[{name}] seed {seed}: start  val MSE {val:.5f}", flush=True)
        if val < best_val:
            best_cb, best_val = cb.copy(), val
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


def split_npy(paths: list[Path], n_train: int, n_val: int) -> tuple[list[np.ndarray], list[np.ndarray], str]:
    """Per file: a seeded shuffle, the first min(n_val, n/5) groups held out, the next n_train for training."""
    train_sets, val_sets, parts = [], [], []
    for path in paths:
        groups = npy_groups(path)
        order = np.random.default_rng(1234).permutation(len(groups))
        nv = min(n_val, len(groups) // 5)
        val_sets.append(groups[order[:nv]])
        train_sets.append(groups[order[nv : nv + n_train]])
        parts.append(f"{path.name}: {len(train_sets[-1])} train / {nv} val groups of {groups.shape[1]}")
    return train_sets, val_sets, "; ".join(parts)


def eval_report(name: str, paths: list[Path], codebooks: dict[str, np.ndarray]) -> None:
    """Per-coordinate MSE (z units, raw norm) of each codebook on each file of ``paths`` (all groups)."""
    k, L = tcq.TCQ_PARAMS[name]
    for path in paths:
        z = to_unit_z(npy_groups(path))
        cells = ", ".join(f"{label} {distortion([z], cb, k, L)[0]:.5f}" for label, cb in codebooks.items())
        print(f"[{name}] eval {path.name} ({len(z)} groups of {z.shape[1]}): {cells}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="all", choices=["all", *tcq.TCQ_PARAMS])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--gaussian", action="store_true", help="train on rotated N(0,1) groups (default)")
    src.add_argument("--from-npy", type=Path, nargs="+",
                     help="float32 [n, G] rotated unit-normalised vectors (one or more files, any G)")
    ap.add_argument("--group", type=int, default=128, help="G for --gaussian (default 128)")
    ap.add_argument("--n-train", type=int, default=16384, help="training groups (per --from-npy file; default 16384)")
    ap.add_argument("--n-val", type=int, default=4096, help="held-out groups (per --from-npy file; default 4096)")
    ap.add_argument("--iters", type=int, default=60, help="Lloyd iterations per seed (default 60)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="initial codebook seeds (default 0)")
    ap.add_argument("--init", default="random",
                    help="start codebook: 'random' (QTIP random Gaussian, per --seeds), 'package' (the shipped "
                         "tcq_*.npy) or a folder holding tcq_*.npy")
    ap.add_argument("--relax", type=float, default=2.5, help="over-relaxation of the centroid step (default 2.5)")
    ap.add_argument("--val-every", type=int, default=5, help="check the held-out MSE every N iterations")
    ap.add_argument("--eval-npy", type=Path, nargs="*", default=[],
                    help="after training, report the MSE of the package codebook and the new one on these files "
                         "(e.g. K/V dumped from a different text)")
    ap.add_argument("--out-dir", type=Path, default=tcq.DATA_DIR, help="where tcq_*.npy go (package data)")
    args = ap.parse_args(argv)

    if args.from_npy is not None:
        train_groups, val_groups, source = split_npy(args.from_npy, args.n_train, args.n_val)
    else:
        train_groups = [gaussian_groups(args.n_train, args.group, seed=1000)]
        val_groups = [gaussian_groups(args.n_val, args.group, seed=2000)]
        source = f"gaussian ({args.n_train} train / {args.n_val} val groups of {args.group})"
    z_train, z_val = [to_unit_z(g) for g in train_groups], [to_unit_z(g) for g in val_groups]
    print(f"training data: {source}")

    names = list(tcq.TCQ_PARAMS) if args.format == "all" else [args.format]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        package_cb = np.load(tcq.codebook_path(name)) if tcq.codebook_path(name).exists() else None
        if args.init == "random":
            init = None
        elif args.init == "package":
            init = package_cb
        else:
            init = np.load(Path(args.init) / tcq.codebook_path(name).name)
        cb, val = train(name, z_train, z_val, args.iters, args.seeds, args.relax, args.val_every, init)
        out = args.out_dir / tcq.codebook_path(name).name
        np.save(out, cb)
        lm = lloyd_max.gaussian_lloyd_max(LLOYD_MAX_BITS_FOR[name]).mse
        print(f"[{name}] wrote {out}: held-out MSE {val:.5f} (Lloyd-Max scalar at the same bits: {lm:.5f})")
        if args.eval_npy:
            books = {"new": cb} if package_cb is None else {"package": package_cb, "new": cb}
            eval_report(name, args.eval_npy, books)


if __name__ == "__main__":
    main()
