"""Fused Dual Chunk Attention on the GPU (kernels_cu/attention/dca_fused.cu: the DCA instantiations of the fa_vec.cuh and
fa_mma.cuh templates, run by cupyllm/ops/attention/gpu_dca.py) against two independent computations of the same (O, LSE):

* NumPy: ``cupyllm.ops.attention.dca.attend_dca`` (three masked attentions merged by LSE) over the NumPy-decoded
  cache, the definition;
* the three-call LSE path on the GPU: ``dispatch.gpu_attention_lse`` once per regime with an additive mask that
  keeps that regime's keys (the plain kernel instantiations), merged with ``reference.merge``.

Random K/V rows are encoded with the NumPy KV formats (same-format, asymmetric and rotated pairs), the three
query rotations are independent random arrays (any mix-up of the rotations shows), slot j holds position j.
Chunk lengths L = S - W of 56 (key tiles of 32 / 64 straddle chunk boundaries: the kernels' several-regime
passes), 32 (tiles aligned with the chunks) and 88 with YaRN's logit scale; cache lengths that are not a
multiple of L; queries at the end of the cache (decode), in chunk 0 (successive and inter regimes empty), on
chunk boundaries, spread over every chunk with a row that sees no key (prefill). Tolerances as in
tests/ops/test_attention_gpu.py: FA-VEC computes in f32 on the exact decoded values; MMA is compared with the
references on the f16-rounded Q (scaled, rotated for rotated K formats), K and V it multiplies.

Skipped without a CUDA device; ``CUPYLLM_EMULATE=1`` runs it on the CPU emulator (tests/support/cuda_emu), where
tests/test_emulated_kernels.py runs a subset in CI.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

from gpu_helpers import (GPU_TEST_MARKS, MMA_TOL_LSE, MMA_TOL_O, VEC_TOL, emulated, get_test_format,
                         mma_lacks_shared_memory, rounded_f16, rounded_f16_query)

pytestmark = GPU_TEST_MARKS

HEAD_DIMS = (64, 128, 256, 512)
# (S, W, yarn factor): chunk_len L = S - W
CONFIGS = {"L56": (64, 8, 1.0), "L32": (40, 8, 1.0), "L88_yarn": (100, 12, 4.0)}
# query sets: "end" = the last positions (decode), "chunk0" = inside chunk 0, "boundary" = first/last
# positions of chunks, "spread" = every chunk plus a row without position (prefill shapes only)
DECODE_QUERIES = ("end", "chunk0", "boundary")


def _formats():
    from cupyllm.ops.kv_formats.formats import list_formats
    return list_formats()


def _pairs(head_dim: int) -> list[tuple[str, str]]:
    """Each format once as K and once as V, pairs shifted per head dim (same-format at 64)."""
    names = _formats()
    shift = {64: 0, 128: 3, 256: 7, 512: 11}[head_dim]
    return [(k, names[(i + shift) % len(names)]) for i, k in enumerate(names)]


CASES = [(d, k, v, list(CONFIGS)[i % len(CONFIGS)]) for d in HEAD_DIMS for i, (k, v) in enumerate(_pairs(d))]


@pytest.fixture(scope="module")
def runner():
    from cupyllm.ops.attention.gpu_dispatch import GpuAttention
    return GpuAttention()


def _dca(config: str):
    from cupyllm.ops.attention.dca import DCAConfig
    return DCAConfig(*CONFIGS[config])


def make_layer(rng, k_name: str, v_name: str, head_dim: int, n_kv: int, n_slots: int, n_used: int | None = None):
    """A LayerKV-like device cache (slot j = position j, slots past n_used empty) and its NumPy decode."""
    import cupy as cp
    kf, vf = get_test_format(k_name, head_dim), get_test_format(v_name, head_dim)
    k = (rng.standard_normal((n_slots, n_kv, head_dim)) * 1.5).astype(np.float32)
    v = rng.standard_normal((n_slots, n_kv, head_dim)).astype(np.float32)
    v[:, :, rng.choice(head_dim, 2, replace=False)] *= 8.0  # outlier channels
    k_bytes = kf.encode(k.reshape(-1, head_dim)).reshape(n_slots, n_kv, -1)
    v_bytes = vf.encode(v.reshape(-1, head_dim)).reshape(n_slots, n_kv, -1)
    n_used = n_slots if n_used is None else n_used
    pos = np.where(np.arange(n_slots) < n_used, np.arange(n_slots), -1).astype(np.int32)
    return types.SimpleNamespace(
        k_format=kf, v_format=vf, n_kv=n_kv, head_dim=head_dim, v_head_dim=head_dim, ring=False, n_used=n_used,
        k_data=cp.asarray(k_bytes), v_data=cp.asarray(v_bytes), slot_pos=cp.asarray(pos), host_pos=pos,
        k=kf.decode(k_bytes.reshape(n_slots * n_kv, -1), head_dim).reshape(n_slots, n_kv, head_dim),
        v=vf.decode(v_bytes.reshape(n_slots * n_kv, -1), head_dim).reshape(n_slots, n_kv, head_dim))


def query_positions(kind: str, n_q: int, n_used: int, chunk_len: int, rng) -> np.ndarray:
    if kind == "end":
        return np.arange(n_used - n_q, n_used, dtype=np.int32)
    if kind == "chunk0":  # intra only: the successive and inter Q must not matter
        return np.sort(rng.choice(min(chunk_len, n_used), n_q, replace=False)).astype(np.int32)
    if kind == "boundary":  # first and last positions of chunks: one-key intra ranges, full successive ones
        edges = [c * chunk_len + e for c in range(1, n_used // chunk_len + 1) for e in (0, -1)]
        edges = [p for p in edges if p < n_used] + [n_used - 1]
        return np.array(sorted(set(edges))[-n_q:], np.int32)
    assert kind == "spread"  # prefill: every chunk, one row without position (O = 0, LSE = -inf)
    q_pos = np.sort(rng.choice(n_used, n_q - 1, replace=False))
    return np.concatenate([q_pos[:1], [-1], q_pos[1:]]).astype(np.int32)


def numpy_reference(q3, q_pos, layer, dca, *, scale, softcap=0.0, f16_inputs=False):
    """attend_dca over the cache's decoded slots [0, n_used); f16_inputs: on what fa_mma multiplies."""
    from cupyllm.ops.attention.dca import attend_dca
    n = layer.n_used
    k, v, k_pos = layer.k[:n], layer.v[:n], layer.host_pos[:n]
    if f16_inputs:
        q3 = [rounded_f16_query(q, layer.k_format, scale * dca.logit_scale) for q in q3]
        k, v = rounded_f16(k, layer.k_format), rounded_f16(v, layer.v_format)
        scale = 1.0 / dca.logit_scale  # the queries carry the whole logit scale already
    return attend_dca(*q3, k, v, q_pos, k_pos, dca, scale=scale, softcap=softcap)


