"""Qwen3.5 and Qwen3-Next (GGUF architectures `qwen35`, `qwen35moe`, `qwen3next`): Gated DeltaNet layers between
full-attention ones. The logits against transformers are in tests/test_forward_tiny.py (the tiny models are among
its architectures); here: the
configuration and its checks, the cache of a hybrid model (fixed-size states at the linear-attention layers),
the DeltaNet block against the float64 definition (ops/deltanet/reference.py), prompt caching, and the device
choice (the GPU where its DeltaNet kernels take the model's shapes)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import cupyllm
import make_tiny_models
from cupyllm.backend.cpu import CPUBackend
from cupyllm.errors import DeviceError, ModelFileError
from cupyllm.files.config import config_from_gguf
from cupyllm.files.gguf import read_gguf
from cupyllm.kv.cache import LayerKV, RecurrentState
from cupyllm.ops.deltanet import reference

PREFIX = list(range(5, 60))
TAIL = [7, 8, 9]


def _load(path, **options):
    return cupyllm.load(path, device="cpu", ctx=128, max_chunk=16, progress=False, **options)


def test_config_reads_the_hybrid_layout(tiny_model):
    path, spec, _ = tiny_model("qwen35")
    cfg = config_from_gguf(read_gguf(path))
    assert [cfg.is_recurrent(il) for il in range(4)] == [True, False, True, False]  # full_attention_interval 2
    s = cfg.ssm
    assert (s.conv_kernel, s.n_k_heads, s.n_v_heads, s.k_head_dim, s.v_head_dim) == (4, 2, 4, 16, 16)
    assert s.conv_channels == 2 * 2 * 16 + 4 * 16
    assert cfg.rope.n_rot == 16 and cfg.rope.neox and cfg.attn_output_gate and cfg.qk_norm


def test_the_cache_holds_kv_at_attention_layers_and_states_elsewhere(tiny_model):
    path, spec, _ = tiny_model("qwen35")
    model = cupyllm.load(path, device="cpu", ctx=64, kv_type_k="q8_0", kv_type_v="f16", progress=False)
    cache = model.new_cache()
    assert [type(layer) for layer in cache.layers] == [RecurrentState, LayerKV, RecurrentState, LayerKV]
    state_floats = 3 * 128 + 4 * 16 * 16  # conv [K - 1, C] and recurrent [Hv, Dk, Dv]
    kv = 64 * 2 * (34 + 2 * 32)  # 64 slots x 2 KV heads x (q8_0 K row + f16 V row) of head dim 32
    assert cache.nbytes == 2 * 4 * state_floats + 2 * kv


def _gguf_with(tmp_path, name, arch="qwen35", **changes):
    """A tiny Qwen3.5 written with some metadata writer calls replaced (value) or left out (None)."""
    import gguf as gguf_pkg

    saved = {}
    for method, value in changes.items():
        saved[method] = getattr(gguf_pkg.GGUFWriter, method)
        original = saved[method]
        setattr(gguf_pkg.GGUFWriter, method,
                (lambda self, v, _o=original, _value=value: _o(self, _value)) if value is not None
                else (lambda self, v: None))
    try:
        path = tmp_path / f"{name}.gguf"
        make_tiny_models.write_gguf(make_tiny_models.tiny_spec(arch), path)
    finally:
        for method, original in saved.items():
            setattr(gguf_pkg.GGUFWriter, method, original)
    return path


@pytest.mark.parametrize("changes, match", [
    (dict(add_ssm_time_step_rank=3), "ssm.time_step_rank"),  # not a multiple of the 2 key heads
    (dict(add_ssm_inner_size=60), "ssm.inner_size"),  # not a multiple of the 4 value heads
    (dict(add_ssm_inner_size=32), "not supported"),  # value heads of 8 dims: not a multiple of 16
    (dict(add_ssm_conv_kernel=None), "ssm.conv_kernel"),
    (dict(add_ssm_conv_kernel=3), "ssm_conv1d.weight"),  # the tensor has 4 taps
    (dict(add_full_attention_interval=3), "layer 1 is a linear-attention layer"),  # it has attn_q
])
def test_inconsistent_metadata_is_one_clear_error(tmp_path, changes, match):
    path = _gguf_with(tmp_path, "-".join(changes), **changes)
    with pytest.raises(ModelFileError, match=match):
        cupyllm.load(path, device="cpu", progress=False)


def test_the_moe_config(tiny_model, tmp_path):
    """Qwen3.5-MoE: the dense model's layers, 4 experts of which 2 run, a shared expert of 48; a file without the
    shared expert's width is one clear error."""
    cfg = config_from_gguf(read_gguf(tiny_model("qwen35-moe")[0]))
    assert (cfg.arch, cfg.n_expert, cfg.n_expert_used, cfg.shared_expert_ffn) == ("qwen35moe", 4, 2, 48)
    assert [cfg.is_recurrent(il) for il in range(4)] == [True, False, True, False]
    path = _gguf_with(tmp_path, "no-shared", arch="qwen35-moe", add_expert_shared_feed_forward_length=None)
    with pytest.raises(ModelFileError, match="expert_shared_feed_forward_length"):
        cupyllm.load(path, device="cpu", progress=False)


