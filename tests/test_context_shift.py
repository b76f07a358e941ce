"""Context shift (cupyllm/kv/shift.py): after dropping positions [keep, keep + discard), the keys a cache holds
decode to what a fresh prefill of the kept tokens at their new positions stores (within the format's
quantisation error), for every KV type, with normalised K, with Dual Chunk Attention, in sliding-window rings
and (tests marked gpu) in the device and spilled caches; generation goes on past a full context."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

import cupyllm
from cupyllm.errors import InputError
from cupyllm.files.config import RopeConfig
from cupyllm.generate import GenerationStats, generate_stream, prefill
from cupyllm.kv import get_format, list_formats
from cupyllm.kv.cache import KVSpec, LayerKV
from cupyllm.kv.shift import ContextShift, shift_cache, shift_layer
from cupyllm.ops.attention.dca import DCAConfig
from cupyllm.ops.elementwise.reference import apply_rope, rope_tables
from cupyllm.sampling import Sampler, SamplingParams
from cupyllm.speculative import DraftLength, NgramDrafter, spec_config

from gpu_helpers import GPU_TEST_MARKS, emulated

N_KV, HEAD_DIM = 2, 64
ROPE = RopeConfig(base=10000.0, n_rot=HEAD_DIM)
ROPES = {  # what config.py builds: full NEOX, partial (Qwen3.5 / Gemma 4), normal pairs, YaRN (mscale != 1),
    "neox": ROPE,  # frequency factors (Gemma 4's proportional rope)
    "partial": RopeConfig(base=1e6, n_rot=16),
    "normal": RopeConfig(base=10000.0, n_rot=HEAD_DIM, neox=False),
    "yarn": RopeConfig(base=10000.0, n_rot=HEAD_DIM, scaling="yarn", factor=4.0, original_ctx=32),
    "freq_factors": RopeConfig(base=10000.0, n_rot=HEAD_DIM, freq_factors=tuple([1.0] * 16 + [1e30] * 16)),
}


def _roped(raw: np.ndarray, positions: np.ndarray, rope: RopeConfig) -> np.ndarray:
    return apply_rope(raw, *rope_tables(rope, positions), rope.neox)


def _keys(layer) -> dict[int, np.ndarray]:
    """position -> decoded float32 K [n_kv, head_dim] of every slot `layer` (a CPU LayerKV) holds."""
    k, _, pos = layer.decode(0, layer.n_used)
    return {int(p): k[i] for i, p in enumerate(pos) if p >= 0}


def _v_rows(layer) -> dict[int, bytes]:
    return {int(p): layer.v_data[i].tobytes() for i, p in enumerate(layer.slot_pos[:layer.n_used]) if p >= 0}


def _layer(kv_type: str, *, normalize: bool, capacity: int = 64, ring: bool = False, window: int = 0):
    return LayerKV(get_format(kv_type, head_dim=HEAD_DIM), get_format("q8_0", head_dim=HEAD_DIM), N_KV, HEAD_DIM,
                   HEAD_DIM, capacity=capacity, ring=ring, window=window, normalize_k=normalize)


def _fill(layer, raw, key_positions, positions, rope, queries, chunk=4):
    """Write roped raw keys (at key_positions) for `positions` in prefill-sized chunks; V = the raw keys."""
    keys = _roped(raw, key_positions, rope)
    for start in range(0, len(positions), chunk):
        part = slice(start, start + chunk)
        layer.write(keys[part], raw[part], positions[part], queries=queries[part])


def _case(kv_type, *, normalize=False, rope=ROPE, n=40, keep=4, discard=18, dca=None, ring_capacity=0, seed=0):
    """(shifted layer, fresh layer, truth {new position: K}, V rows before the shift by new position)."""
    rng = np.random.default_rng(seed)
    # keys with per-channel offsets and spreads (what K normalisation is for), queries of 4 heads per KV head
    raw = (rng.standard_normal((n, N_KV, HEAD_DIM)) * rng.uniform(0.2, 3.0, HEAD_DIM)
           + rng.normal(0, 2.0, HEAD_DIM)).astype(np.float32)
    queries = rng.standard_normal((n, 4 * N_KV, HEAD_DIM)).astype(np.float32)
    key_pos = (lambda p: p % dca.chunk_len) if dca is not None else (lambda p: p)
    options = dict(capacity=ring_capacity, ring=True, window=6) if ring_capacity else dict(capacity=64)
    positions = np.arange(n)
    shifted = _layer(kv_type, normalize=normalize, **options)
    _fill(shifted, raw, key_pos(positions), positions, rope, queries)
    v_before = _v_rows(shifted)
    shift_layer(shifted, keep, discard, rope, dca)
    kept = np.r_[0:keep, keep + discard:n]
    new = np.arange(len(kept))
    fresh = _layer(kv_type, normalize=normalize, **options)
    _fill(fresh, raw[kept], key_pos(new), new, rope, queries[kept])
    truth = dict(zip(new.tolist(), _roped(raw[kept], key_pos(new), rope)))
    v_moved = {int(q): v_before[int(p)] for p, q in zip(kept, new) if int(p) in v_before}
    return shifted, fresh, truth, v_moved


def _check(shifted, fresh, truth, v_moved, kv_type):
    got, want = _keys(shifted), _keys(fresh)
    assert got and set(got) <= set(want)  # (a ring holds what it held, renumbered: the newest positions)
    if not shifted.ring:
        assert set(got) == set(truth)
    assert _v_rows(shifted) == {p: v_moved[p] for p in got}  # V moves as stored bytes
    positions = sorted(got)
    got = np.stack([got[p] for p in positions])
    want = np.stack([want[p] for p in positions])
    true = np.stack([truth[p] for p in positions])
    if kv_type == "f32":  # the rotation alone: float32 rounding
        np.testing.assert_allclose(got, true, atol=2e-5 * np.abs(true).max())
        return
    # a fresh prefill's own quantisation error sets the scale: the shift decodes, rotates and encodes once more,
    # so its rows are off by at most about one more such error (one quantisation step, twice the rounding error)
    step = 2 * np.abs(want - true).max()
    assert np.abs(got - want).max() <= 1.5 * step
    rms = lambda x: float(np.sqrt((x ** 2).mean()))  # noqa: E731
    assert rms(got - true) <= 2.0 * rms(want - true)


@pytest.mark.parametrize("kv_type", list_formats())
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_shifted_keys_match_a_fresh_prefill(kv_type, normalize):
    _check(*_case(kv_type, normalize=normalize), kv_type)


@pytest.mark.parametrize("rope", list(ROPES))
def test_every_rope_layout_shifts_as_a_pure_rotation(rope):
    """Partial rotary dims pass through, normal pairs, YaRN's magnitude factor not applied again (so nothing
    compounds: three shifts in a row), frequency factors that leave pairs still."""
    shifted, fresh, truth, v_moved = _case("f32", rope=ROPES[rope])
    _check(shifted, fresh, truth, v_moved, "f32")
    for _ in range(2):  # two more shifts of the same layer: still the rope of the final positions
        before = _keys(shifted)
        shift_layer(shifted, 4, 3, ROPES[rope])
        after = _keys(shifted)
        for p, k in after.items():
            old = before[p if p < 4 else p + 3]
            want = _reroped(old, p if p < 4 else p + 3, p, ROPES[rope])
            np.testing.assert_allclose(k, want, atol=1e-4 * np.abs(k).max())


def _reroped(k: np.ndarray, old: int, new: int, rope: RopeConfig) -> np.ndarray:
    """A key [n_kv, head_dim] roped at `old`, roped at `new` instead: unroped, then roped afresh."""
    return _roped(_unroped(k, old, rope)[None], np.array([new]), rope)[0]


def _unroped(k: np.ndarray, position: int, rope: RopeConfig) -> np.ndarray:
    """The raw key of a key roped at `position` (the inverse rotation, the magnitude factor divided out)."""
    cos, sin = rope_tables(rope, np.array([position]))
    mscale2 = float(cos[0, 0] ** 2 + sin[0, 0] ** 2) if rope.n_rot else 1.0
    raw = apply_rope(k[None], cos, -sin, rope.neox)[0]
    raw[..., :rope.n_rot] /= mscale2
    return raw


def test_unshifted_keys_would_fail_the_check():
    """The check can fail: rows moved without their rotation are far from the fresh prefill's."""
    shifted, fresh, truth, v_moved = _case("f16")
    moved = {p: k for p, k in truth.items() if p >= 4}
    wrong = {p: _reroped(k, p, p + 18, ROPE) for p, k in moved.items()}
    assert max(np.abs(wrong[p] - moved[p]).max() for p in moved) > 100 * max(
        np.abs(_keys(shifted)[p] - moved[p]).max() for p in moved)


