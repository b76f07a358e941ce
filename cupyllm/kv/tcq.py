"""turbo3_tcq / turbo2_tcq: the turbo rotation and norm, then a bitshift trellis (QTIP style) over the group.

Rotation, group size, ``r``, ``z`` (the rotated group scaled to about N(0, 1) per coordinate) and the norm
rules are exactly those of ``cupyllm.kv.turbo`` (read its docstring). What changes is how ``z[0..G-1]`` is
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

Encoding is a Viterbi search for the stream that minimises ``sum_t (z[t] - CODEBOOK[state_t])^2``, in float32
with one rounding per operation and no FMA (CUDA: ``__fsub_rn``/``__fmul_rn``/``__fadd_rn``):

* start-state/tail convention: the start state is free (the first L stream bits are whatever the search
  picks: ``cost_0[s] = e_0(s)``), there is no tail-biting and no forced end state; the stream simply ends
  with the last window, so its last ``L - k`` bits belong only to state ``G-1``.
* ``e_t(s) = d*d`` with ``d = z[t] - CODEBOOK[s]``.
* for ``t = 1 .. G-1`` and every state ``s'``: with ``m = s' & (2^(L-k) - 1)``,
  ``best_t(m) = min_r cost_{t-1}[(m << k) | r]``, scanning ``r = 0, 1, ...`` and replacing only on a strictly
  smaller cost (so a tie keeps the SMALLER predecessor state); ``cost_t[s'] = best_t(m) + e_t(s')``.
* the final state is ``argmin_s cost_{G-1}[s]``, the smallest state on ties; backtracking follows the
  recorded ``r`` of each step.

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
parallel over groups) implement the same arithmetic and return identical states and costs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np

from cupyllm.kv import lloyd_max, turbo
from cupyllm.kv.formats import KVFormatError

_F32 = np.float32

TCQ_PARAMS = {"turbo3_tcq": (3, 9), "turbo2_tcq": (2, 8)}  # name -> (k, L)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


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


def viterbi_states_reference(z: np.ndarray, codebook: np.ndarray, k: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """NumPy reference. z [m, G] float32 -> (states [m, G] int32, path costs [m] float32)."""
    z = np.ascontiguousarray(z, dtype=_F32)
    cb = np.ascontiguousarray(codebook, dtype=_F32)
    m, g = z.shape
    n_states, n_low, n_pred = 1 << L, 1 << (L - k), 1 << k
    low_of_state = np.arange(n_states) & (n_low - 1)
    d = z[:, :1] - cb[None, :]
    cost = d * d
    choice = np.zeros((g, m, n_low), dtype=np.int32)
    for t in range(1, g):
        grouped = cost.reshape(m, n_low, n_pred)  # [.., m, r] is state (m << k) | r
        r = np.argmin(grouped, axis=2)  # first minimum = smallest predecessor
        best = np.take_along_axis(grouped, r[:, :, None], axis=2)[:, :, 0]
        choice[t] = r
        d = z[:, t : t + 1] - cb[None, :]
        cost = best[:, low_of_state] + d * d
    states = np.empty((m, g), dtype=np.int32)
    s = np.argmin(cost, axis=1)
    final_cost = cost[np.arange(m), s]
    for t in range(g - 1, 0, -1):
        states[:, t] = s
        low = s & (n_low - 1)
        s = (low << k) | choice[t, np.arange(m), low]
    states[:, 0] = s
    return states, final_cost.astype(_F32)


@numba.njit(cache=True, parallel=True)
def _viterbi_numba(z, codebook, k, L, states, costs):  # pragma: no cover - compiled
    m, g = z.shape
    n_states = 1 << L
    low_mask = (1 << (L - k)) - 1
    n_pred = 1 << k
    for v in numba.prange(m):
        cost = np.empty(n_states, np.float32)
        best = np.empty(low_mask + 1, np.float32)
        choice = np.empty((g, low_mask + 1), np.uint8)
        zt = z[v, 0]
        for s in range(n_states):
            d = zt - codebook[s]
            cost[s] = d * d
        for t in range(1, g):
            for low in range(low_mask + 1):
                base = low << k
                bc = cost[base]
                br = 0
                for r in range(1, n_pred):
                    c = cost[base + r]
                    if c < bc:
                        bc = c
                        br = r
                best[low] = bc
                choice[t, low] = br
            zt = z[v, t]
            for s in range(n_states):
                d = zt - codebook[s]
                cost[s] = best[s & low_mask] + d * d
        bs = 0
        bc = cost[0]
        for s in range(1, n_states):
            if cost[s] < bc:
                bc = cost[s]
                bs = s
        costs[v] = bc
        s = bs
        for t in range(g - 1, 0, -1):
            states[v, t] = s
            low = s & low_mask
            s = (low << k) | choice[t, low]
        states[v, 0] = s


def viterbi_states(z: np.ndarray, codebook: np.ndarray, k: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """numba Viterbi (same results as ``viterbi_states_reference``): (states [m, G] int32, costs [m] float32)."""
    z = np.ascontiguousarray(z, dtype=_F32)
    cb = np.ascontiguousarray(codebook, dtype=_F32)
    m, g = z.shape
    states = np.empty((m, g), dtype=np.int32)
    costs = np.empty(m, dtype=_F32)
    if m:
        _viterbi_numba(z, cb, np.int64(k), np.int64(L), states, costs)
    return states, costs


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
