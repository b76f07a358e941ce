"""The GPU backend (cupyllm/backend/gpu.py) against the NumPy definitions, kernel by kernel, then whole models.

References: weight blocks -> cupyllm/ops/matmul/reference.py `dequantize` (bit for bit); matmuls -> float64 products of
those values (GEMV, float32 activations) or of their f16 roundings (prefill paths); RMSNorm / activations ->
backend/cpu.py; RoPE -> ops/elementwise/reference.py `rope_tables` + `apply_rope`; the KV cache -> kv/cache.py LayerKV (same bytes);
attention -> ops/attention/reference.py; whole models -> the CPU engine on the same GGUF (tiny random models) and
HF transformers' stored logits (the real models).

Stated tolerances (float32 unless said):
- dequantization, embedding rows, cache bytes: exact; RoPE: 1e-6 (device float64 sincos vs the host's);
- SiLU, softcap: 1e-6 relative; tanh-GELU: 4e-6 absolute (1 + tanh cancels for negative inputs);
- GEMV and MMA sums: |y - ref| <= 2e-5 * sum_k |w_k x_k| (summation order differs from the reference);
- tiny models, decode path (every matmul a GEMV): max |dlogit| <= 2e-4 * max |logit| (1e-5 .. 3e-5 seen on the
  emulator); prefill paths (W and x rounded to f16): <= 5e-3 * max |logit| (7e-4 .. 1.2e-3 seen);
- real models: GEMV path within 0.02 of HF's logits with HF's argmax (the CPU engine's bound); the f16 prefill
  paths within 0.1 and the same argmax at >= 95% of positions (the CPU engine with the same f16 roundings gives
  0.013 .. 0.033 and every argmax on the four stored texts of each model).

Marked `gpu`; skipped without a CUDA device. CUPYLLM_EMULATE=1 runs them on the CPU emulator (tests/support/cuda_emu).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpu_helpers import GPU_TEST_MARKS, emulated

pytestmark = GPU_TEST_MARKS

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def backend():
    from cupyllm.backend.gpu import GPUBackend
    return GPUBackend(attention="decode")


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def _weight_types():
    from cupyllm.ops.matmul.gpu import WEIGHT_TYPES
    return list(WEIGHT_TYPES)


def make_weight(type_name: str, n_out: int, n_in: int, seed: int = 0):
    """A Weight of random valid blocks (host) and the float32 values it decodes to by the reference."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from cupyllm.ops.matmul.reference import WEIGHT_FORMATS, dequantize
    from cupyllm.models.weights import Weight

    qtype = T[type_name]
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):  # no quantizer in gguf-py: random blocks with moderate scales
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n_out * n_in // block_values, block_bytes), dtype=np.uint8)
        for off in {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]:
            raw[:, off:off + 2] = (rng.uniform(0.2, 1.0, len(raw)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    elif qtype == T.F32:
        raw = values
    else:
        raw = gguf.quants.quantize(values, qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, -1)
    fmt = WEIGHT_FORMATS[qtype]
    return Weight(f"test.{type_name}", fmt, (n_out, n_in), raw), dequantize(raw, qtype, n_in)


def assert_sums_close(got, w, x, bias=None, rel=2e-5):
    """got [n, n_out] vs x @ w.T (+ bias) in float64, within rel * sum_k |w_k x_k| per output."""
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    if bias is not None:
        ref = ref + bias
        scale = scale + np.abs(bias)
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err - rel * scale), err.shape)
    assert np.all(err <= rel * scale + 1e-30), f"at {worst}: got {got[worst]}, want {ref[worst]} (scale {scale[worst]})"


# ---- weights -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("type_name", _weight_types())
def test_dequantize_rows_bit_exact(backend, cp, type_name):
    weight, ref = make_weight(type_name, 7, 512)
    on_device = backend.upload(weight)
    got = cp.asnumpy(backend.kernels.dequantize(on_device))
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(cp.asnumpy(backend.kernels.dequantize(on_device, dtype="float16")),
                                  ref.astype(np.float16))
    ids = np.array([3, 0, 6, 3], np.int64)
    np.testing.assert_array_equal(cp.asnumpy(backend.embed(on_device, ids)), ref[ids])


