"""One normalised model configuration, read from GGUF metadata.

Where a GGUF omits a hyperparameter, the value is filled exactly as llama.cpp's `llama_model::load_hparams`
fills it (Gemma 3: every 6th layer global, local rope base 10 000, query scale 1/sqrt(head_dim) except 27B).
Gemma 4 varies the attention shape by layer (sliding layers: `key_length_swa`, global layers: `key_length` and
their own KV head count) and lets its last `shared_kv_layers` layers read the cache of an earlier layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import ModelFileError
from .gguf import GGUFFile

SUPPORTED_ARCHITECTURES = ("qwen2", "qwen3", "qwen3moe", "gemma3", "gemma4")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one attention kind (global or sliding)."""

    base: float
    n_rot: int  # rotated dims per head (partial rotary when < head_dim)
    neox: bool = True  # NEOX: rotate (i, i + n_rot/2) pairs; normal: adjacent (2i, 2i+1) pairs
    scaling: str = "none"  # none | linear | yarn
    factor: float = 1.0
    original_ctx: int = 0  # YaRN: the trained context length
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_ext_factor: float | None = None  # llama.cpp default: 1.0 for yarn
    yarn_attn_factor: float = 1.0
    freq_factors: tuple[float, ...] | None = None  # `rope_freqs.weight`: per-pair divisors of the frequency


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int  # of the global layers where they differ (Gemma 4); layer_kv_heads has every layer's
    head_dim: int  # key length (of the global layers where they differ)
    v_head_dim: int
    ffn_dim: int
    n_vocab: int
    norm_eps: float
    ctx_train: int
    rope: RopeConfig
    rope_local: RopeConfig | None = None  # rope of sliding-window layers when it differs (Gemma 3)
    sliding_window: int = 0  # 0: no sliding-window layers
    sliding_layers: tuple[bool, ...] = ()  # per layer: True where attention is sliding-window
    attn_scale: float = 0.0  # multiplies q.k; 1/sqrt(head_dim) unless the model says otherwise
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(d_model)
    final_logit_softcap: float = 0.0
    attn_logit_softcap: float = 0.0
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3, Gemma 3
    sandwich_norm: bool = False  # Gemma: post-attention and post-FFN norms
    activation: str = "silu"  # silu (SwiGLU) | gelu_tanh (GeGLU)
    tied_output: bool = False
    # Gemma 4: per-layer attention shapes, KV sharing, V's RMSNorm, per-layer embeddings, a mixture of experts
    layer_head_dims: tuple[int, ...] = ()  # per layer K = V head dim; () when every layer has head_dim
    layer_kv_heads: tuple[int, ...] = ()  # per layer KV head count; () when every layer has n_kv_head
    kv_sources: tuple[int, ...] = ()  # per layer: the layer whose cache it reads (itself unless shared)
    v_norm: bool = False  # V is RMS-normalised (no weight) before it is cached
    per_layer_dim: int = 0  # width of the per-layer embedding fed to every block (0: none)
    n_expert: int = 0  # experts per MoE layer (0: dense model)
    n_expert_used: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def v_head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.v_head_dim

    def n_kv_head_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.n_kv_head

    def kv_source(self, layer: int) -> int:
        """The layer whose cache `layer` attends over: itself, or for a KV-shared layer the last earlier
        layer of the same kind (sliding or global) that computes its own K and V."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def head_dims(self) -> set[int]:
        """Every (K and V) head dim some layer caches."""
        layers = range(self.n_layer)
        return {self.head_dim_of(il) for il in layers} | {self.v_head_dim_of(il) for il in layers}

    def rope_for(self, layer: int) -> RopeConfig:
        return self.rope_local if (self.rope_local is not None and self.is_sliding(layer)) else self.rope

    @property
    def gqa_ratio(self) -> int:
        return self.n_head // self.n_kv_head


def _rope_scaling(get, arch: str, n_rot: int, base: float) -> RopeConfig:
    scaling = get(f"{arch}.rope.scaling.type", "none") or "none"
    factor = float(get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if scaling == "none" and factor != 1.0:
        scaling = "linear"
    if scaling not in ("none", "linear", "yarn"):
        raise ModelFileError(f"rope scaling type '{scaling}' is not supported (none, linear, yarn)")
    return RopeConfig(
        base=base, n_rot=n_rot, neox=True, scaling=scaling, factor=factor,
        original_ctx=int(get(f"{arch}.rope.scaling.original_context_length", 0) or 0),
        yarn_beta_fast=float(get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0) or 32.0),
        yarn_beta_slow=float(get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0) or 1.0),
        yarn_attn_factor=float(get(f"{arch}.rope.scaling.attn_factor", 1.0) or 1.0),
    )


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    arch = gguf.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"{gguf.path}: architecture '{arch}' is not supported; cupyllm runs "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)} (Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 3, Gemma 4)")

    def get(key, default=None):
        return gguf.get(key, default)

    def need(key):
        value = gguf.get(key)
        if value is None:
            raise ModelFileError(f"{gguf.path}: metadata key '{key}' is missing; the file is not a complete {arch} model")
        return value

    n_layer = int(need(f"{arch}.block_count"))
    d_model = int(need(f"{arch}.embedding_length"))
    n_head = int(need(f"{arch}.attention.head_count"))
    n_kv_head = int(_largest(get(f"{arch}.attention.head_count_kv", n_head)))
    head_dim = int(get(f"{arch}.attention.key_length", d_model // n_head))
    v_head_dim = int(get(f"{arch}.attention.value_length", head_dim))
    n_rot = int(get(f"{arch}.rope.dimension_count", head_dim))
    base = float(get(f"{arch}.rope.freq_base", 10000.0))
    rope = _rope_scaling(get, arch, n_rot, base)
    if "rope_freqs.weight" in gguf.tensors:
        from ..ops.matmul.reference import dequantize  # rope_freqs is a tiny F32 tensor
        t = gguf.tensors["rope_freqs.weight"]
        rope = RopeConfig(**{**rope.__dict__, "freq_factors": tuple(float(v) for v in dequantize(t.data, t.type, t.shape[-1]).ravel())})
    # an MoE file may carry only its experts' width
    ffn_dim = get(f"{arch}.feed_forward_length", get(f"{arch}.expert_feed_forward_length"))
    if ffn_dim is None:
        ffn_dim = need(f"{arch}.feed_forward_length")  # the missing-key error
    tokens = get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if tokens is not None else gguf.tensor("token_embd.weight").shape[0]

    common = dict(
        arch=arch, name=str(get("general.name", arch)), n_layer=n_layer, d_model=d_model, n_head=n_head,
        n_kv_head=n_kv_head, head_dim=head_dim, v_head_dim=v_head_dim,
        ffn_dim=int(_largest(ffn_dim)), n_vocab=n_vocab,
        norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        ctx_train=int(get(f"{arch}.context_length", 4096)), rope=rope,
        tied_output="output.weight" not in gguf.tensors,
    )
    if arch in ("qwen2", "qwen3", "qwen3moe"):
        n_expert, n_expert_used = _experts(gguf, get, arch)
        return ModelConfig(**common, attn_scale=1.0 / math.sqrt(head_dim), qkv_bias=arch == "qwen2",
                           qk_norm=arch != "qwen2", activation="silu", n_expert=n_expert, n_expert_used=n_expert_used)
    if arch == "gemma4":
        return _gemma4_config(gguf, get, common)

    # gemma3, as llama.cpp: sliding pattern 6 (layers 5, 11, ... global), local rope base 10 000 unscaled
    pattern = 6
    sliding = tuple((il % pattern) < (pattern - 1) for il in range(n_layer))
    rope_local = RopeConfig(base=10000.0, n_rot=n_rot, neox=True)
    attn_scale = (1.0 / math.sqrt(d_model / n_head)) if n_layer == 62 else 1.0 / math.sqrt(head_dim)  # 27B
    return ModelConfig(
        **common, rope_local=rope_local,
        sliding_window=int(get(f"{arch}.attention.sliding_window", 4096)), sliding_layers=sliding,
        attn_scale=attn_scale, embed_scale=math.sqrt(d_model),
        final_logit_softcap=float(get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
        attn_logit_softcap=float(get(f"{arch}.attn_logit_softcapping", 0.0) or 0.0),
        qk_norm=True, sandwich_norm=True, activation="gelu_tanh",
    )


def _experts(gguf: GGUFFile, get, arch: str) -> tuple[int, int]:
    """(experts per MoE layer, experts each token uses); (0, 0) for a dense model."""
    n_expert, n_expert_used = int(get(f"{arch}.expert_count", 0) or 0), int(get(f"{arch}.expert_used_count", 0) or 0)
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise ModelFileError(f"{gguf.path}: {n_expert} experts but expert_used_count {n_expert_used}; the file is not "
                             f"a complete {arch} MoE model")
    return n_expert, n_expert_used


def _largest(value):
    """A per-layer array's largest entry (Gemma 4 writes some hyperparameters per layer), or the scalar."""
    return max(value) if np.ndim(value) > 0 else value