def three_call_path(runner, q3, q_pos, layer, dca, *, scale, softcap, kernel):
    """One plain GPU attention per regime (additive mask: 0 on that regime's keys, -inf elsewhere), merged by LSE."""
    import cupy as cp
    from cupyllm.ops.attention.dca import regimes
    from cupyllm.ops.attention.reference import merge
    regime = regimes(q_pos, layer.host_pos, dca)
    out = lse = None
    for which, q in enumerate(q3):
        mask = np.where(regime == which, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
        o, l = runner.attention_lse(cp.asarray(q), q_pos, layer, scale=scale * dca.logit_scale, softcap=softcap,
                                    mask=mask, kernel=kernel)
        o, l = cp.asnumpy(o).astype(np.float32), cp.asnumpy(l)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    return out, lse


def _check(o, lse, ref_o, ref_lse, v_max, tol_o, tol_lse, what):
    o = np.asarray(o, np.float32)
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape
    assert not np.isnan(o).any() and not np.isnan(lse).any(), f"{what}: NaN"
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite), f"{what}: rows without visible keys differ"
    assert (lse[~finite] == -np.inf).all() and (o[~finite] == 0).all(), f"{what}: an empty row is not O = 0, LSE = -inf"
    err_o = np.abs(o - ref_o).max() / v_max
    err_lse = np.abs(lse[finite] - ref_lse[finite]).max(initial=0.0)
    assert err_o <= tol_o, f"{what}: max |dO| / max|V| = {err_o:.3g} > {tol_o}"
    assert err_lse <= tol_lse, f"{what}: max |dLSE| = {err_lse:.3g} > {tol_lse}"


