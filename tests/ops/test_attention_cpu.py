"""Decode attention straight from the encoded CPU cache (ops/attention/cpu.py, the path without the float32
mirror): its row decoder against every format's NumPy decode (bit for bit), its attention against the reference
over the decoded cache (plain, sliding window, softcap, K normalisation, DCA), and the engine with
kv_mirror=False against the engine with the mirror."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

import cupyllm
from cupyllm.ops.attention.cpu import BLOCK_KEYS, _merge_blocks, attend_block, attend_encoded, attend_floats
from cupyllm.ops.kv_formats.cpu import HALF_TABLE, decode_row, decode_row_at, decode_rows, row_codec
from cupyllm.ops.attention.dca import DCAConfig, attend_dca
from cupyllm.ops.attention.reference import attend, causal_mask
from cupyllm.errors import CupyllmError
from cupyllm.kv.cache import LayerKV
from cupyllm.ops.kv_formats.formats import get_format, is_rotated, list_formats
from cupyllm.ops.matmul import cpu as cpu_linear


@pytest.mark.parametrize("head_dim", [4, 64, 128])
@pytest.mark.parametrize("name", list_formats())
def test_the_row_decoder_matches_each_formats_decode(name, head_dim):
    if head_dim % get_format(name).block_values and not is_rotated(name):
        pytest.skip(f"{name} has no rows of {head_dim} values")
    fmt = get_format(name, head_dim=head_dim)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 2 * head_dim)) * rng.uniform(0.1, 5.0, (6, 1))).astype(np.float32)
    if name in ("f32", "f16", "bf16"):  # the edges of the float formats: zeros, subnormal halves, inf
        x[0, :4] = [0.0, -0.0, 3e-6, -6e-8]
        x[1, :3] = [np.inf, -np.inf, np.nan]
    data = fmt.encode(x)
    want = fmt.decode_rotated(data, x.shape[1]) if is_rotated(name) else fmt.decode(data, x.shape[1])
    codec, table = row_codec(fmt)
    bits = np.empty(max(x.shape[1], (data.shape[1] + 7) // 4), np.uint32)
    for row, expected in zip(data, want):
        got = np.empty(x.shape[1], np.float32)
        decode_row(row, codec, table, HALF_TABLE, bits, bits.view(np.float32), got)
        np.testing.assert_array_equal(got, expected)
    flat = data.reshape(-1)  # the rows in place, as attention reads the cache: the last one ends the array
    for i, expected in enumerate(want):
        got = np.empty(x.shape[1], np.float32)
        decode_row_at(flat, i * data.shape[1], codec, table, HALF_TABLE, bits, bits.view(np.float32), got)
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))  # NaN payloads too
    np.testing.assert_array_equal(decode_rows(fmt, data, x.shape[1]), fmt.decode(data, x.shape[1]))  # unrotated


def _filled_layer(rng, k_type, v_type, *, n_kv, head_dim, n_slots, normalize_k):
    """A LayerKV without a mirror holding n_slots keys, written in three chunks (the first sets K's normalisation),
    then given shuffled slot positions (as a ring holds them) and a few empty slots."""
    layer = LayerKV(get_format(k_type, head_dim=head_dim), get_format(v_type, head_dim=head_dim), n_kv, head_dim,
                    head_dim, capacity=n_slots, ring=False, normalize_k=normalize_k)
    k = rng.standard_normal((n_slots, n_kv, head_dim)) + rng.standard_normal((1, n_kv, head_dim)) * 3
    v = rng.standard_normal((n_slots, n_kv, head_dim))
    q = rng.standard_normal((n_slots, 2 * n_kv, head_dim))
    for chunk in np.array_split(np.arange(n_slots), 3):
        layer.write(k[chunk].astype(np.float32), v[chunk].astype(np.float32), chunk, queries=q[chunk])
    layer.slot_pos[:] = rng.permutation(n_slots)
    layer.slot_pos[rng.choice(n_slots, 7, replace=False)] = -1
    return layer


@pytest.mark.parametrize("k_type,v_type", [("f16", "f16"), ("bf16", "f32"), ("q8_0", "q4_0"), ("q6_0", "q5_1"),
                                           ("q5_0", "q4_1"), ("turbo4", "turbo2"), ("turbo3", "turbo3_tcq"),
                                           ("turbo2_tcq", "q8_0")])
@pytest.mark.parametrize("normalize_k", [False, True])
def test_encoded_attention_matches_the_reference_over_the_decoded_cache(k_type, v_type, normalize_k):
    rng = np.random.default_rng(7)
    n_kv, group, head_dim = 2, 3, 64
    n_slots = BLOCK_KEYS + 90  # two key blocks: the split-K merge counts
    layer = _filled_layer(rng, k_type, v_type, n_kv=n_kv, head_dim=head_dim, n_slots=n_slots,
                          normalize_k=normalize_k)
    k, v, k_pos = layer.decode(0, layer.n_used)
    q = rng.standard_normal((3, n_kv * group, head_dim)).astype(np.float32)
    q_pos = np.array([3, 200, n_slots - 1])
    for window, softcap in ((0, 0.0), (40, 0.0), (0, 15.0)):
        want, want_lse = attend(q, k, v, causal_mask(q_pos, k_pos, window), scale=0.2, softcap=softcap)
        got, got_lse = attend_encoded(q, q_pos, layer, scale=0.2, window=window, softcap=softcap)
        np.testing.assert_allclose(got, want, atol=2e-5)
        np.testing.assert_allclose(got_lse, want_lse, atol=2e-5)
    layer.slot_pos[:] = -1  # nothing visible: zeros and -inf, no NaN
    empty, empty_lse = attend_encoded(q, q_pos, layer, scale=0.2)
    assert np.all(empty == 0) and np.all(np.isneginf(empty_lse))


@pytest.mark.parametrize("n_kv,group,head_dim,value_dim", [(1, 4, 256, 256), (2, 7, 64, 64), (1, 8, 80, 80),
                                                           (1, 5, 72, 40), (3, 1, 16, 8)])
def test_the_kernel_tiles_match_the_reference_for_every_group_and_width(n_kv, group, head_dim, value_dim):
    """The float32 rows through every tile of the kernel: dot products four heads at a time and one at a time, value
    sums in 4-row x 64-column tiles, 4 x 16, 1 x 64, 1 x 16 and the scalar tail; several queries that see different
    keys (one of them none in a whole block), sliding window and softcap, empty slots."""
    rng = np.random.default_rng(group * 1000 + head_dim)
    n_slots = 2 * BLOCK_KEYS + 37
    k = rng.standard_normal((n_slots, n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((n_slots, n_kv, value_dim)).astype(np.float32)
    k_pos = rng.permutation(n_slots)
    k_pos[rng.choice(n_slots, 9, replace=False)] = -1
    q = rng.standard_normal((3, n_kv * group, head_dim)).astype(np.float32)
    q_pos = np.array([5, 300, n_slots - 1])
    for window, softcap in ((0, 0.0), (60, 0.0), (0, 12.0)):
        want, want_lse = attend(q, k, v, causal_mask(q_pos, k_pos, window), scale=0.15, softcap=softcap)
        got, got_lse = attend_floats(q, k, v, q_pos, k_pos, scale=0.15, window=window, softcap=softcap)
        np.testing.assert_allclose(got, want, atol=2e-5)
        np.testing.assert_allclose(got_lse, want_lse, atol=2e-5)


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("turbo3_tcq", "turbo3")])
def test_encoded_dca_matches_the_dca_reference_over_the_decoded_cache(k_type, v_type):
    rng = np.random.default_rng(11)
    n_kv, head_dim, n_slots = 2, 128, 700
    layer = _filled_layer(rng, k_type, v_type, n_kv=n_kv, head_dim=head_dim, n_slots=n_slots, normalize_k=True)
    dca = DCAConfig(chunk_size=160, local_size=16)
    k, v, k_pos = layer.decode(0, layer.n_used)
    q3 = rng.standard_normal((3, 2, 2 * n_kv, head_dim)).astype(np.float32)
    q_pos = np.array([100, n_slots - 1])  # a chunk-0 query (no successive / inter keys) and a late one
    want, want_lse = attend_dca(*q3, k, v, q_pos, k_pos, dca, scale=0.1)  # three masked attentions, LSE-merged
    got, got_lse = attend_encoded(q3, q_pos, layer, scale=0.1 * dca.logit_scale, chunk_len=dca.chunk_len)
    np.testing.assert_allclose(got, want, atol=2e-5)
    np.testing.assert_allclose(got_lse, want_lse, atol=2e-5)


@pytest.mark.parametrize("arch,kv_type,dca", [("gemma3", "turbo3", None), ("qwen2", "q4_0", None),
                                              ("qwen3", "turbo2_tcq", {"chunk_size": 16, "local_size": 4})])
def test_the_engine_without_the_mirror_matches_the_engine_with_it(tiny_model, monkeypatch, arch, kv_type, dca):
    """The lean engine prefills 32 tokens in chunks of 4 (max_chunk 4: every chunk takes the few-query path);
    the mirrored engine's cache is restored from the lean one's stored rows (its float32 copies decoded from
    them), and each decodes one more token from those same rows: logits within float rounding (K's
    normalisation and rotation fold into the query without the mirror). (Each engine prefilling on its own
    would write rows that may differ by a quantization step: a last-bit difference upstream of the encoder.)
    The matmuls take float32 activations (ACTIVATION_CODES off), so a last-bit difference stays one, not a
    whole step of a 16-bit activation code (tests/test_kv_cache.py test_engine_with_normalized_keys)."""
    from cupyllm.generate import prefill
    monkeypatch.setattr(cpu_linear, "ACTIVATION_CODES", False)
    path, _, _ = tiny_model(arch)
    ids = list(range(4, 37))
    kw = dict(device="cpu", ctx=64, kv_type_k=kv_type, kv_type_v=kv_type, max_chunk=4, dca=dca, progress=False)
    mirrored = cupyllm.load(path, kv_mirror=True, **kw)
    lean = cupyllm.load(path, **kw)  # the default: no copy
    lean_cache, mirrored_cache = lean.new_cache(), mirrored.new_cache()
    assert all(not layer.mirror for layer in lean_cache.own_layers())
    assert all(layer.mirror for layer in mirrored_cache.own_layers())
    prefill(lean.transformer.forward, ids[:-1], lean_cache, 4)
    mirrored_cache.restore(lean_cache.state(), lean_cache.n_past)
    step = (np.array(ids[-1:]), np.array([len(ids) - 1]))
    got = lean.transformer.forward(*step, lean_cache)
    want = mirrored.transformer.forward(*step, mirrored_cache)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_the_mirror_switch_on_the_cli_and_its_errors(tiny_model):
    path, _, _ = tiny_model("qwen2")
    runs = {}
    for flag in ("--kv-mirror", "--no-kv-mirror"):
        out = subprocess.run([sys.executable, "-m", "cupyllm.cli", "generate", "hello", "-m", str(path), "--device",
                              "cpu", "-n", "6", "--temp", "0", "-ctk", "q8_0", "-ctv", "turbo3", flag],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        runs[flag] = out.stdout
    assert runs["--kv-mirror"] == runs["--no-kv-mirror"]  # greedy: the same tokens either way


def test_a_mirror_asked_of_the_gpu_is_an_error(tiny_model, monkeypatch):
    """The GPU kernels read the encoded rows and keep no float copy: kv_mirror=True there says so at load."""
    import types

    from cupyllm import api
    path, _, _ = tiny_model("qwen2")
    monkeypatch.setattr(api, "select_backend", lambda device, threads=None: types.SimpleNamespace(name="gpu",
                                                                                                 can_mirror_kv=False))
    with pytest.raises(CupyllmError, match="keep none"):
        cupyllm.load(path, device="gpu", ctx=32, kv_mirror=True, progress=False)


def test_a_budget_counts_the_mirror_only_when_asked_for(tiny_model):
    """kv_budget counts what the cache holds: by default the encoded rows alone; with kv_mirror=True their float32
    copy too, which may not fit where the encoded rows do (an error that says how to drop it); `cupyllm info`
    reports the copy's size beside the cache."""
    from cupyllm.errors import BudgetError
    from cupyllm.kv.cache import KVSpec, kv_bytes
    from cupyllm.kv.plan import format_bytes
    from cupyllm.report import model_report
    path, _, _ = tiny_model("qwen2")
    lean = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="q4_0", kv_type_v="q4_0", kv_mirror=False,
                        progress=False)
    spec = KVSpec(ctx=64, kv_type_k="q4_0", kv_type_v="q4_0")
    encoded, mirrored = kv_bytes(lean.cfg, spec), kv_bytes(lean.cfg, spec, mirror=True)
    assert lean.new_cache().nbytes == encoded < mirrored
    budget = (encoded + mirrored) // 2
    kw = dict(device="cpu", ctx=64, kv_type_k="q4_0", kv_type_v="q4_0", kv_budget=budget, progress=False)
    assert not cupyllm.load(path, kv_mirror=False, **kw).new_cache().own_layers()[0].mirror
    default = cupyllm.load(path, **kw)  # no copy by default: the encoded rows fit
    assert not default.new_cache().own_layers()[0].mirror and not default.kv_spec.float_mirror
    with pytest.raises(BudgetError, match="kv_mirror=True asks for"):  # asked for, the copy is kept or it is an error
        cupyllm.load(path, kv_mirror=True, **kw)  # (the message: the copy, and that without it the cache fits)
    mirrored_model = cupyllm.load(path, kv_mirror=True, **{**kw, "kv_budget": mirrored})
    assert mirrored_model.new_cache().own_layers()[0].mirror
    with pytest.raises(BudgetError):  # below the encoded cache nothing fits
        cupyllm.load(path, **{**kw, "kv_budget": encoded // 2})
    auto = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="auto", kv_type_v="auto", kv_budget=encoded,
                        progress=False)  # "auto" types plan on the encoded bytes
    assert not auto.kv_spec.float_mirror and auto.new_cache().nbytes <= encoded
    report = model_report(path, ctx=64, kv_type_k="q4_0", kv_type_v="q4_0")
    assert f"--kv-mirror (CPU) adds {format_bytes(mirrored - encoded)} for a float32 copy" in report


@pytest.mark.parametrize("mirror", [True, False])
def test_prefill_streams_the_cache_in_chunks_to_the_whole_attention(monkeypatch, mirror):
    """CPUBackend's prefill attention (more queries than the decode path takes) decodes KEY_CHUNK slots at a time,
    attends their query rows on the threads and merges the chunks by LSE: equal to one attention over the whole
    decoded cache, plain (sliding window, softcap) and DCA."""
    from cupyllm.ops.attention.dca import attend_dca
    from cupyllm.backend import cpu

    monkeypatch.setattr(cpu, "KEY_CHUNK", 90)  # uneven chunks of a 346-slot cache
    rng = np.random.default_rng(5)
    layer = _filled_layer(rng, "q8_0", "turbo3", n_kv=2, head_dim=64, n_slots=BLOCK_KEYS + 90, normalize_k=True)
    if mirror:  # the same stored rows, read from their float32 copies
        layer.k_f32, layer.v_f32, _ = layer.decode(0, layer.n_used)
        layer.mirror = True
    backend = cpu.CPUBackend(threads=2)
    k, v, k_pos = layer.decode(0, layer.n_used)
    q = rng.standard_normal((40, 4, 64)).astype(np.float32)
    q_pos = np.arange(300, 340)
    for window, softcap in ((0, 0.0), (50, 10.0)):
        want, _ = attend(q, k, v, causal_mask(q_pos, k_pos, window), scale=0.2, softcap=softcap)
        got = backend.attention(q, q_pos, layer, scale=0.2, window=window, softcap=softcap)
        np.testing.assert_allclose(got, want, atol=2e-5)
    dca = DCAConfig(chunk_size=120, local_size=8)
    q3 = rng.standard_normal((3, 40, 4, 64)).astype(np.float32)
    want, _ = attend_dca(*q3, k, v, q_pos, k_pos, dca, scale=0.2)
    np.testing.assert_allclose(backend.dca_attention(*q3, q_pos, layer, dca, scale=0.2), want, atol=2e-5)


def test_a_cache_whose_copy_overflows_the_host(tiny_model, monkeypatch):
    """No budget given: the host's available memory decides. A cache that fits it only without the float32 copy
    is made (it has none by default); asked for, the copy fails with what to do."""
    from cupyllm.backend import cpu
    from cupyllm.errors import BudgetError
    from cupyllm.kv import cache as kv_cache
    from cupyllm.kv.cache import KVSpec, kv_bytes
    path, _, _ = tiny_model("qwen2")
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="q8_0", kv_type_v="q8_0", progress=False)
    spec = KVSpec(ctx=64, kv_type_k="q8_0", kv_type_v="q8_0")
    room = (kv_bytes(model.cfg, spec) + kv_bytes(model.cfg, spec, mirror=True)) // 2
    for module in (cpu, kv_cache):
        monkeypatch.setattr(module, "host_bytes_available", lambda: room)
    lean = model.transformer.ops.new_cache(model.cfg, spec)
    assert not any(layer.mirror for layer in lean.own_layers())
    with pytest.raises(BudgetError, match="drop --kv-mirror"):
        model.transformer.ops.new_cache(model.cfg, dataclasses.replace(spec, float_mirror=True))


