"""GPU flash attention (kernels_cu/attention/fa_vec.cu, fa_mma.cu, fa_combine.cu) against the NumPy reference.

Every case encodes random K/V rows with the NumPy KV formats (cupyllm/kv), runs the kernel over the encoded
cache, and compares (O, LSE) with ``cupyllm.ops.attention.reference.attend`` over the NumPy-decoded rows:

* FA-VEC computes in f32 from the exact decoded values: tight tolerances;
* MMA rounds Q (scaled, rotated for rotated K formats), K and V to f16 before the tensor cores and P to f16
  after the softmax: compared with the reference on the same f16-rounded Q, K, V, so only P's rounding and
  the summation order remain.

The (head dim x K format x V format) product is sampled: for every head dim each format appears once as K
and once as V (same-format, asymmetric and rotated pairs), and the mask cases (causal, sliding window on a
ring, softcap, additive mask, empty/fully-masked rows, unused slots) rotate through the pairs. Split-KV is
checked by comparing different splits and by merging two half-caches with reference.merge.

Skipped without a CUDA device; ``CUPYLLM_EMULATE=1`` runs it on the CPU emulator (tests/support/cuda_emu), where
tests/test_emulated_kernels.py runs a subset in CI.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

from gpu_helpers import (GPU_TEST_MARKS, MMA_TOL_LSE, MMA_TOL_O, VEC_TOL, backend, cp,  # noqa: F401 (fixtures)
                         emulated, get_test_format, layer_pair, mma_lacks_shared_memory, rounded_f16,
                         rounded_f16_query)
from test_attention import dense

pytestmark = GPU_TEST_MARKS

HEAD_DIMS = (64, 128, 256, 512)
MASK_CASES = ("causal", "window_ring", "softcap", "additive", "empty_rows", "unused_slots")


def _formats():
    from cupyllm.ops.kv_formats.formats import list_formats
    return list_formats()


def _pairs(head_dim: int) -> list[tuple[str, str]]:
    """Each format once as K and once as V: same-format pairs for one head dim, shifted pairs for the rest."""
    names = _formats()
    shift = {64: 0, 128: 5, 256: 9, 512: 3}[head_dim]
    return [(k, names[(i + shift) % len(names)]) for i, k in enumerate(names)]


CASES = [(d, k, v, MASK_CASES[i % len(MASK_CASES)]) for d in HEAD_DIMS for i, (k, v) in enumerate(_pairs(d))]


@pytest.fixture(scope="module")
def runner():
    from cupyllm.ops.attention.gpu_dispatch import GpuAttention
    return GpuAttention()


class Layer(types.SimpleNamespace):
    """A LayerKV-like cache on the device plus the NumPy-decoded rows the reference attends over."""


def make_layer(rng, k_name: str, v_name: str, head_dim: int, n_kv: int, n_slots: int, *, ring: bool = False,
               n_used: int | None = None, positions: np.ndarray | None = None) -> Layer:
    import cupy as cp
    kf, vf = get_test_format(k_name, head_dim), get_test_format(v_name, head_dim)
    k = rng.standard_normal((n_slots, n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((n_slots, n_kv, head_dim)).astype(np.float32)
    k *= np.float32(1.5)  # scores of a few units: the softmax is neither flat nor one-hot
    v[:, :, rng.choice(head_dim, 2, replace=False)] *= 8.0  # outlier channels
    k_bytes = kf.encode(k.reshape(-1, head_dim)).reshape(n_slots, n_kv, -1)
    v_bytes = vf.encode(v.reshape(-1, head_dim)).reshape(n_slots, n_kv, -1)
    pos = np.arange(n_slots, dtype=np.int32) if positions is None else positions.astype(np.int32)
    return Layer(
        k_format=kf, v_format=vf, n_kv=n_kv, head_dim=head_dim, v_head_dim=head_dim, ring=ring,
        n_used=n_slots if n_used is None else n_used,
        k_data=cp.asarray(k_bytes), v_data=cp.asarray(v_bytes), slot_pos=cp.asarray(pos), host_pos=pos,
        k=kf.decode(k_bytes.reshape(n_slots * n_kv, -1), head_dim).reshape(n_slots, n_kv, head_dim),
        v=vf.decode(v_bytes.reshape(n_slots * n_kv, -1), head_dim).reshape(n_slots, n_kv, head_dim))


def reference(q, q_pos, layer: Layer, *, scale, window=0, softcap=0.0, mask=None, f16_inputs=False):
    """(O, LSE) of reference.attend over the slots [0, n_used) (with an additive mask, which attend does not
    take: a direct float64 softmax). f16_inputs: on the f16-rounded Q, K, V that fa_mma computes with."""
    from cupyllm.ops.attention.reference import attend, causal_mask
    n = layer.n_used
    k, v, k_pos = layer.k[:n], layer.v[:n], layer.host_pos[:n]
    if f16_inputs:  # what fa_mma feeds the tensor cores
        q = rounded_f16_query(q, layer.k_format, scale)
        k, v = rounded_f16(k, layer.k_format), rounded_f16(v, layer.v_format)
        scale = 1.0
    allowed = causal_mask(q_pos, k_pos, window)
    if mask is None:
        return attend(q, k, v, allowed, scale=scale, softcap=softcap)
    out, lse = dense(q, k, v, allowed, scale, softcap, mask=mask[:, :n])
    return out.astype(np.float32), lse.astype(np.float32)


def _case_inputs(rng, head_dim, k_name, v_name, case, n_q, n_head, n_kv, n_slots):
    """Layer, q, q_pos and the attention options of one mask case."""
    opts = {"window": 0, "softcap": 0.0, "mask": None}
    q_pos = np.arange(n_slots - n_q, n_slots, dtype=np.int32)
    if case == "window_ring":  # a ring: slot = position % capacity, positions past one lap, two empty slots
        first = 3 * n_slots // 2
        positions = np.arange(first, first + n_slots)
        slots = positions % n_slots
        slot_pos = np.empty(n_slots, np.int64)
        slot_pos[slots] = positions
        slot_pos[rng.choice(n_slots, 2, replace=False)] = -1
        layer = make_layer(rng, k_name, v_name, head_dim, n_kv, n_slots, ring=True, positions=slot_pos)
        q_pos = np.arange(first + n_slots - n_q, first + n_slots, dtype=np.int32)
        opts["window"] = n_slots // 3
        return layer, q_pos, opts
    if case == "unused_slots":  # only the first n_used slots hold keys; the rest must not be read
        layer = make_layer(rng, k_name, v_name, head_dim, n_kv, n_slots, n_used=n_slots - 37)
        q_pos = np.arange(n_slots - 37 - n_q, n_slots - 37, dtype=np.int32)
        return layer, q_pos, opts
    layer = make_layer(rng, k_name, v_name, head_dim, n_kv, n_slots)
    if case == "softcap":
        opts["softcap"] = 2.5
    elif case == "additive":
        mask = rng.normal(0, 1, (n_q, n_slots)).astype(np.float32)
        mask[:, rng.choice(n_slots, n_slots // 4, replace=False)] = -np.inf
        opts["mask"] = mask
        opts["softcap"] = 4.0
    elif case == "empty_rows":  # the first query sees no key at all; the second sees exactly one
        q_pos[0] = -1
        if n_q > 1:
            q_pos[1] = 0
    return layer, q_pos, opts


def _check(o, lse, ref_o, ref_lse, v_max, tol_o, tol_lse, what):
    import cupy as cp
    o = cp.asnumpy(o).astype(np.float32)
    lse = cp.asnumpy(lse)
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite), f"{what}: rows without visible keys differ"
    assert (lse[~finite] == -np.inf).all() and (o[~finite] == 0).all(), f"{what}: an empty row is not O = 0, LSE = -inf"
    err_o = np.abs(o - ref_o).max() / v_max
    err_lse = np.abs(lse[finite] - ref_lse[finite]).max(initial=0.0)
    assert err_o <= tol_o, f"{what}: max |dO| / max|V| = {err_o:.3g} > {tol_o}"
    assert err_lse <= tol_lse, f"{what}: max |dLSE| = {err_lse:.3g} > {tol_lse}"


# (n_q, n_head, n_kv) per mask case: GQA groups of 1 to 8, fa_vec with 4 and 8 rows per block and with
# two row blocks, fa_mma with one and several row tiles
VEC_SHAPES = {"causal": (1, 8, 2), "window_ring": (2, 6, 2), "softcap": (3, 8, 2), "additive": (2, 4, 2),
              "empty_rows": (2, 6, 2), "unused_slots": (1, 16, 2)}
MMA_SHAPES = {"causal": (9, 8, 2), "window_ring": (20, 8, 2), "softcap": (6, 4, 4), "additive": (12, 6, 2),
              "empty_rows": (9, 8, 2), "unused_slots": (40, 4, 1)}


def _sizes(head_dim: int, kernel: str, case: str = "causal") -> tuple[int, int, int, int]:
    """(n_q, n_head, n_kv, n_slots): a partial last tile, several tiles, GQA; fewer slots under the emulator."""
    n_q, n_head, n_kv = (VEC_SHAPES if kernel == "vec" else MMA_SHAPES)[case]
    if kernel == "vec":
        return n_q, n_head, n_kv, 203 if emulated() else 1500
    return n_q, n_head, n_kv, 150 if emulated() else 700


# splits over the keys per mask case: the combine kernel runs in most cases (None: the automatic choice)
SPLITS = {"causal": None, "window_ring": 2, "softcap": 3, "additive": 4, "empty_rows": 3, "unused_slots": 2}


def _run_case(runner, head_dim, k_name, v_name, case, kernel, seed=0, shapes=None):
    import cupy as cp
    rng = np.random.default_rng(seed)
    n_q, n_head, n_kv, n_slots = _sizes(head_dim, shapes or kernel, case)
    layer, q_pos, opts = _case_inputs(rng, head_dim, k_name, v_name, case, n_q, n_head, n_kv, n_slots)
    q = rng.standard_normal((n_q, n_head, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    if kernel == "mma" and mma_lacks_shared_memory(runner, layer, n_q, n_head, head_dim):
        from cupyllm.ops.attention.gpu_dispatch import AttentionArgumentError
        with pytest.raises(AttentionArgumentError, match="shared memory.*use kernel='vec'"):
            runner.attention_lse(cp.asarray(q), q_pos, layer, scale=scale, kernel=kernel, **opts)
        return
    o, lse = runner.attention_lse(cp.asarray(q), q_pos, layer, scale=scale, kernel=kernel, n_split=SPLITS[case],
                                  **opts)
    ref_o, ref_lse = reference(q, q_pos, layer, scale=scale, f16_inputs=kernel == "mma", **opts)
    v_max = float(np.abs(layer.v).max())
    tol_o, tol_lse = (VEC_TOL, VEC_TOL * 10) if kernel == "vec" else (MMA_TOL_O, MMA_TOL_LSE)
    _check(o, lse, ref_o, ref_lse, v_max, tol_o, tol_lse, f"{kernel} d={head_dim} K={k_name} V={v_name} {case}")


@pytest.mark.parametrize("head_dim,k_name,v_name,case", CASES)
def test_vec_matches_reference(runner, head_dim, k_name, v_name, case):
    _run_case(runner, head_dim, k_name, v_name, case, "vec")


@pytest.mark.parametrize("head_dim,k_name,v_name,case", CASES)
def test_mma_matches_reference(runner, head_dim, k_name, v_name, case):
    _run_case(runner, head_dim, k_name, v_name, case, "mma")


@pytest.mark.parametrize("head_dim,k_name,v_name,case", CASES)
def test_mma_decode_matches_reference(runner, head_dim, k_name, v_name, case):
    """fa_mma's decode layout (<= 16 rows: one tile, warps splitting the keys) on the decode shapes."""
    _run_case(runner, head_dim, k_name, v_name, case, "mma", shapes="vec")


