"""Mixed KV types by position (cupyllm/kv/window.py; --kv-window N, -ctkt / -ctvt): a global layer keeps its newest
N positions in the main types and older ones in the tail types. Attention over the mixed cache is the NumPy
reference attention over the rows decoded from their own formats (each query: the main rows of its window, the
tail rows behind it); a tail row is encode_tail(decode_main(row)), computed here with the formats' NumPy codecs;
no tail type is today's cache byte for byte; prompt caches, rewinds and context shifts keep working; every model
family generates with a mixed cache."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

import cupyllm
from cupyllm.backend.cpu import CPUBackend
from cupyllm.errors import InputError
from cupyllm.generate import prefill
from cupyllm.kv import get_format
from cupyllm.kv.cache import KVSpec, LayerKV, kv_bytes
from cupyllm.kv.plan import floor_tail
from cupyllm.kv.prompt_cache import PromptCache, layer_state_problem
from cupyllm.kv.shift import shift_cache
from cupyllm.kv.window import WindowedLayerKV
from cupyllm.ops.attention.dca import DCAConfig, attend_dca
from cupyllm.ops.attention.reference import attend, causal_mask

N_KV, N_HEAD, HEAD_DIM = 2, 4, 64
WINDOW, CHUNK, CTX = 12, 20, 64  # (a chunk past MAX_QUERIES: the prefill path)
PAIRS = [("f16", "q4_0"), ("q8_0", "q4_0"), ("f16", "turbo3"), ("q8_0", "turbo2_tcq"), ("turbo4", "q4_0")]


def _windowed(main: str, tail: str, *, normalize: bool, ctx: int = CTX) -> WindowedLayerKV:
    fmt = lambda name: get_format(name, head_dim=HEAD_DIM)  # noqa: E731
    return WindowedLayerKV(
        LayerKV(fmt(main), fmt(main), N_KV, HEAD_DIM, HEAD_DIM, capacity=WINDOW + CHUNK, ring=True, window=WINDOW,
                normalize_k=normalize),
        LayerKV(fmt(tail), fmt(tail), N_KV, HEAD_DIM, HEAD_DIM, capacity=ctx, ring=False, normalize_k=normalize))


def _filled(main, tail, *, normalize=False, n=45, seed=0):
    """A windowed layer after n positions written in prefill chunks of up to CHUNK, with the raw K / V written."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(n, N_KV, HEAD_DIM)).astype(np.float32) + np.linspace(-3, 3, HEAD_DIM, dtype=np.float32)
    v = rng.normal(size=(n, N_KV, HEAD_DIM)).astype(np.float32)
    q = rng.normal(size=(n, N_HEAD, HEAD_DIM)).astype(np.float32)
    layer = _windowed(main, tail, normalize=normalize)
    start = 0
    for size in (CHUNK, 3, CHUNK, 1, CHUNK, 5) + (1,) * n:  # prefill chunks, then decode steps
        stop = min(start + size, n)
        if start == stop:
            break
        layer.write(k[start:stop], v[start:stop], np.arange(start, stop), queries=q[start:stop])
        start = stop
    return layer, k, v


def _decoded(part):
    """position -> (K, V) decoded by the part's format's own NumPy decode, denormalised."""
    held = {}
    for slot, p in enumerate(part.slot_pos[:part.n_used]):
        if p < 0:
            continue
        k = part.k_format.decode(part.k_data[slot], part.head_dim)
        if part.k_offset is not None:
            k = k * part.k_scale + part.k_offset
        held[int(p)] = (k, part.v_format.decode(part.v_data[slot], part.v_head_dim))
    return held


