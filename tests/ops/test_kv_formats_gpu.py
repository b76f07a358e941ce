"""GPU parity of the KV-cache kernels with the NumPy references (cupyllm/kv/).

Encode: the bytes the GPU scatters into the cache equal ``fmt.encode`` of the same rows, for every
format (TCQ too: its Viterbi search is integer arithmetic, ties included). Decode: within 1 f16 ulp of
``fmt.decode`` (the kernels compute the same float32 values; only the final f16 rounding is theirs).

Skipped without a CUDA device (no CuPy, no driver, or no GPU).
"""
from __future__ import annotations

import numpy as np
import pytest

from cupyllm.ops.kv_formats import turbo
from gpu_helpers import GPU_TEST_MARKS, backend, cp, get_test_format, layer_pair  # noqa: F401 (fixtures)

pytestmark = GPU_TEST_MARKS

N_KV_HEADS = 8
HEAD_DIMS = (64, 128, 256)
SOURCE_DTYPES = ("float32", "float16")


def _formats():
    from cupyllm.ops.kv_formats.formats import list_formats
    return list_formats()


def make_kv_rows(rng, n_new: int, head_dim: int, dtype: str) -> np.ndarray:
    """K/V-like rows [n_new, N_KV_HEADS, head_dim]: Gaussian with a per-row scale over four decades,
    a few outlier channels, and the edge cases the references define: zero and -0.0 rows, a constant
    row, blocks whose largest |x| appears with both signs (first-occurrence tie-break), tiny values, rows
    that rotate to a single coordinate per group."""
    x = rng.standard_normal((n_new, N_KV_HEADS, head_dim)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-2, 2, (n_new, N_KV_HEADS, 1))).astype(np.float32)
    x[:, :, rng.choice(head_dim, 3, replace=False)] *= 20.0  # outlier channels, as in K
    x[0, 0] = 0.0
    x[1, 0] = -0.0
    x[2, 0] = 1.5
    x[3, 0] = np.where(np.arange(head_dim) % 2 == 0, -2.0, 2.0)
    x[3, 1, :32] = rng.integers(-3, 4, 32).astype(np.float32)  # many exact magnitude ties
    x[4, 0] *= np.float32(1e-6)
    group = min(128, head_dim)  # a rotated group all in one coordinate: TCQ's largest |z| (its clamp)
    x[5, 0] = turbo.unrotate(np.where(np.arange(head_dim) % group == 7, 3.0, 0.0).astype(np.float32)[None], group)[0]
    return x.astype(dtype)


@pytest.fixture(scope="module")
def registry():
    """One registry for the module: each kernel set is compiled (or read from CuPy's cache) once."""
    from cupyllm.cuda.registry import KernelRegistry
    return KernelRegistry()


def _encode_case(registry, name: str, head_dim: int, src_dtype: str, seed: int = 0, fmt=None,
                 n_heads: int = N_KV_HEADS):
    """Encode 37 tokens into 53 slots (one skipped, one out of range) with the format `name` (or `fmt`)."""
    import cupy as cp
    from cupyllm.ops.kv_formats.gpu import GpuKVCodec

    rng = np.random.default_rng(seed)
    fmt = fmt if fmt is not None else get_test_format(name, head_dim)
    codec = GpuKVCodec(fmt, head_dim, n_heads, registry=registry)
    n_new, n_slots = 37, 53
    x = np.ascontiguousarray(make_kv_rows(rng, n_new, head_dim, src_dtype)[:, :n_heads])
    slots = rng.permutation(n_slots)[:n_new].astype(np.int32)
    slots[5] = -1  # skipped by the kernel
    slots[6] = n_slots  # out of range: skipped too
    cache = cp.full((n_slots, n_heads, codec.row_bytes), 0xA5, dtype=cp.uint8)
    codec.encode(cp.asarray(x), cp.asarray(slots), cache)
    kept = (slots >= 0) & (slots < n_slots)
    ref = fmt.encode(x[kept].astype(np.float32).reshape(-1, head_dim)).reshape(int(kept.sum()), n_heads, -1)
    host = cp.asnumpy(cache)
    untouched = np.setdiff1d(np.arange(n_slots), slots[kept])
    assert (host[untouched] == 0xA5).all(), "encode wrote to a slot it was not given"
    return fmt, codec, cache, host[slots[kept]], ref, x[kept]


