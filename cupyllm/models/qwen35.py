"""Qwen3.5 (dense and MoE): pre-norm blocks with SwiGLU whose token mixer is, at every `full_attention_interval`-th
layer, gated full attention, and elsewhere a Gated DeltaNet (linear attention with a fixed-size state).

    h = x + Mixer(RMSNorm(x))
    y = h + W_down( SiLU(W_gate RMSNorm(h)) * W_up RMSNorm(h) )
    MoE: y = h + sum_{e in top-k(router(n))} p_e Expert_e(n) + sigmoid(w_shexp . n) SharedExpert(n),  n = RMSNorm(h)

Gated attention (full-attention layers): q's projection gives each head its q and an output gate.
    [q | gate] = W_q n,  k = W_k n,  v = W_v n
    Attn = W_o( Attention(RoPE(RMSNorm(q)), RoPE(RMSNorm(k)), v) * sigmoid(gate) )    (partial rotary)

Gated DeltaNet (linear-attention layers; ops/deltanet/reference.py defines the core):
    [q | k | v] = SiLU(CausalConv1d(W_qkv n))          (the conv's last K - 1 inputs carried in the cache)
    g = ssm_a * softplus(W_alpha n + dt_bias)           (ssm_a = -exp(A_log): g is the log decay, <= 0)
    beta = sigmoid(W_beta n)
    o = DeltaRule(q, k, v, g, beta; S)                  (S [Hv, Dk, Dv] carried in the cache)
    Mixer = W_out( RMSNorm(o; ssm_norm) * SiLU(W_gate n) )   (per value head)

Value head h reads key head h % Hk: llama.cpp's converter stores Qwen3.5's value heads in that (tiled) order.
Qwen3-Next (`qwen3next`, MoE) is the same model with HF's grouped order (value head h reads key head
h // (Hv / Hk)) and W_beta, W_alpha in one projection (`ssm_ba`: per key head, its value heads' beta rows, then
their alpha rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ModelFileError
from ..files.config import ModelConfig
from ..files.gguf import GGUFFile
from ..kv.cache import KVCache, RecurrentState
from .layers import LayerWeights, MoEWeights, WeightGroup, default_attention, gated_mlp, moe_mlp
from .residual import ResidualStream
from .weights import Weight, load_matrix, load_vector


@dataclass(frozen=True)
class DeltaNetWeights(WeightGroup):
    """One Gated DeltaNet layer, as llama.cpp's converter names and lays it out."""

    qkv: Weight  # attn_qkv [2 Hk Dk + Hv Dv, d]
    gate: Weight  # attn_gate [Hv Dv, d]: z, the output gate
    alpha: Weight | None  # ssm_alpha [Hv, d]: the decay's input
    beta: Weight | None  # ssm_beta [Hv, d]: the write strength's input
    a: np.ndarray  # ssm_a [Hv]: -exp(A_log)
    dt_bias: np.ndarray  # ssm_dt.bias [Hv]
    conv: np.ndarray  # ssm_conv1d [C, K]
    norm: np.ndarray  # ssm_norm [Dv]
    out: Weight  # ssm_out [d, Hv Dv]
    beta_alpha: Weight | None = None  # Qwen3-Next's ssm_ba [2 Hv, d] in place of ssm_beta and ssm_alpha

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, layer: int) -> "DeltaNetWeights":
        p = f"blk.{layer}."
        fused = p + "ssm_ba.weight" in gguf.tensors
        return cls(qkv=load_matrix(gguf, p + "attn_qkv.weight"), gate=load_matrix(gguf, p + "attn_gate.weight"),
                   alpha=None if fused else load_matrix(gguf, p + "ssm_alpha.weight"),
                   beta=None if fused else load_matrix(gguf, p + "ssm_beta.weight"),
                   beta_alpha=load_matrix(gguf, p + "ssm_ba.weight") if fused else None,
                   a=load_vector(gguf, p + "ssm_a"), dt_bias=load_vector(gguf, p + "ssm_dt.bias"),
                   conv=np.ascontiguousarray(load_vector(gguf, p + "ssm_conv1d.weight")),
                   norm=load_vector(gguf, p + "ssm_norm.weight"), out=load_matrix(gguf, p + "ssm_out.weight"))

    def on(self, backend) -> "DeltaNetWeights":
        def move(value):
            return value if value is None else backend.upload(value) if isinstance(value, Weight) \
                else backend.asarray(value)
        return type(self)(**{name: move(value) for name, value in self.__dict__.items()})


