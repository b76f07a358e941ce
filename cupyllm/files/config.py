"""One normalised model configuration, read from GGUF metadata.

Where a GGUF omits a hyperparameter, the value is filled exactly as llama.cpp's `llama_model::load_hparams`
fills it (Gemma 3: every 6th layer global, local rope base 10 000, query scale 1/sqrt(head_dim) except 27B).
Gemma 4 varies the attention shape by layer (sliding layers: `key_length_swa`, global layers: `key_length` and
their own KV head count) and lets its last `shared_kv_layers` layers read the cache of an earlier layer.

Every hyperparameter is read with its type and range checked, and the tensors are checked against the shapes
the hyperparameters give them before a configuration is returned (files/validate.py): a file whose metadata
and tensors disagree is one ModelFileError naming the key or tensor, never a crash at the first token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import ModelFileError
from .gguf import GGUFFile
from .validate import Hyperparameters, check_block_count, check_tensors, check_tokenizer_metadata

SUPPORTED_ARCHITECTURES = ("qwen2", "qwen3", "qwen3moe", "gemma3", "gemma4", "qwen35", "qwen35moe", "qwen3next")
HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")  # Gated DeltaNet layers between full-attention ones


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
class SSMConfig:
    """The Gated DeltaNet (linear-attention) layers of Qwen3.5 / Qwen3-Next: the GGUF's `ssm.*` keys."""

    conv_kernel: int  # ssm.conv_kernel: taps of the causal depthwise conv over q|k|v
    n_k_heads: int  # ssm.group_count: query/key heads
    n_v_heads: int  # ssm.time_step_rank: value heads (each with its own decay and state)
    k_head_dim: int  # ssm.state_size
    v_head_dim: int  # ssm.inner_size / time_step_rank
    grouped_v_heads: bool = False  # value head h reads key head h // (Hv / Hk) (Qwen3-Next); else h % Hk (Qwen3.5)

    @property
    def conv_channels(self) -> int:
        """The conv's channels: q, k and v side by side."""
        return 2 * self.n_k_heads * self.k_head_dim + self.n_v_heads * self.v_head_dim


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
    # Qwen3.5: Gated DeltaNet layers between full-attention ones, whose q projection also gives an output gate
    recurrent_layers: tuple[bool, ...] = ()  # per layer: True where the layer is linear attention (DeltaNet)
    ssm: SSMConfig | None = None
    attn_output_gate: bool = False  # attention's output times sigmoid(gate), the gate from q's projection
    shared_expert_ffn: int = 0  # Qwen3.5-MoE: width of the shared expert beside the routed ones (0: none)
    # A layer plan (models/layer_plan.py): the stored block each layer of the stack runs; () runs each once
    layer_order: tuple[int, ...] = ()
    # Qwen3.5: NextN (MTP) heads the file stores after the decoder's blocks (`nextn_predict_layers`); the decoder
    # neither runs nor checks them, the MTP drafter (speculative/mtp.py) does
    n_nextn_layer: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def stored_layer(self, layer: int) -> int:
        """The GGUF block (`blk.N`) whose weights layer `layer` of the stack runs: itself unless a layer plan
        repeats blocks."""
        return self.layer_order[layer] if self.layer_order else layer

    @property
    def n_stored_layer(self) -> int:
        """Blocks the GGUF stores (n_layer counts the layers the stack runs, repeats included)."""
        return len(set(self.layer_order)) if self.layer_order else self.n_layer

    @property
    def nextn_layers(self) -> range:
        """The blocks (`blk.N`) of the file's NextN heads: the ones after the decoder's."""
        return range(self.n_stored_layer, self.n_stored_layer + self.n_nextn_layer)

    def is_nextn_tensor(self, name: str) -> bool:
        """Whether the tensor `name` belongs to a NextN head's block rather than to the decoder."""
        kind, _, rest = name.partition(".")
        block = rest.partition(".")[0]
        return kind == "blk" and block.isdigit() and int(block) in self.nextn_layers

    def is_recurrent(self, layer: int) -> bool:
        """Whether `layer` is a linear-attention (Gated DeltaNet) layer: a fixed-size state, no KV cache."""
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

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