# (n_q, n_head, n_kv): decode (FA-VEC and MMA's decode tiles) and prefill (MMA's 64-row tiles, two row blocks)
DECODE_SHAPE = (2, 8, 2)
PREFILL_SHAPE = (24, 8, 2)


def _n_slots(kernel: str) -> int:
    """Cache slots (the last 5 empty): several chunks of every L, not a multiple of any; fewer on the emulator."""
    if emulated():
        return 181 if kernel == "vec" else 150
    return 1499 if kernel == "vec" else 701


def run_case(runner, head_dim, k_name, v_name, config, kernel, queries, *, shape=None, seed=0, softcap=0.0,
             n_split=None, three_call=True):
    import cupy as cp
    from cupyllm.ops.attention.gpu_dca import gpu_dca_attention_lse
    rng = np.random.default_rng(seed)
    dca = _dca(config)
    n_q, n_head, n_kv = shape or (PREFILL_SHAPE if queries == "spread" else DECODE_SHAPE)
    n_slots = _n_slots(kernel)
    layer = make_layer(rng, k_name, v_name, head_dim, n_kv, n_slots, n_used=n_slots - 5)
    q_pos = query_positions(queries, n_q, layer.n_used, dca.chunk_len, rng)
    n_q = len(q_pos)
    q3 = [rng.standard_normal((n_q, n_head, head_dim)).astype(np.float32) for _ in range(3)]
    scale = head_dim ** -0.5
    if kernel == "mma" and mma_lacks_shared_memory(runner, layer, n_q, n_head, head_dim):
        from cupyllm.ops.attention.gpu_dispatch import AttentionArgumentError
        with pytest.raises(AttentionArgumentError, match="shared memory.*use kernel='vec'"):
            gpu_dca_attention_lse(*(cp.asarray(q) for q in q3), q_pos, layer, dca, scale=scale, kernel=kernel,
                                  runner=runner)
        return None
    o, lse = gpu_dca_attention_lse(*(cp.asarray(q) for q in q3), q_pos, layer, dca, scale=scale, softcap=softcap,
                                   kernel=kernel, n_split=n_split, runner=runner)
    o, lse = cp.asnumpy(o), cp.asnumpy(lse)
    what = f"{kernel} d={head_dim} K={k_name} V={v_name} {config} {queries}"
    v_max = float(np.abs(layer.v).max())
    tol = (VEC_TOL, VEC_TOL * 10) if kernel == "vec" else (MMA_TOL_O, MMA_TOL_LSE)
    ref_o, ref_lse = numpy_reference(q3, q_pos, layer, dca, scale=scale, softcap=softcap, f16_inputs=kernel == "mma")
    _check(o, lse, ref_o, ref_lse, v_max, *tol, what + " vs NumPy attend_dca")
    if three_call:
        ref_o, ref_lse = three_call_path(runner, q3, q_pos, layer, dca, scale=scale, softcap=softcap, kernel=kernel)
        _check(o, lse, ref_o, ref_lse, v_max, *tol, what + " vs the three-call LSE path")
    return o, lse


@pytest.mark.parametrize("head_dim,k_name,v_name,config", CASES)
def test_vec_decode_matches_references(runner, head_dim, k_name, v_name, config):
    queries = DECODE_QUERIES[_formats().index(k_name) % len(DECODE_QUERIES)]
    run_case(runner, head_dim, k_name, v_name, config, "vec", queries)


@pytest.mark.parametrize("head_dim,k_name,v_name,config", CASES)
def test_mma_decode_matches_references(runner, head_dim, k_name, v_name, config):
    """fa_mma's decode layout (<= 16 rows: one tile, warps splitting the keys)."""
    queries = DECODE_QUERIES[(_formats().index(k_name) + 1) % len(DECODE_QUERIES)]
    run_case(runner, head_dim, k_name, v_name, config, "mma", queries)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_mma_f16_decode_path_matches_references(runner, head_dim, config):
    """fa_mma's f16 path (K and V f16, decode) with DCA: Q reloaded per regime, mixed tiles recomputed."""
    from cupyllm.ops.attention import gpu as fk
    from cupyllm.ops.kv_formats.formats import get_format
    f16 = get_format("f16", head_dim=head_dim)
    assert fk.mma_f16_direct(True, f16, f16)
    for queries in DECODE_QUERIES:
        run_case(runner, head_dim, "f16", "f16", config, "mma", queries)