def qwen35_layer_weights(gguf: GGUFFile, layer: int, cfg: ModelConfig,
                         recurrent: bool | None = None) -> LayerWeights:
    """Layer `layer`'s weights: its norms and MLP, and its DeltaNet or its gated attention (`wq` [2 n_head
    head_dim, d]: per head its q rows, then its gate rows). `ffn_norm` is the GGUF's post_attention_norm (HF's
    post_attention_layernorm, the norm before the MLP). recurrent: whether it is a DeltaNet layer (None: as the
    config says; an MTP block past the decoder's layers is full attention)."""
    p = f"blk.{layer}."
    mlp = "_shexp" if cfg.n_expert else ""  # MoE: the dense MLP's place is the shared expert's
    common = dict(attn_norm=load_vector(gguf, p + "attn_norm.weight"),
                  ffn_norm=load_vector(gguf, p + "post_attention_norm.weight"),
                  w_gate=load_matrix(gguf, p + f"ffn_gate{mlp}.weight"),
                  w_up=load_matrix(gguf, p + f"ffn_up{mlp}.weight"),
                  w_down=load_matrix(gguf, p + f"ffn_down{mlp}.weight"))
    if cfg.n_expert:
        gate = load_matrix(gguf, p + "ffn_gate_inp_shexp.weight")
        common.update(moe=MoEWeights.from_gguf(gguf, layer),
                      shared_expert_gate=Weight(gate.name, gate.fmt, (1, cfg.d_model), gate.data))
    if cfg.is_recurrent(layer) if recurrent is None else recurrent:
        return LayerWeights(wq=None, wk=None, wv=None, wo=None, deltanet=DeltaNetWeights.from_gguf(gguf, layer),
                            **common)
    return LayerWeights(wq=load_matrix(gguf, p + "attn_q.weight"), wk=load_matrix(gguf, p + "attn_k.weight"),
                        wv=load_matrix(gguf, p + "attn_v.weight"), wo=load_matrix(gguf, p + "attn_output.weight"),
                        q_norm=load_vector(gguf, p + "attn_q_norm.weight"),
                        k_norm=load_vector(gguf, p + "attn_k_norm.weight"), **common)


def qwen35_block(ops, cfg, w, layer, x: ResidualStream, positions, cache: KVCache, attention=None):
    """One block on the residual stream x: h, then y."""
    n = x.norm(w.attn_norm)
    if cfg.is_recurrent(layer):
        x.add(gated_deltanet(ops, cfg, w.deltanet, n, cache.recurrent_parts(layer), positions))
    else:
        x.add(gated_attention(ops, cfg, w, layer, n, positions, cache, attention))
    n = x.norm(w.ffn_norm)
    mlp = gated_mlp(ops, w, n, cfg.activation)
    if w.moe is not None:  # the gated MLP is the shared expert
        gate = _sigmoid(ops.xp, ops.linear(n, w.shared_expert_gate))
        mlp = moe_mlp(ops, cfg, w.moe, n, router_input=n) + mlp * gate
    x.add(mlp)


def _sigmoid(xp, x):
    return 1.0 / (1.0 + xp.exp(-x))


