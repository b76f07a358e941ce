"""A spilled KV cache on the GPU (kv/gpu_spill.py): the newest positions on the device, the older ones in
pinned host memory, attention over both merged by LSE, against the same model with the whole cache on the
device and against the CPU engine. Runs on a GPU, or on the CUDA emulator (CUPYLLM_EMULATE=1)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpu_helpers import GPU_TEST_MARKS

pytestmark = GPU_TEST_MARKS

IDS = [5, 17, 99, 3, 42, 7, 11, 64, 200, 1, 33, 18, 77, 9, 120, 4, 57, 81]


@pytest.fixture(scope="module")
def flash_models(tmp_path_factory):
    """Head dims the flash kernels cover: a Qwen2 (every layer global) and a Gemma 4 (sliding layers stay
    whole on the device, shared layers read spilled caches)."""
    import make_tiny_models
    out = {}
    for arch, n_layer in (("qwen2", 2), ("gemma4", 7)):
        spec = dataclasses.replace(make_tiny_models.tiny_spec(arch), n_layer=n_layer, head_dim=64,
                                   global_head_dim=128 if arch == "gemma4" else 0)
        path = tmp_path_factory.mktemp("spill") / f"tiny-{arch}.gguf"
        make_tiny_models.write_gguf(spec, path)
        out[arch] = path
    return out


def _run(ops, path, spec, n_prefill: int, dca=None):
    """Logits of IDS: the first n_prefill in chunks of spec.max_chunk, then one-token steps."""
    from cupyllm.generate import prefill
    from cupyllm.files.gguf import read_gguf
    from cupyllm.models.build import Transformer
    from cupyllm.models.layers import dca_attention
    transformer = Transformer.from_gguf(read_gguf(path), ops, progress=False)
    if dca is not None:
        transformer.attention = dca_attention(dca)
    cache = ops.new_cache(transformer.cfg, spec)

    def forward(tokens, positions, cache, all_logits=False):
        return ops.to_numpy(transformer.forward(tokens, positions, cache, all_logits))

    logits = [prefill(forward, IDS[:n_prefill], cache, spec.max_chunk, all_logits=True)]
    for token in IDS[n_prefill:]:
        logits.append(forward(np.array([token]), np.array([cache.n_past]), cache))
        cache.n_past += 1
    return np.concatenate(logits), cache


@pytest.mark.parametrize("arch", ["qwen2", "gemma4"])
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_spilled_cache_matches_the_whole_cache(flash_models, arch, kv_type):
    from cupyllm.backend.cpu import CPUBackend
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.kv.gpu_spill import SpilledLayerKV
    from cupyllm.kv.cache import KVSpec
    whole = KVSpec(ctx=64, kv_type_k=kv_type, kv_type_v=kv_type, max_chunk=4)
    spilled = dataclasses.replace(whole, device_window=6)
    ops = GPUBackend(attention="dispatch")
    want, _ = _run(ops, flash_models[arch], whole, n_prefill=12)
    got, cache = _run(ops, flash_models[arch], spilled, n_prefill=12)
    layers = [layer for layer in cache.own_layers() if isinstance(layer, SpilledLayerKV)]
    assert layers and all(layer.n_host == len(IDS) - 6 for layer in layers)  # 12 of the 18 positions on the host
    scale = np.abs(want).max()
    # the same keys in other tiles: fa_mma rounds P (and q8_0's dequantized K, times the normalised Q) to f16
    # against each part's own running maximum; measured up to 5e-4 (f16) and 2.1e-3 (q8_0) of the largest logit
    assert np.abs(got - want).max() <= (1e-3 if kv_type == "f16" else 4e-3) * scale
    cpu, _ = _run(CPUBackend(), flash_models[arch], whole, n_prefill=12)
    # against the CPU engine, spilling adds at most that rounding to what the GPU paths differ by anyway
    assert np.abs(got - cpu).max() <= np.abs(want - cpu).max() + (1e-3 if kv_type == "f16" else 4e-3) * scale


def test_spilled_cache_with_dual_chunk_attention(flash_models):
    """The fused DCA kernels over the device ring and the host rows (chunks of 6 positions: the 18 tokens
    cross two chunk boundaries), against DCA over the whole device cache."""
    from cupyllm.ops.attention.dca import DCAConfig
    from cupyllm.backend.gpu import GPUBackend
    from cupyllm.kv.cache import KVSpec
    dca = DCAConfig.for_model(256, chunk_size=8, local_size=2)
    whole = KVSpec(ctx=64, max_chunk=4)
    ops = GPUBackend(attention="dispatch")
    want, _ = _run(ops, flash_models["qwen2"], whole, n_prefill=12, dca=dca)
    got, _ = _run(ops, flash_models["qwen2"], dataclasses.replace(whole, device_window=6), n_prefill=12, dca=dca)
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


def test_spilled_load_and_generate(flash_models):
    """kv_spill through the API: a budget below the whole cache spills, and generation runs greedily to the
    same tokens as with the whole cache."""
    import cupyllm
    from cupyllm.kv.cache import KVSpec, kv_bytes
    path = flash_models["qwen2"]
    whole = cupyllm.load(path, device="gpu", ctx=64, max_chunk=4, progress=False)
    budget = kv_bytes(whole.cfg, KVSpec(ctx=64, max_chunk=4, device_window=10))
    spilled = cupyllm.load(path, device="gpu", ctx=64, max_chunk=4, kv_budget=budget, kv_spill=True, progress=False)
    assert spilled.kv_spec.device_window == 10 and "pinned host memory" in spilled.spill_plan.describe()
    prompt = "the water in the sea"
    assert spilled.generate(prompt, max_tokens=12, temperature=0) == whole.generate(prompt, max_tokens=12, temperature=0)


def test_auto_types_take_the_free_device_memory(flash_models):
    """kv_type 'auto' without a budget: 90% of what the device has free once the weights are on it."""
    import cupyllm
    model = cupyllm.load(flash_models["qwen2"], device="gpu", ctx=64, kv_type_k="auto", kv_type_v="auto",
                         progress=False)
    free = model.transformer.ops.memory_available()
    assert abs(model.kv_plan.budget - 0.9 * free) <= 0.01 * free  # (free memory moves a little meanwhile)
    assert model.kv_plan.tier.name == "f16"  # a 64-token cache of a tiny model fits anywhere


def test_prompt_cache_of_a_spilled_cache(flash_models, tmp_path):
    """Prompt caching over a spilled cache (device ring + host rows): a cached prefix, a cache cut back below
    its host part, a reply kept by generate(keep_cache=True) and a file round trip all give the fresh run's
    tokens."""
    import cupyllm
    from cupyllm.kv.cache import KVSpec, kv_bytes
    from cupyllm.kv.prompt_cache import PromptCache
    path = flash_models["qwen2"]
    probe = cupyllm.load(path, device="gpu", ctx=96, max_chunk=4, progress=False)
    budget = kv_bytes(probe.cfg, KVSpec(ctx=96, max_chunk=4, device_window=10))
    model = cupyllm.load(path, device="gpu", ctx=96, max_chunk=4, kv_budget=budget, kv_spill=True, progress=False)
    assert model.kv_spec.device_window == 10
    prefix, tail = list(range(3, 33)), [7, 8, 9]

    def scribble():
        model.generate(list(range(150, 190)), max_tokens=2, temperature=0)

    fresh = model.generate(prefix + tail, max_tokens=6, temperature=0)
    cached = model.cache_prompt(prefix)
    assert max(int(state["n_host"]) for state in cached.layer_states) == len(prefix) - 10
    scribble()
    assert model.generate(prefix + tail, max_tokens=6, temperature=0, prompt_cache=cached) == fresh
    assert model.last_stats.cached_tokens == len(prefix)

    longer = model.cache_prompt(prefix + list(range(100, 120)))  # its host part reaches past the shared 30
    assert max(int(state["n_host"]) for state in longer.layer_states) > len(prefix)
    scribble()
    assert model.generate(prefix + tail, max_tokens=6, temperature=0, prompt_cache=longer) == fresh
    assert model.last_stats.cached_tokens == len(prefix)

    model.generate(prefix, max_tokens=5, temperature=0, keep_cache=True)
    kept = model.last_prompt_cache
    follow_up = list(kept.ids) + tail
    want = model.generate(follow_up, max_tokens=6, temperature=0)
    kept.save(tmp_path / "spilled.npz")
    scribble()
    assert model.generate(follow_up, max_tokens=6, temperature=0,
                          prompt_cache=PromptCache.load(tmp_path / "spilled.npz")) == want
    assert model.last_stats.cached_tokens == len(kept.ids)