def _per_layer(value, n_layer: int, what: str, path) -> tuple:
    """A GGUF hyperparameter that is one number for every layer or an array with one per layer."""
    if np.ndim(value) > 0:
        if len(value) != n_layer:
            raise ModelFileError(f"{path}: '{what}' has {len(value)} entries for {n_layer} layers")
        return tuple(value)
    return (value,) * n_layer


def _gemma4_config(gguf: GGUFFile, get, common: dict) -> ModelConfig:
    """Gemma 4, as llama.cpp loads it: per-layer sliding pattern, sliding layers with their own head dim and
    rope (base `freq_base_swa`, no frequency factors), global layers with `key_length` and the proportional
    rope that `rope_freqs` encodes (factors of 1e30 leave the unrotated pairs still), no query scaling (q and k
    are RMS-normalised), and the last `shared_kv_layers` layers reading the cache of the last earlier layer of
    their kind."""
    arch, path, n_layer = "gemma4", gguf.path, common["n_layer"]
    sliding = tuple(bool(v) for v in _per_layer(get(f"{arch}.attention.sliding_window_pattern", False), n_layer,
                                                "attention.sliding_window_pattern", path))
    head_dim_global = common["head_dim"]
    head_dim_swa = int(get(f"{arch}.attention.key_length_swa", head_dim_global))
    v_head_dim_swa = int(get(f"{arch}.attention.value_length_swa", head_dim_swa))
    if v_head_dim_swa != head_dim_swa or common["v_head_dim"] != head_dim_global:
        raise ModelFileError(f"{path}: gemma4 with value length != key length is not supported")
    kv_heads = tuple(int(v) for v in _per_layer(get(f"{arch}.attention.head_count_kv", common["n_head"]), n_layer,
                                                "attention.head_count_kv", path))
    n_shared = int(get(f"{arch}.attention.shared_kv_layers", 0) or 0)
    first_shared = n_layer - n_shared
    sources = []
    for il in range(n_layer):
        if il < first_shared:
            sources.append(il)
            continue
        same_kind = [j for j in range(first_shared) if sliding[j] == sliding[il]]
        if not same_kind:
            raise ModelFileError(f"{path}: layer {il} shares the KV cache of an earlier layer of its kind, and there "
                                 "is none")
        sources.append(same_kind[-1])
    rope = common["rope"]
    rope_swa = RopeConfig(base=float(get(f"{arch}.rope.freq_base_swa", rope.base)),
                          n_rot=int(get(f"{arch}.rope.dimension_count_swa", head_dim_swa)), neox=True)
    n_expert, n_expert_used = _experts(gguf, get, arch)
    global_layers = [il for il in range(n_layer) if not sliding[il]] or [0]
    return ModelConfig(
        **{**common, "n_kv_head": kv_heads[global_layers[0]]},
        rope_local=rope_swa, sliding_window=int(get(f"{arch}.attention.sliding_window", 512)), sliding_layers=sliding,
        attn_scale=1.0, embed_scale=math.sqrt(common["d_model"]),
        final_logit_softcap=float(get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
        qk_norm=True, sandwich_norm=True, activation="gelu_tanh",
        layer_head_dims=tuple(head_dim_swa if s else head_dim_global for s in sliding), layer_kv_heads=kv_heads,
        kv_sources=tuple(sources), v_norm=True,
        per_layer_dim=int(get(f"{arch}.embedding_length_per_layer_input", 0) or 0),
        n_expert=n_expert, n_expert_used=n_expert_used,
    )
