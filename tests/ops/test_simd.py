"""The numba SIMD intrinsics (cupyllm/ops/simd.py) against NumPy: lane loads and stores, bit fields, reductions,
half-float conversion, the polynomial exp and the gathers."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from cupyllm.ops import simd


@njit
def _lanes(raw, x):
    """Every simd helper once, written to a float32 array [8 * 9] (+ one horizontal sum, + a broadcast load)."""
    out = np.empty(8 * 10 + 1, np.float32)
    u = simd.load_u8(raw, 3)
    i = simd.load_i8(raw, 3)
    simd.store_f32(out, 0, simd.to_f32(u))
    simd.store_f32(out, 8, simd.to_f32(i))
    simd.store_f32(out, 16, simd.to_f32(simd.ior(simd.iand(u, 15), simd.ishl(simd.ishr(u, 6), 4))))
    simd.store_f32(out, 24, simd.to_f32(simd.isub(u, i)))
    simd.store_f32(out, 32, simd.to_f32(simd.bit_lanes(np.uint32(0xA5F00F5A), 9, 16)))
    v = simd.load_f32(x, 1)
    simd.store_f32(out, 40, simd.fma(v, v, simd.splat(0.5)))
    simd.store_f32(out, 48, simd.fadd(simd.fmul(v, simd.splat(3)), simd.zeros()))
    simd.store_f32(out, 56, simd.to_f32(simd.iand(u, simd.load_u8(raw, 0))))
    simd.store_f32(out, 64, simd.to_f32(simd.ishr(u, simd.load_u8(raw, 20))))
    out[72] = simd.hsum(v)
    simd.store_f32(out, 73, simd.splat_at(x, 5))
    return out


def test_simd_lanes_match_numpy():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, 32, dtype=np.uint8)
    raw[20:28] = rng.integers(0, 8, 8)  # shift counts
    x = rng.standard_normal(16).astype(np.float32)
    out = _lanes(raw, x)
    u = raw[3:11].astype(np.int64)
    i = raw[3:11].view(np.int8).astype(np.int64)
    np.testing.assert_array_equal(out[0:8], u)
    np.testing.assert_array_equal(out[8:16], i)
    np.testing.assert_array_equal(out[16:24], (u & 15) | ((u >> 6) << 4))
    np.testing.assert_array_equal(out[24:32], u - i)
    np.testing.assert_array_equal(out[32:40], ((0xA5F00F5A >> np.arange(9, 17)) & 1) * 16)
    v = x[1:9]
    np.testing.assert_allclose(out[40:48], v * v + np.float32(0.5), rtol=1e-6)
    np.testing.assert_array_equal(out[48:56], v * np.float32(3))
    np.testing.assert_array_equal(out[56:64], u & raw[0:8])
    np.testing.assert_array_equal(out[64:72], u >> raw[20:28])
    np.testing.assert_allclose(out[72], v.astype(np.float64).sum(), rtol=1e-6)
    np.testing.assert_array_equal(out[73:81], np.full(8, x[5]))


@njit
def _word_lanes(raw, codes, x):
    """Every int16-lane helper once (as int32 [16 * 9 + 8]) and the float max helpers (float32 [8 * 3 + 1])."""
    out = np.empty(16 * 9 + 8, np.int32)
    words = np.empty(16, np.float32)
    u = simd.load_u8w(raw, 3)
    i = simd.load_i8w(raw, 3)
    c = simd.load_i16(codes, 2)
    stored = np.zeros(20, np.int16)
    simd.store_i16(stored, 3, simd.isub(u, i))  # int16 lanes stored as they are: back through load_i16
    lanes = (u, i, c, simd.ior(simd.iand(u, 15), simd.ishl(simd.ishr(u, 6), 4)), simd.load_i16(stored, 3),
             simd.bit_words(np.uint32(0xA5F00F5A), 9, 16), simd.iand(u, simd.load_u8w(raw, 0)),
             simd.ishr(u, simd.load_u8w(raw, 20)), simd.splat_pair(codes, 5))
    for j in range(9):  # int16 lanes out through madd against 1, 0 pairs: lane 2m -> int32 lane m
        even = simd.madd(simd.izeros(), lanes[j], simd.load_i16(codes, 40))
        odd = simd.madd(simd.izeros(), lanes[j], simd.load_i16(codes, 41))
        simd.store_f32(words, 0, simd.to_f32(even))
        simd.store_f32(words, 8, simd.to_f32(odd))
        for m in range(8):
            out[16 * j + 2 * m] = np.int32(words[m])
            out[16 * j + 2 * m + 1] = np.int32(words[8 + m])
    simd.store_f32(words, 0, simd.to_f32(simd.madd(simd.madd(simd.izeros(), i, c), u, c)))
    for m in range(8):
        out[144 + m] = np.int32(words[m])
    floats = np.empty(8 * 3 + 1, np.float32)
    v, w = simd.load_f32(x, 0), simd.load_f32(x, 8)
    simd.store_f32(floats, 0, simd.fabs(v))
    simd.store_f32(floats, 8, simd.fmax(v, w))
    simd.store_f32(floats, 16, simd.fmin(v, w))
    floats[24] = simd.hmax(v)
    return out, floats


def test_simd_word_lanes_match_numpy():
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, 40, dtype=np.uint8)
    raw[20:36] = rng.integers(0, 8, 16)  # shift counts
    codes = rng.integers(-32767, 32768, 64).astype(np.int16)
    codes[40:58] = np.tile([1, 0], 9)  # madd against these picks even lanes (at 40) or odd lanes (at 41)
    x = rng.standard_normal(16).astype(np.float32)
    out, floats = _word_lanes(raw, codes, x)
    u = raw[3:19].astype(np.int64)
    i = raw[3:19].view(np.int8).astype(np.int64)
    c = codes[2:18].astype(np.int64)
    expect = [u, i, c, (u & 15) | ((u >> 6) << 4), u - i, ((0xA5F00F5A >> np.arange(9, 25)) & 1) * 16, u & raw[0:16],
              u >> raw[20:36], np.tile(codes[5:7].astype(np.int64), 8)]
    for j, want in enumerate(expect):
        np.testing.assert_array_equal(out[16 * j:16 * j + 16], want, err_msg=f"lane helper {j}")
    np.testing.assert_array_equal(out[144:152], (i * c + u * c).reshape(8, 2).sum(1))
    v, w = x[:8], x[8:]
    np.testing.assert_array_equal(floats[0:8], np.abs(v))
    np.testing.assert_array_equal(floats[8:16], np.maximum(v, w))
    np.testing.assert_array_equal(floats[16:24], np.minimum(v, w))
    assert floats[24] == v.max()


@njit
def _wide_reductions(x, bits):
    """hsum of sixteen sixteen-lane vectors one at a time, then all sixteen by hsums_16 (stored where `bits`
    says, over a row of 3s); hmax and fmax of 16."""
    out = np.full(2 * 16 + 2, 3.0, np.float32)
    vs = (simd.load_f32_16(x, 0), simd.load_f32_16(x, 16), simd.load_f32_16(x, 32), simd.load_f32_16(x, 48))
    for t in range(16):
        out[t] = simd.hsum(simd.load_f32_16(x, 16 * t))
    ld = simd.load_f32_16
    sums = simd.hsums_16(ld(x, 0), ld(x, 16), ld(x, 32), ld(x, 48), ld(x, 64), ld(x, 80), ld(x, 96), ld(x, 112),
                         ld(x, 128), ld(x, 144), ld(x, 160), ld(x, 176), ld(x, 192), ld(x, 208), ld(x, 224),
                         ld(x, 240))
    simd.store_f32_where(out, 16, sums, bits)
    out[32] = simd.hmax(vs[1])
    out[33] = simd.hmax(simd.fmax(vs[2], vs[3]))
    return out


def test_sixteen_sums_at_once_are_hsums_bit_for_bit():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(256) * 10.0 ** rng.integers(-6, 6, 256)).astype(np.float32)  # sums that round
    bits = 0b1011_0000_1111_0111
    out = _wide_reductions(x, bits)
    stored = (bits >> np.arange(16)) & 1 == 1
    np.testing.assert_array_equal(out[16:32][stored], out[:16][stored])
    assert np.all(out[16:32][~stored] == 3.0)
    np.testing.assert_allclose(out[:16], x.reshape(16, 16).astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-4)
    assert out[32] == x[16:32].max() and out[33] == np.maximum(x[32:48], x[48:64]).max()


@njit
def _wide_lanes(raw, x, pick):
    """The 32-lane helpers of the wide GEMV once each: int16 lanes out through madd against `pick` (1, 0 pairs:
    lane 2m -> int32 lane m, then the odd lanes), float lanes stored as they are."""
    u = simd.load_u8w(raw, 3)
    lanes = (simd.load_i8w_32(raw, 1), simd.join_32(simd.iand(u, 15), simd.ishr(u, 4)),
             simd.bit_words_32(np.uint32(0xA5F00F5A), 16), simd.load_u8w_32(raw, 2))
    out = np.empty(32 * len(lanes) + 16 * 2, np.float32)
    for j in range(len(lanes)):
        simd.store_f32(out, 32 * j, simd.to_f32(simd.madd(simd.izeros_16(), lanes[j], simd.load_i16_32(pick, 0))))
        simd.store_f32(out, 32 * j + 16, simd.to_f32(simd.madd(simd.izeros_16(), lanes[j], simd.load_i16_32(pick, 1))))
    simd.store_f32(out, 128, simd.lane_pair_splat_16(simd.load_f32(x, 0), 5))
    simd.store_f32(out, 144, simd.fadd(simd.splat_16(x[9]), simd.zeros_16()))
    return out


def test_simd_wide_lanes_match_numpy():
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, 40, dtype=np.uint8)
    x = rng.standard_normal(16).astype(np.float32)
    pick = np.tile(np.array([1, 0], np.int16), 17)
    out = _wide_lanes(raw, x, pick)
    u = raw[3:19].astype(np.int64)
    expect = [raw[1:33].view(np.int8), np.concatenate([u & 15, u >> 4]), ((0xA5F00F5A >> np.arange(32)) & 1) * 16,
              raw[2:34]]
    for j, want in enumerate(expect):
        got = np.empty(32)
        got[0::2], got[1::2] = out[32 * j:32 * j + 16], out[32 * j + 16:32 * j + 32]
        np.testing.assert_array_equal(got, np.asarray(want, np.int64), err_msg=f"wide lane helper {j}")
    np.testing.assert_array_equal(out[128:144], np.repeat(x[5:7], 8))
    np.testing.assert_array_equal(out[144:160], np.full(16, x[9]))


@njit
def _row_lanes(raw, table, table16):
    """The sixteen-lane helpers of the KV row decoder (ops/kv_formats/cpu.py) once each, as float32 lanes."""
    out = np.empty(16 * 8, np.float32)
    simd.store_f32(out, 0, simd.load_f16_16(raw, 1))
    simd.store_f32(out, 16, simd.load_bf16_16(raw, 3))
    simd.store_f32(out, 32, simd.to_f32(simd.isub(simd.iand(simd.load_u8_16(raw, 2), 15), 8)))
    simd.store_f32(out, 48, simd.to_f32(simd.load_i8_16(raw, 5)))
    simd.store_f32(out, 64, simd.to_f32(simd.bit_lanes_16(np.uint32(0xA5F00F5A), 9, 16)))
    indices = simd.bit_fields_16(simd.load_u64(raw, 7), 3, 7)
    simd.store_f32(out, 80, simd.to_f32(indices))
    simd.store_f32(out, 96, simd.gather_16(simd.borrow(table), simd.bit_fields_16(simd.load_u64(raw, 9), 4, 511)))
    simd.store_f32(out, 112, simd.lookup_16(simd.load_f32_16(table16, 0), indices))
    return out, (simd.load_u16(raw, 3), simd.load_u32(raw, 5), simd.load_u64(raw, 9))


def test_simd_row_lanes_match_numpy():
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, 48, dtype=np.uint8)
    raw[1:3] = [0x01, 0x7C]  # a signalling NaN half: its payload kept, as NumPy's astype keeps it
    table, table16 = rng.standard_normal(512).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    out, scalars = _row_lanes(raw, table, table16)
    np.testing.assert_array_equal(out[:16].view(np.uint32), raw[1:33].view(np.float16).astype(np.float32).view(np.uint32))
    np.testing.assert_array_equal(out[16:32].view(np.uint32), raw[3:35].view(np.uint16).astype(np.uint32) << 16)
    np.testing.assert_array_equal(out[32:48], (raw[2:18] & 15).astype(np.float32) - 8)
    np.testing.assert_array_equal(out[48:64], raw[5:21].view(np.int8))
    np.testing.assert_array_equal(out[64:80], ((0xA5F00F5A >> np.arange(9, 25)) & 1) * 16)
    word = int(raw[7:15].view("<u8")[0])
    fields = np.array([(word >> (3 * i)) & 7 for i in range(16)])
    np.testing.assert_array_equal(out[80:96], fields)
    word = int(raw[9:17].view("<u8")[0])
    np.testing.assert_array_equal(out[96:112], table[[(word >> (4 * i)) & 511 for i in range(16)]])
    np.testing.assert_array_equal(out[112:128], table16[fields])
    assert [int(v) for v in scalars] == [int(raw[3:5].view("<u2")[0]), int(raw[5:9].view("<u4")[0]), word]


def test_every_half_converts_as_numpy():
    """load_f16_16 on all 65,536 fp16 bit patterns: NumPy's float32, bit for bit (zeros, subnormals, inf, NaNs)."""
    halves = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(1 << 16, np.float32)
    _halves(halves.view(np.uint8), got)
    np.testing.assert_array_equal(got.view(np.uint32), halves.view(np.float16).astype(np.float32).view(np.uint32))