@pytest.mark.parametrize("kv_type", ["f32", "q8_0", "turbo3"])
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_dual_chunk_attention_keys_move_to_their_new_chunk_position(kv_type, normalize):
    """DCA stores keys at p mod L (L = 12 here): a key moved by 18 turns by (new mod L) - (old mod L)."""
    dca = DCAConfig(chunk_size=16, local_size=4)
    _check(*_case(kv_type, normalize=normalize, dca=dca), kv_type)
    _check(*_case(kv_type, normalize=normalize, dca=dca, discard=12), kv_type)  # a whole chunk: no turn at all


@pytest.mark.parametrize("kv_type", ["f32", "q4_0", "turbo2_tcq"])
@pytest.mark.parametrize("keep, discard", [(4, 18), (4, 3), (0, 9)])
def test_sliding_window_ring(kv_type, keep, discard):
    """A ring of 10 slots (window 6 + chunk 4): its rows move to the slots of their new positions; with a small
    discard the kept positions and the moved ones share the ring."""
    shifted, fresh, truth, v_moved = _case(kv_type, ring_capacity=10, keep=keep, discard=discard)
    assert all(shifted.slot_pos[p % 10] == p for p in _keys(shifted))
    assert max(_keys(shifted)) == 40 - discard - 1
    _check(shifted, fresh, truth, v_moved, kv_type)