def _reference(q, q_pos, layer, *, scale, dca=None, q_rotations=None):
    """Each query's attention over its own rows: position p from the main part when q - p < window, else from the
    tail (the NumPy reference attention, or the dense DCA reference)."""
    main, tail = _decoded(layer.main), _decoded(layer.tail)
    out = []
    for i, qp in enumerate(q_pos):
        positions = np.arange(qp + 1)
        rows = [main[p] if qp - p < layer.kv_window else tail[p] for p in positions]
        k = np.stack([r[0] for r in rows]).astype(np.float32)
        v = np.stack([r[1] for r in rows]).astype(np.float32)
        if dca is None:
            o, _ = attend(q[i:i + 1], k, v, causal_mask([qp], positions), scale=scale)
        else:
            qs = [r[i:i + 1] for r in q_rotations]
            o, _ = attend_dca(*qs, k, v, np.array([qp]), positions, dca, scale=scale)
        out.append(o[0])
    return np.stack(out)


@pytest.mark.parametrize("main, tail", PAIRS)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("n_q", [1, 3, 20])  # decode, a verify run, a prefill chunk (the streaming path)
def test_attention_over_a_mixed_cache_is_the_reference(main, tail, normalize, n_q):
    layer, _, _ = _filled(main, tail, normalize=normalize)
    rng = np.random.default_rng(1)
    q = rng.normal(size=(n_q, N_HEAD, HEAD_DIM)).astype(np.float32)
    q_pos = np.arange(45 - n_q, 45)
    got = CPUBackend().attention(q, q_pos, layer, scale=0.125)
    want = _reference(q, q_pos, layer, scale=0.125)
    assert np.abs(got - want).max() <= 2e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("n_q", [1, 20])
def test_dual_chunk_attention_over_a_mixed_cache(n_q):
    """DCA's three regimes over both parts (the window's mask and its complement)."""
    dca = DCAConfig(chunk_size=24, local_size=4)
    layer, _, _ = _filled("q8_0", "q4_0", normalize=True)
    rng = np.random.default_rng(2)
    qs = [rng.normal(size=(n_q, N_HEAD, HEAD_DIM)).astype(np.float32) for _ in range(3)]
    q_pos = np.arange(45 - n_q, 45)
    got = CPUBackend().dca_attention(*qs, q_pos, layer, dca, scale=0.125)
    want = _reference(qs[0], q_pos, layer, scale=0.125, dca=dca, q_rotations=qs)
    assert np.abs(got - want).max() <= 2e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("main, tail", PAIRS)
@pytest.mark.parametrize("normalize", [False, True])
def test_rows_older_than_the_window_are_the_main_rows_retyped(main, tail, normalize):
    """Every tail row is encode_tail(decode_main(encode_main(k))) in the shared normalised domain (the formats'
    NumPy codecs, from the raw keys); the ring holds the newest positions in the main types as they were
    encoded."""
    layer, k, v = _filled(main, tail, normalize=normalize)
    m_k, m_v = get_format(main, head_dim=HEAD_DIM), get_format(main, head_dim=HEAD_DIM)
    t_k, t_v = get_format(tail, head_dim=HEAD_DIM), get_format(tail, head_dim=HEAD_DIM)
    if normalize:
        assert layer.tail.k_offset is layer.main.k_offset and layer.tail.k_scale is layer.main.k_scale
        k = (k - layer.main.k_offset) / layer.main.k_scale
    n = len(k)
    main_k = m_k.encode(k.reshape(n * N_KV, HEAD_DIM))
    main_v = m_v.encode(v.reshape(n * N_KV, HEAD_DIM))
    want_k = t_k.encode(m_k.decode(main_k, HEAD_DIM)).reshape(n, N_KV, -1)
    want_v = t_v.encode(m_v.decode(main_v, HEAD_DIM)).reshape(n, N_KV, -1)
    assert np.array_equal(layer.tail.slot_pos[:n], np.arange(n))
    assert np.array_equal(layer.tail.k_data[:n], want_k) and np.array_equal(layer.tail.v_data[:n], want_v)
    held = layer.main.slot_pos[layer.main.slot_pos >= 0]
    assert set(range(n - WINDOW, n)) <= set(held.tolist())
    for slot, p in enumerate(layer.main.slot_pos):
        if p >= 0:
            assert layer.main.k_data[slot].tobytes() == main_k.reshape(n, N_KV, -1)[p].tobytes()
    assert layer.nbytes == layer.main.nbytes + layer.tail.nbytes