@njit
def _halves(raw, out):
    for i in range(0, out.size, 16):
        simd.store_f32(out, i, simd.load_f16_16(raw, 2 * i))


@njit
def _exp_lanes(x, out):
    for i in range(0, x.shape[0], 16):
        simd.store_f32(out, i, simd.fexp(simd.load_f32_16(x, i)))
        simd.store_f32(out, i + 8, simd.fexp(simd.load_f32(x, i + 8)))  # (the 8-lane form on the upper half)


def test_fexp_matches_exp():
    """simd.fexp against float64 exp: within 2e-7 relative where e^x is a normal float32, 0 below (-inf
    included: a softmax's masked scores), NaN kept; both widths."""
    x = np.concatenate([np.linspace(-100, 88, 40000), [-np.inf, np.nan, 0.0, -0.0, simd.EXP_SMALLEST_X - 1e-3]])
    x = np.concatenate([x, np.zeros(-len(x) % 16)]).astype(np.float32)
    got = np.empty_like(x)
    _exp_lanes(x, got)
    normal = x >= simd.EXP_SMALLEST_X
    want = np.exp(x[normal].astype(np.float64))
    assert np.max(np.abs(got[normal] - want) / want) <= 2e-7
    assert np.all(got[(x < simd.EXP_SMALLEST_X)] == 0) and np.isnan(got[np.isnan(x)]).all()


