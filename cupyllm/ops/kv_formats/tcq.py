"""turbo3_tcq / turbo2_tcq: the turbo rotation and norm, then a bitshift trellis (QTIP style) over the group.

Rotation, group size, ``r``, ``z`` (the rotated group scaled to about N(0, 1) per coordinate) and the norm
rules are exactly those of ``cupyllm.ops.kv_formats.turbo`` (read its docstring). What changes is how ``z[0..G-1]`` is
coded:

Trellis. Parameters ``k`` (bits per value) and ``L`` (state bits): turbo3_tcq k=3, L=9 (512 states),
turbo2_tcq k=2, L=8 (256 states). A group is a bitstream of ``G*k + (L-k)`` bits; the state at step
``t = 0..G-1`` is the L-bit window starting at stream bit ``t*k``, read as a little-endian integer:
``state_t = (stream >> (t*k)) & (2^L - 1)``. Hence ``state_{t+1} = (state_t >> k) | (new_bits << (L-k))``
and the predecessors of a state ``s'`` are ``((s' & (2^(L-k) - 1)) << k) | r`` for ``r = 0 .. 2^k - 1``.
Coordinate t is reconstructed from ``CODEBOOK[state_t]`` (2^L float32 values, package data
``cupyllm/data/tcq_turbo3.npy`` / ``tcq_turbo2.npy``, one codebook per format for every group size).

Training set of the shipped codebooks (commands, sizes and measurements in ``cupyllm/data/TCQ_CODEBOOKS.md``).
Both are trained with this module's own Viterbi encoder, so under the start-state/tail convention below
(free start state, no tail-biting, no forced end state):

* ``tcq_turbo2.npy``: synthetic Gaussian. ``python tools/train_tcq_codebook.py --format all --gaussian``:
  16384 groups of 128 i.i.d. N(0, 1) values, rotated and normalised exactly as the encoder does (4096 more
  held out), Lloyd iterations from QTIP's random-Gaussian codebook (seed 0), 60 iterations with
  over-relaxation 2.5. Held-out MSE per coordinate (N(0,1) units, raw norm) 0.07264 (Lloyd-Max scalar
  0.11748). Fine-tuning on real K/V lowered its MSE slightly but not the KLD, so it was kept.
* ``tcq_turbo3.npy``: the Gaussian turbo3 codebook (held-out 0.01910; Lloyd-Max 0.03455), then 30 Lloyd
  iterations on real K/V: K (after RoPE) and V of every layer of Gemma 3 270M (G = 128) and Qwen2.5-Coder-0.5B
  (G = 64) over ``tests/data/kv_train_text.txt`` (``tools/dump_kv.py``), 8192 training + 2048 held-out
  groups from each of the four dumps. Held-out MSE on K/V of the separate evaluation text: Gemma K/V
  0.01869 / 0.01892, Qwen K/V 0.01779 / 0.01802 (Gaussian codebook 0.01886 / 0.01902 / 0.01825 / 0.01814).

Scale convention: the codebook is in N(0, 1) units, like the turbo LEVELS: ``z_hat[t] = CODEBOOK[state_t]``
approximates ``z[t] = y[t] * sqrt(G) / r``, and the decoded rotated value is
``y_hat[t] = fl32(fl32(f32(n) * INV_SQRT_G) * CODEBOOK[state_t])`` with ``n`` the stored fp16 norm.
The norm is ``turbo.stored_norm(r, z, CODEBOOK[states], mode)``; the default mode "lsq" stores
``fp16(r * fl32(tree_sum(z*c) / tree_sum(c*c)))``, ``c = CODEBOOK[states]``.

Encoding is a Viterbi search for the stream that minimises ``sum_t (z[t] - CODEBOOK[state_t])^2``. It runs in
exact int32 arithmetic (``TrellisMetric``), so the NumPy, numba and CUDA encoders agree bit for bit, ties
included, and the GPU's fused add-min instruction (``__viaddmin_s32``, one DPX instruction on sm_90) does a
state's update. Dropping the ``z[t]^2`` that every state of a step shares, the cost of state ``s`` at step t is

    e_t(s) = C_s^2 2^(2 Fx - F) + X_t * C_s,   X_t = rint(-2 z[t] 2^Fx),   C_s = rint(CODEBOOK[s] 2^(F - Fx))

in units of 2^-F: exactly ``(z_q - c_q)^2 - z_q^2`` for ``z`` rounded to 2^-(Fx+1) and the centroids to
2^-(F-Fx) (``metric_for``: F as large as keeps every cost within int32, 16 bits for turbo3_tcq at G = 128;
Fx = ceil(F / 2); ``X_t`` clamped to the largest |z| a unit-norm group has, 0 for a NaN). On N(0, 1) groups
its paths have a squared error 0.007% above the float32 search's (turbo3_tcq, G = 128). Every
``RENORM_STEPS``-th step subtracts ``best_{t-1}(0)`` from every ``best_t`` (the same constant for all states:
no comparison changes), which bounds the costs whatever the group length.

* start-state/tail convention: the start state is free (the first L stream bits are whatever the search
  picks: ``cost_0[s] = e_0(s)``), there is no tail-biting and no forced end state; the stream simply ends
  with the last window, so its last ``L - k`` bits belong only to state ``G-1``.
* for ``t = 1 .. G-1`` and every state ``s'``: with ``m = s' & (2^(L-k) - 1)``,
  ``best_t(m) = min_r cost_{t-1}[(m << k) | r]``, the smallest ``r`` on ties (so a tie keeps the SMALLER
  predecessor state); ``cost_t[s'] = best_t(m) + e_t(s')``.
* the final state is ``argmin_s cost_{G-1}[s]``, the smallest state on ties; backtracking follows the
  recorded ``r`` of each step.

The tie rule is free in the packed form the encoders compute in: ``cost << k | r`` for the state
``(m << k) | r``, so one integer minimum over a predecessor set gives the smallest cost and, among equal
costs, the smallest ``r`` (``TrellisMetric.centroid`` and ``.square`` are stored shifted and tagged so).

(``best_t(m)`` is shared by the 2^k states that have the same ``m``, so a step costs O(2^L), not O(2^(L+k)).)

Block layout, ``block_bytes = 4 * ceil((2 + ceil((G*k + L - k) / 8)) / 4)`` bytes:

* bytes 0..1: the norm, fp16 little-endian;
* bytes 2 .. 2 + ceil((G*k + L - k)/8) - 1: the stream, stream bit ``p`` = bit ``p % 8`` of byte ``2 + p // 8``;
  unused high bits of the last stream byte are 0;
* then zero bytes up to the block size (a multiple of 4).

G = 128: turbo3_tcq 2 + 49 + 1 = 52 B (3.25 bpv), turbo2_tcq 2 + 33 + 1 = 36 B (2.25 bpv).
G = 64:  turbo3_tcq 2 + 25 + 1 = 28 B (3.5 bpv),  turbo2_tcq 2 + 17 + 1 = 20 B (2.5 bpv).

Decoding is O(1) per value: ``state_t`` is ``L`` bits read from stream bit ``t*k`` (at most 3 bytes).

``viterbi_states_reference`` (NumPy, vectorised over groups and states) and ``viterbi_states`` (numba,
parallel over groups) implement the same arithmetic and return identical states and (integer) costs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np

from . import lloyd_max, turbo
from .base import KVFormatError

_F32 = np.float32

TCQ_PARAMS = {"turbo3_tcq": (3, 9), "turbo2_tcq": (2, 8)}  # name -> (k, L)

DATA_DIR = Path(__file__).resolve().parents[2] / "data"  # cupyllm/data


def codebook_path(name: str) -> Path:
    return DATA_DIR / f"tcq_{name.removesuffix('_tcq')}.npy"


def stream_bits(group_values: int, k: int, L: int) -> int:
    return group_values * k + L - k


def block_bytes_for(group_values: int, k: int, L: int) -> int:
    unpadded = 2 + (stream_bits(group_values, k, L) + 7) // 8
    return (unpadded + 3) // 4 * 4


def initial_codebook(L: int, seed: int = 0) -> np.ndarray:
    """A structured start for training: the 2^L Gaussian quantiles ``Phi^-1((j + 0.5) / 2^L)`` dealt to the
    states in a fixed pseudo-random order (the "random Gaussian codebook" of QTIP)."""
    n = 1 << L
    quantiles = np.array([lloyd_max.normal_quantile((j + 0.5) / n) for j in range(n)])
    order = np.random.default_rng(seed).permutation(n)
    return quantiles[order].astype(_F32)


@functools.lru_cache(maxsize=None)
def load_codebook(name: str) -> np.ndarray:
    k, L = TCQ_PARAMS[name]
    path = codebook_path(name)
    if not path.exists():
        raise KVFormatError(
            f"the codebook of KV format {name!r} is missing ({path}); reinstall cupyllm or run "
            f"`python tools/train_tcq_codebook.py --format {name} --gaussian`"
        )
    cb = np.load(path)
    if cb.shape != (1 << L,) or cb.dtype != np.float32:
        raise KVFormatError(f"{path} holds {cb.dtype} {cb.shape}, expected float32 ({1 << L},); retrain it")
    cb.setflags(write=False)
    return cb


# -- Viterbi -------------------------------------------------------------------------------------------

_INT32_MAX = (1 << 31) - 1
RENORM_STEPS = 16  # every 16th step the search subtracts best_{t-1}(0) from every best_t: costs stay small


@dataclass(frozen=True)
class TrellisMetric:
    """The search's integer branch metric for one codebook, group size and k (module docstring): state ``s``
    at step t costs ``X_t * centroid[s] + square[s]`` = ``e_t(s) << k | (s & (2^k - 1))``, X_t from ``steps``."""
    k: int
    frac_bits: int  # F: the metric's unit is 2^-F (N(0, 1) units squared)
    z_bits: int  # Fx: X_t = rint(-2 z 2^Fx)
    x_limit: int  # |X_t| <= x_limit: the largest |z| of a unit-norm group
    centroid: np.ndarray  # int32 [2^L]: C_s << k, C_s = rint(c_s 2^(F - Fx))
    square: np.ndarray  # int32 [2^L]: C_s^2 2^(2 Fx - F) << k | (s & (2^k - 1))

    def steps(self, z: np.ndarray) -> np.ndarray:
        """z [m, G] float32 -> X [m, G] int32: rint(z * -2^(Fx+1)) (exact scaling, ties to even), clamped to
        +-x_limit, 0 where z is NaN."""
        scaled = np.asarray(z, dtype=_F32) * _F32(-(1 << (self.z_bits + 1)))
        limit = _F32(self.x_limit)
        clamped = np.minimum(np.maximum(scaled, -limit), limit)
        return np.where(np.isnan(scaled), _F32(0), np.rint(clamped)).astype(np.int32)

    @property
    def tag_mask(self) -> int:
        return (1 << self.k) - 1


def _metric_for_bits(cb: np.ndarray, group_values: int, k: int, frac_bits: int) -> TrellisMetric:
    z_bits = (frac_bits + 1) // 2  # >= F / 2, so that the squares are whole units
    c_int = np.rint(cb * 2.0 ** (frac_bits - z_bits)).astype(np.int64)
    states = np.arange(cb.size)
    return TrellisMetric(k=k, frac_bits=frac_bits, z_bits=z_bits,
                         x_limit=int(np.ceil(2.0 ** (z_bits + 1) * np.sqrt(group_values))),
                         centroid=c_int << k,
                         square=((c_int * c_int) << (2 * z_bits - frac_bits) << k) | (states & ((1 << k) - 1)))


def _cost_bound(metric: TrellisMetric, L: int) -> int:
    """A bound on |cost| of any state at any step, packed. With E = max |e_t(s)| (``step``) and mu_t the least
    cost at step t: every state is reachable from every other in q = ceil(L / k) steps, so the costs of a step
    lie within 2qE above mu_t, and mu_t moves by at most E a step. A renormalisation at step t subtracts
    best_{t-1}(0), within [mu_{t-2}, mu_{t-2} + 2qE], from values within [mu_{t-1}, mu_{t-1} + 2qE]: all then lie
    within (2q + 1)E of 0, and they drift by at most E a step for the RENORM_STEPS steps to the next one (before
    the first, a cost is a sum of at most RENORM_STEPS step costs). Three more steps of margin."""
    step = int(np.max(np.abs(metric.square.astype(np.int64) >> metric.k))) + metric.x_limit * int(
        np.max(np.abs(metric.centroid.astype(np.int64) >> metric.k)))
    q = -(-L // metric.k)
    return ((RENORM_STEPS + 2 * q + 4) * step + 1) << metric.k


def metric_for(codebook: np.ndarray, group_values: int, k: int) -> TrellisMetric:
    """The finest TrellisMetric whose packed costs stay within int32 for this codebook, group size and trellis
    (made once per codebook: every encode asks for it)."""
    return _metric_for_codebook(np.asarray(codebook, dtype=_F32).tobytes(), int(group_values), int(k))


@functools.lru_cache(maxsize=64)
def _metric_for_codebook(codebook_bytes: bytes, group_values: int, k: int) -> TrellisMetric:
    cb = np.frombuffer(codebook_bytes, dtype=_F32).astype(np.float64)
    if not np.all(np.isfinite(cb)):
        raise KVFormatError("a TCQ codebook holds a non-finite value; retrain it")
    L = int(cb.size).bit_length() - 1
    for frac_bits in range(24, 0, -1):
        metric = _metric_for_bits(cb, group_values, k, frac_bits)
        if _cost_bound(metric, L) <= _INT32_MAX:
            centroid, square = metric.centroid.astype(np.int32), metric.square.astype(np.int32)
            centroid.setflags(write=False)
            square.setflags(write=False)
            return dataclasses.replace(metric, centroid=centroid, square=square)
    raise KVFormatError(f"a TCQ codebook with |c| up to {np.max(np.abs(cb)):.3g} cannot be searched in int32; "
                        f"retrain it")


def viterbi_states_reference(z: np.ndarray, codebook: np.ndarray, k: int, L: int,
                             renorm_steps: int | None = RENORM_STEPS) -> tuple[np.ndarray, np.ndarray]:
    """NumPy reference. z [m, G] float32 -> (states [m, G] int32, path costs [m] int64 in the metric's units).
    ``renorm_steps=None`` searches without renormalising (int64: the int32 bound is then not checked)."""
    m, g = np.shape(z)
    metric = metric_for(codebook, g, k)
    x = metric.steps(z).astype(np.int64)
    centroid, square = metric.centroid.astype(np.int64), metric.square.astype(np.int64)
    n_states, n_low, n_pred = 1 << L, 1 << (L - k), 1 << k
    low_of_state = np.arange(n_states) & (n_low - 1)
    packed = x[:, :1] * centroid + square  # [m, states]: cost << k | r
    choice = np.zeros((g, m, n_low), dtype=np.int32)
    offset = np.zeros(m, dtype=np.int64)  # what the renormalisations took off
    best = None
    for t in range(1, g):
        previous, best = best, packed.reshape(m, n_low, n_pred).min(axis=2)  # smallest cost, then smallest r
        choice[t] = best & metric.tag_mask
        best &= ~metric.tag_mask
        if renorm_steps and t % renorm_steps == 0:
            offset += previous[:, 0] >> k
            best -= previous[:, :1]
        packed = best[:, low_of_state] + x[:, t:t + 1] * centroid + square
        assert not renorm_steps or np.all(np.abs(packed) <= _INT32_MAX), "TrellisMetric bound broken"
    cost = packed >> k
    states = np.empty((m, g), dtype=np.int32)
    s = np.argmin(cost, axis=1)  # the smallest state on ties
    final_cost = cost[np.arange(m), s] + offset
    for t in range(g - 1, 0, -1):
        states[:, t] = s
        low = s & (n_low - 1)
        s = (low << k) | choice[t, np.arange(m), low]
    states[:, 0] = s
    return states, final_cost


@numba.njit(cache=True, parallel=True)
def _viterbi_numba(x, centroid, square, k, L, renorm_steps, states, costs):  # pragma: no cover - compiled
    m, g = x.shape
    n_states = 1 << L
    n_low = 1 << (L - k)
    low_mask = n_low - 1
    tag_mask = (1 << k) - 1
    n_pred = 1 << k
    for v in numba.prange(m):
        packed = np.empty(n_states, np.int32)
        best = np.empty(n_low, np.int32)
        choice = np.empty((g, n_low), np.uint8)
        offset = 0
        previous_best0 = np.int32(0)
        xt = np.int32(x[v, 0])
        for s in range(n_states):
            packed[s] = xt * centroid[s] + square[s]
        for t in range(1, g):
            ref = previous_best0 if t % renorm_steps == 0 else np.int32(0)
            offset += ref >> k
            for low in range(n_low):
                base = low << k
                b = packed[base]
                for r in range(1, n_pred):
                    b = min(b, packed[base + r])
                best[low] = np.int32((b & ~tag_mask) - ref)
                choice[t, low] = b & tag_mask
            previous_best0 = best[0]
            xt = np.int32(x[v, t])
            for high in range(n_pred):  # s = high * n_low + low: contiguous runs, so the loop vectorises
                for low in range(n_low):
                    s = high * n_low + low
                    packed[s] = np.int32(best[low] + xt * centroid[s] + square[s])
        bs = 0
        bc = packed[0] >> k
        for s in range(1, n_states):
            c = packed[s] >> k
            if c < bc:
                bc = c
                bs = s
        costs[v] = bc + offset
        s = bs
        for t in range(g - 1, 0, -1):
            states[v, t] = s
            low = s & low_mask
            s = (low << k) | choice[t, low]
        states[v, 0] = s


def viterbi_states(z: np.ndarray, codebook: np.ndarray, k: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """numba Viterbi (same results as ``viterbi_states_reference``): (states [m, G] int32, costs [m] int64)."""
    m, g = np.shape(z)
    metric = metric_for(codebook, g, k)
    states = np.empty((m, g), dtype=np.int32)
    costs = np.empty(m, dtype=np.int64)
    if m:
        _viterbi_numba(metric.steps(z), metric.centroid, metric.square, np.int64(k), np.int64(L),
                       np.int64(RENORM_STEPS), states, costs)
    return states, costs


def path_cost(z: np.ndarray, codebook: np.ndarray, k: int, states: np.ndarray) -> np.ndarray:
    """The metric's cost of given paths: z [m, G], states [m, G] -> int64 [m] (what the search minimises)."""
    metric = metric_for(codebook, np.shape(z)[1], k)
    x = metric.steps(z).astype(np.int64)
    packed = x * metric.centroid.astype(np.int64)[states] + metric.square.astype(np.int64)[states]
    return (packed >> k).sum(axis=1)


# -- bitstream -----------------------------------------------------------------------------------------


def _window_positions(group_values: int, k: int, L: int) -> np.ndarray:
    """[G, L] stream bit index of bit j of state t: t*k + j."""
    return np.arange(group_values)[:, None] * k + np.arange(L)[None, :]


def pack_states(states: np.ndarray, k: int, L: int, n_bytes: int) -> np.ndarray:
    """[m, G] states of a valid path -> [m, n_bytes] uint8 (stream, then zero padding)."""
    m, g = states.shape
    bits = np.zeros((m, n_bytes * 8), dtype=np.uint8)
    window = ((states[:, :, None] >> np.arange(L)) & 1).astype(np.uint8)  # [m, G, L]
    bits[:, _window_positions(g, k, L)] = window  # overlapping windows agree on a valid path
    return np.packbits(bits, axis=1, bitorder="little")


def unpack_states(raw: np.ndarray, group_values: int, k: int, L: int) -> np.ndarray:
    """[m, nbytes] uint8 stream -> [m, G] int32 states (``state_t = (stream >> t*k) & (2^L - 1)``)."""
    bits = np.unpackbits(raw, axis=1, bitorder="little")
    window = bits[:, _window_positions(group_values, k, L)].astype(np.int32)  # [m, G, L]
    return (window << np.arange(L, dtype=np.int32)).sum(axis=2)


def path_is_valid(states: np.ndarray, k: int, L: int) -> bool:
    return bool(np.all((states[:, 1:] & ((1 << (L - k)) - 1)) == (states[:, :-1] >> k)))


# -- the format ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TCQFormat(turbo.RotatedFormat):
    k: int
    L: int
    codebook: np.ndarray = field(compare=False, repr=False)

    def encode_groups(self, groups: np.ndarray) -> np.ndarray:
        r, z = turbo.group_norm_and_z(groups)
        states, _ = viterbi_states(z, self.codebook, self.k, self.L)
        norms = turbo.stored_norm(r, z, self.codebook[states], self.norm_mode)
        stream = pack_states(states, self.k, self.L, self.block_bytes - 2)
        return np.concatenate([norms.astype("<f2").view(np.uint8).reshape(-1, 2), stream], axis=1)

    def decode_groups(self, blocks: np.ndarray) -> np.ndarray:
        norms = np.ascontiguousarray(blocks[:, :2]).view("<f2").reshape(-1)
        states = unpack_states(blocks[:, 2:], self.group_values, self.k, self.L)
        return turbo.reconstruct(norms, self.codebook[states])


def make_format(
    name: str,
    group_values: int,
    codebook: np.ndarray | None = None,
    norm_mode: str = turbo.DEFAULT_NORM_MODE,
) -> TCQFormat:
    """The TCQ format ``name`` with ``group_values``-value groups; ``codebook`` defaults to the package data."""
    if name not in TCQ_PARAMS:
        raise KVFormatError(f"{name!r} is not a TCQ format; choose one of {sorted(TCQ_PARAMS)}")
    k, L = TCQ_PARAMS[name]
    return trellis_format(k, L, group_values, load_codebook(name) if codebook is None else codebook, norm_mode, name)


def trellis_format(k: int, L: int, group_values: int, codebook: np.ndarray,
                   norm_mode: str = turbo.DEFAULT_NORM_MODE, name: str | None = None) -> TCQFormat:
    """A TCQ format with any step k and window L (the named formats are (3, 9) and (2, 8)): what
    tools/tcq_trellis_sizes.py and bench/kv_encode.py --tcq-sizes weigh other trellis sizes with."""
    turbo.check_group_values(group_values)
    name = name or f"trellis_k{k}_L{L}"
    cb = np.asarray(codebook, dtype=_F32)
    if cb.shape != (1 << L,):
        raise KVFormatError(f"{name!r} needs a codebook of {1 << L} values, got shape {cb.shape}")
    return TCQFormat(
        name=name,
        block_values=group_values,
        block_bytes=block_bytes_for(group_values, k, L),
        group_values=group_values,
        norm_mode=norm_mode,
        k=k,
        L=L,
        codebook=cb,
    )