@pytest.mark.parametrize("head_dim,k_name,v_name,config", CASES)
def test_mma_prefill_matches_references(runner, head_dim, k_name, v_name, config):
    run_case(runner, head_dim, k_name, v_name, config, "mma", "spread", softcap=20.0 if head_dim == 256 else 0.0)


@pytest.mark.parametrize("kernel", ("vec", "mma"))
def test_split_count_does_not_change_the_result(runner, kernel):
    """1, 3 and the automatic number of splits: each split is one pass, fa_combine merges them by LSE."""
    results = [run_case(runner, 128, "q8_0", "turbo4", "L56", kernel, "end", n_split=s, three_call=False)
               for s in (1, 3, None)]
    for o, lse in results[1:]:
        np.testing.assert_allclose(o, results[0][0], atol=2e-5 if kernel == "vec" else 2e-3)
        np.testing.assert_allclose(lse, results[0][1], atol=2e-4)


def test_float16_queries_and_softcap(runner):
    import cupy as cp
    from cupyllm.ops.attention.gpu_dca import gpu_dca_attention_lse
    rng = np.random.default_rng(4)
    dca = _dca("L32")
    layer = make_layer(rng, "f16", "q4_0", 256, 1, 90)
    q3 = [rng.standard_normal((3, 4, 256)).astype(np.float16) for _ in range(3)]
    q_pos = np.array([89, 60, 10], np.int32)
    for kernel in ("vec", "mma"):
        o, lse = gpu_dca_attention_lse(*(cp.asarray(q) for q in q3), q_pos, layer, dca, scale=0.0625, softcap=30.0,
                                       kernel=kernel, runner=runner)
        assert o.dtype == np.float16 and lse.dtype == np.float32
        ref_o, ref_lse = numpy_reference([q.astype(np.float32) for q in q3], q_pos, layer, dca, scale=0.0625,
                                         softcap=30.0, f16_inputs=kernel == "mma")
        _check(cp.asnumpy(o), cp.asnumpy(lse), ref_o, ref_lse, float(np.abs(layer.v).max()), 2e-3, 2e-3,
               f"{kernel} f16 q")


def test_rows_without_keys_give_zero_and_minus_infinity(runner):
    """Every slot empty, or no query position: O = 0, LSE = -inf, no NaN, on both kernels and with splits."""
    import cupy as cp
    from cupyllm.ops.attention.gpu_dca import gpu_dca_attention_lse
    rng = np.random.default_rng(5)
    dca = _dca("L56")
    layer = make_layer(rng, "q8_0", "turbo3", 128, 2, 70)
    q3 = [cp.asarray(rng.standard_normal((2, 4, 128)).astype(np.float32)) for _ in range(3)]
    empty = types.SimpleNamespace(**vars(layer))
    empty.slot_pos = cp.full(70, -1, dtype=cp.int32)
    empty.ring = True  # slot positions are not slot indices: every slot is read and masked
    for lay, q_pos in ((empty, np.array([69, 3], np.int32)), (layer, np.array([-1, -1], np.int32))):
        for kernel, n_split in (("vec", None), ("vec", 2), ("mma", None), ("mma", 2)):
            o, lse = gpu_dca_attention_lse(*q3, q_pos, lay, dca, scale=0.1, kernel=kernel, n_split=n_split,
                                           runner=runner)
            o, lse = cp.asnumpy(o), cp.asnumpy(lse)
            assert (o == 0).all() and (lse == -np.inf).all(), (kernel, n_split)


def test_bad_arguments_raise(runner):
    import cupy as cp
    from cupyllm.ops.attention.gpu_dispatch import AttentionArgumentError
    from cupyllm.ops.attention.gpu_dca import gpu_dca_attention
    rng = np.random.default_rng(6)
    layer = make_layer(rng, "f16", "f16", 64, 2, 40)
    q = cp.zeros((1, 4, 64), cp.float32)
    with pytest.raises(AttentionArgumentError, match="one shape and dtype"):
        gpu_dca_attention(q, q, cp.zeros((2, 4, 64), cp.float32), np.array([3], np.int32), layer, _dca("L32"),
                          scale=0.1, runner=runner)
    with pytest.raises(AttentionArgumentError, match="head_dim"):
        q_bad = cp.zeros((1, 4, 128), cp.float32)
        gpu_dca_attention(q_bad, q_bad, q_bad, np.array([3], np.int32), layer, _dca("L32"), scale=0.1, runner=runner)