def test_gather_from_integer_addresses(monkeypatch):
    """gather_16 as an older llvmlite (no vector GEP) compiles it: the same lanes."""
    monkeypatch.setattr(simd, "_VECTOR_GEP", False)

    @njit(cache=False)
    def gather(table, raw):
        out = np.empty(16, np.float32)
        simd.store_f32(out, 0, simd.gather_16(table, simd.bit_fields_16(simd.load_u64(raw, 0), 4, 511)))
        return out

    table = np.random.default_rng(4).standard_normal(512).astype(np.float32)
    raw = (np.arange(8) * 37).astype(np.uint8)
    word = int(raw.view("<u8")[0])
    np.testing.assert_array_equal(gather(table, raw), table[[(word >> (4 * i)) & 511 for i in range(16)]])


def _byte_lanes(raw, a, b, acc):
    """The byte-lane helpers of the VNNI GEMV: dpbusd of a (unsigned) and b (signed) bytes onto acc, the nibbles
    and fifth bits of raw's first 32 bytes through dpbusd against ones (byte lane 4i + j alone: j-th one-hot)."""
    out = np.empty(16 * 9, np.float32)
    ones = np.zeros((4, 64), np.uint8)
    for j in range(4):
        ones[j, j::4] = 1
    sums = simd.dpbusd(simd.load_bytes_64(acc.view(np.uint8), 0), simd.load_bytes_64(a, 0), simd.load_bytes_64(b, 0))
    simd.store_f32(out, 0, simd.to_f32(sums))
    nibbles = simd.ior(simd.load_nibbles_64(raw, 0), simd.fifth_bits_64(raw, 32, 3))
    for j in range(4):  # (nibbles unsigned in a, the one-hot ones signed in b)
        picked = simd.dpbusd(simd.izeros_16(), nibbles, simd.load_bytes_64(ones[j], 0))
        simd.store_f32(out, 16 + 16 * j, simd.to_f32(picked))
        picked = simd.dpbusd(simd.izeros_16(), simd.load_bytes_64(ones[j], 0), simd.fifth_bits_64(raw, 32, 6))
        simd.store_f32(out, 80 + 16 * j, simd.to_f32(picked))
    return out