@pytest.mark.parametrize("arch", ["qwen2", "gemma4"])
def test_no_tail_type_is_todays_cache_byte_for_byte(tiny_model, arch):
    """A window without tail types, or tail types with a window as long as the context: the plain cache, the same
    state() bytes after the same prompt, the same bytes counted."""
    path, _, _ = tiny_model(arch)
    model = cupyllm.load(path, device="cpu", ctx=48, kv_type_k="q8_0", kv_type_v="q4_0", max_chunk=8,
                         progress=False)
    ids = list(range(3, 40))
    states = []
    for spec in (model.kv_spec, dataclasses.replace(model.kv_spec, kv_window=16),
                 dataclasses.replace(model.kv_spec, kv_window=48, kv_type_k_tail="q4_0", kv_type_v_tail="q4_0")):
        assert not spec.has_tail and kv_bytes(model.cfg, spec) == kv_bytes(model.cfg, model.kv_spec)
        cache = model.transformer.ops.new_cache(model.cfg, spec)
        assert not any(isinstance(layer, WindowedLayerKV) for layer in cache.layers)
        prefill(model._forward_numpy, ids, cache, spec.max_chunk)
        states.append(cache.state())
    for other in states[1:]:
        assert len(other) == len(states[0])
        for a, b in zip(states[0], other):
            assert a.keys() == b.keys() and all(np.asarray(a[n]).tobytes() == np.asarray(b[n]).tobytes() for n in a)


def test_bytes_counted(tiny_model):
    """kv_bytes of a mixed cache: the ring of window + chunk in the main types and every position in the tail
    types, for the global layers (sliding ones as they were); what the cache allocates."""
    path, _, _ = tiny_model("gemma4")
    model = cupyllm.load(path, device="cpu", ctx=96, kv_type_k="f16", kv_type_v="f16", max_chunk=8,
                         kv_window=16, kv_type_k_tail="q4_0", kv_type_v_tail="q8_0", progress=False)
    cfg, spec = model.cfg, model.kv_spec
    cache = model.transformer.ops.new_cache(cfg, spec)
    assert kv_bytes(cfg, spec) == cache.nbytes
    want = 0
    for il in range(cfg.n_layer):
        if cfg.kv_source(il) != il:
            continue
        n_kv, d = cfg.n_kv_head_of(il), cfg.head_dim_of(il)
        row = lambda name: get_format(name, head_dim=d).row_bytes(d) * n_kv  # noqa: E731
        if cfg.is_sliding(il):
            want += min(96, cfg.sliding_window + 8) * 2 * row("f16")
        else:
            want += (16 + 8) * 2 * row("f16") + 96 * (row("q4_0") + row("q8_0"))
    assert cache.nbytes == want < kv_bytes(cfg, dataclasses.replace(spec, kv_type_k_tail=None, kv_type_v_tail=None))


def test_q4_0_floor_for_an_auto_spill(tiny_model):
    """-ctk auto with a spill: a tier above q4_0 gets a q4_0 host part, one at or below it none."""
    path, _, _ = tiny_model("qwen2")
    model = cupyllm.load(path, device="cpu", ctx=48, progress=False)
    spec = KVSpec(ctx=4096, kv_type_k="q8_0", kv_type_v="turbo3_tcq", device_window=512)
    floored = floor_tail(model.cfg, spec)
    assert (floored.kv_type_k_tail, floored.kv_type_v_tail) == ("q4_0", None) and floored.has_tail
    assert not floor_tail(model.cfg, dataclasses.replace(spec, kv_type_k="q4_0")).kv_type_k_tail


def _mixed(tiny_model, arch, main="f16", tail="q4_0", *, window=8, ctx=64, **options):
    path, _, _ = tiny_model(arch)
    return cupyllm.load(path, device="cpu", ctx=ctx, kv_type_k=main, kv_type_v=main, max_chunk=8,
                        kv_window=window, kv_type_k_tail=tail, kv_type_v_tail=tail, progress=False, **options)


