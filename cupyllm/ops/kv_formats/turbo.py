"""turbo4 / turbo3 / turbo2: randomised Walsh-Hadamard rotation + fp16 norm + Lloyd-Max coordinate codes.

Groups. A row of ``d`` values is cut into consecutive groups of ``G`` values (``G = min(128, head_dim)``, a
power of two); each group is one block. ``G`` never straddles two heads because it divides ``head_dim``.

Rotation (``rotate`` / ``unrotate``), all float32, every step one IEEE rounding, no FMA:

1. Sign flips: value ``i`` of the group is negated iff bit ``i % 32`` of ``SIGN_WORDS[i // 32]`` is 1.
   ``SIGN_WORDS = (0x9E3779B9, 0x7F4A7C15, 0xF39CC060, 0x5CEDC834)``: the first 128 bits of the fractional
   part of the golden ratio (a nothing-up-my-sleeve constant); a group of ``G < 128`` uses its first ``G`` bits.
2. Unnormalised fast Walsh-Hadamard transform in Sylvester (natural) order: for ``h = 1, 2, 4, ..., G/2``
   (in this order), for every ``i`` with ``i & h == 0``: ``(v[i], v[i+h]) <- (v[i] + v[i+h], v[i] - v[i+h])``.
   (Different threads may do different butterflies of one stage in any order; the stage order is fixed.)
3. Multiply every value by ``INV_SQRT_G = fl32(1/sqrt(G))`` (exact for G = 4^j, e.g. 1/8 for G = 64).

So ``y = rotate(x) = H (s * x) / sqrt(G)``, orthonormal; ``unrotate(y) = s * (H y) / sqrt(G)`` (same butterfly
stages on ``y``, then ``* INV_SQRT_G``, then the sign flips). Attention works in the rotated domain: the engine
rotates Q once (``q.k = rotate(q).rotate(k)``) and unrotates the attention output once for V.

Encoding a rotated group ``y[0..G-1]`` (``encode_rotated``; ``encode(x) == encode_rotated(rotate(x))``):

* ``ss = tree_sum(y[i] * y[i])`` with the stride-halving tree: ``s[i] = y[i]*y[i]``; for ``h = G/2, ..., 2, 1``:
  ``s[i] = s[i] + s[i+h]`` for ``i < h``; ``ss = s[0]``. (Thread layout "value i in lane i % 32, slot i // 32",
  adding the slots in the same tree and then ``__shfl_xor`` over lanes 16, 8, 4, 2, 1, reproduces it.)
* ``r = sqrt(ss)`` (correctly rounded); ``scale = r > 0 ? SQRT_G / r : 0`` with ``SQRT_G = fl32(sqrt(G))``;
  ``z[i] = y[i] * scale`` (z is the unit vector times sqrt(G): each coordinate is about N(0, 1)).
* ``code[i] = #{ j : z[i] > BOUNDS[j] }``, the index of the nearest float32 Lloyd-Max level of N(0, 1)
  (``lloyd_max.float32_tables(bits)``: ``LEVELS`` 2^b values, ``BOUNDS[j] = fl32((LEVELS[j] + LEVELS[j+1]) * 0.5)``;
  a value exactly on a boundary takes the lower code).
* Stored norm (``norm_mode`` "lsq", the default): with ``L[i] = LEVELS[code[i]]``,
  ``ll = tree_sum(L[i]*L[i])``, ``zl = tree_sum(z[i]*L[i])``: ``n = fp16(r * fl32(zl / ll))`` (``n = 0`` when
  ``ll == 0``). This is the least-squares norm: the one that minimises the group's squared error for the
  chosen codes. Measured against the alternatives on N(0, 1) data (G = 128, per-value MSE,
  tests/ops/test_kv_formats.py::test_turbo_norm_modes checks the ordering):

  =========== ========= ========= =============================================================
  format      lsq       raw       corrected (``r * SQRT_G / sqrt(ll)``: decoded norm == r)
  =========== ========= ========= =============================================================
  turbo4      0.00912   0.00929   0.00914
  turbo3      0.03341   0.03386   0.03370
  turbo2      0.11494   0.11573   0.11853
  turbo3_tcq  0.01891   0.01909   0.01900
  turbo2_tcq  0.07217   0.07272   0.07353
  =========== ========= ========= =============================================================

  The corrected norm helps a little at 4 bits but hurts at 2 (Lloyd-Max levels are conditional means, so
  the reconstruction is meant to be shorter than the input); lsq is best everywhere. The "raw"
  (``fp16(r)``) and "corrected" modes stay selectable (``make_format(..., norm_mode=...)``) for KLD studies.

Block layout (``2 + G*b/8`` bytes; G = 128: turbo4 66 B = 4.125 bpv, turbo3 50 B = 3.125 bpv, turbo2 34 B =
2.125 bpv; G = 64: 34 / 26 / 18 B = 4.25 / 3.25 / 2.25 bpv):

* bytes 0..1: the norm, fp16 little-endian;
* bytes 2..: the G codes as a little-endian bitstream, LSB first: code ``i`` occupies stream bits
  ``i*b .. i*b + b - 1`` (bit ``j`` of the code is stream bit ``i*b + j``), stream bit ``p`` is bit ``p % 8`` of
  byte ``2 + p // 8``. (4 bits: byte ``2 + i//2`` holds code i in its low nibble when i is even; 2 bits: four
  codes per byte, code i at bits ``2*(i%4)``; 3 bits: codes straddle bytes.)

Decoding a group (``decode_rotated``): ``f = fl32(f32(n) * INV_SQRT_G)``; ``y_hat[i] = fl32(f * LEVELS[code[i]])``.
``decode = unrotate(decode_rotated(...))``.

The float32 tables (``python -m cupyllm.ops.kv_formats.lloyd_max`` prints them; a test checks this copy)::

    TURBO4_LEVELS = {-2.7325894832611084, -2.069017171859741, -1.6180464029312134, -1.2562311887741089,
                     -0.9423404335975647, -0.6567591428756714, -0.38804829120635986, -0.12839503586292267,
                     0.12839503586292267, 0.38804829120635986, 0.6567591428756714, 0.9423404335975647,
                     1.2562311887741089, 1.6180464029312134, 2.069017171859741, 2.7325894832611084}
    TURBO3_LEVELS = {-2.1519455909729004, -1.3439092636108398, -0.7560052871704102, -0.2450941801071167,
                     0.2450941801071167, 0.7560052871704102, 1.3439092636108398, 2.1519455909729004}
    TURBO2_LEVELS = {-1.5104175806045532, -0.4527800381183624, 0.4527800381183624, 1.5104175806045532}

Non-finite inputs, and groups whose stored norm would overflow fp16, raise ``KVFormatError``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import lloyd_max
from .base import KVFormat, KVFormatError, MAX_GROUP_VALUES

_F32 = np.float32

SIGN_WORDS = (0x9E3779B9, 0x7F4A7C15, 0xF39CC060, 0x5CEDC834)

TURBO_BITS = {"turbo4": 4, "turbo3": 3, "turbo2": 2}

NORM_MODES = ("lsq", "raw", "corrected")
DEFAULT_NORM_MODE = "lsq"


def check_group_values(group_values: int) -> None:
    if group_values < 2 or group_values > MAX_GROUP_VALUES or group_values & (group_values - 1):
        raise KVFormatError(
            f"rotated KV formats need a group of 2..{MAX_GROUP_VALUES} values that is a power of two, got "
            f"{group_values}; use a scalar KV format (q8_0, q4_0, ...) for this head_dim"
        )


@functools.lru_cache(maxsize=None)
def sign_vector(group_values: int) -> np.ndarray:
    """float32 [G] of +1/-1: -1 where the sign bit of that position is set."""
    check_group_values(group_values)
    i = np.arange(group_values)
    words = np.array(SIGN_WORDS, dtype=np.uint64)[i // 32]
    bits = (words >> (i % 32).astype(np.uint64)) & np.uint64(1)
    out = np.where(bits == 1, _F32(-1.0), _F32(1.0)).astype(_F32)
    out.setflags(write=False)
    return out


def inv_sqrt_g(group_values: int) -> np.float32:
    return _F32(1.0 / np.sqrt(float(group_values)))


def sqrt_g(group_values: int) -> np.float32:
    return _F32(np.sqrt(float(group_values)))


def fwht_unnormalised(v: np.ndarray) -> np.ndarray:
    """[m, G] float32 -> H v (Sylvester order), butterfly stages h = 1, 2, ..., G/2."""
    m, g = v.shape
    v = np.ascontiguousarray(v, dtype=_F32)
    h = 1
    while h < g:
        pairs = v.reshape(m, g // (2 * h), 2, h)
        a = pairs[:, :, 0, :]
        b = pairs[:, :, 1, :]
        v = np.stack([a + b, a - b], axis=2).reshape(m, g)
        h *= 2
    return v


def _as_groups(x: np.ndarray, group_values: int) -> np.ndarray:
    x = np.asarray(x, dtype=_F32)
    if x.ndim != 2 or x.shape[1] % group_values:
        raise KVFormatError(
            f"rotation of {group_values}-value groups takes a 2-D float array [n, d] with d a multiple of "
            f"{group_values}, got shape {x.shape}"
        )
    return x.reshape(-1, group_values)


def rotate(x: np.ndarray, group_values: int) -> np.ndarray:
    """[n, d] float32 -> rotated [n, d]: per group ``H (s * x) / sqrt(G)``."""
    groups = _as_groups(x, group_values)
    out = fwht_unnormalised(groups * sign_vector(group_values)) * inv_sqrt_g(group_values)
    return out.reshape(np.shape(x))


def unrotate(y: np.ndarray, group_values: int) -> np.ndarray:
    """Inverse of ``rotate``: per group ``s * (H y) / sqrt(G)``."""
    groups = _as_groups(y, group_values)
    out = (fwht_unnormalised(groups) * inv_sqrt_g(group_values)) * sign_vector(group_values)
    return out.reshape(np.shape(y))


def tree_sum(v: np.ndarray) -> np.ndarray:
    """[m, G] -> [m]: the stride-halving pairwise sum (s[i] += s[i+h], h = G/2 ... 1), float32."""
    s = np.ascontiguousarray(v, dtype=_F32)
    h = s.shape[1] // 2
    while h >= 1:
        s = s[:, :h] + s[:, h : 2 * h]
        h //= 2
    return s[:, 0]


def group_norm_and_z(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[m, G] rotated values -> (r [m] float32 L2 norms, z [m, G] = y * sqrt(G) / r, zero where r == 0)."""
    g = groups.shape[1]
    r = np.sqrt(tree_sum(groups * groups))
    scale = np.zeros_like(r)
    np.divide(sqrt_g(g), r, out=scale, where=r > 0)
    return r, groups * scale[:, None]


