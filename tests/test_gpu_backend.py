"""The GPU backend (cupyllm/backend/gpu.py) on whole models: tiny random models against the CPU engine on the same
GGUF, the real models against HF transformers' stored logits. The kernels one by one are checked in tests/ops/
(test_matmul_gpu, test_elementwise_gpu, test_kv_formats_gpu, test_attention_gpu).

Stated tolerances (float32):
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
    path, _, _ = tiny_model(arch)
    # MoE: f16 activations can flip a near-tied expert choice, a jump no tolerance covers; GEMVs are f32
    _assert_matches_the_cpu_engine(path, monkeypatch, () if arch.endswith("-moe") else ("cublas", "mma"))


def _assert_matches_the_cpu_engine(path, monkeypatch, prefill_paths) -> None:
    """GPU decode path (chunks of 4, then one-token steps) within 2e-4 of the CPU engine on float32 activations,
    with its argmax; then each of `prefill_paths` over the whole prompt within 5e-3."""
    from cupyllm.backend.cpu import CPUBackend
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.ops.matmul import cpu as cpu_linear
    ids = [5, 17, 99, 3, 42, 7, 11, 64, 200, 1, 33, 18, 77]
    steps = [9, 120, 4]
    with monkeypatch.context() as patch:
        patch.setattr(cpu_linear, "ACTIVATION_CODES", False)
        want = _run(CPUBackend(), path, ids, chunk=4, decode_steps=steps)
    scale = np.abs(want).max()
    got = _run(GPUBackend(attention="decode"), path, ids, chunk=4, decode_steps=steps)
    assert np.abs(got - want).max() <= 2e-4 * scale
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    for prefill_path in prefill_paths:
        got = _run(GPUBackend(prefill=prefill_path, attention="decode"), path, ids, chunk=len(ids))
        assert np.abs(got - want[:len(ids)]).max() <= 5e-3 * scale, prefill_path


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory):
    """The tiny Qwen3.5 hybrids with DeltaNet key and value head dims 32 (the tiny models' 16 is below the
    smallest the GPU kernels take: ops/deltanet/gpu.py KEY_HEAD_DIMS)."""
    import dataclasses

    import make_tiny_models
    out = {}
    for arch in ("qwen35", "qwen35-moe", "qwen3next"):
        path = tmp_path_factory.mktemp("hybrid") / f"tiny-{arch}-32.gguf"
        spec = dataclasses.replace(make_tiny_models.tiny_spec(arch), ssm_k_dim=32, ssm_v_dim=32)
        make_tiny_models.write_gguf(spec, path)
        out[arch] = path
    return out


@pytest.mark.parametrize("arch", ["qwen35", "qwen35-moe", "qwen3next"])
def test_hybrid_logits_match_the_cpu_engine(hybrid_models, arch, monkeypatch):
    """The Gated DeltaNet layers on the GPU kernels (conv state and recurrent state on the device, carried
    across prefill chunks and decode steps), against the CPU engine; tolerances as for the other tiny models."""
    # MoE: f16 activations can flip a near-tied expert choice (as above)
    _assert_matches_the_cpu_engine(hybrid_models[arch], monkeypatch, ("cublas",) if arch == "qwen35" else ())


def test_hybrid_generates_as_the_cpu_engine_and_with_a_prompt_cache(hybrid_models):
    """cupyllm.load(device="gpu") on a hybrid: greedy text as the CPU engine's, and again from a prompt cache
    (the device states copied to the host and restored)."""
    import cupyllm
    path = hybrid_models["qwen35"]
    prefix, tail = list(range(5, 60)), [7, 8, 9]
    gpu = cupyllm.load(path, device="gpu", ctx=128, max_chunk=16, progress=False)
    cpu = cupyllm.load(path, device="cpu", ctx=128, max_chunk=16, progress=False)
    fresh = gpu.generate(prefix + tail, max_tokens=6, temperature=0)
    assert fresh == cpu.generate(prefix + tail, max_tokens=6, temperature=0)
    cached = gpu.cache_prompt(prefix)
    assert gpu.generate(prefix + tail, max_tokens=6, temperature=0, prompt_cache=cached) == fresh
    # the restored device states give the tail the logits of the cache they were taken from
    ops, transformer = gpu.transformer.ops, gpu.transformer
    forward = _numpy_forward(ops, transformer)
    source, restored, empty = (ops.new_cache(gpu.cfg, gpu.kv_spec) for _ in range(3))
    forward(np.array(prefix), np.arange(len(prefix)), source)
    source.n_past = len(prefix)
    restored.restore(source.state(), len(prefix))
    positions = np.arange(len(prefix), len(prefix) + len(tail))
    want = forward(np.array(tail), positions, source, all_logits=True)
    np.testing.assert_array_equal(forward(np.array(tail), positions, restored, all_logits=True), want)
    assert np.abs(forward(np.array(tail), positions, empty, all_logits=True) - want).max() > 1e-3  # states matter


def test_hybrid_device_states_are_zeroed_float32_and_counted(hybrid_models):
    """GPUBackend.new_cache: each linear-attention layer's conv [K - 1, C] and recurrent [Hv, Dk, Dv] states are
    zeroed float32 device arrays, counted in the cache's bytes as kv_bytes plans them."""
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.files.config import config_from_gguf
    from cupyllm.files.gguf import read_gguf
    from cupyllm.kv.cache import KVCache, KVSpec, kv_bytes
    from cupyllm.kv.gpu_cache import DeviceRecurrentState
    ops = GPUBackend()
    cfg = config_from_gguf(read_gguf(hybrid_models["qwen35"]))
    spec = KVSpec(ctx=64, kv_type_k="f16", kv_type_v="f16", max_chunk=8)
    cache = ops.new_cache(cfg, spec)
    s = cfg.ssm
    states = [layer for layer in cache.layers if isinstance(layer, DeviceRecurrentState)]
    assert len(states) == sum(cfg.is_recurrent(il) for il in range(cfg.n_layer)) == 2
    for state in states:
        assert state.conv.shape == (s.conv_kernel - 1, s.conv_channels) and state.conv.dtype == np.float32
        assert state.recurrent.shape == (s.n_v_heads, 32, 32) and state.recurrent.dtype == np.float32
        assert not ops.to_numpy(state.conv).any() and not ops.to_numpy(state.recurrent).any()
    assert cache.nbytes == KVCache.for_model(cfg, spec).nbytes == kv_bytes(cfg, spec)


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


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "qwen35"])
def test_speculative_decoding_on_the_device(flash_sized_models, hybrid_models, arch):
    """Drafts verified on the GPU backend (the verify runs take the multi-query paths, the plain steps the decode
    kernels and graphs; rewinds cut device rings, the hybrid's device states go back to their mark): greedy text as
    plain decoding's, with n-gram drafts and with the model drafting for itself."""
    import cupyllm
    path = hybrid_models[arch] if arch == "qwen35" else flash_sized_models[arch]
    model = cupyllm.load(path, device="gpu", ctx=96, max_chunk=8, progress=False)
    prompt = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 11, 64]
    plain = model.generate(prompt, max_tokens=24, temperature=0)
    for spec in ({"type": "ngram", "ngram_min": 1, "draft_max": 4, "adaptive": False},
                 {"type": "self", "draft_max": 4, "adaptive": False}):
        assert model.generate(prompt, max_tokens=24, temperature=0, spec=spec) == plain, spec
    assert model.last_stats.draft.drafted > 0


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "qwen35"])
def test_batched_forward_on_the_device(flash_sized_models, hybrid_models, arch):
    """The server's batched forward (models/batch.py) on the GPU backend: three sequences prefilled one by one,
    then three steps of all three in one forward (several rows through the device's GEMVs, attention over each
    sequence's own device cache, the hybrid's device states per sequence): each sequence's logits those of its
    own forward alone, within the device's float32 rounding, with the same argmax."""
    import cupyllm
    from cupyllm.models.batch import Segment, forward_batch
    path = hybrid_models[arch] if arch == "qwen35" else flash_sized_models[arch]
    model = cupyllm.load(path, device="gpu", ctx=96, progress=False)
    t = model.transformer
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, model.cfg.n_vocab, size=n) for n in (5, 11, 2)]
    alone = [t.ops.new_cache(model.cfg, model.kv_spec) for _ in prompts]
    batched = [t.ops.new_cache(model.cfg, model.kv_spec) for _ in prompts]

    def check(got, want):
        want = np.asarray(t.ops.to_numpy(want), np.float32)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))

    for ids, a, b in zip(prompts, alone, batched):
        got, = forward_batch(t, [Segment(ids, b)])
        check(got, t.forward(ids, np.arange(len(ids)), a))
        a.n_past = b.n_past = len(ids)
    for _ in range(3):
        tokens = [np.array([int(rng.integers(3, model.cfg.n_vocab))]) for _ in prompts]
        got = forward_batch(t, [Segment(tk, b) for tk, b in zip(tokens, batched)])
        for i, (tk, a, b) in enumerate(zip(tokens, alone, batched)):
            check(got[i], t.forward(tk, np.array([a.n_past]), a))
            a.n_past += 1
            b.n_past += 1


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