def _logits(model, ids, spec=None):
    cache = model.transformer.ops.new_cache(model.cfg, spec or model.kv_spec)
    return prefill(model._forward_numpy, ids, cache, model.kv_spec.max_chunk).reshape(-1), cache


ARCHS = ["qwen2", "qwen3", "qwen3-moe", "gemma3", "gemma4", "gemma4-moe", "qwen35"]


@pytest.mark.parametrize("arch", ARCHS + ["qwen2-dca"])
def test_every_family_generates_with_a_mixed_cache(tiny_model, arch):
    """Tail types equal to the main ones: the same logits as the uniform cache (no key lost or read twice by the
    two masks); q4_0 tail: other logits (the tail is read), and generation runs."""
    dca = {"chunk_size": 24, "local_size": 4} if arch.endswith("-dca") else None
    arch = arch.removesuffix("-dca")
    ids = list(range(3, 45))
    same = _mixed(tiny_model, arch, "f16", "f16", dca=dca)
    mixed = _mixed(tiny_model, arch, "f16", "q4_0", dca=dca)
    uniform = dataclasses.replace(same.kv_spec, kv_window=0, kv_type_k_tail=None, kv_type_v_tail=None)
    want, _ = _logits(same, ids, uniform)
    got, cache = _logits(same, ids)
    if arch != "gemma3":  # (the tiny Gemma 3 has sliding layers only: nothing windowed)
        assert any(isinstance(layer, WindowedLayerKV) for layer in cache.layers)
        assert not np.allclose(_logits(mixed, ids)[0], want, atol=1e-4 * np.abs(want).max())
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    text = mixed.generate(ids, max_tokens=12, temperature=0.0)
    assert mixed.last_stats.generated_tokens == 12 and isinstance(text, str)


def test_speculative_decoding_keeps_greedy_text(tiny_model):
    """Drafts written and rejected (mark / rewind) leave each query the same rows as plain decoding reads."""
    model = _mixed(tiny_model, "qwen2", "q8_0", "q4_0")
    prompt = [3, 17, 5, 9, 3, 17, 5, 11, 2, 8, 13, 21, 3, 17, 5, 9, 3, 17]
    plain = model.generate(prompt, max_tokens=30, temperature=0.0)
    spec = model.generate(prompt, max_tokens=30, temperature=0.0, spec="ngram")
    assert model.last_stats.draft.drafted > 0 and spec == plain


def test_rewind_and_cut(tiny_model):
    """mark / rewind back within the ring's spare slots, and cut_to: the rows of a fresh prefill of the kept
    tokens; a cut further back than the ring holds starts afresh (as a sliding-window layer)."""
    model = _mixed(tiny_model, "qwen3", "q8_0", "q4_0")
    ids = list(range(3, 40))
    _, fresh = _logits(model, ids[:30])
    _, cache = _logits(model, ids[:30])
    mark = cache.mark()
    prefill(model._forward_numpy, ids[30:36], cache, 8)
    assert cache.rewind(mark, 30) == 30
    step = lambda c: model._forward_numpy(np.array([7]), np.array([30]), c).reshape(-1)  # noqa: E731
    want = step(fresh)
    assert np.array_equal(step(cache), want)
    _, cache = _logits(model, ids)
    assert cache.cut_to(30) == 30 and cache.n_past == 30
    assert np.array_equal(step(cache), want)
    _, cache = _logits(model, ids)
    assert cache.cut_to(10) == 0 and cache.n_past == 0  # the ring lost the window before 10