def stored_norm(r: np.ndarray, z: np.ndarray, recon_levels: np.ndarray, mode: str) -> np.ndarray:
    """The norm to store (float16 [m]) for raw norms ``r`` [m], the N(0,1)-unit coordinates ``z`` [m, G] and
    their reconstruction ``recon_levels`` [m, G] (LEVELS[code], or the TCQ codebook entries of the path).

    lsq:       ``fp16(r * fl32(tree_sum(z*L) / tree_sum(L*L)))`` (0 when ``tree_sum(L*L) == 0``): the norm
               that minimises the group's squared error for the chosen codes (the default)
    raw:       ``fp16(r)``
    corrected: ``fp16(r * fl32(SQRT_G / sqrt(tree_sum(L*L))))``: the decoded group has norm r
    """
    if mode == "raw":
        norms = r
    elif mode == "lsq":
        ll = tree_sum(recon_levels * recon_levels)
        ratio = np.zeros_like(ll)
        np.divide(tree_sum(z * recon_levels), ll, out=ratio, where=ll > 0)
        norms = r * ratio
    elif mode == "corrected":
        ll = tree_sum(recon_levels * recon_levels)
        factor = np.ones_like(ll)
        np.divide(sqrt_g(recon_levels.shape[1]), np.sqrt(ll), out=factor, where=ll > 0)
        norms = r * factor
    else:
        raise KVFormatError(f"unknown norm mode {mode!r}; choose one of {NORM_MODES}")
    with np.errstate(over="ignore"):
        out = norms.astype(np.float16)
    if not np.isfinite(out).all():
        raise KVFormatError(
            "a K/V group's L2 norm exceeds the fp16 range (65504) of the rotated KV formats; "
            "use a scalar KV format (f16 / q8_0) for this model"
        )
    return out


