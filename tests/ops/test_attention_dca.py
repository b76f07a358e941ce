"""Dual Chunk Attention: the three-regime LSE merge against a dense reference that builds the remapped score
matrix directly; the fused CPU kernel and the chunked stream against both; the engine wiring."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import cupyllm
import make_tiny_models
from cupyllm.ops.attention.dca import DCAConfig, attend_dca, key_positions, query_positions
from cupyllm.ops.attention.cpu import dca_few
from cupyllm.ops.attention.reference import merge
from cupyllm.files.config import RopeConfig
from cupyllm.errors import CupyllmError
from cupyllm.ops.matmul import cpu as cpu_linear
from cupyllm.ops.elementwise.reference import apply_rope, rope_tables

ROPE = RopeConfig(base=10000.0, n_rot=32, neox=True)


def rot(x, positions):
    return apply_rope(x, *rope_tables(ROPE, np.asarray(positions)), ROPE.neox)


def dense_dca(q, k, v, n, dca, scale):
    """Score of every causal (i, j) pair computed from its own remapped positions, then one softmax per row."""
    S, L = dca.chunk_size, dca.chunk_len
    n_head, group = q.shape[1], q.shape[1] // k.shape[1]
    out = np.zeros((n, n_head, v.shape[-1]))
    for i in range(n):
        for h in range(n_head):
            scores = np.empty(i + 1)
            for j in range(i + 1):
                gap = i // L - j // L
                q_at = i % L if gap == 0 else (min(i % L + L, S) if gap == 1 else min(2 * L - 1, S))
                qr = rot(q[i:i + 1, h:h + 1], [q_at])[0, 0].astype(np.float64)
                kr = rot(k[j:j + 1, h // group:h // group + 1], [j % L])[0, 0].astype(np.float64)
                scores[j] = scale * dca.logit_scale * qr @ kr
            p = np.exp(scores - scores.max())
            out[i, h] = p @ v[:i + 1, h // group] / p.sum()
    return out


def roped_inputs(n, dca, n_head=4, n_kv=2, d=32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    pos = np.arange(n)
    q3 = [rot(q, p) for p in query_positions(pos, dca)]
    return q, k, v, q3, rot(k, key_positions(pos, dca)), pos


@pytest.mark.parametrize("S,W,n,yarn", [(16, 4, 40, 1.0), (12, 3, 29, 1.0), (20, 2, 20, 1.0), (10, 4, 33, 4.0)])
def test_three_regime_merge_equals_dense(S, W, n, yarn):
    dca = DCAConfig(S, W, yarn)
    q, k, v, q3, k_roped, pos = roped_inputs(n, dca)
    expected = dense_dca(q, k, v, n, dca, scale=0.2)
    out, lse = attend_dca(*q3, k_roped, v, pos, pos, dca, scale=0.2)
    np.testing.assert_allclose(out, expected, atol=2e-5)
    assert np.isfinite(lse).all()
    few, _ = dca_few(*[x[-3:] for x in q3], k_roped, v, pos[-3:], pos, dca, scale=0.2)  # fused decode kernel
    np.testing.assert_allclose(few, expected[-3:], atol=2e-5)
    blocks = [(k_roped[a:b], v[a:b], pos[a:b]) for a, b in ((0, 7), (7, 8), (8, n))]  # uneven key blocks
    parts = [attend_dca(*q3, kb, vb, pos, pb, dca, scale=0.2) for kb, vb, pb in blocks]
    streamed, _ = functools.reduce(lambda a, b: merge(*a, *b), parts)
    np.testing.assert_allclose(streamed, expected, atol=2e-5)


def test_chunk_zero_queries_and_empty_regimes():
    dca = DCAConfig(16, 4)
    q, k, v, q3, k_roped, pos = roped_inputs(12, dca)  # all in chunk 0: successive and inter are empty
    out, lse = attend_dca(*q3, k_roped, v, pos, pos, dca, scale=0.2)
    plain_q, plain_k = rot(q, pos), rot(k, pos)
    from cupyllm.ops.attention.reference import attend, causal_mask

    ref, ref_lse = attend(plain_q, plain_k, v, causal_mask(pos, pos), scale=0.2)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    masked_pos = np.full(12, -1)  # a block with only empty slots contributes nothing, without NaN
    out, lse = attend_dca(*q3, k_roped, v, pos, masked_pos, dca, scale=0.2)
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    few, few_lse = dca_few(*q3, k_roped, v, pos, masked_pos, dca, scale=0.2)
    assert np.all(few == 0) and np.all(np.isneginf(few_lse))


def test_remaps_keep_distances_within_chunk_size():
    dca = DCAConfig(64, 8)
    pos = np.arange(1000)
    intra, successive, inter = query_positions(pos, dca)
    keys = key_positions(pos, dca)
    assert keys.max() < dca.chunk_len and successive.max() <= 64 and inter.max() <= 64
    assert np.all(intra == pos % 56)


def test_bad_dca_options(tiny_model):
    with pytest.raises(CupyllmError, match="local_size < chunk_size"):
        DCAConfig(16, 16)
    path, _, _ = tiny_model("qwen2")
    with pytest.raises(CupyllmError, match="unknown DCA option"):
        cupyllm.load(path, device="cpu", dca={"chunk": 4}, progress=False)


@pytest.fixture(scope="module")
def gemma6(tmp_path_factory):
    """A tiny Gemma 3 with 6 layers, so layer 5 is a global (DCA) layer beside 5 sliding ones."""
    spec = make_tiny_models.TinySpec("gemma3", n_layer=6, sliding_window=5)
    path = tmp_path_factory.mktemp("gemma6") / "tiny-gemma3-6.gguf"
    make_tiny_models.write_gguf(spec, path)
    return path


@pytest.mark.parametrize("arch", ["qwen2", "gemma6", "gemma4"])
def test_dca_is_plain_attention_when_the_sequence_fits(arch, tiny_model, gemma6, monkeypatch):
    """Logits with DCA equal plain attention's: as the engine runs, within the steps of the matmuls' 16-bit
    activation codes, which turn the merge's last-bit differences into whole code steps (measured up to 1.6e-4),
    and with float32 activations (ACTIVATION_CODES off), where only float32 summation order separates the two."""
    path = gemma6 if arch == "gemma6" else tiny_model(arch)[0]
    ids = list(range(3, 33))  # 30 tokens < S = 32: at most one chunk boundary, distances exact
    kw = dict(device="cpu", ctx=64, kv_type_k="f32", kv_type_v="f32", max_chunk=8, progress=False)
    plain_model = cupyllm.load(path, **kw)
    dca_model = cupyllm.load(path, dca={"chunk_size": 32, "local_size": 4}, **kw)
    np.testing.assert_allclose(dca_model.logits(ids), plain_model.logits(ids), atol=1e-3)
    monkeypatch.setattr(cpu_linear, "ACTIVATION_CODES", False)
    np.testing.assert_allclose(dca_model.logits(ids), plain_model.logits(ids), atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "gemma6", "gemma4"])
def test_dca_prefill_and_decode_agree_past_the_chunk(arch, tiny_model, gemma6):
    path = gemma6 if arch == "gemma6" else tiny_model(arch)[0]
    ids = list(np.random.default_rng(0).integers(3, 200, 60))
    model = cupyllm.load(path, device="cpu", ctx=96, kv_type_k="f32", kv_type_v="f32", max_chunk=16,
                         dca={"chunk_size": 16, "local_size": 4}, progress=False)
    full = model.logits(ids)
    plain = cupyllm.load(path, device="cpu", ctx=96, kv_type_k="f32", kv_type_v="f32", progress=False).logits(ids)
    assert np.abs(full[20:] - plain[20:]).max() > 1e-3  # past S the remap changes the result
    from cupyllm.generate import prefill

    cache = model.new_cache()
    steps = [prefill(model.transformer.forward, ids[:37], cache, 16)]
    for token in ids[37:]:
        steps.append(model.transformer.forward(np.array([token]), np.array([cache.n_past]), cache))
        cache.n_past += 1
    decoded = np.concatenate(steps)
    # decode (GEMV) and prefill (GEMM) multiply the same 16-bit activation codes, summed in other orders: far
    # below what the remap changes (asserted to be 10x more at these positions)
    np.testing.assert_allclose(decoded, full[36:], atol=1.5e-3)
    assert np.abs(decoded - plain[36:]).max() > 10 * np.abs(decoded - full[36:]).max()
