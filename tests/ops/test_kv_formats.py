"""KV storage formats: layouts against independent references (gguf.quants, per-element C transliterations,
explicit Hadamard matrices, big-integer bitstreams, brute force), error statistics against Lloyd-Max theory."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from cupyllm.kv import KVFormatError, bits_per_value_for, get_format, group_format, list_formats
from cupyllm.ops.kv_formats import lloyd_max, tcq, turbo

F32 = np.float32
ROTATED = ["turbo4", "turbo3", "turbo2", "turbo3_tcq", "turbo2_tcq"]


def _scalar_test_rows(rng: np.random.Generator) -> np.ndarray:
    """[n, 256]: Gaussian rows at many scales plus blocks aimed at the rounding / clamping edges."""
    x = (rng.standard_normal((40, 256)) * rng.uniform(1e-3, 50.0, (40, 1))).astype(F32)
    edge = np.zeros((8, 256), F32)
    j = np.arange(32, dtype=F32)
    blocks = [
        np.zeros(32, F32),  # all zero: d == 0 path
        np.full(32, 3.0, F32),  # constant block
        j - 16,  # every 5-bit level
        j - 32 + 0.5 * (j % 2),  # ties of the +n.5 truncation
        (j % 5 + 0.5) * np.where(j % 2, -1, 1).astype(F32),  # roundf halves (q8_0 with amax 127 below)
        np.where(j % 2, F32(1000.0), F32(-1000.0)),  # +-amax
        np.r_[np.full(31, 1e-3, F32), F32(1e4)],  # one outlier
        rng.uniform(-1, 1, 32).astype(F32) * 1e-20,  # tiny but normal scales
    ]
    blocks[4][-1] = 127.0
    edge[:, :32] = np.stack(blocks)
    for r in range(8):  # the rest of each edge row: the same blocks rotated
        edge[r, 32:] = np.concatenate([blocks[(r + i) % 8] for i in range(1, 8)])
    return np.concatenate([x, edge])


GGUF_TYPES = {"q8_0": GT.Q8_0, "q5_1": GT.Q5_1, "q5_0": GT.Q5_0, "q4_1": GT.Q4_1, "q4_0": GT.Q4_0, "bf16": GT.BF16}


@pytest.mark.parametrize("name", sorted(GGUF_TYPES))
def test_scalar_formats_bit_exact_against_gguf(name):
    x = _scalar_test_rows(np.random.default_rng(1))
    fmt = get_format(name)
    ours = fmt.encode(x)
    ref = gguf_quantize(x, GGUF_TYPES[name]).view(np.uint8).reshape(ours.shape)
    assert np.array_equal(ours, ref)
    dec = fmt.decode(ours, x.shape[1])
    ref_dec = gguf_dequantize(ref, GGUF_TYPES[name]).astype(F32)
    assert np.array_equal(dec.view(np.uint32), ref_dec.view(np.uint32))


def test_float_formats_exact():
    x = _scalar_test_rows(np.random.default_rng(2))
    f32 = get_format("f32")
    assert np.array_equal(f32.decode(f32.encode(x), 256).view(np.uint32), x.view(np.uint32))
    f16 = get_format("f16")
    assert np.array_equal(f16.encode(x).view("<f2"), x.astype(np.float16))
    assert np.array_equal(f16.decode(f16.encode(x), 256), x.astype(np.float16).astype(F32))


def _q6_0_block_reference(xb: np.ndarray) -> bytes:
    """Per-element transliteration of ik_llama.cpp quantize_f32_q6_0_block (cpy-utils.cuh)."""
    amax, vmax = F32(0), F32(0)
    for v in xb:
        if amax < abs(v):
            amax, vmax = abs(v), v
    d = F32(vmax / F32(-32))
    inv = F32(F32(1) / d) if d != 0 else F32(0)
    qs, qh = [0] * 16, [0] * 8
    for j in range(16):
        x0 = F32(xb[j] * inv)
        x1 = F32(xb[j + 16] * inv)
        q0 = min(63, int(F32(x0 + F32(32.5))))  # int() truncates toward zero like (int8_t)
        q1 = min(63, int(F32(x1 + F32(32.5))))
        qs[j] = (q0 & 0xF) | ((q1 & 0xF) << 4)
        h = (q0 >> 4) | ((q1 >> 4) << 2)
        qh[j % 8] |= h << (4 * (j // 8))
    return np.float16(d).tobytes() + bytes(qh) + bytes(qs)


def _q6_0_dequant_reference(block: bytes) -> np.ndarray:
    """Per-element transliteration of ik_llama.cpp dequantize_row_q6_0."""
    d = F32(np.frombuffer(block[:2], "<f2")[0])
    qh, qs = block[2:10], block[10:26]
    out = np.zeros(32, F32)
    for j in range(16):
        h = qh[j % 8] >> (4 * (j // 8))
        out[j] = F32((((qs[j] & 0xF) | ((h << 4) & 0x30)) - 32) * d)
        out[j + 16] = F32((((qs[j] >> 4) | ((h << 2) & 0x30)) - 32) * d)
    return out


def test_q6_0_against_per_element_reference():
    x = _scalar_test_rows(np.random.default_rng(3))[::3]
    fmt = get_format("q6_0")
    assert fmt.block_bytes == 26 and fmt.bits_per_value == 6.5
    ours = fmt.encode(x)
    dec = fmt.decode(ours, x.shape[1])
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            ref = _q6_0_block_reference(x[r, 32 * b : 32 * b + 32])
            assert ours[r, 26 * b : 26 * b + 26].tobytes() == ref, (r, b)
            assert np.array_equal(dec[r, 32 * b : 32 * b + 32], _q6_0_dequant_reference(ref))


@pytest.mark.parametrize("name", list_formats())
@pytest.mark.parametrize("head_dim", [64, 256])
def test_round_trip_shapes(name, head_dim):
    fmt = get_format(name, head_dim=head_dim)
    x = np.random.default_rng(4).standard_normal((3, 2 * head_dim)).astype(F32)
    data = fmt.encode(x)
    assert data.dtype == np.uint8
    assert data.shape == (3, 2 * head_dim // fmt.block_values * fmt.block_bytes)
    y = fmt.decode(data, 2 * head_dim)
    assert y.dtype == F32 and y.shape == x.shape
    assert np.mean((y - x) ** 2) < 0.2  # every format keeps most of the signal
    assert fmt.encode(x[:0]).shape == (0, data.shape[1])


def test_sizes_and_bits_per_value():
    want_128 = {"turbo4": 66, "turbo3": 50, "turbo2": 34, "turbo3_tcq": 52, "turbo2_tcq": 36}
    want_64 = {"turbo4": 34, "turbo3": 26, "turbo2": 18, "turbo3_tcq": 28, "turbo2_tcq": 20}
    for name in ROTATED:
        assert get_format(name).block_bytes == want_128[name]
        assert get_format(name, head_dim=256).block_values == 128
        fmt64 = group_format(name, 64)
        assert fmt64 is get_format(name, head_dim=64)
        assert (fmt64.block_values, fmt64.block_bytes) == (64, want_64[name])
        assert bits_per_value_for(name, 64) == want_64[name] * 8 / 64
        assert bits_per_value_for(name, 128) == want_128[name] * 8 / 128
        assert get_format(name).block_bytes % (4 if name.endswith("_tcq") else 1) == 0
    scalar = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q6_0": 6.5, "q5_1": 6, "q5_0": 5.5, "q4_1": 5, "q4_0": 4.5}
    for name, bpv in scalar.items():
        assert bits_per_value_for(name, 64) == bpv


def test_bad_input_raises_kvformaterror():
    with pytest.raises(KVFormatError, match="unknown KV format"):
        get_format("q3_7")
    with pytest.raises(KVFormatError):
        get_format("q8_0").encode(np.zeros((2, 40), F32))
    with pytest.raises(KVFormatError):
        get_format("q8_0").encode(np.zeros(64, F32))
    with pytest.raises(KVFormatError):
        get_format("turbo3").decode(np.zeros((1, 49), np.uint8), 128)
    with pytest.raises(KVFormatError):
        get_format("turbo3", head_dim=96)  # a 96-value group is not a power of two
    with pytest.raises(KVFormatError, match="NaN"):
        get_format("turbo2").encode(np.full((1, 128), np.nan, F32))


# -- rotation ------------------------------------------------------------------------------------------


def _explicit_rotation(g: int) -> np.ndarray:
    """R with rotate(x) = x @ R.T, from the definitions: Sylvester H[i, j] = (-1)^popcount(i & j) and the
    sign bits of the 128-bit golden-ratio constant."""
    golden = 0x9E3779B97F4A7C15F39CC0605CEDC834
    words = [(golden >> (96 - 32 * w)) & 0xFFFFFFFF for w in range(4)]
    signs = np.array([-1.0 if (words[i // 32] >> (i % 32)) & 1 else 1.0 for i in range(g)])
    h = np.array([[(-1.0) ** bin(i & j).count("1") for j in range(g)] for i in range(g)])
    return h * signs[None, :] / np.sqrt(g)


@pytest.mark.parametrize("g", [4, 64, 128])
def test_rotation_matches_definition_and_is_orthogonal(g):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 2 * g)).astype(F32)
    r = _explicit_rotation(g)
    y = turbo.rotate(x, g)
    ref = (x.reshape(-1, g).astype(np.float64) @ r.T).reshape(x.shape)
    assert np.allclose(y, ref, atol=1e-5)
    assert np.abs(turbo.unrotate(y, g) - x).max() < 1e-6 * max(1.0, np.abs(x).max())
    eye = turbo.rotate(np.eye(g, dtype=F32), g)  # rows: rotated basis vectors
    assert np.abs(eye @ eye.T - np.eye(g)).max() < 1e-6


# -- Lloyd-Max and turbo ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,theory", [(1, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)])
def test_lloyd_max_matches_classical_values(bits, theory):
    q = lloyd_max.gaussian_lloyd_max(bits)
    assert abs(q.mse - theory) / theory < 1e-3
    # centroid condition by numerical integration of the density, independent of the closed forms
    t = np.linspace(-12, 12, 400_001)
    pdf = np.exp(-0.5 * t * t) / np.sqrt(2 * np.pi)
    cell = np.searchsorted(q.boundaries, t)
    for i, c in enumerate(q.levels):
        w = pdf * (cell == i)
        assert abs(np.sum(w * t) / np.sum(w) - c) < 1e-4


def test_turbo_docstring_tables_match_computed_levels():
    for bits in (4, 3, 2):
        m = re.search(rf"TURBO{bits}_LEVELS = \{{([^}}]*)\}}", turbo.__doc__)
        documented = np.array([float(v) for v in m.group(1).replace("\n", " ").split(",")], dtype=F32)
        assert np.array_equal(documented, lloyd_max.float32_tables(bits)[0])


def _gaussian(n_rows: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_rows, d)).astype(F32)


@pytest.mark.parametrize("name,bits", [("turbo4", 4), ("turbo3", 3), ("turbo2", 2)])
@pytest.mark.parametrize("g", [128, 64])
def test_turbo_mse_near_lloyd_max(name, bits, g):
    x = _gaussian(1024, 256, seed=bits * g)
    theory = lloyd_max.gaussian_lloyd_max(bits).mse
    raw = turbo.make_format(name, g, norm_mode="raw")
    mse_raw = float(np.mean((raw.decode(raw.encode(x), 256) - x) ** 2))
    fmt = group_format(name, g)
    mse = float(np.mean((fmt.decode(fmt.encode(x), 256) - x) ** 2))
    # raw norm: the Lloyd-Max MSE up to the unit-sphere coordinate law (slightly lighter tails than N(0,1))
    assert abs(mse_raw / theory - 1) < (0.05 if g == 128 else 0.08)
    assert abs(mse / theory - 1) < (0.08 if g == 128 else 0.12)


def test_turbo_norm_modes():
    x = _gaussian(1024, 256, seed=11)
    for name in ("turbo3", "turbo2", "turbo2_tcq"):
        mse = {}
        for mode in turbo.NORM_MODES:
            if name.endswith("_tcq"):
                fmt = tcq.make_format(name, 128, norm_mode=mode)
            else:
                fmt = turbo.make_format(name, 128, norm_mode=mode)
            mse[mode] = float(np.mean((fmt.decode(fmt.encode(x), 256) - x) ** 2))
        assert mse["lsq"] < mse["raw"] and mse["lsq"] < mse["corrected"], (name, mse)
    assert turbo.DEFAULT_NORM_MODE == "lsq"


@pytest.mark.parametrize("name", ["turbo4", "turbo3", "turbo2"])
@pytest.mark.parametrize("g", [128, 64])
def test_turbo_block_layout(name, g):
    """Codes, bitstream and norm rebuilt from the definitions with Python integers and argmin."""
    fmt = group_format(name, g)
    bits = fmt.bits
    x = _gaussian(8, g, seed=g + bits)
    y = fmt.rotate(x)
    blocks = fmt.encode_rotated(y)
    assert np.array_equal(blocks, fmt.encode(x))
    levels = lloyd_max.gaussian_lloyd_max(bits).levels
    for i in range(x.shape[0]):
        block = blocks[i].tobytes()
        stream = int.from_bytes(block[2:], "little")
        codes = np.array([(stream >> (t * bits)) & ((1 << bits) - 1) for t in range(g)])
        unit = y[i].astype(np.float64) / np.linalg.norm(y[i].astype(np.float64))
        nearest = np.argmin(np.abs(unit[:, None] * np.sqrt(g) - levels[None, :]), axis=1)
        assert np.array_equal(codes, nearest)
        c = levels[codes]
        lsq_norm = np.linalg.norm(y[i]) * np.dot(unit * np.sqrt(g), c) / np.dot(c, c)
        stored = float(np.frombuffer(block[:2], "<f2")[0])
        assert abs(stored - lsq_norm) <= 1e-3 * lsq_norm
        assert len(block) == 2 + g * bits // 8
    dec = fmt.decode_rotated(blocks, g)
    norms = blocks[:, :2].copy().view("<f2").astype(F32)
    codes_all = turbo.unpack_codes(blocks[:, 2:], bits, g)
    want = (norms * turbo.inv_sqrt_g(g)) * fmt.levels[codes_all]
    assert np.array_equal(dec, want)
    assert np.array_equal(fmt.decode(blocks, g), fmt.unrotate(dec))


def test_zero_group_decodes_to_zero():
    for name in ROTATED:
        fmt = get_format(name)
        x = np.zeros((2, 256), F32)
        x[1, 128:] = 1.0
        y = fmt.decode(fmt.encode(x), 256)
        assert np.all(y[0] == 0) and np.all(y[1, :128] == 0)


# -- TCQ -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k,L,g", [(3, 9, 16), (2, 8, 32), (2, 4, 8), (1, 3, 12)])
def test_tcq_numba_viterbi_equals_numpy_reference(k, L, g):
    rng = np.random.default_rng(k * 100 + L)
    cb = rng.standard_normal(1 << L).astype(F32)
    z = rng.standard_normal((12, g)).astype(F32)
    s_ref, c_ref = tcq.viterbi_states_reference(z, cb, k, L)
    s_nb, c_nb = tcq.viterbi_states(z, cb, k, L)
    assert np.array_equal(s_ref, s_nb) and np.array_equal(c_ref, c_nb)
    assert tcq.path_is_valid(s_ref, k, L)
    # exact ties everywhere: coarse grids make many equal path costs, so the tie-break rules decide
    cb_t = np.round(cb * 2) / 2
    z_t = (np.round(z * 4) / 4).astype(F32)
    s_ref, c_ref = tcq.viterbi_states_reference(z_t, cb_t, k, L)
    s_nb, c_nb = tcq.viterbi_states(z_t, cb_t, k, L)
    assert np.array_equal(s_ref, s_nb) and np.array_equal(c_ref, c_nb)


def test_tcq_viterbi_cost_is_brute_force_minimum():
    """The search finds the stream of least integer metric (tcq.path_cost) over all streams, and that stream's
    float squared error is within the metric's rounding of the float optimum's."""
    rng = np.random.default_rng(21)
    for k, L, g in [(1, 3, 4), (2, 4, 4), (1, 4, 5), (1, 3, 18)]:
        cb = rng.standard_normal(1 << L).astype(F32)
        z = rng.standard_normal((5, g)).astype(F32)
        states, costs = tcq.viterbi_states(z, cb, k, L)
        n_bits = g * k + L - k
        streams = np.arange(1 << n_bits)
        all_states = ((streams[:, None] >> (np.arange(g) * k)) & ((1 << L) - 1)).astype(np.int32)
        for i in range(z.shape[0]):
            all_costs = tcq.path_cost(np.broadcast_to(z[i], (len(streams), g)), cb, k, all_states)
            assert costs[i] == all_costs.min() == tcq.path_cost(z[i:i + 1], cb, k, states[i:i + 1])[0]
            float_errors = np.sum((z[i].astype(np.float64) - cb[all_states]) ** 2, axis=1)
            path_error = float(np.sum((z[i].astype(np.float64) - cb[states[i]]) ** 2))
            assert path_error <= float_errors.min() + 1e-3 * g


def test_tcq_renormalisation_changes_no_path():
    """Subtracting best_{t-1}(0) every RENORM_STEPS steps is invisible: the same paths and total costs as a
    search that never renormalises (int64, where nothing can overflow)."""
    rng = np.random.default_rng(4)
    cb = tcq.load_codebook("turbo3_tcq")
    z = rng.standard_normal((16, 128)).astype(F32)
    states, costs = tcq.viterbi_states_reference(z, cb, 3, 9)
    plain_states, plain_costs = tcq.viterbi_states_reference(z, cb, 3, 9, renorm_steps=None)
    assert np.array_equal(states, plain_states) and np.array_equal(costs, plain_costs)


@pytest.mark.parametrize("name", ["turbo3_tcq", "turbo2_tcq"])
@pytest.mark.parametrize("g", [128, 64, 32])
def test_tcq_metric_stays_within_int32_on_extreme_groups(name, g):
    """The groups that push the packed costs hardest: all of a unit-norm group in one coordinate (|z| = sqrt(G),
    X at its clamp), every coordinate at +-sqrt(G) (not unit-norm: what an underflowed norm could give), inf and
    NaN. The NumPy reference asserts the int32 bound at every step; numba (int32 stores) must agree with it."""
    fmt = group_format(name, g)
    root = np.float32(np.sqrt(g))
    one_hot = np.zeros((4, g), F32)
    one_hot[np.arange(4), [0, 1, g // 2, g - 1]] = [root, -root, root, -root]
    alternating = np.where(np.arange(g) % 2 == 0, root, -root).astype(F32)[None] * np.array([[1], [-1]], F32)
    constant = np.full((2, g), root, F32) * np.array([[1], [-1]], F32)
    odd = np.zeros((2, g), F32)
    odd[0, ::3], odd[1, 5] = np.inf, np.nan
    z = np.concatenate([one_hot, alternating, constant, odd])
    s_ref, c_ref = tcq.viterbi_states_reference(z, fmt.codebook, fmt.k, fmt.L)
    s_nb, c_nb = tcq.viterbi_states(z, fmt.codebook, fmt.k, fmt.L)
    assert np.array_equal(s_ref, s_nb) and np.array_equal(c_ref, c_nb)
    assert np.array_equal(c_ref, tcq.path_cost(z, fmt.codebook, fmt.k, s_ref))


@pytest.mark.parametrize("name", ["turbo3_tcq", "turbo2_tcq"])
@pytest.mark.parametrize("g", [128, 64])
def test_tcq_block_layout_and_state_definition(name, g):
    fmt = group_format(name, g)
    k, L = fmt.k, fmt.L
    x = _gaussian(6, 2 * g, seed=3)
    blocks = fmt.encode(x).reshape(-1, fmt.block_bytes)
    _, z = turbo.group_norm_and_z(fmt.rotate(x).reshape(-1, g))
    states, _ = tcq.viterbi_states(z, fmt.codebook, k, L)
    n_bits = g * k + L - k
    for i, block in enumerate(blocks):
        raw = block.tobytes()
        stream = int.from_bytes(raw[2:], "little")
        assert stream >> n_bits == 0  # zero padding after the stream
        decoded_states = [(stream >> (t * k)) & ((1 << L) - 1) for t in range(g)]
        assert decoded_states == states[i].tolist()
    # random streams decode by the state definition, value by value
    rng = np.random.default_rng(9)
    rand = rng.integers(0, 256, (4, fmt.block_bytes), dtype=np.uint8)
    rand[:, :2] = np.frombuffer(np.float16(1.5).tobytes() * 4, np.uint8).reshape(4, 2)
    dec = fmt.decode_rotated(rand, g)
    for i in range(4):
        stream = int.from_bytes(rand[i, 2:].tobytes(), "little")
        want = [F32(F32(1.5) * turbo.inv_sqrt_g(g)) * fmt.codebook[(stream >> (t * k)) & ((1 << L) - 1)] for t in range(g)]
        assert np.array_equal(dec[i], np.array(want, F32))


def test_tcq_beats_turbo_at_the_same_bits():
    x = _gaussian(256, 256, seed=17)
    mse = {}
    for name in ("turbo3", "turbo2", "turbo3_tcq", "turbo2_tcq"):
        fmt = get_format(name)
        mse[name] = float(np.mean((fmt.decode(fmt.encode(x), 256) - x) ** 2))
    assert mse["turbo3_tcq"] < 0.7 * mse["turbo3"], mse
    assert mse["turbo2_tcq"] < 0.7 * mse["turbo2"], mse
    assert mse["turbo2_tcq"] < 0.08, mse


def test_tcq_codebooks_are_package_data():
    for name, (k, L) in tcq.TCQ_PARAMS.items():
        cb = tcq.load_codebook(name)
        assert cb.dtype == F32 and cb.shape == (1 << L,)
        assert np.isfinite(cb).all() and abs(float(np.mean(cb))) < 0.1 and 0.7 < float(np.std(cb)) < 1.3


def _trainer():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "train_tcq_codebook.py"
    spec = importlib.util.spec_from_file_location("train_tcq_codebook", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_training_step_lowers_distortion():
    """One Lloyd step of tools/train_tcq_codebook.py on a fresh start never raises the training MSE."""
    mod = _trainer()
    z = mod.to_unit_z(mod.gaussian_groups(64, 32, seed=0))
    cb = tcq.initial_codebook(8, seed=0)
    before, states = mod.distortion(z, cb, 2, 8)
    after, _ = mod.distortion(z, mod.centroid_update(z, states, cb), 2, 8)
    assert after <= before + 1e-7


def test_training_a_trellis_no_format_has():
    """train(trellis=(k, L)) (tools/tcq_trellis_sizes.py): a 32-state, 2-bit trellis trained briefly on Gaussian
    groups beats the scalar 2-bit Lloyd-Max quantizer on held-out groups, as TCQ must."""
    from cupyllm.ops.kv_formats import lloyd_max

    mod = _trainer()
    z_train = [mod.to_unit_z(mod.gaussian_groups(512, 64, seed=1))]
    z_val = [mod.to_unit_z(mod.gaussian_groups(256, 64, seed=2))]
    cb, val_mse = mod.train("k2_L5", z_train, z_val, iters=6, seeds=[0], relax=2.5, val_every=3, trellis=(2, 5))
    assert cb.shape == (32,) and "k2_L5" not in tcq.TCQ_PARAMS
    assert val_mse == pytest.approx(mod.distortion(z_val[0], cb, 2, 5)[0], rel=1e-6)
    assert val_mse < 0.95 * lloyd_max.gaussian_lloyd_max(2).mse


def test_list_formats_all_constructible():
    names = list_formats()
    assert len(names) == len(set(names)) == 14
    for name, hd in itertools.product(names, (64, 128, 256)):
        assert get_format(name, head_dim=hd).name == name