def test_decoding_fallback_matches_numpy():
    """attend_dca_decoded (the backend's path for caches without flash kernels) against attend_dca."""
    import cupy as cp
    from cupyllm.ops.attention.dca import DCAConfig, attend_dca
    from cupyllm.ops.attention.gpu_dca import attend_dca_decoded
    rng = np.random.default_rng(7)
    dca = DCAConfig(20, 4)
    n, n_kv, d = 50, 2, 32
    k = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    k16, v16 = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    pos = np.arange(n)

    class Decoded(types.SimpleNamespace):
        def decode(self, start, stop):
            return cp.asarray(k16[start:stop]), cp.asarray(v16[start:stop]), cp.asarray(pos[start:stop].astype(np.int32))

    layer = Decoded(xp=cp, n_kv=n_kv, v_head_dim=d, n_used=n)
    q_pos = np.array([3, 17, 33, 49])
    q3 = [rng.standard_normal((4, 6, d)).astype(np.float32) for _ in range(3)]
    got = attend_dca_decoded(*(cp.asarray(q) for q in q3), cp.asarray(q_pos.astype(np.int32)), layer, dca,
                             scale=0.2, softcap=5.0, key_chunk=16)
    want, _ = attend_dca(*q3, k16, v16, q_pos, pos, dca, scale=0.2, softcap=5.0)
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_qwen64(tmp_path_factory):
    """A tiny Qwen2 with head_dim 64 (a head dim the flash kernels cover)."""
    import make_tiny_models
    path = tmp_path_factory.mktemp("dca") / "tiny-qwen2-64.gguf"
    make_tiny_models.write_gguf(make_tiny_models.TinySpec("qwen2", n_layer=2, head_dim=64), path)
    return path


@pytest.mark.parametrize("attention", ["dispatch", "decode"])
def test_engine_dca_matches_the_cpu_engine(tiny_qwen64, attention):
    """A tiny model with DCA (chunks of 10 positions over 40): prefill in chunks then decode steps, the GPU backend's
    dca_attention (fused kernels, or the decoding fallback) against the CPU backend's."""
    from cupyllm.ops.attention.dca import DCAConfig
    from cupyllm.backend.cpu import CPUBackend
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.generate import prefill
    from cupyllm.files.gguf import read_gguf
    from cupyllm.kv.cache import KVCache, KVSpec
    from cupyllm.models.build import Transformer
    from cupyllm.models.layers import dca_attention
    ids = list(np.random.default_rng(8).integers(3, 200, 36))
    steps = [9, 120, 4, 77]

    def run(ops):
        transformer = Transformer.from_gguf(read_gguf(tiny_qwen64), ops, progress=False)
        transformer.attention = dca_attention(DCAConfig(12, 2))
        # raw K: a normalised q8_0 K (the default) sends DCA to the decoding path on the GPU, which
        # test_gpu_backend.py's normalised-K tests cover; here the fused kernels are under test
        spec = KVSpec(ctx=64, kv_type_k="q8_0", kv_type_v="f16", max_chunk=12, normalize_k=False)
        cache = ops.new_cache(transformer.cfg, spec) if ops.name == "gpu" else \
            KVCache.for_model(transformer.cfg, spec)

        def forward(tokens, positions, cache, all_logits=False):
            return ops.to_numpy(transformer.forward(tokens, positions, cache, all_logits))

        logits = [prefill(forward, ids, cache, 12, all_logits=True)]
        for token in steps:
            logits.append(forward(np.array([token]), np.array([cache.n_past]), cache))
            cache.n_past += 1
        return np.concatenate(logits)

    want = run(CPUBackend())
    got = run(GPUBackend(attention=attention))
    scale = np.abs(want).max()
    # prefill chunks of 12 queries (> 8: MMA, K/V/Q/P rounded to f16) then decode (q8_0 K: MMA decode tiles)
    assert np.abs(got - want).max() <= 5e-3 * scale