def test_one_block_merge_is_the_general_merge():
    """A decode step's single key block skips the log-sum-exp merge's arithmetic: its (O, LSE) are the general
    merge's of the same block beside an empty one (weight 0), bit for bit, rows that saw no key included."""
    rng = np.random.default_rng(7)
    for trial in range(50):
        n_kv, rows, dv = (int(n) for n in rng.integers(1, [4, 9, 300]))
        acc = rng.standard_normal((n_kv, 1, rows, dv)).astype(np.float32)
        best = (rng.standard_normal((n_kv, 1, rows)) * 5).astype(np.float32)
        total = (rng.random((n_kv, 1, rows)) * 3 + 0.1).astype(np.float32)
        if trial % 3 == 0:  # a row that saw no key
            acc[0, 0, 0], best[0, 0, 0], total[0, 0, 0] = 0.0, -np.inf, 0.0
        one = _merge_blocks(acc, best, total)
        two = _merge_blocks(np.concatenate([acc, np.zeros_like(acc)], axis=1),
                            np.concatenate([best, np.full_like(best, -np.inf)], axis=1),
                            np.concatenate([total, np.zeros_like(total)], axis=1))
        for got, want in zip(one, two):
            np.testing.assert_array_equal(got, want)
        if trial % 3 == 0:
            assert one[1][0, 0] == -np.inf and not one[0][0, 0].any()