def test_float_mirror_follows_the_shift():
    shifted = LayerKV(get_format("q8_0", head_dim=HEAD_DIM), get_format("q8_0", head_dim=HEAD_DIM), N_KV, HEAD_DIM,
                      HEAD_DIM, capacity=64, ring=False, mirror=True)
    raw = np.random.default_rng(1).standard_normal((30, N_KV, HEAD_DIM)).astype(np.float32)
    _fill(shifted, raw, np.arange(30), np.arange(30), ROPE, np.zeros((30, 8, HEAD_DIM), np.float32))
    shift_layer(shifted, 2, 10, ROPE)
    shifted.mirror = False  # decode the stored rows, not the mirror
    k, v, _ = shifted.decode(0, shifted.n_used)
    assert shifted.n_used == 20
    np.testing.assert_array_equal(shifted.k_f32[:20], k)
    np.testing.assert_array_equal(shifted.v_f32[:20], v)


# --- whole caches of the tiny models ------------------------------------------------------------------------------
IDS = [5, 17, 99, 3, 42, 7, 11, 64, 200, 1, 33, 18, 77, 9, 120, 4, 57, 81, 6, 13, 150, 2, 44, 90, 31, 8]


def _model_cache(model, ids, ctx=48):
    spec = dataclasses.replace(model.kv_spec, ctx=ctx)
    cache = model.transformer.ops.new_cache(model.cfg, spec)
    prefill(model._forward_numpy, ids, cache, spec.max_chunk)
    return cache


@pytest.mark.parametrize("arch, kv_type", [("qwen2", "f16"), ("qwen3", "q8_0"), ("gemma3", "q4_0"),
                                           ("gemma4", "f16"), ("gemma4", "turbo3")])