@pytest.mark.parametrize("type_name", _weight_types())
def test_gemv_every_instantiation(backend, cp, type_name):
    """Every (tokens, rows per warp) shape; rows not a multiple of a CTA's; several spans, the last partial."""
    from cupyllm.ops.matmul.gpu import GEMV_SHAPES
    weight, w = make_weight(type_name, 45, 1280, seed=1)
    on_device = backend.upload(weight)
    rng = np.random.default_rng(2)
    bias = rng.standard_normal(45).astype(np.float32)
    for tokens, rows in GEMV_SHAPES:
        for n in sorted({1, tokens}):
            x = rng.standard_normal((n, 1280)).astype(np.float32)
            with_bias = (tokens + rows) % 2 == 0
            got = backend.kernels.gemv(on_device, cp.asarray(x), cp.asarray(bias) if with_bias else None,
                                       shape=(tokens, rows))
            assert_sums_close(cp.asnumpy(got), w, x, bias if with_bias else None)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K"])
def test_gemv_of_several_matrices_in_one_launch(backend, cp, type_name):
    """gemv_many: up to three matrices of one type (different row counts, a bias on some) give each the sums
    of a launch of its own, bit for bit; linear_many groups by type (a Q5_0 matrix among them runs apart)."""
    weights = [backend.upload(make_weight(type_name, n_out, 512, seed=5 + i)[0]) for i, n_out in enumerate((70, 9, 33))]
    rng = np.random.default_rng(6)
    biases = [None, cp.asarray(rng.standard_normal(9).astype(np.float32)), None]
    for n in (1, 3):
        x = cp.asarray(rng.standard_normal((n, 512)).astype(np.float32))
        together = backend.kernels.gemv_many(weights, x, biases)
        for weight, bias, got in zip(weights, biases, together):
            np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(backend.kernels.gemv(weight, x, bias)))
        other = backend.upload(make_weight("Q5_0", 17, 512, seed=9)[0])
        mixed = backend.linear_many(x, [weights[0], other, weights[2]], [None, None, None])
        for weight, got in zip((weights[0], other, weights[2]), mixed):
            np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(backend.kernels.gemv(weight, x)))
    from cupyllm.errors import DeviceError
    with pytest.raises(DeviceError, match="one type and width"):
        backend.kernels.gemv_many([weights[0], other], x)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K", "F16"])
def test_gated_gemv_equals_the_gemvs_then_gated_act(backend, cp, type_name):
    """weight_gemv_gated: act(gate . x) * (up . x), or * given up values, in one launch; bit for bit the two
    GEMVs then gated_act, for every instantiation (rows past the end of a partial last warp included), and
    gated_linear takes it for a few tokens and the separate kernels otherwise."""
    from cupyllm.ops.matmul.gpu import GEMV_GATED_SHAPES, GEMV_MAX_TOKENS
    n_out, n_in = 37, 512
    gate, up = (backend.upload(make_weight(type_name, n_out, n_in, seed=11 + i)[0]) for i in range(2))
    rng = np.random.default_rng(12)
    for tokens, rows in GEMV_GATED_SHAPES:
        for n in sorted({1, tokens}):
            x = cp.asarray(rng.standard_normal((n, n_in)).astype(np.float32))
            given = cp.asarray(rng.standard_normal((n, n_out)).astype(np.float32))
            g, u = backend.kernels.gemv(gate, x), backend.kernels.gemv(up, x)
            for activation in ("silu", "gelu_tanh"):
                fused = backend.kernels.gemv_gated(gate, x, activation, up=up, shape=(tokens, rows))
                np.testing.assert_array_equal(cp.asnumpy(fused), cp.asnumpy(backend.gated_act(g, u, activation)))
                by_given = backend.kernels.gemv_gated(gate, x, activation, up_given=given, shape=(tokens, rows))
                np.testing.assert_array_equal(cp.asnumpy(by_given),
                                              cp.asnumpy(backend.gated_act(g, given, activation)))
    x = cp.asarray(rng.standard_normal((GEMV_MAX_TOKENS + 1, n_in)).astype(np.float32))  # prefill: apart
    for w_up, given in ((up, None), (None, cp.asarray(rng.standard_normal((len(x), n_out)).astype(np.float32)))):
        got = backend.gated_linear(x, gate, "silu", w_up=w_up, up=given)
        want = backend.gated_act(backend.linear(x, gate), backend.linear(x, up) if given is None else given, "silu")
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(want))
    from cupyllm.errors import DeviceError
    other = backend.upload(make_weight("Q5_0", n_out, n_in, seed=13)[0])
    with pytest.raises(DeviceError, match="one type and shape"):
        backend.kernels.gemv_gated(gate, x[:1], "silu", up=other)