def gated_attention(ops, cfg: ModelConfig, w: LayerWeights, layer: int, x, positions: np.ndarray, cache: KVCache,
                    attention=None):
    """Full attention whose output is gated per head and channel by sigmoid(gate), gate from q's projection."""
    n, hd, xp = x.shape[0], cfg.head_dim, ops.xp
    q_gate, k, v = ops.linear_many(x, [w.wq, w.wk, w.wv])
    q_gate = q_gate.reshape(n, cfg.n_head, 2, hd)
    q, gate = xp.ascontiguousarray(q_gate[:, :, 0]), q_gate[:, :, 1].reshape(n, cfg.n_head * hd)
    k, v = k.reshape(n, cfg.n_kv_head, hd), v.reshape(n, cfg.n_kv_head, hd)
    out = (attention or default_attention)(ops, cfg, w, layer, q, k, v, positions, cache)
    return ops.linear(out.reshape(n, cfg.n_head * hd) * _sigmoid(xp, gate), w.wo)


def gated_deltanet(ops, cfg: ModelConfig, w: DeltaNetWeights, x, parts: list[tuple[slice, RecurrentState]],
                   positions: np.ndarray):
    """The Gated DeltaNet token mixer over x [n, d], advancing the layer's conv and recurrent states: `parts`,
    (rows, state) for each sequence in x (KVCache.recurrent_parts; several in a batched forward). The projections
    take all rows at once; the conv and the delta rule run each sequence's rows on its own state."""
    s, n, xp = cfg.ssm, x.shape[0], ops.xp
    per_key_head = s.n_v_heads // s.n_k_heads
    if w.beta_alpha is None:
        qkv, z, alpha, beta = ops.linear_many(x, [w.qkv, w.gate, w.alpha, w.beta])
    else:
        qkv, z, beta_alpha = ops.linear_many(x, [w.qkv, w.gate, w.beta_alpha])
        beta_alpha = beta_alpha.reshape(n, s.n_k_heads, 2, per_key_head)
        beta, alpha = beta_alpha[:, :, 0].reshape(n, s.n_v_heads), beta_alpha[:, :, 1].reshape(n, s.n_v_heads)
    g = w.a * xp.logaddexp(np.float32(0.0), alpha + w.dt_bias)  # softplus, without overflow
    beta = _sigmoid(xp, beta)
    o = []
    for rows, state in parts:
        o.append(_delta_rule(ops, cfg, w, qkv[rows], g[rows], beta[rows], state))
        state.n_seen = int(positions[rows][-1]) + 1
    o = o[0] if len(o) == 1 else xp.concatenate(o)
    o = ops.gated_rms_norm(o, z.reshape(n, s.n_v_heads, s.v_head_dim), w.norm, cfg.norm_eps)
    return ops.linear(o.reshape(n, s.n_v_heads * s.v_head_dim), w.out)


def _delta_rule(ops, cfg: ModelConfig, w: DeltaNetWeights, qkv, g, beta, state: RecurrentState):
    """One sequence's rows of gated_deltanet between its projections: the causal conv on the state's last
    inputs, then the delta rule on its recurrent state (both advanced); o [n, Hv, Dv]."""
    s, n, xp = cfg.ssm, qkv.shape[0], ops.xp
    per_key_head = s.n_v_heads // s.n_k_heads
    qkv = ops.causal_conv1d_silu(qkv, w.conv, state.conv)
    key_width = s.n_k_heads * s.k_head_dim
    q = qkv[:, :key_width].reshape(n, s.n_k_heads, s.k_head_dim)
    k = qkv[:, key_width:2 * key_width].reshape(n, s.n_k_heads, s.k_head_dim)
    v = qkv[:, 2 * key_width:].reshape(n, s.n_v_heads, s.v_head_dim)
    if s.grouped_v_heads and per_key_head > 1:  # one key head per value head, in the order the backend reads
        q, k = xp.repeat(q, per_key_head, axis=1), xp.repeat(k, per_key_head, axis=1)
    return ops.gated_delta_rule(q, k, v, g, beta, state.recurrent)