def reconstruct(norms: np.ndarray, recon_levels: np.ndarray) -> np.ndarray:
    """``fl32(fl32(f32(n) * INV_SQRT_G) * L)``: norms [m] float16, recon_levels [m, G] float32."""
    f = norms.astype(_F32) * inv_sqrt_g(recon_levels.shape[1])
    return f[:, None] * recon_levels


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[m, G] integer codes < 2^bits -> [m, ceil(G*bits/8)] uint8 little-endian bitstream, LSB first."""
    m, g = codes.shape
    c = codes.astype(np.uint32)
    stream = ((c[:, :, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8).reshape(m, g * bits)
    return np.packbits(stream, axis=1, bitorder="little")


def unpack_codes(raw: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of ``pack_codes``: [m, nbytes] uint8 -> [m, count] int32."""
    m = raw.shape[0]
    stream = np.unpackbits(raw, axis=1, bitorder="little")[:, : count * bits].reshape(m, count, bits)
    return (stream.astype(np.int32) << np.arange(bits, dtype=np.int32)).sum(axis=2)


def check_finite(fmt_name: str, x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        raise KVFormatError(
            f"KV format {fmt_name!r} got NaN/inf values to store; the model produced non-finite K/V "
            f"(check the weights / the previous layer), the cache cannot hold them"
        )


@dataclass(frozen=True)
class RotatedFormat(KVFormat):
    """Shared plumbing of the rotated formats: groups of ``group_values`` values, rotation, row reshapes."""

    group_values: int
    norm_mode: str

    def rotate(self, x: np.ndarray) -> np.ndarray:
        return rotate(x, self.group_values)

    def unrotate(self, y: np.ndarray) -> np.ndarray:
        return unrotate(y, self.group_values)

    def encode(self, x: np.ndarray) -> np.ndarray:
        x = self._float_rows(x)
        return self.encode_rotated(self.rotate(x))

    def decode(self, data: np.ndarray, d: int) -> np.ndarray:
        return self.unrotate(self.decode_rotated(data, d))

    def encode_rotated(self, y: np.ndarray) -> np.ndarray:
        y = self._float_rows(y)
        check_finite(self.name, y)
        n, d = y.shape
        blocks = self.encode_groups(y.reshape(-1, self.group_values))
        return blocks.reshape(n, self.row_bytes(d))

    def decode_rotated(self, data: np.ndarray, d: int) -> np.ndarray:
        data = self._byte_rows(data, d)
        n = data.shape[0]
        return self.decode_groups(data.reshape(-1, self.block_bytes)).reshape(n, d)

    def encode_groups(self, groups: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode_groups(self, blocks: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class TurboFormat(RotatedFormat):
    bits: int

    @property
    def levels(self) -> np.ndarray:
        return lloyd_max.float32_tables(self.bits)[0]

    @property
    def boundaries(self) -> np.ndarray:
        return lloyd_max.float32_tables(self.bits)[1]

    def codes_of(self, z: np.ndarray) -> np.ndarray:
        """Nearest-level codes of N(0,1)-unit coordinates: #{j : z > BOUNDS[j]}."""
        return np.searchsorted(self.boundaries, z, side="left").astype(np.int32)

    def encode_groups(self, groups: np.ndarray) -> np.ndarray:
        r, z = group_norm_and_z(groups)
        codes = self.codes_of(z)
        norms = stored_norm(r, z, self.levels[codes], self.norm_mode)
        return np.concatenate([norms.astype("<f2").view(np.uint8).reshape(-1, 2), pack_codes(codes, self.bits)], axis=1)

    def decode_groups(self, blocks: np.ndarray) -> np.ndarray:
        norms = np.ascontiguousarray(blocks[:, :2]).view("<f2").reshape(-1)
        codes = unpack_codes(blocks[:, 2:], self.bits, self.group_values)
        return reconstruct(norms, self.levels[codes])


def block_bytes_for(bits: int, group_values: int) -> int:
    return 2 + (group_values * bits + 7) // 8


def make_format(name: str, group_values: int, norm_mode: str = DEFAULT_NORM_MODE) -> TurboFormat:
    if name not in TURBO_BITS:
        raise KVFormatError(f"{name!r} is not a turbo format; choose one of {sorted(TURBO_BITS)}")
    check_group_values(group_values)
    bits = TURBO_BITS[name]
    return TurboFormat(
        name=name,
        block_values=group_values,
        block_bytes=block_bytes_for(bits, group_values),
        group_values=group_values,
        norm_mode=norm_mode,
        bits=bits,
    )