@pytest.mark.parametrize("type_name", _weight_types())
def test_mma_matmul(backend, cp, type_name):
    """The tensor-core prefill kernel: two row tiles and two token tiles, both partial, with a bias."""
    weight, w = make_weight(type_name, 70, 512, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((67, 512)).astype(np.float32)
    bias = rng.standard_normal(70).astype(np.float32)
    got = backend.kernels.mma_matmul(backend.upload(weight), cp.asarray(x.astype(np.float16)), cp.asarray(bias))
    assert_sums_close(cp.asnumpy(got), w.astype(np.float16).astype(np.float32),
                      x.astype(np.float16).astype(np.float32), bias)


@pytest.mark.parametrize("path", ["cublas", "mma", "auto"])
def test_linear_dispatch(cp, path):
    """backend.linear: GEMV up to 8 tokens, the chosen prefill path above; rows of 64 floats (not a multiple
    of the MMA depth) take the cuBLAS path either way."""
    from cupyllm.backend.gpu import GPUBackend
    ops = GPUBackend(prefill=path, attention="decode")
    rng = np.random.default_rng(5)
    for type_name, n_in in (("Q4_K", 256), ("Q8_0", 384), ("F32", 64)):
        weight, w = make_weight(type_name, 33, n_in, seed=6)
        on_device = ops.upload(weight)
        for n in (1, 8, 9, 40):
            x = rng.standard_normal((n, n_in)).astype(np.float32)
            got = cp.asnumpy(ops.linear(cp.asarray(x), on_device))
            if n <= 8:
                assert_sums_close(got, w, x)
            else:
                assert_sums_close(got, w.astype(np.float16).astype(np.float32), x.astype(np.float16).astype(np.float32))


def test_float_rows_the_kernels_cannot_read_fall_back_to_dense(backend, cp):
    """F16 rows of 40 values are not whole 32-value pseudo-blocks: stored as dense float32 rows instead."""
    weight, w = make_weight("F16", 9, 40)
    on_device = backend.upload(weight)
    x = np.random.default_rng(7).standard_normal((3, 40)).astype(np.float32)
    assert_sums_close(cp.asnumpy(backend.linear(cp.asarray(x), on_device)), w, x)
    np.testing.assert_array_equal(cp.asnumpy(backend.embed(on_device, np.array([8, 1]))), w[[8, 1]])


def test_embed_rejects_out_of_range_ids(backend):
    from cupyllm.errors import CupyllmError
    weight, _ = make_weight("Q8_0", 5, 64)
    with pytest.raises(CupyllmError, match="token ids"):
        backend.embed(backend.upload(weight), np.array([1, 5]))


# ---- rows and elements ---------------------------------------------------------------------------------

def test_rms_norm_and_fused_residuals(backend, cp):
    from cupyllm.backend.cpu import CPUBackend
    rng = np.random.default_rng(8)
    for shape in ((5, 896), (3, 4, 128), (2, 3584)):
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        r = rng.standard_normal(shape).astype(np.float32)
        w = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)
        want = CPUBackend.rms_norm(x, w, 1e-6)
        got = cp.asnumpy(backend.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
        total, normed = backend.rms_norm_residual(cp.asarray(x), cp.asarray(r), cp.asarray(w), 1e-6)
        np.testing.assert_array_equal(cp.asnumpy(total), x + r)
        np.testing.assert_allclose(cp.asnumpy(normed), CPUBackend.rms_norm(x + r, w, 1e-6), rtol=2e-6, atol=1e-6)
        added = backend.add_rms_norm(cp.asarray(r), cp.asarray(x), cp.asarray(w), 1e-6)  # r + norm(x)
        np.testing.assert_allclose(cp.asnumpy(added), r + want, rtol=2e-6, atol=2e-6)
        w2 = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)
        h, h_normed = backend.add_rms_norm_and_norm(cp.asarray(r), cp.asarray(x), cp.asarray(w), 1e-6, cp.asarray(w2))
        np.testing.assert_array_equal(cp.asnumpy(h), cp.asnumpy(added))  # the fused pass: the two kernels' bits
        np.testing.assert_array_equal(cp.asnumpy(h_normed), cp.asnumpy(backend.rms_norm(h, cp.asarray(w2), 1e-6)))
        np.testing.assert_allclose(cp.asnumpy(h_normed), CPUBackend.rms_norm(cp.asnumpy(h), w2, 1e-6),
                                   rtol=2e-6, atol=1e-6)
        scale = cp.asarray(np.array([0.3125 + shape[-1] * 1e-4], np.float32))  # Gemma 4's layer output scale
        scaled = backend.add_rms_norm(cp.asarray(r), cp.asarray(x), cp.asarray(w), 1e-6, out_scale=scale)
        np.testing.assert_array_equal(cp.asnumpy(scaled), cp.asnumpy(added * scale))  # the sum, then the scale
        hs, hs_normed = backend.add_rms_norm_and_norm(cp.asarray(r), cp.asarray(x), cp.asarray(w), 1e-6,
                                                      cp.asarray(w2), out_scale=scale)
        np.testing.assert_array_equal(cp.asnumpy(hs), cp.asnumpy(scaled))
        np.testing.assert_array_equal(cp.asnumpy(hs_normed), cp.asnumpy(backend.rms_norm(hs, cp.asarray(w2), 1e-6)))