def _rope_scaling(hp: Hyperparameters, arch: str, n_rot: int, base: float) -> RopeConfig:
    scaling = hp.text(f"{arch}.rope.scaling.type", "none") or "none"
    factor = hp.real(f"{arch}.rope.scaling.factor", 1.0, positive=False) or 1.0  # 0: none, as llama.cpp reads it
    if scaling == "none" and factor != 1.0:
        scaling = "linear"
    if scaling not in ("none", "linear", "yarn"):
        raise ModelFileError(f"{hp.path}: rope scaling type '{scaling}' is not supported (none, linear, yarn)")
    return RopeConfig(
        base=base, n_rot=n_rot, neox=True, scaling=scaling, factor=factor,
        original_ctx=hp.integer(f"{arch}.rope.scaling.original_context_length", 0),
        yarn_beta_fast=hp.real(f"{arch}.rope.scaling.yarn_beta_fast", 32.0, positive=False) or 32.0,
        yarn_beta_slow=hp.real(f"{arch}.rope.scaling.yarn_beta_slow", 1.0, positive=False) or 1.0,
        yarn_attn_factor=hp.real(f"{arch}.rope.scaling.attn_factor", 1.0, positive=False) or 1.0,
    )


def _rotary_dims(hp: Hyperparameters, key: str, head_dim: int, partial: bool) -> int:
    """Rotated dims per head: even, at most the head dim (all of it unless the architecture rotates part)."""
    n_rot = hp.integer(key, head_dim, lo=2, hi=head_dim)
    if n_rot % 2 or (not partial and n_rot != head_dim):
        raise hp.fail(key, n_rot, f"{'an even number <= ' if partial else ''}the head dim {head_dim}")
    return n_rot


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    """The model's configuration, every hyperparameter checked against its range and the tensors it
    describes. Tensors of unknown names are set aside into gguf.unused_tensors with a ModelFileWarning. A Qwen3.5
    file's NextN (MTP) blocks stay where they are: the config counts them (n_nextn_layer) apart from the
    decoder's layers."""
    arch = gguf.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"{gguf.path}: architecture '{arch}' is not supported; cupyllm runs "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)} (Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 3, Gemma 4, "
                             "Qwen3.5 dense and MoE, Qwen3-Next)")
    hp = Hyperparameters(gguf, arch)
    n_layer = hp.integer(f"{arch}.block_count", lo=1)
    check_block_count(gguf, f"{arch}.block_count", n_layer)  # before anything is sized by it
    # llama.cpp's converter counts a Qwen3.5 file's NextN blocks, its last ones, in block_count
    n_nextn = hp.integer(f"{arch}.nextn_predict_layers", 0, hi=n_layer - 1) if arch in HYBRID_ARCHITECTURES else 0
    n_layer -= n_nextn
    d_model = hp.integer(f"{arch}.embedding_length", lo=1)
    n_head = hp.uniform(f"{arch}.attention.head_count", n_layer, lo=1)
    kv_heads = hp.per_layer(f"{arch}.attention.head_count_kv", n_layer, n_head, lo=1)
    for key, value in ((f"{arch}.attention.head_count_kv", kv) for kv in kv_heads):
        if n_head % value:
            raise hp.fail(key, value, f"a divisor of the {n_head} query heads")
    if arch != "gemma4":
        kv_heads = (hp.uniform(f"{arch}.attention.head_count_kv", n_layer, n_head, lo=1),) * n_layer
    head_dim = hp.integer(f"{arch}.attention.key_length", d_model // n_head)
    if head_dim < 1:
        raise hp.fail(f"{arch}.attention.key_length", head_dim, "a head dim >= 1")
    v_head_dim = hp.integer(f"{arch}.attention.value_length", head_dim, lo=1)
    partial_rotary = arch in ("gemma4", *HYBRID_ARCHITECTURES)
    n_rot = _rotary_dims(hp, f"{arch}.rope.dimension_count", head_dim, partial=partial_rotary)
    rope = _rope_scaling(hp, arch, n_rot, hp.real(f"{arch}.rope.freq_base", 10000.0))
    # an MoE file may carry only its experts' width
    ffn_key = f"{arch}.feed_forward_length"
    if gguf.get(ffn_key) is None and gguf.get(f"{arch}.expert_feed_forward_length") is not None:
        ffn_key = f"{arch}.expert_feed_forward_length"
    layer_ffn = hp.per_layer(ffn_key, n_layer, lo=1)
    if arch != "gemma4":
        layer_ffn = (hp.uniform(ffn_key, n_layer, lo=1),) * n_layer
    n_expert, n_expert_used, expert_ffn = _experts(gguf, hp, arch, n_layer)
    tokens = gguf.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if isinstance(tokens, list) else gguf.tensor("token_embd.weight").shape[0]
    if n_vocab < 1:
        raise hp.fail("tokenizer.ggml.tokens", tokens, "at least one token")
    check_tokenizer_metadata(gguf, n_vocab)

    common = dict(
        arch=arch, name=str(gguf.get("general.name", arch)), n_layer=n_layer, d_model=d_model, n_head=n_head,
        n_kv_head=kv_heads[0], head_dim=head_dim, v_head_dim=v_head_dim, ffn_dim=max(layer_ffn), n_vocab=n_vocab,
        norm_eps=hp.real(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        ctx_train=hp.integer(f"{arch}.context_length", 4096, lo=1), rope=rope,
        tied_output="output.weight" not in gguf.tensors, n_expert=n_expert, n_expert_used=n_expert_used,
        n_nextn_layer=n_nextn,
    )
    if arch in ("qwen2", "qwen3", "qwen3moe"):
        cfg = ModelConfig(**common, attn_scale=1.0 / math.sqrt(head_dim), qkv_bias=arch == "qwen2",
                          qk_norm=arch != "qwen2", activation="silu")
    elif arch == "gemma4":
        cfg = _gemma4_config(gguf, hp, common, kv_heads)
    elif arch in HYBRID_ARCHITECTURES:
        cfg = _qwen35_config(hp, common)
    else:
        # gemma3, as llama.cpp: sliding pattern 6 (layers 5, 11, ... global), local rope base 10 000 unscaled
        pattern = 6
        sliding = tuple((il % pattern) < (pattern - 1) for il in range(n_layer))
        rope_local = RopeConfig(base=10000.0, n_rot=n_rot, neox=True)
        attn_scale = (1.0 / math.sqrt(d_model / n_head)) if n_layer == 62 else 1.0 / math.sqrt(head_dim)  # 27B
        cfg = ModelConfig(
            **common, rope_local=rope_local,
            sliding_window=hp.integer(f"{arch}.attention.sliding_window", 4096, lo=1), sliding_layers=sliding,
            attn_scale=attn_scale, embed_scale=math.sqrt(d_model),
            final_logit_softcap=hp.real(f"{arch}.final_logit_softcapping", 0.0, positive=False),
            attn_logit_softcap=hp.real(f"{arch}.attn_logit_softcapping", 0.0, positive=False),
            qk_norm=True, sandwich_norm=True, activation="gelu_tanh",
        )
    check_tensors(gguf, cfg, layer_ffn, expert_ffn)
    if "rope_freqs.weight" in gguf.tensors:
        cfg = replace(cfg, rope=replace(cfg.rope, freq_factors=_rope_freq_factors(gguf)))
    return cfg


def _rope_freq_factors(gguf: GGUFFile) -> tuple[float, ...]:
    """`rope_freqs.weight` (its shape already checked): finite positive divisors of the rope frequencies."""
    from ..ops.matmul.reference import dequantize, weight_format  # rope_freqs is a tiny F32 tensor

    t = gguf.tensors["rope_freqs.weight"]
    if weight_format(t.type) is None:
        raise ModelFileError(f"{gguf.path}: tensor 'rope_freqs.weight' has type {t.type.name}, expected F32")
    factors = dequantize(t.data, t.type, t.shape[-1]).ravel()
    if not (np.isfinite(factors) & (factors > 0)).all():
        raise ModelFileError(f"{gguf.path}: tensor 'rope_freqs.weight' holds factors that are not finite and "
                             "positive; the file is corrupt")
    return tuple(float(v) for v in factors)


def _experts(gguf: GGUFFile, hp: Hyperparameters, arch: str, n_layer: int) -> tuple[int, int, tuple[int, ...]]:
    """(experts per MoE layer, experts each token uses, each layer's expert width); (0, 0, zeros) for a dense
    model. Without `expert_feed_forward_length` the width is the first layer's down projection's (its shape
    is then checked in every layer)."""
    n_expert = hp.integer(f"{arch}.expert_count", 0, lo=1 if arch in ("qwen3moe", "qwen35moe", "qwen3next") else 0)
    if not n_expert:
        return 0, 0, (0,) * n_layer
    n_expert_used = hp.integer(f"{arch}.expert_used_count", 0)
    if not 0 < n_expert_used <= n_expert:
        raise ModelFileError(f"{gguf.path}: {n_expert} experts but expert_used_count {n_expert_used}; the file is not "
                             f"a complete {arch} MoE model")
    down = gguf.tensors.get("blk.0.ffn_down_exps.weight")
    width = down.shape[-1] if down is not None else 1
    widths = hp.per_layer(f"{arch}.expert_feed_forward_length", n_layer, width, lo=1)
    if arch != "gemma4":
        widths = (hp.uniform(f"{arch}.expert_feed_forward_length", n_layer, width, lo=1),) * n_layer
    return n_expert, n_expert_used, widths


def _sliding_pattern(hp: Hyperparameters, n_layer: int) -> tuple[bool, ...]:
    key = "gemma4.attention.sliding_window_pattern"
    value = hp.gguf.get(key, False)
    if isinstance(value, np.ndarray):
        if len(value) != n_layer or value.dtype.kind not in "biu" or not np.isin(value, (0, 1)).all():
            raise hp.fail(key, value, f"an array of {n_layer} booleans (one per layer)")
        return tuple(bool(v) for v in value)
    if not isinstance(value, (bool, np.bool_)):
        raise hp.fail(key, value, f"an array of {n_layer} booleans (one per layer)")
    return (bool(value),) * n_layer


def _gemma4_config(gguf: GGUFFile, hp: Hyperparameters, common: dict, kv_heads: tuple[int, ...]) -> ModelConfig:
    """Gemma 4, as llama.cpp loads it: per-layer sliding pattern, sliding layers with their own head dim and
    rope (base `freq_base_swa`, no frequency factors), global layers with `key_length` and the proportional
    rope that `rope_freqs` encodes (factors of 1e30 leave the unrotated pairs still), no query scaling (q and k
    are RMS-normalised), and the last `shared_kv_layers` layers reading the cache of the last earlier layer of
    their kind."""
    arch, path, n_layer = "gemma4", gguf.path, common["n_layer"]
    sliding = _sliding_pattern(hp, n_layer)
    head_dim_global = common["head_dim"]
    head_dim_swa = hp.integer(f"{arch}.attention.key_length_swa", head_dim_global, lo=1)
    v_head_dim_swa = hp.integer(f"{arch}.attention.value_length_swa", head_dim_swa, lo=1)
    if v_head_dim_swa != head_dim_swa or common["v_head_dim"] != head_dim_global:
        raise ModelFileError(f"{path}: gemma4 with value length != key length is not supported")
    n_shared = hp.integer(f"{arch}.attention.shared_kv_layers", 0, hi=n_layer - 1)
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
        if kv_heads[il] != kv_heads[sources[-1]]:  # it attends over that layer's cache
            raise hp.fail(f"{arch}.attention.head_count_kv", kv_heads[il], f"layer {il} to have the KV heads of "
                          f"layer {sources[-1]}, whose cache it reads ({kv_heads[sources[-1]]})")
    rope = common["rope"]
    rope_swa = RopeConfig(base=hp.real(f"{arch}.rope.freq_base_swa", rope.base),
                          n_rot=_rotary_dims(hp, f"{arch}.rope.dimension_count_swa", head_dim_swa, partial=True),
                          neox=True)
    global_layers = [il for il in range(n_layer) if not sliding[il]] or [0]
    return ModelConfig(
        **{**common, "n_kv_head": kv_heads[global_layers[0]]},
        rope_local=rope_swa, sliding_window=hp.integer(f"{arch}.attention.sliding_window", 512, lo=1),
        sliding_layers=sliding, attn_scale=1.0, embed_scale=math.sqrt(common["d_model"]),
        final_logit_softcap=hp.real(f"{arch}.final_logit_softcapping", 0.0, positive=False),
        qk_norm=True, sandwich_norm=True, activation="gelu_tanh",
        layer_head_dims=tuple(head_dim_swa if s else head_dim_global for s in sliding), layer_kv_heads=kv_heads,
        kv_sources=tuple(sources), v_norm=True,
        per_layer_dim=hp.integer(f"{arch}.embedding_length_per_layer_input", 0),
    )


def _qwen35_config(hp: Hyperparameters, common: dict) -> ModelConfig:
    """Qwen3.5 (dense, and MoE: routed experts beside a gated shared expert), as llama.cpp loads it: layer il is
    full attention where (il + 1) % full_attention_interval == 0 (default 4), Gated DeltaNet elsewhere; full
    attention with q/k RMSNorm, partial NEOX rope (the text positions of its interleaved M-RoPE are equal in all
    sections, so `rope.dimension_sections` changes nothing for text) and a sigmoid output gate from q's
    projection. The GGUF's norm weights already hold Qwen3.5's 1 + w (all but the DeltaNet's gated norm).
    Qwen3-Next (`qwen3next`) is the MoE model with its value heads grouped by key head (its converter does not
    reorder them) and the DeltaNet's beta and alpha projections in one tensor (`ssm_ba`)."""
    arch, n_layer = common["arch"], common["n_layer"]
    interval = hp.integer(f"{arch}.full_attention_interval", 4, lo=1, hi=n_layer)
    sections = hp.gguf.get(f"{arch}.rope.dimension_sections")
    if sections is not None and (not isinstance(sections, np.ndarray) or sections.dtype.kind not in "iu"
                                 or len(sections) > 4 or (sections < 0).any()):
        raise hp.fail(f"{arch}.rope.dimension_sections", sections, "at most 4 non-negative integers")
    n_k_heads = hp.integer(f"{arch}.ssm.group_count", lo=1)
    n_v_heads = hp.integer(f"{arch}.ssm.time_step_rank", lo=1)
    if n_v_heads % n_k_heads:
        raise hp.fail(f"{arch}.ssm.time_step_rank", n_v_heads, f"a multiple of ssm.group_count ({n_k_heads})")
    inner = hp.integer(f"{arch}.ssm.inner_size", lo=1)
    if inner % n_v_heads:
        raise hp.fail(f"{arch}.ssm.inner_size", inner, f"a multiple of ssm.time_step_rank ({n_v_heads})")
    ssm = SSMConfig(conv_kernel=hp.integer(f"{arch}.ssm.conv_kernel", lo=2, hi=64), n_k_heads=n_k_heads,
                    n_v_heads=n_v_heads, k_head_dim=hp.integer(f"{arch}.ssm.state_size", lo=1, hi=4096),
                    v_head_dim=inner // n_v_heads, grouped_v_heads=arch == "qwen3next")
    if ssm.v_head_dim % 16:  # the CPU recurrence runs the state in 16-lane tiles (ops/deltanet/cpu.py)
        raise ModelFileError(f"{hp.path}: Gated DeltaNet value heads of {ssm.v_head_dim} dims (ssm.inner_size / "
                             "ssm.time_step_rank) are not supported: cupyllm needs a multiple of 16")
    shared = hp.integer(f"{arch}.expert_shared_feed_forward_length", lo=1) if common["n_expert"] else 0
    return ModelConfig(**common, attn_scale=1.0 / math.sqrt(common["head_dim"]), qk_norm=True, activation="silu",
                       recurrent_layers=tuple((il + 1) % interval != 0 for il in range(n_layer)), ssm=ssm,
                       attn_output_gate=True, shared_expert_ffn=shared)