def test_prefill_block_is_the_reference():
    """attend_block (a prefill's block of queries: 128 at a time over only the keys they see, scale folded into
    q, the mask written over the columns some query does not see, the row sums from the P @ V matmul) gives the
    reference's (O, LSE) within float32 rounding: causal blocks over a cache, sliding windows, soft-capping, GQA,
    queries that see no key, random masks, all keys seen (no mask)."""
    rng = np.random.default_rng(11)
    for trial in range(40):
        n_kv = int(rng.choice([1, 2, 4]))
        group, d, dv = int(rng.choice([1, 3, 7])), int(rng.choice([8, 64, 80])), int(rng.choice([8, 64]))
        n_q, n_k = int(rng.integers(17, 300)), int(rng.integers(1, 300))  # (blocks of 128 queries)
        q = rng.standard_normal((n_q, n_kv * group, d)).astype(np.float32)
        k = rng.standard_normal((n_k, n_kv, d)).astype(np.float32)
        v = rng.standard_normal((n_k, n_kv, dv)).astype(np.float32)
        q_pos = np.arange(n_q) + int(rng.integers(-n_q, n_k + 1))
        k_pos = np.arange(n_k) if trial % 4 else rng.permutation(n_k) - int(rng.integers(0, 3))  # (a ring, gaps)
        window = int(rng.choice([0, 0, 16, -8]))
        allowed = [causal_mask(q_pos, k_pos, window), rng.random((n_q, n_k)) < 0.5, None][trial % 3]
        cap = float(rng.choice([0.0, 30.0]))
        want = attend(q, k, v, allowed, scale=0.3, softcap=cap)
        got = attend_block(q, k, v, allowed, scale=0.3, softcap=cap)
        np.testing.assert_allclose(got[0], want[0], atol=2e-5, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))
        seen = np.isfinite(want[1])
        np.testing.assert_allclose(got[1][seen], want[1][seen], atol=2e-5, rtol=1e-6)