def test_model_cache_shift(tiny_model, arch, kv_type):
    """Every layer of a model's cache: each held key is the pre-shift key re-roped with that layer's rope (local
    and global bases, Gemma 4's partial global rope, shared layers once), V rows unchanged; layer 0's keys,
    which depend on the token alone, are what a fresh prefill of the kept tokens stores."""
    path, _, _ = tiny_model(arch)
    model = cupyllm.load(path, device="cpu", ctx=48, kv_type_k=kv_type, kv_type_v=kv_type, max_chunk=4,
                         progress=False)
    keep, discard = 3, 9
    tol = {"f16": 2e-3, "q8_0": 2e-2, "q4_0": 0.2, "turbo3": 0.3}[kv_type]  # of the largest key value
    cache = _model_cache(model, IDS)
    before = [(_keys(layer), _v_rows(layer)) for layer in cache.own_layers()]
    shift_cache(cache, model.cfg, keep, discard)
    assert cache.n_past == len(IDS) - discard
    own = {id(layer): il for il, layer in reversed(list(enumerate(cache.layers)))}
    for layer, (k_before, v_before) in zip(cache.own_layers(), before):
        rope = model.cfg.rope_for(own[id(layer)])
        k_after = _keys(layer)
        old = lambda p: p if p < keep else p + discard  # noqa: E731
        assert _v_rows(layer) == {p: v_before[old(p)] for p in k_after}
        scale = max(np.abs(k).max() for k in k_before.values())
        for p, k in k_after.items():  # (decoded once more than the keys before: up to twice the error)
            want = _reroped(k_before[old(p)], old(p), p, rope)
            assert np.abs(k - want).max() <= 2 * tol * scale, (own[id(layer)], p)
    fresh = _model_cache(model, IDS[:keep] + IDS[keep + discard:])
    got, want = _keys(cache.layers[0]), _keys(fresh.layers[0])
    scale = max(np.abs(w).max() for w in want.values())
    assert all(np.abs(got[p] - want[p]).max() <= 2 * tol * scale for p in got)  # (as above)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "gemma4"])
def test_dropping_the_start_keeps_every_relative_position(tiny_model, arch, monkeypatch):
    """keep=0: the shift moves every held token by the same -d, so every query-key distance stays (RoPE scores
    depend on distances alone; so do sliding windows): the next token's logits are those of the unshifted cache
    with the dropped positions masked out, in every layer (f32 KV: up to rounding)."""
    path, _, _ = tiny_model(arch)
    model = cupyllm.load(path, device="cpu", ctx=48, kv_type_k="f32", kv_type_v="f32", max_chunk=4,
                         progress=False)
    logits = []
    for shift in (True, False):
        cache = _model_cache(model, IDS)
        if shift:
            shift_cache(cache, model.cfg, 0, 11)
        else:
            for layer in cache.own_layers():
                layer.slot_pos[(layer.slot_pos >= 0) & (layer.slot_pos < 11)] = -1
        logits.append(model._forward_numpy(np.array([7]), np.array([cache.n_past]), cache).reshape(-1))
    assert np.abs(logits[0] - logits[1]).max() <= 1e-4 * np.abs(logits[1]).max()
    # (and the check can fail: rows moved without their rotation give other logits)
    monkeypatch.setattr("cupyllm.kv.shift.rerope_rows", lambda layer, k_rows, turn, rope: k_rows)
    unturned = _model_cache(model, IDS)
    shift_cache(unturned, model.cfg, 0, 11)
    wrong = model._forward_numpy(np.array([7]), np.array([unturned.n_past]), unturned).reshape(-1)
    assert np.abs(wrong - logits[1]).max() > 100 * np.abs(logits[0] - logits[1]).max()


def test_hybrid_models_refuse_context_shift(tiny_model):
    path, _, _ = tiny_model("qwen35")
    model = cupyllm.load(path, device="cpu", ctx=32, progress=False)
    with pytest.raises(InputError, match="linear-attention"):
        model.generate([3, 4, 5], max_tokens=40, context_shift=True)
    with pytest.raises(InputError, match="linear-attention"):
        ContextShift(model.cfg)