@dataclass(frozen=True)
class NextNWeights(WeightGroup):
    """One multi-token-prediction (NextN / MTP) block of a Qwen3.5 / Qwen3-Next file, as llama.cpp's converter
    stores it after the decoder's blocks (conversion/qwen.py _Qwen35MtpMixin: HF's mtp.fc -> blk.N.nextn.eh_proj,
    mtp.pre_fc_norm_embedding -> nextn.enorm, mtp.pre_fc_norm_hidden -> nextn.hnorm, mtp.norm ->
    nextn.shared_head_norm, mtp.layers.0.* -> blk.N.*; norms written as 1 + w like the decoder's). The block is
    a full-attention decoder layer (gated attention, the dense MLP or the experts). speculative/mtp.py runs it."""

    eh_proj: Weight  # [d, 2d]: columns [0, d) read the normed embedding, [d, 2d) the normed hidden state
    enorm: np.ndarray  # [d]
    hnorm: np.ndarray  # [d]
    head_norm: np.ndarray  # [d]: shared_head_norm (the file's output_norm when absent)
    block: LayerWeights
    embed: Weight | None = None  # nextn.embed_tokens: its own embedding (None: the model's token_embd)
    head: Weight | None = None  # nextn.shared_head_head: its own output head (None: the model's)

    def on(self, backend) -> "NextNWeights":
        def move(value):
            if value is None or isinstance(value, LayerWeights):
                return value.on(backend) if value is not None else None
            return backend.upload(value) if isinstance(value, Weight) else backend.asarray(value)
        return type(self)(**{name: move(value) for name, value in self.__dict__.items()})


def nextn_weights(gguf: GGUFFile, cfg: ModelConfig, index: int = 0) -> NextNWeights:
    """The file's NextN block `index` (blk.{n_layer + index}, cfg.nextn_layers), its tensors' shapes checked
    (ModelFileError names a wrong one)."""
    layer, d, hd = cfg.n_layer + index, cfg.d_model, cfg.head_dim
    view = _NextNTensors(gguf)
    p = f"blk.{layer}."
    shapes = {p + "nextn.eh_proj.weight": (d, 2 * d), p + "nextn.enorm.weight": (d,),
              p + "nextn.hnorm.weight": (d,), p + "attn_q.weight": (2 * cfg.n_head * hd, d),
              p + "attn_k.weight": (cfg.n_kv_head * hd, d), p + "attn_v.weight": (cfg.n_kv_head * hd, d),
              p + "attn_output.weight": (d, cfg.n_head * hd)}
    for name, shape in shapes.items():
        info = view.tensor(name)
        if tuple(info.shape) != shape:
            raise ModelFileError(f"{gguf.path}: NextN tensor '{name}' has shape {tuple(info.shape)}, expected "
                                 f"{shape}; the file's MTP block does not match its decoder")
    optional = lambda name: load_matrix(view, p + name) if p + name in view.tensors else None  # noqa: E731
    head_norm = p + "nextn.shared_head_norm.weight"
    return NextNWeights(
        eh_proj=load_matrix(view, p + "nextn.eh_proj.weight"), enorm=load_vector(view, p + "nextn.enorm.weight"),
        hnorm=load_vector(view, p + "nextn.hnorm.weight"),
        head_norm=load_vector(view, head_norm) if head_norm in view.tensors
        else load_vector(gguf, "output_norm.weight"),
        block=qwen35_layer_weights(view, layer, cfg, recurrent=False),
        embed=optional("nextn.embed_tokens.weight"), head=optional("nextn.shared_head_head.weight"))


class _NextNTensors:
    """The GGUF file as the weight loaders read it (`tensors`, `tensor(name)`, `path`, `get`), a missing tensor
    named as a NextN block's."""

    def __init__(self, gguf: GGUFFile):
        self.path, self.get, self.tensors = gguf.path, gguf.get, gguf.tensors

    def tensor(self, name: str):
        if name not in self.tensors:
            raise ModelFileError(f"{self.path}: NextN tensor '{name}' is missing; the file's MTP block is "
                                 "incomplete")
        return self.tensors[name]