ROPE_CASES = {
    "neox": dict(base=1_000_000.0, n_rot=64),
    "normal": dict(base=10_000.0, n_rot=64, neox=False),
    "partial": dict(base=10_000.0, n_rot=32),
    "freq_factors": dict(base=500_000.0, n_rot=64, freq_factors=tuple(1.0 + 0.25 * i for i in range(32))),
    "linear": dict(base=10_000.0, n_rot=64, scaling="linear", factor=4.0),
    "yarn": dict(base=1_000_000.0, n_rot=64, scaling="yarn", factor=4.0, original_ctx=32768),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_variants(backend, cp, case):
    from cupyllm.files.config import RopeConfig
    from cupyllm.ops.elementwise.reference import apply_rope, rope_tables
    rope = RopeConfig(**ROPE_CASES[case])
    rng = np.random.default_rng(9)
    positions = np.array([0, 1, 7, 4095, 32768, 131071, 999_999])
    x = rng.standard_normal((len(positions), 3, 64)).astype(np.float32)
    cos, sin = rope_tables(rope, positions)
    want = apply_rope(x, cos, sin, rope.neox)
    got = cp.asnumpy(backend.rope(cp.asarray(x), rope, positions))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    if rope.n_rot < 64:
        np.testing.assert_array_equal(got[..., rope.n_rot:], x[..., rope.n_rot:])


@pytest.mark.parametrize("case", ["neox", "normal", "partial"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_rope_of_normed_q_and_k_in_one_launch(backend, cp, case, head_dim):
    """rope_qk: q and k (their own heads and positions, as DCA has them) each RMS-normed per head, then
    rotated, against the CPU backend's rms_norm and rope one after the other."""
    from cupyllm.backend.cpu import CPUBackend
    from cupyllm.files.config import RopeConfig
    rope = RopeConfig(**{**ROPE_CASES[case], "n_rot": min(head_dim, ROPE_CASES[case]["n_rot"] * head_dim // 64)})
    rng = np.random.default_rng(10)
    q_pos, k_pos = np.array([0, 5, 4095, 70000]), np.array([0, 5, 3000, 3001])
    q = (rng.standard_normal((4, 6, head_dim)) * 4).astype(np.float32)
    k = (rng.standard_normal((4, 2, head_dim)) * 4).astype(np.float32)
    q_norm, k_norm = (1 + 0.2 * rng.standard_normal((2, head_dim))).astype(np.float32)
    cpu = CPUBackend()
    for norms in ((None, None), (q_norm, k_norm)):
        want_q, want_k = cpu.rope_qk(q, k, rope, q_pos, k_pos, *norms, eps=1e-6)
        got_q, got_k = backend.rope_qk(cp.asarray(q), cp.asarray(k), rope, q_pos, k_pos,
                                       *(None if w is None else cp.asarray(w) for w in norms), eps=1e-6)
        np.testing.assert_allclose(cp.asnumpy(got_q), want_q, rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(cp.asnumpy(got_k), want_k, rtol=2e-6, atol=2e-6)
        alone, none = backend.rope_qk(cp.asarray(q), None, rope, q_pos, None,
                                      None if norms[0] is None else cp.asarray(norms[0]), None, eps=1e-6)
        assert none is None
        np.testing.assert_array_equal(cp.asnumpy(alone), cp.asnumpy(got_q))


def test_activations_and_softcap(backend, cp):
    from cupyllm.ops.elementwise.reference import gelu_tanh, silu
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((7, 300)) * 4).astype(np.float32)
    up = rng.standard_normal((7, 300)).astype(np.float32)
    # GELU's 1 + tanh(.) cancels for negative x: a 2-ulp tanh (CUDA's tanhf) moves it by ~2.4e-7 * |x| / 2
    for name, ref, atol in (("silu", silu, 1e-7), ("gelu_tanh", gelu_tanh, 4e-6)):
        got = cp.asnumpy(getattr(backend, name)(cp.asarray(x)))
        np.testing.assert_allclose(got, ref(x), rtol=1e-6, atol=atol)
        gated = cp.asnumpy(backend.gated_act(cp.asarray(x), cp.asarray(up), name))
        np.testing.assert_allclose(gated, ref(x) * up, rtol=1e-6, atol=atol * np.abs(up).max())
    capped = cp.asnumpy(backend.softcap(cp.asarray(x * 10), 30.0))
    np.testing.assert_allclose(capped, np.float32(30.0) * np.tanh(x * 10 / np.float32(30.0)), rtol=1e-6, atol=1e-6)


# ---- KV cache and attention -------------------------------------------------------------------------------

def _layer_pair(backend, kv_type: str, head_dim: int = 64, n_kv: int = 2, capacity: int = 40, ring: bool = False,
                window: int = 0, v_type: str | None = None, v_head_dim: int | None = None):
    from cupyllm.kv.gpu_cache import device_layer_factory
    from cupyllm.ops.kv_formats.gpu import GpuKVCodec
    from cupyllm.kv.cache import LayerKV
    from cupyllm.ops.kv_formats.formats import get_format
    v_head_dim = v_head_dim or head_dim
    fmt, v_fmt = get_format(kv_type, head_dim=head_dim), get_format(v_type or kv_type, head_dim=v_head_dim)
    make = device_layer_factory(lambda f, d, n: GpuKVCodec(f, d, n, registry=backend.registry), backend.inputs)
    args = (fmt, v_fmt, n_kv, head_dim, v_head_dim)
    options = dict(capacity=capacity, ring=ring, window=window)
    return LayerKV(*args, **options), make(*args, **options)


# (K type, V type, V head dim): one launch encodes K and V of one encoder (kv_encode.cu gridDim.y = 2), V of a
# wider head included; other formats or group sizes take a launch each
KV_WRITES = [("f16", None, None), ("q8_0", None, None), ("q4_0", None, None), ("turbo3", None, None),
             ("turbo3_tcq", None, None), ("q8_0", "turbo3", None), ("q8_0", None, 128), ("turbo3", None, 128)]


@pytest.mark.parametrize("kv_type,v_type,v_head_dim", KV_WRITES)
def test_device_cache_holds_the_cpu_cache_bytes(backend, cp, kv_type, v_type, v_head_dim):
    rng = np.random.default_rng(11)
    for ring in (False, True):
        cpu, gpu = _layer_pair(backend, kv_type, capacity=24 if ring else 60, ring=ring, window=16 if ring else 0,
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


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (9, 0.0), (0, 20.0)])
def test_decode_attention_matches_reference(backend, cp, window, softcap):
    from cupyllm.ops.attention.reference import attend, causal_mask
    from cupyllm.ops.attention.gpu_decoded import attend_decoded
    rng = np.random.default_rng(12)
    cpu, gpu = _layer_pair(backend, "f16", capacity=64, n_kv=2, ring=window > 0, window=window)
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
    cpu, gpu = _layer_pair(backend, "q8_0", capacity=64)
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


# ---- whole models -----------------------------------------------------------------------------------------

def _numpy_forward(ops, transformer):
    def forward(tokens, positions, cache, all_logits=False):
        return ops.to_numpy(transformer.forward(tokens, positions, cache, all_logits))
    return forward


def _run(ops, path, ids, chunk: int, kv_type: str = "f16", decode_steps=(), normalize_k: bool | None = None):
    """All-position logits of `ids` prefilled in chunks of `chunk`, then the logits of one-token steps."""
    from cupyllm.generate import prefill
    from cupyllm.files.gguf import read_gguf
    from cupyllm.kv.cache import KVCache, KVSpec
    from cupyllm.models.build import Transformer
    transformer = Transformer.from_gguf(read_gguf(path), ops, progress=False)
    spec = KVSpec(ctx=128, kv_type_k=kv_type, kv_type_v=kv_type, max_chunk=max(chunk, 1), normalize_k=normalize_k)
    if ops.name == "gpu":
        cache = ops.new_cache(transformer.cfg, spec)
    else:
        cache = KVCache.for_model(transformer.cfg, spec)
    forward = _numpy_forward(ops, transformer)
    logits = [prefill(forward, ids, cache, chunk, all_logits=True)]
    for token in decode_steps:
        logits.append(forward(np.array([token]), np.array([cache.n_past]), cache))
        cache.n_past += 1
    return np.concatenate(logits)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3-moe", "gemma3", "gemma4", "gemma4-moe"])
def test_tiny_model_logits_match_the_cpu_engine(tiny_model, arch, monkeypatch):
    """Prefill in GEMV-sized chunks, then decode steps (gemma3's 6-token window is crossed), against the CPU
    engine; then both prefill paths (f16 W and x) over the whole prompt. The CPU engine runs every matmul through
    its float32 tiles here (ACTIVATION_CODES off): the GPU's GEMVs multiply float32 activations, the CPU's
    16-bit codes, and a near-tied expert choice of the MoE models can flip on that difference."""
    from cupyllm.backend.cpu import CPUBackend
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.ops.matmul import cpu as cpu_linear
    path, _, _ = tiny_model(arch)
    ids = [5, 17, 99, 3, 42, 7, 11, 64, 200, 1, 33, 18, 77]
    steps = [9, 120, 4]
    with monkeypatch.context() as patch:
        patch.setattr(cpu_linear, "ACTIVATION_CODES", False)
        want = _run(CPUBackend(), path, ids, chunk=4, decode_steps=steps)
    scale = np.abs(want).max()
    got = _run(GPUBackend(attention="decode"), path, ids, chunk=4, decode_steps=steps)
    assert np.abs(got - want).max() <= 2e-4 * scale
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    if arch.endswith("-moe"):
        return  # f16 activations can flip a near-tied expert choice, a jump no tolerance covers; GEMVs are f32
    for prefill_path in ("cublas", "mma"):
        got = _run(GPUBackend(prefill=prefill_path, attention="decode"), path, ids, chunk=len(ids))
        assert np.abs(got - want[:len(ids)]).max() <= 5e-3 * scale, prefill_path


@pytest.fixture(scope="module")
def flash_sized_models(tmp_path_factory):
    """Tiny models with head_dim 64 (Gemma 4: 64 on sliding layers, 128 on global ones), sizes the
    flash-attention kernels (ops/attention/gpu_dispatch.py) cover. Gemma 3's gate and up of one type (as the real
    models have them: the fused gated GEMV), Qwen2's of two (the GEMVs and gated_act apart)."""
    import dataclasses

    import make_tiny_models
    from gguf import GGMLQuantizationType as T
    out = {}
    for arch, n_layer in (("qwen2", 2), ("gemma3", 6), ("gemma4", 7)):
        path = tmp_path_factory.mktemp("flash") / f"tiny-{arch}-64.gguf"
        spec = make_tiny_models.tiny_spec(arch)
        types = {**spec.types, "ffn_up.weight": spec.types["ffn_gate.weight"]} if arch == "gemma3" else spec.types
        spec = dataclasses.replace(spec, n_layer=n_layer, head_dim=64, global_head_dim=128 if arch == "gemma4" else 0,
                                   types=types)
        make_tiny_models.write_gguf(spec, path)
        out[arch] = path
    return out


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "gemma4"])
def test_tiny_model_with_flash_attention(flash_sized_models, arch):
    """The whole engine with the in-register flash attention against the CPU engine (same bounds)."""
    pytest.importorskip("cupyllm.ops.attention.gpu_dispatch")
    from cupyllm.backend.cpu import CPUBackend
    from cupyllm.backend.gpu import GPUBackend
    path = flash_sized_models[arch]
    ids = [5, 17, 99, 3, 42, 7, 11, 64, 200, 1, 33, 18, 77]
    steps = [9, 120, 4]
    want = _run(CPUBackend(), path, ids, chunk=4, decode_steps=steps)
    scale = np.abs(want).max()
    ops = GPUBackend(attention="dispatch")
    got = _run(ops, path, ids, chunk=4, decode_steps=steps)
    # f16 caches decode on fa_mma's f16 path (Q and P rounded to f16 for the tensor cores, as in prefill)
    assert np.abs(got - want).max() <= 5e-3 * scale
    got = _run(ops, path, ids, chunk=len(ids))
    assert np.abs(got - want[:len(ids)]).max() <= 5e-3 * scale


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_normalized_keys_match_the_cpu_engine(flash_sized_models, arch):
    """KVSpec.normalize_k on the GPU: the flash kernels read the normalised rows with Q scaled (softmax does not
    see the offset), the decoding path undoes the normalisation; both against the CPU engine's normalised
    cache, and against the raw q8_0 cache (which the switch must change)."""
    from cupyllm.backend.cpu import CPUBackend
    from cupyllm.backend.gpu import GPUBackend
    path = flash_sized_models[arch]
    ids = [5, 17, 99, 3, 42, 7, 11, 64, 200, 1, 33, 18, 77]
    steps = [9, 120, 4]
    want = _run(CPUBackend(), path, ids, chunk=4, kv_type="q8_0", decode_steps=steps, normalize_k=True)
    raw = _run(CPUBackend(), path, ids, chunk=4, kv_type="q8_0", decode_steps=steps, normalize_k=False)
    assert np.abs(raw - want).max() > 0
    scale = np.abs(want).max()
    for attention in ("dispatch", "decode"):
        got = _run(GPUBackend(attention=attention), path, ids, chunk=4, kv_type="q8_0", decode_steps=steps,
                   normalize_k=True)
        # q8_0 K and V decode to f16 on the GPU paths (about 1e-3 relative), which a q8_0 cache without
        # centring shows against the CPU as well
        assert np.abs(got - want).max() <= 1e-2 * scale, attention


@pytest.mark.parametrize("arch", ["qwen2", "gemma4"])
@pytest.mark.parametrize("attention", ["decode", "dispatch"])
def test_decode_graphs_replay_the_eager_steps(flash_sized_models, attention, arch):
    """DecodeGraphs gives the eager logits step by step; on a GPU the steps after the first of a bucket replay
    a captured graph (CuPy stream capture), with either attention path (Gemma 4: sliding rings, per-layer
    embeddings and layers reading shared caches inside the graph)."""
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.generate import prefill
    from cupyllm.files.gguf import read_gguf
    from cupyllm.kv.cache import KVSpec
    from cupyllm.models.build import Transformer
    if attention == "dispatch":
        pytest.importorskip("cupyllm.ops.attention.gpu_dispatch")
    path = flash_sized_models[arch]
    ops = GPUBackend(attention=attention)
    transformer = Transformer.from_gguf(read_gguf(path), ops, progress=False)
    spec = KVSpec(ctx=64, max_chunk=8)
    eager_cache, graph_cache = ops.new_cache(transformer.cfg, spec), ops.new_cache(transformer.cfg, spec)
    eager = _numpy_forward(ops, transformer)
    graphs = ops.decode_forward(transformer.forward, min_bucket=16)
    prompt = [5, 17, 99, 3, 42]
    prefill(eager, prompt, eager_cache, 8)
    prefill(eager, prompt, graph_cache, 8)
    for token in [7, 11, 64, 200, 1, 33, 18, 77, 9, 120, 4, 6, 8, 10, 12, 14]:  # crosses the 16-slot bucket
        want = eager(np.array([token]), np.array([eager_cache.n_past]), eager_cache)
        got = ops.to_numpy(graphs(np.array([token]), np.array([graph_cache.n_past]), graph_cache))
        eager_cache.n_past += 1
        graph_cache.n_past += 1
        # The flash kernels add the padded, empty slots of a graph's bucket as exact zeros tile by tile; the
        # decoded path's CuPy reductions sum over the slot count, so padding changes their association: that
        # path is held to the engine's GPU-vs-CPU decode bound instead.
        bound = 1e-5 if attention == "dispatch" else 2e-4
        np.testing.assert_allclose(got, want, rtol=bound, atol=bound * np.abs(want).max())
    if not emulated():  # the emulator has no stream capture: the runner must have fallen back to eager steps
        assert graphs.enabled, f"graph capture failed: {graphs.disabled_reason}"
        assert graphs.captures == 2 and graphs.replays == 14


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_prompt_cache_on_the_device(flash_sized_models, arch):
    """Prompt caching with the cache in GPU memory: host copies restored in place (captured decode graphs read
    the same arrays), greedy text as a fresh run's, also when cut back to the shared part (Gemma: sliding rings)."""
    import cupyllm
    model = cupyllm.load(flash_sized_models[arch], device="gpu", ctx=64, max_chunk=8, progress=False)
    prefix, tail = [5, 17, 99, 3, 42, 7, 11, 64, 200, 1, 33, 18], [77, 9]
    fresh = model.generate(prefix + tail, max_tokens=4, temperature=0)
    cached = model.cache_prompt(prefix)
    scribble = list(range(120, 150))  # another prompt through the working cache: a restore must replace it all
    model.generate(scribble, max_tokens=2, temperature=0)
    assert model.generate(prefix + tail, max_tokens=4, temperature=0, prompt_cache=cached) == fresh
    assert model.last_stats.cached_tokens == len(prefix)
    longer = model.cache_prompt(prefix + [6, 8, 10])
    model.generate(scribble, max_tokens=2, temperature=0)
    assert model.generate(prefix + tail, max_tokens=4, temperature=0, prompt_cache=longer) == fresh
    assert model.last_stats.cached_tokens == len(prefix)


def test_import_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['cupy_backends'] = None\n"
            "import cupyllm, cupyllm.backend.gpu as g, cupyllm.ops.matmul.gpu as k\n"
            "assert k.kernel_sets()\n"
            "from cupyllm.errors import DeviceError\n"
            "try:\n    g.GPUBackend()\n    raise SystemExit('GPUBackend built without CuPy')\n"
            "except DeviceError:\n    pass\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# ---- the real models -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma", "qwen"])
def test_real_model_logits_match_transformers(name):
    """HF transformers' stored top-32 logits (tests/data/hf_reference_*.npz): the GEMV path (chunks of 8) within
    the CPU engine's bound, the f16 prefill paths within their stated one."""
    if emulated():
        pytest.skip("the real models are too large for the CPU emulator")
    from cupyllm.backend.gpu import GPUBackend
    from models import gemma_path, qwen_path
    path = {"gemma": gemma_path, "qwen": qwen_path}[name]()
    ref = np.load(REPO / "tests" / "data" / f"hf_reference_{name}.npz")
    ids = ref["ids_0"].tolist()
    top_idx, top_val = ref["top_idx_0"].astype(np.int64), ref["top_val_0"]
    for prefill_path, chunk, bound, agree in (("cublas", 8, 0.02, 1.0), ("cublas", 512, 0.1, 0.95),
                                              ("mma", 512, 0.1, 0.95)):
        logits = _run(GPUBackend(prefill=prefill_path), path, ids, chunk=chunk)
        diff = np.abs(np.take_along_axis(logits, top_idx, axis=-1) - top_val).max()
        assert diff <= bound, f"{name} {prefill_path} chunk {chunk}: max |dlogit| over HF's top-32 = {diff}"
        assert np.mean(logits.argmax(-1) == top_idx[:, 0]) >= agree