# --- generation ---------------------------------------------------------------------------------------------------
class _NoEnd:
    """The model's tokenizer with no end-of-generation token: a run ends at max_tokens or a full context."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def is_eog(self, token):
        return False

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def _generate(model, prompt, max_tokens, shift=None, drafter=None, ctx=64, on_done=None):
    cache = model.transformer.ops.new_cache(model.cfg, dataclasses.replace(model.kv_spec, ctx=ctx))
    stats = GenerationStats()
    text = "".join(generate_stream(model._forward_numpy_graphed, _NoEnd(model.tokenizer), prompt, cache,
                                   Sampler(SamplingParams(temperature=0.0)), max_tokens=max_tokens,
                                   chunk=model.kv_spec.max_chunk, stats=stats, context_shift=shift, drafter=drafter,
                                   on_done=on_done, draft_length=DraftLength(4, adaptive=False) if drafter else None))
    return text, stats, cache


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_generation_runs_past_a_full_context(tiny_model, arch):
    """-c 64 -n 300: without a shift the context ends it; with one it runs to the end, shifting each time the
    cache fills (keep 4, discard half of the other 60: every 30 tokens)."""
    path, _, _ = tiny_model(arch)
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="q8_0", kv_type_v="q8_0", progress=False)
    prompt = [2, 5, 7, 9, 11, 13]
    _, stats, _ = _generate(model, prompt, 300)
    assert stats.stop_reason == "context full" and stats.generated_tokens == 64 - len(prompt)
    held = {}
    _, stats, cache = _generate(model, prompt, 300, shift=ContextShift(model.cfg, keep=4),
                                on_done=lambda ids, logits: held.setdefault("ids", list(ids)))
    assert stats.stop_reason == "max_tokens" and stats.generated_tokens == 300
    # shifts before the forwards of tokens 60, 90, ..., 300 (58 tokens fill the 64 positions; then 30 a shift)
    assert stats.context_shifts == 9 and "context shifts: 9" in stats.summary()
    assert held["ids"][:4] == prompt[:4] and len(held["ids"]) == cache.n_past <= 64


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_speculative_decoding_across_shifts(tiny_model, drafter):
    """Drafts verified across context shifts (n-gram lookup; the model drafting for itself from a cache of its own,
    which follows the shifted tokens): greedy, the same tokens as plain decoding with the same shifts (a verify
    run always fits: the shift happens between steps)."""
    path, _, _ = tiny_model("qwen2")
    model = cupyllm.load(path, device="cpu", ctx=48, progress=False)
    prompt = [3, 17, 5, 9, 3, 17, 5, 11, 2, 8, 13, 21, 3, 17]
    shift = ContextShift(model.cfg, keep=2, discard=10)
    plain, plain_stats, _ = _generate(model, prompt, 120, shift=shift, ctx=48)
    drafter = NgramDrafter() if drafter == "ngram" else model._drafter(spec_config("self"))
    spec, spec_stats, _ = _generate(model, prompt, 120, shift=shift, ctx=48, drafter=drafter)
    assert spec_stats.draft.drafted > 0 and spec_stats.context_shifts == plain_stats.context_shifts >= 3
    assert spec == plain


def test_api_options_and_kept_cache(tiny_model):
    """generate(context_shift=True, keep=2): the first token (BOS) kept besides; keep_cache leaves the shifted
    cache with the tokens it holds, which the next call reuses whole; keep below -1 is refused up front."""
    path, _, _ = tiny_model("gemma3")
    model = cupyllm.load(path, device="cpu", ctx=32, progress=False)
    prompt = model.tokenize("hello world")
    assert prompt[0] == model.tokenizer.specials.bos and len(prompt) == 10
    model.generate("hello world", max_tokens=60, temperature=0, context_shift=True, keep=2, keep_cache=True)
    stats, cached = model.last_stats, model.last_prompt_cache
    assert stats.context_shifts == 3 and stats.generated_tokens == 60  # before tokens 24, 38, 52 (as below)
    assert cached.ids[:3] == tuple(prompt[:3]) and cached.ids[3] != prompt[3] and len(cached.ids) <= 32
    model.generate(list(cached.ids) + [7], max_tokens=2, temperature=0, prompt_cache=cached)
    assert model.last_stats.cached_tokens == len(cached.ids)
    for wrong in ({"keep": -2}, {"discard": -1}, {"keep": 1.5}):
        with pytest.raises(InputError, match="must be a count"):
            model.generate("hello", context_shift=True, **wrong)


def test_cli_context_shift(tiny_model):
    """--context-shift --keep 2 at -c 32: the 10-token prompt (its first token, BOS, kept besides the 2) fills the
    context after 22 tokens, then each shift drops half of the 29 positions not kept (14): shifts before tokens 24,
    38, 52, 66, 80."""
    path, _, _ = tiny_model("gemma3")
    run = subprocess.run([sys.executable, "-m", "cupyllm.cli", "generate", "-m", str(path), "--device", "cpu",
                          "-c", "32", "-n", "80", "--temp", "0", "--context-shift", "--keep", "2", "hello world"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    stats = run.stderr.strip().splitlines()[-1]
    assert "context shifts: 5, stop: max_tokens" in stats, stats


# --- the GPU backend's caches (a GPU, or the CUDA emulator: CUPYLLM_EMULATE=1 python -m pytest -m gpu) -----------
def _device_rows(layer) -> dict[int, tuple[bytes, bytes]]:
    """position -> (K row, V row) bytes of a DeviceLayerKV or a SpilledLayerKV (its host rows and device ring)."""
    rows = {}
    if getattr(layer, "spilled", False):
        rows = {p: (layer.host_k[p].tobytes(), layer.host_v[p].tobytes()) for p in range(layer.n_host)}
        layer = layer.device
    positions, k_data, v_data = layer.slot_pos.get(), layer.k_data.get(), layer.v_data.get()
    for slot in np.flatnonzero(positions >= 0):
        assert int(positions[slot]) not in rows  # a position is on the host or in the ring, never both
        rows[int(positions[slot])] = (k_data[slot].tobytes(), v_data[slot].tobytes())
    return rows


def _decoded_k(layer, row: bytes) -> np.ndarray:
    fmt = layer.k_format
    k = fmt.decode(np.frombuffer(row, np.uint8).reshape(layer.n_kv, -1), layer.head_dim)
    offset = layer.k_offset
    return k if offset is None else k * layer.k_scale.get() + offset.get()


@pytest.mark.parametrize("window", [0, 6], ids=["device", "spilled"])
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("use_dca", [False, True], ids=["", "dca"])
@GPU_TEST_MARKS[0]
@GPU_TEST_MARKS[1]
def test_device_and_spilled_caches_shift(tmp_path_factory, window, kv_type, use_dca):
    """The device cache and the spilled one (host rows + a 6-slot device ring) after a shift: every position
    held once, V rows moved as they were, K re-roped (at DCA's in-chunk positions with DCA); decoding then goes
    on and the spilled cache's logits follow the whole device cache's."""
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.files.gguf import read_gguf
    from cupyllm.models.build import Transformer
    from cupyllm.models.layers import dca_attention
    import make_tiny_models
    path = tmp_path_factory.mktemp("shift") / "tiny-qwen2-64.gguf"  # (a head dim the flash kernels take)
    make_tiny_models.write_gguf(dataclasses.replace(make_tiny_models.tiny_spec("qwen2"), n_layer=2, head_dim=64), path)
    ops = GPUBackend(attention="dispatch")
    transformer = Transformer.from_gguf(read_gguf(path), ops, progress=False)
    dca = DCAConfig(chunk_size=8, local_size=2) if use_dca else None
    if dca is not None:
        transformer.attention = dca_attention(dca)
    cfg, keep, discard = transformer.cfg, 3, 9

    def forward(tokens, positions, cache, all_logits=False):
        return ops.to_numpy(transformer.forward(np.asarray(tokens), positions, cache, all_logits))

    logits = {}
    for w in (0, window):
        # (normalised K with DCA is not read by a spilled cache: GPUBackend refuses it)
        spec = KVSpec(ctx=32, kv_type_k=kv_type, kv_type_v=kv_type, max_chunk=4, device_window=w,
                      normalize_k=False if dca is not None else None)
        cache = ops.new_cache(cfg, spec)
        prefill(forward, IDS, cache, 4)
        before = [_device_rows(layer) for layer in cache.own_layers()]
        shift_cache(cache, cfg, keep, discard, dca)
        old = lambda p: p if p < keep else p + discard  # noqa: E731
        key = (lambda p: p % dca.chunk_len) if dca is not None else (lambda p: p)  # noqa: E731
        for layer, rows_before in zip(cache.own_layers(), before):
            rows = _device_rows(layer)
            assert sorted(rows) == list(range(len(IDS) - discard))
            assert getattr(layer, "n_host", 0) == (len(IDS) - discard - window if w else 0)
            assert all(rows[p][1] == rows_before[old(p)][1] for p in rows)
            for p in rows:
                k, k_old = _decoded_k(layer, rows[p][0]), _decoded_k(layer, rows_before[old(p)][0])
                want = _reroped(k_old, key(old(p)), key(p), cfg.rope)
                assert np.abs(k - want).max() <= (4e-3 if kv_type == "f16" else 4e-2) * np.abs(want).max()
        steps = []
        for token in (7, 8, 9):
            steps.append(forward([token], np.array([cache.n_past]), cache))
            cache.n_past += 1
        logits[w] = np.concatenate(steps)
    assert np.abs(logits[window] - logits[0]).max() <= 4e-3 * np.abs(logits[0]).max()


@GPU_TEST_MARKS[0]
@GPU_TEST_MARKS[1]
def test_gpu_generation_runs_past_a_full_context(tmp_path_factory):
    """The GPU engine's decode loop (CUDA graphs of one-token steps where the device captures them) across
    shifts: the whole run, and greedy tokens as the CPU engine's (the same shifts at the same steps)."""
    import make_tiny_models
    path = tmp_path_factory.mktemp("shift") / "tiny-qwen2-64.gguf"
    make_tiny_models.write_gguf(dataclasses.replace(make_tiny_models.tiny_spec("qwen2"), n_layer=2, head_dim=64), path)
    texts = {}
    for device in ("gpu", "cpu"):
        model = cupyllm.load(path, device=device, ctx=32, max_chunk=4, progress=False)
        texts[device], stats, _ = _generate(model, [2, 5, 7, 9, 11, 13], 80, shift=ContextShift(model.cfg, keep=2),
                                            ctx=32)
        assert stats.generated_tokens == 80 and stats.context_shifts >= 3
    if emulated():  # (float32 throughout; a device's f16 rounding may pick another token of random weights)
        assert texts["gpu"] == texts["cpu"]


# --- the real models (CUPYLLM_LONG_TESTS=1: 1,500 tokens each, minutes on a CPU) -------------------------------
def _distinct(ids: list[int], n: int) -> float:
    """Distinct n-grams over all n-grams: near 0 where the text collapses into repeating a few tokens."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CUPYLLM_LONG_TESTS") != "1",
                    reason="1,500 tokens on each real model (minutes on a CPU): CUPYLLM_LONG_TESTS=1 runs it")
@pytest.mark.parametrize("name", ["gemma", "qwen"])
def test_real_models_keep_going(name):
    """-c 256 -n 1500 --context-shift on both real models, sampled (defaults, seed 1) with end-of-generation
    tokens suppressed (llama.cpp's --ignore-eos) so that every run is 1,500 tokens: it runs to the end and the
    text does not collapse over the whole run (distinct 4-grams >= 0.15; docs/context-shift.md has the
    figures beside runs at -c 2048 without a shift)."""
    from models import gemma_path, qwen_path
    model = cupyllm.load({"gemma": gemma_path, "qwen": qwen_path}[name](), device="cpu", ctx=256, progress=False)
    eog = sorted(model.tokenizer.eog_ids)

    def forward(*args, **options):
        logits = model._forward_numpy_graphed(*args, **options)
        logits[..., eog] = -np.inf
        return logits

    stats = GenerationStats()
    text = "".join(generate_stream(forward, model.tokenizer, model.tokenize("The history of the city of Rome begins"),
                                   model.new_cache(), Sampler(SamplingParams(seed=1)), max_tokens=1500, stats=stats,
                                   context_shift=ContextShift(model.cfg, keep=1)))  # (generate()'s default)
    assert stats.generated_tokens == 1500 and stats.stop_reason == "max_tokens" and stats.context_shifts >= 9
    assert _distinct(model.tokenize(text, add_bos=False), 4) >= 0.15