def test_prompt_cache_state_restore_and_file(tiny_model, tmp_path):
    """cache_prompt / save / load / generate(prompt_cache=): the restored mixed cache gives the logits and text
    of a fresh run; its arrays pass layer_state_problem; a uniform cache's file does not fit it."""
    model = _mixed(tiny_model, "gemma4", "q8_0", "q4_0")
    prompt = list(range(3, 35))
    saved = model.cache_prompt(prompt)
    saved.save(tmp_path / "p.npz")
    loaded = PromptCache.load(tmp_path / "p.npz")
    cache = model.new_cache()
    assert all(layer_state_problem(layer, state, len(prompt)) is None
               for layer, state in zip(cache.own_layers(), loaded.layer_states))
    cache.restore(loaded.layer_states, len(prompt))
    fresh_logits, fresh = _logits(model, prompt)
    step = lambda c: model._forward_numpy(np.array([9]), np.array([len(prompt)]), c).reshape(-1)  # noqa: E731
    assert np.array_equal(step(cache), step(fresh))
    want = model.generate(prompt + [40, 41], max_tokens=10, temperature=0.0)
    assert model.generate(prompt + [40, 41], max_tokens=10, temperature=0.0, prompt_cache=loaded) == want
    uniform = cupyllm.load(model.path, device="cpu", ctx=64, kv_type_k="q8_0", kv_type_v="q8_0", max_chunk=8,
                           progress=False)
    assert uniform.prompt_cache_problem(loaded) is not None


@pytest.mark.parametrize("keep, discard", [(4, 20), (30, 6)])
def test_context_shift(tiny_model, keep, discard):
    """After a shift each part holds its own rows re-roped (K decodes near the unshifted key rotated), the ring
    holds every position of the new window (a kept prefix brought into it comes back from its tail row), and
    attention still reads each position once; generation goes on past a full context."""
    model = _mixed(tiny_model, "qwen2", "q8_0", "q4_0", window=12)
    ids = list(range(3, 45))
    _, cache = _logits(model, ids)
    shift_cache(cache, model.cfg, keep, discard)
    n = cache.n_past
    assert n == len(ids) - discard
    for layer in cache.own_layers():
        held = set(layer.main.slot_pos[layer.main.slot_pos >= 0].tolist())
        assert set(range(n - 12, n)) <= held and max(held) == n - 1
        assert np.array_equal(layer.tail.slot_pos[:n], np.arange(n)) and layer.tail.n_used == n
        rng = np.random.default_rng(3)
        q = rng.normal(size=(1, model.cfg.n_head, layer.head_dim)).astype(np.float32)
        got = CPUBackend().attention(q, np.array([n]), layer, scale=0.125)
        main, tail = _decoded(layer.main), _decoded(layer.tail)
        rows = [main[p] if n - p < 12 else tail[p] for p in range(n)]
        want, _ = attend(q, np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]), None, scale=0.125)
        assert np.abs(got - want).max() <= 2e-5 * max(1.0, np.abs(want).max())
    text = model.generate(ids, max_tokens=60, temperature=0.0, context_shift=True, keep=4)
    assert model.last_stats.generated_tokens == 60 and model.last_stats.context_shifts >= 2 and text