@pytest.mark.parametrize("vnni", [False] + [True] * simd.MACHINE_HAS_VNNI, ids=lambda v: "vnni" if v else "plain")
def test_byte_lanes_match_numpy(vnni, monkeypatch):
    """dpbusd sums four unsigned-by-signed byte products a lane (the VNNI instruction where the machine has it,
    plain vector code elsewhere: both compiled here where the machine has it); load_nibbles_64 / fifth_bits_64
    lay out a Q4_K / Q5_K pair of sub-blocks."""
    monkeypatch.setattr(simd, "MACHINE_HAS_VNNI", vnni)  # (read as the intrinsics generate code)
    byte_lanes = njit(_byte_lanes)  # compiled under the patched flag
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, 64, dtype=np.uint8)
    a = rng.integers(0, 256, 64, dtype=np.uint8)
    b = rng.integers(0, 256, 64, dtype=np.uint8)
    acc = rng.integers(-1000, 1000, 16).astype(np.int32)
    out = byte_lanes(raw, a, b, acc)
    products = a.astype(np.int64) * b.view(np.int8).astype(np.int64)
    np.testing.assert_array_equal(out[:16], acc + products.reshape(16, 4).sum(1))
    q, qh = raw[:32], raw[32:]
    nibbles = np.concatenate([q & 15, q >> 4]) | np.concatenate([(qh >> 3) & 1, (qh >> 4) & 1]) << 4
    fifth = np.concatenate([(qh >> 6) & 1, (qh >> 7) & 1]) << 4
    for j in range(4):
        np.testing.assert_array_equal(out[16 + 16 * j:32 + 16 * j], nibbles[j::4])
        np.testing.assert_array_equal(out[80 + 16 * j:96 + 16 * j], fifth[j::4])