@pytest.mark.parametrize("case", list(SPLITS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_mma_f16_decode_path(runner, head_dim, case):
    """fa_mma's f16 path (K and V f16, decode: cache rows copied straight into the tiles, V read row-major)
    against the reference, for every head dim and mask case."""
    from cupyllm.ops.attention import gpu as fk
    from cupyllm.ops.kv_formats.formats import get_format
    f16 = get_format("f16", head_dim=head_dim)
    assert fk.mma_f16_direct(True, f16, f16)  # the launch below takes that path
    _run_case(runner, head_dim, "f16", "f16", case, "mma", shapes="vec")


@pytest.mark.parametrize("group", (64, 128))
@pytest.mark.parametrize("name", _formats())
def test_chunk_reader_is_bit_exact(runner, name, group):
    """The kernels' 8-value reader (Chunk8, by runtime format id) gives the NumPy decode's values bit for
    bit (rotated formats: the rotated-domain values), equal to kv_formats.cuh's per-value dequant; the f16
    reader of fa_mma's tiles (Half8: f16 arithmetic for the symmetric block formats) gives those values
    rounded to f16, also where the result is an f16 subnormal."""
    import cupy as cp
    from cupyllm.ops.attention import gpu as fk
    from cupyllm.ops.kv_formats.formats import is_rotated
    rng = np.random.default_rng(3)
    fmt = get_test_format(name, group)
    n_rows, d = 8, 2 * group
    x = rng.standard_normal((n_rows, d)).astype(np.float32) * np.float32(3.0)
    x[0] = 0.0
    x[1] *= np.float32(2e-6)   # decoded values near and below f16's smallest normal (6.1e-5)
    rows = fmt.encode(x)
    ref = fmt.decode_rotated(rows, d) if is_rotated(name) else fmt.decode(rows, d)
    out_chunk = cp.empty((n_rows, d), cp.float32)
    out_ref = cp.empty((n_rows, d), cp.float32)
    out_f16 = cp.empty((n_rows, d), cp.uint16)
    kernel = runner.registry.function(fk.chunk_check_kernel_name(group))
    n_tasks = n_rows * d // 8
    kernel((-(-n_tasks // fk.THREADS),), (fk.THREADS,),
           (cp.asarray(rows), cp.asarray(fk.kernel_table(fmt)), out_chunk, out_ref, out_f16, np.int32(n_rows),
            np.int32(d), np.int32(fk.FORMAT_IDS[name]), np.int32(rows.shape[1])))
    got, per_value = cp.asnumpy(out_chunk), cp.asnumpy(out_ref)
    assert np.array_equal(got.view(np.uint32), per_value.view(np.uint32)), "Chunk8 != load_kv_value"
    assert np.array_equal(got.view(np.uint32), ref.astype(np.float32).view(np.uint32)), "kernel != NumPy decode"
    want_f16 = ref.astype(np.float32).astype(np.float16).view(np.uint16)
    got_f16 = cp.asnumpy(out_f16)
    bad = np.argwhere(got_f16 != want_f16)
    assert bad.size == 0, (f"Half8 != f16 rounding of the decode at {len(bad)} values, first {bad[0].tolist()}: "
                           f"{got_f16[tuple(bad[0])]:#06x} vs {want_f16[tuple(bad[0])]:#06x}")


@pytest.mark.parametrize("from_floats", (False, True))
@pytest.mark.parametrize("name", ("q8_0", "q4_1", "turbo3"))
def test_dequant_bench_kernel_folds_the_f16_decode(runner, name, from_floats):
    """bench/dequant_gpu.py's kernel (fa_mma's dequantizing pass alone: K rows and V^T columns) reads every value
    of every row as the f16 decode: each block's xor of the words of its f16 tiles equals NumPy's, with either
    reader."""
    import cupy as cp
    from cupyllm.ops.attention import gpu as fk
    from cupyllm.ops.kv_formats.formats import is_rotated
    rng = np.random.default_rng(8)
    d, n_rows, n_blocks = 128, 200, 3  # 4 tiles of 64 rows, the last one part-filled
    fmt = get_test_format(name, d)
    rows = fmt.encode(rng.standard_normal((n_rows, d)).astype(np.float32))
    values = fmt.decode_rotated(rows, d) if is_rotated(name) else fmt.decode(rows, d)
    halves = values.astype(np.float32).astype(np.float16).view(np.uint16)
    want = np.zeros(n_blocks, np.uint32)
    tile_rows = fk.DEQUANT_BENCH_TILE
    for tile in range(-(-n_rows // tile_rows)):
        part = halves[tile * tile_rows:(tile + 1) * tile_rows].astype(np.uint32)
        k_words = part[:, 0::2] | part[:, 1::2] << 16      # K rows: dim pairs of one key
        v_words = part[0::2] | part[1::2] << 16 if len(part) % 2 == 0 else None
        if v_words is None:                                # an odd last tile: its zero-filled row completes the pair
            part = np.vstack([part, np.zeros((1, d), np.uint32)])
            v_words = part[0::2] | part[1::2] << 16        # V^T: key pairs of one dim
        want[tile % n_blocks] ^= np.bitwise_xor.reduce(k_words, axis=None) ^ np.bitwise_xor.reduce(v_words, axis=None)
    kernel = runner.registry.function(fk.dequant_bench_kernel_name(d, from_floats))
    checksum = cp.zeros(n_blocks, cp.uint32)
    kernel((n_blocks,), (fk.THREADS,),
           (cp.asarray(rows), cp.asarray(fk.kernel_table(fmt)), checksum, np.int32(n_rows),
            np.int32(fk.FORMAT_IDS[name]), np.int32(rows.shape[1]), np.int32(fk.table_len(fmt))),
           shared_mem=fk.dequant_bench_smem_bytes(d, rows.shape[1], fk.table_len(fmt)))
    assert np.array_equal(cp.asnumpy(checksum), want)


@pytest.mark.parametrize("kernel", ("vec", "mma"))
def test_split_count_does_not_change_the_result(runner, kernel):
    """1, 3 and the automatic number of splits agree with each other and with the reference."""
    import cupy as cp
    rng = np.random.default_rng(5)
    d = 128
    n_q, n_head, n_kv, n_slots = _sizes(d, kernel)
    layer = make_layer(rng, "q8_0", "turbo4", d, n_kv, n_slots)
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    q_pos = np.arange(n_slots - n_q, n_slots, dtype=np.int32)
    results = [runner.attention_lse(cp.asarray(q), q_pos, layer, scale=d ** -0.5, kernel=kernel, n_split=s)
               for s in (1, 3, None)]
    ref_o, ref_lse = reference(q, q_pos, layer, scale=d ** -0.5, f16_inputs=kernel == "mma")
    v_max = float(np.abs(layer.v).max())
    for o, lse in results:
        if kernel == "vec":
            _check(o, lse, ref_o, ref_lse, v_max, VEC_TOL, VEC_TOL * 10, "vec split")
        else:
            _check(o, lse, ref_o, ref_lse, v_max, MMA_TOL_O, MMA_TOL_LSE, "mma split")


def test_lse_merges_two_caches(runner):
    """Attention over two halves of a cache, merged with reference.merge by their LSE, is attention over all."""
    import cupy as cp
    from cupyllm.ops.attention.reference import merge
    rng = np.random.default_rng(6)
    d, n_q, n_head, n_kv, n = 64, 2, 4, 2, 120
    whole = make_layer(rng, "q4_0", "q5_1", d, n_kv, n)
    halves = []
    for lo, hi in ((0, n // 2), (n // 2, n)):
        part = Layer(**vars(whole))
        part.k_data, part.v_data = cp.ascontiguousarray(whole.k_data[lo:hi]), cp.ascontiguousarray(whole.v_data[lo:hi])
        part.slot_pos, part.host_pos, part.n_used = whole.slot_pos[lo:hi].copy(), whole.host_pos[lo:hi], hi - lo
        part.k, part.v = whole.k[lo:hi], whole.v[lo:hi]
        part.ring = lo > 0  # slot j of the second half holds position j + lo: not "slot = position"
        halves.append(part)
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    q_pos = np.array([n - 1, n // 3], np.int32)  # the second query sees only part of the first half
    (o1, l1), (o2, l2) = (runner.attention_lse(cp.asarray(q), q_pos, h, scale=0.125, kernel="vec") for h in halves)
    merged_o, merged_lse = merge(cp.asnumpy(o1), cp.asnumpy(l1), cp.asnumpy(o2), cp.asnumpy(l2))
    ref_o, ref_lse = reference(q, q_pos, whole, scale=0.125)
    _check(cp.asarray(merged_o), cp.asarray(merged_lse), ref_o, ref_lse, float(np.abs(whole.v).max()), VEC_TOL,
           VEC_TOL * 10, "merged halves")


@pytest.mark.parametrize("kernel", ("vec", "mma"))
def test_float16_queries_give_float16_output(runner, kernel):
    import cupy as cp
    rng = np.random.default_rng(7)
    d = 256
    layer = make_layer(rng, "f16", "f16", d, 1, 90)
    q = rng.standard_normal((3, 4, d)).astype(np.float16)
    q_pos = np.array([89, 60, 10], np.int32)
    o, lse = runner.attention_lse(cp.asarray(q), q_pos, layer, scale=d ** -0.5, softcap=30.0, kernel=kernel)
    assert o.dtype == np.float16 and lse.dtype == np.float32
    ref_o, ref_lse = reference(q.astype(np.float32), q_pos, layer, scale=d ** -0.5, softcap=30.0,
                               f16_inputs=kernel == "mma")
    tol = 2e-3  # the output itself is rounded to f16
    _check(o, lse, ref_o, ref_lse, float(np.abs(layer.v).max()), tol, tol, f"{kernel} f16 q")


def test_module_functions_and_dispatch_choice(runner):
    """gpu_attention / gpu_attention_lse pick FA-VEC for float-cache decode, MMA's decode tiles for quantized
    decode and MMA for prefill, and agree with the reference."""
    import cupy as cp
    from cupyllm.ops.attention import gpu_dispatch as dispatch
    rng = np.random.default_rng(8)
    d = 64
    for fmt, n_q, expected in (("bf16", 1, "vec"), ("f16", 1, "mma"), ("turbo3", 1, "mma"), ("turbo3", 20, "mma")):
        layer = make_layer(rng, fmt, fmt, d, 2, 130)
        q = rng.standard_normal((n_q, 14, d)).astype(np.float32)  # Qwen2.5-0.5B: 14 query heads, 2 KV heads
        q_pos = np.arange(130 - n_q, 130, dtype=np.int32)
        kernel = dispatch.choose_kernel(n_q, 14, 2, d, fmt, fmt)
        assert kernel == expected
        o = dispatch.gpu_attention(cp.asarray(q), q_pos, layer, scale=d ** -0.5, runner=runner)
        o2, lse = dispatch.gpu_attention_lse(cp.asarray(q), q_pos, layer, scale=d ** -0.5, runner=runner)
        ref_o, ref_lse = reference(q, q_pos, layer, scale=d ** -0.5, f16_inputs=kernel == "mma")
        tol = (VEC_TOL, VEC_TOL * 10) if kernel == "vec" else (MMA_TOL_O, MMA_TOL_LSE)
        _check(o2, lse, ref_o, ref_lse, float(np.abs(layer.v).max()), *tol, f"dispatch {fmt} n_q={n_q}")
        assert np.array_equal(cp.asnumpy(o), cp.asnumpy(o2))


def test_bad_arguments_raise(runner):
    import cupy as cp
    from cupyllm.ops.attention.gpu_dispatch import AttentionArgumentError
    rng = np.random.default_rng(9)
    layer = make_layer(rng, "f16", "q8_0", 128, 2, 40)
    q = cp.zeros((1, 4, 128), cp.float32)
    with pytest.raises(AttentionArgumentError, match="head_dim"):
        runner.attention(cp.zeros((1, 4, 64), cp.float32), np.array([3], np.int32), layer, scale=0.1)
    with pytest.raises(AttentionArgumentError, match="query heads"):
        runner.attention(cp.zeros((1, 3, 128), cp.float32), np.array([3], np.int32), layer, scale=0.1)
    with pytest.raises(AttentionArgumentError, match="float32 or float16"):
        runner.attention(q.astype(cp.float64), np.array([3], np.int32), layer, scale=0.1)
    with pytest.raises(AttentionArgumentError, match="q_pos"):
        runner.attention(q, np.array([3, 4], np.int32), layer, scale=0.1)
    with pytest.raises(AttentionArgumentError, match="mask"):
        runner.attention(q, np.array([3], np.int32), layer, scale=0.1, mask=np.zeros((1, 5), np.float32))
    bad = Layer(**vars(layer))
    bad.k_data = cp.zeros((40, 2, 100), cp.uint8)
    with pytest.raises(AttentionArgumentError, match="k_data"):
        runner.attention(q, np.array([3], np.int32), bad, scale=0.1)


# ---- the backend's decoding path (gpu_decoded.py) and normalised K through backend.attention ----

@pytest.mark.parametrize("window,softcap", [(0, 0.0), (9, 0.0), (0, 20.0)])
def test_decode_attention_matches_reference(backend, cp, window, softcap):
    from cupyllm.ops.attention.reference import attend, causal_mask
    from cupyllm.ops.attention.gpu_decoded import attend_decoded
    rng = np.random.default_rng(12)
    cpu, gpu = layer_pair(backend, "f16", capacity=64, n_kv=2, ring=window > 0, window=window)
    positions = np.arange(0, 30)
    k = rng.standard_normal((30, 2, 64)).astype(np.float32)
    v = rng.standard_normal((30, 2, 64)).astype(np.float32)
    cpu.write(k, v, positions)
    gpu.write(cp.asarray(k), cp.asarray(v), positions)
    q_pos = np.array([3, 17, 29])
    q = rng.standard_normal((3, 6, 64)).astype(np.float32)  # GQA: 3 query heads per KV head
    kk, vv, kp = cpu.decode(0, cpu.n_used)
    want, _ = attend(q, kk, vv, causal_mask(q_pos, kp, window), scale=0.125, softcap=softcap)
    got = attend_decoded(cp.asarray(q), backend.inputs.int32(q_pos), gpu, scale=0.125, window=window,
                         softcap=softcap, key_chunk=8)  # several chunks: the online softmax merges them
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_normalized_cache_attention(backend, cp, softcap):
    """KVSpec.normalize_k on the device: keys with large per-channel offsets and spreads, stored as
    (K - offset) / scale. Plain softmax reads the normalised rows in the flash kernels with Q scaled; a
    soft-capped score goes to the decoding path, which undoes the normalisation. Both against the CPU's
    normalised layer and the reference attention."""
    from cupyllm.ops.attention.reference import attend, causal_mask
    cpu, gpu = layer_pair(backend, "q8_0", capacity=64)
    cpu.normalize_k = gpu.normalize_k = True
    rng = np.random.default_rng(13)
    offset = rng.standard_normal((2, 64)).astype(np.float32) * 20.0
    k = rng.standard_normal((40, 2, 64)).astype(np.float32)
    k[..., ::16] *= 30.0  # loud channels
    k += offset
    v = rng.standard_normal((40, 2, 64)).astype(np.float32)
    for lo, hi in ((0, 24), (24, 40)):
        cpu.write(k[lo:hi], v[lo:hi], np.arange(lo, hi))
        gpu.write(cp.asarray(k[lo:hi]), cp.asarray(v[lo:hi]), np.arange(lo, hi))
    np.testing.assert_allclose(cp.asnumpy(gpu.k_offset), cpu.k_offset, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(cp.asnumpy(gpu.k_scale), cpu.k_scale, rtol=1e-5)
    k_gpu, _, _ = gpu.decode(0, 40)
    k_cpu, _, _ = cpu.decode(0, 40)
    # normalisation undone after the f16 decode: f16's rounding of the largest stored value, times the scale
    stored = np.abs((k - cpu.k_offset) / cpu.k_scale).max()
    np.testing.assert_allclose(cp.asnumpy(k_gpu), k_cpu, atol=1e-3 * float(stored * cpu.k_scale.max()))
    q_pos = np.array([39])
    q = rng.standard_normal((1, 6, 64)).astype(np.float32)
    want, _ = attend(q, k_cpu, cpu.decode(0, 40)[1], causal_mask(q_pos, cpu.slot_pos[:40], 0), scale=0.125,
                     softcap=softcap)
    got = cp.asnumpy(backend.attention(cp.asarray(q), q_pos, gpu, scale=0.125, softcap=softcap))
    np.testing.assert_allclose(got, want, atol=5e-3 * np.abs(v).max())