def test_cli(tiny_model):
    """`cupyllm info` counts the tail (the bytes kv_bytes gives) and `cupyllm generate` announces it."""
    path, _, _ = tiny_model("qwen3")
    flags = ["-c", "256", "--kv-window", "32", "-ctkt", "q4_0", "-ctvt", "q8_0"]
    info = subprocess.run([sys.executable, "-m", "cupyllm.cli", "info", str(path), *flags], capture_output=True,
                          text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    model = cupyllm.load(path, device="cpu", ctx=256, kv_window=32, kv_type_k_tail="q4_0", kv_type_v_tail="q8_0",
                         progress=False)
    from cupyllm.kv.plan import format_bytes
    line = next(line for line in info.stdout.splitlines() if line.startswith("KV cache"))
    assert f"{format_bytes(kv_bytes(model.cfg, model.kv_spec))} at ctx 256" in line
    assert "older than the newest 32: K q4_0, V q8_0" in line
    run = subprocess.run([sys.executable, "-m", "cupyllm.cli", "generate", "-m", str(path), "--device", "cpu",
                          *flags, "-n", "8", "--temp", "0", "hello world"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "KV tail: positions past the newest 32 stored as K q4_0, V q8_0" in run.stderr
    refused = subprocess.run([sys.executable, "-m", "cupyllm.cli", "generate", "-m", str(path), "--device", "cpu",
                              "--kv-window", "32", "-n", "2", "hello"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "-ctkt/--cache-type-k-tail" in refused.stderr


def test_options_refused_clearly(tiny_model):
    path, _, _ = tiny_model("qwen2")
    for options, words in ((dict(kv_window=16), "tail types"), (dict(kv_type_k_tail="q4_0"), "--kv-window"),
                           (dict(kv_window=-1, kv_type_k_tail="q4_0"), ">= 0"),
                           (dict(kv_window=8, kv_type_k_tail="auto"), "not auto"),
                           (dict(kv_window=8, kv_type_k_tail="q4_0", kv_mirror=True), "--kv-mirror"),
                           (dict(kv_window=8, kv_type_v_tail="q9"), "q9")):
        with pytest.raises((InputError, cupyllm.errors.CupyllmError), match=words):
            cupyllm.load(path, device="cpu", ctx=48, progress=False, **options)


# --- the GPU (a device, or the CUDA emulator: CUPYLLM_EMULATE=1 python -m pytest -m gpu) -----------------------------
GPU_IDS = [5, 17, 99, 3, 42, 7, 11, 64, 200, 1, 33, 18, 77, 9, 120, 4, 57, 81]


@pytest.fixture(scope="module")
def flash_qwen(tmp_path_factory):
    """A Qwen2 of head dim 64 (the flash kernels' dims), every layer global."""
    import make_tiny_models
    spec = dataclasses.replace(make_tiny_models.tiny_spec("qwen2"), n_layer=2, head_dim=64)
    path = tmp_path_factory.mktemp("window") / "tiny-qwen2.gguf"
    make_tiny_models.write_gguf(spec, path)
    return path


def _run_ids(ops, path, spec, n_prefill: int):
    """Logits of GPU_IDS: the first n_prefill in chunks of spec.max_chunk, then one-token steps; and the cache."""
    from cupyllm.files.gguf import read_gguf
    from cupyllm.models.build import Transformer
    transformer = Transformer.from_gguf(read_gguf(path), ops, progress=False)
    cache = ops.new_cache(transformer.cfg, spec)

    def forward(tokens, positions, cache, all_logits=False):
        return ops.to_numpy(transformer.forward(tokens, positions, cache, all_logits))

    logits = [prefill(forward, GPU_IDS[:n_prefill], cache, spec.max_chunk, all_logits=True)]
    for token in GPU_IDS[n_prefill:]:
        logits.append(forward(np.array([token]), np.array([cache.n_past]), cache))
        cache.n_past += 1
    return np.concatenate(logits), cache


def _gpu_ops():
    from gpu_helpers import GPU_TEST_MARKS
    for mark in GPU_TEST_MARKS[1:]:  # (the skip when there is no device, at run time)
        if mark.args and mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
    from cupyllm.backend.gpu import GPUBackend
    return GPUBackend(attention="dispatch")


@pytest.mark.gpu
@pytest.mark.parametrize("main, tail", [("f16", "q4_0"), ("q8_0", "q4_0")])
def test_gpu_windowed_cache(flash_qwen, main, tail):
    """The device's windowed cache: each tail row the ring still holds is encode_tail(decode_main(its main row))
    with the NumPy codecs; attention (the flash kernels, FA-VEC for a decode step and FA-MMA for a chunk, reading
    the tail with the negative window) is the NumPy reference over the rows decoded from their own formats; the
    model's logits differ from the CPU's windowed cache by less than the tail itself changes them."""
    ops = _gpu_ops()
    whole = KVSpec(ctx=64, kv_type_k=main, kv_type_v=main, max_chunk=4)
    mixed = dataclasses.replace(whole, kv_window=6, kv_type_k_tail=tail, kv_type_v_tail=tail)
    got, gpu_cache = _run_ids(ops, flash_qwen, mixed, n_prefill=12)
    cpu, _ = _run_ids(CPUBackend(), flash_qwen, mixed, n_prefill=12)
    want, _ = _run_ids(ops, flash_qwen, whole, n_prefill=12)
    cpu_whole, _ = _run_ids(CPUBackend(), flash_qwen, whole, n_prefill=12)
    m_fmt, t_fmt = get_format(main, head_dim=64), get_format(tail, head_dim=64)
    for layer in gpu_cache.own_layers():
        assert isinstance(layer, WindowedLayerKV)
        held = layer.main.slot_pos.get()
        for slot in np.flatnonzero(held >= 0):
            p = int(held[slot])
            for data, tail_data in ((layer.main.k_data, layer.tail.k_data), (layer.main.v_data, layer.tail.v_data)):
                want_row = t_fmt.encode(m_fmt.decode(data[int(slot)].get(), 64))
                assert np.array_equal(tail_data[p].get(), want_row)
    from gpu_helpers import MMA_TOL_O
    layer = gpu_cache.own_layers()[1]
    host = _HostCopy(layer)
    rng = np.random.default_rng(4)
    n = len(GPU_IDS)
    for n_q in (1, 4):
        q = rng.normal(size=(n_q, 4, 64)).astype(np.float32)
        q_pos = np.arange(n - n_q, n)
        got_o = ops.to_numpy(ops.attention(ops.asarray(q), q_pos, layer, scale=0.125))
        want_o = _reference(q, q_pos, host, scale=0.125)
        assert np.abs(got_o - want_o).max() <= 2 * MMA_TOL_O * max(1.0, np.abs(want_o).max())
    assert np.abs(got - want).max() > 1e-4 * np.abs(want).max()  # (the q4_0 tail is read)
    assert np.abs(got - cpu).max() < np.abs(cpu - cpu_whole).max()


def _spill_and_window(ops, path, base, n_prefill=12):
    """(spilled with a device window of 6, windowed by 6) caches of one spec with tail types, on the device."""
    spilled = _run_ids(ops, path, dataclasses.replace(base, device_window=6), n_prefill=n_prefill)
    windowed = _run_ids(ops, path, dataclasses.replace(base, kv_window=6), n_prefill=n_prefill)
    return spilled, windowed


@pytest.mark.gpu
def test_gpu_spilled_host_part_is_the_tail(flash_qwen):
    """Spilled with tail types: the host rows are the tail rows a windowed cache of that window holds (layer 0,
    whose keys depend on the tokens alone: the same bytes), the bytes counted are the arrays', and each decode
    step reads what the windowed cache reads (the device ring holds the newest `window` positions, the host the
    rest): token by token, the same logits up to the order of the merges."""
    from cupyllm.kv.cache import host_kv_bytes
    from cupyllm.kv.gpu_spill import SpilledLayerKV
    ops = _gpu_ops()
    base = KVSpec(ctx=64, kv_type_k="q8_0", kv_type_v="q8_0", max_chunk=4, normalize_k=False,
                  kv_type_k_tail="q4_0", kv_type_v_tail="q4_0")
    (got, spilled), (want, windowed) = _spill_and_window(ops, flash_qwen, base, n_prefill=1)
    layers = spilled.own_layers()
    assert all(isinstance(layer, SpilledLayerKV) and layer.retyped and layer.n_host == len(GPU_IDS) - 6
               for layer in layers)
    first, first_windowed = layers[0], windowed.own_layers()[0]
    assert np.array_equal(first.host_k[:first.n_host], first_windowed.tail.k_data[:first.n_host].get())
    assert np.array_equal(first.host_v[:first.n_host], first_windowed.tail.v_data[:first.n_host].get())
    assert sum(layer.host_bytes for layer in layers) == host_kv_bytes(
        _cfg(flash_qwen), dataclasses.replace(base, device_window=6))
    # (one token a step: a prefill chunk would split the parts at its end, the window at each of its queries)
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


@pytest.mark.gpu
def test_gpu_context_shift_of_a_retyped_host_part(flash_qwen):
    """A shift of a spilled cache whose host part is the tail: the host rows are the windowed cache's tail rows
    after its shift (the tail's codec on the same bytes: layer 0), the ring holds the new window, and the next
    step's logits are finite."""
    ops = _gpu_ops()
    base = KVSpec(ctx=64, kv_type_k="f16", kv_type_v="f16", max_chunk=4, normalize_k=False,
                  kv_type_k_tail="q4_0", kv_type_v_tail="q4_0")
    (_, spilled), (_, windowed) = _spill_and_window(ops, flash_qwen, base)
    cfg = _cfg(flash_qwen)
    for keep, discard in ((2, 5), (9, 3)):  # (9: a kept host row comes back into the device window)
        for cache in (spilled, windowed):
            shift_cache(cache, cfg, keep, discard)
        n = spilled.n_past
        for layer in spilled.own_layers():
            assert layer.n_host == n - 6
            held = layer.device.slot_pos.get()
            assert sorted(held[held >= 0].tolist()) == list(range(n - 6, n))
        first, first_windowed = spilled.own_layers()[0], windowed.own_layers()[0]
        assert np.array_equal(first.host_k[:first.n_host], first_windowed.tail.k_data[:first.n_host].get())
    from cupyllm.files.gguf import read_gguf
    from cupyllm.models.build import Transformer
    transformer = Transformer.from_gguf(read_gguf(flash_qwen), ops, progress=False)
    logits = ops.to_numpy(transformer.forward(np.array([7]), np.array([spilled.n_past]), spilled))
    assert np.isfinite(logits).all()


@pytest.mark.gpu
def test_gpu_state_restore_of_mixed_caches(flash_qwen):
    """Prompt caching on the device: a windowed cache's and a spilled cache's (host part in the tail types) state()
    restores into a fresh cache of the same spec (layer_state_problem passes) and the next step's logits are
    the original cache's."""
    from cupyllm.files.gguf import read_gguf
    from cupyllm.models.build import Transformer
    ops = _gpu_ops()
    transformer = Transformer.from_gguf(read_gguf(flash_qwen), ops, progress=False)
    base = KVSpec(ctx=64, kv_type_k="q8_0", kv_type_v="q8_0", max_chunk=4, kv_type_k_tail="q4_0",
                  kv_type_v_tail="q4_0")
    for spec in (dataclasses.replace(base, kv_window=6), dataclasses.replace(base, device_window=6)):
        _, cache = _run_ids(ops, flash_qwen, spec, n_prefill=12)
        fresh = ops.new_cache(transformer.cfg, spec)
        states = cache.state()
        assert all(layer_state_problem(layer, state, cache.n_past) is None
                   for layer, state in zip(fresh.own_layers(), states))
        fresh.restore(states, cache.n_past)
        step = lambda c: ops.to_numpy(transformer.forward(np.array([7]), np.array([c.n_past]), c))  # noqa: E731
        assert np.array_equal(step(fresh), step(cache))


class _HostCopy:
    """A device WindowedLayerKV's parts as host arrays (what _decoded reads)."""

    def __init__(self, layer):
        self.kv_window = layer.kv_window
        self.main, self.tail = _host_part(layer.main), _host_part(layer.tail)


def _host_part(part):
    copy = LayerKV(part.k_format, part.v_format, part.n_kv, part.head_dim, part.v_head_dim, capacity=part.capacity,
                   ring=part.ring, window=part.window)
    copy.k_data, copy.v_data = part.k_data.get(), part.v_data.get()
    copy.slot_pos, copy.n_used = part.slot_pos.get().astype(np.int64), part.n_used
    if part.k_offset is not None:
        copy.k_offset, copy.k_scale = part.k_offset.get(), part.k_scale.get()
    return copy


def _cfg(path):
    from cupyllm.files.config import config_from_gguf
    from cupyllm.files.gguf import read_gguf
    return config_from_gguf(read_gguf(path))