def test_the_qwen3next_config(tiny_model):
    """Qwen3-Next: the MoE model with HF's grouped value heads and alpha / beta fused in ssm_ba."""
    cfg = config_from_gguf(read_gguf(tiny_model("qwen3next")[0]))
    assert (cfg.arch, cfg.n_expert, cfg.shared_expert_ffn, cfg.ssm.grouped_v_heads) == ("qwen3next", 4, 48, True)
    assert not config_from_gguf(read_gguf(tiny_model("qwen35-moe")[0])).ssm.grouped_v_heads


def test_rope_dimension_count_must_fit_the_head(tmp_path):
    path = _gguf_with(tmp_path, "rot", add_rope_dimension_count=33)
    with pytest.raises(ModelFileError, match="rope.dimension_count"):
        cupyllm.load(path, device="cpu", progress=False)


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_the_deltanet_block_is_the_definition(tiny_model, arch):
    """Layer 0's token mixer on random inputs, in two pieces (the state carried between them), against the float64
    reference with the decoded weights; value heads mapped to key heads by hand: Qwen3.5's tiled order (head h
    reads key head h % Hk), Qwen3-Next's grouped one (h // (Hv / Hk)) with beta and alpha from ssm_ba."""
    from cupyllm.backend.cpu import CPUBackend
    from cupyllm.models.qwen35 import DeltaNetWeights, gated_deltanet

    path, spec, decoded = tiny_model(arch)
    gguf = read_gguf(path)
    cfg = config_from_gguf(gguf)
    ops = CPUBackend(threads=1)
    w = DeltaNetWeights.from_gguf(gguf, 0)
    state = RecurrentState.for_model(cfg)
    x = np.random.default_rng(3).standard_normal((11, cfg.d_model)).astype(np.float32)
    got = np.concatenate([gated_deltanet(ops, cfg, w, x[:6], [(slice(None), state)], np.arange(6)),
                          gated_deltanet(ops, cfg, w, x[6:], [(slice(None), state)], np.arange(6, 11))])
    assert state.n_seen == 11

    p = "blk.0."
    nk, nv, dk, dv = 2, 4, 16, 16
    xd = x.astype(np.float64)
    qkv, _ = reference.causal_conv1d_silu(xd @ decoded[p + "attn_qkv.weight"].T, decoded[p + "ssm_conv1d.weight"])
    q, k = qkv[:, :nk * dk].reshape(11, nk, dk), qkv[:, nk * dk:2 * nk * dk].reshape(11, nk, dk)
    v = qkv[:, 2 * nk * dk:].reshape(11, nv, dv)
    if arch == "qwen35":
        heads = [h % nk for h in range(nv)]  # the reference repeats nothing: one key head per value head
        alpha_in, beta_in = xd @ decoded[p + "ssm_alpha.weight"].T, xd @ decoded[p + "ssm_beta.weight"].T
    else:
        heads = [h // (nv // nk) for h in range(nv)]
        beta_alpha = (xd @ decoded[p + "ssm_ba.weight"].T).reshape(11, nk, 2, nv // nk)
        beta_in, alpha_in = beta_alpha[:, :, 0].reshape(11, nv), beta_alpha[:, :, 1].reshape(11, nv)
    g = decoded[p + "ssm_a"] * reference.softplus(alpha_in + decoded[p + "ssm_dt.bias"])
    beta = 1 / (1 + np.exp(-beta_in))
    o, final = reference.gated_delta_rule(q[:, heads], k[:, heads], v, g, beta)
    z = (xd @ decoded[p + "attn_gate.weight"].T).reshape(11, nv, dv)
    want = reference.gated_rms_norm(o, z, decoded[p + "ssm_norm.weight"]).reshape(11, -1) @ \
        decoded[p + "ssm_out.weight"].T.astype(np.float64)
    # the matmuls run through 16-bit activation codes (attn_gate Q8_0, ssm_out Q5_0)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    np.testing.assert_allclose(state.recurrent, final, rtol=0, atol=1e-4 * np.abs(final).max())


def test_a_cached_prefix_gives_what_a_fresh_run_gives(tiny_model):
    """The states are saved with the prompt and restored; a prompt that continues the cached one prefills only
    its tail. A state cannot be rewound to any position: a cache that ran past the shared part goes back to its
    last checkpoint before the cut (a prefill chunk boundary: every 16 tokens here) and runs the rest again."""
    model = _load(tiny_model("qwen35")[0])
    cached = model.cache_prompt(PREFIX)
    np.testing.assert_allclose(cached.logits, model.logits(PREFIX)[-1], rtol=0, atol=1e-5)
    fresh = model.generate(PREFIX + TAIL, max_tokens=6, temperature=0)
    model.generate(list(range(120, 200)), max_tokens=2, temperature=0)  # scribble over the working cache
    assert model.generate(PREFIX + TAIL, max_tokens=6, temperature=0, prompt_cache=cached) == fresh
    assert model.last_stats.cached_tokens == len(PREFIX) and model.last_stats.prompt_tokens == len(TAIL)
    # shares only part of the cached prompt: back to the checkpoint at 16, the tokens from there run again
    assert [layer["checkpoint_pos"].tolist() for layer in cached.layer_states if "conv" in layer][0] == \
        [16, 32, 48, 55]
    for cut, reused in ((30, 16), (48, 48), (10, 0)):
        shorter = PREFIX[:cut] + TAIL
        want = model.generate(shorter, max_tokens=4, temperature=0)
        assert model.generate(shorter, max_tokens=4, temperature=0, prompt_cache=cached) == want
        assert model.last_stats.cached_tokens == reused


def test_the_prompt_cache_survives_a_file(tiny_model, tmp_path):
    from cupyllm.kv.prompt_cache import PromptCache

    model = _load(tiny_model("qwen35")[0])
    cached = model.cache_prompt(PREFIX)
    cached.save(tmp_path / "p.npz")
    loaded = PromptCache.load(tmp_path / "p.npz")
    fresh = model.generate(PREFIX + TAIL, max_tokens=5, temperature=0)
    assert model.generate(PREFIX + TAIL, max_tokens=5, temperature=0, prompt_cache=loaded) == fresh
    want = model.generate(PREFIX[:40] + TAIL, max_tokens=5, temperature=0)
    assert model.generate(PREFIX[:40] + TAIL, max_tokens=5, temperature=0, prompt_cache=loaded) == want
    assert model.last_stats.cached_tokens == 32  # the checkpoints came through the file
    broken = PromptCache(ids=cached.ids[:-1], layer_states=cached.layer_states, logits=cached.logits,
                         key=cached.key)
    with pytest.raises(cupyllm.errors.InputError, match="n_seen"):
        model.generate(PREFIX + TAIL, max_tokens=5, prompt_cache=broken)
    layers = [dict(layer) for layer in cached.layer_states]
    first = next(i for i, layer in enumerate(layers) if "conv" in layer)
    layers[first]["checkpoint_pos"] = layers[first]["checkpoint_pos"][::-1].copy()
    with pytest.raises(cupyllm.errors.InputError, match="checkpoint_pos"):
        model.generate(PREFIX + TAIL, max_tokens=5, prompt_cache=PromptCache(
            ids=cached.ids, layer_states=layers, logits=cached.logits, key=cached.key))


def test_the_gpu_backend_refuses_deltanet_shapes_its_kernels_lack(tiny_model, tmp_path, monkeypatch):
    """The tiny models' DeltaNet key head dim (16) is below the GPU kernels' smallest (32): device='auto' picks
    the CPU even where a GPU is usable, and the GPU backend's cache refuses before it touches the device. A key
    head dim of 32 is taken (tests/test_gpu_backend.py runs those on the GPU backend)."""
    import dataclasses

    from cupyllm import api
    from cupyllm.backend.gpu import GPUBackend, deltanet_problem

    path = tiny_model("qwen35")[0]
    asked = []
    monkeypatch.setattr(api, "select_backend", lambda device, threads=None: asked.append(device) or CPUBackend())
    cupyllm.load(path, ctx=32, progress=False)
    wide_path = tmp_path / "tiny-qwen35-32.gguf"
    make_tiny_models.write_gguf(dataclasses.replace(make_tiny_models.tiny_spec("qwen35"), ssm_k_dim=32,
                                                    ssm_v_dim=32), wide_path)
    cupyllm.load(wide_path, ctx=32, progress=False)
    assert asked == ["cpu", "auto"]  # "auto": the GPU where one is usable
    cfg = config_from_gguf(read_gguf(path))
    with pytest.raises(DeviceError, match="key head dims .* this model's is 16.*device='cpu'"):
        GPUBackend.new_cache(None, cfg, None)
    wider = dataclasses.replace(cfg, ssm=dataclasses.replace(cfg.ssm, k_head_dim=32))
    assert deltanet_problem(wider) is None and deltanet_problem(config_from_gguf(read_gguf(tiny_model("qwen3")[0]))) \
        is None


def test_chat_with_thinking_on_and_off_end_to_end(tmp_path):
    """`cupyllm chat` on a hybrid model with its chat template (a tiny model with one in Qwen3.5's form):
    --think / --no-think reach the template's generation prompt, every turn replies, and each later turn reuses
    the cache up to where the re-rendered conversation differs from what ran (the template drops the thought of
    earlier replies: the states go back to the checkpoint at the end of the previous prompt)."""
    path = tmp_path / "tiny-qwen35-chat.gguf"
    make_tiny_models.write_gguf(make_tiny_models.tiny_spec("qwen35"), path,
                                chat_template=make_tiny_models.QWEN35_TEMPLATE)
    model = _load(path)
    decode = model.tokenizer.decode
    assert decode(model.chat_ids("hi")).endswith("<|im_start|>assistant\n<think>\n")
    assert decode(model.chat_ids("hi", {"enable_thinking": False})).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for flag in ("--think", "--no-think"):
        out = subprocess.run([sys.executable, "-m", "cupyllm.cli", "chat", "-m", str(path), "-n", "6", "--temp", "0",
                              "--device", "cpu", "-c", "256", flag], input="the sea\nand the sky\n/exit\n",
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        stats = [line for line in out.stderr.splitlines() if "prefill" in line and "decode" in line]
        assert len(stats) == 2 and "cached)" in stats[1], out.stderr
        first_turn = model.chat_ids([{"role": "user", "content": "the sea"}],
                                    {"enable_thinking": flag == "--think"})
        turn_start = model._turn_start("the sea", first_turn, True, {"enable_thinking": flag == "--think"})[0]
        assert 0 < turn_start < len(first_turn)
        assert int(stats[1].split("(+")[1].split(" cached)")[0]) >= turn_start