@pytest.mark.parametrize("src_dtype", SOURCE_DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("name", _formats())
def test_encode_is_bit_exact(registry, name, head_dim, src_dtype):
    _, _, _, got, ref, _ = _encode_case(registry, name, head_dim, src_dtype)
    _assert_rows_equal(got, ref)


def _assert_rows_equal(got: np.ndarray, ref: np.ndarray):
    bad = np.argwhere((got != ref).any(axis=2))
    assert len(bad) == 0, (f"{len(bad)} of {got.shape[0] * got.shape[1]} head rows differ; first "
                           f"(token, head) {tuple(bad[0])}:\n gpu {got[tuple(bad[0])]}\n ref {ref[tuple(bad[0])]}")


@pytest.mark.parametrize("name", ["turbo3_tcq", "turbo2_tcq"])
def test_tcq_ties_break_as_the_reference(registry, name):
    """A codebook rounded to halves (most of its 2^L entries shared by many states) makes equal path costs
    everywhere: the predecessor and final-state tie rules decide, and the GPU must take the reference's path."""
    from cupyllm.ops.kv_formats import tcq

    base = get_test_format(name, 128)
    coarse = tcq.trellis_format(base.k, base.L, 128, np.round(base.codebook * 2) / 2, name=name)
    _, _, _, got, ref, _ = _encode_case(registry, name, 128, "float32", seed=3, fmt=coarse)
    _assert_rows_equal(got, ref)


@pytest.mark.parametrize("n_heads", [N_KV_HEADS, 1])
@pytest.mark.parametrize("k, L", [(3, 9), (3, 8), (3, 7), (3, 6), (2, 7), (2, 6), (2, 5)])
def test_other_trellis_sizes_encode_like_the_reference(k, L, n_heads):
    """The encoder at trellis sizes no format names (bench/kv_encode.py times them): 32 threads a group at
    L - k = 5, fewer than its stream bytes at k = 3; below that several groups share a warp's CTA, with skipped
    slots among them (their groups compute beside the others and store nothing) and (one head: 37 groups) a
    last CTA that runs past the end."""
    from cupyllm.ops.kv_formats.gpu import trellis_encode_kernel, trellis_registry
    from cupyllm.ops.kv_formats import tcq

    head_dim = 128
    fmt = tcq.trellis_format(k, L, head_dim, tcq.initial_codebook(L, seed=1))
    registry = trellis_registry([trellis_encode_kernel(fmt)])
    _, _, _, got, ref, _ = _encode_case(registry, fmt.name, head_dim, "float32", seed=k * 16 + L, fmt=fmt,
                                        n_heads=n_heads)
    _assert_rows_equal(got, ref)


def _assert_within_one_f16_ulp(got16: np.ndarray, ref32: np.ndarray, what: str):
    ref16 = ref32.astype(np.float16)
    ulp = np.spacing(np.abs(ref16)).astype(np.float64)
    err = np.abs(got16.astype(np.float64) - ref16.astype(np.float64))
    bad = np.argwhere(~(err <= ulp))
    assert len(bad) == 0, (f"{what}: {len(bad)} values off by more than 1 f16 ulp; first at {tuple(bad[0])}: "
                           f"gpu {got16[tuple(bad[0])]!r} ref {ref32[tuple(bad[0])]!r}")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("name", _formats())
def test_decode_within_one_f16_ulp(registry, name, head_dim):
    import cupy as cp
    from cupyllm.ops.kv_formats.formats import is_rotated

    fmt, codec, cache, _, _, _ = _encode_case(registry, name, head_dim, "float32", seed=1)
    host = cp.asnumpy(cache)
    row_start, n_rows = 3, 41  # a range that does not start at 0
    rows = host[row_start:row_start + n_rows].reshape(-1, codec.row_bytes)
    got = cp.asnumpy(codec.decode(cache, row_start, n_rows))
    ref = fmt.decode(rows, head_dim).reshape(n_rows, N_KV_HEADS, head_dim)
    _assert_within_one_f16_ulp(got, ref, f"{name} decode")
    if is_rotated(name):
        got_rot = cp.asnumpy(codec.decode(cache, row_start, n_rows, unrotate=False))
        ref_rot = fmt.decode_rotated(rows, head_dim).reshape(n_rows, N_KV_HEADS, head_dim)
        _assert_within_one_f16_ulp(got_rot, ref_rot, f"{name} rotated-domain decode")


def test_encode_overwrites_a_slot_and_bad_arguments_raise(registry):
    import cupy as cp
    from cupyllm.ops.kv_formats.gpu import GpuKVCodec
    from cupyllm.ops.kv_formats.formats import KVFormatError, get_format

    fmt = get_format("q4_0")
    codec = GpuKVCodec(fmt, 128, N_KV_HEADS, registry=registry)
    cache = codec.allocate(4)
    rng = np.random.default_rng(2)
    first, second = (rng.standard_normal((1, N_KV_HEADS, 128)).astype(np.float32) for _ in range(2))
    slot = cp.asarray(np.array([2], np.int32))
    codec.encode(cp.asarray(first), slot, cache)
    codec.encode(cp.asarray(second), slot, cache)
    assert (cp.asnumpy(cache[2]) == fmt.encode(second.reshape(-1, 128)).reshape(N_KV_HEADS, -1)).all()
    with pytest.raises(KVFormatError, match="src"):
        codec.encode(cp.zeros((1, N_KV_HEADS, 64), cp.float32), slot, cache)
    with pytest.raises(KVFormatError, match="int32"):
        codec.encode(cp.asarray(first), slot.astype(cp.int64), cache)
    with pytest.raises(KVFormatError, match="float32 or float16"):
        codec.encode(cp.asarray(first).astype(cp.float64), slot, cache)
    with pytest.raises(KVFormatError, match="allocate"):
        codec.encode(cp.asarray(first), slot, cp.zeros((4, N_KV_HEADS, 10), cp.uint8))
    with pytest.raises(KVFormatError, match="outside"):
        codec.decode(cache, 3, 2)


def test_registry_turns_compile_errors_into_device_errors(tmp_path):
    from cupyllm.cuda.registry import KernelRegistry, KernelSet
    from cupyllm.errors import DeviceError

    (tmp_path / "broken.cu").write_text("template <int N> __global__ void k(float* x) { x[0] = undefined_name; }\n")
    registry = KernelRegistry(sets=[KernelSet("broken.cu", ("k<1>",))], source_dir=tmp_path)
    with pytest.raises(DeviceError, match="undefined_name"):
        registry.function("k<1>")


def test_registry_compiles_each_set_once():
    from cupyllm.ops.kv_formats.gpu import decode_kernel_name
    from cupyllm.cuda.registry import KernelRegistry

    registry = KernelRegistry()
    a = registry.function(decode_kernel_name("q8_0"))
    b = registry.function(decode_kernel_name("q4_0"))  # same set: same module
    assert registry.function(decode_kernel_name("q8_0")) is a
    assert len(registry._modules) == 1 and a is not b


# (K type, V type, V head dim): one launch encodes K and V of one encoder (kv_encode.cu gridDim.y = 2), V of a
# wider head included; other formats or group sizes take a launch each
KV_WRITES = [("f16", None, None), ("q8_0", None, None), ("q4_0", None, None), ("turbo3", None, None),
             ("turbo3_tcq", None, None), ("q8_0", "turbo3", None), ("q8_0", None, 128), ("turbo3", None, 128)]


@pytest.mark.parametrize("kv_type,v_type,v_head_dim", KV_WRITES)
def test_device_cache_holds_the_cpu_cache_bytes(backend, cp, kv_type, v_type, v_head_dim):
    rng = np.random.default_rng(11)
    for ring in (False, True):
        cpu, gpu = layer_pair(backend, kv_type, capacity=24 if ring else 60, ring=ring, window=16 if ring else 0,
                               v_type=v_type, v_head_dim=v_head_dim)
        for start, n in ((0, 13), (13, 1), (14, 20), (34, 1)):
            positions = np.arange(start, start + n)
            k = rng.standard_normal((n, 2, 64)).astype(np.float32)
            v = rng.standard_normal((n, 2, v_head_dim or 64)).astype(np.float32)
            cpu.write(k, v, positions)
            gpu.write(cp.asarray(k), cp.asarray(v), positions)
        np.testing.assert_array_equal(cp.asnumpy(gpu.k_data), cpu.k_data)
        np.testing.assert_array_equal(cp.asnumpy(gpu.v_data), cpu.v_data)
        np.testing.assert_array_equal(cp.asnumpy(gpu.slot_pos), cpu.slot_pos)
        assert gpu.n_used == cpu.n_used
        k_gpu, v_gpu, pos_gpu = gpu.decode(0, gpu.n_used)
        k_cpu, v_cpu, _ = cpu.decode(0, cpu.n_used)
        np.testing.assert_array_equal(cp.asnumpy(k_gpu), k_cpu.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(cp.asnumpy(v_gpu), v_cpu.astype(np.float16).astype(np.float32))
        gpu.clear()
        assert gpu.n_used == 0 and int(cp.asnumpy(gpu.slot_pos).max()) == -1
