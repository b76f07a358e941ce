"""Lloyd-Max scalar quantizers of the standard normal N(0, 1), from the exact density (math.erf, no scipy).

The Lloyd iteration alternates the two optimality conditions of a minimum-MSE scalar quantizer:
boundaries are midpoints of neighbouring levels, and each level is the conditional mean of its cell,
``E[X | a < X < b] = (phi(a) - phi(b)) / (Phi(b) - Phi(a))``. It starts from the quantiles of the cell
centres and stops when no level moves by more than ``tol``. The levels are symmetrised (``c[i] = -c[-1-i]``
exactly), so the middle boundary of an even level count is exactly 0.

Resulting MSE for unit variance (``gaussian_lloyd_max(b).mse``): 1 bit 0.3634, 2 bits 0.1175,
3 bits 0.03454, 4 bits 0.009497 (the classical Max 1960 values).

The turbo formats use ``levels / sqrt(G)`` as the codebook of a coordinate of a rotated unit vector
(approximately N(0, 1/G)); they store the N(0, 1) levels as float32 and apply ``1/sqrt(G)`` with the norm.
``python -m cupyllm.ops.kv_formats.lloyd_max`` prints the float32 tables (levels and decision boundaries) as C arrays.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def normal_pdf(x: float) -> float:
    if math.isinf(x):
        return 0.0
    return _INV_SQRT_2PI * math.exp(-0.5 * x * x)


def normal_cdf(x: float) -> float:
    # erfc keeps precision in the far tails (Phi(b) - Phi(a) of the outer cells).
    return 0.5 * math.erfc(-x / _SQRT2)


def normal_quantile(p: float) -> float:
    """Inverse of normal_cdf by bisection (only used for initial points and codebook seeds)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"normal_quantile needs 0 < p < 1, got {p}")
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if normal_cdf(mid) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class ScalarQuantizer:
    levels: np.ndarray  # float64 [2^bits], increasing
    boundaries: np.ndarray  # float64 [2^bits - 1], midpoints of neighbouring levels
    mse: float  # expected squared error for X ~ N(0, 1)


def _cell_stats(a: float, b: float) -> tuple[float, float, float]:
    """P(a<X<b), E[X; a<X<b], E[X^2; a<X<b] for X ~ N(0,1)."""
    p = normal_cdf(b) - normal_cdf(a)
    pa, pb = normal_pdf(a), normal_pdf(b)
    m1 = pa - pb
    ta = 0.0 if math.isinf(a) else a * pa
    tb = 0.0 if math.isinf(b) else b * pb
    m2 = p + ta - tb
    return p, m1, m2


def quantizer_mse(levels: np.ndarray) -> float:
    """Exact N(0,1) MSE of nearest-level quantization with the given increasing levels."""
    edges = [-math.inf] + [0.5 * (levels[i] + levels[i + 1]) for i in range(len(levels) - 1)] + [math.inf]
    total = 0.0
    for i, c in enumerate(levels):
        p, m1, m2 = _cell_stats(edges[i], edges[i + 1])
        total += m2 - 2.0 * c * m1 + c * c * p
    return total


@functools.lru_cache(maxsize=None)
def gaussian_lloyd_max(bits: int, tol: float = 1e-14, max_iter: int = 200_000) -> ScalarQuantizer:
    """The Lloyd-Max quantizer of N(0, 1) with 2^bits levels."""
    if not 1 <= bits <= 8:
        raise ValueError(f"gaussian_lloyd_max supports 1..8 bits, got {bits}")
    n = 1 << bits
    levels = [normal_quantile((i + 0.5) / n) for i in range(n)]
    for _ in range(max_iter):
        edges = [-math.inf] + [0.5 * (levels[i] + levels[i + 1]) for i in range(n - 1)] + [math.inf]
        new = []
        for i in range(n):
            p, m1, _ = _cell_stats(edges[i], edges[i + 1])
            new.append(m1 / p)
        moved = max(abs(u - v) for u, v in zip(new, levels))
        levels = new
        if moved < tol:
            break
    arr = np.array(levels, dtype=np.float64)
    arr = 0.5 * (arr - arr[::-1])  # exact symmetry
    bounds = 0.5 * (arr[1:] + arr[:-1])
    return ScalarQuantizer(levels=arr, boundaries=bounds, mse=quantizer_mse(arr))


def float32_tables(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The float32 levels and the float32 decision boundaries ``fl32((c[i] + c[i+1]) * 0.5)`` (computed in
    float32 from the float32 levels) that the turbo formats use."""
    levels = gaussian_lloyd_max(bits).levels.astype(np.float32)
    bounds = ((levels[1:] + levels[:-1]) * np.float32(0.5)).astype(np.float32)
    return levels, bounds


def _c_array(name: str, values: np.ndarray) -> str:
    body = ", ".join(f"{float(v)!r}f" for v in values)  # repr of a float32-valued double round-trips
    return f"static const float {name}[{len(values)}] = {{{body}}};"


def main() -> None:
    for bits in (4, 3, 2):
        levels, bounds = float32_tables(bits)
        print(f"// {bits}-bit Lloyd-Max, N(0,1), MSE {gaussian_lloyd_max(bits).mse:.6f}")
        print(_c_array(f"TURBO{bits}_LEVELS", levels))
        print(_c_array(f"TURBO{bits}_BOUNDS", bounds))


if __name__ == "__main__":
    main()
